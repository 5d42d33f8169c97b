"""A loopback OpAMP server for tests, on the protobuf messages the OpAMP client package ships.

It speaks OpAMP's plain-HTTP transport: each ``POST`` carries one ``AgentToServer`` and is
answered with one ``ServerToAgent``. For every agent (by ``instance_uid``) it keeps what the
agent last reported: its description, ``RemoteConfigStatus`` and ``EffectiveConfig``. A
configuration set with :meth:`OpAMPServer.push` is sent to every agent whose last status does
not name its hash yet, as an OpAMP server does; an agent it does not know is asked for its full
state.

``behaviour`` selects how it answers, for fault tests: ``"ok"``; ``"hang"`` (the request is
read and never answered until :meth:`release` or exit); ``"garbage"`` (``raw`` is sent as the
body, e.g. bytes that are no protobuf, or a huge body); ``"error"`` (HTTP 500, and nothing of
the request kept, as a server that is down); ``"redirect"`` (a 307 to ``location`` for the
path ``/v1/opamp``, other paths answered as ``"ok"``); ``"drip-body"`` and ``"drip-headers"``
(a slow-loris: the answer's body, or its headers, one byte every ``DRIP_EVERY`` seconds, at
most ``DRIP_BYTES`` of them, until the client hangs up). Requests are counted whatever the
behaviour. ``full_state_always`` sets the ReportFullState flag in every answer; ``flap``
offers its configurations in turn, one per answer, whatever the agent reported.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry._opamp.proto import anyvalue_pb2, opamp_pb2

from otel_gpu import config
from otel_gpu.control import opamp

DRIP_EVERY = 0.1
DRIP_BYTES = 300  # 30 s of dripping: far past any request's deadline
APPLIED = opamp_pb2.RemoteConfigStatuses_APPLIED
FAILED = opamp_pb2.RemoteConfigStatuses_FAILED


@dataclass
class AgentSeen:
    """What one agent reported, last value of each part."""

    description: dict[str, Any] = field(default_factory=dict)
    identifying: dict[str, Any] = field(default_factory=dict)
    status: Any = None  # RemoteConfigStatus
    effective: dict[str, bytes] = field(default_factory=dict)
    messages: int = 0
    disconnected: bool = False

    def effective_json(self, name: str = "otel-gpu") -> Any:
        body = self.effective.get(name)
        return None if body is None else json.loads(body)


def _value(v: anyvalue_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


class OpAMPServer:
    def __init__(self, behaviour: str = "ok", raw: bytes = b"") -> None:
        self.behaviour = behaviour
        self.raw = raw
        self.agents: dict[bytes, AgentSeen] = {}
        self.requests = 0
        self.headers: dict[str, str] = {}  # of the last request, names lower-cased
        self.config: opamp_pb2.AgentRemoteConfig | None = None
        self.error_message: str | None = None  # set: every answer is a ServerErrorResponse
        self.location = ""  # where "redirect" sends the agent
        self.full_state_always = False
        self.flap: list[opamp_pb2.AgentRemoteConfig] = []
        self.answers = 0  # answers sent with a configuration of ``flap``
        self.statuses: list[tuple[bytes, int]] = []  # each change of an agent's status
        self.dripped = 0  # bytes dripped before the client hung up (or DRIP_BYTES)
        self.cut = threading.Event()  # the client hung up while the server dripped
        self.lock = threading.Lock()
        self._released = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with server.lock:
                    server.headers = {k.lower(): v for k, v in self.headers.items()}
                if server.behaviour == "redirect" and self.path == "/v1/opamp":
                    with server.lock:
                        server.requests += 1
                    self.send_response(307)
                    self.send_header("Location", server.location)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if server.behaviour.startswith("drip-"):
                    with server.lock:
                        server.requests += 1
                    self._drip(server.behaviour == "drip-headers")
                    return
                if server.behaviour == "error":  # as a server that is down: nothing kept
                    with server.lock:
                        server.requests += 1
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                answer = server._handle(body)
                if server.behaviour == "hang":
                    server._released.wait(120)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                try:
                    self.wfile.write(answer)
                except OSError:
                    pass

            def _drip(self, in_headers: bool) -> None:
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                if not in_headers:
                    self.wfile.write(
                        b"Content-Type: application/x-protobuf\r\n"
                        + f"Content-Length: {DRIP_BYTES}\r\n\r\n".encode()
                    )
                    drop = b"\x00"
                else:
                    self.wfile.write(b"X-Drip: ")
                    drop = b"a"
                self.wfile.flush()
                for _ in range(DRIP_BYTES):  # bounded: 30 s at most
                    if server._released.wait(DRIP_EVERY):
                        return
                    try:
                        self.wfile.write(drop)
                        self.wfile.flush()
                    except OSError:
                        server.cut.set()
                        return
                    with server.lock:
                        server.dripped += 1

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/opamp"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> OpAMPServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
        self.httpd.shutdown()
        self.httpd.server_close()

    def release(self) -> None:
        self._released.set()

    # ------------------------------------------------------------------ the protocol

    def _handle(self, body: bytes) -> bytes:
        message = opamp_pb2.AgentToServer()
        message.ParseFromString(body)
        with self.lock:
            self.requests += 1
            agent = self.agents.setdefault(message.instance_uid, AgentSeen())
            agent.messages += 1
            if message.HasField("agent_description"):
                d = message.agent_description
                agent.identifying = {kv.key: _value(kv.value) for kv in d.identifying_attributes}
                agent.description = {
                    **agent.identifying,
                    **{kv.key: _value(kv.value) for kv in d.non_identifying_attributes},
                }
            if message.HasField("remote_config_status"):
                status = message.remote_config_status
                if agent.status is None or (
                    agent.status.last_remote_config_hash != status.last_remote_config_hash
                ):
                    self.statuses.append((status.last_remote_config_hash, status.status))
                agent.status = status
            if message.HasField("effective_config"):
                agent.effective = {
                    name: entry.body
                    for name, entry in message.effective_config.config_map.config_map.items()
                }
            if message.HasField("agent_disconnect"):
                agent.disconnected = True
            if self.behaviour == "garbage":
                return self.raw
            answer = opamp_pb2.ServerToAgent(instance_uid=message.instance_uid)
            if self.error_message is not None:
                answer.error_response.error_message = self.error_message
                return bytes(answer.SerializeToString())
            if not agent.description or self.full_state_always:
                answer.flags = opamp_pb2.ServerToAgentFlags_ReportFullState
            if self.flap:
                answer.remote_config.CopyFrom(self.flap[self.answers % len(self.flap)])
                self.answers += 1
                return bytes(answer.SerializeToString())
            config = self.config
            if config is not None and (
                agent.status is None or agent.status.last_remote_config_hash != config.config_hash
            ):
                answer.remote_config.CopyFrom(config)
            return bytes(answer.SerializeToString())

    def flapping(self, *docs: Any) -> list[bytes]:
        """Offer ``docs`` in turn, one per answer, whatever the agent reported; their hashes."""
        configs = [self._config(doc, "application/json", "otel-gpu", None) for doc in docs]
        with self.lock:
            self.flap = configs
        return [c.config_hash for c in configs]

    def push(
        self,
        doc: Any,
        content_type: str = "application/json",
        name: str = "otel-gpu",
        extra: dict[str, bytes] | None = None,
    ) -> bytes:
        """Offer a configuration to every agent: ``doc`` as JSON (bytes are sent as they are).
        Its hash is returned, as agents will name it in their status."""
        config = self._config(doc, content_type, name, extra)
        with self.lock:
            self.config = config
        return config.config_hash

    @staticmethod
    def _config(
        doc: Any, content_type: str, name: str, extra: dict[str, bytes] | None
    ) -> opamp_pb2.AgentRemoteConfig:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        config = opamp_pb2.AgentRemoteConfig()
        entry = config.config.config_map[name]
        entry.body = body
        entry.content_type = content_type
        for other, other_body in (extra or {}).items():
            config.config.config_map[other].body = other_body
        config.config_hash = hashlib.sha256(config.config.SerializeToString()).digest()
        return config

    def seen(self) -> list[AgentSeen]:
        with self.lock:
            return list(self.agents.values())

    def with_status(self, digest: bytes) -> list[AgentSeen]:
        """The agents whose last status names the configuration ``digest``."""
        return [a for a in self.seen() if a.status and a.status.last_remote_config_hash == digest]

    def wait(self, condition: Any, what: str, limit: float = 120.0) -> None:
        """Wait, generously, for ``condition()`` (a slow shared machine must not fail a test)."""
        deadline = time.monotonic() + limit
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting for {what} after {limit:.0f} s")
            time.sleep(0.05)


class FakeState:
    """Stands for the control state in an in-process agent: what was applied, and by whom."""

    def __init__(self) -> None:
        self.current: dict[str, Any] = {"level": 1}
        self.applied: list[tuple[Any, str]] = []

    def apply(self, change: Any, source: str) -> dict[str, Any]:
        self.applied.append((change, source))
        self.current = {**self.current, **change.fields()}
        return dict(self.current)

    def effective(self) -> dict[str, Any]:
        return dict(self.current)


@contextlib.contextmanager
def agent_of(server: OpAMPServer, state: FakeState, **env: str) -> Iterator[opamp.Agent]:
    """An agent of ``server`` in this process, applying to ``state``, polling every second."""
    settings = config.load(
        env={"OTEL_GPU_OPAMP_ENDPOINT": server.endpoint, "OTEL_GPU_OPAMP_INTERVAL": "1", **env}
    )
    agent = opamp.Agent(
        settings,
        {"service.name": "test-service", "process.pid": 1},
        apply=state.apply,
        effective=state.effective,
    )
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()
