"""``otel-gpu show`` and ``otel-gpu ship --check`` agree on what a valid trace line is.

A hand-edited or crafted trace file may carry times and integers that no OTLP producer writes:
negative or fractional times, times past 2**64, integers thousands of digits long. ``ship``
parses them into protobuf, which refuses them; ``show`` used to draw them (negative
durations, a 4000-digit number). Both now read times and ``intValue`` through the same two
functions (:func:`otel_gpu.traces.decode.unix_nano`, :func:`~otel_gpu.traces.decode.int64`):
each such line is refused per line, with its number and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from otel_gpu.cli import main

HUGE = int("9" * 4000)
GOOD_SPAN = {
    "traceId": "5b8efff798038103d269b633813fc60c",
    "spanId": "00000000000000a1",
    "name": "f",
    "startTimeUnixNano": "1000",
    "endTimeUnixNano": "2000",
}


def _line(**change: Any) -> str:
    span = dict(GOOD_SPAN)
    value = change.pop("intValue", None)
    span.update(change)
    if value is not None:
        span["attributes"] = [{"key": "otel_gpu.input.n.value", "value": {"intValue": value}}]
    return json.dumps({"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": [span]}]}]})


PAYLOADS = {
    "negative start": (_line(startTimeUnixNano=-5), "startTimeUnixNano -5", "outside 0 to 2**64-1"),
    "negative start as text": (
        _line(startTimeUnixNano="-5"),
        "startTimeUnixNano '-5'",
        "outside 0 to 2**64-1",
    ),
    "fractional end": (
        _line(endTimeUnixNano=2000.5),
        "endTimeUnixNano 2000.5",
        "not a whole number",
    ),
    "end past 2**64": (
        _line(endTimeUnixNano=2**64),
        "endTimeUnixNano 18446744073709551616",
        "outside",
    ),
    "4000-digit start": (_line(startTimeUnixNano=HUGE), "startTimeUnixNano 9999", "outside"),
    "4000-digit intValue": (_line(intValue=HUGE), "intValue 9999", "outside -2**63 to 2**63-1"),
    "4000-digit intValue as text": (_line(intValue=str(HUGE)), "intValue '9999", "outside"),
    "fractional intValue": (_line(intValue=1.5), "intValue 1.5", "not a whole number"),
    "boolean time": (_line(startTimeUnixNano=True), "startTimeUnixNano True", "not a whole number"),
}


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_show_refuses_per_line_what_ship_check_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """Attack: one crafted value on line 2 of a file whose other lines are valid. ``ship
    --check`` refuses line 2; ``show`` refuses it too (exit 2, ``FILE:2:``, the key and why),
    and with ``--skip-invalid`` draws the valid lines."""
    line, what, why = PAYLOADS[name]
    path = tmp_path / "crafted.jsonl"
    path.write_text(_line() + "\n" + line + "\n" + _line(spanId="00000000000000a2") + "\n")
    assert main(["ship", "--check", "-q", str(path)]) != 0
    ship_err = capsys.readouterr().err
    assert f"{path}:2:" in ship_err
    assert main(["show", "--no-color", str(path)]) == 2
    err = capsys.readouterr().err
    (problem,) = [ln for ln in err.splitlines() if f"{path}:" in ln]
    assert problem.startswith(f"otel-gpu show: {path}:2: "), problem
    assert what in problem
    assert why in problem and len(problem) < 400
    assert main(["show", "--no-color", "--skip-invalid", str(path)]) == 1
    assert capsys.readouterr().out.count("f ") >= 2


@pytest.mark.parametrize("value", ["1000", 1000, 1000.0, "18446744073709551615"])
def test_what_ship_accepts_show_accepts(tmp_path: Path, value: Any) -> None:
    """The other side of the agreement: times ship takes (a decimal string, a number, a number
    with a zero fraction, 2**64-1) are drawn by show."""
    path = tmp_path / "ok.jsonl"
    path.write_text(_line(startTimeUnixNano=value, endTimeUnixNano=value) + "\n")
    assert main(["ship", "--check", "-q", str(path)]) == 0
    assert main(["show", "--no-color", str(path)]) == 0
