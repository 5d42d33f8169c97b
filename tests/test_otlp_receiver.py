"""Tests for the in-process OTLP receivers in ``otlp_receiver``.

They drive the official OTLP exporters (gRPC and HTTP/protobuf) through the
plain OpenTelemetry SDK, so they pin both what those exporters put on the wire
and that the receivers decode it faithfully.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import Status as StatusProto
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

try:
    from otlp_receiver import Receiver, attrs_of, grpc_receiver, hex_id, http_receiver
except ModuleNotFoundError:  # tests/ imported as a package
    from tests.otlp_receiver import Receiver, attrs_of, grpc_receiver, hex_id, http_receiver

SERVICE = "otlp-receiver-test"
SCOPE = "tests.otlp_receiver"

PARENT_ATTRS: dict[str, Any] = {
    "gpu.op": "matmul",
    "gpu.device.index": 3,
    "gpu.duration_ms": 1.25,
    "gpu.synchronized": True,
    "gpu.shape": (64, 128, 256),
}
EVENT_ATTRS: dict[str, Any] = {"bytes": 4096, "direction": "h2d"}

ReceiverFactory = Callable[..., AbstractContextManager[Receiver]]


def _grpc_exporter(rx: Receiver, **kwargs: Any) -> SpanExporter:
    return GrpcSpanExporter(endpoint=rx.endpoint, insecure=True, **kwargs)


def _http_exporter(rx: Receiver, **kwargs: Any) -> SpanExporter:
    return HttpSpanExporter(endpoint=rx.endpoint + "/v1/traces", **kwargs)


TRANSPORTS = [
    pytest.param(grpc_receiver, _grpc_exporter, id="grpc"),
    pytest.param(http_receiver, _http_exporter, id="http"),
]


@pytest.fixture(autouse=True)
def _hermetic_otlp_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Keep ambient OTEL_* settings (endpoint, headers, compression, timeout...) out."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    yield


def _emit_parent_child(exporter: SpanExporter) -> tuple[ReadableSpan, ReadableSpan]:
    """Send a parent/child pair through a TracerProvider + SimpleSpanProcessor."""
    provider = TracerProvider(resource=Resource({"service.name": SERVICE}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer(SCOPE, "1.2.3")
    try:
        with tracer.start_as_current_span("parent", attributes=PARENT_ATTRS) as parent:
            with tracer.start_as_current_span("child", kind=trace.SpanKind.CLIENT) as child:
                child.add_event("copy", attributes=EVENT_ATTRS)
                child.set_status(trace.Status(trace.StatusCode.ERROR, "boom"))
    finally:
        provider.shutdown()  # also shuts the exporter down
    assert isinstance(parent, ReadableSpan) and isinstance(child, ReadableSpan)
    return parent, child


def _unexported_span(name: str = "lonely") -> ReadableSpan:
    """A finished SDK span (a ReadableSpan) that no processor exported."""
    tracer = TracerProvider(resource=Resource({"service.name": SERVICE})).get_tracer(SCOPE)
    span = tracer.start_span(name, attributes={"k": "v"})
    span.end()
    assert isinstance(span, ReadableSpan)
    return span


def _span_id_hex(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return format(ctx.span_id, "016x")


def _trace_id_hex(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return format(ctx.trace_id, "032x")


def _assert_parent_child_received(
    rx: Receiver, sdk_parent: ReadableSpan, sdk_child: ReadableSpan
) -> None:
    spans = rx.received.wait_for_spans(2, timeout=5.0)
    assert len(spans) == 2
    by_name = {span.name: (resource, span) for resource, span in spans}
    assert set(by_name) == {"parent", "child"}
    (parent_res, parent), (child_res, child) = by_name["parent"], by_name["child"]

    for resource in (parent_res, child_res):
        assert attrs_of(resource.attributes)["service.name"] == SERVICE

    # Identity and linkage.
    assert hex_id(parent.trace_id) == hex_id(child.trace_id) == _trace_id_hex(sdk_parent)
    assert hex_id(parent.span_id) == _span_id_hex(sdk_parent)
    assert hex_id(child.span_id) == _span_id_hex(sdk_child)
    assert hex_id(child.parent_span_id) == hex_id(parent.span_id)
    assert parent.parent_span_id == b""

    # Attributes keep their types; sequences arrive as arrays.
    parent_attrs = attrs_of(parent.attributes)
    assert parent_attrs == {**PARENT_ATTRS, "gpu.shape": [64, 128, 256]}
    assert type(parent_attrs["gpu.device.index"]) is int
    assert type(parent_attrs["gpu.duration_ms"]) is float
    assert type(parent_attrs["gpu.synchronized"]) is bool

    # Event, kind and status of the child.
    assert [event.name for event in child.events] == ["copy"]
    assert attrs_of(child.events[0].attributes) == EVENT_ATTRS
    assert child.start_time_unix_nano <= child.events[0].time_unix_nano <= child.end_time_unix_nano
    assert child.kind == SpanProto.SPAN_KIND_CLIENT
    assert parent.kind == SpanProto.SPAN_KIND_INTERNAL
    assert child.status.code == StatusProto.STATUS_CODE_ERROR
    assert child.status.message == "boom"

    # Instrumentation scope survives the trip.
    scopes = {
        (scope_spans.scope.name, scope_spans.scope.version)
        for request in rx.received.requests()
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
    }
    assert scopes == {(SCOPE, "1.2.3")}


@pytest.mark.parametrize(("receiver", "make_exporter"), TRANSPORTS)
def test_official_exporter_round_trip(
    receiver: ReceiverFactory, make_exporter: Callable[..., SpanExporter]
) -> None:
    """The official exporter's parent/child spans arrive intact: names, ids and parent
    linkage, typed attributes (str/int/float/bool/int array), the span event, kind,
    status, scope and the resource's service.name; one request per ended span."""
    with receiver() as rx:
        sdk_parent, sdk_child = _emit_parent_child(make_exporter(rx))
        _assert_parent_child_received(rx, sdk_parent, sdk_child)
        # SimpleSpanProcessor exports each span on end: child first, then parent.
        assert [
            [s.name for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
            for req in rx.received.requests()
        ] == [["child"], ["parent"]]


def test_http_receiver_decodes_gzip_compressed_exports() -> None:
    """A gzip-compressing HTTP exporter (Content-Encoding: gzip) is decoded transparently."""
    with http_receiver() as rx:
        exporter = _http_exporter(rx, compression=Compression.Gzip)
        sdk_parent, sdk_child = _emit_parent_child(exporter)
        _assert_parent_child_received(rx, sdk_parent, sdk_child)
        assert {h.get("content-encoding") for h in rx.received.headers} == {"gzip"}
        assert {h.get("content-type") for h in rx.received.headers} == {"application/x-protobuf"}


@pytest.mark.parametrize(("receiver", "make_exporter"), TRANSPORTS)
def test_custom_headers_from_environment_are_recorded(
    receiver: ReceiverFactory,
    make_exporter: Callable[..., SpanExporter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Headers from OTEL_EXPORTER_OTLP_HEADERS reach the receiver (keys lower-cased)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "X-Test-Token=s3cret,tenant=gpu-team")
    with receiver() as rx:
        exporter = make_exporter(rx)
        try:
            assert exporter.export([_unexported_span()]) == SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        [headers] = rx.received.headers
        assert headers["x-test-token"] == "s3cret"
        assert headers["tenant"] == "gpu-team"
        [(_, span)] = rx.received.spans()
        assert span.name == "lonely"


@contextmanager
def _export_one(
    receiver: ReceiverFactory,
    make_exporter: Callable[..., SpanExporter],
    behaviour: str,
    timeout: float,
    name: str,
) -> Iterator[tuple[Any, SpanExportResult, float]]:
    """Export one span named ``name`` to a receiver with ``behaviour``, then shut the exporter
    down; yields (receiver, result, seconds export() took) inside the receiver's context."""
    with receiver(behaviour=behaviour) as rx:
        exporter = make_exporter(rx, timeout=timeout)
        try:
            started = time.monotonic()
            result = exporter.export([_unexported_span(name)])
            elapsed = time.monotonic() - started
        finally:
            exporter.shutdown()
        yield rx, result, elapsed


@pytest.mark.parametrize(("receiver", "make_exporter"), TRANSPORTS)
def test_refuse_makes_export_fail_after_bounded_retries(
    receiver: ReceiverFactory, make_exporter: Callable[..., SpanExporter]
) -> None:
    """behaviour="refuse" (gRPC UNAVAILABLE / HTTP 503) makes export() return FAILURE
    within the exporter's timeout. The refusal is retryable, so with a 2 s timeout the
    exporter backs off (~1 s) and tries again: the receiver records both attempts."""
    timeout = 2.0
    with _export_one(receiver, make_exporter, "refuse", timeout, "refused") as (
        rx,
        result,
        elapsed,
    ):
        assert result == SpanExportResult.FAILURE
        assert elapsed < timeout + 1.5
        assert len(rx.received.requests()) >= 2
        assert {span.name for _, span in rx.received.spans()} == {"refused"}


@pytest.mark.parametrize(("receiver", "make_exporter"), TRANSPORTS)
def test_hang_times_out_export_and_exits_promptly(
    receiver: ReceiverFactory, make_exporter: Callable[..., SpanExporter]
) -> None:
    """behaviour="hang" accepts the request but never answers: export() gives up with
    FAILURE around its own timeout, and leaving the context manager does not wait
    for the hung handler."""
    timeout = 1.0
    with _export_one(receiver, make_exporter, "hang", timeout, "hung") as (rx, result, elapsed):
        assert result == SpanExportResult.FAILURE
        assert elapsed < timeout + 1.5
        assert rx.received.wait_for_spans(1, timeout=1.0)[0][1].name == "hung"
        exit_started = time.monotonic()
    assert time.monotonic() - exit_started < 2.0


@pytest.mark.parametrize(("receiver", "make_exporter"), TRANSPORTS)
def test_hang_exit_is_prompt_while_a_request_is_in_flight(
    receiver: ReceiverFactory, make_exporter: Callable[..., SpanExporter]
) -> None:
    """Exiting a "hang" receiver while an export is still blocked in it returns
    promptly (hung handlers are released at exit, not waited out)."""
    results: list[SpanExportResult] = []
    with receiver(behaviour="hang") as rx:
        exporter = make_exporter(rx, timeout=5.0)
        worker = threading.Thread(
            target=lambda: results.append(exporter.export([_unexported_span()])), daemon=True
        )
        worker.start()
        rx.received.wait_for_spans(1, timeout=5.0)
        exit_started = time.monotonic()
    assert time.monotonic() - exit_started < 2.0
    worker.join(6.0)
    exporter.shutdown()
    assert not worker.is_alive()
    assert len(results) == 1


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type", "")


def test_http_receiver_accepts_otlp_json_with_hex_ids() -> None:
    """OTLP/JSON bodies (hex trace/span ids, integer enums, lowerCamelCase keys, unknown
    fields ignored) are parsed and answered with a JSON ExportTraceServiceResponse."""
    trace_id, span_id, parent_id = (
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
        "00f067aa0ba902b7",
    )
    payload = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": SERVICE}}]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": SCOPE},
                        "spans": [
                            {
                                "traceId": trace_id,
                                "spanId": span_id,
                                "parentSpanId": parent_id,
                                "name": "from-json",
                                "kind": 3,
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000000000001000",
                                "attributes": [
                                    {"key": "n", "value": {"intValue": "7"}},
                                    {"key": "f", "value": {"doubleValue": 0.5}},
                                ],
                                "someFutureField": True,
                            }
                        ],
                    }
                ],
            }
        ]
    }
    with http_receiver() as rx:
        status, body, content_type = _post(
            rx.traces_url, json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )
        assert status == 200
        assert content_type == "application/json"
        assert json.loads(body) == {}
        [(resource, span)] = rx.received.spans()
        assert attrs_of(resource.attributes) == {"service.name": SERVICE}
        assert (hex_id(span.trace_id), hex_id(span.span_id), hex_id(span.parent_span_id)) == (
            trace_id,
            span_id,
            parent_id,
        )
        assert span.name == "from-json"
        assert span.kind == SpanProto.SPAN_KIND_CLIENT
        assert span.end_time_unix_nano - span.start_time_unix_nano == 1000
        assert attrs_of(span.attributes) == {"n": 7, "f": 0.5}


