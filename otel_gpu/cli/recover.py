"""``otel-gpu recover``: the command line of :mod:`otel_gpu.journal.recover`, and its report.

The journal modules are imported when the command runs: a journal's records hold torch's dtypes
and devices, so reading one imports torch, but ``recover --help`` and a bad flag do not.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from otel_gpu.cli import add_command, say
from otel_gpu.cli.flags import checked

if TYPE_CHECKING:
    from otel_gpu.journal.recover import Outcome

__all__ = ["register"]


_LINES = {
    "recovered": "{calls}: exported as ERROR spans to {to}",
    "unconfirmed": "{calls}: handed as ERROR spans to {to}, but {detail}; journal removed: "
    "a destination that keeps them confirmed them",
    "unconfirmed-kept": "{calls}: handed as ERROR spans to {to}, but {detail}; journal kept for "
    "another run (a destination that did receive them gets them again)",
    "shown": "{calls}: shown as ERROR spans on {to} only; journal kept",
    "failed": "{calls}: not exported ({detail}); journal kept for another run",
    "dead": "{calls} (dry run: not exported, journal kept)",
    "empty": "pid {pid} died with no call in flight: nothing to export, journal removed",
    "alive": "pid {pid} is still running: left alone",
    "other-host": "pid {pid} ran on host {detail}: left alone, run otel-gpu recover there",
    "taken": "not recovered here: {detail}",
    "invalid": "not a journal this otel-gpu can recover ({detail}): left alone",
    "unreadable": "cannot list the directory ({detail})",
}


def _line(o: Outcome, dry_run: bool) -> str:
    """What happened to one journal, in words that claim only what was checked."""
    if o.state == "clean":
        if o.detail:
            return f"pid {o.pid} exited normally, but its journal remains ({o.detail})"
        kept = "journal kept" if dry_run else "journal removed"
        return f"pid {o.pid} exited normally: nothing to export, {kept}"
    template = _LINES.get(f"{o.state}-kept" if o.kept and o.state == "unconfirmed" else o.state)
    if template is None:
        return f"{o.state} ({o.detail})" if o.detail else o.state
    calls = f"pid {o.pid} died with {o.spans} call(s) in flight"
    # the values are inserted once: braces in a detail are not read as fields
    return template.format(calls=calls, to=o.to, detail=o.detail, pid=o.pid)


def _summary(outcomes: list[Outcome], where: str, dry_run: bool) -> str:
    if not outcomes:
        missing = "" if os.path.lexists(where) else " (it does not exist)"
        return f"no journals in {where}{missing}"
    if [o.state for o in outcomes] == ["unreadable"]:
        return f"nothing recovered: cannot list {where}"

    def calls(*states: str) -> tuple[int, int]:
        chosen = [o for o in outcomes if o.state in states]
        return sum(o.spans for o in chosen), len(chosen)

    if dry_run:
        found, dead = calls("dead")
        return (
            f"dry run: {found} call(s) in flight in {dead} dead process(es); "
            "nothing exported or removed"
        )
    dead = calls("recovered", "unconfirmed", "failed", "empty", "shown")[1]
    text = f"{calls('recovered')[0]} call(s) recovered from {dead} dead process(es)"
    lost, lost_in = calls("unconfirmed")
    if lost:
        text += f"; {lost} call(s) of {lost_in} process(es) not confirmed by the exporters"
    kept, kept_in = calls("failed")
    if kept:
        text += f"; {kept} call(s) of {kept_in} process(es) not exported, journal(s) kept"
    shown, shown_in = calls("shown")
    if shown:
        text += (
            f"; {shown} call(s) of {shown_in} process(es) only shown on the terminal, journal(s) "
            f"kept: to export and remove them, run OTEL_GPU_LOGDEST={_EXAMPLE} otel-gpu recover "
            "(or OTEL_GPU_LOGDEST=otlp)"
        )
    return text


_EXAMPLE = "crash.jsonl"


def _main(args: argparse.Namespace) -> int:
    from otel_gpu import config
    from otel_gpu.journal import recover as _recover
    from otel_gpu.journal import writer as _writer

    try:
        settings = config.current()
        where = args.path or _writer.journal_dir(settings)
        timeout = args.timeout if args.timeout is not None else max(settings.flush_timeout, 10.0)
        outcomes = _recover.recover(settings, where, timeout=timeout, dry_run=args.dry_run)
    except config.ConfigError as exc:
        print(f"otel-gpu recover: {exc}", file=sys.stderr)
        return 2
    # Paths come from a directory listing, hosts and reasons from the journals: escaped.
    for o in outcomes:
        say(f"{o.path}: {_line(o, args.dry_run)}")
        if o.fault:
            say(f"{o.path}: {o.fault}")
    summary = _summary(outcomes, where, args.dry_run)
    say(f"otel-gpu recover: {summary}")
    failures = ("unconfirmed", "failed", "unreadable")
    return 1 if any(o.state in failures for o in outcomes) else 0


# nan >= 0 is False: nan is refused too
_seconds = checked(float, lambda value: value >= 0, "must be a number of seconds >= 0, not {raw!r}")


def register(sub: Any) -> None:
    p = add_command(
        sub,
        "recover",
        "Turn the crash journals of dead processes into ERROR spans "
        "('process died during call') with their original ids, start times and inputs, "
        "exported to the destinations OTEL_GPU_LOGDEST names. Journals of running processes "
        "are left alone. A journal is removed only once a destination that keeps its spans (a "
        "file, or a collector that acknowledged them) confirmed them: with the terminal alone "
        "(the default, stdout) the spans are shown and the journal kept; run e.g. "
        "OTEL_GPU_LOGDEST=crash.jsonl otel-gpu recover to export and remove it. Exit codes: 0 "
        "every dead process's calls were confirmed by the destinations, or only shown on the "
        "terminal (or there was nothing to export); 1 some calls were not confirmed or not "
        "exported, or the directory could not be listed; 2 invalid configuration.",
    )
    p.add_argument(
        "path",
        nargs="?",
        default=None,
        help="a journal directory or file (default: OTEL_GPU_JOURNAL_DIR, else "
        "$XDG_RUNTIME_DIR/otel-gpu, else <tmp>/otel-gpu-<uid>)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="list what would be recovered; export nothing"
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        help="seconds to wait for the exporters (default: OTEL_GPU_FLUSH_TIMEOUT, at least 10)",
    )
    p.set_defaults(func=_main)
