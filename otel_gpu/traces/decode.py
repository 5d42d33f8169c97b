"""OTLP/JSON trace lines -> OTLP protobuf bytes, checked in the same pass, for ``otel-gpu ship``.

A line (already parsed by :func:`otel_gpu.traces.reader.load_json`) becomes, per scope, the
serialised heads of its ``ResourceSpans`` and ``ScopeSpans`` and one framed ``Span`` each
(:class:`Group`): ``ship`` cuts requests of any size from them by concatenating bytes, with no
message objects in between. The messages are built by protobuf's native constructors (upb)
from dicts whose keys this module renames to the proto's field names; the constructors check
every type and range. One Python walk over the keys and values, instead of ``json_format``'s
pure-Python ``ParseDict`` (which cost ~1 ms a span).

A line that fails anywhere in that walk is parsed again by the slow, exact path
(:func:`parse_slow`: hex ids checked and turned into base64, then ``ParseDict``), which decides
whether it is valid and names the offending entry and field. On the lines the tests try
(otel-gpu's files, the official file exporter's, snake_case keys, enum names, NaN and
Infinity, bytes, arrays and kvlists, unknown keys) both paths build the same message.
"""

from __future__ import annotations

import base64
import functools
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

from otel_gpu._text import brief

__all__ = [
    "Group",
    "ShipError",
    "decode",
    "groups_of",
    "int64",
    "parse_slow",
    "request_bytes",
    "unix_nano",
    "varint",
]


class ShipError(ValueError):
    """A file cannot be read, or one of its lines is not OTLP/JSON trace data.

    The message starts with ``FILE:LINE:`` (or ``FILE:`` when the file itself is the problem).
    """


class Group(NamedTuple):
    """The spans of one scope of one line, as wire bytes."""

    resource: bytes
    """A serialised ``ResourceSpans`` without its ``scope_spans``: resource and schema url."""
    scope: bytes
    """A serialised ``ScopeSpans`` without its ``spans``: scope and schema url."""
    spans: list[bytes]
    """Each span serialised and framed as field 2 of ``ScopeSpans``."""


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def request_bytes(groups: Iterable[Group]) -> bytes:
    """An ``ExportTraceServiceRequest`` (the same bytes as a ``TracesData``) of ``groups``.

    Fields may come in any order and a message may be split across repeated occurrences, so
    a head followed by the framed spans is the whole message."""
    out = []
    for group in groups:
        scope = group.scope + b"".join(group.spans)
        resource = (
            group.resource + b"\x12" + varint(len(scope)) + scope
        )  # ResourceSpans.scope_spans
        out.append(b"\x0a" + varint(len(resource)) + resource)  # resource_spans
    return b"".join(out)


@functools.cache
def _messages() -> Any:
    from opentelemetry.proto.trace.v1 import trace_pb2

    return trace_pb2


# --------------------------------------------------------------------------- the fast path

_DOUBLES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_VALUE_KINDS = {
    "stringValue": "string_value",
    "boolValue": "bool_value",
    "intValue": "int_value",
    "doubleValue": "double_value",
    "arrayValue": "array_value",
    "kvlistValue": "kvlist_value",
    "bytesValue": "bytes_value",
}
_VALUE_KINDS.update({v: v for v in list(_VALUE_KINDS.values())})


class _Invalid(Exception):
    """The fast path met something it does not take as is: the slow path decides and names it."""


def _any(node: dict[str, Any]) -> dict[str, Any]:
    ((kind, raw),) = node.items()  # ValueError for {} or two kinds: the slow path names it
    name = _VALUE_KINDS[kind]
    if name == "string_value" or name == "bool_value":
        return {name: raw}  # the constructor checks the type
    if name == "int_value":
        try:
            return {name: int64(raw)}
        except ValueError:
            raise _Invalid from None
    if name == "double_value":
        return {name: _DOUBLES[raw] if type(raw) is str else raw}
    if name == "bytes_value":
        return {name: base64.b64decode(raw, validate=True)}
    values = raw.get("values", ())
    if name == "array_value":
        return {name: {"values": [_any(v) for v in values]}}
    return {name: {"values": [{"key": kv["key"], "value": _any(kv["value"])} for kv in values]}}


def _attributes(kvs: list[Any]) -> list[dict[str, Any]]:
    # inline, not a call per attribute: a level-3 span has dozens
    return [{"key": kv["key"], "value": _any(kv["value"])} for kv in kvs]


