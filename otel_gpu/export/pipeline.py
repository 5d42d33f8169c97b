"""Deferred materialisation: call records in, finished spans out, off the caller's thread.

The caller's thread appends a :class:`~otel_gpu.core.record.Call` to a bounded deque and
returns. An export thread wakes every 100 ms (or sooner when the queue fills),
turns each record into a finished span and hands it to the target TracerProvider's
span processors (``on_end``). An application's provider gets SDK ``ReadableSpan`` objects,
so every standard processor and exporter works unchanged; otel-gpu's own provider
with the native encoders (``OTEL_GPU_ENCODER=native``) gets ``SpanData``, the same
span without the SDK's per-attribute validation, which only its own exporters read.

When a tight loop fills the queue, the caller exports the next chunk itself
(``OTEL_GPU_QUEUE_FULL=block``, the default; ``drop`` drops and counts instead).
Building the spans lives in :mod:`otel_gpu.export.spans`.

The target provider is resolved on the first call (see ``OTEL_GPU_PROVIDER``):
the application's global SDK provider, one given to :func:`otel_gpu.configure`,
or otel-gpu's own provider with the ``OTEL_GPU_LOGDEST`` destinations.
"""

from __future__ import annotations

import collections
import functools
import gc
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from otel_gpu import _guard
from otel_gpu.attributes import (
    EVENT_SPANS_DROPPED,
)
from otel_gpu.config import Settings, check_sdk_import_variables
from otel_gpu.core import sink
from otel_gpu.core.record import Call
from otel_gpu.core.threads import bounded_call

# opentelemetry.sdk.trace reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT when it is imported and stops the
# import with its own chained ValueError on a bad value, at any level. This is the first SDK import
# on the way to @otel_gpu.api: the same failure, as the one-line ConfigError of a bad OTEL_GPU_*
# variable. The other standard variables are checked when otel-gpu builds its own provider.
check_sdk_import_variables()

from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider  # noqa: E402

from otel_gpu.export import drops  # noqa: E402
from otel_gpu.export import observers as _observers  # noqa: E402
from otel_gpu.export import spans as _spans  # noqa: E402
from otel_gpu.export import target as _target  # noqa: E402
from otel_gpu.export.spans import SCOPE as SCOPE  # noqa: E402
from otel_gpu.export.spans import SpanBuilder  # noqa: E402

if TYPE_CHECKING:
    from otel_gpu.core.protocols import MetricsSink, RingDump
    from otel_gpu.export.observers import Observer
    from otel_gpu.exporters.console import ConsoleSpanExporter

__all__ = ["Pipeline", "defer_export", "get", "reset", "shutdown"]

_WAKE_EVERY: float | None = (
    0.1  # seconds (None: only when flushed); batching amortises the export thread's wake-ups and GIL grabs
)
_WAKE_AT = 1024  # queued calls that wake the export thread early, to bound memory
_EXPORT_CHUNK = 64  # spans per export; bounds how long drain() keeps the collector paused
_STALL_AFTER = 1.0  # seconds without progress before a full queue drops (block mode): above
# the 0.5 s a slow __repr__ may hold one span, and above an OS scheduling gap on a busy machine
# the SDK's self-metric for spans a processor took or lost (error.type says why)
DROP_EVENT = EVENT_SPANS_DROPPED


