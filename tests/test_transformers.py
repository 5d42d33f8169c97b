"""Real third-party code, instrumented with OTEL_GPU_INSTRUMENT alone: tiny GPT2 and Llama models
(transformers, built from a config) under ``otel-gpu run`` and ``opentelemetry-instrument``.

Promises: outputs are bit-identical to the run without instrumentation; inputs bind to the
right parameter names; KV-cache tensors appear as attributes (level 3) and statistics (level 5);
at level 10, replay passes every replayable call and skips the rest with a reason, no errors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from commands import python_command
from jsonl_spans import read_spans

pytest.importorskip("transformers")

pytestmark = [pytest.mark.transformers, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
TARGETS = ",".join(
    [
        "transformers.models.gpt2.modeling_gpt2",
        "transformers.models.llama.modeling_llama",
        "transformers.generation.utils.GenerationMixin.generate",
    ]
)


def _cache_name() -> str:
    """The name GPT2Model.forward gives its KV cache: ``cache`` from transformers 5.24,
    ``past_key_values`` before. The attribute keys follow the library's own parameter and
    output-field names, so the tests ask the installed release rather than fix one spelling."""
    import inspect

    from transformers.models.gpt2.modeling_gpt2 import GPT2Model

    params = inspect.signature(GPT2Model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE = _cache_name()


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLASHINFER_"))}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OTEL_GPU_STRICT": "true"})
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> None:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The outputs of the models run without otel-gpu."""
    tmp = tmp_path_factory.mktemp("baseline")
    _run([sys.executable, str(HERE / "tiny_models.py"), str(tmp / "out.pt")], _env(tmp), tmp)
    return torch.load(tmp / "out.pt")


def _instrumented(
    tmp: Path, level: int, **extra: str
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    env = _env(tmp, OTEL_GPU_INSTRUMENT=TARGETS, OTEL_GPU_PROVIDER="own", **extra)
    cmd = [sys.executable, "-m", "otel_gpu", "run", "--level", str(level), "--dest"]
    cmd += [str(tmp / "spans.jsonl"), "--", sys.executable, str(HERE / "tiny_models.py")]
    _run([*cmd, str(tmp / "out.pt")], env, tmp)
    return torch.load(tmp / "out.pt"), read_spans(tmp / "spans.jsonl")


def _ints(array: dict) -> list[int]:
    return [int(v["intValue"]) for v in array["values"]]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_level_3_outputs_identical_and_arguments_bound_by_name(tmp_path, baseline):
    """Every module and generate() call is a span named by the library's own qualname; the first
    argument of a wrapped bound method binds to its name (the bug: shifted by one)."""
    out, spans = _instrumented(tmp_path, 3)
    _same(out, baseline)
    names = {s["name"] for s in spans}
    assert "transformers.models.gpt2.modeling_gpt2.GPT2Block.forward" in names
    assert "transformers.models.llama.modeling_llama.LlamaDecoderLayer.forward" in names
    assert "transformers.generation.utils.GenerationMixin.generate" in names
    block = next(s for s in spans if s["name"].endswith("GPT2Block.forward"))
    assert _ints(block["attrs"]["otel_gpu.input.hidden_states.shape"]) == [2, 8, 64]
    model = next(s for s in spans if s["name"].endswith("GPT2Model.forward"))
    assert _ints(model["attrs"]["otel_gpu.input.input_ids.shape"]) == [2, 8]
    assert model["attrs"][f"otel_gpu.input.{CACHE}.value"] == "None"
    layer = next(s for s in spans if s["name"].endswith("LlamaDecoderLayer.forward"))
    assert _ints(layer["attrs"]["otel_gpu.input.hidden_states.shape"]) == [2, 8, 64]
    generate = next(s for s in spans if s["name"].endswith("GenerationMixin.generate"))
    assert _ints(generate["attrs"]["otel_gpu.input.inputs.shape"]) == [2, 8]
    # the KV cache a forward returns, walked to its tensors
    kv = f"otel_gpu.output.{CACHE}.layers.0.keys.shape"
    assert any(kv in s["attrs"] for s in spans if s["name"].endswith("GPT2Model.forward"))


def test_level_5_kv_cache_tensors_get_statistics(tmp_path, baseline):
    """At level 5 the cache's key/value tensors have statistics events of their own."""
    out, spans = _instrumented(tmp_path, 5)
    _same(out, baseline)
    tensors = {
        e["attributes"][0]["value"]["stringValue"]
        for s in spans
        for e in s.get("events", [])
        if e["name"] == "otel_gpu.stats"
    }
    assert f"output.{CACHE}.layers.0.keys" in tensors
    assert f"output.{CACHE}.layers.1.values" in tensors


def test_level_10_replay_passes_or_skips_with_reasons_and_never_errors(tmp_path, baseline):
    """Recorded with the flight recorder (module states on), replayed with --trust-dump: pass for
    every replayable call — whole-model forwards and generate() rebuilt from config and
    state_dict among them — skipped with a reason for the rest, and no error, mismatch or
    unverified call."""
    out, spans = _instrumented(
        tmp_path, 10, OTEL_GPU_DUMP_DIR=str(tmp_path / "dumps"), OTEL_GPU_DUMP_MODULES="true"
    )
    _same(out, baseline)
    replay = ["replay", "--dir", str(tmp_path / "dumps"), "--trust-dump", "--json", "--no-progress"]
    proc = python_command(
        ["-m", "otel_gpu", *replay], env=_env(tmp_path), cwd=tmp_path, timeout=900
    )
    report = json.loads(proc.stdout)
    summary = report["summary"]
    assert summary["total"] == len([s for s in spans if "otel_gpu.dump.dir" in s["attrs"]])
    bad = [r for r in report["results"] if r["verdict"] not in ("pass", "skipped")]
    assert bad == [], bad[:3]
    assert all(r["detail"] for r in report["results"] if r["verdict"] == "skipped")
    passed = {
        r["span_name"].rsplit(".", 2)[-2] for r in report["results"] if r["verdict"] == "pass"
    }
    assert {"GenerationMixin", "LlamaForCausalLM", "GPT2LMHeadModel", "LlamaMLP"} <= passed
    assert proc.returncode == 0


def test_opentelemetry_instrument_applies_the_same_targets(tmp_path, baseline):
    """``opentelemetry-instrument python app.py`` with OTEL_GPU_INSTRUMENT set: the same spans,
    the same outputs (otel-gpu's opentelemetry_instrumentor entry point)."""
    command = shutil.which("opentelemetry-instrument") or str(
        Path(sys.executable).with_name("opentelemetry-instrument")
    )
    env = _env(
        tmp_path,
        OTEL_GPU_INSTRUMENT=TARGETS,
        OTEL_GPU_LOGLEVEL="3",
        OTEL_GPU_PROVIDER="own",
        OTEL_GPU_LOGDEST=str(tmp_path / "spans.jsonl"),
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
    )
    _run(
        [command, sys.executable, str(HERE / "tiny_models.py"), str(tmp_path / "out.pt")],
        env,
        tmp_path,
    )
    _same(torch.load(tmp_path / "out.pt"), baseline)
    spans = read_spans(tmp_path / "spans.jsonl")
    block = next(s for s in spans if s["name"].endswith("GPT2Block.forward"))
    assert _ints(block["attrs"]["otel_gpu.input.hidden_states.shape"]) == [2, 8, 64]
