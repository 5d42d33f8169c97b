"""``otel-gpu diff A B``: the command line of :mod:`otel_gpu.traces.diff`."""

from __future__ import annotations

import argparse
import math
from typing import Any

from otel_gpu.cli import add_command
from otel_gpu.cli.flags import add_json, checked, reads_trace_files

__all__ = ["register"]


_tolerance = checked(
    float, lambda value: math.isfinite(value) and value >= 0, "must be a number >= 0, not {raw!r}"
)


def _main(args: argparse.Namespace) -> int:
    from otel_gpu.traces.diff import diff

    return diff(
        args.a,
        args.b,
        rtol=args.rtol,
        atol=args.atol,
        as_json=args.json,
        fingerprints=not args.no_fingerprints,
        accept_close=args.tolerance or args.rtol is not None or args.atol is not None,
    )


def register(sub: Any) -> None:
    p = add_command(
        sub,
        "diff",
        "Compare two runs of one program, call by call: two OTLP JSON Lines trace files, or "
        "two flight-recorder dump folders. Calls are lined up by function and position in the "
        "call tree (fuzzily where the trees differ); each pair's tensors are compared by their "
        "dumped values (level 10), else their statistics (level 5), else their metadata. "
        "Names the first call whose inputs matched and outputs did not, the first call whose "
        "inputs already differed, and calls present in one run only. Exit codes: 0 same "
        "(every compared tensor bit-identical); 1 diverged; 2 bad input (unreadable or torn "
        "files, different services or versions, nothing comparable); 3 close (tensors differ, "
        "all within tolerance; 0 with --tolerance, --rtol or --atol). See docs/diff.md.",
    )
    p.add_argument("a", metavar="A", help="run A: a trace file or a dump folder")
    p.add_argument("b", metavar="B", help="run B: the same kind as A")
    p.add_argument(
        "--rtol",
        type=_tolerance,
        metavar="R",
        help="relative tolerance for every dtype (implies --tolerance)",
    )
    p.add_argument(
        "--atol",
        type=_tolerance,
        metavar="A",
        help="absolute tolerance for every dtype (implies --tolerance)",
    )
    p.add_argument(
        "--tolerance",
        action="store_true",
        help="accept differences within the tolerance (per dtype, or --rtol/--atol): the "
        "verdict close exits 0 instead of 3 (it is never called same)",
    )
    p.add_argument(
        "--no-fingerprints",
        action="store_true",
        help="compare level-5 tensors by their statistics within tolerance even where both "
        "runs carry fingerprints (runs whose bytes differ by rounding: eager and compiled)",
    )
    add_json(p)
    reads_trace_files(p, _main, gc_off=True)
