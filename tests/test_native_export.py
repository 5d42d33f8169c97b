"""otel-gpu's own destinations with the native encoders say exactly what the official path said.

With ``OTEL_GPU_ENCODER=native`` (the default) the pipeline hands otel-gpu's own provider
``SpanData`` built without ``BoundedAttributes`` and its destinations encode them with
``exporters.otlp_json`` / ``exporters.otlp_proto``; with ``official`` it hands over SDK
``ReadableSpan`` objects encoded by the official exporters. The same calls (levels 1/3/5, a
raising call, a call that sets attributes, events and status on the current span, nested
calls, NaN/Inf statistics) must decode to the same OTLP messages either way: attributes,
events, status, ids, times, resource and scope.

Two comparisons: the same call records built both ways and encoded by each side's encoders
(ids and times identical, so the messages are compared whole), and the same calls made
twice, once per setting, through real ``.jsonl`` and OTLP destinations (ids and times
normalised).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as official_json
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as official_proto,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode
from otel_gpu.exporters.otlp_json import JsonEncoder
from otel_gpu.exporters.otlp_proto import ProtoEncoder
from otel_gpu.exporters.spandata import SpanData

import otel_gpu
from otel_gpu.export import pipeline

try:
    from otlp_receiver import attrs_of, grpc_receiver, hex_ids_to_base64, http_receiver
except ModuleNotFoundError:  # tests/ imported as a package
    from tests.otlp_receiver import attrs_of, grpc_receiver, hex_ids_to_base64, http_receiver


# --------------------------------------------------------------------------- the calls


def _make_lib() -> dict[str, Callable[..., Any]]:
    """Decorated with the settings in force now (call after configure)."""

    def attention(q, k, *, scale=1.0, causal=True):
        return q * scale

    def outer(q, k):
        return lib["attention"](q, k, scale=0.5) + k

    def boom(x, n):
        raise ValueError(f"boom {n}")

    def poison(x):
        y = x.clone()
        y[0] = float("nan")
        y[1] = float("inf")
        return y

    def annotate(x, tag="t"):
        span = trace.get_current_span()
        span.set_attribute("user.tag", "hello")
        span.set_attribute("user.sizes", [1, 2, 3])
        span.set_attributes({"user.ratio": 0.25, "user.flag": True})
        span.add_event("user.checkpoint", {"step": 7, "names": ("a", "b")})
        span.add_event("user.bare")
        span.set_status(Status(StatusCode.OK, "fine"))
        return x

    def rename(x):
        # overwrites one of the decorated function's constant code.* attributes
        trace.get_current_span().set_attribute("code.function.name", "renamed.by.user")
        return x

    lib = {
        fn.__name__: otel_gpu.api(fn) for fn in (attention, outer, boom, poison, annotate, rename)
    }
    return lib


def _run_calls(lib: dict[str, Callable[..., Any]]) -> int:
    """The same calls every time (same tensors, same call sites); returns how many spans."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    lib["attention"](q, k, scale=0.5)
    lib["outer"](q, k)  # two spans: outer and its child
    with pytest.raises(ValueError, match="boom 3"):
        lib["boom"](q, 3)
    lib["poison"](torch.arange(6.0))
    lib["annotate"](q)
    lib["rename"](k)
    return 7


@pytest.fixture
def deferred(monkeypatch):
    """The export thread never wakes on its own: call records stay queued until read."""
    monkeypatch.setattr(pipeline, "_WAKE_EVERY", 10**9)
    monkeypatch.setattr(pipeline, "_WAKE_AT", -1)


def _queued(level: int, tmp_path: Path) -> tuple[pipeline.Pipeline, list[Any]]:
    otel_gpu.configure(level=level, dest=str(tmp_path / "t.jsonl"), provider="own")
    n = _run_calls(_make_lib())
    pipe = pipeline.current()
    assert pipe is not None and pipe.native
    calls = list(pipe.queue)
    assert len(calls) == n
    return pipe, calls


# --------------------------------------------------------------------------- decoding


def _parse_json(text: str, message: Any) -> Any:
    return json_format.Parse(json.dumps(hex_ids_to_base64(json.loads(text), strict=True)), message)


def assert_same_message(ours: Any, official: Any) -> None:
    """The two protobuf messages serialise to the same bytes (shown as dicts when they differ)."""
    a = ours.SerializeToString(deterministic=True)
    b = official.SerializeToString(deterministic=True)
    if a != b:  # show the difference readably
        assert json_format.MessageToDict(ours) == json_format.MessageToDict(official)
    assert a == b


