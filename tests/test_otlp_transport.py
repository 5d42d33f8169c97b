"""``OtlpSpanExporter``: otel-gpu's own request bytes over OTLP gRPC and HTTP/protobuf.

Every test points the exporter at the in-process receivers of ``otlp_receiver`` (or a
tiny HTTP server answering 429) and checks what arrived against the official encoder's
message for the same spans, or how failures are retried and reported.
"""

from __future__ import annotations

import http.server
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode
from otel_gpu.exporters.otlp_transport import OtlpSpanExporter
from otel_gpu.exporters.spandata import SpanData

try:
    from otlp_receiver import grpc_receiver, http_receiver
except ModuleNotFoundError:  # tests/ imported as a package
    from tests.otlp_receiver import grpc_receiver, http_receiver

PROTOCOLS = ["grpc", "http/protobuf"]


def _spans(n: int = 3) -> list[SpanData]:
    resource = Resource({"service.name": "transport-test"})
    scope = InstrumentationScope("otel_gpu", "0.1.0")
    return [
        SpanData(
            "f",
            SpanContext(99, i + 1, False),
            None,
            10 + i,
            20 + i,
            {"code.function.name": "f", "otel_gpu.input.x.shape": [2, 3], "x": 1.5},
            [Event("otel_gpu.stats", {"min": 0.0, "numel": 6}, 15)],
            [],
            Status(StatusCode.ERROR, "boom") if i else Status(StatusCode.UNSET),
            resource,
            scope,
            fixed=("f", 1),
        )
        for i in range(n)
    ]


