"""OTLP/JSON Lines for otel-gpu's own destinations, written as text directly.

The official encoder (``opentelemetry-exporter-otlp-json-common``) builds a dataclass
per message, then a dict per message, then runs ``json.dumps``: 23–109 µs a span. Here
a span is one format string and a join: the resource, scope and span name are encoded
once, the attributes a ``fixed`` hint marks constant once per key, and repeating
attribute fragments (dtype, device, shapes, flags) once per value. The output decodes
to the same ``ExportTraceServiceRequest`` as the official one, with the same keys in
the same order (hex ids, int64 as strings, NaN/Infinity as strings); see
tests/test_encoder_equivalence.py.

One deliberate difference: an int outside int64 drops its attribute, as the official
*protobuf* encoder does; the official JSON one writes a number no OTLP parser accepts.
"""

from __future__ import annotations

import base64
import logging
import os
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import IO, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags
from otel_gpu.exporters import _encoding, _streams
from otel_gpu.exporters._encoding import CACHE_MAX, INT64_MAX, INT64_MIN
from otel_gpu.exporters._grouping import group_spans

__all__ = ["JsonEncoder", "JsonLinesSpanExporter", "encode_json"]

_logger = logging.getLogger(__name__)

_quote = encode_basestring_ascii  # the C escaper json.dumps uses: same text, no dict walk
_INTERNAL = SpanKind.INTERNAL
_UNSET = StatusCode.UNSET
_TAG = ""  # JSON attributes are encoded alike in every field that holds them
# A span's text in one %-format (C-level, parsed once a call: a third of the f-string's cost,
# which formats each hex id through format()): ids, flags, the cached name and kind, the
# times, and the rest of the span.
_WITH_PARENT = (
    '{"traceId":"%032x","spanId":"%016x","parentSpanId":"%016x","flags":%d%s'
    ',"startTimeUnixNano":"%d","endTimeUnixNano":"%d"%s'
)
_ROOT = '{"traceId":"%032x","spanId":"%016x","flags":256%s,"startTimeUnixNano":"%d","endTimeUnixNano":"%d"%s'


def _tuple_layout() -> bool:
    """Whether a ``SpanContext`` is the SDK's tuple ``(trace_id, span_id, is_remote, flags,
    state, valid)``, so it can be unpacked instead of read through five properties."""
    try:
        ctx = SpanContext(3, 5, True, TraceFlags(1))
        trace_id, span_id, remote, _, state, _ = ctx  # type: ignore[misc]
        return (trace_id, span_id, remote, state) == (3, 5, True, ctx.trace_state)
    except Exception:
        return False


_TUPLE_CONTEXT = _tuple_layout()


def _nonfinite_text(v: float) -> str:
    """NaN and the infinities as OTLP/JSON spells them: strings."""
    if v != v:
        return '"NaN"'
    return '"Infinity"' if v > 0 else '"-Infinity"'


def _value(v: Any) -> str:
    """One AnyValue. Exact types first: the common case costs one ``type()`` and a compare."""
    t = type(v)
    if t is str:
        return '{"stringValue":' + _quote(v) + "}"
    if t is bool:
        return '{"boolValue":true}' if v else '{"boolValue":false}'
    if t is int:
        if INT64_MIN <= v <= INT64_MAX:
            return f'{{"intValue":"{v}"}}'
        raise _encoding.Unencodable(f"int {v} is outside int64")
    if t is float:
        if v - v == 0:
            return f'{{"doubleValue":{v!r}}}'
        return '{"doubleValue":' + _nonfinite_text(v) + "}"
    if t is list or t is tuple:
        if not v:
            return '{"arrayValue":{}}'
        return '{"arrayValue":{"values":[' + ",".join([_value(x) for x in v]) + "]}}"
    return _value_slow(v)


