"""otel-gpu's own aggregation of the call metrics (``metrics/aggregation.py``), against the SDK
instruments it replaces on otel-gpu's own provider: the same calls give the same points, value
for value, read through the official in-memory reader as the oracle."""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics._internal import instrument as sdk_instrument
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.trace import SpanContext, TraceFlags

import otel_gpu
from otel_gpu.attributes import CODE_FUNCTION_NAME
from otel_gpu.core.record import Call, CallSpan
from otel_gpu.export import pipeline
from otel_gpu.metrics import aggregation, exporter, names
from otel_gpu.metrics.aggregation import CallAggregation
from otel_gpu.metrics.calls import DEVICE_DURATION, CallMetrics

DELTA, CUMULATIVE = AggregationTemporality.DELTA, AggregationTemporality.CUMULATIVE


class _Plan:
    """The part of a plan the call metrics read (hashable by identity, as plans are)."""

    def __init__(self, name: str, level: int = 1) -> None:
        self.name = name
        self.level = level
        self.attributes = {CODE_FUNCTION_NAME: name}


F, G, H = _Plan("lib.f"), _Plan("lib.g"), _Plan("lib.h", level=5)
H1 = _Plan("lib.h", level=1)  # the same name at level 1 (another module, or switched live)


def _call(
    plan: _Plan,
    ns: int,
    span_id: int,
    exc: BaseException | None = None,
    sampled: bool = True,
    device: float | None = None,
    nonfinite: bool | None = None,
) -> Call:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    span = CallSpan(SpanContext(0xABC + span_id, span_id, False, flags), plan.name)
    call = Call(plan, span, None, 0)  # type: ignore[arg-type]
    call.end_ns = ns
    call.exc = exc
    if device is not None:
        call.span.set_attributes({DEVICE_DURATION: device})
    if nonfinite is not None:
        call.stats = [SimpleNamespace(nonfinite=nonfinite)]
    return call


def _chunks() -> list[tuple[list[Call], list[tuple[Any, int, Any]]]]:
    """Two collection intervals of calls: every bucket edge, failures of two types, device time,
    NaN checks at level 5 (and a plan of the same name below it), and calls the head sampler
    dropped (a call record is always a sampled span: an unsampled call gets none)."""
    edges = [int(b * 1e9) for b in names.DURATION_BUCKETS]
    first = [_call(F, ns, i + 1) for i, ns in enumerate(edges)]  # exactly on each boundary
    first += [_call(F, ns + 1, 100 + i) for i, ns in enumerate(edges)]  # just above it
    first += [
        _call(F, 20_000_000_000, 200),  # above the last bound: the overflow bucket
        _call(G, 3_000, 201, exc=KeyError("k")),
        _call(G, 7_000, 202, exc=ValueError("v")),
        _call(G, 8_000, 203, exc=KeyError("k"), device=0.002),
        _call(F, 4_000, 204, device=0.0005),
        _call(H, 12_000, 206, nonfinite=False),
        _call(H, 13_000, 207, nonfinite=True),
        _call(H, 14_000, 208, exc=RuntimeError("r"), nonfinite=True),
        _call(H1, 16_000, 209, nonfinite=True),  # not checked at its level: not counted
    ]
    unsampled_first = [(F, 2_500, None), (G, 9_000, KeyError), (H, 30_000, None)]
    second = [
        _call(F, 6_000, 300),
        _call(F, 6_100, 301, device=0.0001),
        _call(H, 15_000, 302, nonfinite=False),
    ]
    return [(first, unsampled_first), (second, [(G, 1_000, ValueError)])]


def _normal(data: Any) -> dict[str, Any]:
    """Each metric's description, unit, kind and points, without the times (the two paths read
    the clock at different instants): histogram fields and exemplars, or counter values."""
    out: dict[str, Any] = {}
    for metric in data:
        kind = type(metric.data).__name__
        points = {}
        for p in metric.data.data_points:
            key = tuple(sorted(p.attributes.items()))
            if kind == "Histogram":
                points[key] = (
                    p.count,
                    p.sum,
                    tuple(p.bucket_counts),
                    tuple(p.explicit_bounds),
                    p.min,
                    p.max,
                    [(e.value, e.span_id, e.trace_id, e.filtered_attributes) for e in p.exemplars],
                )
            else:
                points[key] = (p.value, [e.value for e in p.exemplars])
        out[metric.name] = (
            metric.description,
            metric.unit,
            kind,
            metric.data.aggregation_temporality,
            getattr(metric.data, "is_monotonic", None),
            points,
        )
    return out


def _sdk_metrics(data: Any) -> list[Any]:
    return [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]


