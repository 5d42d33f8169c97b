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

import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any, NamedTuple, cast

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from otel_gpu.exporters.console import ConsoleSpanExporter

from otel_gpu import _guard
from otel_gpu.attributes import INPUT_PREFIX
from otel_gpu.config import (
    ConfigError,
    Settings,
    check_standard,
    expand_path,
    otel_standard_variables,
    otlp_protocol,
)
from otel_gpu.core import raw

if TYPE_CHECKING:
    from otel_gpu.core.record import Call

__all__ = [
    "PRECALL_LEVEL",
    "CountingExporter",
    "DrainBatchProcessor",
    "FileStream",
    "OwnProvider",
    "build_provider",
    "otlp_exporter",
]


class FileStream:
    """A destination file whose writes never raise: a full disk loses spans, not the export thread.

    Unbuffered: each ``write()`` (one export, or one pre-call block) is one ``os.write`` loop, so a
    failed write is known at once and nothing failed lingers in a buffer to be written twice or
    out of order. A failure is recorded (``failures``, ``error``) for :class:`CountingExporter`,
    which counts the spans and reports once; the next write tries again (a disk can free up).
    A line torn by a failure in the middle is ended before the next one, so readers lose one line.
    """

    def __init__(self, path: str) -> None:
        self.name = path
        self.failures = 0
        self.error: OSError | None = None
        self._fd: int | None = None
        self._closed = False
        self._torn = False
        self._lock = threading.Lock()
        self._open()  # a failure is recorded, and the open retried at each write

    def _open(self) -> int | None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(self.name, flags, 0o666)  # the umask applies, as for log files
        except OSError as exc:
            self.error = exc
        return self._fd

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def open_error(self) -> OSError | None:
        """Why the file could not be opened, while it is not open (``None`` once it is)."""
        return self.error if self._fd is None and not self._closed else None

    def write(self, text: str) -> int:
        data = text.encode("utf-8", "backslashreplace")
        with self._lock:
            if self._closed or not data:
                return 0
            fd = self._fd if self._fd is not None else self._open()
            if fd is None:
                self.failures += 1
                return 0
            if self._torn:
                data = b"\n" + data
            done = 0
            try:
                while done < len(data):
                    done += os.write(fd, data[done:])
            except OSError as exc:
                self.failures += 1
                self.error = exc
                self._torn = done > 0 and data[done - 1 : done] != b"\n"
                return 0
            self._torn = False
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered."""

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError("I/O operation on closed file")
        return self._fd

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


class CountingExporter(SpanExporter):
    """Wraps a destination's exporter and counts the spans it confirmed, and those it lost.

    Spans lost behind it (a full BatchSpanProcessor queue, a refused export, an export
    abandoned at exit) are the difference between what otel-gpu handed over and ``confirmed``.
    ``failed`` counts those of exports that failed outright: an exporter that raised, or a
    write to ``stream`` that failed (a full disk, a file made read-only). Each new kind of
    failure is reported once, as one line with the count so far; every lost span is counted
    for the exit report.
    """

    def __init__(self, exporter: SpanExporter, name: str, stream: FileStream | None = None) -> None:
        self.exporter = exporter
        self.name = name
        self.stream = stream
        self.confirmed = 0
        self.failed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        stream = self.stream
        before = stream.failures if stream is not None else 0
        error: BaseException | None = None
        try:
            result = self.exporter.export(spans)
        except Exception as exc:  # an exporter that raises loses its batch, not the export thread
            result, error = SpanExportResult.FAILURE, exc
        if stream is not None and stream.failures != before:
            result, error = SpanExportResult.FAILURE, stream.error
        elif result is not SpanExportResult.SUCCESS and error is None:
            error = getattr(self.exporter, "write_error", None)  # the console on stdout/stderr
        if result is SpanExportResult.SUCCESS:
            self.confirmed += len(spans)
        elif error is not None:
            self.failed += len(spans)
            self._report(error, len(spans))
        return result

    def _report(self, error: BaseException, lost: int) -> None:
        code = getattr(error, "errno", None)
        name = errno.errorcode.get(code, str(code)) if isinstance(code, int) else None
        _guard.warn_once(
            f"destination.{self.name}.{type(error).__name__}.{name}",
            "otel-gpu cannot write to %s: %s%s: %s; %d span(s) lost so far. It keeps trying; the "
            "exit report counts every span lost",
            self.name,
            type(error).__name__,
            f" [{name}]" if name else "",
            getattr(error, "strerror", None) or error,
            lost,
        )

    def shutdown(self) -> None:
        try:
            self.exporter.shutdown()
        finally:
            if self.stream is not None:  # the official file exporter never closes a given stream
                self.stream.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class OwnProvider(NamedTuple):
    """otel-gpu's own TracerProvider and what the pipeline needs to drive it."""

    provider: TracerProvider
    after_drain: list[Callable[[], Any]]
    consoles: tuple[ConsoleSpanExporter, ...]
    """The console destinations that print a call's inputs before it runs (``ConsolePrecall``)."""
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

    def on_end_batch(self, spans: Sequence[ReadableSpan]) -> None:
        """A chunk of the export queue at once: one call and one lock, not one per span."""
        with self._lock:
            self._batch.extend(spans)

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
    """Observer that prints a call's header and inputs before the call runs (crash safety),
    on each console destination."""

    min_level: int  # set by the observer registry (otel_gpu.export.observers)

    def __init__(self, exporters: tuple[ConsoleSpanExporter, ...], settings: Settings) -> None:
        self.exporters = exporters
        self.limit = settings.repr_limit

    def start(self, call: Call) -> None:
        failure: Exception | None = None
        for exporter in self.exporters:  # each destination prints even if another fails
            try:
                attrs: dict[str, Any] = {}
                if call.inputs:
                    raw.to_attributes(INPUT_PREFIX, call.inputs, self.limit, attrs)
                ctx = call.span.get_span_context()
                exporter.write_call_start(call.plan.name, ctx.span_id, time.time_ns(), attrs)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def end(self, call: Call) -> None:
        pass

    def flush(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass


def otlp_exporter() -> SpanExporter:
    """The official OTLP span exporter for the protocol the standard variables choose."""
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()


def _jsonl_exporter(stream: FileStream, native: bool) -> SpanExporter:
    if native:
        from otel_gpu.exporters.otlp_json import JsonLinesSpanExporter

        return JsonLinesSpanExporter(stream=cast(IO[str], stream))
    from opentelemetry.exporter.otlp.json.file import FileSpanExporter

    return FileSpanExporter(stream=cast(IO[str], stream))  # a text stream in all they use


def _batch_size(settings: Settings) -> int | None:
    """OTEL_BSP_MAX_EXPORT_BATCH_SIZE (validated), lowered to the queue size the SDK requires."""
    raw = otel_standard_variables().get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "").strip()
    size = int(raw) if raw else 512
    return min(size, settings.queue_size)


