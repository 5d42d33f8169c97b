"""Fingerprints and low-precision statistics read from hostile trace files by ``otel-gpu diff``.

Attacks: a ``fingerprint`` of a JSON type otel-gpu never writes (list, object, number, a
megabyte string), equal in both runs or not; fractions that are NaN, strings or infinite.
Promises: ``compare_stats`` gives a status and never raises; two runs' values that are not
equal are never called the same; a NaN fraction is not "within tolerance".
"""

from __future__ import annotations

import pytest

from otel_gpu.traces.diff_values import compare_stats

BASE = {"numel": 4, "min": 0.0, "max": 1.0, "mean": 0.5, "std": 0.1, "nan_count": 0}


@pytest.mark.parametrize(
    "odd", [[1, 2], {"a": 1}, 7, 1.5, None, True, "f" * 1_000_000], ids=lambda v: type(v).__name__
)
def test_a_fingerprint_of_an_odd_type_is_compared_by_equality_only(odd):
    """Attack: a fingerprint that is not 16 hex digits. Equal in both runs: same; against a
    real one: differ, with the statistics' verdict beside it; never an exception."""
    a = {**BASE, "fingerprint": odd}
    assert compare_stats("output.0", a, dict(a), "torch.float32")["status"] == "same"
    b = {**BASE, "fingerprint": "0123456789abcdef"}
    r = compare_stats("output.0", a, b, "torch.float32")
    assert (r["status"], r["method"], r["statistics"]) == ("differ", "fingerprint", "same")


@pytest.mark.parametrize(
    ("x", "y", "status"),
    [
        (float("nan"), float("nan"), "differ"),  # NaN is not within any tolerance
        (float("nan"), 0.0, "differ"),
        (float("inf"), 0.0, "differ"),
        ("0.5", 0.0, "same"),  # not a number: not compared, the rest decides
        (0.5, 0.5, "same"),
    ],
)
def test_fractions_that_are_not_plain_numbers(x, y, status):
    """Attack: saturation as NaN, Infinity or a string in a crafted trace: a verdict, never an
    exception, and a NaN never counts as agreeing."""
    a, b = {**BASE, "saturation": x}, {**BASE, "saturation": y}
    assert compare_stats("output.0", a, b, "torch.float8_e4m3fn")["status"] == status


def test_an_infinite_amax_does_not_widen_the_tolerance():
    """Attack: amax = Infinity in one run: it differs from a finite amax, and the mean's bound
    stays that of the finite extremes."""
    a = {**BASE, "amax": float("inf")}
    b = {**BASE, "amax": 1.0}
    r = compare_stats("output.0", a, b, "torch.float32")
    assert (r["status"], r["field"]) == ("differ", "amax")
    c = {**BASE, "amax": float("inf"), "mean": 0.6}
    assert compare_stats("output.0", a, c, "torch.float32")["field"] == "mean"
