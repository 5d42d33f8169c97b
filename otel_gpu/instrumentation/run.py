"""``otel-gpu run``: run a program with ``OTEL_GPU_INSTRUMENT`` applied, with no code change.

    otel-gpu run --instrument transformers.models.gpt2.modeling_gpt2 -- python serve.py --port 8000
    otel-gpu run --level 3 --dest trace.jsonl -m mypkg.serve

The command is executed in place of this process, with the bootstrap directory first on
``PYTHONPATH``: its ``sitecustomize`` instruments the targets when Python starts, in the program
and in every Python process it starts (workers, ``torchrun`` ranks). This is what
``opentelemetry-instrument`` does for OpenTelemetry's own instrumentations; with that command,
otel-gpu's ``opentelemetry_instrumentor`` entry point does the same job.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

from otel_gpu.config import RUN_PID

__all__ = ["PROGRAM_PID", "bootstrap_dir", "build_env", "register"]

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


def _with_bootstrap(env: dict[str, str]) -> dict[str, str]:
    # only when there is something to instrument: otherwise every Python process the program
    # starts would import otel_gpu (and torch) for nothing
    path = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": bootstrap_dir() + (os.pathsep + path if path else "")}


def _main(args: argparse.Namespace) -> int:
    from otel_gpu import config

    targets = [t.strip() for item in args.instrument for t in item.split(",") if t.strip()]
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.module:
        command = [sys.executable, "-m", args.module, *command]
    if not command:
        print(
            "otel-gpu run: no program given. Usage: otel-gpu run [--instrument TARGET ...] "
            "-- python script.py [args]  or  otel-gpu run -m package [args]",
            file=sys.stderr,
        )
        return 2
    level = None if args.level is None else str(args.level)
    env = build_env(config.child_environment(), targets, level, args.dest)
    # the same validation as the program will do: a ConfigError fails here, at the front door
    settings = config.load(env=env)
    if settings.level == 0:
        print(
            "otel-gpu run: OTEL_GPU_LOGLEVEL is 0, so nothing is instrumented; set --level or "
            "OTEL_GPU_LOGLEVEL to 1, 3, 5 or 10",
            file=sys.stderr,
        )
    elif not settings.instrument:
        print(
            "otel-gpu run: no targets: pass --instrument TARGET or set OTEL_GPU_INSTRUMENT; only "
            "functions decorated with @otel_gpu.api will make spans",
            file=sys.stderr,
        )
    else:
        from otel_gpu.instrumentation.refused import refusal

        # said once here, whatever the program is (a shell script, a launcher): the Python
        # processes it starts skip these targets quietly
        for spec in settings.instrument:
            why = refusal(spec)
            if why is not None:
                print(f"otel-gpu run: OTEL_GPU_INSTRUMENT {why}", file=sys.stderr)
        env = {**_with_bootstrap(env), PROGRAM_PID: str(os.getpid())}
    program = shutil.which(command[0], path=env.get("PATH")) or command[0]
    try:
        os.execve(program, command, env)
    except OSError as exc:
        print(f"otel-gpu run: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: execve replaced this process


def _settings_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {"level": args.level, "dest": args.dest}


_HELP = "run a program with OTEL_GPU_INSTRUMENT applied (no code change)"
_DESCRIPTION = (
    "Run a Python program so that the targets of --instrument and OTEL_GPU_INSTRUMENT "
    "(modules, classes, functions, globs, flashinfer) make spans, in it and in every "
    "Python process it starts. Example: otel-gpu run --instrument "
    "transformers.models.gpt2.modeling_gpt2 -- python generate.py"
)


def register(sub: Any) -> None:
    from otel_gpu.cli import dest_flag, level_flag

    p = sub.add_parser("run", help=_HELP, description=_DESCRIPTION)
    p.add_argument(
        "--instrument",
        action="append",
        default=[],
        metavar="TARGET",
        help="a target to instrument (repeatable or comma-separated), added to OTEL_GPU_INSTRUMENT",
    )
    p.add_argument(
        "--level", type=level_flag, default=None, help="sets OTEL_GPU_LOGLEVEL for the program"
    )
    p.add_argument(
        "--dest", type=dest_flag, default=None, help="sets OTEL_GPU_LOGDEST for the program"
    )
    p.add_argument("-m", dest="module", default=None, help="run a module, as python -m does")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- program [args]")
    p.set_defaults(func=_main, settings_from_flags=_settings_from_flags)