def _registered_sampler() -> Any:
    """The sampler an installed package registers under ``OTEL_TRACES_SAMPLER``'s name (entry-point
    group ``opentelemetry_traces_sampler``), built as the SDK's auto-configuration builds it, with
    ``OTEL_TRACES_SAMPLER_ARG`` as its argument. None for the SDK's built-in names, which its
    TracerProvider reads itself (it ignores the entry points)."""
    from importlib.metadata import entry_points

    from opentelemetry.sdk.trace.sampling import Sampler

    from otel_gpu.config import SAMPLER_ENTRY_POINTS, SAMPLERS

    env = otel_standard_variables()
    name = env.get("OTEL_TRACES_SAMPLER", "")
    if not name.strip() or name.lower() in SAMPLERS:
        return None
    found = entry_points(group=SAMPLER_ENTRY_POINTS, name=name)  # checked at configuration
    try:
        sampler = next(iter(found)).load()(env.get("OTEL_TRACES_SAMPLER_ARG"))
    except Exception as exc:
        raise ConfigError(
            f"OTEL_TRACES_SAMPLER={name!r} (environment) is invalid: its entry point failed: {exc!r}"
        ) from None
    if not isinstance(sampler, Sampler):
        raise ConfigError(
            f"OTEL_TRACES_SAMPLER={name!r} (environment) is invalid: its entry point made {sampler!r}, not a Sampler"
        )
    return sampler


PRECALL_LEVEL = 3
"""The lowest level whose calls the console prints before they run (:class:`ConsolePrecall`,
the observer registry's ``console`` entry); level 1 prints only the end-of-call line."""


def build_provider(settings: Settings) -> OwnProvider:
    """otel-gpu's own provider for ``settings.dest``, one span processor per destination."""
    from otel_gpu.resource import build_resource

    check_standard("provider")  # the SDK reads these for the provider below; bounded, not guessed
    resource = build_resource()
    if settings.service_name:  # configure(service_name=...) wins, as OTEL_SERVICE_NAME does
        resource = resource.merge(Resource({"service.name": settings.service_name}))
    provider = TracerProvider(
        resource=resource, sampler=_registered_sampler(), shutdown_on_exit=False
    )
    hooks: list[Callable[[], Any]] = []
    consoles: list[ConsoleSpanExporter] = []
    counters: list[CountingExporter] = []
    precall = settings.level >= PRECALL_LEVEL  # the registry's console entry, same bound
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
            processor = BatchSpanProcessor(
                counted,
                max_queue_size=settings.queue_size,
                max_export_batch_size=_batch_size(settings),
            )
        else:
            if key in ("stdout", "stderr"):
                import sys

                stream: IO[str] = sys.stdout if key == "stdout" else sys.stderr
                color = settings.color
            else:
                path = expand_path(item)
                file = FileStream(path)
                if path.endswith(".jsonl"):
                    counted = CountingExporter(_jsonl_exporter(file, native), item, file)
                    counters.append(counted)
                    drain = DrainBatchProcessor(counted)
                    hooks.append(drain.force_flush)
                    provider.add_span_processor(drain)
                    continue
                stream = cast(IO[str], file)
                color = "never" if settings.color == "auto" else settings.color
            console = ConsoleSpanExporter(
                stream,
                color=color,
                inputs_printed_before=precall,
                resource=resource,
                owns_stream=key not in ("stdout", "stderr"),
            )
            if precall:
                consoles.append(console)
            counted = CountingExporter(
                console, item, stream if isinstance(stream, FileStream) else None
            )
            counters.append(counted)
            processor = DrainBatchProcessor(counted)
            hooks.append(processor.force_flush)
        provider.add_span_processor(processor)
    return OwnProvider(provider, hooks, tuple(consoles), counters, spandata=native)
