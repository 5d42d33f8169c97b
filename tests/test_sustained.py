"""Sustained load: with default settings no span is lost; dropping is explicit, counted, reported.

A tight single-thread loop outruns the export thread, which gets too few turns on the GIL.
At a full queue the default (``OTEL_GPU_QUEUE_FULL=block``) makes the caller export a chunk
itself or wait for the export thread to make room; ``drop`` drops and counts. Counts only,
never times.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

import otel_gpu
from otel_gpu.export import pipeline


def _spans(path: Path) -> list[dict[str, Any]]:
    """Every span of an OTLP JSON Lines file (raw OTLP JSON objects)."""
    out: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    out.extend(ss["spans"])
    return out


def _drop_events(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The drop notes in file order, each as {attribute key: value}."""
    notes = []
    for span in spans:
        for event in span.get("events", ()):
            if event["name"] == pipeline.DROP_EVENT:
                notes.append(
                    {kv["key"]: next(iter(kv["value"].values())) for kv in event["attributes"]}
                )
    return notes


def _fn() -> Any:
    def attention(q: Any, k: Any, *, scale: float = 1.0) -> Any:
        return q

    return attention


def _never_wake(monkeypatch: pytest.MonkeyPatch) -> None:
    """The export thread sleeps through the test: only the caller (or flush) exports."""
    monkeypatch.setattr(pipeline, "_WAKE_EVERY", 10**6)
    monkeypatch.setattr(pipeline, "_WAKE_AT", -1)


def _small_queue(path: Path, **settings: Any) -> tuple[Any, pipeline.Pipeline]:
    """Level 1 to ``path`` with a queue of 10, one call made: the function and the pipeline."""
    otel_gpu.configure(level=1, dest=str(path), provider="own", queue_size=10, **settings)
    fn = otel_gpu.api(_fn())
    fn(1, 2)
    pipe = pipeline.current()
    assert pipe is not None
    return fn, pipe


@pytest.mark.parametrize(("level", "calls"), [(1, 300_000), (3, 50_000)])
def test_a_tight_loop_at_default_settings_delivers_every_span(tmp_path, level, calls):
    """300k level-1 calls (50k at level 3, with tensors) in one tight loop, default queue and
    OTEL_GPU_QUEUE_FULL: every span is in the file, each once, and nothing was dropped.
    Before back-pressure, 70% of the level-1 spans were dropped here."""
    import torch

    path = tmp_path / "spans.jsonl"
    otel_gpu.configure(level=level, dest=str(path), provider="own")
    fn = otel_gpu.api(_fn())
    q = torch.zeros(4, 8)
    for _ in range(calls):
        fn(q, q, scale=0.5)
    assert otel_gpu.flush(120.0)
    pipe = pipeline.current()
    assert pipe is not None and pipe.dropped == 0
    spans = _spans(path)
    assert len(spans) == calls
    assert len({s["spanId"] for s in spans}) == calls
    assert _drop_events(spans) == []


def test_drop_mode_counts_and_reports_every_drop_exactly(tmp_path, monkeypatch, caplog):
    """OTEL_GPU_QUEUE_FULL=drop with a queue of 100 and no export during the loop: the calls past
    100 are dropped and counted exactly, the next exported span carries the count as an
    ``otel.sdk.processor.span.processed`` event (error.type queue_full), and the exit report
    names them."""
    _never_wake(monkeypatch)
    path = tmp_path / "spans.jsonl"
    otel_gpu.configure(level=1, dest=str(path), provider="own", queue_size=100, queue_full="drop")
    fn = otel_gpu.api(_fn())
    for _ in range(250):
        fn(1, 2)
    pipe = pipeline.current()
    assert pipe is not None and pipe.dropped == 150 and pipe.exported == 0
    assert otel_gpu.flush(10.0)
    for _ in range(10):  # fits: no drop, no note
        fn(1, 2)
    assert otel_gpu.flush(10.0)
    for _ in range(150):
        fn(1, 2)
    assert pipe.dropped == 200 and pipe.stalled == 0
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        pipeline.reset(timeout=10.0)
    spans = _spans(path)
    assert len(spans) == 100 + 10 + 100
    notes = _drop_events(spans)
    assert [(n["error.type"], n["otel_gpu.spans.dropped"]) for n in notes] == [
        ("queue_full", "150"),
        ("queue_full", "50"),
    ]
    assert [n["otel_gpu.spans.dropped.total"] for n in notes] == ["150", "200"]
    # the notes ride on the first span exported after the drops
    firsts = [i for i, s in enumerate(spans) if _drop_events([s])]
    assert firsts == [0, 110]
    report = [r.getMessage() for r in caplog.records if "otel-gpu dropped" in r.getMessage()]
    assert len(report) == 1
    assert report[0].startswith(
        "otel-gpu dropped 200 span(s): 200 because the queue was full (OTEL_GPU_QUEUE_FULL=drop, "
        "OTEL_GPU_QUEUE_SIZE=100; 0 of them because export stalled)"
    )


def test_block_mode_makes_the_caller_export_when_the_export_thread_is_idle(tmp_path, monkeypatch):
    """Default mode, queue of 10, export thread asleep: the caller exports a chunk itself each
    time the queue is full, so 1000 calls reach the file with no drop and without a flush."""
    _never_wake(monkeypatch)
    path = tmp_path / "spans.jsonl"
    fn, pipe = _small_queue(path)
    for _ in range(999):
        fn(1, 2)
    assert pipe.dropped == 0
    # everything but the last queue's worth was exported by the caller's own thread, and written
    assert pipe.exported >= 1000 - 10
    assert len(_spans(path)) == pipe.exported
    assert otel_gpu.flush(10.0)
    assert len(_spans(path)) == 1000


