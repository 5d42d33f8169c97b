"""``otel-gpu show --fault``: the call whose kernel faulted, from a trace file.

A CUDA fault surfaces at a later synchronising call (``otel_gpu.cuda.fault = "surfaced"``);
the device-time resolver names the call that caused it (``otel_gpu.cuda.fault.suspect``, the
suspect's own span has ``otel_gpu.cuda.fault = "kernel"``) or, when it could not single one
out, the range of candidates (``otel_gpu.cuda.fault.candidates``). This prints, for each fault
in the files, where it surfaced and the suspect (or each candidate), with the inputs' metadata
(level >= 3) and the flight recorder's dump directory (level 10).

Exit codes as ``show``'s: 0 a fault was found; 1 none (or lines skipped); 2 usage errors.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import IO

from otel_gpu._text import printable
from otel_gpu.attributes import (
    CUDA_FAULT,
    CUDA_FAULT_CANDIDATES,
    CUDA_FAULT_SUSPECT,
    DUMP_DIR,
    INPUT_PREFIX,
)
from otel_gpu.traces.reader import Span, TraceFileError, read_all

__all__ = ["show_fault"]

EXIT_FOUND, EXIT_NONE, EXIT_USAGE = 0, 1, 2
_MAX_INPUT_LINES = 24


def show_fault(paths: Sequence[str], out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Print each CUDA fault of ``paths`` and the call it names; returns the exit code."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    problems: list[TraceFileError] = []
    spans = read_all(paths, None, problems.append, attributes=True)
    for problem in problems:
        print(printable(f"otel-gpu show: {problem}"), file=err)
    if any(not p.torn for p in problems):
        return EXIT_USAGE
    by_id = {s.span_id: s for s in spans}
    surfaced = [s for s in spans if s.attrs.get(CUDA_FAULT) == "surfaced"]
    kernels = [s for s in spans if s.attrs.get(CUDA_FAULT) == "kernel"]
    named = {s.attrs.get(CUDA_FAULT_SUSPECT) for s in surfaced}
    if not surfaced and not kernels:
        print(
            f"No CUDA fault in {', '.join(paths)}: no span has {CUDA_FAULT} (device time must "
            "be on, OTEL_GPU_DEVICE_TIME, for a fault to be traced to its call).",
            file=out,
        )
        return EXIT_NONE
    for span in sorted(surfaced, key=lambda s: s.start):
        print(printable(f"CUDA fault surfaced in {span.name} (span {span.span_id})"), file=out)
        if span.message:
            print(printable(f"  {span.message}"), file=out)
        suspect = span.attrs.get(CUDA_FAULT_SUSPECT)
        if suspect:
            print(f"  caused by span {suspect}:", file=out)
            _call(out, by_id.get(str(suspect)), str(suspect))
            continue
        candidates = [str(c) for c in span.attrs.get(CUDA_FAULT_CANDIDATES) or ()]
        print(
            f"  caused by one of {len(candidates)} calls that could not be told apart "
            "(earliest first):",
            file=out,
        )
        for cid in candidates:
            _call(out, by_id.get(cid), cid)
    for span in sorted(kernels, key=lambda s: s.start):
        if span.span_id not in named:  # no call raised it in these files (the process died)
            print(printable(f"CUDA fault in the kernels of {span.name}:"), file=out)
            _call(out, span, span.span_id)
    return EXIT_NONE if problems else EXIT_FOUND


def _call(out: IO[str], span: Span | None, span_id: str) -> None:
    if span is None:
        print(f"    span {span_id}: not in these files", file=out)
        return
    print(printable(f"    {span.name} (span {span_id}, trace {span.trace_id})"), file=out)
    if span.message:
        print(printable(f"      status: {span.message}"), file=out)
    inputs = sorted((k, v) for k, v in span.attrs.items() if k.startswith(INPUT_PREFIX))
    for key, value in inputs[:_MAX_INPUT_LINES]:
        print(printable(f"      {key[len(INPUT_PREFIX) :]} = {value}"), file=out)
    if len(inputs) > _MAX_INPUT_LINES:
        print(f"      ... {len(inputs) - _MAX_INPUT_LINES} more input attributes", file=out)
    if not inputs:
        print("      (no input metadata: recorded at level >= 3)", file=out)
    if DUMP_DIR in span.attrs:
        print(printable(f"      dump dir: {span.attrs[DUMP_DIR]}"), file=out)
