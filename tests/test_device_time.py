"""Device time (``OTEL_GPU_DEVICE_TIME``) through fake CUDA events: two events from a reused
pool around each call, recorded on the caller's thread, resolved off it by querying; a span waits
a bounded time, then goes out unresolved; the pool bounds memory; ``<name> [device]`` child
spans on the host clock; nested calls, torch.compile and forked children."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from lib_sources import NESTED
from pipelines import drain

from otel_gpu.attributes import (
    DEVICE_DURATION,
    DEVICE_QUEUE_DELAY,
    DEVICE_STREAM,
    DEVICE_UNMEASURED,
    DEVICE_UNRESOLVED,
)
from otel_gpu.devices import device_time, events
from otel_gpu.export import pipeline

LIB = NESTED


def _complete_all(fake_events: events.FakeEvents, step_ms: float = 1.0) -> None:
    """Complete every recorded event, ``step_ms`` apart, after the calls were made and before
    now, as a device does: the last one 1 ms ago."""
    n = len(fake_events.recorded)
    time.sleep((n * step_ms + 2) / 1e3)
    now = time.time_ns()
    for i, event in enumerate(fake_events.recorded):
        fake_events.complete(event, now, (i - n) * step_ms)


def test_completed_events_put_duration_queue_delay_and_stream_on_the_span(
    otel_gpu_spans, module_factory, fake_events
):
    """A call whose two events completed gets otel_gpu.device.duration (end - start, seconds),
    otel_gpu.device.queue_delay (device start minus host start, on the host clock) and the id
    of the stream current at call time."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    fake_events.current = 42
    lib.inner(1)
    start, end = fake_events.recorded
    time.sleep(0.03)
    call_start = time.time_ns() - 20_000_000  # after the call started, before now
    fake_events.complete(start, call_start, 0.0)
    fake_events.complete(end, call_start, 2.5)
    (span,) = spans.get()
    assert span.attributes[DEVICE_DURATION] == pytest.approx(0.0025)
    assert span.attributes[DEVICE_STREAM] == 42
    # device start at call_start; the host started the call before the test read the clock
    delay = span.attributes[DEVICE_QUEUE_DELAY]
    assert 0.0 <= delay < 5.0
    assert (span.start_time + delay * 1e9) == pytest.approx(call_start, abs=2e6)


def test_level_1_has_no_device_span_level_3_has_one_on_the_device_clock(
    otel_gpu_spans, module_factory, fake_events
):
    """OTEL_GPU_DEVICE_SPANS=auto: no child at level 1; at level 3 a child ``<name> [device]``
    under the call, its start and end the device's times mapped to the host clock."""
    spans = otel_gpu_spans(level=3)
    lib = module_factory(LIB)
    lib.inner(1)
    time.sleep(0.03)
    t0 = time.time_ns() - 20_000_000  # after the call started, before now
    fake_events.complete(fake_events.recorded[0], t0, 0.0)
    fake_events.complete(fake_events.recorded[1], t0, 4.0)
    got = spans.get()
    (call,) = [s for s in got if not s.name.endswith("[device]")]
    (child,) = [s for s in got if s.name.endswith("[device]")]
    assert child.name == call.name + " [device]"
    assert child.parent.span_id == call.context.span_id
    assert child.context.trace_id == call.context.trace_id
    assert child.start_time == pytest.approx(t0, abs=1e5)
    assert child.end_time - child.start_time == pytest.approx(4_000_000, abs=1e3)


def test_device_spans_on_gives_level_1_calls_a_child(otel_gpu_spans, module_factory, fake_events):
    """OTEL_GPU_DEVICE_SPANS=on: a level-1 call gets its ``[device]`` child too; off: never."""
    spans = otel_gpu_spans(level=1, device_spans="on")
    lib = module_factory(LIB)
    lib.inner(1)
    _complete_all(fake_events)
    assert sorted(s.name.endswith("[device]") for s in spans.get()) == [False, True]


