"""``otel-gpu diff`` never claims more than it compared.

Promises: "same" (exit 0) only when every compared tensor is bit-identical, by fingerprint, by
exactly equal statistics or by the same dumped bytes; a difference within the tolerance is the
verdict "close" (exit 3), which exits 0 only when the user accepted a tolerance (``--tolerance``,
``--rtol``, ``--atol``) and is never called "same"; one run with fingerprints and one without is
compared by statistics, with a warning saying so; the same program run twice on one machine
gives exactly equal statistics; ``--json`` is valid JSON, with non-finite numbers as strings.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from crafted_calls import call, stats, tensor, write

import otel_gpu
from otel_gpu.traces.diff import EXIT_CLOSE, diff
from otel_gpu.traces.diff_values import compare_stats, compare_tensors


def _matmul_run(path: Path, perturb: bool, fingerprint: bool = False) -> str:
    """The issue's repro: level 5, ``x @ w`` with activations around 1e-3; ``perturb`` scales
    one weight element by 1.001."""
    otel_gpu.configure(
        level=5, dest=str(path), provider="own", strict=True, fingerprint=fingerprint
    )

    @otel_gpu.api(name="lib.matmul")
    def matmul(x, w):
        return x @ w

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=gen) * 1e-3
    w = torch.randn(16, 16, generator=gen) * 1e-3
    if perturb:
        w[3, 5] *= 1.001
    matmul(x, w)
    assert otel_gpu.flush()
    return str(path)


def _diff(a: str, b: str, **kw) -> tuple[int, dict, str]:
    out, err = io.StringIO(), io.StringIO()
    code = diff(a, b, as_json=True, out=out, err=err, **kw)
    return code, (json.loads(out.getvalue()) if out.getvalue() else {}), err.getvalue()


def test_a_weight_element_times_1_001_is_close_never_same(tmp_path):
    """w[3,5] *= 1.001 with activations around 1e-3: the statistics move by about 1e-6
    relative, inside float32's tolerance. The verdict is "close" with exit 3, naming the call,
    never "same"; with a tolerance accepted it exits 0, and the verdict is still "close"."""
    a = _matmul_run(tmp_path / "a.jsonl", False)
    b = _matmul_run(tmp_path / "b.jsonl", True)
    code, report, _ = _diff(a, b)
    assert (code, report["verdict"]) == (EXIT_CLOSE, "close"), report
    assert report["tensors"]["close"] >= 1 and report["tensors"]["differ"] == 0
    assert report["first_close"]["function"] == "lib.matmul"
    code, report, _ = _diff(a, b, accept_close=True)
    assert (code, report["verdict"]) == (0, "close")
    text = io.StringIO()
    assert diff(a, b, out=text, err=io.StringIO()) == EXIT_CLOSE
    assert text.getvalue().startswith("close: ") and "within tolerance" in text.getvalue()


def test_the_same_program_twice_gives_exactly_equal_statistics(tmp_path):
    """Two runs of one program on one machine: every statistic equal to the last bit, so the
    verdict is "same" (exit 0) by statistics alone."""
    a = _matmul_run(tmp_path / "a.jsonl", False)
    b = _matmul_run(tmp_path / "b.jsonl", False)
    code, report, err = _diff(a, b)
    assert (code, report["verdict"]) == (0, "same"), (report, err)
    assert report["tensors"]["close"] == 0 and report["compared_by"] == {"statistics": 3}


def test_one_run_with_fingerprints_and_one_without_warns_and_says_how(tmp_path):
    """A with fingerprints, B without: compared by statistics (the report says so, and which run
    had them), a warning on stderr; the changed weight is still not "same"."""
    a = _matmul_run(tmp_path / "a.jsonl", False, fingerprint=True)
    b = _matmul_run(tmp_path / "b.jsonl", True)
    code, report, err = _diff(a, b)
    assert report["verdict"] == "close" and code == EXIT_CLOSE
    assert report["fingerprints"] == {"a": True, "b": False, "used": False}
    assert report["compared_by"] == {"statistics": 3}
    assert "run A carries fingerprints" in report["warnings"][0]
    assert "warning: run A carries fingerprints" in err
    # both with fingerprints: the bytes decide, and the change is a divergence
    c = _matmul_run(tmp_path / "c.jsonl", True, fingerprint=True)
    code, report, err = _diff(a, c)
    assert (code, report["verdict"]) == (1, "diverged") and not report["warnings"]
    assert report["fingerprints"]["used"] is True


def test_statistics_exactly_equal_are_same_within_tolerance_close():
    """compare_stats: the same numbers are "same"; a mean 1e-9 apart is "close" (naming the
    statistic); beyond the tolerance "differ"."""
    base = stats(-1, 1, 0, 0.5)
    assert compare_stats("o", base, dict(base), "torch.float32")["status"] == "same"
    r = compare_stats("o", base, {**base, "mean": 1e-9}, "torch.float32")
    assert (r["status"], r["field"]) == ("close", "mean")
    assert compare_stats("o", base, {**base, "mean": 1e-3}, "torch.float32")["status"] == "differ"


def test_equal_statistics_with_different_fingerprints_are_never_same():
    """--no-fingerprints compares by statistics, but bytes known to differ are "close" at best."""
    base = stats(-1, 1, 0, 0.5)
    a, b = {**base, "fingerprint": "ab"}, {**base, "fingerprint": "cd"}
    r = compare_stats("o", a, b, "torch.float32", fingerprints=False)
    assert r["status"] == "close"
    r = compare_stats("o", a, b, "torch.float32")
    assert (r["status"], r["statistics"]) == ("differ", "same")


def test_dumped_tensors_are_same_only_when_bit_identical():
    """One rounding step apart is "close"; -0.0 against 0.0 is not bit-identical; a copy is."""
    a = torch.linspace(-1, 1, 16)
    assert compare_tensors("o", a, a.clone())["status"] == "same"
    b = a.clone()
    b[3] = torch.nextafter(b[3], torch.tensor(2.0))
    assert compare_tensors("o", a, b)["status"] == "close"
    zeros = torch.zeros(4)
    assert compare_tensors("o", zeros, -zeros)["status"] == "close"


def test_json_output_writes_non_finite_numbers_as_strings(tmp_path):
    """An infinite statistic in one run: the report's error is infinite; --json writes it as
    the string "Infinity" and parses with a strict JSON reader (no bare Infinity or NaN)."""

    def run(name: str, hi: float) -> str:
        s = {"output.0": {**stats(-1, 1, 0, 0.5), "max": hi}}
        return write(tmp_path / name, [call("lib.f", outputs={"0": tensor([4])}, stats=s)])

    out = io.StringIO()
    code = diff(run("a", 1.0), run("b", math.inf), as_json=True, out=out, err=io.StringIO())
    assert code == 1

    def refuse(word: str) -> None:
        raise ValueError(f"bare {word} in --json output")

    report = json.loads(out.getvalue(), parse_constant=refuse)
    (tensor_report,) = report["first_diverged"]["tensors"]
    assert tensor_report["error"] == "Infinity"


@pytest.mark.parametrize("flag", [["--tolerance"], ["--rtol", "0.5"], ["--atol", "0.01"]])
def test_the_command_line_accepts_close_only_when_asked(tmp_path, flag):
    """otel-gpu diff: close exits 3; with --tolerance, --rtol or --atol it exits 0."""
    from otel_gpu.cli import main

    def run(name: str, mean: float) -> str:
        s = {"output.0": stats(-1, 1, mean, 0.5)}
        return write(tmp_path / name, [call("lib.f", outputs={"0": tensor([4])}, stats=s)])

    a, b = run("a", 0.0), run("b", 1e-9)
    assert main(["diff", a, b]) == EXIT_CLOSE
    assert main(["diff", a, b, *flag]) == 0
