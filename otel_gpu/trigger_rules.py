"""What a trigger is, and how one is written: a rule that raises detail when something happens.

A trigger is a small JSON object, given as a list in ``OTEL_GPU_TRIGGERS``, in a control
document's ``triggers`` field (``otel-gpu control --triggers``) or in a remote configuration::

    {"on": "nonfinite", "level": 10, "calls": 20}
    {"on": "exception", "types": ["OutOfMemoryError"], "dump": true}
    {"on": "slow", "threshold": "5ms", "level": 5, "calls": 100, "scope": "all", "for": "2m"}

- ``on``: ``nonfinite`` (a call whose level-5 statistics saw NaN or Inf), ``exception`` (a call
  that raised; ``types`` narrows it to exception classes by name, bare or dotted, matched along
  the class's bases), ``slow`` (a call that took at least ``threshold``: a number of seconds,
  or a string ending in ``us``, ``ms``, ``s`` or ``m``; of host time, or of device time with
  ``"clock": "device"``, judged when the call's device time is resolved on the export thread).
- ``level`` (1, 3, 5, 10): the level the next ``calls`` calls take (default 10 calls), for at
  most ``for`` (default 60 s) — both bounds hold, whichever comes first; ``scope``: ``function``
  (default, the function whose call fired) or ``all`` (every controllable function).
- ``dump``: write the in-memory ring (the calls before, and the call that fired).
- ``functions``: globs on ``module.qualname`` or the span name; only those functions' calls fire
  it (default: all).
- ``max_fires`` and ``per``: the rule fires at most ``max_fires`` times in any ``per`` seconds
  (default ``OTEL_GPU_TRIGGER_MAX_FIRES`` times in 60 s); a firing past it is skipped, so a rule
  that matches every call costs at most that many dumps and spans.

``nonfinite`` fires on the call that produced the NaN or Inf (finite inputs, non-finite output,
no call inside it to blame), not on the calls that merely receive it (``anomalies/triggers.py``).

A trigger needs ``level`` or ``dump`` (or both). Parsing reads no path and runs no code: types
are compared by name, never imported. :func:`parse` raises :class:`ValueError` naming the entry,
the field and what is allowed; the callers turn it into their own error (``ConfigError``,
``ControlError``). Part of the bottom layer: it imports nothing of otel-gpu.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "MAX_TRIGGERS",
    "ON",
    "Trigger",
    "load_json",
    "parse",
    "parse_duration",
    "parse_text",
]

ON = ("nonfinite", "exception", "slow")
"""What a trigger may watch for."""
MAX_TRIGGERS = 16
"""Triggers in one list."""
MAX_DEPTH = 16
"""How deep a trigger list's JSON may nest (a trigger itself needs 3 levels)."""
MAX_FIRES = 1_000_000
"""The most ``max_fires`` may say."""
_LEVELS = (1, 3, 5, 10)
_FIELDS = (
    "on",
    "types",
    "threshold",
    "clock",
    "level",
    "calls",
    "for",
    "scope",
    "dump",
    "functions",
    "max_fires",
    "per",
)
_MAX_CALLS = 1_000_000
_MAX_WINDOW = 7 * 24 * 3600.0
_MAX_NAMES = 32
_MAX_NAME = 256
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(us|ms|s|m)?$")


@dataclass(frozen=True)
class Trigger:
    """One validated trigger (see the module's docstring for the fields)."""

    on: str
    types: tuple[str, ...] = ()
    threshold: float | None = None
    """Seconds (``on: slow``), of ``clock`` time."""
    clock: str = "host"
    """``host`` (the call's span) or ``device`` (its kernels, where device time is measured)."""
    level: int | None = None
    calls: int = 10
    window: float = 60.0
    scope: str = "function"
    dump: bool = False
    functions: tuple[str, ...] = ()
    max_fires: int | None = None
    """Firings allowed in any ``per`` seconds; None: ``OTEL_GPU_TRIGGER_MAX_FIRES``."""
    per: float = 60.0

    def as_dict(self) -> dict[str, Any]:
        """The trigger as it would be written (JSON-able), for spans and ``--show``."""
        out: dict[str, Any] = {"on": self.on}
        if self.types:
            out["types"] = list(self.types)
        if self.threshold is not None:
            out.update(threshold=self.threshold, clock=self.clock)
        if self.level is not None:
            out.update(level=self.level, calls=self.calls, scope=self.scope)
        out["for"] = self.window
        if self.dump:
            out["dump"] = True
        if self.functions:
            out["functions"] = list(self.functions)
        if self.max_fires is not None:
            out["max_fires"] = self.max_fires
        if self.per != 60.0:
            out["per"] = self.per
        return out

    def matches_type(self, exc: BaseException) -> bool:
        """Whether ``exc`` is of one of ``types`` (any exception when there are none)."""
        if not self.types:
            return True
        for cls in type(exc).__mro__:
            qualified = f"{getattr(cls, '__module__', '')}.{cls.__qualname__}"
            if cls.__name__ in self.types or qualified in self.types:
                return True
        return False


def parse_text(text: str) -> tuple[Trigger, ...]:
    """``OTEL_GPU_TRIGGERS``: a JSON list of triggers ('' or 'none': no trigger)."""
    if not text.strip() or text.strip().lower() == "none":
        return ()
    return parse(load_json(text))


