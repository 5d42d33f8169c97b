"""The process's control state: what live control changed, until when, and the span of each change.

:func:`apply` takes a validated :class:`~otel_gpu.control.document.Change` and applies it whole:
it merges the change into the state in force (a field the change leaves out keeps its value),
sets the rule every armed function follows (:mod:`otel_gpu.calls.armed`: each function's path
is swapped, none checks a level per call), resizes the ring, and starts the window. When the
window lapses, a timer thread puts the configured state back; the calls never look at a clock
for it. :func:`reset` puts the configured state back now.

Every change, the window's end included, is one span named ``otel_gpu.control`` (its own trace)
saying who asked, what changed, the configuration in force after it and until when
(docs/attributes.md, Control).

Thread-safe: requests come from the control listener's thread, a remote-configuration client's
thread, or the application's own.
"""

from __future__ import annotations

import fnmatch
import json
import os
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanContext, TraceFlags

from otel_gpu import _guard, config
from otel_gpu.attributes import (
    CONTROL_CHANGE,
    CONTROL_EFFECTIVE,
    CONTROL_FUNCTIONS,
    CONTROL_SOURCE,
    CONTROL_SPAN_NAME,
    CONTROL_UNTIL,
)
from otel_gpu.calls import armed
from otel_gpu.control.document import Change, ControlError
from otel_gpu.core.plan import Plan
from otel_gpu.core.record import Call, CallSpan
from otel_gpu.export import pipeline

__all__ = ["ControlError", "apply", "effective", "reset"]

_MAX_SOURCE = 128


@dataclass(frozen=True)
class _Override:
    """What control has changed; all None: the configured state."""

    level: int | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    sample: float | None = None
    ring_size: int | None = None
    until: float | None = None
    """Epoch seconds when it lapses; None: until changed."""
    source: str | None = None

    @property
    def active(self) -> bool:
        return (
            self.level is not None
            or bool(self.include or self.exclude)
            or self.sample is not None
            or self.ring_size is not None
        )


_lock = threading.RLock()
_override = _Override()
_timer: threading.Timer | None = None
_generation = 0


def apply(change: Change, source: str) -> dict[str, Any]:
    """Apply ``change`` whole, on behalf of ``source`` (who asked, for the span); returns the
    configuration in force after it (:func:`effective`). Raises :class:`ControlError`, having
    changed nothing, when the process cannot honour a field."""
    if change.reset:
        return reset(source)
    source = _source(source)
    with _lock:
        ring = _ring(build=change.ring_size is not None)
        if change.ring_size is not None and ring is None:
            raise ControlError(
                "ring_size: this process keeps no ring (it needs OTEL_GPU_RING > 0, or "
                "OTEL_GPU_ON_NONFINITE=dump, at level >= 3 when it started); nothing was changed"
            )
        old = _override
        new = _Override(
            level=change.level if change.level is not None else old.level,
            include=change.include if change.include is not None else old.include,
            exclude=change.exclude if change.exclude is not None else old.exclude,
            sample=change.sample if change.sample is not None else old.sample,
            ring_size=change.ring_size if change.ring_size is not None else old.ring_size,
            until=None if change.window is None else time.time() + change.window,
            source=source,
        )
        changed = _install(new, ring)
        _schedule(change.window)
        result = effective()
    _emit(source, change.fields(), result, len(changed))
    return result


def reset(source: str) -> dict[str, Any]:
    """Put the configured state back now (every armed function on its configured path, the
    ring at its configured size); returns :func:`effective`."""
    source = _source(source)
    with _lock:
        changed = _install(_Override(source=source), _ring())
        _schedule(None)
        result = effective()
    _emit(source, {"reset": True}, result, len(changed))
    return result


def effective() -> dict[str, Any]:
    """The configuration in force, JSON-able: ``level`` (the level control set, None: each
    function's configured level), ``include``/``exclude``, ``sample``, ``until`` (epoch seconds,
    None: until changed or nothing changed), ``ring_size`` (None: no ring), ``source`` of the
    last change, and counts of the armed functions and of those off their configured level."""
    with _lock:
        settings = config.current()
        o = _override
        ring = _ring()
        entries = armed.entries()
        return {
            "pid": os.getpid(),
            "control": settings.control,
            "configured_level": settings.level,
            "changed": o.active,
            "level": o.level,
            "include": list(o.include),
            "exclude": list(o.exclude),
            "sample": o.sample,
            "until": None if o.until is None else round(o.until, 3),
            "ring_size": None if ring is None else int(getattr(ring, "size", 0)),
            "source": o.source,
            "functions": len(entries),
            "functions_changed": sum(1 for e in entries if e.level != e.configured_level),
        }