def _compare_records(pipe: pipeline.Pipeline, calls: list[Any]) -> list[SpanData]:
    """Build each call both ways; the native encoders on SpanData must give the official
    encoders' message on ReadableSpan, in protobuf and in JSON."""
    readable = [pipe.materialise(call) for call in calls]
    native = [pipe.materialise_native(call) for call in calls]
    assert all(type(s) is ReadableSpan for s in readable)
    assert all(type(s) is SpanData for s in native)
    for encoders in range(2):  # the second round reads the encoders' warm caches
        proto, text = ProtoEncoder(), JsonEncoder()
        for _ in range(encoders + 1):
            ours = ExportTraceServiceRequest.FromString(proto.encode(native))
            assert_same_message(ours, official_proto(readable))
            theirs = json.dumps(official_json(readable).to_dict(), separators=(",", ":"))
            assert_same_message(
                _parse_json(text.encode(native), ExportTraceServiceRequest()),
                _parse_json(theirs, ExportTraceServiceRequest()),
            )
    return native


# --------------------------------------------------------------------------- same records


@pytest.mark.parametrize("level", [1, 3, 5])
def test_native_spans_decode_to_the_official_paths_message(level, tmp_path, deferred):
    """At levels 1, 3 and 5 the SpanData of each call, encoded natively, decodes to the message
    the official encoders make of the ReadableSpan the official path builds from the same call
    record: plain, nested, raising, NaN-producing calls, and calls that set attributes, events
    and status on the current span or overwrite a code.* attribute."""
    pipe, calls = _queued(level, tmp_path)
    native = _compare_records(pipe, calls)

    by_name = {s.name.rsplit(".", 1)[1]: s for s in native}
    # the constant code.* head is hinted, except where the user overwrote one of its keys; at
    # level 3 a call without statistics, exception or attributes of its own is hinted whole
    attention = by_name["attention"]
    if level == 3:
        assert attention.fixed is not None
        assert attention.fixed[1] == len(attention.attributes) > 3
    else:
        assert attention.fixed == (calls[0].plan, 3)
    assert by_name["rename"].fixed is None
    annotate = by_name["annotate"]
    assert annotate.attributes["user.tag"] == "hello"
    assert [e.name for e in annotate.events][-2:] == ["user.checkpoint", "user.bare"]
    assert annotate.status.status_code is StatusCode.OK
    assert by_name["boom"].status.status_code is StatusCode.ERROR
    assert by_name["rename"].attributes["code.function.name"] == "renamed.by.user"


def test_limits_apply_to_native_spans_as_to_sdk_spans(tmp_path, deferred, monkeypatch):
    """The provider's SpanLimits apply identically on both paths: the attribute count limit
    (summarised in otel_gpu.attributes.omitted), the value length limit
    (OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, strings and strings in sequences cut as the SDK cuts
    them) and the event count limit (otel_gpu.events.omitted, exception event kept)."""
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "6")
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "9")
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "1")
    pipe, calls = _queued(5, tmp_path)
    native = _compare_records(pipe, calls)

    outer = next(s for s in native if s.name.endswith(".outer"))
    assert len(outer.attributes) == 6
    assert outer.attributes["code.function.name"] == outer.name[:9]
    assert outer.attributes["otel_gpu.attributes.omitted"] == "17 attrib"  # cut at 9 characters
    assert outer.fixed is None  # cut values are cleaned by the SDK's BoundedAttributes
    assert outer.attributes["otel_gpu.events.omitted"] == 2
    boom = next(s for s in native if s.name.endswith(".boom"))
    assert [e.name for e in boom.events] == ["exception"]


def test_user_values_the_sdk_cleans_are_cleaned_the_same_way(tmp_path, deferred):
    """Attribute values set on the current span that BoundedAttributes changes (None, a dict,
    mixed sequences, an object, an empty key) reach the native path's span cleaned the same way."""

    class Thing:
        def __str__(self) -> str:
            return "thing"

    otel_gpu.configure(level=3, dest=str(tmp_path / "t.jsonl"), provider="own")

    def odd(x):
        span = trace.get_current_span()
        span.set_attribute("user.none", None)
        span.set_attribute("user.map", {"a": 1, "b": [1, 2]})
        span.set_attribute("user.mixed", [1, "two", 3.0])
        span.set_attribute("user.thing", Thing())
        span.set_attribute("", "empty key")
        return x

    otel_gpu.api(odd)(torch.ones(2))
    pipe = pipeline.current()
    assert pipe is not None
    [span] = _compare_records(pipe, list(pipe.queue))
    assert span.fixed is None and span.dropped_attributes == 1


