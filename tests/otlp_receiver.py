"""In-process OTLP trace (and metrics) receivers for tests.

The receivers here speak the real OTLP wire protocol, built on the official
``opentelemetry-proto`` message and service definitions, so a test can point an
official OTLP exporter (gRPC or HTTP/protobuf) at them and then assert on
exactly what went over the wire.

Both receivers listen on an ephemeral loopback port and are context managers::

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    with grpc_receiver() as rx:
        exporter = OTLPSpanExporter(endpoint=rx.endpoint, insecure=True)
        ...  # produce spans through a TracerProvider using ``exporter``
        [(resource, span)] = rx.received.wait_for_spans(1)
        assert span.name == "work"
        assert attrs_of(resource.attributes)["service.name"] == "svc"

    with http_receiver() as rx:
        # The HTTP exporter takes the full signal URL.
        exporter = HTTPSpanExporter(endpoint=rx.traces_url)  # == rx.endpoint + "/v1/traces"

``behaviour`` selects how the receiver answers, for fault tests:

``"ok"``
    Accept and acknowledge every export.
``"refuse"``
    Answer with a retryable failure: gRPC status ``UNAVAILABLE``, HTTP ``503``.
``"hang"``
    Accept the request and never answer until the context manager exits (or
    :meth:`Receiver.release` is called), as a collector that stopped responding
    would. Exiting the context manager releases hung handlers first, so it
    returns promptly.

Every request that arrives and parses is recorded in :class:`Received`,
whatever the behaviour, so a fault test can also count the exporter's attempts
(``len(rx.received.requests())``). The metadata / headers of every request are
recorded too (keys lower-cased), for checking e.g. ``OTEL_EXPORTER_OTLP_HEADERS``.

Metrics exports (``MetricsService/Export``, ``POST /v1/metrics``) are recorded apart, in
:meth:`Received.metrics`, whatever the behaviour (they are always acknowledged).

The HTTP receiver accepts ``application/x-protobuf`` and ``application/json``
bodies on ``POST /v1/traces``, optionally compressed with ``gzip`` or
``deflate`` (``Content-Encoding``), and answers in the request's content type.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import http.server
import json
import socket
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

__all__ = [
    "Behaviour",
    "HttpReceiver",
    "Received",
    "Receiver",
    "attrs_of",
    "grpc_receiver",
    "hex_id",
    "http_receiver",
]

Behaviour = Literal["ok", "refuse", "hang"]
_BEHAVIOURS: frozenset[str] = frozenset({"ok", "refuse", "hang"})

ExportTraceServiceRequest = trace_service_pb2.ExportTraceServiceRequest
ExportTraceServiceResponse = trace_service_pb2.ExportTraceServiceResponse

TRACES_PATH = "/v1/traces"
METRICS_PATH = "/v1/metrics"

# A hung handler gives up on its own after this long even if nobody releases
# it, so a forgotten receiver can never pin a thread forever.
_HANG_LIMIT_S = 120.0
# Poll interval of hung handlers and of the HTTP accept loop.
_POLL_S = 0.05
# Upper bound for each step of shutting a receiver down.
_STOP_WAIT_S = 5.0


class Received:
    """Thread-safe store of the ``ExportTraceServiceRequest`` messages a receiver got."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._headers: list[dict[str, str]] = []
        self._metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    def add_metrics(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        """Record one metrics export."""
        with self._cond:
            self._metrics.append(request)
            self._cond.notify_all()

    def metrics(self) -> list[metrics_service_pb2.ExportMetricsServiceRequest]:
        """Copy of the metrics exports received so far, in arrival order."""
        with self._cond:
            return list(self._metrics)

    def add(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        headers: dict[str, str],
    ) -> None:
        """Record one request and the headers / metadata it came with."""
        with self._cond:
            self._requests.append(request)
            self._headers.append(dict(headers))
            self._cond.notify_all()

    def clear(self) -> None:
        """Forget everything received so far."""
        with self._cond:
            self._requests.clear()
            self._headers.clear()

    def requests(self) -> list[trace_service_pb2.ExportTraceServiceRequest]:
        """Copy of the requests received so far, in arrival order."""
        with self._cond:
            return list(self._requests)

    @property
    def headers(self) -> list[dict[str, str]]:
        """Headers (HTTP) or invocation metadata (gRPC) of each request, keys lower-cased."""
        with self._cond:
            return [dict(h) for h in self._headers]

    def spans(self) -> list[tuple[Resource, Span]]:
        """All spans received so far, flattened, each with the resource it was sent under."""
        with self._cond:
            return self._spans_locked()

    def _spans_locked(self) -> list[tuple[Resource, Span]]:
        out: list[tuple[Resource, Span]] = []
        for request in self._requests:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    out.extend((resource_spans.resource, span) for span in scope_spans.spans)
        return out

    def wait_for_spans(self, n: int, timeout: float = 10.0) -> list[tuple[Resource, Span]]:
        """Block until at least ``n`` spans arrived and return all spans received.

        Raises ``AssertionError`` naming what did arrive if ``timeout`` seconds pass first.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                spans = self._spans_locked()
                if len(spans) >= n:
                    return spans
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    names = [span.name for _, span in spans]
                    raise AssertionError(
                        f"expected at least {n} span(s) within {timeout:g}s, "
                        f"got {len(spans)} in {len(self._requests)} request(s): {names}"
                    )
                self._cond.wait(remaining)


@dataclass
class Receiver:
    """A running receiver, as yielded by :func:`grpc_receiver` / :func:`http_receiver`."""

    endpoint: str
    """Base URL, ``http://127.0.0.1:PORT``."""
    port: int
    behaviour: Behaviour
    received: Received = field(default_factory=Received)
    _release: threading.Event = field(default_factory=threading.Event, repr=False)

    def release(self) -> None:
        """Let requests held by ``behaviour="hang"`` be answered (and new ones pass) now."""
        self._release.set()


@dataclass
class HttpReceiver(Receiver):
    """An OTLP/HTTP receiver; :attr:`traces_url` is what the HTTP exporter takes."""

    @property
    def traces_url(self) -> str:
        """Full traces URL, ``endpoint + "/v1/traces"``."""
        return self.endpoint + TRACES_PATH


def _check_behaviour(behaviour: str) -> None:
    if behaviour not in _BEHAVIOURS:
        raise ValueError(f"unknown behaviour {behaviour!r}; expected one of {sorted(_BEHAVIOURS)}")


def _hold(release: threading.Event, still_wanted: Any = None) -> None:
    """Wait (bounded) until ``release`` is set or ``still_wanted()`` turns false."""
    deadline = time.monotonic() + _HANG_LIMIT_S
    while not release.wait(_POLL_S):
        if time.monotonic() >= deadline:
            return
        if still_wanted is not None and not still_wanted():
            return


# --------------------------------------------------------------------------- gRPC


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Export(
        self,
        request: metrics_service_pb2.ExportMetricsServiceRequest,
        context: grpc.ServicerContext,
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        self._receiver.received.add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        rx = self._receiver
        metadata = {
            str(key).lower(): value if isinstance(value, str) else repr(value)
            for key, value in (context.invocation_metadata() or ())
        }
        rx.received.add(request, metadata)
        if rx.behaviour == "refuse":
            context.abort(grpc.StatusCode.UNAVAILABLE, "test receiver refuses exports")
        if rx.behaviour == "hang":
            _hold(rx._release, context.is_active)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def grpc_receiver(*, behaviour: Behaviour = "ok", traces_only: bool = False) -> Iterator[Receiver]:
    """Run an OTLP/gRPC trace receiver on ``127.0.0.1`` (ephemeral port) for the block;
    ``traces_only``: without the metrics service, which then answers ``UNIMPLEMENTED`` as a
    traces-only backend (Jaeger, Tempo) does."""
    _check_behaviour(behaviour)
    executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="otlp-grpc-receiver")
    server = grpc.server(executor)
    port = server.add_insecure_port("127.0.0.1:0")
    if not port:
        executor.shutdown(wait=False)
        raise RuntimeError("could not bind a loopback port for the gRPC receiver")
    receiver = Receiver(endpoint=f"http://127.0.0.1:{port}", port=port, behaviour=behaviour)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceServicer(receiver), server)
    if not traces_only:
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _MetricsServicer(receiver), server
        )
    server.start()
    try:
        yield receiver
    finally:
        receiver.release()
        server.stop(grace=0).wait(_STOP_WAIT_S)
        executor.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- HTTP


