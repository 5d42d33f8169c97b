"""The in-memory ring: the last N calls' inputs in host memory, dumped when something goes wrong.

Level 10 writes every call to disk, which fleets cannot afford. With ``OTEL_GPU_RING=N`` (level
>= 3) otel-gpu keeps, in host memory, the inputs of the last N calls (bounded by
``OTEL_GPU_RING_MAX_MB``; the oldest go first) and writes them, with the call that triggered it,
as flight-recorder dumps (``otel-gpu replay`` re-runs them) when:

* a call raises (the raising call as ``raised``, with its exception);
* a call produces NaN/Inf and ``OTEL_GPU_ON_NONFINITE=dump`` (the call with its outputs): a call
  whose outputs hold NaN/Inf while its inputs are finite, and the first non-finite call of the
  process; calls that merely pass a NaN on are not dumped again (``OTEL_GPU_RING=0`` with
  ``dump`` writes the call alone);
* a trigger rule with ``dump: true`` fires on a call (:meth:`Ring.dump_call`: the same dump, the
  call with its outputs for ``nonfinite``, named by its span id); which call produced a NaN is
  one verdict shared with the triggers (``recorder/nonfinite.py``);
* a call is stuck (``OTEL_GPU_STUCK_AFTER``; the call as in flight);
* the process gets ``SIGTERM`` (every call in flight), before the previous handler runs.

Each trigger writes a directory ``<OTEL_GPU_DUMP_DIR>/ring-<pid>-<n>-<reason>-<span id>/`` holding one
call directory per call, in call order, in the flight recorder's format; calls already written
by an earlier trigger are not written again. The triggering call's span (raised, nonfinite) or the
stuck-call report carries ``otel_gpu.ring.dump.dir``. Ring calls other than the trigger kept only their inputs: replay says
``unverified`` for them unless they raised (then it compares the exception).

The copies hold no reference to the caller's tensors, so no GPU memory is kept alive. On CUDA the
copy to host is asynchronous (pinned memory, an event per call) and completed before writing;
unverified without a GPU (docs/gpu.md).
"""

from __future__ import annotations

import collections
import itertools
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from otel_gpu import _files, _guard
from otel_gpu.attributes import RING_DUMP_DIR
from otel_gpu.calls import describe, metadata
from otel_gpu.config import Settings, expand_path
from otel_gpu.recorder import nonfinite, tensor_files
from otel_gpu.recorder import target as _target

if TYPE_CHECKING:
    from otel_gpu.core.plan import Plan
    from otel_gpu.core.protocols import Host
    from otel_gpu.core.record import Call

__all__ = ["ATTR_RING_DIR", "Ring"]

ATTR_RING_DIR = RING_DUMP_DIR
"""Span attribute: the ring dump this call triggered."""
_TRIGGERS = itertools.count(1)
_SEQ = itertools.count(1)
_NAME_TRIES = 100  # ring dump names already taken (planted) before one is given up


class _Entry:
    """One call as the ring keeps it: everything a dump needs, tensors copied to the host."""

    __slots__ = (
        "copies",
        "dumped",
        "end_ns",
        "exception",
        "manifest",
        "nbytes",
        "span_id",
        "start_ns",
        "status",
    )

    def __init__(self, manifest: dict[str, Any], copies: tensor_files.HostCopies) -> None:
        self.manifest = manifest
        self.copies = copies  # may still be filling from a device: copies.wait() before writing
        self.nbytes = copies.nbytes
        self.status = "inputs_saved"
        self.dumped: str | None = None
        self.exception: dict[str, str] | None = None
        self.end_ns: int | None = None
        self.span_id = manifest["span_id"]
        self.start_ns = manifest["time"]["start_unix_nano"]