def _id(raw: Any, width: int) -> bytes:
    if type(raw) is not str or len(raw) != width:
        raise _Invalid
    value = bytes.fromhex(raw)
    if not any(value):
        raise _Invalid  # an all-zero trace or span id is invalid
    return value


# --------------------------------------------------------------------------- integers
# The proto3 JSON rules for the integer fields, as ``json_format`` (ship's exact path) applies
# them: a JSON number without a fraction or a decimal string, within the field's range. ``show``
# reads times and ``intValue`` with the same two functions, so it refuses what ship refuses.

_UINT64_MAX = 2**64 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _integer(raw: Any, low: int, high: int, span: str) -> int:
    if type(raw) is int:
        value = raw
    elif type(raw) is float and raw.is_integer():
        value = int(raw)
    elif type(raw) is str and raw.strip() == raw and raw.lstrip("-").isdecimal():
        try:
            value = int(raw)
        except ValueError:  # more digits than Python converts
            raise ValueError("more digits than any 64-bit integer") from None
    else:
        raise ValueError("not a whole number")
    if not low <= value <= high:
        raise ValueError(f"outside {span}")
    return value


def unix_nano(raw: Any) -> int:
    """A ``*TimeUnixNano`` (fixed64): 0 to 2**64-1; ``ValueError`` saying why not."""
    return _integer(raw, 0, _UINT64_MAX, "0 to 2**64-1")


def int64(raw: Any) -> int:
    """An ``intValue`` (int64): -2**63 to 2**63-1; ``ValueError`` saying why not."""
    return _integer(raw, _INT64_MIN, _INT64_MAX, "-2**63 to 2**63-1")


def _uint(raw: Any) -> Any:
    try:
        return unix_nano(raw)
    except ValueError:
        raise _Invalid from None


# JSON key (camelCase, or the proto's own snake_case) -> (field, how its value is converted)
_SPAN, _EVENT, _LINK = "span", "event", "link"
_ID32, _ID16, _PARENT, _UINT, _ATTRS, _EVENTS, _LINKS, _STATUS, _AS_IS = range(9)


def _table(**fields: tuple[str, int]) -> dict[str, tuple[str, int]]:
    table = {}
    for camel, (name, how) in fields.items():
        table[camel] = table[name] = (name, how)
    return table


# every message with attributes carries their count of dropped ones; a link carries the
# context of the span it points to, with the same fields as the span's own
_ATTRIBUTED = _table(
    attributes=("attributes", _ATTRS),
    droppedAttributesCount=("dropped_attributes_count", _UINT),
)
_CONTEXT = _table(
    traceId=("trace_id", _ID32),
    spanId=("span_id", _ID16),
    traceState=("trace_state", _AS_IS),
    flags=("flags", _UINT),
)
_SPAN_FIELDS = {
    **_CONTEXT,
    **_ATTRIBUTED,
    **_table(
        parentSpanId=("parent_span_id", _PARENT),
        name=("name", _AS_IS),
        kind=("kind", _AS_IS),
        startTimeUnixNano=("start_time_unix_nano", _UINT),
        endTimeUnixNano=("end_time_unix_nano", _UINT),
        events=("events", _EVENTS),
        droppedEventsCount=("dropped_events_count", _UINT),
        links=("links", _LINKS),
        droppedLinksCount=("dropped_links_count", _UINT),
        status=("status", _STATUS),
    ),
}
_EVENT_FIELDS = {
    **_ATTRIBUTED,
    **_table(timeUnixNano=("time_unix_nano", _UINT), name=("name", _AS_IS)),
}
_LINK_FIELDS = {**_CONTEXT, **_ATTRIBUTED}
_HEAD_FIELDS = {  # resource and scope
    **_ATTRIBUTED,
    **_table(name=("name", _AS_IS), version=("version", _AS_IS)),
}


