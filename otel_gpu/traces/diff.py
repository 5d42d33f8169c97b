"""``otel-gpu diff A B``: where two runs of one program diverge, call by call.

A and B are two trace files (OTLP JSON Lines) or two flight-recorder dump folders. Their calls
are lined up (:mod:`otel_gpu.traces.align`) and each pair's tensors compared
(:mod:`otel_gpu.traces.diff_values`) with the best data both runs hold for it: dumped tensors
(level 10), else statistics (level 5), else metadata (level 3). The report names the first call
whose inputs matched and whose outputs did not (the kernel that diverged; pairs are taken in the
order their calls ended, so the innermost call that diverged comes before the callers that
carried its result), the first call whose inputs already differed, and the calls present in one
run only.

Exit codes: 0 same (every tensor compared is bit-identical: the same bytes, fingerprints or
statistics, and something was compared); 1 diverged; 2 bad input: unreadable or torn files, runs
of different services, ranks or otel-gpu versions, or nothing comparable (verdict ``not
compared``); 3 close (some tensors differ, all within the tolerance): 0 instead when the user
accepted a tolerance (``--tolerance``, ``--rtol``, ``--atol``), the verdict still ``close``.
See docs/diff.md.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import IO, Any

from otel_gpu._text import printable
from otel_gpu.traces import reader
from otel_gpu.traces.align import align, tree_order
from otel_gpu.traces.call_records import CallRecord, load_calls
from otel_gpu.traces.diff_values import FINGERPRINT, compare_metadata, compare_stats

__all__ = [
    "EXIT_CLOSE",
    "EXIT_DIVERGED",
    "EXIT_SAME",
    "EXIT_USAGE",
    "DiffError",
    "compare_runs",
    "diff",
    "json_safe",
]

EXIT_SAME, EXIT_DIVERGED, EXIT_USAGE, EXIT_CLOSE = 0, 1, 2, 3
_LISTED = 20  # calls of one run only listed by name


class DiffError(ValueError):
    """The runs cannot be compared; the message says why (exit code 2)."""


# --------------------------------------------------------------------------- loading


def load_run(path: str) -> list[CallRecord]:
    """The calls of one run: a trace file's spans, or a dump folder's recorded calls."""
    if os.path.isdir(path):
        from otel_gpu.traces.dump_calls import load_dump_calls

        return load_dump_calls(path)
    problems: list[reader.TraceFileError] = []
    calls = load_calls([path], problems.append)
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        if first.torn:
            raise DiffError(f"{first}{more}: the run's trace is incomplete, not compared")
        raise DiffError(f"{first}{more}")
    return calls


def _identity(calls: list[CallRecord], label: str, path: str) -> tuple[str, str, int | None]:
    if not calls:
        raise DiffError(f"{label} ({path}) holds no otel-gpu call")
    services = {c.service for c in calls}
    ranks = {c.rank for c in calls}
    versions = {c.version for c in calls if c.version}
    if len(services) > 1 or len(ranks) > 1:
        what = "services " + ", ".join(sorted(services)) if len(services) > 1 else "several ranks"
        raise DiffError(
            f"{label} ({path}) holds {what}: diff compares one process's run with another's"
        )
    return services.pop(), ",".join(sorted(versions)), ranks.pop()


# --------------------------------------------------------------------------- comparing


def _tensor_meta(call: CallRecord) -> dict[str, dict[str, Any]]:
    meta = {f"input.{k}": v for k, v in call.inputs.items()}
    meta.update({f"output.{k}": v for k, v in call.outputs.items()})
    return meta


def _compare_pair(
    a: CallRecord, b: CallRecord, rtol: float | None, atol: float | None, fingerprints: bool
) -> list[dict[str, Any]]:
    if a.dump_dir and b.dump_dir:
        from otel_gpu.traces.dump_calls import compare_dumps

        dumped = compare_dumps(a.dump_dir, b.dump_dir, rtol, atol)
        if dumped is not None:
            return dumped
    out = []
    meta_a, meta_b = _tensor_meta(a), _tensor_meta(b)
    for name in sorted(meta_a.keys() & meta_b.keys()):
        ma, mb = meta_a[name], meta_b[name]
        result = compare_metadata(name, ma, mb)
        if result["status"] == "not compared" and name in a.stats and name in b.stats:
            result = compare_stats(
                name, a.stats[name], b.stats[name], ma.get("dtype"), rtol, atol, fingerprints
            )
        out.append(result)
    return out


def _metadata_only_and_equal(a: CallRecord, b: CallRecord) -> bool:
    """Neither call has statistics or a dump to compare, and their metadata is equal: the
    common case of a level-3 pair, decided by two C-speed dict comparisons."""
    return (
        not a.stats
        and not b.stats
        and not (a.dump_dir and b.dump_dir)
        and a.inputs == b.inputs
        and a.outputs == b.outputs
    )


def _side(results: list[dict[str, Any]], side: str) -> str:
    mine = [r for r in results if r["tensor"].startswith(side)]
    for status in ("differ", "close", "same"):
        if any(r["status"] == status for r in mine):
            return status
    return "none" if not mine else "not compared"


def _fingerprinted(calls: list[CallRecord]) -> bool:
    """Whether the run's statistics carry fingerprints (``OTEL_GPU_FINGERPRINT`` was on)."""
    return any(FINGERPRINT in s for c in calls for s in c.stats.values())


