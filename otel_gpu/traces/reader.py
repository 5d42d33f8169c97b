"""Reading OTLP JSON Lines trace files into span trees, for ``otel-gpu show``.

Accepts what otel-gpu writes (one ``TracesData`` per line, hex ids, ``intValue`` as strings) and
what the OpenTelemetry Collector's file exporter and other producers write: the older
``instrumentationLibrarySpans``, snake_case keys, base64 ids, ``doubleValue`` as ``"NaN"`` or
``"Infinity"``, and gzip files. ``otel_gpu.traces.ship`` reads lines with :func:`read_lines` and
:func:`load_json` too, then parses them into protobuf messages (it needs hex ids and
``scopeSpans``); here lines stay plain JSON, so one pass over a large file keeps only the few
fields the tree needs.

Files may be hostile: each line is bounded (:data:`MAX_LINE_BYTES`, :data:`MAX_DEPTH`) and every
problem is a :class:`TraceFileError` naming ``FILE:LINE``, never another exception.
"""

from __future__ import annotations

import base64
import binascii
import gc
import gzip
import io
import json
import math
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from otel_gpu import _text
from otel_gpu._text import brief
from otel_gpu.attributes import (
    CUDA_FAULT,
    DUMP_PREFIX,
    EVENT_STATS,
    EVENTS_OMITTED,
    INPUT_PREFIX,
    NONFINITE,
    OUTPUT_PREFIX,
    REQUEST_ID,
    STATS_INF_COUNT,
    STATS_NAN_COUNT,
    STATS_NOTE,
    STATS_NUMEL,
    STATS_TENSOR,
    STUCK,
)
from otel_gpu.traces.decode import int64, unix_nano

__all__ = [
    "MAX_DEPTH",
    "MAX_LINE_BYTES",
    "Line",
    "Problem",
    "Span",
    "TraceFileError",
    "fill",
    "hex_id",
    "list_at",
    "load_json",
    "read_all",
    "read_lines",
    "read_spans",
    "refused",
    "resource_spans",
    "spans_in",
    "too_deep",
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
    NONFINITE,
    "otel_gpu.batch.",  # a batch step's counts: show --request, workloads --by-request
    CUDA_FAULT,  # otel_gpu.cuda.fault*: show --fault (traces/fault.py)
    DUMP_PREFIX,
    "otel_gpu.ring.dump.",
    "otel_gpu.device.",  # device time and memory per call
    STUCK,
    EVENTS_OMITTED,
)
_UNUSED_FIELDS = (".stride", ".device", ".requires_grad", ".is_contiguous")
_STAT_KEYS = frozenset({STATS_TENSOR, STATS_NUMEL, STATS_NAN_COUNT, STATS_INF_COUNT, STATS_NOTE})
_DOUBLES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

MAX_LINE_BYTES = 64 * 1024 * 1024
"""The longest line read: 64 MiB. otel-gpu writes one export batch (at most 512 spans) a line,
a few MiB at most; a collector's file exporter writes one batch a line too."""
MAX_DEPTH = _text.MAX_JSON_DEPTH
too_deep = _text.too_deep
"""The deepest nesting of JSON arrays and objects read in a line. OTLP trace data needs 12
levels down to an attribute's value, and 3 more for each array or map value nested in it."""
_LONG = f"line longer than {MAX_LINE_BYTES // 2**20} MiB (the most a line may hold): skipped"
_DEEP = f"arrays and objects nested deeper than {MAX_DEPTH} levels (the most read)"
_SKIP_CHUNK = 2**20


class TraceFileError(ValueError):
    """A file cannot be read or one of its lines is not OTLP/JSON; starts with ``FILE:LINE:``.

    ``torn``: the file ends inside a line (its last line has no newline and is not JSON, or a
    gzip stream stops short), as a writer killed mid-line leaves it. ``whole_file``: the file
    could not be read (to the end); nothing more comes from it.
    """

    def __init__(self, message: str, *, torn: bool = False, whole_file: bool = False) -> None:
        super().__init__(message)
        self.torn = torn
        self.whole_file = whole_file


Problem = Callable[[TraceFileError], None]
"""Told about each invalid line or unreadable file; the reader goes on with the next line."""


