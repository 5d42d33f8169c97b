"""One call's lifecycle on the caller's thread: begin, start, finish.

Every way a call becomes a span goes through these functions: the decorator's wrappers
(:mod:`otel_gpu.calls.decorator`), calls inside compiled graphs (:mod:`otel_gpu.calls.compiled`),
asynchronous collectives (:mod:`otel_gpu.instrumentation.torch_distributed`) and CUDA graph
replays (:func:`replayed`, which :mod:`otel_gpu.devices.cuda_graphs` calls).

- :func:`begin`: ids and context for a new call, or the decision that it is not sampled;
- :func:`start`: before the call runs: inputs captured and statistics launched (level 3 and up),
  the observers' ``start``; then the call's span made current and its clock started;
- :func:`finish`: after it returned or raised: its clock stopped and its span no longer current,
  outputs and statistics (level 3 and up), the non-finite policy, the observers' ``end``, the
  record queued;
- :func:`replayed`: the record of a call that a CUDA graph replay ran again, queued.

The level 1-2 wrapper inlines the observers' ``start`` and ``end`` (two Python calls fewer per
call, see the decorator); every other body calls :func:`start` and :func:`finish`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import DEFAULT_TRACE_STATE, TraceState

from otel_gpu import _guard
from otel_gpu.attributes import STATS_INF_COUNT, STATS_NAN_COUNT
from otel_gpu.calls import _context, memory, metadata, stats, stats_reader
from otel_gpu.core import record
from otel_gpu.core.plan import Plan
from otel_gpu.core.protocols import SpanSink
from otel_gpu.core.record import Call, CallSpan
from otel_gpu.devices import cuda_graphs, device_time

__all__ = [
    "NonFiniteError",
    "attach_span",
    "begin",
    "capture_inputs",
    "detach",
    "finish",
    "launch_stats",
    "nonfinite",
    "replayed",
    "run_unsampled",
    "start",
    "time_ns",
    "traceback_of",
]


class NonFiniteError(FloatingPointError):
    """Raised after a call whose tensors hold NaN/Inf, with ``OTEL_GPU_ON_NONFINITE=raise``.

    ``tensors`` maps each non-finite tensor (``"output.0"``, ``"input.q"``) to its NaN and Inf
    counts; ``span_id`` is the call's span id (16 hex digits); ``result`` is what the call
    returned, so a debugger can inspect it.
    """

    def __init__(
        self, message: str, tensors: dict[str, tuple[int, int]], span_id: str, result: Any
    ) -> None:
        super().__init__(message)
        self.tensors = tensors
        self.span_id = span_id
        self.result = result


_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_get_current_span = _context.current_span
attach_span = _context.attach_span  # the API's attach(set_span_in_context(span)), fewer calls
"""Make a span current; returns the token :func:`detach` takes."""
detach = _context.detach
_current_step = _context.STEP.get
_getrandbits = random.getrandbits  # reseeded in fork children by the random module
time_ns = time.time_ns
"""The clock of a call's start and end."""
_NO_STATE = DEFAULT_TRACE_STATE
_SAMPLED_BIT = int(TraceFlags.SAMPLED)
_FAST_CONTEXT = record.FAST_CONTEXT


def begin(
    plan: Plan, pipe: SpanSink, current: trace.Span | None = None
) -> Call | NonRecordingSpan | None:
    """Ids and context for a new call; None when the parent says the trace is not sampled, a
    ``NonRecordingSpan`` when the head sampler drops a root call (see :func:`run_unsampled`).

    ``current``: the parent span when it is not the context's (calls inside compiled graphs).
    """
    cur = current or _get_current_span()
    parent: SpanContext | None = cur.get_span_context()
    state: TraceState | None
    if _FAST_CONTEXT and type(parent) is SpanContext:
        # the tuple unpacked: five property reads cost 0.4 µs more, and a module's every call
        # has a parent (the layout is checked once at import, see record._context_maker)
        trace_id, _, _, flags, state, valid = parent  # type: ignore[misc]
        if valid:
            if not flags & _SAMPLED_BIT:
                return None
        else:
            parent = None
    elif parent is not None and parent.is_valid:
        if not parent.trace_flags.sampled:
            return None
        trace_id = parent.trace_id
        state = parent.trace_state
    else:
        parent = None
    if parent is None:
        trace_id = _getrandbits(128) or 1
        state = None
        sampler = pipe.root_sampler
        if sampler is not None and not sampler(trace_id, plan.name):
            return NonRecordingSpan(
                SpanContext(trace_id, _getrandbits(64) or 1, False, _NOT_SAMPLED)
            )
    # the record is its span, one GC-tracked object queued; the SpanContext is built when first
    # asked for (a child's start, the export thread): a leaf span never needs one on this thread
    call = Call(plan, None, parent, time_ns(), trace_id, _getrandbits(64) or 1, state or _NO_STATE)
    # a batch step's links (calls/batch.py): a call under a call inherits its parent's, one slot
    # read; only a call under another span reads the context variable
    if type(cur) is Call or type(cur) is CallSpan:
        step = cur.batch
    else:
        step = _current_step()
    if step is not None:
        call.batch = step
    return call


