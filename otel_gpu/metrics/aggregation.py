"""The call metrics aggregated by otel-gpu itself, for its own ``MeterProvider``.

The SDK's ``Histogram.record`` costs 10–13 µs a measurement (measurement consumer, attribute
hashing, exemplar filter and reservoir), which doubled a level-1 call's total CPU. On the export
thread, the calls of a chunk are aggregated here instead, in plain slots: per series (function,
and ``error.type`` for failed calls) the explicit-bucket counts over ``DURATION_BUCKETS``, sum,
count, min and max, and the exemplar the SDK's ``AlignedHistogramBucketExemplarReservoir`` would
keep (the last measurement per bucket, with the span's ids when the exemplar filter keeps it):
well under a microsecond a call, no SDK call.

At each collection, :meth:`CallAggregation.collect` turns them into the SDK's own point objects
(``HistogramDataPoint``, ``NumberDataPoint``), with the names, units, descriptions, attributes,
boundaries and temporality the SDK instruments of :mod:`otel_gpu.metrics.calls` would have
given; :mod:`otel_gpu.metrics.exporter` adds them to the ``MetricsData`` of otel-gpu's provider
before the official exporter encodes it. The counters (``otel_gpu.calls``,
``otel_gpu.call.errors``) are the histogram's counts summed per function and per failed series:
the same calls, so the same values. ``otel_gpu.call.nonfinite`` is counted beside them.

Where this does not apply (the spans go to the application's provider, whose views and readers
decide; an exporter preferring another histogram aggregation; ``OTEL_METRICS_EXEMPLAR_FILTER=
always_on``), :mod:`otel_gpu.metrics.calls` records through SDK instruments, at their cost.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.metrics import Exemplar
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    NumberDataPoint,
    Sum,
)

from otel_gpu.metrics.calls import device_seconds, error_type
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
    from otel_gpu.core.record import Call

__all__ = ["CallAggregation", "Collection"]

_MAX_PLANS = 4096  # plans remembered; decorating in a loop must not grow the cache
_CARDINALITY_LIMIT = 2000  # the SDK's default: distinct attribute sets per instrument
_OVERFLOW = {"otel.metric.overflow": True}  # the SDK's attributes of the overflow series
_BOUNDS = DURATION_BUCKETS
_BUCKETS = len(_BOUNDS) + 1
_INF = math.inf


class _Series:
    """One histogram series: the measurements since the last collection (of any reader)."""

    __slots__ = ("attrs", "born_ns", "counts", "exemplars", "failed", "max", "min", "sum")

    def __init__(self, attrs: dict[str, Any], failed: bool) -> None:
        self.attrs = attrs
        """The point's attributes: ``code.function.name``, and ``error.type`` when failed."""
        self.failed = failed
        """A series of failed calls: also counted in ``otel_gpu.call.errors``."""
        self.born_ns = time.time_ns()  # a cumulative point's start before any collection
        self.counts = [0] * _BUCKETS
        self.sum = 0.0
        self.min = _INF
        self.max = -_INF
        self.exemplars: list[Any] = [None] * _BUCKETS
        """Per bucket, the last kept call (a device duration: ``(value, call)``), or None."""


class _Name:
    """A function name's series and NaN/Inf counts, shared by every plan that has the name."""

    __slots__ = ("attrs", "checked", "device", "nonfinite", "ok")

    def __init__(self, attrs: dict[str, Any], ok: _Series, device: _Series) -> None:
        self.attrs = attrs  # {code.function.name: ...}: the counters' attributes
        self.ok = ok  # the host durations of its calls that returned
        self.device = device  # their device durations
        self.checked = 0  # calls checked for NaN/Inf since the last collection
        self.nonfinite = 0  # of which held one


class _Function:
    """What a plan maps to: its name's series, and whether its calls are checked for NaN/Inf
    (a plan's own level: two plans of one name may differ, as an SDK instrument sees them)."""

    __slots__ = ("attrs", "checks", "device", "name", "ok")

    def __init__(self, name: _Name, checks: bool) -> None:
        self.name = name
        self.attrs = name.attrs
        self.ok = name.ok  # copied from the name: one attribute read a call, not two
        self.device = name.device
        self.checks = checks  # decorated at level >= 5