def _value_slow(v: Any) -> str:
    """Subclasses and the types otel-gpu never produces, in the official encoder's order."""
    v = _encoding.plain(v)
    if v is None:
        return "{}"
    if isinstance(v, bytes):
        return '{"bytesValue":"' + base64.b64encode(v).decode("ascii") + '"}'
    if isinstance(v, Mapping):
        kvs = ",".join(
            ['{"key":' + _quote(str(k)) + ',"value":' + _value(x) + "}" for k, x in v.items()]
        )
        return '{"kvlistValue":{"values":[' + kvs + "]}}" if kvs else '{"kvlistValue":{}}'
    return _value(v)


def _status(status: Any) -> str:
    if status is None:
        return ""
    code = status.status_code
    description = status.description
    if code is _UNSET and not description:
        return ',"status":{}'
    parts = []
    if description:
        parts.append('"message":' + _quote(description))
    if code.value:
        parts.append(f'"code":{code.value}')
    return ',"status":{' + ",".join(parts) + "}"


class JsonEncoder(_encoding.CachingEncoder):
    """Encodes spans to OTLP/JSON text, caching what repeats. Safe to share between threads.

    Fragment cache keys assume valid OTel values: a sequence holds one element type.
    """

    _close = "}}"  # a float's doubleValue, then its KeyValue
    _sep = ","

    def __init__(self) -> None:
        super().__init__()
        self._named: dict[tuple[str, Any], str] = {}  # (name, kind) -> their text
        self._tails: dict[Any, tuple[Any, str]] = {}  # fixed key -> (status, the span's rest)
        self._quoted: dict[str, str] = {}
        self._keys: dict[str, str] = {}
        self._last_status: tuple[Any, str] = (self, "")  # (status object, its text + "}")

    # ------------------------------------------------------------------ attributes

    def _key_prefix(self, key: str) -> str:
        prefix = '{"key":' + _quote(key) + ',"value":'
        if len(self._keys) < CACHE_MAX:
            self._keys[key] = prefix
        return prefix

    def _double_prefix(self, tag: Any, key: str) -> str:
        prefix = (self._keys.get(key) or self._key_prefix(key)) + '{"doubleValue":'
        self._remember(self._caches[tag][1], key, prefix, CACHE_MAX)
        return prefix

    def _nonfinite(self, prefix: str, value: float) -> str:
        return prefix + _nonfinite_text(value) + "}}"

    def _fragment(self, tag: Any, key: str, value: Any) -> str:
        return (self._keys.get(key) or self._key_prefix(key)) + _value(value) + "}"

    # ------------------------------------------------------------------ spans

    def _span(self, span: Any) -> str:
        ctx = span.context
        parent = span.parent
        if _TUPLE_CONTEXT and type(ctx) is SpanContext:
            trace_id, span_id, _, _, state, _ = ctx
        else:
            trace_id, span_id, state = ctx.trace_id, ctx.span_id, ctx.trace_state
        start, end = span.start_time, span.end_time
        if state or not (start and end):
            return self._span_in_full(span)
        named = self._named.get((span.name, span.kind))
        if named is None:
            named = self._name_and_kind(span.name, span.kind)
        # what follows the times: constant per `fixed` key and status for a span whose
        # attributes are all constant and that has no events or links of its own (level 1)
        fixed = getattr(span, "fixed", None)
        status = span.status
        if (
            fixed is not None
            and len(span.attributes) == fixed[1]
            and not (span.events or span.links or span.dropped_attributes)
            and not (span.dropped_events or span.dropped_links)
        ):
            kept = self._tails.get(fixed)
            if kept is not None and kept[0] is status:  # the pipeline's one UNSET status
                tail = kept[1]
            else:
                tail = self._rest(span)
                self._remember(self._tails, fixed, (status, tail), CACHE_MAX)
        else:
            tail = self._rest(span)
        if parent:
            if _TUPLE_CONTEXT and type(parent) is SpanContext:
                parent_id, remote = parent[1], parent[2]
            else:
                parent_id, remote = parent.span_id, parent.is_remote
            flags = 768 if remote else 256
            return _WITH_PARENT % (trace_id, span_id, parent_id, flags, named, start, end, tail)
        return _ROOT % (trace_id, span_id, named, start, end, tail)

    def _name_and_kind(self, name: str, kind: Any) -> str:
        text = (',"name":' + _quote(name) if name else "") + (
            ',"kind":1' if kind is _INTERNAL else f',"kind":{kind.value + 1}'
        )
        return self._remember(self._named, (name, kind), text)

    def _rest(self, span: Any) -> str:
        """What follows a span's times: its attributes, events, links, their dropped counts and
        its status, with the closing brace."""
        parts = []
        if span.attributes:
            out: list[str] = []
            self._span_attributes(_TAG, span, out)
            parts.append(',"attributes":[' + ",".join(out) + "]")
        if span.dropped_attributes:
            parts.append(f',"droppedAttributesCount":{span.dropped_attributes}')
        if span.events:
            parts.append(',"events":[' + ",".join([self._event(e) for e in span.events]) + "]")
        if span.dropped_events:
            parts.append(f',"droppedEventsCount":{span.dropped_events}')
        if span.links:
            parts.append(self._links(span.links))
        if span.dropped_links:
            parts.append(f',"droppedLinksCount":{span.dropped_links}')
        status = span.status
        last = self._last_status  # one tuple, so a concurrent update never pairs it wrongly
        if last[0] is not status:  # most spans share the pipeline's one UNSET status object
            last = self._last_status = (status, _status(status) + "}")
        parts.append(last[1])
        return "".join(parts)

    def _span_in_full(self, span: Any) -> str:
        """A span with a trace state, or without a start or end time: each field checked."""
        ctx = span.context
        parent = span.parent
        state = ctx.trace_state
        head = f'{{"traceId":"{ctx.trace_id:032x}","spanId":"{ctx.span_id:016x}"'
        if state:
            head += ',"traceState":' + _quote(",".join([f"{k}={v}" for k, v in state.items()]))
        if parent:
            flags = 768 if parent.is_remote else 256
            head += f',"parentSpanId":"{parent.span_id:016x}","flags":{flags}'
        else:
            head += ',"flags":256'
        named = self._named.get((span.name, span.kind))
        if named is None:
            named = self._name_and_kind(span.name, span.kind)
        head += named
        start, end = span.start_time, span.end_time
        head += f',"startTimeUnixNano":"{start}"' if start else ""
        head += f',"endTimeUnixNano":"{end}"' if end else ""
        return head + self._rest(span)

    def _event(self, event: Any) -> str:
        fields = [f'"timeUnixNano":"{event.timestamp}"'] if event.timestamp else []
        if event.name:
            quoted = self._quoted.get(event.name)
            if quoted is None:
                quoted = _quote(event.name)
                self._remember(self._quoted, event.name, quoted)
            fields.append('"name":' + quoted)
        attributes = self._joined(_TAG, event.attributes)
        if attributes:
            fields.append('"attributes":[' + attributes + "]")
        dropped = getattr(event, "dropped_attributes", 0)
        if dropped:
            fields.append(f'"droppedAttributesCount":{dropped}')
        return "{" + ",".join(fields) + "}"

    def _encode_links(self, links: Any) -> str:
        return ',"links":[' + ",".join([self._link(x) for x in links]) + "]"

    def _link(self, link: Any) -> str:
        ctx = link.context
        text = f'{{"traceId":"{ctx.trace_id:032x}","spanId":"{ctx.span_id:016x}"'
        attributes = self._joined(_TAG, link.attributes)
        if attributes:
            text += ',"attributes":[' + attributes + "]"
        dropped = getattr(link, "dropped_attributes", 0)
        if dropped:
            text += f',"droppedAttributesCount":{dropped}'
        return text + (',"flags":768}' if ctx.is_remote else ',"flags":256}')

    # ------------------------------------------------------------------ resource and scope

    def _encode_resource(self, resource: Any) -> str:
        attributes = self._joined(_TAG, getattr(resource, "attributes", None))
        return '{"resource":{' + ('"attributes":[' + attributes + "]" if attributes else "") + "}"

    def _encode_scope(self, scope: Any) -> str:
        fields = []
        if scope is not None:
            if scope.name:
                fields.append('"name":' + _quote(scope.name))
            if scope.version:
                fields.append('"version":' + _quote(scope.version))
            attributes = self._joined(_TAG, scope.attributes)
            if attributes:
                fields.append('"attributes":[' + attributes + "]")
        return '{"scope":{' + ",".join(fields) + "}"

    # ------------------------------------------------------------------ request

    def encode(self, spans: Iterable[Any]) -> str:
        """The ``ExportTraceServiceRequest`` of ``spans`` as one line of OTLP/JSON (no newline).

        Spans are grouped by resource, then scope, in first-seen order, as the official encoder does.
        """
        groups = group_spans(spans, self._span)
        if not groups:
            return "{}"
        blocks = []
        for resource, by_scope in groups.items():
            scopes = []
            for scope, texts in by_scope.items():
                schema = getattr(scope, "schema_url", None) if scope is not None else None
                scopes.append(
                    self._scope(scope)
                    + ',"spans":['
                    + ",".join(texts)
                    + "]"
                    + (',"schemaUrl":' + _quote(schema) if schema else "")
                    + "}"
                )
            schema = getattr(resource, "schema_url", None)
            blocks.append(
                self._resource(resource)
                + ',"scopeSpans":['
                + ",".join(scopes)
                + "]"
                + (',"schemaUrl":' + _quote(schema) if schema else "")
                + "}"
            )
        return '{"resourceSpans":[' + ",".join(blocks) + "]}"


