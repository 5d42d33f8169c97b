"""OTLP/protobuf for otel-gpu's own destinations, written as wire bytes directly.

The official encoder (``opentelemetry-exporter-otlp-proto-common``) builds a protobuf
message object per span, attribute and value, then serialises the tree. Here a span is
a join of byte strings: tags and lengths are written by hand, the resource, scope and
span name are encoded once, the attributes a ``fixed`` hint marks constant once per
key, and repeating attribute fragments once per value.
``ExportTraceServiceRequest.FromString(encode_request(spans))`` equals the official
``encode_spans(spans)`` (tests/test_encoder_equivalence.py); the bytes themselves may
differ in field order.

Wire format, for reading the constants below: a tag is ``field << 3 | wire_type``
(0 varint, 1 fixed64, 2 length-delimited, 5 fixed32); proto3 defaults are omitted
except where presence matters (oneof members, sub-messages the official always sets).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from struct import Struct
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from otel_gpu.exporters import _encoding
from otel_gpu.exporters._encoding import CACHE_MAX, INT64_MAX, INT64_MIN
from otel_gpu.exporters._grouping import group_spans

__all__ = ["ProtoEncoder", "encode_request"]

_logger = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
_BYTE = [bytes((i,)) for i in range(128)]
_DOUBLE = Struct("<Bd")  # AnyValue.double_value: tag 0x21 + little-endian double
_PACK_DOUBLE = Struct("<d").pack
_TIMES = Struct("<BQBQ")  # Span.start/end_time_unix_nano: tags 0x39, 0x41 + fixed64 each
_FIXED64 = Struct("<BQ")
_FIXED32 = Struct("<BI")
_INTERNAL = SpanKind.INTERNAL
_UNSET = StatusCode.UNSET
# Span.flags (field 16, fixed32): HAS_IS_REMOTE, plus IS_REMOTE when the parent is remote
_FLAGS_LOCAL = b"\x85\x01" + (256).to_bytes(4, "little")
_FLAGS_REMOTE = b"\x85\x01" + (768).to_bytes(4, "little")


def _varint(v: int) -> bytes:
    if v < 0x80:
        return _BYTE[v]
    if v < 0x4000:  # two bytes cover every length of an attribute or a span
        return bytes(((v & 0x7F) | 0x80, v >> 7))
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _field(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: tag, length, body."""
    n = len(body)
    return tag + (_BYTE[n] if n < 0x80 else _varint(n)) + body


def _string(tag: bytes, text: str) -> bytes:
    return _field(tag, text.encode("utf-8"))


def _value(v: Any) -> bytes:
    """One AnyValue body. Exact types first: the common case costs one ``type()`` and a compare."""
    t = type(v)
    if t is str:
        return _field(b"\x0a", v.encode("utf-8"))
    if t is bool:
        return b"\x10\x01" if v else b"\x10\x00"
    if t is int:
        if 0 <= v < 0x80:
            return b"\x18" + _BYTE[v]
        if INT64_MIN <= v <= INT64_MAX:
            return b"\x18" + _varint(v & _U64)  # negative int64: ten-byte two's complement
        raise _encoding.Unencodable(f"int {v} is outside int64")
    if t is float:
        return _DOUBLE.pack(0x21, v)
    if t is list or t is tuple:
        return _field(b"\x2a", b"".join([_field(b"\x0a", _value(x)) for x in v]))
    return _value_slow(v)


def _value_slow(v: Any) -> bytes:
    """Subclasses and the types otel-gpu never produces, in the official encoder's order."""
    v = _encoding.plain(v)
    if v is None:
        return b""
    if isinstance(v, bytes):
        return _field(b"\x3a", v)
    if isinstance(v, Mapping):
        kvs = [_field(b"\x0a", _key_value(str(k), x)) for k, x in v.items()]
        return _field(b"\x32", b"".join(kvs))
    return _value(v)


def _key_value(key: str, v: Any) -> bytes:
    return _string(b"\x0a", key) + _field(b"\x12", _value(v))


def _status(status: Any) -> bytes:
    if status is None:
        return b""
    code = status.status_code
    description = status.description
    if code is _UNSET and not description:
        return b"\x7a\x00"  # present but empty, as the official always sets it
    body = _string(b"\x12", description) if description else b""
    if code.value:
        body += b"\x18" + _BYTE[code.value]
    return _field(b"\x7a", body)


