"""Describe user objects off the caller's thread, with a time bound.

An exception's ``__str__`` and its traceback are user code: they may raise ``SystemExit``,
sleep, or walk a million items. The caller's thread never runs them. It takes the type and
``id()`` and hands the object to one daemon thread, the describer, which fills in a
placeholder in the manifest node (a dict value, assigned in place: a writer serialising the
node meanwhile sees the placeholder or the text, never a half-changed dict).

An argument's description (:func:`later`) runs no user code at all: not its ``__repr__``,
which could end the process with ``os._exit`` (nothing catches that), nor the ``__repr__`` of
anything inside it. :func:`safe_repr` formats builtin atoms and containers itself, read
through the builtin types' own methods, at most :data:`MAX_LEVEL` levels deep (a list nested
100,000 deep would overflow the C stack in the builtin ``repr``) and :data:`MAX_ITEMS` items
a container; anything else is its type and id.

Time bound: a description that takes longer than :data:`BUDGET_S` is recorded as
timed out, its type is never described again in this process, and every object
still queued behind it is recorded as not described. While the describer is busy
past the budget, new objects are not queued at all. A describer stuck forever costs
one daemon thread: nothing joins it, not the export thread, not exit.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import os
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "BUDGET_S",
    "MAX_ITEMS",
    "MAX_LEVEL",
    "PENDING",
    "drain",
    "exception_record",
    "exception_text",
    "later",
    "safe_repr",
]

BUDGET_S = 0.5
"""Seconds one description may take before it is recorded as timed out."""
_EXCEPTION_WAIT_S = 0.05
"""How long a raising call waits for its exception's message and traceback (then a placeholder)."""
_QUEUE_ITEMS = 256
_TEXT_LIMIT = 200  # characters of a repr kept in a manifest
_TRACEBACK_LIMIT = 64 * 1024

PENDING = "<not described yet: described after the call, off the caller's thread>"

_Job = tuple[dict[str, Any], str, Callable[[], Any], type]


