"""``@otel_gpu.api``: the decorator, and ``configure``/``flush``.

Everything that can be decided when a function is decorated is decided then: the
level, the span name, the ``code.*`` attributes, the argument binder, which
parameters are redacted. The wrapper returned for level N does only level N's
work. At level 0 the decorator returns the function object itself.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, overload

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import DEFAULT_TRACE_STATE, TraceState

from otel_gpu import _guard, config
from otel_gpu.attributes import (
    CODE_FILE_PATH,
    CODE_FUNCTION_NAME,
    CODE_LINE_NUMBER,
    STATS_INF_COUNT,
    STATS_NAN_COUNT,
)
from otel_gpu.calls import _context, compiled, describe, metadata, stats
from otel_gpu.core import record
from otel_gpu.core.plan import Plan, Shape, qualified_name, shape_of
from otel_gpu.core.record import Call, CallSpan
from otel_gpu.devices import cuda
from otel_gpu.export import pipeline, spans
from otel_gpu.instrumentation import targets as _targets

__all__ = ["NonFiniteError", "api", "configure", "flush", "make_plan"]


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


F = TypeVar("F", bound=Callable[..., Any])

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_get_current_span = _context.current_span
_attach_span = _context.attach_span  # the API's attach(set_span_in_context(span)), fewer calls
_detach = _context.detach
_getrandbits = random.getrandbits  # reseeded in fork children by the random module
_time_ns = time.time_ns
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
# a call's exception is formatted on the export thread within a time bound (user __str__)
spans.describe_exceptions_with(describe.exception_text)


def make_plan(
    fn: Callable[..., Any],
    name: str,
    settings: config.Settings,
    shape: Shape | None = None,
    attributes: dict[str, Any] | None = None,
) -> Plan:
    """The plan of a function decorated with ``settings``: span name, ``code.*`` attributes,
    binder, redacted parameters and the graph-capture check, decided once."""
    shape = shape or Shape(fn, fn, True, None)
    plan = Plan(name, settings.level)
    plan.max_items = settings.max_items
    plan.on_nonfinite = settings.on_nonfinite
    code = getattr(fn, "__code__", None)
    plan.module = getattr(fn, "__module__", None) or type(fn).__module__
    plan.qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    plan.attributes[CODE_FUNCTION_NAME] = f"{plan.module}.{plan.qualname}"
    if code is not None:
        plan.attributes[CODE_FILE_PATH] = code.co_filename
        plan.attributes[CODE_LINE_NUMBER] = code.co_firstlineno
    if attributes:
        plan.attributes.update(attributes)
    # Calls pass the receiver as args[0] only for functions decorated in a class body (or taken
    # from the class); a bound method or a callable object carries its receiver itself.
    plan.receiver_passed = shape.receiver_passed
    plan.receiver = shape.receiver
    plan.replay_note = shape.replay_note
    signed = shape.signature_source
    if plan.level >= 3:
        plan.binder = metadata.make_binder(signed, skip_self=shape.receiver_passed)
    plan.redact = settings.redact
    try:
        params = list(inspect.signature(signed).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params]
    plan.redacted = frozenset(n for n in names if metadata.is_secret(n, plan.redact))
    # under torch.compile: positional parameter names, after the receiver passed as args[0]
    positional = [p.name for p in params if p.kind in _POSITIONAL]
    passed = shape.receiver_passed and positional[:1] in (["self"], ["cls"])
    plan.skip = 1 if passed else 0
    plan.param_names = tuple(positional[plan.skip :])
    # CUDA graph capture can only be in progress where CUDA exists; decide the check now.
    if plan.level >= 5:
        plan.capture_stats = cuda.is_capturing if cuda.cuda_available() else None
    return plan


def _capture_inputs(plan: Plan, bound: list[tuple[str, Any, bool]], tensors: Any) -> tuple:
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
    return tuple(out)  # queued until export: the GC can untrack a tuple of atoms, never a list


def _traceback_of(exc: BaseException) -> Any:
    """``exc.__traceback__``, or None when a ``__traceback__`` property raises: the user's own
    exception must reach the caller, never one that reading it raised."""
    try:
        return exc.__traceback__
    except BaseException:  # a property on the user's exception class
        return None


def _nonfinite(call: Call, result: Any) -> NonFiniteError | None:
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


def _launch_stats(plan: Plan, prefix: str, tensors: list[tuple[str, Any]]) -> list[stats.Pending]:
    """Start the reductions for a call's tensors, or record why not (CUDA graph capture)."""
    if plan.capture_stats is not None and plan.capture_stats():
        # CUDA graph capture: into static device buffers, read after replays (devices/cuda_graphs)
        return [stats.capture(prefix + k, t) for k, t in tensors]
    return [stats.compute(prefix + k, t) for k, t in tensors]


