"""``otel-gpu show``: the command line of :mod:`otel_gpu.traces.show`."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from otel_gpu.cli import add_command
from otel_gpu.cli.flags import add_trace_files, checked, reads_trace_files
from otel_gpu.traces import show as traces_show  # torch-free, as every trace tool

__all__ = ["register"]


def _trace_id(raw: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{32}", raw):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a trace id: 32 hex digits, any case")
    return raw.lower()


def _request_id(raw: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{32}|[0-9a-fA-F]{16}", raw):
        raise argparse.ArgumentTypeError(
            f"{raw!r} is not a request: its trace id (32 hex digits) or span id (16), any case"
        )
    return raw.lower()


_limit = checked(int, lambda value: value >= 0, "{raw!r}: a number of spans >= 0 (0: no limit)")


def _main(args: argparse.Namespace) -> int:
    from otel_gpu.config import no_color

    if args.request and (args.nonfinite or args.name or args.trace_id or args.fault):
        print(
            "otel-gpu show: --request follows links across traces; it takes no --nonfinite, "
            "--name, --trace-id or --fault",
            file=sys.stderr,
        )
        return traces_show.EXIT_USAGE
    if args.fault:  # the call whose kernel faulted (traces/fault.py)
        from otel_gpu.traces.fault import show_fault

        return show_fault(args.files)
    color = not args.no_color and not no_color() and sys.stdout.isatty()
    return traces_show.show(
        args.files,
        nonfinite=args.nonfinite,
        names=args.name or (),
        trace_id=args.trace_id,
        limit=args.limit,
        color=color,
        skip_invalid=args.skip_invalid,
        request=args.request,
    )


def register(sub: Any) -> None:
    p = add_command(
        sub,
        "show",
        "Render the spans of OTLP JSON Lines files (as OTEL_GPU_LOGDEST=FILE.jsonl or "
        "the OpenTelemetry Collector's file exporter writes them; .gz too) as one tree per "
        "trace. Exit codes: 0 spans shown (--nonfinite: a producer found); 1 nothing matched "
        "(--nonfinite: no producer found), or lines skipped (a torn last line, or invalid lines "
        "with --skip-invalid); 2 usage errors (missing file, invalid line).",
    )
    add_trace_files(p)
    p.add_argument(
        "--nonfinite",
        action="store_true",
        help="report the first call whose outputs hold NaN/Inf while its inputs are finite "
        "and no call below it produced them (needs level-5 statistics)",
    )
    p.add_argument(
        "--name",
        action="append",
        metavar="GLOB",
        help="keep spans whose name matches (fnmatch; repeatable) and their ancestors; "
        "with --nonfinite, report only producers whose name matches",
    )
    p.add_argument(
        "--trace-id", type=_trace_id, metavar="ID", help="only this trace (32 hex digits)"
    )
    p.add_argument(
        "--request",
        type=_request_id,
        metavar="ID",
        help="the steps and calls that served this request (its trace id, 32 hex digits, or "
        "its span id, 16): spans linking to it (otel_gpu.batch) and the calls under its span, "
        "with device time where recorded, then the first error or NaN/Inf among them",
    )
    p.add_argument(
        "--limit",
        type=_limit,
        default=traces_show.DEFAULT_LIMIT,
        metavar="N",
        help=f"show at most N spans of the tree (default {traces_show.DEFAULT_LIMIT}; 0: all)",
    )
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="show the valid lines even if some lines are invalid or some files cannot be read "
        "(each is reported; exit code 1). A torn last line is skipped without it",
    )
    p.add_argument(
        "--fault",
        action="store_true",
        help="print the call whose CUDA kernel faulted (otel_gpu.cuda.fault), with its inputs' "
        "metadata and dump directory, or the candidates when it could not be singled out",
    )
    p.add_argument("--no-color", action="store_true", help="plain text (also when NO_COLOR is set)")
    reads_trace_files(p, _main)
