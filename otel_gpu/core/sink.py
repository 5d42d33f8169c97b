"""The process's span sink, for the calls layer, which sits below the pipeline.

The decorator's wrappers, compiled calls and CUDA-graph replays submit calls to the running
pipeline without importing it: the pipeline module installs its two accessors here when it is
imported (:func:`install`), and the calls layer reads them from here.

- :func:`getter` is what a wrapper binds when it is built: the pipeline's ``get``, which builds
  the pipeline on first use. A wrapper built before the pipeline module was imported binds a
  stand-in that looks again on each call, so it starts recording as soon as the pipeline exists
  (the top of the package, :mod:`otel_gpu.runtime`, imports the pipeline before it decorates, so
  this only happens on paths that decorate directly).
- :func:`current` is the pipeline if one is built (never builds one): for code that finishes
  calls off a wrapper, such as a CUDA graph's replays read on a reader thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from otel_gpu.core.protocols import SpanSink

__all__ = ["current", "get", "getter", "install"]


def _none() -> SpanSink | None:
    return None


def _late() -> SpanSink | None:
    """The stand-in for ``get`` before the pipeline module is imported: looks again each call."""
    return None if _get is _late else _get()


_current: Callable[[], SpanSink | None] = _none
_get: Callable[[], SpanSink | None] = _late


def install(
    current: Callable[[], SpanSink | None], get: Callable[[], SpanSink | None] | None = None
) -> None:
    """Make the pipeline module's ``current`` (and ``get``, which builds on first use) the ways
    to the running sink."""
    global _current, _get
    _current = current
    if get is not None:
        _get = get


def current() -> SpanSink | None:
    """The running sink, or None (none built yet, or it failed)."""
    return _current()


def get() -> SpanSink | None:
    """The running sink, built on first use; None if it cannot be built (calls then run as
    they are). On the hot path, bind :func:`getter`'s function instead of calling this."""
    return _get()


def getter() -> Callable[[], SpanSink | None]:
    """The function that returns the running sink, building it on first use: bound once by a
    wrapper, so each call costs one call of the pipeline's own ``get``."""
    return _get