class Ring:
    """Observer: ``start`` copies the inputs, ``end`` keeps the call and fires the triggers.

    Built by the observer registry when ``OTEL_GPU_RING`` > 0 or ``OTEL_GPU_ON_NONFINITE=dump``,
    from level 3; the registry hands it to the watchdog, which dumps it for stuck calls.
    """

    min_level: int  # set by the observer registry (otel_gpu.export.observers)

    def __init__(self, settings: Settings, pipeline: Host) -> None:
        self.size = settings.ring
        self.max_bytes = int(settings.ring_max_mb * 2**20)
        self.settings = settings
        self.pipeline = pipeline
        self.root = os.path.abspath(os.path.expanduser(expand_path(settings.dump_dir)))
        self.entries: collections.deque[_Entry] = collections.deque()
        self.bytes = 0
        self.active: dict[int, _Entry] = {}
        self.dumps = 0
        self.on_nonfinite_dump = settings.on_nonfinite == "dump"
        self.origins = nonfinite.Origins()
        """Which call produced a NaN: shared with the nonfinite triggers (one verdict a call)."""
        self._lock = threading.RLock()
        self._targets: dict[Plan, _target.Target] = {}
        self._buffers = tensor_files.HostBuffers(self.max_bytes)
        words = tuple(settings.redact)
        self._secret = (lambda name: metadata.is_secret(name, words)) if words else None
        self._previous_sigterm: Any = None
        _install_sigterm(self)

    # ------------------------------------------------------------------ caller's thread

    def start(self, call: Call) -> None:
        """Copy the call's inputs to host memory (asynchronously on CUDA)."""
        from otel_gpu.recorder import call_manifest

        target, tensors, meta, params, _, receiver = call_manifest.encode_inputs(
            call, self._targets, self._secret
        )
        nbytes = sum(m["nbytes"] for m in meta.values())
        why_not = target.why_not
        if nbytes > self.max_bytes:  # kept without its tensors: the dump says so
            tensors = {}
            why_not = f"its inputs ({nbytes} bytes) exceed OTEL_GPU_RING_MAX_MB: not kept"
        copies = self._buffers.copy(tensors)  # async on CUDA; no reference to the caller's tensors
        manifest = call_manifest.new_manifest(
            call, target, params, receiver, meta, why_not, next(_SEQ), self.pipeline
        )
        entry = _Entry(manifest, copies)
        with self._lock:
            self.active[id(call)] = entry

    def end(self, call: Call) -> None:
        """Keep the call in the ring; dump it and the ring if it raised or asked for it."""
        with self._lock:
            entry = self.active.pop(id(call), None)
        if entry is None:
            return
        entry.end_ns = call.end_ns
        if call.exc is not None:
            entry.status = "raised"
            # message and traceback run the exception's own code: formatted off the caller's thread
            entry.exception = describe.exception_record(call.exc, call.tb)
        else:
            entry.status = "completed"
        self._keep(entry)
        if call.exc is not None:
            self._dump_ended(call, entry, "raised")
        elif self.on_nonfinite_dump and self.origins.produced(call):
            self._dump_ended(call, entry, "nonfinite")

    def dump_call(self, call: Call, reason: str) -> str | None:
        """Dump the ring with ``call``, which ended and is kept in it, as the trigger (a trigger
        rule fired on it): named by its span id, with its outputs when ``reason`` is
        ``nonfinite``; the call's span carries the directory. The same dump
        ``OTEL_GPU_ON_NONFINITE=dump`` writes. A call no longer in the ring (a ring of size 0, or
        a device-clock trigger judged later) dumps the calls the ring holds, still named by its
        span id; None when there are none or nothing could be written."""
        span_id = f"{call.span.get_span_context().span_id:016x}"
        with self._lock:
            entry = next((e for e in reversed(self.entries) if e.span_id == span_id), None)
        if entry is None:
            return self.dump(reason, None, span_id=span_id)
        return self._dump_ended(call, entry, reason)

    def _dump_ended(self, call: Call, entry: _Entry, reason: str) -> str | None:
        directory = self.dump(reason, entry, result=call.result if reason == "nonfinite" else None)
        if directory is not None:
            call.span.set_attribute(ATTR_RING_DIR, directory)
        return directory

    def flush(self, timeout: float) -> bool:
        """Nothing queued: a ring writes only when triggered."""
        return True

    def close(self) -> None:
        _restore_sigterm(self)
        with self._lock:
            self.entries.clear()
            self.bytes = 0
        self._buffers.clear()

    # ------------------------------------------------------------------ dumping

    def dump_for(self, call: Call, reason: str) -> str | None:
        """Dump the ring and ``call`` (in flight): the watchdog's stuck report."""
        with self._lock:
            entry = self.active.get(id(call))
        return self.dump(reason, entry)

    def dump(
        self, reason: str, trigger: _Entry | None, result: Any = None, span_id: str | None = None
    ) -> str | None:
        """Write the ring's calls and ``trigger`` as flight-recorder dumps; returns the directory
        (named by the trigger's span id, else ``span_id``, else zeros)."""
        try:
            return self._dump(reason, trigger, result, span_id)
        except Exception as exc:  # a full disk must never break the program being observed
            _guard.internal_error("ring", exc)
            return None

    def _dump(
        self, reason: str, trigger: _Entry | None, result: Any, name_id: str | None
    ) -> str | None:
        from otel_gpu.recorder import call_manifest

        with self._lock:
            entries = [e for e in self.entries if e.dumped is None and e is not trigger]
            if trigger is not None:
                entries.append(trigger)
            if not entries:
                return None
            span_id = trigger.span_id if trigger is not None else (name_id or "0" * 16)
            directory = _make_ring_dir(self.root, reason, span_id)
            for entry in sorted(entries, key=lambda e: e.start_ns):
                with_outputs = entry is trigger and reason == "nonfinite"
                entry.dumped = call_manifest.write_ring_call(
                    directory,
                    entry,
                    result if with_outputs else None,
                    with_outputs,
                    self.settings.dump_format,
                    self._secret,
                )
            self.dumps += 1
        _guard.warn_once(
            f"ring.{reason}",
            "otel-gpu ring: %d call(s) written to %s (%s); replay them with otel-gpu replay --dir "
            "%s. Reported once per kind of trigger.",
            len(entries),
            directory,
            reason,
            directory,
        )
        return directory

    def _keep(self, entry: _Entry) -> None:
        with self._lock:
            self.entries.append(entry)
            self.bytes += entry.nbytes
            while self.entries and (len(self.entries) > self.size or self.bytes > self.max_bytes):
                old = self.entries.popleft()
                self.bytes -= old.nbytes
                self._buffers.release(old.copies)  # written or dropped: its buffers are reused

    def dump_in_flight(self, reason: str) -> None:
        """Every call in flight and the ring: the process is being terminated."""
        with self._lock:
            in_flight = list(self.active.values())
        last = in_flight[-1] if in_flight else None
        with self._lock:
            for entry in in_flight[:-1]:
                self.entries.append(entry)
        self.dump(reason, last)