def _begin(
    plan: Plan, pipe: pipeline.Pipeline, current: trace.Span | None = None
) -> Call | NonRecordingSpan | None:
    """Ids and context for a new call; None when the parent says the trace is not sampled.

    ``current``: the parent span when it is not the context's (calls inside compiled graphs).
    """
    parent: SpanContext | None = (current or _get_current_span()).get_span_context()
    state: TraceState | None
    if _FAST_CONTEXT and type(parent) is SpanContext:
        # the tuple unpacked: five property reads cost 0.4 µs more, and a module's every call
        # has a parent (the layout is checked once at import, see _context_maker)
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
    # the SpanContext is built when first asked for (a child's start, the export thread): a leaf
    # span never needs one on the caller's thread, and it is one GC-tracked object less queued
    span = CallSpan(None, plan.name, trace_id, _getrandbits(64) or 1, state or _NO_STATE)
    return Call(plan, span, parent, _time_ns())


_NO_STATE = DEFAULT_TRACE_STATE
_SAMPLED_BIT = int(TraceFlags.SAMPLED)
_new_context, _FAST_CONTEXT = record.new_context, record.FAST_CONTEXT


def _run_unsampled(
    span: NonRecordingSpan,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    plan: Plan,
    pipe: pipeline.Pipeline,
) -> Any:
    """Run a call the sampler dropped, with its unsampled context current so children agree.

    With ``OTEL_GPU_METRICS`` it is still timed and counted: the call metrics count every call,
    not only the sampled ones (no span, so no exemplar and no NaN check)."""
    token = _attach_span(span)
    if pipe.metrics is None:
        try:
            return fn(*args, **kwargs)
        finally:
            _detach(token)
    failed: type | None = None
    start = _time_ns()
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        failed = type(exc)
        raise
    finally:
        end = _time_ns()
        _detach(token)
        pipe.note_unsampled(plan, end - start, failed)


def _tell_end(call: Call, observers: tuple[Any, ...], result: Any) -> None:
    """The observers' ``end`` for a light (level 1-2) call that raised."""
    call.result = result
    for observer in observers:
        try:
            observer.end(call)
        except BaseException as exc:  # user hooks run here
            _guard.internal_error("observer", exc)
    call.result = None
    call.args = None


