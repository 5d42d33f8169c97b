"""On a real GPU: NVTX ranges through the real NVTX API (``torch.cuda.nvtx``, or the ``nvtx``
package where installed), balanced around decorated calls, none during a real CUDA-graph capture.

Skipped without CUDA (``conftest.py``). Without Nsight Systems attached, NVTX calls reach no
tool: this checks that the real calls are made, balanced and without error, not what a tool
records (docs/nvtx.md).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import otel_gpu
from otel_gpu.devices import nvtx as nvtx_seam
from otel_gpu.export import pipeline


class Counting:
    """The real NVTX API, with each call it forwards recorded."""

    def __init__(self, real: nvtx_seam.Backend) -> None:
        self.real = real
        self.payload = real.payload
        self.calls: list[str] = []

    def push(self, message: str, value: int) -> None:
        self.real.push(message, value)
        self.calls.append("push")

    def pop(self) -> None:
        self.real.pop()
        self.calls.append("pop")

    def start(self, message: str, value: int) -> int:
        handle = self.real.start(message, value)
        self.calls.append("start")
        return handle

    def end(self, range_id: int) -> None:
        self.real.end(range_id)
        self.calls.append("end")


@pytest.fixture
def real_nvtx(monkeypatch):
    """The seam's own loader on this machine, its API wrapped to count the calls."""
    counting = Counting(nvtx_seam._load_backend())  # raises here if no NVTX API works
    monkeypatch.setattr(nvtx_seam, "_load_backend", lambda: counting)
    return counting


def _lib():
    @otel_gpu.api
    def inner(x):
        return x * 2

    @otel_gpu.api
    def outer(x):
        return inner(x) + 1

    @otel_gpu.api
    def fails(x):
        raise ValueError("bad")

    return inner, outer, fails


def test_real_ranges_are_pushed_and_popped_balanced_around_calls(otel_gpu_spans, real_nvtx):
    """Nested and raising decorated calls on CUDA tensors: every push is popped, in nesting
    order, and no NVTX call raises; the spans are exported as without NVTX."""
    spans = otel_gpu_spans(level=1, nvtx=True)
    _, outer, fails = _lib()
    x = torch.randn(16, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(outer(x), x * 2 + 1)
    with pytest.raises(ValueError, match="bad"):
        fails(x)
    torch.cuda.synchronize()
    assert real_nvtx.calls == ["push", "push", "pop", "pop"] * 3 + ["push", "pop"]
    assert len(spans.get()) == 7
    pipe = pipeline.current()
    assert pipe is not None
    assert any(isinstance(o, nvtx_seam.NvtxRanges) for o in pipe.observers)


def test_no_range_during_a_real_cuda_graph_capture(otel_gpu_spans, real_nvtx):
    """A decorated call captured into a CUDA graph opens no range; the replays run."""
    otel_gpu_spans(level=1, nvtx=True)
    inner, _, _ = _lib()
    x = torch.randn(16, device="cuda")
    inner(x)  # warm-up, outside the capture
    torch.cuda.synchronize()
    real_nvtx.calls.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = inner(x)
    assert real_nvtx.calls == []
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 2)


def test_real_process_ranges_on_an_event_loop(otel_gpu_spans, real_nvtx):
    """Decorated coroutines start and end real process ranges, one end per start."""
    otel_gpu_spans(level=1, nvtx=True)

    @otel_gpu.api
    async def step(x):
        await asyncio.sleep(0)
        return x + 1

    async def run():
        x = torch.randn(4, device="cuda")
        return await asyncio.gather(step(x), step(x))

    asyncio.run(run())
    assert sorted(real_nvtx.calls) == ["end", "end", "start", "start"]
