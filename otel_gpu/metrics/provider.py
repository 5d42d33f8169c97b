"""Where the metrics go: the ``MeterProvider`` of one pipeline, built once, shut down with it.

The metrics follow the spans (docs/metrics.md, "Where metrics go"):

- spans to otel-gpu's own provider: otel-gpu's own ``MeterProvider``, with one reader per
  ``OTEL_GPU_LOGDEST`` destination: ``otlp`` gets the official OTLP metric exporter (gRPC or HTTP,
  as for spans), a ``.jsonl`` path gets the official OTLP JSON Lines file exporter writing the
  sibling file ``<name>.metrics.jsonl``, and a console or text destination gets a table at exit
  (:mod:`otel_gpu.metrics.summary`);
- spans to the application's provider: the application's global SDK ``MeterProvider`` when it has
  set one (its readers, views and exemplar filter apply), otherwise otel-gpu's own as above.

Each reader of otel-gpu's own provider is a ``PeriodicExportingMetricReader`` on its own thread
every ``OTEL_GPU_METRICS_INTERVAL`` seconds, so a slow collector never holds the span export
thread; the last collection is exported at exit within ``OTEL_GPU_FLUSH_TIMEOUT``.

On otel-gpu's own provider the call metrics are aggregated by otel-gpu
(:mod:`otel_gpu.metrics.aggregation`, well under a microsecond a call on the export thread) and
added to each export by :class:`otel_gpu.metrics.exporter.CallMetricsExporter`. On the
application's provider, or where an exporter asks for what that aggregation does not reproduce,
they are recorded through SDK instruments (:mod:`otel_gpu.metrics.calls`, 10–13 µs a call).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, cast

from opentelemetry import metrics as metrics_api
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_gpu import _guard
from otel_gpu.config import Settings, exemplar_filter, expand_path, metrics_destination
from otel_gpu.core.scope import SCOPE
from otel_gpu.core.threads import bounded_call
from otel_gpu.metrics import names

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter

    from otel_gpu.core.protocols import ExportState
    from otel_gpu.metrics.aggregation import CallAggregation
    from otel_gpu.metrics.summary import Summary

__all__ = ["Metrics", "build", "metrics_path", "metrics_protocol"]

# Readers of otel-gpu's own providers in this process: a forked child must not export the
# parent's measurements again from the copies it inherited (the SDK restarts their threads).
_OWN_READERS: weakref.WeakSet[PeriodicExportingMetricReader] = weakref.WeakSet()


def metrics_path(trace_path: str) -> str:
    """The metrics file beside a ``.jsonl`` span destination: ``spans.jsonl`` → ``spans.metrics.jsonl``.

    A file of its own, not lines in the span file: otel-gpu's trace tools and a collector's
    traces pipeline read span files, and one signal per file keeps both simple.
    """
    return trace_path[: -len(".jsonl")] + ".metrics.jsonl"


def metrics_protocol(env: dict[str, str] | None = None) -> str:
    """The OTLP protocol for metrics: ``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL``, then
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, then gRPC."""
    from otel_gpu.config import otlp_protocol

    return otlp_protocol(env, "METRICS")


def _otlp_exporter() -> Any:
    if metrics_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpExporter,
    )

    return HttpExporter()


def _file_exporter(path: str) -> Any:
    from opentelemetry.exporter.otlp.json.file import FileMetricExporter

    from otel_gpu.exporters.destinations import FileStream

    # otel-gpu's own file stream: unbuffered, never raising (a full disk loses a collection,
    # not the reader's thread), opened as the span files are
    return FileMetricExporter(stream=cast(IO[str], FileStream(path)))


class Metrics:
    """One pipeline's metrics: the provider, its meter, and what to do at exit."""

    def __init__(
        self,
        provider: Any,
        own: bool,
        readers: list[MetricReader],
        summary: Summary | None,
        timeout: float,
        aggregation: CallAggregation | None = None,
    ) -> None:
        self.provider = provider
        self.own = own  # otel-gpu's own provider (shut down at exit), not the application's
        self.readers = readers
        self.summary = summary
        self.timeout = timeout
        self.meter: Meter = provider.get_meter(names.METER, _version())
        # metrics.calls.CallMetrics (SDK instruments) or the own aggregation, set by build()
        self.calls: Any = aggregation
        self.gpu: Any = None  # metrics.gpu.GpuGauges, or None without GPUs
        self._closed = False

    def flush(self, timeout: float) -> bool:
        """Export a collection now (``otel_gpu.flush()``); True when every reader confirmed."""
        if not self.own:
            return True
        return bool(self.provider.force_flush(int(timeout * 1000)))

    def shutdown(self, timeout: float) -> None:
        """The last collection, exported; then the console's table. The application's provider
        is the application's to shut down: it only gets the calls recorded so far."""
        if self._closed:
            return
        self._closed = True
        if self.summary is not None:
            self.summary.print(self)
        if self.own:
            _bounded(lambda: self.provider.shutdown(int(timeout * 1000)), timeout)


