"""Stuck calls: ``OTEL_GPU_STUCK_AFTER`` reports a call in flight for too long, at once.

A watchdog that kills a hung process (the NCCL watchdog, a Kubernetes liveness probe) leaves
no span for the call that hung: it never ended. This observer keeps the calls in flight and,
from the export thread (which wakes every 100 ms), reports each call once when it has run
longer than ``OTEL_GPU_STUCK_AFTER`` seconds:

* a span ``otel_gpu.stuck <name>``, child of the stuck call's span, exported immediately (not
  at exit), with ``otel_gpu.stuck = true``, how long the call has run, the call's input
  metadata (as the crash journal has it) and one ``otel_gpu.thread_stack`` event per Python
  thread (``sys._current_frames()``), the stuck thread marked;
* one warning in the ``otel_gpu`` logger;
* the in-memory ring and the call written as flight-recorder dumps, when ``OTEL_GPU_RING`` is on.

What it cannot see: the check runs on the export thread, so it runs while the caller waits in
``time.sleep``, I/O, a lock, or a C/CUDA call that releases the GIL (torch ops and
``torch.cuda.synchronize`` do). A C call that holds the GIL stops every Python thread, the
watchdog too: the report then comes when the GIL is released, or never if the process is
killed first. The crash journal (``otel-gpu recover``) still has the call in that case.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

from opentelemetry.trace import SpanContext, TraceFlags

from otel_gpu import _guard
from otel_gpu.attributes import (
    CODE_STACKTRACE,
    EVENT_THREAD_STACK,
    RING_DUMP_DIR,
    STUCK,
    STUCK_AFTER,
    STUCK_CALL,
    STUCK_SECONDS,
    STUCK_SPAN_ID,
    STUCK_SPAN_NAME,
    STUCK_THREAD,
    THREAD_ID,
    THREAD_NAME,
)
from otel_gpu.config import Settings
from otel_gpu.core.plan import Plan
from otel_gpu.core.record import Call, CallSpan

if TYPE_CHECKING:
    from otel_gpu.core.protocols import Host, RingDump


__all__ = ["Watchdog", "add_thread_stacks"]

_STACK_LIMIT = 2048  # bytes of a thread's stack: the innermost frames are kept


def _stuck_plan(call: Call) -> Plan:
    """The plan of a stuck-call report: the call's name behind a prefix, its level and attributes."""
    return Plan(STUCK_SPAN_NAME + call.plan.name, call.plan.level, dict(call.plan.attributes))


class Watchdog:
    """Observer: ``start``/``end`` keep the calls in flight; :meth:`check` runs on the export thread.

    Built by the observer registry (``OTEL_GPU_STUCK_AFTER`` > 0), which also hands it the ring.
    """

    min_level: int  # set by the observer registry (otel_gpu.export.observers)

    def __init__(self, settings: Settings, pipeline: Host) -> None:
        self.after = float(settings.stuck_after or 0)
        self.limit = settings.repr_limit
        self.pipeline = pipeline
        self.ring: RingDump | None = None
        """The in-memory ring, dumped with a stuck call: handed over by the registry."""
        self.active: dict[int, tuple[Call, float, int]] = {}
        self.reported: set[int] = set()
        self.reports = 0
        pipeline.add_after_drain(self.check)

    # ------------------------------------------------------------------ caller's thread

    def start(self, call: Call) -> None:
        # dict stores are atomic under the GIL: no lock on the caller's path
        self.active[id(call)] = (call, time.monotonic(), threading.get_ident())

    def end(self, call: Call) -> None:
        self.active.pop(id(call), None)
        if self.reported:
            self.reported.discard(id(call))

    def flush(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ export thread

    def check(self) -> None:
        """Report every call in flight longer than ``after`` seconds, once each."""
        now = time.monotonic()
        for key, (call, started, thread_id) in list(self.active.items()):
            if now - started >= self.after and key not in self.reported:
                self.reported.add(key)
                self.report(call, thread_id, now - started)

    def report(self, call: Call, thread_id: int, seconds: float) -> None:
        """Export the stuck-call span now, log one warning, and dump the ring if it is on."""
        self.reports += 1
        span = self._span(call, thread_id, seconds)
        ctx = call.span.get_span_context()
        _guard.logger.warning(
            "otel-gpu: %s (span %016x, trace %032x) has been running for %.1f s of host time "
            "(OTEL_GPU_STUCK_AFTER=%g); its thread's stack and every other thread's are in "
            "the span %r",
            call.plan.name,
            ctx.span_id,
            ctx.trace_id,
            seconds,
            self.after,
            span.span.name,
        )
        ring = self.ring
        if ring is not None:  # first, so the report can name the dump
            directory = ring.dump_for(call, "stuck")
            if directory is not None:
                span.span.set_attribute(RING_DUMP_DIR, directory)
        self.pipeline.export_now(span)

    def _span(self, call: Call, thread_id: int, seconds: float) -> Call:
        """A call record for the report, so the pipeline builds and exports it like any span."""
        parent = call.span.get_span_context()
        ctx = SpanContext(
            parent.trace_id,
            _random_id(),
            False,
            TraceFlags(TraceFlags.SAMPLED),
            parent.trace_state,
        )
        plan = _stuck_plan(call)
        now = time.time_ns()
        record = Call(plan, CallSpan(ctx, plan.name), parent, call.start_ns)
        record.end_ns = now
        record.inputs = call.inputs  # the metadata taken when the call started
        record.span.set_attributes(
            {
                STUCK: True,
                STUCK_SECONDS: round(seconds, 3),
                STUCK_AFTER: self.after,
                STUCK_CALL: call.plan.name,
                STUCK_SPAN_ID: format(parent.span_id, "016x"),
                THREAD_ID: thread_id,
            }
        )
        add_thread_stacks(record.span, thread_id, now)
        return record


def add_thread_stacks(span: CallSpan, marked: int | None, now: int) -> int:
    """One ``otel_gpu.thread_stack`` event per Python thread on ``span``, the thread ``marked``
    flagged (``otel_gpu.stuck.thread``); returns how many. Also used by snapshots."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    for ident, frame in frames.items():
        stack = "".join(traceback.format_stack(frame))
        span.add_event(
            EVENT_THREAD_STACK,
            {
                THREAD_ID: ident,
                THREAD_NAME: names.get(ident, "?"),
                STUCK_THREAD: ident == marked,
                CODE_STACKTRACE: _tail(stack, _STACK_LIMIT),
            },
            now,
        )
    return len(frames)


def _tail(text: str, limit: int) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return "...\n" + data[-(limit - 4) :].decode("utf-8", "ignore")


def _random_id() -> int:
    import random

    return random.getrandbits(64) or 1
