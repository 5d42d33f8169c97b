"""``otel-gpu run``: run a program with ``OTEL_GPU_INSTRUMENT`` applied, with no code change.

    otel-gpu run --instrument transformers.models.gpt2.modeling_gpt2 -- python serve.py --port 8000
    otel-gpu run --level 3 --dest trace.jsonl -m mypkg.serve

The command is executed in place of this process, with the bootstrap directory first on
``PYTHONPATH`` (:mod:`otel_gpu.instrumentation.run`): its ``sitecustomize`` instruments the
targets when Python starts, in the program and in every Python process it starts (workers,
``torchrun`` ranks). This is what ``opentelemetry-instrument`` does for OpenTelemetry's own
instrumentations; with that command, otel-gpu's ``opentelemetry_instrumentor`` entry point does
the same job.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

from otel_gpu.cli import add_command
from otel_gpu.cli.flags import add_level_and_dest
from otel_gpu.instrumentation.run import PROGRAM_PID, build_env, with_bootstrap

__all__ = ["register"]


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
    if settings.level == 0 and not settings.controllable:
        print(
            "otel-gpu run: OTEL_GPU_LOGLEVEL is 0, so nothing is instrumented; set --level or "
            "OTEL_GPU_LOGLEVEL to 1, 3, 5 or 10, or OTEL_GPU_CONTROL=on to arm the targets at level 0 "
            "for otel-gpu control",
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
        env = {**with_bootstrap(env), PROGRAM_PID: str(os.getpid())}
    program = shutil.which(command[0], path=env.get("PATH")) or command[0]
    try:
        os.execve(program, command, env)
    except OSError as exc:
        print(f"otel-gpu run: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: execve replaced this process


_DESCRIPTION = (
    "Run a Python program so that the targets of --instrument and OTEL_GPU_INSTRUMENT "
    "(modules, classes, functions, globs, flashinfer) make spans, in it and in every "
    "Python process it starts. Example: otel-gpu run --instrument "
    "transformers.models.gpt2.modeling_gpt2 -- python generate.py"
)


def register(sub: Any) -> None:
    p = add_command(sub, "run", _DESCRIPTION)
    p.add_argument(
        "--instrument",
        action="append",
        default=[],
        metavar="TARGET",
        help="a target to instrument (repeatable or comma-separated), added to OTEL_GPU_INSTRUMENT",
    )
    add_level_and_dest(
        p, "sets OTEL_GPU_LOGLEVEL for the program", "sets OTEL_GPU_LOGDEST for the program"
    )
    p.add_argument("-m", dest="module", default=None, help="run a module, as python -m does")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- program [args]")
    p.set_defaults(func=_main)
