"""Arize Phoenix, an independent OTLP backend, run on loopback for the end-to-end tests.

Phoenix pins its own OpenTelemetry versions, so it lives in its own virtualenv
(``.ci/install-phoenix.sh`` makes one) and the tests find its executable through
``OTEL_GPU_TEST_PHOENIX``. Without it the e2e tests are skipped, except under
``CI=true``, where a missing Phoenix is a failure: CI must not pass by skipping.

What Phoenix does with OTLP, checked against Phoenix 20.x (its source and by experiment):

- it receives OTLP/gRPC on ``PHOENIX_GRPC_PORT`` and OTLP/HTTP (protobuf) at
  ``http://HOST:PHOENIX_PORT/v1/traces``;
- it files spans under the project named by the resource attribute
  ``openinference.project.name`` (else the ``x-project-name`` HTTP header, else
  ``default``); ``service.name`` does not choose the project;
- it keeps each span's name, ids, parent, times, kind, status, attributes and events,
  but no other resource attribute: ``/v1/projects/<project>/spans`` returns spans
  without their resource;
- it keeps no span links: its OTLP decoder (``phoenix/trace/otel.py``, ``decode_otlp_span``)
  ignores them and its span table has no place for them, so ``/spans`` returns no ``links``
  and ``/spans/otlpv1`` returns ``links`` null;
- it stores a dotted attribute key as nested objects (``a.b`` as ``{"a": {"b": ...}}``) and
  returns it flattened again, arrays of strings or numbers as JSON arrays; its span filter
  (the UI's search box, GraphQL ``filterCondition``) names such a key bare (``a.b``), and
  ``"x" in a.b`` on an array matches text within its JSON rendering (checked on its default
  SQLite storage); the REST ``attribute=key:value`` parameter matches no array;
- ``GET /v1/projects/<project>/spans`` pages with ``limit`` (at most 1000) and
  ``next_cursor``, and answers 404 until the project's first span is stored.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "ENV_EXECUTABLE",
    "PhoenixServer",
    "phoenix_executable",
    "run_phoenix",
]

ENV_EXECUTABLE = "OTEL_GPU_TEST_PHOENIX"
"""Path of the ``phoenix`` executable (e.g. ``.ci/.phoenix-venv/bin/phoenix``)."""

ENV_START_TIMEOUT = "OTEL_GPU_TEST_PHOENIX_TIMEOUT"
"""Seconds to wait for Phoenix to become ready (default 180; a cold start takes ~25 s here)."""

_INSTALL_HINT = (
    "run `.ci/install-phoenix.sh` and set "
    f"{ENV_EXECUTABLE}=.ci/.phoenix-venv/bin/phoenix (Phoenix must live in its own virtualenv)"
)


def phoenix_executable() -> str:
    """The Phoenix executable the tests may use.

    Skips the calling test when ``OTEL_GPU_TEST_PHOENIX`` is unset, fails it instead when
    ``CI`` is ``true``, and always fails it when the variable names no executable file.
    """
    path = os.environ.get(ENV_EXECUTABLE, "").strip()
    if not path:
        reason = f"Phoenix end-to-end tests need {ENV_EXECUTABLE}: {_INSTALL_HINT}"
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(
            f"{ENV_EXECUTABLE}={path!r} is not an executable file; {_INSTALL_HINT}", pytrace=False
        )
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PhoenixServer:
    """A running Phoenix: where to send OTLP and how to read spans back."""

    base_url: str
    """``http://127.0.0.1:PORT``: UI, REST API, and the OTLP/HTTP base endpoint."""
    grpc_endpoint: str
    """``http://127.0.0.1:GRPC_PORT`` for OTLP/gRPC."""
    log_path: Path
    process: subprocess.Popen[bytes]

    def get_json(self, path: str, **params: Any) -> Any:
        """GET ``path`` of the REST API; raises ``urllib.error.HTTPError`` on 4xx/5xx."""
        query = urllib.parse.urlencode(params, doseq=True)
        url = f"{self.base_url}{path}" + (f"?{query}" if query else "")
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.load(response)

    def spans(self, project: str, *, otlp: bool = False) -> list[dict[str, Any]]:
        """Every span stored under ``project`` (all pages); ``[]`` while the project does not exist.

        ``otlp``: as the ``/spans/otlpv1`` view returns them (OTLP's field names, attributes as
        key-value lists, a ``links`` field) instead of Phoenix's own span model."""
        out: list[dict[str, Any]] = []
        cursor = None
        path = f"/v1/projects/{urllib.parse.quote(project, safe='')}/spans"
        if otlp:
            path += "/otlpv1"
        while True:
            params: dict[str, Any] = {"limit": 1000, "sort": "start_time", "order": "asc"}
            if cursor:
                params["cursor"] = cursor
            try:
                page = self.get_json(path, **params)
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return []
                raise
            out.extend(page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def search(self, project: str, condition: str) -> list[dict[str, Any]]:
        """The spans of ``project`` that Phoenix's own span filter selects (the condition typed in
        its UI's search box, sent as GraphQL ``filterCondition``): name, span id and trace id each.

        Raises ``AssertionError`` with Phoenix's message when it refuses the condition."""
        query = (
            "query($project: String!, $condition: String!) { getProjectByName(name: $project) {"
            " spans(first: 1000, filterCondition: $condition) { pageInfo { hasNextPage }"
            " edges { node { name spanId trace { traceId } } } } } }"
        )
        body = json.dumps(
            {"query": query, "variables": {"project": project, "condition": condition}}
        )
        request = urllib.request.Request(
            f"{self.base_url}/graphql",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.load(response)
        assert not answer.get("errors"), f"Phoenix refused {condition!r}: {answer['errors']}"
        spans = answer["data"]["getProjectByName"]["spans"]
        assert not spans["pageInfo"]["hasNextPage"], "more than 1000 spans match"
        return [
            {
                "name": e["node"]["name"],
                "span_id": e["node"]["spanId"],
                "trace_id": e["node"]["trace"]["traceId"],
            }
            for e in spans["edges"]
        ]

    def wait_for_spans(self, project: str, n: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Poll until ``project`` holds at least ``n`` spans (Phoenix inserts in the background)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(project)
            if len(spans) >= n:
                return spans
            if time.monotonic() > deadline:
                names = sorted(s["name"] for s in spans)
                raise AssertionError(
                    f"Phoenix project {project!r} holds {len(spans)} span(s) after {timeout:g}s, "
                    f"expected {n}: {names}\n--- Phoenix log tail ---\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _ready(base_url: str, grpc_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/healthz", timeout=2) as response:
            if response.status != 200:
                return False
        with socket.create_connection(("127.0.0.1", grpc_port), timeout=2):
            return True
    except OSError:
        return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, then SIGKILL if it lingers: never leave it running."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=15)


@contextlib.contextmanager
def run_phoenix(executable: str, workdir: Path) -> Iterator[PhoenixServer]:
    """Start ``phoenix serve`` on free loopback ports with its data in ``workdir``; stop it after.

    Raises ``RuntimeError`` with the server's log tail if it exits or is not ready within
    ``OTEL_GPU_TEST_PHOENIX_TIMEOUT`` seconds.
    """
    http_port, grpc_port = _free_port(), _free_port()
    while grpc_port == http_port:
        grpc_port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
    env.update(
        PHOENIX_HOST="127.0.0.1",
        PHOENIX_PORT=str(http_port),
        PHOENIX_GRPC_PORT=str(grpc_port),
        PHOENIX_WORKING_DIR=str(workdir),
        # no phoning home, no assistant features: a plain OTLP backend
        PHOENIX_TELEMETRY_ENABLED="false",
        PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",
        PHOENIX_DISABLE_AGENT_ASSISTANT="true",
        PHOENIX_AGENTS_DISABLE_BASH="true",
        PHOENIX_AGENTS_DISABLE_WEB_ACCESS="true",
        PHOENIX_AGENTS_DISABLE_GITHUB="true",
        PHOENIX_LOG_SQL="false",
    )
    log_path = workdir / "phoenix.log"
    timeout = float(os.environ.get(ENV_START_TIMEOUT, "180"))
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [executable, "serve"],
            env=env,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so _stop reaches its workers too
        )
    server = PhoenixServer(
        base_url=f"http://127.0.0.1:{http_port}",
        grpc_endpoint=f"http://127.0.0.1:{grpc_port}",
        log_path=log_path,
        process=process,
    )
    try:
        deadline = time.monotonic() + timeout
        while not _ready(server.base_url, grpc_port):
            if process.poll() is not None:
                raise RuntimeError(
                    f"phoenix serve exited with {process.returncode} before it was ready:\n"
                    f"{server.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"phoenix serve not ready within {timeout:g}s ({ENV_START_TIMEOUT}):\n"
                    f"{server.log_tail()}"
                )
            time.sleep(0.5)
        yield server
    finally:
        _stop(process)