class Pipeline:
    """One process's path from call records to span processors.

    It holds a :class:`~otel_gpu.export.spans.SpanBuilder` for its target provider, and is
    complete (provider, resource, processor, sampler) before any observer is built: an observer
    receives it as its :class:`~otel_gpu.core.protocols.Host`."""

    def __init__(self, settings: Settings, tracer_provider: Any = None) -> None:
        self.settings = settings
        self.queue: collections.deque[Call] = collections.deque()
        self.maxsize = settings.queue_size
        # OTEL_GPU_QUEUE_FULL: at a full queue the caller helps export (block) or drops (drop)
        self.block = settings.queue_full == "block"
        self.dropped = 0  # calls never exported: the queue was full (drop) or export stalled
        self.stalled = 0  # of those, dropped in block mode because export made no progress
        self._stalled_at = -1  # self.taken when export was found stalled; drop until it moves
        self._noted = (0, 0)  # (dropped, stalled) already put on an exported span
        self._drainer: int | None = None  # the thread holding _drain_lock
        self._handover = False  # a caller at a full queue waits to export the next chunk
        self.exported = 0  # spans handed to the processors
        self.taken = 0  # calls taken off the queue (taken - exported: failed or still being built)
        self.pid = os.getpid()
        self.observers: tuple[Observer, ...] = ()
        self.observers_at: dict[int, tuple[Observer, ...]] = {}
        # otel-gpu's own console destinations, which print a call's inputs before it runs
        self.consoles: tuple[ConsoleSpanExporter, ...] = ()
        self.root_sampler: Callable[[int, str], bool] | None = None
        self.ring: RingDump | None = None  # the in-memory ring, when OTEL_GPU_RING is on
        # device time (devices/device_time.py), set by its observer; typed loosely so that
        # export does not import a plugin
        self.device_time: Any = None
        self.errors: list[BaseException] = []
        self._wake = threading.Event()
        self._drain_lock = threading.Lock()
        self._stopped = False
        self._own_provider: SdkTracerProvider | None = None
        self._after_drain: list[Any] = []  # destinations' batch writes: after every chunk
        self._after_drain_hooks: list[Any] = []  # add_after_drain (the watchdog): drains only
        self._before_flush: list[
            Callable[[float], Any]
        ] = []  # add_before_flush: calls on their way
        self._counters: list[Any] = []  # own destinations' exporters, counting confirmed spans
        self.native = False  # the processors take SpanData (own provider, native encoders)
        self.metrics: MetricsSink | None = None  # OTEL_GPU_METRICS: fed each chunk's calls
        # calls the head sampler dropped, for the call metrics: (plan, duration ns, raised class)
        self.unsampled: collections.deque[tuple[Any, int, Any]] = collections.deque()
        self.unsampled_dropped = 0  # not counted in the metrics: the export fell far behind
        self._resolve(tracer_provider)
        if settings.metrics:
            self.metrics = _observers.build_metrics(settings, self)
        self._thread = threading.Thread(target=self._run, name="otel-gpu-export", daemon=True)
        self._thread.start()
        if settings.journal and settings.recover_on_start:
            _observers.start_recovery(settings, self)

    # ------------------------------------------------------------------ set-up

    def _resolve(self, explicit: Any) -> None:
        target = _target.resolve(self.settings, explicit)
        provider = target.provider
        if target.own is not None:
            self._after_drain, self.consoles = target.own.after_drain, target.own.consoles
            self._counters = target.own.exporters
            self._own_provider = provider
            self.native = target.own.spandata
        self.provider = provider
        self.processor = provider._active_span_processor
        self._chunk_ends, self._span_ends = _target.handoffs(
            self.processor, self._own_provider is not None
        )
        self.spans = SpanBuilder(self.settings, provider)
        self.resource = self.spans.resource
        # bound once: the export loop builds a span per call through one of them
        self.materialise = self.spans.materialise
        self.materialise_native = self.spans.materialise_native
        self.root_sampler = _target.root_sampler(getattr(provider, "sampler", None))
        # The pipeline is complete: the observers get it as their host.
        built = _observers.build(self.settings, self)
        self.observers, self.ring = built.observers, built.ring
        # A function keeps the level it was decorated at; observers run only for levels they serve.
        self.observers_at = _observers.by_level(self.observers)

    def note_unsampled(self, plan: Any, duration_ns: int, failed: Any) -> None:
        """A call the head sampler dropped, for the call metrics (caller's thread: one append).
        Bounded by ``OTEL_GPU_QUEUE_SIZE``; beyond it the call is counted as not recorded."""
        if len(self.unsampled) < self.maxsize:
            self.unsampled.append((plan, duration_ns, failed))
        else:
            self.unsampled_dropped += 1

    @property
    def owns_provider(self) -> bool:
        """Whether spans go to otel-gpu's own provider (``OTEL_GPU_LOGDEST``), not the
        application's (whose processors decide what is kept)."""
        return self._own_provider is not None

    @property
    def _layouts(self) -> dict[Any, Any]:
        """The span builder's per-layout attribute cache (its size is bounded)."""
        return self.spans._layouts

    @property
    def counters(self) -> list[Any]:
        """otel-gpu's own destinations' exporters, each counting the spans it confirmed (the
        exit report and the metrics' summary read them)."""
        return self._counters

    def add_before_flush(self, hook: Callable[[float], Any]) -> None:
        """Call ``hook(timeout)`` at the start of every flush and at exit: it waits (within
        ``timeout`` seconds) for calls still on their way to :meth:`submit` (the level-5
        statistics reader, calls/stats_reader.py)."""
        self._before_flush.append(hook)

    def _calls_on_their_way(self, deadline: float) -> None:
        for hook in tuple(self._before_flush):
            try:
                hook(max(deadline - time.monotonic(), 0.0))
            except Exception as exc:
                self.report_internal("export", exc)

    def add_after_drain(self, hook: Callable[[], Any]) -> None:
        """Run ``hook`` on the export thread after each drain (every ~100 ms), e.g. a heartbeat."""
        self._after_drain_hooks.append(hook)

    def export_now(self, call: Call, timeout: float | None = None) -> None:
        """Build and export one record immediately, flushed (the stuck-call report: a watchdog
        may kill the process right after, so it must not wait in a batch)."""
        build = self.materialise_native if self.native else self.materialise
        self.processor.on_end(build(call))
        self.exported += 1
        self.taken += 1
        wait = self.settings.flush_timeout if timeout is None else timeout
        self.processor.force_flush(int(wait * 1000))

    # ------------------------------------------------------------------ hot path

    def submit(self, call: Call) -> None:
        """Queue a finished call. At a full queue, :meth:`_full` decides: help export, or drop."""
        queue = self.queue
        n = len(queue)
        if n < self.maxsize:
            queue.append(call)
            if n == _WAKE_AT:
                self._wake.set()
        else:
            self._full(call)

    def _full(self, call: Call) -> None:
        """The queue is full: export fell behind the caller (in a tight loop the export thread
        gets too few turns on the GIL).

        ``block`` (default): back-pressure, paid only now. The caller exports one chunk
        itself; when the export thread is exporting, it hands over after its current chunk.
        Every destination's ``on_end`` returns at once (a local
        file is written in the chunk; OTLP goes to the SDK's batch queue, which drops when a
        collector is down), so export always progresses. Should it stop progressing (a
        materialisation stuck in user code, a console nobody reads) for ``_STALL_AFTER``, the
        call is dropped and counted, and so are the next ones until export moves again.
        ``drop``: the call is dropped and counted.
        """
        if not self.block:
            self.dropped += 1
            return
        if self._drainer == threading.get_ident():
            # a span processor or exporter called a decorated function: export is this thread
            self.dropped += 1
            self.stalled += 1
            return
        try:
            # still stalled (export has not moved since): only a free export lock helps now
            room = self._make_room(wait=self._stalled_at != self.taken)
        except Exception as exc:
            self.report_internal("export", exc)
            room = len(self.queue) < self.maxsize
        if room:
            self.queue.append(call)
        else:
            self._stalled_at = self.taken
            self.dropped += 1
            self.stalled += 1

    def _make_room(self, wait: bool) -> bool:
        """Export one chunk on this thread; False when export is busy and (``wait``) made no
        progress for ``_STALL_AFTER`` s, or (not ``wait``) the export lock is taken."""
        lock = self._drain_lock
        if not lock.acquire(blocking=False):
            if not wait:
                return False
            # The export thread is draining: it hands over after its current chunk, and this
            # thread exports the next one. Measured cheaper than waiting for the export thread
            # to make room: no GIL hand-offs, and the records are still warm in the CPU cache.
            self._handover = True
            try:
                taken = self.taken
                while not lock.acquire(timeout=_STALL_AFTER):  # waits without the GIL
                    if self.taken == taken:
                        return False
                    taken = self.taken
            finally:
                self._handover = False
        try:
            self._drainer = threading.get_ident()
            # the batch writes only: a hook such as the watchdog's report (which may wait
            # on a collector to confirm) never runs inside the program's call
            self._export_chunk(None, ())
        finally:
            self._drainer = None
            lock.release()
        return True

    # ------------------------------------------------------------------ export thread

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(_WAKE_EVERY)
            self._wake.clear()
            self.drain(handover=True)

    def drain(self, deadline: float | None = None, handover: bool = False) -> None:
        """Materialise every queued call and hand the spans to the processors, a chunk at a time.

        ``handover`` (the export thread): stop after a chunk when a caller at a full queue
        asks to export the next one itself (:meth:`_make_room`)."""
        wait = -1.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self._drain_lock.acquire(timeout=wait):
            return  # the export thread is stuck in a span (e.g. a slow __repr__): don't wait on it
        try:
            self._drainer = threading.get_ident()
            while self._export_chunk(deadline, self._after_drain_hooks) and self.queue:
                if handover and self._handover:
                    break
        finally:
            self._drainer = None
            self._drain_lock.release()

    def _export_chunk(self, deadline: float | None, hooks: Sequence[Callable[[], Any]]) -> bool:
        """Build and hand over up to ``_EXPORT_CHUNK`` queued calls, write local destinations'
        batches, then run ``hooks``. False when ``deadline`` passed. Called with ``_drain_lock``
        held."""
        queue = self.queue
        build = self.materialise_native if self.native else self.materialise
        on_time = True
        if self.dropped != self._noted[0]:
            self._note_drops()
        spans: list[Any] = []
        append = spans.append
        metrics = self.metrics
        calls: list[Call] | None = [] if metrics is not None else None
        device = self.device_time  # device time: calls whose events still run wait beside the
        if device is not None:  # queue (devices/device_time.py); those now done come first
            device.release(queue)
        # Spans and the SDK encoders' objects (~100 GC-tracked per span) live only for a
        # chunk; with the collector on they get promoted and trigger full collections,
        # which in a torch process walk ~200k objects (100-300 ms each). Pause it per chunk
        # (OTEL_GPU_EXPORT_GC_PAUSE): halves the total cost per span at level 3.
        paused = self.settings.export_gc_pause and gc.isenabled()
        if paused:
            gc.disable()
        try:
            # inline loops, not a helper per span: a call per span costs more than the loop
            for _ in range(_EXPORT_CHUNK):
                if not queue:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    on_time = False
                    break
                call = queue.popleft()
                if call.device is not None and device is not None and device.hold(call):
                    continue
                self.taken += 1
                try:
                    append(build(call))
                    if call.device is not None and device is not None:
                        device.children(call, build, append)  # its `<name> [device]` span
                except Exception as exc:
                    self.report_internal("export", exc)
                    continue
                if calls is not None:
                    calls.append(call)
            failed = 0
            if self._span_ends:
                for span in spans:
                    try:
                        for on_end in self._span_ends:
                            on_end(span)
                    except Exception as exc:
                        failed += 1
                        self.report_internal("export", exc)
            for end in self._chunk_ends:
                try:
                    end(spans)
                except Exception as exc:
                    self.report_internal("export", exc)
            self.exported += len(spans) - failed
            if calls:
                try:
                    metrics.calls.record(calls)  # type: ignore[union-attr]
                except Exception as exc:
                    self.report_internal("metrics", exc)
            if metrics is not None and self.unsampled:
                try:
                    metrics.calls.record_unsampled(self.unsampled)
                except Exception as exc:
                    self.report_internal("metrics", exc)
            for hook in (*self._after_drain, *hooks):
                try:
                    hook()
                except Exception as exc:
                    self.report_internal("export", exc)
        finally:
            if paused:
                gc.enable()
        return on_time

    def _note_drops(self) -> None:
        """Drops since the last note become events on the next span built."""
        self.spans.notes.extend(drops.events(self.dropped, self.stalled, self._noted))
        self._noted = (self.dropped, self.stalled)

    def report_internal(self, kind: str, exc: BaseException) -> None:
        """An internal error on the export thread, logged once per kind; in strict mode kept
        for :meth:`flush` to raise (the test's thread, not the export thread)."""
        try:
            _guard.internal_error(kind, exc)
        except Exception as raised:  # strict mode: keep it for flush() to re-raise in the test
            self.errors.append(raised)

    # ------------------------------------------------------------------ flush and exit

    def flush(self, timeout: float | None = None) -> bool:
        """Export everything queued so far; True when the processors confirmed within ``timeout``."""
        timeout = self.settings.flush_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._before_flush:
            self._calls_on_their_way(deadline)
        self.drain(deadline)
        for observer in self.observers:  # e.g. the flight recorder's queued output files
            try:
                observer.flush(max(deadline - time.monotonic(), 0.0))
            except Exception as exc:
                self.report_internal("observer", exc)
        metrics = self.metrics

        def confirm() -> bool:
            try:
                ok = bool(
                    self.processor.force_flush(int(max(deadline - time.monotonic(), 0) * 1000))
                )
            except Exception as exc:
                _guard.logger.debug("otel-gpu flush failed: %s", exc)
                ok = False
            if metrics is not None:
                try:
                    ok = bool(metrics.flush(max(deadline - time.monotonic(), 0.0))) and ok
                except Exception as exc:
                    self.report_internal("metrics", exc)
            return ok

        # One thread bounds both, the spans' confirmation and then a metrics collection: a
        # thread of its own for each cost a flush another ~0.25 ms (start and join).
        ok = bounded_call(confirm, max(deadline - time.monotonic(), 0.0))
        if self.errors and _guard.is_strict():
            errors, self.errors = self.errors, []
            raise errors[0]
        return bool(ok) and not self.queue

    def _drain_while_progressing(self, window: float) -> None:
        """Build every queued call, as long as each ``window`` seconds builds at least one: a
        100k-call level-5 run left 15% of its spans unbuilt within a fixed 3 s. Each window runs
        on a helper thread, so a span stuck in a slow ``__repr__`` ends the wait, not the exit."""
        window = max(window, 0.5)
        while self.queue:
            before = self.taken
            end = time.monotonic() + window
            bounded_call(functools.partial(self.drain, end), window)
            if self.taken == before:
                return

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the export thread and close otel-gpu's own provider, after a flush: bounded by
        ``timeout`` seconds when given or when ``OTEL_GPU_FLUSH_TIMEOUT`` was set; otherwise every
        queued call is built while export progresses, then the destinations get the timeout."""
        if self._stopped:
            return
        bounded = timeout is not None or self.settings.flush_timeout_explicit
        timeout = self.settings.flush_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._before_flush:  # calls still on their way come into the queue first
            self._calls_on_their_way(deadline)
        self._stopped = True
        self._wake.set()
        if bounded:  # the user chose a bound: what is not built within it is dropped, counted
            # On a helper thread: a span whose materialisation blocks must not hold exit.
            bounded_call(lambda: self.drain(deadline), max(deadline - time.monotonic(), 0.0))
        else:  # the default loses nothing: build all, then give the destinations their time
            self._drain_while_progressing(timeout)
            deadline = time.monotonic() + timeout
        for observer in self.observers:
            try:
                observer.close()
            except Exception as exc:
                self.report_internal("observer", exc)
        if self.unsampled_dropped:
            _guard.logger.warning(
                "otel-gpu call metrics: %d call(s) the head sampler dropped were not counted: the "
                "export thread fell OTEL_GPU_QUEUE_SIZE=%d such calls behind",
                self.unsampled_dropped,
                self.maxsize,
            )
        if self.metrics is not None:  # before the console destinations close: its table
            try:
                self.metrics.shutdown(max(deadline - time.monotonic(), 0.0))
            except Exception as exc:
                self.report_internal("metrics", exc)
        if self._own_provider is not None:
            provider = self._own_provider
            bounded_call(provider.shutdown, max(deadline - time.monotonic(), 0.0))
        else:
            bounded_call(
                lambda: self.processor.force_flush(int(max(deadline - time.monotonic(), 0) * 1000)),
                max(deadline - time.monotonic(), 0.0),
            )
        drops.report_lost(
            self.settings,
            self.dropped,
            self.stalled,
            # never built in time: still queued, or taken but not handed over (failed, or stuck
            # in a slow __repr__ on the export thread)
            len(self.queue) + max(self.taken - self.exported, 0),
            self.exported,
            self._counters,
            timeout,
        )


# ---------------------------------------------------------------------- process-wide pipeline

_lock = threading.Lock()
_pipeline: Pipeline | None = None
_FAILED: Any = object()  # the pipeline could not be built; calls run uninstrumented until reset()
_explicit_provider: Any = None
_building: int | None = None  # the thread building the pipeline, whose calls pass through


def get() -> Pipeline | None:
    """The process's pipeline, created on first use from the settings then in force.

    None if it could not be built (an internal error, reported once): calls then run uninstrumented.
    """
    global _pipeline, _building
    pipe = _pipeline
    if pipe is None:
        if _building == threading.get_ident():
            # building the pipeline called an instrumented function (resource detection, an
            # exporter): it runs as it is, not as a span waiting for the pipeline it builds
            return None
        from otel_gpu import config

        with _lock:
            if _pipeline is None:
                _building = threading.get_ident()
                try:
                    _describe_exceptions()
                    _pipeline = Pipeline(config.current(), _explicit_provider)
                except config.ConfigError as exc:  # a standard variable the SDK would choke on
                    _pipeline = _FAILED
                    if _guard.is_strict():
                        raise
                    _guard.logger.warning("otel-gpu records nothing in this process: %s", exc)
                except Exception as exc:
                    _pipeline = _FAILED
                    _guard.internal_error("pipeline", exc)
                finally:
                    _building = None
            pipe = _pipeline
    return None if pipe is _FAILED else pipe


def _describe_exceptions() -> None:
    """Spans format a call's exception with the calls' describer, which bounds the time a user
    ``__str__`` may take on the export thread. Only decorated calls reach a pipeline, so the
    calls layer (and torch) is already imported when one is built."""
    from otel_gpu.calls import describe

    _spans.describe_exceptions_with(describe.exception_text)


def defer_export() -> None:
    """Let the export thread wake only when flushed, not on its timer or a full batch: for
    ``otel-gpu bench``'s workers, which measure what the caller pays alone and flush after the
    loop. Never for a program: its queue would fill."""
    global _WAKE_EVERY, _WAKE_AT
    _WAKE_EVERY = None
    _WAKE_AT = -1


def current() -> Pipeline | None:
    """The process's pipeline if one is built (never builds one)."""
    return None if _pipeline is _FAILED else _pipeline


