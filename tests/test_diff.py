"""``otel-gpu diff``: two runs lined up call by call, and the first call that diverged.

Promises: a tiny GPT2 run twice with 1e-3 added inside one module (a forward hook on a kernel
it calls) names that module as the first divergence, by statistics (level 5) and by dumped
tensors (level 10, trace files or dump folders); the same program twice is "same"; eager
against torch.compile is "same" within the default tolerances; an extra call is named as in
one run only; bad input exits 2 and never gives a verdict on what was not compared.
(The verdicts' own promises, "same" only for the bit-identical: test_diff_verdicts.py.)
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from crafted_calls import call, stats, tensor, write

from otel_gpu.traces.diff import diff
from otel_gpu.traces.diff_values import compare_stats, compare_tensors, tolerance

MLP_PATH = "GPT2LMHeadModel > GPT2Model > GPT2Block[1] > GPT2MLP"
PERTURB = ("--perturb", "transformer.h.1.mlp.c_proj")


def _diff(a: object, b: object, **kw) -> tuple[int, dict, str]:
    out, err = io.StringIO(), io.StringIO()
    code = diff(str(a), str(b), as_json=True, out=out, err=err, **kw)
    return code, (json.loads(out.getvalue()) if out.getvalue() else {}), err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The tiny GPT2 at batch 2: level 5 and level 10, plain and with 1e-3 added to the output
    of h.1.mlp's c_proj (not instrumented itself: the GPT2MLP span sees the change)."""
    pytest.importorskip("transformers")
    from tiny_runs import traced

    tmp = tmp_path_factory.mktemp("diff")
    return {
        "a5": traced(tmp / "a5", 5, 2),
        "p5": traced(tmp / "p5", 5, 2, *PERTURB),
        "a10": traced(tmp / "a10", 10, 2),
        "p10": traced(tmp / "p10", 10, 2, *PERTURB),
    }


@pytest.mark.transformers
@pytest.mark.slow
def test_level_5_statistics_name_the_perturbed_module(runs):
    """By statistics, the first call whose inputs matched and outputs did not is h.1's MLP."""
    code, report, _ = _diff(runs["a5"], runs["p5"])
    assert code == 1 and report["verdict"] == "diverged"
    first = report["first_diverged"]
    assert first["path"] == MLP_PATH
    assert {t["method"] for t in first["tensors"]} == {"statistics"}
    assert report["calls"]["a_only"] == report["calls"]["b_only"] == 0


@pytest.mark.transformers
@pytest.mark.slow
def test_level_5_fingerprints_name_the_perturbed_module(runs):
    """By fingerprints (OTEL_GPU_FINGERPRINT=true), the first divergence is h.1's MLP too, and
    the same program twice is the same by fingerprint: the hash is deterministic across
    processes."""
    from tiny_runs import traced

    tmp = runs["a5"].parent.parent
    on = {"OTEL_GPU_FINGERPRINT": "true"}
    a, b = traced(tmp / "f5", 5, 2, **on), traced(tmp / "pf5", 5, 2, *PERTURB, **on)
    code, report, _ = _diff(a, b)
    assert code == 1 and report["first_diverged"]["path"] == MLP_PATH
    assert {t["method"] for t in report["first_diverged"]["tensors"]} == {"fingerprint"}
    code, report, _ = _diff(a, traced(tmp / "f5again", 5, 2, **on))
    assert code == 0 and report["verdict"] == "same"
    assert report["tensors"]["differ"] == 0


@pytest.mark.transformers
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["trace files", "dump folders"])
def test_level_10_dumped_tensors_name_the_perturbed_module(runs, kind):
    """By dumped tensors (read through the span's dump directory, or from the dump folders
    themselves): h.1's MLP, with its errors measured."""
    a, b = runs["a10"], runs["p10"]
    if kind == "dump folders":
        a, b = a.parent / "dumps", b.parent / "dumps"
    code, report, _ = _diff(a, b)
    assert code == 1
    first = report["first_diverged"]
    assert first["path"] == MLP_PATH
    (out,) = first["tensors"]
    assert out["method"] == "tensors" and out["mismatch_pct"] == 100.0
    assert out["max_abs_error"] == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.transformers