def test_events_come_from_a_reused_pool_not_one_per_call(
    otel_gpu_spans, module_factory, fake_events
):
    """500 calls record 1000 events but create at most one batch of the pool: events are reused
    once their call is resolved."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    for i in range(500):
        lib.inner(i)
        _complete_all(fake_events)
        fake_events.recorded.clear()
        if i % 50 == 0:
            drain()
    got = spans.get()
    assert len(got) == 500 and all(DEVICE_DURATION in s.attributes for s in got)
    assert fake_events.records == 1000
    assert fake_events.created <= 2 * device_time._GROW


def test_events_that_never_complete_go_out_unresolved_after_the_wait(
    otel_gpu_spans, module_factory, fake_events
):
    """A span waits OTEL_GPU_DEVICE_TIME_WAIT for its events, then is exported with
    otel_gpu.device.unresolved = true and no duration; the calls themselves returned at once."""
    spans = otel_gpu_spans(level=3, device_time_wait=0.2)
    lib = module_factory(LIB)
    assert lib.inner(1) == 2
    deadline = time.monotonic() + 10
    got = []
    while time.monotonic() < deadline and not got:
        got = spans.get()
        time.sleep(0.05)
    (span,) = got
    assert span.attributes[DEVICE_UNRESOLVED] is True
    assert DEVICE_DURATION not in span.attributes
    assert DEVICE_QUEUE_DELAY not in span.attributes


def test_a_waiting_call_does_not_hold_back_spans_resolved_after_it(
    otel_gpu_spans, module_factory, fake_events
):
    """A call whose events still run waits beside the export queue: a later call whose events
    completed is exported first, and the waiting one once its events complete."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    lib.inner(1)
    fake_events.current = 9  # another stream
    lib.inner(2)
    first, second = fake_events.recorded[:2], fake_events.recorded[2:]
    now = time.time_ns() - 50_000_000
    fake_events.complete(second[0], now, 0)
    fake_events.complete(second[1], now, 1)
    drain()
    got = spans.exporter.get_finished_spans()
    assert [s.attributes[DEVICE_STREAM] for s in got] == [9]
    fake_events.complete(first[0], now, 0)
    fake_events.complete(first[1], now, 3)
    got = spans.get()
    assert [s.attributes[DEVICE_STREAM] for s in got] == [9, 7]
    assert got[1].attributes[DEVICE_DURATION] == pytest.approx(0.003)


def test_nested_calls_each_get_their_own_pair(otel_gpu_spans, module_factory, fake_events):
    """outer(inner): four events in call order (outer start, inner start, inner end, outer end);
    each span's duration is its own pair's."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    lib.outer(1)
    o_start, i_start, i_end, o_end = fake_events.recorded
    now = time.time_ns() - 50_000_000
    for event, at in ((o_start, 0), (i_start, 1), (i_end, 3), (o_end, 10)):
        fake_events.complete(event, now, at)
    by_name = {s.name.rsplit(".", 1)[1]: s for s in spans.get()}
    assert by_name["inner"].attributes[DEVICE_DURATION] == pytest.approx(0.002)
    assert by_name["outer"].attributes[DEVICE_DURATION] == pytest.approx(0.010)


def test_an_empty_pool_measures_no_more_calls_and_counts_them(
    otel_gpu_spans, module_factory, fake_events, monkeypatch
):
    """With every pair waiting for events that do not complete, further calls go without device
    time (never blocked, nothing created), and the next span resolved says how many."""
    monkeypatch.setattr(device_time, "POOL", 2)
    monkeypatch.setattr(device_time, "_GROW", 2)
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    for i in range(5):
        lib.inner(i)
    assert fake_events.created == 4 and len(fake_events.recorded) == 4  # two calls measured
    _complete_all(fake_events)
    drain()  # resolved: the pool has its pairs back
    lib.inner(9)
    _complete_all(fake_events)
    got = spans.get()
    assert sum(DEVICE_DURATION in s.attributes for s in got) == 3
    assert sum(s.attributes.get(DEVICE_UNMEASURED, 0) for s in got) == 3


def test_the_caller_thread_never_queries_events(otel_gpu_spans, module_factory, fake_events):
    """Events are recorded on the caller's thread and queried only by the export thread (or a
    flush), so a device that never finishes cannot stall the program's calls."""
    queried: set[int] = set()
    real_query = fake_events.query

    def query(event):
        queried.add(threading.get_ident())
        return real_query(event)

    fake_events.query = query
    otel_gpu_spans(level=1, device_time_wait=30.0)
    lib = module_factory(LIB)
    start = time.monotonic()
    for i in range(200):
        lib.inner(i)
    assert time.monotonic() - start < 30  # a hang guard only
    deadline = time.monotonic() + 10
    while not queried and time.monotonic() < deadline:
        time.sleep(0.02)
    assert queried and threading.get_ident() not in queried


