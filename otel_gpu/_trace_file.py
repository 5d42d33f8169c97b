"""Reading OTLP JSON Lines trace files into span trees, for ``otel-gpu show``.

Accepts what otel-gpu writes (one ``TracesData`` per line, hex ids, ``intValue`` as strings) and
what the OpenTelemetry Collector's file exporter and other producers write: the older
``instrumentationLibrarySpans``, snake_case keys, base64 ids, ``doubleValue`` as ``"NaN"`` or
``"Infinity"``, and gzip files. ``otel_gpu.ship`` parses lines into protobuf messages and needs
hex ids and ``scopeSpans``; here lines stay plain JSON, so one pass over a large file keeps
only the few fields the tree needs.
"""

from __future__ import annotations

import base64
import binascii
import gc
import gzip
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = [
    "Span",
    "Trace",
    "TraceFileError",
    "build_traces",
    "read_all",
    "read_spans",
    "tree_path",
]

_GZIP_MAGIC = b"\x1f\x8b"
_SERVICE = "service.name"
_SCOPE_KEYS = (
    "scopeSpans",
    "scope_spans",
    "instrumentationLibrarySpans",  # before OTLP 0.15, still written by some producers
    "instrumentation_library_spans",
)
_ERROR_CODES = (2, "2", "STATUS_CODE_ERROR", "ERROR")
# What the tree and the NaN/Inf analysis read; other attributes are not kept.
_SPAN_KEYS = (
    "otel_gpu.nonfinite",
    "otel_gpu.dump.",
    "otel_gpu.ring.dump.",
    "otel_gpu.stuck",
    "otel_gpu.events.omitted",
)
_UNUSED_FIELDS = (".stride", ".device", ".requires_grad", ".is_contiguous")
_STAT_KEYS = frozenset(
    {"otel_gpu.tensor", "numel", "nan_count", "inf_count", "otel_gpu.stats.note"}
)
_DOUBLES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class TraceFileError(ValueError):
    """A file cannot be read or one of its lines is not OTLP/JSON; starts with ``FILE:LINE:``."""


@dataclass(eq=False, slots=True)
class Span:
    """The fields of one span that the tree and the NaN/Inf analysis use."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start: int
    end: int
    error: bool
    message: str
    attrs: dict[str, Any]
    """The span's ``otel_gpu.*`` attributes that ``show`` uses (not stride, device…)."""
    stats: list[dict[str, Any]]
    """Of its ``otel_gpu.stats`` events, in order: tensor, numel, NaN/Inf counts and note."""
    where: str
    """``FILE:LINE`` the span was read from."""
    service: str = ""
    cycle: bool = False
    """Its parent is in the file, but linking to it would close a cycle: shown as a root."""
    parent: Span | None = None
    children: list[Span] = field(default_factory=list)


@dataclass(eq=False)
class Trace:
    trace_id: str
    roots: list[Span]
    count: int

    @property
    def start(self) -> int:
        return min((r.start for r in self.roots), default=0)


# --------------------------------------------------------------------------- reading


def _open(path: str) -> IO[str]:
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == _GZIP_MAGIC
    if gzipped:
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_spans(path: str, trace_id: str | None = None) -> Iterator[Span]:
    """The spans of ``path`` (gzip too), line by line; only trace ``trace_id`` (hex) if given.

    Raises :class:`TraceFileError` for a missing or unreadable file and at the first invalid line.
    Reading a large file is about twice as fast with the cyclic garbage collector paused (the
    spans hold no cycles until :func:`build_traces` links them): see :func:`read_all`.
    """
    lineno = 0
    try:
        with _open(path) as stream:
            for lineno, line in enumerate(stream, 1):
                if line.strip():
                    yield from _line_spans(line, f"{path}:{lineno}", trace_id)
    except FileNotFoundError:
        raise TraceFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceFileError(f"{path}: is a directory, not a trace file") from None
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        where = f"{path}:{lineno + 1}" if lineno else path
        raise TraceFileError(f"{where}: cannot read: {exc}") from None


