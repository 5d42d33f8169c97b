"""Trace files after the fact: the OTLP JSON Lines reader, ``otel-gpu show`` and ``otel-gpu ship``."""
