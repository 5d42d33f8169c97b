"""Flight recorder and replay across processes: a SIGKILL inside a call, and the real command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from commands import python_command
from dump_files import call_dirs as _sorted_dirs

from otel_gpu.export import pipeline
from otel_gpu.recorder import tensor_files
from otel_gpu.replay import Allow, Options, replay

KILLER = """
import os, signal, torch, otel_gpu

FLAG = {flag!r}

@otel_gpu.api
def step(x, w):
    if os.path.exists(FLAG) and bool((x == 2).all()):  # the "bug": these inputs kill the process
        os.kill(os.getpid(), signal.SIGKILL)
    return x @ w
"""

SCRIPT = """
import torch, otel_gpu, {module} as m
w = torch.arange(6.0).view(2, 3).t()  # non-contiguous
m.step(torch.ones(4, 3), w)
otel_gpu.flush()  # a completed call's files are written off the caller's thread: wait for them
open(m.FLAG, "w").close()
m.step(torch.full((4, 3), 2.0), w)
print("unreachable")
"""


def _env(tmp_path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]), **extra)
    return env


def test_sigkill_inside_a_call_leaves_loadable_inputs_and_replay_says_crashed_originally(
    otel_gpu_spans, tmp_path, monkeypatch
):
    """A process killed inside a call leaves complete inputs; replay reports crashed-originally, and whether it completes now."""
    module = "killer_lib"
    flag = tmp_path / "kill.flag"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(KILLER.format(flag=str(flag))))
    root = tmp_path / "dumps"
    env = _env(
        tmp_path,
        OTEL_GPU_LOGLEVEL="10",
        OTEL_GPU_DUMP_DIR=str(root),
        OTEL_GPU_LOGDEST=str(tmp_path / "x.jsonl"),
    )
    proc = python_command(["-c", SCRIPT.format(module=module)], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    done, killed = _sorted_dirs(root)
    assert json.load(open(os.path.join(done, "manifest.json")))["status"] == "completed"
    manifest = json.load(open(os.path.join(killed, "manifest.json")))
    assert manifest["status"] == "inputs_saved"
    assert manifest["tensors"]["input.w"]["stride"] == [1, 3]

    inputs = tensor_files.load_tensors(killed, manifest["files"]["inputs"])
    assert torch.equal(inputs["input.x"], torch.full((4, 3), 2.0))
    assert torch.equal(inputs["input.w"], torch.arange(6.0).view(2, 3).t())

    monkeypatch.syspath_prepend(str(tmp_path))  # the isolated child imports like this process
    otel_gpu_spans(level=1)  # replay calls only functions decorated when imported
    monkeypatch.delitem(sys.modules, module, raising=False)
    results = replay(str(root), Options(allow=Allow([module])))
    assert [r.verdict for r in results] == ["pass", "crashed-originally"], [
        r.detail for r in results
    ]
    assert (results[1].completes_now, results[1].now) == (False, "crashes")
    assert "crashes again (killed by SIGKILL)" in results[1].detail
    flag.unlink()  # the bug is fixed: the same inputs now complete (checked in this process)
    (result,) = replay(killed, Options(allow=Allow([module]), in_process=True))
    assert (result.verdict, result.completes_now, result.now) == (
        "crashed-originally",
        True,
        "returns",
    )
    assert result.detail.endswith("now it returns")


LIB_V1 = """
import torch, otel_gpu

@otel_gpu.api
def scale(x, factor=2.0):
    return x * factor
"""

LIB_V2 = LIB_V1.replace("return x * factor", "return x * factor + 1e-3")


def test_cli_exits_1_after_a_deliberate_change_and_links_replay_spans(
    otel_gpu_spans, tmp_path, monkeypatch
):
    """``python -m otel_gpu replay`` on a changed module: exit 1, mismatch in --json, and --dest gets spans linked to the originals."""
    module = "cli_scale_lib"
    (tmp_path / f"{module}.py").write_text(LIB_V1)
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "dumps"
    spans = otel_gpu_spans(level=10, dump_dir=str(root))
    import importlib

    lib = importlib.import_module(module)
    try:
        lib.scale(torch.ones(3))
        (original,) = spans.get()
        pipeline.reset(timeout=2.0)
    finally:
        sys.modules.pop(module, None)
    (tmp_path / f"{module}.py").write_text(LIB_V2)
    out = tmp_path / "replay.jsonl"
    cmd = [sys.executable, "-m", "otel_gpu", "replay", "--dir", str(root), "--allow-module", module]
    proc = subprocess.run(
        [*cmd, "--json", "--dest", str(out)],
        env=_env(tmp_path, PYTHONDONTWRITEBYTECODE="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    report = json.loads(proc.stdout)
    (result,) = report["results"]
    assert result["verdict"] == "mismatch" and report["exit_code"] == 1
    assert result["mismatches"][0]["max_abs"] == pytest.approx(1e-3, rel=1e-3)
    exported = [
        span
        for line in out.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    (call_span,) = [s for s in exported if s["name"] == f"replay {module}.scale"]
    (link,) = call_span["links"]
    ctx = original.get_span_context()
    assert (link["traceId"], link["spanId"]) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    attrs = {a["key"]: a["value"] for a in call_span["attributes"]}
    assert attrs["otel_gpu.replay.verdict"] == {"stringValue": "mismatch"}
    assert call_span["status"]["code"] in (2, "STATUS_CODE_ERROR")
