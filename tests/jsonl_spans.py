"""Reading OTLP JSON Lines files in tests: each span as its JSON object plus ``attrs``.

Lines are read and decoded by otel-gpu's one reader (``otel_gpu.traces.reader``: gzip by
content, bounded lines, a torn or invalid line is an error); only the walk down to the spans,
which keeps every raw field the tests look at, is here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from otel_gpu.traces.reader import TraceFileError, load_json, read_lines


def _fail(exc: TraceFileError) -> None:
    raise exc


def read_spans(path: Path, *, plain: bool = False) -> list[dict[str, Any]]:
    """Every span of the file, in file order; every line must parse.

    ``span["attrs"]`` maps keys to raw OTLP values (``"x"``, ``True``,
    ``{"values": [{"intValue": "2"}]}``); with ``plain``, to Python values (``2``, ``[2]``), and
    ``span["resource"]`` holds the resource's attributes likewise.
    """
    spans = []
    for line in read_lines(str(path), _fail):
        for rs in load_json(line.raw, line.where, line.torn)["resourceSpans"]:
            resource = _attributes(rs.get("resource", {}), plain)
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    span["attrs"] = _attributes(span, plain)
                    if plain:
                        span["resource"] = resource
                    spans.append(span)
    return spans


def _attributes(node: dict[str, Any], plain: bool) -> dict[str, Any]:
    out = {}
    for kv in node.get("attributes", []):
        ((kind, value),) = kv["value"].items()
        out[kv["key"]] = _plain(kind, value) if plain else value
    return out


def _plain(kind: str, value: Any) -> Any:
    if kind == "arrayValue":
        return [_plain(*next(iter(v.items()))) for v in value.get("values", [])]
    if kind == "intValue":
        return int(value)
    return value
