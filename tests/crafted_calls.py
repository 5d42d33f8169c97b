"""Trace files written by hand for ``workloads`` and ``diff`` tests: call spans with inputs,
outputs, statistics events, device time and dump directories, as otel-gpu writes them."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

_ids = itertools.count(1)


def value(v: Any) -> dict[str, Any]:
    """An OTLP/JSON AnyValue."""
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v if math.isfinite(v) else str(v).replace("inf", "Infinity")}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [value(x) for x in v]}}
    return {"stringValue": str(v)}


def attrs(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": value(v)} for k, v in d.items()]


def tensor(shape: list[int], dtype: str = "float32", stride: list[int] | None = None) -> dict:
    """The fields of a tensor argument (contiguous unless ``stride`` is given)."""
    out: dict[str, Any] = {"shape": shape, "dtype": f"torch.{dtype}", "device": "cpu"}
    out["is_contiguous"] = stride is None
    if stride is not None:
        out["stride"] = stride
    return out


def call(
    name: str,
    *,
    inputs: dict[str, dict[str, Any]] | None = None,
    outputs: dict[str, dict[str, Any]] | None = None,
    stats: dict[str, dict[str, Any]] | None = None,
    parent: dict[str, Any] | None = None,
    start: int | None = None,
    seconds: float = 0.001,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One span (OTLP/JSON); ``stats``: tensor name (``output.0``) -> its statistics."""
    n = next(_ids)
    start = 1_000_000_000 * n if start is None else start
    flat: dict[str, Any] = {}
    for prefix, args in (("otel_gpu.input.", inputs or {}), ("otel_gpu.output.", outputs or {})):
        for path, fields in args.items():
            for f, v in fields.items():
                flat[f"{prefix}{path}.{f}"] = v
    flat.update(extra or {})
    span = {
        "traceId": parent["traceId"] if parent else f"{n:032x}",
        "spanId": f"{n:016x}",
        "name": name,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(start + int(seconds * 1e9)),
        "attributes": attrs(flat),
        "events": [
            {"name": "otel_gpu.stats", "attributes": attrs({"otel_gpu.tensor": t, **s})}
            for t, s in (stats or {}).items()
        ],
    }
    if parent:
        span["parentSpanId"] = parent["spanId"]
    return span


def write(
    path: Path, spans: list[dict[str, Any]], service: str = "app", resource: dict | None = None
) -> str:
    res = {"service.name": service, "otel_gpu.version": "0.1.0", **(resource or {})}
    line = {
        "resourceSpans": [
            {
                "resource": {"attributes": attrs(res)},
                "scopeSpans": [{"scope": {"name": "otel_gpu"}, "spans": spans}],
            }
        ]
    }
    path.write_text(json.dumps(line) + "\n")
    return str(path)


def stats(lo: float, hi: float, mean: float, std: float, numel: int = 16) -> dict[str, Any]:
    return {
        "numel": numel,
        "min": lo,
        "max": hi,
        "mean": mean,
        "std": std,
        "nan_count": 0,
        "inf_count": 0,
    }
