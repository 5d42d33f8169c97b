"""``SpanData``: a finished span as otel-gpu's own exporters read it.

It has the read interface of the SDK's ``ReadableSpan`` (``name``, ``context``,
``parent``, ``start_time``, ``end_time``, ``attributes``, ``events``, ``links``,
``status``, ``kind``, ``resource``, ``instrumentation_scope``, ``dropped_*``), so
every exporter in this package accepts either. Building one costs a slotted object;
a ``ReadableSpan`` validates and copies every attribute into ``BoundedAttributes``
(8–41 µs a span, see docs/performance.md), which the application's own span
processors need but our own encoders do not.

``fixed`` is an optional hint for encoders: ``(key, n)`` says that the first ``n``
attributes are identical in every span carrying the same ``key`` (a decorated
function's ``code.*`` attributes), so their encoded form can be cached per key.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanContext, SpanKind, Status

__all__ = ["SpanData"]


@dataclass(eq=False, slots=True)
class SpanData:
    """A finished span: plain slots, no validation. Attribute values must already be valid OTel values."""

    name: str
    context: SpanContext
    parent: SpanContext | None
    start_time: int
    end_time: int
    attributes: Mapping[str, Any]
    events: Sequence[Any]
    links: Sequence[Any]
    status: Status
    resource: Any
    instrumentation_scope: Any
    kind: SpanKind = SpanKind.INTERNAL
    fixed: tuple[Hashable, int] | None = None
    dropped_attributes: int = 0
    dropped_events: int = field(default=0, init=False)
    dropped_links: int = field(default=0, init=False)

    def get_span_context(self) -> SpanContext:
        return self.context

    def __repr__(self) -> str:
        return f"SpanData({self.name!r}, span_id={self.context.span_id:016x})"