def run_unsampled(
    span: NonRecordingSpan,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    plan: Plan,
    pipe: SpanSink,
) -> Any:
    """Run a call the sampler dropped, with its unsampled context current so children agree.

    With ``OTEL_GPU_METRICS`` it is still timed and counted: the call metrics count every call,
    not only the sampled ones (no span, so no exemplar and no NaN check)."""
    token = attach_span(span)
    if pipe.metrics is None:
        try:
            return fn(*args, **kwargs)
        finally:
            detach(token)
    failed: type | None = None
    started = time_ns()
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        failed = type(exc)
        raise
    finally:
        ended = time_ns()
        detach(token)
        pipe.note_unsampled(plan, ended - started, failed)


def capture_inputs(plan: Plan, bound: list[tuple[str, Any, bool]], tensors: Any) -> tuple:
    """The raw metadata of a call's bound arguments (``tensors`` collects those to reduce)."""
    out: list[tuple[str, int, Any]] = []
    for name, value, is_default in bound:
        mark = len(out)
        try:
            metadata.capture(out, name, value, plan.max_items, tensors)
        except BaseException as exc:  # a hostile argument costs only its own metadata
            del out[mark:]
            out.append((name, metadata.VALUE, f"<metadata unavailable: {type(exc).__name__}>"))
            _guard.internal_error("metadata", exc)
        if is_default:
            out.append((name, metadata.DEFAULT, True))
    if plan.redact:
        metadata.redact(out, plan.redact)
    # queued until export: an earlier call's equal record, so this call keeps no tuples of its own
    return metadata.shared(tuple(out))


def traceback_of(exc: BaseException) -> Any:
    """``exc.__traceback__``, or None when a ``__traceback__`` property raises: the user's own
    exception must reach the caller, never one that reading it raised."""
    try:
        return exc.__traceback__
    except BaseException:  # a property on the user's exception class
        return None


def nonfinite(call: Call, result: Any) -> NonFiniteError | None:
    """OTEL_GPU_ON_NONFINITE=error/raise: status ERROR naming the tensors (dump: the ring writes)."""
    bad = {
        s.key: (s.values.get(STATS_NAN_COUNT, 0), s.values.get(STATS_INF_COUNT, 0))
        for s in call.stats
        if s.nonfinite
    }
    if not bad:
        return None
    message = "non-finite values in " + ", ".join(
        f"{key} ({nan} NaN, {inf} Inf)" for key, (nan, inf) in bad.items()
    )
    if call.plan.on_nonfinite in ("error", "raise"):
        call.span.set_status(Status(StatusCode.ERROR, message[:256]))
    span_id = format(call.span.get_span_context().span_id, "016x")
    return NonFiniteError(f"{call.plan.name}: {message} (span {span_id})", bad, span_id, result)


def launch_stats(plan: Plan, prefix: str, tensors: list[tuple[str, Any]]) -> list[stats.Pending]:
    """Start the reductions for a call's tensors, or record why not (CUDA graph capture)."""
    if plan.capture_stats is not None and plan.capture_stats():
        # CUDA graph capture: into static device buffers, read after replays (devices/cuda_graphs)
        return [stats.capture(prefix + k, t) for k, t in tensors]
    return [stats.compute(prefix + k, t) for k, t in tensors]


def start(call: Call, pipe: SpanSink, args: tuple, kwargs: dict, deferred: bool = False) -> Any:
    """Work before the call runs: inputs captured and stats launched (level 3+), observers told;
    then the call's span made current and its start time taken, last.

    Returns the context token that :func:`finish` detaches. The statistics launched wait in
    ``call.stats`` until :func:`finish` reads them. ``deferred``: the call's work completes
    later, on another thread (an asynchronous collective): no statistics and no memory reading,
    which would measure the wrong moment."""
    plan = call.plan
    level = plan.level
    internal = _guard.internal_error
    call.args = args
    if level >= 3:
        try:
            tensors: list | None = [] if level >= 5 and not deferred else None
            call.bound = plan.binder(args, kwargs)  # type: ignore[misc]
            call.inputs = capture_inputs(plan, call.bound, tensors)
            if tensors:
                call.stats = launch_stats(plan, "input.", tensors)
        except BaseException as exc:  # user hooks run here
            internal("metadata", exc)
    for observer in pipe.observers_at[level]:
        try:
            observer.start(call)
        except BaseException as exc:  # user hooks run here
            internal("observer", exc)
    if plan.memory and not deferred:  # last, so nothing of our own counts in the call's memory
        try:
            call.memory = memory.begin(plan.memory == 2)
        except BaseException as exc:
            internal("memory", exc)
    token = attach_span(call)  # the record is its span
    call.start_ns = time_ns()
    return token


