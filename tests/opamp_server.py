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
the request kept, as a server that is down). Requests are counted whatever the behaviour.
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
                agent.status = message.remote_config_status
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
            if not agent.description:
                answer.flags = opamp_pb2.ServerToAgentFlags_ReportFullState
            config = self.config
            if config is not None and (
                agent.status is None or agent.status.last_remote_config_hash != config.config_hash
            ):
                answer.remote_config.CopyFrom(config)
            return bytes(answer.SerializeToString())

    def push(
        self,
        doc: Any,
        content_type: str = "application/json",
        name: str = "otel-gpu",
        extra: dict[str, bytes] | None = None,
    ) -> bytes:
        """Offer a configuration to every agent: ``doc`` as JSON (bytes are sent as they are).
        Its hash is returned, as agents will name it in their status."""
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        config = opamp_pb2.AgentRemoteConfig()
        entry = config.config.config_map[name]
        entry.body = body
        entry.content_type = content_type
        for other, other_body in (extra or {}).items():
            config.config.config_map[other].body = other_body
        digest = hashlib.sha256(config.config.SerializeToString()).digest()
        config.config_hash = digest
        with self.lock:
            self.config = config
        return digest

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