# the calls layer (wrappers, compiled calls, CUDA graph replays) finds the pipeline through the core
sink.install(current, get)


def set_tracer_provider(provider: Any) -> None:
    global _explicit_provider
    _explicit_provider = provider


def reset(timeout: float | None = None) -> None:
    """Flush and drop the pipeline, so that the next call builds one from the current settings."""
    global _pipeline
    with _lock:
        pipe, _pipeline = _pipeline, None
    if pipe is not None and pipe is not _FAILED:
        pipe.shutdown(timeout)


def shutdown() -> None:
    """Interpreter exit: every queued span built (or within ``OTEL_GPU_FLUSH_TIMEOUT`` if set)."""
    pipe = current()
    if pipe is not None and pipe.pid == os.getpid():
        pipe.shutdown()


def _after_fork_in_child() -> None:
    # The parent's export thread and queued calls stay with the parent, which exports
    # them; the child builds its own pipeline (and files, via %i) on its first call.
    global _pipeline, _lock, _building
    _pipeline = None
    _lock = threading.Lock()
    _building = None


os.register_at_fork(after_in_child=_after_fork_in_child)

try:  # runs before atexit handlers, so before an SDK provider's own atexit shutdown
    threading._register_atexit(shutdown)  # type: ignore[attr-defined]
except Exception:  # pragma: no cover - interpreter already shutting down
    import atexit

    atexit.register(shutdown)
