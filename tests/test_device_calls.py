"""What a call costs in CUDA calls: the real device-time backend (``events.CudaEvents``) and the
real memory seams (``devices.memory``) driven over a counting stand-in for ``torch``, so the
number of stream lookups, capture queries, event records, event queries and allocator reads a
call makes is pinned on a machine without a GPU (docs/gpu.md, docs/performance.md)."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch

import otel_gpu
from otel_gpu.devices import cuda, events
from otel_gpu.devices import memory as devices_memory


class _Stream:
    def __init__(self, counts: collections.Counter, device: int = 0) -> None:
        self.stream_id, self.device_index, self.cuda_stream = 3, device, 0x7000 + device
        counts["stream objects"] += 1


class _Event:
    def __init__(self, counts: collections.Counter) -> None:
        self.counts = counts

    def record(self, stream=None) -> None:  # torch.cuda.Event.record: a Python frame
        self.counts["Event.record (Python)"] += 1

    def query(self) -> bool:
        self.counts["event queries"] += 1
        return True  # the stand-in device is always done

    def elapsed_time(self, other) -> float:
        self.counts["elapsed times"] += 1
        return 0.5


class CountingTorch:
    """The part of ``torch`` that device time and memory per call touch, counting each call."""

    def __init__(self) -> None:
        counts = self.counts = collections.Counter()

        def count(name, result=None):
            def call(*args, **kwargs):
                counts[name] += 1
                return result() if callable(result) else result

            return call

        def record(event, stream):
            counts["cudaEventRecord"] += 1

        def memory_stats(device=None):
            counts["allocator reads"] += 1
            return {"allocated_bytes": {"all": {"current": 0, "peak": 0}}}

        self.cuda = SimpleNamespace(
            is_initialized=lambda: True,
            is_current_stream_capturing=count("capture queries", False),
            current_stream=count("current_stream()", lambda: _Stream(counts)),
            current_device=count("device lookups", 0),
            Event=lambda enable_timing=False: _Event(counts),
            Stream=lambda device=0, priority=0: _Stream(counts, device),
            memory_stats_as_nested_dict=memory_stats,
            OutOfMemoryError=torch.OutOfMemoryError,
        )
        self._C = SimpleNamespace(
            _cuda_isCurrentStreamCapturing=count("capture queries", False),
            _cuda_getDevice=count("device lookups", 0),
            _cuda_getCurrentRawStream=count("raw stream lookups", 0x7000),
            _CudaEventBase=SimpleNamespace(record=record),
        )


@pytest.fixture
def counting(monkeypatch):
    """CUDA available, the real CudaEvents over a counting torch, the memory seams over it too."""
    fake = CountingTorch()
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    events.use(events.CudaEvents(fake))
    monkeypatch.setattr(devices_memory, "torch", fake)
    yield fake
    events.use(None)


def _per_call(counts: collections.Counter, calls: int) -> dict[str, float]:
    return {name: n / calls for name, n in counts.items()}


def test_level_1_call_makes_two_records_and_three_c_getters_and_no_stream_object(
    counting, otel_gpu_spans
):
    """At level 1 with device time, a call costs the caller exactly: one capture query, one device
    lookup, one raw stream lookup and two event records through the C binding. No
    ``torch.cuda.current_stream()`` (a Python stream object, ~4.4 µs) after the first call, no
    ``Event.record`` Python frame, and no allocator read."""
    spans = otel_gpu_spans(level=1, device_time="on")

    @otel_gpu.api
    def step(x):
        return x

    step(1)  # the first call meets the stream: one current_stream() to remember it
    otel_gpu.flush()
    counting.counts.clear()
    for _ in range(100):
        step(1)
    caller = dict(counting.counts)
    otel_gpu.flush()
    assert _per_call(collections.Counter(caller), 100) == {
        "capture queries": 1.0,
        "device lookups": 1.0,
        "raw stream lookups": 1.0,
        "cudaEventRecord": 2.0,
    }
    assert len(spans.get()) == 101


def test_level_3_module_tree_reads_the_allocator_twice_per_forward(counting, otel_gpu_spans):
    """At level 3 with the defaults (device time and memory on), a forward of a three-deep tree
    of decorated calls (1 + 4 + 8 calls) makes two allocator reads in all (the outermost call's),
    and per call the same stream lookups and records as level 1."""
    otel_gpu_spans(level=3, device_time="on")

    @otel_gpu.api
    def leaf(x):
        return x

    @otel_gpu.api
    def layer(x):
        return leaf(leaf(x))

    @otel_gpu.api
    def model(x):
        for _ in range(4):
            x = layer(x)
        return x

    model(torch.ones(2))
    otel_gpu.flush()
    counting.counts.clear()
    for _ in range(10):
        model(torch.ones(2))
    counts = dict(counting.counts)
    otel_gpu.flush()
    calls = 10 * 13
    assert counts.get("allocator reads", 0) == 2 * 10
    assert counts.get("current_stream()", 0) == 0
    assert counts.get("Event.record (Python)", 0) == 0
    assert counts["cudaEventRecord"] == 2 * calls
    assert counts["raw stream lookups"] == calls
    assert counts["capture queries"] == calls


def test_resolution_queries_one_fence_per_stream_not_every_event(counting, otel_gpu_spans):
    """Off the caller's thread, the calls of a drain are resolved by querying the last end
    event recorded on their stream (the fence): a few queries per drain, not two per call, so
    queries do not contend with the caller's launches in the driver."""
    spans = otel_gpu_spans(level=1, device_time="on")

    @otel_gpu.api
    def step(x):
        return x

    step(1)
    otel_gpu.flush()
    counting.counts.clear()
    for _ in range(60):  # under one export chunk: one drain resolves them
        step(1)
    otel_gpu.flush()
    # the fence's end event, and the reference event that maps device times to the host clock
    assert counting.counts["event queries"] <= 2
    assert len(spans.get()) == 61
    assert all("otel_gpu.device.duration" in s.attributes for s in spans.get())
