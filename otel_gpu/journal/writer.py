"""The crash journal: a per-process memory-mapped file holding the calls in flight.

When a process dies inside a decorated call (SIGKILL, SIGSEGV, ``abort()``,
``os._exit``), its span never reaches the export thread. The journal keeps a
compact record of every call in flight in a ``MAP_SHARED`` file mapping: the
writes are plain memory stores, and the kernel keeps the dirty pages when the
process dies, so ``otel-gpu recover`` (:mod:`otel_gpu.journal.recover`) can turn them
into ERROR spans afterwards.

The file's layout is :mod:`otel_gpu.journal.layout`, shared with the reader.

A slot is taken from a free list when a call starts and given back when it
ends. Each slot begins with a commit word, stored last when a call starts and
cleared first when it ends (one aligned 8-byte store, atomic with respect to
the process dying), so a record is either complete or ignored: reusing slots
never yields a torn record. The file is allocated up front (``posix_fallocate``)
so a full disk is an error at creation, never a SIGBUS in the middle of a call.

A normal exit (or reconfiguration) deletes the file: only dead processes leave
journals behind.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import socket
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import SpanContext, TraceFlags

from otel_gpu import _guard
from otel_gpu.calls import metadata
from otel_gpu.config import Settings
from otel_gpu.journal.directory import default_dir, journal_dir, private_dir
from otel_gpu.journal.inputs import encode as _encode
from otel_gpu.journal.inputs import key_of as _key_of
from otel_gpu.journal.layout import (
    BODY,
    CLOSED,
    COMMIT,
    COMMITTED,
    F_INPUTS,
    F_INPUTS_FAILED,
    F_PARENT,
    F_PARENT_REMOTE,
    F_TRUNCATED,
    HEADER,
    HEADER_SIZE,
    HEARTBEAT_AT,
    I64,
    INPUTS_AT,
    LARGE_SLOT,
    MAGIC,
    META_AT,
    NO_PLAN,
    OPEN,
    PLANS_SIZE,
    PREFIX,
    RECORD,
    SLOTS_LARGE,
    SLOTS_SMALL,
    SMALL_SLOT,
    STATE_AT,
    SUFFIX,
    U32,
    VERSION,
    boot_id,
    process_start_ticks,
)

_payload = metadata.payload_of
_kind = metadata.kind_of

if TYPE_CHECKING:
    from otel_gpu.core.plan import Plan
    from otel_gpu.core.protocols import Host
    from otel_gpu.core.record import Call

__all__ = [
    "Journal",
    "default_dir",
    "journal_dir",
    "make_observer",
    "open_journals",
    "private_dir",
    "start_recovery",
]

# Bound once: module globals, not attribute lookups, on the caller's thread.
_pack_body = BODY.pack_into
_pack_commit = COMMIT.pack_into
_COMMIT_SIZE = COMMIT.size
# thread.id is the "managed" id; get_native_id() would cost a gettid syscall per call.
_thread_id = threading.get_ident
_M64 = (1 << 64) - 1


def _tuple_layout() -> bool:
    """Whether a SpanContext is the tuple (trace_id, span_id, is_remote, …) its properties read."""
    try:
        probe = SpanContext(3, 5, True, TraceFlags(TraceFlags.SAMPLED))
        return (probe[0], probe[1], probe[2]) == (probe.trace_id, probe.span_id, probe.is_remote)
    except Exception:
        return False


_TUPLE_LAYOUT = _tuple_layout()
_CACHE_ENTRIES = 512  # distinct input layouts remembered; cleared when full


# --------------------------------------------------------------------------- the observer

_open_journals: weakref.WeakSet[Journal] = weakref.WeakSet()


def open_journals() -> list[Journal]:
    """The journals this process has open now (one per pipeline that keeps one)."""
    return list(_open_journals)


class Journal:
    """The observer that keeps one process's journal. ``start``/``end`` run on the caller's thread."""

    min_level: int  # set by the observer registry (otel_gpu.export.observers)

    def __init__(self, directory: str, settings: Settings, pipeline: Host | None) -> None:
        self.pid = os.getpid()
        self.level = settings.level
        self.limit = settings.repr_limit
        large = settings.level >= 3
        self.stride = LARGE_SLOT if large else SMALL_SLOT
        self.count = SLOTS_LARGE if large else SLOTS_SMALL
        self.capacity = self.stride - INPUTS_AT if large else 0
        self.flush_timeout = settings.flush_timeout
        self.base = HEADER_SIZE + PLANS_SIZE
        size = self.base + self.stride * self.count
        self.overflow = 0
        """Calls not journaled because every slot was in flight."""
        self.bytes_written = 0
        """Bytes stored into the mapping so far: call records (commit word, body and encoded
        inputs at a call's start, the cleared commit word at its end), plan entries and the
        metadata; not the header written at creation nor the export thread's heartbeat. Unlocked
        (one add on the caller's path): with several threads calling at once, an increment may
        rarely be lost."""
        self._plans: dict[Plan, int] = {}
        self._cache: dict[Any, tuple[tuple[type, ...], tuple[bytes, bool]]] = {}
        # by identity: a call's inputs are often an earlier call's record, shared
        # (calls/metadata.py's ``shared``); the record is kept, so its id is not reused meanwhile
        self._same: dict[int, tuple[Any, tuple[bytes, bool]]] = {}
        self._plan_end = HEADER_SIZE
        self._plan_count = 0
        self._lock = threading.Lock()
        # Free slots as file offsets, last first: pop() hands out the lowest, and a process
        # that is not concurrent keeps reusing the same page.
        self._free = [self.base + i * self.stride for i in range(self.count - 1, -1, -1)]
        name = f"{PREFIX}{self.pid}-{os.urandom(4).hex()}{SUFFIX}"
        self.path = os.path.join(directory, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(self.path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            _allocate(fd, size)
            self._mm: mmap.mmap | None = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _unlink(self.path)
            raise
        os.close(fd)
        ticks = process_start_ticks(self.pid)
        HEADER.pack_into(
            self._mm,
            0,
            MAGIC,
            VERSION,
            HEADER_SIZE,
            PLANS_SIZE,
            self.stride,
            self.count,
            self.level,
            self.pid,
            ticks[0] if ticks else 0,
            boot_id(),
            time.time_ns(),
            time.time_ns(),
            OPEN,
            0,
        )
        _open_journals.add(self)
        # The host is complete (its resource detected) before any observer is built: the
        # resource is written now, so the calls take the fast method from the first.
        if pipeline is not None:
            try:
                self._write_meta(pipeline)
            except Exception as exc:  # recovery then lacks the resource, not the calls
                _guard.internal_error("journal", exc)

    # ------------------------------------------------------------------ caller's thread

    def start(self, call: Call) -> None:
        mm = self._mm
        if mm is None:
            return
        try:
            offset = self._free.pop()  # list.pop/append are atomic under the GIL: no lock
        except IndexError:
            self.overflow += 1
            return
        plan = call.plan
        index = self._plans.get(plan)
        if index is None:
            index = self._add_plan(plan)
        # the ids, not get_span_context(): that would build the context a leaf call never needs;
        # read from the record, which is its span (no property call)
        trace_id, span_id = call.trace_id, call.span_id
        parent = call.parent
        flags = 0
        parent_id = 0
        if _TUPLE_LAYOUT and type(parent) is SpanContext:
            # indexed, not through the properties: 0.1 µs a call (layout checked at import)
            parent_id = parent[1]
            flags = F_PARENT | F_PARENT_REMOTE if parent[2] else F_PARENT
        elif parent is not None:
            parent_id = parent.span_id
            flags = F_PARENT | F_PARENT_REMOTE if parent.is_remote else F_PARENT
        size = 0
        failure = None
        inputs = call.inputs
        if inputs and self.capacity:
            try:
                blob, truncated = self._encoded(inputs)
                size = len(blob)
                mm[offset + INPUTS_AT : offset + INPUTS_AT + size] = blob
                flags |= F_INPUTS | F_TRUNCATED if truncated else F_INPUTS
            except Exception as exc:  # hostile values: journal the call without its inputs
                size = 0
                flags |= F_INPUTS_FAILED
                failure = exc
        elif inputs:
            flags |= F_TRUNCATED
        _pack_body(
            mm,
            offset + 8,
            trace_id >> 64,
            trace_id & _M64,
            span_id,
            parent_id,
            call.start_ns,
            _thread_id(),
            index,
            flags,
            size,
        )
        _pack_commit(mm, offset, COMMITTED)  # last: the record now counts
        self.bytes_written += RECORD + size
        call.token = offset
        if failure is not None:
            _guard.internal_error("journal", failure)

    def _encoded(self, inputs: Any) -> tuple[bytes, bool]:
        """The encoded inputs, from a cache of recent calls' (a serving loop repeats its shapes).

        Encoding costs ~3 µs a call (half of level 3's caller cost); a hit costs ~0.6 µs, and
        ~0.1 µs for a record shared with an earlier call (the same object).
        Tuples compare 1 == 1.0 == True equal, so a hit also checks the scalar types.
        """
        same = self._same.get(id(inputs))
        if same is not None and same[0] is inputs:
            return same[1]
        try:
            hit = self._cache.get(inputs)
        except TypeError:  # an unhashable payload: encode it every time
            return _encode(inputs, self.limit, self.capacity)
        # every payload's type (one C-level pass; a generator picking the scalars' cost 0.4 µs)
        kinds = tuple(map(type, map(_payload, inputs)))
        if hit is not None and hit[0] == kinds:
            if len(self._same) >= _CACHE_ENTRIES:
                self._same.clear()
            self._same[id(inputs)] = (inputs, hit[1])
            return hit[1]
        # An object's payload carries its id (for the repr taken off the caller's thread), so a
        # new object each call (a model's KV cache) never hit: keyed by what the journal keeps
        # of it, its type name, such a call costs ~2 µs instead of an encoding (~20 µs).
        key = _key_of(inputs)
        if key is not inputs:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == kinds:
                return hit[1]
        encoded = _encode(inputs, self.limit, self.capacity)
        if len(self._cache) >= _CACHE_ENTRIES:
            self._cache.clear()
            self._same.clear()
        self._cache[key] = (kinds, encoded)
        self._same[id(inputs)] = (inputs, encoded)
        return encoded

    def end(self, call: Call) -> None:
        offset = call.token
        if type(offset) is not int:
            return  # start() did not journal this call (slots full, closed, async level 1)
        call.token = None
        mm = self._mm
        if mm is None:
            return
        _pack_commit(mm, offset, 0)  # first: the record is gone
        self.bytes_written += _COMMIT_SIZE
        self._free.append(offset)

    # ------------------------------------------------------------------ rare paths

    def _add_plan(self, plan: Plan) -> int:
        with self._lock:
            index = self._plans.get(plan)
            if index is not None:
                return index
            mm = self._mm
            attrs = plan.attributes or {}
            entry = json.dumps(
                [
                    str(plan.name)[:1024],
                    {k: v for k, v in attrs.items() if isinstance(v, (str, int))},
                ],
                default=str,
            ).encode("utf-8")
            at = self._plan_end
            if mm is None or at + 4 + len(entry) + 4 > HEADER_SIZE + PLANS_SIZE:
                index = NO_PLAN
            else:
                mm[at + 4 : at + 4 + len(entry)] = entry
                U32.pack_into(mm, at, len(entry))  # the length last: a torn entry reads as absent
                self.bytes_written += 4 + len(entry)
                self._plan_end = at + 4 + ((len(entry) + 7) & ~7)
                index = self._plan_count
                self._plan_count += 1
            self._plans[plan] = index
            return index

    def _write_meta(self, pipeline: Host | None) -> None:
        mm = self._mm
        if mm is None:
            return
        resource = (pipeline.resource.attributes if pipeline is not None else None) or {}
        attrs = {str(k): list(v) if isinstance(v, tuple) else v for k, v in resource.items()}
        argv = [str(a)[:256] for a in sys.argv[:16]]
        meta = {"host": socket.gethostname(), "resource": attrs, "argv": argv}
        self._write_meta_dict(meta)

    def note_fault(self, verdict: dict[str, Any]) -> None:
        """Keep a CUDA fault's verdict (devices/cuda_fault.py) in the header, for recovery."""
        mm = self._mm
        if mm is None:
            return
        (length,) = U32.unpack_from(mm, HEADER.size - 4)
        meta = json.loads(bytes(mm[META_AT : META_AT + length]) or b"{}")
        meta["cuda_fault"] = verdict
        self._write_meta_dict(meta)

    def _write_meta_dict(self, meta: dict[str, Any]) -> None:
        mm = self._mm
        if mm is None:
            return
        attrs = meta.get("resource") or {}
        data = json.dumps(meta, default=str).encode("utf-8")
        room = HEADER_SIZE - META_AT
        while len(data) > room and attrs:  # drop the longest values until it fits
            del attrs[max(attrs, key=lambda k: len(str(attrs[k])))]
            data = json.dumps(meta, default=str).encode("utf-8")
        data = data[:room]
        U32.pack_into(mm, HEADER.size - 4, 0)  # a rewrite never leaves a torn entry readable
        mm[META_AT : META_AT + len(data)] = data
        U32.pack_into(mm, HEADER.size - 4, len(data))
        self.bytes_written += 4 + len(data)

    def heartbeat(self) -> None:
        """Record that the process was alive now: the end time of recovered spans (export thread)."""
        mm = self._mm
        if mm is not None:
            I64.pack_into(mm, HEARTBEAT_AT, time.time_ns())

    def flush(self, timeout: float) -> bool:
        """Nothing queued: every record is written on the caller's thread."""
        return True

    def in_flight(self) -> int:
        """Calls currently journaled."""
        return self.count - len(self._free)

    def close(self) -> None:
        """Normal exit or reconfiguration: delete the journal, there is nothing to recover."""
        if self.pid != os.getpid():
            return  # a fork child must not delete its parent's journal
        with self._lock:
            mm, self._mm = self._mm, None
        if mm is None:
            return
        U32.pack_into(mm, STATE_AT, CLOSED)  # in case the unlink below fails
        _unlink(self.path)
        _open_journals.discard(self)
        # The mapping is not closed here: another thread may be inside start()/end() with it.
        # It goes when the last reference does; writes into an unlinked file are harmless.
        _join_recovery(self.flush_timeout)


def _allocate(fd: int, size: int) -> None:
    """Reserve the file's blocks now: a full disk must fail here, not SIGBUS a later store."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    os.ftruncate(fd, size)  # no fallocate here (some filesystems, macOS): write the zeros
    zeros = bytes(64 * 1024)
    for at in range(0, size, len(zeros)):
        os.pwrite(fd, zeros[: size - at], at)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _after_fork_in_child() -> None:
    # The child shares the parent's mapping: it must never write to it. Its pipeline
    # builds a journal of its own on its first call.
    for journal in list(_open_journals):
        journal._mm = None
    _open_journals.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --------------------------------------------------------------------------- pipeline hook

_recovery_lock = threading.Lock()
_recovery_thread: threading.Thread | None = None


def make_observer(settings: Settings, pipeline: Host) -> Journal | None:
    """The observer registry's factory: this process's journal (``OTEL_GPU_JOURNAL``).

    A journal that cannot be created (unwritable or foreign directory, full disk) is a
    warning, once; the program runs on without it.
    """
    directory = journal_dir(settings)
    try:
        private_dir(directory, shared_parent=not settings.journal_dir)
        journal = Journal(directory, settings, pipeline)
    except OSError as exc:
        _guard.warn_once(
            "journal.unavailable",
            "otel-gpu crash journal disabled: cannot use %s (%s); calls that crash the process "
            "will not be recoverable. Set OTEL_GPU_JOURNAL_DIR to a writable directory, or "
            "OTEL_GPU_JOURNAL=false.",
            directory,
            exc,
        )
        return None
    pipeline.add_after_drain(journal.heartbeat)  # the export thread drains every 100 ms
    return journal


def start_recovery(settings: Settings, pipeline: Host) -> None:
    """``OTEL_GPU_RECOVER_ON_START``: once per process, in the background, so no call waits.

    The pipeline calls this once it is built, so its processor exists.
    """
    global _recovery_thread
    with _recovery_lock:
        if _recovery_thread is not None:
            return

        def run() -> None:
            from otel_gpu.journal import recover

            try:
                # otel-gpu's own provider writing to the terminal alone keeps nothing: the
                # journal must stay, as `otel-gpu recover` keeps it for the terminal
                keeps = not (
                    pipeline.owns_provider
                    and all(d.lower() in recover.TERMINAL for d in settings.dest)
                )
                outcomes = recover.recover(
                    settings, processor=pipeline.processor, processor_keeps=keeps
                )
                shown = sum(1 for o in outcomes if o.state == "shown")
                if shown:
                    _guard.logger.warning(
                        "otel-gpu: %d crash journal(s) shown on the terminal and kept (the "
                        "terminal keeps nothing); to export and remove them, run "
                        "OTEL_GPU_LOGDEST=crash.jsonl otel-gpu recover",
                        shown,
                    )
            except Exception as exc:  # strict mode: the host keeps it for flush() to raise
                pipeline.report_internal("recover", exc)

        _recovery_thread = threading.Thread(target=run, name="otel-gpu-recover", daemon=True)
        _recovery_thread.start()


def _join_recovery(timeout: float) -> None:
    # A normal exit waits (bounded) for auto-recovery, so a claimed journal is not left half done.
    thread = _recovery_thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


def _after_fork_recovery() -> None:
    global _recovery_lock
    _recovery_lock = threading.Lock()  # the parent already recovered; the child does not repeat it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_recovery)