@pytest.mark.parametrize("temporality", [CUMULATIVE, DELTA], ids=["cumulative", "delta"])
def test_same_points_as_the_sdk_instruments(temporality):
    """For the same calls, in two collection intervals, otel-gpu's aggregation gives exactly the
    points of the SDK instruments read by the official in-memory reader: every histogram's
    count, sum, buckets, min, max and exemplars (the span of the last sampled call per bucket),
    every counter's value, the names, units, descriptions and temporality; a delta collection
    holds only the series measured since the previous one."""
    reader = InMemoryMetricReader(
        preferred_temporality={Histogram: temporality, Counter: temporality}
    )
    sdk = CallMetrics(MeterProvider(metric_readers=[reader]).get_meter(names.METER), None)  # type: ignore[arg-type]
    ours = CallAggregation(exemplars=True)
    view = ours.collection(temporality)
    collections = []
    for calls, unsampled in _chunks():
        for metrics in (sdk, ours):
            metrics.record(calls)
            metrics.record_unsampled(deque(unsampled))
        expected = _normal(_sdk_metrics(reader.get_metrics_data()))
        got = _normal(ours.collect(view))
        assert got == expected
        collections.append(got)
    first, second = collections
    duration = names.CALL_DURATION.name
    f_point = ((CODE_FUNCTION_NAME, "lib.f"),)
    assert first[duration][5][f_point][0] == 2 * len(names.DURATION_BUCKETS) + 3
    assert second[duration][5][f_point][0] == (2 if temporality is DELTA else 49)
    # a series without calls in the second interval: in a cumulative collection only
    g_key = ((CODE_FUNCTION_NAME, "lib.g"), ("error.type", "KeyError"))
    assert (g_key in second[duration][5]) is (temporality is CUMULATIVE)
    assert second[names.CALL_NONFINITE.name][5][((CODE_FUNCTION_NAME, "lib.h"),)][0] == (
        0 if temporality is DELTA else 2
    )


def test_exemplars_are_those_since_the_last_collection():
    """As the SDK's reservoir, a cumulative point carries the exemplars of its last interval
    only; with ``OTEL_METRICS_EXEMPLAR_FILTER=always_off`` there are none."""
    ours = CallAggregation(exemplars=True)
    view = ours.collection(CUMULATIVE)
    ours.record([_call(F, 4_000, 1)])
    [first] = ours.collect(view)[0].data.data_points
    assert [e.span_id for e in first.exemplars] == [1]
    ours.record_unsampled(deque([(F, 4_000, None)]))
    [second] = ours.collect(view)[0].data.data_points
    assert second.count == 2 and second.exemplars == []

    off = CallAggregation(exemplars=False)
    view = off.collection(CUMULATIVE)
    off.record([_call(F, 4_000, 1)])
    [point] = off.collect(view)[0].data.data_points
    assert point.count == 1 and point.exemplars == []


def test_an_unsampled_span_never_names_the_bucket():
    """A call record is a sampled span by construction; should one not be, its bucket shows no
    exemplar rather than one the trace-based filter would not have kept."""
    ours = CallAggregation(exemplars=True)
    view = ours.collection(CUMULATIVE)
    ours.record([_call(F, 4_000, 1), _call(F, 4_500, 2, sampled=False), _call(F, 40_000, 3)])
    [point] = ours.collect(view)[0].data.data_points
    assert point.count == 3 and [e.span_id for e in point.exemplars] == [3]


def test_two_readers_each_see_every_call_once():
    """Two readers (two destinations): each collection of either gives the other the calls
    too, so a delta reader and a cumulative reader both count every call exactly once."""
    ours = CallAggregation(exemplars=True)
    cumulative, delta = ours.collection(CUMULATIVE), ours.collection(DELTA)
    counts = []
    for n in (3, 2):
        ours.record([_call(F, 4_000, i + 1) for i in range(n)])
        ours.collect(cumulative)
        ours.record([_call(F, 5_000, 10)])
        counts.append([ours.collect(v)[0].data.data_points[0].count for v in (cumulative, delta)])
    assert counts == [[4, 4], [7, 3]]


def test_record_device_learnt_after_the_span():
    """``record_device`` adds a device time learnt after the span was built, with the failed
    call's ``error.type`` and its span as exemplar, as the SDK path does."""
    ours = CallAggregation(exemplars=True)
    view = ours.collection(CUMULATIVE)
    call = _call(G, 1_000, 0x44, exc=KeyError("k"))
    ours.record_device(call, 0.25)
    [device] = [m for m in ours.collect(view) if m.name == names.CALL_DEVICE_DURATION.name]
    [point] = device.data.data_points
    assert dict(point.attributes) == {CODE_FUNCTION_NAME: "lib.g", "error.type": "KeyError"}
    assert point.count == 1 and [e.span_id for e in point.exemplars] == [0x44]