@pytest.mark.slow
def test_the_same_program_twice_is_same(runs):
    """Level 5 against level 10 of the same program: every statistic agrees, exit 0."""
    code, report, _ = _diff(runs["a5"], runs["a10"])
    assert code == 0, report
    assert report["verdict"] == "same" and report["tensors"]["differ"] == 0
    assert report["tensors"]["same"] > 0


@pytest.mark.transformers
@pytest.mark.slow
def test_eager_against_torch_compile_is_same(runs, tmp_path):
    """The model under torch.compile (inductor) against eager, at level 5: nothing differs
    beyond the default tolerances; where the bytes differ the verdict is "close" (exit 3),
    which a tolerance accepted (--tolerance) turns into exit 0."""
    from tiny_runs import traced

    compiled = traced(tmp_path, 5, 2, "--compile")
    code, report, err = _diff(runs["a5"], compiled)
    assert report["verdict"] in ("same", "close"), (report, err)
    assert code == (0 if report["verdict"] == "same" else 3)
    code, report, err = _diff(runs["a5"], compiled, accept_close=True)
    assert code == 0 and report["tensors"]["differ"] == 0, (report, err)


def _model(tmp: Path, name: str, *, extra: bool = False, shift: float = 0.0, **kw) -> str:
    """A crafted run: model > [norm, (extra), mlp]; mlp's output shifted by ``shift``."""
    x = {"x": tensor([4, 4])}
    root = call("lib.model", inputs=x, outputs={"0": tensor([4, 4])})
    spans = [root]
    spans.append(
        call(
            "lib.norm",
            parent=root,
            inputs=x,
            outputs={"0": tensor([4, 4])},
            stats={"input.x": stats(-1, 1, 0, 0.5), "output.0": stats(-1, 1, 0, 0.5)},
        )
    )
    if extra:
        spans.append(call("lib.extra", parent=root, inputs=x))
    spans.append(
        call(
            "lib.mlp",
            parent=root,
            inputs=x,
            outputs={"0": tensor([4, 4])},
            stats={"input.x": stats(-1, 1, 0, 0.5), "output.0": stats(-1, 1 + shift, shift, 0.5)},
        )
    )
    return write(tmp / name, spans, **kw)


def test_one_extra_call_is_in_one_run_only_and_the_rest_still_lines_up(tmp_path):
    """B calls lib.extra between two calls A also makes: it is named as in B only, the others
    pair off, and the verdict is diverged (exit 1)."""
    code, report, _ = _diff(_model(tmp_path, "a"), _model(tmp_path, "b", extra=True))
    assert code == 1
    assert [c["function"] for c in report["b_only"]] == ["lib.extra"]
    assert report["calls"]["paired"] == 3 and report["aligned_fuzzily"]
    assert report["first_diverged"] is None


def test_statistics_beyond_tolerance_name_the_call_and_its_caller_comes_after(tmp_path):
    """mlp's output mean moved by 1e-3: mlp is the first to diverge (its inputs agree). Moved by
    1e-9, within tolerance: "close" (exit 3), never "same", naming mlp."""
    code, report, _ = _diff(_model(tmp_path, "a"), _model(tmp_path, "b", shift=1e-3))
    assert code == 1 and report["first_diverged"]["function"] == "lib.mlp"
    code, report, _ = _diff(_model(tmp_path, "c"), _model(tmp_path, "d", shift=1e-9))
    assert code == 3 and report["verdict"] == "close"
    assert report["first_close"]["function"] == "lib.mlp"


def test_fingerprints_decide_when_both_runs_carry_them(tmp_path):
    """Equal statistics but different fingerprints: differ (by fingerprint)."""
    same = stats(-1, 1, 0, 0.5)
    a = compare_stats(
        "output.0", {**same, "fingerprint": "ab"}, {**same, "fingerprint": "cd"}, "torch.float32"
    )
    assert (a["status"], a["method"]) == ("differ", "fingerprint")
    b = compare_stats("output.0", {**same, "fingerprint": "ab"}, same, "torch.float32")
    assert (b["status"], b["method"]) == ("same", "statistics")


