"""Fault injection: concurrency. Threads get separate, correct span trees; fork and spawn
workers (torchrun-style RANK/LOCAL_RANK) each write their own files, every line whole.

Reproduce the figures: ``pytest tests/test_faults_concurrency.py -s -q``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

import otel_gpu
from otel_gpu.export import pipeline

THREADS = 16
CALLS = 1000


def test_16_threads_get_separate_correct_span_trees(otel_gpu_spans):
    """16 threads x 1k calls of outer() -> inner(), under an application span per 100 calls.

    Figure: 0 mixed-up parents among 32k spans: every inner span's parent is the outer call of
    the same thread and iteration, every outer's parent is its thread's application span, each
    trace id is the application span's, and no span is lost. The journal is empty afterwards.
    """
    provider = TracerProvider()
    spans = otel_gpu_spans(level=3, tracer_provider=provider, queue_size=200_000)
    tracer = provider.get_tracer("app")

    @otel_gpu.api
    def inner(t, i):
        return (t, i)

    @otel_gpu.api
    def outer(t, i):
        return inner(t, i)

    app_spans: dict[tuple[int, int], Any] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def work(t: int) -> None:
        try:
            barrier.wait()
            for batch in range(CALLS // 100):
                with tracer.start_as_current_span(f"app-{t}-{batch}") as app:
                    app_spans[(t, batch)] = app.get_span_context()
                    for i in range(batch * 100, batch * 100 + 100):
                        assert outer(t, i) == (t, i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    got = [s for s in spans.get() if s.name.endswith(("inner", "outer"))]
    assert len(got) == 2 * THREADS * CALLS
    key = {}
    for s in got:
        key[
            (
                s.name.rsplit(".", 1)[1],
                s.attributes["otel_gpu.input.t.value"],
                s.attributes["otel_gpu.input.i.value"],
            )
        ] = s
    mixed = 0
    for t in range(THREADS):
        for i in range(CALLS):
            o, n = key[("outer", t, i)], key[("inner", t, i)]
            app = app_spans[(t, i // 100)]
            ok = (
                n.parent.span_id == o.context.span_id
                and o.parent.span_id == app.span_id
                and n.context.trace_id == o.context.trace_id == app.trace_id
            )
            mixed += not ok
    ids = {s.context.span_id for s in got}
    print(
        f"\n[figure] {THREADS} threads x {CALLS} calls: {len(got)} spans, {mixed} mixed-up parents"
    )
    assert mixed == 0 and len(ids) == len(got)
    journal = [o for o in pipeline.current().observers if type(o).__name__ == "Journal"]
    assert journal and journal[0].in_flight() == 0


def _worker(calls: int, threads: int) -> None:  # pragma: no cover - runs in the worker process
    import torch

    import otel_gpu

    @otel_gpu.api
    def step(x, rank, i):
        return x

    rank = int(os.environ["RANK"])

    def run() -> None:
        for i in range(calls // threads):
            step(torch.ones(2, rank + 1), rank, i)

    pool = [threading.Thread(target=run) for _ in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()


def _read_lines(path: Path) -> list[dict[str, Any]]:
    batches = []
    for n, line in enumerate(path.read_text().splitlines()):
        try:
            batches.append(json.loads(line))
        except ValueError:
            pytest.fail(f"{path.name} line {n + 1} is torn or interleaved: {line[:120]!r}")
    return batches


@pytest.mark.parametrize(("method", "ranks"), [("fork", 4), ("spawn", 3)])
def test_worker_processes_write_their_own_whole_files(tmp_path, monkeypatch, method, ranks):
    """torchrun-style workers (RANK, LOCAL_RANK, WORLD_SIZE in their environment at start) started
    by multiprocessing ``fork`` and ``spawn``, 4 threads x 500 calls each, with
    OTEL_GPU_LOGDEST=spans-%r-%i.jsonl.

    Figure: one file per worker (and its metrics file), named by its own rank and pid; every line
    of every span file parses as JSON (0 torn or interleaved lines); every span of a worker is in
    its file and carries its rank in the resource.
    """
    calls, threads = 2000, 4
    monkeypatch.setenv("OTEL_GPU_LOGLEVEL", "3")
    monkeypatch.setenv("OTEL_GPU_LOGDEST", str(tmp_path / "spans-%r-%i.jsonl"))
    monkeypatch.setenv("OTEL_GPU_JOURNAL_DIR", str(tmp_path / "journal"))
    monkeypatch.setenv("WORLD_SIZE", str(ranks))
    ctx = multiprocessing.get_context(method)
    procs = []
    for rank in range(ranks):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        p = ctx.Process(target=_worker, args=(calls, threads))
        p.start()
        procs.append((rank, p))
    for _, p in procs:
        p.join(120)
        assert p.exitcode == 0
    files = sorted(tmp_path.glob("spans-*.jsonl"))
    spans = [f.name for f in files if not f.name.endswith(".metrics.jsonl")]
    assert sorted(spans) == sorted(f"spans-{r}-{p.pid}.jsonl" for r, p in procs)
    # the metrics beside them (on by default for a .jsonl destination), named alike
    metrics = [f.name for f in files if f.name.endswith(".metrics.jsonl")]
    assert sorted(metrics) == sorted(f"spans-{r}-{p.pid}.metrics.jsonl" for r, p in procs)
    lines = 0
    for rank, p in procs:
        batches = _read_lines(tmp_path / f"spans-{rank}-{p.pid}.jsonl")
        lines += len(batches)
        n = 0
        for batch in batches:
            for rs in batch["resourceSpans"]:
                res = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
                assert res["otel_gpu.rank"] == {"intValue": str(rank)}
                assert res["otel_gpu.local_rank"] == {"intValue": str(rank)}
                assert res["process.pid"] == {"intValue": str(p.pid)}
                for ss in rs["scopeSpans"]:
                    for s in ss["spans"]:
                        attrs = {a["key"]: a["value"] for a in s["attributes"]}
                        assert attrs["otel_gpu.input.rank.value"] == {"intValue": str(rank)}
                        n += 1
        assert n == calls
    assert list((tmp_path / "journal").iterdir()) == []
    print(
        f"\n[figure] {method}: {ranks} ranks x {calls} calls in {len(files)} files, "
        f"{lines} lines, 0 torn"
    )
