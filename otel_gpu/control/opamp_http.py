"""OpAMP's network rules: the one HTTP transport every request of the agent goes through.

Imported only where the ``opamp`` extra is installed (by :class:`otel_gpu.control.opamp.Agent`).

- **The configured origin only.** Redirects are not left to ``requests``: a 307 or 308 within
  the endpoint's origin (scheme, host and port) is followed, at most :data:`MAX_REDIRECTS`
  times; a redirect to another origin is refused (one warning), so the headers of
  ``OTEL_GPU_OPAMP_HEADERS`` and the agent's description never leave the configured origin,
  and no other server's answer is taken for the server's. A 301, 302 or 303 (which would turn
  the POST into a GET) is a failed poll.
- **A deadline in all.** Each read waits at most the time left (socket timeouts), and at the
  deadline a watchdog shuts the connection down, so a server that drips its status line, its
  headers or its body a byte at a time cannot hold a request past it.
- **One request per interval** (:class:`Pace`), whatever the server's flags say: a server
  asking for the full state gets it with the next poll, never in a request of its own.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
from opentelemetry._opamp import messages
from opentelemetry._opamp.proto import opamp_pb2
from opentelemetry._opamp.transport.exceptions import OpAMPException
from requests.adapters import HTTPAdapter

from otel_gpu import _guard
from otel_gpu._text import printable

__all__ = ["MAX_REDIRECTS", "Pace", "Refused", "Transport", "origin"]

MAX_REDIRECTS = 3
"""Redirects within the server's origin followed for one request."""
_CHUNK = 16 * 1024
_DEFAULT_PORTS = {"http": 80, "https": 443}
_FULL_STATE = opamp_pb2.ServerToAgentFlags_ReportFullState


class Refused(OpAMPException):
    """A request the agent will not make, or an answer it will not take; the transport has
    said why (once), so the agent does not say again that the server does not answer."""


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``url``, the port filled in for http and https."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = -1
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme, 0)


def _name(origin_: tuple[str, str, int]) -> str:
    scheme, host, port = origin_
    host = f"[{host}]" if ":" in host else host
    return printable(f"{scheme}://{host}:{port}")[:200]


class Pace:
    """At most one request per ``interval``, counted from the start of one to the start of
    the next; the goodbye at exit is not held back. A full state owed to the server (it asked,
    a configuration was handled, the effective configuration changed) goes with the next
    request instead of a heartbeat. Used on the client's worker thread only."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.stopping = threading.Event()
        self.owed = False
        self.full_state: Callable[[], bytes] | None = None
        self.started: float | None = None
        """When the last request started (``time.monotonic()``): its answer's time."""

    def turn(self) -> bool:
        """Wait for the next request's turn; False when the agent is stopping."""
        if self.started is not None:
            wait = self.started + self.interval - time.monotonic()
            if wait > 0 and self.stopping.wait(wait):
                return False
        if self.stopping.is_set():
            return False
        self.started = time.monotonic()
        return True


# ---------------------------------------------------------------------- the deadline in all

_current = threading.local()  # the deadline of the request this thread is making


