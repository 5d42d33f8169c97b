"""What ``otel-gpu run`` (:mod:`otel_gpu.cli.run`) sets up: the program's environment, with
``OTEL_GPU_INSTRUMENT`` applied by a bootstrap, so that a program is instrumented with no code change.

    otel-gpu run --instrument transformers.models.gpt2.modeling_gpt2 -- python serve.py --port 8000
    otel-gpu run --level 3 --dest trace.jsonl -m mypkg.serve

The command is executed in place of this process, with the bootstrap directory first on
``PYTHONPATH``: its ``sitecustomize`` instruments the targets when Python starts, in the program
and in every Python process it starts (workers, ``torchrun`` ranks). This is what
``opentelemetry-instrument`` does for OpenTelemetry's own instrumentations; with that command,
otel-gpu's ``opentelemetry_instrumentor`` entry point does the same job.
"""

from __future__ import annotations

import os

from otel_gpu.config import RUN_PID

__all__ = ["PROGRAM_PID", "bootstrap_dir", "build_env", "with_bootstrap"]

PROGRAM_PID = RUN_PID
"""Set by ``otel-gpu run`` for the program: the pid it keeps after ``execve``. Not a setting but
a note from ``run`` to its bootstrap, so that only the program itself, not every Python process
it starts (compile workers, helpers), warns at exit about targets that were never imported."""


def bootstrap_dir() -> str:
    """The directory whose ``sitecustomize`` applies ``OTEL_GPU_INSTRUMENT`` at start-up."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


def build_env(
    env: dict[str, str], targets: list[str], level: str | None, dest: str | None
) -> dict[str, str]:
    """The program's environment: targets merged into OTEL_GPU_INSTRUMENT (and level, dest)."""
    env = dict(env)
    existing = [t.strip() for t in env.get("OTEL_GPU_INSTRUMENT", "").split(",") if t.strip()]
    merged = existing + [t for t in targets if t not in existing]
    if merged:
        env["OTEL_GPU_INSTRUMENT"] = ",".join(merged)
    if level is not None:
        env["OTEL_GPU_LOGLEVEL"] = level
    if dest is not None:
        env["OTEL_GPU_LOGDEST"] = dest
    return env


def with_bootstrap(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the bootstrap directory first on ``PYTHONPATH``."""
    # only when there is something to instrument: otherwise every Python process the program
    # starts would import otel_gpu (and torch) for nothing
    path = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": bootstrap_dir() + (os.pathsep + path if path else "")}
