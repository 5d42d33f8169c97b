"""Instrumenting code otel-gpu does not own: targets, torch modules, FlashInfer, the
OpenTelemetry entry point and ``otel-gpu run``."""