# --------------------------------------------------------------------------- internals


def _install(new: _Override, ring: Any) -> list[armed.Armed]:
    """Make ``new`` the state in force: the armed functions' rule and the ring's size."""
    global _override
    _override = new
    if ring is not None:
        # the ring's configured size is its own settings' (a reconfigured process has a new ring)
        configured = getattr(getattr(ring, "settings", None), "ring", None)
        if new.ring_size is not None:
            ring.size = new.ring_size
        elif isinstance(configured, int):
            ring.size = configured
    if not new.active:
        return armed.set_rule(None)
    return armed.set_rule(_rule_of(new))


def _rule_of(o: _Override) -> armed.Rule:
    include, exclude, level, sample = o.include, o.exclude, o.level, o.sample

    def rule(entry: armed.Armed) -> tuple[int, float | None] | None:
        if not selected(entry.qualified, entry.name, include, exclude):
            return None
        return (entry.configured_level if level is None else level, sample)

    return rule


def selected(qualified: str, name: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    """Whether a function (``module.qualname``, span name) is one a change applies to: it
    matches an include glob (or there is none) and no exclude glob."""

    def hit(patterns: tuple[str, ...]) -> bool:
        return any(
            fnmatch.fnmatchcase(qualified, p) or fnmatch.fnmatchcase(name, p) for p in patterns
        )

    return (not include or hit(include)) and not hit(exclude)


def _schedule(window: float | None) -> None:
    """Start the window's timer (cancelling the last one); None: no timer."""
    global _timer, _generation
    _generation += 1
    if _timer is not None:
        _timer.cancel()
        _timer = None
    if window is None:
        return
    timer = threading.Timer(window, _lapse, (_generation,))
    timer.name = "otel-gpu-control-window"
    timer.daemon = True
    timer.start()
    _timer = timer


def _lapse(generation: int) -> None:
    with _lock:
        if generation != _generation or not _override.active:
            return  # a later change replaced this window
    try:
        reset("window end")
    except Exception as exc:
        _guard.internal_error("control", exc)


def _ring(build: bool = False) -> Any:
    """The pipeline's ring, or None; ``build``: build the pipeline if no call has yet (a
    process at armed level 0 has none, and its ring comes with it)."""
    pipe = pipeline.get() if build else pipeline.current()
    return None if pipe is None else pipe.ring


def _source(source: str) -> str:
    text = str(source)[:_MAX_SOURCE]
    return "".join(c if c.isprintable() else "?" for c in text) or "unknown"


def _emit(source: str, fields: Mapping[str, Any], result: Mapping[str, Any], changed: int) -> None:
    """The change's span, exported with the process's other spans (its own trace)."""
    try:
        pipe = pipeline.get()
        if pipe is None:
            return
        now = time.time_ns()
        plan = Plan(CONTROL_SPAN_NAME, 1)
        ctx = SpanContext(
            random.getrandbits(128) or 1,
            random.getrandbits(64) or 1,
            False,
            TraceFlags(TraceFlags.SAMPLED),
        )
        record = Call(plan, CallSpan(ctx, plan.name), None, now)
        record.end_ns = now
        attrs: dict[str, Any] = {
            CONTROL_SOURCE: source,
            CONTROL_CHANGE: json.dumps(dict(fields), sort_keys=True),
            CONTROL_EFFECTIVE: json.dumps(dict(result), sort_keys=True),
            CONTROL_FUNCTIONS: changed,
        }
        if result.get("until") is not None:
            attrs[CONTROL_UNTIL] = float(result["until"])
        record.span.set_attributes(attrs)
        pipe.submit(record)
    except Exception as exc:
        _guard.internal_error("control", exc)


def _after_fork_in_child() -> None:
    # The parent's timer thread stays with the parent: the child gets its own for what is left
    # of the window, and fresh locks.
    global _lock, _timer
    _lock = threading.RLock()
    _timer = None
    until = _override.until
    if _override.active and until is not None:
        _schedule(max(0.001, until - time.time()))


os.register_at_fork(after_in_child=_after_fork_in_child)