@pytest.mark.parametrize(
    ("dtype", "step", "status"),
    [
        ("float32", 1e-7, "close"),
        ("float32", 1e-3, "differ"),
        ("bfloat16", 1e-3, "same"),  # rounds back to the same bfloat16 values
        ("bfloat16", 0.1, "differ"),
        ("float64", 1e-5, "differ"),
        ("float64", 1e-9, "close"),
        ("int64", 1, "differ"),
    ],
)
def test_dumped_tensors_are_compared_with_dtype_aware_tolerances(dtype, step, status):
    """Default (rtol, atol) per dtype: float32's 1.3e-6/1e-5, bfloat16's 1.6e-2, integers exact;
    within them "close", and "same" only for the same bytes."""
    import torch

    a = torch.arange(1, 17, dtype=torch.float64).reshape(4, 4).to(getattr(torch, dtype))
    b = (a.to(torch.float64) + step).to(getattr(torch, dtype))
    result = compare_tensors("output.0", a, b)
    assert result["status"] == status, result
    loose = compare_tensors("output.0", a, b, rtol=1.0, atol=1.0)
    assert loose["status"] == ("same" if status == "same" else "close")
    assert tolerance(dtype, rtol=0.5) == (0.5, tolerance(dtype)[1])


def test_nan_and_inf_positions_must_match():
    """NaN equals NaN and Inf equals the same Inf; a NaN against a number differs."""
    import torch

    a = torch.tensor([1.0, float("nan"), float("inf")])
    assert compare_tensors("o", a, a.clone())["status"] == "same"
    b = torch.tensor([1.0, 2.0, float("inf")])
    assert compare_tensors("o", a, b)["status"] == "differ"


def test_bad_input_exits_2_and_gives_no_verdict(tmp_path):
    """Different services, a torn file, a file against a folder, and runs with only metadata
    (level 3) that agrees, a scalar argument included: exit 2 with one line saying why; no
    verdict is claimed (equal metadata is not "same")."""
    a = _model(tmp_path, "a")
    other = _model(tmp_path, "b", service="other")
    code, report, err = _diff(a, other)
    assert code == 2 and not report and "different programs" in err
    torn = Path(_model(tmp_path, "t"))
    torn.write_text(torn.read_text() + '{"resourceSpans": [')
    code, report, err = _diff(a, torn)
    assert code == 2 and not report and "incomplete" in err
    code, _, err = _diff(a, tmp_path)
    assert code == 2 and "two trace files or two dump folders" in err
    meta = [
        call(
            "lib.f",
            inputs={"x": tensor([2]), "eps": {"value": 1e-6}},
            outputs={"0": tensor([2])},
        )
    ]
    code, report, err = _diff(write(tmp_path / "m1", meta), write(tmp_path / "m2", meta))
    assert code == 2 and report["verdict"] == "not compared" and "not compared" in err
    shapes = [
        call(
            "lib.f",
            inputs={"x": tensor([3]), "eps": {"value": 1e-6}},
            outputs={"0": tensor([3])},
        )
    ]
    code, report, _ = _diff(write(tmp_path / "m3", meta), write(tmp_path / "m4", shapes))
    assert code == 1 and report["first_inputs_differ"]["function"] == "lib.f"
    versions = write(tmp_path / "v", meta, resource={"otel_gpu.version": "9.9"})
    code, _, err = _diff(write(tmp_path / "m5", meta), versions)
    assert code == 2 and "otel-gpu 0.1.0" in err


def test_the_command_line(tmp_path):
    """otel-gpu diff is a registered command with --rtol/--atol; a negative tolerance is a
    one-line usage error."""
    from otel_gpu.cli import main

    a, b = _model(tmp_path, "a"), _model(tmp_path, "b", shift=1e-3)
    assert main(["diff", a, b]) == 1
    assert main(["diff", a, b, "--atol", "0.01"]) == 0
    with pytest.raises(SystemExit) as exited:
        main(["diff", a, b, "--rtol", "-1"])
    assert exited.value.code == 2


def test_workloads_and_diff_of_trace_files_import_no_torch(tmp_path):
    """Both commands read trace files (statistics, no dumps) without importing torch, as the
    other trace tools do: they start in a fraction of torch's import time."""
    import subprocess
    import sys

    path = _model(tmp_path, "a")
    program = (
        "import json, sys\n"
        "from otel_gpu.cli import main\n"
        f"codes = [main(['workloads', {path!r}]), main(['diff', {path!r}, {path!r}])]\n"
        "print(json.dumps({'codes': codes, 'torch': 'torch' in sys.modules}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"codes": [0, 0], "torch": False}
