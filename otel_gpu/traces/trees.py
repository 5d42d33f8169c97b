"""Spans read from trace files (:mod:`otel_gpu.traces.reader`) linked into trees: one per trace,
children in start order, cycles and duplicates a hostile file may hold broken safely.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from otel_gpu.traces.reader import Span

__all__ = ["Linked", "Trace", "build_traces", "closes_cycle", "cycle_closers", "tree_path"]

K = TypeVar("K", bound=Hashable)


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
        closers = cycle_closers(
            {
                span_id: span.parent_id if span.parent_id in members else None
                for span_id, span in members.items()
            }
        )
        for span_id, span in members.items():
            parent = members.get(span.parent_id) if span.parent_id else None
            if parent is not None and span_id not in closers:
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


def cycle_closers(parents: Mapping[K, K | None]) -> set[K]:
    """The nodes whose link to their parent would close a cycle, were the links made in the
    order of ``parents`` (node -> its parent, itself a key, or None), each refused that would
    close one (:func:`closes_cycle`): in each loop of parent links, its node last in that order.
    In time linear in the number of nodes, whatever the depth (one walk up per node, each node
    walked once), where asking :func:`closes_cycle` of every link costs the depth each."""
    order = {node: i for i, node in enumerate(parents)}
    done: set[K] = set()
    closers: set[K] = set()
    for start in parents:
        path: dict[K, None] = {}  # this walk's nodes, in order
        node: K | None = start
        while node is not None and node not in done and node not in path:
            path[node] = None
            node = parents.get(node)
        if node is not None and node in path:  # the walk came back to itself: a loop
            walked = list(path)
            loop = walked[walked.index(node) :]
            closers.add(max(loop, key=order.__getitem__))
        done.update(path)
    return closers


def closes_cycle(child: Linked, parent: Linked | None) -> bool:
    """Whether linking ``child`` under ``parent`` closes a cycle: ``child`` is ``parent`` or one
    of its ancestors (a hostile file's parent ids may loop). It walks up the ancestors: over
    many links, :func:`cycle_closers` is linear where this is quadratic in the depth."""
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
