"""The console's metrics: one table at exit, per function.

A console or text destination has no metrics backend to send points to, so its reader is an
in-memory one, read once when the pipeline shuts down. Percentiles come from the histogram's
buckets, so the table prints the bucket's upper bound ("≤ 25 µs"), never a made-up exact value;
the maximum is exact.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu._text import printable
from otel_gpu.config import expand_path
from otel_gpu.metrics.names import CALL_DEVICE_DURATION, CALL_DURATION, CALL_NONFINITE, FUNCTION

if TYPE_CHECKING:
    from otel_gpu.core.protocols import ExportState
    from otel_gpu.metrics.provider import Metrics

__all__ = ["Summary", "bucket_quantile", "render"]


def bucket_quantile(q: float, bounds: tuple[float, ...], counts: tuple[int, ...]) -> float | None:
    """The upper bound of the bucket holding the ``q`` quantile; ``inf`` in the overflow bucket,
    None without points."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank and n:
            return bounds[i] if i < len(bounds) else float("inf")
    return float("inf")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds == float("inf"):
        return "> 10 s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds * 1e9:.4g} ns"


class _Row:
    __slots__ = ("bounds", "buckets", "calls", "device", "errors", "max", "nonfinite")

    def __init__(self) -> None:
        self.calls = 0
        self.errors = 0
        self.nonfinite: int | None = None
        self.max = 0.0
        self.bounds: tuple[float, ...] = ()
        self.buckets: list[int] = []
        self.device: _Row | None = None  # the device-time histogram's, where calls have one


def _rows(data: Any) -> dict[str, _Row]:
    """Per function, from the histogram (calls, errors by error.type, buckets) and the
    non-finite counter, read from one collection."""
    rows: dict[str, _Row] = {}
    for rm in getattr(data, "resource_metrics", None) or ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name not in _READ:
                    continue
                for point in metric.data.data_points:
                    attrs = point.attributes or {}
                    row = rows.setdefault(str(attrs.get(FUNCTION, "?")), _Row())
                    if metric.name == CALL_DEVICE_DURATION.name:
                        row.device = row.device or _Row()
                        row = row.device
                    if metric.name == CALL_NONFINITE.name:
                        row.nonfinite = (row.nonfinite or 0) + int(point.value)
                        continue
                    row.calls += point.count
                    if "error.type" in attrs:
                        row.errors += point.count
                    row.max = max(row.max, point.max)
                    bounds = tuple(point.explicit_bounds)
                    if not row.buckets:
                        row.bounds, row.buckets = bounds, [0] * (len(bounds) + 1)
                    if bounds == row.bounds:
                        for i, n in enumerate(point.bucket_counts):
                            row.buckets[i] += n
    return rows


_READ = (CALL_DURATION.name, CALL_DEVICE_DURATION.name, CALL_NONFINITE.name)


def render(data: Any) -> str:
    """The table for one collection, or "" when no call was recorded."""
    rows = _rows(data)
    if not rows:
        return ""
    width = min(max(len(name) for name in rows), 60)
    device = any(r.device is not None for r in rows.values())
    header = (
        f"{'function':<{width}}  {'calls':>9}  {'errors':>7}  {'NaN/Inf':>7}  "
        f"{'p50':>10}  {'p99':>10}  {'max':>10}"
    ) + (f"  {'dev calls':>9}  {'dev p50':>10}  {'dev p99':>10}" if device else "")
    clocks = (
        "p50/p99/max: host time; dev: device time of the calls that have it"
        if device
        else "p50/p99/max: host time"
    )
    lines = [
        f"otel-gpu metrics: {sum(r.calls for r in rows.values())} calls of "
        f"{len(rows)} function(s) ({clocks}; p50/p99: upper bound of the histogram bucket; "
        "NaN/Inf '-': not checked, level < 5)",
        header,
    ]
    for name in sorted(rows):
        row = rows[name]
        counts = tuple(row.buckets)
        shown = printable(name)
        if len(shown) > width:
            shown = "…" + shown[-(width - 1) :]
        p50 = bucket_quantile(0.5, row.bounds, counts)
        p99 = bucket_quantile(0.99, row.bounds, counts)
        lines.append(
            f"{shown:<{width}}  {row.calls:>9}  {row.errors:>7}  "
            f"{'-' if row.nonfinite is None else row.nonfinite:>7}  "
            f"{'≤ ' + _duration(p50) if p50 is not None else '-':>10}  "
            f"{'≤ ' + _duration(p99) if p99 is not None else '-':>10}  "
            f"{_duration(row.max):>10}" + (_device_columns(row.device) if device else "")
        )
    return "\n".join(lines) + "\n"


def _device_columns(row: _Row | None) -> str:
    if row is None:
        return f"  {0:>9}  {'-':>10}  {'-':>10}"
    counts = tuple(row.buckets)
    p50 = bucket_quantile(0.5, row.bounds, counts)
    p99 = bucket_quantile(0.99, row.bounds, counts)
    return (
        f"  {row.calls:>9}  {'≤ ' + _duration(p50) if p50 is not None else '-':>10}  "
        f"{'≤ ' + _duration(p99) if p99 is not None else '-':>10}"
    )


class Summary:
    """The in-memory reader of the console destinations, and where their table goes."""

    def __init__(self, pipeline: ExportState, items: list[str]) -> None:
        self.reader = InMemoryMetricReader()
        self._pipeline = pipeline
        self._items = items  # the console and text entries of OTEL_GPU_LOGDEST
        # Adds the call metrics otel-gpu aggregated itself to the reader's collection (set by
        # the provider where it aggregates them: the SDK's reader has no call instruments then)
        self.add: Callable[[Any], Any] | None = None

    def print(self, metrics: Metrics) -> None:
        data = self.reader.get_metrics_data()
        if self.add is not None:
            data = self.add(data)
        text = render(data)
        if text:
            for item in self._items:
                _write(self._pipeline, item, text)


def _write(pipeline: ExportState, item: str, text: str) -> None:
    """Through the destination's console exporter (after its spans), else to the stream."""
    from otel_gpu.exporters.console import ConsoleSpanExporter

    for counted in pipeline.counters:
        exporter = getattr(counted, "exporter", None)
        if getattr(counted, "name", None) == item and isinstance(exporter, ConsoleSpanExporter):
            exporter.write_text(text)
            return
    key = item.lower()
    if key in ("stdout", "stderr"):
        stream = sys.stdout if key == "stdout" else sys.stderr
        stream.write(text)
        stream.flush()
        return
    from otel_gpu.exporters.destinations import FileStream

    file = FileStream(expand_path(item))
    file.write(text)
    file.close()
