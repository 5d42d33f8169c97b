"""The flight recorder (level 10): every decorated call's tensors on disk, linked to its span.

For each call that passes the filters and limits, :class:`Recorder` creates one
directory below ``OTEL_GPU_DUMP_DIR`` and, on the caller's thread *before the call
runs*, writes the inputs and a manifest with status ``inputs_saved`` (both fsync'd),
so a process that dies inside the call leaves a loadable case. After the call the
outputs are copied to the host on the caller's thread and written by a background
thread through a bounded queue; a raised exception is recorded synchronously.

The span of a dumped call carries ``otel_gpu.dump.dir``; any other call carries
``otel_gpu.dump.skipped`` with the reason. The format is in ``docs/flight-recorder.md``;
:mod:`otel_gpu.replay` re-runs the calls.
"""

from __future__ import annotations

import errno
import fnmatch
import itertools
import os
import queue
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch

from otel_gpu import _dump_target, _guard, _manifest, metadata
from otel_gpu.config import Settings, environ, expand_path

__all__ = [
    "ATTR_DIR",
    "ATTR_OUTPUTS_SKIPPED",
    "ATTR_OUTPUTS_UNSUPPORTED",
    "ATTR_SKIPPED",
    "Recorder",
    "make_observer",
]

ATTR_DIR = "otel_gpu.dump.dir"
"""Span attribute: absolute path of the call's dump directory."""
ATTR_SKIPPED = "otel_gpu.dump.skipped"
"""Span attribute: why the call was not dumped (see :data:`SKIP_REASONS`)."""
ATTR_OUTPUTS_SKIPPED = "otel_gpu.dump.outputs_skipped"
"""Span attribute: why a dumped call's outputs (all or some) were not written."""
ATTR_OUTPUTS_UNSUPPORTED = "otel_gpu.dump.outputs_unsupported"
"""Span attribute: the parts of the outputs that could not be recorded, with their types."""

SKIP_REASONS = (
    "filtered",  # OTEL_GPU_DUMP_INCLUDE / _EXCLUDE
    "max_count",  # OTEL_GPU_DUMP_MAX_COUNT reached
    "max_size",  # OTEL_GPU_DUMP_MAX_SIZE_GB would be exceeded
    "cuda_graph_capture",  # copying would break the capture
    "write_failed",  # the directory could not be written; dumping stopped
    "closed",  # the recorder was shut down (exit or reconfiguration)
)

_QUEUE_ITEMS = 32  # queued output writes; beyond this (or _QUEUE_BYTES) the caller writes itself
_QUEUE_BYTES = 1 << 30
_CLOSE_TIMEOUT = 60.0  # seconds close() waits for queued outputs: they are the point of level 10
_SEQ = itertools.count(1)  # process-wide, so directory names keep sorting across reconfiguration
_STOP = object()


def make_observer(settings: Settings, pipeline: Any) -> Recorder | None:
    """Called by the pipeline at level 10: the recorder for ``settings``."""
    return Recorder(settings, pipeline)


class _Pending:
    __slots__ = ("dir", "inputs", "manifest")

    def __init__(self, directory: str, manifest: dict[str, Any], inputs: list[Any]) -> None:
        self.dir = directory
        self.manifest = manifest
        self.inputs = inputs  # (key, tensor, version at start): in-place changes become outputs


