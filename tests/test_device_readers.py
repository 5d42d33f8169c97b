"""Readers of device time and memory: ``show``, the console, ``ranks``, the stuck-call report and
the call metrics show a span's device time where it has one and say which clock they show.

Spans are built by hand (JSON Lines files, SDK ``ReadableSpan`` objects, call records) with and
without ``otel_gpu.device.duration``, as the device-time resolver writes it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import crafted_calls
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags
from otel_gpu.exporters.console import ConsoleSpanExporter
from test_ranks import Rank
from test_ranks import _run as run_ranks

import otel_gpu
from otel_gpu.attributes import (
    CODE_FUNCTION_NAME,
    MEMORY_ALLOCATED,
    MEMORY_ALLOCATED_DELTA,
    MEMORY_LARGEST_FREE_BLOCK,
    MEMORY_PEAK,
    MEMORY_RESERVED,
)
from otel_gpu.core.record import Call, CallSpan
from otel_gpu.metrics import summary
from otel_gpu.metrics.calls import CallMetrics
from otel_gpu.metrics.names import CALL_DEVICE_DURATION, CALL_DURATION
from otel_gpu.traces.show import show

DEVICE_DURATION = "otel_gpu.device.duration"
DEVICE_UNRESOLVED = "otel_gpu.device.unresolved"
MiB = 1 << 20
MS = 1_000_000


def _file(tmp_path, spans: list[tuple[str, float, dict[str, Any]]], name="spans.jsonl") -> str:
    """One JSON Lines file of root spans: (name, host milliseconds, attributes)."""
    clock = 1_700_000_000 * 1_000_000_000
    raw = []
    for span_name, host_ms, attrs in spans:
        raw.append(
            {
                "traceId": os.urandom(16).hex(),
                "spanId": os.urandom(8).hex(),
                "name": span_name,
                "startTimeUnixNano": str(clock),
                "endTimeUnixNano": str(clock + int(host_ms * MS)),
                "attributes": crafted_calls.attrs(attrs),
            }
        )
        clock += 10 * 1_000_000_000
    line = {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": raw}]}]}
    path = tmp_path / name
    path.write_text(json.dumps(line) + "\n")
    return str(path)


def _show(*paths: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    assert show(list(paths), out=out, err=err) == 0, err.getvalue()
    return out.getvalue()


# --------------------------------------------------------------------------- show


def test_show_gives_device_time_with_the_host_time_beside_it_and_names_the_clocks(tmp_path):
    """A span with device time reads ``device … (host …)``; one without keeps its host duration;
    one whose device time was not resolved says so; the tree ends naming the clocks (mixed)."""
    path = _file(
        tmp_path,
        [
            ("lib.rmsnorm", 0.01, {DEVICE_DURATION: 0.0123}),
            ("lib.cpu_step", 2.0, {}),
            ("lib.slow", 0.02, {DEVICE_UNRESOLVED: True}),
        ],
    )
    lines = _show(path).splitlines()
    by_name = {line.split()[1]: line for line in lines if line.startswith("└─")}
    assert "lib.rmsnorm  device 12.3 ms (host 10 µs)" in by_name["lib.rmsnorm"]
    assert "lib.cpu_step  2 ms" in by_name["lib.cpu_step"]
    assert "device" not in by_name["lib.cpu_step"]
    assert "lib.slow  20 µs (host; device time unresolved)" in by_name["lib.slow"]
    assert lines[-1].startswith("durations: device time where measured, host time otherwise")


def test_show_names_device_time_alone_when_every_span_has_it(tmp_path):
    """Every drawn span with device time: the closing line says device time, not mixed."""
    path = _file(tmp_path, [("lib.a", 0.01, {DEVICE_DURATION: 0.5})])
    out = _show(path)
    assert "lib.a  device 500 ms (host 10 µs)" in out
    assert out.splitlines()[-1].startswith("durations: device time (")


def test_show_without_device_time_is_unchanged(tmp_path):
    """A host-only file: plain host durations, no closing line about clocks."""
    out = _show(_file(tmp_path, [("lib.a", 1.5, {})]))
    assert "lib.a  1.5 ms" in out
    assert "durations:" not in out and "device" not in out


def test_show_gives_memory_per_call_and_the_out_of_memory_summary(tmp_path):
    """The allocated delta and peak are shown; an out-of-memory span shows the summary."""
    path = _file(
        tmp_path,
        [
            ("lib.make", 1.0, {MEMORY_ALLOCATED_DELTA: 64 * MiB, MEMORY_PEAK: 1536 * MiB}),
            (
                "lib.huge",
                1.0,
                {
                    MEMORY_ALLOCATED_DELTA: 0,
                    MEMORY_RESERVED: 70 << 30,
                    MEMORY_ALLOCATED: 69 << 30,
                    MEMORY_LARGEST_FREE_BLOCK: 20 * MiB,
                },
            ),
        ],
    )
    out = _show(path)
    assert "mem +64 MiB peak 1.5 GiB" in out
    assert "out of memory: reserved 70 GiB, allocated 69 GiB, largest free block 20 MiB" in out


def test_show_says_a_stuck_report_is_host_time(tmp_path):
    """A stuck-call report's running time is labelled host time."""
    path = _file(
        tmp_path,
        [("otel_gpu.stuck lib.f", 1.0, {"otel_gpu.stuck": True, "otel_gpu.stuck.seconds": 3.5})],
    )
    assert "STUCK: running for 3.5 s (host time) when reported" in _show(path)


