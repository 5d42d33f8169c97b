"""Low-precision statistics at level 5: float8, float4 and e8m0 tensors, and a wide tensor's
simulated cast (``OTEL_GPU_LOWP_SIMULATE``).

Promises: amax, dynamic range, zero fraction and saturation of every float8 format, of
float8_e8m0fnu and of float4_e2m1fn_x2 agree with values computed here independently (upcast
to float32 on CPU; float4 unpacked from its nibbles with the e2m1 table); a float4 tensor's
min/max/mean/std are of its unpacked values; a wide tensor's underflow and overflow under a
simulated cast agree with torch's own cast (float8) or round-to-nearest on the e2m1 table;
the same at CUDA graph capture; broadcast views give the materialised tensor's fractions; the
console shows them; ``otel-gpu diff`` compares amax and the fractions; a bad setting is a
clear error.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import otel_gpu
from otel_gpu.calls import stats
from otel_gpu.traces.diff_values import compare_stats


@pytest.fixture(autouse=True)
def _fingerprints_on():
    """Fingerprints on (off by default), so capture and broadcast views check them too."""
    otel_gpu.configure(fingerprint=True, strict=True)


FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _one(t: torch.Tensor) -> dict:
    (s,) = stats.finish([stats.compute("input.t", t)])
    return s.values


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _format_max(dtype: torch.dtype) -> float:
    """The format's largest finite magnitude, from all 256 bit patterns."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return every[torch.isfinite(every)].abs().max().item()


def _expected(values: torch.Tensor, top: float) -> dict[str, float]:
    """amax, dynamic range, zero fraction and saturation of float32 ``values``, by plain torch."""
    a = values.abs()
    finite = a[torch.isfinite(a)]
    nonzero = finite[finite > 0]
    out = {
        "amax": finite.max().item(),
        "zero_fraction": (a == 0).sum().item() / a.numel(),
        "saturation": (a == top).sum().item() / a.numel(),
    }
    if nonzero.numel():
        out["dynamic_range"] = math.log2(finite.max().item() / nonzero.min().item())
    return out


def _check(got: dict, want: dict) -> None:
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


@pytest.mark.parametrize("dtype", [*FP8, torch.float8_e8m0fnu], ids=str)
def test_float8_statistics_match_an_independent_upcast(dtype):
    """Every bit pattern (NaN and Inf included) over 4096 random bytes: amax, dynamic range,
    zero fraction and saturation match the float32 upcast computed here."""
    t = _random_bytes(4096, 1).view(dtype)
    values = t.float()
    got = _one(t)
    _check(got, _expected(values, _format_max(dtype)))
    assert "underflow" not in got and "simulated_format" not in got


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_a_saturated_float8_tensor(dtype):
    """Values cast past the format's largest magnitude and exact zeros are counted."""
    top = _format_max(dtype)
    wide = torch.tensor([0.0, 0.0, top, -top, 1.0, 0.5, -0.25, 2.0**-6])
    got = _one(wide.to(dtype))
    assert got["saturation"] == pytest.approx(2 / 8)
    assert got["zero_fraction"] == pytest.approx(2 / 8)
    assert got["amax"] == top
    assert got["dynamic_range"] == pytest.approx(math.log2(top / 2.0**-6))


def _unpack(raw: torch.Tensor) -> list[float]:
    """Two e2m1 values per byte, from its nibbles: bit 3 the sign, bits 0-2 the table index."""
    out = []
    for byte in raw.tolist():
        for nibble in (byte & 0xF, byte >> 4):
            value = E2M1[nibble & 7]
            out.append(-value if nibble & 8 else value)
    return out


def test_float4_statistics_match_the_unpacked_nibbles():
    """float4_e2m1fn_x2: min/max/mean/std, amax, dynamic range, zeros and saturation are those
    of the 2 x numel values unpacked here, nibble by nibble; numel stays the tensor's."""
    raw = _random_bytes(3000, 2)
    values = torch.tensor(_unpack(raw), dtype=torch.float64)
    (s,) = stats.finish([stats.compute("input.t", raw.view(torch.float4_e2m1fn_x2))])
    got = s.values
    assert s.numel == 3000 and "two e2m1 values" in s.note
    assert got["min"] == values.min().item() and got["max"] == values.max().item()
    assert got["mean"] == pytest.approx(values.mean().item(), rel=1e-9, abs=1e-12)
    assert got["std"] == pytest.approx(values.std().item(), rel=1e-6)
    assert (got["nan_count"], got["inf_count"]) == (0, 0)
    _check(got, _expected(values.float(), 6.0))
    assert got["amax"] == 6.0 and got["dynamic_range"] == pytest.approx(math.log2(12))


