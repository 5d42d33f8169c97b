"""``otel-gpu bench`` and the pytest-benchmark suite.

The ``test_benchmark_*`` functions are pytest-benchmark benchmarks of one call per
configuration. CI runs them with ``--benchmark-disable`` (each benchmarked function
runs once, for correctness); nothing here asserts a time. Figures come from
``otel-gpu bench`` (see docs/performance.md).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable

import pytest
import torch

import otel_gpu
from otel_gpu import bench, cli
from otel_gpu.bench import report as _report
from otel_gpu.bench import worker
from otel_gpu.export import pipeline

SHAPE = worker.SHAPE

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)


@pytest.fixture
def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)


@pytest.fixture
def deferred_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a worker configuration patch the export thread's wake-ups; restored after the test."""
    monkeypatch.setattr(pipeline, "_WAKE_EVERY", pipeline._WAKE_EVERY)
    monkeypatch.setattr(pipeline, "_WAKE_AT", pipeline._WAKE_AT)


def _counted() -> tuple[list[int], Callable[..., torch.Tensor]]:
    calls = [0]

    def attention(q: torch.Tensor, k: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        calls[0] += 1
        return q

    return calls, attention


# ---------------------------------------------------------------------------- benchmarks


def test_benchmark_bare_call(benchmark, tensors) -> None:
    """Benchmark: the undecorated function, the zero of every other row."""
    q, k = tensors
    calls, fn = _counted()
    assert benchmark(fn, q, k, scale=0.5) is q
    assert calls[0] >= 1


def test_benchmark_torch_sum_floor(benchmark, tensors) -> None:
    """Benchmark: one torch.sum per tensor of the call, the bandwidth floor of level 5."""
    q, k = tensors

    def floor() -> None:
        q.sum()
        k.sum()
        q.sum()

    benchmark(floor)


@pytest.mark.parametrize("level", [1, 3, 5])
def test_benchmark_decorated_call(benchmark, tensors, tmp_path, level: int) -> None:
    """Benchmark: one decorated call per level; every benchmarked call becomes one span on disk."""
    q, k = tensors
    path = str(tmp_path / "spans.jsonl")
    otel_gpu.configure(level=level, dest=path, provider="own")
    calls, fn = _counted()
    wrapped = otel_gpu.api(fn)
    assert benchmark(wrapped, q, k, scale=0.5) is q
    assert otel_gpu.flush(30.0)
    assert worker.count_spans(path) == calls[0]


def test_benchmark_level_0_is_identity(benchmark, tensors) -> None:
    """Benchmark: level 0 returns the function itself, so its cost is the bare call's."""
    q, k = tensors
    otel_gpu.configure(level=0)
    _calls, fn = _counted()
    wrapped = otel_gpu.api(fn)
    assert wrapped is fn
    benchmark(wrapped, q, k, scale=0.5)


def test_benchmark_otel_sdk_span(benchmark, tensors, tmp_path) -> None:
    """Benchmark: a plain SDK span around the call, exported by the same JSON Lines exporter."""
    from opentelemetry.exporter.otlp.json.file import FileSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    q, k = tensors
    path = str(tmp_path / "otel.jsonl")
    provider = TracerProvider(shutdown_on_exit=False)
    # a queue that holds every span of the run, as in otel-gpu bench: the SDK's default 2048
    # drops spans when its export thread falls behind on a loaded machine, and the count below
    # would then fail for the baseline, not for otel-gpu
    provider.add_span_processor(BatchSpanProcessor(FileSpanExporter(path), max_queue_size=2**24))
    tracer = provider.get_tracer("bench")
    calls, fn = _counted()

    def call() -> None:
        with tracer.start_as_current_span("bench.attention"):
            fn(q, k, scale=0.5)

    benchmark(call)
    provider.force_flush()
    assert worker.count_spans(path) == calls[0]
    provider.shutdown()


@pytest.mark.transformers
@needs_transformers
@pytest.mark.parametrize("level", [0, 1, 3])
def test_benchmark_gpt2_forward(benchmark, tmp_path, level: int) -> None:
    """Benchmark: one tiny-GPT2 forward with every module instrumented; every submodule call it
    makes becomes one span on disk (none at level 0, where nothing is wrapped)."""
    path = str(tmp_path / "spans.jsonl")
    otel_gpu.configure(level=level, dest=path, provider="own")
    model, ids = worker.tiny_gpt2()
    per_forward = worker.module_calls(model, ids)
    wrapped = otel_gpu.instrument_module(model)
    assert (wrapped == 0) == (level == 0)
    forwards = [0]

    def forward() -> None:
        forwards[0] += 1
        with torch.no_grad():
            model(ids)

    benchmark(forward)
    assert otel_gpu.flush(30.0)
    expected = 0 if level == 0 else per_forward * forwards[0]
    assert worker.count_spans(path) == expected


# ---------------------------------------------------------------------------- worker configurations


def test_worker_round_defers_export_then_writes_every_span(tensors, tmp_path, deferred_export):
    """A timed round's loop leaves export to the flush, and the flush puts every call's span on disk."""
    q, k = tensors
    cfg = worker.Ours({"level": 1, "dir": str(tmp_path)}, q, k)
    sample = worker._timed_round(cfg, 7, "cpu")
    assert sample["n"] == 7
    assert 0 < sample["caller_ns"] <= sample["total_ns"]
    assert cfg.count() == 7 == cfg.calls


def test_worker_level_0_is_the_function_itself(tensors, tmp_path, deferred_export):
    """At level 0 the worker reports the decorator returned the function itself and writes no spans."""
    q, k = tensors
    cfg = worker.Ours({"level": 0, "dir": str(tmp_path)}, q, k)
    assert cfg.identity
    assert cfg.count() is None


def _without_module(monkeypatch, missing: str) -> None:
    """The worker finds no module ``missing``, as in a build or environment without it."""
    real = worker.importlib.util.find_spec
    monkeypatch.setattr(
        worker.importlib.util,
        "find_spec",
        lambda name, *a: None if name == missing else real(name, *a),
    )


def test_worker_level_10_unavailable_without_flight_recorder(
    tensors, tmp_path, deferred_export, monkeypatch
):
    """Level 10 is reported unavailable, not failed, when otel_gpu.recorder is not part of the build."""
    _without_module(monkeypatch, "otel_gpu.recorder.recorder")
    q, k = tensors
    with pytest.raises(worker.Unavailable, match=r"otel_gpu\.recorder\.recorder"):
        worker.Ours({"level": 10, "dir": str(tmp_path)}, q, k)


@pytest.mark.transformers
@needs_transformers
@pytest.mark.parametrize("level", [0, 1, 3])
def test_worker_gpt2_round_writes_a_span_per_submodule_call(
    tensors, tmp_path, deferred_export, level: int
):
    """The gpt2 worker runs whole forwards; at level 1/3 every submodule call of every forward
    reaches the file (about 30 per forward), at level 0 nothing is wrapped and nothing is written."""
    q, k = tensors
    cfg = worker.Gpt2({"level": level, "dir": str(tmp_path)}, q, k)
    assert cfg.spans_per_call >= 30  # root, transformer, embeddings, 2 blocks of ~13, ln_f, head
    assert cfg.identity == (level == 0)
    sample = worker._timed_round(cfg, 3, "cpu")
    assert sample["n"] == 3 and 0 < sample["caller_ns"] <= sample["total_ns"]
    if level == 0:
        assert cfg.count() is None and cfg.instrumented == 0
    else:
        assert cfg.instrumented > 0
        assert cfg.count() == 3 * cfg.spans_per_call


@pytest.mark.transformers
@needs_transformers
def test_worker_gpt2_attention_only_writes_a_span_per_attention_call(
    tensors, tmp_path, deferred_export
):
    """The gpt2att rows wrap only the modules include=["*Attention"] selects (the 2 attention
    layers), and every forward writes exactly one span per attention call."""
    q, k = tensors
    spec = {"level": 1, "dir": str(tmp_path), "include": ["*Attention"]}
    cfg = worker.Gpt2(spec, q, k)
    assert cfg.spans_per_call == 2 == cfg.instrumented
    worker._timed_round(cfg, 3, "cpu")
    assert cfg.count() == 6


@pytest.mark.transformers
@needs_transformers
def test_worker_gpt2_armed_level_0_wraps_every_module_and_writes_nothing(
    tensors, tmp_path, deferred_export
):
    """The gpt2arm0 row (OTEL_GPU_CONTROL=on, level 0) puts a trampoline on every module, which
    the plain level-0 row does not, and its forwards record no span: it measures the cost of
    being controllable, not of recording."""
    from otel_gpu.control import state

    q, k = tensors
    cfg = worker.Gpt2({"level": 0, "control": True, "dir": str(tmp_path)}, q, k)
    try:
        assert cfg.instrumented >= 30 and not cfg.identity
        sample = worker._timed_round(cfg, 3, "cpu")
        assert sample["n"] == 3
        assert cfg.count() is None
    finally:
        state.reset("test teardown")


@pytest.mark.transformers
@needs_transformers
@pytest.mark.parametrize("level", [0, 1])
def test_worker_mixtral_round_writes_a_span_per_submodule_call(
    tensors, tmp_path, deferred_export, level: int
):
    """The mixtral rows run whole forwards of the tiny Mixtral; at level 1 every submodule call
    (experts included, as many as the router picks) reaches the file, at level 0 nothing."""
    q, k = tensors
    cfg = worker.Mixtral({"level": level, "dir": str(tmp_path)}, q, k)
    assert type(cfg.model).__name__ == "MixtralForCausalLM"
    assert cfg.spans_per_call >= 20
    assert cfg.identity == (level == 0)
    worker._timed_round(cfg, 2, "cpu")
    if level == 0:
        assert cfg.count() is None
    else:
        assert cfg.count() == 2 * cfg.spans_per_call


def test_mixtral_rows_have_budgets_beside_gpt2():
    """The bench reports the model budgets for Mixtral as for GPT2 (Performance III): level 1
    ≤ 1.2×, level 3 ≤ 1.6× of the forward at level 0, on the total with the collector counted."""
    budgets = {(b.ours, b.other): (b.limit, b.cost) for b in _report.BUDGETS}
    assert budgets[("mixtral_1", "mixtral_0")] == (1.2, "total_gc")
    assert budgets[("mixtral_3", "mixtral_0")] == (1.6, "total_gc")
    assert budgets[("gpt2_1", "gpt2_0")] == (1.2, "total_gc")
    assert budgets[("gpt2_3", "gpt2_0")] == (1.6, "total_gc")


def test_worker_ring_row_runs_level_5_with_the_ring_and_writes_every_span(
    tensors, tmp_path, deferred_export
):
    """The ours5ring worker configures the ring (ring=8) at level 5: the Ring observer runs on
    every call, no dump is written, and every call's span reaches the file."""
    q, k = tensors
    cfg = worker.Ours({"level": 5, "dir": str(tmp_path), "ring": 8}, q, k)
    worker._timed_round(cfg, 10, "cpu")
    assert "Ring" in cfg.observers()  # the pipeline starts with the first call
    assert cfg.count() == 10 == cfg.calls
    assert cfg.count_dumps() is None


def test_worker_armed_rows_are_a_trampoline_and_a_switched_level_1(
    tensors, tmp_path, deferred_export
):
    """armed0 is an armed function (not the function itself) that records nothing; armed1 is
    the same switched to level 1 by live control: every call's span reaches the file, and the
    control span is not counted as a call."""
    from otel_gpu.control import state

    q, k = tensors
    try:
        armed0 = worker.Ours({"level": 0, "dir": str(tmp_path), "control": True}, q, k)
        assert not armed0.identity and armed0.count() is None
        worker._timed_round(armed0, 10, "cpu")
        armed1 = worker.Ours({"level": 0, "dir": str(tmp_path), "control": True, "switch": 1}, q, k)
        worker._timed_round(armed1, 10, "cpu")
        assert armed1.count() == 10 == armed1.calls
    finally:
        state.reset("test teardown")


@pytest.mark.parametrize("on", [True, False])
def test_worker_fingerprint_rows_differ_only_by_the_fingerprint(
    tensors, tmp_path, deferred_export, on
):
    """ours5fp and ours5 are level 5 with and without fingerprints: every span reaches the
    file, and its statistics events carry a fingerprint exactly when the row asks for one."""
    q, k = tensors
    cfg = worker.Ours({"level": 5, "dir": str(tmp_path), "fingerprint": on}, q, k)
    worker._timed_round(cfg, 4, "cpu")
    assert worker._info(cfg)["fingerprint"] is on
    assert cfg.count() == 4 == cfg.calls
    with open(cfg.spans_file, encoding="utf-8") as f:
        text = f.read()
    assert ('"fingerprint"' in text) is on


def test_fingerprint_cost_is_level_5_with_fingerprints_minus_level_5():
    """The fingerprint's cost per call is ours5fp − ours5, with the ratio of the two; absent
    when the row with fingerprints did not run."""
    configs = _configs()
    assert _report.fingerprint_cost(configs) is None
    configs["ours5fp"] = _row(300.0, 500.0)
    fp = _report.fingerprint_cost(configs)
    assert fp is not None and fp["caller_us"] == 50.0 and fp["total_us"] == 100.0
    assert math.isclose(fp["total_ratio"], 500.0 / 400.0)
    report = _report.build({}, device="cpu", rounds=1, target_s=0.1)
    report["fingerprint_cost"] = fp
    assert "fingerprints at level 5 (ours5fp − ours5): 50 µs" in _report.render(report)


def test_worker_gpt2_unavailable_without_transformers(tensors, tmp_path, monkeypatch):
    """Without transformers the gpt2 rows are unavailable, with the reason, as FlashInfer's are."""
    _without_module(monkeypatch, "transformers")
    q, k = tensors
    with pytest.raises(worker.Unavailable, match="transformers is not installed"):
        worker.Gpt2({"level": 1, "dir": str(tmp_path)}, q, k)


def test_worker_flashinfer_unavailable_names_the_reason(tensors, monkeypatch):
    """Without an importable flashinfer the FlashInfer rows are unavailable, with the import error."""
    monkeypatch.delitem(sys.modules, "flashinfer.api_logging", raising=False)
    monkeypatch.setattr(worker, "_FLASHINFER_ERROR", "import flashinfer failed: boom")
    q, k = tensors
    with pytest.raises(worker.Unavailable, match="boom"):
        worker.FlashInfer({"level": 1, "dir": "."}, q, k)


def test_worker_floor_sums_each_tensor_of_the_call(tensors, monkeypatch):
    """The floor is one torch.sum per tensor of the call: two inputs and the output."""
    q, k = tensors
    cfg = worker.Floor({}, q, k)
    seen: list[int] = []
    real_sum = torch.Tensor.sum
    monkeypatch.setattr(
        torch.Tensor, "sum", lambda self, *a, **kw: seen.append(1) or real_sum(self)
    )
    cfg.loop(2)
    assert len(seen) == 6


def test_count_spans_reads_every_line(tmp_path):
    """count_spans adds up spans over every ExportTraceServiceRequest line of a JSON Lines file."""
    path = tmp_path / "x.jsonl"
    line = {"resourceSpans": [{"scopeSpans": [{"spans": [{}, {}]}, {"spans": [{}]}]}]}
    path.write_text(json.dumps(line) + "\n\n" + json.dumps(line) + "\n")
    assert worker.count_spans(str(path)) == 6
    assert worker.count_spans(str(tmp_path / "missing.jsonl")) == 0


# ---------------------------------------------------------------------------- report and budgets


def _row(caller: float | None, total: float | None = None, **extra) -> dict:
    if caller is None:
        return {"status": "unavailable", "reason": "not installed", **extra}
    return {
        "status": "ready",
        "caller_us": caller,
        "total_us": caller if total is None else total,
        **extra,
    }


def _configs() -> dict[str, dict]:
    return {
        "bare": _row(0.1),
        "floor": _row(100.0),
        "ours0": _row(0.1, identity=True),
        "ours1": _row(5.0, 15.0),
        "ours3": _row(30.0, 120.0),
        "ours5": _row(250.0, 400.0),
        "ours10": _row(300.0, 1400.0),
        "fi1": _row(20.0),
        "fi3": _row(90.0),
        "fi5": _row(7000.0),
        "save": _row(2000.0),
        "gpt2_0": _row(1000.0, 1010.0, identity=True, gc_us=10.0, total_gc_us=1010.0),
        "gpt2_1": _row(1100.0, 1500.0, gc_us=50.0, total_gc_us=1530.0, gc_full_collections=2),
        "gpt2_3": _row(1500.0, 1900.0, gc_us=80.0, total_gc_us=1600.0, gc_full_collections=3),
    }


def test_budgets_compare_the_issue_ratios():
    """Each budget is ours÷peer on the cost it names, marked met at or under its limit."""
    budgets = {b["name"]: b for b in _report.evaluate(_configs(), "cpu")}
    l1_caller = budgets["level 1 caller-visible ≤ 0.5× FlashInfer level 1"]
    assert l1_caller["status"] == "met" and math.isclose(l1_caller["value"], 0.25)
    assert budgets["level 1 total ≤ 1.0× FlashInfer level 1"]["status"] == "met"
    l3_caller = budgets["level 3 caller-visible ≤ 0.25× FlashInfer level 3"]
    assert l3_caller["status"] == "missed" and math.isclose(l3_caller["value"], 30 / 90)
    assert budgets["level 3 total ≤ 1.0× FlashInfer level 3"]["status"] == "missed"
    assert budgets["level 5 ≤ 3× the torch.sum floor (caller-visible)"]["value"] == 2.5
    assert budgets["level 0 is the function itself (zero cost)"]["status"] == "met"


def test_budget_level_10_uses_the_recorders_marginal_cost():
    """Dump throughput compares torch.save with level 10's cost above level 5 (the recorder's own)."""
    budgets = {b["name"]: b for b in _report.evaluate(_configs(), "cpu")}
    dump = budgets["level 10 recorder throughput ≥ 0.7× torch.save"]
    assert math.isclose(dump["value"], 2000.0 / (1400.0 - 400.0))
    assert dump["status"] == "met"


L1 = "tiny GPT2 forward, level 1 ≤ 1.2× level 0 (total with GC: every span on disk)"
L3 = "tiny GPT2 forward, level 3 ≤ 1.6× level 0 (total with GC: every span on disk)"


def test_gpt2_budgets_take_total_and_report_caller_visible_beside():
    """The GPT2 budgets compare a forward with level 0's on the total with the collector
    counted (every span on disk), the stricter reading; the collector's share, the median total
    without it and the caller-visible ratio are reported in the detail."""
    budgets = {b["name"]: b for b in _report.evaluate(_configs(), "cpu")}
    l1 = budgets[L1]
    assert l1["status"] == "missed" and math.isclose(l1["value"], 1530.0 / 1010.0)
    assert "caller-visible 1.10×" in l1["detail"]
    assert (
        "the collector 50 µs vs 10 µs a forward (full collections amortised; 2 full" in l1["detail"]
    )
    assert "median total without it 1.49×" in l1["detail"]
    l3 = budgets[L3]
    assert l3["status"] == "met" and math.isclose(l3["value"], 1600.0 / 1010.0)
    assert "caller-visible 1.50×" in l3["detail"]


def test_budgets_report_the_per_round_ratio_beside_the_ratio_of_medians():
    """Beside the ratio of medians, a budget shows the median of same-round ratios, which
    cancels load drift between rounds; it is left out when the rows' rounds do not pair up."""
    configs = _configs()
    configs["gpt2_0"]["total_gc_samples_us"] = [1000.0, 3000.0, 1000.0]
    configs["gpt2_1"]["total_gc_samples_us"] = [1400.0, 1500.0, 1400.0]  # rounds 1, 3 pair: 1.4×
    budgets = {b["name"]: b for b in _report.evaluate(configs, "cpu")}
    assert "(per-round ratio 1.40×)" in budgets[L1]["detail"]
    configs["gpt2_1"]["total_gc_samples_us"] = [1400.0, 1500.0]
    budgets = {b["name"]: b for b in _report.evaluate(configs, "cpu")}
    assert "per-round ratio" not in budgets[L1]["detail"].split("; caller-visible")[0]


def test_ring_cost_is_level_5_with_the_ring_minus_level_5_against_the_recorder():
    """The ring's cost per call is ours5ring − ours5, compared with level 10's recorder cost
    (ours10 − ours5) on the same cost; absent when the ring row did not run."""
    configs = _configs()
    assert _report.ring_cost(configs) is None
    configs["ours5ring"] = _row(290.0, 500.0, ring=8)
    ring = _report.ring_cost(configs)
    assert ring is not None and ring["ring"] == 8
    assert ring["ring_caller_us"] == 40.0 and ring["ring_total_us"] == 100.0
    assert ring["recorder_total_us"] == 1000.0
    assert math.isclose(ring["ring_vs_recorder_total"], 0.1)
    assert math.isclose(ring["ring_vs_recorder_caller"], 40.0 / 50.0)


def test_budget_level_10_names_the_durability_mode():
    """The recorder throughput budget says which OTEL_GPU_DUMP_DURABILITY the level-10 row ran."""
    configs = _configs()
    configs["ours10"]["dump_durability"] = "async"
    budgets = {b["name"]: b for b in _report.evaluate(configs, "cpu")}
    assert (
        "OTEL_GPU_DUMP_DURABILITY=async"
        in (budgets["level 10 recorder throughput ≥ 0.7× torch.save"]["detail"])
    )


def test_budgets_not_applicable_when_a_row_is_missing_or_not_cuda():
    """A budget whose rows did not run is n/a with the reason; the sync budget is CUDA-only."""
    configs = _configs()
    configs["fi3"] = _row(None)
    budgets = {b["name"]: b for b in _report.evaluate(configs, "cpu")}
    l3 = budgets["level 3 total ≤ 1.0× FlashInfer level 3"]
    assert l3["status"] == "n/a" and "not installed" in l3["detail"]
    assert budgets["level 5 on CUDA: ≤ 1 host sync per call"]["status"] == "n/a"


def test_budget_host_syncs_on_cuda_counts_the_worst_counter():
    """On CUDA the level-5 sync budget takes the larger of torch's sync count and our read count."""
    configs = _configs()
    configs["ours5"]["host_syncs_per_call"] = {"torch_syncs": 2.0, "host_reads": 1.0}
    budgets = {b["name"]: b for b in _report.evaluate(configs, "cuda")}
    sync = budgets["level 5 on CUDA: ≤ 1 host sync per call"]
    assert sync["status"] == "missed" and sync["value"] == 2.0


def _result(name: str, caller: list[float], total: list[float], **kw) -> bench.Result:
    r = bench.Result(bench._BY_NAME[name], status="ready", n=10, caller=caller, total=total)
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def test_report_takes_medians_and_flags_lost_spans():
    """The report uses per-round medians, and a span count short of the call count is a problem."""
    results = {
        "fi1": _result("fi1", [20e3, 30e3, 25e3], [20e3, 30e3, 25e3], calls=5, spans=5),
        "ours1": _result("ours1", [5e3, 4e3, 6e3], [15e3, 99e3, 14e3], calls=9, spans=8),
    }
    report = _report.build(results, device="cpu", rounds=3, target_s=0.01)
    ours = report["configs"]["ours1"]
    assert ours["caller_us"] == 5.0 and ours["total_us"] == 15.0
    assert math.isclose(ours["caller_vs_peer"], 0.2)
    assert not report["ok"]
    assert report["problems"] == ["ours1: 9 calls but 8 records in the file"]


def test_report_checks_gpt2_spans_per_forward_exactly():
    """A gpt2 row must write exactly spans-per-forward × forwards spans; one short is a problem."""
    info = {"spans_per_call": 31, "modules_instrumented": 33}
    ok = _result("gpt2_1", [1e6], [2e6], calls=4, spans=124, info=info)
    short = _result("gpt2_3", [1e6], [2e6], calls=4, spans=123, info=info)
    base = _result("gpt2_0", [1e6], [1e6], calls=4, spans=None, info={"spans_per_call": 31})
    report = _report.build(
        {"gpt2_0": base, "gpt2_1": ok, "gpt2_3": short}, device="cpu", rounds=1, target_s=0.01
    )
    assert report["problems"] == [
        "gpt2_3: 4 calls but 123 records in the file, expected 124 (31 per call)"
    ]
    assert report["configs"]["gpt2_1"]["peer"] == "gpt2_0"
    assert math.isclose(report["configs"]["gpt2_1"]["total_vs_peer"], 2.0)
    text = _report.render(report)
    assert "gpt2_1 31/33" in text and "gpt2_0" in text


def test_render_shows_every_row_and_budget():
    """The text report has a row per configuration (unavailable ones with their reason) and every budget."""
    results = {
        "fi1": _result("fi1", [20e3], [20e3], calls=1, spans=1),
        "ours1": _result("ours1", [5e3], [15e3], calls=1, spans=1),
        "fi3": bench.Result(bench._BY_NAME["fi3"], status="unavailable", reason="no flashinfer"),
    }
    text = _report.render(_report.build(results, device="cpu", rounds=1, target_s=0.01))
    assert "otel-gpu level 1" in text and "0.25×" in text
    assert "FlashInfer level 3" in text and "no flashinfer" in text
    for budget in _report.BUDGETS:
        assert budget.name in text
    assert "[MET   ] level 1 caller-visible" in text


# ---------------------------------------------------------------------------- the command


def test_cli_rejects_unknown_configuration(capsys):
    """`otel-gpu bench --only` with an unknown name exits 2 and lists the known ones."""
    assert cli.main(["bench", "--only", "ours1,nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "ours1" in err


@pytest.mark.slow
def test_cli_quick_json_end_to_end(capsys, tmp_path):
    """`otel-gpu bench --quick --json` runs real worker processes and reports every span written."""
    code = cli.main(
        [
            "bench",
            "--quick",
            "--json",
            "--rounds",
            "2",
            "--only",
            "bare,ours0,ours1,fi1,gpt2_0,gpt2_1,gpt2att_1",
            "--dir",
            str(tmp_path),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["problems"]
    configs = report["configs"]
    assert set(configs) == {"bare", "ours0", "ours1", "fi1", "gpt2_0", "gpt2_1", "gpt2att_1"}
    assert configs["ours0"]["identity"] is True
    ours1 = configs["ours1"]
    assert ours1["status"] == "ready" and len(ours1["caller_samples_us"]) == 2
    assert ours1["spans_written"] == ours1["calls"] > 0
    assert configs["fi1"]["status"] in ("ready", "unavailable")
    # unavailable (with the reason) without transformers; gpt2att_1: the 2 attention modules
    for name, per_forward in (
        ("gpt2_0", range(30, 99)),
        ("gpt2_1", range(30, 99)),
        ("gpt2att_1", [2]),
    ):
        row = configs[name]
        assert row["status"] in ("ready", "unavailable"), row["reason"]
        if row["status"] == "ready":
            assert row["calls"] > 0 and row["spans_per_call"] in per_forward
            expected = None if name == "gpt2_0" else row["calls"] * row["spans_per_call"]
            assert row["spans_written"] == expected
    assert report["machine"]["cores"] == os.cpu_count()


@pytest.mark.slow
def test_a_failing_worker_is_reported_not_fatal(monkeypatch, tmp_path):
    """A worker that cannot start is reported as an error row, and the report is marked not ok."""
    broken = bench.ConfigSpec("broken", "a broken configuration", "no-such-kind")
    monkeypatch.setitem(bench._BY_NAME, "broken", broken)
    report = bench.run(
        rounds=1, target_s=0.005, only=["broken"], device="cpu", workdir=str(tmp_path)
    )
    row = report["configs"]["broken"]
    assert row["status"] == "error" and "no-such-kind" in row["reason"]
    assert not report["ok"] and report["problems"]


def test_metrics_budget_is_the_caller_visible_difference_with_the_total_beside():
    """The metrics budget compares level 1 with OTEL_GPU_METRICS on against level 1 as a
    difference in µs per call (≤ 1 µs caller-visible), and shows the total difference beside it;
    the rendered line carries µs, not a ratio."""
    configs = _configs()
    configs["ours1m"] = _row(5.6, 17.0)
    configs["ours1m"]["caller_samples_us"] = [5.5, 6.9, 5.4]
    configs["ours1"]["caller_samples_us"] = [5.0, 5.0, 5.0]
    budgets = {b["name"]: b for b in _report.evaluate(configs, "cpu")}
    entry = budgets["metrics cost ≤ 1 µs caller-visible per call over level 1"]
    assert entry["status"] == "met" and math.isclose(entry["value"], 0.6)
    assert "(per-round difference 0.50 µs)" in entry["detail"]
    assert "total (every span on disk) +2.00 µs per call" in entry["detail"]
    configs["ours1m"] = _row(6.2, 15.0)
    budgets = {b["name"]: b for b in _report.evaluate(configs, "cpu")}
    entry = budgets["metrics cost ≤ 1 µs caller-visible per call over level 1"]
    assert entry["status"] == "missed" and math.isclose(entry["value"], 1.2)
    del configs["ours1m"]
    budgets = {b["name"]: b for b in _report.evaluate(configs, "cpu")}
    assert budgets["metrics cost ≤ 1 µs caller-visible per call over level 1"]["status"] == "n/a"


def test_metrics_on_by_default_budget_is_the_total_difference():
    """What lets metrics be on by default: level 1 with them costs at most 2 µs more a call in
    total than without, judged in µs with the per-round difference and the caller-visible one
    beside it."""
    configs = _configs()
    configs["ours1"] = _row(5.0, 9.0)
    configs["ours1m"] = _row(5.1, 10.5)
    configs["ours1m"]["total_samples_us"] = [10.4, 10.6, 10.5]
    configs["ours1"]["total_samples_us"] = [9.0, 9.0, 9.0]
    name = "metrics cost ≤ 2 µs per call over level 1 in total (every span on disk)"
    entry = {b["name"]: b for b in _report.evaluate(configs, "cpu")}[name]
    assert entry["status"] == "met" and entry["unit"] == "µs"
    assert "(per-round difference 1.50 µs)" in entry["detail"]
    assert "caller-visible +0.10 µs per call" in entry["detail"]
    configs["ours1m"] = _row(5.1, 19.0)
    entry = {b["name"]: b for b in _report.evaluate(configs, "cpu")}[name]
    assert entry["status"] == "missed"


def test_metrics_budget_renders_in_microseconds():
    """In the text report the metrics budget reads "<value> µs (limit 1.0 µs)"."""
    from otel_gpu.bench import Result

    results = {}
    for name, caller, total in (("ours1", 5.0, 9.0), ("ours1m", 5.4, 9.5)):
        r = Result(bench._BY_NAME[name], status="ready", n=10)
        r.caller, r.total = [caller * 1e3], [total * 1e3]
        r.calls, r.spans = 10, 10
        results[name] = r
    text = _report.render(_report.build(results, device="cpu", rounds=1, target_s=0.2))
    line = next(x for x in text.splitlines() if "metrics cost" in x)
    assert "[MET   ]" in line and "0.400 µs (limit 1.0 µs)" in line
    assert "otel-gpu level 1, metrics on" in text


def test_worker_metrics_row_configures_level_1_with_metrics_on(tensors, tmp_path, deferred_export):
    """The ours1m worker is level 1 with the metrics setting on (other rows leave it off, whatever
    the environment says), and every call's span still reaches the file."""
    q, k = tensors
    cfg = worker.Ours({"level": 1, "dir": str(tmp_path), "metrics": True}, q, k)
    worker._timed_round(cfg, 5, "cpu")
    assert worker._info(cfg)["metrics"] is True
    assert cfg.count() == 5 == cfg.calls
    (tmp_path / "plain").mkdir()
    plain = worker.Ours({"level": 1, "dir": str(tmp_path / "plain")}, q, k)
    assert worker._info(plain)["metrics"] is False


def test_calibration_takes_the_longest_round_allowed_when_it_fits_the_target(monkeypatch):
    """A configuration whose longest allowed round fits the target runs rounds of that length,
    however noisy its trial rounds (a model's level-0 row must run as many forwards a round as
    the rows compared with it); one that does not fit gets a shorter round."""
    totals = {1: 2e6, 4: 3e6, 16: 4e6, 33: 150e6}  # ns: noise makes 16 → 33 look expensive

    def fake_round(cfg, n, device):
        return {"n": n, "caller_ns": totals[n], "total_ns": totals[n]}

    monkeypatch.setattr(worker, "_timed_round", fake_round)
    assert worker._calibrate(None, 0.2, "cpu", 33) == 33
    totals[16] = 60e6  # a slow trial past a quarter of the target ends the trials at 16 calls
    assert worker._calibrate(None, 0.2, "cpu", 33) == 33
    totals[16] = 4e6
    totals[33] = 400e6  # 33 calls take longer than the target: fewer calls a round
    assert worker._calibrate(None, 0.2, "cpu", 33) < 33


@pytest.mark.transformers
@pytest.mark.slow
@needs_transformers
def test_control_row_measures_a_change_through_the_real_command():
    """The live-control row sends real `otel-gpu control` commands to a child in a forward
    loop: each change makes spans of the raised module, none before its control span, and the
    text states both budgets' verdicts (the figures themselves are not asserted)."""
    from otel_gpu.bench import control

    result = control.row(quick=True)
    assert result["ok"] is True
    assert len(result["rounds"]["reply_s"]) == 2 == len(result["rounds"]["effect_s"])
    assert result["rounds"]["ordered"] is True
    assert "otel-gpu control --show, idle process" in result["text"]
    assert "≤ 1.0 s:" in result["text"]


def test_count_spans_leaves_out_device_time_children(tmp_path):
    """On a GPU each level-3 call also has a '<name> [device]' child span (device time): the
    bench counts calls, so those children are not counted and the file is not reported as
    holding twice the calls."""
    path = tmp_path / "x.jsonl"
    spans = [{"name": "lib.step"}, {"name": "lib.step [device]"}, {"name": "lib.other"}]
    path.write_text(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}) + "\n")
    assert worker.count_spans(str(path)) == 2


def test_a_round_counts_the_collectors_time_and_the_row_pays_its_mean(tensors, tmp_path):
    """The worker's clock (``gc.callbacks``) counts every collection inside a round, full ones
    apart; a row's total with GC is each round without its own collections plus their cost per
    call: the young generations' mean and the full collections' amortised estimate (measured
    when there is none), so a full collection in one round of three costs every forward a third."""
    import gc

    from otel_gpu.bench import ConfigSpec, Result

    class Collecting:
        calls = 0

        def loop(self, n):
            for _ in range(n):
                gc.collect()

        def flush(self):
            pass

        def after_round(self):
            pass

    gc.callbacks.append(worker._GC)
    try:
        sample = worker._timed_round(Collecting(), 3, "cpu")
    finally:
        gc.callbacks.remove(worker._GC)
    assert sample["gc_full"] == 3
    assert 0 < sample["gc_full_ns"] <= sample["gc_ns"] <= sample["total_ns"]
    res = Result(ConfigSpec("gpt2_1", "gpt2", 1, "x"), status="ready", n=1)
    res.caller = [1000.0, 1000.0, 1000.0]
    res.total = [1000.0, 1000.0, 4000.0]  # ns per call; the third round held a 3000 ns collection
    res.gc_rounds = [0.0, 0.0, 3000.0]
    res.gc_full_rounds = [0.0, 0.0, 3000.0]
    row = res.as_dict()
    assert math.isclose(row["gc_us"], 1.0)  # no estimate: the full collection measured
    assert row["total_us"] == 1.0  # the median drops the collection
    assert row["total_gc_samples_us"] == [2.0, 2.0, 2.0]
    assert row["total_gc_us"] == 2.0  # counted: every forward pays its share
    # young collections every round, and a full collection too rare for the rounds to meet:
    # their mean, plus the amortised estimate of full collections
    res.total = [1300.0, 1300.0, 1300.0]
    res.gc_rounds = [300.0, 300.0, 300.0]
    res.gc_full_rounds = [0.0, 0.0, 0.0]
    res.gc = {"gc_amortised_us": 5.0}
    row = res.as_dict()
    assert math.isclose(row["gc_us"], 5.3)
    assert math.isclose(row["total_gc_us"], 6.3)
