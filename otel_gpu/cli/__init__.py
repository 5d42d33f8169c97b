"""``otel-gpu`` / ``python -m otel_gpu``: the command line, and its one front door.

Each subcommand lives in the module of its concept and registers itself with
``register(subparsers)``; every such module is imported to build the parser (and, through
``otel_gpu``'s own ``__init__``, that imports torch today).

Errors a user can fix are reported here, the same way for every command: one line on stderr,
``otel-gpu COMMAND: what was wrong and what is allowed``, exit status 2, no traceback. That
covers bad flags (argparse's usage block is not printed) and an invalid setting
(:class:`otel_gpu.ConfigError`), which is checked before any command runs, so a command never
does half its work before failing on the environment.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

__all__ = ["EXIT_USAGE", "build_parser", "dest_flag", "level_flag", "main", "whole_number"]

EXIT_USAGE = 2
"""Exit status of every usage or configuration error, in every command."""

# Modules that provide subcommands, in help order.
_COMMAND_MODULES = (
    "otel_gpu.cli.demo",
    "otel_gpu.cli.info",
    "otel_gpu.replay",
    "otel_gpu.journal.recover",
    "otel_gpu.traces.ship",
    "otel_gpu.traces.show",
    "otel_gpu.cli.ranks",
    "otel_gpu.cli.snapshot",
    "otel_gpu.bench",
    "otel_gpu.instrumentation.run",
)

SettingsFromFlags = Callable[[argparse.Namespace], Mapping[str, Any]]
"""What a command sets from its flags (``{"level": args.level}``): checked instead of the
environment's value, as :func:`otel_gpu.configure` arguments beat the environment. A command
registers it with ``parser.set_defaults(settings_from_flags=...)``. A command that reads no
setting (``show``) registers ``reads_settings=False``: a bad variable it never uses is not its
error."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse prints its usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(_usage_error(self.prog, message))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="otel-gpu",
        description="OpenTelemetry-native debugging and observability for GPU library calls.",
    )
    # dest: not "command", which `run` uses for its program; subparsers are _Parser too
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
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
        return EXIT_USAGE

    sub.add_parser(command, help=f"(unavailable: {type(exc).__name__})").set_defaults(func=fail)


# --------------------------------------------------------------------------- flags of settings


def _setting_flag(field: str, raw: str) -> None:
    """Validate a flag as the setting it overrides; ArgumentTypeError names what is allowed."""
    from otel_gpu import config

    try:
        config.load({field: raw}, env={})  # this value alone: the environment is checked later
    except config.ConfigError as exc:
        message = str(exc)
        # config names the setting and blames configure(); argparse names the flag instead
        why = message.partition(" is invalid: ")[2] or message
        raise argparse.ArgumentTypeError(f"{raw!r} is invalid: {why}") from None


def level_flag(raw: str) -> int:
    """``--level``: validated as ``OTEL_GPU_LOGLEVEL`` is, at parse time, naming the flag."""
    _setting_flag("level", raw)
    return int(raw)


def dest_flag(raw: str) -> str:
    """``--dest``: validated as ``OTEL_GPU_LOGDEST`` is (unwritable paths too), naming the flag."""
    _setting_flag("dest", raw)
    return raw


def whole_number(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number ``>= least``, whose error says so (argparse's own names
    the type function instead)."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {least}, not {raw!r}")
        return value

    return parse


# --------------------------------------------------------------------------- the front door


def _check_settings(args: argparse.Namespace) -> None:
    """Raise ConfigError for an invalid setting, before the command runs (flags beat the env)."""
    from otel_gpu import config

    if not vars(args).get("reads_settings", True):
        return
    from_flags: SettingsFromFlags | None = vars(args).get("settings_from_flags")
    config.load(dict(from_flags(args)) if from_flags is not None else None)


def _usage_error(prog: str, message: str) -> int:
    _say(f"{prog}: {message} (see: {prog} --help)")
    return EXIT_USAGE


def _say(line: str) -> None:
    """One line on stderr, whatever the arguments or the environment held: a newline or an
    escape sequence in a value is shown escaped, and cannot forge a second line."""
    from otel_gpu._text import printable

    print(printable(line), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        if extra:
            return _usage_error("otel-gpu", f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return EXIT_USAGE
    prog = f"otel-gpu {args.subcommand}"
    if extra:  # argparse would blame the top-level parser: name the command instead
        return _usage_error(prog, f"unrecognized arguments: {' '.join(extra)}")
    from otel_gpu.config import ConfigError

    try:
        _check_settings(args)
        return int(args.func(args) or 0)
    except ConfigError as exc:
        _say(f"{prog}: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
