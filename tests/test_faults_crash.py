"""Fault injection: processes that die inside a decorated call, and what ``otel-gpu recover`` gets back.

Each case forks real child processes that die by SIGKILL, SIGSEGV, abort() or
os._exit while a call is in flight, then runs ``otel-gpu recover`` (the CLI, as
a user would) and checks that every in-flight call reaches the JSONL destination
as an ERROR span with its original ids, parent, start time and inputs.

To keep the suite fast, a "lab" process imports torch and otel-gpu once and
forks one child per crash (``python tests/test_faults_crash.py lab ...``); one
case also starts fresh interpreters, so nothing depends on fork.

Reproduce the figures: ``pytest tests/test_faults_crash.py -s -q`` (each test
prints its figure).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from commands import otel_gpu_command, python_command
from jsonl_spans import read_spans

HERE = Path(__file__).resolve()
N_CRASHES = 20
STRESS_THREADS = 4
MODES = ("kill", "segv", "abort", "exit")

STATUS = "process died during call"
EXPECTED_SIGNAL = {"kill": signal.SIGKILL, "segv": signal.SIGSEGV, "abort": signal.SIGABRT}


# --------------------------------------------------------------------------- helpers shared with other fault tests


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment for a child process: no inherited OTEL_*, journal and output under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RANK", "LOCAL_RANK"))}
    env.update(
        OTEL_GPU_LOGLEVEL="3",
        OTEL_GPU_LOGDEST=str(tmp_path / "spans.jsonl"),
        OTEL_GPU_JOURNAL_DIR=str(tmp_path / "journal"),
        OTEL_SERVICE_NAME="crash-lab",
        PYTHONPATH=str(HERE.parent.parent) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


def run_lab(env: dict[str, str], modes: str, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Fork children that die mid-call: ``count`` per mode in ``modes`` ("kill,segv" or
    "kill:5,idle:1"); one dict per child: its pid, ids and how it died."""
    proc = python_command([str(HERE), "lab", modes, str(count), str(seed)], env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def recover_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``otel-gpu recover`` as a user would, in ``env``."""
    return otel_gpu_command(["recover", *args], env)


def jsonl_spans(path: Path) -> list[dict[str, Any]]:
    """Every span in an OTLP JSON Lines file, each with its resource attributes; every line must parse."""
    return read_spans(path, plain=True) if path.exists() else []


def _last_line_spans(path: Path) -> list[dict[str, Any]]:
    """Spans of the last line of a JSONL file (which must parse), or [] for a missing file."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    if not lines:
        return []
    tail = path.parent / (path.name + ".last")
    tail.write_text(lines[-1] + "\n")
    return jsonl_spans(tail)


def error_spans(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in spans if s.get("status", {}).get("message") == STATUS]


# --------------------------------------------------------------------------- the lab (child side)


def _lab(modes: str, count: int, seed: int) -> None:  # pragma: no cover - runs in a subprocess
    import ctypes
    import resource as rlimit

    import torch
    from opentelemetry import trace

    import otel_gpu

    rng = random.Random(seed)
    # Imports the children would each repeat on their first call happen once, before forking.
    import opentelemetry.exporter.otlp.json.file  # noqa: F401
    from otel_gpu.exporters import destinations  # noqa: F401

    from otel_gpu import resource
    from otel_gpu.export import pipeline  # noqa: F401

    resource._gpu_report()
    outer_ids: dict[str, int] = {}

    mode = ""

    @otel_gpu.api
    def outer(case: int, x: torch.Tensor, wfd: int) -> Any:
        outer_ids["span"] = trace.get_current_span().get_span_context().span_id
        return kernel(x, x.t(), case=case, tag=f"case-{case}", wfd=wfd)

    @otel_gpu.api
    def kernel(
        q: torch.Tensor, k: torch.Tensor, *, case: int, tag: str, wfd: int, scale: float = 0.5
    ) -> Any:
        ctx = trace.get_current_span().get_span_context()
        info = {"trace_id": f"{ctx.trace_id:032x}", "kernel": f"{ctx.span_id:016x}"}
        info["outer"] = f"{outer_ids['span']:016x}"
        os.write(wfd, (json.dumps(info) + "\n").encode())
        if mode == "kill":
            time.sleep(60)
        elif mode == "segv":
            ctypes.string_at(0)
        elif mode == "abort":
            os.abort()
        elif mode == "exit":
            os._exit(7)
        return None

    @otel_gpu.api
    def tick(i: int, x: torch.Tensor) -> float:
        return float(x.sum())

    def ticker() -> None:
        i = 0
        while True:
            tick(i, torch.full((i % 13 + 1, 2), 1.0))
            i += 1

    for spec in modes.split(","):
        mode, _, n = spec.partition(":")
        for case in range(int(n or count)):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                rlimit.setrlimit(rlimit.RLIMIT_CORE, (0, 0))  # no core files
                try:
                    if mode == "idle":  # dies between calls: nothing in flight
                        tick(0, torch.ones(1, 2))
                        os.write(w, b"{}\n")
                        os._exit(0)
                    if mode == "stress":
                        tick(-1, torch.ones(1, 2))  # the first call builds the pipeline
                        for _ in range(STRESS_THREADS):
                            threading.Thread(target=ticker, daemon=True).start()
                        os.write(w, b"{}\n")
                        time.sleep(60)
                    outer(case, torch.full((case % 5 + 1, 3), float(case)), w)
                finally:
                    os._exit(99)  # never reached when the crash works
            os.close(w)
            with os.fdopen(r) as reader:
                line = reader.readline()
                if mode == "kill":
                    time.sleep(rng.uniform(0, 0.01))
                    os.kill(pid, signal.SIGKILL)
                elif mode == "stress":
                    time.sleep(rng.uniform(0.05, 0.3))
                    os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            info = json.loads(line) if line.strip() else {}
            info.update(case=case, pid=pid, mode=mode)
            if os.WIFSIGNALED(status):
                info["signal"] = os.WTERMSIG(status)
            else:
                info["exit"] = os.WEXITSTATUS(status)
            print(json.dumps(info), flush=True)


# --------------------------------------------------------------------------- tests


FRESH = 3
FRESH_CHILD = (
    "import sys, time, otel_gpu\n"
    "@otel_gpu.api\n"
    "def step(n):\n"
    "    print('ready', flush=True); time.sleep(60)\n"
    "step(1)\n"
)


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    """All the crashes of this module, then one ``otel-gpu recover`` and a second one.

    N_CRASHES forked children per way of dying mid-call, N_CRASHES killed at random instants of
    a 4-thread call loop, and FRESH freshly started interpreters (level 1) SIGKILLed mid-call.
    Spans go to ``spans-%i.jsonl``: recovery appends to each dead process's own file.
    """
    tmp_path = tmp_path_factory.mktemp("crashes")
    env = child_env(tmp_path, OTEL_GPU_LOGDEST=str(tmp_path / "spans-%i.jsonl"))
    fresh_env = dict(env, OTEL_GPU_LOGLEVEL="1")
    fresh = [
        subprocess.Popen(
            [sys.executable, "-c", FRESH_CHILD], env=fresh_env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(FRESH)
    ]
    modes = ",".join([*MODES, "stress"])
    cases = run_lab(env, modes, N_CRASHES, seed=11)
    for p in fresh:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        p.kill()
        p.wait()
        p.stdout.close()
    before = time.time_ns()
    first = recover_cli(env)
    second = recover_cli(env)
    return {
        "tmp": tmp_path,
        "cases": cases,
        "fresh": [p.pid for p in fresh],
        "before": before,
        "first": first,
        "second": second,
    }


def _spans_of(crashes: dict[str, Any], pids: list[int]) -> list[dict[str, Any]]:
    spans = []
    for pid in pids:
        spans += error_spans(jsonl_spans(crashes["tmp"] / f"spans-{pid}.jsonl"))
    return spans


@pytest.mark.parametrize("mode", MODES)
def test_every_call_in_flight_at_a_crash_is_recovered_with_its_inputs(crashes, mode):
    """20 of 20 children dying mid-call (SIGKILL / SIGSEGV / abort() / os._exit) are recovered.

    Figure: for each way of dying, N_CRASHES of N_CRASHES crashes give back both calls in flight
    (the outer call and the kernel inside it) as ERROR spans "process died during call", with
    the original trace id, span ids, parent link, name, start time, inputs and the dead
    process's resource, appended to the dead process's own file.
    """
    cases = [c for c in crashes["cases"] if c["mode"] == mode]
    assert len(cases) == N_CRASHES
    for case in cases:
        if mode == "exit":
            assert case.get("exit") == 7, case
        else:
            assert case.get("signal") == EXPECTED_SIGNAL[mode], case
        assert "kernel" in case, case
    first = crashes["first"]
    assert first.returncode == 0, first.stderr

    recovered = 0
    for case in cases:
        spans = _spans_of(crashes, [case["pid"]])
        by_id = {s["spanId"]: s for s in spans}
        assert len(spans) == 2, case
        kernel, outer = by_id.get(case["kernel"]), by_id.get(case["outer"])
        assert kernel is not None and outer is not None, case
        assert kernel["traceId"] == outer["traceId"] == case["trace_id"]
        assert kernel["parentSpanId"] == case["outer"] and not outer.get("parentSpanId")
        assert kernel["name"].endswith("kernel") and outer["name"].endswith("outer")
        start, end = int(kernel["startTimeUnixNano"]), int(kernel["endTimeUnixNano"])
        assert int(outer["startTimeUnixNano"]) <= start <= end < crashes["before"]
        rows = case["case"] % 5 + 1
        attrs = kernel["attrs"]
        assert attrs["otel_gpu.input.q.shape"] == [rows, 3]
        assert attrs["otel_gpu.input.k.shape"] == [3, rows]
        assert attrs["otel_gpu.input.k.is_contiguous"] is (rows == 1)  # a transpose
        assert attrs["otel_gpu.input.case.value"] == case["case"]
        assert attrs["otel_gpu.input.tag.value"] == f"case-{case['case']}"
        assert attrs["otel_gpu.input.scale.default"] is True
        assert attrs["otel_gpu.recovered"] is True
        assert outer["attrs"]["otel_gpu.input.x.dtype"] == "torch.float32"
        assert kernel["resource"]["process.pid"] == case["pid"]
        assert kernel["resource"]["service.name"] == "crash-lab"
        recovered += 1
    print(f"\n[figure] {mode}: {recovered} of {N_CRASHES} crashes mid-call recovered with inputs")


def test_fresh_interpreters_killed_mid_call_are_recovered(crashes):
    """3 of 3 freshly started interpreters (no fork involved) SIGKILLed mid-call are recovered at
    level 1, each into its own file."""
    spans = _spans_of(crashes, crashes["fresh"])
    assert sorted(s["resource"]["process.pid"] for s in spans) == sorted(crashes["fresh"])
    assert all(s["name"] == "__main__.step" for s in spans)
    print(f"\n[figure] fresh interpreters: {len(spans)} of {FRESH} SIGKILLs mid-call recovered")


def test_kills_at_random_instants_never_yield_torn_or_stale_records(crashes):
    """SIGKILL at random instants while 4 threads call in a tight loop: every record is whole.

    Figure: over N_CRASHES kills, each dead process yields at most one record per thread (the
    call in flight, never a stale slot of an earlier call), and every recovered record is
    internally consistent (its ``i`` input matches its tensor shape): 0 torn, 0 stale. The
    recovered spans are appended to the dead process's own JSONL file as a line of their own,
    even when the process was killed in the middle of writing a line.
    """
    cases = [c for c in crashes["cases"] if c["mode"] == "stress"]
    assert len(cases) == N_CRASHES
    assert all(c.get("signal") == signal.SIGKILL for c in cases), cases
    in_flight = {}
    for line in crashes["first"].stderr.splitlines():
        if " call(s) in flight: exported" in line:
            words = line.split(" pid ")[1].split()
            in_flight[int(words[0])] = int(words[3])
    hits = 0
    for case in cases:
        path = crashes["tmp"] / f"spans-{case['pid']}.jsonl"
        recovered = error_spans(_last_line_spans(path))
        assert len(recovered) == in_flight.get(case["pid"], 0) <= STRESS_THREADS, case
        threads = [s["attrs"]["thread.id"] for s in recovered]
        assert len(set(threads)) == len(threads), "two records of one thread: a stale slot"
        for span in recovered:
            attrs = span["attrs"]
            assert attrs["otel_gpu.input.x.shape"] == [attrs["otel_gpu.input.i.value"] % 13 + 1, 2]
        hits += len(recovered)
    assert hits > 0, "no kill landed mid-call: the test proved nothing"
    print(
        f"\n[figure] random-instant kills: {N_CRASHES} kills of 4-thread loops, {hits} calls in "
        "flight recovered, all whole: 0 torn, 0 stale"
    )


def test_recovering_twice_exports_nothing_twice(crashes):
    """The first ``otel-gpu recover`` took every journal; the second finds none and exports
    nothing, so each crashed call is in the output exactly once."""
    total = N_CRASHES * len(MODES)
    summary = re.search(r"(\d+) call\(s\) recovered from (\d+) dead", crashes["first"].stderr)
    assert summary is not None, crashes["first"].stderr[-2000:]
    assert int(summary[1]) == 2 * total + FRESH + _stress_hits(crashes)
    assert int(summary[2]) == total + FRESH + N_CRASHES
    assert crashes["second"].returncode == 0 and "no journals" in crashes["second"].stderr
    pids = [c["pid"] for c in crashes["cases"] if c["mode"] in MODES] + crashes["fresh"]
    ids = [s["spanId"] for s in _spans_of(crashes, pids)]
    assert len(ids) == len(set(ids)) == 2 * total + FRESH
    assert list((crashes["tmp"] / "journal").iterdir()) == []


def _stress_hits(crashes: dict[str, Any]) -> int:
    total = 0
    stress = {c["pid"] for c in crashes["cases"] if c["mode"] == "stress"}
    for line in crashes["first"].stderr.splitlines():
        if " call(s) in flight: exported" in line:
            words = line.split(" pid ")[1].split()
            if int(words[0]) in stress:
                total += int(words[3])
    return total


def test_normal_exits_leave_nothing_to_recover(tmp_path):
    """Normal exit, sys.exit() inside a call and a daemon thread still inside a call at exit
    all leave an empty journal directory: there is nothing to recover."""
    from otel_gpu import config
    from otel_gpu.journal import recover

    code = (
        "import sys, threading, time, otel_gpu\n"
        "@otel_gpu.api\n"
        "def work(n):\n"
        "    if n == 'exit': sys.exit(0)\n"
        "    if n == 'hang': time.sleep(60)\n"
        "    return n\n"
        "for i in range(100): work(i)\n"
        "threading.Thread(target=work, args=('hang',), daemon=True).start()\n"
        "time.sleep(0.2)\n"
        "if sys.argv[1] == 'exit': work('exit')\n"
    )
    env = child_env(tmp_path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, how], env=env, stderr=subprocess.PIPE, text=True
        )
        for how in ("return", "exit")
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    assert list((tmp_path / "journal").iterdir()) == []
    assert recover.recover(config.load(env=env)) == []


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "lab":
    _lab(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
