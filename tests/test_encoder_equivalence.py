"""otel-gpu's own OTLP encoders say the same thing as the official ones.

For generated batches of spans, ``exporters.otlp_json`` and ``exporters.otlp_proto`` must
decode (with the official opentelemetry-proto classes; JSON after converting the hex ids
to base64, as OTLP/JSON differs from the canonical protobuf JSON mapping there) to the
same ``ExportTraceServiceRequest`` as ``opentelemetry-exporter-otlp-json-common`` and
``opentelemetry-exporter-otlp-proto-common`` produce. Messages are compared by their
deterministic serialisation: stricter than ``==`` (it sees the sign of -0.0) and sensible
for NaN (the same NaN serialises the same; ``==`` never holds for NaN).
"""

from __future__ import annotations

import io
import itertools
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as official_json
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as official_proto,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState
from otel_gpu.exporters.otlp_json import JsonEncoder, JsonLinesSpanExporter, encode_json
from otel_gpu.exporters.otlp_proto import ProtoEncoder, encode_request
from otel_gpu.exporters.spandata import SpanData
from otlp_receiver import hex_ids_to_base64
from test_native_export import assert_same_message

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
SCALARS: list[st.SearchStrategy[Any]] = [
    st.text(max_size=12),
    st.booleans(),
    INT64 | st.sampled_from([-(2**63), 2**63 - 1, 0, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
]
VALUES = st.one_of(
    *SCALARS,
    *[st.lists(s, max_size=4) for s in SCALARS],
    *[st.lists(s, max_size=4).map(tuple) for s in SCALARS],
)
KEYS = st.text(max_size=10) | st.sampled_from(
    ["code.function.name", "otel_gpu.input.q.shape", "otel_gpu.input.q.dtype", "min", "numel"]
)
ATTRIBUTES = st.dictionaries(KEYS, VALUES, max_size=6)
TRACE_IDS = st.integers(min_value=1, max_value=2**128 - 1)
SPAN_IDS = st.integers(min_value=1, max_value=2**64 - 1)
TIMES = st.integers(min_value=0, max_value=2**64 - 1)
TRACE_STATES = st.sampled_from(
    [TraceState(), TraceState([("k", "v")]), TraceState([("vendor", "a1"), ("tenant@sys", "x")])]
)
CONTEXTS = st.builds(
    SpanContext,
    trace_id=TRACE_IDS,
    span_id=SPAN_IDS,
    is_remote=st.booleans(),
    trace_flags=st.sampled_from([TraceFlags(0), TraceFlags(1)]),
    trace_state=TRACE_STATES,
)
STATUSES = st.sampled_from(
    [Status(StatusCode.UNSET), Status(StatusCode.OK), Status(StatusCode.ERROR)]
) | st.builds(Status, st.just(StatusCode.ERROR), st.text(max_size=12))
_RESOURCE = Resource({"service.name": "svc", "host.name": "h"})
RESOURCES = st.sampled_from(
    [
        _RESOURCE,
        Resource({"service.name": "svc", "host.name": "h"}),  # equal to the first, another object
        Resource({"service.name": "other", "n": 3, "ids": (1, 2)}, "https://schema/1"),
        Resource({}),
    ]
)
SCOPES = st.sampled_from(
    [
        InstrumentationScope("otel_gpu", "0.1.0"),
        InstrumentationScope("other", None, "https://schema/2", {"a": 1, "b": ["x"]}),
        None,
    ]
)
EVENTS = st.lists(st.builds(Event, st.text(max_size=8), ATTRIBUTES, TIMES), max_size=3)
LINKS = st.lists(st.builds(Link, CONTEXTS, ATTRIBUTES), max_size=2)
_fixed_keys = itertools.count()


@st.composite
def span_data(draw: st.DrawFn, head: tuple[Any, dict[str, Any]] | None = None) -> SpanData:
    """A SpanData; ``head=(key, attributes)`` puts those constant attributes first, hinted as fixed."""
    ctx = draw(CONTEXTS)
    parent = draw(
        st.none()
        | st.builds(
            SpanContext, st.just(ctx.trace_id), SPAN_IDS, st.booleans(), st.just(TraceFlags(1))
        )
    )
    attributes = draw(ATTRIBUTES)
    fixed = None
    if head is not None:
        key, constant = head
        attributes = {**constant, **{k: v for k, v in attributes.items() if k not in constant}}
        fixed = (key, len(constant))
    span = SpanData(
        name=draw(st.text(max_size=12)),
        context=ctx,
        parent=parent,
        start_time=draw(TIMES),
        end_time=draw(TIMES),
        attributes=attributes,
        events=draw(EVENTS),
        links=draw(LINKS),
        status=draw(STATUSES),
        resource=draw(RESOURCES),
        instrumentation_scope=draw(SCOPES),
        kind=draw(st.sampled_from(list(SpanKind))),
        fixed=fixed,
        dropped_attributes=draw(st.sampled_from([0, 0, 3])),
    )
    span.dropped_events = draw(st.sampled_from([0, 0, 2]))
    span.dropped_links = draw(st.sampled_from([0, 0, 1]))
    return span


def _readable(span: SpanData) -> ReadableSpan:
    """The same span as the SDK's own ReadableSpan, attributes held in BoundedAttributes."""
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=BoundedAttributes(None, span.attributes, immutable=True),
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def _without_hint(span: SpanData) -> SpanData:
    copy = SpanData(
        span.name,
        span.context,
        span.parent,
        span.start_time,
        span.end_time,
        span.attributes,
        span.events,
        span.links,
        span.status,
        span.resource,
        span.instrumentation_scope,
        span.kind,
        None,
        span.dropped_attributes,
    )
    copy.dropped_events, copy.dropped_links = span.dropped_events, span.dropped_links
    return copy


# --------------------------------------------------------------------------- decoding


def _parse_json(text: str) -> ExportTraceServiceRequest:
    """Strict parse (unknown fields fail) of one OTLP/JSON request."""
    return json_format.Parse(
        json.dumps(hex_ids_to_base64(json.loads(text), strict=True)), ExportTraceServiceRequest()
    )


def _official_json(spans: Sequence[Any]) -> ExportTraceServiceRequest:
    return _parse_json(json.dumps(official_json(spans).to_dict(), separators=(",", ":")))


def _check(spans: Sequence[Any]) -> None:
    assert_same_message(
        ExportTraceServiceRequest.FromString(encode_request(spans)), official_proto(spans)
    )
    assert_same_message(_parse_json(encode_json(spans)), _official_json(spans))


# --------------------------------------------------------------------------- properties

_PROPERTY = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])


