"""Triggers at work: watch each recorded call, and raise detail when a rule fires.

It also builds the ``otel_gpu.control`` span of every change, live control's included
(:func:`emit_control_span`): control sits above the pipeline, the triggers beside the other
anomaly plugins, and both write the same span.

The rules (:mod:`otel_gpu.trigger_rules`) come from ``OTEL_GPU_TRIGGERS`` and can be replaced
live (a control document's ``triggers`` field: ``otel-gpu control``, OpAMP). The watcher is an
observer at level 1 and up, built when triggers are set or ``OTEL_GPU_CONTROL=on``; its ``end``
runs on the caller's thread after each recorded call and costs one check while no rule is set.

When a rule fires for a call:

- ``level``: the function whose call fired (``scope: function``) or every controllable function
  (``scope: all``) takes that level's path for the next ``calls`` calls, then goes back to the
  path control's rule gives it; a timer puts it back after ``for`` seconds if the calls have not
  come by then. A function already boosted, or already at that level, is left as it is, so a
  rule firing on every call does not stack.
- ``dump``: the in-memory ring is written with the call that fired (``OTEL_GPU_RING``; the
  same dump ``OTEL_GPU_ON_NONFINITE=dump`` writes, which keeps working on its own).

Each firing is one ``otel_gpu.control`` span, its source ``trigger``, saying which rule, which
function and what changed. A trigger sees only calls that are recorded: a function at level 0
has no span to watch, and ``nonfinite`` needs the level-5 statistics.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from otel_gpu import _guard, config
from otel_gpu.attributes import (
    CONTROL_CHANGE,
    CONTROL_EFFECTIVE,
    CONTROL_FUNCTIONS,
    CONTROL_SOURCE,
    CONTROL_SPAN_NAME,
    CONTROL_UNTIL,
    RING_DUMP_DIR,
)
from otel_gpu.calls import armed
from otel_gpu.core import sink
from otel_gpu.core.plan import Plan
from otel_gpu.core.record import Call, standalone
from otel_gpu.devices import device_time
from otel_gpu.trigger_rules import Trigger

if TYPE_CHECKING:
    from otel_gpu.core.protocols import Host

__all__ = [
    "Watch",
    "boosted_count",
    "current",
    "emit_control_span",
    "make_observer",
    "selected",
    "set_triggers",
]

_lock = threading.Lock()
_rules: tuple[Trigger, ...] | None = None  # None: the configured ones (OTEL_GPU_TRIGGERS)
_boosted: dict[int, threading.Timer | None] = {}  # id(Armed) -> its window's timer
_host: Host | None = None  # the pipeline the watcher serves, for its ring


def current() -> tuple[Trigger, ...]:
    """The triggers in force: set by control, else ``OTEL_GPU_TRIGGERS``."""
    rules = _rules
    return config.current().triggers if rules is None else rules


def set_triggers(rules: tuple[Trigger, ...] | None) -> None:
    """Replace the triggers in force (None: back to ``OTEL_GPU_TRIGGERS``). Takes effect at the
    next call's end."""
    global _rules
    _rules = rules


