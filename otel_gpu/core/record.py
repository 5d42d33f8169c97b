"""The per-call record and the light span that stands in the context during the call.

The caller's thread builds one :class:`Call` per decorated call: ids, clocks and
raw captures, nothing formatted. The export thread turns it into an SDK
``ReadableSpan`` (see :mod:`otel_gpu.export.pipeline`). Part of the core: it imports nothing
of otel-gpu but ``attributes``.

:class:`CallSpan` is what ``trace.get_current_span()`` returns inside a decorated
call: the :class:`Call` itself, a ``CallSpan`` with the record's fields, so a queued call
is one GC-tracked object. It carries the call's real ``SpanContext``, so decorated calls
and user spans opened inside become children; attributes and events a user adds to it are
kept and merged into the exported span.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import DEFAULT_TRACE_STATE, TraceState
from opentelemetry.util import types

from otel_gpu.attributes import (
    EVENT_EXCEPTION,
    EXCEPTION_MESSAGE,
    EXCEPTION_STACKTRACE,
    EXCEPTION_TYPE,
)

if TYPE_CHECKING:
    from otel_gpu.core.plan import Plan

__all__ = [
    "FAST_CONTEXT",
    "Call",
    "CallSpan",
    "ExceptionText",
    "StepLinks",
    "exception_attributes",
    "new_context",
    "standalone",
]

ExceptionText = Callable[[BaseException, Any], tuple[str, str]]
"""``(exception, traceback) -> (message, stack trace)``, e.g. formatted within a time bound."""

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NO_STATE = DEFAULT_TRACE_STATE


def _context_maker() -> tuple[Callable[[int, int, Any], SpanContext], bool]:
    """``SpanContext(trace_id, span_id, False, SAMPLED, state)`` for ids known valid (a parent's
    trace id, or ``getrandbits(...) or 1``): the tuple built directly, without the constructor's
    defaults and range checks (0.5 µs a span, every module of a model a span). Checked once
    against the constructor: any other layout of the tuple gets the constructor itself. The
    boolean says the layout matched, so a parent's tuple may be unpacked as well."""
    new = tuple.__new__

    def fast(trace_id: int, span_id: int, state: Any) -> SpanContext:
        return new(SpanContext, (trace_id, span_id, False, _SAMPLED, state, True))  # type: ignore[type-var]

    def slow(trace_id: int, span_id: int, state: Any) -> SpanContext:
        return SpanContext(trace_id, span_id, False, _SAMPLED, state)

    try:
        probe, real = fast(3, 5, _NO_STATE), slow(3, 5, _NO_STATE)
        same = tuple(probe) == tuple(real) and (
            probe.trace_id,
            probe.span_id,
            probe.is_remote,
            probe.trace_flags,
            probe.trace_state,
            probe.is_valid,
        ) == (3, 5, False, _SAMPLED, real.trace_state, True)
    except Exception:
        same = False
    return (fast, True) if same else (slow, False)


new_context, FAST_CONTEXT = _context_maker()
"""``new_context(trace_id, span_id, state)``, and whether a SpanContext is that plain tuple."""


class StepLinks:
    """What every span of one batch step shares (``otel_gpu.batch``, calls/batch.py): the links
    to the requests it serves and the attributes that count them. Built once per step; each
    call span of the step holds the same object, so the export thread and the native encoders
    see one links tuple per step, never a copy per span."""

    __slots__ = ("attributes", "links")

    def __init__(self, links: tuple[Link, ...], attributes: dict[str, Any]) -> None:
        self.links = links
        """The links to the step's requests (within the cap), shared by every span of the step."""
        self.attributes = attributes
        """How many requests the step served and how many links were kept."""