class ProtoEncoder(_encoding.CachingEncoder):
    """Encodes spans to ``ExportTraceServiceRequest`` bytes, caching what repeats.

    Safe to share between threads. Fragment cache keys assume valid OTel values: a
    sequence holds one element type.
    """

    _pack = _PACK_DOUBLE  # the 8 bytes of a double, after the prefix's tag 0x21
    _sep = b""

    def __init__(self) -> None:
        super().__init__()
        self._names: dict[str, bytes] = {}
        self._event_names: dict[str, bytes] = {}

    # ------------------------------------------------------------------ attributes

    def _double_prefix(self, tag: bytes, key: str) -> bytes:
        """Everything of a double-valued KeyValue field before the 8 value bytes."""
        key_field = _string(b"\x0a", key)
        prefix = tag + _varint(len(key_field) + 11) + key_field + b"\x12\x09\x21"
        self._remember(self._caches[tag][1], key, prefix, CACHE_MAX)
        return prefix

    def _fragment(self, tag: bytes, key: str, value: Any) -> bytes:
        return _field(tag, _key_value(key, value))

    # ------------------------------------------------------------------ spans

    def _span(self, span: Any) -> bytes:
        """One Span message body (without its ScopeSpans.spans tag and length)."""
        ctx = span.context
        parent = span.parent
        name = self._names.get(span.name)
        if name is None:
            # name (field 5) with kind INTERNAL (field 6) appended: the common case in one piece
            name = _string(b"\x2a", span.name) if span.name else b""
            self._remember(self._names, span.name, name)
        kind = span.kind
        parts = [
            b"\x0a\x10",
            ctx.trace_id.to_bytes(16, "big"),
            b"\x12\x08",
            ctx.span_id.to_bytes(8, "big"),
            name,
            b"\x30\x01" if kind is _INTERNAL else b"\x30" + _BYTE[kind.value + 1],
        ]
        if parent:
            parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
            parts.append(_FLAGS_REMOTE if parent.is_remote else _FLAGS_LOCAL)
        else:
            parts.append(_FLAGS_LOCAL)
        state = ctx.trace_state
        if state:
            parts.append(_string(b"\x1a", ",".join([f"{k}={v}" for k, v in state.items()])))
        start, end = span.start_time, span.end_time
        if start and end:
            parts.append(_TIMES.pack(0x39, start, 0x41, end))
        else:
            if start:
                parts.append(_FIXED64.pack(0x39, start))
            if end:
                parts.append(_FIXED64.pack(0x41, end))
        if span.attributes:
            self._span_attributes(b"\x4a", span, parts)
        if span.dropped_attributes:
            parts.append(b"\x50" + _varint(span.dropped_attributes))
        for event in span.events:
            parts.append(_field(b"\x5a", self._event(event)))
        if span.dropped_events:
            parts.append(b"\x60" + _varint(span.dropped_events))
        if span.links:
            parts.append(self._links(span.links))
        if span.dropped_links:
            parts.append(b"\x70" + _varint(span.dropped_links))
        parts.append(_status(span.status))
        return b"".join(parts)

    def _event(self, event: Any) -> bytes:
        name = self._event_names.get(event.name)
        if name is None:
            name = _string(b"\x12", event.name) if event.name else b""
            self._remember(self._event_names, event.name, name)
        body = _FIXED64.pack(0x09, event.timestamp) + name if event.timestamp else name
        if event.attributes:
            parts = [body]
            self._attributes(b"\x1a", _encoding.attribute_items(event.attributes), parts)
            body = b"".join(parts)
        dropped = getattr(event, "dropped_attributes", 0)
        if dropped:
            body += b"\x20" + _varint(dropped)
        return body

    def _encode_links(self, links: Any) -> bytes:
        return b"".join([_field(b"\x6a", self._link(link)) for link in links])

    def _link(self, link: Any) -> bytes:
        ctx = link.context
        body = (
            b"\x0a\x10"
            + ctx.trace_id.to_bytes(16, "big")
            + b"\x12\x08"
            + ctx.span_id.to_bytes(8, "big")
            + self._joined(b"\x22", link.attributes)
        )
        dropped = getattr(link, "dropped_attributes", 0)
        if dropped:
            body += b"\x28" + _varint(dropped)
        return body + _FIXED32.pack(0x35, 768 if ctx.is_remote else 256)

    # ------------------------------------------------------------------ resource and scope

    def _encode_resource(self, resource: Any) -> bytes:
        """ResourceSpans.resource as a whole field (always present, as the official sets it)."""
        attributes = getattr(resource, "attributes", None)
        return _field(b"\x0a", self._joined(b"\x0a", attributes))

    def _encode_scope(self, scope: Any) -> bytes:
        """ScopeSpans.scope as a whole field, plus ScopeSpans.schema_url."""
        body = b""
        schema = b""
        if scope is not None:
            if scope.name:
                body += _string(b"\x0a", scope.name)
            if scope.version:
                body += _string(b"\x12", scope.version)
            body += self._joined(b"\x1a", scope.attributes)
            if scope.schema_url:
                schema = _string(b"\x1a", scope.schema_url)
        return _field(b"\x0a", body) + schema

    # ------------------------------------------------------------------ request

    def _framed_span(self, span: Any) -> bytes:
        """The span as field 2 (``spans``) of its ``ScopeSpans``."""
        body = self._span(span)
        n = len(body)
        return b"\x12" + (_BYTE[n] if n < 0x80 else _varint(n)) + body

    def encode(self, spans: Iterable[Any]) -> bytes:
        """The ``ExportTraceServiceRequest`` of ``spans`` in protobuf wire format.

        Spans are grouped by resource, then scope, in first-seen order, as the official encoder does.
        """
        groups = group_spans(spans, self._framed_span)
        out = []
        for resource, by_scope in groups.items():
            scope_spans = [
                _field(b"\x12", self._scope(scope) + b"".join(encoded))
                for scope, encoded in by_scope.items()
            ]
            schema = getattr(resource, "schema_url", None)
            body = self._resource(resource) + b"".join(scope_spans)
            if schema:
                body += _string(b"\x1a", schema)
            out.append(_field(b"\x0a", body))
        return b"".join(out)


_DEFAULT = ProtoEncoder()


def encode_request(
    spans: Sequence[ReadableSpan] | Iterable[Any], encoder: ProtoEncoder | None = None
) -> bytes:
    """``spans`` as a serialised OTLP ``ExportTraceServiceRequest``; ``b""`` for none."""
    return (encoder or _DEFAULT).encode(spans)