def finish(
    call: Call, pipe: SpanSink, result: Any, token: Any = None, exc: BaseException | None = None
) -> None:
    """Work after the call returned ``result`` or raised ``exc``: its end time taken and ``token``
    (from :func:`start`; None where the caller detached it already) detached, first; then outputs
    captured and statistics read (level 3+), the non-finite policy, the observers' ``end``, the
    record queued.

    Raises :class:`NonFiniteError` after the record is queued, with
    ``OTEL_GPU_ON_NONFINITE=raise``, when the call itself did not raise."""
    call.end_ns = time_ns()
    if token is not None:
        detach(token)
    if exc is not None:
        call.exc = exc
        call.tb = traceback_of(exc)
    plan = call.plan
    level = plan.level
    internal = _guard.internal_error
    pending = call.stats  # launched by start(): never seen by an observer as results
    call.stats = None
    if call.device is not None:  # device time: its end event before any statistics kernel
        device_time.stop(call)
    if plan.memory:  # first, before the output statistics allocate
        try:
            memory.end(call, getattr(call, "memory", None))
        except BaseException as exc_:
            internal("memory", exc_)
        call.memory = None
    if level >= 3 and call.exc is None:
        tensors: list | None = [] if level >= 5 else None
        try:
            call.outputs = metadata.shared(
                tuple(metadata.capture_output(result, plan.max_items, tensors))
            )
        except BaseException as exc_:  # user hooks run here
            internal("metadata", exc_)
        if tensors:
            try:
                pending = (pending or []) + launch_stats(plan, "output.", tensors)
            except BaseException as exc_:  # user hooks run here
                internal("statistics", exc_)
    bad: NonFiniteError | None = None
    read = None
    if pending:
        try:
            if plan.read_later and not stats_reader.wanted_on_caller:
                # no host sync: a copy and an event; the reader thread completes the statistics
                read = stats.read_later(pending, call)
            if read is None:
                call.stats = stats.finish(pending, call)
                if plan.on_nonfinite != "mark":
                    bad = nonfinite(call, result)
        except BaseException as exc_:  # user hooks run here
            internal("statistics", exc_)
    observers = pipe.observers_at[level]
    if observers:
        call.result = result
        for observer in observers:
            try:
                observer.end(call)
            except BaseException as exc_:  # user hooks run here
                internal("observer", exc_)
        call.result = None
    call.bound = None
    call.args = None
    if read is None:
        pipe.submit(call)
    else:  # queued to the pipeline by the reader thread once its statistics are complete
        try:
            stats_reader.submit(call, pipe, pending, read)  # type: ignore[arg-type]
        except BaseException as exc_:
            internal("statistics", exc_)
            pipe.submit(call)
    if bad is not None and plan.on_nonfinite == "raise" and call.exc is None:
        # after the span is queued, so the trace shows the call; never instead of the
        # user's own exception, which passes through untouched
        raise bad


def replayed(
    pipe: SpanSink,
    captured: cuda_graphs.CapturedCall,
    context: SpanContext,
    job: cuda_graphs.Job,
    results: list,
    attributes: dict[str, Any],
) -> None:
    """Queue the record of a call that a CUDA graph replay ran again (the reader thread of
    :mod:`otel_gpu.devices.cuda_graphs` calls this): ``context`` holds the span's ids, reserved
    at the replay; ``job`` the replay's parent and clocks; ``captured`` the metadata kept at
    capture and the capture span, which the span links to; ``results`` the statistics the replay
    computed. Nothing runs on the host at a replay: no start, no observer."""
    call = Call(captured.plan, CallSpan(context, captured.name), job.parent, job.start_ns)
    call.end_ns = job.end_ns
    call.inputs = captured.inputs
    call.outputs = captured.outputs
    call.span.set_attributes(attributes)
    call.span.add_link(captured.context)
    call.stats = results
    pipe.submit(call)


cuda_graphs.set_replayed(replayed)
