"""Reading OTLP JSON Lines files in tests: each span as its JSON object plus ``attrs``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_spans(path: Path) -> list[dict[str, Any]]:
    """Every span of the file, in file order; ``span["attrs"]`` maps keys to raw OTLP values
    (``"x"``, ``True``, ``{"values": [{"intValue": "2"}]}``)."""
    spans = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    attrs = {}
                    for kv in span.get("attributes", []):
                        (value,) = kv["value"].values()
                        attrs[kv["key"]] = value
                    span["attrs"] = attrs
                    spans.append(span)
    return spans
