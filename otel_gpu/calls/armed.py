"""Armed functions: decorated functions whose level live control can change (``OTEL_GPU_CONTROL``).

With ``OTEL_GPU_CONTROL=on`` the decorator returns, at every level, a trampoline that calls the
function's *current path*: the function itself at level 0, the level-N wrapper otherwise. The
path is one closure variable, read once per call; a level change builds the new level's plan and
wrapper (as decoration would have) and swaps it in. No path checks a level per call: deciding at
decoration stays deciding at decoration, the decision can only be redone. The trampoline is the
whole cost of being controllable (``otel-gpu bench``: the armed level-0 row). At level 0 a plain
function's trampoline has the function's own parameters and passes them on one by one (no
``*args``/``**kwargs`` packing); with another level's wrapper in place it passes the call on as
made, so the wrapper binds it as it would have (see :func:`_trampoline`).

Each armed function registers here, weakly: a function that is dropped leaves the registry.
Control (:mod:`otel_gpu.control.state`) sets the :data:`Rule` that decides each function's
level and sampling, and every armed function, present and future, follows it.

Under ``torch.compile`` a graph compiled before a change keeps the path it traced, unless
Dynamo guards on the trampoline's closure and recompiles (docs/control.md says what was seen).
"""

from __future__ import annotations

import functools
import inspect
import keyword
import random
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

from otel_gpu import _guard, config
from otel_gpu.core.plan import Plan, qualified_name, shape_of

__all__ = ["Armed", "Rule", "arm", "entries", "refollow", "rule_in_force", "set_rule"]

Builder = Callable[[config.Settings], Any]
"""Builds the wrapper of a function for the given settings (their ``level``, > 0)."""

Rule = Callable[["Armed"], "tuple[int, float | None] | None"]
"""For one armed function: ``(level, sample ratio or None)`` as control wants it, or None for
its configured path."""


class Armed:
    """One armed function: its names (what control's globs match), its configured level, and how
    to build and swap in the path of another level."""

    __slots__ = (
        "__weakref__",
        "_build",
        "_paths",
        "_set",
        "_settings",
        "fn",
        "level",
        "name",
        "qualified",
        "sample",
    )

    def __init__(
        self,
        fn: Any,
        name: str,
        qualified: str,
        settings: config.Settings,
        build: Builder,
        set_path: Callable[[Any], None],
        configured: Any,
    ) -> None:
        self.fn = fn
        self.name = name
        """The span name."""
        self.qualified = qualified
        """``module.qualname``."""
        self.level = settings.level
        """The level the path now in place records at."""
        self.sample: float | None = None
        """The share of calls control samples on that path (None: every call)."""
        self._build = build
        self._set = set_path
        self._paths: dict[int, Any] = {settings.level: configured}
        self._paths[0] = fn
        self._settings = settings

    @property
    def configured_level(self) -> int:
        return self._settings.level

    def follow(self, want: tuple[int, float | None] | None) -> None:
        """Swap in the path for ``want`` (None: the configured one). Builds a level's wrapper
        once and keeps it, so switching back and forth costs nothing after the first time."""
        level, sample = (self._settings.level, None) if want is None else want
        path = self._paths.get(level)
        if path is None:
            path = self._build(config.with_changes(self._settings, level=level))
            self._paths[level] = path
        if sample is not None and sample < 1.0 and level > 0:
            path = _sampled(path, self.fn, sample)
        else:
            sample = None
        self._set(path)
        self.level = level
        self.sample = sample

    def plan_in_force(self) -> Plan | None:
        """The plan of the level now in place (None at level 0): for a caller that runs a call's
        lifecycle itself, as an asynchronous collective does, instead of calling the path."""
        if self.level == 0:
            return None
        path = self._paths.get(self.level)
        return getattr(path, "__otel_gpu_plan__", None)

    def boost(self, level: int, calls: int, done: Callable[[], None]) -> bool:
        """Take ``level``'s path for the next ``calls`` calls (a trigger fired), then call
        ``done``, which puts back the path the rule gives. False, changing nothing, when the
        function already records at ``level`` or above. The countdown is on the boosted path
        only: the other paths stay as they are."""
        if level <= self.level:
            return False
        path = self._paths.get(level)
        if path is None:
            path = self._build(config.with_changes(self._settings, level=level))
            self._paths[level] = path
        left = [calls]

        def count() -> None:
            left[0] -= 1
            if left[0] == 0:  # the last boosted call: later calls take the rule's path
                try:
                    done()
                except Exception as exc:
                    _guard.internal_error("control", exc)

        if inspect.iscoroutinefunction(self.fn):

            async def boosted_async(*args: Any, **kwargs: Any) -> Any:
                count()
                return await path(*args, **kwargs)

            self._set(boosted_async)
        else:

            def boosted(*args: Any, **kwargs: Any) -> Any:
                count()
                return path(*args, **kwargs)

            self._set(boosted)
        self.level = level
        self.sample = None
        return True


