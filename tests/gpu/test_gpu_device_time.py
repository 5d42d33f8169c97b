"""On a real GPU: device time from CUDA events, queue delay, the fault suspect, graph replays.

Skipped without CUDA (``conftest.py``). No fakes: real events on the current stream, resolved
by the export thread. The fault tests run in a child process, since a device-side assert is
sticky for the rest of the process; the child writes its spans to a JSON file.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest
import torch
from commands import python_command

import otel_gpu
from otel_gpu.attributes import (
    CUDA_FAULT,
    CUDA_FAULT_CANDIDATES,
    CUDA_FAULT_SUSPECT,
    CUDA_GRAPH_REPLAY_DEVICE_DURATION,
    DEVICE_DURATION,
    DEVICE_QUEUE_DELAY,
    DEVICE_STREAM,
)


def _cycles_per_ms() -> float:
    """``torch.cuda._sleep`` spins for clock cycles: measure how many make a millisecond."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    rates = []
    for _ in range(3):
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        rates.append(20_000_000 / start.elapsed_time(end))
    return sorted(rates)[1]


def _reference_ms(cycles: int) -> float:
    """The device time of ``_sleep(cycles)``, measured with plain events (no otel-gpu)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[1]


def _wait_for(spans, name: str, key: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [s for s in spans.get() if s.name.endswith(name) and key in s.attributes]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {name} span with {key}: {[dict(s.attributes) for s in spans.get()]}")


def test_device_duration_of_a_known_kernel_while_the_host_span_is_short(otel_gpu_spans):
    """A 30 ms ``_sleep`` kernel: the span's otel_gpu.device.duration is within 10 % of the same
    kernel timed with plain events, while the span itself (the launch) lasts under 1 ms."""
    torch.cuda.init()
    cycles = int(30 * _cycles_per_ms())
    reference = _reference_ms(cycles) / 1e3
    spans = otel_gpu_spans(level=1)

    @otel_gpu.api
    def sleeper(n):
        torch.cuda._sleep(n)

    sleeper(1000)  # warm-up: the pipeline and the event pool are built on the first call
    torch.cuda.synchronize()
    otel_gpu.flush()
    spans.clear()
    sleeper(cycles)
    (span,) = _wait_for(spans, "sleeper", DEVICE_DURATION)
    assert span.attributes[DEVICE_DURATION] == pytest.approx(reference, rel=0.10)
    assert span.end_time - span.start_time < 1_000_000
    assert span.attributes[DEVICE_STREAM] == torch.cuda.current_stream().stream_id


def test_a_call_on_a_side_stream_is_timed_on_that_stream(otel_gpu_spans):
    """The stream is found through its raw handle and a kept stream object: a call made under
    ``torch.cuda.stream(side)`` records its events on the side stream (its id on the span, and
    its 30 ms kernel timed there), and the next call on the default stream is on that one again."""
    torch.cuda.init()
    cycles = int(30 * _cycles_per_ms())
    reference = _reference_ms(cycles) / 1e3
    spans = otel_gpu_spans(level=1)

    @otel_gpu.api
    def sleeper(n):
        torch.cuda._sleep(n)

    sleeper(1000)
    torch.cuda.synchronize()
    otel_gpu.flush()
    spans.clear()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        sleeper(cycles)
    (span,) = _wait_for(spans, "sleeper", DEVICE_DURATION)
    assert span.attributes[DEVICE_STREAM] == side.stream_id
    assert span.attributes[DEVICE_DURATION] == pytest.approx(reference, rel=0.10)
    torch.cuda.synchronize()
    spans.clear()
    sleeper(1000)
    (span,) = _wait_for(spans, "sleeper", DEVICE_DURATION)
    assert span.attributes[DEVICE_STREAM] == torch.cuda.current_stream().stream_id


def test_queue_delay_when_the_stream_is_busy(otel_gpu_spans):
    """Behind 50 ms of earlier work on the stream, a tiny call's queue delay is about 50 ms and
    its device duration small; its ``[device]`` child (level 3) starts that much later."""
    torch.cuda.init()
    cycles = int(50 * _cycles_per_ms())
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def tiny(x):
        return x + 1

    x = torch.ones(16, device="cuda")
    tiny(x)  # warm-up
    torch.cuda.synchronize()
    otel_gpu.flush()
    spans.clear()
    torch.cuda._sleep(cycles)  # not decorated: the stream is busy for ~50 ms
    tiny(x)
    (span,) = [s for s in _wait_for(spans, "tiny", DEVICE_DURATION) if "[device]" not in s.name]
    delay = span.attributes[DEVICE_QUEUE_DELAY]
    assert 0.035 < delay < 0.2, delay
    assert span.attributes[DEVICE_DURATION] < 0.005
    (child,) = [s for s in spans.get() if s.name.endswith("tiny [device]")]
    assert child.parent.span_id == span.context.span_id
    offset_s = (child.start_time - span.start_time) / 1e9
    assert offset_s == pytest.approx(delay, abs=0.002)


_FAULT_CHILD = """
import json, sys, time
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
import otel_gpu