# --------------------------------------------------------------------------- console


def _sdk_span(name: str, host_ns: int, attrs: dict[str, Any], error: bool = False) -> ReadableSpan:
    ctx = SpanContext(0x1234, 0x5678, False, TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(
        name=name,
        context=ctx,
        attributes=attrs,
        start_time=1_000,
        end_time=1_000 + host_ns,
        status=Status(StatusCode.ERROR, "OutOfMemoryError: CUDA out of memory")
        if error
        else Status(StatusCode.UNSET),
        resource=Resource.create({"service.name": "svc"}),
    )


def test_console_end_of_call_line_gives_device_time_and_memory():
    """The console's end-of-call line reads ``device … ms (host … ms)`` where the span has device
    time, says so when it was not resolved, and keeps the host duration otherwise; memory per
    call and an out-of-memory summary get a line of their own."""
    stream = io.StringIO()
    exporter = ConsoleSpanExporter(stream, color="never")
    exporter.export(
        [
            _sdk_span("dev", 10_000, {DEVICE_DURATION: 0.0123, MEMORY_ALLOCATED_DELTA: 64 * MiB}),
            _sdk_span("host", 50_000, {}),
            _sdk_span("lost", 20_000, {DEVICE_UNRESOLVED: True}),
            _sdk_span("oom", 30_000, {MEMORY_RESERVED: 2 * MiB, MEMORY_ALLOCATED: MiB}, True),
        ]
    )
    out = stream.getvalue()
    dev = out[out.index("dev  ") : out.index("host  ")]
    assert "✔ OK  device 12.300 ms (host 0.010 ms)" in dev
    assert "  memory: +64.0 MiB allocated" in dev
    host = out[out.index("host  ") : out.index("lost  ")]
    assert "✔ OK  0.050 ms" in host and "device" not in host and "memory" not in host
    lost = out[out.index("lost  ") : out.index("oom  ")]
    assert "✔ OK  0.020 ms (host; device time unresolved)" in lost
    oom = out[out.index("oom  ") :]
    assert "memory: out of memory: reserved 2.0 MiB, allocated 1.0 MiB" in oom
    assert "✘ ERROR OutOfMemoryError: CUDA out of memory  0.030 ms" in oom


# --------------------------------------------------------------------------- ranks


def _stalled_job(device_s: float | None, unresolved_rank: int | None = None) -> list[Rank]:
    """Ranks 0, 1, 3 launched their 3rd all_reduce (1 ms on the host); rank 2 never did."""
    job = [Rank(r) for r in range(4)]
    for r in job:
        for _ in range(2):
            r.collective()
    for r in (job[0], job[1], job[3]):
        r.collective(seconds=0.001)
        extra: dict[str, Any] = {}
        if device_s is not None:
            extra[DEVICE_DURATION] = device_s
        if r.rank == unresolved_rank:
            extra = {DEVICE_UNRESOLVED: True}
        r.spans[-1]["attributes"] += crafted_calls.attrs(extra)
    return job


def test_ranks_waited_uses_device_time_and_says_so(tmp_path):
    """An asynchronous collective returns at once on the host while its kernel waits for the
    missing rank: the wait shown is the device time, labelled as such, text and JSON."""
    paths = [r.write(tmp_path) for r in _stalled_job(device_s=30.0)]
    code, out, _ = run_ranks(paths)
    assert code == 1
    assert "never by rank 2; the others have waited 30.0 s (device time)" in out
    code, out, _ = run_ranks(paths, as_json=True)
    (group,) = json.loads(out)["groups"]
    assert group["stalled"]["waited_s"] == 30.0
    assert group["stalled"]["waited_time"] == "device"
    assert group["stalled"]["device_unresolved"] == []


def test_ranks_without_device_time_say_host_time_and_name_unresolved_ranks(tmp_path):
    """Without device time the wait is the host's, and says so; a rank whose call's device time
    was unresolved (its kernel had not finished) is named."""
    paths = [r.write(tmp_path) for r in _stalled_job(device_s=None, unresolved_rank=0)]
    code, out, _ = run_ranks(paths)
    assert code == 1
    assert "the others have waited 0.0 s (host time)" in out
    assert "device time unresolved on rank 0: their GPU work in it had not finished" in out
    code, out, _ = run_ranks(paths, as_json=True)
    (group,) = json.loads(out)["groups"]
    assert group["stalled"]["waited_time"] == "host"
    assert group["stalled"]["device_unresolved"] == [0]


def test_ranks_calls_in_flight_are_host_time(tmp_path):
    """A call in flight (recovered) is timed on the host, and the line says so."""
    job = [Rank(r, 2) for r in range(2)]
    for r in job:
        r.collective()
    job[0].collective()
    job[1].recovered("mylib.load_batch", seconds=12.0)
    code, out, _ = run_ranks([r.write(tmp_path) for r in job])
    assert code == 1
    assert "in flight: mylib.load_batch (span " in out
    assert "12.0 s host time)" in out


# --------------------------------------------------------------------------- stuck-call report


def test_stuck_call_warning_says_host_time(otel_gpu_spans, caplog):
    """The stuck-call warning gives the running time as host time: a call still running has no
    device time."""
    spans = otel_gpu_spans(level=1, stuck_after=0.2)
    release = threading.Event()

    @otel_gpu.api
    def hang():
        release.wait(10)

    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        worker = threading.Thread(target=hang)
        worker.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
            "has been running" in r.getMessage() for r in caplog.records
        ):
            time.sleep(0.05)
        release.set()
        worker.join(10)
    (message,) = [r.getMessage() for r in caplog.records if "has been running" in r.getMessage()]
    assert " s of host time (OTEL_GPU_STUCK_AFTER=0.2)" in message
    spans.get()


