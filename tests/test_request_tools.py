"""From a request to its calls, offline: ``otel-gpu show --request`` and ``workloads --by-request``.

The spans come from real ``otel_gpu.batch`` steps written to a JSON Lines file: a step of two
requests, a step of one request (its calls are the request's children), and a call that fails;
a hand-written file adds device time and NaN/Inf.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

import otel_gpu
from otel_gpu import cli
from otel_gpu.traces import reader, request, show
from otel_gpu.traces.trees import build_traces
from otel_gpu.traces.workloads import workloads

A = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
B = ("1af7651916cd43dd8448eb211c80319c", "b7ad6b7169203332")
C = ("2af7651916cd43dd8448eb211c80319c", "b7ad6b7169203333")


def _tp(ids: tuple[str, str]) -> str:
    return f"00-{ids[0]}-{ids[1]}-01"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """Three steps: {A, B} runs f(1) and f(2); {B} alone runs f(3) and a failing f(9); {C} and
    {A} (another step of both) runs f(4). f calls g, so each f is two spans."""
    path = tmp_path / "run.jsonl"
    otel_gpu.configure(level=1, dest=str(path), provider="own")
    try:

        def g(x):
            return x

        def f(x):
            if x == 9:
                raise ValueError("nine")
            return traced_g(x) + 1

        traced_g = otel_gpu.api(g)
        traced_f = otel_gpu.api(f)
        with otel_gpu.batch(requests={"a": _tp(A), "b": _tp(B)}):
            traced_f(1)
            traced_f(2)
        with otel_gpu.batch(requests={"b": _tp(B)}):
            traced_f(3)
            with pytest.raises(ValueError):
                traced_f(9)
        with otel_gpu.batch(requests={"c": _tp(C), "a": _tp(A)}):
            traced_f(4)
        otel_gpu.flush()
    finally:
        from otel_gpu import config
        from otel_gpu.export import pipeline

        pipeline.reset(timeout=2.0)
        config.reset_overrides()
    return path


def _served(path: Path, rid: str) -> list[reader.Span]:
    traces = build_traces(reader.read_all([str(path)]))
    return request.served(traces, rid)


def _names(spans: list[reader.Span]) -> list[str]:
    return sorted(s.name.rsplit(".", 1)[-1] for s in spans)


def test_a_request_is_served_by_the_steps_linking_to_it_and_its_own_calls(run: Path) -> None:
    """By trace id or by span id, a request's calls are the subtrees of the steps that link to
    it and the calls of its one-request steps, and nothing of other steps."""
    for rid in (B[0], B[1]):
        spans = _served(run, rid)
        assert _names(spans) == ["batch"] + ["f"] * 4 + ["g"] * 3
    a = _served(run, A[0])
    assert _names(a) == ["batch"] * 2 + ["f"] * 3 + ["g"] * 3
    c = _served(run, C[1])
    assert _names(c) == ["batch", "f", "g"]
    assert _served(run, "3af7651916cd43dd8448eb211c80319c") == []


def test_show_request_lists_the_calls_and_the_first_error(run: Path, capsys) -> None:
    """``show --request`` draws the steps and calls, names the request id the links carry,
    and ends with the first error among them; exit 0."""
    assert cli.main(["show", "--request", B[0].upper(), str(run)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"request {B[0]}  request id b  1 step span, 7 calls"
    drawn = [line.split("─ ", 1)[1].split()[0] for line in out.splitlines() if "─ " in line]
    assert sorted(name.rsplit(".", 1)[-1] for name in drawn) == ["batch"] + ["f"] * 4 + ["g"] * 3
    last = out.strip().splitlines()[-1]
    assert last.startswith("first problem: ") and "ERROR ValueError: nine" in last


def test_show_request_for_a_request_without_calls_and_bad_ids(run: Path, capsys) -> None:
    """No step served it: exit 1 with a message; a malformed id or a flag that filters traces
    is a usage error (exit 2) naming what is allowed."""
    assert cli.main(["show", "--request", "ab" * 8, str(run)]) == 1
    assert "no step or call served request" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["show", "--request", "xyz", str(run)])
    assert exc.value.code == 2
    assert "trace id (32 hex digits) or span id (16)" in capsys.readouterr().err
    assert cli.main(["show", "--request", A[1], "--trace-id", A[0], str(run)]) == 2
    assert "--request follows links across traces" in capsys.readouterr().err


def test_workloads_by_request_counts_each_requests_steps_and_calls(run: Path) -> None:
    """``workloads --by-request --json``: per request its steps, calls (a call of a step of
    several requests counted for each) and first problem."""
    out = io.StringIO()
    assert workloads([str(run)], by_request=True, as_json=True, out=out) == 0
    rows = {r["request_id"]: r for r in json.loads(out.getvalue())["requests"]}
    assert set(rows) == {"a", "b", "c"}
    assert (rows["a"]["steps"], rows["a"]["calls"]) == (2, 6)
    assert (rows["b"]["steps"], rows["b"]["calls"]) == (1, 7)
    assert (rows["c"]["steps"], rows["c"]["calls"]) == (1, 2)
    assert rows["b"]["first_problem"]["error"] == "ValueError: nine"
    assert rows["a"]["first_problem"] is None
    assert rows["b"]["span_id"] == B[1] and rows["b"]["time"] == "host"


def test_workloads_by_request_refuses_signature_flags(run: Path, capsys) -> None:
    """--by-request with --function is a usage error naming the flags it does not take."""
    assert cli.main(["workloads", "--by-request", "--function", "f*", str(run)]) == 2
    assert "takes no --function" in capsys.readouterr().err


def _span(name: str, span_id: str, parent: str | None, start: int, **extra: Any) -> dict:
    span: dict[str, Any] = {
        "traceId": "ee" * 16,
        "spanId": span_id,
        "name": name,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(start + 1000),
        "attributes": [
            {"key": k, "value": {"doubleValue": v} if isinstance(v, float) else {"boolValue": v}}
            for k, v in extra.get("attrs", {}).items()
        ],
        "links": [{"traceId": A[0], "spanId": A[1]}] if extra.get("linked") else [],
    }
    if parent:
        span["parentSpanId"] = parent
    return span


def test_the_first_problem_is_the_earliest_nonfinite_and_device_time_is_shown(
    tmp_path: Path,
) -> None:
    """A collector's file: the step's calls show their device time, and the first problem is
    the earliest call with NaN/Inf (otel_gpu.nonfinite), not a later one."""
    spans = [
        _span("otel_gpu.batch", "1" * 16, None, 100, linked=True),
        _span("mm", "2" * 16, "1" * 16, 200, linked=True, attrs={"otel_gpu.device.duration": 0.25}),
        _span("late", "3" * 16, "1" * 16, 400, linked=True, attrs={"otel_gpu.nonfinite": True}),
        _span("early", "4" * 16, "1" * 16, 300, linked=True, attrs={"otel_gpu.nonfinite": True}),
    ]
    path = tmp_path / "collector.jsonl"
    path.write_text(
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}) + "\n",
        encoding="utf-8",
    )
    out = io.StringIO()
    assert show.show([str(path)], request=A[0], out=out, err=io.StringIO()) == 0
    text = out.getvalue()
    assert "mm  device 250 ms" in text
    assert text.strip().splitlines()[-1].startswith("first problem: early")


def test_malformed_links_are_left_out_not_the_line(tmp_path: Path) -> None:
    """A collector's span whose links are not objects, have bad ids or a links field that is not
    a list keeps its line: the tree is drawn, and only the well-formed link counts."""
    good = _span("otel_gpu.batch", "1" * 16, None, 100, linked=True)
    good["links"] += ["not a link", {"traceId": "zz", "spanId": "1" * 16}, {"spanId": "2" * 16}]
    odd = _span("other", "5" * 16, None, 200)
    odd["links"] = {"traceId": A[0]}
    path = tmp_path / "collector.jsonl"
    path.write_text(
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [good, odd]}]}]}) + "\n",
        encoding="utf-8",
    )
    spans = reader.read_all([str(path)])
    assert [s.links for s in spans] == [((A[0], A[1], ""),), ()]
    out = io.StringIO()
    assert show.show([str(path)], out=out, err=io.StringIO()) == 0
    assert show.show([str(path)], request=A[0], out=io.StringIO(), err=io.StringIO()) == 0