def test_http_receiver_rejects_bad_requests_without_recording() -> None:
    """Wrong path (``/v1/logs``) -> 404, unsupported content type -> 415, garbage protobuf or gzip -> 400;
    none of them is recorded. A gzip'd protobuf body posted by hand gets a protobuf reply."""
    good = trace_service_pb2.ExportTraceServiceRequest()
    good.resource_spans.add().scope_spans.add().spans.add(name="manual")
    protobuf = {"Content-Type": "application/x-protobuf"}
    with http_receiver() as rx:
        assert _post(rx.endpoint + "/v1/logs", b"", protobuf)[0] == 404
        assert _post(rx.traces_url, b"hello", {"Content-Type": "text/plain"})[0] == 415
        assert _post(rx.traces_url, b"\xff\xff\xff", protobuf)[0] == 400
        bad_gzip = {**protobuf, "Content-Encoding": "gzip"}
        assert _post(rx.traces_url, b"not gzip", bad_gzip)[0] == 400
        assert rx.received.requests() == []

        status, body, content_type = _post(
            rx.traces_url, gzip.compress(good.SerializeToString()), bad_gzip
        )
        assert (status, content_type) == (200, "application/x-protobuf")
        trace_service_pb2.ExportTraceServiceResponse.FromString(body)  # parses
        assert [span.name for _, span in rx.received.spans()] == ["manual"]


