"""``otel-gpu workloads --by-request``: the calls of trace files grouped by the request they served.

Each request (a link's target, or the span a one-request step's calls hang under; see
:mod:`otel_gpu.traces.request`) gets its steps, its calls, their time and the first error or
NaN/Inf among them. A call of a step of several requests counts for each of them. Time is the
top-level calls' (a call's children are inside it): device time where every one of them carries
it, host time otherwise, and each request says which.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import IO, Any

from otel_gpu._text import printable
from otel_gpu.traces import device, reader
from otel_gpu.traces.request import Request, by_request, first_problem
from otel_gpu.traces.trees import build_traces

__all__ = ["report_by_request", "summary"]

EXIT_OK, EXIT_NONE, EXIT_USAGE = 0, 1, 2


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def summary(request: Request) -> dict[str, Any]:
    """One request's row: ids, steps, calls, time (and which), the first problem."""
    mine = {id(c) for c in request.calls}
    tops = [c for c in request.calls if c.parent is None or id(c.parent) not in mine]
    readings = [device.seconds(c.attrs) for c in tops]
    on_device = bool(tops) and all(r is not None for r in readings)
    if on_device:
        total = sum(r or 0.0 for r in readings)
    else:
        total = sum(max(c.end - c.start, 0) for c in tops) / 1e9
    bad = first_problem(request.calls)
    return {
        "trace_id": request.trace_id,
        "span_id": request.span_id,
        "request_id": request.request_id or None,
        "steps": request.steps,
        "calls": len(request.calls),
        "total_s": total,
        "time": "device" if on_device else "host",
        "first_problem": None
        if bad is None
        else {
            "name": bad.name,
            "span_id": bad.span_id,
            "where": bad.where,
            "error": bad.message if bad.error else None,
            "nonfinite": not bad.error,
        },
    }


def report_by_request(
    paths: Sequence[str], *, top: int, as_json: bool, out: IO[str], say: Callable[[str], None]
) -> int:
    """Read ``paths``, group their calls by request, print (text or JSON); the exit code."""
    problems: list[reader.TraceFileError] = []
    spans = reader.read_all(paths, None, problems.append, attributes=True)
    if reader.refused(problems, say, "counted"):
        return EXIT_USAGE
    if problems:
        say("a torn last line was skipped: the counts may miss the calls it held")
    requests = by_request(build_traces(spans))
    if not requests:
        say(f"no call served a request (otel_gpu.batch) in {', '.join(paths)}")
        return EXIT_NONE
    rows = [summary(r) for r in requests]
    shown = rows[:top] if top else rows
    if as_json:
        json.dump({"requests": shown, "left_out": len(rows) - len(shown)}, out, indent=2)
        out.write("\n")
        return EXIT_OK
    print(printable(f"{len(rows)} requests, in the order their first call started"), file=out)
    for row in shown:
        rid = f" ({row['request_id']})" if row["request_id"] else ""
        line = (
            f"request {row['trace_id']}/{row['span_id']}{rid}  {_n(row['steps'], 'step span')}  "
            f"{_n(row['calls'], 'call')}  total {device.human(row['total_s'] * 1e9)} "
            f"({row['time']} time)"
        )
        print(printable(line), file=out)
        bad = row["first_problem"]
        if bad is not None:
            what = f"ERROR {bad['error']}" if bad["error"] is not None else "NaN/Inf"
            print(
                printable(f"  first problem: {bad['name']} span {bad['span_id']} {what}"), file=out
            )
    if len(shown) < len(rows):
        print(f"... and {len(rows) - len(shown)} more requests (--top 0 shows all)", file=out)
    return EXIT_OK
