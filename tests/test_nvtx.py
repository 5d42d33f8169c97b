"""NVTX ranges (``OTEL_GPU_NVTX``), through a fake NVTX API: each decorated call opens a range
named like its span, carrying the exported span's id (payload or message), nested as the calls
nest, closed also when the call raised, skipped while torch.compile traces and during CUDA-graph
capture; with NVTX off nothing is built, and with no NVTX API one warning and nothing else."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch
from lib_sources import NESTED
from torch._dynamo.utils import counters

from otel_gpu import _guard
from otel_gpu.devices import cuda
from otel_gpu.devices import nvtx as nvtx_seam
from otel_gpu.export import pipeline

LIB = (
    NESTED
    + """
class Boom(Exception):
    pass

@otel_gpu.api
def fails(exc):
    raise exc
"""
)


class FakeNvtx:
    """Records every NVTX call, with the thread it came from."""

    def __init__(self, payload: bool = True) -> None:
        self.payload = payload
        self.events: list[tuple] = []
        self.next_id = 100
        self.loads = 0

    def push(self, message: str, value: int) -> None:
        self.events.append(("push", message, value, threading.get_ident()))

    def pop(self) -> None:
        self.events.append(("pop", threading.get_ident()))

    def start(self, message: str, value: int) -> int:
        self.next_id += 1
        self.events.append(("start", message, value, self.next_id))
        return self.next_id

    def end(self, range_id: int) -> None:
        self.events.append(("end", range_id))

    def kinds(self) -> list[str]:
        return [e[0] for e in self.events]

    def opened(self) -> list[tuple]:
        return [e for e in self.events if e[0] in ("push", "start")]


@pytest.fixture
def fake(monkeypatch):
    """The fake NVTX API, handed out by the seam's one loader (with a count of loads)."""
    api = FakeNvtx()

    def load():
        api.loads += 1
        return api

    monkeypatch.setattr(nvtx_seam, "_load_backend", load)
    return api


def _span_hex(span) -> str:
    return format(span.context.span_id, "016x")


@pytest.mark.parametrize("in_payload", [True, False], ids=["payload", "message"])
@pytest.mark.parametrize("level", [1, 3])
def test_each_call_pushes_a_range_named_like_its_span_with_the_exported_span_id(
    otel_gpu_spans, module_factory, fake, level, in_payload
):
    """The range's name is the exported span's name and its span id is the exported span's: in
    the payload (as a signed 64-bit value) where the API has one, else in the message as
    ``<name> span_id=<16 hex>``; every push is popped."""
    fake.payload = in_payload
    spans = otel_gpu_spans(level=level, nvtx=True)
    lib = module_factory(LIB)
    for i in range(3):
        assert lib.inner(i) == i + 1
    exported = spans.get()
    assert len(exported) == 3
    pushes = [e for e in fake.events if e[0] == "push"]
    assert len(pushes) == 3 and fake.kinds().count("pop") == 3
    for (_, message, value, _), span in zip(pushes, exported):
        if in_payload:
            assert message == span.name
            assert nvtx_seam.span_id_hex(value) == _span_hex(span)
            assert -(2**63) <= value < 2**63  # what an NVTX INT64 payload holds
        else:
            assert message == f"{span.name} span_id={_span_hex(span)}"
    assert fake.loads == 1  # the API is loaded once per pipeline, not per call


def test_nested_calls_push_and_pop_nested_as_their_spans(otel_gpu_spans, module_factory, fake):
    """A decorated call inside a decorated call: push outer, push inner, pop, pop — the inner
    range carries the child span's id, the outer the parent's."""
    spans = otel_gpu_spans(level=1, nvtx=True)
    lib = module_factory(LIB)
    assert lib.outer(1) == 4
    by_name = {s.name.rsplit(".", 1)[-1]: s for s in spans.get()}
    assert by_name["inner"].parent.span_id == by_name["outer"].context.span_id
    assert fake.kinds() == ["push", "push", "pop", "pop"]
    first, second = fake.events[0], fake.events[1]
    assert nvtx_seam.span_id_hex(first[2]) == _span_hex(by_name["outer"])
    assert nvtx_seam.span_id_hex(second[2]) == _span_hex(by_name["inner"])


