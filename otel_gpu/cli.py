"""``otel-gpu`` / ``python -m otel_gpu``: the command line.

Each subcommand lives in the module of its concept and registers itself with
``register(subparsers)``; the module is imported only to build the parser, and
its heavy imports happen inside the command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

# Modules that provide subcommands, in help order.
_COMMAND_MODULES = (
    "otel_gpu.demo",
    "otel_gpu.info",
    "otel_gpu.replay",
    "otel_gpu.recover",
    "otel_gpu.ship",
    "otel_gpu.show",
    "otel_gpu.bench",
    "otel_gpu.run",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otel-gpu",
        description="OpenTelemetry-native debugging and observability for GPU library calls.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # feature not part of this build
            _broken(sub, name, exc)
            continue
        except Exception as exc:  # one broken command must not take the others down
            _broken(sub, name, exc)
            continue
        module.register(sub)
    return parser


def _broken(sub: Any, module: str, exc: BaseException) -> None:
    command = module.rsplit(".", 1)[1]

    def fail(args: argparse.Namespace) -> int:
        print(
            f"otel-gpu {command}: cannot load {module}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 2

    sub.add_parser(command, help=f"(unavailable: {type(exc).__name__})").set_defaults(func=fail)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
