"""``otel-gpu bench``: what each level costs per call, side by side with FlashInfer and plain OTel.

Every configuration runs in its own worker process (:mod:`otel_gpu.bench.worker`):
FlashInfer reads its level when it is imported, our level is fixed when a function is
decorated, and a process holds one pipeline. The parent never measures anything
itself; it drives the workers in interleaved rounds, each round visiting every
configuration in a new random order while the other workers sleep on their stdin, and
reports medians over rounds. Ratios are therefore taken side by side in one run.

For each configuration two costs per call are reported:

* caller-visible: the loop of calls alone, with export deferred;
* total: the loop plus the flush that puts every span into an OTLP JSON Lines file
  (FlashInfer writes its own log file synchronously, so its two costs coincide).

The ``gpt2_*`` rows are a second workload: one forward pass of a tiny transformers GPT2
per call, every module instrumented with :func:`otel_gpu.instrument_module` (about 30
spans per forward), compared with the same forward at level 0. The ``gpt2att_*`` rows
instrument the attention modules only (``include=["*Attention"]``, 2 spans per forward).
The ``mixtral_*`` rows are the same workload for a tiny Mixtral (mixture of experts).

``ours1m`` is level 1 with ``OTEL_GPU_METRICS`` on: against ``ours1`` it gives what the call
metrics cost per call, on the caller's thread and in total.

``armed0`` is level 0 with ``OTEL_GPU_CONTROL=on``: the trampoline live control can swap,
against the bare call (and ``ours0``, the function itself). ``armed1`` is the same armed
function switched to level 1 by live control before the rounds: against ``ours1``, a function
decorated at level 1, it gives what a switched path costs over a decided one. ``gpt2arm0``
is the tiny GPT2 forward with every module armed at level 0 by ``instrument_module`` under
``OTEL_GPU_CONTROL=on`` (a trampoline per module, no span): against ``gpt2_0``, the plain
forward, it is what a server pays to be controllable.

``ours5fp`` is level 5 with ``OTEL_GPU_FINGERPRINT`` on: against ``ours5`` (fingerprints off,
the default) it gives what the fingerprint costs per call.

``ours1batch`` is level 1 with every call inside ``otel_gpu.batch`` of 64 requests (each span
then carries 64 links): against ``ours1`` it gives what the batch context costs per call.

``ours5ring`` is level 5 with the in-memory ring on (``ring=8``): compared with level 5 it
gives the ring's own cost per call, and with level 10 (the recorder it stands in for) the
ratio of the two.

Report formatting and the budgets live in :mod:`otel_gpu.bench.report`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CONFIGS", "Result", "register", "run"]


@dataclass(frozen=True)
class ConfigSpec:
    """One row of the benchmark: a worker kind and its options."""

    name: str
    label: str
    kind: str
    level: int | None = None
    ring: int = 0  # OTEL_GPU_RING: the in-memory ring's size (0: off)
    include: tuple[str, ...] | None = None  # gpt2: instrument_module's include patterns
    metrics: bool = False  # OTEL_GPU_METRICS: call metrics on (recorded on the export thread)
    control: bool = False  # OTEL_GPU_CONTROL=on: the function is armed (calls/armed.py)
    switch: int | None = None  # a level live control switches the armed function to, untimed
    fingerprint: bool = False  # OTEL_GPU_FINGERPRINT: the level-5 hash of each tensor's bytes
    batch: int = 0  # calls inside otel_gpu.batch() of this many requests (0: outside one)


CONFIGS: tuple[ConfigSpec, ...] = (
    ConfigSpec("bare", "bare call", "bare"),
    ConfigSpec("floor", "torch.sum floor (3 tensors)", "floor"),
    ConfigSpec("ours0", "otel-gpu level 0", "ours", 0),
    ConfigSpec("ours1", "otel-gpu level 1", "ours", 1),
    ConfigSpec("ours1m", "otel-gpu level 1, metrics on", "ours", 1, metrics=True),
    ConfigSpec("ours3", "otel-gpu level 3", "ours", 3),
    ConfigSpec("ours5", "otel-gpu level 5", "ours", 5),
    ConfigSpec("ours10", "otel-gpu level 10", "ours", 10),
    ConfigSpec("ours5fp", "otel-gpu level 5, fingerprints", "ours", 5, fingerprint=True),
    ConfigSpec("ours5ring", "otel-gpu level 5, ring of 8", "ours", 5, ring=8),
    ConfigSpec("ours1batch", "otel-gpu level 1, in a step of 64 requests", "ours", 1, batch=64),
    ConfigSpec("armed0", "otel-gpu level 0, armed (CONTROL=on)", "ours", 0, control=True),
    ConfigSpec("armed1", "armed level 0 switched to 1", "ours", 0, control=True, switch=1),
    ConfigSpec("otel", "OTel SDK span", "otel"),
    ConfigSpec("fi1", "FlashInfer level 1", "flashinfer", 1),
    ConfigSpec("fi3", "FlashInfer level 3", "flashinfer", 3),
    ConfigSpec("fi5", "FlashInfer level 5", "flashinfer", 5),
    ConfigSpec("save", "torch.save of the call", "save"),
    ConfigSpec("gpt2_0", "tiny GPT2 forward, level 0", "gpt2", 0),
    ConfigSpec("gpt2_1", "tiny GPT2 forward, level 1", "gpt2", 1),
    ConfigSpec("gpt2_3", "tiny GPT2 forward, level 3", "gpt2", 3),
    ConfigSpec("gpt2_5", "tiny GPT2 forward, level 5", "gpt2", 5),
    ConfigSpec("gpt2arm0", "tiny GPT2 forward, armed L0", "gpt2", 0, control=True),
    ConfigSpec("gpt2att_1", "tiny GPT2, attention only, L1", "gpt2", 1, include=("*Attention",)),
    ConfigSpec("gpt2att_3", "tiny GPT2, attention only, L3", "gpt2", 3, include=("*Attention",)),
    ConfigSpec("mixtral_0", "tiny Mixtral forward, level 0", "mixtral", 0),
    ConfigSpec("mixtral_1", "tiny Mixtral forward, level 1", "mixtral", 1),
    ConfigSpec("mixtral_3", "tiny Mixtral forward, level 3", "mixtral", 3),
    ConfigSpec("gloo0", "gloo all_reduce [4], bare", "gloo", 0),
    ConfigSpec("gloo1", "gloo all_reduce [4], level 1", "gloo", 1),
    ConfigSpec("gloo3", "gloo all_reduce [4], level 3", "gloo", 3),
)
_BY_NAME = {c.name: c for c in CONFIGS}
SECTIONS = ("otel_gpu.bench.tools",)
"""Rows measured by a module of their own after the configurations, each named by its ``NAME``
(``--only`` takes it): ``measure(rounds=, spans=, log=)`` returns a section with ``budgets``,
``problems`` and what its ``render(section)`` turns into lines."""
# Rows measured by their own module's row(quick), after the per-call configurations.
_ROWS = {
    "sustained": "otel_gpu.bench.sustained",
    "device_time": "otel_gpu.bench.device_time",
    "control": "otel_gpu.bench.control",
}

_MAX_QUEUED = (
    1024  # otel_gpu.export.pipeline._WAKE_AT: production never defers more calls than this
)
_READY_TIMEOUT = 600.0  # seconds; 16 workers importing torch at once on 2 cores take a while
_REPLY_TIMEOUT = 900.0


@dataclass
class Result:
    """One configuration's outcome: status, loop length and per-round samples (ns per call)."""

    spec: ConfigSpec
    status: str = "pending"  # ready | unavailable | error
    reason: str | None = None
    n: int = 0
    caller: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    syncs: dict[str, float] = field(default_factory=dict)
    gc: dict[str, float] = field(default_factory=dict)
    gc_rounds: list[float] = field(default_factory=list)
    """The collector's time in each round (loop and flush), ns per call."""
    gc_full_rounds: list[float] = field(default_factory=list)
    """Of which full collections (the oldest generation), ns per call."""
    gc_full: int = 0
    """Full collections within the rounds."""
    calls: int | None = None  # calls made: forwards, for the gpt2 rows
    spans: int | None = None
    dumps: int | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ready" and bool(self.caller)

    @property
    def caller_us(self) -> float | None:
        return statistics.median(self.caller) / 1e3 if self.ok else None

    @property
    def total_us(self) -> float | None:
        return statistics.median(self.total) / 1e3 if self.ok else None

    @property
    def gc_us(self) -> float | None:
        """The collector's time per call: the young generations' averaged over every round, and
        the full collections' amortised cost (``_retained``: what a queued call keeps alive,
        priced at this heap's full collection), since a full collection comes once in
        thousands of forwards, more than a bench run makes; measured instead when the
        estimate is missing."""
        if not self.ok or len(self.gc_rounds) != len(self.total):
            return None
        young = statistics.fmean(g - f for g, f in zip(self.gc_rounds, self.gc_full_rounds))
        amortised = (self.gc or {}).get("gc_amortised_us")
        full = statistics.fmean(self.gc_full_rounds) / 1e3 if amortised is None else amortised
        return young / 1e3 + full

    def _total_gc(self) -> list[float]:
        """Each round's total with its own collections replaced by their cost per call (µs)."""
        mean = self.gc_us
        if mean is None:
            return []
        return [(t - g) / 1e3 + mean for t, g in zip(self.total, self.gc_rounds)]

    def as_dict(self) -> dict[str, Any]:
        total_gc = self._total_gc()
        return {
            "label": self.spec.label,
            "status": self.status,
            "reason": self.reason,
            "calls_per_round": self.n,
            "caller_us": self.caller_us,
            "total_us": self.total_us,
            "caller_samples_us": [x / 1e3 for x in self.caller],
            "total_samples_us": [x / 1e3 for x in self.total],
            "host_syncs_per_call": self.syncs or None,
            "gc": self.gc or None,
            # the garbage collector counted in the row: each round's total without its own
            # collections, plus their cost per call (gc_us: the young generations' mean, the
            # full collections amortised; a median of rounds would drop the rare full
            # collection); the median of those, and the samples for per-round ratios
            "gc_us": self.gc_us,
            "gc_full_collections": self.gc_full if self.ok else None,
            "total_gc_us": statistics.median(total_gc) if total_gc else None,
            "total_gc_samples_us": total_gc,
            "calls": self.calls,
            "spans_written": self.spans,
            "spans_per_call": self.info.get("spans_per_call"),
            "modules_instrumented": self.info.get("modules_instrumented"),
            "dumps_written": self.dumps,
            "dump_durability": self.info.get("dump_durability"),
            "ring": self.info.get("ring"),
            "metrics": self.info.get("metrics"),
            "fingerprint": self.info.get("fingerprint"),
            "identity": self.info.get("identity"),
            "observers": self.info.get("observers"),
        }