@contextmanager
def _receiver(protocol: str, behaviour: str = "ok") -> Iterator[tuple[str, Any]]:
    """(endpoint for OTEL_EXPORTER_OTLP_ENDPOINT, receiver) of the protocol's receiver."""
    factory = grpc_receiver if protocol == "grpc" else http_receiver
    with factory(behaviour=behaviour) as rx:
        yield rx.endpoint, rx


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_spans_arrive_as_the_official_message_with_env_headers(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Endpoint and headers come from the standard variables, and the receiver decodes the
    request to exactly the official encoder's message."""
    with _receiver(protocol) as (endpoint, rx):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=gpu%20lab,x-other=1")
        exporter = OtlpSpanExporter(protocol)
        spans = _spans()
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        exporter.shutdown()
        [request] = rx.received.requests()
        assert request == encode_spans(spans)
        [headers] = rx.received.headers
        assert headers["x-tenant"] == "gpu lab"
        assert headers["x-other"] == "1"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_gzip_compression_from_the_environment(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_EXPORTER_OTLP_COMPRESSION=gzip compresses the request; the receiver still decodes it."""
    with _receiver(protocol) as (endpoint, rx):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        exporter = OtlpSpanExporter(protocol)
        assert exporter.export(_spans(1)) is SpanExportResult.SUCCESS
        exporter.shutdown()
        assert rx.received.requests() == [encode_spans(_spans(1))]
        if protocol == "http/protobuf":
            assert rx.received.headers[0]["content-encoding"] == "gzip"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_retryable_refusals_are_retried_within_the_timeout_and_reported(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver answering UNAVAILABLE / 503 gets several attempts with backoff, the export
    gives up within OTEL_EXPORTER_OTLP_TIMEOUT, and returns FAILURE instead of raising."""
    with _receiver(protocol, "refuse") as (endpoint, rx):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1.5")
        exporter = OtlpSpanExporter(protocol, backoff=0.05)
        t0 = time.monotonic()
        assert exporter.export(_spans(1)) is SpanExportResult.FAILURE
        assert time.monotonic() - t0 < 2.5
        exporter.shutdown()
        assert len(rx.received.requests()) >= 3


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_hung_receiver_costs_at_most_the_timeout(protocol: str) -> None:
    """A receiver that never answers fails the export after the timeout, without raising."""
    with _receiver(protocol, "hang") as (endpoint, _rx):
        url = endpoint if protocol == "grpc" else endpoint + "/v1/traces"
        exporter = OtlpSpanExporter(protocol, endpoint=url, timeout=1.0, backoff=0.05)
        t0 = time.monotonic()
        assert exporter.export(_spans(1)) is SpanExportResult.FAILURE
        assert time.monotonic() - t0 < 3.0
        exporter.shutdown()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_unreachable_endpoint_fails_quietly(protocol: str) -> None:
    """Nothing listening: FAILURE within the timeout, no exception."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}" + ("" if protocol == "grpc" else "/v1/traces")
    exporter = OtlpSpanExporter(protocol, endpoint=url, timeout=1.0, backoff=0.05)
    assert exporter.export(_spans(1)) is SpanExportResult.FAILURE
    exporter.shutdown()
    assert exporter.export(_spans(1)) is SpanExportResult.FAILURE  # after shutdown: refused


def test_an_outage_is_reported_once_then_summarised_then_its_recovery(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Failed requests during an outage: one warning for the first, nothing for the next ones
    until a summary is due (then one line with the requests and spans lost so far), and one line
    when a request succeeds again, counting what failed meanwhile. A later failure starts anew."""
    from otel_gpu.exporters import otlp_transport

    exporter = OtlpSpanExporter("http/protobuf", endpoint="http://127.0.0.1:9/v1/traces")
    answer = [(False, False, None, "HTTP 400")]  # not retryable: one attempt per request
    monkeypatch.setattr(exporter, "_send", lambda body, timeout: answer[0])

    def lines() -> list[str]:
        found = [r.getMessage() for r in caplog.records if r.name == otlp_transport.__name__]
        caplog.clear()
        return found

    with caplog.at_level(logging.WARNING, logger=otlp_transport.__name__):
        for n in (1, 2, 3, 2, 1):
            assert exporter.export(_spans(n)) is SpanExportResult.FAILURE
        [first] = lines()
        assert first.startswith("OTLP export of 1 spans to http://127.0.0.1:9/v1/traces failed")
        assert "HTTP 400" in first and "one line a minute until it recovers" in first
        monkeypatch.setattr(otlp_transport, "_SUMMARY_EVERY", 0.0)
        assert exporter.export(_spans(4)) is SpanExportResult.FAILURE
        [summary] = lines()
        assert "still failing (HTTP 400): 6 requests (13 spans) failed in" in summary
        answer[0] = (True, False, None, "")
        assert exporter.export(_spans(1)) is SpanExportResult.SUCCESS
        assert exporter.export(_spans(1)) is SpanExportResult.SUCCESS
        [recovered] = lines()
        assert "recovered after" in recovered
        assert recovered.endswith("6 requests (13 spans) failed meanwhile")
        answer[0] = (False, False, None, "HTTP 400")
        assert exporter.export(_spans(2)) is SpanExportResult.FAILURE
        [again] = lines()
        assert again.startswith("OTLP export of 2 spans to")
    exporter.shutdown()


def test_retry_after_is_honoured() -> None:
    """HTTP 429 with ``Retry-After: 0.3`` delays the next attempt by that much, then succeeds."""
    arrivals: list[float] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            arrivals.append(time.monotonic())
            first = len(arrivals) == 1
            self.send_response(429 if first else 200)
            if first:
                self.send_header("Retry-After", "0.3")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        exporter = OtlpSpanExporter("http/protobuf", endpoint=url, timeout=5.0, backoff=0.01)
        assert exporter.export(_spans(1)) is SpanExportResult.SUCCESS
        exporter.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    assert len(arrivals) == 2
    assert arrivals[1] - arrivals[0] >= 0.28


def test_shutdown_interrupts_a_retry_wait() -> None:
    """shutdown() from another thread ends an export sleeping between retries at once."""
    with http_receiver(behaviour="refuse") as rx:
        exporter = OtlpSpanExporter(
            "http/protobuf", endpoint=rx.traces_url, timeout=30.0, backoff=5.0
        )
        result: list[SpanExportResult] = []
        worker = threading.Thread(target=lambda: result.append(exporter.export(_spans(1))))
        worker.start()
        rx.received.wait_for_spans(1)
        t0 = time.monotonic()
        exporter.shutdown()
        worker.join(5.0)
        assert result == [SpanExportResult.FAILURE]
        assert time.monotonic() - t0 < 2.0


def test_the_request_bytes_decode_with_the_official_classes() -> None:
    """What goes over the wire is ``encode_request``: a valid ExportTraceServiceRequest."""
    from otel_gpu.exporters.otlp_proto import encode_request

    spans = _spans()
    assert ExportTraceServiceRequest.FromString(encode_request(spans)) == encode_spans(spans)
