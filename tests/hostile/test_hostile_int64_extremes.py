"""Level 5 on int64 tensors at their extremes: min and max are exact integers on the exported
span, never a float rounded past int64 (2**63 - 1 read through float64 is 2**63, which no OTLP
integer can hold, and the attribute was dropped)."""

from __future__ import annotations

import pytest
import torch

import otel_gpu
from otel_gpu.calls import stats

CASES = [
    [-(2**63), 2**63 - 1, 5],
    [2**53 + 1, 3, -7],
    [-(2**63)],
    [2**62, 2**62 + 1],
]


@pytest.mark.parametrize("values", CASES)
def test_int64_min_and_max_are_exact_on_the_span(otel_gpu_spans, values):
    """The statistics event of an int64 input and output carries its exact min and max."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def same(t):
        return t.clone()

    same(torch.tensor(values, dtype=torch.int64))
    (span,) = spans.get()
    events = [dict(e.attributes) for e in span.events if e.name == "otel_gpu.stats"]
    assert len(events) == 2
    for event in events:
        assert event["min"] == min(values) and type(event["min"]) is int
        assert event["max"] == max(values) and type(event["max"]) is int


@pytest.mark.parametrize("values", CASES)
def test_capture_gives_the_same_exact_extremes(values):
    """The CUDA-graph capture vector carries the same exact columns: a replay's statistics of
    an int64 tensor are exact too (read here from the vector as a replay would)."""
    from otel_gpu.core.stats import captured_stats

    t = torch.tensor(values, dtype=torch.int64)
    p = stats.capture("x", t)
    row = p.vec.tolist()
    got = captured_stats("x", p.numel, p.note, p.integer, row, p.extras, bool(p.moments))
    assert got.values["min"] == min(values) and got.values["max"] == max(values)
