"""Reading what the flight recorder wrote, in tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from otel_gpu.export import pipeline
from otel_gpu.recorder.manifest import MANIFEST


def finish(timeout: float = 5.0) -> None:
    """Close the pipeline and the recorder: queued outputs and manifests reach the disk."""
    pipeline.reset(timeout=timeout)


def call_dirs(root: str | Path) -> list[str]:
    """The call directories below a dump root, in name order (which is call order)."""
    return sorted(os.path.join(root, d) for d in os.listdir(root) if not d.startswith("."))


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of one call directory."""
    with open(os.path.join(directory, MANIFEST)) as f:
        return json.load(f)


def start_recording(
    otel_gpu_spans: Any, load: Any, tmp_path: Path, **settings: Any
) -> tuple[Path, Any]:
    """Level 10 into ``tmp_path/d`` with ``settings``, then ``load()`` the test's library
    (decorated at level 10): (dump root, library module)."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root), **settings)
    return root, load()


def record_script(tmp_path: Path, calls: int) -> subprocess.CompletedProcess[str]:
    """Run a script that calls its own decorated ``step`` ``calls`` times at level 10, dumping
    into ``tmp_path/d`` (a function defined in ``__main__``); returns the finished process."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch, otel_gpu

            @otel_gpu.api
            def step(x):
                return x + 1

            for _ in range({calls}):
                step(torch.ones(1))
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_GPU_LOGLEVEL="10",
        OTEL_GPU_DUMP_DIR=str(tmp_path / "d"),
        OTEL_GPU_LOGDEST=str(tmp_path / "spans.jsonl"),
    )
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )


RECORDER_PROBES = """
@otel_gpu.api
def probe(x, check):
    check(x)
    return x + 1

@otel_gpu.api
def fails(x):
    raise ValueError("bad input")
"""
"""Functions both recorder test libraries end with (the library imports otel_gpu)."""


MODULE_BLOCK = """
class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.width = width
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return self.proj(x)
"""
"""A small ``torch.nn.Module`` for test libraries that import ``from torch import nn``."""
