"""``otel-gpu recover`` (otel_gpu.journal.recover): which journals it recovers, what it exports, and where.

Dead processes are made by the crash lab of tests/test_faults_crash.py (forked
children SIGKILLed inside a nested decorated call).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from test_faults_crash import (
    child_env,
    error_spans,
    jsonl_spans,
    recover_cli,
    run_lab,
)

import otel_gpu
from otel_gpu import config
from otel_gpu.export import pipeline
from otel_gpu.journal import reader, recover, writer


def _settings(env: dict[str, str]) -> config.Settings:
    return config.load(env=env)


def _memory() -> tuple[SimpleSpanProcessor, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return SimpleSpanProcessor(exporter), exporter


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Journals of dead processes, made once for the module: 17 killed mid-call, 1 died idle."""
    tmp = tmp_path_factory.mktemp("pool")
    cases = run_lab(child_env(tmp, RANK="5"), "kill:17,idle:1", 0, seed=3)
    files = {int(p.name.split("-")[2]): p for p in (tmp / "journal").iterdir()}
    return [(c, files[c["pid"]]) for c in cases]


@pytest.fixture
def crashes(pool, tmp_path):
    """``crashes(n, mode="kill", **env)``: move n dead journals of the pool into this test's
    journal directory; returns (env, cases)."""

    def take(n: int = 1, mode: str = "kill", **extra: str):
        env = child_env(tmp_path, **extra)
        jdir = Path(env["OTEL_GPU_JOURNAL_DIR"])
        jdir.mkdir(mode=0o700, exist_ok=True)
        taken = []
        for item in list(pool):
            case, path = item
            if case["mode"] == mode and len(taken) < n:
                pool.remove(item)
                path.rename(jdir / path.name)
                taken.append(case)
        assert len(taken) == n, "pool exhausted: raise the counts in the pool fixture"
        return env, taken

    return take


def test_recovered_spans_keep_ids_parent_times_name_inputs_and_resource(crashes, tmp_path):
    """Each in-flight call becomes an SDK span: same trace/span/parent ids, start time, name,
    code.* and input attributes, ERROR "process died during call", the dead process's resource,
    ending no earlier than it started and no later than now."""
    env, (case,) = crashes()
    processor, exporter = _memory()
    outcomes = recover.recover(_settings(env), processor=processor)
    assert [(o.state, o.pid, o.spans) for o in outcomes] == [("recovered", case["pid"], 2)]
    spans = {f"{s.context.span_id:016x}": s for s in exporter.get_finished_spans()}
    kernel, outer = spans[case["kernel"]], spans[case["outer"]]
    assert f"{kernel.context.trace_id:032x}" == case["trace_id"]
    assert kernel.parent.span_id == outer.context.span_id and outer.parent is None
    assert kernel.status.status_code is StatusCode.ERROR
    assert kernel.status.description == recover.STATUS_MESSAGE
    assert kernel.kind is SpanKind.INTERNAL and kernel.instrumentation_scope.name == "otel_gpu"
    assert outer.start_time <= kernel.start_time <= kernel.end_time <= time.time_ns()
    assert kernel.name.endswith("._lab.<locals>.kernel")
    assert kernel.attributes["code.function.name"].endswith("kernel")
    assert kernel.attributes["otel_gpu.input.q.shape"] == (1, 3)
    assert kernel.attributes["otel_gpu.input.tag.value"] == "case-0"
    assert kernel.attributes["otel_gpu.recovered"] is True
    assert isinstance(kernel.attributes["thread.id"], int)
    assert kernel.resource.attributes["process.pid"] == case["pid"]
    assert kernel.resource.attributes["service.name"] == "crash-lab"
    assert list((tmp_path / "journal").iterdir()) == []


