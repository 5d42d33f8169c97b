"""Level-5 statistics read off the caller's thread (``OTEL_GPU_STATS_READ=async``): the caller
queues a copy and an event and never reads; a reader thread completes the statistics exactly as
the caller would have, and the call's span is exported only then. The CUDA seams are faked
(every CPU tensor is treated as a CUDA one, a copy "lands" when the test says so), so this runs
on a machine without a GPU; docs/gpu.md says what ran on one."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import otel_gpu
from otel_gpu.attributes import STATS_NONFINITE_SEEN, STATS_NOTE, STATS_TENSOR
from otel_gpu.calls import stats
from otel_gpu.devices import cuda

_TIMEOUT = 60.0  # seconds: generous, the machine may be loaded


class _Copy:
    """A fake copy's event: it lands when the test opens the gate (open by default)."""

    def __init__(self, gate: threading.Event, waits: list[str]) -> None:
        self.gate, self.waits = gate, waits

    def synchronize(self) -> None:
        self.waits.append(threading.current_thread().name)
        assert self.gate.wait(_TIMEOUT), "the test never let the copy land"

    def query(self) -> bool:
        return self.gate.is_set()


class FakeDevice:
    """The CUDA seams of a deferred read, over CPU tensors."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.waits: list[str] = []
        self.reads_started: list[str] = []
        self.streams: list[object] = []
        monkeypatch.setattr(cuda, "cuda_available", lambda: True)
        monkeypatch.setattr(cuda, "is_capturing", lambda: False)
        monkeypatch.setattr(cuda, "readable_later", lambda t: True)
        monkeypatch.setattr(cuda, "read_later", self.read_later)
        monkeypatch.setattr(cuda, "wait_copy", lambda event: event.synchronize())
        monkeypatch.setattr(cuda, "on_stream", self.on_stream)
        monkeypatch.setattr(cuda, "host_reads", 0)

    def read_later(self, vectors):
        self.reads_started.append(threading.current_thread().name)
        read = cuda.Read()
        read.lengths = [int(v.shape[0]) for v in vectors]
        read.hosts = [torch.cat(list(vectors)).clone()]  # the values at the time of the copy
        read.indices = [list(range(len(vectors)))]
        read.event = _Copy(self.gate, self.waits)
        read.stream = "the call's stream"
        return read

    @contextlib.contextmanager
    def on_stream(self, stream):
        self.streams.append(stream)
        yield


@pytest.fixture
def device(monkeypatch):
    return FakeDevice(monkeypatch)


def _events(span) -> dict[str, dict]:
    return {
        e.attributes[STATS_TENSOR]: dict(e.attributes)
        for e in span.events
        if e.name == "otel_gpu.stats"
    }


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    nan = torch.randn(64, generator=g)
    nan[5] = float("nan")
    inf = torch.randn(64, generator=g)
    inf[7] = float("inf")
    return [
        torch.randn(32, 16, generator=g),
        torch.randn(100, generator=g).to(torch.float16),
        torch.randn(100, generator=g).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (50,), generator=g),
        nan,
        inf,
        1e6 + torch.rand(1000, generator=g),  # a large offset: the precise pass runs
        torch.randn(1, 8, generator=g).expand(4, 8),  # a broadcast view
        torch.rand(30, generator=g) > 0.5,
        torch.empty(0),
        torch.full((10,), 2.5),
    ]


@pytest.mark.parametrize("index", range(11))
def test_statistics_equal_the_synchronous_ones_value_for_value(
    device, otel_gpu_spans, monkeypatch, index
):
    """For every kind of tensor (floats of each width, integers, NaN, Inf, a precision doubt, a
    broadcast view, bool, empty, constant), the statistics read off the caller's thread are
    exactly those of OTEL_GPU_STATS_READ=sync: every event attribute, value for value."""
    x = _inputs()[index]
    got = {}
    for mode in ("sync", "async"):
        spans = otel_gpu_spans(level=5, stats_read=mode)

        @otel_gpu.api
        def step(t):
            return t.clone()

        step(x)
        (span,) = spans.get()
        got[mode] = _events(span)
        spans.clear()
    assert got["async"] == got["sync"]
    assert got["sync"]  # the comparison was about something


def test_the_caller_never_reads_and_the_span_waits_for_its_statistics(device, otel_gpu_spans):
    """With the copy not yet landed, calls return at once with no device read on the caller's
    thread and no span exported; once it lands, the reader thread (not the caller) waits for
    it, and every span arrives with its statistics."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def step(a, b):
        return a + b

    device.gate.clear()
    for _ in range(5):
        step(torch.ones(8), torch.ones(8))
    assert cuda.host_reads == 0
    assert device.reads_started == ["MainThread"] * 5
    assert spans.exporter.get_finished_spans() == ()
    device.gate.set()
    got = spans.get()
    assert len(got) == 5
    assert all(set(_events(s)) == {"input.a", "input.b", "output.0"} for s in got)
    assert set(device.waits) == {"otel-gpu-stats"}
    assert cuda.host_reads == 0  # clean tensors need no second pass


