"""Memory per call: the caching allocator's counters around a call, with a fake allocator.

The seams of ``otel_gpu.devices.memory`` (``initialized``, ``current_device``, ``counters``,
``summary``) are replaced by a fake allocator whose counters the decorated functions move, so
these run on a CPU-only machine. tests/gpu/test_gpu_memory.py checks the same on a real GPU.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import otel_gpu
from otel_gpu import _guard
from otel_gpu.attributes import (
    MEMORY_ALLOCATED,
    MEMORY_ALLOCATED_DELTA,
    MEMORY_DEVICE_FREE,
    MEMORY_LARGEST_FREE_BLOCK,
    MEMORY_PEAK,
    MEMORY_PREFIX,
    MEMORY_RESERVED,
)
from otel_gpu.devices import cuda
from otel_gpu.devices import memory as devices

MiB = 1 << 20


class FakeAllocator:
    """Per-device allocated bytes and their high-water mark, as the caching allocator keeps them."""

    def __init__(self, initialized: bool = True) -> None:
        self.is_initialized = initialized
        self.device = 0
        self.current = {0: 0, 1: 0}
        self.peak = {0: 0, 1: 0}
        self.reads = 0
        self.summaries: list[int] = []

    def allocate(self, nbytes: int) -> None:
        self.is_initialized = True
        self.current[self.device] += nbytes
        self.peak[self.device] = max(self.peak[self.device], self.current[self.device])

    def free(self, nbytes: int) -> None:
        self.current[self.device] -= nbytes

    # the seams
    def initialized(self) -> bool:
        return self.is_initialized

    def current_device(self) -> int:
        return self.device

    def counters(self, device: int) -> tuple[int, int]:
        self.reads += 1
        return self.current[device], self.peak[device]

    def summary(self, device: int) -> dict[str, int]:
        self.summaries.append(device)
        return {
            "reserved": 1000 * MiB,
            "allocated": self.current[device],
            "largest_free_block": 2 * MiB,
            "device_free": 3 * MiB,
            "device_total": 80 * 1024 * MiB,
        }


@pytest.fixture
def alloc(monkeypatch):
    """CUDA available (asked at decoration) and a fake allocator behind the memory seams."""
    fake = FakeAllocator()
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    for name in ("initialized", "current_device", "counters", "summary"):
        monkeypatch.setattr(devices, name, getattr(fake, name))
    monkeypatch.setattr(
        torch.cuda,
        "reset_peak_memory_stats",
        lambda *a, **k: pytest.fail("otel-gpu reset the program's peak memory statistics"),
    )
    return fake


def _memory(span) -> dict[str, int]:
    return {k: v for k, v in span.attributes.items() if k.startswith(MEMORY_PREFIX)}


def test_delta_and_peak_of_a_call_that_keeps_one_buffer_and_frees_another(alloc, otel_gpu_spans):
    """The delta is what the call left allocated; the peak is the most allocated during it,
    what was allocated before the call included."""
    spans = otel_gpu_spans(level=3)
    alloc.allocate(10 * MiB)  # the program's own memory before the call

    @otel_gpu.api
    def step(x):
        alloc.allocate(64 * MiB)  # the output, kept
        alloc.allocate(32 * MiB)  # a temporary
        alloc.free(32 * MiB)
        return x

    step(torch.ones(2))
    (span,) = spans.get()
    assert _memory(span) == {
        MEMORY_ALLOCATED_DELTA: 64 * MiB,
        MEMORY_PEAK: (10 + 64 + 32) * MiB,
    }


def test_no_peak_when_the_call_stays_under_the_earlier_high_water_mark(alloc, otel_gpu_spans):
    """A call that did not raise the allocator's high-water mark gets no peak (only a bound is
    known without resetting the program's statistics); its delta is still exact, negative when
    it freed more than it kept."""
    spans = otel_gpu_spans(level=3)
    alloc.allocate(100 * MiB)
    alloc.free(60 * MiB)  # the mark stays at 100 MiB

    @otel_gpu.api
    def shrink():
        alloc.allocate(20 * MiB)
        alloc.free(30 * MiB)

    shrink()
    (span,) = spans.get()
    assert _memory(span) == {MEMORY_ALLOCATED_DELTA: -10 * MiB}
    assert alloc.peak[0] == 100 * MiB


@pytest.mark.parametrize("calls", ["all", "outermost"])
def test_nested_calls_get_a_delta_and_only_the_outermost_a_peak(alloc, otel_gpu_spans, calls):
    """With OTEL_GPU_DEVICE_MEMORY_CALLS=all a call nested in another decorated call gets its own
    delta but no peak; with outermost (the default) it reads nothing and gets nothing. Either
    way the outermost call's peak covers the inner one's, and the next outer call gets a peak
    again."""
    spans = otel_gpu_spans(level=3, device_memory_calls=calls)

    @otel_gpu.api
    def inner():
        alloc.allocate(8 * MiB)

    @otel_gpu.api
    def outer():
        alloc.allocate(4 * MiB)
        inner()
        alloc.free(12 * MiB)

    outer()
    outer()
    by_name = {}
    for s in spans.get():
        by_name.setdefault(s.name.rsplit(".", 1)[-1], []).append(_memory(s))
    inner_memory = {MEMORY_ALLOCATED_DELTA: 8 * MiB} if calls == "all" else {}
    assert by_name["inner"] == [inner_memory] * 2
    assert alloc.reads == (8 if calls == "all" else 4)  # two per reading call
    assert by_name["outer"][0] == {MEMORY_ALLOCATED_DELTA: 0, MEMORY_PEAK: 12 * MiB}
    # the second call reached the same mark, not above it: no peak, but it is outermost again
    assert by_name["outer"][1] == {MEMORY_ALLOCATED_DELTA: 0}
    alloc.allocate(1 * MiB)
    outer()
    assert _memory(spans.get()[-1]) == {MEMORY_ALLOCATED_DELTA: 0, MEMORY_PEAK: 13 * MiB}


def test_an_inner_call_that_raised_does_not_leave_the_outer_mark_behind(alloc, otel_gpu_spans):
    """After nested calls that raised, the next top-level call is outermost again (gets a peak)."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def inner():
        alloc.allocate(MiB)
        raise ValueError("inner")

    @otel_gpu.api
    def outer():
        inner()

    with pytest.raises(ValueError):
        outer()

    @otel_gpu.api
    def later():
        alloc.allocate(5 * MiB)

    later()
    span = next(s for s in spans.get() if s.name.endswith(".later"))
    assert _memory(span) == {MEMORY_ALLOCATED_DELTA: 5 * MiB, MEMORY_PEAK: 6 * MiB}


