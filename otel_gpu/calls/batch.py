"""A batch step: the requests one step of a serving engine serves, joined to the calls it runs.

    with otel_gpu.batch(requests=[span_context, span, "00-4bf9...-00f0...-01"]):
        logits = model(input_ids)

In a continuously batching engine one forward serves many requests, each with its own trace;
the calls of that forward belong to none of them. Inside a :func:`batch` context:

- a step span named ``otel_gpu.batch`` is current, so the step's calls form one tree under it
  (a child of the span current when the step began, or a root);
- the step span and every call span under it carry links to the requests' span contexts
  (at most ``OTEL_GPU_BATCH_MAX_LINKS``, the first ones given, duplicates once) and say how
  many requests there were and how many links were kept (``otel_gpu.batch.requests``,
  ``otel_gpu.batch.links``);
- with one request, the calls are children of the request's span itself and no step span is
  made: a plain trace view shows them inline in the request's trace;
- the step span alone also names the linked requests as attributes (their trace ids,
  ``otel_gpu.batch.request.trace_ids``, and their ids, ``otel_gpu.batch.request.ids``), for
  backends that drop links and for searches by attribute.

Cost: the links are built once per step (:class:`~otel_gpu.core.record.StepLinks`); a call
span holds that one object (a slot it inherits from its parent call, or one context-variable
read for a call under another span), and the native encoders encode its links once per step.

A request is an OTel ``SpanContext``, a ``Span`` or a W3C ``traceparent`` string; a mapping
gives each request an id, which its link carries (``otel_gpu.request.id``). A malformed
``traceparent`` is refused with one warning per distinct string and is not linked: the request
still runs, and whoever made its own spans from it starts a new trace. A request of any other
type is the caller's mistake: :class:`TypeError`, naming what is allowed.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_gpu import _guard, config
from otel_gpu.attributes import (
    BATCH_LINKS,
    BATCH_REQUEST_IDS,
    BATCH_REQUEST_TRACE_IDS,
    BATCH_REQUESTS,
    REQUEST_ID,
)
from otel_gpu.calls import _context, armed, lifecycle
from otel_gpu.core import sink
from otel_gpu.core.plan import Plan
from otel_gpu.core.record import Call, CallSpan, StepLinks

__all__ = [
    "BATCH_SPAN_NAME",
    "Matcher",
    "Request",
    "Step",
    "batch",
    "request_context",
    "set_request_rule",
    "step_links",
]

BATCH_SPAN_NAME = "otel_gpu.batch"
"""The step span's name (the public function shares it, so it is not an attribute key)."""

Request = SpanContext | Span | str
"""What a request may be given as: its span's context, its span, or a W3C ``traceparent``."""

_PLAN = Plan(BATCH_SPAN_NAME, 1)
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACEPARENT_MAX = 256  # longer strings are refused unparsed (version 00 has 55 characters)
_PARSED_MAX = 4096  # traceparent strings remembered (each a request); cleared whole when full
_parsed: dict[str, SpanContext | None] = {}
_parsed_lock = threading.Lock()


def request_context(request: Request) -> SpanContext | None:
    """The span context a request stands for; None when it has none to link to (an invalid
    context, a non-recording span of no trace, a malformed ``traceparent``: refused with one
    warning per distinct string). :class:`TypeError` for any other type."""
    if isinstance(request, SpanContext):
        return request if request.is_valid else None
    if isinstance(request, Span):
        try:
            own = request.get_span_context()
            return own if isinstance(own, SpanContext) and own.is_valid else None
        except Exception as exc:  # a span of the user's whose context cannot be read
            _guard.internal_error("batch", exc)
            return None
    if isinstance(request, str):
        if len(request) > _TRACEPARENT_MAX:
            # not remembered: a cache of such keys would hold megabytes
            _guard.warn_once(
                "batch.traceparent_length",
                "otel-gpu: a request traceparent of %d characters refused: a W3C traceparent "
                "has 55 (version 00); the request runs and is not linked",
                len(request),
            )
            return None
        hit = _parsed.get(request, _parsed)
        if hit is not _parsed:
            return hit  # type: ignore[return-value]
        parsed = _parse(request)
        with _parsed_lock:
            if len(_parsed) >= _PARSED_MAX:
                _parsed.clear()
            _parsed[request] = parsed
        if parsed is None:
            _guard.logger.warning(
                "otel-gpu: request traceparent %r refused: not a W3C traceparent "
                "(version-traceid-spanid-flags, e.g. 00-<32 hex>-<16 hex>-01); the request "
                "runs and is not linked",
                request[:80],
            )
        return parsed
    raise TypeError(
        f"otel_gpu.batch: a request must be a SpanContext, a Span or a W3C traceparent string, "
        f"not {type(request).__name__}"
    )