def test_nan_pass_runs_on_the_reader_thread_on_the_calls_stream(device, otel_gpu_spans):
    """A NaN output needs the NaN/Inf pass: it runs on the reader thread, on the call's stream,
    and the span carries the counts and otel_gpu.nonfinite."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def poison(x):
        y = x.clone()
        y[1] = float("nan")
        return y

    poison(torch.ones(4))
    (span,) = spans.get()
    assert _events(span)["output.0"]["nan_count"] == 1
    assert span.attributes["otel_gpu.nonfinite"] is True
    assert device.streams == ["the call's stream"]


def test_a_tensor_modified_in_place_before_its_nan_pass_says_so(device, otel_gpu_spans):
    """A NaN output changed in place before its deferred NaN/Inf pass could run keeps what the
    first pass showed: non-finite values seen (otel_gpu.nonfinite stays true), no counts that
    would describe the new values, and a note saying why."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def poison(x):
        y = x.clone()
        y[1] = float("nan")
        return y

    device.gate.clear()
    out = poison(torch.ones(4))
    out.fill_(1.0)  # the program moves on before the device copy landed
    device.gate.set()
    (span,) = spans.get()
    stats_event = _events(span)["output.0"]
    assert stats_event[STATS_NONFINITE_SEEN] is True
    assert "nan_count" not in stats_event
    assert stats_event[STATS_NOTE] == stats.MODIFIED_NOTE
    assert span.attributes["otel_gpu.nonfinite"] is True


@pytest.mark.parametrize("policy", ["error", "raise"])
def test_policies_that_decide_on_the_caller_read_there(device, otel_gpu_spans, policy):
    """OTEL_GPU_ON_NONFINITE=error and raise (and dump, which takes the same branch) decide on
    the caller's thread, so they read there (one read per clean call), as documented."""
    otel_gpu_spans(level=5, on_nonfinite=policy)

    @otel_gpu.api
    def step(a):
        return a * 2

    step(torch.ones(8))
    assert cuda.host_reads == 1
    assert device.reads_started == []


def test_a_nonfinite_trigger_in_force_reads_on_the_caller(device, otel_gpu_spans):
    """A non-finite trigger reads each call's statistics when the call ends, on the caller's
    thread: while one is in force, calls read there."""
    otel_gpu_spans(level=5, triggers=[{"on": "nonfinite", "level": 5, "for": 10}])

    @otel_gpu.api
    def step(a):
        return a * 2

    step(torch.ones(8))
    assert device.reads_started == []
    assert cuda.host_reads == 1


def test_sync_reads_on_the_caller(device, otel_gpu_spans):
    """OTEL_GPU_STATS_READ=sync: one blocking read per clean call on the caller's thread."""
    otel_gpu_spans(level=5, stats_read="sync")

    @otel_gpu.api
    def step(a):
        return a * 2

    for _ in range(3):
        step(torch.ones(8))
    assert cuda.host_reads == 3
    assert device.reads_started == []
