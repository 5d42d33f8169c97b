"""``otel-gpu workloads``: calls grouped by function and input signature, and ``--emit``.

Promises: a tiny GPT2 traced twice with different batch shapes gives one workload per shape
with the right call counts; device time is used (and said) where spans carry it; ``--emit``
writes files a benchmark rebuilds tensors of the recorded shapes from (random or from the
level-10 dump); FlashInfer's own definition comes from the real package's ``fi_trace``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from crafted_calls import call, tensor, write

from otel_gpu.traces.workload_files import rebuild_inputs
from otel_gpu.traces.workloads import workloads

MLP = "transformers.models.gpt2.modeling_gpt2.GPT2MLP.forward"
HEAD = "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel.forward"


def _run(paths: list[str], **kw) -> tuple[int, dict, str]:
    out, err = io.StringIO(), io.StringIO()
    code = workloads(paths, as_json=True, out=out, err=err, **kw)
    return code, (json.loads(out.getvalue()) if out.getvalue() else {}), err.getvalue()


@pytest.fixture(scope="module")
def two_batches(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny GPT2 at batch 2 (level 10, safetensors dumps) and at batch 3 (level 3)."""
    pytest.importorskip("transformers")
    from tiny_runs import traced

    tmp = tmp_path_factory.mktemp("workloads")
    a = traced(tmp / "a", 10, 2, OTEL_GPU_DUMP_FORMAT="safetensors")
    b = traced(tmp / "b", 3, 3)
    return a, b


@pytest.mark.transformers
@pytest.mark.slow
def test_two_batch_shapes_give_one_workload_per_shape_with_its_count(two_batches):
    """GPT2MLP runs twice a forward (two layers): two signatures, [2,8,64] and [3,8,64], two
    calls each; the whole model once per batch; shares add up to 1; the level-10 run's
    signature names a dump directory."""
    code, report, _ = _run([str(p) for p in two_batches])
    assert code == 0
    rows = report["workloads"]
    mlp = {tuple(r["inputs"]["hidden_states"]["shape"]): r for r in rows if r["function"] == MLP}
    assert set(mlp) == {(2, 8, 64), (3, 8, 64)}
    assert [mlp[k]["calls"] for k in sorted(mlp)] == [2, 2]
    assert mlp[(2, 8, 64)]["dump_dir"] and mlp[(3, 8, 64)]["dump_dir"] is None
    head = sorted(
        (r["inputs"]["input_ids"]["shape"], r["calls"]) for r in rows if r["function"] == HEAD
    )
    assert head == [([2, 8], 1), ([3, 8], 1)]
    assert abs(sum(r["share"] for r in rows) - 1) < 1e-3
    assert all(r["time"] == "host" for r in rows)
    totals = [r["total_s"] for r in rows]
    assert totals == sorted(totals, reverse=True)


@pytest.mark.transformers
@pytest.mark.slow
def test_emit_round_trips_into_tensors_of_the_recorded_shapes(two_batches, tmp_path):
    """Every workload line rebuilds its inputs: random tensors of the recorded shape and dtype,
    or, where a level-10 dump exists, the dumped tensor itself (read from its safetensors file)."""
    import torch
    from safetensors.torch import load_file

    code, _, _ = _run([str(p) for p in two_batches], functions=[MLP], emit=str(tmp_path))
    assert code == 0
    lines = [
        json.loads(x)
        for f in (tmp_path / "workloads").iterdir()
        for x in f.read_text().splitlines()
    ]
    assert len(lines) == 2
    for line in lines:
        entry = line["workload"]["inputs"]["hidden_states"]
        rebuilt = rebuild_inputs(line["workload"]["inputs"])["hidden_states"]
        assert list(rebuilt.shape) == entry["shape"] and rebuilt.dtype == torch.float32
        definition = json.loads((tmp_path / line["otel_gpu"]["definition_file"]).read_text())
        assert definition["inputs"]["hidden_states"]["shape"] == entry["shape"]
        if entry["type"] == "safetensors":
            dumped = load_file(entry["path"])[entry["tensor_key"]]
            assert torch.equal(rebuilt, dumped)
    assert {line["workload"]["inputs"]["hidden_states"]["type"] for line in lines} == {
        "safetensors",
        "random",
    }


def test_device_time_is_used_and_said_where_every_call_has_it(tmp_path):
    """A signature whose calls all carry otel_gpu.device.duration is timed by it ("device");
    one with a call without it falls back to host time ("host"); sorted by total time."""
    x = {"x": tensor([4, 4])}
    spans = [
        call("lib.f", inputs=x, seconds=0.5, extra={"otel_gpu.device.duration": 0.001}),
        call("lib.f", inputs=x, seconds=0.5, extra={"otel_gpu.device.duration": 0.003}),
        call("lib.g", inputs=x, seconds=0.002),
        call("lib.g", inputs=x, seconds=0.004, extra={"otel_gpu.device.duration": 9.0}),
    ]
    code, report, _ = _run([write(tmp_path / "t.jsonl", spans)])
    assert code == 0
    f, g = sorted(report["workloads"], key=lambda r: r["function"])
    assert (f["time"], f["total_s"], f["p50_s"], f["p99_s"]) == ("device", 0.004, 0.001, 0.003)
    assert (g["time"], g["total_s"]) == ("host", 0.006)
    assert [r["function"] for r in report["workloads"]] == ["lib.g", "lib.f"]


