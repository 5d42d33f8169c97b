"""Hostile OpAMP servers: whatever a server answers, the agent refuses it, applies nothing,
keeps running and crashes nothing; a refused document comes back FAILED with the reason.

Two kinds of payload, each crafted here: the remote configuration ``otel-gpu`` itself (not
JSON, not UTF-8, nested too deeply, too large, duplicate fields, NaN, a foreign content type),
and the whole answer (bytes that are no protobuf, a truncated message, an answer far larger
than any configuration, an HTTP error). The promises are docs/control.md's, section OpAMP.
"""

from __future__ import annotations

import json
import logging
import tracemalloc

import pytest
from opamp_server import APPLIED, FAILED, FakeState, OpAMPServer, agent_of

from otel_gpu.control import opamp

pytest.importorskip("opentelemetry._opamp")

DOCUMENTS = [
    pytest.param(b"level: 5\nfor: 2m\n", "application/json", "is not JSON", id="yaml"),
    pytest.param(b"\xff\xfe{}", "application/json", "is not UTF-8", id="not-utf8"),
    pytest.param(b"[1, 2]", "application/json", "is a JSON list", id="array"),
    pytest.param(b'"level=10"', "application/json", "is a JSON str", id="string"),
    pytest.param(b'{"level": NaN}', "application/json", "NaN is not a JSON number", id="nan"),
    pytest.param(b'{"level": 5, "level": 0}', "", "'level' twice", id="duplicate-field"),
    pytest.param(b"[" * 30_000 + b"]" * 30_000, "text/json", "nested too deeply", id="deep"),
    pytest.param(
        json.dumps({"level": 5, "include": ["x" * 100_000]}).encode(),
        "application/json",
        "a control document has at most 65536",
        id="over-64KiB",
    ),
    pytest.param(
        b'{"level": 5}', "application/yaml", "content type 'application/yaml'", id="yaml-type"
    ),
    pytest.param(
        b'{"level": 5, "for": 1e999}', "application/json", "for must be", id="infinite-window"
    ),
    pytest.param(
        b'{"__class__": "os.system"}', "application/json", "unknown field", id="unknown-field"
    ),
    pytest.param(b"{}", "application/json", "changes something", id="empty"),
    pytest.param(
        b'{"level": 5}',
        "text/plain\r\nX-Forged: 1\u202e",
        "content type 'text/plain\\r\\nX-Forged: 1\\u202e'",
        id="content-type-with-crlf-and-bidi",
    ),
]


@pytest.mark.parametrize(("body", "content_type", "reason"), DOCUMENTS)
def test_a_hostile_document_is_refused_with_the_reason_and_nothing_applied(
    body, content_type, reason
):
    """Each crafted ``otel-gpu`` entry comes back FAILED with a one-line reason saying what is
    wrong, nothing is applied, and the agent goes on: a good document after it is APPLIED."""
    state = FakeState()
    with OpAMPServer() as server, agent_of(server, state):
        digest = server.push(body, content_type=content_type)
        server.wait(lambda: server.with_status(digest), "the status of the configuration")
        (agent,) = server.with_status(digest)
        assert agent.status.status == FAILED
        assert reason in agent.status.error_message, agent.status.error_message
        assert "\n" not in agent.status.error_message
        assert len(agent.status.error_message) <= 512
        assert state.applied == []
        good = server.push({"level": 3})
        server.wait(lambda: server.with_status(good), "the status of a good configuration")
        assert server.with_status(good)[0].status.status == APPLIED
    assert [change.level for change, _ in state.applied] == [3]


ANSWERS = [
    pytest.param("garbage", b"\xff" * 100, id="not-protobuf"),
    pytest.param(
        "garbage",
        b"\x0a\x10" + b"\x01" * 4,  # field 1 says 16 bytes follow; 4 do
        id="truncated",
    ),
    pytest.param("garbage", b"\x00" * (opamp.MAX_RESPONSE_BYTES + 1), id="over-4MiB"),
    pytest.param("error", b"", id="http-500"),
]


@pytest.mark.parametrize(("behaviour", "raw"), ANSWERS)
def test_a_hostile_answer_is_a_failed_poll_and_the_agent_recovers(behaviour, raw, caplog):
    """An answer that is no ServerToAgent, or too large, or an HTTP error, is a failed poll:
    nothing applied, one warning line (not one per retry, and never the request's bytes), and
    once the server answers properly again its configuration is applied."""
    state = FakeState()
    caplog.set_level(logging.DEBUG)
    with OpAMPServer(behaviour, raw) as server, agent_of(server, state):
        server.wait(lambda: server.requests >= 2, "a retry")
        assert state.applied == []
        server.behaviour = "ok"
        digest = server.push({"level": 5})
        server.wait(lambda: server.with_status(digest), "the status once the server is sane")
        assert server.with_status(digest)[0].status.status == APPLIED
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warnings].count(
        next(r.getMessage() for r in warnings if "does not answer" in r.getMessage())
    ) == 1
    assert not any(r.getMessage().startswith("Job ") for r in warnings)
    assert [change.level for change, _ in state.applied] == [5]


def test_a_huge_answer_is_not_read_into_memory():
    """A server answering 64 MiB (again at each retry) costs the process about the 4 MiB it
    reads before giving up, not the answer: the peak of Python's allocations (tracemalloc)
    stays far below 64 MiB (the client's own transport reads the whole body first: 128 MiB)."""
    huge = b"\x00" * (64 * 1024 * 1024)
    with OpAMPServer("garbage", huge) as server:
        tracemalloc.start()
        try:
            with agent_of(server, FakeState()):
                server.wait(lambda: server.requests >= 2, "two answers")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    print(
        f"\n{server.requests} answers of 64 MiB: peak of Python allocations {peak / 2**20:.1f} MiB"
    )
    assert peak < 32 * 2**20


def test_a_server_error_at_every_poll_is_one_escaped_warning(caplog):
    """A server answering every poll with an error response whose message carries a CR LF and a
    bidi override: one warning line in all, the message escaped (it cannot forge a log line)."""
    caplog.set_level(logging.WARNING)
    with OpAMPServer() as server, agent_of(server, FakeState()):
        server.error_message = "overloaded\r\nERROR forged line\u202e"
        mark = server.requests
        server.wait(lambda: server.requests > mark + 10, "ten polls answered with an error")
    errors = [r.getMessage() for r in caplog.records if "answered with an error" in r.getMessage()]
    assert len(errors) == 1
    assert "\n" not in errors[0] and "\u202e" not in errors[0]
    assert "overloaded" in errors[0]


def test_heartbeats_do_not_queue_up_behind_a_server_that_hangs():
    """A server that takes every request and never answers, for long after the first report
    was given up: the client's queue of heartbeats (unbounded) stays near empty, since each
    request takes at most half the interval and a heartbeat one try (with 5 s requests tried
    twice it grew by about one heartbeat a second at a 1 s interval)."""
    with OpAMPServer("hang") as server, agent_of(server, FakeState()) as agent:
        queue = getattr(agent.agent, "_queue", None)  # the client's own (0.5b0), for this check
        if queue is None:
            pytest.skip("this version of the client keeps its queue elsewhere")
        server.wait(lambda: server.requests >= 10, "heartbeats after the first report was given up")
        assert queue.qsize() <= 3