class Watch:
    """The observer that checks each recorded call against the triggers in force."""

    min_level = 1

    def __init__(self, host: Host) -> None:
        global _host
        _host = host  # its ring is set once every observer is built
        self._host = host
        device_time.on_resolved(_device_resolved)  # slow on the device clock

    def start(self, call: Call) -> None:
        return None

    def end(self, call: Call) -> None:
        rules = _rules
        if rules is None:
            rules = self._host.settings.triggers
        if not rules:
            return
        for rule in rules:
            if _fired(rule, call):
                _fire(rule, call)

    def flush(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        return None


def make_observer(settings: config.Settings, host: Host) -> Watch | None:
    """The watcher, when triggers are set or live control may set them."""
    if not settings.controllable:
        return None
    return Watch(host)


def _fired(rule: Trigger, call: Call) -> bool:
    if rule.on == "exception":
        exc = call.exc
        if exc is None or not rule.matches_type(exc):
            return False
    elif rule.on == "slow":
        if rule.clock != "host" or call.end_ns is None or rule.threshold is None:
            return False  # the device clock is judged when device time is resolved
        if call.end_ns - call.start_ns < rule.threshold * 1e9:
            return False
    else:  # nonfinite: the level-5 statistics of this call
        results = call.stats
        if not results or not any(getattr(r, "nonfinite", 0) for r in results):
            return False
    return _wanted(rule, call)


def _device_resolved(call: Call, seconds: float) -> None:
    """A call's device duration, resolved on the export thread: the ``slow`` rules on the
    device clock. A rule fired here raises the function's next calls, as on the host clock."""
    rules = current()
    for rule in rules:
        if (
            rule.on == "slow"
            and rule.clock == "device"
            and rule.threshold is not None
            and seconds >= rule.threshold
            and _wanted(rule, call)
        ):
            _fire(rule, call)


def _wanted(rule: Trigger, call: Call) -> bool:
    if not rule.functions:
        return True
    plan = call.plan
    return selected(f"{plan.module}.{plan.qualname}", plan.name, rule.functions, ())


def _fire(rule: Trigger, call: Call) -> None:
    try:
        boosted = _boost(rule, call) if rule.level is not None else []
        dumped = _dump(rule, call) if rule.dump else None
        if not boosted and dumped is None:
            return  # nothing changed (already boosted, no ring): no span for it
        plan = call.plan
        fields: dict[str, Any] = {
            "trigger": rule.as_dict(),
            "function": f"{plan.module}.{plan.qualname}",
            "span_id": format(call.span.span_id, "016x"),
        }
        if boosted:
            fields["boosted"] = sorted(e.qualified for e in boosted)[:32]
        if dumped is not None:
            fields["dump"] = dumped
        effective = {"triggers_boosted": boosted_count()}
        emit_control_span("trigger", fields, effective, len(boosted))
    except Exception as exc:
        _guard.internal_error("control", exc)


def _boost(rule: Trigger, call: Call) -> list[armed.Armed]:
    plan = call.plan
    qualified = f"{plan.module}.{plan.qualname}"
    if rule.scope == "all":
        chosen = armed.entries()
    else:
        chosen = [e for e in armed.entries() if e.qualified == qualified and e.name == plan.name]
    level = rule.level
    assert level is not None
    done = []
    for entry in chosen:
        key = id(entry)
        with _lock:
            if key in _boosted:
                continue
            _boosted[key] = None
        if entry.boost(level, rule.calls, functools.partial(_unboost, entry)):
            timer = threading.Timer(rule.window, _unboost, (entry,))
            timer.name = "otel-gpu-trigger-window"
            timer.daemon = True
            with _lock:
                if key in _boosted:  # not already ended by its calls
                    _boosted[key] = timer
                    timer.start()
            done.append(entry)
        else:
            with _lock:
                _boosted.pop(key, None)
    return done


def _unboost(entry: armed.Armed) -> None:
    """The boost's calls are done or its window lapsed: the path control's rule gives."""
    with _lock:
        if id(entry) not in _boosted:
            return
        timer = _boosted.pop(id(entry))
    if timer is not None:
        timer.cancel()
    armed.refollow(entry)


def _dump(rule: Trigger, call: Call) -> str | None:
    ring = _host.ring if _host is not None else None
    if ring is None:
        return None
    # the ring's own end() ran first and kept this call: the dump holds it and the calls before.
    # A call that raised was dumped by the ring itself already: that dump is the one named.
    already = (call.span.attributes or {}).get(RING_DUMP_DIR)
    if already is not None:
        return str(already)
    return ring.dump("trigger", None)


def boosted_count() -> int:
    """Functions a trigger has boosted now (for ``effective()``)."""
    with _lock:
        return len(_boosted)


def selected(qualified: str, name: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    """Whether a function (``module.qualname``, span name) is one a change applies to: it
    matches an include glob (or there is none) and no exclude glob."""

    def hit(patterns: tuple[str, ...]) -> bool:
        return any(
            fnmatch.fnmatchcase(qualified, p) or fnmatch.fnmatchcase(name, p) for p in patterns
        )

    return (not include or hit(include)) and not hit(exclude)


def emit_control_span(
    source: str,
    fields: Mapping[str, Any],
    result: Mapping[str, Any],
    changed: int,
    start_ns: int | None = None,
) -> None:
    """One ``otel_gpu.control`` span (its own trace): who asked (``source``), what changed
    (``fields``), the configuration in force after it (``result``, with ``until`` when a window
    runs) and how many functions changed path. Exported with the process's other spans.
    ``start_ns``: when the change began to apply (before any function's path was swapped), so
    that no span of a new level starts before the span that explains it; it ends now."""
    try:
        pipe = sink.get()
        if pipe is None:
            return
        now = time.time_ns()
        record = standalone(Plan(CONTROL_SPAN_NAME, 1), now if start_ns is None else start_ns)
        record.end_ns = now
        attrs: dict[str, Any] = {
            CONTROL_SOURCE: source,
            CONTROL_CHANGE: json.dumps(dict(fields), sort_keys=True, default=str),
            CONTROL_EFFECTIVE: json.dumps(dict(result), sort_keys=True, default=str),
            CONTROL_FUNCTIONS: changed,
        }
        if result.get("until") is not None:
            attrs[CONTROL_UNTIL] = float(result["until"])
        record.span.set_attributes(attrs)
        pipe.submit(record)
    except Exception as exc:
        _guard.internal_error("control", exc)


def _reset_for_tests() -> None:
    """No trigger set by control, no function boosted."""
    global _rules
    _rules = None
    with _lock:
        timers = list(_boosted.values())
        _boosted.clear()
    for timer in timers:
        if timer is not None:
            timer.cancel()