def test_a_raising_call_still_pops_and_the_users_exception_passes_through(
    otel_gpu_spans, module_factory, fake
):
    """The call raised: its range is popped all the same, and the caller gets the very same
    exception object; the span is exported as an error."""
    spans = otel_gpu_spans(level=1, nvtx=True)
    lib = module_factory(LIB)
    error = lib.Boom("bad input")
    with pytest.raises(lib.Boom) as caught:
        lib.fails(error)
    assert caught.value is error
    assert fake.kinds() == ["push", "pop"]
    (span,) = spans.get()
    assert not span.status.is_ok


@pytest.mark.parametrize("setting", [None, False])
def test_off_builds_no_observer_and_never_loads_nvtx(otel_gpu_spans, module_factory, fake, setting):
    """Default (and ``nvtx=False``): the NVTX API is never loaded, no observer is built, no call
    pushes anything."""
    settings = {} if setting is None else {"nvtx": setting}
    spans = otel_gpu_spans(level=1, **settings)
    lib = module_factory(LIB)
    assert lib.outer(1) == 4
    assert len(spans.get()) == 2
    pipe = pipeline.current()
    assert pipe is not None
    assert not any(isinstance(o, nvtx_seam.NvtxRanges) for o in pipe.observers)
    assert fake.loads == 0 and fake.events == []


def test_on_builds_one_observer_at_level_1(otel_gpu_spans, module_factory, fake):
    """On: exactly one NVTX observer, serving level 1 and up."""
    otel_gpu_spans(level=1, nvtx=True, journal=False)
    lib = module_factory(LIB)
    lib.inner(1)
    pipe = pipeline.current()
    assert pipe is not None
    ranges = [o for o in pipe.observers if isinstance(o, nvtx_seam.NvtxRanges)]
    assert len(ranges) == 1 and ranges[0].min_level == 1
    assert pipe.observers_at[1] == tuple(ranges)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_calls_under_torch_compile_fullgraph_push_nothing_and_do_not_break_the_graph(
    otel_gpu_spans, module_factory, fake, backend
):
    """Compiled with fullgraph: no graph break, no NVTX call while tracing nor when the graph
    runs, while the spans of the compiled calls are still exported; the same function called
    eagerly pushes (so the fake is wired)."""
    spans = otel_gpu_spans(level=1, nvtx=True)
    lib = module_factory(LIB)
    x = torch.randn(4)
    expected = lib.outer(x)
    assert fake.kinds() == ["push", "push", "pop", "pop"]
    fake.events.clear()
    spans.clear()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lib.outer, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), expected)
    torch.testing.assert_close(compiled(x), expected)
    assert sum(counters["graph_break"].values()) == 0
    assert fake.events == []
    got = [s for s in spans.get() if s.attributes.get("otel_gpu.compiled")]
    assert len(got) == 4


def test_the_observer_itself_skips_while_compiling(otel_gpu_spans, module_factory, fake):
    """Should an observer run while torch.compile traces (the wrapper normally takes the compiled
    path before any observer), the NVTX observer opens and closes nothing."""
    from otel_gpu.calls.decorator import _begin

    otel_gpu_spans(level=1, nvtx=True)
    lib = module_factory(LIB)
    lib.inner(0)
    pipe = pipeline.current()
    assert pipe is not None
    (ranges,) = [o for o in pipe.observers if isinstance(o, nvtx_seam.NvtxRanges)]
    fake.events.clear()
    call = _begin(lib.inner.__otel_gpu_plan__, pipe)
    ranges._is_compiling = lambda: True
    ranges.start(call)
    ranges._is_compiling = lambda: False
    ranges.end(call)
    assert fake.events == []


class _Capture:
    on = False


@pytest.fixture
def capture(monkeypatch):
    """A faked CUDA: ``cuda.is_capturing`` follows ``_Capture.on``."""
    _Capture.on = False
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "is_capturing", lambda: _Capture.on)
    yield _Capture
    _Capture.on = False


