"""``Plan``: what a decorated function's calls must do, fixed at decoration time; and the
callable shapes (how a callable's calls bind, where its receiver is).

The decorator fills a plan (:func:`otel_gpu.calls.decorator.make_plan`: the binder, the
redacted parameters, the graph-capture check); every other part of otel-gpu only reads one. A
span otel-gpu makes on its own (a stuck-call report, a snapshot) gets a plan with a name, a
level and attributes, and the defaults for the rest.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Binder", "Plan", "Shape", "innermost", "qualified_name", "shape_of"]

Binder = Callable[[tuple[Any, ...], Mapping[str, Any]], list[tuple[str, Any, bool]]]
"""``(args, kwargs) -> [(name, value, is_default), ...]``: a call's arguments, bound once."""


class Plan:
    """What a decorated function's calls must do, fixed at decoration time."""

    __slots__ = (
        "__weakref__",
        "attributes",
        "binder",
        "capture_stats",
        "instrumented",
        "level",
        "max_items",
        "memory",
        "module",
        "name",
        "on_nonfinite",
        "param_names",
        "qualname",
        "read_later",
        "receiver",
        "receiver_passed",
        "redact",
        "redacted",
        "replay_note",
        "skip",
    )

    def __init__(self, name: str, level: int, attributes: dict[str, Any] | None = None) -> None:
        self.name = name
        """The span name."""
        self.level = level
        """The level the function was decorated at."""
        self.attributes: dict[str, Any] = {} if attributes is None else attributes
        """Attributes every span of the plan carries (``code.*``, a module's path)."""
        self.module = ""
        self.qualname = ""
        self.max_items = 0
        self.on_nonfinite = "mark"
        self.binder: Binder | None = None
        """Binds a call's arguments (level 3 and up)."""
        self.redact: tuple[str, ...] = ()
        self.redacted: frozenset[str] = frozenset()
        """Top-level parameter names that look like secrets (the flight recorder uses this)."""
        self.receiver_passed = False
        """Calls pass the receiver as ``args[0]`` (a function decorated in a class body)."""
        self.receiver: Any = None
        """A bound method's ``__self__``, or a callable object itself."""
        self.replay_note: str | None = None
        self.instrumented: str | None = None
        """The ``otel_gpu.instrument()`` target that made this plan."""
        self.skip = 0
        """Positional arguments before the parameters (the receiver passed as ``args[0]``)."""
        self.param_names: Sequence[str] = ()
        """Positional parameter names after the receiver (under ``torch.compile``)."""
        self.capture_stats: Callable[[], bool] | None = None
        """Level 5 and up where CUDA exists: whether a CUDA graph capture is in progress."""
        self.read_later = False
        """Level 5 to 9 where CUDA exists, OTEL_GPU_STATS_READ=async and the non-finite policy
        mark: statistics on a CUDA device are read off the caller's thread
        (calls/stats_reader.py)."""
        self.memory = 0
        """Level 3 and up where CUDA exists: memory per call is read (calls/memory.py), by the
        outermost call only (1) or by every call (2); 0: never."""


class Shape:
    """How a callable is called: where its signature comes from and where its receiver is."""

    __slots__ = ("receiver", "receiver_passed", "replay_note", "signature_source", "target")

    def __init__(
        self,
        target: Any,
        signature_source: Any,
        receiver_passed: bool,
        receiver: Any,
        replay_note: str | None = None,
    ) -> None:
        self.target = target  # the innermost function: name and code.* come from it
        self.signature_source = signature_source  # what inspect.signature() binds the call to
        self.receiver_passed = receiver_passed  # args[0] is self/cls
        self.receiver = receiver  # a bound method's __self__, or a callable object itself
        self.replay_note = replay_note


def qualified_name(fn: Any) -> str:
    """module.Class.method from __qualname__; partials and callable objects fall back to their type."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}"


def innermost(fn: Any) -> Any:
    """The function at the bottom of a ``__wrapped__`` chain (``fn`` itself on a cycle)."""
    try:
        return inspect.unwrap(fn) if hasattr(fn, "__wrapped__") else fn
    except ValueError:  # a __wrapped__ cycle
        return fn


def shape_of(fn: Any) -> Shape:
    """Decide, once, how calls of ``fn`` bind: every callable shape gets the right names and receiver.

    A bound method whose function carries ``__wrapped__`` (``functools.wraps``, ``torch.no_grad``)
    unwraps to a plain function with ``self`` first, yet its calls never pass ``self``: binding
    must follow the bound method's own signature, or every argument shifts by one.
    """
    if isinstance(fn, types.MethodType):
        return Shape(innermost(fn.__func__), fn, False, fn.__self__)
    if isinstance(fn, functools.partial):
        note = "a functools.partial: replay cannot rebuild the arguments it binds"
        return Shape(innermost(fn.func), fn, False, None, note)
    if inspect.isfunction(fn) or hasattr(fn, "__wrapped__"):
        return Shape(innermost(fn), fn, True, None)
    if inspect.isbuiltin(fn) or inspect.isroutine(fn) or isinstance(fn, type):
        return Shape(fn, fn, False, None)
    # a callable object: its __call__ is bound to it; the object is the receiver
    return Shape(fn, fn, False, fn, None)
