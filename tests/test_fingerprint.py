"""The level-5 ``fingerprint`` statistic: a 64-bit hash of a tensor's bytes, computed on its device.

Promises: the documented formula (checked against a pure-Python implementation of it); equal
logical contents give equal fingerprints whatever the strides, one element changed by 1e-3
changes it; every dtype gets one (bool, complex, float8, float4, sub-byte, quantized, empty,
0-d); the same in another process; at capture the same as eager; never raised into the
program; off unless ``OTEL_GPU_FINGERPRINT=true``; ``otel-gpu diff`` names a call whose
output bytes changed though its statistics agree within tolerance.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import otel_gpu
from otel_gpu.calls import fingerprint, stats

M64 = (1 << 64) - 1


@pytest.fixture(autouse=True)
def _fingerprints_on():
    """Fingerprints are off by default; these tests turn them on (a test may turn them off)."""
    otel_gpu.configure(fingerprint=True, strict=True)


def _fp(t: torch.Tensor) -> str | None:
    (s,) = stats.finish([stats.compute("input.t", t)])
    return s.values.get("fingerprint")


def _signed(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


def _mix(i: int) -> int:
    """The documented odd mix of a position, on Python ints (torch's >> is arithmetic)."""
    w = _signed((i * 0x9E3779B97F4A7C15) & M64)
    w = (w ^ (w >> 31)) & M64
    return ((w * 0xBF58476D1CE4E5B9) & M64) | 1


def _reference(data: bytes, width: int) -> str:
    """The fingerprint of ``data`` read as little-endian signed words of ``width`` bytes, from
    the formula in docs/levels.md, without torch."""
    fmt = {1: "b", 2: "h", 4: "i", 8: "q"}[width]
    words = struct.unpack(f"<{len(data) // width}{fmt}", data)
    total = 0
    for i, v in enumerate(words):
        total += v * _mix(i % 65536) * _mix(i // 65536)
    h = (total + len(words) * 0x2545F4914F6CDD1D) & M64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & M64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & M64
    return format(h ^ (h >> 31), "016x")


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    ("t", "width"),
    [
        (torch.arange(10, dtype=torch.float32), 4),
        (torch.randn(65536 * 2 + 5, generator=torch.Generator().manual_seed(1)), 4),
        (torch.tensor([1, -2, 3], dtype=torch.int64), 8),
        (torch.tensor([True, False, True]), 1),
        (torch.tensor([1.5, -2.25], dtype=torch.bfloat16), 2),
        (torch.tensor([1 + 2j, -3j], dtype=torch.complex128), 8),
    ],
    ids=["float32", "two-rows-and-a-tail", "int64", "bool", "bfloat16", "complex128"],
)
def test_fingerprint_is_the_documented_formula(t, width):
    """The fingerprint equals the formula computed in pure Python over the tensor's bytes
    (weights past 65,536 words included)."""
    assert _fp(t) == _reference(_bytes(t), width)


def test_equal_tensors_agree_and_a_small_change_does_not():
    """Equal values give equal fingerprints; one element moved by 1e-3 gives another."""
    torch.manual_seed(0)
    a = torch.randn(32, 32)
    b = a.clone()
    assert _fp(a) == _fp(b)
    b[7, 3] += 1e-3
    assert _fp(a) != _fp(b)
    c = a.clone()
    c[0, 0], c[0, 1] = a[0, 1], a[0, 0]  # a permutation keeps min/max/mean/std, not the hash
    assert _fp(a) != _fp(c)


def test_strides_and_offsets_do_not_matter_only_the_values():
    """A transposed view, a strided slice, an offset view and a broadcast view give the
    fingerprint of their contiguous copy."""
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    views = [base.t(), base[1:, ::2], base[3], torch.randn(1, 5).expand(4, 5), base.view(-1)[5:]]
    for v in views:
        assert not v.is_contiguous() or v.storage_offset() > 0
        assert _fp(v) == _fp(v.contiguous().clone())


def _every_dtype() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, generator=g)
    raw = torch.randint(0, 255, (3, 4), dtype=torch.uint8, generator=g)
    out = [
        x.to(d)
        for d in (
            torch.float16,
            torch.bfloat16,
            torch.float64,
            torch.complex64,
            torch.complex128,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.uint8,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.float8_e4m3fnuz,
            torch.float8_e5m2fnuz,
        )
    ]
    out += [x > 0, x.to(torch.complex32)]
    out += [raw.view(d) for d in (torch.float4_e2m1fn_x2, torch.float8_e8m0fnu, torch.uint4)]
    out += [raw.view(d) for d in (torch.int2, torch.bits8, torch.bits4x2)]
    out.append(torch.quantize_per_tensor(x, 0.1, 0, torch.qint8))
    return out


@pytest.mark.parametrize("t", _every_dtype(), ids=lambda t: str(t.dtype))
def test_every_dtype_has_a_fingerprint_that_sees_a_changed_byte(t):
    """Every dtype, with arithmetic in torch or not, gets a fingerprint; a transposed view has
    its copy's; one byte changed changes it."""
    fp = _fp(t)
    assert fp is not None and len(fp) == 16
    if not t.is_quantized:
        assert _fp(t.t()) == _fp(_contiguous(t.t()))
        size = t.element_size()
        changed = _contiguous(t).view(torch.uint8).clone()  # (3, 4 * size) bytes
        changed[1, 2 * size] ^= 0x10
        assert _fp(changed.view(t.dtype)) != fp


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy, through a same-width integer view for dtypes torch cannot copy."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.element_size() in ints:
        return t.view(ints[t.element_size()]).contiguous().view(t.dtype)
    return t.contiguous()


