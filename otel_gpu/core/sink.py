"""The process's span sink, for code that finishes calls outside a decorated call's wrapper.

A CUDA graph's replays become spans on a reader thread (:mod:`otel_gpu.devices.cuda_graphs`):
it finds the sink here. The pipeline installs its accessor when it is imported, so nothing
below it imports the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from otel_gpu.core.protocols import SpanSink

__all__ = ["current", "install"]


def _none() -> SpanSink | None:
    return None


_current: Callable[[], SpanSink | None] = _none


def install(accessor: Callable[[], SpanSink | None]) -> None:
    """Make ``accessor`` (the pipeline module's ``current``) the way to the running sink."""
    global _current
    _current = accessor


def current() -> SpanSink | None:
    """The running sink, or None (none built yet, or it failed)."""
    return _current()
