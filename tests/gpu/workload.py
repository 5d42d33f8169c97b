"""A short real workload on a GPU: a tiny GPT2 built from a config, every module instrumented.

Run by ``tests/gpu/run.sh`` after the GPU suite (it needs CUDA and transformers; without them it
says so and exits 0). For each level in 0, 1, 3, 5 and 10, level 1 with device time off and level
3 with memory read by every call (OTEL_GPU_DEVICE_MEMORY_CALLS=all), a
fresh process (the level is read at decoration):

- builds the model on ``cuda``, keeps its logits uninstrumented as the reference, then wraps
  every module with ``otel_gpu.instrument_module`` and checks the logits are bit-identical;
- times forwards (median of rounds, each ended by ``torch.cuda.synchronize()``), the figure the
  per-call cost on the GPU is read from, against level 0 of the same run;
- compiles the instrumented model with ``torch.compile(fullgraph=True)`` and checks its
  logits against eager ones (tolerance: compiled kernels differ in the last bits);
- at level 10 (the library's classes instrumented, as ``OTEL_GPU_INSTRUMENT`` does, with
  module states recorded), replays the dumps on the GPU with ``otel-gpu replay`` and keeps the
  verdicts.

Spans go to ``OUT/traces/level-N.jsonl``; the summary to ``OUT/workload.json``, with, per level,
how many spans carry a device time and the model's forward's host and device durations.
Usage: ``python tests/gpu/workload.py OUT`` (``--device cpu --no-compile`` checks the script
itself on a machine without a GPU; ``--no-compile --no-replay`` keeps only the timings and the
checks of identical outputs, when time on a GPU machine is short).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# (label, level, extra settings): level 1 also with device time off, for its cost on the GPU;
# level 3 also with memory read by every call, not only the outermost (the default)
CONFIGS: tuple[tuple[str, int, dict[str, str]], ...] = (
    ("0", 0, {}),
    ("1", 1, {}),
    ("1-device-time-off", 1, {"OTEL_GPU_DEVICE_TIME": "off"}),
    ("3", 3, {}),
    ("3-memory-all-calls", 3, {"OTEL_GPU_DEVICE_MEMORY_CALLS": "all"}),
    ("5", 5, {}),
    ("10", 10, {}),
)
ROUNDS, FORWARDS = 5, 20


def _child(level: int, out: Path, device: str, compile_: bool) -> dict[str, Any]:
    sys.path.insert(0, str(HERE.parent))
    import torch
    from tiny_models import gpt2

    import otel_gpu

    result: dict[str, Any] = {"level": level}
    model = gpt2().to(device)
    ids = torch.randint(0, 1000, (2, 16), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        reference = model(ids).logits.clone()
        if level == 10:
            # the flight recorder's replay rebuilds modules from their class and recorded state,
            # which instrument_module's per-instance wrappers do not allow: the library's
            # classes are instrumented instead, as OTEL_GPU_INSTRUMENT does
            result["instrumented"] = otel_gpu.instrument("transformers.models.gpt2.modeling_gpt2")
            result["instrumented"] = len(result["instrumented"])
        else:
            result["modules_wrapped"] = otel_gpu.instrument_module(model)
        eager = model(ids).logits
        result["identical_to_uninstrumented"] = bool(torch.equal(eager, reference))
        for _ in range(3):
            model(ids)
        sync()
        rounds = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(FORWARDS):
                model(ids)
            sync()
            rounds.append((time.perf_counter() - start) / FORWARDS * 1e3)
        result["ms_per_forward"] = statistics.median(rounds)
        result["ms_per_forward_rounds"] = rounds
        try:
            if not compile_:
                raise RuntimeError("not asked for (--no-compile)")
            compiled = torch.compile(model, fullgraph=True)
            logits = compiled(ids).logits
            sync()
            result["compile_fullgraph"] = "ok"
            result["compile_max_abs_diff"] = float((logits - eager).abs().max())
        except Exception as exc:  # reported, not raised: the other levels still run
            result["compile_fullgraph"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    otel_gpu.flush()
    return result


def _spans(path: Path) -> dict[str, Any]:
    """How many spans the file holds, how many carry a device time, and the model's forward's
    host and device durations (medians, ms)."""
    figures: dict[str, Any] = {"spans_written": 0, "with_device_time": 0, "device_spans": 0}
    host, device = [], []
    if not path.exists():
        return figures
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            for rs in json.loads(line).get("resourceSpans", []):
                for ss in rs.get("scopeSpans", []):
                    for span in ss.get("spans", []):
                        figures["spans_written"] += 1
                        attrs = {a["key"]: a["value"] for a in span.get("attributes", [])}
                        if span["name"].endswith("[device]"):
                            figures["device_spans"] += 1
                        dur = attrs.get("otel_gpu.device.duration")
                        if dur is not None:
                            figures["with_device_time"] += 1
                        if "GPT2LMHeadModel" in span["name"] and "[device]" not in span["name"]:
                            ns = int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])
                            host.append(ns / 1e6)
                            if dur is not None:
                                device.append(float(dur.get("doubleValue", 0.0)) * 1e3)
    if host:
        figures["model_forward_host_ms"] = statistics.median(host)
    if device:
        figures["model_forward_device_ms"] = statistics.median(device)
    return figures


def main(out: Path, device: str = "cuda", compile_: bool = True, replay: bool = True) -> int:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"workload: skipped ({exc})")
        return 0
    if device == "cuda" and not torch.cuda.is_available():
        print("workload: skipped (no CUDA device)")
        return 0
    traces = out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if device == "cuda" else device
    summary: dict[str, Any] = {"device": name, "levels": []}
    failed = False
    for label, level, extra in CONFIGS:
        spans = traces / f"level-{label}.jsonl"
        env = dict(os.environ, OTEL_GPU_LOGLEVEL=str(level), OTEL_GPU_LOGDEST=str(spans), **extra)
        env["OTEL_SERVICE_NAME"] = "otel-gpu-gpu-workload"
        if level == 10:
            env["OTEL_GPU_DUMP_DIR"] = str(traces / "dumps")
            env["OTEL_GPU_DUMP_MODULES"] = "true"
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(level), str(out), device, str(compile_)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            failed = True
            row: dict[str, Any] = {"level": level, "error": proc.stderr[-3000:]}
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row.update(_spans(spans))
            if not row["identical_to_uninstrumented"]:
                failed = True
        row["config"] = label
        summary["levels"].append(row)
        print(f"workload: {label}: {json.dumps(row)[:700]}", flush=True)
    base = next((r.get("ms_per_forward") for r in summary["levels"] if r["config"] == "0"), None)
    for row in summary["levels"]:
        if base and row.get("ms_per_forward"):
            row["ratio_to_level_0"] = row["ms_per_forward"] / base
    dumps = traces / "dumps"
    if dumps.exists() and not replay:
        summary["replay"] = {"skipped": "not asked for (--no-replay)"}
    elif dumps.exists():
        cmd = [sys.executable, "-m", "otel_gpu", "replay", str(dumps), "--trust-dump"]
        proc = subprocess.run(
            [*cmd, "--json", "--no-progress"], capture_output=True, text=True, timeout=600
        )
        try:
            report = json.loads(proc.stdout)
            summary["replay"] = {
                "exit": proc.returncode,
                "summary": report.get("summary"),
                "not_pass": [
                    {k: r.get(k) for k in ("span_name", "verdict", "detail")}
                    for r in report.get("results", [])
                    if r.get("verdict") != "pass"
                ][:20],
            }
        except json.JSONDecodeError:
            summary["replay"] = {"exit": proc.returncode, "stderr": proc.stderr[-3000:]}
    (out / "workload.json").write_text(json.dumps(summary, indent=2))
    print(f"workload: summary in {out / 'workload.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        level, out, device, compile_ = sys.argv[2:6]
        print(json.dumps(_child(int(level), Path(out), device, compile_ == "True")))
        sys.exit(0)
    # --device cpu --no-compile: a quick check of this script itself on a machine without a GPU
    flags = ("--device", "cpu", "--no-compile", "--no-replay")
    args = [a for a in sys.argv[1:] if a not in flags]
    if len(args) != 1:
        sys.exit(
            "usage: python tests/gpu/workload.py OUT [--device cpu] [--no-compile] [--no-replay]"
        )
    device = "cpu" if "cpu" in sys.argv[1:] else "cuda"
    compile_, replay = "--no-compile" not in sys.argv[1:], "--no-replay" not in sys.argv[1:]
    sys.exit(main(Path(args[0]), device, compile_, replay))
