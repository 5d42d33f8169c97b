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

import base64
import binascii
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
from otel_gpu.traces.decode import int64, unix_nano

__all__ = [
    "DEVICE_DURATION",
    "RANK_KEY",
    "CallRecord",
    "arguments",
    "link",
    "load_calls",
]

DEVICE_DURATION = "otel_gpu.device.duration"
"""Span attribute: the call's time on the device, in seconds (a float), where it was measured."""
RANK_KEY = "otel_gpu.rank"
"""Resource attribute naming the process's rank (as ``otel-gpu ranks`` reads it)."""
_SERVICE, _VERSION = "service.name", "otel_gpu.version"
_SCOPES = ("scopeSpans", "scope_spans", "instrumentationLibrarySpans")
_OTHER_SIGNALS = ("resourceMetrics", "resource_metrics", "resourceLogs", "resource_logs")
_DOUBLES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_ERROR_CODES = (2, "2", "STATUS_CODE_ERROR", "ERROR")


@dataclass(eq=False, slots=True)
class CallRecord:
    """One call's span, with its arguments grouped by path (see :func:`arguments`)."""

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


def arguments(attrs: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """``{"q": {"shape": [..], "dtype": ..}, "kv.0": {...}}`` from ``prefix<path>.<field>`` keys."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in attrs.items():
        if key.startswith(prefix):
            path, dot, name = key[len(prefix) :].rpartition(".")
            if dot and path:
                out.setdefault(path, {})[name] = value
    return out


def load_calls(paths: Iterable[str], problem: reader.Problem) -> list[CallRecord]:
    """Every call span of ``paths`` (stuck-call reports, snapshots and recovered spans left
    out), linked to its parent and children in start order; problems go to ``problem``."""
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
        link(calls)
    finally:
        if enabled:
            gc.enable()
    return calls


def link(calls: list[CallRecord]) -> None:
    """Link each call to its parent among ``calls`` (a link closing a cycle is left out);
    children in start order."""
    by_id: dict[tuple[str, str], CallRecord] = {}
    for call in calls:
        by_id.setdefault((call.trace_id, call.span_id), call)
    for call in calls:
        parent = by_id.get((call.trace_id, call.parent_id or ""))
        if parent is not None and parent is not call and not _above(call, parent):
            call.parent = parent
            parent.children.append(call)
    for call in calls:
        call.children.sort(key=lambda c: (c.start, c.span_id))


def _above(call: CallRecord, node: CallRecord | None) -> bool:
    while node is not None:
        if node is call:
            return True
        node = node.parent
    return False


def _list(node: Any, keys: tuple[str, ...], where: str) -> list[Any]:
    if not isinstance(node, dict):
        raise reader.TraceFileError(f"{where}: expected a JSON object holding {keys[0]}")
    for key in keys:
        if key in node:
            if not isinstance(node[key], list):
                raise reader.TraceFileError(f"{where}: {key} is not a list")
            return node[key]  # type: ignore[no-any-return]
    return []


def _line(payload: Any, where: str) -> Iterator[CallRecord]:
    if not isinstance(payload, dict):
        raise reader.TraceFileError(f"{where}: expected a JSON object (OTLP TracesData)")
    if "resourceSpans" not in payload and "resource_spans" not in payload:
        if any(k in payload for k in _OTHER_SIGNALS):
            return
        raise reader.TraceFileError(f"{where}: not OTLP trace data (no resourceSpans)")
    for rs in _list(payload, ("resourceSpans", "resource_spans"), where):
        resource = rs.get("resource") if isinstance(rs, dict) else None
        res = _attributes(resource, where) if isinstance(resource, dict) else {}
        rank = res.get(RANK_KEY)
        try:
            number = int(rank) if rank is not None else None
        except (TypeError, ValueError):
            raise reader.TraceFileError(
                f"{where}: resource attribute {RANK_KEY} is {brief(rank)}, not a whole number"
            ) from None
        for ss in _list(rs, _SCOPES, where):
            for raw in _list(ss, ("spans",), where):
                if not isinstance(raw, dict):
                    raise reader.TraceFileError(f"{where}: a span is not a JSON object")
                call = _span(raw, where)
                if call is not None:
                    call.service = str(res.get(_SERVICE, ""))
                    call.version = str(res.get(_VERSION, ""))
                    call.rank = number
                    yield call


def _get(node: dict[str, Any], camel: str, snake: str, default: Any = None) -> Any:
    return node.get(camel, node.get(snake, default))


def _span(raw: dict[str, Any], where: str) -> CallRecord | None:
    name = str(raw.get("name", ""))
    at = f"{where}: span {brief(name)}"
    trace_id = _id(_get(raw, "traceId", "trace_id"), 16, "traceId", at)
    span_id = _id(_get(raw, "spanId", "span_id"), 8, "spanId", at)
    if trace_id is None or span_id is None:
        raise reader.TraceFileError(f"{at}: no traceId or spanId (or an all-zero one)")
    attrs = _attributes(raw, at)
    if attrs.get(STUCK) is True or attrs.get(RECOVERED) is True or name == SNAPSHOT_SPAN_NAME:
        return None  # reports about calls, or calls that never ended: not calls to count
    status = raw.get("status") or {}
    call = CallRecord(
        name=name,
        trace_id=trace_id,
        span_id=span_id,
        parent_id=_id(_get(raw, "parentSpanId", "parent_span_id"), 8, "parentSpanId", at),
        start=_time(_get(raw, "startTimeUnixNano", "start_time_unix_nano", 0), at),
        end=_time(_get(raw, "endTimeUnixNano", "end_time_unix_nano", 0), at),
        where=where,
        error=isinstance(status, dict) and status.get("code") in _ERROR_CODES,
        compiled=attrs.get(COMPILED) is True,
        inputs=arguments(attrs, INPUT_PREFIX),
        outputs=arguments(attrs, OUTPUT_PREFIX),
    )
    dump = attrs.get(DUMP_DIR)
    call.dump_dir = dump if isinstance(dump, str) and dump else None
    device = attrs.get(DEVICE_DURATION)
    if isinstance(device, (int, float)) and not isinstance(device, bool):
        call.device_s = float(device) if math.isfinite(device) and device >= 0 else None
    for event in _list(raw, ("events",), at):
        if isinstance(event, dict) and event.get("name") == EVENT_STATS:
            stat = _attributes(event, at)
            tensor = stat.pop(STATS_TENSOR, None)
            if isinstance(tensor, str):
                call.stats[tensor] = stat
    return call


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
        raise reader.TraceFileError(
            f"{where}: {key} {brief(raw)} is neither {2 * size} hex digits nor base64 of {size} bytes"
        )
    return data.hex() if any(data) else None


def _time(raw: Any, where: str) -> int:
    try:
        return unix_nano(raw)
    except ValueError as exc:
        raise reader.TraceFileError(
            f"{where}: time {brief(raw)} is not in nanoseconds ({exc})"
        ) from None


def _attributes(node: dict[str, Any], where: str) -> dict[str, Any]:
    out = {}
    for kv in _list(node, ("attributes",), where):
        if isinstance(kv, dict):
            out[str(kv.get("key"))] = _value(kv.get("value"), where, 0)
    return out


def _value(node: Any, where: str, depth: int) -> Any:
    """An OTLP/JSON ``AnyValue`` as a plain value (None for a shape that is not one); the
    nesting is bounded by :func:`reader.load_json` already."""
    if not isinstance(node, dict) or not node:
        return None
    kind, raw = next(iter(node.items()))
    kind = kind.replace("_value", "Value")
    if kind == "intValue":
        try:
            return int64(raw)
        except ValueError as exc:
            raise reader.TraceFileError(
                f"{where}: intValue {brief(raw)} is not a 64-bit integer ({exc})"
            ) from None
    if kind == "doubleValue":
        try:
            return _DOUBLES[raw] if isinstance(raw, str) and raw in _DOUBLES else float(raw)
        except (TypeError, ValueError, OverflowError):
            raise reader.TraceFileError(
                f"{where}: doubleValue {brief(raw)} is not a number"
            ) from None
    if kind == "arrayValue":
        values = raw.get("values", []) if isinstance(raw, dict) else []
        return [_value(v, where, depth + 1) for v in values] if isinstance(values, list) else []
    if kind == "kvlistValue":
        values = raw.get("values", []) if isinstance(raw, dict) else []
        return {
            str(kv.get("key")): _value(kv.get("value"), where, depth + 1)
            for kv in (values if isinstance(values, list) else [])
            if isinstance(kv, dict)
        }
    return raw if isinstance(raw, (str, bool)) else None
