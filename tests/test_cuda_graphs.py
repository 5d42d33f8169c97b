"""CUDA graphs on CPU, with fakes: what a call records at capture and the spans of each replay.

The GPU seams are faked: ``cuda.is_capturing`` follows a fake capture, ``graph_class`` is a fake
``CUDAGraph`` with ``capture_begin``/``capture_end``/``replay``, and pinned buffers, copies and
events record who made and waited for them (a copy "lands" only when its event is waited for).
A real graph rewrites its static buffers at each replay; here the test stands in for the GPU
and rewrites them (:func:`_gpu_runs`). The real thing is ``tests/gpu/`` (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import pytest
import torch
from opentelemetry import trace

import otel_gpu
from otel_gpu.calls import stats
from otel_gpu.devices import cuda, cuda_graphs


class _Capture:
    on = False


class _FakeCopies:
    """Pinned buffers and asynchronous copies that count who allocates, copies and waits."""

    def __init__(self) -> None:
        self.pinned = 0
        self.copies: Counter[str] = Counter()
        self.waits: Counter[str] = Counter()
        self.caller = threading.get_ident()
        self.gate: threading.Event | None = None  # when set, wait_copy blocks until it is set
        self.capture = _Capture

    def _who(self) -> str:
        me = threading.current_thread()
        return "caller" if me.ident == self.caller else me.name

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        assert not self.capture.on, "pinned allocation during capture"
        self.pinned += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor):
        assert not self.capture.on, "device-to-host copy during capture"
        self.copies[self._who()] += 1
        return (dst, src.clone())

    def wait_copy(self, event) -> None:
        if self.gate is not None:
            assert self.gate.wait(10)
        self.waits[self._who()] += 1
        dst, values = event
        dst.copy_(values)


def fake_cuda(monkeypatch: pytest.MonkeyPatch, copies: _FakeCopies, graph: type) -> None:
    """CUDA faked for the rest of the test: available, capturing while :class:`_Capture` says
    so, every tensor on the device, the copies done by ``copies``, ``graph`` the CUDAGraph."""
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "is_capturing", lambda: _Capture.on)
    monkeypatch.setattr(cuda, "is_cuda_tensor", lambda t: True)
    monkeypatch.setattr(cuda, "pinned_empty", copies.pinned_empty)
    monkeypatch.setattr(cuda, "copy_to_host", copies.copy_to_host)
    monkeypatch.setattr(cuda, "wait_copy", copies.wait_copy)
    monkeypatch.setattr(cuda_graphs, "graph_class", lambda: graph)


@pytest.fixture
def fake(monkeypatch):
    """Faked CUDA: capture flag, copies, and a fresh fake CUDAGraph class; unpatched afterwards."""

    class FakeGraph:
        def __init__(self) -> None:
            self.replayed = 0
            self.result: object = None
            self.error: BaseException | None = None

        def capture_begin(self, *args, **kwargs) -> None:
            _Capture.on = True

        def capture_end(self) -> None:
            _Capture.on = False

        def replay(self):
            self.replayed += 1
            if self.error is not None:
                raise self.error
            return self.result

    copies = _FakeCopies()
    _Capture.on = False
    fake_cuda(monkeypatch, copies, FakeGraph)
    copies.graph_class = FakeGraph  # type: ignore[attr-defined]
    yield copies
    if copies.gate is not None:
        copies.gate.set()
    cuda_graphs.flush(5.0)
    cuda_graphs.uninstall()
    _Capture.on = False


@contextlib.contextmanager
def _captured(graph):
    """``torch.cuda.graph(graph)``: capture_begin, the body, capture_end."""
    graph.capture_begin()
    try:
        yield
    finally:
        graph.capture_end()


@contextlib.contextmanager
def _no_host_reads():
    """Fail on any Python-level read of tensor values to the host while the block runs."""

    def refuse(*args, **kwargs):
        raise AssertionError("host read during capture")

    saved = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu", "numpy", "__bool__")}
    for name in saved:
        setattr(torch.Tensor, name, refuse)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _gpu_runs(graph, *tensors_per_call):
    """Stand in for the GPU during a replay: rewrite each captured call's static statistics
    buffer from the given tensors (one list per call), as the captured kernels would."""
    calls = cuda_graphs._graphs[graph].calls
    for c, tensors in zip(calls, tensors_per_call):
        assert c.buffer is not None
        c.buffer.copy_(torch.cat([stats.capture("k", t).vec for t in tensors]))


def _attrs_by_tensor(span):
    return {
        e.attributes["otel_gpu.tensor"]: dict(e.attributes)
        for e in span.events
        if e.name == "otel_gpu.stats"
    }


def _lib():
    @otel_gpu.api
    def scale(x):
        return x * 2

    @otel_gpu.api
    def shift(x, y):
        return x + y

    return scale, shift


def _replaying(otel_gpu_spans, fake, x: torch.Tensor, every: int):
    """(spans, graph): level 5 with every ``every``-th replay read, and a fake graph that
    captured ``scale(x)``; the capture's spans already taken."""
    spans = otel_gpu_spans(level=5, graph_stats_every=every)
    scale, _ = _lib()
    graph = fake.graph_class()
    with _captured(graph):
        scale(x)
    spans.get(), spans.clear()  # the capture spans
    return spans, graph


