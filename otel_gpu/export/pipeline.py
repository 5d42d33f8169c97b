"""Deferred materialisation: call records in, finished spans out, off the caller's thread.

The caller's thread appends a :class:`~otel_gpu.calls.record.Call` to a bounded deque and
returns. An export thread wakes every 100 ms (or sooner when the queue fills),
turns each record into a finished span and hands it to the target TracerProvider's
span processors (``on_end``). An application's provider gets SDK ``ReadableSpan`` objects,
so every standard processor and exporter works unchanged; otel-gpu's own provider
with the native encoders (``OTEL_GPU_ENCODER=native``) gets ``SpanData``, the same
span without the SDK's per-attribute validation, which only its own exporters read.

The target provider is resolved on the first call (see ``OTEL_GPU_PROVIDER``):
the application's global SDK provider, one given to :func:`otel_gpu.configure`,
or otel-gpu's own provider with the ``OTEL_GPU_LOGDEST`` destinations.
"""

from __future__ import annotations

import collections
import gc
import os
import threading
import time
from collections.abc import Callable
from itertools import islice
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_gpu import _guard, attributes
from otel_gpu.attributes import (
    ATTRIBUTES_OMITTED,
    EVENT_EXCEPTION,
    EVENT_STATS,
    EVENTS_OMITTED,
    EXCEPTION_MESSAGE,
    INPUT_PREFIX,
    NONFINITE,
    OUTPUT_PREFIX,
)
from otel_gpu.calls import metadata, stats
from otel_gpu.calls.record import Call, exception_attributes
from otel_gpu.config import Settings
from otel_gpu.export import observers as _observers
from otel_gpu.exporters.spandata import SpanData

if TYPE_CHECKING:
    from otel_gpu.export.observers import Observer
    from otel_gpu.exporters.console import ConsoleSpanExporter
    from otel_gpu.recorder.ring import Ring

__all__ = ["Pipeline", "get", "reset", "shutdown"]

_WAKE_EVERY = 0.1  # seconds; batching amortises the export thread's wake-ups and GIL grabs
_WAKE_AT = 1024  # queued calls that wake the export thread early, to bound memory
_EXPORT_CHUNK = 64  # spans per export; bounds how long drain() keeps the collector paused
# keys (and prefixes) whose values the export thread writes per call
_PER_CALL_KEYS = (
    INPUT_PREFIX,
    OUTPUT_PREFIX,
    NONFINITE,
    EVENTS_OMITTED,
    ATTRIBUTES_OMITTED,
)

try:
    from importlib.metadata import version as _pkg_version

    _VERSION = _pkg_version("otel-gpu")
except Exception:
    _VERSION = "0.0.0"

SCOPE = InstrumentationScope(attributes.SCOPE, _VERSION)
_UNSET = Status(StatusCode.UNSET)