def test_series_beyond_the_cardinality_limit_overflow_as_in_the_sdk(monkeypatch):
    """Past the SDK's limit of distinct attribute sets, calls go to one more series with
    ``otel.metric.overflow=true``: counted, not lost, and the series stay bounded."""
    monkeypatch.setattr(aggregation, "_CARDINALITY_LIMIT", 4)
    ours = CallAggregation(exemplars=False)
    view = ours.collection(CUMULATIVE)
    ours.record([_call(_Plan(f"lib.f{i}"), 1_000, i + 1) for i in range(10)])
    [duration, calls] = ours.collect(view)
    points = {tuple(p.attributes.items()): p.count for p in duration.data.data_points}
    assert len(points) == 5 and points[(("otel.metric.overflow", True),)] == 6
    assert sum(p.value for p in calls.data.data_points) == 10


def test_exporter_preferences_decide_the_path():
    """otel-gpu aggregates where the exporter asks for explicit buckets (its default) and one
    temporality for histograms and counters; an exponential histogram or a mixed temporality
    keeps the SDK instruments."""
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation

    def made(temporality: dict[type, Any], aggregation: dict[type, Any]) -> Any:
        return SimpleNamespace(
            _preferred_temporality=temporality, _preferred_aggregation=aggregation
        )

    assert exporter.aggregates(made({}, {}))
    assert exporter.aggregates(made({Histogram: DELTA, Counter: DELTA}, {}))
    assert exporter.temporality(made({Histogram: DELTA, Counter: DELTA}, {})) is DELTA
    assert not exporter.aggregates(made({Histogram: DELTA}, {}))
    assert not exporter.aggregates(made({}, {Histogram: ExponentialBucketHistogramAggregation()}))


def _read(path: Path) -> list[dict[str, Any]]:
    """Each collection of a metrics file: its ``otel_gpu`` scope's metrics by name."""
    out = []
    for line in path.read_text().splitlines():
        for rm in json.loads(line)["resourceMetrics"]:
            for sm in rm["scopeMetrics"]:
                if sm["scope"]["name"] == names.METER:
                    out.append({m["name"]: m for m in sm["metrics"]})
    return out


