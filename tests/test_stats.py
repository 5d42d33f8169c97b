"""Level 5: tensor statistics as `otel_gpu.stats` span events, for every dtype, with one host read per call."""

from __future__ import annotations

import math

import pytest
import torch

import otel_gpu
from otel_gpu.calls import stats
from otel_gpu.devices import cuda


def _events(span):
    return {
        e.attributes["otel_gpu.tensor"]: dict(e.attributes)
        for e in span.events
        if e.name == "otel_gpu.stats"
    }


def _one(t: torch.Tensor) -> stats.TensorStats:
    return stats.finish([stats.compute("input.t", t)])[0]


FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_float_statistics_match_torch(dtype):
    """min/max/mean/std of clean float tensors agree with torch's own reductions."""
    torch.manual_seed(0)
    t = (torch.randn(1000, dtype=torch.float64) * 3 + 1).to(dtype)
    s = _one(t)
    ref = t.double()
    tol = 1e-6 if dtype in (torch.float32, torch.float64) else 2e-2
    assert s.values["min"] == pytest.approx(ref.min().item(), rel=tol)
    assert s.values["max"] == pytest.approx(ref.max().item(), rel=tol)
    assert s.values["mean"] == pytest.approx(ref.mean().item(), rel=tol, abs=tol)
    assert s.values["std"] == pytest.approx(ref.std().item(), rel=tol)
    assert s.values["nan_count"] == 0 and s.values["inf_count"] == 0
    assert s.numel == 1000 and s.note is None


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nan_and_inf_are_counted_and_excluded(dtype):
    """With NaN/Inf present, counts are exact and min/max/mean/std are over the finite values."""
    t = torch.tensor(
        [1.0, 2.0, float("nan"), float("inf"), -float("inf"), 3.0, float("nan")], dtype=dtype
    )
    s = _one(t)
    assert s.values["nan_count"] == 2
    assert s.values["inf_count"] == 2
    assert s.values["min"] == 1.0 and s.values["max"] == 3.0
    assert s.values["mean"] == pytest.approx(2.0)
    assert s.values["std"] == pytest.approx(1.0)
    assert s.nonfinite
    assert "finite values only" in s.note


def test_all_nan_leaves_out_what_does_not_apply():
    """A tensor with no finite value reports counts only, and says why the rest is missing."""
    s = _one(torch.full((4,), float("nan")))
    assert s.values == {"nan_count": 4, "inf_count": 0}
    assert "no finite values" in s.note


def test_large_mean_small_spread_is_refined_precisely():
    """Where sum-of-squares variance would cancel (mean >> std), std is recomputed in float64."""
    t = torch.full((10000,), 1000.0) + torch.linspace(-1, 1, 10000)
    s = _one(t)
    assert s.values["std"] == pytest.approx(t.double().std().item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8], ids=str)
def test_integer_tensors(dtype):
    """Integers: exact min/max as ints, mean/std; NaN/Inf counts do not apply and the note says so."""
    t = torch.tensor([1, 5, 3, 7], dtype=dtype)
    s = _one(t)
    assert s.values["min"] == 1 and isinstance(s.values["min"], int)
    assert s.values["max"] == 7
    assert s.values["mean"] == 4.0
    assert "nan_count" not in s.values
    assert "integer" in s.note


def test_bool_tensor():
    """Bools: statistics over 0/1 (mean is the fraction true), no NaN/Inf."""
    s = _one(torch.tensor([True, False, True, True]))
    assert s.values["mean"] == 0.75
    assert s.values["min"] == 0.0 and s.values["max"] == 1.0
    assert "bool" in s.note


def test_complex_tensor_uses_magnitudes():
    """Complex values have no order: statistics are of |x|, and NaN is still counted."""
    s = _one(torch.tensor([3 + 4j, 0 + 1j, complex(float("nan"), 0)], dtype=torch.complex64))
    assert s.values["max"] == pytest.approx(5.0)
    assert s.values["nan_count"] == 1
    assert "|x|" in s.note


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_tensors(dtype):
    """fp8 has no native reductions on CPU: it is upcast, and gets the float answer."""
    t = torch.tensor([0.5, 1.0, 2.0]).to(dtype)
    s = _one(t)
    assert s.values["min"] == 0.5 and s.values["max"] == 2.0
    assert s.values["nan_count"] == 0


