"""``otel-gpu workloads TRACE...``: the command line of :mod:`otel_gpu.traces.workloads`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from otel_gpu.cli import add_command, whole_number
from otel_gpu.cli.flags import add_json, add_trace_files, reads_trace_files

__all__ = ["register"]


def _rule(raw: str) -> str:
    glob, eq, _ = raw.partition("=")
    if not eq or not glob:
        raise argparse.ArgumentTypeError(f"{raw!r} is not GLOB=NAME[,NAME...] (GLOB= for none)")
    return raw


def _main(args: argparse.Namespace) -> int:
    from otel_gpu.traces.workloads import parse_rules, workloads

    if args.by_request and (args.function or args.scalars or args.emit):
        print(
            "otel-gpu workloads: --by-request groups every call by request; it takes no "
            "--function, --scalars or --emit",
            file=sys.stderr,
        )
        return 2

    return workloads(
        args.files,
        top=args.top,
        functions=args.function or (),
        rules=parse_rules(args.scalars or ()),
        as_json=args.json,
        emit=args.emit,
        by_request=args.by_request,
    )


def register(sub: Any) -> None:
    p = add_command(
        sub,
        "workloads",
        "Group the calls recorded at level 3 or more in OTLP JSON Lines trace files (any mix of "
        "files, ranks and processes) by function and input signature (dtypes, shapes, strides "
        "of non-contiguous tensors, other arguments' values), with call count, share, total, "
        "p50 and p99 time (device time where spans carry it, host time otherwise), ranks, "
        "services and a level-10 dump directory; largest total first. Exit codes: 0 workloads "
        "shown; 1 no call recorded at level 3 or more; 2 bad input (a missing or invalid file, "
        "an --emit folder that cannot be written). See docs/workloads.md.",
    )
    add_trace_files(p)
    p.add_argument(
        "--top", type=whole_number(0), default=0, metavar="N", help="the N largest (0: all)"
    )
    p.add_argument(
        "--function",
        action="append",
        metavar="GLOB",
        help="only functions whose span name matches (fnmatch; repeatable)",
    )
    p.add_argument(
        "--scalars",
        action="append",
        type=_rule,
        metavar="GLOB=NAMES",
        help="for functions matching GLOB, only these non-tensor arguments (comma-separated "
        "parameter names) count in the signature; GLOB= for none (default: all; repeatable, "
        "the first matching rule applies)",
    )
    p.add_argument(
        "--by-request",
        action="store_true",
        help="group the calls by the request they served instead (spans linking to it, from "
        "otel_gpu.batch, and calls under a one-request step): steps, calls, time and the first "
        "error or NaN/Inf per request, any level; see docs/serving.md",
    )
    add_json(p)
    p.add_argument(
        "--emit",
        metavar="DIR",
        help="write a definition JSON per signature and a workload JSON Lines file per function "
        "(and FlashInfer's own definition where its API has fi_trace) under DIR",
    )
    reads_trace_files(p, _main, gc_off=True)
