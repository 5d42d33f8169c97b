"""otel_gpu.metrics.names and docs/metrics.md name the same metrics, units and instruments."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from otel_gpu.metrics import names

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
# A table row documenting a metric: | `name` | instrument | `unit` | ...
_ROW = re.compile(
    r"^\| `([a-z_][a-z0-9_.]*)` \| (histogram|counter|up-down counter|gauge) \| `([^`]+)` \|", re.M
)


def _declared() -> dict[str, str]:
    return {m.name: m.unit for m in vars(names).values() if isinstance(m, names.Metric)}


def _documented(text: str) -> dict[str, str]:
    return {name: unit for name, _, unit in _ROW.findall(text)}


def test_every_metric_is_documented_with_its_unit_and_nothing_else_is():
    """Each ``Metric`` of names.py has a row in docs/metrics.md with the same unit, and each
    documented row is a declared metric."""
    assert _documented(DOC.read_text()) == _declared()


@pytest.mark.parametrize("direction", ["undocumented", "undeclared"])
def test_the_check_fails_on_a_mismatch(direction):
    """The comparison above is not vacuous: a missing row or an extra row is seen."""
    text = DOC.read_text()
    if direction == "undocumented":
        text = text.replace("| `otel_gpu.calls` |", "| otel_gpu.calls |")
    else:
        text += "\n| `otel_gpu.call.bogus` | counter | `{call}` | x |\n"
    assert _documented(text) != _declared()
