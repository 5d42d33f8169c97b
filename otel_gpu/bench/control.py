"""The live-control row of ``otel-gpu bench``: how fast ``otel-gpu control`` answers and how
fast a change takes effect in a process busy in a forward loop.

A child process builds the bench's tiny GPT2, arms every module at level 0
(``OTEL_GPU_CONTROL=on``, ``instrument_module``) and waits. Then:

* ``reply_s``: the wall time of ``otel-gpu control PID --show`` (a new interpreter: its own
  start, the request, the listener's poll, the reply) while the child is idle; budget 0.3 s.
* ``effect_s``: with the child running forwards back to back, the time from the start of
  ``otel-gpu control PID --level 5 --include transformer.h.1.mlp --for 1s`` to the start of that
  module's first span; budget 1 s. Each round also checks that no span of the raised module
  starts before the ``otel_gpu.control`` span that explains it (``ordered``).

Medians over the rounds; on a shared machine the command's own start is most of both figures.

Run alone: ``python -m otel_gpu.bench.control [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["EFFECT_BUDGET_S", "REPLY_BUDGET_S", "measure", "render", "row"]

REPLY_BUDGET_S = 0.3
EFFECT_BUDGET_S = 1.0
MODULE = "transformer.h.1.mlp"

_CHILD = """
import os, sys, time
import torch
import otel_gpu
from otel_gpu.bench.models import tiny_gpt2
model, ids = tiny_gpt2()
assert otel_gpu.instrument_module(model) > 0
work = sys.argv[1]
open(os.path.join(work, "ready"), "w").close()
while not os.path.exists(os.path.join(work, "go")):
    time.sleep(0.01)
with torch.no_grad():
    while not os.path.exists(os.path.join(work, "stop")):
        model(ids)
otel_gpu.flush()
"""


def _wait(path: str, limit: float = 600.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {limit:.0f} s")
        time.sleep(0.05)


def _command(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    begun = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "otel_gpu", "control", *args],
        env=env,
        capture_output=True,
        timeout=120,
    )
    return time.perf_counter() - begun, done.returncode


def _spans(path: str) -> list[tuple[str, int]]:
    """``(name, start ns)`` of every span of an OTLP JSON Lines file."""
    from otel_gpu.traces.reader import load_json, read_lines

    def fail(exc: Exception) -> None:
        raise exc

    out = []
    for line in read_lines(path, fail):
        for rs in load_json(line.raw, line.where, line.torn)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                out += [(s["name"], int(s["startTimeUnixNano"])) for s in ss["spans"]]
    return out


def measure(rounds: int = 5) -> dict[str, Any]:
    """Both figures per round, measured against one child process."""
    from otel_gpu import config

    with tempfile.TemporaryDirectory(prefix="otel-gpu-bench-control-") as work:
        journal = os.path.join(work, "journal")
        os.mkdir(journal, 0o700)
        spans_file = os.path.join(work, "spans.jsonl")
        env = {
            **config.child_environment(),
            "OTEL_GPU_CONTROL": "on",
            "OTEL_GPU_LOGLEVEL": "0",
            "OTEL_GPU_LOGDEST": spans_file,
            "OTEL_GPU_JOURNAL_DIR": journal,
        }
        child = subprocess.Popen([sys.executable, "-c", _CHILD, work], env=env)
        try:
            _wait(os.path.join(work, "ready"))
            pid = str(child.pid)
            replies = []
            for _ in range(rounds):
                took, code = _command([pid, "--show"], env)
                if code != 0:
                    raise RuntimeError(f"otel-gpu control --show exited {code}")
                replies.append(took)
            open(os.path.join(work, "go"), "w").close()
            time.sleep(1.0)  # the loop is running
            starts = []
            for _ in range(rounds):
                starts.append(time.time_ns())
                _, code = _command([pid, "--level", "5", "--include", MODULE, "--for", "1s"], env)
                if code != 0:
                    raise RuntimeError(f"otel-gpu control --level 5 exited {code}")
                time.sleep(2.0)  # past the window's end
        finally:
            open(os.path.join(work, "stop"), "w").close()
            child.wait(timeout=120)
        spans = _spans(spans_file)
    raised = sorted(t for n, t in spans if n == MODULE)
    controls = sorted(t for n, t in spans if n == "otel_gpu.control")
    effects, ordered = [], True
    for began in starts:
        first = next((t for t in raised if t >= began), None)
        control = next((t for t in controls if t >= began), None)
        if first is None or control is None:
            raise RuntimeError("a change made no span of the raised module")
        effects.append((first - began) / 1e9)
        ordered = ordered and control <= first
    return {"reply_s": replies, "effect_s": effects, "ordered": ordered}


def render(result: dict[str, Any]) -> str:
    reply, effect = result["reply_median_s"], result["effect_median_s"]
    return (
        "live control (tiny GPT2, every module armed at level 0; medians of "
        f"{len(result['rounds']['reply_s'])} rounds)\n"
        f"  otel-gpu control --show, idle process   {reply:6.3f} s  "
        f"(≤ {REPLY_BUDGET_S} s: {'met' if reply <= REPLY_BUDGET_S else 'MISSED'})\n"
        f"  command start to first level-5 span    {effect:6.3f} s  "
        f"(≤ {EFFECT_BUDGET_S} s: {'met' if effect <= EFFECT_BUDGET_S else 'MISSED'}; "
        f"max {max(result['rounds']['effect_s']):.3f} s)\n"
        "  control span before the first span at its level: "
        + ("yes, every round" if result["rounds"]["ordered"] else "NO")
    )


def row(quick: bool = False) -> dict[str, Any]:
    """The bench row (2 rounds with ``--quick``: checks the harness only). ``ok`` says the row
    was measured; the text says whether the budgets were met."""
    from otel_gpu.bench.models import Unavailable, import_transformers

    try:
        import_transformers()
    except Unavailable as exc:
        return {"name": "control", "ok": True, "text": f"live control: not run ({exc})"}
    raw = measure(2 if quick else 5)
    result: dict[str, Any] = {
        "name": "control",
        "rounds": raw,
        "reply_median_s": statistics.median(raw["reply_s"]),
        "effect_median_s": statistics.median(raw["effect_s"]),
        "reply_budget_s": REPLY_BUDGET_S,
        "effect_budget_s": EFFECT_BUDGET_S,
        "ok": True,
    }
    result["text"] = render(result)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m otel_gpu.bench.control")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    raw = measure(args.rounds)
    result = {
        "rounds": raw,
        "reply_median_s": statistics.median(raw["reply_s"]),
        "effect_median_s": statistics.median(raw["effect_s"]),
    }
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
