"""pytest plugin: capture otel-gpu spans in memory, with internal errors turned into failures.

Installed with the package (``pytest11`` entry point). In a test::

    def test_my_kernel(otel_gpu_spans):
        spans = otel_gpu_spans(level=3)   # configure first, then decorate
        my_lib.kernel = otel_gpu.api(my_lib_kernel_impl)
        ...
        assert spans.get()[0].name == "my_lib.kernel"
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

__all__ = ["CapturedSpans", "otel_gpu_spans"]


class CapturedSpans:
    """Spans otel-gpu exported during a test. :meth:`get` flushes first."""

    def __init__(self, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
        self.provider = provider
        self.exporter = exporter

    def get(self) -> list[ReadableSpan]:
        import otel_gpu

        otel_gpu.flush()
        return list(self.exporter.get_finished_spans())

    def by_name(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.get() if s.name == name]

    def clear(self) -> None:
        self.exporter.clear()


@pytest.fixture
def otel_gpu_spans() -> Iterator[Callable[..., CapturedSpans]]:
    """Returns ``start(level=..., **settings) -> CapturedSpans``; restores otel-gpu's state afterwards."""
    from otel_gpu import _guard, config
    from otel_gpu.export import pipeline

    def start(
        level: int = 1, tracer_provider: TracerProvider | None = None, **settings: Any
    ) -> CapturedSpans:
        import otel_gpu

        exporter = InMemorySpanExporter()
        provider = tracer_provider or TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        settings.setdefault("strict", True)
        otel_gpu.configure(level=level, tracer_provider=provider, **settings)
        return CapturedSpans(provider, exporter)

    yield start
    pipeline.reset(timeout=2.0)
    pipeline.set_tracer_provider(None)
    config.reset_overrides()
    _guard.set_strict(False)