class _Describer:
    """One daemon thread and its queue; see the module docstring for the time bound."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: collections.deque[_Job] = collections.deque()
        self.ready = threading.Condition(threading.Lock())
        self.busy_since: float | None = None
        self.slow: set[type] = set()  # types whose description once exceeded the budget
        self.idle = threading.Event()
        self.idle.set()
        self.thread = threading.Thread(target=self._loop, name="otel-gpu-describer", daemon=True)
        self.thread.start()

    def submit(self, node: dict[str, Any], key: str, fn: Callable[[], Any], tp: type) -> bool:
        """Queue ``fn`` to fill ``node[key]``; False (node left as is) when it cannot be queued."""
        if tp in self.slow:
            node[key] = (
                f"<not described: describing a {tp.__qualname__} once took over {BUDGET_S} s>"
            )
            return False
        with self.ready:
            since = self.busy_since
            if since is not None and time.monotonic() - since > BUDGET_S:
                node[key] = f"<not described: the describer is busy past its {BUDGET_S} s budget>"
                return False
            if len(self.jobs) >= _QUEUE_ITEMS:
                node[key] = "<not described: too many objects waiting to be described>"
                return False
            self.jobs.append((node, key, fn, tp))
            self.idle.clear()
            self.ready.notify()
        return True

    def _loop(self) -> None:
        while True:
            with self.ready:
                while not self.jobs:
                    self.idle.set()
                    self.ready.wait()
                node, key, fn, tp = self.jobs.popleft()
                self.busy_since = started = time.monotonic()
            try:
                text: Any = fn()
            except BaseException as exc:  # user code: SystemExit included
                text = f"<failed: {_type_name(exc)}>"
            took = time.monotonic() - started
            with self.ready:
                self.busy_since = None
                if took > BUDGET_S:
                    self.slow.add(tp)
                    text = f"<not described: took {took:.1f} s, over the {BUDGET_S} s budget>"
                    dropped, self.jobs = self.jobs, collections.deque()
                else:
                    dropped = collections.deque()
            node[key] = text
            for other, other_key, _, _ in dropped:
                other[other_key] = "<not described: queued behind a description that timed out>"
            del node, fn, dropped, text  # drop the user's objects now, not at the next job


_describer: _Describer | None = None
_lock = threading.Lock()


def _get() -> _Describer:
    global _describer
    describer = _describer
    if describer is None or describer.pid != os.getpid():  # a fork child has no thread
        with _lock:
            describer = _describer
            if describer is None or describer.pid != os.getpid():
                describer = _describer = _Describer()
    return describer


def _type_name(value: Any) -> str:
    tp = type(value)  # never value.__class__: a property can lie or raise
    return str(type.__dict__["__qualname__"].__get__(tp))


MAX_LEVEL = 4
"""Container levels :func:`safe_repr` shows; deeper ones are ``[...]``."""
MAX_ITEMS = 8
"""Items of a container :func:`safe_repr` shows; more are ``...``."""
_ATOM_BITS = 256  # ints past this many bits are described by their size


def safe_repr(value: Any, limit: int = _TEXT_LIMIT) -> str:
    """A repr of ``value`` that runs none of its code, cut at ``limit`` characters.

    Builtin atoms print as ``repr`` prints them; lists, tuples, dicts, sets (subclasses
    included, under their type's name) are read through the builtin methods, bounded in depth
    and items; enum members with the standard repr and dataclasses with the generated one are
    formatted as those reprs would; anything else is ``<module.Type object at 0x...>``.
    """
    text = _safe(value, 0)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _safe(value: Any, level: int) -> str:
    tp = type(value)
    if tp in _ATOMS:
        return repr(value)  # builtin code of bounded cost
    if tp is int:
        bits = value.bit_length()
        return repr(value) if bits <= _ATOM_BITS else f"<int of {bits} bits>"
    if tp is str or tp is bytes:
        return repr(value[:_TEXT_LIMIT]) + ("..." if len(value) > _TEXT_LIMIT else "")
    for base, (left, right) in _CONTAINERS.items():
        if issubclass(tp, base):
            return _container(value, tp, base, left, right, level)
    if issubclass(tp, enum.Enum):
        return _enum(value, tp)
    text = _dataclass(value, tp, level)
    if text is not None:
        return text
    module = type.__dict__["__module__"].__get__(tp)
    return f"<{module}.{_type_name(value)} object at 0x{id(value):x}>"


_ATOMS = frozenset(
    (type(None), bool, float, complex, type(Ellipsis), range, torch.dtype, torch.device)
)
_CONTAINERS: dict[type, tuple[str, str]] = {
    list: ("[", "]"),
    tuple: ("(", ")"),
    dict: ("{", "}"),
    frozenset: ("frozenset({", "})"),
    set: ("{", "}"),
}


def _container(value: Any, tp: type, base: Any, left: str, right: str, level: int) -> str:
    length = base.__len__(value)
    if length == 0:
        inner = ""
    elif level >= MAX_LEVEL:
        inner = "..."
    else:
        if base is dict:
            pairs = itertools.islice(dict.items(value), MAX_ITEMS)
            parts = [f"{_safe(k, level + 1)}: {_safe(v, level + 1)}" for k, v in pairs]
        else:
            items = itertools.islice(base.__iter__(value), MAX_ITEMS)
            parts = [_safe(item, level + 1) for item in items]
        if length > MAX_ITEMS:
            parts.append("...")
        inner = ", ".join(parts) + ("," if base is tuple and length == 1 else "")
    text = f"{left}{inner}{right}"
    if tp is base:
        return "set()" if base is set and not length else text
    return f"{_type_name(value)}({text})"


def _enum(member: Any, tp: type) -> str:
    """``<Mode.A: 0>`` when the enum keeps the standard repr; its type and name otherwise."""
    from otel_gpu.calls.metadata import instance_dict

    attrs = instance_dict(member) or {}
    name, inner = attrs.get("_name_"), attrs.get("_value_")
    if type(name) is not str:
        return f"<{_type_name(member)} member>"
    standard = _lookup(tp, "__repr__") is enum.Enum.__repr__
    if standard and type(inner) in (int, str, float, bool):
        return f"<{_type_name(member)}.{name}: {_safe(inner, MAX_LEVEL)}>"
    return f"<{_type_name(member)}.{name}>"


def _lookup(tp: type, name: str) -> Any:
    """``name`` as found along ``tp``'s MRO, from the classes' own dicts: no metaclass code."""
    for cls in type.__dict__["__mro__"].__get__(tp):
        namespace = type.__dict__["__dict__"].__get__(cls)
        if name in namespace:
            return namespace[name]
    return None


def _dataclass(value: Any, tp: type, level: int) -> str | None:
    """``Point(x=1, y=2)`` for a dataclass with the generated ``__repr__``, fields from its
    instance dict (no property, no ``__getattribute__`` runs)."""
    from otel_gpu.calls.metadata import instance_dict

    fields = _lookup(tp, "__dataclass_fields__")
    method = _lookup(tp, "__repr__")
    if type(fields) is not dict or type(method) is not types.FunctionType:
        return None
    if method.__code__.co_filename != dataclasses.__file__:
        return None  # a repr the class wrote itself
    attrs = instance_dict(value)
    if attrs is None:
        return None
    parts = []
    for name, field in itertools.islice(dict.items(fields), 32):
        if field._field_type is not dataclasses._FIELD or not field.repr:  # type: ignore[attr-defined]
            continue
        shown = _safe(attrs[name], level + 1) if name in attrs else "..."
        parts.append(f"{name}={shown}")
    return f"{_type_name(value)}({', '.join(parts)})"


def later(node: dict[str, Any], key: str, value: Any) -> None:
    """Set ``node[key]`` to ``value``'s :func:`safe_repr` once the describer gets to it.

    ``node[key]`` holds :data:`PENDING` until then. Holds a reference to ``value`` until described.
    """
    node[key] = PENDING
    _get().submit(node, key, lambda: safe_repr(value), type(value))


def exception_record(
    exc: BaseException, tb: Any, wait: float = _EXCEPTION_WAIT_S
) -> dict[str, str]:
    """``{"type", "message", "traceback"}`` of a raised exception, for a manifest.

    The message and traceback run the exception's ``__str__`` and read its chained
    exceptions: user code. They are formatted by the describer; the caller waits at most
    ``wait`` seconds (50 ms by default), then the record holds a placeholder that the
    describer replaces when it is done.
    """
    tp = type(exc)
    record = {
        "type": f"{type.__dict__['__module__'].__get__(tp)}.{_type_name(exc)}",
        "message": PENDING,
        "traceback": PENDING,
    }
    done = threading.Event()

    def format_both() -> str:
        try:
            record["message"] = _bounded_str(exc)
            record["traceback"] = _format_traceback(tp, exc, tb)
        finally:
            done.set()
        return record["traceback"]

    if _get().submit(record, "traceback", format_both, tp):
        done.wait(wait)
    if record["message"] is PENDING and record["traceback"] is not PENDING:
        record["message"] = record["traceback"]  # the describer refused: say why in both
    return record


def exception_text(exc: BaseException, tb: Any) -> tuple[str, str]:
    """The message and traceback of ``exc`` for a span, formatted by the describer.

    For the export thread: a ``__str__`` that sleeps would otherwise hold every span behind it.
    It waits at most :data:`BUDGET_S`, once per slow exception type (the describer then refuses
    that type at once); what is not ready by then is said to be so, never filled in later.
    """
    record = exception_record(exc, tb, BUDGET_S)
    late = f"<not formatted within {BUDGET_S} s: described off the export thread>"
    message, stack = record["message"], record["traceback"]
    return (late if message is PENDING else message), (late if stack is PENDING else stack)


def _bounded_str(exc: BaseException) -> str:
    try:
        text = str(exc)
    except BaseException as err:  # user code
        return f"<str() of {_type_name(exc)} failed: {_type_name(err)}>"
    if type(text) is not str:
        return f"<str() of {_type_name(exc)} returned a {_type_name(text)}>"
    return text[:_TRACEBACK_LIMIT]


def _format_traceback(tp: type, exc: BaseException, tb: Any) -> str:
    try:
        text = "".join(traceback.format_exception(tp, exc, tb))
    except BaseException as err:  # user code (__str__, chained exceptions)
        return f"<traceback of {_type_name(exc)} could not be formatted: {_type_name(err)}>"
    return text if len(text) <= _TRACEBACK_LIMIT else "...\n" + text[-_TRACEBACK_LIMIT:]


def drain(timeout: float) -> bool:
    """Wait until every queued description is done; True when it finished within ``timeout`` s."""
    describer = _describer
    if describer is None or describer.pid != os.getpid():
        return True
    return describer.idle.wait(timeout)
