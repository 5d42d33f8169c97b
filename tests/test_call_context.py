"""The call's OTel context operations (otel_gpu/calls/_context.py) behave as the API's own."""

from __future__ import annotations

import contextvars
import logging

import pytest
from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import INVALID_SPAN

from otel_gpu.calls import _context


@pytest.fixture
def tracer():
    return TracerProvider().get_tracer("test")


def test_the_default_runtime_context_takes_the_direct_path():
    """With the SDK's ContextVar runtime context the ContextVar is read directly."""
    assert _context.FAST


def test_current_span_is_the_api_current_span(tracer):
    """current_span() sees an application span made current by the API, and INVALID_SPAN without."""
    assert _context.current_span() is INVALID_SPAN
    with tracer.start_as_current_span("app") as app:
        assert _context.current_span() is app is trace.get_current_span()
    assert _context.current_span() is INVALID_SPAN


def test_attach_span_and_detach_are_seen_by_the_api(tracer):
    """A span attached here is the API's current span, keeps the other context values, and
    detach restores the previous context exactly."""
    token_value = context.attach(context.set_value("user-key", 42))
    try:
        before = context.get_current()
        with tracer.start_as_current_span("app") as app:
            child = tracer.start_span("child")
            token = _context.attach_span(child)
            assert trace.get_current_span() is child
            assert context.get_value("user-key") == 42
            _context.detach(token)
            assert trace.get_current_span() is app
        assert context.get_current() == before
    finally:
        context.detach(token_value)


def test_detaching_a_token_of_another_context_logs_and_never_raises(tracer, caplog):
    """As context.detach: a token made in another context is logged, not raised into the program."""
    span = tracer.start_span("elsewhere")
    token = contextvars.copy_context().run(_context.attach_span, span)
    with caplog.at_level(logging.ERROR, logger="opentelemetry.context"):
        _context.detach(token)
    assert "Failed to detach context" in caplog.text
    assert _context.current_span() is INVALID_SPAN


def test_a_call_span_attached_is_the_current_span_for_both_paths():
    """otel-gpu's own CallSpan (the parent of a nested module call) is returned as it is, by
    current_span() and by the API."""
    from opentelemetry.trace import SpanContext, TraceFlags

    from otel_gpu.core.record import CallSpan

    span = CallSpan(SpanContext(7, 9, False, TraceFlags(TraceFlags.SAMPLED)), "parent")
    token = _context.attach_span(span)
    try:
        assert _context.current_span() is span is trace.get_current_span()
        assert _context.current_span().get_span_context().span_id == 9
    finally:
        _context.detach(token)
    assert _context.current_span() is INVALID_SPAN


def test_a_calls_span_context_is_the_one_the_constructor_builds():
    """The span context a call gets (built without SpanContext's constructor) is equal, field by
    field, to SpanContext(trace_id, span_id, False, SAMPLED, state), with or without a state."""
    from opentelemetry.trace import SpanContext, TraceFlags, TraceState

    from otel_gpu.calls import decorator

    sampled = TraceFlags(TraceFlags.SAMPLED)
    for state in (decorator._NO_STATE, TraceState([("vendor", "v1")])):
        for trace_id, span_id in ((1, 1), (2**128 - 1, 2**64 - 1), (0xABC, 0xDEF)):
            ours = decorator._new_context(trace_id, span_id, state)
            real = SpanContext(trace_id, span_id, False, sampled, state)
            assert type(ours) is SpanContext
            assert ours == real
            assert (ours.trace_id, ours.span_id, ours.is_remote, ours.is_valid) == (
                trace_id,
                span_id,
                False,
                True,
            )
            assert ours.trace_flags.sampled and ours.trace_state is state


