"""CUDA graphs: what decorated calls record at capture, and the spans of each replay.

A decorated call at level >= 5 that runs while a CUDA graph is being captured cannot read
anything back (a host sync would break the capture). Instead (see docs/levels.md, "Under CUDA
graphs"):

* at capture, :func:`otel_gpu.calls.stats.capture` records the call's statistics into a static
  device vector with capturable ops, and :func:`record` keeps that vector, the call's metadata
  and its capture span's context in a :class:`CapturedCall` of the current thread's capture;
  the level-10 recorder attaches a deferred snapshot to the same record;
* the patched ``CUDAGraph.capture_end`` gives the thread's records to the graph;
* the patched ``CUDAGraph.replay`` runs the original first, returns its result (or lets its
  exception through untouched), then, for replay 1 and one replay in
  ``OTEL_GPU_GRAPH_STATS_EVERY``, concatenates the graph's vectors (one kernel), copies them
  into a reused pinned host buffer without waiting (:func:`otel_gpu.devices.cuda.copy_to_host`,
  an event) and queues them for the reader thread; ``OTEL_GPU_GRAPH_DUMP_EVERY`` does the same
  for level-10 snapshots. The caller never waits: a replay whose buffers are still being read,
  or that finds the reader's queue full, is counted in ``skipped`` and not read.
* the reader thread waits for the copy's event (:func:`otel_gpu.devices.cuda.wait_copy`) and
  turns every captured call into a span with ``otel_gpu.cuda_graph.replay`` = the replay number,
  a link to its capture span and the statistics events.

torch 2.13 offers no replay hook, hence the patch: installed once, when the first level >= 5
call is captured, and removed by :func:`uninstall` (the original methods are put back).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from opentelemetry import trace
from opentelemetry.trace import SpanContext, TraceFlags

from otel_gpu import _guard, config
from otel_gpu.attributes import (
    CUDA_GRAPH_CAPTURE,
    CUDA_GRAPH_REPLAY,
    CUDA_GRAPH_REPLAY_DEVICE_DURATION,
    DUMP_DIR,
)
from otel_gpu.core import sink
from otel_gpu.core.threads import JobThread
from otel_gpu.devices import cuda, replay_timing

if TYPE_CHECKING:
    from otel_gpu.core.protocols import SpanSink

__all__ = [
    "ATTR_CAPTURE",
    "ATTR_REPLAY",
    "CapturedCall",
    "Job",
    "Replayed",
    "flush",
    "graph_class",
    "install",
    "installed",
    "record",
    "replays",
    "set_replayed",
    "uninstall",
]

ATTR_REPLAY = CUDA_GRAPH_REPLAY
"""Span attribute of a replay span: the replay's number for its graph, from 1."""
ATTR_CAPTURE = CUDA_GRAPH_CAPTURE
"""Span attribute of a call that ran during CUDA graph capture (level >= 5): true."""

_SLOTS = 4  # pinned host buffers per graph: a replay finding all in use is skipped, not waited on
_QUEUE = 64  # replays queued for the reader; beyond, replays are skipped
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_getrandbits = random.getrandbits


def graph_class() -> Any:
    """The class whose ``capture_begin``/``capture_end``/``replay`` are patched (a seam: tests
    return a fake)."""
    return torch.cuda.CUDAGraph


Snapshot = Callable[[int, SpanContext, "SpanContext | None", int, int], "str | None"]
"""A deferred level-10 dump: ``(replay, span context, parent, start_ns, end_ns) -> directory``."""


