"""Calls read from trace files with every recorded argument, for ``workloads`` and ``diff``.

``show`` keeps only what its tree draws (:mod:`otel_gpu.traces.reader` drops strides, scalar
values' neighbours and most statistics); these two commands need all of a call's
``otel_gpu.input.*``/``otel_gpu.output.*`` fields, its ``otel_gpu.stats`` events whole, its
dump directory, its device time and the resource it came from. Lines are read and bounded by
:func:`reader.read_lines` and :func:`reader.load_json`, so every problem is a
:class:`reader.TraceFileError` naming ``FILE:LINE``, torn last lines included, as for ``show``
and ``ranks``. Nothing read here runs code: it is JSON turned into plain values.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from otel_gpu._text import brief
from otel_gpu.attributes import (
    COMPILED,
    DUMP_DIR,
    EVENT_STATS,
    INPUT_PREFIX,
    OUTPUT_PREFIX,
    RECOVERED,
    SNAPSHOT_SPAN_NAME,
    STATS_TENSOR,
    STUCK,
)
from otel_gpu.traces import reader
from otel_gpu.traces.decode import unix_nano

__all__ = [
    "DEVICE_DURATION",
    "RANK_KEY",
    "CallRecord",
    "link",
    "load_calls",
]

DEVICE_DURATION = "otel_gpu.device.duration"
"""Span attribute: the call's time on the device, in seconds (a float), where it was measured."""
RANK_KEY = "otel_gpu.rank"
"""Resource attribute naming the process's rank (as ``otel-gpu ranks`` reads it)."""
_SERVICE, _VERSION = "service.name", "otel_gpu.version"
# as this reader has always taken them: its own keys, not quite the span reader's defaults
_SCOPES = ("scopeSpans", "scope_spans", "instrumentationLibrarySpans")
_OTHER_SIGNALS = ("resourceMetrics", "resource_metrics", "resourceLogs", "resource_logs")
_DOUBLES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_ERROR_CODES = (2, "2", "STATUS_CODE_ERROR", "ERROR")


@dataclass(eq=False, slots=True)
class CallRecord:
    """One call's span, with its arguments grouped by path (``inputs["q"]["shape"]``)."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start: int
    end: int
    where: str
    service: str = ""
    version: str = ""
    rank: int | None = None
    error: bool = False
    compiled: bool = False
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``input.<path>``/``output.<path>`` -> the attributes of its ``otel_gpu.stats`` event."""
    dump_dir: str | None = None
    device_s: float | None = None
    children: list[CallRecord] = field(default_factory=list)
    parent: CallRecord | None = None

    @property
    def host_s(self) -> float:
        return max(self.end - self.start, 0) / 1e9

    @property
    def recorded(self) -> bool:
        """Whether it carries level-3 metadata (an input or output attribute)."""
        return bool(self.inputs or self.outputs)


def load_calls(
    paths: Iterable[str], problem: reader.Problem, linked: bool = True
) -> list[CallRecord]:
    """Every call span of ``paths`` (stuck-call reports, snapshots and recovered spans left
    out), linked to its parent and children in start order (unless ``linked`` is False: a
    reader that never walks the tree saves the work); problems go to ``problem``."""
    calls: list[CallRecord] = []
    enabled = gc.isenabled()
    gc.disable()  # as reader.read_all: the records hold no cycles until linked
    try:
        for path in paths:
            for line in reader.read_lines(path, problem):
                try:
                    payload = reader.load_json(line.raw, line.where, line.torn)
                    calls.extend(_line(payload, line.where))
                except reader.TraceFileError as exc:
                    problem(exc)
        if linked:
            link(calls)
    finally:
        if enabled:
            gc.enable()
    return calls


def link(calls: list[CallRecord]) -> None:
    """Link each call to its parent among ``calls``; children in start order.

    A hostile file's parent ids may loop: of each loop, the link of the call that comes last in
    ``calls`` is left out (it is the link that, added in order, would close the loop). Linear in
    the number of calls whatever the depth: every call is walked up from once (a parent chain
    20,000 deep took 24 s when each link walked its chain to look for a loop)."""
    by_id: dict[tuple[str, str], int] = {}
    for i, call in enumerate(calls):
        by_id.setdefault((call.trace_id, call.span_id), i)
    up = [by_id.get((c.trace_id, c.parent_id), -1) if c.parent_id else -1 for c in calls]
    state = bytearray(len(calls))  # 0 not seen, 1 on the walk under way, 2 done
    for i in range(len(calls)):
        walk = []
        j = i
        while j != -1 and not state[j]:
            state[j] = 1
            walk.append(j)
            j = up[j]
        if j != -1 and state[j] == 1:  # the walk came back to itself: a loop
            loop = walk[walk.index(j) :]
            up[max(loop)] = -1
        for k in walk:
            state[k] = 2
    for call, j in zip(calls, up):
        if j != -1:
            parent = calls[j]
            call.parent = parent
            parent.children.append(call)
    for call in calls:
        call.children.sort(key=lambda c: (c.start, c.span_id))