def test_signature_strides_scalars_rules_top_and_function_filters(tmp_path):
    """Strides count only for non-contiguous tensors; every scalar counts by default, and a
    --scalars rule keeps only the named ones; --top and --function cut the list."""
    spans = [
        call("lib.f", inputs={"x": tensor([4, 4]), "eps": {"value": 1e-6}, "step": {"value": 1}}),
        call("lib.f", inputs={"x": tensor([4, 4]), "eps": {"value": 1e-6}, "step": {"value": 2}}),
        call("lib.f", inputs={"x": tensor([4, 4], stride=[1, 4]), "eps": {"value": 1e-6}}),
        call("lib.h", inputs={"x": tensor([4])}),
        call("lib.level1"),
    ]
    path = write(tmp_path / "t.jsonl", spans)
    _, report, _ = _run([path], functions=["lib.f"])
    assert sorted(r["calls"] for r in report["workloads"]) == [1, 1, 1]
    strided = [r for r in report["workloads"] if "stride" in r["inputs"]["x"]]
    assert len(strided) == 1 and strided[0]["inputs"]["x"]["stride"] == [1, 4]
    _, report, _ = _run([path], functions=["lib.f"], rules={"lib.*": frozenset({"eps"})})
    assert sorted(r["calls"] for r in report["workloads"]) == [1, 2]
    _, report, _ = _run([path], top=1)
    assert len(report["workloads"]) == 1 and report["left_out"] == 3
    assert report["calls"] == 4  # the level-1 call (no inputs recorded) is not counted


def test_no_recorded_call_exits_1_and_an_invalid_file_exits_2(tmp_path):
    """Only level-1 spans: exit 1 saying so; an invalid line: exit 2 naming FILE:LINE; a torn
    last line is skipped with a warning, as show and ranks do."""
    code, _, err = _run([write(tmp_path / "a.jsonl", [call("lib.f")])])
    assert code == 1 and "no call recorded at level 3" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    code, _, err = _run([str(bad)])
    assert code == 2 and f"{bad}:1" in err
    torn = tmp_path / "torn.jsonl"
    write(torn, [call("lib.f", inputs={"x": tensor([2])})])
    torn.write_text(torn.read_text() + '{"resourceSpans": [')
    code, report, err = _run([str(torn)])
    assert code == 0 and report["calls"] == 1 and "torn" in err


def test_the_command_line(tmp_path):
    """otel-gpu workloads is a registered command; a bad --scalars rule is a one-line error."""
    from otel_gpu.cli import main

    path = write(tmp_path / "t.jsonl", [call("lib.f", inputs={"x": tensor([2])})])
    assert main(["workloads", path, "--top", "1", "--function", "lib.*"]) == 0
    with pytest.raises(SystemExit) as exited:
        main(["workloads", path, "--scalars", "noequals"])
    assert exited.value.code == 2


@pytest.mark.flashinfer
def test_flashinfer_definition_comes_from_the_real_fi_trace(tmp_path):
    """For flashinfer.rmsnorm the emitted FlashInfer definition is what the installed
    package's fi_trace returns for tensors of the recorded shapes (called on meta tensors: no
    kernel), and the workload line names it, with the axes read from the recorded shapes."""
    flashinfer = pytest.importorskip("flashinfer")
    import torch

    inputs = {
        "input": tensor([7, 64], "bfloat16"),
        "weight": tensor([64], "bfloat16"),
        "eps": {"value": 1e-6},
    }
    path = write(tmp_path / "t.jsonl", [call("flashinfer.rmsnorm", inputs=inputs)])
    code, _, err = _run([path], emit=str(tmp_path / "out"))
    assert code == 0, err
    expected = flashinfer.rmsnorm.fi_trace(
        input=torch.empty(7, 64, dtype=torch.bfloat16, device="meta"),
        weight=torch.empty(64, dtype=torch.bfloat16, device="meta"),
        eps=1e-6,
    )
    written = json.loads((tmp_path / "out" / "flashinfer" / f"{expected['name']}.json").read_text())
    assert written == json.loads(json.dumps(expected))
    line = json.loads(next((tmp_path / "out" / "workloads").iterdir()).read_text())
    assert line["definition"] == expected["name"]
    assert line["workload"]["axes"] == {"batch_size": 7, "hidden_size": 64}
    # keyed by FlashInfer's input names, with only flashinfer-bench's fields
    assert line["workload"]["inputs"] == {
        "hidden_states": {"type": "random"},
        "weight": {"type": "random"},
    }
    assert line["otel_gpu"]["inputs"]["input"]["shape"] == [7, 64]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "definitions",
        "flashinfer",
        "workloads",
    ]