class Recorder:
    """The level-10 observer: ``start``/``end`` on the caller's thread, a writer thread for outputs."""

    min_level = 10  # functions decorated below level 10 are never dumped

    def __init__(self, settings: Settings, pipeline: Any) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.root = os.path.abspath(os.path.expanduser(expand_path(settings.dump_dir)))
        self.format = settings.dump_format
        self.max_bytes = int(settings.dump_max_size_gb * (1 << 30))
        self.max_count = settings.dump_max_count
        self.count = 0
        self.used = 0
        self.stopped: str | None = None
        self._lock = threading.Lock()
        self._active: dict[Any, _Pending] = {}
        self._selected: dict[str, bool] = {}
        self._targets: dict[Any, _dump_target.Target] = {}
        self._resource: dict[str, Any] | None = None
        self._proc: dict[str, Any] | None = None
        words = tuple(settings.redact)
        # the same rule as the span attributes (OTEL_GPU_REDACT): parameter, dict key or kwarg name
        self._secret = (lambda name: metadata.is_secret(name, words)) if words else None
        self._queue: queue.Queue[Any] = queue.Queue(_QUEUE_ITEMS)
        self._queued_bytes = 0
        self._closing = False
        self._errors: list[BaseException] = []
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        except OSError as exc:
            self._fail(exc)
        self._writer = threading.Thread(target=self._write_loop, name="otel-gpu-dump", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ caller's thread

    def start(self, call: Any) -> None:
        """Write the call's inputs and manifest (fsync'd) before the call runs, or record why not."""
        reason = self._gate(call.plan)
        if reason is None:
            try:
                reason = self._record_inputs(call)
            except OSError as exc:
                reason = self._fail(exc)
        if reason is not None:
            call.span.set_attribute(ATTR_SKIPPED, reason)

    def end(self, call: Any) -> None:
        """Record how the call ended: exception synchronously, outputs through the writer thread."""
        pending = self._active.pop(call, None)
        if pending is None:
            return
        try:
            if call.exc is not None:
                self._record_raised(call, pending)
            else:
                self._record_outputs(call, pending)
        except OSError as exc:
            self._fail(exc)

    def flush(self, timeout: float = _CLOSE_TIMEOUT) -> bool:
        """Wait until queued outputs are on disk; True when the queue emptied within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and self._writer.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self) -> None:
        """Stop dumping and wait (up to 60 s) for queued outputs to reach the disk."""
        with self._lock:
            self._closing = True  # after this, end() writes outputs itself
            if self.stopped is None:
                self.stopped = "closed"
        if self._writer.is_alive():
            self._queue.put(_STOP)
            self._writer.join(_CLOSE_TIMEOUT)
            if self._writer.is_alive():
                _guard.warn_once(
                    "dump.close",
                    "otel-gpu flight recorder: outputs of %d call(s) were not written within %.0f s "
                    "at shutdown; replay reports them as skipped",
                    self._queue.qsize(),
                    _CLOSE_TIMEOUT,
                )
        if self._errors:
            errors, self._errors = self._errors, []
            _guard.internal_error("dump", errors[0])

    # ------------------------------------------------------------------ decisions

    def _gate(self, plan: Any) -> str | None:
        if self.stopped is not None:
            return self.stopped
        name = plan.name
        selected = self._selected.get(name)
        if selected is None:
            s = self.settings
            selected = (
                not s.dump_include or any(fnmatch.fnmatchcase(name, p) for p in s.dump_include)
            ) and not any(fnmatch.fnmatchcase(name, p) for p in s.dump_exclude)
            self._selected[name] = selected
        if not selected:
            return "filtered"
        capturing = plan.capture_stats  # _gpu.is_capturing where CUDA exists, decided at decoration
        if capturing is not None and capturing():
            return "cuda_graph_capture"
        return None

    def _reserve(self, nbytes: int, new_call: bool) -> str | None:
        """Count a call and its bytes against the limits before anything is copied."""
        with self._lock:
            if new_call and self.count >= self.max_count:
                reason = "max_count"
            elif self.used + nbytes > self.max_bytes:
                reason = "max_size"
            else:
                self.count += new_call
                self.used += nbytes
                return None
        limit = (
            f"OTEL_GPU_DUMP_MAX_COUNT={self.max_count}"
            if reason == "max_count"
            else f"OTEL_GPU_DUMP_MAX_SIZE_GB={self.settings.dump_max_size_gb:g}"
        )
        _guard.warn_once(
            "dump." + reason,
            "otel-gpu flight recorder: %s reached; further calls are not dumped (their spans carry "
            "otel_gpu.dump.skipped=%s). This is reported once.",
            limit,
            reason,
        )
        return reason

    def _fail(self, exc: OSError) -> str:
        """A full disk or an unwritable directory stops dumping, with one warning."""
        self.stopped = "write_failed"
        why = errno.errorcode.get(exc.errno or 0, "") if exc.errno else ""
        _guard.warn_once(
            "dump.write_failed",
            "otel-gpu flight recorder stopped: cannot write below %s (%s%s). Your program continues; "
            "further calls carry otel_gpu.dump.skipped=write_failed.",
            self.root,
            f"{why}: " if why else "",
            exc,
        )
        return "write_failed"

    # ------------------------------------------------------------------ recording

    def _record_inputs(self, call: Any) -> str | None:
        plan = call.plan
        target = self._targets.get(plan)
        if target is None:
            target = _dump_target.Target(plan)
            if target.found:  # a module still being imported may define the function later
                self._targets[plan] = target
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        enc = _manifest.Encoder("input.", tensors, meta, self._secret)
        params = [
            {"name": name, "default": is_default, "value": enc.encode(value, name)}
            for name, value, is_default in call.bound or ()
        ]
        arg_keys = list(tensors)  # receiver state is not compared after the call
        receiver = _dump_target.receiver(call, enc) if target.receiver else None
        why_not = target.why_not
        if call.bound is None and why_not is None:
            why_not = "the arguments could not be captured"
        reason = self._reserve(sum(m["nbytes"] for m in meta.values()), True)
        if reason is not None:
            return reason
        seq = next(_SEQ)
        ctx = call.span.get_span_context()
        directory = os.path.join(
            self.root, _manifest.call_dir_name(seq, call.start_ns, ctx.span_id, plan.name)
        )
        os.mkdir(directory, 0o700)
        host = {k: _manifest.host_copy(t, always_copy=False) for k, t in tensors.items()}
        inputs_file = _manifest.save_tensors(os.path.join(directory, "inputs"), host, self.format)
        del host
        manifest: dict[str, Any] = {
            "schema_version": _manifest.SCHEMA_VERSION,
            "status": "inputs_saved",
            "function": {
                "span_name": plan.name,
                "module": target.module,
                "qualname": target.qualname,
                "file": target.file,
                "receiver": receiver is not None,
            },
            "replayable": why_not is None,
            "why_not_replayable": why_not,
            "trace_id": f"{ctx.trace_id:032x}",
            "span_id": f"{ctx.span_id:016x}",
            "parent_span_id": f"{call.parent.span_id:016x}" if call.parent else None,
            "sequence": seq,
            "process": self._process(),
            "time": {"start_unix_nano": call.start_ns, "end_unix_nano": None},
            "torch_state": {
                "grad_enabled": torch.is_grad_enabled(),
                "inference_mode": torch.is_inference_mode_enabled(),
                "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            },
            "files": {"inputs": inputs_file, "outputs": None},
            "tensors": meta,
            "params": params,
            "receiver": receiver,
            "result": None,
            "mutated": {},
            "outputs_skipped": None,
            "outputs_unsupported": [],
            "exception": None,
            "resource": self._resource_summary(),
        }
        _manifest.write_json(directory, _manifest.MANIFEST, manifest)
        # inference tensors have no version counter: their in-place changes go unnoticed
        versions = [
            (k, tensors[k], tensors[k]._version) for k in arg_keys if not tensors[k].is_inference()
        ]
        self._active[call] = _Pending(directory, manifest, versions)
        call.span.set_attribute(ATTR_DIR, directory)
        return None

    def _record_raised(self, call: Any, pending: _Pending) -> None:
        exc = call.exc
        cls = type(exc)
        manifest = pending.manifest
        manifest["status"] = "raised"
        manifest["time"]["end_unix_nano"] = call.end_ns
        manifest["exception"] = {
            "type": f"{cls.__module__}.{cls.__qualname__}",
            "message": _str(exc),
            "traceback": "".join(traceback.format_exception(cls, exc, call.tb)),
        }
        _manifest.write_json(pending.dir, _manifest.MANIFEST, manifest)

    def _record_outputs(self, call: Any, pending: _Pending) -> None:
        manifest = pending.manifest
        manifest["time"]["end_unix_nano"] = call.end_ns
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        enc = _manifest.Encoder("", tensors, meta, self._secret)
        manifest["result"] = enc.encode(call.result, "output")
        for key, t, version in pending.inputs:
            if t._version != version:  # modified in place by the call: an output too
                manifest["mutated"][key] = enc.encode(t, "mutated." + key.removeprefix("input."))
        manifest["tensors"].update(meta)
        if enc.unsupported:  # replay will say "unverified" for these parts, never "pass"
            manifest["outputs_unsupported"] = enc.unsupported[:64]
            call.span.set_attribute(ATTR_OUTPUTS_SKIPPED, "unsupported_type")
            call.span.set_attribute(
                ATTR_OUTPUTS_UNSUPPORTED, [u[:256] for u in enc.unsupported[:16]]
            )
        # marker first: if the process dies before the writer runs, replay knows the call returned
        os.close(
            os.open(os.path.join(pending.dir, _manifest.RETURNED), os.O_CREAT | os.O_WRONLY, 0o600)
        )
        nbytes = sum(m["nbytes"] for m in meta.values())
        capturing = call.plan.capture_stats
        if capturing is not None and capturing():
            reason: str | None = "cuda_graph_capture"
        else:
            reason = self._reserve(nbytes, False) if nbytes else None
        if reason is not None:
            manifest["outputs_skipped"] = reason
            call.span.set_attribute(ATTR_OUTPUTS_SKIPPED, reason)
            tensors = {}
        # the program may modify outputs after the call returns: copy them now
        host = {k: _manifest.host_copy(t, always_copy=True) for k, t in tensors.items()}
        job = (pending.dir, host, manifest, nbytes if host else 0)
        with self._lock:
            queued = not self._closing and self._queued_bytes + job[3] <= _QUEUE_BYTES
            if queued:
                try:
                    self._queue.put_nowait(job)
                    self._queued_bytes += job[3]
                except queue.Full:
                    queued = False
        if not queued:
            self._write_outputs(*job[:3])  # back-pressure: the caller writes, memory stays bounded

    # ------------------------------------------------------------------ writer thread

    def _write_outputs(self, directory: str, host: dict[str, torch.Tensor], manifest: dict) -> None:
        if host:
            manifest["files"]["outputs"] = _manifest.save_tensors(
                os.path.join(directory, "outputs"), host, self.format
            )
        manifest["status"] = "completed"
        _manifest.write_json(directory, _manifest.MANIFEST, manifest)

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                self._queue.task_done()
                return
            directory, host, manifest, nbytes = job
            try:
                if self.stopped != "write_failed":
                    self._write_outputs(directory, host, manifest)
            except OSError as exc:
                self._fail(exc)
            except Exception as exc:
                try:
                    _guard.internal_error("dump", exc)
                except Exception as raised:  # strict mode: re-raised by close()
                    self._errors.append(raised)
            finally:
                with self._lock:
                    self._queued_bytes -= nbytes
                self._queue.task_done()

    # ------------------------------------------------------------------ context

    def _process(self) -> dict[str, Any]:
        if self._proc is None or self._proc["pid"] != os.getpid():
            rank = environ().get("RANK")
            self._proc = {
                "pid": os.getpid(),
                "rank": int(rank) if rank and rank.isdigit() else None,
                "host": socket.gethostname(),
            }
        return dict(self._proc)

    def _resource_summary(self) -> dict[str, Any]:
        if self._resource is None:
            summary: dict[str, Any] = {
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "torch.cuda": torch.version.cuda,
            }
            resource = getattr(self.pipeline, "resource", None)
            for key, value in dict(getattr(resource, "attributes", None) or {}).items():
                summary[key] = list(value) if isinstance(value, tuple) else value
            self._resource = summary
        return self._resource


def _str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<str() of {type(exc).__name__} failed>"
