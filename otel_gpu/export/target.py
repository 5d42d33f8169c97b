"""Where the spans go: the target provider, and how a chunk of spans reaches its processors.

``OTEL_GPU_PROVIDER`` decides between the application's global SDK provider, one given to
:func:`otel_gpu.configure`, and otel-gpu's own provider with the ``OTEL_GPU_LOGDEST``
destinations (:func:`otel_gpu.exporters.destinations.build_provider`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

from otel_gpu import _guard
from otel_gpu.config import Settings
from otel_gpu.exporters import destinations

__all__ = ["Target", "handoffs", "resolve", "root_sampler"]


class Target(NamedTuple):
    provider: Any
    """The SDK ``TracerProvider`` the spans go to."""
    own: destinations.OwnProvider | None
    """otel-gpu's own provider and what drives it, when the spans go there."""


def resolve(settings: Settings, explicit: Any) -> Target:
    """The target provider: ``explicit`` (``configure(tracer_provider=...)``), the application's
    global SDK provider (``OTEL_GPU_PROVIDER`` auto or global), or otel-gpu's own."""
    provider = explicit
    mode = settings.provider
    if provider is None and mode in ("auto", "global"):
        candidate = trace.get_tracer_provider()
        if hasattr(candidate, "_active_span_processor"):
            provider = candidate
        elif mode == "global":
            _guard.warn_once(
                "provider.global",
                "OTEL_GPU_PROVIDER=global but the application has not set an SDK "
                "TracerProvider (found %s); using otel-gpu's own provider with OTEL_GPU_LOGDEST",
                type(candidate).__name__,
            )
    if provider is not None and not hasattr(provider, "_active_span_processor"):
        _guard.warn_once(
            "provider.unsupported",
            "otel-gpu cannot feed spans to %s (not an OpenTelemetry SDK TracerProvider); "
            "using its own provider with OTEL_GPU_LOGDEST",
            type(provider).__name__,
        )
        provider = None
    if provider is None:
        own = destinations.build_provider(settings)
        return Target(own.provider, own)
    return Target(provider, None)


def handoffs(processor: Any, own: bool) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """How a chunk of spans reaches the processors: ``(chunk_ends, span_ends)``.

    otel-gpu's own local destinations (``destinations.DrainBatchProcessor``) take a chunk in one call; the
    SDK's multi-processor dispatch and a lock per span cost ~10% of a level-1 span's export.
    Every other processor (the OTLP batch processor, an application's) gets ``on_end`` per span.
    """
    processors = getattr(processor, "_span_processors", None) if own else None
    if processors is None:
        return (), (processor.on_end,)
    chunk = tuple(
        p.on_end_batch for p in processors if isinstance(p, destinations.DrainBatchProcessor)
    )
    single = tuple(
        p.on_end for p in processors if not isinstance(p, destinations.DrainBatchProcessor)
    )
    return chunk, single


def root_sampler(sampler: Any) -> Callable[[int, str], bool] | None:
    """The decision for calls with no parent; None means always sample (the default, and fastest).

    Calls with a parent follow the parent's sampled flag, as ParentBased samplers do.
    """
    root = sampler._root if isinstance(sampler, ParentBased) else sampler
    if root is None or root is ALWAYS_ON:
        return None
    if root is ALWAYS_OFF:
        return lambda trace_id, name: False
    return lambda trace_id, name: root.should_sample(None, trace_id, name).decision.is_sampled()
