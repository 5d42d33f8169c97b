"""Span exporters and destination wiring (installed as ``otel_gpu.exporters``).

This package knows output formats and destinations, and nothing about how calls
become spans.
"""

from otel_gpu.exporters.console import ConsoleSpanExporter

__all__ = ["ConsoleSpanExporter"]