def _get(node: dict[str, Any], camel: str, snake: str, default: Any = None) -> Any:
    return node.get(camel, node.get(snake, default))


def _list(node: Any, keys: tuple[str, ...], where: str) -> list[Any]:
    if not isinstance(node, dict):
        raise TraceFileError(f"{where}: expected a JSON object holding {keys[0]}")
    for key in keys:
        if key in node:
            value = node[key]
            if not isinstance(value, list):
                raise TraceFileError(f"{where}: {key} is not a list")
            return value
    return []


def _line_spans(text: str, where: str, only: str | None) -> Iterator[Span]:
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        at = "" if exc.msg.endswith(" at") else " at"  # "Unterminated string starting at"
        raise TraceFileError(f"{where}: not JSON ({exc.msg}{at} column {exc.colno})") from None
    if not isinstance(payload, dict):
        raise TraceFileError(f"{where}: expected a JSON object (OTLP TracesData)")
    if "resourceSpans" not in payload and "resource_spans" not in payload:
        if "resourceMetrics" in payload or "resourceLogs" in payload:
            return  # a collector file may mix signals; metrics and logs have no spans to show
        raise TraceFileError(f"{where}: not OTLP trace data (no resourceSpans)")
    for rs in _list(payload, ("resourceSpans", "resource_spans"), where):
        resource = rs.get("resource") if isinstance(rs, dict) else None
        service = str(_attributes(resource, where, _SERVICE.__eq__).get(_SERVICE, ""))
        for ss in _list(rs, _SCOPE_KEYS, where):
            for raw in _list(ss, ("spans",), where):
                if not isinstance(raw, dict):
                    raise TraceFileError(f"{where}: a span is not a JSON object")
                span = _span(raw, where, service)
                if only is None or span.trace_id == only:
                    yield span


def _span(raw: dict[str, Any], where: str, service: str) -> Span:
    name = str(raw.get("name", ""))
    at = f"{where}: span {name!r}"
    trace_id = _id(_get(raw, "traceId", "trace_id"), 16, "traceId", at)
    span_id = _id(_get(raw, "spanId", "span_id"), 8, "spanId", at)
    if trace_id is None or span_id is None:
        raise TraceFileError(f"{at}: no traceId or spanId (or an all-zero one)")
    attrs = _attributes(raw, at, _span_key)
    stats = [
        _attributes(event, at, _STAT_KEYS.__contains__)
        for event in _list(raw, ("events",), at)
        if isinstance(event, dict) and event.get("name") == "otel_gpu.stats"
    ]
    status = raw.get("status") or {}
    return Span(
        trace_id=trace_id,
        span_id=span_id,
        parent_id=_id(_get(raw, "parentSpanId", "parent_span_id"), 8, "parentSpanId", at),
        name=name,
        start=_int(_get(raw, "startTimeUnixNano", "start_time_unix_nano", 0), at, "start time"),
        end=_int(_get(raw, "endTimeUnixNano", "end_time_unix_nano", 0), at, "end time"),
        error=isinstance(status, dict) and status.get("code") in _ERROR_CODES,
        message=str(status.get("message", "")) if isinstance(status, dict) else "",
        attrs=attrs,
        stats=stats,
        where=where,
        service=service,
    )


def _id(raw: Any, size: int, key: str, where: str) -> str | None:
    """Lower-case hex of a hex or base64 id; None when absent, empty or all zeros."""
    if raw in (None, ""):
        return None
    data = None
    if isinstance(raw, str):
        try:
            data = (
                bytes.fromhex(raw) if len(raw) == 2 * size else base64.b64decode(raw, validate=True)
            )
        except (ValueError, binascii.Error):
            data = None
    if data is None or len(data) != size:
        raise TraceFileError(
            f"{where}: {key} {raw!r} is neither {2 * size} hex digits nor base64 of {size} bytes"
        )
    return data.hex() if any(data) else None


