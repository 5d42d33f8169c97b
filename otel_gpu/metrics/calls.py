"""The call metrics, recorded from call records on the export thread.

The caller's thread does nothing for them: the export thread, which turns each queued call into
a span, hands the same chunk of calls to :meth:`CallMetrics.record` after the spans. So a call is
in the metrics exactly when its span was built: the histogram's count equals the spans of the
function. Each duration is recorded with the call's span as its context, so the SDK's exemplar
filter (``trace_based`` by default: sampled spans) keeps the trace and span ids on the bucket's
exemplar, and a latency spike on a dashboard links to the span that caused it.

The counters are summed per chunk (one ``add`` per function and chunk, not per call); the
histogram takes one ``record`` per call, which the exemplars need.

A call whose span carries its device time (``otel_gpu.device.duration``, set on the call's span
before the span is built) is also recorded in the device histogram, with the same attributes
and exemplar; a resolver that learns it later calls :meth:`CallMetrics.record_device`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, set_span_in_context

from otel_gpu.metrics.names import (
    CALL_DEVICE_DURATION,
    CALL_DURATION,
    CALL_ERRORS,
    CALL_NONFINITE,
    CALLS,
    DURATION_BUCKETS,
    ERROR_TYPE,
    FUNCTION,
)

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter

    from otel_gpu.config import Settings
    from otel_gpu.core.record import Call

__all__ = ["CallMetrics", "error_type"]

_MAX_KEYS = 4096  # plans and error types remembered; decorating in a loop must not grow them


def error_type(cls: type) -> str:
    """``error.type`` of an exception class: its ``<module>.<qualname>``, as ``exception.type``
    on the span (builtins and ``__main__`` by the qualname alone)."""
    module = cls.__module__
    return (
        cls.__qualname__ if module in ("builtins", "__main__") else f"{module}.{cls.__qualname__}"
    )


class CallMetrics:
    """The instruments of the call metrics, and the per-function attribute sets they reuse."""

    def __init__(self, meter: Meter, settings: Settings) -> None:
        self.meter = meter
        self.duration = meter.create_histogram(
            CALL_DURATION.name,
            unit=CALL_DURATION.unit,
            description=CALL_DURATION.description,
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
        )
        # Beside the host histogram, same attributes and buckets: recorded for a call whose span
        # carries its device time (resolved before the span is built, see record())
        self.device_duration = meter.create_histogram(
            CALL_DEVICE_DURATION.name,
            unit=CALL_DEVICE_DURATION.unit,
            description=CALL_DEVICE_DURATION.description,
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
        )
        self.calls = meter.create_counter(
            CALLS.name, unit=CALLS.unit, description=CALLS.description
        )
        self.errors = meter.create_counter(
            CALL_ERRORS.name, unit=CALL_ERRORS.unit, description=CALL_ERRORS.description
        )
        # Created with the first function decorated at level >= 5: below it NaN/Inf is not
        # checked, and a zero would claim it was.
        self.nonfinite: Any = None
        self._function: dict[Any, tuple[dict[str, str], bool]] = {}  # plan -> (attrs, checks)
        self._failed: dict[tuple[str, type], dict[str, str]] = {}  # (function, class) -> attrs

    def _plan(self, plan: Any) -> tuple[dict[str, str], bool]:
        if len(self._function) >= _MAX_KEYS:
            self._function.clear()
        name = plan.attributes.get(FUNCTION)
        attrs = {FUNCTION: name if isinstance(name, str) else str(plan.name)}
        checks = getattr(plan, "level", 0) >= 5
        if checks and self.nonfinite is None:
            self.nonfinite = self.meter.create_counter(
                CALL_NONFINITE.name,
                unit=CALL_NONFINITE.unit,
                description=CALL_NONFINITE.description,
            )
        self._function[plan] = entry = (attrs, checks)
        return entry

    def _error(self, attrs: dict[str, str], cls: type) -> dict[str, str]:
        """The point attributes of a call of ``attrs``'s function that raised ``cls``."""
        function = attrs[FUNCTION]
        point = self._failed.get((function, cls))
        if point is None:
            if len(self._failed) >= _MAX_KEYS:
                self._failed.clear()
            point = {FUNCTION: function, ERROR_TYPE: error_type(cls)}
            self._failed[(function, cls)] = point
        return point

    def record(self, calls: Sequence[Call]) -> None:
        """Record a chunk of calls whose spans were just built (export thread)."""
        record = self.duration.record
        functions = self._function
        tally = _Tally()
        for call in calls:
            plan = call.plan
            attrs, checks = functions.get(plan) or self._plan(plan)
            exc = call.exc
            point = attrs if exc is None else self._error(attrs, type(exc))
            tally.add(attrs, point)
            if checks:
                nonfinite = bool(call.stats) and any(r.nonfinite for r in call.stats)
                tally.checked(attrs, nonfinite)
            context = set_span_in_context(NonRecordingSpan(call.span.get_span_context()), _EMPTY)
            record((call.end_ns - call.start_ns) / 1e9, point, context=context)
            extra = call.span.attributes  # None for most calls: one read per call
            if extra:
                seconds = device_seconds(extra)
                if seconds is not None:
                    self.device_duration.record(seconds, point, context=context)
        tally.flush(self)

    def record_device(self, call: Call, seconds: float) -> None:
        """Record the device time of a call whose span is already counted (export thread), for
        a resolver that learns it after the span was built; exemplar as in :meth:`record`."""
        attrs = (self._function.get(call.plan) or self._plan(call.plan))[0]
        point = attrs if call.exc is None else self._error(attrs, type(call.exc))
        context = set_span_in_context(NonRecordingSpan(call.span.get_span_context()), _EMPTY)
        self.device_duration.record(seconds, point, context=context)

    def record_unsampled(self, queue: deque[tuple[Any, int, Any]]) -> None:
        """Record the calls the head sampler dropped, taken off ``queue`` (export thread): the
        histogram and counters only, as these calls have no span (no exemplar, no NaN check)."""
        record = self.duration.record
        functions = self._function
        tally = _Tally()
        for _ in range(len(queue)):
            plan, duration_ns, cls = queue.popleft()
            attrs = (functions.get(plan) or self._plan(plan))[0]
            point = attrs if cls is None else self._error(attrs, cls)
            tally.add(attrs, point)
            record(duration_ns / 1e9, point, context=_EMPTY)
        tally.flush(self)