def test_journal_of_a_running_process_is_left_alone(otel_gpu_spans, tmp_path):
    """recover never touches the journal of a live process, even with calls in flight."""
    jdir = tmp_path / "journal"
    otel_gpu_spans(level=1, journal_dir=str(jdir))
    seen = []

    @otel_gpu.api
    def busy():
        processor, exporter = _memory()
        seen.extend(recover.recover(config.current(), processor=processor))
        seen.append(len(exporter.get_finished_spans()))

    busy()
    (outcome, exported) = seen
    assert outcome.state == "alive" and outcome.pid == os.getpid() and exported == 0
    assert len(list(jdir.iterdir())) == 1


def _waitable_zombie() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = writer.process_start_ticks(proc.pid)
        if info is not None and info[1] == "Z":
            return proc
        time.sleep(0.02)
    raise AssertionError("child did not become a zombie")


def test_liveness_tells_pid_reuse_zombies_reboots_and_other_hosts(monkeypatch):
    """judge(): our own pid with our start time is alive; the same pid with another start time
    (pid reuse), a zombie, a pid that no longer exists and a journal from before a reboot are
    dead; a journal written on another host is not ours to judge."""
    ticks, _ = writer.process_start_ticks(os.getpid())

    def jf(pid: int, start: int, boot: bytes | None = None, host: str | None = None):
        return reader.JournalFile(
            path="x",
            pid=pid,
            start_ticks=start,
            boot_id=boot if boot is not None else writer.boot_id(),
            created_ns=0,
            heartbeat_ns=0,
            level=1,
            closed=False,
            host=host,
            resource={},
        )

    assert recover.judge(jf(os.getpid(), ticks)) == "alive"
    assert recover.judge(jf(os.getpid(), ticks + 1)) == "dead"
    assert recover.judge(jf(os.getpid(), ticks, boot=b"\x01" * 16)) == "dead"
    zombie = _waitable_zombie()
    try:
        assert recover.judge(jf(zombie.pid, 0)) == "dead"
    finally:
        zombie.wait()
    assert recover.judge(jf(zombie.pid, 0)) == "dead"
    assert recover.judge(jf(os.getpid(), ticks, host="some-other-host")) == "other-host"