def test_module_spans_keep_the_hint_and_the_official_message(tmp_path, deferred):
    """instrument_module()'s spans carry constant otel_gpu.module.* attributes after code.*:
    they are hinted as the plan's constant head and still decode to the official message."""
    otel_gpu.configure(level=3, dest=str(tmp_path / "t.jsonl"), provider="own")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    assert otel_gpu.instrument_module(model) == 3
    model(torch.ones(2, 4))
    model(torch.ones(5, 4))
    pipe = pipeline.current()
    assert pipe is not None
    native = _compare_records(pipe, list(pipe.queue))
    assert len(native) == 6
    for span in native:
        assert span.fixed is not None and span.fixed[1] >= 3
        assert "otel_gpu.module.class" in list(span.attributes)[: span.fixed[1]]


def test_plan_attributes_the_pipeline_rewrites_or_the_sdk_cleans_are_not_hinted(tmp_path, deferred):
    """Constant attributes given at decoration that a call overwrites (an otel_gpu.input.* key)
    or that BoundedAttributes may change (a mixed list, which older SDKs drop) are not
    hinted as the plan's constant head, and both paths agree. (The layout cache may hint a
    call's whole attributes, as built and cleaned for that layout.)"""
    from otel_gpu.calls.decorator import decorate as _decorate

    otel_gpu.configure(level=3, dest=str(tmp_path / "t.jsonl"), provider="own")

    def overwritten(x):
        return x

    def mixed(x):
        return x

    _decorate(overwritten, None, {"otel_gpu.input.x.dtype": "declared"})(torch.ones(2))
    _decorate(mixed, None, {"lib.tags": ["a", 1]})(torch.ones(2))
    pipe = pipeline.current()
    assert pipe is not None
    calls = list(pipe.queue)
    first, second = _compare_records(pipe, calls)
    assert first.attributes["otel_gpu.input.x.dtype"] == "torch.float32"
    for span, call in zip((first, second), calls):
        assert span.fixed is None or span.fixed[0] is not call.plan


def test_repeated_layouts_share_their_attributes_and_keep_each_calls_own_values(tmp_path, deferred):
    """Calls of one function whose captured inputs and outputs repeat share one attribute dict
    (built, checked and encoded once), yet what differs between calls that compare equal as
    tuples still differs in their spans: 1, True and 1.0; 0.0 and -0.0; two objects' ids. Every
    span decodes to the message the official path builds without that cache."""
    otel_gpu.configure(level=3, dest=str(tmp_path / "t.jsonl"), provider="own")

    class Handle:  # no tensor inside: recorded as its type and id
        pass

    def step(x, n, handle=None):
        return x

    step = otel_gpu.api(step)
    x = torch.ones(2, 3)
    a, b = Handle(), Handle()
    for n in (1, True, 1.0, 0.0, -0.0, 2, 2):
        step(x, n)
    step(x, 2, a)
    step(x, 2, b)
    step(x, 2, a)
    pipe = pipeline.current()
    assert pipe is not None
    native = _compare_records(pipe, list(pipe.queue))
    values = [s.attributes["otel_gpu.input.n.value"] for s in native[:7]]
    assert [type(v) for v in values] == [int, bool, float, float, float, int, int]
    assert str(values[3]) == "0.0" and str(values[4]) == "-0.0"
    assert native[6].attributes is native[5].attributes  # the repeated layout, shared
    assert native[5].fixed is not None and native[5].fixed[1] == len(native[5].attributes)
    ids = [s.attributes["otel_gpu.input.handle.id"] for s in native[7:]]
    assert ids == [f"0x{id(a):x}", f"0x{id(b):x}", f"0x{id(a):x}"]
    # the attributes before the id are hinted constant, the id is written per span
    keys = list(native[7].attributes)
    assert native[7].fixed is not None
    assert native[7].fixed[1] == keys.index("otel_gpu.input.handle.id")
    assert native[8].fixed == native[7].fixed