def _line(payload: Any, where: str) -> Iterator[CallRecord]:
    for rs in reader.resource_spans(payload, where, _OTHER_SIGNALS):
        resource = rs.get("resource") if isinstance(rs, dict) else None
        res = _attributes(resource, where) if isinstance(resource, dict) else {}
        rank = res.get(RANK_KEY)
        try:
            number = int(rank) if rank is not None else None
        except (TypeError, ValueError):
            raise reader.TraceFileError(
                f"{where}: resource attribute {RANK_KEY} is {brief(rank)}, not a whole number"
            ) from None
        for raw in reader.spans_in(rs, where, _SCOPES):
            call = _span(raw, where)
            if call is not None:
                call.service = str(res.get(_SERVICE, ""))
                call.version = str(res.get(_VERSION, ""))
                call.rank = number
                yield call


def _get(node: dict[str, Any], camel: str, snake: str, default: Any = None) -> Any:
    if camel in node:  # otel-gpu's and the collector's spelling: one lookup
        return node[camel]
    return node.get(snake, default)


def _span(raw: dict[str, Any], where: str) -> CallRecord | None:
    name = raw.get("name", "")
    if type(name) is not str:
        name = str(name)
    at = f"{where}: span {brief(name) if len(name) > 60 else name!r}"
    trace_id = reader.hex_id(_get(raw, "traceId", "trace_id"), 16, "traceId", at)
    span_id = reader.hex_id(_get(raw, "spanId", "span_id"), 8, "spanId", at)
    if trace_id is None or span_id is None:
        raise reader.TraceFileError(f"{at}: no traceId or spanId (or an all-zero one)")
    attrs, inputs, outputs = _span_attributes(raw, at)
    if attrs.get(STUCK) is True or attrs.get(RECOVERED) is True or name == SNAPSHOT_SPAN_NAME:
        return None  # reports about calls, or calls that never ended: not calls to count
    status = raw.get("status") or {}
    call = CallRecord(
        name=name,
        trace_id=trace_id,
        span_id=span_id,
        parent_id=reader.hex_id(_get(raw, "parentSpanId", "parent_span_id"), 8, "parentSpanId", at),
        start=_time(_get(raw, "startTimeUnixNano", "start_time_unix_nano", 0), at),
        end=_time(_get(raw, "endTimeUnixNano", "end_time_unix_nano", 0), at),
        where=where,
        error=isinstance(status, dict) and status.get("code") in _ERROR_CODES,
        compiled=attrs.get(COMPILED) is True,
        inputs=inputs,
        outputs=outputs,
    )
    dump = attrs.get(DUMP_DIR)
    call.dump_dir = dump if isinstance(dump, str) and dump else None
    device = attrs.get(DEVICE_DURATION)
    if isinstance(device, (int, float)) and not isinstance(device, bool):
        call.device_s = float(device) if math.isfinite(device) and device >= 0 else None
    for event in reader.list_at(raw, ("events",), at):
        if isinstance(event, dict) and event.get("name") == EVENT_STATS:
            stat = _attributes(event, at)
            tensor = stat.pop(STATS_TENSOR, None)
            if isinstance(tensor, str):
                call.stats[tensor] = stat
    return call


def _time(raw: Any, where: str) -> int:
    if type(raw) is str and raw.isdecimal() and len(raw) < 20:
        return int(raw)  # below 10**19: inside fixed64 without a range check
    try:
        return unix_nano(raw)
    except ValueError as exc:
        raise reader.TraceFileError(
            f"{where}: time {brief(raw)} is not in nanoseconds ({exc})"
        ) from None


_Place = tuple[int, str, str] | None
_PLACES: dict[str, _Place] = {}
"""Per distinct key (a file repeats a few hundred): where :func:`_span_attributes` puts it."""
_PLACES_MAX = 1 << 16  # past this, a hostile file's keys are placed one by one
_OTHER_KEYS = frozenset({STUCK, RECOVERED, COMPILED, DUMP_DIR, DEVICE_DURATION})
_UNUSED = frozenset({"device", "requires_grad"})  # fields neither command reads


def _place(key: str) -> _Place:
    """(0 input, 1 output, 2 other; argument path; field), or None for a key not kept."""
    for side, prefix in ((0, INPUT_PREFIX), (1, OUTPUT_PREFIX)):
        if key.startswith(prefix):
            path, dot, name = key[len(prefix) :].rpartition(".")
            return (side, path, name) if dot and path and name not in _UNUSED else None
    return (2, key, "") if key in _OTHER_KEYS else None


