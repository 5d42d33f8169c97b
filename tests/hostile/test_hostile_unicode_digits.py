"""``otel-gpu workloads`` and ``otel-gpu diff`` on numbers written with non-ASCII digit characters.

``str.isdigit()`` accepts superscripts and other characters that ``int()`` refuses ("²", "³", "①").
The promise: a time or an ``intValue`` spelled with them is a named problem of its line
(``FILE:LINE: ... is not ...``), as ``show`` and ``ranks`` name it, never an uncaught
``ValueError`` with a traceback; digits ``int()`` takes (Arabic-Indic "٣") still read as numbers.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from otel_gpu.traces.diff import diff
from otel_gpu.traces.workloads import workloads

_SPAN = {
    "traceId": "0" * 31 + "1",
    "spanId": "0" * 15 + "1",
    "name": "f",
    "startTimeUnixNano": "1",
    "endTimeUnixNano": "2",
}


def _write(path: Path, **fields: object) -> str:
    span = {**_SPAN, **fields}
    line = {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": [span]}]}]}
    path.write_text(json.dumps(line) + "\n")
    return str(path)


def _value(kind: str, raw: object) -> list[dict[str, object]]:
    return [{"key": "otel_gpu.input.x.value", "value": {kind: raw}}]


_HOSTILE = {
    "value": {"attributes": _value("intValue", "\u00b2")},
    "shape": {
        "attributes": [
            {
                "key": "otel_gpu.input.x.shape",
                "value": {"arrayValue": {"values": [{"intValue": "\u00b3"}]}},
            }
        ]
    },
    "start": {"startTimeUnixNano": "\u2460"},
    "end": {"endTimeUnixNano": "1\u00b2"},
}


@pytest.mark.parametrize("where", sorted(_HOSTILE))
def test_workloads_names_a_superscript_number_as_a_problem_of_its_line(tmp_path, where):
    """Attack: a superscript digit where ``workloads`` expects a whole number (a scalar's value,
    a shape element, a span's start or end time): exit 2 with the line named, no traceback."""
    trace = _write(tmp_path / "t.jsonl", **_HOSTILE[where])
    err = io.StringIO()
    code = workloads([trace], out=io.StringIO(), err=err)
    assert code == 2
    assert f"{trace}:1:" in err.getvalue()
    assert "Traceback" not in err.getvalue()


@pytest.mark.parametrize("where", sorted(_HOSTILE))
def test_diff_names_a_superscript_number_as_a_problem_of_its_line(tmp_path, where):
    """Attack: the same numbers in one of the two files ``diff`` reads: a usage error naming
    the line, no traceback."""
    good = _write(tmp_path / "good.jsonl", attributes=_value("intValue", "2"))
    bad = _write(tmp_path / "bad.jsonl", **_HOSTILE[where])
    err = io.StringIO()
    code = diff(good, bad, out=io.StringIO(), err=err)
    assert code == 2
    assert f"{bad}:1:" in err.getvalue()


def test_digits_int_takes_are_still_read_as_numbers(tmp_path):
    """Digits of other scripts that ``int()`` converts (Arabic-Indic three) read as before:
    the call is counted, not refused."""
    trace = _write(tmp_path / "t.jsonl", attributes=_value("intValue", "\u0663"))
    out = io.StringIO()
    code = workloads([trace], as_json=True, out=out, err=io.StringIO())
    assert code == 0
    assert json.loads(out.getvalue())


# --------------------------------------------------------------------------- pids and ranks
# The same characters where otel-gpu reads a process id or a rank: from RANK, and from the file
# names a shared directory may hold (live processes for snapshot/control, claimed journals).


def test_a_superscript_rank_is_no_rank(monkeypatch):
    """``RANK=²`` is not a non-negative integer: ``config.rank()`` is None, as for any other
    junk, never a ValueError from ``int()`` wherever the rank is read."""
    from otel_gpu import config

    monkeypatch.setenv("RANK", "²")
    assert config.rank() is None
    monkeypatch.setenv("RANK", "3")
    assert config.rank() == 3


def test_a_superscript_pid_in_a_journal_name_is_passed_over(tmp_path):
    """A file named like a crash journal whose pid is "²" is not a live process: snapshot and
    control (``live_processes``) pass over it instead of raising."""
    from otel_gpu.anomalies import snapshot

    (tmp_path / "otel-gpu-²-deadbeef.journal").write_bytes(b"")
    (tmp_path / "otel-gpu-١-deadbeef.journal").write_bytes(b"")  # a digit int() takes: pid 1
    assert snapshot.live_processes(str(tmp_path)) == []


def test_a_claimed_journal_with_a_superscript_pid_is_named_and_left_alone(tmp_path, capsys):
    """A journal claimed by recoverer "²" (``*.journal.recovering.²-abcd``): ``otel-gpu recover``
    says the name is unexpected, leaves the file and exits 0, never a traceback."""
    from otel_gpu.cli import main

    claimed = tmp_path / "otel-gpu-1-deadbeef.journal.recovering.²-abcd"
    claimed.write_bytes(b"\0" * 64)
    assert main(["recover", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "unexpected file name for a claimed journal" in err
    assert claimed.exists()


def test_ship_calls_a_superscript_time_not_a_whole_number():
    """The trace decoder ``otel-gpu ship`` uses says a time of "²" is "not a whole number", not
    that it has "more digits than any 64-bit integer"; "٣", a digit ``int()`` takes, is 3."""
    from otel_gpu.traces import decode

    with pytest.raises(ValueError, match=r"^not a whole number$"):
        decode.unix_nano("²")
    assert decode.unix_nano("٣") == 3