def _make_wrapper(
    fn: Callable[..., Any], plan: Plan, settings: config.Settings
) -> Callable[..., Any]:
    level = plan.level
    get_pipeline = pipeline.get
    internal = _guard.internal_error

    def before(call: Call, pipe: pipeline.Pipeline, args: tuple, kwargs: dict) -> list | None:
        """Work before the call runs: inputs captured and stats launched (level 3+), observers told."""
        pending = None
        call.args = args
        if level >= 3:
            try:
                tensors: list | None = [] if level >= 5 else None
                call.bound = plan.binder(args, kwargs)  # type: ignore[misc]
                call.inputs = _capture_inputs(plan, call.bound, tensors)
                if tensors:
                    pending = _launch_stats(plan, "input.", tensors)
            except BaseException as exc:  # user hooks run here
                internal("metadata", exc)
        for observer in pipe.observers_at[level]:
            try:
                observer.start(call)
            except BaseException as exc:  # user hooks run here
                internal("observer", exc)
        return pending

    def after(call: Call, pipe: pipeline.Pipeline, result: Any, pending: list | None) -> None:
        if level >= 3 and call.exc is None:
            tensors: list | None = [] if level >= 5 else None
            try:
                call.outputs = tuple(metadata.capture_output(result, plan.max_items, tensors))
            except BaseException as exc:  # user hooks run here
                internal("metadata", exc)
            if tensors:
                try:
                    pending = (pending or []) + _launch_stats(plan, "output.", tensors)
                except BaseException as exc:  # user hooks run here
                    internal("statistics", exc)
        nonfinite: NonFiniteError | None = None
        if pending:
            try:
                call.stats = stats.finish(pending, call)
                if plan.on_nonfinite != "mark":
                    nonfinite = _nonfinite(call, result)
            except BaseException as exc:  # user hooks run here
                internal("statistics", exc)
        observers = pipe.observers_at[level]
        if observers:
            call.result = result
            for observer in observers:
                try:
                    observer.end(call)
                except BaseException as exc:  # user hooks run here
                    internal("observer", exc)
            call.result = None
        call.bound = None
        call.args = None
        pipe.submit(call)
        if nonfinite is not None and plan.on_nonfinite == "raise" and call.exc is None:
            # after the span is queued, so the trace shows the call; never instead of the
            # user's own exception, which passes through untouched
            raise nonfinite

    heavy = level >= 3  # metadata (and stats) to capture around every call

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            pipe = get_pipeline()
            call = _begin(plan, pipe) if pipe is not None else None
            if call is None or pipe is None:
                return await fn(*args, **kwargs)
            if not isinstance(call, Call):  # not sampled: children must see the decision
                token = _attach_span(call)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    _detach(token)
            # Level 1 with no observer skips before()/after(), as the sync wrapper does. The body
            # repeats the sync wrapper's with `await`: a shared helper would cost a call per call.
            busy = heavy or pipe.observers_at[level]
            pending = before(call, pipe, args, kwargs) if busy else None
            token = _attach_span(call.span)
            call.start_ns = _time_ns()
            try:
                result = await fn(*args, **kwargs)
            except BaseException as exc:
                call.end_ns = _time_ns()
                _detach(token)
                call.exc = exc
                call.tb = _traceback_of(exc)
                if busy:
                    after(call, pipe, None, pending)
                else:
                    pipe.submit(call)
                raise
            call.end_ns = _time_ns()
            _detach(token)
            if busy:
                after(call, pipe, result, pending)
            else:
                pipe.submit(call)
            return result

        return async_wrapper

    is_compiling = compiled.is_compiling
    plan_id = compiled.register(plan)
    compiled_call = compiled.call

    if not heavy:

        @functools.wraps(fn)
        def light_wrapper(*args: Any, **kwargs: Any) -> Any:
            # Levels 1-2: no metadata, so the observers (the crash journal by default) are told
            # inline; before()/after() cost two calls and their checks, ~0.4 µs a call.
            if is_compiling():
                return compiled_call(plan_id, plan, fn, args, kwargs)
            pipe = get_pipeline()
            call = _begin(plan, pipe) if pipe is not None else None
            if call is None or pipe is None:
                return fn(*args, **kwargs)
            if not isinstance(call, Call):
                return _run_unsampled(call, fn, args, kwargs, plan, pipe)
            observers = pipe.observers_at[level]
            if observers:
                call.args = args
                for observer in observers:
                    try:
                        observer.start(call)
                    except BaseException as exc:  # user hooks run here
                        internal("observer", exc)
            token = _attach_span(call.span)
            call.start_ns = _time_ns()
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                call.end_ns = _time_ns()
                _detach(token)
                call.exc = exc
                call.tb = _traceback_of(exc)
                if observers:
                    _tell_end(call, observers, None)
                pipe.submit(call)
                raise
            call.end_ns = _time_ns()
            _detach(token)
            if observers:
                call.result = result
                for observer in observers:
                    try:
                        observer.end(call)
                    except BaseException as exc:  # user hooks run here
                        internal("observer", exc)
                call.result = None
                call.args = None
            pipe.submit(call)
            return result

        return light_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # While Dynamo traces: graph operators instead of locks and clocks (calls/compiled.py);
        # the check costs ~0.07 µs per eager call
        if is_compiling():
            return compiled_call(plan_id, plan, fn, args, kwargs)
        pipe = get_pipeline()
        call = _begin(plan, pipe) if pipe is not None else None
        if call is None or pipe is None:
            return fn(*args, **kwargs)
        if not isinstance(call, Call):
            return _run_unsampled(call, fn, args, kwargs, plan, pipe)
        # Level 1 with no observer skips before()/after(): ids, clocks and one append.
        busy = heavy or pipe.observers_at[level]
        pending = before(call, pipe, args, kwargs) if busy else None
        token = _attach_span(call.span)
        call.start_ns = _time_ns()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            call.end_ns = _time_ns()
            _detach(token)
            call.exc = exc
            call.tb = _traceback_of(exc)
            if busy:
                after(call, pipe, None, pending)
            else:
                pipe.submit(call)
            raise
        call.end_ns = _time_ns()
        _detach(token)
        if busy:
            after(call, pipe, result, pending)
        else:
            pipe.submit(call)
        return result

    return wrapper