def _short(name: str) -> str:
    """``GPT2MLP`` for ``...modeling_gpt2.GPT2MLP.forward``, ``attention`` for ``mylib.attention``."""
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1] == "forward" else parts[-1]


_PATH_DEPTH = 64  # levels of a path shown: a parent chain 100,000 deep is not printed whole


def _path(call: CallRecord) -> str:
    """The call's place in its tree, ``GPT2Model > GPT2Block[1] > GPT2MLP``: ``[k]`` counts the
    calls of the same function among its siblings. The innermost 64 levels, after ``…`` where
    the chain is deeper: the cost stays bounded whatever the depth."""
    parts: list[str] = []
    node: CallRecord | None = call
    while node is not None:
        if len(parts) == _PATH_DEPTH:
            parts.append("…")
            break
        siblings = node.parent.children if node.parent is not None else [node]
        same = [s for s in siblings if s.name == node.name]
        index = f"[{same.index(node)}]" if len(same) > 1 else ""
        parts.append(_short(node.name) + index)
        node = node.parent
    return " > ".join(reversed(parts))


def _describe(
    a: CallRecord, b: CallRecord | None, results: list[dict[str, Any]], status: str = "differ"
) -> dict[str, Any]:
    out: dict[str, Any] = {"function": a.name, "path": _path(a), "a_span_id": a.span_id}
    if b is not None:
        out["b_span_id"] = b.span_id
    out["tensors"] = [r for r in results if r["status"] == status][:8]
    return out