# --------------------------------------------------------------------------- SIGTERM


def _make_ring_dir(root: str, reason: str, span_id: str) -> str:
    """Create ``<root>/ring-<pid>-<n>-<reason>-<span id>/`` (0700, the root and its parents too).

    The name is predictable, so it is created exclusively: a name that already exists (a
    symlink or a folder somebody planted) is never used; the next trigger number is taken.
    """
    if not _files.make_dirs(root):
        _files.warn_if_shared(root, "dump dir (OTEL_GPU_DUMP_DIR)")
    pid = os.getpid()
    for _ in range(_NAME_TRIES):
        directory = os.path.join(root, f"ring-{pid}-{next(_TRIGGERS):04d}-{reason}-{span_id}")
        try:
            _files.make_dir(directory)
            return directory
        except FileExistsError:
            continue
    raise FileExistsError(f"no free ring dump name below {root!r} after {_NAME_TRIES} tries")


def _install_sigterm(ring: Ring) -> None:
    """Dump on SIGTERM, then let the previous handler (or the default: exit) run."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    try:
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            ring.dump_in_flight("sigterm")
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)
        ring._previous_sigterm = previous
    except (ValueError, OSError):
        pass


def _restore_sigterm(ring: Ring) -> None:
    previous = ring._previous_sigterm
    if previous is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        signal.signal(signal.SIGTERM, previous)
    except (ValueError, OSError):
        pass
    ring._previous_sigterm = None