@pytest.mark.parametrize("remote", [False, True])
def test_a_parent_read_from_its_tuple_decides_as_its_properties(otel_gpu_spans, remote):
    """A call reads its parent's span context by unpacking the tuple: under a sampled parent it
    joins the parent's trace with its trace state, under an unsampled one it records nothing, and
    under an invalid one it starts a trace of its own, as the properties would decide."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    import otel_gpu
    from otel_gpu.calls import decorator

    assert decorator._FAST_CONTEXT
    spans = otel_gpu_spans(level=1)

    @otel_gpu.api
    def work(x):
        return trace.get_current_span().get_span_context()

    state = TraceState([("vendor", "v1")])
    sampled = SpanContext(0xABC, 0xDEF, remote, TraceFlags(TraceFlags.SAMPLED), state)
    unsampled = SpanContext(0xABC, 0x123, remote, TraceFlags(TraceFlags.DEFAULT), state)
    with trace.use_span(NonRecordingSpan(sampled)):
        inside = work(1)
    with trace.use_span(NonRecordingSpan(unsampled)):
        work(2)
    with trace.use_span(NonRecordingSpan(INVALID_SPAN.get_span_context())):
        root = work(3)
    got = {s.context.span_id: s for s in spans.get()}
    assert set(got) == {inside.span_id, root.span_id}
    child = got[inside.span_id]
    assert child.context.trace_id == 0xABC and child.parent.span_id == 0xDEF
    assert child.parent.is_remote is remote and inside.trace_state is state
    assert got[root.span_id].parent is None and root.trace_id != 0xABC


def test_a_queued_call_is_one_gc_tracked_object(otel_gpu_spans, monkeypatch):
    """A queued level-1 call keeps one GC-tracked object alive, its record, which is also its
    span: a leaf builds no SpanContext on the caller's thread (1 object a call), a call with a
    child has its context built when the child starts (3 objects for the pair: 2 records and
    the parent's context), and the ids agree."""
    import gc

    import otel_gpu
    from otel_gpu.export import pipeline

    monkeypatch.setattr(pipeline, "_WAKE_EVERY", 10**9)  # export waits for the flush
    monkeypatch.setattr(pipeline, "_WAKE_AT", -1)
    spans = otel_gpu_spans(level=1, journal=True)

    @otel_gpu.api
    def leaf(x):
        return x

    @otel_gpu.api
    def parent(x):
        return leaf(x)

    def kept_by(fn, n):
        gc.collect()
        before = len(gc.get_objects())
        for i in range(n):
            fn(i)
        gc.collect(1)  # as the collector would: untrack what holds only atoms
        return (len(gc.get_objects()) - before) / n

    leaf(0)  # the pipeline and the journal's plan entry exist before counting
    parent(0)
    assert otel_gpu.flush(10.0)
    n = 500
    assert 0.9 <= kept_by(leaf, n) <= 1.1
    assert 2.9 <= kept_by(parent, n) <= 3.1
    parent(1)
    assert otel_gpu.flush(10.0)
    got = spans.get()
    assert len(got) == 3 * n + 5
    outer = [s for s in got if s.name.endswith(".parent")][-1]
    inner = [s for s in got if s.name.endswith(".leaf")][-1]
    assert inner.parent.span_id == outer.context.span_id
    assert inner.context.trace_id == outer.context.trace_id


def test_a_queued_level_3_call_keeps_no_metadata_tuples_of_its_own(otel_gpu_spans, monkeypatch):
    """At level 3 a call's captured inputs and outputs are nested tuples, which the collector
    untracks a level per pass: fresh ones reach the oldest generation still tracked (5 kept a
    call here before records were shared). A call whose records equal an earlier call's shares
    them, so a queued call keeps its record only; one holding an object (its id differs per
    call) keeps at most its outer tuple and the object's entry besides, the tensors' entries
    shared."""
    import gc

    import torch

    import otel_gpu
    from otel_gpu.export import pipeline

    monkeypatch.setattr(pipeline, "_WAKE_EVERY", 10**9)  # export waits for the flush
    monkeypatch.setattr(pipeline, "_WAKE_AT", -1)
    spans = otel_gpu_spans(level=3, journal=True)

    @otel_gpu.api
    def leaf(x, flag=True, scale=2):
        return x

    class Cache:
        pass

    @otel_gpu.api
    def with_object(x, cache):
        return x

    x = torch.zeros(2, 3)

    def kept_by(fn, n):
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(n):
            fn()
        gc.collect(1)  # as the collector would: untrack what holds only atoms
        return (len(gc.get_objects()) - before) / n

    leaf(x)
    with_object(x, Cache())
    assert otel_gpu.flush(10.0)
    n = 300
    assert 0.9 <= kept_by(lambda: leaf(x), n) <= 1.1
    cache = Cache()  # one object: a new one each call would be kept by its record
    # the record, its outer tuple and the object's entry
    assert kept_by(lambda: with_object(x, cache), n) <= 3.1
    assert otel_gpu.flush(10.0)
    got = spans.get()
    assert len(got) == 2 * n + 2
    last = [s for s in got if s.name.endswith(".leaf")][-1].attributes
    assert last["otel_gpu.input.x.shape"] == (2, 3)
    assert last["otel_gpu.input.flag.default"] is True


def test_shared_records_keep_what_distinguishes_equal_values(otel_gpu_spans):
    """1, 1.0 and True are equal as tuples, and so are 0.0 and -0.0: a call's attributes are its
    own values, never an earlier call's equal record; an object's id is its own each call."""
    import math

    import otel_gpu

    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def f(v):
        return v

    class Thing:
        __repr__ = object.__repr__

    values = [1, 1.0, True, 0.0, -0.0, 0.0, 1, True]
    for v in values:
        f(v)
        f(v)
    a, b = Thing(), Thing()
    f(a)
    f(b)
    assert otel_gpu.flush(10.0)
    got = [s.attributes for s in spans.get()]
    expected = [v for v in values for _ in range(2)]
    for key in ("otel_gpu.input.v.value", "otel_gpu.output.0.value"):
        seen = [s[key] for s in got[: len(expected)]]
        for value, attr in zip(expected, seen, strict=True):
            assert type(attr) is type(value) and attr == value
            if type(value) is float:
                assert math.copysign(1, attr) == math.copysign(1, value)
    ids = [s["otel_gpu.input.v.id"] for s in got[-2:]]
    assert ids == [f"0x{id(a):x}", f"0x{id(b):x}"]


def test_what_a_shared_record_may_hold():
    """Equal records with the same payload types are one object; a record with a float zero, a
    long string, a payload type that is not an atom (an enum, whose ``__eq__`` may be the
    user's), or of another payload type is its own; an object's record shares only its
    tensors' entries."""
    import enum

    import torch

    from otel_gpu.calls import metadata

    def fresh(raw):  # an equal record that is another object, all the way down
        return tuple(tuple(e) for e in raw)

    tensor = []
    metadata.capture(tensor, "x", torch.zeros(2, 3), 16, None)
    first = (*tensor, ("n", metadata.VALUE, 1), ("flag", metadata.DEFAULT, True))
    assert metadata.shared(first) is first
    assert metadata.shared(fresh(first)) is first
    as_float = (*tensor, ("n", metadata.VALUE, 1.0), ("flag", metadata.DEFAULT, True))
    assert as_float == first and metadata.shared(as_float) is as_float

    class Mode(enum.Enum):
        A = 1

    for value in (0.0, -0.0, "x" * 2000, Mode.A):
        raw = (tensor[0], ("v", metadata.VALUE, value))
        assert metadata.shared(raw) is raw
        again = fresh(raw)
        assert metadata.shared(again) is again
    with_object = (*tensor, ("cache", metadata.OBJECT, ("Cache", None, 1234)))
    got = metadata.shared(with_object)
    assert got == with_object and got[0] is metadata.shared(fresh(with_object))[0]
    assert got[1] is with_object[1]
