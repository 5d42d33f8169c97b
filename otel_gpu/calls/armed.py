"""Armed functions: decorated functions whose level live control can change (``OTEL_GPU_CONTROL``).

With ``OTEL_GPU_CONTROL=on`` the decorator returns, at every level, a trampoline that calls the
function's *current path*: the function itself at level 0, the level-N wrapper otherwise. The
path is one closure variable, read once per call; a level change builds the new level's plan and
wrapper (as decoration would have) and swaps it in. No path checks a level per call: deciding at
decoration stays deciding at decoration, the decision can only be redone. The trampoline is the
whole cost of being controllable (``otel-gpu bench``: the armed level-0 row).

Each armed function registers here, weakly: a function that is dropped leaves the registry.
Control (:mod:`otel_gpu.control.state`) sets the :data:`Rule` that decides each function's
level and sampling, and every armed function, present and future, follows it.

Under ``torch.compile`` a graph compiled before a change keeps the path it traced, unless
Dynamo guards on the trampoline's closure and recompiles (docs/control.md says what was seen).
"""

from __future__ import annotations

import functools
import inspect
import random
import threading
import weakref
from collections.abc import Callable
from typing import Any

from otel_gpu import _guard, config
from otel_gpu.core.plan import Plan, qualified_name, shape_of

__all__ = ["Armed", "Rule", "arm", "entries", "set_rule"]

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
        self._set(path)
        self.level = level


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
    path = configured

    def set_path(new: Any) -> None:
        nonlocal path
        path = new

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def armed_async(*args: Any, **kwargs: Any) -> Any:
            return await path(*args, **kwargs)

        trampoline: Any = armed_async
    else:

        @functools.wraps(fn)
        def armed(*args: Any, **kwargs: Any) -> Any:
            return path(*args, **kwargs)  # one closure read: the path is swapped, never checked

        trampoline = armed
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
