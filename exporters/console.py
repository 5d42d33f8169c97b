"""The human-readable console renderer: a span exporter that prints a block per call.

It knows otel-gpu's attribute keys and nothing about how spans are made. It is
also registered as the ``otel_gpu_console`` traces exporter entry point, so any
OpenTelemetry app can use it with ``OTEL_TRACES_EXPORTER=otel_gpu_console``.

For crash safety, otel-gpu's own console destination prints a call's header and
inputs *before* the call runs (:meth:`ConsoleSpanExporter.write_call_start`,
flushed), and the rest of the block when the span ends.
"""

from __future__ import annotations

import datetime as _dt
import math
import sys
import threading
from collections.abc import Mapping, Sequence
from functools import partialmethod
from typing import IO, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode
from otel_gpu.exporters import _streams

from otel_gpu import attributes as attr
from otel_gpu._text import printable

__all__ = ["ConsoleSpanExporter"]

_FIELDS = (
    "shape",
    "dtype",
    "device",
    "stride",
    "requires_grad",
    "is_contiguous",
    "value",
    "enum_value",
    "type",
    "length",
    "repr",
    "id",
    "default",
)
_RULE = "─" * 78


class _Style:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.enabled else text

    # one SGR code per style: bold, dim and the colours the renderer uses
    bold = partialmethod(__call__, code="1")
    dim = partialmethod(__call__, code="2")
    red = partialmethod(__call__, code="1;31")
    green = partialmethod(__call__, code="32")
    cyan = partialmethod(__call__, code="36")
    yellow = partialmethod(__call__, code="33")


def _want_color(stream: IO[str], color: str) -> bool:
    if color == "always":
        return True
    if color == "never":
        return False
    from otel_gpu.config import no_color

    if no_color():
        return False
    try:
        return bool(stream.isatty())
    except Exception:
        return False