def test_a_call_on_another_thread_is_not_nested(alloc, otel_gpu_spans):
    """Nesting is per thread: a call on another thread while one runs here is outermost there."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def worker():
        alloc.allocate(MiB)

    @otel_gpu.api
    def main():
        t = threading.Thread(target=worker)
        t.start()
        t.join()

    main()
    span = next(s for s in spans.get() if s.name.endswith(".worker"))
    assert MEMORY_PEAK in _memory(span)


def test_async_calls_are_measured(alloc, otel_gpu_spans):
    """A coroutine function's call reads the allocator around its body like a plain one."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    async def fetch():
        alloc.allocate(3 * MiB)

    asyncio.run(fetch())
    (span,) = spans.get()
    assert _memory(span) == {MEMORY_ALLOCATED_DELTA: 3 * MiB, MEMORY_PEAK: 3 * MiB}


def test_the_device_current_at_the_start_is_measured(alloc, otel_gpu_spans):
    """Both readings are of the device current when the call started, even if it switches."""
    spans = otel_gpu_spans(level=3)
    alloc.device = 1

    @otel_gpu.api
    def on_one():
        alloc.allocate(7 * MiB)
        alloc.device = 0
        alloc.allocate(100 * MiB)

    on_one()
    assert _memory(spans.get()[0]) == {MEMORY_ALLOCATED_DELTA: 7 * MiB, MEMORY_PEAK: 7 * MiB}


