"""Describe user objects off the caller's thread, with a time bound.

A user object's ``__repr__``, an exception's ``__str__`` and its traceback are user code:
they may raise ``SystemExit``, sleep, or walk a million items. The caller's thread
never runs them. It takes the type and ``id()`` and hands the object to one daemon
thread, the describer, which fills in a placeholder in the manifest node (a dict
value, assigned in place: a writer serialising the node meanwhile sees the
placeholder or the text, never a half-changed dict).

Time bound: a description that takes longer than :data:`BUDGET_S` is recorded as
timed out, its type is never described again in this process, and every object
still queued behind it is recorded as not described. While the describer is busy
past the budget, new objects are not queued at all. A describer stuck forever costs
one daemon thread: nothing joins it, not the export thread, not exit.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["BUDGET_S", "PENDING", "drain", "exception_record", "exception_text", "later"]

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


def _bounded_repr(value: Any) -> str:
    text = repr(value)
    if type(text) is not str:
        return f"<repr returned a {_type_name(text)}>"
    return text if len(text) <= _TEXT_LIMIT else text[: _TEXT_LIMIT - 3] + "..."


def later(node: dict[str, Any], key: str, value: Any) -> None:
    """Set ``node[key]`` to ``value``'s repr (cut at 200 characters) once the describer gets to it.

    ``node[key]`` holds :data:`PENDING` until then. Holds a reference to ``value`` until described.
    """
    node[key] = PENDING
    _get().submit(node, key, lambda: _bounded_repr(value), type(value))


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
