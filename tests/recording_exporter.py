"""A span exporter for tests of ``otel-gpu ship``: it keeps what it is given."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace.export import SpanExportResult


class RecordingExporter:
    """Keeps the spans it is given in ``spans`` (``into`` when given) and answers ``result``
    (the SpanExporter interface)."""

    def __init__(
        self, result: SpanExportResult = SpanExportResult.SUCCESS, into: list[Any] | None = None
    ) -> None:
        self.result = result
        self.spans: list[Any] = [] if into is None else into

    def export(self, spans: Any) -> SpanExportResult:
        self.spans.extend(spans)
        return self.result

    def shutdown(self) -> None:
        pass