def _group(attributes: Mapping[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """``{'q': {'shape': [..], 'dtype': ..}, 'kv.0': {...}}`` in attribute order."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in attributes.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        name, _, field = rest.rpartition(".")
        if field not in _FIELDS:
            continue
        groups.setdefault(name, {})[field] = value
    return groups


def _s(value: Any) -> str:
    """``str(value)`` with control characters escaped: names, values and messages come from
    user code and must not reach a terminal as control sequences (see ``otel_gpu._text``)."""
    return printable(str(value))


def _fmt_num(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.6g}"
    return _s(value)


def _describe(entry: Mapping[str, Any], style: _Style) -> str:
    if "dtype" in entry:
        shape = ", ".join(_s(d) for d in entry.get("shape", ()))
        parts = [
            style.cyan(f"Tensor[{shape}]"),
            _s(entry["dtype"]).removeprefix("torch."),
            _s(entry.get("device", "?")),
        ]
        if "stride" in entry:
            parts.append("stride=(" + ", ".join(_s(s) for s in entry["stride"]) + ")")
        if entry.get("is_contiguous") is False:
            parts.append(style.yellow("non-contiguous"))
        if entry.get("requires_grad"):
            parts.append("requires_grad")
        text = " ".join(parts)
    elif "enum_value" in entry:  # an enum member: its name and its value, as FlashInfer logs them
        text = f"{_s(entry.get('value', '?'))} (value {printable(repr(entry['enum_value']))})"
    elif "value" in entry:
        text = (
            printable(repr(entry["value"]))
            if isinstance(entry["value"], str) and entry["value"] not in ("None", "<redacted>")
            else _s(entry["value"])
        )
    elif "length" in entry:
        text = f"{_s(entry.get('type', 'container'))}[{_s(entry['length'])}]"
    elif "repr" in entry:
        text = f"{_s(entry.get('type', 'object'))}: {_s(entry['repr'])}"
    elif "id" in entry:  # a mutable object: its repr at export time could differ from the call's
        text = f"{_s(entry.get('type', 'object'))} object (id {_s(entry['id'])})"
    else:
        text = _s(entry.get("type", "?"))
    if entry.get("default"):
        text += style.dim(" (default)")
    return text


def _lines_for(groups: Mapping[str, Mapping[str, Any]], style: _Style) -> list[str]:
    lines = []
    for name, entry in groups.items():
        depth = name.count(".")
        label = printable(name) if name else "(result)"
        lines.append(f"    {'  ' * depth}{label} = {_describe(entry, style)}")
    return lines


def _lowp_parts(attrs: Mapping[str, Any], style: _Style) -> list[str]:
    """Low-precision statistics: amax, dynamic range, zeros, saturation or a simulated cast's
    underflow and overflow (fractions; red when a value is lost)."""
    parts = []
    if attr.STATS_AMAX in attrs:
        parts.append(f"amax={_fmt_num(attrs[attr.STATS_AMAX])}")
    if attr.STATS_DYNAMIC_RANGE in attrs:
        parts.append(f"dynamic_range={_fmt_num(attrs[attr.STATS_DYNAMIC_RANGE])}")
    if attr.STATS_ZERO_FRACTION in attrs:
        parts.append(f"zero_fraction={_fmt_num(attrs[attr.STATS_ZERO_FRACTION])}")
    if attr.STATS_SIMULATED_FORMAT in attrs:
        parts.append(f"as {_s(attrs[attr.STATS_SIMULATED_FORMAT])}:")
    for name in (attr.STATS_SATURATION, attr.STATS_UNDERFLOW, attr.STATS_OVERFLOW):
        if name in attrs:
            text = f"{name}={_fmt_num(attrs[name])}"
            parts.append(style.red(text) if attrs[name] else text)
    return parts


def _stats_line(attrs: Mapping[str, Any], style: _Style) -> str:
    key = _s(attrs.get(attr.STATS_TENSOR, "?"))
    parts = []
    for name in (attr.STATS_MIN, attr.STATS_MAX, attr.STATS_MEAN, attr.STATS_STD):
        if name in attrs:
            parts.append(f"{name}={_fmt_num(attrs[name])}")
    for name in (attr.STATS_NAN_COUNT, attr.STATS_INF_COUNT):
        if name in attrs:
            text = f"{name.split('_')[0]}={_s(attrs[name])}"
            parts.append(style.red(text) if attrs[name] else text)
    parts.extend(_lowp_parts(attrs, style))
    parts.append(f"numel={_s(attrs.get(attr.STATS_NUMEL, '?'))}")
    if attr.STATS_FINGERPRINT in attrs:
        parts.append(style.dim(f"fingerprint={_s(attrs[attr.STATS_FINGERPRINT])}"))
    line = f"    {key}: " + " ".join(parts)
    note = attrs.get(attr.STATS_NOTE)
    if note:
        line += style.dim(f"  [{_s(note)}]")
    return line


def _dump_lines(attrs: Mapping[str, Any]) -> list[str]:
    """Where the flight recorder (level 10) or the ring put this call, or why it did not."""
    lines = []
    if attrs.get(attr.DUMP_DIR):
        lines.append(f"  dump: {_s(attrs[attr.DUMP_DIR])}")
    elif attrs.get(attr.DUMP_SKIPPED):
        lines.append(f"  not dumped: {_s(attrs[attr.DUMP_SKIPPED])}")
    if attrs.get(attr.RING_DUMP_DIR):
        lines.append(f"  ring dump: {_s(attrs[attr.RING_DUMP_DIR])}")
    return lines


_DEVICE_DURATION = "otel_gpu.device.duration"  # seconds of the call's GPU work (device time)
_DEVICE_UNRESOLVED = "otel_gpu.device.unresolved"  # its GPU work had not finished in time


def _took(attrs: Mapping[str, Any], host_ms: float) -> str:
    """``0.050 ms`` (host), or ``device 12.300 ms (host 0.010 ms)`` where the span has device time."""
    device = attrs.get(_DEVICE_DURATION)
    if (type(device) is float or type(device) is int) and math.isfinite(device) and device >= 0:
        return f"device {device * 1e3:.3f} ms (host {host_ms:.3f} ms)"
    if attrs.get(_DEVICE_UNRESOLVED) is True:
        return f"{host_ms:.3f} ms (host; device time unresolved)"
    return f"{host_ms:.3f} ms"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _memory_line(attrs: Mapping[str, Any]) -> str:
    """``memory: +64.0 MiB allocated, peak 1024.0 MiB``; on an out-of-memory error the
    allocator's summary. Empty when the span has no memory attribute (level < 3, no CUDA)."""
    parts = []
    delta = attrs.get(attr.MEMORY_ALLOCATED_DELTA)
    if type(delta) is int:
        parts.append(f"{delta / (1 << 20):+.1f} MiB allocated")
    peak = attrs.get(attr.MEMORY_PEAK)
    if type(peak) is int:
        parts.append(f"peak {_mib(peak)}")
    summary = [
        f"{label} {_mib(value)}"
        for key, label in (
            (attr.MEMORY_RESERVED, "reserved"),
            (attr.MEMORY_ALLOCATED, "allocated"),
            (attr.MEMORY_LARGEST_FREE_BLOCK, "largest free block"),
            (attr.MEMORY_DEVICE_FREE, "device free"),
        )
        if type(value := attrs.get(key)) is int
    ]
    if summary:
        parts.append("out of memory: " + ", ".join(summary))
    return "memory: " + ", ".join(parts) if parts else ""


def _links_line(links: Any) -> str:
    """The span's links: how many, and the first three as trace/span ids (and request ids)."""
    shown = []
    for link in list(links)[:3]:
        ctx = link.context
        rid = (link.attributes or {}).get(attr.REQUEST_ID)
        shown.append(
            f"{ctx.trace_id:032x}/{ctx.span_id:016x}" + (f" ({printable(str(rid))})" if rid else "")
        )
    more = f", +{len(links) - 3} more" if len(links) > 3 else ""
    return f"links: {len(links)} → " + ", ".join(shown) + more


def _timestamp(ns: int | None) -> str:
    if not ns:
        return "?"
    return _dt.datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


class ConsoleSpanExporter(SpanExporter):
    """Prints each span as a readable block, with a system-information header once.

    ``inputs_printed_before``: the inputs were already written by :meth:`write_call_start`,
    so the end-of-call block shows only outputs, statistics, duration and status.
    """

    def __init__(
        self,
        stream: IO[str] | None = None,
        *,
        color: str = "auto",
        inputs_printed_before: bool = False,
        resource: Any = None,
        owns_stream: bool = False,
    ) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self._owns_stream = owns_stream
        self._style = _Style(_want_color(self._stream, color))
        self._inputs_before = inputs_printed_before
        self._resource = resource
        self._header_done = False
        self._lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------- SpanExporter

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed:
            return SpanExportResult.FAILURE
        text = "".join(self.render(span) for span in spans)
        return (
            SpanExportResult.SUCCESS
            if self._write(text, spans[0].resource if spans else None)
            else SpanExportResult.FAILURE
        )

    def shutdown(self) -> None:
        self._closed = True
        self.force_flush()
        _streams.close(self._stream, self._lock, self._owns_stream)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return _streams.flush(self._stream, self._lock)

    def write_text(self, text: str) -> bool:
        """Write a block that is not a span (the metrics table at exit), unless shut down."""
        if self._closed:
            return False
        return self._write(text, None)

    # ----------------------------------------------------------------- rendering

    def write_call_start(
        self, name: str, span_id: int, start_ns: int, input_attributes: Mapping[str, Any]
    ) -> None:
        """Print a call's header and inputs before it runs, and flush: the record a crash cannot erase."""
        s = self._style
        lines = [
            s.dim(_RULE),
            f"{s.bold('▶ ' + printable(name))}  {s.dim(_timestamp(start_ns))}  {s.dim('span ' + format(span_id, '016x'))}",
        ]
        groups = _group(input_attributes, attr.INPUT_PREFIX)
        if groups:
            lines.append("  inputs:")
            lines.extend(_lines_for(groups, s))
        self._write("\n".join(lines) + "\n", self._resource)

    def render(self, span: ReadableSpan) -> str:
        s = self._style
        attrs = span.attributes or {}
        name = printable(span.name)
        ctx = span.context
        span_hex = format(ctx.span_id, "016x") if ctx else "?"
        duration = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
        lines: list[str] = []
        if self._inputs_before:
            lines.append(f"{s.bold('◀ ' + name)}  {s.dim('span ' + span_hex)}")
        else:
            lines.append(s.dim(_RULE))
            lines.append(
                f"{s.bold(name)}  {s.dim(_timestamp(span.start_time))}  {s.dim('span ' + span_hex)}"
                + (s.dim(f"  parent {span.parent.span_id:016x}") if span.parent else "")
            )
            inputs = _group(attrs, attr.INPUT_PREFIX)
            if inputs:
                lines.append("  inputs:")
                lines.extend(_lines_for(inputs, s))
        outputs = _group(attrs, attr.OUTPUT_PREFIX)
        if outputs:
            lines.append("  outputs:")
            lines.extend(_lines_for(outputs, s))
        stat_events = [e for e in span.events if e.name == attr.EVENT_STATS]
        if stat_events:
            lines.append("  stats:")
            lines.extend(_stats_line(e.attributes or {}, s) for e in stat_events)
        if attrs.get(attr.NONFINITE):
            lines.append("  " + s.red("⚠ NaN/Inf found in this call's tensors"))
        # Here, not in the ▶ block: the recorder names the directory after the ▶ block is printed.
        lines.extend(_dump_lines(attrs))
        memory = _memory_line(attrs)
        if memory:
            lines.append("  " + (s.red(memory) if "out of memory" in memory else s.dim(memory)))
        if span.links:
            lines.append("  " + s.dim(_links_line(span.links)))
        took = s.dim(_took(attrs, duration))
        if span.status.status_code is StatusCode.ERROR:
            lines.append(f"  {s.red('✘ ERROR')} {printable(span.status.description or '')}  {took}")
        else:
            lines.append(f"  {s.green('✔ OK')}  {took}")
        return "\n".join(lines) + "\n"

    def _header(self, resource: Any) -> str:
        s = self._style
        lines = [s.dim("═" * 78), s.bold("otel-gpu · system information")]
        attrs = dict(getattr(resource, "attributes", {}) or {})
        if attrs.get("service.name"):
            lines.append(f"  service: {_s(attrs['service.name'])}")
        try:
            from otel_gpu.resource import describe_resource_lines

            lines.extend("  " + printable(line) for line in describe_resource_lines(resource))
        except Exception:
            pass
        lines.append(s.dim("═" * 78))
        return "\n".join(lines) + "\n"

    def _write(self, text: str, resource: Any) -> bool:
        try:
            with self._lock:
                if not self._header_done:
                    self._header_done = True
                    text = self._header(resource if resource is not None else self._resource) + text
                self._stream.write(text)
                self._stream.flush()
        except Exception as exc:  # a full disk: the destination counts and reports it once
            self.write_error = exc
            return False
        return True