def _version() -> str:
    return SCOPE.version or ""


def _bounded(fn: Any, timeout: float) -> None:
    bounded_call(fn, timeout)


def _application_provider(settings: Settings, pipeline: ExportState) -> Any:
    """The application's global SDK MeterProvider, when the spans go to the application too."""
    if pipeline.owns_provider:
        return None
    candidate = metrics_api.get_meter_provider()
    if isinstance(candidate, MeterProvider):
        return candidate
    _guard.warn_once(
        "metrics.provider",
        "OTEL_GPU_METRICS=true: the spans go to the application's TracerProvider, but the "
        "application has set no SDK MeterProvider (found %s); the metrics go to otel-gpu's own, "
        "with OTEL_GPU_LOGDEST",
        type(candidate).__name__,
    )
    return None


def build(settings: Settings, pipeline: ExportState) -> Metrics:
    """The metrics of ``pipeline`` (``OTEL_GPU_METRICS`` true, or auto where the wiring found
    an OTLP or file destination): provider, call metrics, GPU gauges and otel-gpu's own
    counters."""
    from otel_gpu.metrics import calls, own

    app = _application_provider(settings, pipeline)
    if app is not None:
        result = Metrics(app, False, [], None, settings.flush_timeout)
    else:
        result = _own(settings, pipeline)
    if result.calls is None:
        result.calls = calls.CallMetrics(result.meter, settings)
    own.register(result.meter, pipeline)
    from otel_gpu.metrics import gpu

    result.gpu = gpu.register(result.meter, settings)
    return result


def _otlp_spans_taken(pipeline: ExportState) -> Callable[[], bool]:
    """Whether the pipeline's OTLP destination has had spans confirmed (its endpoint is up)."""

    def taken() -> bool:
        return any(
            getattr(c, "confirmed", 0) > 0
            for c in pipeline.counters
            if str(getattr(c, "name", "")).lower() == "otlp"
        )

    return taken


def _own(settings: Settings, pipeline: ExportState) -> Metrics:
    from otel_gpu.metrics import exporter as call_exporter
    from otel_gpu.metrics.aggregation import CallAggregation

    interval = int(settings.metrics_interval * 1000)
    exporters: list[Any] = []
    consoles: list[str] = []
    otlp: Any = None
    for item in settings.dest:
        kind = metrics_destination(item)
        if kind == "otlp":
            otlp = _otlp_exporter()
            exporters.append(otlp)
        elif kind == "file":
            exporters.append(_file_exporter(metrics_path(expand_path(item))))
        elif settings.metrics is True:  # a table at exit only when asked for: auto prints none
            consoles.append(item)
    # Aggregated by otel-gpu where that gives what the SDK instruments would: the trace-based
    # (or no) exemplar filter, and exporters that ask for explicit buckets and one temporality
    filter_ = exemplar_filter()
    aggregation = None
    if filter_ in ("trace_based", "always_off") and all(map(call_exporter.aggregates, exporters)):
        aggregation = CallAggregation(exemplars=filter_ == "trace_based")
    scope = InstrumentationScope(names.METER, _version())
    readers: list[MetricReader] = []
    for exporter in exporters:
        if aggregation is not None:
            exporter = call_exporter.CallMetricsExporter(
                exporter,
                aggregation,
                scope,
                spans_taken=_otlp_spans_taken(pipeline) if exporter is otlp else None,
            )
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval)
        _OWN_READERS.add(reader)
        readers.append(reader)
    summary = None
    resource = pipeline.provider.resource
    if consoles:
        from otel_gpu.metrics.summary import Summary

        summary = Summary(pipeline, consoles)
        if aggregation is not None:
            view = aggregation.collection(AggregationTemporality.CUMULATIVE)
            summary.add = lambda data: call_exporter.inject(
                data, aggregation.collect(view), scope, resource
            )
        readers.append(summary.reader)
    provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
    return Metrics(provider, True, readers, summary, settings.flush_timeout, aggregation)


def _after_fork_in_child() -> None:
    # Registered before any reader (this module is imported before one is built), so it runs
    # before the SDK's own hook restarts each reader's thread: that thread then stops at once.
    for reader in list(_OWN_READERS):
        reader._shutdown = True
        reader._shutdown_event.set()
    _OWN_READERS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
