"""The official metric exporters, with otel-gpu's own call metrics added to each export.

otel-gpu's own ``MeterProvider`` collects the GPU gauges and otel-gpu's own counters as usual;
:class:`CallMetricsExporter` sits between its ``PeriodicExportingMetricReader`` and the official
exporter (OTLP, or the JSON Lines file) and adds the call metrics aggregated on the export thread
(:mod:`otel_gpu.metrics.aggregation`) to the ``MetricsData``, under the same resource and in
otel-gpu's instrumentation scope, before the official exporter encodes it. So the encoding, the
protocol, retries and the exporter's preferred temporality stay the official ones.

:func:`aggregates` says when this applies: only where the exporter asks for what the SDK
instruments would have produced and otel-gpu reproduces (explicit buckets, one temporality for
histograms and counters, the trace-based or no exemplar filter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.metrics import Counter, Histogram
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.view import DefaultAggregation, ExplicitBucketHistogramAggregation
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_gpu import _guard
from otel_gpu.metrics.aggregation import CallAggregation, Collection

__all__ = ["CallMetricsExporter", "aggregates", "inject", "temporality"]

_CUMULATIVE = AggregationTemporality.CUMULATIVE


def temporality(exporter: Any) -> AggregationTemporality | None:
    """The temporality ``exporter`` prefers for the call metrics, or None where the histogram's
    and the counters' differ (otel-gpu's aggregation derives the counters from the histogram)."""
    preferred = getattr(exporter, "_preferred_temporality", None) or {}
    histograms = preferred.get(Histogram, _CUMULATIVE)
    return histograms if preferred.get(Counter, _CUMULATIVE) is histograms else None


def aggregates(exporter: Any) -> bool:
    """Whether otel-gpu's own aggregation reproduces what ``exporter`` would get from SDK
    instruments: explicit-bucket histograms with the advisory boundaries (the default), and one
    temporality for histograms and counters."""
    preferred = getattr(exporter, "_preferred_aggregation", None) or {}
    aggregation = preferred.get(Histogram, DefaultAggregation())
    if type(aggregation) is ExplicitBucketHistogramAggregation:
        explicit = getattr(aggregation, "_boundaries", None) is None  # else its own boundaries
    else:
        explicit = type(aggregation) is DefaultAggregation
    return explicit and temporality(exporter) is not None


def inject(
    data: MetricsData | None, points: list[Any], scope: InstrumentationScope, resource: Any
) -> MetricsData | None:
    """``data`` with ``points`` (the call metrics) first in ``scope``'s metrics, as the SDK
    orders its instruments (the call metrics are created first)."""
    if not points:
        return data
    if data is None or not data.resource_metrics:
        return MetricsData([ResourceMetrics(resource, [ScopeMetrics(scope, points, "")], "")])
    first, *rest = data.resource_metrics
    scopes = list(first.scope_metrics)
    for i, sm in enumerate(scopes):
        if sm.scope == scope:
            scopes[i] = ScopeMetrics(sm.scope, [*points, *sm.metrics], sm.schema_url)
            break
    else:
        scopes.insert(0, ScopeMetrics(scope, points, scope.schema_url or ""))
    return MetricsData([ResourceMetrics(first.resource, scopes, first.schema_url), *rest])


class CallMetricsExporter(MetricExporter):
    """An official metric exporter, fed otel-gpu's call metrics with each export."""

    def __init__(
        self,
        exporter: MetricExporter,
        calls: CallAggregation,
        scope: InstrumentationScope,
        spans_taken: Callable[[], bool] | None = None,
    ) -> None:
        # the reader reads these two to choose its temporality and aggregation: the official
        # exporter's, so the SDK's own metrics are collected as they would be without us
        super().__init__(exporter._preferred_temporality, exporter._preferred_aggregation)
        self.exporter = exporter
        self.scope = scope
        self.view: Collection = calls.collection(temporality(exporter) or _CUMULATIVE)
        self._calls = calls
        # an OTLP endpoint that took otel-gpu's spans but never a collection is a traces-only
        # backend (metrics are on by default): say once how to turn them off, beside the SDK's
        # error; one that took no span either is down or unreachable, which the spans report
        self._spans_taken = spans_taken
        self._taken = False

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        data = metrics_data
        try:
            resource = data.resource_metrics[0].resource if data.resource_metrics else None
            data = inject(data, self._calls.collect(self.view), self.scope, resource) or data
        except Exception as exc:  # the SDK's own metrics are exported all the same
            _guard.internal_error("metrics", exc)
        result = self.exporter.export(data, timeout_millis=timeout_millis, **kwargs)
        if result is MetricExportResult.SUCCESS:
            self._taken = True
        elif not self._taken and self._spans_taken is not None and self._spans_taken():
            _guard.warn_once(
                "metrics.refused",
                "otel-gpu: the OTLP endpoint took otel-gpu's spans but not its metrics (on by "
                "default, docs/metrics.md); a backend that takes traces only (Jaeger, Tempo or "
                "Phoenix without a collector in front) refuses them: set "
                "OTEL_METRICS_EXPORTER=none, or OTEL_GPU_METRICS=false, there",
            )
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return bool(self.exporter.force_flush(timeout_millis=timeout_millis))

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.exporter.shutdown(timeout_millis=timeout_millis, **kwargs)
