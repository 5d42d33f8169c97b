"""``import otel_gpu.auto``: apply ``OTEL_GPU_INSTRUMENT`` now, as ``ddtrace.auto`` does.

``import otel_gpu`` alone applies nothing: the package's import stays free (the commands import
it too, and must not instrument, listen for control, or import torch). A program that sets
``OTEL_GPU_INSTRUMENT`` and is not started by ``otel-gpu run`` or ``opentelemetry-instrument``
imports this module first, before the libraries it names, and their calls are spans (or, with
``OTEL_GPU_CONTROL=on``, armed at level 0 for live control) from then on. Nothing else is
needed: a target imported later is instrumented when it is imported.

A program that forgets it is told at exit, when it imported a module that
``OTEL_GPU_INSTRUMENT`` names and nothing applied the variable (docs/instrument.md).
"""

from __future__ import annotations

from otel_gpu.instrumentation.targets import instrument_from_settings

__all__: list[str] = []

instrument_from_settings(via="import otel_gpu.auto")
