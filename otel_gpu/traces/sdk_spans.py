"""A ``TracesData`` message -> SDK ``ReadableSpan`` objects, ids and values unchanged.

``otel-gpu ship`` sends a file's protobuf bytes to its own OTLP transport as they are; this is
for an exporter given as a ``SpanExporter`` (the SDK's interface), which takes spans.
What the SDK span model cannot carry is not rebuilt: the W3C trace-flag bits of ``Span.flags``,
link ``trace_state``, resource and scope ``dropped_attributes_count`` and resource
``entity_refs``; a status message is kept for ERROR status only.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["to_spans"]


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@functools.cache
def _sdk_types() -> dict[str, Any]:
    """SDK subclasses that carry a file's values verbatim (the SDK classes would re-validate)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link

    class _Resource(Resource):
        # Identity, not value, equality: the encoder groups spans by resource, and two
        # ResourceSpans of a file must stay two.
        __eq__ = object.__eq__
        __hash__ = object.__hash__

        def __init__(self, attributes: dict[str, Any], schema_url: str) -> None:
            super().__init__({}, schema_url)
            self._raw = attributes

        @property
        def attributes(self) -> Any:
            return self._raw

    class _Scope(InstrumentationScope):
        __eq__ = object.__eq__
        __hash__ = object.__hash__

        def __init__(self, name: str, version: str, schema_url: str, attributes: Any) -> None:
            super().__init__(name, version or None, schema_url)
            self._raw = attributes

        @property
        def attributes(self) -> Any:
            return self._raw

    class _Event(Event):
        def __init__(self, name: str, attributes: Any, timestamp: int, dropped: int) -> None:
            super().__init__(name, attributes, timestamp)
            self._dropped = dropped

        @property
        def dropped_attributes(self) -> int:
            return self._dropped

    class _Link(Link):
        def __init__(self, context: Any, attributes: Any, dropped: int) -> None:
            super().__init__(context, attributes)
            self._dropped = dropped

        @property
        def dropped_attributes(self) -> int:
            return self._dropped

    class _Span(ReadableSpan):
        def __init__(self, dropped: tuple[int, int, int], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._dropped = dropped

        @property
        def dropped_attributes(self) -> int:
            return self._dropped[0]

        @property
        def dropped_events(self) -> int:
            return self._dropped[1]

        @property
        def dropped_links(self) -> int:
            return self._dropped[2]

    return {"resource": _Resource, "scope": _Scope, "event": _Event, "link": _Link, "span": _Span}


_REMOTE = 0x200  # SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


def to_spans(traces: Any) -> list[Any]:
    """The ``ReadableSpan`` objects of a ``TracesData``, ids and values unchanged."""
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
    from opentelemetry.trace.span import TraceState

    types = _sdk_types()
    kinds = list(SpanKind)
    spans = []
    for rs in traces.resource_spans:
        resource = types["resource"](_attrs(rs.resource.attributes), rs.schema_url)
        for ss in rs.scope_spans:
            scope = types["scope"](
                ss.scope.name, ss.scope.version, ss.schema_url, _attrs(ss.scope.attributes)
            )
            for s in ss.spans:
                trace_id = int.from_bytes(s.trace_id, "big")
                state = TraceState.from_header([s.trace_state]) if s.trace_state else None
                context = SpanContext(
                    trace_id,
                    int.from_bytes(s.span_id, "big"),
                    False,
                    TraceFlags(s.flags & 0xFF),
                    state,
                )
                parent = None
                if s.parent_span_id:
                    remote = bool(s.flags & _REMOTE)
                    parent = SpanContext(trace_id, int.from_bytes(s.parent_span_id, "big"), remote)
                code = StatusCode(s.status.code) if s.status.code in (0, 1, 2) else StatusCode.UNSET
                status = Status(
                    code, s.status.message or None if code is StatusCode.ERROR else None
                )
                events = [
                    types["event"](
                        e.name, _attrs(e.attributes), e.time_unix_nano, e.dropped_attributes_count
                    )
                    for e in s.events
                ]
                links = [
                    types["link"](
                        SpanContext(
                            int.from_bytes(link.trace_id, "big"),
                            int.from_bytes(link.span_id, "big"),
                            bool(link.flags & _REMOTE),
                        ),
                        _attrs(link.attributes),
                        link.dropped_attributes_count,
                    )
                    for link in s.links
                ]
                spans.append(
                    types["span"](
                        (s.dropped_attributes_count, s.dropped_events_count, s.dropped_links_count),
                        name=s.name,
                        context=context,
                        parent=parent,
                        resource=resource,
                        attributes=_attrs(s.attributes),
                        events=events,
                        links=links,
                        kind=kinds[s.kind - 1] if 1 <= s.kind <= len(kinds) else SpanKind.INTERNAL,
                        status=status,
                        start_time=s.start_time_unix_nano,
                        end_time=s.end_time_unix_nano,
                        instrumentation_scope=scope,
                    )
                )
    return spans
