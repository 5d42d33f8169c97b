"""``otel-gpu bench``'s tools rows: ``ship``, ``show``, ``workloads``, ``diff``, ``ranks`` and
``recover`` against the parse floor.

The floor is a plain ``json.loads`` pass over the same OTLP JSON Lines file, in its own
``python`` process. Each tool runs as the user runs it (``python -m otel_gpu ship|show FILE``),
in interleaved rounds with the floor, and the CPU time of each child process (user + system,
of the reaped child) is compared, so load from other processes on the machine weighs less than in
wall time (both are reported). ``ship`` sends to a loopback OTLP/HTTP sink in a separate
process and must deliver every span. ``recover`` is timed inside a child, after its imports, on
journals of processes that died with a thousand calls in flight each. Start-up: each command
with ``--help`` (``info`` runs whole) against ``python -c "import torch"``.

The file is synthetic but shaped as otel-gpu writes level 3: one trace per line of 100 spans
(a root and its children), each with the ``code.*`` attributes, two input tensors and a scalar,
one output tensor, and every tenth an ERROR status with an exception event.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["NAME", "measure", "render", "write_trace_file"]

NAME = "tools"

SHIP_LIMIT = 5.0  # × the json.loads pass (issue budget)
SHOW_LIMIT = 2.0
READERS_LIMIT = 3.0  # workloads and diff: × the json.loads pass of each file they read
RECOVER_MIN = 10_000.0  # spans per second
START_LIMIT = 0.4  # × `python -c "import torch"`

_FLOOR = "import json, sys\nfor line in open(sys.argv[1], 'rb'):\n    json.loads(line)\n"

_SINK = """
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

_CRASH = """
import os, sys
sys.setrecursionlimit(100000)
import otel_gpu

@otel_gpu.api
def nested(n):
    if n:
        return nested(n - 1)
    os._exit(1)  # dies with every call above in flight

nested(int(sys.argv[1]))
"""

_RECOVER = """
import json, sys, time
from otel_gpu import config
from otel_gpu.journal import recover
settings = config.current()
started = time.perf_counter()
outcomes = recover.recover(settings, sys.argv[1], timeout=60)
took = time.perf_counter() - started
print(json.dumps({"seconds": took, "spans": sum(o.spans for o in outcomes if o.state == "recovered"),
                  "states": sorted({o.state for o in outcomes})}))
"""


# --------------------------------------------------------------------------- the file