def test_out_of_memory_span_carries_the_allocator_summary(alloc, otel_gpu_spans):
    """A call that raised torch.OutOfMemoryError carries the allocator's reserved, allocated and
    largest free block and the driver's free memory; the user's exception passes through."""
    spans = otel_gpu_spans(level=3)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 10240.00 GiB.")

    @otel_gpu.api
    def big():
        alloc.allocate(MiB)
        raise error

    with pytest.raises(torch.OutOfMemoryError) as caught:
        big()
    assert caught.value is error
    (span,) = spans.get()
    got = _memory(span)
    assert got[MEMORY_RESERVED] == 1000 * MiB
    assert got[MEMORY_ALLOCATED] == MiB
    assert got[MEMORY_LARGEST_FREE_BLOCK] == 2 * MiB
    assert got[MEMORY_DEVICE_FREE] == 3 * MiB
    assert got[MEMORY_ALLOCATED_DELTA] == MiB
    assert alloc.summaries == [0]


def test_other_exceptions_carry_no_summary(alloc, otel_gpu_spans):
    """Only an out-of-memory error pays for the allocator's summary."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def bad():
        raise RuntimeError("not memory")

    with pytest.raises(RuntimeError):
        bad()
    assert _memory(spans.get()[0]) == {MEMORY_ALLOCATED_DELTA: 0}
    assert alloc.summaries == []


def test_nothing_before_cuda_is_initialised(alloc, otel_gpu_spans):
    """Where CUDA exists but the process has not initialised it, the allocator is not read and
    the span claims nothing."""
    spans = otel_gpu_spans(level=3)
    alloc.is_initialized = False

    @otel_gpu.api
    def cpu_only(x):
        return x * 2

    cpu_only(torch.ones(2))
    assert _memory(spans.get()[0]) == {}
    assert alloc.reads == 0


def test_a_call_that_initialises_cuda_counts_from_zero(alloc, otel_gpu_spans):
    """CUDA initialised during the call: it began with nothing allocated on any GPU."""
    spans = otel_gpu_spans(level=3)
    alloc.is_initialized = False

    @otel_gpu.api
    def first():
        alloc.allocate(2 * MiB)  # initialises CUDA

    first()
    assert _memory(spans.get()[0]) == {MEMORY_ALLOCATED_DELTA: 2 * MiB, MEMORY_PEAK: 2 * MiB}


def test_no_reading_without_cuda_or_below_level_3(monkeypatch, otel_gpu_spans):
    """On a machine without CUDA (decided at decoration) and at level 1, no seam is called and
    no memory attribute is set."""
    fake = FakeAllocator()
    for name in ("initialized", "current_device", "counters", "summary"):
        monkeypatch.setattr(devices, name, lambda *a, _n=name: pytest.fail(f"{_n} called"))

    def allocate():
        fake.allocate(MiB)

    monkeypatch.setattr(cuda, "cuda_available", lambda: False)
    spans = otel_gpu_spans(level=3)
    otel_gpu.api(allocate)()  # decorated without CUDA
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    spans = otel_gpu_spans(level=1)
    otel_gpu.api(allocate)()  # decorated at level 1
    assert [_memory(s) for s in spans.get()] == [{}]


def test_a_failing_reading_costs_only_the_attributes(alloc, otel_gpu_spans, monkeypatch):
    """A reading that raises is an internal error: the call's result and span survive, and the
    nesting mark is not left behind (the next call is outermost and gets its peak)."""
    spans = otel_gpu_spans(level=3, strict=False)
    _guard.set_strict(False)
    real = alloc.counters
    monkeypatch.setattr(devices, "counters", lambda d: 1 / 0)

    @otel_gpu.api
    def step():
        alloc.allocate(MiB)
        return 42

    assert step() == 42
    monkeypatch.setattr(devices, "counters", real)
    assert step() == 42
    first, second = spans.get()
    assert _memory(first) == {}
    assert _memory(second) == {MEMORY_ALLOCATED_DELTA: MiB, MEMORY_PEAK: 2 * MiB}
    assert _guard.internal_error_counts().get("memory")


def test_real_seams_on_a_cpu_only_torch_never_raise_or_initialise():
    """The real seams on CPU torch: not initialised, and the summary is empty, not an error."""
    assert devices.initialized() is False
    assert devices.summary(0) == {}
    assert torch.cuda.is_initialized() is False
    assert torch.OutOfMemoryError in devices.OUT_OF_MEMORY
    assert torch.cuda.OutOfMemoryError in devices.OUT_OF_MEMORY


def test_memory_attributes_follow_a_cached_layout_with_each_calls_own_values(alloc, tmp_path):
    """Spans written by the native encoders keep the per-layout attribute cache with memory per
    call on: each span has its inputs and its own call's memory, never a cached call's."""
    from jsonl_spans import read_spans

    from otel_gpu.export import pipeline

    otel_gpu.configure(level=3, dest=str(tmp_path / "spans.jsonl"))
    sizes = iter((MiB, 2 * MiB, 3 * MiB))

    @otel_gpu.api
    def grow(x, n):
        alloc.allocate(next(sizes))
        return x

    x = torch.ones(2, 3)
    for _ in range(3):
        grow(x, n=4)  # the same layout each time, a different allocation
    assert otel_gpu.flush(timeout=10)
    assert pipeline.current()._layouts  # the layout path was taken
    spans = read_spans(tmp_path / "spans.jsonl", plain=True)
    assert [s["attrs"]["otel_gpu.input.x.shape"] for s in spans] == [[2, 3]] * 3
    assert [s["attrs"]["otel_gpu.input.n.value"] for s in spans] == [4] * 3
    assert [s["attrs"][MEMORY_ALLOCATED_DELTA] for s in spans] == [MiB, 2 * MiB, 3 * MiB]
    assert [s["attrs"][MEMORY_PEAK] for s in spans] == [MiB, 3 * MiB, 6 * MiB]


def test_device_memory_false_reads_nothing(alloc, otel_gpu_spans, monkeypatch):
    """OTEL_GPU_DEVICE_MEMORY=false at level 3 with CUDA: no seam is called, no memory attribute
    is set, and an out-of-memory error still passes through as the same object."""
    monkeypatch.setenv("OTEL_GPU_DEVICE_MEMORY", "false")
    for name in ("initialized", "current_device", "counters", "summary"):
        monkeypatch.setattr(devices, name, lambda *a, _n=name: pytest.fail(f"{_n} called"))
    spans = otel_gpu_spans(level=3)
    boom = torch.OutOfMemoryError("out of memory")

    @otel_gpu.api
    def step(fail):
        alloc.allocate(MiB)
        if fail:
            raise boom

    step(False)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        step(True)
    assert caught.value is boom
    assert [_memory(s) for s in spans.get()] == [{}, {}]


def test_by_default_a_module_tree_reads_the_allocator_twice_a_forward(alloc, otel_gpu_spans):
    """OTEL_GPU_DEVICE_MEMORY_CALLS defaults to outermost: three levels of nested decorated calls
    (a model, its layers, their sublayers) cost two allocator readings per top-level call, and
    only the top-level call's span carries memory attributes."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def leaf():
        alloc.allocate(MiB)

    @otel_gpu.api
    def layer():
        leaf()
        leaf()

    @otel_gpu.api
    def model():
        for _ in range(4):
            layer()

    model()
    model()
    assert alloc.reads == 4
    with_memory = [s.name.rsplit(".", 1)[-1] for s in spans.get() if _memory(s)]
    assert with_memory == ["model", "model"]


def test_a_nested_call_that_runs_out_of_memory_still_gets_the_summary(alloc, otel_gpu_spans):
    """With outermost-only readings, a nested call that raises an out-of-memory error still gets
    the allocator's summary on its span, and the exception passes through as the same object."""
    spans = otel_gpu_spans(level=3)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    @otel_gpu.api
    def inner():
        raise oom

    @otel_gpu.api
    def outer():
        inner()

    with pytest.raises(torch.OutOfMemoryError) as raised:
        outer()
    assert raised.value is oom
    inner_span = next(s for s in spans.get() if s.name.endswith("inner"))
    assert _memory(inner_span)[MEMORY_PREFIX + "device_total"] == 80 * 1024 * MiB
    assert MEMORY_ALLOCATED_DELTA not in _memory(inner_span)