def test_float4_with_one_value_per_element_pair():
    """A single packed byte holds two values: std is defined (two values), the fractions are
    over both."""
    raw = torch.tensor([0x70], dtype=torch.uint8)  # low nibble 0 (0.0), high nibble 7 (6.0)
    got = _one(raw.view(torch.float4_e2m1fn_x2))
    assert (got["min"], got["max"], got["mean"]) == (0.0, 6.0, 3.0)
    assert got["std"] == pytest.approx(math.sqrt(18))
    assert got["zero_fraction"] == 0.5 and got["saturation"] == 0.5
    assert "dynamic_range" in got and got["dynamic_range"] == 0.0


def _wide() -> torch.Tensor:
    """float32 values across every threshold: tiny, half-steps, normal, near and past the max."""
    g = torch.Generator().manual_seed(3)
    mags = torch.exp2(torch.empty(5000).uniform_(-30, 20, generator=g))
    signs = torch.where(torch.rand(5000, generator=g) < 0.5, -1.0, 1.0)
    exact = torch.tensor([0.0, 0.0, 2.0**-10, 2.0**-17, 0.25, 448.0, 57344.0, 6.0, float("inf")])
    return torch.cat([mags * signs, exact, -exact[2:8]])


def _cast_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest on the e2m1 magnitudes (ties to the even code), saturating at 6."""
    out = []
    for v in x.abs().tolist():
        if v > 6.0:
            out.append(6.0)
            continue
        best = min(range(8), key=lambda i: (abs(E2M1[i] - v), i % 2))
        out.append(E2M1[best])
    return torch.tensor(out)


@pytest.mark.parametrize(
    ("setting", "dtype", "top"),
    [
        ("e4m3", torch.float8_e4m3fn, 448.0),
        ("e5m2", torch.float8_e5m2, 57344.0),
        ("e2m1", None, 6.0),
    ],
)
@pytest.mark.parametrize("wide", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_simulated_cast_underflow_and_overflow(setting, dtype, top, wide):
    """A wide tensor with OTEL_GPU_LOWP_SIMULATE: underflow is the fraction of non-zero values
    the cast makes zero (torch's own cast for float8, round-to-nearest on the e2m1 table for
    float4), overflow the fraction beyond the format's largest magnitude (Inf included)."""
    otel_gpu.configure(lowp_simulate=setting, strict=True)
    x = _wide().to(wide)
    x32 = x.float()
    finite = torch.isfinite(x32)
    if dtype is not None:
        cast = x32[finite].to(dtype).float()
    else:
        cast = _cast_e2m1(x32[finite])
    underflow = ((x32[finite] != 0) & (cast == 0)).sum().item() / x.numel()
    overflow = (x32.abs() > top).sum().item() / x.numel()
    got = _one(x)
    assert got["simulated_format"] == {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}.get(
        setting, "float4_e2m1fn"
    )
    assert got["underflow"] == pytest.approx(underflow, abs=1e-12)
    assert got["overflow"] == pytest.approx(overflow, abs=1e-12)
    assert got["underflow"] > 0 and got["overflow"] > 0
    want = _expected(x32, top)
    del want["saturation"]
    _check(got, want)
    assert "saturation" not in got


def test_no_simulation_by_default_and_never_for_integers():
    """OTEL_GPU_LOWP_SIMULATE defaults to off: a float32 tensor gets no low-precision keys; with
    it on, an integer tensor still gets none."""
    assert "amax" not in _one(torch.randn(10))
    otel_gpu.configure(lowp_simulate="e4m3", strict=True)
    assert "amax" not in _one(torch.arange(10))
    assert "underflow" in _one(torch.randn(10))


def test_bad_simulate_value_is_a_clear_error():
    """An unknown format is refused, naming the setting and what is allowed."""
    with pytest.raises(
        otel_gpu.ConfigError, match=r"OTEL_GPU_LOWP_SIMULATE.*off, e4m3, e5m2, e2m1"
    ):
        otel_gpu.configure(lowp_simulate="e3m4")