def _span_attributes(
    node: dict[str, Any], where: str
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The span's other kept attributes, and its inputs and outputs grouped by argument path
    (``{"q": {"shape": [..], "dtype": ..}, "kv.0": {...}}``), in one pass: it runs for every attribute of every span
    of the file, and most keys are placed from :data:`_PLACES`."""
    attrs: dict[str, Any] = {}
    sides: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]] = ({}, {})
    places = _PLACES
    for kv in reader.list_at(node, ("attributes",), where):
        # subscripts, not .get(): a dict subscript is a bytecode, .get() a method call, and
        # this loop runs for every attribute of the file (a missing key is the rare case)
        if type(kv) is not dict:  # JSON objects are plain dicts
            continue
        try:
            key = kv["key"]
        except KeyError:
            key = None
        if type(key) is not str:
            key = str(key)
        if key in places:  # most keys are placed already
            place = places[key]
        else:
            place = _place(key)
            if len(places) < _PLACES_MAX:
                places[key] = place
        if place is None:
            continue
        try:
            cell = kv["value"]
        except KeyError:
            cell = None
        # the common kinds inline: this line runs for every kept attribute of the file
        if type(cell) is dict and len(cell) == 1:
            [(kind, raw)] = cell.items()
            if kind == "stringValue" and type(raw) is str:
                value: Any = raw
            elif kind == "arrayValue":
                value = _digits(raw)
                if value is None:
                    value = _value(cell, where, 0)
            elif kind == "boolValue" and type(raw) is bool:
                value = raw
            elif kind == "intValue" and type(raw) is str and raw.isdecimal() and len(raw) < 19:
                value = int(raw)
            else:
                value = _value(cell, where, 0)
        else:
            value = _value(cell, where, 0)
        side, path, name = place
        if side == 2:
            attrs[key] = value
        else:
            grouped = sides[side]
            if path in grouped:
                grouped[path][name] = value
            else:
                grouped[path] = {name: value}
    return attrs, sides[0], sides[1]


def _digits(raw: Any) -> list[int] | None:
    """A shape or a stride (an array of small non-negative ``intValue`` strings) in a few
    C-speed passes; None for any other array, which :func:`_value` converts or refuses. A file
    repeats a few shapes: each distinct one is converted once (:data:`_ARRAYS`), and every
    call gets its own list."""
    try:
        texts = tuple([v["intValue"] for v in raw["values"]])
        known = _ARRAYS.get(texts)
        if known is not None:
            return list(known)
        joined = "".join(texts)
        # under 19 digits in all (a shape's usual case), no element can have 19 or more
        if joined.isdigit() and (len(joined) < 19 or max(map(len, texts)) < 19):
            value = tuple(map(int, texts))
            if len(_ARRAYS) < _PLACES_MAX:
                _ARRAYS[texts] = value
            return list(value)
    except (KeyError, TypeError, ValueError):
        pass
    return None


_ARRAYS: dict[tuple[str, ...], tuple[int, ...]] = {}


def _attributes(node: dict[str, Any], where: str) -> dict[str, Any]:
    out = {}
    for kv in reader.list_at(node, ("attributes",), where):
        if isinstance(kv, dict):
            out[str(kv.get("key"))] = _value(kv.get("value"), where, 0)
    return out


def _value(node: Any, where: str, depth: int) -> Any:
    """An OTLP/JSON ``AnyValue`` as a plain value (None for a shape that is not one); the
    nesting is bounded by :func:`reader.load_json` already."""
    if not isinstance(node, dict) or not node:
        return None
    kind, raw = next(iter(node.items()))
    if kind == "stringValue":
        return raw if isinstance(raw, str) else None
    kind = kind.replace("_value", "Value")
    if kind == "intValue":
        return reader._int(raw, where)
    if kind == "doubleValue":
        try:
            return _DOUBLES[raw] if isinstance(raw, str) and raw in _DOUBLES else float(raw)
        except (TypeError, ValueError, OverflowError):
            raise reader.TraceFileError(
                f"{where}: doubleValue {brief(raw)} is not a number"
            ) from None
    if kind == "arrayValue":
        values = raw.get("values", []) if isinstance(raw, dict) else []
        if not isinstance(values, list):
            return []
        try:  # a shape or a stride: whole numbers, without a call per element
            return [reader._int(v["intValue"], where) for v in values if len(v) == 1]
        except (KeyError, TypeError):
            return [_value(v, where, depth + 1) for v in values]
    if kind == "kvlistValue":
        values = raw.get("values", []) if isinstance(raw, dict) else []
        return {
            str(kv.get("key")): _value(kv.get("value"), where, depth + 1)
            for kv in (values if isinstance(values, list) else [])
            if isinstance(kv, dict)
        }
    return raw if isinstance(raw, (str, bool)) else None