DEVICE_DURATION = "otel_gpu.device.duration"  # the span's device time, seconds (a float)


def device_seconds(attrs: Mapping[str, Any]) -> float | None:
    """A span's ``otel_gpu.device.duration`` when it is a finite number of seconds ≥ 0, else
    None (an unresolved span has none)."""
    value = attrs.get(DEVICE_DURATION)
    if (type(value) is float or type(value) is int) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


class _Tally:
    """One chunk's counter increments, summed per attribute set: one ``add`` each at the end."""

    __slots__ = ("calls", "failed", "nonfinite")

    def __init__(self) -> None:
        # id(attrs) -> [attrs, n]: attribute dicts are cached per function, so ids are stable
        self.calls: dict[int, list[Any]] = {}
        self.failed: dict[int, list[Any]] = {}
        self.nonfinite: dict[int, list[Any]] = {}

    @staticmethod
    def _bump(rows: dict[int, list[Any]], attrs: dict[str, str], n: int) -> None:
        row = rows.get(id(attrs))
        if row is None:
            rows[id(attrs)] = [attrs, n]
        else:
            row[1] += n

    def add(self, attrs: dict[str, str], point: dict[str, str]) -> None:
        """A call of ``attrs``'s function; ``point`` differs from ``attrs`` when it raised."""
        self._bump(self.calls, attrs, 1)
        if point is not attrs:
            self._bump(self.failed, point, 1)

    def checked(self, attrs: dict[str, str], nonfinite: bool) -> None:
        """A call checked for NaN/Inf (level >= 5): a zero is a point too."""
        self._bump(self.nonfinite, attrs, int(nonfinite))

    def flush(self, metrics: CallMetrics) -> None:
        for attrs, n in self.calls.values():
            metrics.calls.add(n, attrs)
        for attrs, n in self.failed.values():
            metrics.errors.add(n, attrs)
        for attrs, n in self.nonfinite.values():
            metrics.nonfinite.add(n, attrs)


_EMPTY = Context()
