"""The ``opentelemetry_instrumentor`` entry point: ``opentelemetry-instrument python app.py``
applies ``OTEL_GPU_INSTRUMENT`` like ``otel-gpu run`` does.

Needs ``opentelemetry-instrumentation`` (installed with the ``opentelemetry-instrument`` command).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

__all__ = ["GpuInstrumentor"]


class GpuInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Instruments the targets of ``OTEL_GPU_INSTRUMENT`` (nothing when it is empty or level is 0)."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()  # the targets are chosen at run time: no fixed library to check

    def _instrument(self, **kwargs: Any) -> None:
        from otel_gpu.instrumentation.targets import instrument_from_settings

        instrument_from_settings(via="opentelemetry-instrument")

    def _uninstrument(self, **kwargs: Any) -> None:
        from otel_gpu.instrumentation.targets import uninstrument

        uninstrument()