_DEFAULT = JsonEncoder()


def encode_json(
    spans: Sequence[ReadableSpan] | Iterable[Any], encoder: JsonEncoder | None = None
) -> str:
    """``spans`` as one OTLP/JSON ``ExportTraceServiceRequest`` (no newline); ``"{}"`` for none."""
    return (encoder or _DEFAULT).encode(spans)


class JsonLinesSpanExporter(SpanExporter):
    """Appends one OTLP/JSON line per ``export()`` call, as the official ``FileSpanExporter`` does.

    ``path`` is opened for line-buffered append (UTF-8); otherwise ``stream``, otherwise stdout.
    Encoding runs outside the lock; only the write is serialised.
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, stream: IO[str] | None = None
    ) -> None:
        if path is not None and stream is not None:
            raise ValueError("Cannot specify both 'path' and 'stream'")
        self._owns_stream = path is not None
        if path is not None:
            self._stream: IO[str] = open(path, "a", encoding="utf-8", buffering=1)
        else:
            self._stream = stream if stream is not None else sys.stdout
        self._encoder = JsonEncoder()
        self._lock = threading.Lock()
        self._shutdown = False
        self._reported: set[str] = set()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            _logger.warning("Exporter already shutdown, ignoring call")
            return SpanExportResult.FAILURE
        try:
            line = self._encoder.encode(spans) + "\n" if spans else ""
            with self._lock:
                if self._stream.closed:
                    _logger.warning("Stream is closed, ignoring spans export call")
                    return SpanExportResult.FAILURE
                if line:
                    self._stream.write(line)
                self._stream.flush()
        except Exception as exc:
            # One line per kind of failure, not a traceback per batch: a full disk fails them all.
            kind = f"{type(exc).__name__}.{getattr(exc, 'errno', None)}"
            if kind not in self._reported:
                self._reported.add(kind)
                _logger.warning(
                    "Failed to write spans to %s: %s: %s (reported once; later batches that fail "
                    "the same way are refused silently)",
                    getattr(self._stream, "name", "the stream"),
                    type(exc).__name__,
                    exc,
                )
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._shutdown:
            _logger.warning("Exporter already shutdown, ignoring call")
            return
        self._shutdown = True
        _streams.close(self._stream, self._lock, self._owns_stream)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return _streams.flush(self._stream, self._lock)
