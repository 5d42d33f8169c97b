"""On a real GPU: levels 5 and 10 inside ``torch.cuda.graph`` capture, and after each replay.

Skipped without CUDA (``conftest.py``). These tests have the fakes of ``tests/test_cuda_graphs.py``
removed: real capture, real captured kernels, real pinned copies and events.
"""

from __future__ import annotations

import threading

import pytest
import torch

import otel_gpu
from otel_gpu.calls import stats
from otel_gpu.devices import cuda, cuda_graphs
from otel_gpu.export import pipeline
from otel_gpu.recorder import manifest, tensor_files
from otel_gpu.recorder.recorder import Recorder


def _lib():
    @otel_gpu.api
    def scale(x):
        return x * 2

    return scale


def _capture(fn, x):
    """The documented recipe: warm up on a side stream, then capture ``fn(x)`` into a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    return graph, out


def _calls(spans):
    """The calls' own spans: without the ``<name> [device]`` children that device time adds at
    level 3 and above (docs/levels.md), which carry no statistics."""
    return [s for s in spans.get() if not s.name.endswith(" [device]")]


def _stats(span):
    return {
        e.attributes["otel_gpu.tensor"]: dict(e.attributes)
        for e in span.events
        if e.name == "otel_gpu.stats"
    }


@pytest.fixture(autouse=True)
def _unpatch():
    yield
    cuda_graphs.flush(10.0)
    cuda_graphs.uninstall()


def test_level_5_capture_and_replays_give_right_statistics(otel_gpu_spans):
    """Capture succeeds at level 5 with no host read; each replay gives one span with the
    statistics of the values that replay saw (known values: NaN and Inf included)."""
    spans = otel_gpu_spans(level=5, graph_stats_every=1)
    scale = _lib()
    x = torch.ones(4, device="cuda")
    reads = cuda.host_reads
    graph, out = _capture(scale, x)
    captures = [s for s in _calls(spans) if _stats(s)["input.x"].get("otel_gpu.stats.note")]
    assert captures and all(
        _stats(s)["input.x"]["otel_gpu.stats.note"] == stats.CAPTURED_NOTE for s in captures
    )
    assert cuda.host_reads - reads == 3  # the three warm-up calls, none during capture
    spans.clear()
    values = [
        torch.tensor([1.0, 2.0, 3.0, 4.0]),
        torch.tensor([-1.0, float("nan"), float("inf"), 5.0]),
    ]
    for v in values:
        x.copy_(v.cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert cuda_graphs.flush(10.0)
    # the graph still computes what it captured
    torch.testing.assert_close(out.cpu(), values[-1] * 2, equal_nan=True)
    replayed = {s.attributes["otel_gpu.cuda_graph.replay"]: s for s in _calls(spans)}
    assert sorted(replayed) == [1, 2]
    first, second = _stats(replayed[1]), _stats(replayed[2])
    assert (first["input.x"]["min"], first["input.x"]["max"]) == (1.0, 4.0)
    assert first["input.x"]["mean"] == pytest.approx(2.5)
    assert first["output.0"]["std"] == pytest.approx(torch.tensor([2.0, 4, 6, 8]).std().item())
    assert (second["input.x"]["nan_count"], second["input.x"]["inf_count"]) == (1, 1)
    assert (second["input.x"]["min"], second["input.x"]["max"]) == (-1.0, 5.0)
    assert replayed[2].attributes["otel_gpu.nonfinite"] is True
    capture_ids = {s.context.span_id for s in captures}
    assert all(link.context.span_id in capture_ids for s in replayed.values() for link in s.links)


def test_replay_makes_no_host_sync_on_the_callers_thread(otel_gpu_spans, monkeypatch):
    """With torch's sync debug mode set to error, a replay that is read still returns: the copy
    is non-blocking into pinned memory and the wait happens on the reader thread."""
    otel_gpu_spans(level=5, graph_stats_every=1)
    scale = _lib()
    x = torch.arange(8.0, device="cuda")
    graph, _ = _capture(scale, x)
    gate = threading.Event()
    real_wait = cuda.wait_copy

    def gated_wait(event):
        assert gate.wait(30)
        real_wait(event)

    monkeypatch.setattr(cuda, "wait_copy", gated_wait)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        gate.set()
    assert cuda_graphs.flush(10.0)
    host = cuda_graphs._graphs[graph].free
    assert host and all(b.is_pinned() for b in host)


def test_level_10_snapshot_after_replay_holds_that_replays_values(otel_gpu_spans, tmp_path):
    """At level 10 the dump is deferred at capture and written after replays, from pinned
    copies, with the inputs and outputs of that replay."""
    root = tmp_path / "dumps"
    spans = otel_gpu_spans(level=10, dump_dir=str(root), graph_stats_every=1, graph_dump_every=1)
    scale = _lib()
    x = torch.zeros(5, device="cuda")
    graph, _ = _capture(scale, x)
    pipe = pipeline.current()
    assert pipe is not None
    (recorder,) = [o for o in pipe.observers if isinstance(o, Recorder)]
    recorder.flush(30.0)
    before = set(root.iterdir())  # the warm-up calls' dumps
    spans.get(), spans.clear()
    x.copy_(torch.arange(5.0, device="cuda"))
    graph.replay()
    assert cuda_graphs.flush(10.0)
    assert recorder.flush(30.0)
    (directory,) = set(root.iterdir()) - before
    (span,) = spans.get()
    assert span.attributes["otel_gpu.dump.dir"] == str(directory)
    man = manifest.read_manifest(str(directory))
    assert man["status"] == "completed" and man["cuda_graph"]["replay"] == 1
    ins = tensor_files.load_tensors(str(directory), man["files"]["inputs"])
    outs = tensor_files.load_tensors(str(directory), man["files"]["outputs"])
    assert torch.equal(ins["input.x"], torch.arange(5.0))
    assert torch.equal(outs["output"], torch.arange(5.0) * 2)