def test_off_and_not_initialised_measure_nothing(otel_gpu_spans, module_factory, fake_events):
    """OTEL_GPU_DEVICE_TIME=off records no event; auto records none until CUDA is initialised."""
    spans = otel_gpu_spans(level=3, device_time="off")
    lib = module_factory(LIB)
    lib.inner(1)
    assert fake_events.records == 0 and DEVICE_DURATION not in spans.get()[0].attributes
    fake_events.initialised = False
    spans = otel_gpu_spans(level=3, device_time="auto")
    lib = module_factory(LIB)
    lib.inner(1)
    assert fake_events.records == 0
    fake_events.initialised = True
    lib.inner(2)
    assert fake_events.records == 2


def test_a_cpu_only_machine_claims_no_device_time(otel_gpu_spans, module_factory, monkeypatch):
    """Without CUDA: no observer, no attribute, no child span, and the reason is known."""
    from otel_gpu.devices import cuda

    events.use(None)
    monkeypatch.setattr(events, "_backend", None)
    monkeypatch.setattr(cuda, "cuda_available", lambda: False)
    spans = otel_gpu_spans(level=3, device_time="on", device_spans="on")
    lib = module_factory(LIB)
    lib.inner(1)
    (span,) = spans.get()
    assert not any(k.startswith("otel_gpu.device.") for k in span.attributes)
    assert pipeline.current().device_time is None
    assert "no CUDA device" in events.why_not()


def test_a_graph_capture_records_no_timing_event(otel_gpu_spans, module_factory, fake_events):
    """While the current stream captures a CUDA graph no event is recorded (replays are timed)."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    fake_events.capturing = True
    lib.inner(1)
    assert fake_events.records == 0
    assert DEVICE_DURATION not in spans.get()[0].attributes


def test_compiled_fullgraph_calls_record_events_in_the_runtime_operators(
    otel_gpu_spans, module_factory, fake_events
):
    """Under torch.compile(fullgraph=True) nothing breaks the graph; each runtime call of a
    decorated function inside it records its two events and gets its device time."""
    from torch._dynamo.utils import counters

    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x: lib.inner(x) * 3, backend="eager", fullgraph=True)
    x = torch.ones(3)
    assert torch.equal(compiled(x), (x + 1) * 3)
    assert sum(counters["graph_break"].values()) == 0
    assert len(fake_events.recorded) == 2
    _complete_all(fake_events, 1.5)
    (span,) = spans.get()
    assert span.attributes[DEVICE_DURATION] == pytest.approx(0.0015)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_reuses_the_parents_events(
    otel_gpu_spans, module_factory, fake_events
):
    """A child forked after calls were measured builds its own pool: none of the parent's
    event objects is recorded again in the child."""
    otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    lib.inner(1)
    parent_events = {id(e) for e in fake_events.recorded}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            fake_events.recorded.clear()
            lib.inner(2)
            ok = len(fake_events.recorded) == 2 and not (
                {id(e) for e in fake_events.recorded} & parent_events
            )
            code = 0 if ok else 3
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    result = os.read(read, 1)
    os.waitpid(pid, 0)
    assert result == b"\x00"


def test_each_read_replay_of_a_cuda_graph_carries_its_device_time(
    otel_gpu_spans, fake_events, monkeypatch
):
    """Two reused events around each CUDA-graph replay; the reader thread, once the replay's
    copy completed, puts the replay's device time on each of its spans."""
    from test_cuda_graphs import _Capture, _captured, _FakeCopies, _gpu_runs, fake_cuda

    from otel_gpu.attributes import CUDA_GRAPH_REPLAY, CUDA_GRAPH_REPLAY_DEVICE_DURATION
    from otel_gpu.devices import cuda_graphs

    class FakeGraph:
        def capture_begin(self, *args, **kwargs) -> None:
            _Capture.on = fake_events.capturing = True

        def capture_end(self) -> None:
            _Capture.on = fake_events.capturing = False

        def replay(self):
            return None

    copies = _FakeCopies()
    fake_cuda(monkeypatch, copies, FakeGraph)
    spans = otel_gpu_spans(level=5, graph_stats_every=1)

    @otel_gpu_api
    def scale(x):
        return x * 2

    graph = FakeGraph()
    x = torch.ones(3)
    try:
        with _captured(graph):
            scale(x)
        assert fake_events.records == 0  # nothing recorded into the capture
        spans.get()
        spans.clear()
        created = []
        for ms in (2.0, 5.0):
            copies.gate = threading.Event()  # the reader waits until the device "ran" it
            _gpu_runs(graph, [x, x * 2])
            graph.replay()
            start, end = fake_events.recorded[-2:]
            now = time.time_ns() - 50_000_000
            fake_events.complete(start, now, 0.0)
            fake_events.complete(end, now, ms)
            copies.gate.set()
            assert cuda_graphs.flush(5.0)
            created.append(fake_events.created)
        got = sorted(spans.get(), key=lambda s: s.attributes[CUDA_GRAPH_REPLAY])
        assert [s.attributes[CUDA_GRAPH_REPLAY_DEVICE_DURATION] for s in got] == pytest.approx(
            [0.002, 0.005]
        )
        assert created[0] == created[1]  # the second replay reused the first one's events
    finally:
        copies.gate = None
        cuda_graphs.flush(5.0)
        cuda_graphs.uninstall()
        _Capture.on = False