def refused(problems: list[TraceFileError], say: Callable[[str], None], what: str) -> bool:
    """Whether a command that reads whole runs stops at ``problems``: each of the first ten is
    said, and any but a torn last line (a writer killed mid-line) stops it, saying ``nothing
    {what}``."""
    for problem in problems[:10]:
        say(str(problem))
    if any(not p.torn for p in problems):
        say(f"nothing {what}: fix or leave out the files above")
        return True
    return False


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
    pending: bool = False
    """Read without ``attrs`` and ``stats`` (``attributes=False``): :func:`fill` reads them."""
    cycle: bool = False
    """Its parent is in the file, but linking to it would close a cycle: shown as a root."""
    links: tuple[tuple[str, str, str], ...] = ()
    """Its links: trace id, span id (hex) and ``otel_gpu.request.id`` ("" when absent)."""
    parent: Span | None = None
    children: list[Span] = field(default_factory=list)


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class Line:
    """One non-blank line of a trace file, as bytes (decoded by :func:`load_json`)."""

    path: str
    number: int
    """Counted from 1, blank lines included."""
    raw: bytes
    torn: bool
    """The file's last line, with no newline after it: a writer may have died mid-line."""

    @property
    def where(self) -> str:
        """``FILE:LINE``, for messages."""
        return f"{self.path}:{self.number}"


def _open(path: str) -> gzip.GzipFile | io.BufferedReader:
    """Bytes, gzip or not by the content's magic (whatever the name): a text stream decodes
    ahead in chunks, so its UnicodeDecodeError would name the wrong line and end the file."""
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == _GZIP_MAGIC
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def read_lines(path: str, problem: Problem) -> Iterator[Line]:
    """The non-blank lines of ``path`` (gzip too), each at most :data:`MAX_LINE_BYTES`.

    A longer line is reported to ``problem`` and skipped, without holding it in memory. A file
    that cannot be read (missing, a directory, a gzip stream cut short) is reported with
    ``whole_file`` and ends the iteration.
    """
    lineno = 0
    try:
        with _open(path) as stream:
            while True:
                raw = stream.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    return
                lineno += 1
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    while raw and not raw.endswith(b"\n"):  # skip to the next line
                        raw = stream.readline(_SKIP_CHUNK)
                    problem(TraceFileError(f"{path}:{lineno}: {_LONG}"))
                elif raw.strip():
                    yield Line(path, lineno, raw, not raw.endswith(b"\n"))
    except FileNotFoundError:
        problem(TraceFileError(f"{path}: no such file", whole_file=True))
    except IsADirectoryError:
        problem(TraceFileError(f"{path}: is a directory, not a file", whole_file=True))
    except (OSError, EOFError, zlib.error) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        after = f" after line {lineno}" if lineno else ""
        # a gzip stream that stops short is what a writer killed mid-write leaves
        torn = isinstance(exc, EOFError)
        problem(TraceFileError(f"{path}: cannot read{after}: {why}", torn=torn, whole_file=True))


def load_json(raw: bytes, where: str, torn: bool = False) -> Any:
    """One line as JSON, within the bounds; :class:`TraceFileError` naming ``where`` if not.

    ``torn`` (no newline after the file's last line): a line that is not UTF-8 or not JSON is
    reported as cut short, with ``torn`` set, so a reader can show the rest.
    """
    cut = " (the last line, cut short: no newline after it)" if torn else ""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})"
        raise TraceFileError(message + cut, torn=torn) from None
    if too_deep(raw):
        raise TraceFileError(f"{where}: {_DEEP}")
    try:
        # without its newline, a line cut short reads as cut short
        return json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        at = "" if exc.msg.endswith(" at") else " at"  # "Unterminated string starting at"
        message = f"{where}: not JSON ({exc.msg}{at} column {exc.colno})"
        raise TraceFileError(message + cut, torn=torn) from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise TraceFileError(f"{where}: not JSON ({exc})") from None
    except RecursionError:  # unbalanced brackets that too_deep left to the parser
        raise TraceFileError(f"{where}: {_DEEP}") from None


def read_spans(
    path: str,
    trace_id: str | None = None,
    problem: Problem | None = None,
    attributes: bool = True,
) -> Iterator[Span]:
    """The spans of ``path`` (gzip too), line by line; only trace ``trace_id`` (hex) if given.

    Each invalid line or unreadable file is reported to ``problem`` and skipped; without one,
    :class:`TraceFileError` is raised at the first.
    Reading a large file is about twice as fast with the cyclic garbage collector paused (the
    spans hold no cycles until :func:`otel_gpu.traces.trees.build_traces` links them): see
    :func:`read_all`.
    """
    report = _raise if problem is None else problem
    for line in read_lines(path, report):
        try:
            payload = load_json(line.raw, line.where, line.torn)
            _check_ints(line.raw, line.where)
            spans = list(_line_spans(payload, line.where, trace_id, attributes))
        except TraceFileError as exc:
            report(exc)
            continue
        yield from spans