def load_json(text: str) -> Any:
    """JSON text of a trigger list, nested at most :data:`MAX_DEPTH` deep (checked before it is
    parsed, so a deep nesting is this ValueError, never a RecursionError)."""
    depth = deepest = 0
    quoted = escaped = False
    for ch in text:
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                raise ValueError(
                    f"nested deeper than {MAX_DEPTH} levels: a trigger list is a list of flat "
                    "objects"
                )
        elif ch in "]}":
            depth -= 1
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at position {exc.pos}): write a JSON list") from None
    except RecursionError:  # not expected past the check above; never a traceback
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None


def parse(raw: Any) -> tuple[Trigger, ...]:
    """A list of trigger objects, validated whole; raises ValueError naming what is wrong."""
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise ValueError(f"a list of trigger objects, not {_kind(raw)}")
    if len(raw) > MAX_TRIGGERS:
        raise ValueError(f"at most {MAX_TRIGGERS} triggers, not {len(raw)}")
    return tuple(_one(i, item) for i, item in enumerate(raw))


def _one(i: int, item: Any) -> Trigger:
    where = f"trigger {i}"
    if not isinstance(item, dict):
        raise ValueError(
            f'{where}: an object such as {{"on": "nonfinite", "level": 10}}, not {_kind(item)}'
        )
    unknown = sorted(str(k)[:40] for k in item if k not in _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; allowed: {', '.join(_FIELDS)}")
    on = item.get("on")
    if on not in ON:
        raise ValueError(f"{where}: on must be one of {', '.join(ON)}, not {_show(on)}")
    types = _names(item, "types", where)
    if types and on != "exception":
        raise ValueError(f"{where}: types goes with on: exception only")
    threshold = None
    if on == "slow":
        if "threshold" not in item:
            raise ValueError(f"{where}: on: slow needs a threshold (seconds, or '5ms', '2s')")
        threshold = parse_duration(item["threshold"], f"{where}: threshold", 3600.0)
        if threshold <= 0:
            raise ValueError(f"{where}: threshold must be above 0")
    elif "threshold" in item:
        raise ValueError(f"{where}: threshold goes with on: slow only")
    clock = item.get("clock", "host")
    if clock not in ("host", "device"):
        raise ValueError(f"{where}: clock must be host or device, not {_show(clock)}")
    if "clock" in item and on != "slow":
        raise ValueError(f"{where}: clock goes with on: slow only")
    level = item.get("level")
    if level is not None and (type(level) is not int or level not in _LEVELS):
        raise ValueError(f"{where}: level must be one of 1, 3, 5, 10, not {_show(level)}")
    calls = item.get("calls", 10)
    if isinstance(calls, bool) or not isinstance(calls, int) or not 1 <= calls <= _MAX_CALLS:
        raise ValueError(
            f"{where}: calls must be a whole number from 1 to {_MAX_CALLS}, not {_show(calls)}"
        )
    window = parse_duration(item.get("for", 60.0), f"{where}: for", _MAX_WINDOW)
    if window <= 0:
        raise ValueError(f"{where}: for must be above 0")
    scope = item.get("scope", "function")
    if scope not in ("function", "all"):
        raise ValueError(f"{where}: scope must be function or all, not {_show(scope)}")
    dump = item.get("dump", False)
    if not isinstance(dump, bool):
        raise ValueError(f"{where}: dump must be true or false, not {_show(dump)}")
    if level is None and not dump:
        raise ValueError(f"{where}: give a level (1, 3, 5, 10) or dump: true, or both")
    max_fires = item.get("max_fires")
    if max_fires is not None and (type(max_fires) is not int or not 1 <= max_fires <= MAX_FIRES):
        raise ValueError(
            f"{where}: max_fires must be a whole number from 1 to {MAX_FIRES}, not "
            f"{_show(max_fires)}"
        )
    per = parse_duration(item.get("per", 60.0), f"{where}: per", _MAX_WINDOW)
    if per <= 0:
        raise ValueError(f"{where}: per must be above 0")
    return Trigger(
        on=on,
        types=types,
        threshold=threshold,
        clock=clock,
        level=level,
        calls=calls,
        window=window,
        scope=scope,
        dump=dump,
        functions=_names(item, "functions", where),
        max_fires=max_fires,
        per=per,
    )


def parse_duration(raw: Any, name: str, most: float) -> float:
    """Seconds from a number or a string ending in us, ms, s or m (a bare number: seconds)."""
    if isinstance(raw, bool):
        raise ValueError(f"{name}: a duration such as 5, '500ms' or '2m', not {_show(raw)}")
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str) and (m := _DURATION.match(raw.strip())):
        value = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    else:
        raise ValueError(f"{name}: a duration such as 5, '500ms' or '2m', not {_show(raw)}")
    if not math.isfinite(value) or value < 0 or value > most:
        raise ValueError(f"{name}: from 0 to {most:g} seconds, not {_show(raw)}")
    return value


def _names(item: dict[str, Any], field: str, where: str) -> tuple[str, ...]:
    raw = item.get(field, [])
    if isinstance(raw, str):
        raw = [raw]
    ok = (
        isinstance(raw, list)
        and len(raw) <= _MAX_NAMES
        and all(isinstance(n, str) and 0 < len(n) <= _MAX_NAME and n.isprintable() for n in raw)
    )
    if not ok:
        raise ValueError(
            f"{where}: {field} must be a list of at most {_MAX_NAMES} names "
            f"(printable, up to {_MAX_NAME} characters)"
        )
    return tuple(raw)


def _kind(value: Any) -> str:
    kinds: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}
    return kinds.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = (
        json.dumps(value)
        if isinstance(value, (str, int, float, bool, type(None)))
        else _kind(value)
    )
    return text if len(text) <= 60 else text[:57] + "..."
