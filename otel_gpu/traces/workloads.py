"""``otel-gpu workloads TRACE...``: the input signatures production calls, and the time in each.

Calls recorded at level 3 or more (those with input or output attributes) are grouped by
function and input signature: per tensor its dtype and shape, and its strides when it is not
contiguous; per other argument its value (or, for containers and objects, their type and
length), all of them unless a rule names the arguments that count for a function
(``--scalars 'GLOB=eps,causal'``). Each group gets its call count, share of the calls, total,
p50 and p99 time, the ranks and services it was seen in and a level-10 dump directory.

Time is the device time (``otel_gpu.device.duration``) when every call of the group carries
one, the span's host duration otherwise; each group says which (``time``). See
docs/workloads.md; :mod:`otel_gpu.traces.workload_files` writes ``--emit``.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any

from otel_gpu._text import printable
from otel_gpu.traces import reader
from otel_gpu.traces.call_records import CallRecord, load_calls
from otel_gpu.traces.output import clip, clipped, dump
from otel_gpu.workloads import signature as _signature
from otel_gpu.workloads.signature import Rules

__all__ = [
    "EXIT_NONE",
    "EXIT_OK",
    "EXIT_USAGE",
    "Workload",
    "group",
    "signature",
    "workloads",
]

EXIT_OK, EXIT_NONE, EXIT_USAGE = 0, 1, 2


def signature(call: CallRecord, rules: Rules | None = None) -> dict[str, dict[str, Any]]:
    """The input signature of ``call``: per argument path, the fields that identify it
    (:func:`otel_gpu.workloads.signature.signature`, which ``OTEL_GPU_WORKLOADS_DIR`` uses too)."""
    return _signature.signature(call.name, call.inputs, rules)


@dataclass
class Workload:
    """One function's calls with one input signature."""

    function: str
    signature: dict[str, dict[str, Any]]
    id: str
    calls: list[CallRecord] = field(default_factory=list)

    @property
    def device(self) -> bool:
        return all(c.device_s is not None for c in self.calls)

    def times(self) -> list[float]:
        device = self.device
        return sorted((c.device_s if device else c.host_s) or 0.0 for c in self.calls)

    @property
    def total_s(self) -> float:
        return sum(self.times())

    def dump_dirs(self) -> list[str]:
        return sorted({c.dump_dir for c in self.calls if c.dump_dir})

    def as_json(self, everything: int) -> dict[str, Any]:
        times = self.times()
        dumps = self.dump_dirs()
        return {
            "function": self.function,
            "signature": self.id,
            "inputs": self.signature,
            "calls": len(self.calls),
            "share": round(len(self.calls) / everything, 6) if everything else 0.0,
            "time": "device" if self.device else "host",
            "total_s": round(sum(times), 9),
            "p50_s": round(_percentile(times, 0.50), 9),
            "p99_s": round(_percentile(times, 0.99), 9),
            "ranks": sorted({c.rank for c in self.calls if c.rank is not None}),
            "services": sorted({c.service for c in self.calls if c.service}),
            "dump_dir": dumps[0] if dumps else None,
        }


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least ``q`` of the values at or below it."""
    if not ordered:
        return 0.0
    rank = max(1, -int(-q * len(ordered) // 1))  # ceil without floats drifting
    return ordered[min(rank, len(ordered)) - 1]


def group(
    calls: Sequence[CallRecord], rules: Rules | None = None, functions: Sequence[str] = ()
) -> list[Workload]:
    """The workloads of ``calls`` recorded at level >= 3 (of the functions matching any glob
    in ``functions``, if given), by total time, largest first."""
    found: dict[str, Workload] = {}
    # calls of one function with the same recorded inputs (their repr, in the file's order)
    # share a signature: it is computed once per distinct set of inputs
    seen: dict[tuple[str, str], Workload] = {}
    for call in calls:
        if not call.recorded:
            continue
        if functions and not any(fnmatch.fnmatchcase(call.name, g) for g in functions):
            continue
        raw = (call.name, repr(call.inputs))
        workload = seen.get(raw)
        if workload is None:
            sig = signature(call, rules)
            # paths and fields are in sorted order, so the repr is canonical; the id, a hash of
            # the canonical JSON, is computed once per workload
            text = repr((call.name, sig))
            workload = found.get(text)
            if workload is None:
                workload = found[text] = Workload(
                    call.name, sig, _signature.signature_id(call.name, sig)
                )
            seen[raw] = workload
        workload.calls.append(call)
    return sorted(found.values(), key=lambda w: (-w.total_s, w.function, w.id))


def parse_rules(raw: Sequence[str]) -> dict[str, frozenset[str]]:
    """``GLOB=NAME,NAME`` (an empty list: no scalar counts) -> rules; ValueError naming a bad one."""
    rules = {}
    for item in raw:
        glob, eq, names = item.partition("=")
        if not eq or not glob:
            raise ValueError(f"{item!r} is not GLOB=NAME[,NAME...] (GLOB= for none)")
        rules[glob] = frozenset(n.strip() for n in names.split(",") if n.strip())
    return rules


def workloads(
    paths: Sequence[str],
    *,
    top: int = 0,
    functions: Sequence[str] = (),
    rules: Rules | None = None,
    as_json: bool = False,
    emit: str | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    by_request: bool = False,
) -> int:
    """Read, group, print (and with ``emit``, write the files); returns the exit code.
    ``by_request``: the calls grouped by the request they served instead (docs/serving.md)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if by_request:
        from otel_gpu.traces.request_report import report_by_request

        return report_by_request(paths, top=top, as_json=as_json, out=out, say=partial(_say, err))
    problems: list[reader.TraceFileError] = []
    calls = load_calls(paths, problems.append, linked=False)  # no tree walked here
    if reader.refused(problems, partial(_say, err), "counted"):
        return EXIT_USAGE
    if problems:
        _say(err, "a torn last line was skipped: the counts may miss the calls it held")
    found = group(calls, rules, functions)
    if not found:
        what = " matching " + " or ".join(functions) if functions else ""
        _say(err, f"no call recorded at level 3 or more{what} in {', '.join(paths)}")
        return EXIT_NONE
    everything = sum(len(w.calls) for w in found)
    shown = found[:top] if top else found
    if emit is not None:
        from otel_gpu.traces.workload_files import EmitError, emit_files

        try:
            written = emit_files(emit, shown)
        except EmitError as exc:
            _say(err, str(exc))
            return EXIT_USAGE
        _say(err, f"wrote {written} files to {emit}")
    if as_json:
        report = {
            "calls": everything,
            "workloads": [w.as_json(everything) for w in shown],
            "left_out": len(found) - len(shown),
        }
        dump(report, out)  # values whole; NaN and infinities as strings
    else:
        _print(shown, everything, len(found), out)
    return EXIT_OK