# An intValue that may be outside what ship takes: 20 digits or more (int64 holds 19), or a
# fraction or exponent. Scanned in the raw line (C speed), so the tree, which converts only the
# attributes it draws, still refuses every line ship refuses for one.
_NUMBER = rb"-?(?:\d{20,}|\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)"
_SUSPECT_INT = re.compile(rb'"int(?:V|_v)alue"\s*:\s*("' + _NUMBER + rb'"|' + _NUMBER + rb")")


def _check_ints(raw: bytes, where: str) -> None:
    for match in _SUSPECT_INT.finditer(raw):
        token = match.group(1)
        value: Any = token[1:-1].decode() if token.startswith(b'"') else json.loads(token)
        _int(value, where)


def _raise(exc: TraceFileError) -> None:
    raise exc


def _get(node: dict[str, Any], camel: str, snake: str, default: Any = None) -> Any:
    return node.get(camel, node.get(snake, default))


def list_at(node: Any, keys: tuple[str, ...], where: str) -> list[Any]:
    """``node[key]`` for the first of ``keys`` present (camelCase and snake_case spellings), []
    when none is; a :class:`TraceFileError` naming ``where`` when it is not a list."""
    if not isinstance(node, dict):
        raise TraceFileError(f"{where}: expected a JSON object holding {keys[0]}")
    for key in keys:
        if key in node:
            value = node[key]
            if not isinstance(value, list):
                raise TraceFileError(f"{where}: {key} is not a list")
            return value
    return []


_OTHER_SIGNALS = ("resourceMetrics", "resourceLogs")


def resource_spans(
    payload: Any, where: str, other_signals: tuple[str, ...] = _OTHER_SIGNALS
) -> list[Any]:
    """A line's ``ResourceSpans``: [] for a line of one of ``other_signals`` (a collector file
    may mix signals; metrics and logs have no spans), a :class:`TraceFileError` for anything else
    that is not OTLP trace data."""
    if not isinstance(payload, dict):
        raise TraceFileError(f"{where}: expected a JSON object (OTLP TracesData)")
    if "resourceSpans" not in payload and "resource_spans" not in payload:
        if any(key in payload for key in other_signals):
            return []
        raise TraceFileError(f"{where}: not OTLP trace data (no resourceSpans)")
    return list_at(payload, ("resourceSpans", "resource_spans"), where)


def spans_in(
    rs: Any, where: str, scope_keys: tuple[str, ...] = _SCOPE_KEYS
) -> Iterator[dict[str, Any]]:
    """The spans of one ``ResourceSpans``, scope by scope; a :class:`TraceFileError` for a span
    that is not a JSON object."""
    for ss in list_at(rs, scope_keys, where):
        for raw in list_at(ss, ("spans",), where):
            if not isinstance(raw, dict):
                raise TraceFileError(f"{where}: a span is not a JSON object")
            yield raw


def _line_spans(
    payload: Any, where: str, only: str | None, attributes: bool = True
) -> Iterator[Span]:
    for rs in resource_spans(payload, where):
        resource = rs.get("resource") if isinstance(rs, dict) else None
        service = str(_attributes(resource, where, _SERVICE.__eq__).get(_SERVICE, ""))
        for raw in spans_in(rs, where):
            span = _span(raw, where, service, attributes)
            if only is None or span.trace_id == only:
                yield span


