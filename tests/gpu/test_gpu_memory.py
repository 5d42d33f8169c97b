"""On a real GPU: memory per call (level 3) from the CUDA caching allocator's counters.

Skipped without CUDA (``conftest.py``). tests/test_device_memory.py checks the same logic with a
fake allocator; these check the real seams of ``otel_gpu.devices.memory``: that the counters
move by exactly the sizes allocated (sizes that are multiples of the allocator's 512-byte
rounding), that the peak is the new high-water mark, that the program's own peak statistics are
left alone, and the summary on a real out-of-memory error.
"""

from __future__ import annotations

import pytest
import torch
from opentelemetry.trace import StatusCode

import otel_gpu
from otel_gpu.attributes import (
    MEMORY_ALLOCATED,
    MEMORY_ALLOCATED_DELTA,
    MEMORY_DEVICE_FREE,
    MEMORY_DEVICE_TOTAL,
    MEMORY_LARGEST_FREE_BLOCK,
    MEMORY_PEAK,
    MEMORY_RESERVED,
)

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _cuda_ready():
    """CUDA initialised and idle before each test; the test's buffers are gone after it."""
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    yield
    torch.cuda.synchronize()


def _span(spans, suffix):
    return next(s for s in spans.get() if s.name.endswith(suffix))


def test_delta_and_peak_of_a_known_allocation(otel_gpu_spans):
    """A call returning a 64 MiB buffer and freeing a 32 MiB temporary: delta 64 MiB; peak the
    allocated bytes before the call plus 96 MiB (the program reset its peak statistics first,
    so the call raises the high-water mark)."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def make(n):
        keep = torch.empty(n, dtype=torch.uint8, device="cuda")
        temporary = torch.empty(n // 2, dtype=torch.uint8, device="cuda")
        del temporary
        return keep

    torch.cuda.reset_peak_memory_stats()  # the program's own choice, before the call
    before = torch.cuda.memory_allocated()
    out = make(64 * MiB)
    assert torch.cuda.memory_allocated() - before == 64 * MiB
    span = _span(spans, ".make")
    assert span.attributes[MEMORY_ALLOCATED_DELTA] == 64 * MiB
    assert span.attributes[MEMORY_PEAK] == before + 96 * MiB
    assert torch.cuda.max_memory_allocated() == before + 96 * MiB
    del out


@pytest.mark.parametrize("calls", ["all", "outermost"])
def test_nested_call_has_a_delta_but_no_peak(otel_gpu_spans, calls):
    """With OTEL_GPU_DEVICE_MEMORY_CALLS=all the inner call of two gets its own delta and no
    peak; with outermost (the default) it reads nothing; the outer one gets both either way."""
    spans = otel_gpu_spans(level=3, device_memory_calls=calls)

    @otel_gpu.api
    def inner():
        return torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")

    @otel_gpu.api
    def outer():
        a = inner()
        b = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        return a, b

    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = outer()
    inner_span, outer_span = _span(spans, ".inner"), _span(spans, ".outer")
    if calls == "all":
        assert inner_span.attributes[MEMORY_ALLOCATED_DELTA] == 16 * MiB
    else:
        assert MEMORY_ALLOCATED_DELTA not in inner_span.attributes
    assert MEMORY_PEAK not in inner_span.attributes
    assert outer_span.attributes[MEMORY_ALLOCATED_DELTA] == 24 * MiB
    assert outer_span.attributes[MEMORY_PEAK] == before + 24 * MiB
    del out


def test_the_programs_peak_statistics_are_left_alone(otel_gpu_spans):
    """A call under the program's earlier high-water mark: no peak on its span, and
    ``max_memory_allocated`` is what the program would see without otel-gpu."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def small():
        return torch.empty(MiB, dtype=torch.uint8, device="cuda")

    big = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    del big
    mark = torch.cuda.max_memory_allocated()
    out = small()
    assert torch.cuda.max_memory_allocated() == mark
    span = _span(spans, ".small")
    assert span.attributes[MEMORY_ALLOCATED_DELTA] == MiB
    assert MEMORY_PEAK not in span.attributes
    del out


def test_out_of_memory_span_carries_the_allocators_summary(otel_gpu_spans):
    """Asking for 10 TiB raises torch.OutOfMemoryError, passed through; the span is ERROR and
    carries reserved, allocated, the largest free block and the driver's free and total memory,
    consistent with what torch reports right after."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def huge():
        return torch.empty(10 << 40, dtype=torch.uint8, device="cuda")

    keep = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    with pytest.raises(torch.OutOfMemoryError):
        huge()
    allocated = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    free, total = torch.cuda.mem_get_info()
    span = _span(spans, ".huge")
    attrs = span.attributes
    assert span.status.status_code is StatusCode.ERROR
    assert attrs[MEMORY_ALLOCATED_DELTA] == 0
    assert attrs[MEMORY_ALLOCATED] == allocated
    assert attrs[MEMORY_RESERVED] == reserved
    assert attrs[MEMORY_RESERVED] >= attrs[MEMORY_ALLOCATED] >= 4 * MiB
    assert 0 <= attrs[MEMORY_LARGEST_FREE_BLOCK] <= reserved - allocated
    assert attrs[MEMORY_DEVICE_TOTAL] == total
    assert 0 < attrs[MEMORY_DEVICE_FREE] <= total
    assert abs(attrs[MEMORY_DEVICE_FREE] - free) <= 64 * MiB  # other processes may allocate
    del keep