@_PROPERTY
@given(st.lists(span_data(), max_size=5))
def test_spandata_batches_decode_to_the_official_messages(spans: list[SpanData]) -> None:
    """Any batch of SpanData (all value types, events, links, statuses, parents, several
    resources and scopes) encodes, in JSON and protobuf, to the official encoders' message."""
    _check(spans)


@_PROPERTY
@given(st.lists(span_data(), max_size=4))
def test_readable_spans_decode_to_the_official_messages(spans: list[SpanData]) -> None:
    """Real SDK ReadableSpans (BoundedAttributes, no ``fixed``) encode to the official message."""
    _check([_readable(span) for span in spans])


@_PROPERTY
@given(st.data())
def test_the_fixed_hint_never_changes_the_output(data: st.DataObject) -> None:
    """Spans hinted ``fixed=(key, n)`` encode to exactly what the same spans without the hint
    do, and to the official message, with warm caches and with fresh encoders."""
    heads = [
        (("fn", next(_fixed_keys)), data.draw(st.dictionaries(KEYS, VALUES, max_size=4)))
        for _ in range(data.draw(st.integers(1, 2)))
    ]
    spans = [data.draw(span_data(head=data.draw(st.sampled_from(heads)))) for _ in range(4)]
    plain = [_without_hint(span) for span in spans]
    json_fresh, proto_fresh = JsonEncoder(), ProtoEncoder()
    for _ in range(2):  # the second round reads the cached constant heads
        assert encode_json(spans, json_fresh) == encode_json(plain, JsonEncoder())
        assert encode_request(spans, proto_fresh) == encode_request(plain, ProtoEncoder())
    _check(spans)
    _check(plain)


def test_ints_outside_int64_drop_their_attribute_like_the_official_protobuf_encoder() -> None:
    """An int outside int64 (alone or in a sequence) drops its attribute in both our encoders,
    as the official protobuf encoder does; the rest of the span is unchanged."""
    span = SpanData(
        "f",
        SpanContext(1, 2, False),
        None,
        1,
        2,
        {"big": 2**63, "small": -(2**63) - 1, "seq": [1, 2**64], "ok": 2**63 - 1},
        [Event("e", {"big": 2**70, "fine": 1})],
        [],
        Status(StatusCode.UNSET),
        _RESOURCE,
        InstrumentationScope("otel_gpu"),
    )
    official = official_proto([span])
    assert [kv.key for kv in official.resource_spans[0].scope_spans[0].spans[0].attributes] == [
        "ok"
    ]
    assert_same_message(ExportTraceServiceRequest.FromString(encode_request([span])), official)
    assert_same_message(_parse_json(encode_json([span])), official)


def test_equal_python_values_of_other_types_are_not_confused_by_the_caches() -> None:
    """True, 1 and 1.0 (equal and same-hashed in Python), 0.0 and -0.0, and [1] and (True,)
    each keep their own OTLP type through the fragment caches."""
    values = [True, 1, 1.0, 0.0, -0.0, [1], (True,), [1.0], ("1",), "1"]
    spans = [
        SpanData(
            "f",
            SpanContext(1, i + 1, False),
            None,
            1,
            2,
            {"v": value},
            [],
            [],
            Status(StatusCode.UNSET),
            _RESOURCE,
            None,
        )
        for i, value in enumerate(values * 2)
    ]
    _check(spans)


