"""The decorator's work: a decorated function's plan and the wrapper of its level.

Everything that can be decided when a function is decorated is decided then: the
level, the span name, the ``code.*`` attributes, the argument binder, which
parameters are redacted. The wrapper returned for level N does only level N's
work. At level 0 the decorator returns the function object itself.

The public ``@otel_gpu.api``, ``configure`` and ``flush`` live at the top of the package
(:mod:`otel_gpu.runtime`), which wires this layer to the running pipeline: the wrappers reach
the pipeline through :mod:`otel_gpu.core.sink`, never by importing it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from otel_gpu import _guard, config
from otel_gpu.attributes import (
    CODE_FILE_PATH,
    CODE_FUNCTION_NAME,
    CODE_LINE_NUMBER,
)
from otel_gpu.calls import armed, compiled, lifecycle, metadata
from otel_gpu.calls.lifecycle import NonFiniteError
from otel_gpu.core import record, sink
from otel_gpu.core.plan import Plan, Shape, qualified_name, shape_of
from otel_gpu.core.record import Call
from otel_gpu.devices import cuda

__all__ = ["NonFiniteError", "decorate", "make_plan"]

# the lifecycle's steps as module globals: one dict lookup each on the hot path
_begin = lifecycle.begin
_attach_span = lifecycle.attach_span
_detach = lifecycle.detach
_time_ns = lifecycle.time_ns
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


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
        plan.read_later = (
            plan.level < 10
            and settings.stats_read == "async"
            and plan.on_nonfinite == "mark"
            and plan.capture_stats is not None
        )
    # Memory per call: only where CUDA exists, decided now (no per-call cost without it)
    if plan.level >= 3 and settings.device_memory and cuda.cuda_available():
        plan.memory = 2 if settings.device_memory_calls == "all" else 1
    return plan


_NO_STATE = DEFAULT_TRACE_STATE
_new_context, _FAST_CONTEXT = record.new_context, record.FAST_CONTEXT


def _make_wrapper(
    fn: Callable[..., Any], plan: Plan, settings: config.Settings
) -> Callable[..., Any]:
    """The wrapper of ``plan``'s level: one body for sync functions, one for coroutine functions,
    each the lifecycle (calls/lifecycle.py): begin, start, the call, finish. At levels 1-2 the
    sync body inlines start's and finish's observer loops instead of calling them."""
    level = plan.level
    get_pipeline = sink.getter()  # the pipeline's own get(): one call per call, as before
    internal = _guard.internal_error
    # the lifecycle's functions, bound once: as cheap as closures
    start, finish, run_unsampled = lifecycle.start, lifecycle.finish, lifecycle.run_unsampled

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            pipe = get_pipeline()
            if pipe is None or (call := _begin(plan, pipe)) is None:
                return await fn(*args, **kwargs)
            if not isinstance(call, Call):  # not sampled: children must see the decision
                unsampled = _attach_span(call)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    _detach(unsampled)
            token = start(call, pipe, args, kwargs)
            try:
                result = await fn(*args, **kwargs)
            except BaseException as exc:
                finish(call, pipe, None, token, exc)
                raise
            finish(call, pipe, result, token)
            return result

        return async_wrapper

    is_compiling = compiled.is_compiling
    plan_id = compiled.register(plan)
    compiled_call = compiled.call

    heavy = level >= 3  # metadata (and statistics) captured around every call

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # While Dynamo traces: graph operators instead of locks and clocks (calls/compiled.py);
        # the check costs ~0.07 µs per eager call
        if is_compiling():
            return compiled_call(plan_id, plan, fn, args, kwargs)
        pipe = get_pipeline()
        if pipe is None or (call := _begin(plan, pipe)) is None:
            return fn(*args, **kwargs)
        if not isinstance(call, Call):
            return run_unsampled(call, fn, args, kwargs, plan, pipe)
        if heavy:
            token = start(call, pipe, args, kwargs)
        else:
            # Levels 1-2: no metadata, so start's and finish's observer loops are inlined (the
            # crash journal observes by default): two Python calls and their checks fewer.
            observers = pipe.observers_at[level]
            if observers:
                call.args = args
                for observer in observers:
                    try:
                        observer.start(call)
                    except BaseException as exc:  # user hooks run here
                        internal("observer", exc)
            token = _attach_span(call)  # the record is its span
            call.start_ns = _time_ns()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            finish(call, pipe, None, token, exc)
            raise
        if heavy:
            finish(call, pipe, result, token)
            return result
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
    if settings.controllable:  # OTEL_GPU_CONTROL or triggers: a path to swap (calls/armed.py)
        return armed.arm(fn, name, settings, lambda s: _wrap(fn, name, attributes, instrumented, s))
    if settings.level == 0:
        return fn  # level 0: the function itself, no wrapper, no per-call check
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