out, looks = sys.argv[1], sys.argv[2] == "looks"
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
otel_gpu.configure(level=1, tracer_provider=provider)

@otel_gpu.api
def good(x):
    return x * 2

@otel_gpu.api
def bad(x, idx, cycles):
    torch.cuda._sleep(cycles)  # the device runs this call for a while before the assert
    return x[idx]  # out of range: a device-side assert, reported later

@otel_gpu.api
def sync():
    torch.cuda.synchronize()

x = torch.ones(16, device="cuda")
idx = torch.tensor([1000], device="cuda")
torch.cuda.init()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record(); torch.cuda._sleep(20_000_000); end.record(); end.synchronize()
cycles = int(20_000_000 / start.elapsed_time(end) * 400)  # ~400 ms
for _ in range(3):
    good(x)
torch.cuda.synchronize()
if looks:
    time.sleep(0.5)  # the resolver sees the good calls finished
bad(x, idx, cycles if looks else 0)
good(x)
good(x)
if looks:
    time.sleep(0.3)  # the resolver sees bad running (started, not finished)
error = None
try:
    sync()
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
otel_gpu.flush(10)
spans = [
    {
        "name": s.name.rsplit(".", 1)[-1],
        "id": format(s.context.span_id, "016x"),
        "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.attributes.items()},
        "status": s.status.status_code.name,
        "description": s.status.description,
    }
    for s in exporter.get_finished_spans()
]
with open(out, "w") as f:
    json.dump({"error": error, "spans": spans}, f)
"""


def _fault_run(tmp_path, mode: str) -> dict:
    script = tmp_path / "fault_child.py"
    script.write_text(textwrap.dedent(_FAULT_CHILD))
    out = tmp_path / f"{mode}.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_LAUNCH_BLOCKING"}
    env["PYTHONPATH"] = os.pathsep.join([*sys.path])
    proc = python_command([str(script), str(out), mode], env=env, timeout=120)
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


def _faulted(tmp_path, mode: str) -> tuple[dict, dict, dict]:
    """(result, the span of ``bad``, the span of ``sync``) of a fault run that ended in the
    device-side assert."""
    result = _fault_run(tmp_path, mode)
    assert result["error"] and "device-side assert" in result["error"], result["error"]
    by_name: dict = {}
    for s in result["spans"]:
        by_name.setdefault(s["name"], []).append(s)
    (bad,) = by_name["bad"]
    (sync,) = by_name["sync"]
    return result, bad, sync


def test_a_device_side_assert_is_blamed_on_the_call_that_launched_it(tmp_path):
    """Without CUDA_LAUNCH_BLOCKING: ``bad`` launches an out-of-range index (a device-side
    assert) two calls before ``sync`` raises it. The resolver saw ``bad`` running: its span is
    ERROR with fault = "kernel", and ``sync``'s span names it as the suspect."""
    result, bad, sync = _faulted(tmp_path, "looks")
    assert bad["attributes"].get(CUDA_FAULT) == "kernel", result
    assert bad["status"] == "ERROR"
    assert sync["attributes"].get(CUDA_FAULT_SUSPECT) == bad["id"], result
    assert sync["description"].startswith("CUDA error surfaced here, caused earlier by span")


def test_a_fault_the_resolver_never_saw_names_the_range_of_candidates(tmp_path):
    """The same assert with no pause: the resolver never looked between the launches and the
    error, so ``sync`` names the candidates (``bad`` among them) and says so."""
    result, bad, sync = _faulted(tmp_path, "quick")
    suspect = sync["attributes"].get(CUDA_FAULT_SUSPECT)
    candidates = sync["attributes"].get(CUDA_FAULT_CANDIDATES) or []
    # either the resolver happened to look (a single suspect: bad), or it names the range
    assert suspect == bad["id"] or bad["id"] in candidates, result
    if not suspect:
        assert "could not be told apart" in sync["description"]


def test_each_read_replay_of_a_graph_carries_its_device_time(otel_gpu_spans):
    """A captured 20 ms ``_sleep`` in a decorated call at level 5: each read replay's spans carry
    the replay's device time, about 20 ms."""
    torch.cuda.init()
    cycles = int(20 * _cycles_per_ms())
    reference = _reference_ms(cycles) / 1e3
    spans = otel_gpu_spans(level=5, graph_stats_every=1)

    @otel_gpu.api
    def step(x):
        torch.cuda._sleep(cycles)
        return x * 2

    x = torch.ones(16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(x)
    torch.cuda.synchronize()
    otel_gpu.flush()
    spans.clear()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    from otel_gpu.devices import cuda_graphs

    assert cuda_graphs.flush(10.0)
    replayed = [s for s in spans.get() if CUDA_GRAPH_REPLAY_DEVICE_DURATION in s.attributes]
    assert len(replayed) == 2, [dict(s.attributes) for s in spans.get()]
    for s in replayed:
        assert s.attributes[CUDA_GRAPH_REPLAY_DEVICE_DURATION] == pytest.approx(reference, rel=0.15)