def test_calls_during_cuda_graph_capture_push_nothing(
    otel_gpu_spans, module_factory, fake, capture
):
    """During a (faked) capture no range is opened or closed; before and after it, calls push."""
    otel_gpu_spans(level=1, nvtx=True)
    lib = module_factory(LIB)
    lib.inner(0)
    capture.on = True
    lib.outer(1)
    lib.inner(2)
    capture.on = False
    lib.inner(3)
    assert fake.kinds() == ["push", "pop", "push", "pop"]


def test_a_call_during_which_capture_begins_still_pops_its_range(
    otel_gpu_spans, module_factory, fake, capture
):
    """What a call opened is what it closes: a call that starts a capture (as capture_begin does)
    pops its range though capture is on when it ends; one that ends a capture pops nothing."""
    otel_gpu_spans(level=1, nvtx=True)
    lib = module_factory(
        """
        import otel_gpu

        @otel_gpu.api
        def set_capture(state, on):
            state.on = on
        """
    )
    lib.set_capture(capture, True)
    assert fake.kinds() == ["push", "pop"]
    lib.set_capture(capture, False)
    assert fake.kinds() == ["push", "pop"]


def test_calls_in_an_unsampled_trace_open_no_range(otel_gpu_spans, module_factory, fake):
    """Under a parent the sampler dropped, a call has no span and opens no range."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    spans = otel_gpu_spans(level=1, nvtx=True)
    lib = module_factory(LIB)
    dropped = NonRecordingSpan(SpanContext(7, 9, False, TraceFlags(TraceFlags.DEFAULT)))
    with trace.use_span(dropped):
        assert lib.outer(1) == 4
    assert fake.events == [] and spans.get() == []
    assert lib.inner(1) == 2  # sampled again: a range
    assert fake.kinds() == ["push", "pop"]


def test_no_nvtx_api_gives_one_warning_and_calls_run_unaffected(
    otel_gpu_spans, module_factory, monkeypatch, caplog
):
    """No NVTX API (a CPU build of torch, no nvtx package): one warning naming why, no observer,
    and calls return their results and export their spans as before, across a reconfiguration."""
    loads = []

    def unavailable():
        loads.append(1)
        raise nvtx_seam.NvtxUnavailable("torch 2.x is built without NVTX")

    monkeypatch.setattr(nvtx_seam, "_load_backend", unavailable)
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        spans = otel_gpu_spans(level=1, nvtx=True)
        lib = module_factory(LIB)
        assert lib.outer(1) == 4
        assert len(spans.get()) == 2
        spans = otel_gpu_spans(level=1, nvtx=True)  # a new pipeline tries again, quietly
        assert lib.outer(2) == 6
        assert len(spans.get()) == 2
    warnings = [r.getMessage() for r in caplog.records if "NVTX" in r.getMessage()]
    assert len(warnings) == 1 and len(loads) == 2
    assert "built without NVTX" in warnings[0] and "OTEL_GPU_NVTX=true" in warnings[0]
    pipe = pipeline.current()
    assert pipe is not None
    assert not any(isinstance(o, nvtx_seam.NvtxRanges) for o in pipe.observers)


def test_on_this_machine_the_real_loader_answers_or_says_why():
    """The real loader either returns an API with the four range calls or raises
    NvtxUnavailable with a reason naming both candidates; it never raises anything else."""
    try:
        backend = nvtx_seam._load_backend()
    except nvtx_seam.NvtxUnavailable as exc:
        assert "nvtx package" in str(exc) and "torch.cuda.nvtx" in str(exc)
    else:
        assert all(callable(getattr(backend, n)) for n in ("push", "pop", "start", "end"))


class _Recorder:
    """Stands in for an NVTX module or domain: records each call by name."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return 7 if name in ("start_range", "rangeStartA") else None

        return record