class _Sums:
    """One series as a reader has it: cumulative, or since its last collection (delta)."""

    __slots__ = ("count", "counts", "exemplars", "max", "min", "start_ns", "sum")

    def __init__(self, start_ns: int) -> None:
        self.start_ns = start_ns
        self.counts = [0] * _BUCKETS
        self.count = 0
        self.sum: float = 0
        self.min = _INF
        self.max = -_INF
        self.exemplars: list[Any] = [None] * _BUCKETS


class Collection:
    """One reader's view of the call metrics, in the temporality its exporter prefers.

    Every collection of any reader takes the measurements since the previous one and adds them
    to every reader's view (:meth:`CallAggregation.collect`), so two readers each see every call
    once, as with two SDK readers. A cumulative view keeps its sums; a delta view starts them
    again at each of its collections.
    """

    def __init__(self, temporality: AggregationTemporality) -> None:
        self.temporality = temporality
        self.last_ns = 0  # the previous collection's time: a new series starts there
        self.series: dict[_Series, _Sums] = {}  # host durations
        self.device: dict[_Series, _Sums] = {}
        self.nonfinite: dict[_Name, list[int]] = {}  # [start_ns, calls that held NaN/Inf]


_AGGREGATIONS: weakref.WeakSet[CallAggregation] = weakref.WeakSet()


