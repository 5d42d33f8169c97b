"""Helpers on the running export pipeline, shared by several test files."""

from __future__ import annotations

from otel_gpu.export import pipeline


def drain() -> None:
    """Wait until the current pipeline has resolved and exported what it holds."""
    pipe = pipeline.current()
    assert pipe is not None
    pipe.drain()
