"""The call whose kernel faulted, from what the device-time resolver saw before the fault.

A CUDA fault (an illegal address, a device-side assert, a launch failure) is reported at a
later synchronising call, and it is sticky: every query fails after it, completed events
included. What tells the calls apart is only what the resolver
(:mod:`otel_gpu.devices.device_time`) noted before: which calls' start events it found
complete, and which calls' end events.

:func:`find`: the calls on the faulting device whose end was never seen complete are pending.
Among them, those whose start was seen complete were running on the device at the last look.
On one stream they are nested in each other, so the innermost one (started last) holds the
faulting kernel: it is the *suspect*. When no pending call was seen started (the fault came
between two looks), or open calls sit on several streams, the pending calls are the
*candidates*, earliest first: the verdict names the range, and says it could not single one
out. Caveat: a suspect that finished right after the last look, and a later call that faulted
before the next, read the same; the resolver looks at least every 100 ms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Status, StatusCode

from otel_gpu import _guard
from otel_gpu.attributes import CUDA_FAULT, CUDA_FAULT_CANDIDATES, CUDA_FAULT_SUSPECT

if TYPE_CHECKING:
    from otel_gpu.core.record import Call
    from otel_gpu.devices.device_time import Pair

__all__ = ["CANDIDATE", "KERNEL", "SURFACED", "Verdict", "find", "mark_raising", "surfaced_status"]

KERNEL = "kernel"  # otel_gpu.cuda.fault on the suspect call
SURFACED = "surfaced"  # on a call that raised the error another call caused
CANDIDATE = "candidate"  # on each call of a range that could not be told apart
MAX_CANDIDATES = 64  # span ids named on a span (the earliest ones)


class Verdict:
    """Which call faulted on one device: one suspect, or a range of candidates."""

    __slots__ = ("candidates", "device", "error", "ids", "names", "suspect")

    def __init__(self, device: int, error: str, suspect: Pair | None, candidates: list[Pair]):
        self.device = device
        self.error = error
        self.suspect = suspect
        self.candidates = candidates
        self.ids = [_span_id(p) for p in ([suspect] if suspect is not None else candidates)]
        self.names = [_name(p) for p in ([suspect] if suspect is not None else candidates)]

    @property
    def single(self) -> bool:
        return self.suspect is not None

    def as_dict(self) -> dict[str, Any]:
        """What the crash journal keeps (``otel-gpu recover`` and ``show --fault`` read it)."""
        return {
            "device": self.device,
            "error": self.error,
            "suspect": self.ids[0] if self.single else None,
            "candidates": [] if self.single else self.ids,
            "names": self.names,
        }


def _span_id(pair: Pair) -> str:
    call = pair.call
    return format(call.span.span_id if call is not None else pair.span_id, "016x")


def _name(pair: Pair) -> str:
    call = pair.call
    return str(call.plan.name if call is not None else pair.name)


def find(pairs: list[Pair], device: int, error: str) -> Verdict:
    """The verdict for ``device`` from the pending pairs' noted flags (``pairs`` in record
    order)."""
    pending = [p for p in pairs if p.device == device and not p.end_seen]
    running = [p for p in pending if p.start_seen]
    if running and len({p.stream_id for p in running}) == 1:
        return Verdict(device, error, running[-1], [])  # the innermost open call
    return Verdict(device, error, None, (running or pending)[:MAX_CANDIDATES])


def mark_suspects(verdict: Verdict) -> None:
    """The suspect's span: ERROR, ``otel_gpu.cuda.fault = "kernel"``; each candidate's span:
    ``"candidate"`` and the whole range. Spans already exported are named by id only."""
    suspect = verdict.suspect
    if suspect is not None:
        call = suspect.call
        if call is not None:
            call.span.set_attribute(CUDA_FAULT, KERNEL)
            call.span.set_status(
                Status(StatusCode.ERROR, f"CUDA fault in this call's kernels: {verdict.error}")
            )
        return
    for pair in verdict.candidates:
        call = pair.call
        if call is not None:
            call.span.set_attribute(CUDA_FAULT, CANDIDATE)
            call.span.set_attribute(CUDA_FAULT_CANDIDATES, list(verdict.ids))


def mark_raising(call: Call, verdict: Verdict) -> None:
    """The call that raised the error: the suspect's id, or the range of candidates."""
    if not verdict.ids:
        return  # no call was measured on that device: nothing to say
    if verdict.suspect is not None and verdict.suspect.call is call:
        return  # it faulted itself: marked as the suspect
    span = call.span
    span.set_attribute(CUDA_FAULT, SURFACED)
    if verdict.suspect is not None:
        span.set_attribute(CUDA_FAULT_SUSPECT, verdict.ids[0])
    else:
        span.set_attribute(CUDA_FAULT_CANDIDATES, list(verdict.ids))


def surfaced_status(attributes: dict[str, Any], text: str) -> str:
    """The status description of a call the error surfaced in (the span builder calls this)."""
    suspect = attributes.get(CUDA_FAULT_SUSPECT)
    if suspect:
        return f"CUDA error surfaced here, caused earlier by span {suspect}: {text}"
    n = len(attributes.get(CUDA_FAULT_CANDIDATES) or ())
    return (
        f"CUDA error surfaced here, caused earlier by one of {n} calls that could not be told "
        f"apart ({CUDA_FAULT_CANDIDATES}): {text}"
    )


def journal(pipeline: Any, verdict: Verdict) -> None:
    """Keep the verdict in the crash journal, so ``otel-gpu recover`` names the suspect even if
    the process dies of the error."""
    for observer in pipeline.observers:
        note = getattr(observer, "note_fault", None)  # the journal's (journal/writer.py)
        if note is not None:
            try:
                note(verdict.as_dict())
            except Exception as exc:
                _guard.internal_error("journal", exc)