def otel_gpu_api(fn):
    import otel_gpu

    return otel_gpu.api(fn)


def test_info_says_why_a_cpu_only_machine_has_no_device_time(monkeypatch, capsys):
    """`otel-gpu info` on a machine without CUDA: one line saying calls carry no device time
    and why; with CUDA available it says nothing about it."""
    from otel_gpu.cli import main
    from otel_gpu.devices import cuda

    events.use(None)
    monkeypatch.setattr(events, "_backend", None)
    monkeypatch.setattr(cuda, "cuda_available", lambda: False)
    monkeypatch.setenv("OTEL_GPU_LOGLEVEL", "1")
    assert main(["info"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "OTEL_GPU_DEVICE_TIME:" in ln]
    assert lines == [
        "  note: OTEL_GPU_DEVICE_TIME: no call carries device time: no CUDA device is available "
        "to this process (torch.cuda.is_available() is false)"
    ]
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    assert main(["info"]) == 0
    assert "OTEL_GPU_DEVICE_TIME:" not in capsys.readouterr().out


def test_at_level_5_the_end_event_precedes_the_statistics_kernels(
    otel_gpu_spans, fake_events, monkeypatch
):
    """The end event is recorded right after the call returns, before the output statistics are
    launched, so a level-5 call's device time is its own work, not otel-gpu's reductions."""
    import otel_gpu
    from otel_gpu.calls import stats

    seen: list[tuple[str, int]] = []
    real = stats.compute

    def compute(key, tensor):
        seen.append((key, fake_events.records))
        return real(key, tensor)

    monkeypatch.setattr(stats, "compute", compute)
    otel_gpu_spans(level=5)

    @otel_gpu.api
    def double(x):
        return x * 2

    double(torch.ones(4))
    assert [k for k, _ in seen] == ["input.x", "output.0"]
    assert seen == [
        ("input.x", 0),
        ("output.0", 2),
    ]  # inputs before the start, outputs after the end


def test_at_exit_waiting_calls_go_out_unresolved_not_lost(
    otel_gpu_spans, module_factory, fake_events
):
    """Shutting the pipeline down (exit, reconfiguration) exports the calls still waiting for
    their events at once, marked unresolved, rather than waiting out OTEL_GPU_DEVICE_TIME_WAIT
    or dropping them."""
    spans = otel_gpu_spans(level=1, device_time_wait=600.0)
    lib = module_factory(LIB)
    lib.inner(1)
    drain()  # taken off the queue: it now waits beside it
    assert pipeline.current().device_time.held
    start = time.monotonic()
    pipeline.reset(timeout=5.0)
    assert time.monotonic() - start < 60  # a hang guard only
    (span,) = spans.exporter.get_finished_spans()
    assert span.attributes[DEVICE_UNRESOLVED] is True