class CallAggregation:
    """The call metrics of otel-gpu's own provider: recorded by the export thread, collected by
    the readers' threads. Same interface as :class:`otel_gpu.metrics.calls.CallMetrics`."""

    def __init__(self, exemplars: bool) -> None:
        self.exemplars = exemplars  # the trace-based filter (else always_off: none)
        self._lock = threading.Lock()
        self._plans: dict[Any, _Function] = {}
        self._names: dict[str, _Name] = {}  # a plan cache reset keeps the series of a name
        self._failed: dict[tuple[str, type], _Series] = {}
        self._failed_device: dict[tuple[str, type], _Series] = {}
        self._series: list[_Series] = []  # every host series, in creation order
        self._device: list[_Series] = []
        self._overflow: tuple[_Series, _Series] | None = None
        self._collections: list[Collection] = []
        _AGGREGATIONS.add(self)

    def collection(self, temporality: AggregationTemporality) -> Collection:
        """A view for one more reader (before the first call is recorded)."""
        view = Collection(temporality)
        with self._lock:
            self._collections.append(view)
        return view

    # ---- recording (export thread)

    def _new(self, attrs: dict[str, Any], failed: bool, device: bool) -> _Series:
        series = self._device if device else self._series
        if len(series) >= _CARDINALITY_LIMIT:  # as the SDK: one overflow series beyond the limit
            if self._overflow is None:
                self._overflow = (_Series(_OVERFLOW, False), _Series(_OVERFLOW, False))
                self._series.append(self._overflow[0])
                self._device.append(self._overflow[1])
            return self._overflow[1 if device else 0]
        made = _Series(attrs, failed)
        series.append(made)
        return made

    def _plan(self, plan: Any) -> _Function:
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        name = plan.attributes.get(FUNCTION)
        name = name if isinstance(name, str) else str(plan.name)
        shared = self._names.get(name)
        if shared is None:
            attrs = {FUNCTION: name}
            shared = self._names[name] = _Name(
                attrs, self._new(attrs, False, False), self._new(attrs, False, True)
            )
        entry = self._plans[plan] = _Function(shared, getattr(plan, "level", 0) >= 5)
        return entry

    def _error(self, function: _Function, cls: type, device: bool = False) -> _Series:
        """The series of ``function``'s calls that raised ``cls``."""
        failed = self._failed_device if device else self._failed
        name = function.attrs[FUNCTION]
        series = failed.get((name, cls))
        if series is None:
            attrs = {FUNCTION: name, ERROR_TYPE: error_type(cls)}
            series = failed[(name, cls)] = self._new(attrs, True, device)
        return series

    def record(self, calls: Sequence[Call]) -> None:
        """Aggregate a chunk of calls whose spans were just built (export thread).

        A call record is a sampled span by construction (an unsampled call gets none,
        calls/lifecycle.py), so the trace-based filter would keep each: the bucket keeps the
        call itself, and its span's ids are read at collection (:func:`_exemplar`), not per call.
        """
        plans = self._plans
        bounds = _BOUNDS
        keep = self.exemplars
        with self._lock:  # one acquisition per chunk, not per call
            for call in calls:
                function = plans.get(call.plan) or self._plan(call.plan)
                exc = call.exc
                series = function.ok if exc is None else self._error(function, type(exc))
                value = (call.end_ns - call.start_ns) / 1e9
                i = bisect_left(bounds, value)
                series.counts[i] += 1  # the count is their sum, taken at collection
                series.sum += value
                if value < series.min:
                    series.min = value
                if value > series.max:
                    series.max = value
                if keep:
                    series.exemplars[i] = call
                if function.checks:
                    counts = function.name
                    counts.checked += 1
                    if call.stats and any(r.nonfinite for r in call.stats):
                        counts.nonfinite += 1
                extra = call.attributes  # the span's (the record is its span): None for most
                if extra:
                    seconds = device_seconds(extra)
                    if seconds is not None:
                        self._device_one(function, call, seconds)

    def _device_one(self, function: _Function, call: Call, value: float) -> None:
        exc = call.exc
        series = function.device if exc is None else self._error(function, type(exc), True)
        i = bisect_left(_BOUNDS, value)
        series.counts[i] += 1
        series.sum += value
        series.min = min(series.min, value)
        series.max = max(series.max, value)
        if self.exemplars:
            series.exemplars[i] = (value, call)

    def record_device(self, call: Call, seconds: float) -> None:
        """The device time of a call whose span is already counted (export thread), for a
        resolver that learns it after the span was built; exemplar as in :meth:`record`."""
        with self._lock:
            function = self._plans.get(call.plan) or self._plan(call.plan)
            self._device_one(function, call, seconds)

    def record_unsampled(self, queue: deque[tuple[Any, int, Any]]) -> None:
        """The calls the head sampler dropped, taken off ``queue`` (export thread): histogram
        and counters only, as these calls have no span (no exemplar, no NaN check)."""
        plans = self._plans
        with self._lock:
            for _ in range(len(queue)):
                plan, duration_ns, cls = queue.popleft()
                function = plans.get(plan) or self._plan(plan)
                series = function.ok if cls is None else self._error(function, cls)
                value = duration_ns / 1e9
                series.counts[bisect_left(_BOUNDS, value)] += 1
                series.sum += value
                if value < series.min:
                    series.min = value
                if value > series.max:
                    series.max = value

    # ---- collection (a reader's thread)

    def collect(self, view: Collection) -> list[Metric]:
        """The call metrics for ``view``'s reader now: the measurements since any reader's last
        collection go to every view, then ``view``'s points are built (and, for a delta view,
        its interval starts again)."""
        now = time.time_ns()
        with self._lock:
            for every, which in ((self._series, "series"), (self._device, "device")):
                for s in every:
                    if s.max != -_INF:  # measured since the last collection
                        self._take(s, which)
            for counts in self._names.values():
                if counts.checked:
                    for other in self._collections:
                        row = other.nonfinite.get(counts)
                        if row is None:
                            row = other.nonfinite[counts] = [other.last_ns or now, 0]
                        row[1] += counts.nonfinite
                    counts.checked = counts.nonfinite = 0
            metrics = _points(view, now)
            view.last_ns = now
            if view.temporality is AggregationTemporality.DELTA:
                view.series, view.device, view.nonfinite = {}, {}, {}
            else:  # the exemplars are those since the reader's last collection, as the SDK's
                for rows in (view.series, view.device):
                    for kept in rows.values():
                        kept.exemplars = [None] * _BUCKETS
        return metrics

    def _take(self, s: _Series, which: str) -> None:
        """Move ``s``'s interval into every view's sums, and start a new interval."""
        for view in self._collections:
            rows: dict[_Series, _Sums] = getattr(view, which)
            sums = rows.get(s)
            if sums is None:
                sums = rows[s] = _Sums(view.last_ns or s.born_ns)
            counts = sums.counts
            for i, n in enumerate(s.counts):
                if n:
                    counts[i] += n
            sums.count += sum(s.counts)
            sums.sum = s.sum + sums.sum  # the SDK's order of addition: equal floats
            sums.min = min(s.min, sums.min)
            sums.max = max(s.max, sums.max)
            for i, exemplar in enumerate(s.exemplars):
                if exemplar is not None:
                    sums.exemplars[i] = exemplar
        s.counts = [0] * _BUCKETS
        s.sum = 0.0
        s.min = _INF
        s.max = -_INF
        s.exemplars = [None] * _BUCKETS


