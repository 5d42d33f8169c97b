"""``otel-gpu ranks FILE...``: which rank of a job is behind, and which ranks diverged."""

from __future__ import annotations

import argparse
from typing import Any

from otel_gpu.cli import add_command
from otel_gpu.cli.flags import add_json, add_trace_files, reads_trace_files

__all__ = ["register"]


def _main(args: argparse.Namespace) -> int:
    from otel_gpu.traces.ranks import ranks

    return ranks(args.files, as_json=args.json)


def register(sub: Any) -> None:
    p = add_command(
        sub,
        "ranks",
        "Read the trace files of every rank of a job (OTLP JSON Lines as "
        "OTEL_GPU_LOGDEST=FILE.jsonl or the collector's file exporter writes them, recovered "
        "spans included) and line calls up: collectives per process group by sequence number, "
        "other calls by their k-th call on each rank. Prints the last call every rank completed, "
        "the first one some ranks entered and others never did, the ranks behind with their "
        "calls in flight and top frames, and ranks that entered different collectives or the "
        "same one with different shapes or dtypes. Exit codes: 0 all ranks agree; 1 a rank "
        "behind or a divergence; 2 bad input (a missing or invalid file, no call spans).",
    )
    add_trace_files(p, "every rank's trace files")
    add_json(p)
    reads_trace_files(p, _main)