def test_block_mode_feeds_an_application_provider_too(monkeypatch):
    """An application's own provider gets every span of a loop that overruns the queue."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    _never_wake(monkeypatch)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel_gpu.configure(level=1, tracer_provider=provider, queue_size=16)
    fn = otel_gpu.api(_fn())
    for _ in range(500):
        fn(1, 2)
    assert otel_gpu.flush(10.0)
    assert len(exporter.get_finished_spans()) == 500
    pipe = pipeline.current()
    assert pipe is not None and pipe.dropped == 0


def test_a_stalled_export_drops_and_counts_instead_of_stalling_the_caller(tmp_path, monkeypatch):
    """Export holding its lock without progress (as a materialisation stuck in user code does):
    the first call at the full queue waits up to the stall bound, then that call and every
    following one while export stays stuck are dropped at once, counted as stalled; once export
    moves again the caller exports, and the next span names the stalled drops."""
    _never_wake(monkeypatch)
    path = tmp_path / "spans.jsonl"
    fn, pipe = _small_queue(path)
    waited: list[bool] = []  # per call at the full queue: whether it could wait for export
    make_room = pipe._make_room

    def counting_make_room(wait: bool) -> bool:
        waited.append(wait)
        return make_room(wait)

    monkeypatch.setattr(pipe, "_make_room", counting_make_room)
    stuck = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with pipe._drain_lock:
            stuck.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert stuck.wait(10)
    try:
        for _ in range(49):
            fn(1, 2)
    finally:
        release.set()
        holder.join(10)
    assert pipe.dropped == 40 and pipe.stalled == 40
    # only the first dropped call waited (up to the stall bound); the 39 after it did not
    assert waited == [True] + [False] * 39
    assert otel_gpu.flush(10.0)  # export moves again
    for _ in range(30):  # the caller exports when the queue fills: nothing more is dropped
        fn(1, 2)
    assert pipe.dropped == 40
    assert otel_gpu.flush(10.0)
    spans = _spans(path)
    assert len(spans) == 10 + 30
    notes = _drop_events(spans)
    assert [(n["error.type"], n["otel_gpu.spans.dropped"]) for n in notes] == [
        ("export_stalled", "40")
    ]


def test_queue_full_setting_is_validated():
    """A bad OTEL_GPU_QUEUE_FULL is one clear error naming the allowed values."""
    from otel_gpu import config

    with pytest.raises(config.ConfigError, match=r"OTEL_GPU_QUEUE_FULL.*block, drop"):
        config.load(env={"OTEL_GPU_QUEUE_FULL": "wait"})


def test_bench_row_reports_delivered_fraction_and_cpu_against_flashinfer():
    """The sustained-load row divides what reached the file by the calls made, and otel-gpu's
    CPU per call by FlashInfer's; a row short of every span is marked as missing its budget."""
    from otel_gpu.bench import sustained

    rows = [
        {
            "kind": "ours",
            "level": 1,
            "calls": 1000,
            "delivered": 1000,
            "cpu_s": 0.009,
            "loop_cpu_s": 0.005,
            "dropped": 0,
        },
        {"kind": "flashinfer", "level": 1, "calls": 1000, "delivered": 1000, "cpu_s": 0.012},
        {
            "kind": "ours",
            "level": 3,
            "calls": 1000,
            "delivered": 900,
            "cpu_s": 0.03,
            "loop_cpu_s": 0.02,
            "dropped": 100,
        },
        {"kind": "flashinfer", "level": 3, "calls": 1000, "delivered": 1000, "cpu_s": 0.05},
    ]
    summary = sustained._summary(rows)
    assert [(s["level"], s["delivered"], s["dropped"]) for s in summary] == [
        (1, 1.0, 0),
        (3, 0.9, 100),
    ]
    assert summary[0]["cpu_ratio"] == pytest.approx(0.75)
    text = sustained.render({"calls": 1000, "summary": summary})
    assert "0.75×  every span, ≤ 1.00× met" in text
    assert "90.0%" in text and "MISSED" in text


def test_bench_only_accepts_the_sustained_row(capsys):
    """`otel-gpu bench --only` knows the sustained row by name (and still refuses unknown ones)."""
    from otel_gpu import cli

    assert cli.main(["bench", "--only", "sustained,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown configuration(s) nope;" in err and "sustained" in err


def test_a_chunk_exported_by_the_caller_runs_no_after_drain_hook(tmp_path, monkeypatch):
    """Hooks added with add_after_drain (the watchdog's check, which may wait on a collector)
    run when the export thread or a flush drains, never inside the program's call; the
    destination's batch is still written by the caller's chunk."""
    _never_wake(monkeypatch)
    path = tmp_path / "spans.jsonl"
    fn, pipe = _small_queue(path)
    ran: list[int] = []
    pipe.add_after_drain(lambda: ran.append(pipe.exported))
    for _ in range(99):
        fn(1, 2)
    assert pipe.exported >= 90 and ran == []
    assert len(_spans(path)) == pipe.exported
    assert otel_gpu.flush(10.0)
    assert ran and ran[-1] == 100