def test_empty_zero_dim_meta_sparse_and_quantized():
    """Edge tensors get a defined answer: empty and meta say why; 0-d has no std; sparse is not supported."""
    empty = _one(torch.empty(0, 3))
    assert empty.numel == 0 and empty.values == {} and empty.note == "empty tensor"
    scalar = _one(torch.tensor(2.5))
    assert scalar.values["mean"] == 2.5 and "std" not in scalar.values
    assert "at least 2" in scalar.note
    meta = _one(torch.empty(3, device="meta"))
    assert meta.values == {} and "meta" in meta.note
    sparse = _one(torch.eye(3).to_sparse())
    assert sparse.values == {} and "layout" in sparse.note
    q = torch.quantize_per_tensor(torch.tensor([0.0, 1.0, 2.0]), 0.1, 0, torch.quint8)
    quant = _one(q)
    assert quant.values["max"] == pytest.approx(2.0) and "dequantized" in quant.note


def test_level_5_events_on_the_span_and_nonfinite_flag(otel_gpu_spans):
    """Each input and output tensor gets an otel_gpu.stats event; NaN anywhere sets otel_gpu.nonfinite."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def log_of(x, eps=0.0):
        return torch.log(x + eps)

    log_of(torch.tensor([-1.0, 0.0, 1.0, math.e]))
    (span,) = spans.get()
    ev = _events(span)
    assert set(ev) == {"input.x", "output.0"}
    assert ev["input.x"]["nan_count"] == 0 and ev["input.x"]["numel"] == 4
    assert ev["output.0"]["nan_count"] == 1 and ev["output.0"]["inf_count"] == 1
    assert ev["output.0"]["max"] == pytest.approx(1.0)
    assert span.attributes["otel_gpu.nonfinite"] is True
    for attrs in ev.values():
        assert set(attrs) <= {
            "otel_gpu.tensor",
            "min",
            "max",
            "mean",
            "std",
            "nan_count",
            "inf_count",
            "numel",
            "otel_gpu.stats.note",
        }


def test_clean_call_has_no_nonfinite_flag(otel_gpu_spans):
    """Only calls with NaN/Inf carry otel_gpu.nonfinite (so tail sampling can key on it)."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def f(x):
        return x * 2

    f(torch.ones(3))
    assert "otel_gpu.nonfinite" not in spans.get()[0].attributes


def test_one_host_read_per_clean_call_for_all_tensors(otel_gpu_spans, monkeypatch):
    """All tensors of a call (inputs and outputs) are read back together: one read per call, not per tensor."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def three(a, b, c):
        return a + b, c

    monkeypatch.setattr(cuda, "host_reads", 0)
    for _ in range(5):
        three(torch.ones(8), torch.ones(8), torch.ones(8))
    assert cuda.host_reads == 5
    assert len(_events(spans.get()[0])) == 5


def test_nan_call_pays_exactly_one_extra_read(otel_gpu_spans, monkeypatch):
    """NaN/Inf counting runs only when min/max/sum show non-finite values: one extra read for such a call."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def f(a, b):
        return a

    monkeypatch.setattr(cuda, "host_reads", 0)
    f(torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 1.0]))
    assert cuda.host_reads == 2
    ev = _events(spans.get()[0])
    assert ev["input.a"]["nan_count"] == 1 and ev["input.b"]["inf_count"] == 1


def test_cuda_graph_capture_defers_statistics_to_replays(otel_gpu_spans, monkeypatch):
    """While a CUDA graph is captured (faked), statistics are launched into a static buffer but
    never read; each event says they are not known at capture (tests/test_cuda_graphs.py has the
    replays)."""
    from otel_gpu.devices import cuda_graphs

    class FakeGraph:
        def replay(self):
            pass

        def capture_begin(self):
            pass

        def capture_end(self):
            pass

    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "is_capturing", lambda: True)
    monkeypatch.setattr(cuda_graphs, "graph_class", lambda: FakeGraph)
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def captured(x):
        return x + 1

    monkeypatch.setattr(cuda, "host_reads", 0)
    monkeypatch.setattr(
        stats, "compute", lambda *a: pytest.fail("eager reduction launched during capture")
    )
    try:
        captured(torch.ones(4))
    finally:
        cuda_graphs.uninstall()
    assert cuda.host_reads == 0
    ev = _events(spans.get()[0])
    assert set(ev) == {"input.x", "output.0"}
    for attrs in ev.values():
        assert attrs["otel_gpu.stats.note"] == stats.CAPTURED_NOTE
        assert "min" not in attrs and attrs["numel"] == 4


def test_level_10_behaves_at_least_like_5(otel_gpu_spans, tmp_path):
    """Level 10 includes level 5's statistics."""
    spans = otel_gpu_spans(level=10, dump_dir=str(tmp_path / "dumps"))

    @otel_gpu.api
    def f(x):
        return x

    f(torch.ones(2))
    assert "input.x" in _events(spans.get()[0])