def _parse(traceparent: str) -> SpanContext | None:
    """The official W3C Trace Context propagator's reading of one ``traceparent``."""
    ctx = NonRecordingSpan(SpanContext(0, 0, False))
    try:
        from opentelemetry import trace

        extracted = _PROPAGATOR.extract({"traceparent": traceparent})
        ctx = trace.get_current_span(extracted)  # type: ignore[assignment]
    except Exception as exc:  # the propagator's own failure: the request is not linked
        _guard.internal_error("batch", exc)
    span_context = ctx.get_span_context()
    return span_context if span_context.is_valid else None


Matcher = str | tuple[str, str]
"""What selects a request for live control: a glob on its id and trace id (a string), or a
request attribute's key and a glob on its value (a pair)."""

# live control by request (control/state.py): (the id and trace-id globs, the (key, glob) pairs
# on attributes, the rule the armed functions follow during a step serving a request one of them
# matches); None: no such control
_request_rule: tuple[tuple[str, ...], tuple[tuple[str, str], ...], armed.Rule] | None = None


def set_request_rule(matchers: tuple[Matcher, ...] | None, rule: armed.Rule | None) -> None:
    """During each step serving a request that one of ``matchers`` matches (a glob on its id or
    trace id, 32 hex digits; a (key, glob) pair on one of its attributes), the armed functions
    follow ``rule``; None: no step is treated apart. Set by live control (a control document's
    ``requests`` and ``request_attributes``); read once per step."""
    global _request_rule
    if not matchers or rule is None:
        _request_rule = None
        return
    globs = tuple(m for m in matchers if isinstance(m, str))
    _request_rule = (globs, tuple(m for m in matchers if not isinstance(m, str)), rule)


def _attributes_of(rid: Any, request: Any, given: Mapping[Any, Any] | None) -> Mapping[Any, Any]:
    """A request's attributes: those ``batch(attributes=...)`` gave for its id, else its span's
    (a recording span of the OTel SDK, or of otel-gpu, shows them), else none."""
    if given is not None and rid is not None:
        own = given.get(rid)
        if isinstance(own, Mapping):
            return own
    if isinstance(request, Span):
        spans = getattr(request, "attributes", None)
        if isinstance(spans, Mapping):
            return spans
    return {}


def _value_matches(value: Any, glob: str) -> bool:
    """An attribute's value against a glob: a string, number or bool as its text; a sequence
    when any element matches."""
    if isinstance(value, (list, tuple)):
        return any(_value_matches(v, glob) for v in value)
    if isinstance(value, bool):
        value = "true" if value else "false"
    return value is not None and fnmatch.fnmatchcase(str(value), glob)


def _matches(
    requests: Any,
    globs: tuple[str, ...],
    pairs_of_attributes: tuple[tuple[str, str], ...],
    given: Mapping[Any, Any] | None = None,
) -> bool:
    """Whether a request of the step has an id or trace id one of ``globs`` matches, or an
    attribute one of ``pairs_of_attributes`` does (``given``: ``batch(attributes=...)``,
    attributes by request id)."""
    pairs = requests.items() if isinstance(requests, Mapping) else ((None, r) for r in requests)
    for rid, request in pairs:
        if globs:
            names = [] if rid is None else [str(rid)]
            try:
                ctx = request_context(request)
            except TypeError:
                ctx = None
            if ctx is not None:
                names.append(f"{ctx.trace_id:032x}")
            if any(fnmatch.fnmatchcase(n, g) for n in names for g in globs):
                return True
        if pairs_of_attributes:
            attributes = _attributes_of(rid, request, given)
            for key, glob in pairs_of_attributes:
                if key in attributes and _value_matches(attributes[key], glob):
                    return True
    return False


def step_links(
    requests: Iterable[Request] | Mapping[Any, Request], cap: int
) -> tuple[StepLinks, SpanContext | None]:
    """The links of one step (at most ``cap``, duplicates once) and its counts; and the one
    request's context when the step serves exactly one request that has one."""
    if isinstance(requests, Mapping):
        pairs: list[tuple[Any, Request]] = list(requests.items())
    elif isinstance(requests, (str, SpanContext, Span)):
        raise TypeError(
            "otel_gpu.batch: requests= takes a list (or a mapping of request id to request), "
            f"not one {type(requests).__name__}"
        )
    else:
        pairs = [(None, r) for r in requests]
    links: list[Link] = []
    seen: set[tuple[int, int]] = set()
    only: SpanContext | None = None
    for rid, request in pairs:
        ctx = request_context(request)
        if ctx is None:
            continue
        only = ctx
        key = (ctx.trace_id, ctx.span_id)
        if key in seen or len(links) >= cap:
            continue
        seen.add(key)
        # no attribute but the request's id: a step's links are written once per span, so
        # each byte of a link is paid spans × requests times
        links.append(Link(ctx, {REQUEST_ID: str(rid)} if rid is not None else None))
    n = len(pairs)
    single = only if n == 1 else None
    if single is not None:  # the calls are the request's children: no link to their parent
        links = []
    return StepLinks(tuple(links), {BATCH_REQUESTS: n, BATCH_LINKS: len(links)}), single