class _Worker:
    """A worker process and its line protocol."""

    def __init__(
        self, spec: ConfigSpec, workdir: str, device: str, threads: int, journal: bool
    ) -> None:
        self.spec = spec
        os.makedirs(workdir, exist_ok=True)
        from otel_gpu.config import child_environment

        env = child_environment()
        env["FLASHINFER_LOGLEVEL"] = "0"
        if spec.kind == "flashinfer":
            env["FLASHINFER_LOGLEVEL"] = str(spec.level)
            env["FLASHINFER_LOGDEST"] = os.path.join(workdir, f"flashinfer{spec.level}.log")
        payload = {
            "kind": spec.kind,
            "level": spec.level,
            "dir": workdir,
            "device": device,
            "threads": threads,
            "journal": journal,
            "ring": spec.ring,
            "metrics": spec.metrics,
            "control": spec.control,
            "switch": spec.switch,
            "fingerprint": spec.fingerprint,
            "batch": spec.batch,
            "include": list(spec.include) if spec.include is not None else None,
        }
        self.stderr = open(os.path.join(workdir, "stderr.txt"), "w+b")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "otel_gpu.bench.worker", json.dumps(payload)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            text=True,
            bufsize=1,
        )

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"worker {self.spec.name} gave no answer: {self.stderr_tail()}")
        return json.loads(line)

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = self.read(_REPLY_TIMEOUT)
        if "error" in answer:
            raise RuntimeError(f"worker {self.spec.name}: {answer['error']}")
        return answer

    def stderr_tail(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        text = self.stderr.read().decode("utf-8", "replace").strip()
        return text[-2000:] or f"exit code {self.proc.poll()}"

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.ask(cmd="exit")
        except Exception:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def _pick_device(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


def run(
    *,
    rounds: int = 15,
    target_s: float = 0.2,
    only: Sequence[str] | None = None,
    device: str = "auto",
    threads: int = 1,
    journal: bool = True,
    workdir: str | None = None,
    keep: bool = False,
    seed: int = 0,
    log: Any = None,
) -> dict[str, Any]:
    """Run the benchmark and return the report as a JSON-ready dict."""
    from otel_gpu.bench import report as _report

    device = _pick_device(device)
    specs = [_BY_NAME[n] for n in only] if only else list(CONFIGS)
    root = workdir or tempfile.mkdtemp(prefix="otel-gpu-bench-")
    say = (lambda msg: print(msg, file=log, flush=True)) if log else (lambda msg: None)
    results = {s.name: Result(s) for s in specs}
    workers: dict[str, _Worker] = {}
    started = time.monotonic()
    try:
        say(f"starting {len(specs)} workers in {root} …")
        for s in specs:
            workers[s.name] = _Worker(s, os.path.join(root, s.name), device, threads, journal)
        for name, w in list(workers.items()):
            res = results[name]
            try:
                hello = w.read(_READY_TIMEOUT)
            except RuntimeError as exc:
                res.status, res.reason = "error", str(exc)
            else:
                if hello.get("ready"):
                    res.status, res.info = "ready", hello.get("info", {})
                elif "unavailable" in hello:
                    res.status, res.reason = "unavailable", hello["unavailable"]
                else:
                    res.status, res.reason = "error", hello.get("error", "?")
            if res.status != "ready":
                w.close()
                del workers[name]
        if "save" in workers and "ours10" in results and results["ours10"].status != "ready":
            results["save"].status = "unavailable"
            results["save"].reason = "only measured against otel-gpu level 10"
            workers.pop("save").close()

        def ask(name: str, **cmd: Any) -> dict[str, Any] | None:
            """A worker's answer; a worker that fails is reported as an error and dropped."""
            try:
                return workers[name].ask(**cmd)
            except (RuntimeError, OSError, ValueError) as exc:
                results[name].status, results[name].reason = "error", str(exc)
                workers.pop(name).close()
                return None

        for name in list(workers):
            # Records wait in a queue until export: our export thread wakes at 1024 queued calls
            # (and the SDK's batch processor exports at 512), so a longer deferred loop would
            # keep more records alive, for the garbage collector to walk, than a real run does.
            kind = _BY_NAME[name].kind
            max_n = _MAX_QUEUED if kind in ("ours", "otel") else 200_000
            # a model row makes ~30 (or 2) spans a forward: as many queued spans as above
            if kind in ("gpt2", "mixtral"):
                max_n = max(1, _MAX_QUEUED // (results[name].info.get("spans_per_call") or 1))
            answer = ask(name, cmd="calibrate", target_s=target_s, max_n=max_n)
            if answer is not None:
                results[name].n = answer["n"]
        say(
            f"workers ready and calibrated in {time.monotonic() - started:.0f} s; calls per round: "
            + ", ".join(f"{k}={results[k].n}" for k in workers)
        )
        rng = random.Random(seed)
        for r in range(rounds):
            round_started = time.monotonic()
            order = list(workers)
            rng.shuffle(order)
            for name in order:
                res = results[name]
                sample = ask(name, cmd="run", n=res.n)
                if sample is not None:
                    res.caller.append(sample["caller_ns"] / sample["n"])
                    res.total.append(sample["total_ns"] / sample["n"])
                    res.gc_rounds.append(sample.get("gc_ns", 0) / sample["n"])
                    res.gc_full_rounds.append(sample.get("gc_full_ns", 0) / sample["n"])
                    res.gc_full += sample.get("gc_full", 0)
            # this round's own time: one round of every configuration, not the time since start
            took = time.monotonic() - round_started
            say(f"round {r + 1}/{rounds} done in {took:.{2 if took < 10 else 0}f} s")
        for name in list(workers):
            answer = ask(name, cmd="retained", n=max(1, min(results[name].n, 256)))
            if answer is not None:
                results[name].gc = answer
        if device == "cuda":
            for name in list(workers):
                n = 3 if name in ("fi5", "ours10", "ours5ring", "ours5fp", "save") else 20
                answer = ask(name, cmd="syncs", n=n)
                if answer is not None:
                    results[name].syncs = answer
        for name in list(workers):
            done = ask(name, cmd="finish")
            if done is not None:
                results[name].calls, results[name].spans = done["calls"], done["spans"]
                results[name].dumps = done.get("dumps")
    finally:
        for w in workers.values():
            w.close()
        if not keep and workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return _report.build(
        results,
        device=device,
        rounds=rounds,
        target_s=target_s,
        threads=threads,
        journal=journal,
    )


def _main(args: argparse.Namespace) -> int:
    from otel_gpu.bench import report as _report

    if args.quick:
        rounds, target = 3, 0.01
    else:
        rounds, target = 15, 0.2
    rounds = args.rounds or rounds
    target = args.target_ms / 1e3 if args.target_ms else target
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    sections = {name.rsplit(".", 1)[1]: name for name in SECTIONS}
    if only:
        unknown = [n for n in only if n not in _BY_NAME and n not in sections and n not in _ROWS]
        if unknown:
            print(
                f"otel-gpu bench: unknown configuration(s) {', '.join(unknown)}; "
                f"known: {', '.join([*_BY_NAME, *sections, *_ROWS])}",
                file=sys.stderr,
            )
            return 2
    # rows with their own runner: each module's row(quick) gives a JSON-ready dict, "ok", "text"
    rows = [importlib.import_module(m) for n, m in _ROWS.items() if not only or n in only]
    wanted = {n: m for n, m in sections.items() if only is None or n in only}
    only = [n for n in only if n in _BY_NAME] if only else None
    if only == [] and not wanted:  # only rows with their own runner
        extra = [row.row(args.quick) for row in rows]
        print(json.dumps(extra, indent=2) if args.json else "\n\n".join(r["text"] for r in extra))
        return 0 if all(r["ok"] for r in extra) else 1
    report = run(
        rounds=rounds,
        target_s=target,
        # `--only tools`: the bare row alone gives the report its machine and versions
        only=only or ["bare"] if only is not None else None,
        device=args.device,
        threads=args.threads,
        journal=not args.no_journal,
        workdir=args.dir,
        keep=args.keep,
        seed=args.seed,
        log=None if args.json else sys.stderr,
    )
    for name, module in wanted.items():
        _add_section(report, name, module, rounds=3 if args.quick else 5, quick=args.quick)
    report["rows"] = [row.row(args.quick) for row in rows]
    report["ok"] = report["ok"] and all(r["ok"] for r in report["rows"])
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n\n".join([_report.render(report), *(r["text"] for r in report["rows"])]))
    return 0 if report["ok"] else 1


def _add_section(report: dict[str, Any], name: str, module: str, rounds: int, quick: bool) -> None:
    import importlib

    section = importlib.import_module(module).measure(
        rounds=rounds, spans=5_000 if quick else 50_000, log=lambda m: print(m, file=sys.stderr)
    )
    report.setdefault("sections", {})[name] = section
    report["budgets"] += section["budgets"]
    report["problems"] += [f"{name}: {p}" for p in section["problems"]]
    report["ok"] = not report["problems"]


def _positive_ms(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 60_000:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(
            f"must be a number of milliseconds > 0 and <= 60000, not {raw!r}"
        )
    return value


def register(sub: Any) -> None:
    from otel_gpu.cli import whole_number

    p = sub.add_parser(
        "bench",
        help="measure each level's cost per call, side by side with FlashInfer and plain OTel",
        description=(
            "Per-call cost of a decorated function with two [32,128,128] float32 tensors and a "
            "scalar kwarg: bare, otel-gpu levels 0/1/3/5/10, level 1 with metrics on, level 5 "
            "with fingerprints and level 5 with the ring of 8 calls, "
            "a plain OTel SDK span and FlashInfer's @flashinfer_api (when installed); and one "
            "forward pass of a tiny GPT2 with every module instrumented "
            "(otel_gpu.instrument_module) at levels 0/1/3/5, or its attention modules only at "
            "levels 1/3, and a tiny Mixtral at levels 0/1/3 (when transformers is installed); "
            "and an all_reduce of 4 floats on a "
            "one-rank gloo group, bare and with the torch.distributed target at levels 1/3. "
            "Each configuration runs in its own worker "
            "process, measured in interleaved rounds; medians and ratios against the budgets. "
            "Then the sustained-load row (--only sustained): 300k level-1 calls in one tight loop "
            "at default settings, the fraction of spans that reached the file and the process CPU "
            "against FlashInfer's logger for the same calls. And the live-control row (--only "
            "control): how fast otel-gpu control answers an idle process, and how fast a change "
            "takes effect in one busy in a forward loop."
        ),
    )
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.add_argument(
        "--quick", action="store_true", help="3 short rounds: checks the harness, not the figures"
    )
    p.add_argument(
        "--rounds", type=whole_number(1), default=0, help="interleaved rounds (default 15)"
    )
    p.add_argument(
        "--target-ms",
        type=_positive_ms,
        default=0.0,
        help="wall time of one configuration's round, loop plus flush (default 200)",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated configurations to run (default all): "
        + ",".join([*_BY_NAME, *(name.rsplit(".", 1)[1] for name in SECTIONS), *_ROWS]),
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--threads",
        type=whole_number(0),
        default=1,
        help="torch intra-op threads in every worker (default 1: on a shared machine OpenMP "
        "barriers turn other processes' load into noise); 0 keeps torch's default",
    )
    p.add_argument(
        "--no-journal",
        action="store_true",
        help="run otel-gpu with OTEL_GPU_JOURNAL off (default: on, as in production)",
    )
    p.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the temporary working directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the round order shuffle")
    p.set_defaults(func=_main)