class CallSpan(trace.Span):
    """A recording span without SDK bookkeeping: costs one small object per call.

    Built with its ``SpanContext``, or with ``ctx`` None and the ids: the context is then built
    when first asked for, so a leaf call never builds one on the caller's thread and queues one
    GC-tracked object less. A decorated call's span is its :class:`Call`, which extends this.
    """

    __slots__ = (
        "_ctx",
        "_state",
        "attributes",
        "batch",
        "events",
        "links",
        "name",
        "span_id",
        "status",
        "trace_id",
    )

    def __init__(
        self,
        ctx: SpanContext | None,
        name: str,
        trace_id: int = 0,
        span_id: int = 0,
        state: TraceState = _NO_STATE,
    ) -> None:
        if ctx is not None:
            trace_id, span_id, state = ctx.trace_id, ctx.span_id, ctx.trace_state
        self._ctx = ctx
        self.trace_id = trace_id
        self.span_id = span_id
        self._state = state
        self.name = name
        self.attributes: dict[str, Any] | None = None
        self.events: list[tuple[str, Mapping[str, Any] | None, int]] | None = None
        self.links: list[Link] | None = None
        self.status: Status | None = None
        self.batch: StepLinks | None = None
        """The batch step this span belongs to (its links and counts), inherited by children."""

    def get_span_context(self) -> SpanContext:
        ctx = self._ctx
        if ctx is None:  # sampled, local, ids known valid: see new_context
            ctx = self._ctx = new_context(self.trace_id, self.span_id, self._state)
        return ctx

    def is_recording(self) -> bool:
        return True

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        if self.attributes is None:
            self.attributes = {}
        self.attributes.update(attributes)

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        if self.attributes is None:
            self.attributes = {}
        self.attributes[key] = value

    def add_event(
        self, name: str, attributes: types.Attributes = None, timestamp: int | None = None
    ) -> None:
        if self.events is None:
            self.events = []
        self.events.append((name, attributes, timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        if self.links is None:
            self.links = []
        self.links.append(Link(context, attributes))

    def update_name(self, name: str) -> None:
        self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if isinstance(status, StatusCode):
            status = Status(status, description)
        self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        attrs: dict[str, Any] = dict(exception_attributes(exception, exception.__traceback__))
        if attributes:
            attrs.update(attributes)
        self.add_event(EVENT_EXCEPTION, attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        """Ignored: the decorator ends the call's span when the call returns."""


def exception_attributes(
    exc: BaseException, tb: Any, text: ExceptionText | None = None
) -> dict[str, str]:
    """The semantic-convention ``exception.*`` attributes.

    ``text`` (the export thread's, :func:`otel_gpu.calls.describe.exception_text`): the message
    and traceback run the exception's ``__str__``, user code that may sleep, so it formats them
    within a time bound rather than letting one exception hold every span queued behind it.
    """
    cls = type(exc)
    qualname = cls.__qualname__
    module = cls.__module__
    if text is not None:
        message, stack = text(exc, tb)
    else:
        message, stack = _safe_str(exc), _safe_traceback(cls, exc, tb)
    return {
        EXCEPTION_TYPE: qualname if module in ("builtins", "__main__") else f"{module}.{qualname}",
        EXCEPTION_MESSAGE: _head(message, _MAX_BYTES),
        EXCEPTION_STACKTRACE: _tail(stack, _MAX_BYTES),
    }


def _safe_traceback(cls: type, exc: BaseException, tb: Any) -> str:
    try:
        return "".join(traceback.format_exception(cls, exc, tb))
    except BaseException as err:  # a hostile __class__/__str__ or chained exception: keep the span
        return f"<traceback could not be formatted: {type(err).__name__}>"


_MAX_BYTES = 2048  # Tempo's default cut for attribute values


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except BaseException as err:  # a hostile __str__ must not lose the span
        return f"<str() failed: {type(err).__name__}>"


def _head(text: str, limit: int) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", "ignore") + "..."


def _tail(text: str, limit: int) -> str:
    """The end of a stack trace: the innermost frames and the exception line matter most."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return "...\n" + data[-(limit - 4) :].decode("utf-8", "ignore")


class Call(CallSpan):
    """One decorated call, as recorded on the caller's thread, and the span current during it.

    The record is its own span (``call.span is call``): a queued call keeps one GC-tracked
    object alive until export, not a record and a span (the collector's full passes walk every
    queued object: ~2 µs an object, amortised, in a small model's forward). Plain slots, no methods on the hot path.

    ``span``: a span made on its own, whose ids, name and contents the record takes over (the
    span itself is dropped); or None, with the ids given (the decorator's calls), the context then
    built when first asked for and the name the plan's.
    """

    __slots__ = (
        "args",
        "bound",
        "device",
        "end_ns",
        "exc",
        "inputs",
        "memory",  # set only where memory is read (calls/memory.py): no per-call cost elsewhere
        "outputs",
        "parent",
        "plan",
        "result",
        "start_ns",
        "stats",
        "tb",
        "token",
    )

    memory: Any  # the allocator's counters at the start (calls/memory.py); not set elsewhere

    def __init__(
        self,
        plan: Plan,
        span: CallSpan | None,
        parent: SpanContext | None,
        start_ns: int,
        trace_id: int = 0,
        span_id: int = 0,
        state: TraceState = _NO_STATE,
    ) -> None:
        if span is None:  # CallSpan.__init__ inlined: one Python call fewer per call
            self._ctx = None
            self.trace_id = trace_id
            self.span_id = span_id
            self._state = state
            self.name = plan.name
            self.attributes = None
            self.events = None
            self.links = None
            self.status = None
            self.batch = None
        else:
            self._ctx = span._ctx
            self.trace_id = span.trace_id
            self.span_id = span.span_id
            self._state = span._state
            self.name = span.name
            self.attributes = span.attributes
            self.events = span.events
            self.links = span.links
            self.status = span.status
            self.batch = span.batch
        self.plan = plan
        self.parent = parent
        self.start_ns = start_ns
        self.end_ns = 0
        self.exc: BaseException | None = None
        self.tb: Any = None
        self.inputs: Sequence[tuple[str, int, Any]] | None = None
        self.outputs: Sequence[tuple[str, int, Any]] | None = None
        self.stats: Any = None
        self.token: Any = None  # observers' per-call state, e.g. a journal slot
        self.device: Any = None  # device time's events, then its result (devices/device_time.py)
        # Live argument values and return value: set only while observers run, then cleared,
        # so queued records never keep user tensors alive.
        self.bound: list[tuple[str, Any, bool]] | None = None
        self.args: tuple[Any, ...] | None = None  # the positional arguments as passed (self first)
        self.result: Any = None

    @property
    def span(self) -> CallSpan:
        """The call's span: the record itself (a property, not a slot: a slot holding its own
        object would be a cycle that only the collector frees)."""
        return self


def standalone(plan: Plan, now_ns: int) -> Call:
    """A record of its own trace, started and ended at ``now_ns``, with no parent: a span that
    reports an event rather than a call (``otel-gpu snapshot``'s, a control change's)."""
    import random

    ctx = SpanContext(random.getrandbits(128) or 1, random.getrandbits(64) or 1, False, _SAMPLED)
    record = Call(plan, CallSpan(ctx, plan.name), None, now_ns)
    record.end_ns = now_ns
    return record