def _name_requests(span: CallSpan, step: StepLinks) -> None:
    """The step span alone names its linked requests as attributes (their trace ids, and their
    ids when given): a backend that drops links (Arize Phoenix) or a search by attribute still
    finds the steps of a request. Once per step, not on the calls, whose spans are many."""
    span.set_attribute(
        BATCH_REQUEST_TRACE_IDS, tuple(f"{link.context.trace_id:032x}" for link in step.links)
    )
    ids = tuple(a[REQUEST_ID] for link in step.links if (a := link.attributes) and REQUEST_ID in a)
    if ids:
        span.set_attribute(BATCH_REQUEST_IDS, ids)


class Step:
    """The context manager :func:`batch` returns; one ``with`` per object."""

    __slots__ = ("_attributes", "_call", "_pipe", "_raised", "_requests", "_tokens")

    def __init__(
        self,
        requests: Iterable[Request] | Mapping[Any, Request],
        attributes: Mapping[Any, Mapping[str, Any]] | None = None,
    ) -> None:
        if isinstance(requests, (str, SpanContext, Span)) or not isinstance(
            requests, (Iterable, Mapping)
        ):
            raise TypeError(
                "otel_gpu.batch: requests= takes a list of requests (SpanContext, Span or W3C "
                f"traceparent string) or a mapping of request id to one, not {type(requests).__name__}"
            )
        if attributes is not None and not isinstance(attributes, Mapping):
            raise TypeError(
                "otel_gpu.batch: attributes= takes a mapping of request id (a key of requests=) "
                f"to that request's attributes, not {type(attributes).__name__}"
            )
        self._requests = requests
        self._attributes = attributes
        self._call: Call | None = None
        self._pipe: Any = None
        self._tokens: tuple[Any, Any] | None = None
        self._raised: tuple[Any, Any] | None = None  # (rule set for the step, rule before it)

    def __enter__(self) -> Step:
        control = _request_rule
        if control is not None:  # live control by request: before the step's calls start
            try:
                if isinstance(self._requests, Mapping) or not isinstance(self._requests, Iterable):
                    requests: Any = self._requests
                else:
                    requests = self._requests = list(self._requests)  # read twice: keep it
                globs, attributes, rule = control
                if _matches(requests, globs, attributes, self._attributes):
                    before = armed.rule_in_force()
                    armed.set_rule(rule)
                    self._raised = (rule, before)
            except Exception as exc:
                _guard.internal_error("batch", exc)
        settings = config.current()
        if settings.level == 0 and not settings.controllable:
            return self  # nothing is recorded: nothing to join
        pipe = sink.get()
        if pipe is None:
            return self
        step, single = step_links(self._requests, settings.batch_max_links)
        span: Any
        try:
            if single is not None:
                # one request: a stand-in for its span, so the calls are its children
                span = CallSpan(single, BATCH_SPAN_NAME)
                span.batch = step
            else:
                made = lifecycle.begin(_PLAN, pipe)
                if made is None:
                    return self  # the enclosing trace is not sampled: nor are the calls
                if isinstance(made, Call):
                    made.span.batch = step
                    if step.links:
                        _name_requests(made.span, step)
                    self._call, self._pipe = made, pipe
                    span = made.span
                else:
                    span = made  # the head sampler dropped the step: children agree
            self._tokens = (lifecycle.attach_span(span), _context.STEP.set(step))
        except Exception as exc:
            _guard.internal_error("batch", exc)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tokens, self._tokens = self._tokens, None
        call, self._call = self._call, None
        raised, self._raised = self._raised, None
        if raised is not None:
            try:
                if armed.rule_in_force() is raised[0]:  # unless control changed it meanwhile
                    armed.set_rule(raised[1])
            except Exception as err:
                _guard.internal_error("batch", err)
        try:
            if tokens is not None:
                _context.STEP.reset(tokens[1])
                lifecycle.detach(tokens[0])
            if call is not None:
                call.end_ns = lifecycle.time_ns()
                if exc is not None:
                    call.exc = exc
                    call.tb = tb
                self._pipe.submit(call)
        except Exception as err:
            _guard.internal_error("batch", err)


def batch(
    requests: Iterable[Request] | Mapping[Any, Request],
    attributes: Mapping[Any, Mapping[str, Any]] | None = None,
) -> Step:
    """The step that serves ``requests``: its calls carry links to them (see the module).

    ``requests``: a list of requests, each a ``SpanContext``, a ``Span`` or a W3C
    ``traceparent`` string; or a mapping of request id to request (each link then carries
    ``otel_gpu.request.id``). Use as ``with otel_gpu.batch(requests=[...]):`` around one step.

    ``attributes``: optional, each request's attributes by its id (a key of ``requests``), e.g.
    ``{"req-17": {"tenant": "acme"}}``, for live control by request attribute (a control
    document's ``request_attributes``); a request given as a recording span is matched on the
    span's own attributes. They are read only while such control is in force, and are not
    recorded: they select steps, nothing more.
    """
    return Step(requests, attributes)
