"""Target ``torch.distributed``: every collective and point-to-point call a span.

Each call of ``all_reduce``, ``all_gather(_into_tensor)``, ``reduce_scatter(_tensor)``,
``broadcast``, ``reduce``, ``gather``, ``scatter``, ``all_to_all(_single)``, ``barrier``,
``send``/``recv`` and ``isend``/``irecv`` becomes a span named ``torch.distributed.<op>`` with
the process group (name, id, global ranks, size), the caller's rank in it, a per-group
sequence number, the op and ``async_op`` (``otel_gpu.collective.*``, docs/attributes.md); the
decorator adds the tensor metadata at level >= 3, as for any call.

The functions are patched where torch defines them (``torch.distributed.distributed_c10d``), and
every module of torch holding the same object gets the wrapper too, so ``dist.all_reduce`` and
``distributed_c10d.all_reduce`` both give spans. Other functions of ``distributed_c10d`` call
them through its module globals, so ``all_gather_object`` shows its inner ``all_gather``. Before
``torch.distributed`` is imported the targets wait for it (the post-import hook of
``targets.py``).

The sequence number counts the calls of this process on each group (by its ``group_name``),
from 1, whether or not a call was sampled, so the same collective has the same number on every
rank of a group that runs the same program. Point-to-point calls are counted apart, per pair of
ranks, so a ``send`` between two ranks does not shift the others' numbering. It is otel-gpu's
count, not c10d's internal one.

One span per call the program made: where torch implements a patched function through another
one (since torch 2.x ``send`` and ``recv`` call ``isend``/``irecv`` and wait), the inner call runs
unobserved on that thread, so a blocking ``send`` is one span and advances its pair's sequence
once, as on the peer that called ``irecv``.

An async call (``async_op=True``, ``isend``, ``irecv``) is a span that ends when its work
completes, observed through ``Work.get_future()``; where the backend gives no future, the span
ends when the call returns and ``otel_gpu.collective.async_end`` says so.

Under ``OTEL_GPU_CONTROL=on`` the functions are patched at level 0 too (armed): a call records
nothing but takes its sequence number, a sync call follows its trampoline's path, and an async
call, which runs its span's lifecycle here, takes the plan and sampling control put in place.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import random
import sys
import threading
from collections.abc import Callable
from typing import Any

from otel_gpu import _guard
from otel_gpu.attributes import (
    COLLECTIVE_ASYNC_END,
    COLLECTIVE_ASYNC_OP,
    COLLECTIVE_GROUP_ID,
    COLLECTIVE_GROUP_NAME,
    COLLECTIVE_GROUP_RANK,
    COLLECTIVE_GROUP_RANKS,
    COLLECTIVE_GROUP_SIZE,
    COLLECTIVE_OP,
    COLLECTIVE_PEER,
    COLLECTIVE_SEQ,
)
from otel_gpu.calls._context import current_span
from otel_gpu.core.record import Call

__all__ = ["MODULE", "OPS", "P2P_OPS", "SPEC", "p2p_key", "span_name", "wrap"]

SPEC = "torch.distributed"
"""The target's name in ``instrument()`` and ``OTEL_GPU_INSTRUMENT``."""
MODULE = "torch.distributed.distributed_c10d"
"""Where torch defines the functions patched."""
OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
"""Point-to-point ops: their sequence number counts the calls between the same two ranks."""
_ALWAYS_ASYNC = frozenset({"isend", "irecv"})
_draw = random.random
_PEER_PARAMS = ("dst", "src", "group_dst", "group_src")

_seq: dict[str, Callable[[], int]] = {}  # group_name -> next() of its counter
_inside = threading.local()  # .op: the patched call this thread is inside, if any
# id(group) -> (the group, its fixed attributes), resolved once
_groups: dict[int, tuple[Any, dict[str, Any]]] = {}


def span_name(op: str) -> str:
    """``torch.distributed.<op>``, whatever alias the program called through."""
    return f"{SPEC}.{op}"


