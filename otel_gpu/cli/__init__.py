"""``otel-gpu`` / ``python -m otel_gpu``: the command line, and its one front door.

Each subcommand has one module with ``register(subparsers)``: ``otel_gpu/cli/<name>.py`` for
most, the package of its concept for ``replay`` and ``bench``. ``main`` imports only
the module of the command it runs; the others are listed from :data:`COMMANDS` without being
imported, so ``otel-gpu --help``, ``show`` and ``ship`` run without importing torch, and
``recover`` and ``info`` start without it (``recover`` imports it to read a journal, ``info``
for its resource's CUDA facts). A command module imports its heavy machinery inside the
command.

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

from otel_gpu.cli.flags import dest_flag, level_flag, whole_number

__all__ = [
    "COMMANDS",
    "EXIT_USAGE",
    "add_command",
    "build_parser",
    "dest_flag",
    "level_flag",
    "main",
    "say",
    "version_line",
    "whole_number",
]

EXIT_USAGE = 2
"""Exit status of every usage or configuration error, in every command."""

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "otel_gpu.cli.demo",
        "run a demo workload of decorated torch functions (default: level 5 to stdout)",
    ),
    "info": ("otel_gpu.cli.info", "show the settings in force and the detected resource"),
    "replay": (
        "otel_gpu.replay",
        "re-run calls recorded at level 10 and report pass/mismatch/error per call",
    ),
    "recover": (
        "otel_gpu.cli.recover",
        "export the calls that were in flight when a process died, as ERROR spans",
    ),
    "ship": (
        "otel_gpu.cli.ship",
        "send the spans of OTLP JSON Lines files to the OTEL_EXPORTER_OTLP_* endpoint",
    ),
    "show": (
        "otel_gpu.cli.show",
        "render OTLP JSON Lines trace files as a tree; find the first call producing NaN/Inf",
    ),
    "ranks": (
        "otel_gpu.cli.ranks",
        "line the ranks of a job up: the rank behind, where it is, and divergences",
    ),
    "workloads": (
        "otel_gpu.cli.workloads",
        "group recorded calls by function and input signature: counts, time; --emit for benchmarks",
    ),
    "diff": (
        "otel_gpu.cli.diff",
        "compare two runs call by call: the first call that diverged, and calls in one run only",
    ),
    "snapshot": (
        "otel_gpu.cli.snapshot",
        "make a live otel-gpu process export its threads' stacks and calls in flight now",
    ),
    "control": (
        "otel_gpu.cli.control",
        "turn a live otel-gpu process's recording up or down, per function, for a while",
    ),
    "bench": (
        "otel_gpu.bench",
        "measure each level's cost per call, side by side with FlashInfer and plain OTel",
    ),
    "run": (
        "otel_gpu.cli.run",
        "run a program with OTEL_GPU_INSTRUMENT applied (no code change)",
    ),
}
"""Each command, in help order: the module whose ``register(subparsers)`` adds it, and the
line ``otel-gpu --help`` shows for it without importing that module."""

SettingsFromFlags = Callable[[argparse.Namespace], Mapping[str, Any]]
"""What a command sets from its flags (``{"level": args.level}``): checked instead of the
environment's value, as :func:`otel_gpu.configure` arguments beat the environment. A command
registers it with ``parser.set_defaults(settings_from_flags=...)``. A command that reads no
setting (``show``: :func:`otel_gpu.cli.flags.reads_trace_files`) registers ``reads_settings=False``: a bad variable it never uses is not its
error."""


def version_line() -> str:
    """``otel-gpu 0.1.0 (Python 3.11.7, torch 2.13.0)``: from the installed packages' metadata,
    without importing torch (which takes seconds)."""
    import platform
    from importlib import metadata

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (
        f"otel-gpu {installed('otel-gpu')} "
        f"(Python {platform.python_version()}, torch {installed('torch')})"
    )


class _Version(argparse.Action):
    """``--version``, with the line computed only when asked for (every command builds the parser)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help=kwargs.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        print(version_line())
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse prints its usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(_usage_error(self.prog, message))


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; with ``argv``, only the command it names is imported (the
    others are listed by name and help line, as ``otel-gpu --help`` shows them)."""
    parser = _Parser(
        prog="otel-gpu",
        description="OpenTelemetry-native debugging and observability for GPU library calls.",
    )
    parser.add_argument("--version", action=_Version, help="show the version and exit")
    # dest: not "command", which `run` uses for its program; subparsers are _Parser too
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    chosen = None if argv is None else _command_of(argv)
    for command, (name, help_line) in COMMANDS.items():
        if argv is not None and command != chosen:
            sub.add_parser(command, help=help_line)  # listed, not imported
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # feature not part of this build
            _broken(sub, command, name, exc)
            continue
        except Exception as exc:  # one broken command must not take the others down
            _broken(sub, command, name, exc)
            continue
        module.register(sub)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (the top-level parser
    has no option that takes a value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def add_command(sub: Any, command: str, description: str) -> argparse.ArgumentParser:
    """The subparser of ``command``, with its help line from :data:`COMMANDS`."""
    parser: argparse.ArgumentParser = sub.add_parser(
        command, help=COMMANDS[command][1], description=description
    )
    return parser


def _broken(sub: Any, command: str, module: str, exc: BaseException) -> None:
    def fail(args: argparse.Namespace) -> int:
        print(
            f"otel-gpu {command}: cannot load {module}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return EXIT_USAGE

    sub.add_parser(command, help=f"(unavailable: {type(exc).__name__})").set_defaults(func=fail)


# --------------------------------------------------------------------------- the front door


def _check_settings(args: argparse.Namespace) -> None:
    """Raise ConfigError for an invalid setting, before the command runs (flags beat the env)."""
    from otel_gpu import config

    if not vars(args).get("reads_settings", True):
        return
    from_flags: SettingsFromFlags | None = vars(args).get("settings_from_flags")
    config.load(dict(from_flags(args)) if from_flags is not None else None)


def _usage_error(prog: str, message: str) -> int:
    say(f"{prog}: {message} (see: {prog} --help)")
    return EXIT_USAGE


def say(line: str) -> None:
    """One line on stderr, whatever the arguments or the environment held: a newline or an
    escape sequence in a value is shown escaped, and cannot forge a second line."""
    from otel_gpu._text import printable

    print(printable(line), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
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
        say(f"{prog}: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
