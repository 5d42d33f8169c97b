"""A tiny GPT2 forward pass for ``workloads`` and ``diff`` tests, run under ``otel-gpu run``.

``python tiny_runs.py BATCH [--perturb MODULE_PATH] [--compile]``: one forward pass of the tiny
GPT2 of :mod:`tiny_models` on a batch of ``BATCH`` sequences of 8 tokens (the same tokens for
the same batch size). ``--perturb`` adds 1e-3 to the output of the submodule at that path through
a forward hook; ``--compile`` runs the model under ``torch.compile`` (inductor).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("batch", type=int)
    parser.add_argument("--perturb", default="")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = tiny_models.gpt2()
    if args.perturb:
        model.get_submodule(args.perturb).register_forward_hook(lambda m, i, out: out + 1e-3)
    ids = torch.randint(1, 1000, (args.batch, 8), generator=torch.Generator().manual_seed(1))
    run = torch.compile(model) if args.compile else model
    with torch.no_grad():
        run(ids, attention_mask=torch.ones_like(ids))


def traced(tmp: Path, level: int, batch: int, *flags: str, **env: str) -> Path:
    """Run this script under ``otel-gpu run --level LEVEL`` with the tiny GPT2's classes
    instrumented; the trace file it wrote (dumps, at level 10, in ``tmp/dumps``)."""
    import os
    import subprocess

    tmp.mkdir(parents=True, exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLASHINFER_"))}
    clean.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OTEL_GPU_STRICT="true")
    clean.update(OTEL_GPU_INSTRUMENT="transformers.models.gpt2.modeling_gpt2")
    clean.update(OTEL_GPU_PROVIDER="own", OTEL_GPU_DUMP_DIR=str(tmp / "dumps"))
    clean.update(XDG_RUNTIME_DIR=str(tmp), **env)
    dest = tmp / "spans.jsonl"
    cmd = [sys.executable, "-m", "otel_gpu", "run", "--level", str(level), "--dest", str(dest)]
    cmd += ["--", sys.executable, __file__, str(batch), *flags]
    proc = subprocess.run(cmd, env=clean, cwd=tmp, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dest


if __name__ == "__main__":
    main()