# --------------------------------------------------------------------------- metrics


def _metrics() -> tuple[CallMetrics, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    return CallMetrics(provider.get_meter("otel_gpu"), SimpleNamespace()), reader  # type: ignore[arg-type]


class _Plan:
    """The part of a decorated function's plan the call metrics read (hashable, as plans are)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.level = 1
        self.attributes = {CODE_FUNCTION_NAME: name}


def _call(name: str, span_id: int, attrs: dict[str, Any]) -> Call:
    plan = _Plan(name)
    ctx = SpanContext(0xABC, span_id, False, TraceFlags(TraceFlags.SAMPLED))
    call = Call(plan, CallSpan(ctx, name), None, 1_000)
    call.end_ns = 1_000 + 10_000  # 10 µs on the host
    if attrs:
        call.span.set_attributes(attrs)
    return call


def _histograms(reader: InMemoryMetricReader) -> dict[str, Any]:
    data = reader.get_metrics_data()
    return {
        m.name: m.data.data_points
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }


def test_device_duration_histogram_is_recorded_beside_the_host_one_with_an_exemplar():
    """A call whose span carries device time records it in ``otel_gpu.call.device.duration``
    (same attributes as the host histogram, the span as exemplar); a call without device time,
    or with an unresolved one, is only in the host histogram."""
    metrics, reader = _metrics()
    metrics.record(
        [
            _call("lib.f", 0x11, {DEVICE_DURATION: 0.0123}),
            _call("lib.f", 0x22, {}),
            _call("lib.f", 0x33, {DEVICE_UNRESOLVED: True}),
        ]
    )
    got = _histograms(reader)
    (host,) = got[CALL_DURATION.name]
    assert host.count == 3
    (device,) = got[CALL_DEVICE_DURATION.name]
    assert device.count == 1
    assert device.sum == 0.0123
    assert dict(device.attributes) == dict(host.attributes) == {CODE_FUNCTION_NAME: "lib.f"}
    assert [(e.span_id, e.trace_id, e.value) for e in device.exemplars] == [(0x11, 0xABC, 0.0123)]


def test_record_device_for_a_time_resolved_after_the_span():
    """``record_device`` records a device time learnt after the span was built, with the call's
    attributes (``error.type`` on a failed call) and its span as exemplar."""
    metrics, reader = _metrics()
    call = _call("lib.g", 0x44, {})
    call.exc = KeyError("k")
    metrics.record_device(call, 0.25)
    (device,) = _histograms(reader)[CALL_DEVICE_DURATION.name]
    assert dict(device.attributes) == {CODE_FUNCTION_NAME: "lib.g", "error.type": "KeyError"}
    assert device.count == 1 and [e.span_id for e in device.exemplars] == [0x44]


def test_console_metrics_table_labels_host_and_device_columns():
    """The console's metrics table says its p50/p99/max are host time and, where calls have device
    time, adds device columns; without device time it adds none."""
    metrics, reader = _metrics()
    metrics.record([_call("lib.f", 0x11, {DEVICE_DURATION: 0.0123}), _call("lib.h", 0x22, {})])
    text = summary.render(reader.get_metrics_data())
    title, header, *rows = text.splitlines()
    assert "p50/p99/max: host time; dev: device time of the calls that have it" in title
    assert header.split()[-6:] == ["dev", "calls", "dev", "p50", "dev", "p99"]
    row_f = next(r for r in rows if r.startswith("lib.f"))
    assert row_f.endswith("1     ≤ 25 ms     ≤ 25 ms")
    row_h = next(r for r in rows if r.startswith("lib.h"))
    assert row_h.endswith("0           -           -")

    metrics, reader = _metrics()
    metrics.record([_call("lib.h", 0x22, {})])
    title, header, *_ = summary.render(reader.get_metrics_data()).splitlines()
    assert "(p50/p99/max: host time;" in title and "dev" not in header
