"""The serving workflow of live control, end to end, on a tiny Llama built from a config: a
process started at armed level 0 (``OTEL_GPU_CONTROL=on``, ``OTEL_GPU_LOGLEVEL=0``) through
``OTEL_GPU_INSTRUMENT`` or ``instrument_module()``, busy in a forward loop, turned up for a
window on one part of the model by ``otel-gpu control`` from another process (the real
channel), and back.

Promises: what is armed at level 0 records nothing and listens for control; a window at level 5
on one module (by its path in the tree) or one class's ``forward`` gives spans of that part
only, only inside the window, each with statistics; outputs are bit-identical to a run without
otel-gpu; ``--list`` names what can be chosen, ``--dry-run`` previews, and a glob that matches
nothing is refused (exit 1) with the closest names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from commands import otel_gpu_command
from distributed_job import wait_for
from jsonl_spans import read_spans

pytest.importorskip("transformers")

pytestmark = [pytest.mark.transformers, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
LLAMA = "transformers.models.llama.modeling_llama"

# The serving loop: argv[1] is the work directory. `how` is "auto" (OTEL_GPU_INSTRUMENT,
# applied by `import otel_gpu.auto` before transformers), "module" (instrument_module on the
# model) or "plain" (no otel-gpu at all: the reference outputs).
SERVE = """
import os, sys, time
work, how = sys.argv[1], sys.argv[2]
if how == "auto":
    import otel_gpu.auto
import torch
sys.path.insert(0, {here!r})
import tiny_models
model = tiny_models.llama()
if how == "module":
    import otel_gpu
    wrapped = otel_gpu.instrument_module(model)
    assert wrapped > 0, wrapped
ids = torch.arange(12).reshape(1, 12) % 1000
outputs, steps = [], []
with open(os.path.join(work, "ready"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.time() + 600
with torch.no_grad():
    while time.time() < deadline:
        start = time.time_ns()
        out = model(ids).logits
        steps.append((start, time.time_ns()))
        if len(outputs) < 1000:
            outputs.append(out)
        with open(os.path.join(work, "steps.tmp"), "w") as f:
            f.write(str(steps[-1][1]))
        os.replace(os.path.join(work, "steps.tmp"), os.path.join(work, "steps"))
        if how == "plain" or os.path.exists(os.path.join(work, "stop")):
            break
torch.save(outputs, os.path.join(work, "outputs.pt"))
if how != "plain":
    import otel_gpu
    otel_gpu.flush()
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLASHINFER_"))}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OTEL_GPU_STRICT": "true"})
    env["OTEL_GPU_JOURNAL_DIR"] = str(tmp_path / "journal")
    env.update(extra)
    return env


def _last_step(work: Path) -> int:
    try:
        return int((work / "steps").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _serve(tmp_path: Path, how: str, **extra: str) -> tuple[subprocess.Popen[bytes], Path, dict]:
    work = tmp_path / how
    work.mkdir()
    (tmp_path / "journal").mkdir(mode=0o700, exist_ok=True)
    env = _env(
        tmp_path,
        OTEL_GPU_CONTROL="on",
        OTEL_GPU_LOGLEVEL="0",
        OTEL_GPU_LOGDEST=str(work / "spans.jsonl"),
        **extra,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE.format(here=str(HERE)), str(work), how],
        env=env,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: (work / "steps").exists() or proc.poll() is not None, "the first step")
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    return proc, work, env


