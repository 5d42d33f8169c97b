"""Which steps and calls served a request, read from trace files: ``otel-gpu show --request`` and
``otel-gpu workloads --by-request``.

A request (its trace id, 32 hex digits, or its span id, 16) is served two ways, and both are
followed (see ``otel_gpu.batch``, docs/serving.md):

- **by link**: a step of several requests is an ``otel_gpu.batch`` span whose calls are its
  children; it and each call link to the request. A span linking to it, and all the spans under
  it, served it.
- **by parent**: a step of one request has no step span: its calls are children of the request's
  span. A request given by trace id: the spans of that trace; by span id: the spans under it
  (the request's span itself is often in another process's file, so its children are found by
  their parent id).

The first problem among them is the earliest (by start time) span in ERROR or with NaN/Inf
(``otel_gpu.nonfinite``, level-5 statistics): what a slow or failed request's debugging
starts from.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from otel_gpu import attributes as attr
from otel_gpu.traces.reader import Span
from otel_gpu.traces.trees import Trace

__all__ = ["BATCH_SPAN_NAME", "Request", "by_request", "first_problem", "served"]

BATCH_SPAN_NAME = "otel_gpu.batch"


def _walk(roots: Iterable[Span]) -> list[Span]:
    """``roots`` and their descendants, parents before children, each once."""
    order: list[Span] = []
    seen: set[int] = set()
    stack = list(roots)[::-1]
    while stack:
        span = stack.pop()
        if id(span) in seen:
            continue
        seen.add(id(span))
        order.append(span)
        stack.extend(reversed(span.children))
    return order


def _single_top(span: Span) -> bool:
    """The top call of a step of one request (no step span: a child of the request's span)."""
    parent = span.parent
    return (
        span.attrs.get(attr.BATCH_REQUESTS) == 1
        and not span.links
        and (parent is None or parent.attrs.get(attr.BATCH_REQUESTS) != 1)
    )


def _under(span: Span, span_id: str) -> bool:
    """Whether ``span`` hangs under the span ``span_id`` (in the files or not)."""
    node: Span | None = span
    while node is not None:
        if node.parent_id == span_id:
            return True
        node = node.parent
    return False


def served(traces: list[Trace], request: str) -> list[Span]:
    """The spans that served ``request`` (a trace id or a span id, lower-case hex), parents
    before children; the request's own span and the spans it made itself are not among them.
    The spans' attributes must have been read (``otel_gpu.batch.requests``)."""
    request = request.lower()
    by_trace = len(request) == 32
    position = 0 if by_trace else 1
    roots: list[Span] = []
    for trace in traces:
        for span in _walk(trace.roots):
            if any(link[position] == request for link in span.links):
                # a step span, or a call of a step linking itself: its subtree served it
                parent = span.parent
                if parent is None or not any(link[position] == request for link in parent.links):
                    roots.append(span)
            elif _single_top(span) and (
                span.trace_id == request if by_trace else _under(span, request)
            ):
                roots.append(span)
    return _walk(roots)


def first_problem(spans: Iterable[Span]) -> Span | None:
    """The earliest span in ERROR or with NaN/Inf among ``spans`` (their attributes read)."""
    bad = [s for s in spans if s.error or s.attrs.get(attr.NONFINITE) or _nonfinite_stats(s)]
    return min(bad, key=lambda s: (s.start, s.span_id)) if bad else None


def _nonfinite_stats(span: Span) -> bool:
    return any(
        (stat.get(attr.STATS_NAN_COUNT) or 0) + (stat.get(attr.STATS_INF_COUNT) or 0) > 0
        for stat in span.stats
    )


@dataclass
class Request:
    """One request and the calls that served it, as ``workloads --by-request`` groups them."""

    trace_id: str
    span_id: str
    request_id: str = ""
    """The engine's id for it (``otel_gpu.request.id`` on the links), when given."""
    steps: int = 0
    """How many ``otel_gpu.batch`` step spans served it (a step of one request has none)."""
    calls: list[Span] = field(default_factory=list)
    tops: set[str] = field(default_factory=set)
    """The span ids of the subtrees counted (a step span, or a one-request step's top call)."""


def by_request(traces: list[Trace]) -> list[Request]:
    """Every request the spans link to or hang under, with the calls that served it; a call
    of a step of several requests counts for each. Requests by first call, earliest first."""
    found: dict[tuple[str, str], Request] = {}

    def add(key: tuple[str, str], rid: str, step: Span, calls: list[Span]) -> None:
        entry = found.get(key)
        if entry is None:
            entry = found[key] = Request(key[0], key[1], rid)
        entry.request_id = entry.request_id or rid
        if step.span_id not in entry.tops:
            entry.tops.add(step.span_id)
            entry.steps += step.name == BATCH_SPAN_NAME
            entry.calls.extend(s for s in calls if s.name != BATCH_SPAN_NAME)

    for trace in traces:
        for span in _walk(trace.roots):
            parent = span.parent
            if span.links and (parent is None or parent.links != span.links):
                # the top of a step of several requests: its subtree, once per request
                subtree = _walk([span])
                for trace_id, span_id, rid in span.links:
                    add((trace_id, span_id), rid, span, subtree)
            elif _single_top(span) and span.parent_id:
                # the top call of a step of one request: a child of the request's span
                add((span.trace_id, span.parent_id), "", span, _walk([span]))
    return sorted(found.values(), key=lambda r: min(c.start for c in r.calls) if r.calls else 0)