class _Deadline:
    """One request's bound in all: when it runs out, the connections the request uses are shut
    down, so that a read blocked on a server that drips bytes returns at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.expired = False
        self._lock = threading.Lock()
        self._connections: list[Any] = []
        self._done = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.name = "otel-gpu-opamp-deadline"
        self._timer.start()

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def watch(self, connection: Any) -> None:
        with self._lock:
            if self._done:
                return
            self._connections.append(connection)
            if self.expired:
                _shut(connection)

    def _expire(self) -> None:
        with self._lock:  # held while shutting: close() cannot hand a connection on meanwhile
            if self._done:
                return
            self.expired = True
            for connection in self._connections:
                _shut(connection)

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._done = True
            self._connections.clear()


def _shut(connection: Any) -> None:
    sock = getattr(connection, "sock", None)
    if sock is not None:
        try:  # the plain socket's shutdown: a TLS socket's would drop its state under a reader
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except (OSError, TypeError):
            pass


def _watch(connection: Any) -> None:
    deadline = getattr(_current, "deadline", None)
    if deadline is not None:
        deadline.watch(connection)


_watched: dict[type, type] = {}


def _watched_pool(pool_class: Any) -> Any:
    """``pool_class`` whose connections put themselves under the current request's deadline
    when they connect and before they read an answer (urllib3's ``ConnectionCls``)."""
    if getattr(pool_class, "_otel_gpu_watched", False):
        return pool_class
    if pool_class not in _watched:
        base: Any = pool_class.ConnectionCls

        class Connection(base):  # type: ignore[misc,valid-type]
            def connect(self, *args: Any, **kwargs: Any) -> Any:
                _watch(self)
                return super().connect(*args, **kwargs)

            def getresponse(self, *args: Any, **kwargs: Any) -> Any:
                _watch(self)
                return super().getresponse(*args, **kwargs)

        _watched[pool_class] = type(
            pool_class.__name__,
            (pool_class,),
            {"ConnectionCls": Connection, "_otel_gpu_watched": True},
        )
    return _watched[pool_class]


def _watch_manager(manager: Any) -> None:
    classes = getattr(manager, "pool_classes_by_scheme", None)
    if isinstance(classes, Mapping):
        manager.pool_classes_by_scheme = {k: _watched_pool(v) for k, v in classes.items()}


class _Adapter(HTTPAdapter):
    """``requests``' adapter, its pools (and a proxy's) under the deadline."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        _watch_manager(self.poolmanager)

    def proxy_manager_for(self, proxy: Any, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        _watch_manager(manager)
        return manager


# ---------------------------------------------------------------------- the transport


def _is_goodbye(data: bytes) -> bool:
    try:
        return opamp_pb2.AgentToServer.FromString(data).HasField("agent_disconnect")
    except Exception:
        return False


class Transport:
    """The client's transport (``requests``, as its own, which also honours ``HTTPS_PROXY``
    and ``.netrc``), under the rules above: an answer over ``max_bytes`` or past the deadline
    is a failed poll, and a body that is not protobuf too (the client retries with backoff)."""

    def __init__(self, endpoint: str, max_bytes: int, pace: Pace | None = None) -> None:
        self._origin = origin(endpoint)
        self._max_bytes = max_bytes
        self._pace = pace
        self._said_redirect = False
        self._session = requests.Session()
        for prefix in ("http://", "https://"):
            self._session.mount(prefix, _Adapter())

    def send(
        self,
        *,
        url: str,
        headers: Mapping[str, str],
        data: bytes,
        timeout_millis: int,
        tls_certificate: str | bool,
        tls_client_certificate: str | None = None,
        tls_client_key: str | None = None,
    ) -> Any:
        pace = self._pace
        carried = False
        if pace is not None and not _is_goodbye(data):
            if not pace.turn():
                raise Refused("the agent is stopping")
            if pace.owed and pace.full_state is not None:
                data, carried, pace.owed = pace.full_state(), True, False
        cert = (
            (tls_client_certificate, tls_client_key)
            if tls_client_certificate and tls_client_key
            else tls_client_certificate
        )
        deadline = _Deadline(timeout_millis / 1000)
        _current.deadline = deadline
        try:
            body = self._exchange(url, headers, data, deadline, tls_certificate, cert)
            if deadline.expired:  # cut short, headers and all: what came is no answer
                raise OpAMPException("cut at the deadline")
            message = messages.decode_message(body)
        except Exception as exc:
            if carried and pace is not None:
                pace.owed = True
            if deadline.expired:
                raise OpAMPException(f"no whole answer within {deadline.seconds:g} s") from None
            if isinstance(exc, OpAMPException):
                raise
            # requests' errors, and a body that is not a ServerToAgent
            raise OpAMPException(f"{type(exc).__name__}: {exc}") from None
        finally:
            _current.deadline = None
            deadline.close()
        if pace is not None and message.flags & _FULL_STATE:
            message.flags ^= _FULL_STATE  # the client would send it at once, a request of its own
            pace.owed = True
        return message

    def _exchange(
        self,
        url: str,
        headers: Mapping[str, str],
        data: bytes,
        deadline: _Deadline,
        verify: str | bool,
        cert: Any,
    ) -> bytes:
        for _hop in range(MAX_REDIRECTS + 1):
            remaining = deadline.remaining()
            if remaining <= 0:
                raise OpAMPException(f"no whole answer within {deadline.seconds:g} s")
            with self._session.post(
                url,
                headers={"Content-Type": "application/x-protobuf", **headers},
                data=data,
                timeout=remaining,
                verify=verify,
                cert=cert,
                stream=True,
                allow_redirects=False,
            ) as response:
                if response.is_redirect:
                    url = self._redirect(url, response)
                    continue
                response.raise_for_status()
                body = bytearray()
                for chunk in response.iter_content(_CHUNK):
                    body += chunk
                    if len(body) > self._max_bytes:
                        raise OpAMPException(f"an answer over {self._max_bytes} bytes")
                    if deadline.remaining() <= 0:
                        raise OpAMPException(f"no whole answer within {deadline.seconds:g} s")
                return bytes(body)
        raise OpAMPException(f"more than {MAX_REDIRECTS} redirects")

    def _redirect(self, url: str, response: Any) -> str:
        """Where a redirect within the origin leads, or why it is not followed."""
        target = urljoin(url, response.headers.get("location", ""))
        there = origin(target)
        if there != self._origin:
            if not self._said_redirect:
                self._said_redirect = True
                _guard.logger.warning(
                    "otel-gpu: the OpAMP server at %s redirected to another origin (%s); "
                    "not followed: its headers and this process's description go to %s "
                    "only. Set OTEL_GPU_OPAMP_ENDPOINT to the server's own URL",
                    _name(self._origin),
                    _name(there),
                    _name(self._origin),
                )
            raise Refused(f"HTTP {response.status_code}: a redirect to another origin")
        if response.status_code not in (307, 308):
            raise OpAMPException(
                f"HTTP {response.status_code}: a redirect that would turn the POST into a GET "
                "(only 307 and 308 within the server's origin are followed)"
            )
        return target