def _fields(node: dict[str, Any], table: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """``node``'s known fields, renamed and converted; unknown keys are ignored, as the slow
    path's ``ParseDict(ignore_unknown_fields=True)`` ignores them."""
    out: dict[str, Any] = {}
    for key, raw in node.items():
        field = table.get(key)
        if field is None:
            continue
        name, how = field
        if how == _AS_IS:
            out[name] = raw
        elif how == _ATTRS:
            out[name] = _attributes(raw)
        elif how == _UINT:
            out[name] = _uint(raw)
        elif how == _ID32:
            out[name] = _id(raw, 32)
        elif how == _ID16:
            out[name] = _id(raw, 16)
        elif how == _PARENT:
            if raw not in ("", None):
                out[name] = bytes.fromhex(raw) if len(raw) == 16 else _id(raw, 16)
        elif how == _EVENTS:
            out[name] = [_fields(e, _EVENT_FIELDS) for e in raw]
        elif how == _LINKS:
            out[name] = [_fields(link, _LINK_FIELDS) for link in raw]
        else:  # _STATUS
            out[name] = {k: v for k, v in raw.items() if k in ("code", "message")}
    if (table is _SPAN_FIELDS or table is _LINK_FIELDS) and (
        "trace_id" not in out or "span_id" not in out
    ):
        raise _Invalid
    return out


def _scope_lists(node: dict[str, Any], camel: str, snake: str) -> list[Any]:
    value = node.get(camel, node.get(snake, []))
    if type(value) is not list:
        raise _Invalid
    return value


_OLD_SCOPES = ("instrumentationLibrarySpans", "instrumentation_library_spans")
_OLD_SCOPE = ("instrumentationLibrary", "instrumentation_library")


def _scopes(rs: dict[str, Any]) -> list[Any]:
    """The scope spans of a ``ResourceSpans``, also in the pre-0.15 form that older producers
    still write (``instrumentationLibrarySpans`` holding an ``instrumentationLibrary``), which
    ``show`` reads too: renamed, not skipped."""
    if "scopeSpans" in rs or "scope_spans" in rs or not any(k in rs for k in _OLD_SCOPES):
        return _scope_lists(rs, "scopeSpans", "scope_spans")
    return [_renamed(old) for old in _scope_lists(rs, *_OLD_SCOPES)]


def _renamed(old: Any) -> Any:
    if not isinstance(old, dict):
        return old  # named as what it is by whoever reads it
    new = {k: v for k, v in old.items() if k not in _OLD_SCOPE}
    library = next((old[k] for k in _OLD_SCOPE if k in old), None)
    if library is not None:
        new["scope"] = library
    return new


def _head(node: dict[str, Any], key: str, message: Any) -> bytes:
    """A ``ResourceSpans`` or ``ScopeSpans`` without its list: its ``key`` and schema url."""
    head: dict[str, Any] = {}
    if key in node:
        head[key] = _fields(node[key], _HEAD_FIELDS)
    if "schemaUrl" in node or "schema_url" in node:
        head["schema_url"] = node.get("schemaUrl", node.get("schema_url"))
    return bytes(message(**head).SerializeToString())


def _decode_fast(payload: Any) -> list[Group]:
    pb = _messages()
    span_type, resource_spans, scope_spans = pb.Span, pb.ResourceSpans, pb.ScopeSpans
    groups = []
    if "resourceSpans" not in payload and "resource_spans" not in payload:
        raise _Invalid
    for rs in _scope_lists(payload, "resourceSpans", "resource_spans"):
        resource = _head(rs, "resource", resource_spans)
        for ss in _scopes(rs):
            scope = _head(ss, "scope", scope_spans)
            spans = []
            for span in _scope_lists(ss, "spans", "spans"):
                # inline, not a helper per span: this loop is ship's whole cost
                body = span_type(**_fields(span, _SPAN_FIELDS)).SerializeToString()
                spans.append(b"\x12" + varint(len(body)) + body)
            groups.append(Group(resource, scope, spans))
    return groups


def decode(payload: Any, where: str) -> list[Group]:
    """A line's JSON -> its :class:`Group` s; :class:`ShipError` naming ``where`` if invalid."""
    try:
        return _decode_fast(payload)
    except Exception:  # any surprise: the exact path decides, and names what is wrong
        return groups_of(parse_slow(payload, where))


def groups_of(traces: Any) -> list[Group]:
    """The :class:`Group` s of a ``TracesData`` message."""
    pb = _messages()
    groups = []
    for rs in traces.resource_spans:
        head = pb.ResourceSpans(resource=rs.resource, schema_url=rs.schema_url)
        if not rs.HasField("resource"):
            head.ClearField("resource")
        elif "entity_refs" in head.resource.DESCRIPTOR.fields_by_name:
            head.resource.ClearField("entity_refs")  # as the fast path: not sent
        resource = head.SerializeToString()
        for ss in rs.scope_spans:
            scope_head = pb.ScopeSpans(scope=ss.scope, schema_url=ss.schema_url)
            if not ss.HasField("scope"):
                scope_head.ClearField("scope")
            spans = []
            for span in ss.spans:
                body = span.SerializeToString()
                spans.append(b"\x12" + varint(len(body)) + body)
            groups.append(Group(resource, scope_head.SerializeToString(), spans))
    return groups


# --------------------------------------------------------------------------- the exact path

_ID_KEYS = (("traceId", "trace_id", 32), ("spanId", "span_id", 16))
_PARENT_KEYS = ("parentSpanId", "parent_span_id")


def _b64_id(value: Any, key: str, width: int, where: str, optional: bool = False) -> str:
    """OTLP/JSON carries ids as hex; ``json_format`` wants bytes fields as base64."""
    if optional and value in ("", None):
        return ""
    try:
        if not isinstance(value, str) or len(value) != width:
            raise ValueError
        raw = bytes.fromhex(value)
    except ValueError:
        raise ShipError(f"{where}: {key} {brief(value)} is not {width} hex digits") from None
    if not optional and not any(raw):
        raise ShipError(f"{where}: {key} is all zeros (an invalid id)")
    return base64.b64encode(raw).decode("ascii")


def _convert_ids(node: dict[str, Any], where: str, with_parent: bool) -> None:
    for camel, snake, width in _ID_KEYS:
        key = camel if camel in node else snake
        if key not in node:
            raise ShipError(f"{where}: no {camel}")
        node[key] = _b64_id(node[key], key, width, where)  # named as the file spells it
    if with_parent:
        for key in _PARENT_KEYS:
            if key in node:
                node[key] = _b64_id(node[key], key, 16, where, optional=True)


def _items(node: Any, camel: str, snake: str, where: str) -> list[Any]:
    if not isinstance(node, dict):
        raise ShipError(f"{where} is not an object (expected one holding {camel})")
    key = camel if camel in node else snake
    value = node.get(key, [])
    if not isinstance(value, list):
        raise ShipError(f"{where}: {key} is not a list")
    return value


def parse_slow(payload: Any, where: str) -> Any:
    """A line's JSON -> ``TracesData`` through ``json_format``, or :class:`ShipError` naming the
    entry and field that is wrong. Changes ``payload`` (ids become base64)."""
    from google.protobuf import json_format

    if not isinstance(payload, dict):
        raise ShipError(f"{where}: expected a JSON object (OTLP TracesData)")
    if "resourceSpans" not in payload and "resource_spans" not in payload:
        other = [k for k in ("resourceMetrics", "resourceLogs") if k in payload]
        what = (
            f"{other[0]} found: metrics and logs are not shipped" if other else "no resourceSpans"
        )
        raise ShipError(f"{where}: not OTLP trace data ({what})")
    for r, rs in enumerate(_items(payload, "resourceSpans", "resource_spans", where)):
        at_r = f"{where}: resourceSpans[{r}]"
        if isinstance(rs, dict) and "scopeSpans" not in rs and "scope_spans" not in rs:
            old = next((k for k in _OLD_SCOPES if k in rs), None)
            if old is not None and isinstance(rs[old], list):
                rs["scopeSpans"] = [_renamed(ils) for ils in rs.pop(old)]
        for s, ss in enumerate(_items(rs, "scopeSpans", "scope_spans", at_r)):
            at_s = f"{at_r}.scopeSpans[{s}]"
            for i, span in enumerate(_items(ss, "spans", "spans", at_s)):
                path = f"resourceSpans[{r}].scopeSpans[{s}].spans[{i}]"
                if not isinstance(span, dict):
                    raise ShipError(f"{where}: {path} is not an object")
                at = f"{where}: span {brief(span.get('name', '?'))} ({path})"
                _convert_ids(span, at, with_parent=True)
                for k, link in enumerate(_items(span, "links", "links", at)):
                    _convert_ids(link, f"{at} links[{k}]", with_parent=False)
    traces = _messages().TracesData()
    try:
        json_format.ParseDict(payload, traces, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise ShipError(f"{where}: not OTLP trace data: {_cut(str(exc))}") from None
    return traces


def _cut(text: str, limit: int = 200) -> str:
    """A parser's message quotes the offending value: keep a message one readable line."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
