"""``otel-gpu snapshot``: a live otel-gpu process exports, on request, a span with every
thread's stack and its calls in flight (inputs as journaled); only plain request files of the
same user are answered; the command's exit codes and messages.

The snapshot of a real rank of a sleeping 4-rank job is in ``test_ranks.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from commands import otel_gpu_command, without_otel
from distributed_job import wait_for
from jsonl_spans import read_spans

import otel_gpu
from otel_gpu.anomalies import snapshot


def _snapshots(spans):
    return [s for s in spans.get() if s.name == "otel_gpu.snapshot"]


def test_a_snapshot_holds_every_threads_stack_and_the_calls_in_flight(otel_gpu_spans, tmp_path):
    """Asked while a call is in flight: the export thread answers with one span holding the
    main thread's stack (inside the call) and the call with its inputs as the journal has them;
    the reply names that span."""
    journal = tmp_path / "journal"
    spans = otel_gpu_spans(level=3, journal_dir=str(journal))
    replies = []

    @otel_gpu.api
    def waiting_for_the_others(tensor, step):
        replies.extend(snapshot.request(str(journal), [os.getpid()], timeout=120))

    waiting_for_the_others(torch.ones(2, 3), step=7)
    otel_gpu.flush()
    (reply,) = replies
    assert reply.answer is not None and reply.answer["calls_in_flight"] == 1
    (snap,) = _snapshots(spans)
    assert format(snap.context.span_id, "016x") == reply.answer["span_id"]
    assert snap.attributes["otel_gpu.snapshot"] is True
    assert snap.attributes["otel_gpu.snapshot.requested_by"] == os.getpid()
    stacks = {
        e.attributes["thread.name"]: e.attributes["code.stacktrace"]
        for e in snap.events
        if e.name == "otel_gpu.thread_stack"
    }
    assert threading.current_thread().name in stacks
    assert "waiting_for_the_others" in stacks[threading.current_thread().name]
    (call,) = [e for e in snap.events if e.name == "otel_gpu.call_in_flight"]
    assert call.attributes["otel_gpu.call.name"].endswith("waiting_for_the_others")
    assert tuple(call.attributes["otel_gpu.input.tensor.shape"]) == (2, 3)
    assert call.attributes["otel_gpu.input.step.value"] == 7


def _responder():
    """The responder of the pipeline built by a first call."""
    otel_gpu.api(lambda: None)()
    from otel_gpu.export import pipeline

    pipe = pipeline.get()
    assert pipe is not None
    return snapshot.Responder(pipe.settings, pipe)


def _asked(otel_gpu_spans, tmp_path):
    """(spans, responder, request path) of a level-1 process with a journal folder, before any
    request file is written."""
    spans = otel_gpu_spans(level=1, journal_dir=str(tmp_path / "journal"))
    responder = _responder()
    return spans, responder, snapshot.request_path(responder.directory, os.getpid())


def _assert_ignored(spans, responder, request) -> None:
    """The responder's check removed the request (whatever it was) and answered nothing."""
    responder.check()
    assert not os.path.lexists(request)
    assert responder.answered == 0
    otel_gpu.flush()
    assert _snapshots(spans) == []


@pytest.mark.skipif(not hasattr(os, "chown") or os.getuid() != 0, reason="needs to chown")
def test_a_request_file_of_another_user_is_ignored(otel_gpu_spans, tmp_path):
    """Only the same user may ask: a request owned by another uid is removed, not answered."""
    spans, responder, request = _asked(otel_gpu_spans, tmp_path)
    with open(request, "w") as f:
        f.write("1")
    os.chown(request, 4321, -1)
    _assert_ignored(spans, responder, request)


def test_a_request_that_is_not_a_plain_file_is_ignored(otel_gpu_spans, tmp_path):
    """A symlink at the request path is removed and not answered."""
    spans, responder, request = _asked(otel_gpu_spans, tmp_path)
    os.symlink(str(tmp_path / "elsewhere"), request)
    _assert_ignored(spans, responder, request)


