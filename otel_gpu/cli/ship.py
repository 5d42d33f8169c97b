"""``otel-gpu ship``: the command line of :mod:`otel_gpu.traces.ship`."""

from __future__ import annotations

import argparse
import io
import sys
from typing import Any

from otel_gpu.cli import add_command, say, whole_number
from otel_gpu.traces import ship  # imports protobuf and the exporters only when it sends

__all__ = ["register"]


def _main(args: argparse.Namespace) -> int:
    from otel_gpu.config import ConfigError, otel_standard_variables

    env = otel_standard_variables()
    try:
        if not args.check:  # before reading the files: a bad variable fails at once
            ship.check_environment(env)
        result = ship.ship(
            args.files,
            batch_size=args.batch_size,
            skip_invalid=args.skip_invalid,
            max_failures=args.max_failures,
            check_only=args.check,
            out=io.StringIO() if args.quiet else sys.stderr,
            err=sys.stderr,
            target=ship.describe_target(env),
        )
    except ConfigError as exc:
        say(f"otel-gpu ship: {exc}")
        return 2
    return result.exit_code


def register(sub: Any) -> None:
    p = add_command(
        sub,
        "ship",
        "Send the spans of OTLP JSON Lines files (as OTEL_GPU_LOGDEST=FILE.jsonl "
        "writes them; .jsonl.gz too) to the endpoint the standard OTEL_EXPORTER_OTLP_* variables "
        "name (protocol grpc or http/protobuf), keeping trace and span ids. Every file is "
        "validated before anything is sent. Exit codes: 0 every span sent (with --check: every "
        "line valid); 1 some or all spans not sent (export failures, or invalid input skipped "
        "with --skip-invalid); 2 nothing sent because of invalid input or configuration.",
    )
    p.add_argument("files", nargs="+", metavar="FILE.jsonl", help="OTLP JSON Lines files")
    p.add_argument(
        "--batch-size",
        type=whole_number(1),
        default=ship.BATCH_SIZE,
        help=f"spans per export request (default {ship.BATCH_SIZE})",
    )
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="ship the valid lines even if some lines are invalid (e.g. a truncated last line) "
        "or some files cannot be read",
    )
    p.add_argument(
        "--max-failures",
        type=whole_number(0),
        default=3,
        help="stop after this many failed requests in a row; 0 never stops (default 3)",
    )
    p.add_argument("--check", action="store_true", help="only validate the files; send nothing")
    p.add_argument("-q", "--quiet", action="store_true", help="print only problems")
    p.set_defaults(func=_main)