def _span(raw: dict[str, Any], where: str, service: str, attributes: bool = True) -> Span:
    name = str(raw.get("name", ""))
    at = f"{where}: span {brief(name)}"
    trace_id = hex_id(_get(raw, "traceId", "trace_id"), 16, "traceId", at)
    span_id = hex_id(_get(raw, "spanId", "span_id"), 8, "spanId", at)
    if trace_id is None or span_id is None:
        raise TraceFileError(f"{at}: no traceId or spanId (or an all-zero one)")
    attrs, stats = _details(raw, at) if attributes else ({}, [])
    status = raw.get("status") or {}
    return Span(
        trace_id=trace_id,
        span_id=span_id,
        parent_id=hex_id(_get(raw, "parentSpanId", "parent_span_id"), 8, "parentSpanId", at),
        name=name,
        start=_time(
            _get(raw, "startTimeUnixNano", "start_time_unix_nano", 0), at, "startTimeUnixNano"
        ),
        end=_time(_get(raw, "endTimeUnixNano", "end_time_unix_nano", 0), at, "endTimeUnixNano"),
        error=isinstance(status, dict) and status.get("code") in _ERROR_CODES,
        message=str(status.get("message", "")) if isinstance(status, dict) else "",
        attrs=attrs,
        stats=stats,
        where=where,
        service=service,
        pending=not attributes,
        links=_links(raw, at) if raw.get("links") else (),
    )


def _links(raw: dict[str, Any], at: str) -> tuple[tuple[str, str, str], ...]:
    """A span's links (a batch step's, to the requests it served). Lenient: a link that is not
    an object, or without valid ids, is left out rather than refusing the span's line (the tree
    never needed links; only ``show --request`` and ``workloads --by-request`` read them)."""
    links = raw.get("links")
    out = []
    for link in links if isinstance(links, list) else ():
        if not isinstance(link, dict):
            continue
        try:
            trace_id = hex_id(_get(link, "traceId", "trace_id"), 16, "link traceId", at)
            span_id = hex_id(_get(link, "spanId", "span_id"), 8, "link spanId", at)
            rid = _attributes(link, at, REQUEST_ID.__eq__).get(REQUEST_ID)
        except TraceFileError:
            continue
        if trace_id is None or span_id is None:
            continue
        out.append((trace_id, span_id, "" if rid is None else str(rid)))
    return tuple(out)


