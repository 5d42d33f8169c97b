"""What ``otel-gpu snapshot`` and ``otel-gpu control`` share: asking live otel-gpu processes of
this user, through a request file in the crash journal's directory.

Both take a process id or ``--all`` and ``--timeout``, refuse a process that is not this user's
(or is this one), and report a request they could not write; each keeps its own exit codes.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TypeVar

from otel_gpu.cli.flags import checked, digits

__all__ = ["Refused", "add_targets", "add_timeout", "ask", "targets"]

T = TypeVar("T")

pid_argument = checked(
    digits, lambda pid: pid > 0, "must be a process id (a whole number > 0), not {raw!r}"
)
"""The argument type of a process id."""

seconds_argument = checked(
    float, lambda wait: 0 < wait <= 3600, "must be a number of seconds in (0, 3600], not {raw!r}"
)
"""The argument type of a wait in seconds, in (0, 3600]."""


class Refused(Exception):
    """Nothing was asked: ``str()`` says why, ``code`` is the command's exit status for it."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.code = code


def targets(
    args: argparse.Namespace,
    directory: str,
    found: Callable[[str], list[int]],
    nobody: str,
    not_ours: int,
) -> list[int]:
    """The processes to ask: with ``--all`` those ``found`` in ``directory`` (none: Refused
    ``nobody``, exit 1); else the one named, unless it is this process or not this user's
    (Refused, exit ``not_ours``)."""
    from otel_gpu.anomalies.snapshot import same_user

    if args.all:
        pids = found(directory)
        if not pids:
            raise Refused(nobody, 1)
        return pids
    pid: int = args.pid
    if pid == os.getpid() or not same_user(pid):
        raise Refused(
            f"pid {pid} is not a running process of this user (only the same user may ask)",
            not_ours,
        )
    return [pid]


def ask(directory: str, send: Callable[[], T], code: int) -> T:
    """``send()``'s replies; a request that cannot be written is Refused, exit ``code``."""
    try:
        return send()
    except OSError as exc:
        raise Refused(
            f"cannot write the request in {directory}: {exc.strerror or exc}", code
        ) from None


def add_targets(parser: argparse.ArgumentParser, all_help: str) -> None:
    """``PID`` or ``--all`` (one of them), as ``pid`` and ``all``."""
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("pid", nargs="?", type=pid_argument, help="the process id")
    which.add_argument("--all", action="store_true", help=all_help)


def add_timeout(parser: argparse.ArgumentParser) -> None:
    """``--timeout``: how long to wait for the answers, as ``timeout``."""
    parser.add_argument(
        "--timeout",
        type=seconds_argument,
        default=5.0,
        help="seconds to wait for the answers (default 5)",
    )