def wrap(original: Any, op: str) -> Any:
    """Our wrapper for ``distributed_c10d.<op>``, or ``original`` itself at level 0."""
    from otel_gpu.instrumentation.targets import decorate

    params = list(inspect.signature(original).parameters)
    position = {name: i for i, name in enumerate(params)}
    always_async = op in _ALWAYS_ASYNC
    p2p = op in P2P_OPS

    def argument(args: tuple, kwargs: dict, name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = position.get(name)
        return args[i] if i is not None and i < len(args) else None

    peer_params = tuple(n for n in _PEER_PARAMS if n in position)  # decided once, per op
    name = span_name(op)

    def counted(args: tuple, kwargs: dict) -> tuple[dict[str, Any], str, int | None]:
        """The group's attributes, the key of the call's sequence counter, and the peer."""
        group = _group_attributes(argument(args, kwargs, "group"))
        peer = None
        for param in peer_params:
            value = argument(args, kwargs, param)
            if isinstance(value, int):
                ranks = group[COLLECTIVE_GROUP_RANKS]
                peer = value if not param.startswith("group_") else ranks[value]
                break
        key = group[COLLECTIVE_GROUP_ID]
        if p2p:  # counted per pair of ranks: the ranks not involved never see these calls
            me = group[COLLECTIVE_GROUP_RANKS][group[COLLECTIVE_GROUP_RANK]]
            key = p2p_key(key, me, peer)
        return group, key, peer

    def attributes(args: tuple, kwargs: dict, is_async: bool) -> dict[str, Any]:
        group, key, peer = counted(args, kwargs)
        attrs = dict(group)
        attrs[COLLECTIVE_OP] = op
        attrs[COLLECTIVE_ASYNC_OP] = is_async
        if peer is not None:
            attrs[COLLECTIVE_PEER] = peer
        attrs[COLLECTIVE_SEQ] = _next_seq(key)
        return attrs

    def count(args: tuple, kwargs: dict) -> None:
        """A call not recorded (armed at level 0, sampled out) still takes its number, so the
        numbers agree with ranks that record, whenever each was raised."""
        try:
            _next_seq(counted(args, kwargs)[1])
        except Exception as exc:
            _guard.internal_error("collective", exc)

    def inner(*args: Any, **kwargs: Any) -> Any:
        # the path of every level: inside the call's span where it is recorded (the decorator
        # made it current), the function itself where it is not (then the current span is
        # someone else's, which gets nothing)
        current = current_span()
        if isinstance(current, Call) and current.name == name:
            try:
                current.set_attributes(attributes(args, kwargs, False))
            except Exception as exc:
                _guard.internal_error("collective", exc)
        else:
            count(args, kwargs)
        return original(*args, **kwargs)

    functools.update_wrapper(inner, original)
    sync = decorate(inner, name, instrumented=SPEC)
    plan = getattr(sync, "__otel_gpu_plan__", None)
    # armed (OTEL_GPU_CONTROL=on): patched at every level, since control may raise it; an async
    # collective runs its lifecycle itself, with the plan of the level control put in place
    entry = getattr(sync, "__otel_gpu_armed__", None)
    if entry is None and (sync is inner or plan is None or plan.level == 0):
        return original  # level 0, not armed: nothing patched

    def collective(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "op", None) is not None:  # torch's own use inside an observed call
            return original(*args, **kwargs)
        _inside.op = op
        try:
            if entry is not None and entry.level == 0:  # armed, recording nothing now
                count(args, kwargs)
                return original(*args, **kwargs)
            if always_async or argument(args, kwargs, "async_op"):
                now = plan
                if entry is not None:
                    now = entry.plan_in_force()
                    if now is None or (entry.sample is not None and _draw() >= entry.sample):
                        count(args, kwargs)
                        return original(*args, **kwargs)
                return _run_async(now, original, args, kwargs, attributes)
            return sync(*args, **kwargs)
        finally:
            _inside.op = None

    functools.update_wrapper(collective, original)
    collective.__otel_gpu_plan__ = plan  # type: ignore[attr-defined]
    return collective


def p2p_key(group_id: str, rank: int, peer: int | None) -> str:
    """The counter of the p2p calls between two global ranks of a group (``any`` peer: a
    ``recv`` from any source, which nothing can line up)."""
    if peer is None:
        return f"{group_id}/p2p/{rank}-any"
    low, high = sorted((rank, peer))
    return f"{group_id}/p2p/{low}-{high}"


def _next_seq(group_id: str) -> int:
    counter = _seq.get(group_id)
    if counter is None:
        counter = _seq.setdefault(group_id, itertools.count(1).__next__)
    return counter()


def _group_attributes(group: Any) -> dict[str, Any]:
    """The group's name, id, ranks, size and our rank in it (resolved once per group)."""
    pg = group if group is not None else _default_group()
    cached = _groups.get(id(pg))
    if cached is not None and cached[0] is pg:  # the reference kept makes the id unique
        return cached[1]
    import torch.distributed as dist

    group_id = str(getattr(pg, "group_name", "") or "")
    ranks = [int(r) for r in dist.get_process_group_ranks(pg)]
    attrs = {
        COLLECTIVE_GROUP_ID: group_id,
        COLLECTIVE_GROUP_NAME: str(getattr(pg, "group_desc", "") or group_id),
        COLLECTIVE_GROUP_RANKS: ranks,
        COLLECTIVE_GROUP_SIZE: len(ranks),
        COLLECTIVE_GROUP_RANK: int(dist.get_rank(pg)),
    }
    _groups[id(pg)] = (pg, attrs)
    return attrs


def _default_group() -> Any:
    """The default group: c10d's world state read directly (``_get_default_group()`` checks
    and reads it four times a call), torch's own function where that state is not there."""
    c10d = sys.modules["torch.distributed.distributed_c10d"]  # imported: its functions run
    try:
        pg = c10d._world.default_pg
    except AttributeError:
        pg = None
    return pg if pg is not None else c10d._get_default_group()


def _run_async(
    plan: Any,
    original: Any,
    args: tuple,
    kwargs: dict,
    attributes: Callable[[tuple, dict, bool], dict[str, Any]],
) -> Any:
    """An async call: the span starts now and ends when its work completes."""
    from otel_gpu.calls import lifecycle
    from otel_gpu.core.record import Call
    from otel_gpu.export import pipeline

    internal = _guard.internal_error
    try:
        attrs = attributes(args, kwargs, True)
    except Exception as exc:
        internal("collective", exc)
        attrs = {}
    pipe = pipeline.get()
    call = lifecycle.begin(plan, pipe) if pipe is not None else None
    if call is None or pipe is None:
        return original(*args, **kwargs)
    if not isinstance(call, Call):
        return lifecycle.run_unsampled(call, original, args, kwargs, plan, pipe)
    call.span.set_attributes(attrs)
    token = lifecycle.start(call, pipe, args, kwargs, deferred=True)
    try:
        work = original(*args, **kwargs)
    except BaseException as exc:
        lifecycle.finish(call, pipe, None, token, exc)
        raise
    lifecycle.detach(token)
    call.bound = None
    call.args = None
    future = None
    try:
        future = work.get_future() if work is not None else None
    except Exception:  # the backend's work has no future (gloo's send/recv work, say)
        future = None
    if future is None:
        call.span.set_attribute(COLLECTIVE_ASYNC_END, "call_returned")
        lifecycle.finish(call, pipe, None)
        return work

    def done(fut: Any) -> None:
        # on the thread that completes the work, or here when it is complete already
        call.span.set_attribute(COLLECTIVE_ASYNC_END, "work_completed")
        failed = None
        try:
            fut.value()
        # the work failed: the span says so, and the program's own wait() raises
        except BaseException as exc:
            failed = exc
        lifecycle.finish(call, pipe, None, None, failed)

    try:
        future.add_done_callback(done)
    except Exception as exc:
        internal("collective", exc)
        call.span.set_attribute(COLLECTIVE_ASYNC_END, "call_returned")
        lifecycle.finish(call, pipe, None)
    return work


def install(register: Callable[[str, str, Callable[[Any], Any]], list[str]]) -> list[str]:
    """Patch every op through ``register(spec, span name, wrap)`` (targets.py's patching)."""
    done: list[str] = []
    for op in OPS:
        done += register(f"{MODULE}.{op}", span_name(op), functools.partial(_wrap_op, op=op))
    return done


def _wrap_op(original: Any, op: str) -> Any:
    return wrap(original, op)


def _reset_for_tests() -> None:
    _seq.clear()
    _groups.clear()
