"""Crafted flight-recorder dumps: a manifest written by hand, as an attacker or a bug could."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def crafted_manifest(
    function: dict[str, Any], params: list[tuple[str, Any]], **extra: Any
) -> dict[str, Any]:
    """A complete, valid manifest of one completed call of ``function`` with ``params``
    (``(name, encoded value)`` pairs); ``extra`` replaces any top-level field."""
    return {
        "schema_version": 1,
        "status": "completed",
        "function": {"receiver": False, "file": None, "instrumented": None, **function},
        "replayable": True,
        "why_not_replayable": None,
        "trace_id": "0" * 31 + "1",
        "span_id": "0123456789abcdef",
        "parent_span_id": None,
        "files": {"inputs": None, "outputs": None},
        "tensors": {},
        "params": [{"name": n, "default": False, "value": v} for n, v in params],
        "positional": None,
        "receiver": None,
        "result": {"t": "int", "v": 1},
        "mutated": {},
        "outputs_skipped": None,
        "exception": None,
        **extra,
    }


def write_call(root: Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest`` as the next call directory below ``root``; returns that directory."""
    name = str(manifest["function"].get("span_name", "x"))
    seq = len(list(root.iterdir())) + 1 if root.exists() else 1
    call = root / f"{seq:06d}-20260101T000000.000000-0123456789abcdef-{name}"
    call.mkdir(parents=True)
    (call / "manifest.json").write_text(json.dumps(manifest))
    return call