def test_the_loader_prefers_the_nvtx_package_and_passes_the_id_as_payload(monkeypatch):
    """An importable nvtx package is used: ranges in the otel_gpu domain, the span name as the
    message and the payload as given; start returns the package's handle and end takes it."""
    import sys
    import types

    domain = _Recorder()
    module = types.ModuleType("nvtx")
    module.get_domain = lambda name: domain if name == "otel_gpu" else None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvtx", module)
    backend = nvtx_seam._load_backend()
    assert backend.payload is True
    backend.push("lib.f", -5)
    backend.pop()
    assert backend.start("lib.g", 3) == 7
    backend.end(7)
    assert domain.calls[0][0] == "get_event_attributes"  # the payload probe, once
    assert domain.calls[1:] == [
        ("push_range", (), {"message": "lib.f", "payload": -5}),
        ("pop_range", (), {}),
        ("start_range", (), {"message": "lib.g", "payload": 3}),
        ("end_range", (7,), {}),
    ]


def test_without_the_nvtx_package_torch_cuda_nvtx_carries_the_message(monkeypatch):
    """No nvtx package, a torch built with NVTX: torch.cuda.nvtx is used, messages only."""
    import sys

    import torch.cuda.nvtx as torch_nvtx

    bindings = _Recorder()
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx raises ImportError
    monkeypatch.setattr(torch._C, "_nvtx", bindings, raising=False)
    monkeypatch.setattr(torch_nvtx, "_nvtx", bindings)
    backend = nvtx_seam._load_backend()
    assert backend.payload is False
    backend.push("lib.f span_id=00000000000000ff", 255)
    backend.pop()
    assert backend.start("lib.g span_id=0000000000000001", 1) == 7
    backend.end(7)
    assert bindings.calls == [
        ("rangePushA", ("lib.f span_id=00000000000000ff",), {}),
        ("rangePop", (), {}),
        ("rangeStartA", ("lib.g span_id=0000000000000001",), {}),
        ("rangeEnd", (7,), {}),
    ]


def test_an_nvtx_package_without_payloads_is_passed_over_with_its_reason(monkeypatch):
    """A release of the nvtx package whose event attributes take no payload is not used; with no
    torch NVTX either, the reason names both."""
    import sys
    import types

    class OldDomain:
        def get_event_attributes(self, message=None, color=None, category=None):
            return None

    module = types.ModuleType("nvtx")
    module.get_domain = lambda name: OldDomain()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvtx", module)
    monkeypatch.delattr(torch._C, "_nvtx", raising=False)
    with pytest.raises(nvtx_seam.NvtxUnavailable) as caught:
        nvtx_seam._load_backend()
    assert "the nvtx package: TypeError" in str(caught.value)
    assert "built without NVTX" in str(caught.value)


def test_a_failing_nvtx_call_never_breaks_the_call_and_leaves_nothing_to_pop(
    otel_gpu_spans, module_factory, fake, monkeypatch
):
    """Outside strict mode, a push that raises is an internal error: the call returns its
    result, its span is exported, and its end pops nothing (no pop without a push)."""

    def broken(message: str, value: int) -> None:
        raise OSError("nvtx exploded")

    monkeypatch.setattr(fake, "push", broken)
    spans = otel_gpu_spans(level=1, nvtx=True, strict=False)
    _guard.set_strict(False)
    lib = module_factory(LIB)
    assert lib.inner(1) == 2
    assert len(spans.get()) == 1
    assert fake.events == []
    assert _guard.internal_error_counts().get("observer") == 1


def test_calls_on_two_threads_each_push_and_pop_on_their_own_thread(
    otel_gpu_spans, module_factory, fake
):
    """Thread ranges stay per thread: each thread's pushes and pops alternate on that thread."""
    otel_gpu_spans(level=1, nvtx=True)
    lib = module_factory(LIB)
    gate = threading.Barrier(2)

    def work():
        gate.wait()
        for i in range(50):
            lib.outer(i)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_thread: dict[int, list[str]] = {}
    for event in fake.events:
        by_thread.setdefault(event[-1], []).append(event[0])
    assert len(by_thread) == 2
    for kinds in by_thread.values():
        assert kinds == ["push", "push", "pop", "pop"] * 50