@pytest.mark.parametrize(
    "t",
    [
        _random_bytes(512, 4).view(torch.float8_e4m3fn),
        _random_bytes(512, 5).view(torch.float8_e5m2),
        _random_bytes(512, 6).view(torch.float4_e2m1fn_x2),
        torch.tensor([1.0, -2.0]).to(torch.float8_e4m3fnuz).expand(3, 2),
    ],
    ids=["e4m3fn", "e5m2", "e2m1_x2", "broadcast"],
)
def test_capture_gives_the_eager_low_precision_statistics(t):
    """At CUDA graph capture (capturable kernels, one static vector) the low-precision values
    are the eager ones."""
    eager = _one(t)
    p = stats.capture("k", t)
    got = stats.captured_stats("k", p.numel, p.note, p.integer, p.vec.tolist(), p.extras, True)
    for key in ("amax", "dynamic_range", "zero_fraction", "saturation"):
        assert got.values[key] == pytest.approx(eager[key]), key
    assert got.values["fingerprint"] == eager["fingerprint"]


def test_broadcast_view_fractions_are_the_materialised_tensors():
    """An expanded float8 tensor reports the fractions of its logical contents."""
    base = torch.tensor([0.0, 448.0, 1.0, 2.0]).to(torch.float8_e4m3fn)
    view = base.view(4, 1).expand(4, 50)
    got, want = _one(view), _one(view.contiguous())
    for key in ("amax", "dynamic_range", "zero_fraction", "saturation", "fingerprint"):
        assert got[key] == want[key]


def test_console_shows_low_precision_statistics(capsys):
    """The console's stats line names amax, dynamic range, zero fraction and saturation of a
    float8 tensor, the simulated cast's underflow and overflow of a wide one, and the
    fingerprint."""
    otel_gpu.configure(level=5, dest="stdout", color="never", lowp_simulate="e4m3", strict=True)

    @otel_gpu.api(name="lib.quantize")
    def quantize(x):
        return x.to(torch.float8_e4m3fn)

    quantize(torch.tensor([0.0, 1.0, 500.0, 1e-4]))
    otel_gpu.flush()
    out = capsys.readouterr().out
    line_in = next(x for x in out.splitlines() if x.strip().startswith("input.x:"))
    line_out = next(x for x in out.splitlines() if x.strip().startswith("output.0:"))
    assert "amax=500 " in line_in and "as float8_e4m3fn: underflow=0.25 overflow=0.25" in line_in
    assert "amax=448 " in line_out and "zero_fraction=0.5 saturation=0.25" in line_out
    assert re.search(r"numel=4 fingerprint=[0-9a-f]{16}", line_out)


def test_diff_compares_amax_and_the_fractions():
    """Statistics otherwise equal: amax beyond the tolerance differs; saturation more than
    FRACTION_TOLERANCE apart differs; within it, close (same only when equal)."""
    base = {"numel": 8, "min": -1.0, "max": 1.0, "mean": 0.0, "std": 0.5, "nan_count": 0}
    low = {"amax": 1.0, "zero_fraction": 0.25, "saturation": 0.125}
    dtype = "torch.float8_e4m3fn"

    def cmp(b: dict) -> dict:
        return compare_stats("output.0", {**base, **low}, {**base, **low, **b}, dtype)

    assert cmp({})["status"] == "same"
    assert (cmp({"amax": 2.0})["status"], cmp({"amax": 2.0})["field"]) == ("differ", "amax")
    r = cmp({"saturation": 0.25})
    assert (r["status"], r["field"]) == ("differ", "saturation")
    assert cmp({"saturation": 0.1255})["status"] == "close"
    assert (
        compare_stats("o", {**base, "underflow": 0.0}, {**base, "underflow": 0.5}, dtype)["field"]
        == "underflow"
    )


def test_console_without_color_is_plain_text():
    """The low-precision parts are plain ``name=value`` text a grep finds."""
    from otel_gpu.exporters.console import _stats_line, _Style

    attrs = {"otel_gpu.tensor": "x", "numel": 2, "amax": 3.0, "saturation": 0.0}
    line = _stats_line(attrs, _Style(False))
    assert line == "    x: amax=3 saturation=0 numel=2"