class CapturedCall:
    """One decorated call recorded during a capture: what each replay's span is built from."""

    __slots__ = (
        "buffer",
        "context",
        "inputs",
        "layout",
        "name",
        "outputs",
        "parent",
        "plan",
        "snapshot",
    )

    def __init__(self, call: Any) -> None:
        self.plan = call.plan
        self.name = call.plan.name
        self.context: SpanContext = call.span.get_span_context()
        self.parent = call.parent
        self.inputs = call.inputs
        self.outputs = call.outputs  # set before stats.finish runs, kept for every replay span
        # (key, numel, note, integer, (start, end) in buffer or None, extras, moments) per tensor
        self.layout: list[
            tuple[str, int, str | None, bool, tuple[int, int] | None, tuple[Any, ...], bool]
        ] = []
        self.buffer: torch.Tensor | None = None  # 1-D float64, every vector, in the graph pool
        self.snapshot: Snapshot | None = None

    def add_stats(self, pending: Sequence[Any]) -> None:
        """Keep the static vectors of ``stats.capture`` (one row per tensor with statistics)."""
        vectors: list[torch.Tensor] = []
        size = 0
        for p in pending:
            span = None
            if p.captured and p.vec is not None:
                span = (size, size + p.vec.shape[0])  # vectors differ in length: flat offsets
                size = span[1]
                vectors.append(p.vec)
            self.layout.append((p.key, p.numel, p.note, p.integer, span, p.extras, p.moments > 0))
        if vectors:
            # captured too: the concatenated buffer is what every replay rewrites and we read
            self.buffer = torch.cat(vectors)


class _Graph:
    """What one captured graph's replays need; kept with the graph object (weakly)."""

    __slots__ = (
        "calls",
        "dump_every",
        "free",
        "lock",
        "replays",
        "set_replayed",
        "skipped",
        "stats_every",
        "timers",
    )

    def __init__(self, calls: list[CapturedCall], settings: config.Settings) -> None:
        self.calls = calls
        self.replays = 0
        self.skipped = 0  # replays due to be read but not read (buffers busy, reader behind)
        self.stats_every = settings.graph_stats_every
        self.dump_every = settings.graph_dump_every
        self.free: list[torch.Tensor] = []  # pinned host buffers not being read
        self.lock = threading.Lock()
        self.timers: list[list[Any]] = []  # [backend, start, end] event pairs not being read


_capturing: dict[int, dict[int, CapturedCall]] = {}  # thread id -> span id -> record
_graphs: weakref.WeakKeyDictionary[Any, _Graph] = weakref.WeakKeyDictionary()
_originals: dict[str, Any] = {}
_installed_on: Any = None
_install_lock = threading.Lock()
_MISSING = object()  # the method was inherited, not defined on the patched class


def record(call: Any) -> CapturedCall:
    """The record of ``call`` (running during a capture on this thread), made on first use."""
    calls = _capturing.setdefault(threading.get_ident(), {})
    span_id = call.span.get_span_context().span_id
    rec = calls.get(span_id)
    if rec is None:
        install()
        rec = CapturedCall(call)
        calls[span_id] = rec
        call.span.set_attribute(ATTR_CAPTURE, True)
    return rec


def installed() -> bool:
    return _installed_on is not None


def install() -> None:
    """Patch ``capture_begin``, ``capture_end`` and ``replay`` of :func:`graph_class` (once)."""
    global _installed_on
    with _install_lock:
        if _installed_on is not None:
            return
        cls = graph_class()
        for name in ("capture_begin", "capture_end", "replay"):
            _originals[name] = cls.__dict__.get(name, _MISSING), getattr(cls, name)
        begin, end, replay = (_originals[n][1] for n in ("capture_begin", "capture_end", "replay"))

        def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
            _capturing.pop(threading.get_ident(), None)  # a capture that failed left records
            return begin(self, *args, **kwargs)

        def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = end(self, *args, **kwargs)
            calls = _capturing.pop(threading.get_ident(), None)
            if calls:
                try:
                    _graphs[self] = _Graph(list(calls.values()), config.current())
                except Exception as exc:
                    _guard.internal_error("cuda_graph", exc)
            return result

        def patched_replay(self: Any, *args: Any, **kwargs: Any) -> Any:
            start_ns = time.time_ns()
            graph = _graphs.get(self)
            timer = None
            if graph is not None:
                try:
                    timer = replay_timing.start(graph.timers)  # device time of the replay
                except Exception as exc:
                    _guard.internal_error("cuda_graph", exc)
            result = replay(self, *args, **kwargs)  # the user's exception passes through as is
            if graph is not None:
                try:
                    replay_timing.end(timer)
                    _after_replay(graph, start_ns, timer)
                except Exception as exc:
                    _guard.internal_error("cuda_graph", exc)
            return result

        for name, fn in (
            ("capture_begin", capture_begin),
            ("capture_end", capture_end),
            ("replay", patched_replay),
        ):
            fn.__name__ = name
            fn.__qualname__ = f"{cls.__qualname__}.{name}"
            fn.__wrapped__ = _originals[name][1]  # type: ignore[attr-defined]
            setattr(cls, name, fn)
        _installed_on = cls