class Pipeline:
    """One process's path from call records to span processors."""

    def __init__(self, settings: Settings, tracer_provider: Any = None) -> None:
        self.settings = settings
        self.queue: collections.deque[Call] = collections.deque()
        self.maxsize = settings.queue_size
        self.dropped = 0
        self.exported = 0  # spans handed to the processors
        self.taken = 0  # calls taken off the queue (taken - exported: failed or still being built)
        self.pid = os.getpid()
        self.observers: tuple[Observer, ...] = ()
        self.observers_at: dict[int, tuple[Observer, ...]] = {}
        # otel-gpu's own console destinations, which print a call's inputs before it runs
        self.consoles: tuple[ConsoleSpanExporter, ...] = ()
        self.root_sampler: Callable[[int, str], bool] | None = None
        self.ring: Ring | None = None  # the in-memory ring, when OTEL_GPU_RING is on
        self.errors: list[BaseException] = []
        self._wake = threading.Event()
        self._drain_lock = threading.Lock()
        self._stopped = False
        self._own_provider: SdkTracerProvider | None = None
        self._after_drain: list[Any] = []
        self._counters: list[Any] = []  # own destinations' exporters, counting confirmed spans
        self.native = False  # the processors take SpanData (own provider, native encoders)
        self._heads: dict[Any, int] = {}  # plan -> leading attributes shared by its spans
        self._resolve(tracer_provider)
        self._thread = threading.Thread(target=self._run, name="otel-gpu-export", daemon=True)
        self._thread.start()
        if settings.journal and settings.recover_on_start:
            self._start_recovery()

    def _start_recovery(self) -> None:
        """``OTEL_GPU_RECOVER_ON_START``: recover dead processes' journals into this pipeline's
        processor, in the background, now that it exists."""
        try:
            from otel_gpu.journal import writer

            writer.start_recovery(self.settings, self)
        except Exception as exc:
            _guard.internal_error("journal", exc)

    # ------------------------------------------------------------------ set-up

    def _resolve(self, explicit: Any) -> None:
        provider = explicit
        mode = self.settings.provider
        if provider is None and mode in ("auto", "global"):
            candidate = trace.get_tracer_provider()
            if hasattr(candidate, "_active_span_processor"):
                provider = candidate
            elif mode == "global":
                _guard.warn_once(
                    "provider.global",
                    "OTEL_GPU_PROVIDER=global but the application has not set an SDK "
                    "TracerProvider (found %s); using otel-gpu's own provider with OTEL_GPU_LOGDEST",
                    type(candidate).__name__,
                )
        if provider is not None and not hasattr(provider, "_active_span_processor"):
            _guard.warn_once(
                "provider.unsupported",
                "otel-gpu cannot feed spans to %s (not an OpenTelemetry SDK TracerProvider); "
                "using its own provider with OTEL_GPU_LOGDEST",
                type(provider).__name__,
            )
            provider = None
        if provider is None:
            from otel_gpu.exporters import destinations

            own = destinations.build_provider(self.settings)
            provider, self._after_drain, self.consoles = (
                own.provider,
                own.after_drain,
                own.consoles,
            )
            self._counters = own.exporters
            self._own_provider = provider
            self.native = own.spandata
        built = _observers.build(self.settings, self)
        self.observers, self.ring = built.observers, built.ring
        # A function keeps the level it was decorated at; observers run only for levels they serve.
        self.observers_at = _observers.by_level(self.observers)
        self.provider = provider
        self.processor = provider._active_span_processor
        self.resource = _HashedResource(provider.resource)
        limits = getattr(provider, "_span_limits", None) or SpanLimits()
        self.max_attributes = limits.max_span_attributes
        self.max_events = limits.max_events
        # never above Tempo's 2048 default cut, also for attributes users set on the call's span
        self.max_value_len = min(limits.max_span_attribute_length or 2048, 2048)
        self.root_sampler = _root_sampler(getattr(provider, "sampler", None))

    def add_after_drain(self, hook: Callable[[], Any]) -> None:
        """Run ``hook`` on the export thread after each drain (every ~100 ms), e.g. a heartbeat."""
        self._after_drain.append(hook)

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
        """Queue a finished call. Never blocks; counts the call as dropped when the queue is full."""
        queue = self.queue
        n = len(queue)
        if n < self.maxsize:
            queue.append(call)
            if n == _WAKE_AT:
                self._wake.set()
        else:
            self.dropped += 1

    # ------------------------------------------------------------------ export thread

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(_WAKE_EVERY)
            self._wake.clear()
            self.drain()

    def drain(self, deadline: float | None = None) -> None:
        """Materialise every queued call and hand the spans to the processors, a chunk at a time."""
        wait = -1.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self._drain_lock.acquire(timeout=wait):
            return  # the export thread is stuck in a span (e.g. a slow __repr__): don't wait on it
        try:
            queue = self.queue
            on_end = self.processor.on_end
            build = self.materialise_native if self.native else self.materialise
            late = False
            while True:
                # Spans and the SDK encoders' objects (~100 GC-tracked per span) live only for a
                # chunk; with the collector on they get promoted and trigger full collections,
                # which in a torch process walk ~200k objects (100-300 ms each). Pause it per chunk
                # (OTEL_GPU_EXPORT_GC_PAUSE): halves the total cost per span at level 3.
                paused = self.settings.export_gc_pause and gc.isenabled()
                if paused:
                    gc.disable()
                try:
                    for _ in range(_EXPORT_CHUNK):
                        if not queue:
                            break
                        if deadline is not None and time.monotonic() > deadline:
                            late = True
                            break
                        call = queue.popleft()
                        self.taken += 1
                        try:
                            on_end(build(call))
                            self.exported += 1
                        except Exception as exc:
                            self._internal("export", exc)
                    for hook in self._after_drain:
                        try:
                            hook()
                        except Exception as exc:
                            self._internal("export", exc)
                finally:
                    if paused:
                        gc.enable()
                if late or not queue:
                    break
        finally:
            self._drain_lock.release()

    def _internal(self, kind: str, exc: Exception) -> None:
        try:
            _guard.internal_error(kind, exc)
        except Exception as raised:  # strict mode: keep it for flush() to re-raise in the test
            self.errors.append(raised)

    def materialise(self, call: Call) -> ReadableSpan:
        """Build the SDK span of one call record."""
        span = call.span
        attrs, events, status = self._contents(call)
        return ReadableSpan(
            name=span.name,
            context=span.get_span_context(),
            parent=call.parent,
            resource=self.resource,
            attributes=self._bounded(attrs),
            events=events,
            links=span.links or (),
            kind=SpanKind.INTERNAL,
            status=status,
            start_time=call.start_ns,
            end_time=call.end_ns,
            instrumentation_scope=SCOPE,
        )

    def materialise_native(self, call: Call) -> SpanData:
        """The same span as :meth:`materialise`, as ``SpanData`` for otel-gpu's own encoders.

        ``BoundedAttributes`` validates every value through ABC ``isinstance`` checks
        (15–40 µs a span); here one exact-type pass proves the values need no cleaning,
        and only spans that do (long strings, unusual types, bad keys) take the SDK's path.
        """
        plan = call.plan
        span = call.span
        attrs, events, status = self._contents(call)
        n = self._heads.get(plan)
        if n is None:
            n = self._head_of(plan)
        limit = self.max_attributes
        # The plan's attributes lead every span of the plan unchanged unless something was put
        # before them (the events-omitted count) or a user attribute overwrote one of them.
        head = (
            n > 0
            and next(iter(attrs)) == next(iter(plan.attributes))
            and not (span.attributes and not span.attributes.keys().isdisjoint(plan.attributes))
        )
        if limit is not None and len(attrs) > limit:
            attrs = self._summarised(attrs, limit)
        dropped = 0
        # the plan's own attributes, when they lead unchanged, were checked once per plan
        if limit == 0 or _needs_cleaning(attrs, self.max_value_len, n if head else 0):
            bounded = BoundedAttributes(
                limit, attrs, immutable=True, max_value_len=self.max_value_len
            )
            attrs, dropped, head = bounded._dict, bounded.dropped, False
        return SpanData(
            span.name,
            span.get_span_context(),
            call.parent,
            call.start_ns,
            call.end_ns,
            attrs,
            events,
            span.links or (),
            status,
            self.resource,
            SCOPE,
            fixed=(plan, n) if head else None,
            dropped_attributes=dropped,
        )

    def _head_of(self, plan: Any) -> int:
        """How many leading attributes every span of ``plan`` shares (the ``fixed`` hint), or 0.

        0 when a count limit could cut them, the SDK would clean them, or a key is one the
        pipeline writes per call (a decorator's ``attributes=`` may name any key).
        """
        n = len(plan.attributes)
        limit = self.max_attributes
        if (
            (limit is not None and limit <= n)
            or any(type(k) is not str or k.startswith(_PER_CALL_KEYS) for k in plan.attributes)
            or _needs_cleaning(plan.attributes, self.max_value_len)
        ):
            n = 0
        if len(self._heads) >= 4096:  # decorating in a loop must not grow this without bound
            self._heads.clear()
        self._heads[plan] = n
        return n

    def _contents(self, call: Call) -> tuple[dict[str, Any], list[Event], Status]:
        """A call's attributes (before limits), events (event limit applied) and status."""
        plan = call.plan
        span = call.span
        limit = self.settings.repr_limit
        # Order matters when the attribute count limit cuts: what a query keys on comes first.
        attrs: dict[str, Any] = dict(plan.attributes)
        events: list[Event] = []
        if call.stats:
            nonfinite = False
            for result in call.stats:
                events.append(Event(EVENT_STATS, stats.event_attributes(result), call.end_ns))
                nonfinite = nonfinite or result.nonfinite
            if nonfinite:
                attrs[NONFINITE] = True
        if span.attributes:
            attrs.update(span.attributes)
        if call.inputs:
            metadata.to_attributes(INPUT_PREFIX, call.inputs, limit, attrs)
        if call.outputs:
            metadata.to_attributes(OUTPUT_PREFIX, call.outputs, limit, attrs)
        if span.events:
            events.extend(Event(name, a, ts) for name, a, ts in span.events)
        status = span.status or _UNSET
        if call.exc is not None:
            exc = call.exc
            exc_attrs = exception_attributes(exc, call.tb, off_thread=True)
            events.append(Event(EVENT_EXCEPTION, exc_attrs, call.end_ns))
            status = Status(
                StatusCode.ERROR, f"{type(exc).__name__}: {exc_attrs[EXCEPTION_MESSAGE]}"[:limit]
            )
        if self.max_events is not None and len(events) > self.max_events:
            # keep the exception event (last) and count what the event limit cuts
            tail = events[-1:] if call.exc is not None else []
            body = events[: len(events) - len(tail)]
            keep = self.max_events - len(tail)
            attrs = {EVENTS_OMITTED: len(body) - keep, **attrs}
            events = body[:keep] + tail
        return attrs, events, status

    def _bounded(self, attrs: dict[str, Any]) -> BoundedAttributes:
        """Stay within the provider's attribute count limit: summarise, never drop silently."""
        limit = self.max_attributes
        if limit is not None and len(attrs) > limit:
            attrs = self._summarised(attrs, limit)
        return BoundedAttributes(limit, attrs, immutable=True, max_value_len=self.max_value_len)

    @staticmethod
    def _summarised(attrs: dict[str, Any], limit: int) -> dict[str, Any]:
        """The first ``limit - 1`` attributes and one naming the keys the count limit cut."""
        items = list(attrs.items())
        kept = dict(items[: limit - 1])
        omitted = [k for k, _ in items[limit - 1 :]]
        summary = (
            f"{len(omitted)} attributes omitted (attribute count limit {limit}): "
            + ", ".join(omitted)
        )
        kept[ATTRIBUTES_OMITTED] = metadata._truncate(summary, metadata.MAX_VALUE_BYTES)
        return kept

    # ------------------------------------------------------------------ flush and exit

    def flush(self, timeout: float | None = None) -> bool:
        """Export everything queued so far; True when the processors confirmed within ``timeout``."""
        timeout = self.settings.flush_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self.drain(deadline)
        for observer in self.observers:  # e.g. the flight recorder's queued output files
            try:
                observer.flush(max(deadline - time.monotonic(), 0.0))
            except Exception as exc:
                self._internal("observer", exc)
        ok = _bounded_call(
            lambda: self.processor.force_flush(int(max(deadline - time.monotonic(), 0) * 1000)),
            max(deadline - time.monotonic(), 0.0),
        )
        if self.errors and _guard.is_strict():
            errors, self.errors = self.errors, []
            raise errors[0]
        return bool(ok) and not self.queue

    def shutdown(self, timeout: float | None = None) -> None:
        """Flush within ``timeout`` seconds, stop the export thread, close otel-gpu's own provider."""
        if self._stopped:
            return
        timeout = self.settings.flush_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._stopped = True
        self._wake.set()
        # On a helper thread: a span whose materialisation blocks must not hold exit.
        _bounded_call(lambda: self.drain(deadline), max(deadline - time.monotonic(), 0.0))
        for observer in self.observers:
            try:
                observer.close()
            except Exception as exc:
                self._internal("observer", exc)
        if self._own_provider is not None:
            provider = self._own_provider
            _bounded_call(provider.shutdown, max(deadline - time.monotonic(), 0.0))
        else:
            _bounded_call(
                lambda: self.processor.force_flush(int(max(deadline - time.monotonic(), 0) * 1000)),
                max(deadline - time.monotonic(), 0.0),
            )
        # never built in time: still queued, or taken but not handed over (failed, or stuck in a
        # slow __repr__ on the export thread)
        unexported = len(self.queue) + max(self.taken - self.exported, 0)
        # Spans handed to a destination that it never confirmed (refused, failed to write,
        # timed out, dropped by its own queue, abandoned at exit); each destination got every
        # span, report the worst. Of those, ``failed`` ones failed outright (e.g. a full disk).
        worst = max(self._counters, key=lambda c: self.exported - c.confirmed, default=None)
        unconfirmed = max(self.exported - worst.confirmed, 0) if worst is not None else 0
        failed = min(getattr(worst, "failed", 0), unconfirmed) if worst is not None else 0
        lost = self.dropped + unexported + unconfirmed
        if lost:
            _guard.logger.warning(
                "otel-gpu dropped %d span(s): %d because the queue was full (OTEL_GPU_QUEUE_SIZE=%d), "
                "%d not built within OTEL_GPU_FLUSH_TIMEOUT=%ss at exit or failed, %d not confirmed by a "
                "destination (%d refused or not written, e.g. a full disk; %d not within that time)",
                lost,
                self.dropped,
                self.maxsize,
                unexported,
                timeout,
                unconfirmed,
                failed,
                unconfirmed - failed,
            )


