"""One ``otel-gpu bench`` configuration, measured in its own process on the parent's command.

Run as ``python -m otel_gpu.bench.worker '<json spec>'``. Every worker imports the
same modules (torch, the OTel SDK and JSON file exporter, otel_gpu, and flashinfer
when installed), so the garbage collector walks heaps of the same size in every
configuration. The tiny-GPT2 workers also import transformers and hold the model; they
are compared only with each other. A worker then waits on stdin for JSON commands and answers each with
one JSON line on the original stdout; anything a library prints goes to stderr.

Commands: ``calibrate`` (pick the loop length for a target duration), ``run`` (one
timed round: a loop of calls, then the flush), ``retained`` (GC-tracked objects a
queued call keeps alive), ``syncs`` (host syncs per call, CUDA only), ``finish``
(count what reached the file) and ``exit``.

A configuration's export is deferred during the loop: otel-gpu's export thread and
the SDK's BatchSpanProcessor are set not to wake, so the loop time is what the
caller pays, and the loop plus the flush is the total cost of getting every span
into the OTLP JSON Lines file.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

# the models, also read here by the tests
from otel_gpu.bench.models import (
    Unavailable,
    import_transformers,
    module_calls,
    tiny_gpt2,
    tiny_mixtral,
)

__all__ = ["main"]

SHAPE = (32, 128, 128)
SCALE = 0.5
_NEVER = 10**9  # seconds / calls: a wake-up that never comes during a round


def _fresh_fn() -> Callable[..., Any]:
    """A new undecorated function per configuration: our level is fixed at decoration."""

    def attention(q: Any, k: Any, *, scale: float = 1.0) -> Any:
        return q

    attention.__qualname__ = "attention"
    attention.__module__ = "bench"
    return attention


class Config:
    """A measured loop: ``loop(n)`` makes n calls, ``flush()`` gets their records to the file."""

    identity = False
    spans_file: str | None = None

    def __init__(self, spec: dict[str, Any], q: Any, k: Any) -> None:
        self.spec = spec
        self.q = q
        self.k = k
        self.calls = 0
        self.fn: Callable[..., Any] = _fresh_fn()

    def loop(self, n: int) -> None:
        fn, q, k = self.fn, self.q, self.k
        for _ in range(n):
            fn(q, k, scale=SCALE)

    def flush(self) -> None:
        pass

    def after_round(self) -> None:
        """Untimed clean-up between rounds (dump directories)."""

    def count(self) -> int | None:
        """Spans that reached the file, or None when this configuration writes none."""
        if self.spans_file is None:
            return None
        return count_spans(self.spans_file)


class Bare(Config):
    pass


class Floor(Config):
    """One ``torch.sum`` per tensor of the call (two inputs, one output): the bandwidth floor."""

    def loop(self, n: int) -> None:
        q, k = self.q, self.k
        out = self.fn(q, k, scale=SCALE)
        for _ in range(n):
            q.sum()
            k.sum()
            out.sum()


class Ours(Config):
    def __init__(self, spec: dict[str, Any], q: Any, k: Any) -> None:
        super().__init__(spec, q, k)
        import otel_gpu
        from otel_gpu.export import pipeline

        level = spec["level"]
        if level >= 10:
            if importlib.util.find_spec("otel_gpu.recorder.recorder") is None:
                raise Unavailable("otel_gpu.recorder.recorder is not part of this build")
            try:
                importlib.import_module("otel_gpu.recorder.recorder")
            except Exception as exc:
                raise Unavailable(f"import otel_gpu.recorder.recorder failed: {exc!r}") from exc
        # Defer export for the whole loop (the flush does it): caller-visible cost only.
        pipeline.defer_export()
        switched = "" if spec.get("switch") is None else f"-to{spec['switch']}"
        if spec.get("batch"):
            switched += f"-batch{spec['batch']}"
        self.spans_file = os.path.join(spec["dir"], f"ours{level}{switched}.jsonl")
        self.dump_dir = os.path.join(spec["dir"], "dumps", f"ours{level}")
        otel_gpu.configure(
            level=level,
            dest=self.spans_file,
            provider="own",
            # limits that a run never reaches, within the settings' ranges: a round defers at
            # most bench._MAX_QUEUED calls, and a whole run dumps thousands of calls, not millions
            queue_size=65_536,
            dump_dir=self.dump_dir,
            dump_max_count=1_000_000,
            dump_max_size_gb=1024,
            journal=spec.get("journal", True),
            ring=spec.get("ring") or 0,
            metrics=bool(spec.get("metrics")),
            control="on" if spec.get("control") else "off",
            fingerprint=bool(spec.get("fingerprint")),
        )
        raw = self.fn
        self.fn = otel_gpu.api(raw)
        self.identity = self.fn is raw
        self._flush = otel_gpu.flush
        self.dumped = 0
        self.controls = 0  # otel_gpu.control spans in the file, not calls
        switch = spec.get("switch")
        if switch is not None:  # live control swaps the armed path, as otel-gpu control would
            from otel_gpu.control import document, state

            state.apply(document.parse({"level": switch, "for": None}), "otel-gpu bench")
            self.controls = 1
        elif level == 0:
            self.spans_file = None
        self.step: Any = None
        if spec.get("batch"):
            # every timed call inside one step of N requests (entered here, never left: its own
            # span is not a call and never reaches the file the rounds count)
            requests = [f"00-{i + 1:032x}-{i + 1:016x}-01" for i in range(spec["batch"])]
            self.step = otel_gpu.batch(requests=requests)
            self.step.__enter__()

    def flush(self) -> None:
        from otel_gpu.export import pipeline

        if not self._flush(60.0):
            raise RuntimeError("otel_gpu.flush() did not finish within 60 s")
        pipe = pipeline.current()
        for observer in pipe.observers if pipe is not None else ():
            if not observer.flush(60.0):  # the flight recorder's writer thread
                raise RuntimeError(f"{type(observer).__name__}.flush() did not finish in 60 s")

    def after_round(self) -> None:
        # Count and remove this round's call directories; the recorder keeps its root.
        if not os.path.isdir(self.dump_dir):
            return
        for entry in os.scandir(self.dump_dir):
            if entry.is_dir():
                self.dumped += 1
                shutil.rmtree(entry.path, ignore_errors=True)

    def count(self) -> int | None:
        counted = super().count()
        return None if counted is None else counted - self.controls

    def count_dumps(self) -> int | None:
        return self.dumped if self.spec["level"] >= 10 else None

    def observers(self) -> list[str]:
        from otel_gpu.export import pipeline

        pipe = pipeline.current()
        return [type(o).__name__ for o in pipe.observers] if pipe is not None else []


class Gpt2(Ours):
    """One forward of the tiny GPT2 per call, every module (or those ``include`` selects) wrapped
    by ``instrument_module``."""

    build = staticmethod(tiny_gpt2)

    def __init__(self, spec: dict[str, Any], q: Any, k: Any) -> None:
        self.transformers = import_transformers()
        super().__init__(spec, q, k)  # configures the pipeline at this level, export deferred
        import torch

        import otel_gpu

        self.model, self.ids = self.build(q.device)
        include = spec.get("include") or None
        self.spans_per_call = module_calls(self.model, self.ids, include=include)
        # Level 0: instrument_module wraps nothing and returns 0 (the baseline of these rows);
        # armed level 0 (gpt2arm0): every module gets a trampoline, and no span is made.
        self.instrumented = otel_gpu.instrument_module(self.model, include=include)
        self.identity = self.instrumented == 0
        self.no_grad = torch.no_grad

    def loop(self, n: int) -> None:
        model, ids = self.model, self.ids
        with self.no_grad():
            for _ in range(n):
                model(ids)

    def count_dumps(self) -> int | None:
        return None


class Mixtral(Gpt2):
    """The same rows for a tiny Mixtral: a mixture-of-experts model, its routing in Python."""

    build = staticmethod(tiny_mixtral)


class OtelSdk(Config):
    """A plain SDK span around the call, BatchSpanProcessor → the same JSON Lines exporter."""

    def __init__(self, spec: dict[str, Any], q: Any, k: Any) -> None:
        super().__init__(spec, q, k)
        from opentelemetry.exporter.otlp.json.file import FileSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from otel_gpu.resource import build_resource

        self.spans_file = os.path.join(spec["dir"], "otel.jsonl")
        big = 2**24  # the OTEL_BSP_* knobs set large: export waits for force_flush
        self.provider = TracerProvider(resource=build_resource(), shutdown_on_exit=False)
        self.provider.add_span_processor(
            BatchSpanProcessor(
                FileSpanExporter(self.spans_file),
                max_queue_size=big,
                schedule_delay_millis=_NEVER * 1000,
                max_export_batch_size=big,
            )
        )
        self.tracer = self.provider.get_tracer("bench")

    def loop(self, n: int) -> None:
        fn, q, k, span = self.fn, self.q, self.k, self.tracer.start_as_current_span
        for _ in range(n):
            with span("bench.attention"):
                fn(q, k, scale=SCALE)

    def flush(self) -> None:
        self.provider.force_flush(60_000)


class FlashInfer(Config):
    """``@flashinfer_api`` at FLASHINFER_LOGLEVEL (read at import: set by the parent's env)."""

    def __init__(self, spec: dict[str, Any], q: Any, k: Any) -> None:
        super().__init__(spec, q, k)
        import logging

        mod = sys.modules.get("flashinfer.api_logging")
        if mod is None:
            raise Unavailable(_FLASHINFER_ERROR or "flashinfer is not installed")
        if mod._API_LOG_LEVEL != spec["level"]:
            raise RuntimeError(f"FLASHINFER_LOGLEVEL is {mod._API_LOG_LEVEL}, not {spec['level']}")
        self.fn = mod.flashinfer_api(self.fn)
        self.handlers = logging.getLogger("flashinfer.api").handlers
        self.log_file = mod._API_LOG_DEST

    def flush(self) -> None:
        for handler in self.handlers:
            handler.flush()

    def count(self) -> int | None:
        with open(self.log_file, encoding="utf-8", errors="replace") as f:
            return sum(1 for line in f if "FlashInfer API Call: attention" in line)


class TorchSave(Config):
    """Plain ``torch.save`` of the call's inputs and output, one directory per call."""

    def __init__(self, spec: dict[str, Any], q: Any, k: Any) -> None:
        super().__init__(spec, q, k)
        import torch

        self.save = torch.save
        self.root = os.path.join(spec["dir"], "dumps", "torch_save")
        self.seq = 0

    def loop(self, n: int) -> None:
        save, q, k, join = self.save, self.q, self.k, os.path.join
        out = self.fn(q, k, scale=SCALE)
        for _ in range(n):
            self.seq += 1
            d = join(self.root, f"call_{self.seq:06d}")
            os.makedirs(d)
            save({"q": q, "k": k, "scale": SCALE}, join(d, "inputs.pt"))
            save({"0": out}, join(d, "outputs.pt"))

    def after_round(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _gloo(spec: dict[str, Any], q: Any, k: Any) -> Config:
    from otel_gpu.bench.collectives import Gloo  # imports this module: not at its top

    return Gloo(spec, q, k)


KINDS: dict[str, Callable[[dict[str, Any], Any, Any], Config]] = {
    "bare": Bare,
    "floor": Floor,
    "ours": Ours,
    "gpt2": Gpt2,
    "mixtral": Mixtral,
    "otel": OtelSdk,
    "flashinfer": FlashInfer,
    "save": TorchSave,
    "gloo": _gloo,
}


def count_spans(path: str) -> int:
    """Call spans in an OTLP JSON Lines file (one ExportTraceServiceRequest per line): the
    ``<name> [device]`` children that device time adds on a GPU are not calls, and not counted."""
    if not os.path.exists(path):
        return 0
    total = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            request = json.loads(line)
            for rs in request.get("resourceSpans", ()):
                for ss in rs.get("scopeSpans", ()):
                    for span in ss.get("spans", ()):
                        total += not str(span.get("name", "")).endswith(" [device]")
    return total


# ---------------------------------------------------------------------------- the process


_FLASHINFER_ERROR: str | None = None


def _import_everything() -> None:
    """The same module set in every worker, so heaps (and GC walks) are comparable."""
    global _FLASHINFER_ERROR
    import opentelemetry.exporter.otlp.json.file
    import opentelemetry.sdk.trace  # noqa: F401
    import torch  # noqa: F401

    import otel_gpu
    import otel_gpu.export.pipeline  # noqa: F401

    if importlib.util.find_spec("flashinfer") is None:
        _FLASHINFER_ERROR = "flashinfer is not installed (pip install flashinfer-python)"
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("flashinfer.api_logging")
    except Exception as exc:
        _FLASHINFER_ERROR = f"import flashinfer failed: {type(exc).__name__}: {exc}"


def _host_syncs(cfg: Config, n: int) -> dict[str, float]:
    """Host syncs per call on CUDA: torch's sync debug mode warnings, and our own read counter."""
    import torch

    from otel_gpu.devices import cuda as _cuda

    reads0 = _cuda.host_reads
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            cfg.loop(n)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    cfg.calls += n
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    return {"torch_syncs": syncs / n, "host_reads": (_cuda.host_reads - reads0) / n}


def _retained(cfg: Config, n: int) -> dict[str, float]:
    """GC-tracked objects a queued call keeps alive, and what they cost the collector.

    Records wait up to 100 ms for the export thread, long enough to be promoted to the
    oldest generation; CPython runs a full collection once promotions reach a quarter of
    that generation, so each retained object costs ~4x the full-collection time per
    object, amortised. Medians of short rounds rarely contain a full collection, so this
    figure is reported separately.
    """
    import gc

    cfg.flush()
    cfg.after_round()
    gc.collect()
    heap = len(gc.get_objects())
    t0 = time.perf_counter_ns()
    gc.collect()
    full_ns = time.perf_counter_ns() - t0
    before = len(gc.get_objects())
    cfg.loop(n)  # export deferred: the records stay queued
    gc.collect(1)  # untrack what can be untracked (atomic tuples and dicts), as the collector would
    retained = (len(gc.get_objects()) - before) / n
    cfg.calls += n
    cfg.flush()
    cfg.after_round()
    per_object_ns = full_ns / max(heap, 1)
    return {
        "retained_per_call": retained,
        "heap_objects": heap,
        "full_gc_ms": full_ns / 1e6,
        "gc_amortised_us": max(retained, 0.0) * 4 * per_object_ns / 1e3,
    }


class _GcClock:
    """Time the garbage collector spends, from ``gc.callbacks``: every collection of every
    generation, on whichever thread, while this worker measures. A round's time includes its
    collections; the model rows count them per forward (report.py), not beside the medians."""

    def __init__(self) -> None:
        self.ns = 0  # every collection
        self.full_ns = 0  # collections of the oldest generation
        self.full = 0
        self._started = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
        elif self._started:
            took = time.perf_counter_ns() - self._started
            self.ns += took
            self._started = 0
            if info.get("generation") == 2:
                self.full += 1
                self.full_ns += took


_GC = _GcClock()


def _timed_round(cfg: Config, n: int, device: str) -> dict[str, int]:
    sync: Callable[[], None] = lambda: None  # noqa: E731
    if device == "cuda":
        import torch

        sync = torch.cuda.synchronize
    perf = time.perf_counter_ns
    sync()
    gc_ns, gc_full, gc_full_ns = _GC.ns, _GC.full, _GC.full_ns
    t0 = perf()
    cfg.loop(n)
    sync()
    t1 = perf()
    cfg.flush()
    sync()
    t2 = perf()
    gc_ns, gc_full, gc_full_ns = _GC.ns - gc_ns, _GC.full - gc_full, _GC.full_ns - gc_full_ns
    cfg.calls += n
    cfg.after_round()
    return {
        "n": n,
        "caller_ns": t1 - t0,
        "total_ns": t2 - t0,
        "gc_ns": gc_ns,
        "gc_full": gc_full,
        "gc_full_ns": gc_full_ns,
    }


def _calibrate(cfg: Config, target_s: float, device: str, max_n: int) -> int:
    """Loop length whose total (loop + flush) takes about ``target_s``.

    The flush has a fixed cost (one export, one write), so the per-call cost is taken
    from the difference between the last two trial rounds, not from one round alone.
    """
    n, prev = 1, None
    while True:
        elapsed = _timed_round(cfg, n, device)["total_ns"] / 1e9
        if (elapsed >= target_s / 4 and prev is not None) or n >= max_n:
            break
        prev = (n, elapsed)
        n = min(max_n, n * 4)
    if elapsed / n * max_n <= target_s:
        # Even at this round's cost per call (its fixed cost included) the longest round allowed
        # fits the target: take it. Estimating from the last two trial rounds gave a model's
        # level-0 row 13 forwards a round (one slow trial), against the 33 of the rows compared
        # with it.
        return max_n
    per_call = elapsed / n
    if prev is not None and elapsed > prev[1]:
        per_call = (elapsed - prev[1]) / (n - prev[0])
    fixed = max(elapsed - per_call * n, 0.0)
    return max(1, min(max_n, round((target_s - fixed) / per_call)))


def _info(cfg: Config) -> dict[str, Any]:
    import opentelemetry.sdk.version
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "opentelemetry_sdk": opentelemetry.sdk.version.__version__,
        "flashinfer": None,
        "identity": cfg.identity,
        "torch_threads": torch.get_num_threads(),
    }
    fi = sys.modules.get("flashinfer")
    if fi is not None:
        info["flashinfer"] = getattr(fi, "__version__", "?")
    if isinstance(cfg, Ours):
        from otel_gpu import config

        settings = config.current()
        info["observers"] = cfg.observers()
        if settings.level >= 10:
            info["dump_durability"] = settings.dump_durability
        if settings.ring:
            info["ring"] = settings.ring
        info["metrics"] = settings.metrics
        info["fingerprint"] = settings.fingerprint
    if isinstance(cfg, Gpt2):
        info["transformers"] = cfg.transformers.__version__
        info["spans_per_call"] = cfg.spans_per_call
        info["modules_instrumented"] = cfg.instrumented
    return info


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries' prints go to stderr, never into the protocol
    sys.stdout = sys.stderr

    def reply(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        _import_everything()
        import torch

        device = spec.get("device", "cpu")
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(SHAPE, generator=gen).to(device)
        k = torch.randn(SHAPE, generator=gen).to(device)
        cfg = KINDS[spec["kind"]](spec, q, k)
        cfg.loop(1)  # warm-up: first-call set-up (pipeline, exporter, file) is not measured
        cfg.calls += 1
        cfg.flush()
        cfg.after_round()
    except Unavailable as exc:
        reply({"unavailable": str(exc)})
        return 0
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    import gc

    gc.callbacks.append(_GC)  # after the warm-up: only the measured rounds' collections count
    reply({"ready": True, "info": _info(cfg)})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["cmd"]
            if op == "calibrate":
                # twice, the longer: a worker's first trial rounds are sometimes several times
                # slower than the rest (a model's level-0 row got 12-15 forwards a round, not 33)
                n = max(_calibrate(cfg, cmd["target_s"], device, cmd["max_n"]) for _ in range(2))
                reply({"n": n})
            elif op == "run":
                reply(_timed_round(cfg, cmd["n"], device))
            elif op == "retained":
                reply(_retained(cfg, cmd["n"]))
            elif op == "syncs":
                reply(_host_syncs(cfg, cmd["n"]) if device == "cuda" else {})
            elif op == "finish":
                cfg.flush()
                cfg.after_round()
                dumps = cfg.count_dumps() if isinstance(cfg, Ours) else None
                reply({"calls": cfg.calls, "spans": cfg.count(), "dumps": dumps})
            elif op == "exit":
                reply({"bye": True})
                return 0
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
