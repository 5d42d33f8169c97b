"""The top of the package: ``@otel_gpu.api``, ``configure`` and ``flush``.

It is the one place that joins the layers for a user: the decorator's work is in the calls
layer (:mod:`otel_gpu.calls.decorator`), which never imports the pipeline; this module imports
the pipeline (whose import installs its accessors in :mod:`otel_gpu.core.sink`, where the
wrappers find it) and applies ``OTEL_GPU_INSTRUMENT`` at the first decorated function
(:func:`otel_gpu.instrumentation.targets.decorate`). ``import otel_gpu`` imports none of this:
the package's ``__init__`` loads it on the first use of a public name.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar, overload

from otel_gpu import _guard, config
from otel_gpu.calls.batch import batch
from otel_gpu.calls.lifecycle import NonFiniteError
from otel_gpu.export import pipeline
from otel_gpu.instrumentation import targets as _targets
from otel_gpu.instrumentation.targets import decorate

__all__ = ["NonFiniteError", "api", "batch", "configure", "decorate", "flush"]

F = TypeVar("F", bound=Callable[..., Any])


@overload
def api(fn: F, /, *, name: str | None = None) -> F: ...
@overload
def api(*, name: str | None = None) -> Callable[[F], F]: ...


def api(fn: Any = None, /, *, name: str | None = None) -> Any:
    """Turn every call of ``fn`` into an OpenTelemetry span, at the level ``OTEL_GPU_LOGLEVEL`` sets.

    Use bare (``@otel_gpu.api``) or with a span name (``@otel_gpu.api(name="BatchDecode.run")``).
    The level is read when the function is decorated: call :func:`configure` before importing
    the library whose functions are decorated.
    """
    if fn is None:
        return lambda f: decorate(f, name)
    if isinstance(fn, str):
        raise TypeError(
            "otel_gpu.api takes the span name as a keyword: @otel_gpu.api(name=...), "
            f"not @otel_gpu.api({fn!r})"
        )
    return decorate(fn, name)


def configure(
    *,
    level: int | str | None = None,
    dest: str | list[str] | tuple[str, ...] | None = None,
    tracer_provider: Any = None,
    **settings: Any,
) -> config.Settings:
    """Set otel-gpu's settings from code; wins over the environment.

    Call it before importing the libraries whose functions are decorated: the level is fixed
    when a function is decorated. A new destination takes effect at the next call (queued spans
    are flushed to the old one first). ``tracer_provider`` sends spans to that SDK
    TracerProvider instead of the global or otel-gpu's own one. Other keyword arguments are the
    field names of :class:`otel_gpu.config.Settings` (``max_items``, ``provider``, ``strict``…).
    Raises :class:`otel_gpu.ConfigError` naming the invalid value and what is allowed.
    """
    new = config.set_overrides({"level": level, "dest": dest, **settings})
    _guard.set_strict(new.strict)
    pipeline.reset()
    if tracer_provider is not None:
        pipeline.set_tracer_provider(tracer_provider)
    _targets.apply_settings(new)  # OTEL_GPU_INSTRUMENT where no start-up hook applied it
    return new


def flush(timeout: float | None = None) -> bool:
    """Export every span recorded so far. True when all reached the exporters within ``timeout`` s."""
    pipe = pipeline.current()
    if pipe is None or pipe.pid != os.getpid():
        return True
    graphs = sys.modules.get("otel_gpu.devices.cuda_graphs")
    if graphs is not None:  # CUDA-graph replays still being read become spans first
        graphs.flush(pipe.settings.flush_timeout if timeout is None else timeout)
    return pipe.flush(timeout)