def _needs_cleaning(attrs: dict[str, Any], max_len: int | None, skip: int = 0) -> bool:
    """Whether ``BoundedAttributes`` might change ``attrs`` after the first ``skip`` (known clean):
    a key that is not a non-empty str, a string longer than ``max_len``, or a value other than a
    str/bool/int/float or a list or tuple of one of them. Exact types: a subclass takes the SDK's
    path, which knows what to do."""
    if skip >= len(attrs):
        return False
    for k, v in islice(attrs.items(), skip, None) if skip else attrs.items():
        if type(k) is not str or not k:
            return True
        t = type(v)
        if t is str:
            if max_len is not None and len(v) > max_len:
                return True
        elif t is int or t is float or t is bool:
            continue
        elif t is list or t is tuple:
            if not v:
                continue
            t0 = type(v[0])  # one element type: older SDKs drop mixed sequences
            if t0 is str:
                for x in v:
                    if type(x) is not str or (max_len is not None and len(x) > max_len):
                        return True
            elif t0 is int or t0 is float or t0 is bool:
                for x in v:
                    if type(x) is not t0:
                        return True
            else:
                return True
        else:
            return True
    return False


class _HashedResource(Resource):
    """The provider's resource, hashed once.

    Exporters group spans by resource, and the SDK's ``Resource.__hash__`` serialises every
    attribute to JSON on each call: ~30 µs a span with the GPU resource attributes.
    """

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