def _attribute(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    if isinstance(value, list):
        return {
            "key": key,
            "value": {"arrayValue": {"values": [{"intValue": str(v)} for v in value]}},
        }
    return {"key": key, "value": {"stringValue": value}}


def _span_attributes(i: int) -> list[dict[str, Any]]:
    attrs = [
        ("code.function.name", f"model.layers.Block{i % 12}.forward"),
        ("code.file.path", "/srv/app/model/layers.py"),
        ("code.line.number", 100 + i % 50),
    ]
    for name, shape in (("x", [8, 128, 512]), ("weight", [512, 512])):
        prefix = f"otel_gpu.input.{name}."
        attrs += [
            (prefix + "shape", shape),
            (prefix + "dtype", "torch.bfloat16"),
            (prefix + "device", "cuda:0"),
            (prefix + "stride", [*shape[1:], 1]),
            (prefix + "requires_grad", False),
            (prefix + "is_contiguous", True),
        ]
    attrs += [("otel_gpu.input.eps.value", 1e-6), ("otel_gpu.input.eps.default", True)]
    prefix = "otel_gpu.output.0."
    attrs += [
        (prefix + "shape", [8, 128, 512]),
        (prefix + "dtype", "torch.bfloat16"),
        (prefix + "device", "cuda:0"),
        (prefix + "stride", [65536, 512, 1]),
        (prefix + "requires_grad", False),
        (prefix + "is_contiguous", True),
    ]
    return [_attribute(k, v) for k, v in attrs]


def write_trace_file(path: str, spans: int, per_line: int = 100, seed: int = 0) -> int:
    """Write ``spans`` level-3-shaped spans to ``path`` (OTLP JSON Lines); returns the count."""
    rnd = random.Random(seed)
    resource = {
        "attributes": [
            _attribute("service.name", "bench"),
            _attribute("host.name", "gpu-node-1"),
            _attribute("process.pid", 4242),
            _attribute("otel_gpu.torch.version", "2.13.0"),
        ]
    }
    start = 1_700_000_000_000_000_000
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < spans:
            count = min(per_line, spans - written)
            trace_id = f"{rnd.getrandbits(128) | 1:032x}"
            root = f"{rnd.getrandbits(64) | 1:016x}"
            batch = []
            for k in range(count):
                i = written + k
                span: dict[str, Any] = {
                    "traceId": trace_id,
                    "spanId": root if k == 0 else f"{rnd.getrandbits(64) | 1:016x}",
                    "parentSpanId": "" if k == 0 else root,
                    "flags": 256,
                    "name": f"model.layers.Block{i % 12}.forward",
                    "kind": 1,
                    "startTimeUnixNano": str(start + i * 1000),
                    "endTimeUnixNano": str(start + i * 1000 + 700),
                    "attributes": _span_attributes(i),
                    "status": {},
                }
                if i % 10 == 9:
                    span["status"] = {"code": 2, "message": "RuntimeError: boom"}
                    span["events"] = [
                        {
                            "timeUnixNano": str(start + i * 1000 + 600),
                            "name": "exception",
                            "attributes": [
                                _attribute("exception.type", "RuntimeError"),
                                _attribute("exception.message", "boom"),
                                _attribute(
                                    "exception.stacktrace",
                                    'Traceback (most recent call last):\n  File "layers.py", '
                                    "line 120, in forward\nRuntimeError: boom\n",
                                ),
                            ],
                        }
                    ]
                batch.append(span)
            line = {
                "resourceSpans": [
                    {
                        "resource": resource,
                        "scopeSpans": [{"scope": {"name": "otel_gpu"}, "spans": batch}],
                    }
                ]
            }
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
            written += count
    return written


# --------------------------------------------------------------------------- running


def _child(
    argv: list[str], env: dict[str, str], out: IO[Any] | int | None = None
) -> dict[str, Any]:
    """Run ``argv``: wall seconds, exit status, stdout and the end of stderr."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE if out is None else out, stderr=subprocess.PIPE
    )
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - started
    return {
        "wall": wall,
        "rc": proc.returncode,
        "stdout": (stdout or b"").decode(errors="replace"),
        "stderr": (stderr or b"").decode(errors="replace")[-400:],
    }


def _timed(argv: list[str], env: dict[str, str], out: Any = None) -> dict[str, Any]:
    """:func:`_child`, plus its CPU seconds (user + system): the growth of this process's
    reaped children's usage, one child at a time."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = _child(argv, env, out)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result


def _env(**extra: str) -> dict[str, str]:
    from otel_gpu.config import child_environment

    env = {
        k: v for k, v in child_environment().items() if not k.startswith(("OTEL_", "FLASHINFER_"))
    }
    env.update(extra)
    return env


def _median(samples: list[float]) -> float | None:
    return statistics.median(samples) if samples else None


def _start_sink(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    sink = subprocess.Popen(
        [sys.executable, "-c", _SINK], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert sink.stdout is not None
    port = int(sink.stdout.readline())
    return sink, f"http://127.0.0.1:{port}"


def _journals(root: str, processes: int, depth: int, env: dict[str, str]) -> int:
    """Journals of ``processes`` dead processes with ``depth`` calls in flight each."""
    crash_env = dict(env, OTEL_GPU_LOGLEVEL="1", OTEL_GPU_JOURNAL_DIR=root)
    crash_env["OTEL_GPU_LOGDEST"] = os.path.join(root, "crash-%p.jsonl")
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CRASH, str(depth)],
            env=crash_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(processes)
    ]
    for child in children:
        child.wait()
    return processes * (depth + 1)  # the outermost call too


def measure(
    *, rounds: int = 5, spans: int = 50_000, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run the tools rows; the section of the report (figures, samples and budgets)."""
    say = log or (lambda message: None)
    root = tempfile.mkdtemp(prefix="otel-gpu-bench-tools-")
    env = _env()
    sink = None
    try:
        path = os.path.join(root, "spans.jsonl")
        write_trace_file(path, spans)
        size = os.path.getsize(path)
        sink, endpoint = _start_sink(env)
        ship_env = _env(
            OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint
        )
        python = sys.executable
        jobs: dict[str, tuple[list[str], dict[str, str]]] = {
            "floor": ([python, "-c", _FLOOR, path], env),
            "ship": ([python, "-m", "otel_gpu", "ship", "-q", path], ship_env),
            "show": ([python, "-m", "otel_gpu", "show", "--no-color", path], env),
            "workloads": ([python, "-m", "otel_gpu", "workloads", path], env),
            # the level-3 file against itself: read twice, lined up, metadata compared (exit 2,
            # "not compared": the file holds no statistics)
            "diff": ([python, "-m", "otel_gpu", "diff", path, path], env),
            # one rank's file: every call read and lined up by name (exit 0, the ranks agree)
            "ranks": ([python, "-m", "otel_gpu", "ranks", path], env),
            "import torch": ([python, "-c", "import torch"], env),
            "--help": ([python, "-m", "otel_gpu", "--help"], env),
            "show --help": ([python, "-m", "otel_gpu", "show", "--help"], env),
            "ship --help": ([python, "-m", "otel_gpu", "ship", "--help"], env),
            "recover --help": ([python, "-m", "otel_gpu", "recover", "--help"], env),
            "info --help": ([python, "-m", "otel_gpu", "info", "--help"], env),
            "info": ([python, "-m", "otel_gpu", "info"], env),
        }
        samples: dict[str, dict[str, list[float]]] = {k: {"cpu": [], "wall": []} for k in jobs}
        failures: list[str] = []
        rng = random.Random(0)
        for r in range(rounds):
            began = time.monotonic()
            order = list(jobs)
            rng.shuffle(order)
            for name in order:
                argv, job_env = jobs[name]
                done = _timed(argv, job_env, subprocess.DEVNULL)
                usage = "--help" in name or name == "diff"  # exit 2 is theirs to give
                if done["rc"] not in (0, 2) or (done["rc"] == 2 and not usage):
                    failures.append(f"{name}: exit {done['rc']}: {done['stderr'].strip()}")
                    continue
                samples[name]["cpu"].append(done["cpu"])
                samples[name]["wall"].append(done["wall"])
            say(f"tools round {r + 1}/{rounds} done in {time.monotonic() - began:.1f} s")
        recover = _recover(root, env, say)
    finally:
        if sink is not None:
            sink.kill()
            sink.wait()
        shutil.rmtree(root, ignore_errors=True)
    medians = {
        name: {kind: _median(values) for kind, values in s.items()} for name, s in samples.items()
    }
    return _section(spans, size, rounds, samples, medians, recover, failures)


def _recover(root: str, env: dict[str, str], say: Callable[[str], None]) -> dict[str, Any]:
    journals = os.path.join(root, "journals")
    os.makedirs(journals)
    expected = _journals(journals, processes=8, depth=1000, env=env)
    say(f"tools: {expected} calls in flight in 8 dead processes; recovering")
    out = os.path.join(root, "recovered.jsonl")
    done = _timed(
        [sys.executable, "-c", _RECOVER, journals], _env(OTEL_GPU_LOGDEST=out), subprocess.PIPE
    )
    figures: dict[str, Any] = {"expected": expected, "rc": done["rc"], "cpu": done["cpu"]}
    try:
        figures.update(json.loads(done["stdout"].strip().splitlines()[-1]))
    except (ValueError, IndexError):
        figures["error"] = done["stderr"].strip()
    return figures


def _ratio(medians: dict[str, dict[str, float | None]], name: str, floor: str, kind: str) -> Any:
    ours, base = medians[name][kind], medians[floor][kind]
    return ours / base if ours is not None and base else None


def _section(
    spans: int,
    size: int,
    rounds: int,
    samples: dict[str, dict[str, list[float]]],
    medians: dict[str, dict[str, float | None]],
    recover: dict[str, Any],
    failures: list[str],
) -> dict[str, Any]:
    budgets = []
    for name, limit in (("ship", SHIP_LIMIT), ("show", SHOW_LIMIT)):
        value = _ratio(medians, name, "floor", "cpu")
        wall = _ratio(medians, name, "floor", "wall")
        budgets.append(
            {
                "name": f"{name} ≤ {limit:g}× a json.loads pass ({spans} spans, CPU)",
                "status": "n/a" if value is None else ("met" if value <= limit else "missed"),
                "value": value,
                "limit": limit,
                "detail": f"wall {wall:.2f}×" if wall is not None else "did not run",
            }
        )
    for name, files in (("workloads", 1), ("diff", 2), ("ranks", 1)):
        value = _ratio(medians, name, "floor", "cpu")
        value = None if value is None else value / files
        budgets.append(
            {
                "name": f"{name} ≤ {READERS_LIMIT:g}× a json.loads pass of each file it reads "
                f"({spans} spans, CPU)",
                "status": "n/a"
                if value is None
                else ("met" if value <= READERS_LIMIT else "missed"),
                "value": value,
                "limit": READERS_LIMIT,
                "detail": f"{files} file{'s' if files > 1 else ''}",
            }
        )
    rate = None
    if recover.get("seconds") and recover.get("spans") == recover["expected"]:
        rate = recover["spans"] / recover["seconds"]
    budgets.append(
        {
            "name": f"recover ≥ {RECOVER_MIN:,.0f} spans/s",
            "status": "n/a" if rate is None else ("met" if rate >= RECOVER_MIN else "missed"),
            "value": None,
            "limit": None,
            "detail": (
                f"{rate:,.0f} spans/s ({recover['spans']} spans in {recover['seconds']:.2f} s)"
                if rate is not None
                else f"recovered {recover.get('spans')} of {recover['expected']} "
                f"{recover.get('error', '')}".strip()
            ),
        }
    )
    starts = ("--help", "show --help", "ship --help", "recover --help", "info --help")
    worst = [_ratio(medians, name, "import torch", "wall") for name in starts]
    known = [w for w in worst if w is not None]
    budgets.append(
        {
            "name": f"start without torch ≤ {START_LIMIT:g}× import torch (wall)",
            "status": "n/a"
            if len(known) < len(starts)
            else ("met" if max(known) <= START_LIMIT else "missed"),
            "value": max(known) if known else None,
            "limit": START_LIMIT,
            "detail": ", ".join(
                f"{name} {w:.2f}×" for name, w in zip(starts, worst) if w is not None
            ),
        }
    )
    return {
        "spans": spans,
        "file_bytes": size,
        "rounds": rounds,
        "medians": medians,
        "samples": samples,
        "recover": recover,
        "problems": failures,
        "budgets": budgets,
    }


def render(section: dict[str, Any]) -> list[str]:
    """The tools rows as text lines."""
    m = section["medians"]
    lines = [
        f"tools: {section['spans']} spans ({section['file_bytes'] / 2**20:.0f} MiB), medians of "
        f"{section['rounds']} interleaved rounds, each a fresh process; seconds, and × the "
        "json.loads pass (CPU: user+system of the process)",
        f"{'command':28} {'CPU s':>7} {'wall s':>7} {'CPU×':>6} {'wall×':>6}",
    ]
    for name in ("floor", "ship", "show", "workloads", "diff", "ranks"):
        cpu, wall = m[name]["cpu"], m[name]["wall"]
        if cpu is None or wall is None:
            lines.append(f"{name:28} did not run")
            continue
        lines.append(
            f"{name:28} {cpu:7.2f} {wall:7.2f} "
            f"{_ratio(m, name, 'floor', 'cpu'):6.2f} {_ratio(m, name, 'floor', 'wall'):6.2f}"
        )
    lines.append(f"{'start-up':28} {'CPU s':>7} {'wall s':>7} {'÷ import torch (wall)':>22}")
    for name in ("import torch", "--help", "show --help", "ship --help", "recover --help"):
        cpu, wall = m[name]["cpu"], m[name]["wall"]
        if cpu is None or wall is None:
            continue
        lines.append(
            f"{name:28} {cpu:7.2f} {wall:7.2f} {_ratio(m, name, 'import torch', 'wall'):22.2f}"
        )
    for name in ("info --help", "info"):
        cpu, wall = m[name]["cpu"], m[name]["wall"]
        if cpu is not None and wall is not None:
            note = " (imports torch for the resource's CUDA facts)" if name == "info" else ""
            lines.append(
                f"{name:28} {cpu:7.2f} {wall:7.2f} "
                f"{_ratio(m, name, 'import torch', 'wall'):22.2f}{note}"
            )
    for problem in section["problems"]:
        lines.append(f"  problem: {problem}")
    return lines
