"""The argument types, and what several commands declare alike: flags, and how a trace reader
registers.

An argument type raises :class:`argparse.ArgumentTypeError` with the message the user sees
(argparse names the type function instead when it gets a ValueError); the front door prints it
as one line, ``otel-gpu COMMAND: argument --flag: message (see: otel-gpu COMMAND --help)``.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "add_json",
    "add_level_and_dest",
    "add_trace_files",
    "checked",
    "dest_flag",
    "digits",
    "level_flag",
    "reads_trace_files",
    "whole_number",
]

T = TypeVar("T")


def checked(
    convert: Callable[[str], T], accepts: Callable[[T], bool], message: str
) -> Callable[[str], T]:
    """An argument type: ``convert(raw)``, kept when ``accepts`` it; else (or when ``convert``
    raises ValueError) ``message``, whose ``{raw!r}`` is the value given."""

    def parse(raw: str) -> T:
        try:
            value = convert(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(message.format(raw=raw)) from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(message.format(raw=raw))
        return value

    return parse


def digits(raw: str) -> int:
    """Decimal digits only, as a whole number: no sign, space or underscore (``int`` takes them)."""
    if not raw.isdigit():
        raise ValueError(raw)
    return int(raw)


def whole_number(least: int) -> Callable[[str], int]:
    """An argument type: a whole number ``>= least``, whose error says so."""
    return checked(
        int, lambda value: value >= least, f"must be a whole number >= {least}, not {{raw!r}}"
    )


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


def add_level_and_dest(parser: argparse.ArgumentParser, level_help: str, dest_help: str) -> None:
    """``--level`` and ``--dest``, checked as the settings they override, whose values beat the
    environment's when the settings are checked (``settings_from_flags``)."""
    parser.add_argument("--level", type=level_flag, default=None, help=level_help)
    parser.add_argument("--dest", type=dest_flag, default=None, help=dest_help)
    parser.set_defaults(settings_from_flags=_level_and_dest)


def _level_and_dest(args: argparse.Namespace) -> dict[str, Any]:
    return {"level": args.level, "dest": args.dest}


def add_trace_files(parser: argparse.ArgumentParser, help: str = "OTLP JSON Lines files") -> None:
    """``TRACE.jsonl...``: the trace files a reading command takes, one or more, as ``files``."""
    parser.add_argument("files", nargs="+", metavar="TRACE.jsonl", help=help)


def add_json(parser: argparse.ArgumentParser, help: str = "machine-readable output") -> Any:
    """``--json``: the command prints JSON instead of its text, as ``json``."""
    return parser.add_argument("--json", action="store_true", help=help)


def reads_trace_files(
    parser: argparse.ArgumentParser,
    main: Callable[[argparse.Namespace], int],
    *,
    gc_off: bool = False,
) -> None:
    """``main`` runs the command, which reads trace files and never the environment (a bad
    variable it does not use is not its error). ``gc_off``: no garbage collection while it runs."""

    def without_collection(args: argparse.Namespace) -> int:
        # a short-lived reader: its records are freed at exit, and a collection after reading
        # would only walk the millions of objects a large trace makes
        gc.disable()
        return main(args)

    parser.set_defaults(func=without_collection if gc_off else main, reads_settings=False)