def _root_sampler(sampler: Any) -> Callable[[int, str], bool] | None:
    """The decision for calls with no parent; None means always sample (the default, and fastest).

    Calls with a parent follow the parent's sampled flag, as ParentBased samplers do.
    """
    root = sampler._root if isinstance(sampler, ParentBased) else sampler
    if root is None or root is ALWAYS_ON:
        return None
    if root is ALWAYS_OFF:
        return lambda trace_id, name: False
    return lambda trace_id, name: root.should_sample(None, trace_id, name).decision.is_sampled()


def _bounded_call(fn: Callable[[], Any], timeout: float) -> Any:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` s: exit must never hang on a network."""
    result: list[Any] = []

    def target() -> None:
        try:
            result.append(fn())
        except Exception as exc:
            _guard.logger.debug("otel-gpu flush failed: %s", exc)

    worker = threading.Thread(target=target, name="otel-gpu-flush", daemon=True)
    worker.start()
    worker.join(timeout)
    return result[0] if result else None


# ---------------------------------------------------------------------- process-wide pipeline

_lock = threading.Lock()
_pipeline: Pipeline | None = None
_FAILED: Any = object()  # the pipeline could not be built; calls run uninstrumented until reset()
_explicit_provider: Any = None


def get() -> Pipeline | None:
    """The process's pipeline, created on first use from the settings then in force.

    None if it could not be built (an internal error, reported once): calls then run uninstrumented.
    """
    global _pipeline
    pipe = _pipeline
    if pipe is None:
        from otel_gpu import config

        with _lock:
            if _pipeline is None:
                try:
                    _pipeline = Pipeline(config.current(), _explicit_provider)
                except config.ConfigError as exc:  # a standard variable the SDK would choke on
                    _pipeline = _FAILED
                    if _guard.is_strict():
                        raise
                    _guard.logger.warning("otel-gpu records nothing in this process: %s", exc)
                except Exception as exc:
                    _pipeline = _FAILED
                    _guard.internal_error("pipeline", exc)
            pipe = _pipeline
    return None if pipe is _FAILED else pipe


def current() -> Pipeline | None:
    return None if _pipeline is _FAILED else _pipeline


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
    """Interpreter exit: flush within ``OTEL_GPU_FLUSH_TIMEOUT``."""
    pipe = current()
    if pipe is not None and pipe.pid == os.getpid():
        pipe.shutdown()


def _after_fork_in_child() -> None:
    # The parent's export thread and queued calls stay with the parent, which exports
    # them; the child builds its own pipeline (and files, via %i) on its first call.
    global _pipeline, _lock
    _pipeline = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)

try:  # runs before atexit handlers, so before an SDK provider's own atexit shutdown
    threading._register_atexit(shutdown)  # type: ignore[attr-defined]
except Exception:  # pragma: no cover - interpreter already shutting down
    import atexit

    atexit.register(shutdown)