def test_coroutines_on_an_event_loop_use_process_ranges_each_ended_by_its_own_handle(
    otel_gpu_spans, module_factory, fake
):
    """Interleaved decorated coroutines: each call starts a process range and ends exactly the
    range it started (a pop would close the other coroutine's range)."""
    spans = otel_gpu_spans(level=1, nvtx=True)
    lib = module_factory(
        """
        import asyncio
        import otel_gpu

        @otel_gpu.api
        async def step(first, second):
            await first.wait()
            second.set()
        """
    )

    async def run():
        a, b, c = asyncio.Event(), asyncio.Event(), asyncio.Event()
        c.set()
        slow = asyncio.ensure_future(lib.step(a, b))  # waits for `a`
        await asyncio.sleep(0)
        fast = asyncio.ensure_future(lib.step(c, a))  # starts second, ends first, sets `a`
        await asyncio.gather(slow, fast)

    asyncio.run(run())
    assert "push" not in fake.kinds() and "pop" not in fake.kinds()
    started = [e for e in fake.events if e[0] == "start"]
    ended = [e[1] for e in fake.events if e[0] == "end"]
    assert [e[0] for e in fake.events] == ["start", "start", "end", "end"]
    slow_id, fast_id = started[0][3], started[1][3]
    assert ended == [fast_id, slow_id]
    exported = {_span_hex(s) for s in spans.get()}
    assert {nvtx_seam.span_id_hex(e[2]) for e in started} == exported


@pytest.fixture
def world():
    """A one-rank gloo default group, destroyed afterwards."""
    import datetime

    import torch.distributed as dist

    from otel_gpu.instrumentation import torch_distributed

    torch_distributed._reset_for_tests()
    dist.init_process_group(
        "gloo", rank=0, world_size=1, store=dist.HashStore(), timeout=datetime.timedelta(seconds=60)
    )
    yield torch_distributed
    dist.destroy_process_group()
    torch_distributed._reset_for_tests()


def test_an_async_collective_ended_on_another_thread_closes_its_own_process_range(
    otel_gpu_spans, module_factory, fake, world
):
    """An async collective ends on the thread that completes its work, after later calls began:
    it starts a process range and that very range is ended from the other thread, while the
    decorated call in between pushes and pops its own thread range."""
    spans = otel_gpu_spans(level=1, nvtx=True)
    lib = module_factory(LIB)
    future: torch.futures.Future = torch.futures.Future()

    class Work:
        def get_future(self):
            return future

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return Work()

    wrapped = world.wrap(all_reduce, "all_reduce")
    wrapped(torch.ones(1), async_op=True)
    assert lib.inner(1) == 2
    finisher = threading.Thread(target=future.set_result, args=(None,))
    finisher.start()
    finisher.join()
    assert fake.kinds() == ["start", "push", "pop", "end"]
    started, ended = fake.events[0], fake.events[3]
    assert ended[1] == started[3]
    (collective,) = spans.by_name("torch.distributed.all_reduce")
    assert nvtx_seam.span_id_hex(started[2]) == _span_hex(collective)


@pytest.mark.parametrize(
    ("span_id", "value"),
    [(1, 1), (2**63 - 1, 2**63 - 1), (2**63, -(2**63)), (2**64 - 1, -1)],
)
def test_the_payload_is_the_span_ids_64_bits_as_a_signed_integer(span_id, value):
    """Ids at or above 2**63 wrap to negative (an INT64 payload); the hex comes back intact."""
    assert nvtx_seam.payload(span_id) == value
    assert nvtx_seam.span_id_hex(value) == format(span_id, "016x")
    assert nvtx_seam.message("lib.f", span_id, in_payload=False) == (
        f"lib.f span_id={span_id:016x}"
    )
    assert nvtx_seam.message("lib.f", span_id, in_payload=True) == "lib.f"


def test_the_nvtx_package_accepts_every_payload_value():
    """Where the nvtx package is installed, its event attributes take every payload the
    observer makes (a Python int above 2**63 - 1 overflows its INT64 payload)."""
    nvtx = pytest.importorskip("nvtx")
    from nvtx._lib import lib

    domain = nvtx.get_domain("otel_gpu")
    for span_id in (1, 2**63, 2**64 - 1):
        attributes = lib.EventAttributes(domain, None, None, None, nvtx_seam.payload(span_id))
        assert nvtx_seam.span_id_hex(attributes.payload) == format(span_id, "016x")
    with pytest.raises(OverflowError):
        lib.EventAttributes(domain, None, None, None, 2**64 - 1)
