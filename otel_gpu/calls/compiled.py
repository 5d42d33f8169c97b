"""Decorated calls inside ``torch.compile`` graphs: two custom ops around the traced body.

While Dynamo traces a decorated function, the wrapper does not run its eager path (locks,
context variables and clocks break the graph). It puts two custom ops into the graph instead,
``otel_gpu::call_begin`` before the body and ``otel_gpu::call_end`` after it. Both mutate one
small token tensor, so the compiler keeps them, and in order, under every backend; at runtime
each runs eager Python code that starts and finishes the call's record, exactly once per
runtime call of the compiled graph. ``call_begin`` receives the call's input tensors and
``call_end`` its output tensors, the real runtime tensors: level-3 metadata is taken from them
and level-5 statistics are computed on them by the op, at runtime.

Threads: only the thread Dynamo is tracing on takes this path. ``torch.compiler.is_compiling()``
reads a process-wide flag, true on every thread while any thread compiles, so a server that
compiled on one thread sent its other threads' eager calls here (spans without arguments, lost
spans, broken guards); ``torch.compiler.is_dynamo_compiling()`` is a constant ``True`` in traced
code and ``False`` at run time on every thread. The trace-time nesting depth lives in a
thread-local, so the guard Dynamo puts on it reads the calling thread's own depth, 0 outside a
trace: another thread's trace neither fails nor recompiles a graph.

Nesting: the OTel context cannot be attached from inside a graph (an exception in the graph
would leave it attached), so the ops keep their own per-thread stack. The trace-time nesting
depth of each call is a constant of the graph; ``call_begin`` at depth ``d`` cuts the stack to
``d`` entries first, so calls left open by a graph that raised never become parents of the
next run's calls. Depth 0 takes its parent from the OTel context current when the compiled
callable runs.

Measured cost and what each level records under compile: docs/compile.md.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

from otel_gpu import _guard
from otel_gpu.attributes import COMPILED
from otel_gpu.calls import lifecycle, metadata, stats
from otel_gpu.core import sink
from otel_gpu.core.record import Call
from otel_gpu.devices import compiling

__all__ = ["ATTRIBUTE", "SUPPORTED", "call", "is_compiling", "register"]

ATTRIBUTE = COMPILED

# whether this thread traces (the compile seam, shared with the NVTX observer)
_is_exporting = compiling.is_exporting
_get_pipeline = sink.get  # the running pipeline, built on first use (core/sink.py)
is_compiling = compiling.is_compiling
SUPPORTED = compiling.SUPPORTED

_TOKEN = torch.zeros(1)  # what both ops mutate: the compiler neither drops nor reorders them
# plan id (a graph constant) -> Plan; weak, so a dropped model's plans (and modules) go
_PLANS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_ids = itertools.count()


class _TraceDepth(threading.local):
    """Trace-time nesting of decorated calls on this thread; balanced, so 0 between traces."""

    def __init__(self) -> None:
        self.value = 0


_DEPTH = _TraceDepth()
_SEP = "\x1f"  # joins argument names into one str argument of call_begin
# ends the name of a tensor that requires grad: inside the graph every tensor reads False
# (autograd runs around the compiled graph), so the traced value is passed instead
_GRAD = "\x1e"


class _Stack(threading.local):
    def __init__(self) -> None:
        self.entries: list[Any] = []  # Call, an unsampled span, or None (no pipeline)


_stack = _Stack()


def register(plan: Any) -> int:
    """Give ``plan`` the id its graphs carry as a constant (once, at decoration)."""
    plan_id = next(_ids)
    _PLANS[plan_id] = plan
    return plan_id


def call(plan_id: int, plan: Any, fn: Any, args: tuple, kwargs: dict) -> Any:
    """The wrapper's body while Dynamo traces it: ops around ``fn``, nothing that breaks graphs.

    Runs only at trace time; its Python is turned into graph nodes, never run per call.
    """
    if _is_exporting():
        return fn(*args, **kwargs)
    depth = _DEPTH.value
    limit = plan.max_items  # OTEL_GPU_MAX_ITEMS, as in eager capture
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    if plan.level >= 3:
        params = plan.param_names
        for i, value in enumerate(args[plan.skip :]):
            key = params[i] if i < len(params) else f"args.{i}"
            _collect(key, value, names, tensors, limit)
        for key, value in kwargs.items():
            _collect(key, value, names, tensors, limit)
    torch.ops.otel_gpu.call_begin(_TOKEN, plan_id, depth, _SEP.join(names), tensors)
    _DEPTH.value = depth + 1
    try:
        result = fn(*args, **kwargs)
    finally:
        _DEPTH.value = depth
    out_names: list[str] = []
    outputs: list[torch.Tensor] = []
    if isinstance(result, torch.Tensor):
        _collect("0", result, out_names, outputs, limit)
    elif isinstance(result, (tuple, list)):
        for i, item in enumerate(result[:limit]):
            _collect(str(i), item, out_names, outputs, limit)
    elif isinstance(result, dict):
        for i, (key, item) in enumerate(result.items()):
            if i < limit:
                _collect(str(key), item, out_names, outputs, limit)
    torch.ops.otel_gpu.call_end(_TOKEN, plan_id, depth, _SEP.join(out_names), outputs)
    return result


def _collect(
    key: str, value: Any, names: list[str], tensors: list[torch.Tensor], limit: int
) -> None:
    """Tensors among an argument (itself, or the first ``limit`` items of a list or tuple)."""
    if isinstance(value, torch.Tensor):
        names.append(key + _GRAD if value.requires_grad else key)
        tensors.append(value.detach())
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value[:limit]):
            if isinstance(item, torch.Tensor):
                names.append(f"{key}.{i}{_GRAD}" if item.requires_grad else f"{key}.{i}")
                tensors.append(item.detach())


_SCHEMA = "(Tensor(a!) token, int plan_id, int depth, str names, Tensor[] tensors) -> ()"


def _call_begin(
    token: torch.Tensor, plan_id: int, depth: int, names: str, tensors: list[torch.Tensor]
) -> None:
    try:
        _begin(plan_id, depth, names, tensors)
    except BaseException as exc:  # never break the compiled program
        _guard.internal_error("compiled", exc)


def _call_end(
    token: torch.Tensor, plan_id: int, depth: int, names: str, tensors: list[torch.Tensor]
) -> None:
    try:
        _end(depth, names, tensors)
    except BaseException as exc:  # never break the compiled program
        _guard.internal_error("compiled", exc)


def _fake(
    token: torch.Tensor, plan_id: int, depth: int, names: str, tensors: list[torch.Tensor]
) -> None:
    return None


if SUPPORTED:
    # torch.library.Library, not torch.library.custom_op: measured per call of a compiled graph,
    # a custom_op's Python dispatch costs ~90 µs, a Library kernel ~3 µs (docs/compile.md).
    _LIBRARY = torch.library.Library("otel_gpu", "DEF")
    for _name, _kernel in (("call_begin", _call_begin), ("call_end", _call_end)):
        _LIBRARY.define(_name + _SCHEMA)
        _LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"otel_gpu::{_name}", _fake, lib=_LIBRARY)


def _begin(plan_id: int, depth: int, names: str, tensors: list[torch.Tensor]) -> None:
    entries = _stack.entries
    del entries[depth:]  # calls a graph that raised left open are never parents
    pipe = _get_pipeline()
    if pipe is None or (depth and entries[-1] is None):
        entries.append(None)
        return
    plan = _PLANS.get(plan_id)
    if plan is None:  # the decorated function is gone, its compiled graph still runs
        entries.append(None)
        return
    current = None
    if depth:
        top = entries[-1]
        current = top.span if isinstance(top, Call) else top
    call = lifecycle.begin(plan, pipe, current)
    if not isinstance(call, Call):  # None or an unsampled span: children follow the decision
        entries.append(call)
        return
    call.span.set_attribute(ATTRIBUTE, True)
    if plan.level >= 3:
        pending: list[tuple[str, torch.Tensor]] | None = [] if plan.level >= 5 else None
        call.inputs = _capture(names, tensors, plan.max_items, pending)
        if pending:
            call.stats = [stats.compute("input." + k, t) for k, t in pending]
    entries.append(call)
    if pipe.device_time is not None:  # device time: the start event, as eager calls record it
        pipe.device_time.start(call)
    call.start_ns = lifecycle.time_ns()


def _end(depth: int, names: str, tensors: list[torch.Tensor]) -> None:
    end_ns = lifecycle.time_ns()
    entries = _stack.entries
    if len(entries) <= depth:
        return  # the stack was cut by a later run: nothing of this call is left to finish
    call = entries[depth]
    del entries[depth:]
    if not isinstance(call, Call):
        return
    call.end_ns = end_ns
    if call.device is not None:  # device time: the end event, before any statistics kernel
        call.device.owner.end(call)
    plan = call.plan
    pending: list[Any] | None = call.stats
    call.stats = None
    if plan.level >= 3:
        found: list[tuple[str, torch.Tensor]] | None = [] if plan.level >= 5 else None
        call.outputs = _capture(names, tensors, plan.max_items, found)
        if found:
            pending = (pending or []) + [stats.compute("output." + k, t) for k, t in found]
    if pending:
        call.stats = stats.finish(pending)
    pipeline_ = _get_pipeline()
    if pipeline_ is not None:
        pipeline_.submit(call)


def _capture(
    names: str,
    tensors: list[torch.Tensor],
    max_items: int,
    found: list[tuple[str, torch.Tensor]] | None,
) -> tuple:
    """Raw metadata of the runtime tensors, ``requires_grad`` as it was traced."""
    raw: list[tuple[str, int, Any]] = []
    for name, tensor in zip(names.split(_SEP) if names else (), tensors):
        key = name.rstrip(_GRAD)
        metadata.capture(raw, key, tensor, max_items, found)
        meta = raw[-1][2]
        if key != name and isinstance(meta, tuple) and len(meta) > 4:
            raw[-1] = (key, raw[-1][1], (*meta[:4], True, *meta[5:]))
    return tuple(raw)