def compare_runs(
    a: list[CallRecord],
    b: list[CallRecord],
    rtol: float | None = None,
    atol: float | None = None,
    fingerprints: bool = True,
) -> dict[str, Any]:
    """The report of two runs' calls (see :func:`diff` for the verdict's rules)."""

    def roots(calls: list[CallRecord]) -> list[CallRecord]:
        return sorted((c for c in calls if c.parent is None), key=lambda c: (c.start, c.span_id))

    lined = align(
        tree_order(roots(a), lambda c: c.children),
        tree_order(roots(b), lambda c: c.children),
        lambda c: c.name,
    )
    counts = {"same": 0, "close": 0, "differ": 0, "not compared": 0}
    by_method: dict[str, int] = {}  # tensors compared (same, close or differ), by method
    by_values = 0  # tensors compared by their values (dumps, statistics, fingerprints)
    diverged: list[tuple[int, dict[str, Any]]] = []
    inputs_differ: list[tuple[int, dict[str, Any]]] = []
    close: list[tuple[int, dict[str, Any]]] = []
    close_inputs: list[tuple[int, dict[str, Any]]] = []  # where no call's inputs were exact
    for ca, cb in lined.pairs:
        if _metadata_only_and_equal(ca, cb):
            for fields in (*ca.inputs.values(), *ca.outputs.values()):  # as compare_metadata
                value = "value" in fields and "dtype" not in fields
                counts["same" if value else "not compared"] += 1
                by_method["metadata"] = by_method.get("metadata", 0) + value
            continue
        results = _compare_pair(ca, cb, rtol, atol, fingerprints)
        for r in results:
            counts[r["status"]] += 1
            if r["status"] != "not compared":
                by_method[r["method"]] = by_method.get(r["method"], 0) + 1
                by_values += r["method"] != "metadata"
        inputs, outputs = _side(results, "input."), _side(results, "output.")
        if inputs == "differ":
            inputs_differ.append((ca.start, _describe(ca, cb, results)))
        elif inputs in ("same", "none") and outputs == "differ":
            diverged.append((ca.end, _describe(ca, cb, results)))
        elif inputs in ("same", "none") and outputs == "close":
            close.append((ca.end, _describe(ca, cb, results, "close")))
        elif inputs == "close" and not close_inputs:
            close_inputs.append((ca.start, _describe(ca, cb, results, "close")))
    if counts["differ"] or lined.a_only or lined.b_only:
        verdict = "diverged"
    elif not by_values:  # equal metadata (shapes, scalar arguments) alone never makes "same"
        verdict = "not compared"
    elif counts["close"]:  # "same" only for the bit-identical
        verdict = "close"
    else:
        verdict = "same"
    marked = (_fingerprinted(a), _fingerprinted(b))
    warnings = []
    if marked[0] != marked[1] and (fingerprints or by_method.get("statistics")):
        warnings.append(
            f"run {'A' if marked[0] else 'B'} carries fingerprints (OTEL_GPU_FINGERPRINT) and run "
            f"{'B' if marked[0] else 'A'} does not: level-5 tensors were compared by their "
            "statistics, which miss a change that keeps min, max, mean and std"
        )
    return {
        "verdict": verdict,
        "tolerance": _tolerance_text(rtol, atol),
        "compared_by": dict(sorted(by_method.items())),
        "fingerprints": {"a": marked[0], "b": marked[1], "used": fingerprints and all(marked)},
        "warnings": warnings,
        "calls": {
            "paired": len(lined.pairs),
            "a_only": len(lined.a_only),
            "b_only": len(lined.b_only),
        },
        "aligned_fuzzily": lined.fuzzy,
        "tensors": counts,
        "first_diverged": min(diverged, key=lambda d: d[0])[1] if diverged else None,
        "first_inputs_differ": min(inputs_differ, key=lambda d: d[0])[1] if inputs_differ else None,
        "first_close": min(close or close_inputs, key=lambda d: d[0])[1]
        if close or close_inputs
        else None,
        "a_only": [
            {"function": c.name, "path": _path(c), "span_id": c.span_id}
            for c in lined.a_only[:_LISTED]
        ],
        "b_only": [
            {"function": c.name, "path": _path(c), "span_id": c.span_id}
            for c in lined.b_only[:_LISTED]
        ],
    }