def test_spans_of_a_real_tracer_provider_decode_to_the_official_messages() -> None:
    """Spans the SDK itself finished (events, links, exceptions, nesting) encode to the official message."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=_RESOURCE)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("otel_gpu", "0.1.0")
    with tracer.start_as_current_span("outer", attributes={"a": [1, 2], "b": "x"}) as outer:
        outer.add_event("otel_gpu.stats", {"min": -1.5, "max": float("inf"), "numel": 8})
        with tracer.start_as_current_span(
            "inner", links=[Link(outer.get_span_context(), {"l": 1})]
        ):
            pass
        try:
            with tracer.start_as_current_span("boom"):
                raise ValueError("boom ü")
        except ValueError:
            pass
    provider.shutdown()
    spans = memory.get_finished_spans()
    assert len(spans) == 3
    _check(spans)


# --------------------------------------------------------------------------- the exporter


def _spans(n: int, name: str = "f") -> list[SpanData]:
    scope = InstrumentationScope("otel_gpu", "0.1.0")
    return [
        SpanData(
            name,
            SpanContext(7, i + 1, False),
            None,
            10 + i,
            20 + i,
            {"code.function.name": name, "otel_gpu.input.x.shape": [2, 3], "i": i},
            [Event("otel_gpu.stats", {"min": 0.5, "numel": 6}, 15 + i)],
            [],
            Status(StatusCode.UNSET),
            _RESOURCE,
            scope,
            fixed=(name, 1),
        )
        for i in range(n)
    ]


def test_the_exporter_appends_one_parseable_line_per_export(tmp_path: Path) -> None:
    """Each export() appends one OTLP/JSON line that parses to the official message of its
    batch; an empty export writes nothing; a second exporter on the same file appends."""
    path = tmp_path / "spans.jsonl"
    batches = [_spans(3), [], _spans(1, "g")]
    exporter = JsonLinesSpanExporter(path)
    for batch in batches:
        assert exporter.export(batch) is SpanExportResult.SUCCESS
    assert exporter.force_flush()
    exporter.shutdown()
    again = JsonLinesSpanExporter(str(path))
    assert again.export(_spans(2)) is SpanExportResult.SUCCESS
    again.shutdown()
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    lines = text.splitlines()
    expected = [b for b in batches if b] + [_spans(2)]
    assert len(lines) == len(expected)
    for line, batch in zip(lines, expected):
        assert_same_message(_parse_json(line), official_proto(batch))


def test_the_exporter_writes_whole_lines_from_many_threads() -> None:
    """Concurrent export() calls never interleave inside a line."""
    stream = io.StringIO()
    exporter = JsonLinesSpanExporter(stream=stream)

    def work(k: int) -> None:
        for _ in range(20):
            exporter.export(_spans(3, f"t{k}"))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 80
    for line in lines:
        assert len(_parse_json(line).resource_spans[0].scope_spans[0].spans) == 3


def test_the_exporter_refuses_work_after_shutdown_and_keeps_a_borrowed_stream_open() -> None:
    """After shutdown() export() fails without writing; a stream passed in is not closed."""
    stream = io.StringIO()
    exporter = JsonLinesSpanExporter(stream=stream)
    exporter.shutdown()
    assert exporter.export(_spans(1)) is SpanExportResult.FAILURE
    assert stream.getvalue() == ""
    assert not stream.closed
    assert exporter.force_flush()


def test_a_span_whose_attributes_are_all_fixed_reuses_its_rest_only_with_the_same_status() -> None:
    """Spans of one ``fixed`` key with nothing of their own (level 1) share the text after
    their times while they share one status object; a span with another status (an error), a
    trace state, no end time or an event of its own is encoded in full, and each span keeps
    its own ids, parent and times."""
    unset = Status(StatusCode.UNSET)
    scope = InstrumentationScope("otel_gpu")
    constant = {"code.function.name": "m.f", "otel_gpu.module.path": "layers.0"}
    key = ("fn", next(_fixed_keys))

    def span(i: int, status: Status = unset, **changes: Any) -> SpanData:
        parent = SpanContext(7, 100 + i, i % 2 == 0, TraceFlags(1)) if i % 3 else None
        fields: dict[str, Any] = {
            "context": SpanContext(7, 200 + i, False, TraceFlags(1)),
            "parent": parent,
            "start_time": 1_000 + i,
            "end_time": 2_000 + i,
            "events": [],
        }
        fields.update(changes)
        return SpanData(
            "layers.0",
            fields["context"],
            fields["parent"],
            fields["start_time"],
            fields["end_time"],
            dict(constant),
            fields["events"],
            [],
            status,
            _RESOURCE,
            scope,
            fixed=(key, len(constant)),
        )

    spans = [
        span(0),
        span(1),
        span(2, Status(StatusCode.ERROR, "boom")),
        span(3),
        span(4, context=SpanContext(7, 204, False, TraceFlags(1), TraceState([("k", "v")]))),
        span(5, end_time=None),
        span(6, events=[Event("e", {"x": 1}, timestamp=5)]),
        span(7),
    ]
    encoder = JsonEncoder()
    for _ in range(2):  # the second round reads every cached rest
        assert encode_json(spans, encoder) == encode_json([_without_hint(s) for s in spans])
    _check(spans)
