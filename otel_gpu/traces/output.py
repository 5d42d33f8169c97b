"""What the trace commands (``workloads``, ``show``, ``ranks``) print of values read from files.

- **Human output** shows a value read from a file at most :data:`SHOWN_CHARACTERS` long
  (:func:`clip`), saying how much more it holds: a 40 MB attribute value is one short line.
- **``--json``** keeps every value whole, and is valid JSON everywhere: a number that is not
  finite (``NaN``, ``Infinity``, ``-Infinity``, which ``json.dump`` would write bare) is written
  as that word in a string, as OTLP/JSON writes a ``doubleValue`` (:func:`dump`).
"""

from __future__ import annotations

import json
import math
from typing import IO, Any

__all__ = ["SHOWN_CHARACTERS", "clip", "clipped", "dump", "finite"]

SHOWN_CHARACTERS = 256
"""The longest value shown whole in human output: ``OTEL_GPU_REPR_LIMIT``'s default, the length
a string or repr attribute is cut to when it is recorded."""


def clip(value: Any, limit: int = SHOWN_CHARACTERS) -> str:
    """``str(value)``, cut to ``limit`` characters with how many more it holds."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… (+{len(text) - limit} characters)"


def clipped(value: Any, limit: int = SHOWN_CHARACTERS) -> Any:
    """``value`` (JSON-like: dicts, lists, scalars) with each string longer than ``limit`` cut
    by :func:`clip`; keys too. Nesting is that of a report, a few levels."""
    if isinstance(value, str):
        return clip(value, limit)
    if isinstance(value, dict):
        return {
            clip(k, limit) if isinstance(k, str) else k: clipped(v, limit) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(clipped(v, limit) for v in value)
    return value


_WORDS = {math.inf: "Infinity", -math.inf: "-Infinity"}


def finite(value: Any) -> Any:
    """``value`` with each float that is not finite replaced by ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"``, in containers (keys too) as well."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else _WORDS[value]
    if isinstance(value, dict):
        return {finite(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dump(report: Any, out: IO[str]) -> None:
    """``report`` as indented JSON and a newline, non-finite numbers as strings (:func:`finite`);
    ``allow_nan=False`` makes sure none is written bare."""
    json.dump(finite(report), out, indent=2, allow_nan=False)
    out.write("\n")