def _say(err: IO[str], message: str) -> None:
    print(printable(f"otel-gpu workloads: {message}"), file=err)


def _describe(sig: dict[str, dict[str, Any]]) -> str:
    """The signature on one line, each value read from the file clipped (:func:`clip`)."""
    parts = []
    for path, fields in sig.items():
        if "dtype" in fields:
            dtype = clip(str(fields["dtype"]).removeprefix("torch."))
            shape = clip("x".join(str(n) for n in fields["shape"] or []))
            stride = f" stride {clip(fields['stride'])}" if "stride" in fields else ""
            parts.append(f"{clip(path)}={dtype}[{shape}]{stride}")
        elif "value" in fields:
            parts.append(f"{clip(path)}={clip(fields['value'])}")
        else:
            parts.append(f"{clip(path)}={clip(fields.get('type', '?'))}")
    return " ".join(parts) or "(no inputs)"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3f} ms"
    return f"{value * 1e6:.1f} us"


def _print(shown: list[Workload], everything: int, total: int, out: IO[str]) -> None:
    def say(text: str) -> None:
        print(printable(text), file=out)

    say(f"{everything} calls in {total} workloads (function and input signature), by total time")
    for w in shown:
        row = clipped(w.as_json(everything))  # a value read from a file: one short line
        say(
            f"{row['function']}  {row['calls']} calls ({row['share']:.1%})  "
            f"total {_seconds(row['total_s'])}  p50 {_seconds(row['p50_s'])}  "
            f"p99 {_seconds(row['p99_s'])}  ({row['time']} time)  [{w.id}]"
        )
        say(f"  {_describe(w.signature)}")
        seen = []
        if row["ranks"]:
            seen.append("ranks " + ",".join(str(r) for r in row["ranks"]))
        if row["services"]:
            seen.append("services " + ",".join(row["services"]))
        if row["dump_dir"]:
            seen.append(f"dump {row['dump_dir']}")
        if seen:
            say("  " + "; ".join(seen))
    if len(shown) < total:
        say(f"... and {total - len(shown)} more workloads (--top 0 shows all)")