# --------------------------------------------------------------------------- capture


def test_capture_records_buffers_without_any_host_read(otel_gpu_spans, fake, monkeypatch):
    """At capture a level-5 call launches its statistics into a static buffer: no host read, no
    copy, no pinned allocation; its span says the statistics are not known yet."""
    spans = otel_gpu_spans(level=5)
    scale, _ = _lib()
    graph = fake.graph_class()
    monkeypatch.setattr(cuda, "host_reads", 0)
    x = torch.tensor([1.0, 2.0, float("nan")])
    with _captured(graph), _no_host_reads():
        scale(x)
    assert cuda.host_reads == 0
    assert sum(fake.copies.values()) == 0 and fake.pinned == 0
    (span,) = spans.get()
    assert span.attributes["otel_gpu.cuda_graph.capture"] is True
    events = _attrs_by_tensor(span)
    assert set(events) == {"input.x", "output.0"}
    for attrs in events.values():
        assert attrs["numel"] == 3
        assert attrs["otel_gpu.stats.note"] == stats.CAPTURED_NOTE
        assert "min" not in attrs and "nan_count" not in attrs
    assert "otel_gpu.nonfinite" not in span.attributes  # not known at capture
    (record,) = cuda_graphs._graphs[graph].calls
    # both tensors' vectors, one after the other
    assert record.buffer is not None and record.buffer.shape == (2 * stats.CAPTURED_ROW,)


def test_no_patch_without_a_captured_call(otel_gpu_spans, fake):
    """Eager level-5 calls, and level-3 calls during capture, leave CUDAGraph untouched."""
    original = fake.graph_class.replay
    otel_gpu_spans(level=5)
    scale, _ = _lib()
    scale(torch.ones(2))
    otel_gpu_spans(level=3)
    scale3, _ = _lib()
    with _captured(fake.graph_class()):
        scale3(torch.ones(2))
    assert not cuda_graphs.installed()
    assert fake.graph_class.replay is original


# --------------------------------------------------------------------------- replay