def test_empty_and_zero_dim_tensors():
    """An empty tensor's fingerprint is that of no bytes (known without the device); a 0-d
    tensor is its one element's."""
    assert _fp(torch.empty(0, 3)) == _fp(torch.empty(0)) == _reference(b"", 4)
    assert (
        _fp(torch.tensor(3.0))
        == _fp(torch.tensor([3.0]))
        == _reference(_bytes(torch.tensor(3.0)), 4)
    )


def test_the_same_in_another_process():
    """Deterministic across processes: a child computes the parent's fingerprint."""
    t = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    code = (
        "import torch, otel_gpu; from otel_gpu.calls import stats; "
        "t = torch.randn(1000, generator=torch.Generator().manual_seed(4)); "
        "print(stats.finish([stats.compute('k', t)])[0].values['fingerprint'])"
    )
    env = {**os.environ, "OTEL_GPU_FINGERPRINT": "true"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _fp(t)


def test_capture_computes_the_eager_fingerprint_without_the_cached_table():
    """At CUDA graph capture (no cached table, capturable ops) the fingerprint is the eager one,
    small and large."""
    for t in (torch.randn(100), torch.randn(65536 * 3 + 1), torch.randn(7, 9).t()):
        p = stats.capture("k", t)
        row = p.vec.tolist()
        got = stats.captured_stats("k", p.numel, p.note, p.integer, row, p.extras, p.moments > 0)
        assert got.values["fingerprint"] == _fp(t)


def test_off_by_default_and_by_the_setting(otel_gpu_spans):
    """Without OTEL_GPU_FINGERPRINT (or with it false) statistics events carry no fingerprint."""
    from otel_gpu import config

    assert config.Settings().fingerprint is False
    spans = otel_gpu_spans(level=5, fingerprint=False)

    @otel_gpu.api
    def f(x):
        return x * 2

    f(torch.ones(3))
    (span,) = spans.get()
    events = [dict(e.attributes) for e in span.events if e.name == "otel_gpu.stats"]
    assert events and all("fingerprint" not in e for e in events)
    assert all("min" in e for e in events)


def test_a_failing_fingerprint_never_reaches_the_program(otel_gpu_spans, monkeypatch):
    """An error in the hash is an internal error: the call returns its result, the other
    statistics stay, and the note says the fingerprint was left out."""
    spans = otel_gpu_spans(level=5, strict=False)

    def broken(t, cache=True):
        raise RuntimeError("boom")

    monkeypatch.setattr(fingerprint, "launch", broken)

    @otel_gpu.api
    def f(x):
        return x + 1

    assert f(torch.zeros(2)).tolist() == [1.0, 1.0]
    (span,) = spans.get()
    (event, _) = [dict(e.attributes) for e in span.events if e.name == "otel_gpu.stats"]
    assert event["max"] == 0.0 and "fingerprint" not in event
    assert "fingerprint left out: RuntimeError" in event["otel_gpu.stats.note"]


def test_a_huge_broadcast_view_is_not_hashed_element_by_element():
    """A broadcast view of more than MAX_BROADCAST logical elements keeps its cheap statistics
    and says why it has no fingerprint."""
    (s,) = stats.finish([stats.compute("k", torch.ones(1).expand(fingerprint.MAX_BROADCAST + 1))])
    assert "fingerprint" not in s.values and s.values["mean"] == 1.0
    assert "fingerprint left out" in s.note


def _run(path, delta: float) -> None:
    otel_gpu.configure(level=5, dest=str(path), provider="own", strict=True, fingerprint=True)

    @otel_gpu.api(name="lib.layer")
    def layer(x):
        return x * 3

    @otel_gpu.api(name="lib.kernel")
    def kernel(x):
        y = x + 1
        y[5] += delta  # a one-element change far inside the float32 statistics tolerance
        return y

    x = torch.linspace(-1, 1, 64)
    layer(kernel(x))
    assert otel_gpu.flush()


def test_diff_names_a_call_whose_bytes_changed_though_its_statistics_agree(tmp_path):
    """Level 5, one output element moved by 1e-6: the statistics agree within tolerance, the
    fingerprints do not, and diff names that call (exit 1); by statistics alone it is close
    (exit 3, or 0 with a tolerance accepted), never same."""
    from otel_gpu.traces.diff import diff

    _run(tmp_path / "a.jsonl", 0.0)
    _run(tmp_path / "b.jsonl", 1e-6)
    out = io.StringIO()
    code = diff(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), as_json=True, out=out)
    report = json.loads(out.getvalue())
    assert code == 1 and report["verdict"] == "diverged"
    first = report["first_diverged"]
    assert first["function"] == "lib.kernel"
    (tensor,) = first["tensors"]
    assert tensor["method"] == "fingerprint" and tensor["statistics"] == "same"
    code = diff(
        str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), out=io.StringIO(), fingerprints=False
    )
    assert code == 3  # close: equal statistics, but the bytes are known to differ
    code = diff(
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "b.jsonl"),
        out=io.StringIO(),
        fingerprints=False,
        accept_close=True,
    )
    assert code == 0