def test_the_layout_cache_stays_bounded(tmp_path, deferred):
    """A function called with ever new shapes does not grow the layout cache without bound."""
    from otel_gpu.export import spans

    otel_gpu.configure(level=3, dest=str(tmp_path / "t.jsonl"), provider="own")
    fn = otel_gpu.api(lambda x: None)
    for n in range(spans._LAYOUTS_MAX + 100):
        fn(torch.empty(n))
    pipe = pipeline.current()
    assert pipe is not None
    built = [pipe.materialise_native(call) for call in list(pipe.queue)]
    assert [s.attributes["otel_gpu.input.x.shape"] for s in built[-2:]] == [
        [spans._LAYOUTS_MAX + 98],
        [spans._LAYOUTS_MAX + 99],
    ]
    assert 0 < len(pipe._layouts) <= spans._LAYOUTS_MAX


# --------------------------------------------------------------------------- real destinations


def _normalised(messages: list[Any]) -> list[dict[str, Any]]:
    """Spans of OTLP messages with ids replaced by their order of appearance and times by 0."""
    spans = [
        (rs.resource, ss.scope, span)
        for message in messages
        for rs in message.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    order = {span.span_id: i for i, (_, _, span) in enumerate(spans)}
    traces: dict[bytes, int] = {}
    out = []
    for resource, scope, span in spans:
        copy = type(span)()
        copy.CopyFrom(span)
        copy.trace_id = traces.setdefault(span.trace_id, len(traces)).to_bytes(16, "big")
        copy.span_id = order[span.span_id].to_bytes(8, "big")
        if span.parent_span_id:
            copy.parent_span_id = order[span.parent_span_id].to_bytes(8, "big")
        copy.start_time_unix_nano = copy.end_time_unix_nano = 0
        for event in copy.events:
            event.time_unix_nano = 0
        out.append(
            {
                "resource": attrs_of(resource.attributes),
                "scope": (scope.name, scope.version),
                "span": json_format.MessageToDict(copy),
            }
        )
    return out


def _jsonl_messages(path: Path) -> list[Any]:
    return [_parse_json(line, TracesData()) for line in path.read_text().splitlines()]


def test_jsonl_files_of_both_encoders_hold_the_same_spans(tmp_path):
    """The same calls, made once with OTEL_GPU_ENCODER=native and once with official, give
    .jsonl files whose spans match field by field (ids and times normalised), at level 5."""
    files = {}
    for encoder in ("official", "native"):
        files[encoder] = tmp_path / f"{encoder}.jsonl"
        otel_gpu.configure(level=5, dest=str(files[encoder]), provider="own", encoder=encoder)
        _run_calls(_make_lib())
        pipe = pipeline.current()
        assert pipe is not None and pipe.native is (encoder == "native")
        assert otel_gpu.flush() is True
    official, native = (_normalised(_jsonl_messages(files[e])) for e in ("official", "native"))
    assert len(native) == 7
    assert native == official


@pytest.mark.parametrize(
    ("receiver_factory", "protocol"),
    [(grpc_receiver, "grpc"), (http_receiver, "http/protobuf")],
    ids=["grpc", "http-protobuf"],
)
def test_otlp_requests_of_both_encoders_hold_the_same_spans(
    monkeypatch, receiver_factory, protocol
):
    """Over OTLP (gRPC and HTTP/protobuf), the native exporter's requests carry the same spans
    as the official exporter's, at level 3, and every span is confirmed."""
    got = {}
    with receiver_factory() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        for encoder in ("official", "native"):
            rx.received.clear()
            # spans only: the metrics (on by default) would take their own protocol, gRPC
            otel_gpu.configure(level=3, dest="otlp", provider="own", encoder=encoder, metrics=False)
            n = _run_calls(_make_lib())
            assert otel_gpu.flush() is True
            rx.received.wait_for_spans(n, timeout=10)
            got[encoder] = _normalised(rx.received.requests())
            pipe = pipeline.current()
            assert pipe is not None
            assert [c.confirmed for c in pipe._counters] == [n]
            pipeline.reset(timeout=2.0)  # shut the exporter down while the receiver still runs
    assert len(got["native"]) == 7
    assert got["native"] == got["official"]


def test_an_applications_provider_still_gets_sdk_spans(tmp_path):
    """configure(tracer_provider=...) keeps the SDK path whatever OTEL_GPU_ENCODER says: the
    application's processors get ReadableSpan objects with BoundedAttributes."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel_gpu.configure(level=3, encoder="native", tracer_provider=provider)
    _make_lib()["attention"](torch.ones(2), torch.ones(2))
    assert otel_gpu.flush() is True
    pipe = pipeline.current()
    assert pipe is not None and not pipe.native
    [span] = exporter.get_finished_spans()
    assert type(span) is ReadableSpan
    assert span.attributes["otel_gpu.input.q.shape"] == (2,)
