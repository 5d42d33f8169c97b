"""``OTEL_GPU_LOGDEST`` → otel-gpu's own TracerProvider with one span processor per destination.

* ``stdout`` / ``stderr``: the console renderer.
* a path ending in ``.jsonl``: OTLP JSON Lines.
* any other path: the console renderer's text, without colour.
* ``otlp``: OTLP under a ``BatchSpanProcessor``; gRPC unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
  (or ``OTEL_EXPORTER_OTLP_PROTOCOL``) says ``http/protobuf``, as in the OTel Python SDK.
  Endpoint, headers, timeout and TLS come from the standard ``OTEL_EXPORTER_OTLP_*`` variables.

``OTEL_GPU_ENCODER=native`` (default) writes ``.jsonl`` and ``otlp`` with otel-gpu's own
encoders (``otlp_json``, ``otlp_transport``), which also accept the pipeline's ``SpanData``;
``official`` uses ``opentelemetry-exporter-otlp-json-file`` and the official OTLP exporters,
which need SDK ``ReadableSpan`` objects.

Paths expand ``%i`` to the pid and ``%r`` to the rank.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, NamedTuple

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from otel_gpu.exporters.console import ConsoleSpanExporter

from otel_gpu import metadata
from otel_gpu.config import ConfigError, Settings, environ, expand_path

__all__ = [
    "CountingExporter",
    "DrainBatchProcessor",
    "OwnProvider",
    "build_provider",
    "otlp_exporter",
]

_PROTOCOLS = ("grpc", "http/protobuf")


class CountingExporter(SpanExporter):
    """Wraps a destination's exporter and counts the spans it confirmed.

    Spans lost behind it (a full BatchSpanProcessor queue, a refused export, an export
    abandoned at exit) are the difference between what otel-gpu handed over and this count.
    """

    def __init__(self, exporter: SpanExporter, name: str) -> None:
        self.exporter = exporter
        self.name = name
        self.confirmed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.exporter.export(spans)
        if result is SpanExportResult.SUCCESS:
            self.confirmed += len(spans)
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class OwnProvider(NamedTuple):
    """otel-gpu's own TracerProvider and what the pipeline needs to drive it."""

    provider: TracerProvider
    after_drain: list[Callable[[], Any]]
    observers: tuple[Any, ...]
    exporters: list[CountingExporter]
    spandata: bool = False
    """True when every processor and exporter also accepts ``SpanData`` (the native encoders)."""


class DrainBatchProcessor(SpanProcessor):
    """Collects the spans of one drain of the export queue and exports them as one batch.

    otel-gpu's export thread already batches, so a second queue and thread (the SDK's
    BatchSpanProcessor) would only add cost for local destinations.
    """

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter
        self._batch: list[ReadableSpan] = []
        self._lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            self._batch.append(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            batch, self._batch = self._batch, []
            if batch:
                return self.exporter.export(batch) is SpanExportResult.SUCCESS
        return True

    def shutdown(self) -> None:
        self.force_flush()
        self.exporter.shutdown()


class ConsolePrecall:
    """Observer that prints a call's header and inputs before the call runs (crash safety)."""

    min_level = 3  # level 1 prints only the end-of-call line

    def __init__(self, exporter: ConsoleSpanExporter, settings: Settings) -> None:
        self.exporter = exporter
        self.limit = settings.repr_limit

    def start(self, call: Any) -> None:
        attrs: dict[str, Any] = {}
        if call.inputs:
            metadata.to_attributes("otel_gpu.input.", call.inputs, self.limit, attrs)
        ctx = call.span.get_span_context()
        self.exporter.write_call_start(call.plan.name, ctx.span_id, time.time_ns(), attrs)

    def end(self, call: Any) -> None:
        pass


def otlp_protocol(env: Mapping[str, str] | None = None) -> str:
    """The OTLP protocol the standard variables choose; ConfigError naming the variable if unsupported."""
    env = environ() if env is None else env
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(name, "").strip()
        if value:
            if value not in _PROTOCOLS:
                raise ConfigError(
                    f"{name}={value!r} is not supported by OTEL_GPU_LOGDEST=otlp. "
                    f"Allowed: {', '.join(_PROTOCOLS)}."
                )
            return value
    return "grpc"


def check_otlp_environment(env: Mapping[str, str] | None = None) -> None:
    """Validate the standard OTLP variables otel-gpu relies on; ConfigError naming the bad one."""
    env = environ() if env is None else env
    otlp_protocol(env)
    for name in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        value = env.get(name, "").strip()
        if value:
            try:
                ok = float(value) >= 0
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(f"{name}={value!r} is invalid: not a number of seconds >= 0.")


def otlp_exporter() -> SpanExporter:
    """The official OTLP span exporter for the protocol the standard variables choose."""
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()


def _jsonl_exporter(path: str, native: bool) -> SpanExporter:
    if native:
        from otel_gpu.exporters.otlp_json import JsonLinesSpanExporter

        return JsonLinesSpanExporter(path)
    from opentelemetry.exporter.otlp.json.file import FileSpanExporter

    return FileSpanExporter(path)


def _open_text(path: str) -> IO[str]:
    return open(path, "a", encoding="utf-8", buffering=1)


def build_provider(settings: Settings) -> OwnProvider:
    """otel-gpu's own provider for ``settings.dest``, one span processor per destination."""
    from otel_gpu.resource import build_resource

    resource = build_resource()
    if settings.service_name:  # configure(service_name=...) wins, as OTEL_SERVICE_NAME does
        resource = resource.merge(Resource({"service.name": settings.service_name}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    hooks: list[Callable[[], Any]] = []
    observers: list[Any] = []
    counters: list[CountingExporter] = []
    precall = settings.level >= 3
    native = settings.encoder == "native"
    for item in settings.dest:
        key = item.lower()
        processor: SpanProcessor
        if key == "otlp":
            if native:
                from otel_gpu.exporters.otlp_transport import OtlpSpanExporter

                exporter: SpanExporter = OtlpSpanExporter(otlp_protocol())
            else:
                exporter = otlp_exporter()
            counted = CountingExporter(exporter, item)
            counters.append(counted)
            # Sending must never hold the export thread: the SDK's batch processor (it reads only
            # span.context, so SpanData passes) sends from its own thread. Its default 2048-span
            # queue would silently drop bursts otel-gpu's own queue accepted: same bound as ours.
            processor = BatchSpanProcessor(counted, max_queue_size=settings.queue_size)
        else:
            if key in ("stdout", "stderr"):
                import sys

                stream: IO[str] = sys.stdout if key == "stdout" else sys.stderr
                color = settings.color
            else:
                path = expand_path(item)
                if path.endswith(".jsonl"):
                    counted = CountingExporter(_jsonl_exporter(path, native), item)
                    counters.append(counted)
                    drain = DrainBatchProcessor(counted)
                    hooks.append(drain.force_flush)
                    provider.add_span_processor(drain)
                    continue
                stream = _open_text(path)
                color = "never" if settings.color == "auto" else settings.color
            console = ConsoleSpanExporter(
                stream,
                color=color,
                inputs_printed_before=precall,
                resource=resource,
                owns_stream=key not in ("stdout", "stderr"),
            )
            if precall:
                observers.append(ConsolePrecall(console, settings))
            counted = CountingExporter(console, item)
            counters.append(counted)
            processor = DrainBatchProcessor(counted)
            hooks.append(processor.force_flush)
        provider.add_span_processor(processor)
    return OwnProvider(provider, hooks, tuple(observers), counters, spandata=native)