def _int(raw: Any, where: str, what: str = "intValue") -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise TraceFileError(f"{where}: {what} {raw!r} is not an integer") from None


def _attributes(node: Any, where: str, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The attributes of ``node`` whose key is ``wanted`` (converting only those keeps large
    files fast)."""
    out = {}
    for kv in _list(node, ("attributes",), where) if isinstance(node, dict) else ():
        if isinstance(kv, dict) and wanted(key := str(kv.get("key"))):
            out[sys.intern(key)] = _value(kv.get("value"), where)  # one copy per distinct key
    return out


def _span_key(key: str) -> bool:
    if key.startswith(("otel_gpu.input.", "otel_gpu.output.")):
        return not key.endswith(_UNUSED_FIELDS)
    return key.startswith(_SPAN_KEYS)


def _value(node: Any, where: str) -> Any:
    """An OTLP/JSON ``AnyValue`` as a Python value."""
    if not isinstance(node, dict) or not node:
        return None
    kind, raw = next(iter(node.items()))
    if kind in ("stringValue", "boolValue"):
        return raw
    kind = kind.replace("_value", "Value")
    if kind == "intValue":
        return _int(raw, where)
    if kind == "doubleValue":
        try:
            return _DOUBLES[raw] if isinstance(raw, str) and raw in _DOUBLES else float(raw)
        except (TypeError, ValueError):
            raise TraceFileError(f"{where}: doubleValue {raw!r} is not a number") from None
    if kind == "arrayValue":
        return [_value(v, where) for v in (raw or {}).get("values", [])]
    if kind == "kvlistValue":
        values = (raw or {}).get("values", [])
        return {str(kv.get("key")): _value(kv.get("value"), where) for kv in values}
    return raw  # stringValue, boolValue, bytesValue (base64 text)


def read_all(paths: Iterable[str], trace_id: str | None = None) -> list[Span]:
    """The spans of every file in ``paths``, read with the cyclic garbage collector paused."""
    enabled = gc.isenabled()
    gc.disable()  # every decoded line would otherwise trigger full collections of the spans so far
    try:
        return [span for path in paths for span in read_spans(path, trace_id)]
    finally:
        if enabled:
            gc.enable()


# --------------------------------------------------------------------------- trees


def build_traces(spans: Iterable[Span]) -> list[Trace]:
    """Group spans into traces (earliest first), link children (in start order).

    A span whose parent is not among the spans is a root; so is one whose parent link would
    close a cycle. A span id seen twice in a trace (a file given twice) is kept once.
    """
    by_trace: dict[str, dict[str, Span]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, {}).setdefault(span.span_id, span)
    traces = []
    for trace_id, members in by_trace.items():
        roots = []
        for span in members.values():
            parent = members.get(span.parent_id) if span.parent_id else None
            if parent is not None and not _is_ancestor(span, parent):
                span.parent = parent
                parent.children.append(span)
            else:
                span.cycle = parent is not None
                roots.append(span)
        for span in members.values():
            span.children.sort(key=_order)
        roots.sort(key=_order)
        traces.append(Trace(trace_id, roots, len(members)))
    traces.sort(key=lambda t: (t.start, t.trace_id))
    return traces


def _order(span: Span) -> tuple[int, str]:
    return span.start, span.span_id


def _is_ancestor(span: Span, node: Span | None) -> bool:
    while node is not None:
        if node is span:
            return True
        node = node.parent
    return False


def tree_path(span: Span, roots: list[Span]) -> list[str]:
    """Names from the root down to ``span``, ``name[i]`` where siblings share a name."""
    parts = []
    node: Span | None = span
    while node is not None:
        siblings = node.parent.children if node.parent else roots
        same = [s for s in siblings if s.name == node.name]
        parts.append(f"{node.name}[{same.index(node)}]" if len(same) > 1 else node.name)
        node = node.parent
    return parts[::-1]
