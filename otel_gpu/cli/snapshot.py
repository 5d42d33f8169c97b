"""``otel-gpu snapshot PID`` / ``--all``: a live otel-gpu process exports its state now."""

from __future__ import annotations

import argparse
from typing import Any

from otel_gpu import cli
from otel_gpu.cli import add_command, live

__all__ = ["register"]

EXIT_ANSWERED = 0
EXIT_UNANSWERED = 1
EXIT_USAGE = 2


def _main(args: argparse.Namespace) -> int:
    from otel_gpu import config
    from otel_gpu._text import printable
    from otel_gpu.anomalies import snapshot
    from otel_gpu.journal.directory import journal_dir

    def say(line: str) -> None:
        cli.say(f"otel-gpu snapshot: {line}")

    settings = config.current()
    directory = journal_dir(settings)
    nobody = f"no live otel-gpu process of this user has a journal in {directory}"
    try:
        pids = live.targets(args, directory, snapshot.live_processes, nobody, EXIT_USAGE)
        replies = live.ask(
            directory,
            lambda: snapshot.request(
                directory, pids, args.timeout, chosen=bool(settings.journal_dir)
            ),
            EXIT_USAGE,
        )
    except live.Refused as refused:
        say(str(refused))
        return refused.code
    code = EXIT_ANSWERED
    for reply in replies:
        answer = reply.answer
        if answer is None:
            code = EXIT_UNANSWERED
            say(
                f"pid {reply.pid} did not answer within {args.timeout:g} s: it has made no "
                "otel-gpu call yet, uses another OTEL_GPU_JOURNAL_DIR, or its export thread "
                "cannot run (a thread holding the GIL in C code, or the process is stopped)",
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
    live.add_targets(p, "every live otel-gpu process of this user on this host")
    live.add_timeout(p)
    p.set_defaults(func=_main)