_registry: weakref.WeakSet[Armed] = weakref.WeakSet()
_lock = threading.RLock()
_rule: Rule | None = None


def entries() -> list[Armed]:
    """The armed functions alive now."""
    with _lock:
        return list(_registry)


def set_rule(rule: Rule | None) -> list[Armed]:
    """Make ``rule`` decide every armed function's path (None: back to the configured paths);
    returns the functions whose level it changed."""
    global _rule
    changed = []
    with _lock:
        _rule = rule
        for entry in list(_registry):
            before = entry.level
            _follow(entry, rule)
            if entry.level != before:
                changed.append(entry)
    return changed


def rule_in_force() -> Rule | None:
    """The rule the armed functions follow now (None: their configured paths)."""
    return _rule


def refollow(entry: Armed) -> None:
    """Put ``entry`` back on the path the rule in force gives it (after a trigger's boost)."""
    with _lock:
        _follow(entry, _rule)


def _follow(entry: Armed, rule: Rule | None) -> None:
    try:
        entry.follow(rule(entry) if rule is not None else None)
    except Exception as exc:  # a wrapper that cannot be built keeps the path it has
        _guard.internal_error("control", exc)


def arm(fn: Any, name: str | None, settings: config.Settings, build: Builder) -> Any:
    """The trampoline for ``fn`` decorated under ``settings`` (``name``: its span name, None for
    ``module.qualname``): its configured path now, any level's path once control asks."""
    target = shape_of(fn).target
    qualified = qualified_name(target)
    name = name or qualified
    configured = build(settings) if settings.level > 0 else fn
    set_path: Callable[[Any], None]
    if inspect.iscoroutinefunction(fn):
        path = configured

        def set_async_path(new: Any) -> None:
            nonlocal path
            path = new

        set_path = set_async_path

        @functools.wraps(fn)
        async def armed_async(*args: Any, **kwargs: Any) -> Any:
            return await path(*args, **kwargs)

        trampoline: Any = armed_async
    else:
        trampoline, set_path = _trampoline(fn)
        set_path(configured)
    entry = Armed(fn, name, qualified, settings, build, set_path, configured)
    plan = getattr(configured, "__otel_gpu_plan__", None)
    if plan is None:
        plan = Plan(name, settings.level)
        plan.module = getattr(target, "__module__", None) or type(target).__module__
        plan.qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    trampoline.__otel_gpu_plan__ = plan
    trampoline.__otel_gpu_armed__ = entry
    with _lock:
        _registry.add(entry)
        if _rule is not None:
            _follow(entry, _rule)
    return trampoline


_CELL = "__otel_gpu_path"  # the trampolines' closure variable: no parameter may take its name
_SOURCE = """
def make({cell}):
    def exact({params}):
        return {cell}({forward})

    def generic(*args, **kwargs):
        return {cell}(*args, **kwargs)

    def set_cell(new):
        nonlocal {cell}
        {cell} = new

    return exact, generic, set_cell
"""


