"""What a change would select, before it is applied: the controllable names of this process,
a preview of a control document (``otel-gpu control --dry-run``), and the refusal of a change
whose globs select no function, with the closest names (``difflib``).

A function answers to its span name and its ``module.qualname``; a module of a tree
instrumented with ``instrument_module()`` answers to its path in the tree
(``model.layers.1.mlp``), which is its span name. These are the names control's
``include``/``exclude`` globs match (:func:`otel_gpu.control.state.selected`).
"""

from __future__ import annotations

import difflib
from typing import Any

from otel_gpu.calls import armed
from otel_gpu.control import state
from otel_gpu.control.document import Change

__all__ = ["closest", "listing", "preview", "unmatched"]

_CLOSEST = 5  # names offered when a glob matches nothing


def listing() -> list[dict[str, Any]]:
    """Every armed function: its span name, ``module.qualname``, the level it records at now
    and its configured one, sorted by name."""
    rows = [
        {
            "name": e.name,
            "qualified": e.qualified,
            "level": e.level,
            "configured_level": e.configured_level,
        }
        for e in armed.entries()
    ]
    return sorted(rows, key=lambda row: (row["name"], row["qualified"]))


def _globs(change: Change) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The include and exclude globs of the layer the change would make: a change until changed
    is merged into the baseline field by field (a glob list it leaves out keeps the baseline's);
    a window from ``otel-gpu control`` is a layer of its own, with its own globs only
    (:func:`otel_gpu.control.state.apply`)."""
    base: dict[str, Any] = {}
    if change.window is None:
        base = state.effective().get("baseline") or {}
    include = change.include if change.include is not None else tuple(base.get("include") or ())
    exclude = change.exclude if change.exclude is not None else tuple(base.get("exclude") or ())
    return include, exclude


def _selects(change: Change) -> bool:
    """Whether the change chooses functions (a level, a ratio, globs), not only the ring or
    the recorder's limits or the triggers."""
    return (
        change.level is not None
        or change.sample is not None
        or change.include is not None
        or change.exclude is not None
    )


def preview(change: Change) -> dict[str, Any]:
    """What ``change`` would select, applying nothing: ``selected`` (the functions its globs
    pick, each with its level now and the level it would take) and ``changed`` (how many of
    them would move to another level)."""
    include, exclude = _globs(change)
    rows = []
    for row in listing():
        if not state.selected(row["qualified"], row["name"], include, exclude):
            continue
        # the new layer goes on top: its level wins where it sets one, else the level stays
        row["would_be"] = row["level"] if change.level is None else change.level
        rows.append(row)
    return {
        "selected": rows,
        "changed": sum(1 for r in rows if r["would_be"] != r["level"]),
        "functions": len(armed.entries()),
        "include": list(include),
        "exclude": list(exclude),
    }


def unmatched(change: Change) -> str | None:
    """The refusal of a change that selects functions but whose globs select none (None: it
    selects some, or selects nothing by design, such as a change of the ring alone)."""
    if change.reset or not _selects(change):
        return None
    include, exclude = _globs(change)
    rows = listing()
    if any(state.selected(r["qualified"], r["name"], include, exclude) for r in rows):
        return None
    if not rows:
        return (
            "the change selects no function: this process has no controllable function yet "
            "(instrument() a module, instrument_module() a model, or decorate with @otel_gpu.api); "
            "nothing was changed"
        )
    globs = ", ".join(include) if include else "every function"
    near = closest(include, rows)
    hint = f"; closest: {', '.join(near)}" if near else ""
    excluded = f" less {', '.join(exclude)}" if exclude else ""
    return (
        f"the change selects none of the {len(rows)} controllable function(s): {globs}"
        f"{excluded} matches no span name or module.qualname{hint} "
        "(otel-gpu control PID --list prints them all); nothing was changed"
    )


def closest(globs: tuple[str, ...], rows: list[dict[str, Any]]) -> list[str]:
    """The controllable names nearest to ``globs`` (their wildcards left out), best first."""
    names = sorted({r["name"] for r in rows} | {r["qualified"] for r in rows})
    found: list[str] = []
    for glob in globs:
        bare = glob.replace("*", "").replace("?", "")
        if not bare:
            continue
        # a glob is often a tail of a long dotted name: compare it with tails of equal length
        scored = sorted(
            names,
            key=lambda n: -difflib.SequenceMatcher(None, bare, _tail(n, bare)).ratio(),
        )
        found += [n for n in scored[:_CLOSEST] if n not in found]
    return found[:_CLOSEST]


def _tail(name: str, like: str) -> str:
    """The shortest dotted tail of ``name`` at least as long as ``like`` (the whole name when
    none is)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        tail = ".".join(parts[i:])
        if len(tail) >= len(like):
            return tail
    return name
