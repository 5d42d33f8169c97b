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

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otel_gpu import _guard, config
from otel_gpu.anomalies import triggers
from otel_gpu.calls import armed
from otel_gpu.control.document import Change, ControlError
from otel_gpu.export import pipeline
from otel_gpu.recorder import limits
from otel_gpu.trigger_rules import Trigger

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
    triggers: tuple[Trigger, ...] | None = None
    """The triggers control set (None: OTEL_GPU_TRIGGERS)."""
    dump_max_calls: int | None = None
    dump_max_bytes: int | None = None
    """The flight recorder's limits control set (None: OTEL_GPU_DUMP_MAX_COUNT, _SIZE_GB)."""
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
            or self.triggers is not None
            or self.dump_max_calls is not None
            or self.dump_max_bytes is not None
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
    begun = time.time_ns()  # before any path is swapped: the span starts before their spans
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
            triggers=change.triggers if change.triggers is not None else old.triggers,
            dump_max_calls=_kept(change.dump_max_calls, old.dump_max_calls),
            dump_max_bytes=_kept(change.dump_max_bytes, old.dump_max_bytes),
            until=None if change.window is None else time.time() + change.window,
            source=source,
        )
        changed = _install(new, ring)
        _schedule(change.window)
        result = effective()
    _emit(source, change.fields(), result, len(changed), begun)
    return result


def reset(source: str) -> dict[str, Any]:
    """Put the configured state back now (every armed function on its configured path, the
    ring at its configured size); returns :func:`effective`."""
    source = _source(source)
    begun = time.time_ns()
    with _lock:
        changed = _install(_Override(source=source), _ring())
        _schedule(None)
        result = effective()
    _emit(source, {"reset": True}, result, len(changed), begun)
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
        dump_limits = limits.in_force(settings)
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
            "triggers": [t.as_dict() for t in triggers.current()],
            # the flight recorder's limits in force (control's, else the settings')
            "dump_max_calls": dump_limits.max_calls,
            "dump_max_bytes": dump_limits.max_bytes,
            "functions_boosted": triggers.boosted_count(),
            "source": o.source,
            "functions": len(entries),
            "functions_changed": sum(1 for e in entries if e.level != e.configured_level),
        }


# --------------------------------------------------------------------------- internals


def _install(new: _Override, ring: Any) -> list[armed.Armed]:
    """Make ``new`` the state in force: the armed functions' rule and the ring's size."""
    global _override
    _override = new
    triggers.set_triggers(new.triggers)
    limits.set_limits(new.dump_max_calls, new.dump_max_bytes)
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


def _kept(new: int | None, old: int | None) -> int | None:
    return new if new is not None else old


def _rule_of(o: _Override) -> armed.Rule:
    include, exclude, level, sample = o.include, o.exclude, o.level, o.sample

    def rule(entry: armed.Armed) -> tuple[int, float | None] | None:
        if not selected(entry.qualified, entry.name, include, exclude):
            return None
        return (entry.configured_level if level is None else level, sample)

    return rule


selected = triggers.selected  # the same glob rule as the triggers' ``functions``


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


def _emit(
    source: str, fields: Mapping[str, Any], result: Mapping[str, Any], changed: int, begun: int
) -> None:
    """The change's span, exported with the process's other spans (its own trace), from
    ``begun`` (before any path was swapped) to now."""
    triggers.emit_control_span(source, fields, result, changed, begun)


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