def _stop(proc: subprocess.Popen[bytes], work: Path) -> None:
    (work / "stop").write_text("")
    try:
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.returncode == 0, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """The logits of the serving loop's input, from a run without otel-gpu."""
    tmp = tmp_path_factory.mktemp("plain")
    env = _env(tmp)
    done = subprocess.run(
        [sys.executable, "-c", SERVE.format(here=str(HERE)), str(tmp), "plain"],
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr.decode()
    (out,) = torch.load(tmp / "outputs.pt")
    return out


def _window(proc: subprocess.Popen[bytes], work: Path, env: dict, include: str) -> None:
    """Level 5 on ``include`` for 3 s through `otel-gpu control`; returns when the process has
    made a full step after the window ended."""
    pid = proc.pid
    done = otel_gpu_command(
        ["control", str(pid), "--level", "5", "--include", include, "--for", "3s"],
        env,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "applied: level 5" in done.stdout, done.stdout
    # the window's end is a control span; a step that starts after it is one at level 0 again
    wait_for(lambda: _window_over(env, pid), "the window's end")
    marker = _last_step(work)
    wait_for(lambda: _last_step(work) > marker, "a step after the window")


def _window_over(env: dict, pid: int) -> bool:
    """Whether the process says nothing is changed any more (the window ended)."""
    done = otel_gpu_command(["control", str(pid), "--show", "--json"], env, timeout=240)
    if done.returncode != 0:
        return False
    return json.loads(done.stdout)["effective"].get("changed") is False


def _check_trace(work: Path, reference: torch.Tensor, names: set[str], path: str | None) -> None:
    spans = read_spans(work / "spans.jsonl", plain=True)
    control = [s for s in spans if s["name"] == "otel_gpu.control"]
    calls = [s for s in spans if s["name"] != "otel_gpu.control"]
    sources = [s["attrs"]["otel_gpu.control.source"] for s in control]
    assert len(control) == 2 and sources[1] == "window end", sources
    # a control span lasts while its change applies: every span at level 5 starts after the
    # first one began, and before the window's end had put level 0 back everywhere
    opened, closed = int(control[0]["startTimeUnixNano"]), int(control[1]["endTimeUnixNano"])
    assert calls, "no span inside the window"
    assert {s["name"] for s in calls} == names
    for s in calls:
        assert opened <= int(s["startTimeUnixNano"]) <= closed
        assert any(e["name"] == "otel_gpu.stats" for e in s.get("events", [])), s["name"]
        if path is not None:
            assert s["attrs"]["otel_gpu.module.path"] == path
    outputs = torch.load(work / "outputs.pt")
    assert len(outputs) > 2
    assert all(torch.equal(out, reference) for out in outputs)


def test_one_module_by_path_for_a_window_under_instrument_module(tmp_path, reference):
    """instrument_module() at armed level 0 wraps the tree and the process listens; a window
    at level 5 on `model.layers.1.mlp` records that module only, inside the window, with
    statistics; outputs are bit-identical to the plain run."""
    proc, work, env = _serve(tmp_path, "module")
    try:
        listed = otel_gpu_command(["control", str(proc.pid), "--list"], env, timeout=240)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert "  model.layers.1.mlp  level 0" in listed.stdout
        preview = otel_gpu_command(
            ["control", str(proc.pid), "--level", "5", "--include", "*layers.1.mlp", "--dry-run"],
            env,
            timeout=240,
        )
        assert preview.returncode == 0, preview.stdout + preview.stderr
        assert "would select 1 of" in preview.stdout and "model.layers.1.mlp  level 0 -> 5" in (
            preview.stdout
        )
        _window(proc, work, env, "model.layers.1.mlp")
    finally:
        _stop(proc, work)
    _check_trace(work, reference, {"model.layers.1.mlp"}, "model.layers.1.mlp")


def test_one_class_for_a_window_under_otel_gpu_instrument(tmp_path, reference):
    """OTEL_GPU_INSTRUMENT, applied by `import otel_gpu.auto`, arms the modeling module's
    functions at level 0; a window at level 5 on LlamaMLP.forward records it only (each layer's
    call), inside the window, with statistics; outputs are bit-identical. A module path, which
    class-level patching does not know, is refused with the closest names."""
    proc, work, env = _serve(tmp_path, "auto", OTEL_GPU_INSTRUMENT=LLAMA)
    try:
        for glob, closest in (("*layers.1.mlp", None), ("*LlamaMPL.forward", "LlamaMLP")):
            refused = otel_gpu_command(
                ["control", str(proc.pid), "--level", "5", "--include", glob],
                env,
                timeout=240,
            )
            assert refused.returncode == 1, refused.stdout + refused.stderr
            assert "selects none of the" in refused.stderr
            if closest is not None:
                assert f"closest: {LLAMA}.{closest}.forward" in refused.stderr
        _window(proc, work, env, "*LlamaMLP.forward")
    finally:
        _stop(proc, work)
    _check_trace(work, reference, {f"{LLAMA}.LlamaMLP.forward"}, None)