def test_concurrent_recoverers_export_each_span_once(crashes, tmp_path):
    """Three ``otel-gpu recover`` processes and four threads at once: each of the 6 dead
    journals is exported exactly once (12 spans), whoever wins each claim."""
    env, cases = crashes(6)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "otel_gpu", "recover"],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    processor, exporter = _memory()
    threads = [
        threading.Thread(
            target=recover.recover, args=(_settings(env),), kwargs={"processor": processor}
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for p in procs:
        p.communicate(timeout=120)
        assert p.returncode == 0
    ids = [s["spanId"] for s in error_spans(jsonl_spans(tmp_path / "spans.jsonl"))]
    ids += [f"{s.context.span_id:016x}" for s in exporter.get_finished_spans()]
    assert sorted(ids) == sorted([c["kernel"] for c in cases] + [c["outer"] for c in cases])
    assert list((tmp_path / "journal").iterdir()) == []


def test_a_claim_left_by_a_dead_recoverer_is_recovered_and_a_live_one_is_not(crashes, tmp_path):
    """``*.recovering.<pid>-*`` of a dead recoverer is taken over; one of a live recoverer is not."""
    env, _ = crashes(2)
    first, second = sorted((tmp_path / "journal").iterdir())
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    first.rename(str(first) + f".recovering.{dead_pid}-abcd")
    second.rename(str(second) + f".recovering.{os.getppid()}-abcd")  # pytest's parent: alive
    processor, exporter = _memory()
    outcomes = {o.state: o for o in recover.recover(_settings(env), processor=processor)}
    assert set(outcomes) == {"recovered", "taken"}
    assert len(exporter.get_finished_spans()) == 2
    assert [p.name for p in (tmp_path / "journal").iterdir()] == [
        second.name + f".recovering.{os.getppid()}-abcd"
    ]


@pytest.mark.parametrize("where", ["xdg", "tmpdir"])
def test_recover_needs_no_arguments_in_the_dead_programs_environment(tmp_path, where):
    """Without OTEL_GPU_JOURNAL_DIR both sides derive the same default: $XDG_RUNTIME_DIR/otel-gpu,
    else $TMPDIR/otel-gpu-<uid>; ``otel-gpu recover`` with no argument finds the journal."""
    env = child_env(tmp_path)
    del env["OTEL_GPU_JOURNAL_DIR"]
    env.pop("XDG_RUNTIME_DIR", None)
    if where == "xdg":
        (tmp_path / "run").mkdir(mode=0o700)
        env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
        expected = tmp_path / "run" / "otel-gpu"
    else:
        env["TMPDIR"] = str(tmp_path)
        expected = tmp_path / f"otel-gpu-{os.getuid()}"
    cases = run_lab(env, "kill", 1)
    assert len(list(expected.iterdir())) == 1
    result = recover_cli(env)
    assert result.returncode == 0, result.stderr
    assert "2 call(s) recovered from 1 dead process(es)" in result.stderr
    assert {s["spanId"] for s in error_spans(jsonl_spans(tmp_path / "spans.jsonl"))} == {
        cases[0]["kernel"],
        cases[0]["outer"],
    }


def test_dry_run_lists_and_changes_nothing_and_a_path_argument_is_honoured(crashes, tmp_path):
    """``--dry-run`` reports the dead journal without exporting or deleting it; PATH (a file or a
    directory) overrides the default location."""
    env, _ = crashes()
    moved = tmp_path / "elsewhere"
    (tmp_path / "journal").rename(moved)
    (path,) = moved.iterdir()
    dry = recover_cli(env, "--dry-run", str(moved))
    assert dry.returncode == 0 and "2 call(s) in flight (dry run" in dry.stderr
    assert path.exists() and error_spans(jsonl_spans(tmp_path / "spans.jsonl")) == []
    assert recover.recover(_settings(env)) == []  # the default directory is empty now
    (outcome,) = recover.recover(_settings(env), str(path))
    assert outcome.state == "recovered" and outcome.spans == 2
    assert not path.exists() and len(error_spans(jsonl_spans(tmp_path / "spans.jsonl"))) == 2


def test_spans_go_to_the_dead_process_own_file_after_a_torn_line(crashes, tmp_path):
    """With ``%i``/``%r`` in OTEL_GPU_LOGDEST the spans are appended to the dead process's own file
    (its pid and RANK); a half-written last line there is ended first, so the new line parses."""
    env, (case,) = crashes(OTEL_GPU_LOGDEST=str(tmp_path / "out-%r-%i.jsonl"))
    own = tmp_path / f"out-5-{case['pid']}.jsonl"
    with open(own, "a") as fh:
        fh.write('{"resourceSpans": [{"torn')
    (outcome,) = recover.recover(_settings(env))  # what the CLI runs, without its start-up
    assert outcome.state == "recovered" and not outcome.detail
    lines = own.read_text().splitlines()
    assert lines[-2].endswith('"torn')
    last = json.loads(lines[-1])
    names = [
        s["name"] for rs in last["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]
    ]
    assert len(names) == 2
    assert sorted(p.name for p in tmp_path.glob("out-*.jsonl")) == [own.name]


def test_otlp_destination_receives_the_dead_process_spans(crashes, tmp_path, monkeypatch):
    """OTEL_GPU_LOGDEST=otlp: the recovered spans reach the collector under the dead process's
    resource (service.name, process.pid), with status ERROR."""
    from otlp_receiver import attrs_of, grpc_receiver, hex_id

    env, (case,) = crashes()
    with grpc_receiver() as rx:
        env = dict(env, OTEL_GPU_LOGDEST="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        (outcome,) = recover.recover(_settings(env))
        assert outcome.state == "recovered" and not outcome.detail
        got = rx.received.wait_for_spans(2, timeout=20)
    by_id = {hex_id(span.span_id): (res, span) for res, span in got}
    res, kernel = by_id[case["kernel"]]
    assert attrs_of(res.attributes)["process.pid"] == case["pid"]
    assert attrs_of(res.attributes)["service.name"] == "crash-lab"
    assert kernel.status.message == recover.STATUS_MESSAGE and kernel.status.code == 2
    assert hex_id(kernel.parent_span_id) == case["outer"]


def test_recover_on_start_runs_in_the_background_of_the_next_process(
    crashes, otel_gpu_spans, tmp_path, monkeypatch
):
    """OTEL_GPU_RECOVER_ON_START: the first decorated call of the next process starts recovery on
    a thread and returns without waiting for it; the dead process's calls then reach this
    process's span processors, once."""
    env, (case,) = crashes()
    real = recover.recover
    started = threading.Event()

    def slow_recover(*args, **kwargs):
        started.set()
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(recover, "recover", slow_recover)
    monkeypatch.setattr(writer, "_recovery_thread", None)
    spans = otel_gpu_spans(level=1, journal_dir=env["OTEL_GPU_JOURNAL_DIR"], recover_on_start=True)

    @otel_gpu.api
    def first():
        return 1

    t0 = time.perf_counter()
    first()
    elapsed = time.perf_counter() - t0
    assert started.wait(5) and elapsed < 1.0
    writer._recovery_thread.join(20)
    first()
    recovered = [s for s in spans.get() if s.status.status_code is StatusCode.ERROR]
    assert sorted(f"{s.context.span_id:016x}" for s in recovered) == sorted(
        [case["kernel"], case["outer"]]
    )
    assert [
        p for p in Path(env["OTEL_GPU_JOURNAL_DIR"]).iterdir() if str(os.getpid()) not in p.name
    ] == []


def test_recover_on_start_in_a_real_next_run(crashes, tmp_path):
    """End to end: a program started with OTEL_GPU_RECOVER_ON_START=true after a crash writes the
    crashed calls to its own destination and exits leaving no journal behind."""
    env, (case,) = crashes()
    env = dict(env, OTEL_GPU_RECOVER_ON_START="true", OTEL_GPU_LOGDEST=str(tmp_path / "next.jsonl"))
    code = "import otel_gpu\n@otel_gpu.api\ndef f(): return 1\nf()\n"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    spans = jsonl_spans(tmp_path / "next.jsonl")
    assert {s["spanId"] for s in error_spans(spans)} == {case["kernel"], case["outer"]}
    assert len(spans) == 3
    assert list((tmp_path / "journal").iterdir()) == []


def test_recover_on_start_to_the_terminal_alone_keeps_the_journal(crashes, tmp_path):
    """OTEL_GPU_RECOVER_ON_START with otel-gpu's own provider writing to stdout only: the crashed
    calls are shown, the journal is kept (the terminal keeps nothing once it scrolls), and one
    line says how to export it."""
    env, (case,) = crashes()
    env = dict(env, OTEL_GPU_RECOVER_ON_START="true", OTEL_GPU_LOGDEST="stdout")
    code = "import otel_gpu\n@otel_gpu.api\ndef f(): return 1\nf()\n"
    before = sorted(p.name for p in (tmp_path / "journal").iterdir())
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "process died during call" in proc.stdout and case["kernel"] in proc.stdout
    assert "kept" in proc.stderr and "otel-gpu recover" in proc.stderr
    after = sorted(p.name for p in (tmp_path / "journal").iterdir())
    assert set(before) <= set(after)  # the crashed process's journal is still there


def test_dead_process_with_no_call_in_flight_leaves_nothing_to_export(crashes, tmp_path):
    """A process that died between calls (os._exit) left a journal with no record: recover
    removes it and exports nothing."""
    env, cases = crashes(mode="idle")
    assert cases[0].get("exit") == 0
    assert len(list((tmp_path / "journal").iterdir())) == 1
    (outcome,) = recover.recover(_settings(env))
    assert outcome.state == "empty" and outcome.spans == 0
    assert list((tmp_path / "journal").iterdir()) == []
    assert error_spans(jsonl_spans(tmp_path / "spans.jsonl")) == []


def test_files_that_are_not_our_journals_are_left_alone(crashes, tmp_path):
    """Junk named like a journal, and (as root) a journal owned by another user, are reported
    invalid and neither read into spans nor deleted."""
    jdir = tmp_path / "journal"
    jdir.mkdir(mode=0o700)
    junk = jdir / "otel-gpu-1-deadbeef.journal"
    junk.write_bytes(b"\0" * (writer.HEADER_SIZE + 10))
    env = child_env(tmp_path)
    outcomes = recover.recover(_settings(env), processor=_memory()[0])
    assert [(o.state, "not an otel-gpu journal" in o.detail) for o in outcomes] == [
        ("invalid", True)
    ]
    assert junk.exists()
    if os.geteuid() == 0:
        crashes()
        (theirs,) = [p for p in jdir.iterdir() if p != junk]
        os.chown(theirs, 4242, 4242)
        states = {o.path: o.state for o in recover.recover(_settings(env), processor=_memory()[0])}
        assert states[str(theirs)] == "invalid" and theirs.exists()


def closed_journal(directory: Path) -> Path:
    """A journal closed normally whose file could not be deleted then."""
    j = writer.Journal(str(directory), config.load(env={"OTEL_GPU_LOGLEVEL": "1"}), None)
    real = writer._unlink
    try:
        writer._unlink = lambda p: None
        j.close()
    finally:
        writer._unlink = real
    return Path(j.path)


def test_a_journal_closed_normally_but_not_deleted_is_cleaned_up(tmp_path):
    """If deleting failed at exit, the header says closed: recover removes the file, exports nothing."""
    settings = config.load(env={"OTEL_GPU_LOGLEVEL": "1"})
    path = str(closed_journal(tmp_path))
    assert os.path.exists(path)
    processor, exporter = _memory()
    (outcome,) = recover.recover(settings, str(tmp_path), processor=processor)
    assert outcome.state == "clean" and not os.path.exists(path)
    assert exporter.get_finished_spans() == ()


def test_cli_reports_a_bad_configuration_with_exit_code_2(tmp_path):
    """``otel-gpu recover`` with an invalid setting says which and exits 2, exporting nothing."""
    env = child_env(tmp_path, OTEL_GPU_LOGDEST=str(tmp_path / "missing" / "x.jsonl"))
    result = recover_cli(env)
    assert result.returncode == 2 and "OTEL_GPU_LOGDEST" in result.stderr


def test_register_wires_the_subcommand():
    """The CLI lists ``recover`` and it dispatches to this module."""
    from otel_gpu import cli

    parser = cli.build_parser()
    args = parser.parse_args(["recover", "--dry-run", "/nonexistent"])
    assert (
        args.func.__module__ == "otel_gpu.cli.recover"
        and args.dry_run
        and args.path == "/nonexistent"
    )


def test_pipeline_reset_while_recovery_runs_does_not_break(
    crashes, otel_gpu_spans, tmp_path, monkeypatch
):
    """Shutting the pipeline down while auto-recovery runs waits for it (bounded): no error, and
    no half-done claim is left behind."""
    env, _ = crashes()
    monkeypatch.setattr(writer, "_recovery_thread", None)
    otel_gpu_spans(level=1, journal_dir=env["OTEL_GPU_JOURNAL_DIR"], recover_on_start=True)

    @otel_gpu.api
    def f():
        return 1

    f()
    pipeline.reset()
    writer._recovery_thread.join(20)
    assert [p.name for p in (tmp_path / "journal").iterdir()] == []
