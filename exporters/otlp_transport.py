"""OTLP over gRPC or HTTP/protobuf, sending the bytes of ``otlp_proto.encode_request``.

The official exporters encode through protobuf message objects (80–100 µs a span); this
one sends otel-gpu's hand-written request bytes and otherwise behaves like them: the same
``OTEL_EXPORTER_OTLP_(TRACES_)*`` variables (endpoint, headers, timeout, compression, TLS
files, insecure), the same retryable failures (HTTP 429/502/503/504 and connection errors;
gRPC UNAVAILABLE, RESOURCE_EXHAUSTED, …), exponential backoff with ±20 % jitter that
never sleeps past the timeout, and ``Retry-After`` honoured. ``export()`` never raises.

An outage is reported, not repeated: the first failed request gets a warning, further failures
one summary line a minute (requests and spans lost so far), and the first success after them one
line saying the endpoint recovered and what was lost meanwhile.
"""

from __future__ import annotations

import gzip
import logging
import random
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers
from otel_gpu.exporters.otlp_proto import ProtoEncoder

from otel_gpu.config import STANDARD, otel_standard_variables

__all__ = ["OtlpSpanExporter", "endpoint_url"]

_logger = logging.getLogger(__name__)

_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_RETRYABLE_HTTP = frozenset({429, 502, 503, 504})
_RETRYABLE_GRPC = frozenset(
    {
        "CANCELLED",
        "DEADLINE_EXCEEDED",
        "RESOURCE_EXHAUSTED",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNAVAILABLE",
        "DATA_LOSS",
    }
)
_TIMEOUT = next(s.parse for s in STANDARD if s.env == "OTEL_EXPORTER_OTLP_TIMEOUT")
_SUMMARY_EVERY = 60.0  # seconds between the summary lines of an ongoing outage
_DEFAULTS = {"grpc": "http://localhost:4317", "http/protobuf": "http://localhost:4318/v1/traces"}