def _trampoline(fn: Any) -> tuple[Any, Callable[[Any], None]]:
    """The trampoline of a synchronous ``fn`` and the function that swaps its path.

    Two bodies share one closure variable, the path: ``generic`` passes ``*args, **kwargs``
    through, as a level's wrapper expects its calls (it binds them itself); ``exact`` has
    ``fn``'s own parameters (no defaults written: they are ``fn``'s own ``__defaults__``) and
    passes them on one by one, without packing a tuple and a dict. Where the path is ``fn``
    itself (level 0) the trampoline runs ``exact``'s code, otherwise ``generic``'s: the code
    object is swapped with the path, so neither body checks anything per call. A callable that
    is not a plain Python function gets ``generic`` only.

    The source is built from the names in ``fn.__code__`` alone (parameter names, each checked
    to be an identifier), never from a value.
    """
    params, forward = _signature_text(fn)
    text = _SOURCE.format(cell=_CELL, params=params or "", forward=forward or "")
    namespace: dict[str, Any] = {"__builtins__": {}}
    exec(compile(text, "<otel-gpu armed trampoline>", "exec"), namespace)
    exact, generic, set_cell = namespace["make"](fn)
    if params is None:
        return functools.wraps(fn)(generic), set_cell
    trampoline: Any = functools.wraps(fn)(exact)
    trampoline.__defaults__ = fn.__defaults__
    trampoline.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    fast, slow = exact.__code__, generic.__code__

    def set_path(new: Any) -> None:
        # in this order, a call between the two steps runs with a body that accepts its path
        if new is fn:
            set_cell(new)
            trampoline.__code__ = fast
        else:
            trampoline.__code__ = slow
            set_cell(new)
        _forget_signature(trampoline)

    return trampoline, set_path


def _forget_signature(fn: Any) -> None:
    """Drop what Dynamo remembers of ``fn``'s parameters: it keeps them per function object
    (``torch._dynamo.variables.functions._spec_cache``), and the trampoline's code, so its
    parameters, just changed. Without it, the next trace binds the call to the old parameters."""
    functions = sys.modules.get("torch._dynamo.variables.functions")
    cache = getattr(functions, "_spec_cache", None)
    if cache is not None:
        try:
            cache.pop(fn, None)
        except Exception as exc:  # a torch whose cache is something else
            _guard.internal_error("control", exc)


def _signature_text(fn: Any) -> tuple[str | None, str | None]:
    """``(parameters, forwarded arguments)`` as source text for a plain function, from its code
    object; ``(None, None)`` for anything else."""
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or not isinstance(code, types.CodeType):
        return None, None
    n, n_posonly, n_kwonly = code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount
    names = code.co_varnames
    positional, kwonly = list(names[:n]), list(names[n : n + n_kwonly])
    at = n + n_kwonly
    star = names[at] if code.co_flags & inspect.CO_VARARGS else None
    at += 1 if star else 0
    dstar = names[at] if code.co_flags & inspect.CO_VARKEYWORDS else None
    every = [*positional, *kwonly, *(x for x in (star, dstar) if x)]
    if any(not _plain_name(x) for x in every):
        return None, None
    params = positional[:n_posonly] + (["/"] if n_posonly else []) + positional[n_posonly:]
    params += [f"*{star}"] if star else (["*"] if kwonly else [])
    params += kwonly + ([f"**{dstar}"] if dstar else [])
    forward = positional + ([f"*{star}"] if star else [])
    forward += [f"{k}={k}" for k in kwonly] + ([f"**{dstar}"] if dstar else [])
    return ", ".join(params), ", ".join(forward)


def _plain_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name.isidentifier()
        and name.isascii()
        and not keyword.iskeyword(name)
        and name != _CELL
    )


def _sampled(path: Any, fn: Any, ratio: float) -> Any:
    """Head sampling for a path control turned on: a share ``ratio`` of calls take ``path``,
    the others run as the function itself (no span, no cost but the draw)."""
    draw = random.random
    if inspect.iscoroutinefunction(fn):

        async def sampled_async(*args: Any, **kwargs: Any) -> Any:
            if draw() < ratio:
                return await path(*args, **kwargs)
            return await fn(*args, **kwargs)

        return sampled_async

    def sampled(*args: Any, **kwargs: Any) -> Any:
        if draw() < ratio:
            return path(*args, **kwargs)
        return fn(*args, **kwargs)

    return sampled


def _reset_for_tests() -> None:
    """Forget every armed function and the rule (a test's functions outlive it until the GC)."""
    global _rule
    with _lock:
        _registry.clear()
        _rule = None
