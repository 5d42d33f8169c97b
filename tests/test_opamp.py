"""OpAMP: with OTEL_GPU_OPAMP_ENDPOINT set, a process reports who it is and its effective
configuration to the server, applies the remote configuration ``otel-gpu`` or refuses it whole
with the reason, and a server that is down or hangs costs its calls nothing.

The server is the loopback one of ``tests/opamp_server.py``, written on the protobuf messages
the OpAMP client package ships. Hostile answers and documents: tests/hostile/test_hostile_opamp.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from commands import without_otel
from jsonl_spans import read_spans
from lib_sources import ALPHA_BETA_LOOP
from lib_sources import progress as _progress
from opamp_server import APPLIED, FAILED, FakeState, OpAMPServer, agent_of

from otel_gpu import config
from otel_gpu.control import opamp

pytest.importorskip("opentelemetry._opamp")


def test_a_pushed_configuration_is_applied_once_and_reported_applied():
    """The ``otel-gpu`` document is parsed and applied once, by a source naming the server, and
    the status APPLIED comes back with the effective configuration; the server offering the
    same configuration again (same hash) does not apply it again (a window would restart)."""
    state = FakeState()
    with OpAMPServer() as server, agent_of(server, state):
        digest = server.push({"level": 5, "include": ["mylib.*"], "for": "2m"})
        server.wait(lambda: server.with_status(digest), "the status of the configuration")
        (agent,) = server.with_status(digest)
        assert agent.status.status == APPLIED and agent.status.error_message == ""
        server.wait(
            lambda: (agent.effective_json() or {}).get("level") == 5, "the effective level 5"
        )
        assert agent.effective_json()["include"] == ["mylib.*"]
        before = server.requests
        server.wait(lambda: server.requests > before + 5, "more polls")
    ((change, source),) = state.applied
    assert change.level == 5 and change.include == ("mylib.*",) and change.window == 120.0
    assert source == "opamp " + server.endpoint


def test_a_bad_document_is_refused_whole_with_the_reason_and_nothing_changes():
    """A document with one bad field (the others fine) is refused whole: FAILED with a reason
    naming the field and what is allowed, nothing applied, the effective configuration the same."""
    state = FakeState()
    with OpAMPServer() as server, agent_of(server, state):
        server.wait(lambda: server.seen() and server.seen()[0].effective, "a first report")
        digest = server.push({"level": 5, "sample": 2})
        server.wait(lambda: server.with_status(digest), "the status of the configuration")
        (agent,) = server.with_status(digest)
    assert agent.status.status == FAILED
    assert "sample" in agent.status.error_message
    assert "from 0 to 1" in agent.status.error_message
    assert state.applied == []
    assert agent.effective_json() == {"level": 1}


def test_a_configuration_without_the_otel_gpu_entry_is_refused_naming_it():
    """A remote configuration meant for someone else (no entry ``otel-gpu``) is FAILED with a
    reason naming the entry it lacks and those it has, and nothing is applied."""
    state = FakeState()
    with OpAMPServer() as server, agent_of(server, state):
        digest = server.push({"level": 5}, name="collector.yaml")
        server.wait(lambda: server.with_status(digest), "the status of the configuration")
        (agent,) = server.with_status(digest)
    assert agent.status.status == FAILED
    assert "no entry named 'otel-gpu'" in agent.status.error_message
    assert "collector.yaml" in agent.status.error_message
    assert state.applied == []


def test_a_change_of_the_effective_configuration_is_reported_at_the_next_poll():
    """When the effective configuration changes in the process (a window ran out, local
    control), the server hears the new one at the next poll, without asking for it."""
    state = FakeState()
    with OpAMPServer() as server, agent_of(server, state):
        server.wait(lambda: server.seen() and server.seen()[0].effective, "a first report")
        state.current = {"level": 3, "changed_by": "otel-gpu control"}
        server.wait(
            lambda: server.seen()[0].effective_json() == state.current, "the new configuration"
        )


def test_a_server_that_comes_back_after_the_first_report_was_given_up_is_found():
    """The server fails every request until the agent has given up its first report (5 tries):
    the heartbeats find it when it is back, it asks for the full state, and its configuration
    is applied."""
    state = FakeState()
    with OpAMPServer("error") as server, agent_of(server, state):
        server.wait(lambda: server.requests >= 7, "the first report given up, then heartbeats")
        server.behaviour = "ok"
        digest = server.push({"level": 5})
        server.wait(lambda: server.with_status(digest), "the status once the server is back")
        (agent,) = server.with_status(digest)
        assert agent.status.status == APPLIED
        server.wait(lambda: agent.description, "the full state")
    assert agent.description["service.name"] == "test-service"
    assert [change.level for change, _ in state.applied] == [5]


def test_requests_carry_the_configured_headers():
    """OTEL_GPU_OPAMP_HEADERS (URL-encoded, as the OTLP headers) is sent with every request."""
    with (
        OpAMPServer() as server,
        agent_of(
            server, FakeState(), OTEL_GPU_OPAMP_HEADERS="Authorization=Bearer%20abc,x-team=gpu"
        ),
    ):
        server.wait(lambda: server.requests >= 2, "two requests")
        assert server.headers["authorization"] == "Bearer abc"
        assert server.headers["x-team"] == "gpu"
        assert server.headers["content-type"] == "application/x-protobuf"


def test_configure_takes_the_headers_as_a_dict_with_any_value():
    """``configure(opamp_headers={...})``: values with commas, '=' and spaces arrive as given
    (they are URL-encoded on the way, as the variable expects)."""
    settings = config.load({"opamp_headers": {"Authorization": "Bearer a,b=c", "X-Team": "gpu"}})
    assert settings.opamp_headers == (("authorization", "Bearer a,b=c"), ("x-team", "gpu"))


@pytest.mark.parametrize(
    "raw",
    ["Authorization=Bearer sk-12345%0D%0AX-Evil: 1", "Authorization Bearer sk-12345"],
)
def test_bad_headers_are_refused_without_showing_them(raw):
    """A header value with an encoded CR LF (it would forge a header line) or a pair without
    '=' is refused at configuration, and the message never shows the credentials."""
    with pytest.raises(config.ConfigError) as info:
        config.load(env={"OTEL_GPU_OPAMP_HEADERS": raw})
    message = str(info.value)
    assert "OTEL_GPU_OPAMP_HEADERS=<redacted>" in message and "pair 1" in message
    assert "sk-12345" not in message


def test_otel_gpu_info_says_when_opamp_would_change_no_level():
    """``otel-gpu info`` with an endpoint but without OTEL_GPU_CONTROL=on says that a remote
    configuration would change no function's level; with it, nothing."""
    for control, expected in (("off", True), ("on", False)):
        env = without_otel(
            OTEL_GPU_OPAMP_ENDPOINT="http://127.0.0.1:9/v1/opamp", OTEL_GPU_CONTROL=control
        )
        out = subprocess.run(
            [sys.executable, "-m", "otel_gpu", "info"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        said = "note: OTEL_GPU_OPAMP_ENDPOINT: without OTEL_GPU_CONTROL=on" in out.stdout
        assert said is expected, out.stdout


def test_otel_gpu_info_hides_the_opamp_headers():
    """``otel-gpu info`` shows that OpAMP headers are set, never their value."""
    env = without_otel(OTEL_GPU_OPAMP_HEADERS="authorization=Bearer%20sk-12345")
    for args in ([], ["--json"]):
        out = subprocess.run(
            [sys.executable, "-m", "otel_gpu", "info", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "sk-12345" not in out.stdout and "<redacted>" in out.stdout


# ---------------------------------------------------------------------- whole processes

_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import otel_gpu

    @otel_gpu.api
    def step(x):
        return x + 1

    t = time.perf_counter()
    step(0)  # builds the pipeline (and starts the agent): measured apart
    first = time.perf_counter() - t
    worst, calls, start = 0.0, 1, time.monotonic()
    while time.monotonic() - start < float(sys.argv[1]):
        t = time.perf_counter()
        step(calls)
        worst = max(worst, time.perf_counter() - t)
        calls += 1
        time.sleep(0.002)
    print(json.dumps({"first": first, "worst": worst, "calls": calls, "done": time.time()}), flush=True)
    """
)


def _child_env(tmp_path, endpoint: str, **extra: str) -> dict[str, str]:
    env = without_otel(
        **{
            "OTEL_GPU_LOGLEVEL": "1",
            "OTEL_GPU_LOGDEST": str(tmp_path / "spans-%i.jsonl"),
            "OTEL_GPU_JOURNAL": "false",
            "OTEL_GPU_CONTROL": "on",
            "OTEL_GPU_JOURNAL_DIR": str(tmp_path / "journal"),
            "OTEL_GPU_OPAMP_INTERVAL": "1",
            **extra,
        }
    )
    if endpoint:
        env["OTEL_GPU_OPAMP_ENDPOINT"] = endpoint
    return env


def _run_calls(tmp_path, endpoint: str, seconds: float = 3.0) -> dict[str, float]:
    """A child making calls for ``seconds`` with OpAMP on ``endpoint``: its worst call, its
    number of calls, and the seconds from its last line to its exit."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(seconds)],
        env=_child_env(tmp_path, endpoint),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the process did not exit within 120 s") from None
    ended = time.time()
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr
    result = json.loads(line)
    result["exit"] = ended - result["done"]
    result["stderr"] = stderr
    return result


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_server_down_or_hung_costs_the_calls_nothing(tmp_path):
    """Nothing listening at the endpoint, or a server that takes every request and never
    answers: calls are not slowed and the process exits promptly (hang guards only, far above
    what a poll would cost a caller: its 5 s timeout), and a server that is down is said once.
    The measured numbers are printed beside a process without OpAMP."""
    baseline = _run_calls(tmp_path, "")
    down = _run_calls(tmp_path, f"http://127.0.0.1:{_closed_port()}/v1/opamp")
    with OpAMPServer("hang") as server:
        hung = _run_calls(tmp_path, server.endpoint)
        assert server.requests >= 1
    for name, r in (("no OpAMP", baseline), ("nothing listening", down), ("hung server", hung)):
        print(
            f"\n{name}: first call {r['first'] * 1e3:.1f} ms, worst of the next {r['calls'] - 1}"
            f" {r['worst'] * 1e3:.2f} ms, exit {r['exit']:.2f} s"
        )
    for r in (down, hung):
        assert r["calls"] > 10
        assert r["worst"] < 2.5
        assert r["exit"] < 15
    assert down["stderr"].count("does not answer") == 1, down["stderr"]
    # exit does not wait for the poll in flight: the client's own exit hook did (twice its 5 s
    # timeout: 10.3 s measured, against 2-3 s here)
    assert hung["exit"] < baseline["exit"] + opamp.REQUEST_TIMEOUT


def test_without_the_client_package_the_process_runs_and_says_so_once(tmp_path):
    """OTEL_GPU_OPAMP_ENDPOINT set where opentelemetry-opamp-client is not installed: the
    program runs and records as usual, and one line says what to install."""
    blocker = textwrap.dedent(
        """
        import sys
        class NoOpAMP:
            def find_spec(self, name, path=None, target=None):
                if name.startswith("opentelemetry._opamp"):
                    raise ModuleNotFoundError(f"No module named {name!r}")
                return None
        sys.meta_path.insert(0, NoOpAMP())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", blocker + _CHILD, "0.5"],
        env=_child_env(tmp_path, "http://127.0.0.1:9/v1/opamp"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["calls"] > 0
    lines = [ln for ln in proc.stderr.splitlines() if "opamp" in ln.lower()]
    assert len(lines) == 1 and "pip install 'otel-gpu[opamp]'" in lines[0], proc.stderr
    assert any(p.name.startswith("spans-") for p in tmp_path.iterdir())


def test_importing_otel_gpu_does_not_import_the_client():
    """The package imports without the optional client: nothing imports it unless an
    endpoint is set."""
    code = "import sys, otel_gpu; otel_gpu.api(lambda: 1)(); print('opentelemetry._opamp' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=without_otel(OTEL_GPU_LOGLEVEL="1", OTEL_GPU_LOGDEST="stderr"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_agent_describes_its_process(tmp_path):
    """The agent description carries the resource: service.name identifies the agent; host,
    pid and rank describe it."""
    with OpAMPServer() as server:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, "60"],
            env=_child_env(tmp_path, server.endpoint, RANK="3", OTEL_SERVICE_NAME="trainer"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            server.wait(lambda: any(a.description for a in server.seen()), "a description")
        finally:
            proc.kill()
            proc.wait(timeout=60)
        (agent,) = [a for a in server.seen() if a.description]
    assert agent.identifying["service.name"] == "trainer"
    assert all(key.startswith("service.") for key in agent.identifying)
    assert agent.description["process.pid"] == proc.pid
    assert agent.description["otel_gpu.rank"] == 3
    assert agent.description["host.name"] == socket.gethostname()
    assert "otel_gpu.gpu.count" in agent.description


def test_a_program_under_otel_gpu_run_with_targets_is_an_agent_too(tmp_path):
    """Under ``otel-gpu run`` with targets at level 1 (otel-gpu's first configuration is then
    the start-up hook's, not a decorated function's), the program is an agent all the same."""
    library = tmp_path / "lib"
    library.mkdir()
    (library / "mylib.py").write_text("def work(x):\n    return x + 1\n")
    program = tmp_path / "program.py"
    program.write_text(
        "import time, mylib\nfor i in range(600):\n    mylib.work(i); time.sleep(0.1)\n"
    )
    env = _child_env(tmp_path, "", PYTHONPATH=str(library))
    with OpAMPServer() as server:
        env["OTEL_GPU_OPAMP_ENDPOINT"] = server.endpoint
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "otel_gpu",
                "run",
                "--instrument",
                "mylib",
                "--",
                sys.executable,
                str(program),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            server.wait(lambda: any(a.description for a in server.seen()), "an agent", limit=120)
        finally:
            proc.kill()
            proc.wait(timeout=60)
        (agent,) = [a for a in server.seen() if a.description]
    assert agent.effective_json()["control"] == "on"


def test_stopping_the_agent_does_not_wait_for_a_hung_server():
    """Stopping says goodbye to the server for at most EXIT_WAIT seconds, whatever the server."""
    with OpAMPServer("hang") as server, agent_of(server, FakeState()) as agent:
        server.wait(lambda: server.requests >= 1, "a first request")
        started = time.monotonic()
        agent.stop()
        took = time.monotonic() - started
    print(f"\nstop with a hung server: {took:.2f} s")
    assert took < opamp.EXIT_WAIT + 5  # hang guard


def test_fork_children_do_not_share_the_parents_agent():
    """A forked child forgets its parent's agent (whose threads it does not have)."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    with OpAMPServer() as server:
        settings = config.load(
            env={"OTEL_GPU_OPAMP_ENDPOINT": server.endpoint, "OTEL_GPU_OPAMP_INTERVAL": "1"}
        )
        parent = opamp.start(settings, {"service.name": "p"})
        try:
            assert parent is not None and opamp.running() is parent
            pid = os.fork()
            if pid == 0:
                os._exit(0 if opamp.running() is None else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        finally:
            opamp.stop()


# ---------------------------------------------------------------------- the fleet

_FLEET_CHILD = ALPHA_BETA_LOOP


def _fleet(tmp_path, endpoint: str, count: int) -> list[tuple[subprocess.Popen[bytes], Any]]:
    """``count`` processes at armed level 0 (OTEL_GPU_CONTROL=on), each an agent of ``endpoint``,
    calling alpha and beta; each writes its spans to ``spans-<pid>.jsonl``."""
    program = tmp_path / "child.py"
    program.write_text(_FLEET_CHILD)
    env = _child_env(tmp_path, endpoint, OTEL_GPU_LOGLEVEL="0")
    procs = []
    for i in range(count):
        progress = tmp_path / f"progress-{i}"
        procs.append(
            (subprocess.Popen([sys.executable, str(program), str(progress)], env=env), progress)
        )
    return procs


def _stop_fleet(procs) -> None:
    for _, progress in procs:
        progress.with_name(progress.name + ".stop").touch()
    for proc, _ in procs:
        try:
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_a_configuration_pushed_to_three_processes_is_applied_by_each(tmp_path):
    """Three processes at armed level 0, agents of one server: the server's configuration
    (level 5 for alpha only) comes back APPLIED from each, with an effective configuration
    saying level 5; from then on each process's alpha calls are spans with statistics, beta's
    still record nothing, and the change is a control span naming the server."""
    with OpAMPServer() as server:
        procs = _fleet(tmp_path, server.endpoint, 3)
        try:
            server.wait(
                lambda: len([a for a in server.seen() if a.description]) == 3,
                "three agents",
                limit=240,
            )
            digest = server.push({"level": 5, "include": ["__main__.alpha"], "for": "10m"})
            server.wait(lambda: len(server.with_status(digest)) == 3, "three statuses", limit=240)
            agents = server.with_status(digest)
            assert [a.status.status for a in agents] == [APPLIED] * 3
            server.wait(
                lambda: all(
                    (a.effective_json() or {}).get("functions_changed") == 1 for a in agents
                ),
                "three effective configurations",
            )
            marks = [_progress(progress) for _, progress in procs]
            server.wait(
                lambda: all(_progress(p) > m + 20 for (_, p), m in zip(procs, marks)),
                "calls after the change",
                limit=240,
            )
        finally:
            _stop_fleet(procs)
    assert [proc.returncode for proc, _ in procs] == [0, 0, 0]
    pids = {a.description["process.pid"] for a in agents}
    assert pids == {proc.pid for proc, _ in procs}
    for agent in agents:
        effective = agent.effective_json()
        assert effective["level"] == 5 and effective["include"] == ["__main__.alpha"]
        assert effective["source"] == "opamp " + server.endpoint
    for proc, _ in procs:
        spans = read_spans(tmp_path / f"spans-{proc.pid}.jsonl", plain=True)
        controls = [s for s in spans if s["name"] == "otel_gpu.control"]
        assert [c["attrs"]["otel_gpu.control.source"] for c in controls] == [
            "opamp " + server.endpoint
        ]
        calls = [s for s in spans if s["name"] != "otel_gpu.control"]
        assert len(calls) > 20 and {s["name"] for s in calls} == {"__main__.alpha"}
        assert all(any(e["name"] == "otel_gpu.stats" for e in s.get("events", [])) for s in calls)


def test_a_document_the_process_cannot_honour_is_refused_and_it_keeps_its_configuration(
    tmp_path,
):
    """A valid document the process cannot honour whole (a level, and a ring size where it
    keeps no ring) comes back FAILED with the reason naming ring_size; the level is not applied
    either: the process keeps recording nothing, and says so in its effective configuration."""
    with OpAMPServer() as server:
        procs = _fleet(tmp_path, server.endpoint, 1)
        try:
            server.wait(lambda: any(a.description for a in server.seen()), "the agent", limit=240)
            digest = server.push({"level": 5, "ring_size": 4})
            server.wait(lambda: server.with_status(digest), "its status", limit=240)
            (agent,) = server.with_status(digest)
            mark = _progress(procs[0][1])
            server.wait(lambda: _progress(procs[0][1]) > mark + 20, "calls after the refusal")
        finally:
            _stop_fleet(procs)
    assert agent.status.status == FAILED
    assert agent.status.error_message.startswith("ring_size:")
    effective = agent.effective_json()
    assert effective["level"] is None and effective["changed"] is False
    ((proc, _),) = procs
    spans_file = tmp_path / f"spans-{proc.pid}.jsonl"
    assert not spans_file.exists() or read_spans(spans_file) == []