def uninstall() -> None:
    """Put back the original ``capture_begin``, ``capture_end`` and ``replay``; forget graphs."""
    global _installed_on
    with _install_lock:
        cls = _installed_on
        if cls is None:
            return
        for name, (own, _) in _originals.items():
            if own is _MISSING:
                delattr(cls, name)  # it was inherited: the base class's method shows again
            else:
                setattr(cls, name, own)
        _originals.clear()
        _installed_on = None
        _capturing.clear()
        _graphs.clear()


# --------------------------------------------------------------------------- caller's thread


def _after_replay(graph: _Graph, start_ns: int, timer: list[Any] | None = None) -> None:
    """After a replay: copies started and queued for the reader when the replay is due; no wait."""
    with graph.lock:
        graph.replays += 1
        n = graph.replays
    stats_due = (n - 1) % graph.stats_every == 0
    dump_due = (n - 1) % graph.dump_every == 0 and any(c.snapshot for c in graph.calls)
    if not (stats_due or dump_due):
        replay_timing.give_back(graph.timers, timer)
        return
    pipe = sink.current()
    if pipe is None:
        return
    parent: SpanContext | None = trace.get_current_span().get_span_context()
    if parent is not None and parent.is_valid:
        if not parent.trace_flags.sampled:
            return
        trace_id, state = parent.trace_id, parent.trace_state
    else:
        parent, trace_id, state = None, _getrandbits(128) or 1, None
    buffers = [c.buffer for c in graph.calls if c.buffer is not None]
    host = event = None
    if buffers:
        with graph.lock:
            host = graph.free.pop() if graph.free else None
        if host is None and _reader.busy(graph) >= _SLOTS:
            graph.skipped += 1
            return
        size = sum(b.shape[0] for b in buffers)
        if host is None:
            host = cuda.pinned_empty(size * 8).view(torch.float64)
        # one kernel and one copy per read replay, however many calls the graph holds
        src = torch.cat(buffers) if len(buffers) > 1 else buffers[0]
        event = cuda.copy_to_host(host, src)
    end_ns = time.time_ns()
    contexts = [
        SpanContext(trace_id, _getrandbits(64) or 1, False, _SAMPLED, state) for _ in graph.calls
    ]
    dirs: list[str | None] = [None] * len(graph.calls)
    if dump_due:
        for i, c in enumerate(graph.calls):
            if c.snapshot is not None:
                dirs[i] = c.snapshot(n, contexts[i], parent, start_ns, end_ns)
    job = Job(pipe, graph, n, contexts, parent, start_ns, end_ns, host, event, dirs, timer)
    if not _reader.put(job):
        graph.skipped += 1
        replay_timing.give_back(graph.timers, timer)
        if host is not None:
            with graph.lock:
                graph.free.append(host)


@dataclasses.dataclass(slots=True)
class Job:
    """One read replay, queued for the reader thread: its parent and clocks for every span."""

    pipe: SpanSink
    graph: _Graph
    n: int
    contexts: list[SpanContext]
    parent: SpanContext | None
    start_ns: int
    end_ns: int
    host: torch.Tensor | None
    event: Any
    dirs: list[str | None]
    timer: list[Any] | None = None  # the replay's device-time events (replay_timing)


# --------------------------------------------------------------------------- reader thread