def test_each_replay_gives_one_span_per_captured_call_linked_to_its_capture(otel_gpu_spans, fake):
    """Every replay: one span per captured call, with the replay number, a link to the capture
    span, the replay-time parent and the statistics of that replay; the copy is waited for off
    the caller's thread."""
    spans = otel_gpu_spans(level=5, graph_stats_every=1)
    scale, shift = _lib()
    graph = fake.graph_class()
    x, y = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])
    with _captured(graph):
        out = scale(x)
        shift(out, y)
    capture_ids = {s.name.rsplit(".", 1)[-1]: s.context.span_id for s in spans.get()}
    spans.clear()
    step = trace.NonRecordingSpan(
        trace.SpanContext(0xABC, 0xDEF, False, trace.TraceFlags(trace.TraceFlags.SAMPLED))
    )
    with trace.use_span(step):
        for i in range(3):
            x.fill_(float(i))  # the program writes its static input; the graph recomputes
            _gpu_runs(graph, [x, x * 2], [x * 2, y, x * 2 + y])
            graph.replay()
            assert cuda_graphs.flush(5.0)  # the GPU's copy was read before the next replay
    assert otel_gpu.flush()
    replayed = spans.get()
    assert len(replayed) == 6
    assert fake.copies == {"caller": 3}  # one copy per replay for both calls
    assert fake.waits == {"otel-gpu-graphs": 3} and fake.pinned == 1  # reused
    for s in replayed:
        kind = s.name.rsplit(".", 1)[-1]
        n = s.attributes["otel_gpu.cuda_graph.replay"]
        assert [link.context.span_id for link in s.links] == [capture_ids[kind]]
        assert (s.context.trace_id, s.parent.span_id) == (0xABC, 0xDEF)
        events = _attrs_by_tensor(s)
        x_value = float(n - 1)
        if kind == "scale":
            assert events["input.x"]["min"] == events["input.x"]["max"] == x_value
            assert events["output.0"]["mean"] == 2 * x_value
        else:
            assert events["input.y"]["mean"] == 20.0 and events["input.y"]["std"] == 10.0
            assert events["output.0"]["min"] == 2 * x_value + 10.0
        assert s.attributes["otel_gpu.output.0.stride"] == (1,)  # level-3 metadata of the capture
    assert sorted(s.attributes["otel_gpu.cuda_graph.replay"] for s in replayed) == [
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    assert cuda_graphs.replays(graph) == (3, 0)


def test_otel_gpu_flush_exports_the_spans_of_replays_being_read(otel_gpu_spans, fake):
    """otel_gpu.flush() waits for the replays the reader still holds, then exports them."""
    spans, graph = _replaying(otel_gpu_spans, fake, torch.ones(2), every=1)
    fake.gate = threading.Event()
    graph.replay()
    threading.Timer(0.2, fake.gate.set).start()  # the copy completes later
    assert otel_gpu.flush()
    assert [
        s.attributes["otel_gpu.cuda_graph.replay"] for s in spans.exporter.get_finished_spans()
    ] == [1]


def test_nan_and_inf_of_a_replay_are_counted(otel_gpu_spans, fake):
    """The counts of a replay's non-finite values reach its span, and the span is marked."""
    x = torch.ones(4)
    spans, graph = _replaying(otel_gpu_spans, fake, x, every=1)
    x.copy_(torch.tensor([1.0, float("nan"), float("inf"), 3.0]))
    _gpu_runs(graph, [x, x * 2])
    graph.replay()
    cuda_graphs.flush(5.0)
    (span,) = spans.get()
    ev = _attrs_by_tensor(span)["input.x"]
    assert (ev["nan_count"], ev["inf_count"], ev["min"], ev["max"], ev["mean"]) == (
        1,
        1,
        1.0,
        3.0,
        2.0,
    )
    assert span.attributes["otel_gpu.nonfinite"] is True


def test_sampling_setting_bounds_read_replays(otel_gpu_spans, fake):
    """OTEL_GPU_GRAPH_STATS_EVERY=3: replays 1, 4 and 7 of 7 are read; the others cost no copy."""
    spans, graph = _replaying(otel_gpu_spans, fake, torch.ones(2), every=3)
    for _ in range(7):
        graph.replay()
    cuda_graphs.flush(5.0)
    got = sorted(s.attributes["otel_gpu.cuda_graph.replay"] for s in spans.get())
    assert got == [1, 4, 7]
    assert fake.copies == {"caller": 3}


@pytest.mark.parametrize("value", [0, -1, 1.5, "often"])
def test_sampling_settings_reject_what_is_not_a_positive_integer(value):
    """A bad sampling setting is refused with a one-line error naming the variable."""
    for field, env in (
        ("graph_stats_every", "OTEL_GPU_GRAPH_STATS_EVERY"),
        ("graph_dump_every", "OTEL_GPU_GRAPH_DUMP_EVERY"),
    ):
        with pytest.raises(otel_gpu.ConfigError, match=env) as raised:
            otel_gpu.configure(level=5, **{field: value})
        assert "\n" not in str(raised.value) and "integer > 0" in str(raised.value)


def test_a_slow_reader_never_blocks_the_caller(otel_gpu_spans, fake):
    """While earlier copies are still being read, replays are skipped (counted), not waited on:
    at most four pinned buffers per graph exist."""
    spans, graph = _replaying(otel_gpu_spans, fake, torch.ones(2), every=1)
    fake.gate = threading.Event()  # the reader's first wait blocks until released
    for _ in range(7):
        graph.replay()  # returns: the caller never waits for the reader
    assert fake.pinned == 4
    replays, skipped = cuda_graphs.replays(graph)
    assert replays == 7 and skipped == 3
    fake.gate.set()
    cuda_graphs.flush(5.0)
    assert sorted(s.attributes["otel_gpu.cuda_graph.replay"] for s in spans.get()) == [1, 2, 3, 4]


def test_replay_result_and_exception_pass_through(otel_gpu_spans, fake):
    """The patched replay returns what replay returned and raises the very same exception."""
    otel_gpu_spans(level=5, graph_stats_every=1)
    scale, _ = _lib()
    graph = fake.graph_class()
    with _captured(graph):
        scale(torch.ones(2))
    graph.result = sentinel = object()
    assert graph.replay() is sentinel
    graph.error = boom = RuntimeError("replay failed")
    with pytest.raises(RuntimeError) as raised:
        graph.replay()
    assert raised.value is boom
    assert graph.replayed == 2 and cuda_graphs.replays(graph) == (1, 0)


def test_uninstall_restores_the_original_methods(otel_gpu_spans, fake):
    """uninstall() puts CUDAGraph's own capture_begin, capture_end and replay back."""
    cls = fake.graph_class
    originals = {n: cls.__dict__[n] for n in ("capture_begin", "capture_end", "replay")}
    otel_gpu_spans(level=5)
    scale, _ = _lib()
    with _captured(cls()):
        scale(torch.ones(2))
    assert cuda_graphs.installed() and cls.__dict__["replay"] is not originals["replay"]
    cuda_graphs.uninstall()
    assert not cuda_graphs.installed()
    assert {n: cls.__dict__[n] for n in originals} == originals


# --------------------------------------------------------------------------- statistics values


@pytest.mark.parametrize(
    "t",
    [
        torch.tensor([1.0, -2.0, 3.5, 0.25]),
        torch.tensor([1.0, float("nan"), float("-inf"), 4.0, 5.0]),
        torch.tensor([float("nan"), float("inf")]),
        torch.tensor([7.0]),
        torch.arange(10, dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.randn(4, 5, dtype=torch.float16),
        torch.randn(3, 4, dtype=torch.bfloat16).t(),
        torch.tensor([1e8 + 1, 1e8 + 2, 1e8 + 3], dtype=torch.float32),
    ],
    ids=["float", "nan-inf", "no-finite", "one", "int", "bool", "half", "bf16-t", "large-mean"],
)
def test_captured_statistics_match_eager(t):
    """The capture kernels give the statistics eager mode gives, for every dtype."""
    (eager,) = stats.finish([stats.compute("k", t)])
    p = stats.capture("k", t)
    row = p.vec.tolist()
    got = stats.captured_stats("k", p.numel, p.note, p.integer, row, p.extras, p.moments > 0)
    assert got.note == eager.note
    assert set(got.values) == set(eager.values)
    for key, value in eager.values.items():
        assert got.values[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


# --------------------------------------------------------------------------- level 10


def _recorder():
    from otel_gpu.export import pipeline
    from otel_gpu.recorder.recorder import Recorder

    pipe = pipeline.current()
    assert pipe is not None
    (rec,) = [o for o in pipe.observers if isinstance(o, Recorder)]
    return rec


def test_level_10_defers_the_dump_and_writes_a_snapshot_after_sampled_replays(
    otel_gpu_spans, fake, tmp_path
):
    """At capture nothing is copied or written; after replays 1 and 3 (OTEL_GPU_GRAPH_DUMP_EVERY=2)
    a snapshot holds the static tensors as that replay left them, linked to its replay span."""
    from otel_gpu.recorder import manifest, tensor_files

    root = tmp_path / "dumps"
    spans = otel_gpu_spans(level=10, dump_dir=str(root), graph_stats_every=1, graph_dump_every=2)
    scale, _ = _lib()
    graph = fake.graph_class()
    x = torch.zeros(3)
    with _captured(graph), _no_host_reads():
        out = scale(x)
    (capture,) = spans.get()
    spans.clear()
    assert capture.attributes["otel_gpu.dump.skipped"] == "cuda_graph_capture"
    assert list(root.iterdir()) == [] and sum(fake.copies.values()) == 0
    for i in range(1, 4):
        x.fill_(float(i))
        out.copy_(x * 2)  # what the replay's kernels write
        _gpu_runs(graph, [x, out])
        graph.replay()
        assert cuda_graphs.flush(5.0)
        assert _recorder().flush(5.0)
    replayed = {s.attributes["otel_gpu.cuda_graph.replay"]: s for s in spans.get()}
    assert sorted(replayed) == [1, 2, 3]
    assert "otel_gpu.dump.dir" not in replayed[2].attributes
    dirs = sorted(root.iterdir())
    assert len(dirs) == 2
    for n, directory in zip((1, 3), dirs):
        span = replayed[n]
        assert span.attributes["otel_gpu.dump.dir"] == str(directory)
        man = manifest.read_manifest(str(directory))
        assert man["status"] == "completed"
        assert man["cuda_graph"] == {
            "replay": n,
            "capture_span_id": format(capture.context.span_id, "016x"),
        }
        assert man["span_id"] == format(span.context.span_id, "016x")
        ins = tensor_files.load_tensors(str(directory), man["files"]["inputs"])
        outs = tensor_files.load_tensors(str(directory), man["files"]["outputs"])
        assert torch.equal(ins["input.x"], torch.full((3,), float(n)))
        assert torch.equal(outs["output"], torch.full((3,), 2.0 * n))
    assert fake.waits["caller"] == 0 and fake.waits["otel-gpu-dump"] == 4  # 2 snapshots x 2


def test_snapshots_stay_within_the_dump_count_limit(otel_gpu_spans, fake, tmp_path):
    """OTEL_GPU_DUMP_MAX_COUNT bounds snapshots too: replays beyond it get spans, not dumps."""
    root = tmp_path / "dumps"
    otel_gpu_spans(
        level=10, dump_dir=str(root), graph_stats_every=1, graph_dump_every=1, dump_max_count=2
    )
    scale, _ = _lib()
    graph = fake.graph_class()
    with _captured(graph):
        scale(torch.ones(2))
    for _ in range(5):
        graph.replay()
        cuda_graphs.flush(5.0)
    assert _recorder().flush(5.0)
    assert len([p for p in root.iterdir() if not p.name.startswith(".")]) == 2  # and a note
