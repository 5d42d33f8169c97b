"""What the pipeline dropped, told twice: as events on the next span exported, and in one
warning at exit (docs/reliability.md, "What is dropped and when")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import Event

from otel_gpu import _guard
from otel_gpu.attributes import (
    COMPONENT_TYPE,
    ERROR_TYPE,
    EVENT_SPANS_DROPPED,
    SPANS_DROPPED,
    SPANS_DROPPED_TOTAL,
)
from otel_gpu.config import Settings

__all__ = ["events", "report_lost"]


def events(dropped: int, stalled: int, noted: tuple[int, int]) -> list[Event]:
    """The drops since ``noted`` (the ``(dropped, stalled)`` counts already told), as events
    named after the SDK's self-metric ``otel.sdk.processor.span.processed`` with its
    ``error.type``: ``queue_full`` and ``export_stalled``."""
    seen_dropped, seen_stalled = noted
    full = (dropped - stalled) - (seen_dropped - seen_stalled)
    out = []
    for kind, count in (("queue_full", full), ("export_stalled", stalled - seen_stalled)):
        if count > 0:
            out.append(
                Event(
                    EVENT_SPANS_DROPPED,
                    {
                        ERROR_TYPE: kind,
                        COMPONENT_TYPE: "otel_gpu_queue",
                        SPANS_DROPPED: count,
                        SPANS_DROPPED_TOTAL: dropped,
                    },
                )
            )
    return out


def report_lost(
    settings: Settings,
    dropped: int,
    stalled: int,
    unexported: int,
    exported: int,
    counters: Sequence[Any],
    timeout: float,
) -> None:
    """At exit, one warning for every span lost: dropped at the queue, never built
    (``unexported``), or never confirmed by a destination (each of ``counters`` counts what
    its exporter confirmed)."""
    # Spans handed to a destination that it never confirmed (refused, failed to write,
    # timed out, dropped by its own queue, abandoned at exit); each destination got every
    # span, report the worst. Of those, ``failed`` ones failed outright (e.g. a full disk).
    worst = max(counters, key=lambda c: exported - c.confirmed, default=None)
    unconfirmed = max(exported - worst.confirmed, 0) if worst is not None else 0
    failed = min(getattr(worst, "failed", 0), unconfirmed) if worst is not None else 0
    lost = dropped + unexported + unconfirmed
    if lost:
        _guard.logger.warning(
            "otel-gpu dropped %d span(s): %d because the queue was full (OTEL_GPU_QUEUE_FULL=%s, "
            "OTEL_GPU_QUEUE_SIZE=%d; %d of them because export stalled), %d not built within "
            "OTEL_GPU_FLUSH_TIMEOUT=%ss at exit (or, unset, with no progress for that long) or "
            "failed, %d not confirmed by a destination (%d refused or not written, e.g. a full "
            "disk; %d not within that time)",
            lost,
            dropped,
            settings.queue_full,
            settings.queue_size,
            stalled,
            unexported,
            timeout,
            unconfirmed,
            failed,
            unconfirmed - failed,
        )