def _details(raw: dict[str, Any], at: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The attributes ``show`` uses and the ``otel_gpu.stats`` events of one span."""
    attrs = _span_attributes(raw, at)
    stats = [
        _attributes(event, at, _STAT_KEYS.__contains__)
        for event in list_at(raw, ("events",), at)
        if isinstance(event, dict) and event.get("name") == EVENT_STATS
    ]
    return attrs, stats


_LOWER_HEX = "0123456789abcdef"


def hex_id(raw: Any, size: int, key: str, where: str) -> str | None:
    """Lower-case hex of a hex or base64 id; None when absent, empty or all zeros."""
    if type(raw) is str and len(raw) == 2 * size and not raw.strip(_LOWER_HEX):
        return raw if raw.strip("0") else None  # already lower-case hex: every span's ids
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
            f"{where}: {key} {brief(raw)} is neither {2 * size} hex digits nor base64 of {size} bytes"
        )
    return data.hex() if any(data) else None


def _time(raw: Any, where: str, key: str) -> int:
    """A span's time as ``ship`` takes it (:func:`otel_gpu.traces.decode.unix_nano`)."""
    try:
        return unix_nano(raw)
    except ValueError as exc:
        raise TraceFileError(
            f"{where}: {key} {brief(raw)} is not a time in nanoseconds ({exc})"
        ) from None


def _int(raw: Any, where: str) -> int:
    """An ``intValue`` as ``ship`` takes it (:func:`otel_gpu.traces.decode.int64`), fast for a
    plain one. ``isdecimal``, not ``isdigit``: "²" is a digit that ``int()`` refuses."""
    if type(raw) is str and raw.isdecimal() and len(raw) < 19:
        return int(raw)  # below 10**18: inside int64 without a range check
    try:
        return int64(raw)
    except ValueError as exc:
        raise TraceFileError(
            f"{where}: intValue {brief(raw)} is not a 64-bit integer ({exc})"
        ) from None


def _attributes(node: Any, where: str, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The attributes of ``node`` whose key is ``wanted`` (converting only those keeps large
    files fast)."""
    out = {}
    for kv in list_at(node, ("attributes",), where) if isinstance(node, dict) else ():
        if isinstance(kv, dict) and wanted(key := str(kv.get("key"))):
            out[sys.intern(key)] = _value(kv.get("value"), where)  # one copy per distinct key
    return out


_KEPT: dict[str, bool] = {}
"""Whether :func:`_span_key` keeps a key, per distinct key (a file repeats a few hundred)."""
_KEPT_MAX = 1 << 16  # a hostile file's distinct keys are decided one by one past this


def _span_attributes(node: dict[str, Any], where: str) -> dict[str, Any]:
    """:func:`_attributes` with :func:`_span_key`, inlined: this loop runs once per attribute
    of every span of the file, and most attributes are not kept."""
    out = {}
    kept = _KEPT
    for kv in list_at(node, ("attributes",), where):
        if not isinstance(kv, dict):
            continue
        key = kv.get("key")
        if type(key) is not str:
            key = str(key)
        keep = kept.get(key)
        if keep is None:
            keep = _span_key(key)
            if len(kept) < _KEPT_MAX:
                kept[key] = keep
        if keep:
            out[sys.intern(key)] = _value(kv.get("value"), where)
    return out


def _span_key(key: str) -> bool:
    if key.startswith((INPUT_PREFIX, OUTPUT_PREFIX)):
        return not key.endswith(_UNUSED_FIELDS)
    return key.startswith(_SPAN_KEYS)


def _value(node: Any, where: str) -> Any:
    """An OTLP/JSON ``AnyValue`` as a Python value (None for a shape that is not one)."""
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
        except (TypeError, ValueError, OverflowError):
            raise TraceFileError(f"{where}: doubleValue {brief(raw)} is not a number") from None
    if kind == "arrayValue":
        values = _values(raw)
        try:  # a shape or stride: whole numbers, converted without a call per element
            ints = [int64(v["intValue"]) for v in values if len(v) == 1]
            if len(ints) == len(values):
                return ints
        except (KeyError, TypeError, ValueError, OverflowError):
            pass  # the general path converts or names what is wrong
        return [_value(v, where) for v in values]
    if kind == "kvlistValue":
        return {
            str(kv.get("key")): _value(kv.get("value"), where)
            for kv in _values(raw)
            if isinstance(kv, dict)
        }
    return raw  # stringValue, boolValue, bytesValue (base64 text)


def _values(raw: Any) -> list[Any]:
    values = raw.get("values", []) if isinstance(raw, dict) else []
    return values if isinstance(values, list) else []


def read_all(
    paths: Iterable[str],
    trace_id: str | None = None,
    problem: Problem | None = None,
    attributes: bool = True,
) -> list[Span]:
    """The spans of every file in ``paths``, read with the cyclic garbage collector paused.

    Invalid lines and unreadable files go to ``problem`` (see :func:`read_spans`). Without
    ``attributes`` the spans are ``pending``: a tree needs the ids, names, times and status of
    every span, but the attributes only of those it draws, which :func:`fill` reads."""
    enabled = gc.isenabled()
    gc.disable()  # every decoded line would otherwise trigger full collections of the spans so far
    try:
        return [span for path in paths for span in read_spans(path, trace_id, problem, attributes)]
    finally:
        if enabled:
            gc.enable()


def fill(spans: Iterable[Span]) -> None:
    """Read the ``attrs`` and ``stats`` of the ``pending`` spans among ``spans``.

    Only the lines they came from are parsed again. A file that changed since the first reading
    leaves a span it no longer holds as it was, without attributes."""
    wanted: dict[str, dict[int, dict[str, list[Span]]]] = {}
    for span in spans:
        if span.pending:
            path, _, number = span.where.rpartition(":")
            by_id = wanted.setdefault(path, {}).setdefault(int(number), {})
            by_id.setdefault(span.span_id, []).append(span)
    for path, lines in wanted.items():
        for line in read_lines(path, _ignore):
            found = lines.pop(line.number, None)
            if found is None:
                continue
            try:
                payload = load_json(line.raw, line.where, line.torn)
                for raw in _raw_spans(payload, line.where):
                    span_id = hex_id(_get(raw, "spanId", "span_id"), 8, "spanId", line.where)
                    for span in found.pop(span_id or "", ()):
                        span.attrs, span.stats = _details(raw, line.where)
                        span.pending = False
            except TraceFileError:
                continue  # the line changed since: its spans stay without attributes
            if not lines:
                break  # every line needed was read


def _ignore(_exc: TraceFileError) -> None:
    """Problems were reported when the file was first read."""


def _raw_spans(payload: Any, where: str) -> Iterator[dict[str, Any]]:
    for rs in list_at(payload, ("resourceSpans", "resource_spans"), where):
        for ss in list_at(rs, _SCOPE_KEYS, where):
            for raw in list_at(ss, ("spans",), where):
                if isinstance(raw, dict):
                    yield raw
