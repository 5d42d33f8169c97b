"""Spans read from trace files (:mod:`otel_gpu.traces.reader`) linked into trees: one per trace,
children in start order, cycles and duplicates a hostile file may hold broken safely.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from otel_gpu.traces.reader import Span

__all__ = ["Linked", "Trace", "build_traces", "closes_cycle", "tree_path"]


class Linked(Protocol):
    """A node linked to its parent: a span of a tree, or a call of ``workloads`` and ``diff``."""

    @property
    def parent(self) -> Linked | None: ...


@dataclass(eq=False)
class Trace:
    """One trace of the files read: its root spans, children linked, and how many spans it has."""

    trace_id: str
    roots: list[Span]
    count: int

    @property
    def start(self) -> int:
        return min((r.start for r in self.roots), default=0)


def build_traces(spans: Iterable[Span]) -> list[Trace]:
    """Group spans into traces (earliest first), link children (in start order).

    A span whose parent is not among the spans is a root; so is one whose parent link would
    close a cycle. A span id seen twice in a trace (a file given twice) is kept once.
    """
    by_trace: dict[str, dict[str, Span]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, {}).setdefault(span.span_id, span)
    traces = []
    for trace_id, members in by_trace.items():
        roots = []
        for span in members.values():
            parent = members.get(span.parent_id) if span.parent_id else None
            if parent is not None and not closes_cycle(span, parent):
                span.parent = parent
                parent.children.append(span)
            else:
                span.cycle = parent is not None
                roots.append(span)
        for span in members.values():
            span.children.sort(key=_order)
        roots.sort(key=_order)
        traces.append(Trace(trace_id, roots, len(members)))
    traces.sort(key=lambda t: (t.start, t.trace_id))
    return traces


def _order(span: Span) -> tuple[int, str]:
    return span.start, span.span_id


def closes_cycle(child: Linked, parent: Linked | None) -> bool:
    """Whether linking ``child`` under ``parent`` closes a cycle: ``child`` is ``parent`` or one
    of its ancestors (a hostile file's parent ids may loop)."""
    node = parent
    while node is not None:
        if node is child:
            return True
        node = node.parent
    return False


def tree_path(span: Span, roots: list[Span]) -> list[str]:
    """Names from the root down to ``span``, ``name[i]`` where siblings share a name."""
    parts = []
    node: Span | None = span
    while node is not None:
        siblings = node.parent.children if node.parent else roots
        same = [s for s in siblings if s.name == node.name]
        parts.append(f"{node.name}[{same.index(node)}]" if len(same) > 1 else node.name)
        node = node.parent
    return parts[::-1]