_HEX_ID_LENGTHS = {"traceId": 32, "spanId": 16, "parentSpanId": 16}


def hex_ids_to_base64(node: Any, strict: bool = False) -> Any:
    """Rewrite OTLP/JSON hex trace/span ids into the base64 that ``json_format`` expects.

    OTLP/JSON encodes ``traceId`` / ``spanId`` / ``parentSpanId`` as hex, unlike the
    canonical protobuf JSON mapping of ``bytes`` (base64). Values that are not hex of
    the right length (already base64) are left alone, unless ``strict``: then every
    non-empty id must be hex of its exact length (tests of what otel-gpu writes).
    """
    if isinstance(node, list):
        return [hex_ids_to_base64(item, strict) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        length = _HEX_ID_LENGTHS.get(key)
        if length is not None and isinstance(value, str) and value:
            if strict:
                assert len(value) == length, f"{key}={value!r} is not {length} hex digits"
                value = base64.b64encode(bytes.fromhex(value)).decode("ascii")
            elif len(value) == length:
                try:
                    value = base64.b64encode(bytes.fromhex(value)).decode("ascii")
                except ValueError:
                    pass
        out[key] = hex_ids_to_base64(value, strict)
    return out


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _decode_body(body: bytes, encoding: str) -> bytes:
    encoding = encoding.strip().lower()
    try:
        if encoding in ("", "identity"):
            return body
        if encoding == "gzip":
            return gzip.decompress(body)
        if encoding == "deflate":
            return zlib.decompress(body)
    except (OSError, EOFError, zlib.error) as exc:
        raise _HttpError(400, f"cannot decode {encoding} body: {exc}") from exc
    raise _HttpError(415, f"unsupported Content-Encoding {encoding!r}")


def _parse_request(body: bytes, content_type: str) -> trace_service_pb2.ExportTraceServiceRequest:
    if content_type not in ("application/x-protobuf", "application/json"):
        raise _HttpError(415, f"unsupported Content-Type {content_type!r}")
    request = trace_service_pb2.ExportTraceServiceRequest()
    try:
        if content_type == "application/x-protobuf":
            request.ParseFromString(body)
        else:
            payload = hex_ids_to_base64(json.loads(body or b"{}"))
            json_format.ParseDict(payload, request, ignore_unknown_fields=True)
    except (ValueError, DecodeError, json_format.ParseError, binascii.Error) as exc:
        raise _HttpError(400, f"cannot parse {content_type} body: {exc}") from exc
    return request


class _ReceiverHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, receiver: HttpReceiver | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _OTLPHandler)
        self.receiver = receiver
        self._conn_lock = threading.Lock()
        self._connections: set[socket.socket] = set()

    def track(self, conn: socket.socket) -> None:
        with self._conn_lock:
            self._connections.add(conn)

    def untrack(self, conn: socket.socket) -> None:
        with self._conn_lock:
            self._connections.discard(conn)

    def drop_connections(self) -> None:
        """Shut down open (e.g. keep-alive) connections so their handler threads end."""
        with self._conn_lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _OTLPHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Idle keep-alive connections are dropped after this long (safety net).
    timeout = 60
    server: _ReceiverHTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.untrack(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output quiet

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            # The client gave up (e.g. its timeout expired while we were hanging).
            self.close_connection = True

    def _reply_text(self, status: int, message: str) -> None:
        self._reply(status, message.encode("utf-8"), "text/plain; charset=utf-8")

    def do_POST(self) -> None:
        receiver = self.server.receiver
        assert receiver is not None
        path = self.path.split("?", 1)[0]
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self.close_connection = True
            self._reply_text(411, "Content-Length required")
            return
        try:
            raw = self.rfile.read(int(length_header))
        except (ValueError, OSError):
            self.close_connection = True
            return
        content_type = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if path == METRICS_PATH and content_type == "application/x-protobuf":
            metrics = metrics_service_pb2.ExportMetricsServiceRequest()
            try:
                metrics.ParseFromString(
                    _decode_body(raw, self.headers.get("Content-Encoding") or "")
                )
            except (_HttpError, DecodeError) as err:
                self._reply_text(400, f"cannot parse metrics: {err}")
                return
            receiver.received.add_metrics(metrics)
            self._reply(
                200,
                metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString(),
                "application/x-protobuf",
            )
            return
        if path != TRACES_PATH:
            self._reply_text(404, f"no such endpoint {path!r}; traces go to {TRACES_PATH}")
            return
        try:
            body = _decode_body(raw, self.headers.get("Content-Encoding") or "")
            request = _parse_request(body, content_type)
        except _HttpError as err:
            self._reply_text(err.status, err.message)
            return
        receiver.received.add(request, {k.lower(): v for k, v in self.headers.items()})

        if receiver.behaviour == "refuse":
            self._reply_text(503, "test receiver refuses exports")
            return
        if receiver.behaviour == "hang":
            _hold(receiver._release)
            self.close_connection = True
        response = trace_service_pb2.ExportTraceServiceResponse()
        if content_type == "application/json":
            self._reply(
                200, json_format.MessageToJson(response).encode("utf-8"), "application/json"
            )
        else:
            self._reply(200, response.SerializeToString(), "application/x-protobuf")


@contextmanager
def http_receiver(*, behaviour: Behaviour = "ok") -> Iterator[HttpReceiver]:
    """Run an OTLP/HTTP trace receiver on ``127.0.0.1`` (ephemeral port) for the block.

    Export to ``receiver.traces_url`` (``receiver.endpoint + "/v1/traces"``).
    """
    _check_behaviour(behaviour)
    server = _ReceiverHTTPServer()
    port = int(server.server_address[1])
    receiver = HttpReceiver(endpoint=f"http://127.0.0.1:{port}", port=port, behaviour=behaviour)
    server.receiver = receiver
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": _POLL_S},
        name="otlp-http-receiver",
        daemon=True,
    )
    thread.start()
    try:
        yield receiver
    finally:
        receiver.release()
        server.shutdown()
        thread.join(_STOP_WAIT_S)
        server.drop_connections()
        server.server_close()


# --------------------------------------------------------------------------- helpers


def _any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attrs_of(value.kvlist_value.values)
    # string_value, bool_value, int_value, double_value, bytes_value
    return getattr(value, kind)


def attrs_of(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    """Convert repeated ``KeyValue`` protos to a plain dict.

    Scalars map to ``str`` / ``bool`` / ``int`` / ``float`` / ``bytes``, arrays to
    ``list`` and key-value lists to nested ``dict``; an empty value becomes ``None``.
    """
    return {kv.key: _any_value(kv.value) for kv in kvs}


def hex_id(b: bytes) -> str:
    """Lower-case hex of a trace / span id as carried in OTLP protos (``""`` if unset)."""
    return b.hex()