def test_wait_for_spans_times_out_with_clear_assertion() -> None:
    """wait_for_spans raises AssertionError naming the expected and received counts."""
    with grpc_receiver() as rx:
        started = time.monotonic()
        with pytest.raises(
            AssertionError, match=r"expected at least 1 span\(s\) within 0.2s, got 0"
        ):
            rx.received.wait_for_spans(1, timeout=0.2)
        assert time.monotonic() - started < 2.0


def test_unknown_behaviour_is_rejected() -> None:
    """Only "ok", "refuse" and "hang" are accepted behaviours."""
    with pytest.raises(ValueError, match="unknown behaviour"):
        with grpc_receiver(behaviour="explode"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="unknown behaviour"):
        with http_receiver(behaviour="explode"):  # type: ignore[arg-type]
            pass


def test_attrs_of_and_hex_id_convert_every_value_kind() -> None:
    """attrs_of maps every AnyValue kind (string, bool, int, double, bytes, array,
    kvlist, unset) to plain Python; hex_id renders ids as lower-case hex."""
    kvs = [
        KeyValue(key="s", value=AnyValue(string_value="x")),
        KeyValue(key="b", value=AnyValue(bool_value=False)),
        KeyValue(key="i", value=AnyValue(int_value=-5)),
        KeyValue(key="d", value=AnyValue(double_value=2.5)),
        KeyValue(key="raw", value=AnyValue(bytes_value=b"\x00\x01")),
        KeyValue(
            key="arr",
            value=AnyValue(
                array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="two")])
            ),
        ),
        KeyValue(
            key="kv",
            value=AnyValue(
                kvlist_value=KeyValueList(
                    values=[KeyValue(key="inner", value=AnyValue(bool_value=True))]
                )
            ),
        ),
        KeyValue(key="empty", value=AnyValue()),
    ]
    assert attrs_of(kvs) == {
        "s": "x",
        "b": False,
        "i": -5,
        "d": 2.5,
        "raw": b"\x00\x01",
        "arr": [1, "two"],
        "kv": {"inner": True},
        "empty": None,
    }
    assert hex_id(bytes.fromhex("00f067aa0ba902b7")) == "00f067aa0ba902b7"
    assert hex_id(b"") == ""
