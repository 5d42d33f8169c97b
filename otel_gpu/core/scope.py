"""The instrumentation scope of every span and metric otel-gpu emits (name and version)."""

from __future__ import annotations

from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_gpu import attributes

__all__ = ["SCOPE"]

try:
    from importlib.metadata import version as _pkg_version

    _VERSION = _pkg_version("otel-gpu")
except Exception:
    _VERSION = "0.0.0"

SCOPE = InstrumentationScope(attributes.SCOPE, _VERSION)