def _tolerance_text(rtol: float | None, atol: float | None) -> str:
    if rtol is None and atol is None:
        return "rtol/atol per dtype"
    parts = [f"rtol {rtol:g}" if rtol is not None else "rtol per dtype"]
    parts.append(f"atol {atol:g}" if atol is not None else "atol per dtype")
    return ", ".join(parts)


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float written as a string (``"NaN"``, ``"Infinity"``,
    ``"-Infinity"``): ``--json`` output is JSON, which has no such numbers."""
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value in (math.inf, -math.inf):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# --------------------------------------------------------------------------- the command


def diff(
    a_path: str,
    b_path: str,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    as_json: bool = False,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    fingerprints: bool = True,
    accept_close: bool | None = None,
) -> int:
    """Compare runs ``a_path`` and ``b_path``, print the report; returns the exit code.

    ``fingerprints=False``: level-5 tensors by their statistics within tolerance, even where
    both runs carry fingerprints (runs whose bytes differ by rounding: eager and compiled).
    ``accept_close``: the verdict ``close`` exits 0 rather than 3; by default, when the user
    gave a tolerance (``rtol`` or ``atol``)."""
    if accept_close is None:
        accept_close = rtol is not None or atol is not None
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        if os.path.isdir(a_path) != os.path.isdir(b_path):
            raise DiffError("give two trace files or two dump folders, not one of each")
        a, b = load_run(a_path), load_run(b_path)
        ida, idb = _identity(a, "A", a_path), _identity(b, "B", b_path)
        if ida[0] != idb[0]:
            raise DiffError(f"A is service {ida[0]!r} and B {idb[0]!r}: runs of different programs")
        if ida[1] and idb[1] and ida[1] != idb[1]:
            raise DiffError(
                f"A was recorded by otel-gpu {ida[1]} and B by {idb[1]}: their statistics may "
                "not be computed alike"
            )
        report = compare_runs(a, b, rtol, atol, fingerprints)
    except DiffError as exc:
        print(printable(f"otel-gpu diff: {exc}"), file=err)
        return EXIT_USAGE
    report = {"a": a_path, "b": b_path, **report}
    if as_json:
        json.dump(json_safe(report), out, indent=2, default=str, allow_nan=False)
        out.write("\n")
    else:
        _print(report, out)
    for warning in report["warnings"]:
        print(printable(f"otel-gpu diff: warning: {warning}"), file=err)
    if report["verdict"] == "not compared":
        print(
            printable(
                "otel-gpu diff: not compared: the runs hold no statistics (level 5) or dumps "
                "(level 10) of the same calls, and their metadata agrees"
            ),
            file=err,
        )
        return EXIT_USAGE
    if report["verdict"] == "close":
        return EXIT_SAME if accept_close else EXIT_CLOSE
    return EXIT_DIVERGED if report["verdict"] == "diverged" else EXIT_SAME


def _number(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)


def _detail(r: dict[str, Any]) -> str:
    if r["method"] == "fingerprint":
        if r.get("statistics") == "same":
            return "bytes differ, statistics equal (--no-fingerprints compares by them)"
        if r.get("statistics") == "close":
            return "bytes differ, statistics agree within tolerance (--no-fingerprints compares by them)"
        return "bytes differ"
    if r["method"] == "statistics" and r.get("field") == "fingerprint":
        return "statistics equal, bytes differ (fingerprints)"
    if r["method"] == "tensors" and "max_abs_error" in r:
        return (
            f"max abs {r['max_abs_error']:.3g}, max rel {r['max_rel_error']:.3g}, "
            f"{r['mismatch_pct']:.3g}% mismatched, cosine {r['cosine_similarity']:.6f}"
        )
    if "error" in r:
        return f"{r['field']} off by {_number(r['error'])} (tolerance {_number(r['tolerance'])})"
    if "field" in r:
        return f"{r['field']} {r.get('a')} vs {r.get('b')}"
    return ""


def _print(report: dict[str, Any], out: IO[str]) -> None:
    def say(text: str) -> None:
        print(printable(text), file=out)

    calls, tensors = report["calls"], report["tensors"]
    head = f"{report['verdict']}:"
    if report["verdict"] == "close":
        head = f"close: {tensors['close']} tensors differ within tolerance ({report['tolerance']});"
    say(
        f"{head} {calls['paired']} calls paired, {calls['a_only']} only in A, "
        f"{calls['b_only']} only in B; tensors {tensors['same']} same, {tensors['close']} "
        f"close, {tensors['differ']} differ, {tensors['not compared']} not compared"
    )
    by = report["compared_by"]
    if by:
        say("compared by " + ", ".join(f"{method} {n}" for method, n in by.items()))
    for key, title, verb in (
        ("first_diverged", "first call that diverged (inputs matched, outputs did not)", "differs"),
        ("first_inputs_differ", "first call whose inputs already differed", "differs"),
        ("first_close", "first call whose tensors differ within tolerance", "close"),
    ):
        found = report[key]
        if found is None or (key == "first_close" and report["verdict"] != "close"):
            continue
        say(f"{title}: {found['function']}")
        say(f"  at {found['path']} (A span {found['a_span_id']}, B span {found.get('b_span_id')})")
        for r in found["tensors"]:
            say(f"  {r['tensor']}: {verb} by {r['method']}: {_detail(r)}")
    for side in ("a_only", "b_only"):
        listed = report[side]
        if listed:
            say(f"only in {side[0].upper()}: " + ", ".join(c["path"] for c in listed[:5]))
            if calls[side] > 5:
                say(f"  ... and {calls[side] - 5} more")
