"""Fault injection: a collector that is unreachable, refuses, or accepts and never answers.

A child process makes 10k decorated calls (level 3, one tensor argument) with
``OTEL_GPU_LOGDEST=otlp`` pointed at an in-process receiver (tests/otlp_receiver.py)
behaving badly, and reports the worst single-call latency, the RSS growth over
the loop, and how long it took to exit after its last call.

The promises pinned (issue #4): calls never wait on the network, memory stays
bounded by the queue limits, and exit takes at most ``OTEL_GPU_FLUSH_TIMEOUT``
plus interpreter teardown, never the SDK's 30 s timeout chain. The exporter's own
timeout (``OTEL_EXPORTER_OTLP_TIMEOUT``) is set to 30 s, so a call or an exit that
waited on the network would show up as >= 30 s.

Reproduce the figures: ``pytest tests/test_faults_collector.py -s -q``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from otlp_receiver import grpc_receiver, http_receiver

CALLS = 10_000
FLUSH_TIMEOUT = 1.0
EXPORTER_TIMEOUT = 30
# Bounds that tell waiting on the network (>= EXPORTER_TIMEOUT seconds) from not waiting, not
# speed targets: half the exporter's timeout, so a loaded 2-core machine (an exit once took 7.7 s
# under four parallel jobs against the old 5 s bound) cannot fail a program that did not wait.
WORST_CALL_S = 2.0
EXIT_S = EXPORTER_TIMEOUT / 2
SLOW_REPR_S = 20.0  # > EXIT_S
RSS_MB = 64

ZYGOTE = r"""
import json, os, sys, time
import torch
import otel_gpu
from otel_gpu.calls import metadata  # noqa: F401  (imports the children would repeat)
import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
import opentelemetry.exporter.otlp.json.file  # noqa: F401

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

class SlowRepr:
    def __repr__(self):
        time.sleep(SLOW_REPR_S)
        return "slow"

