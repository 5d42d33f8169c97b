"""The process's control state: what live control changed, until when, and the span of each change.

:func:`apply` takes a validated :class:`~otel_gpu.control.document.Change` and applies it whole:
changes stack. A change ``for: null`` (until changed) is merged into the *baseline* (a field
the change leaves out keeps its value); a change with a window is an *overlay* on top of the
baseline and the windows already in force. Each function's level and sampling come from the
topmost layer that selects it (docs/control.md, "Windows stack"); the process-wide fields (ring
size, triggers, dump limits) from the topmost layer that sets them. The rule every armed function
follows is set from that (:mod:`otel_gpu.calls.armed`: each function's path is swapped, none
checks a level per call), and the ring resized. When a window lapses, a timer thread removes it
and installs what remains (the baseline and the other windows), not the configured state; the
calls never look at a clock for it. :func:`reset` puts the configured state back now.

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
from otel_gpu.calls import armed, batch
from otel_gpu.control.document import Change, ControlError, RequestMatcher, request_fields
from otel_gpu.export import pipeline
from otel_gpu.recorder import limits
from otel_gpu.trigger_rules import Trigger

__all__ = ["MAX_OVERLAYS", "ControlError", "apply", "effective", "reset"]

_MAX_SOURCE = 128


@dataclass(frozen=True)
class _Layer:
    """One change in force: the baseline (``for: null``) or a window (an overlay). A field left
    None (an empty glob list) is not set by this layer: the layers below decide it."""

    level: int | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    sample: float | None = None
    ring_size: int | None = None
    triggers: tuple[Trigger, ...] | None = None
    """The triggers control set (None: those of the layers below, or OTEL_GPU_TRIGGERS)."""
    dump_max_calls: int | None = None
    dump_max_bytes: int | None = None
    """The flight recorder's limits control set (None: OTEL_GPU_DUMP_MAX_COUNT, _SIZE_GB)."""
    requests: tuple[RequestMatcher, ...] = ()
    """Globs on request ids and (key, glob) pairs on request attributes: level, include,
    exclude and sample apply only during the serving steps that serve a matching request
    (calls/batch.py); (): to every call."""
    until: float | None = None
    """Epoch seconds when it lapses; None: until changed (the baseline)."""
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
            or bool(self.requests)
        )

    def as_dict(self) -> dict[str, Any]:
        """The layer as ``effective()`` reports it (JSON-able): what it sets, until, source."""
        out: dict[str, Any] = {
            "level": self.level,
            "include": list(self.include),
            "exclude": list(self.exclude),
            "sample": self.sample,
        }
        for name in ("ring_size", "dump_max_calls", "dump_max_bytes"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.triggers is not None:
            out["triggers"] = [t.as_dict() for t in self.triggers]
        out.update(request_fields(self.requests))
        out["until"] = None if self.until is None else round(self.until, 3)
        out["source"] = self.source
        return out


MAX_OVERLAYS = 16
"""Windows in force at once; one more is refused (a window from the source of one in force is
merged into that one, so it never counts twice)."""

_lock = threading.RLock()
_baseline = _Layer()
_overlays: tuple[_Layer, ...] = ()
_timer: threading.Timer | None = None
_generation = 0


def apply(change: Change, source: str) -> dict[str, Any]:
    """Apply ``change`` whole, on behalf of ``source`` (who asked, for the span); returns the
    configuration in force after it (:func:`effective`). Raises :class:`ControlError`, having
    changed nothing, when the process cannot honour a field.

    A change ``for: null`` (until changed) is merged into the baseline, field by field. A
    change with a window is an overlay on top of the baseline and the overlays in force: when
    it ends, the state is computed again from what remains (docs/control.md, "Windows stack")."""
    global _baseline, _overlays
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
        if change.window is None:
            # a window of the same source is folded into the baseline first: that source's
            # change until changed follows on from its own window, as one change always did
            base = _baseline
            for own in (o for o in _overlays if o.source == source):
                base = _folded(base, own)
            baseline = _merged(base, change, source)
            overlays = tuple(o for o in _overlays if o.source != source)
        else:
            # a window from the same source as one in force is merged into it (and goes on top)
            mine = [o for o in _overlays if o.source == source]
            below = mine[-1] if mine else _Layer()
            layer = _merged(below, change, source, until=time.time() + change.window)
            overlays = (*(o for o in _overlays if o.source != source), layer)
            if len(overlays) > MAX_OVERLAYS:
                raise ControlError(
                    f"for: at most {MAX_OVERLAYS} windows are in force at once; wait for one to "
                    "end, send this one --until-changed, or reset; nothing was changed"
                )
            baseline = _baseline
        _baseline, _overlays = baseline, overlays
        changed = _install(ring)
        _schedule()
        result = effective()
    _emit(source, change.fields(), result, len(changed), begun)
    return result


def reset(source: str) -> dict[str, Any]:
    """Put the configured state back now (every armed function on its configured path, the
    ring at its configured size): the baseline and every window go; returns :func:`effective`."""
    global _baseline, _overlays
    source = _source(source)
    begun = time.time_ns()
    with _lock:
        _baseline, _overlays = _Layer(source=source), ()
        changed = _install(_ring())
        _schedule()
        result = effective()
    _emit(source, {"reset": True}, result, len(changed), begun)
    return result


def effective() -> dict[str, Any]:
    """The configuration in force, JSON-able.

    ``baseline`` (the changes made until changed, or None) and ``overlays`` (the windows in
    force, oldest first, each with its ``until`` in epoch seconds) are the stack; the fields
    beside them are what it resolves to: ``level``, ``include``/``exclude``, ``sample`` and
    ``source`` of the change on top (the last window, else the baseline; ``level`` None: each
    function's configured level), ``until`` (the next end of a window, None: nothing ends by
    itself), ``ring_size`` (None: no ring), the triggers and dump limits in force, and counts of
    the armed functions and of those off their configured level."""
    with _lock:
        settings = config.current()
        top = _top()
        ring = _ring()
        entries = armed.entries()
        dump_limits = limits.in_force(settings)
        ends = [o.until for o in _overlays if o.until is not None]
        return {
            "pid": os.getpid(),
            "control": settings.control,
            "configured_level": settings.level,
            "changed": any(layer.active for layer in _layers()),
            "level": top.level,
            "include": list(top.include),
            "exclude": list(top.exclude),
            "sample": top.sample,
            "until": round(min(ends), 3) if ends else None,
            "ring_size": None if ring is None else int(getattr(ring, "size", 0)),
            "triggers": [t.as_dict() for t in triggers.current()],
            # the request scope in force: id/trace-id globs and attribute globs (docs/serving.md)
            "requests": [],
            "request_attributes": {},
            **request_fields(_scope()),
            # the flight recorder's limits in force (control's, else the settings')
            "dump_max_calls": dump_limits.max_calls,
            "dump_max_bytes": dump_limits.max_bytes,
            "functions_boosted": triggers.boosted_count(),
            "source": top.source,
            "baseline": _baseline.as_dict() if _baseline.active else None,
            "overlays": [o.as_dict() for o in _overlays],
            "functions": len(entries),
            "functions_changed": sum(1 for e in entries if e.level != e.configured_level),
        }


# --------------------------------------------------------------------------- internals


def _layers() -> tuple[_Layer, ...]:
    """The stack, bottom first: the baseline, then the windows in the order they were applied."""
    return (_baseline, *_overlays)


def _scope() -> tuple[RequestMatcher, ...]:
    """The request matchers in force: the topmost layer's that has any."""
    return next((x.requests for x in reversed(_layers()) if x.requests), ())


def _top() -> _Layer:
    """The change on top: the last window in force, else the baseline."""
    return _overlays[-1] if _overlays else _baseline


def _resolved(name: str) -> Any:
    """A process-wide field (ring size, triggers, dump limits): the topmost layer that sets it."""
    for layer in reversed(_layers()):
        value = getattr(layer, name)
        if value is not None:
            return value
    return None


def _merged(old: _Layer, change: Change, source: str, until: float | None = None) -> _Layer:
    """``old`` with the fields ``change`` sets replaced (a field it leaves out keeps its value)."""
    return _Layer(
        level=_kept(change.level, old.level),
        include=change.include if change.include is not None else old.include,
        exclude=change.exclude if change.exclude is not None else old.exclude,
        sample=_kept(change.sample, old.sample),
        ring_size=_kept(change.ring_size, old.ring_size),
        triggers=change.triggers if change.triggers is not None else old.triggers,
        dump_max_calls=_kept(change.dump_max_calls, old.dump_max_calls),
        dump_max_bytes=_kept(change.dump_max_bytes, old.dump_max_bytes),
        requests=change.requests if change.requests is not None else old.requests,
        until=until,
        source=source,
    )


def _folded(base: _Layer, window: _Layer) -> _Layer:
    """``base`` with the fields ``window`` sets (the window made lasting)."""
    return _Layer(
        level=_kept(window.level, base.level),
        include=window.include or base.include,
        exclude=window.exclude or base.exclude,
        sample=_kept(window.sample, base.sample),
        ring_size=_kept(window.ring_size, base.ring_size),
        triggers=_kept(window.triggers, base.triggers),
        dump_max_calls=_kept(window.dump_max_calls, base.dump_max_calls),
        dump_max_bytes=_kept(window.dump_max_bytes, base.dump_max_bytes),
        requests=window.requests or base.requests,
        until=None,
        source=window.source,
    )


def _install(ring: Any) -> list[armed.Armed]:
    """Make the stack the state in force: the armed functions' rule, the triggers, the dump
    limits and the ring's size."""
    triggers.set_triggers(_resolved("triggers"))
    limits.set_limits(_resolved("dump_max_calls"), _resolved("dump_max_bytes"))
    if ring is not None:
        # the ring's configured size is its own settings' (a reconfigured process has a new ring)
        configured = getattr(getattr(ring, "settings", None), "ring", None)
        size = _resolved("ring_size")
        if size is not None:
            ring.size = size
        elif isinstance(configured, int):
            ring.size = configured
    chosen = tuple(
        layer for layer in _layers() if layer.level is not None or layer.sample is not None
    )
    # a layer with requests applies only during the serving steps that serve a matching request
    # (calls/batch.py): the topmost such layer, over the layers that apply to every call
    everywhere = tuple(layer for layer in chosen if not layer.requests)
    scoped = [layer for layer in chosen if layer.requests]
    if scoped:
        batch.set_request_rule(scoped[-1].requests, _rule_of((*everywhere, scoped[-1])))
    else:
        batch.set_request_rule(None, None)
    if not everywhere:
        return armed.set_rule(None)
    return armed.set_rule(_rule_of(everywhere))


def _kept(new: Any, old: Any) -> Any:
    return new if new is not None else old


def _rule_of(layers: tuple[_Layer, ...]) -> armed.Rule:
    """Each function's level and sampling from the stack: the topmost layer that selects the
    function (its include and exclude) and sets a level decides the level, and likewise the
    sampling; a function no layer selects keeps its configured path."""
    top_down = tuple(reversed(layers))

    def rule(entry: armed.Armed) -> tuple[int, float | None] | None:
        level: int | None = None
        sample: float | None = None
        hit = False
        for layer in top_down:
            if not selected(entry.qualified, entry.name, layer.include, layer.exclude):
                continue
            hit = True
            level = layer.level if level is None else level
            sample = layer.sample if sample is None else sample
            if level is not None and sample is not None:
                break
        if not hit:
            return None
        return (entry.configured_level if level is None else level, sample)

    return rule


selected = triggers.selected  # the same glob rule as the triggers' ``functions``


def _schedule() -> None:
    """Start the timer of the next window to end (cancelling the last one); none: no timer."""
    global _timer, _generation
    _generation += 1
    if _timer is not None:
        _timer.cancel()
        _timer = None
    ends = [o.until for o in _overlays if o.until is not None]
    if not ends:
        return
    timer = threading.Timer(max(0.001, min(ends) - time.time()), _lapse, (_generation,))
    timer.name = "otel-gpu-control-window"
    timer.daemon = True
    timer.start()
    _timer = timer


def _lapse(generation: int, now: float | None = None) -> None:
    """The next window's time came: drop the windows that ended (by ``now``, epoch seconds,
    the clock's time unless given), and install what remains."""
    global _overlays
    begun = time.time_ns()
    try:
        with _lock:
            if generation != _generation:
                return  # a later change rescheduled
            now = time.time() if now is None else now
            ended = [o for o in _overlays if o.until is not None and o.until <= now + 0.001]
            if not ended:
                _schedule()  # woke early: wait for the rest
                return
            _overlays = tuple(o for o in _overlays if o not in ended)
            changed = _install(_ring())
            _schedule()
            result = effective()
        fields = {"window_end": [o.as_dict() for o in ended]}
        _emit("window end", fields, result, len(changed), begun)
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
    # of the windows, and fresh locks.
    global _lock, _timer
    _lock = threading.RLock()
    _timer = None
    _schedule()


os.register_at_fork(after_in_child=_after_fork_in_child)
