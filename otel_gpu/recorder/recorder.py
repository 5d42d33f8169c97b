"""The flight recorder (level 10): every decorated call's tensors on disk, linked to its span.

For each call that passes the filters and limits, :class:`Recorder` creates one
directory below ``OTEL_GPU_DUMP_DIR``. How the inputs reach the disk follows
``OTEL_GPU_DUMP_DURABILITY``: ``process`` (default) and ``fsync`` write the inputs and
a manifest with status ``inputs_saved`` on the caller's thread *before the call runs*
(left to the kernel's page cache, or fsync'd), so a process that dies inside the call
leaves a loadable case; ``async`` copies them before the call and lets the writer
thread write them. After the call the outputs are copied to reused host buffers
(pinned, and copied without waiting, for CUDA tensors) on the caller's thread and
written by a background thread through a bounded queue.

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
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from otel_gpu import _files, _guard
from otel_gpu.attributes import (
    DUMP_DIR,
    DUMP_OUTPUTS_SKIPPED,
    DUMP_OUTPUTS_UNSUPPORTED,
    DUMP_SKIPPED,
)
from otel_gpu.calls import describe, metadata
from otel_gpu.config import Settings, expand_path
from otel_gpu.recorder import graph_snapshots, tensor_files, values
from otel_gpu.recorder import limits as _limits
from otel_gpu.recorder import manifest as _manifest
from otel_gpu.recorder import target as _target
from otel_gpu.recorder.call_manifest import encode_inputs, new_manifest

if TYPE_CHECKING:
    from otel_gpu.core.plan import Plan
    from otel_gpu.core.protocols import Host
    from otel_gpu.core.record import Call

__all__ = [
    "ATTR_DIR",
    "ATTR_OUTPUTS_SKIPPED",
    "ATTR_OUTPUTS_UNSUPPORTED",
    "ATTR_SKIPPED",
    "Recorder",
    "make_observer",
]

ATTR_DIR = DUMP_DIR
"""Span attribute: absolute path of the call's dump directory."""
ATTR_SKIPPED = DUMP_SKIPPED
"""Span attribute: why the call was not dumped (see :data:`SKIP_REASONS`)."""
ATTR_OUTPUTS_SKIPPED = DUMP_OUTPUTS_SKIPPED
"""Span attribute: why a dumped call's outputs (all or some) were not written."""
ATTR_OUTPUTS_UNSUPPORTED = DUMP_OUTPUTS_UNSUPPORTED
"""Span attribute: the parts of the outputs that could not be recorded, with their types."""

SKIP_REASONS = (
    "filtered",  # OTEL_GPU_DUMP_INCLUDE / _EXCLUDE
    "max_count",  # OTEL_GPU_DUMP_MAX_COUNT reached
    "max_size",  # OTEL_GPU_DUMP_MAX_SIZE_GB would be exceeded
    "cuda_graph_capture",  # copying would break the capture
    "write_failed",  # the directory could not be written; dumping stopped
    "closed",  # the recorder was shut down (exit or reconfiguration)
)

_QUEUE_ITEMS = 32  # queued calls; beyond this (or _QUEUE_BYTES) the caller writes itself
_QUEUE_BYTES = 1 << 30
_CLOSE_TIMEOUT = 60.0  # seconds close() waits for queued outputs: they are the point of level 10
_SEQ = itertools.count(1)  # process-wide, so directory names keep sorting across reconfiguration
_STOP = object()
# writer jobs: a call's inputs (async mode), its outputs or exception, a CUDA-graph snapshot
_INPUTS, _FINAL, _SNAPSHOT = 0, 1, 2


def make_observer(settings: Settings, pipeline: Host | None) -> Recorder | None:
    """The observer registry's factory (level 10): the recorder for ``settings``."""
    return Recorder(settings, pipeline)


class _Pending:
    __slots__ = ("dir", "ended", "inputs", "manifest", "saved", "written")

    def __init__(self, directory: str, manifest: dict[str, Any], inputs: list[Any]) -> None:
        self.dir = directory
        self.manifest = manifest
        self.inputs = inputs  # (key, tensor, version at start): in-place changes become outputs
        self.ended = False  # the call returned or raised (set under the recorder's lock)
        # an inputs_saved manifest is (being) written: a call that returns needs its marker
        self.saved = True
        self.written: threading.Event | None = None  # async mode: set once the inputs are saved


