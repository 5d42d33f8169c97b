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
- ``dump``: the in-memory ring is written with the call that fired (``OTEL_GPU_RING``), by the
  ring's own path (``Ring.dump_call``): the dump ``OTEL_GPU_ON_NONFINITE=dump`` writes, named
  by the call's span id, with its outputs for ``nonfinite``.

``nonfinite`` fires on the call that produced the NaN or Inf, not on the calls that receive it
(one verdict a call, shared with the ring: ``recorder/nonfinite.py``). A rule fires at most
``max_fires`` times (``OTEL_GPU_TRIGGER_MAX_FIRES``) in any ``per`` seconds; past that, a firing
is skipped, with one line the first time.

Each firing is one ``otel_gpu.control`` span, its source ``trigger``, saying which rule, which
function and what changed. A trigger sees only calls that are recorded: a function at level 0
has no span to watch, and ``nonfinite`` needs the level-5 statistics.
"""

from __future__ import annotations

import collections
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
from otel_gpu.calls import armed, stats_reader
from otel_gpu.core import sink
from otel_gpu.core.plan import Plan
from otel_gpu.core.record import Call, standalone
from otel_gpu.devices import device_time
from otel_gpu.recorder import nonfinite
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
_fires: dict[Trigger, collections.deque[float]] = {}  # a rule's firings in its last `per` seconds
_MAX_COUNTED = 256


def current() -> tuple[Trigger, ...]:
    """The triggers in force: set by control, else ``OTEL_GPU_TRIGGERS``."""
    rules = _rules
    return config.current().triggers if rules is None else rules


def set_triggers(rules: tuple[Trigger, ...] | None) -> None:
    """Replace the triggers in force (None: back to ``OTEL_GPU_TRIGGERS``). Takes effect at the
    next call's end."""
    global _rules
    _rules = rules
    _note_stats_needed(current())


def _note_stats_needed(rules: tuple[Trigger, ...]) -> None:
    """A non-finite rule reads each call's statistics in ``end``, on the caller's thread: while
    one is in force, level-5 calls read them there (calls/stats_reader.py)."""
    stats_reader.require_on_caller(any(rule.on == "nonfinite" for rule in rules))


class Watch:
    """The observer that checks each recorded call against the triggers in force."""

    min_level = 1

    def __init__(self, host: Host) -> None:
        global _host
        _host = host  # its ring is set once every observer is built
        self._host = host
        self._own = nonfinite.Origins()
        device_time.on_resolved(_device_resolved)  # slow on the device clock
        _note_stats_needed(current())

    def start(self, call: Call) -> None:
        return None

    def end(self, call: Call) -> None:
        rules = _rules
        if rules is None:
            rules = self._host.settings.triggers
        if not rules:
            return
        origins = self._origins
        for rule in rules:
            if _fired(rule, call, origins):
                _fire(rule, call)

    @property
    def _origins(self) -> nonfinite.Origins:
        """Who produced a NaN: the ring's verdicts where there is a ring (one verdict a call,
        shared with ``OTEL_GPU_ON_NONFINITE=dump``), else this watcher's own."""
        ring = getattr(self._host, "ring", None)
        origins = getattr(ring, "origins", None)
        return origins if isinstance(origins, nonfinite.Origins) else self._own

    def flush(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        return None


def make_observer(settings: config.Settings, host: Host) -> Watch | None:
    """The watcher, when triggers are set or live control may set them."""
    if not settings.controllable:
        return None
    return Watch(host)


def _fired(rule: Trigger, call: Call, origins: nonfinite.Origins) -> bool:
    if rule.on == "exception":
        exc = call.exc
        if exc is None or not rule.matches_type(exc):
            return False
    elif rule.on == "slow":
        if rule.clock != "host" or call.end_ns is None or rule.threshold is None:
            return False  # the device clock is judged when device time is resolved
        if call.end_ns - call.start_ns < rule.threshold * 1e9:
            return False
    else:  # nonfinite: the call that produced it (level-5 statistics), not those it reached
        if not origins.produced(call):
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
        if not _take(rule):
            return  # past max_fires in the last `per` seconds: skipped (one line said so)
        boosted = _boost(rule, call) if rule.level is not None else []
        dumped = _dump(rule, call) if rule.dump else None
        if not boosted and dumped is None:
            _give_back(rule)
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


def _take(rule: Trigger) -> bool:
    """Count a firing of ``rule``; False (skipped) when it fired ``max_fires`` times in the last
    ``per`` seconds. The first skip of a rule says so in one line."""
    limit = rule.max_fires
    if limit is None:
        settings = _host.settings if _host is not None else config.current()
        limit = settings.trigger_max_fires
    now = time.monotonic()
    with _lock:
        times = _fires.get(rule)
        if times is None:
            if len(_fires) >= _MAX_COUNTED:  # rules replaced by control: forget the old ones
                _fires.clear()
            times = _fires[rule] = collections.deque()
        while times and times[0] <= now - rule.per:
            times.popleft()
        if len(times) >= limit:
            allowed = False
        else:
            times.append(now)
            allowed = True
    if not allowed:
        _guard.warn_once(
            f"trigger.max_fires.{json.dumps(rule.as_dict(), sort_keys=True)}",
            "otel-gpu trigger %s fired %d time(s) in %g s, its limit (max_fires, "
            "OTEL_GPU_TRIGGER_MAX_FIRES): further firings within the window are skipped. "
            "Reported once per rule.",
            json.dumps(rule.as_dict(), sort_keys=True),
            limit,
            rule.per,
        )
    return allowed


def _give_back(rule: Trigger) -> None:
    """A firing that changed nothing does not count."""
    with _lock:
        times = _fires.get(rule)
        if times:
            times.pop()


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
    # A call the ring dumped itself (it raised; or OTEL_GPU_ON_NONFINITE=dump on the NaN's
    # producer): that dump is the one named, not a second one.
    already = (call.span.attributes or {}).get(RING_DUMP_DIR)
    if already is not None:
        return str(already)
    # the same path as OTEL_GPU_ON_NONFINITE=dump: the call named by its span id, its outputs
    return ring.dump_call(call, rule.on)


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
    stats_reader.require_on_caller(False)
    with _lock:
        timers = list(_boosted.values())
        _boosted.clear()
    for timer in timers:
        if timer is not None:
            timer.cancel()
    with _lock:
        _fires.clear()