def _decorate(
    fn: Any,
    name: str | None,
    attributes: dict[str, Any] | None = None,
    instrumented: str | None = None,
) -> Any:
    # staticmethod/classmethod objects: wrap the function inside and re-wrap.
    if isinstance(fn, (staticmethod, classmethod)):
        return type(fn)(_decorate(fn.__func__, name, attributes, instrumented))
    settings = config.current()
    if settings.level == 0:
        return fn  # level 0: the function itself, no wrapper, no per-call check
    _targets.apply_settings(settings)  # OTEL_GPU_INSTRUMENT where no start-up hook applied it
    if settings.strict:
        _guard.set_strict(True)
    shape = shape_of(fn)
    span_name = name or qualified_name(shape.target)
    plan = make_plan(shape.target, span_name, settings, shape, attributes)
    plan.instrumented = instrumented
    wrapper = _make_wrapper(fn, plan, settings)
    wrapper.__otel_gpu_plan__ = plan  # type: ignore[attr-defined]
    return wrapper


@overload
def api(fn: F, /, *, name: str | None = None) -> F: ...
@overload
def api(*, name: str | None = None) -> Callable[[F], F]: ...


def api(fn: Any = None, /, *, name: str | None = None) -> Any:
    """Turn every call of ``fn`` into an OpenTelemetry span, at the level ``OTEL_GPU_LOGLEVEL`` sets.

    Use bare (``@otel_gpu.api``) or with a span name (``@otel_gpu.api(name="BatchDecode.run")``).
    The level is read when the function is decorated: call :func:`configure` before importing
    the library whose functions are decorated.
    """
    if fn is None:
        return lambda f: _decorate(f, name)
    if isinstance(fn, str):
        raise TypeError(
            "otel_gpu.api takes the span name as a keyword: @otel_gpu.api(name=...), "
            f"not @otel_gpu.api({fn!r})"
        )
    return _decorate(fn, name)


def configure(
    *,
    level: int | str | None = None,
    dest: str | list[str] | tuple[str, ...] | None = None,
    tracer_provider: Any = None,
    **settings: Any,
) -> config.Settings:
    """Set otel-gpu's settings from code; wins over the environment.

    Call it before importing the libraries whose functions are decorated: the level is fixed
    when a function is decorated. A new destination takes effect at the next call (queued spans
    are flushed to the old one first). ``tracer_provider`` sends spans to that SDK
    TracerProvider instead of the global or otel-gpu's own one. Other keyword arguments are the
    field names of :class:`otel_gpu.config.Settings` (``max_items``, ``provider``, ``strict``…).
    Raises :class:`otel_gpu.ConfigError` naming the invalid value and what is allowed.
    """
    new = config._set_overrides({"level": level, "dest": dest, **settings})
    _guard.set_strict(new.strict)
    pipeline.reset()
    if tracer_provider is not None:
        pipeline.set_tracer_provider(tracer_provider)
    _targets.apply_settings(new)  # OTEL_GPU_INSTRUMENT where no start-up hook applied it
    return new


def flush(timeout: float | None = None) -> bool:
    """Export every span recorded so far. True when all reached the exporters within ``timeout`` s."""
    pipe = pipeline.current()
    if pipe is None or pipe.pid != os.getpid():
        return True
    graphs = sys.modules.get("otel_gpu.devices.cuda_graphs")
    if graphs is not None:  # CUDA-graph replays still being read become spans first
        graphs.flush(pipe.settings.flush_timeout if timeout is None else timeout)
    return pipe.flush(timeout)