class _Reader:
    """The thread that waits for each read replay's copy and turns its calls into spans; it
    counts, per graph, the jobs holding one of the graph's host buffers."""

    def __init__(self) -> None:
        self._busy: dict[int, int] = {}  # id(graph) -> jobs holding one of its host buffers
        self._jobs: JobThread[Job] = JobThread(
            "otel-gpu-graphs", _QUEUE, _read, done=self._release, on_put=self._hold
        )

    def busy(self, graph: _Graph) -> int:
        return self._busy.get(id(graph), 0)

    def put(self, job: Job) -> bool:
        return self._jobs.put(job)

    def flush(self, timeout: float) -> bool:
        return self._jobs.flush(timeout)

    def _hold(self, job: Job) -> None:  # under the queue's lock, once queued
        if job.host is not None:
            self._busy[id(job.graph)] = self._busy.get(id(job.graph), 0) + 1

    def _release(self, job: Job) -> None:
        if job.host is not None:
            with self._jobs.lock:
                self._busy[id(job.graph)] -= 1
            with job.graph.lock:
                job.graph.free.append(job.host)


def _read(job: Job) -> None:
    try:
        _emit(job)
    except Exception as exc:  # strict mode: kept for the pipeline's flush to raise
        job.pipe.report_internal("cuda_graph", exc)


_reader = _Reader()


Replayed = Callable[["SpanSink", "CapturedCall", SpanContext, "Job", list, dict], None]
"""Queues the record of one replayed call: ``(pipe, captured, context, job, statistics,
attributes)``, where ``context`` holds the replay span's ids and ``job`` its parent and clocks."""
_replayed: Replayed | None = None


def set_replayed(fn: Replayed) -> None:
    """Install what queues each replayed call's record: the call lifecycle's
    :func:`otel_gpu.calls.lifecycle.replayed`, installed by the calls layer (which sits above
    this one) when it is imported."""
    global _replayed
    _replayed = fn


def _emit(job: Job) -> None:
    """One span per captured call of the job's replay, statistics read from the host copy."""
    from otel_gpu.core.stats import TensorStats, captured_stats

    replayed = _replayed
    if replayed is None:  # no decorated call was ever made: nothing was captured to replay
        raise RuntimeError("CUDA graph replay read before the call lifecycle was installed")
    flat: list[float] = []
    if job.host is not None:
        cuda.wait_copy(job.event)
        flat = job.host.tolist()  # host memory, copy complete: no device sync
    # the copy's event follows the replay's end event on the stream: both complete now
    device = replay_timing.seconds(job.graph.timers, job.timer)
    offset = 0
    for c, ctx, directory in zip(job.graph.calls, job.contexts, job.dirs):
        attributes: dict[str, Any] = {ATTR_REPLAY: job.n}
        if device is not None:
            attributes[CUDA_GRAPH_REPLAY_DEVICE_DURATION] = device
        if directory is not None:
            attributes[DUMP_DIR] = directory  # the flight recorder's key
        results = []
        for key, numel, note, integer, span, extras, moments in c.layout:
            if span is None:
                results.append(TensorStats(key, numel, note=note))
            else:
                row = flat[offset + span[0] : offset + span[1]]
                results.append(captured_stats(key, numel, note, integer, row, extras, moments))
        if c.buffer is not None:
            offset += c.buffer.shape[0]
        replayed(job.pipe, c, ctx, job, results, attributes)


def flush(timeout: float = 10.0) -> bool:
    """Wait until every queued replay has become spans (handed to the pipeline's queue); True
    when that happened within ``timeout`` seconds. ``otel_gpu.flush()`` exports them next."""
    return _reader.flush(timeout)


def replays(graph: Any) -> tuple[int, int]:
    """``(replays, skipped)`` of a captured graph: how often it ran, and how many of the replays
    due to be read were not (buffers still being read, reader behind)."""
    state = _graphs.get(graph)
    return (0, 0) if state is None else (state.replays, state.skipped)