def test_no_request_no_snapshot(otel_gpu_spans, tmp_path):
    """The export thread's check without a request exports nothing."""
    journal = tmp_path / "journal"
    spans = otel_gpu_spans(level=1, journal_dir=str(journal))
    responder = _responder()
    responder.check()
    otel_gpu.flush()
    assert responder.answered == 0 and _snapshots(spans) == []


@pytest.mark.parametrize("arg", ["abc", "0", "-3"])
def test_a_bad_pid_is_a_one_line_usage_error(arg):
    """A pid that is not a whole number > 0: exit 2, one line naming what is allowed."""
    result = otel_gpu_command(["snapshot", "--", arg], without_otel())
    assert result.returncode == 2
    assert "must be a process id" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_all_with_no_otel_gpu_process_exits_1(tmp_path):
    """--all in a journal directory with no live process: exit 1, saying so."""
    env = without_otel(OTEL_GPU_JOURNAL_DIR=str(tmp_path / "journal"))
    result = otel_gpu_command(["snapshot", "--all"], env)
    assert result.returncode == 1
    assert "no live otel-gpu process" in result.stderr


def test_a_process_that_does_not_answer_is_reported(tmp_path):
    """A live process of this user that runs no otel-gpu: exit 1 after the timeout, with why;
    the request is withdrawn."""
    journal = tmp_path / "journal"
    env = without_otel(OTEL_GPU_JOURNAL_DIR=str(journal))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        result = otel_gpu_command(["snapshot", str(sleeper.pid), "--timeout", "0.5"], env)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert result.returncode == 1
    assert f"pid {sleeper.pid} did not answer within 0.5 s" in result.stderr
    assert not os.path.exists(snapshot.request_path(str(journal), sleeper.pid))


PROGRAM = """
import os, sys, time
import otel_gpu

@otel_gpu.api
def step(n):
    open(sys.argv[1], "w").close()
    time.sleep(600)

step(1)
"""


def test_snapshot_all_asks_every_live_otel_gpu_process_of_the_user(tmp_path):
    """--all: every live process with a journal in the directory answers with a snapshot span
    in its own trace file, naming its call in flight."""
    journal = tmp_path / "journal"
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    procs = []
    for i in range(2):
        env = without_otel(
            OTEL_GPU_LOGLEVEL="3",
            OTEL_GPU_LOGDEST=str(tmp_path / f"spans-{i}.jsonl"),
            OTEL_GPU_JOURNAL_DIR=str(journal),
        )
        ready = tmp_path / f"ready-{i}"
        procs.append((subprocess.Popen([sys.executable, str(program), str(ready)], env=env), ready))
    try:
        for _, ready in procs:
            wait_for(ready.exists, f"{ready.name}")
        env = without_otel(OTEL_GPU_JOURNAL_DIR=str(journal))
        result = otel_gpu_command(["snapshot", "--all", "--timeout", "120"], env)
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()
    assert result.returncode == 0, result.stderr
    for i, (p, _) in enumerate(procs):
        assert f"pid {p.pid}: snapshot exported" in result.stdout
        assert "1 call(s) in flight" in result.stdout
        (snap,) = [
            s
            for s in read_spans(tmp_path / f"spans-{i}.jsonl", plain=True)
            if s["name"] == "otel_gpu.snapshot"
        ]
        assert snap["attrs"]["otel_gpu.snapshot.calls"] == 1


def test_without_a_journal_the_calls_in_flight_are_unknown_not_zero(otel_gpu_spans, tmp_path):
    """OTEL_GPU_JOURNAL=false: the snapshot still has the stacks, and no call count (the
    journal is where the calls in flight are read), rather than a false 0."""
    directory = tmp_path / "journal"
    spans = otel_gpu_spans(level=1, journal=False, journal_dir=str(directory))
    replies = []

    @otel_gpu.api
    def in_flight():
        replies.extend(snapshot.request(str(directory), [os.getpid()], timeout=120))

    in_flight()
    otel_gpu.flush()
    (reply,) = replies
    assert reply.answer is not None and reply.answer["calls_in_flight"] is None
    (snap,) = _snapshots(spans)
    assert "otel_gpu.snapshot.calls" not in snap.attributes
    assert any(e.name == "otel_gpu.thread_stack" for e in snap.events)