def _points(view: Collection, now: int) -> list[Metric]:
    """``view``'s metrics, in the SDK instruments' order. A delta view holds only the series
    measured since its last collection; a metric without points is left out, as the SDK leaves
    out an instrument without measurements."""
    temporality = view.temporality
    out: list[Metric] = []
    for metric, rows in ((CALL_DURATION, view.series), (CALL_DEVICE_DURATION, view.device)):
        histogram = [_histogram_point(s, sums, now) for s, sums in rows.items()]
        if histogram:
            data = Histogram(data_points=histogram, aggregation_temporality=temporality)
            out.append(Metric(metric.name, metric.description, metric.unit, data))
    # The counters count the host histogram's calls: per function, and per failed series.
    calls: dict[Any, list[Any]] = {}  # function (None: overflow) -> [attrs, start, calls]
    errors: list[NumberDataPoint] = []
    for s, sums in view.series.items():
        name = s.attrs.get(FUNCTION)
        row = calls.get(name)
        if row is None:
            attrs = _OVERFLOW if name is None else {FUNCTION: name}
            calls[name] = [attrs, sums.start_ns, sums.count]
        else:
            row[1] = min(row[1], sums.start_ns)
            row[2] += sums.count
        if s.failed:
            errors.append(_number(s.attrs, sums.start_ns, now, sums.count))
    nonfinite = [_number(f.attrs, start, now, n) for f, (start, n) in view.nonfinite.items()]
    for metric, points in (
        (CALLS, [_number(attrs, start, now, n) for attrs, start, n in calls.values()]),
        (CALL_ERRORS, errors),
        (CALL_NONFINITE, nonfinite),
    ):
        if points:
            total = Sum(data_points=points, aggregation_temporality=temporality, is_monotonic=True)
            out.append(Metric(metric.name, metric.description, metric.unit, total))
    return out


def _histogram_point(s: _Series, sums: _Sums, now: int) -> HistogramDataPoint:
    return HistogramDataPoint(
        attributes=s.attrs,
        start_time_unix_nano=sums.start_ns,
        time_unix_nano=now,
        count=sums.count,
        sum=sums.sum,
        bucket_counts=tuple(sums.counts),
        explicit_bounds=_BOUNDS,
        min=sums.min,
        max=sums.max,
        exemplars=[e for e in map(_exemplar, sums.exemplars) if e is not None],
    )


def _exemplar(kept: Any) -> Exemplar | None:
    """The exemplar of a bucket's last call (a device duration: ``(value, call)``), with its
    span's ids; none for a span that is not sampled, which the trace-based filter would not have
    kept (a call record never is one: the bucket then shows none rather than a wrong call)."""
    if kept is None:
        return None
    if type(kept) is tuple:
        value, call = kept
    else:
        call = kept
        value = (call.end_ns - call.start_ns) / 1e9  # the value recorded, computed as then
    ctx = call.span.get_span_context()
    if not ctx.trace_flags.sampled:
        return None
    # the call's end: when its duration was measured (the SDK stamps when record() ran)
    return Exemplar({}, value, call.end_ns, ctx.span_id, ctx.trace_id)


def _number(attrs: dict[str, Any], start_ns: int, now: int, value: int) -> NumberDataPoint:
    return NumberDataPoint(
        attributes=attrs, start_time_unix_nano=start_ns, time_unix_nano=now, value=value
    )


def _after_fork_in_child() -> None:
    # A fork while the export thread held the lock must not leave the child's copy locked.
    for aggregation in list(_AGGREGATIONS):
        aggregation._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
