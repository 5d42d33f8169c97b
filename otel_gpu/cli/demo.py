"""``otel-gpu demo``: a small workload of decorated torch functions, by default at level 5 on the console."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["DEMO_SERVICE", "register", "run"]

DEMO_SERVICE = "otel-gpu-demo"
"""``service.name`` of the demo's spans unless ``OTEL_SERVICE_NAME`` is set."""


def run(level: int | None = None, dest: str | None = None) -> int:
    """Configure, import the decorated demo library, and call it: nested calls, a NaN, an error."""
    import torch

    import otel_gpu
    from otel_gpu import config

    # One service name however the demo is started (`otel-gpu demo`, `python -m otel_gpu demo`,
    # `make demo`): the default, the script's name, differs between them.
    service = None if config.in_environment("service_name") else DEMO_SERVICE
    otel_gpu.configure(level=level, dest=dest, service_name=service)
    from otel_gpu import demo as lib

    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    weight = torch.ones(32)
    _out, logp = lib.decoder_layer(x, weight)
    table = torch.randn(4, 32)
    try:
        lib.gather_rows(table, torch.tensor([0, 9]))  # index 9 is out of range: an ERROR span
    except IndexError as exc:
        print(f"demo: gather_rows raised {type(exc).__name__} as expected: {exc}", file=sys.stderr)
    otel_gpu.flush()
    nan = int(torch.isnan(logp).sum())
    print(
        f"demo: done; {nan} NaN values in log_probs' output, flagged in its stats", file=sys.stderr
    )
    return 0


def _main(args: argparse.Namespace) -> int:
    from otel_gpu import config

    level = args.level
    if level is None and not config.in_environment("level"):
        level = 5
    return run(level=level, dest=args.dest)


def register(sub: Any) -> None:
    from otel_gpu.cli import add_command
    from otel_gpu.cli.flags import add_level_and_dest

    p = add_command(
        sub,
        "demo",
        "Run a demo workload of decorated torch functions. Level defaults to 5 unless "
        "OTEL_GPU_LOGLEVEL is set; destination follows OTEL_GPU_LOGDEST (default stdout).",
    )
    add_level_and_dest(
        p, "0, 1, 3, 5 or 10 (default: 5)", "stdout, stderr, otlp, FILE.jsonl or FILE (text)"
    )
    p.set_defaults(func=_main)
