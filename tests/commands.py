"""Running ``otel-gpu`` as a user would, in a subprocess: ``python -m otel_gpu ARGS``; and any
other Python program in a child interpreter, its output captured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def without_otel(**extra: str) -> dict[str, str]:
    """This process's environment without any OTEL_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(extra)
    return env


def otel_gpu_command(
    args: list[str],
    env: dict[str, str],
    *,
    cwd: str | Path | None = None,
    text: bool = True,
    timeout: float = 120,
) -> subprocess.CompletedProcess[Any]:
    """``otel-gpu ARGS`` in ``env``; its output captured (as text unless ``text=False``)."""
    return python_command(["-m", "otel_gpu", *args], env, cwd=cwd, text=text, timeout=timeout)


def python_command(
    args: list[str],
    env: dict[str, str] | None = None,
    *,
    cwd: str | Path | None = None,
    text: bool = True,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[Any]:
    """``python ARGS`` (this interpreter) in ``env`` (this process's when None); its output
    captured (as text unless ``text=False``)."""
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=text,
        timeout=timeout,
    )