class Recorder:
    """The level-10 observer: ``start``/``end`` on the caller's thread, a writer thread for outputs."""

    min_level: int  # set by the observer registry (otel_gpu.export.observers)

    def __init__(self, settings: Settings, pipeline: Host | None) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.root = os.path.abspath(os.path.expanduser(expand_path(settings.dump_dir)))
        self.format = settings.dump_format
        durability = settings.dump_durability
        self._fsync = durability == "fsync"  # decided once: the call path only reads a flag
        self._async_inputs = durability == "async"
        self._buffers = tensor_files.HostBuffers()
        limits = _limits.in_force(settings)  # the settings', or what set_limits() set since
        self.max_bytes = limits.max_bytes
        self.max_count = limits.max_calls
        self.count = 0
        self.used = 0
        self.skipped = 0  # calls not dumped for a limit (the note in the dump folder says so)
        self._warned: set[str] = set()  # the limits warned about since they last changed
        self._note = f"{_limits.NOTE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.json"
        self._noted: tuple[str, str] | None = None  # the reason and limit of the last note
        self.stopped: str | None = None
        self._lock = threading.Lock()
        self._active: dict[Call, _Pending] = {}
        self._deferred: dict[Call, graph_snapshots.Deferred] = {}  # calls in a CUDA graph capture
        self._selected: dict[str, bool] = {}
        self._targets: dict[Plan, _target.Target] = {}
        words = tuple(settings.redact)
        # the same rule as the span attributes (OTEL_GPU_REDACT): parameter, dict key or kwarg name
        self._secret = (lambda name: metadata.is_secret(name, words)) if words else None
        # async mode queues two jobs a call (inputs, then outputs): still _QUEUE_ITEMS calls
        self._queue: queue.Queue[Any] = queue.Queue(_QUEUE_ITEMS * (1 + self._async_inputs))
        self._queued_bytes = 0
        self._closing = False
        self._errors: list[BaseException] = []
        self._root_made = False  # the folder is created by the first call dumped, not before
        self._writer = threading.Thread(target=self._write_loop, name="otel-gpu-dump", daemon=True)
        self._writer.start()
        _limits.watch(self)

    # ------------------------------------------------------------------ caller's thread

    def start(self, call: Call) -> None:
        """Write the call's inputs and manifest (fsync'd) before the call runs, or record why not."""
        reason = self._gate(call.plan)
        if reason == "cuda_graph_capture":  # no copy now: a snapshot after replays instead
            self._deferred[call] = graph_snapshots.defer_inputs(self, call)
        elif reason is None:
            try:
                reason = self._record_inputs(call)
            except Exception as exc:  # a full disk, maybe wrapped by torch.save (_os_error)
                full = _os_error(exc)
                if full is None:
                    raise
                reason = self._fail(full)
        if reason is not None:
            call.span.set_attribute(ATTR_SKIPPED, reason)

    def end(self, call: Call) -> None:
        """Record how the call ended: exception synchronously, outputs through the writer thread."""
        pending = self._active.pop(call, None)
        if pending is None:
            deferred = self._deferred.pop(call, None)
            if deferred is not None and call.exc is None:
                graph_snapshots.defer_outputs(self, call, deferred)
            return
        with self._lock:  # from here on the writer no longer writes an inputs_saved manifest
            pending.ended = True
            saved = pending.saved
        try:
            if call.exc is not None:
                self._record_raised(call, call.exc, pending, saved)
            else:
                self._record_outputs(call, pending, saved)
        except Exception as exc:
            full = _os_error(exc)
            if full is None:
                raise
            self._fail(full)

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
        self._buffers.clear()
        if self._noted is not None:  # the final count of calls not dumped
            self._write_note(*self._noted)
        if self._errors:
            errors, self._errors = self._errors, []
            _guard.internal_error("dump", errors[0])

    # ------------------------------------------------------------------ decisions

    def _gate(self, plan: Plan) -> str | None:
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
        if not self._root_made:
            self._make_root()
            if self.stopped is not None:
                return self.stopped
        capturing = plan.capture_stats  # _gpu.is_capturing where CUDA exists, decided at decoration
        if capturing is not None and capturing():
            return "cuda_graph_capture"
        return None

    def _make_root(self) -> None:
        """Create the dump folder (0700, parents too, or the user's own) when a first call is
        to be written into it: a process whose calls never reach level 10 creates none."""
        with self._lock:
            if self._root_made:
                return
            try:
                if not _files.make_dirs(self.root):
                    _files.warn_if_shared(self.root, "dump dir (OTEL_GPU_DUMP_DIR)")
            except OSError as exc:
                self._fail(exc)
            self._root_made = True

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
            self.skipped += new_call
            first = reason not in self._warned
            self._warned.add(reason)
            limit = self._limit_text(reason)
        if first:  # once per limit, and once more after set_limits() changed them
            _guard.logger.warning(
                "otel-gpu flight recorder: %s reached; further calls are not dumped (their spans "
                "carry otel_gpu.dump.skipped=%s, and otel-gpu replay says they have no dump). "
                "This is reported once (again if the limits change at runtime).",
                limit,
                reason,
            )
            self._write_note(reason, limit)
        return reason

    def _limit_text(self, reason: str) -> str:
        base = _limits.configured(self.settings)
        if reason == "max_count":
            if self.max_count == base.max_calls:
                return f"OTEL_GPU_DUMP_MAX_COUNT={self.max_count}"
            return f"the dump limit of {self.max_count} calls (set at runtime)"
        if self.max_bytes == base.max_bytes:
            return f"OTEL_GPU_DUMP_MAX_SIZE_GB={self.settings.dump_max_size_gb:g}"
        return f"the dump limit of {self.max_bytes} bytes (set at runtime)"

    def _write_note(self, reason: str, limit: str) -> None:
        """The dump folder's note that calls of this process were not dumped (for replay)."""
        self._noted = (reason, limit)
        body = {"pid": os.getpid(), "reason": reason, "limit": limit, "skipped": self.skipped}
        try:
            _limits.write_note(self.root, self._note, body)
        except OSError:
            pass  # a folder that cannot be written stops dumping on the next write, saying so

    def apply_limits(self, limits: _limits.Limits) -> None:
        """New limits (:func:`otel_gpu.recorder.limits.set_limits`), from the next call on."""
        with self._lock:
            self.max_count, self.max_bytes = limits.max_calls, limits.max_bytes
            self._warned.clear()

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

    def _record_inputs(self, call: Call) -> str | None:
        plan = call.plan
        target, tensors, meta, params, arg_keys, receiver = encode_inputs(
            call, self._targets, self._secret
        )
        why_not = target.why_not
        if call.bound is None and why_not is None:
            why_not = "the arguments could not be captured"
        reason = self._reserve(sum(m["nbytes"] for m in meta.values()), True)
        if reason is not None:
            return reason
        seq = next(_SEQ)
        manifest = new_manifest(call, target, params, receiver, meta, why_not, seq, self.pipeline)
        directory = os.path.join(
            self.root,
            _manifest.call_dir_name(
                seq, call.start_ns, call.span.get_span_context().span_id, plan.name
            ),
        )
        # inference tensors have no version counter: their in-place changes go unnoticed
        versions = [
            (k, tensors[k], tensors[k]._version) for k in arg_keys if not tensors[k].is_inference()
        ]
        pending = _Pending(directory, manifest, versions)
        if self._async_inputs:
            # the call may change its inputs in place: copying them is the one thing done here
            copies = self._buffers.copy(tensors)
            pending.saved = False
            pending.written = threading.Event()
            if not self._enqueue((_INPUTS, pending, copies, copies.nbytes), copies.nbytes):
                self._write_inputs(pending, copies)  # back-pressure: the caller writes
        else:
            _files.make_dir(directory)
            host = {k: tensor_files.host_copy(t, always_copy=False) for k, t in tensors.items()}
            manifest["files"]["inputs"] = tensor_files.save_tensors(
                os.path.join(directory, "inputs"), host, self.format, self._fsync
            )
            del host
            _manifest.write_json(directory, _manifest.MANIFEST, manifest, self._fsync)
        self._active[call] = pending
        call.span.set_attribute(ATTR_DIR, directory)
        return None

    def _record_raised(
        self, call: Call, exc: BaseException, pending: _Pending, saved: bool
    ) -> None:
        manifest = pending.manifest
        manifest["status"] = "raised"
        manifest["time"]["end_unix_nano"] = call.end_ns
        # message and traceback run the exception's own code: formatted off the caller's thread
        manifest["exception"] = describe.exception_record(exc, call.tb)
        if pending.written is None:  # inputs already on disk: record it now
            _manifest.write_json(pending.dir, _manifest.MANIFEST, manifest, self._fsync)
            return
        if saved:  # async mode: if the process ends before the writer gets here, it is no crash
            _touch(os.path.join(pending.dir, _manifest.RETURNED))
        self._submit(pending, tensor_files.HostCopies())

    def _record_outputs(self, call: Call, pending: _Pending, saved: bool) -> None:
        manifest = pending.manifest
        manifest["time"]["end_unix_nano"] = call.end_ns
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        enc = values.Encoder("", tensors, meta, self._secret)
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
        if saved:  # marker first: if the process dies before the writer runs, replay knows
            _touch(os.path.join(pending.dir, _manifest.RETURNED))
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
        # the program may modify outputs after the call returns: copy them now (a reused
        # buffer costs the copy, a fresh one page faults too; CUDA copies are not waited for)
        self._submit(pending, self._buffers.copy(tensors))

    def _submit(self, pending: _Pending, copies: tensor_files.HostCopies) -> None:
        if self._enqueue((_FINAL, pending, copies, copies.nbytes), copies.nbytes):
            return
        # back-pressure: the caller writes, memory stays bounded (after its queued inputs)
        if pending.written is not None and not pending.written.wait(_CLOSE_TIMEOUT):
            self._buffers.release(copies)
            return
        self._write_outputs(pending, copies)

    def enqueue_snapshot(
        self,
        directory: str,
        manifest: dict[str, Any],
        inputs: tensor_files.HostCopies,
        outputs: tensor_files.HostCopies,
    ) -> bool:
        """Queue a CUDA-graph snapshot for the writer; False (never a wait) when the queue is full."""
        nbytes = inputs.nbytes + outputs.nbytes
        return self._enqueue((_SNAPSHOT, (directory, manifest), (inputs, outputs), nbytes), nbytes)

    def _enqueue(self, job: tuple[Any, ...], nbytes: int) -> bool:
        with self._lock:
            if self._closing or self._queued_bytes + nbytes > _QUEUE_BYTES:
                return False
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                return False
            self._queued_bytes += nbytes
        return True

    # ------------------------------------------------------------------ writer thread

    def _write_inputs(self, pending: _Pending, copies: tensor_files.HostCopies) -> None:
        """Async mode: the inputs copied before the call, then the inputs_saved manifest unless
        the call has already ended (its final manifest follows in the queue: written once)."""
        try:
            _files.make_dir(pending.dir)
            copies.wait()
            name = tensor_files.save_tensors(
                os.path.join(pending.dir, "inputs"), copies.tensors, self.format, False
            )
            with self._lock:  # the caller changes the manifest once the call has ended
                pending.manifest["files"]["inputs"] = name
                pending.saved = not pending.ended
                data = _manifest.encode_json(pending.manifest) if pending.saved else None
            if data is not None:
                _manifest.write_bytes(pending.dir, _manifest.MANIFEST, data, False)
        finally:
            self._buffers.release(copies)
            if pending.written is not None:
                pending.written.set()

    def _write_outputs(self, pending: _Pending, copies: tensor_files.HostCopies) -> None:
        directory, manifest = pending.dir, pending.manifest
        try:
            if copies.tensors:
                copies.wait()
                manifest["files"]["outputs"] = tensor_files.save_tensors(
                    os.path.join(directory, "outputs"), copies.tensors, self.format, self._fsync
                )
        finally:
            self._buffers.release(copies)
        if manifest["status"] == "inputs_saved":
            manifest["status"] = "completed"
        _manifest.write_json(directory, _manifest.MANIFEST, manifest, self._fsync)

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                self._queue.task_done()
                return
            kind, pending, copies, nbytes = job
            try:
                if kind == _SNAPSHOT:
                    if self.stopped == "write_failed":
                        for c in copies:
                            self._buffers.release(c)
                    else:
                        graph_snapshots.write_snapshot(self, *pending, *copies)
                elif self.stopped == "write_failed":
                    self._buffers.release(copies)
                    if pending.written is not None:
                        pending.written.set()
                elif kind == _INPUTS:
                    self._write_inputs(pending, copies)
                else:
                    self._write_outputs(pending, copies)
            except Exception as exc:
                full = _os_error(exc)
                if full is not None:
                    self._fail(full)
                    continue  # the finally below still runs
                try:
                    _guard.internal_error("dump", exc)
                except Exception as raised:  # strict mode: re-raised by close()
                    self._errors.append(raised)
            finally:
                with self._lock:
                    self._queued_bytes -= nbytes
                self._queue.task_done()


def _os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc`` (itself, its cause or its context), or None.

    ``torch.save`` meets a full disk as an ``OSError`` and raises a ``RuntimeError`` while
    handling it (its zip writer's end-of-file check): that is still a full disk, reported in
    one line like any other, not an internal error with two tracebacks.
    """
    seen: BaseException | None = exc
    for _ in range(8):  # a chain of causes is short; a cycle must not loop
        if seen is None:
            break
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _touch(path: str) -> None:
    _files.touch(path)  # O_EXCL|O_NOFOLLOW: a planted link is never opened
