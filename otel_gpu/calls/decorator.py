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
import sys
from collections.abc import Callable
from typing import Any, TypeVar, overload

from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from otel_gpu import _guard, config
from otel_gpu.attributes import (
    CODE_FILE_PATH,
    CODE_FUNCTION_NAME,
    CODE_LINE_NUMBER,
)
from otel_gpu.calls import armed, compiled, describe, lifecycle, metadata
from otel_gpu.calls.lifecycle import NonFiniteError
from otel_gpu.core import record
from otel_gpu.core.plan import Plan, Shape, qualified_name, shape_of
from otel_gpu.core.record import Call
from otel_gpu.devices import cuda
from otel_gpu.export import pipeline, spans
from otel_gpu.instrumentation import targets as _targets

__all__ = ["NonFiniteError", "api", "configure", "decorate", "flush", "make_plan"]


F = TypeVar("F", bound=Callable[..., Any])

# the lifecycle's steps as module globals: one dict lookup each on the hot path
_begin = lifecycle.begin
_attach_span = lifecycle.attach_span
_detach = lifecycle.detach
_time_ns = lifecycle.time_ns
_traceback_of = lifecycle.traceback_of
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
    # Memory per call: only where CUDA exists, decided now (no per-call cost without it)
    plan.memory = plan.level >= 3 and settings.device_memory and cuda.cuda_available()
    return plan


_NO_STATE = DEFAULT_TRACE_STATE
_new_context, _FAST_CONTEXT = record.new_context, record.FAST_CONTEXT


def _make_wrapper(
    fn: Callable[..., Any], plan: Plan, settings: config.Settings
) -> Callable[..., Any]:
    level = plan.level
    get_pipeline = pipeline.get
    internal = _guard.internal_error
    # the lifecycle's start and finish (calls/lifecycle.py), bound once: as cheap as closures
    before, after, end = lifecycle.start, lifecycle.finish, lifecycle.end

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
            # Level 1 with no observer skips start/finish, as the sync wrapper does. The body
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
            # inline; lifecycle.start/finish cost two calls and their checks, ~0.4 µs a call.
            if is_compiling():
                return compiled_call(plan_id, plan, fn, args, kwargs)
            pipe = get_pipeline()
            call = _begin(plan, pipe) if pipe is not None else None
            if call is None or pipe is None:
                return fn(*args, **kwargs)
            if not isinstance(call, Call):
                return lifecycle.run_unsampled(call, fn, args, kwargs, plan, pipe)
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
                end(call, pipe, observers)
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
            return lifecycle.run_unsampled(call, fn, args, kwargs, plan, pipe)
        # Level 1 with no observer skips start/finish: ids, clocks and one append.
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


def decorate(
    fn: Any,
    name: str | None,
    attributes: dict[str, Any] | None = None,
    instrumented: str | None = None,
) -> Any:
    """What ``@otel_gpu.api`` and every instrumentation path do to ``fn``: its plan, and the
    wrapper of the configured level (``fn`` itself at level 0). ``name`` is the span name (None:
    ``module.qualname``), ``attributes`` go on every span of it, ``instrumented`` names the
    ``otel_gpu.instrument()`` target that asked for it."""
    # staticmethod/classmethod objects: wrap the function inside and re-wrap.
    if isinstance(fn, (staticmethod, classmethod)):
        return type(fn)(decorate(fn.__func__, name, attributes, instrumented))
    settings = config.current()
    if settings.control == "on":  # OTEL_GPU_CONTROL: a path live control can swap (calls/armed.py)
        _targets.apply_settings(settings)  # also starts the control listener
        return armed.arm(fn, name, settings, lambda s: _wrap(fn, name, attributes, instrumented, s))
    if settings.level == 0:
        return fn  # level 0: the function itself, no wrapper, no per-call check
    _targets.apply_settings(settings)  # OTEL_GPU_INSTRUMENT where no start-up hook applied it
    return _wrap(fn, name, attributes, instrumented, settings)


def _wrap(
    fn: Any,
    name: str | None,
    attributes: dict[str, Any] | None,
    instrumented: str | None,
    settings: config.Settings,
) -> Any:
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
        return lambda f: decorate(f, name)
    if isinstance(fn, str):
        raise TypeError(
            "otel_gpu.api takes the span name as a keyword: @otel_gpu.api(name=...), "
            f"not @otel_gpu.api({fn!r})"
        )
    return decorate(fn, name)


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
