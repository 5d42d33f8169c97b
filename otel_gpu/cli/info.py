"""``otel-gpu info``: the settings in force and the resource spans will carry."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["register"]


def _main(args: argparse.Namespace) -> int:
    from otel_gpu import config
    from otel_gpu.resource import build_resource

    settings = config.current()
    resource = build_resource()
    if args.json:
        print(
            json.dumps(
                {
                    "settings": {k: v for k, v in vars(settings).items()},
                    "resource": dict(resource.attributes),
                },
                indent=2,
                default=str,
            )
        )
        return 0
    print("settings:")
    for row in config.SETTINGS:
        value = getattr(settings, row.field)
        if isinstance(value, tuple):
            value = ",".join(value)
        print(f"  {row.env:28} = {value}")
    print("resource:")
    for key, value in sorted(resource.attributes.items()):
        print(f"  {key} = {value}")
    return 0


def register(sub: Any) -> None:
    from otel_gpu.cli import add_command

    p = add_command(sub, "info", "Show the settings in force and the resource spans will carry.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_main)