def _count_sdk_instrument_calls(monkeypatch) -> list[str]:
    seen: list[str] = []
    for cls, method in ((sdk_instrument._Histogram, "record"), (sdk_instrument._Counter, "add")):
        original = getattr(cls, method)

        def counting(self, *args, _original=original, _name=f"{cls.__name__}.{method}", **kw):
            seen.append(_name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(cls, method, counting)
    return seen


def test_own_provider_makes_no_sdk_instrument_call_per_span(module_factory, tmp_path, monkeypatch):
    """On otel-gpu's own provider no call reaches an SDK instrument (``Histogram.record``,
    ``Counter.add``), yet the file holds every call with its exemplars."""
    seen = _count_sdk_instrument_calls(monkeypatch)
    otel_gpu.configure(level=1, dest=str(tmp_path / "s.jsonl"), metrics=True)
    lib = module_factory("import otel_gpu\n\n@otel_gpu.api\ndef f(x):\n    return x\n")
    for _ in range(50):
        lib.f(1)
    assert otel_gpu.flush(timeout=10)
    pipe = pipeline.get()
    assert pipe is not None and isinstance(pipe.metrics.calls, CallAggregation)
    assert seen == []
    duration = _read(tmp_path / "s.metrics.jsonl")[-1]["otel_gpu.call.duration"]
    [point] = duration["histogram"]["dataPoints"]
    assert int(point["count"]) == 50 and point["exemplars"]


def test_always_on_exemplar_filter_keeps_the_sdk_instruments(module_factory, tmp_path, monkeypatch):
    """``OTEL_METRICS_EXEMPLAR_FILTER=always_on`` samples counters too, which otel-gpu does not
    reproduce: the SDK instruments record the calls, as before."""
    monkeypatch.setenv("OTEL_METRICS_EXEMPLAR_FILTER", "always_on")
    seen = _count_sdk_instrument_calls(monkeypatch)
    otel_gpu.configure(level=1, dest=str(tmp_path / "s.jsonl"), metrics=True)
    lib = module_factory("import otel_gpu\n\n@otel_gpu.api\ndef f(x):\n    return x\n")
    for _ in range(3):
        lib.f(1)
    assert otel_gpu.flush(timeout=10)
    assert isinstance(pipeline.get().metrics.calls, CallMetrics)  # type: ignore[union-attr]
    assert seen.count("_Histogram.record") == 3


def test_delta_temporality_preference_is_honoured(module_factory, tmp_path, monkeypatch):
    """``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE=delta``: the file's call metrics are
    delta, and a second collection holds only the calls made since the first."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
    otel_gpu.configure(level=1, dest=str(tmp_path / "s.jsonl"), metrics=True)
    lib = module_factory("import otel_gpu\n\n@otel_gpu.api\ndef f(x):\n    return x\n")
    for n in (4, 3):
        for _ in range(n):
            lib.f(1)
        assert otel_gpu.flush(timeout=10)
    first, second = _read(tmp_path / "s.metrics.jsonl")[-2:]
    for collection, n in ((first, 4), (second, 3)):
        duration = collection["otel_gpu.call.duration"]["histogram"]
        assert duration["aggregationTemporality"] == 1  # AGGREGATION_TEMPORALITY_DELTA
        assert int(duration["dataPoints"][0]["count"]) == n
        calls = collection["otel_gpu.calls"]["sum"]
        assert calls["isMonotonic"] and int(calls["dataPoints"][0]["asInt"]) == n


def test_exponential_histogram_preference_keeps_the_sdk_instruments(
    module_factory, tmp_path, monkeypatch
):
    """An exporter asking for exponential histograms
    (``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION``) gets them, from the SDK."""
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION",
        "base2_exponential_bucket_histogram",
    )
    otel_gpu.configure(level=1, dest=str(tmp_path / "s.jsonl"), metrics=True)
    lib = module_factory("import otel_gpu\n\n@otel_gpu.api\ndef f(x):\n    return x\n")
    lib.f(1)
    assert otel_gpu.flush(timeout=10)
    duration = _read(tmp_path / "s.metrics.jsonl")[-1]["otel_gpu.call.duration"]
    assert "exponentialHistogram" in duration


def test_forked_child_can_take_the_aggregation_lock():
    """A fork while the export thread holds the aggregation's lock does not leave the child's
    copy locked."""
    ours = CallAggregation(exemplars=True)
    with ours._lock:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if ours._lock.acquire(timeout=5) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_failure_adding_the_call_metrics_still_exports_the_rest(monkeypatch):
    """An internal error while adding the call metrics is reported once and the collection the
    SDK made (GPU gauges, otel-gpu's own counters) is exported all the same."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from otel_gpu import _guard

    class Recording(MetricExporter):
        def __init__(self) -> None:
            super().__init__()
            self.got: list[Any] = []

        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            self.got.append(metrics_data)
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            pass

    inner = Recording()
    ours = CallAggregation(exemplars=True)
    wrapper = exporter.CallMetricsExporter(inner, ours, InstrumentationScope(names.METER))
    monkeypatch.setattr(ours, "collect", lambda view: 1 / 0)
    monkeypatch.setattr(_guard, "_strict", False)
    data = MetricsData(resource_metrics=[])
    assert wrapper.export(data) is MetricExportResult.SUCCESS
    assert inner.got == [data]


@pytest.mark.parametrize(
    ("taken_first", "spans_taken", "advised"),
    [(False, True, 1), (True, True, 0), (False, False, 0)],
)
def test_an_otlp_endpoint_that_refuses_the_metrics_is_told_how_to_turn_them_off(
    taken_first, spans_taken, advised, caplog
):
    """Metrics are on by default, so a traces-only backend refuses them: a failed export to an
    OTLP endpoint that took otel-gpu's spans but never a collection logs one warning naming
    OTEL_METRICS_EXPORTER=none (and no more however many fail); an endpoint that took a
    collection before is only failing for now, and one that took no span either is down or
    unreachable (the spans report that): no such advice."""
    import logging

    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from otel_gpu import _guard

    class Refusing(MetricExporter):
        results = [MetricExportResult.SUCCESS] if taken_first else []

        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            return self.results.pop(0) if self.results else MetricExportResult.FAILURE

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            pass

    _guard._seen.discard("metrics.refused")
    wrapper = exporter.CallMetricsExporter(
        Refusing(),
        CallAggregation(exemplars=True),
        InstrumentationScope(names.METER),
        spans_taken=lambda: spans_taken,
    )
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        for _ in range(3):
            wrapper.export(MetricsData(resource_metrics=[]))
    advice = [r for r in caplog.records if "OTEL_METRICS_EXPORTER=none" in r.getMessage()]
    assert len(advice) == advised