def _setting(env: Mapping[str, str], name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``."""
    for key in (f"OTEL_EXPORTER_OTLP_TRACES_{name}", f"OTEL_EXPORTER_OTLP_{name}"):
        value = env.get(key, "").strip()
        if value:
            return value
    return None


def endpoint_url(env: Mapping[str, str], protocol: str) -> str:
    """The URL the standard variables name for ``protocol`` (as the official exporters join it)."""
    specific = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if specific:
        return specific  # the signal-specific URL is used as given
    general = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not general:
        return _DEFAULTS[protocol]
    if protocol == "grpc":
        return general
    return general.rstrip("/") + "/v1/traces"


def _seconds(raw: str | None) -> float:
    """The OTLP timeout in seconds; 10 when unset. Configuration rejects one out of its range
    (``otel_gpu.config.STANDARD``); this path is reached only without it (a direct constructor)."""
    if not raw:
        return 10.0
    try:
        return float(_TIMEOUT(raw))
    except ValueError as exc:
        _logger.warning("OTLP timeout %r is invalid (%s); using 10", raw, exc)
        return 10.0


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as file:
        return file.read()


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
        except (TypeError, ValueError):
            return None


class OtlpSpanExporter(SpanExporter):
    """Sends spans as OTLP ``ExportTraceServiceRequest`` bytes over gRPC or HTTP/protobuf.

    Arguments left ``None`` come from the standard variables, then the official defaults.
    ``backoff`` is the first retry delay in seconds (doubling, ±20 % jitter).
    """

    def __init__(
        self,
        protocol: str = "grpc",
        *,
        endpoint: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        compression: str | None = None,
        insecure: bool | None = None,
        backoff: float = 1.0,
    ) -> None:
        if protocol not in _DEFAULTS:
            raise ValueError(f"protocol {protocol!r} is not one of {sorted(_DEFAULTS)}")
        env = otel_standard_variables()
        self.protocol = protocol
        self.endpoint = endpoint or endpoint_url(env, protocol)
        env_headers = _setting(env, "HEADERS")
        self.headers = dict(
            headers if headers is not None else parse_env_headers(env_headers or "", liberal=True)
        )
        self.timeout = timeout if timeout is not None else _seconds(_setting(env, "TIMEOUT"))
        self.compression = (compression or _setting(env, "COMPRESSION") or "none").lower()
        self._backoff = backoff
        self._certificate = _setting(env, "CERTIFICATE")
        self._client_key = _setting(env, "CLIENT_KEY")
        self._client_certificate = _setting(env, "CLIENT_CERTIFICATE")
        if insecure is None:
            raw = _setting(env, "INSECURE")
            insecure = raw.lower() == "true" if raw else None
        self._insecure = insecure
        self._encoder = ProtoEncoder()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        # the ongoing outage: (since, failed requests, spans in them, failed requests reported,
        # when last reported); None while requests succeed
        self._outage: list[Any] | None = None
        self._outage_lock = threading.Lock()
        self._send = self._grpc_client() if protocol == "grpc" else self._http_client()

    # ------------------------------------------------------------------ clients

    def _http_client(self) -> Any:
        import requests

        session = requests.Session()
        session.headers.update(self.headers)
        session.headers["Content-Type"] = "application/x-protobuf"
        if self.compression in ("gzip", "deflate"):
            session.headers["Content-Encoding"] = self.compression
        if self._certificate:
            session.verify = self._certificate
        if self._client_certificate:
            session.cert = (
                (self._client_certificate, self._client_key)
                if self._client_key
                else self._client_certificate
            )
        self._session = session

        def send(body: bytes, timeout: float) -> tuple[bool, bool, float | None, str]:
            """(delivered, retryable, server-requested delay, description)"""
            if self.compression == "gzip":
                body = gzip.compress(body)
            elif self.compression == "deflate":
                body = zlib.compress(body)
            try:
                reply = session.post(self.endpoint, data=body, timeout=timeout)
            except requests.exceptions.RequestException as exc:  # refused, reset, timed out
                return False, True, None, f"{type(exc).__name__}: {exc}"
            if reply.ok:
                return True, False, None, ""
            delay = _retry_after(reply.headers.get("Retry-After"))
            return False, reply.status_code in _RETRYABLE_HTTP, delay, f"HTTP {reply.status_code}"

        return send

    def _grpc_client(self) -> Any:
        import grpc

        parsed = urlparse(self.endpoint)
        insecure = self._insecure
        if parsed.scheme == "https":
            insecure = False
        elif insecure is None:
            insecure = parsed.scheme == "http"
        target = parsed.netloc or self.endpoint
        compression = grpc.Compression.Gzip if self.compression == "gzip" else None
        if insecure:
            channel = grpc.insecure_channel(target, compression=compression)
        else:
            credentials = grpc.ssl_channel_credentials(
                _read(self._certificate), _read(self._client_key), _read(self._client_certificate)
            )
            channel = grpc.secure_channel(target, credentials, compression=compression)
        self._channel = channel
        call = channel.unary_unary(
            _EXPORT_METHOD,
            request_serializer=lambda body: body,  # already wire bytes
            response_deserializer=lambda body: body,  # the response carries nothing we use
        )
        metadata = tuple((key.lower(), value) for key, value in self.headers.items())

        def send(body: bytes, timeout: float) -> tuple[bool, bool, float | None, str]:
            try:
                call(body, metadata=metadata, timeout=timeout)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                name = code.name if code is not None else "UNKNOWN"
                return False, name in _RETRYABLE_GRPC, None, f"gRPC {name}"
            return True, False, None, ""

        return send

    # ------------------------------------------------------------------ SpanExporter

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._stopping.is_set():
            return SpanExportResult.FAILURE
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            body = self._encoder.encode(spans)
        except Exception as exc:  # never break the caller: the spans are lost, not the host
            _logger.warning(
                "OTLP export to %s failed: %s: %s", self.endpoint, type(exc).__name__, exc
            )
            return SpanExportResult.FAILURE
        return self.export_encoded(body, len(spans))

    def export_encoded(self, body: bytes, count: int) -> SpanExportResult:
        """Send ``body``, an encoded ``ExportTraceServiceRequest`` of ``count`` spans (for
        ``otel-gpu ship``, which builds requests from a file's bytes), retrying as ``export``."""
        if self._stopping.is_set():
            return SpanExportResult.FAILURE
        try:
            deadline = time.monotonic() + self.timeout
            attempt = 0
            while True:
                remaining = deadline - time.monotonic()
                delivered, retryable, delay, why = self._send(body, max(remaining, 0.001))
                if delivered:
                    if self._outage is not None:
                        self._recovered()
                    return SpanExportResult.SUCCESS
                if delay is None:
                    delay = self._backoff * 2**attempt * random.uniform(0.8, 1.2)
                attempt += 1
                remaining = deadline - time.monotonic()
                if not retryable or delay > remaining or self._stopping.wait(delay):
                    self._failed(count, attempt, why)
                    return SpanExportResult.FAILURE
        except Exception as exc:  # never break the caller: the spans are lost, not the host
            _logger.warning(
                "OTLP export to %s failed: %s: %s", self.endpoint, type(exc).__name__, exc
            )
            return SpanExportResult.FAILURE

    def _failed(self, count: int, attempt: int, why: str) -> None:
        """Warn of the first failed request of an outage; then one summary a minute."""
        now = time.monotonic()
        with self._outage_lock:
            outage = self._outage
            if outage is None:
                self._outage = [now, 1, count, 1, now]
            else:
                outage[1] += 1
                outage[2] += count
                if now - outage[4] < _SUMMARY_EVERY:
                    return
                outage[3], outage[4] = outage[1], now
                since, requests, spans = outage[0], outage[1], outage[2]
        if outage is None:
            _logger.warning(
                "OTLP export of %d spans to %s failed after %d attempt(s): %s "
                "(further failures: one line a minute until it recovers)",
                count,
                self.endpoint,
                attempt,
                why,
            )
        else:
            _logger.warning(
                "OTLP export to %s still failing (%s): %d requests (%d spans) failed in %.0f s",
                self.endpoint,
                why,
                requests,
                spans,
                now - since,
            )

    def _recovered(self) -> None:
        with self._outage_lock:
            outage, self._outage = self._outage, None
        if outage is None:
            return
        since, requests, spans = outage[0], outage[1], outage[2]
        _logger.warning(
            "OTLP export to %s recovered after %.0f s: %d requests (%d spans) failed meanwhile",
            self.endpoint,
            time.monotonic() - since,
            requests,
            spans,
        )

    def shutdown(self) -> None:
        self._stopping.set()  # wakes an export sleeping between retries
        with self._lock:
            closer = getattr(self, "_channel", None) or getattr(self, "_session", None)
            if closer is not None:
                try:
                    closer.close()
                except Exception:
                    pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export() completes before it returns: nothing is buffered
