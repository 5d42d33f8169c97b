"""``otel-gpu snapshot PID`` / ``--all``: a live otel-gpu process exports its state now."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from otel_gpu.cli import add_command

__all__ = ["pid_argument", "register", "seconds_argument"]

EXIT_ANSWERED = 0
EXIT_UNANSWERED = 1
EXIT_USAGE = 2


def _main(args: argparse.Namespace) -> int:
    from otel_gpu import config
    from otel_gpu._text import printable
    from otel_gpu.anomalies import snapshot
    from otel_gpu.journal.writer import journal_dir

    def say(line: str) -> None:
        print(printable(f"otel-gpu snapshot: {line}"), file=sys.stderr)

    settings = config.current()
    directory = journal_dir(settings)
    if args.all:
        pids = snapshot.live_processes(directory)
        if not pids:
            say(f"no live otel-gpu process of this user has a journal in {directory}")
            return EXIT_UNANSWERED
    else:
        pid = args.pid
        if pid == os.getpid() or not snapshot.same_user(pid):
            say(f"pid {pid} is not a running process of this user (only the same user may ask)")
            return EXIT_USAGE
        pids = [pid]
    try:
        replies = snapshot.request(directory, pids, args.timeout, chosen=bool(settings.journal_dir))
    except OSError as exc:
        say(f"cannot write the request in {directory}: {exc.strerror or exc}")
        return EXIT_USAGE
    code = EXIT_ANSWERED
    for reply in replies:
        answer = reply.answer
        if answer is None:
            code = EXIT_UNANSWERED
            say(
                f"pid {reply.pid} did not answer within {args.timeout:g} s: it has made no "
                "otel-gpu call yet, uses another OTEL_GPU_JOURNAL_DIR, or its export thread "
                "cannot run (a thread holding the GIL in C code, or the process is stopped)"
            )
            continue
        ring = f", ring dump {answer['ring_dump']}" if answer.get("ring_dump") else ""
        print(
            printable(
                f"pid {reply.pid}: snapshot exported: span {answer.get('span_id')} in trace "
                f"{answer.get('trace_id')} ({answer.get('threads')} thread(s), "
                f"{_calls(answer.get('calls_in_flight'))}{ring})"
            )
        )
    return code


def _calls(count: Any) -> str:
    if count is None:
        return "calls in flight unknown: no crash journal"
    return f"{count} call(s) in flight"


def pid_argument(raw: str) -> int:
    """argparse type: a process id (also ``otel-gpu control``'s)."""
    if not raw.isdigit() or int(raw) <= 0:
        raise argparse.ArgumentTypeError(f"must be a process id (a whole number > 0), not {raw!r}")
    return int(raw)


def seconds_argument(raw: str) -> float:
    """argparse type: a wait in seconds, in (0, 3600] (also ``otel-gpu control``'s)."""
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, 3600], not {raw!r}")
    return value


def register(sub: Any) -> None:
    p = add_command(
        sub,
        "snapshot",
        "Ask a running otel-gpu process of this user (one that has made an otel-gpu "
        "call) to export, within a second or two, a span 'otel_gpu.snapshot' holding every "
        "Python thread's stack, its calls in flight with their inputs as the crash journal has "
        "them and, when OTEL_GPU_RING is on, a ring dump. The request is a file in the crash "
        "journal's directory (OTEL_GPU_JOURNAL_DIR), which the process's export thread polls. "
        "Exit codes: 0 every process answered; 1 some did not answer in time (or --all found "
        "none); 2 usage errors (not a process of this user).",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("pid", nargs="?", type=pid_argument, help="the process id")
    which.add_argument(
        "--all", action="store_true", help="every live otel-gpu process of this user on this host"
    )
    p.add_argument(
        "--timeout",
        type=seconds_argument,
        default=5.0,
        help="seconds to wait for the answers (default 5)",
    )
    p.set_defaults(func=_main)