def scenario(n, slow):
    @otel_gpu.api
    def step(x, i):
        return i
    step(torch.ones(4, 4), -1)  # builds the pipeline, connects the exporter
    x = SlowRepr() if slow else torch.ones(4, 4)
    r0 = rss()
    lat = []
    t0 = time.perf_counter()
    for i in range(n):
        a = time.perf_counter_ns()
        step(x, i)
        lat.append(time.perf_counter_ns() - a)
    loop = time.perf_counter() - t0
    lat.sort()
    if slow:
        time.sleep(0.3)  # the export thread is now inside repr()
    return {
        "worst_s": lat[-1] / 1e9, "p50_us": lat[n // 2] / 1e3, "p99_us": lat[int(n * 0.99)] / 1e3,
        "rss_growth_mb": (rss() - r0) / 2**20, "loop_s": loop, "t_end": time.time(),
    }

for spec in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child that exits like a normal program: interpreter teardown, exit hooks
        os.close(r)
        os.environ.update(spec["env"])
        figures = scenario(spec["calls"], spec.get("slow", False))
        os.write(w, json.dumps(figures).encode())
        os.close(w)
        sys.exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    ended = time.time()
    figures = json.loads(data or b"{}")
    figures.update(name=spec["name"], status=status, exit_s=ended - figures.get("t_end", ended))
    print(json.dumps(figures), flush=True)
""".replace("SLOW_REPR_S", str(SLOW_REPR_S))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_scenarios(tmp_path: Path, specs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Run each scenario in its own forked child of one process that imported everything once.

    Each child runs the loop and exits through normal interpreter teardown; its stderr (the
    exit report) goes to a file per scenario. Returns figures by scenario name.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    for spec in specs:
        spec["env"] = {
            "OTEL_GPU_LOGLEVEL": "3",
            "OTEL_GPU_FLUSH_TIMEOUT": str(FLUSH_TIMEOUT),
            "OTEL_EXPORTER_OTLP_TIMEOUT": str(EXPORTER_TIMEOUT),
            "OTEL_GPU_JOURNAL_DIR": str(tmp_path / "journal"),
            **spec["env"],
        }
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as err:
        proc = subprocess.run(
            [sys.executable, "-c", ZYGOTE, json.dumps(specs)],
            env=base,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=600,
        )
    stderr = stderr_path.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            figures = json.loads(line)
            results[figures["name"]] = figures
    results["_stderr"] = {"text": stderr}
    return results


def _figure(label: str, f: dict[str, Any]) -> None:
    print(
        f"\n[figure] {label}: {CALLS} calls, worst call {f['worst_s'] * 1e3:.1f} ms "
        f"(p50 {f['p50_us']:.0f} µs, p99 {f['p99_us']:.0f} µs), RSS +{f['rss_growth_mb']:.1f} MiB, "
        f"exit {f['exit_s']:.2f} s after the last call"
    )


BAD = [(p, b) for p in ("grpc", "http/protobuf") for b in ("unreachable", "refuse", "hang")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario of this module, run once: receivers up, one forked child per scenario."""
    tmp = tmp_path_factory.mktemp("collector")
    specs: list[dict[str, Any]] = [
        {"name": "baseline", "calls": CALLS, "env": {"OTEL_GPU_LOGDEST": str(tmp / "b.jsonl")}}
    ]
    receivers = {}
    with ExitStack() as stack:
        for protocol, behaviour in [*BAD, ("grpc", "ok")]:
            if behaviour == "unreachable":
                endpoint = f"http://127.0.0.1:{_free_port()}"
            else:
                factory = grpc_receiver if protocol == "grpc" else http_receiver
                rx = stack.enter_context(factory(behaviour=behaviour))
                receivers[(protocol, behaviour)] = rx
                endpoint = rx.endpoint
            env = {
                "OTEL_GPU_LOGDEST": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            }
            if behaviour == "ok":  # about not losing spans, not exit time: let it flush
                env["OTEL_GPU_FLUSH_TIMEOUT"] = "10"
            specs.append({"name": f"{protocol}-{behaviour}", "calls": CALLS, "env": env})
        slow_env = {"OTEL_GPU_LOGDEST": str(tmp / "slow.jsonl")}
        specs.append({"name": "slow-repr", "calls": 1, "env": slow_env, "slow": True})
        results = run_scenarios(tmp, specs)
        ok = receivers[("grpc", "ok")]
        deadline = time.monotonic() + 5
        while len(ok.received.spans()) < CALLS + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        results["received"] = {key: len(rx.received.spans()) for key, rx in receivers.items()}
    return results


def test_local_file_baseline(runs):
    """Baseline for the figures below: the same loop exporting to a local JSONL file."""
    f = runs["baseline"]
    _figure("baseline, local JSONL file", f)
    assert f["status"] == 0 and f["worst_s"] < WORST_CALL_S and f["exit_s"] < EXIT_S


@pytest.mark.parametrize(("protocol", "behaviour"), BAD)
def test_a_bad_collector_never_stalls_calls_memory_or_exit(runs, protocol, behaviour):
    """10k calls against a collector that is unreachable / refuses / never answers.

    Figure: worst single call < 2 s (the exporter timeout is 30 s, so no call waited on the
    network), RSS growth < 64 MiB, exit well before the exporter's 30 s timeout (under 15 s).
    """
    f = runs[f"{protocol}-{behaviour}"]
    _figure(f"{protocol}, collector {behaviour}", f)
    assert f["status"] == 0
    assert f["worst_s"] < WORST_CALL_S
    assert f["rss_growth_mb"] < RSS_MB
    assert f["exit_s"] < EXIT_S


def test_no_tracebacks_from_a_bad_collector(runs):
    """Exporter failures are logged by the SDK as one-line warnings; nothing raises to the user."""
    assert "Traceback" not in runs["_stderr"]["text"]


@pytest.mark.slow
def test_memory_stays_bounded_by_the_queue_over_200k_calls(tmp_path):
    """A collector that never answers, 200k calls, OTEL_GPU_QUEUE_SIZE=2048: RSS growth stays
    within the same bound as for 10k calls (the queues are bounded; nothing accumulates)."""
    with grpc_receiver(behaviour="hang") as rx:
        env = {
            "OTEL_GPU_LOGDEST": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
            "OTEL_GPU_QUEUE_SIZE": "2048",
        }
        f = run_scenarios(tmp_path, [{"name": "big", "calls": 200_000, "env": env}])["big"]
    print(
        f"\n[figure] grpc, collector hang, 200000 calls: RSS +{f['rss_growth_mb']:.1f} MiB, "
        f"worst call {f['worst_s'] * 1e3:.1f} ms, exit {f['exit_s']:.2f} s"
    )
    assert f["status"] == 0 and f["rss_growth_mb"] < RSS_MB and f["exit_s"] < EXIT_S


_DROPPED = re.compile(r"otel-gpu dropped (\d+) span")


def test_spans_a_bad_collector_never_took_are_counted_and_reported_once(runs):
    """Each bad-collector child prints one "otel-gpu dropped N span(s)" line at exit with N >= the
    calls its collector never confirmed; no process reports twice or more than it made."""
    reports = [int(n) for n in _DROPPED.findall(runs["_stderr"]["text"])]
    children = [k for k, v in runs.items() if isinstance(v, dict) and "exit_s" in v]
    # every bad-collector child reports (nearly) all its calls as lost…
    assert len([n for n in reports if n >= CALLS - 2048]) >= len(BAD)
    # …once per process, never more than it made. The slow-__repr__ child reports its 1–2 lost
    # spans; on a loaded machine the healthy child may report spans its collector had not yet
    # confirmed when OTEL_GPU_FLUSH_TIMEOUT ran out.
    assert len(reports) <= len(children)
    assert all(1 <= n <= CALLS + 1 for n in reports)


def test_a_healthy_collector_gets_every_span_of_a_burst(runs):
    """A burst of 10k calls that fits in OTEL_GPU_QUEUE_SIZE reaches a healthy collector whole."""
    received = runs["received"][("grpc", "ok")]
    print(f"\n[figure] healthy collector, burst of {CALLS + 1} spans: {received} arrived")
    assert received == CALLS + 1


def test_exit_is_bounded_even_when_materialising_a_span_blocks(runs):
    """An argument whose __repr__ takes 6 s (run on the export thread at level 3) must not hold
    interpreter exit beyond OTEL_GPU_FLUSH_TIMEOUT (1 s) + teardown."""
    f = runs["slow-repr"]
    print(f"\n[figure] exit with a {SLOW_REPR_S:g} s __repr__ pending: {f['exit_s']:.1f} s")
    assert f["status"] == 0 and f["worst_s"] < WORST_CALL_S
    assert f["exit_s"] < EXIT_S
