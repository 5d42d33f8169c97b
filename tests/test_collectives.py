"""The ``torch.distributed`` target: every collective and p2p call is a span with its group, its
rank, a per-group sequence number and ``async_op``, through any alias; async calls end when
their work completes; the program's results and exceptions are untouched.

These run in process on a one-rank gloo group; the real 4-rank job (spans with the right
sequence numbers on every rank, the target applied before ``torch.distributed`` is imported) is
in ``test_ranks.py``."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from distributed_job import wait_for

import otel_gpu
from otel_gpu.instrumentation import torch_distributed

ORIGINALS = {op: getattr(c10d, op) for op in torch_distributed.OPS}


@pytest.fixture
def world():
    """A one-rank gloo default group, destroyed afterwards; fresh sequence counters."""
    torch_distributed._reset_for_tests()
    store = dist.HashStore()
    dist.init_process_group(
        "gloo", rank=0, world_size=1, store=store, timeout=datetime.timedelta(seconds=60)
    )
    yield
    dist.destroy_process_group()
    torch_distributed._reset_for_tests()


def _collectives(spans):
    return [s for s in spans.get() if s.name.startswith("torch.distributed.")]


def test_collectives_through_every_alias_are_spans_with_group_and_sequence(otel_gpu_spans, world):
    """dist.X and distributed_c10d.X are both patched; each span names its op, the group (name,
    id, ranks, size), the rank in it and a sequence number counting calls on the group."""
    spans = otel_gpu_spans(level=3)
    done = otel_gpu.instrument("torch.distributed")
    assert "torch.distributed.distributed_c10d.all_reduce" in done
    t = torch.ones(4)
    dist.all_reduce(t)
    c10d.all_reduce(t)
    dist.broadcast(t, src=0)
    dist.barrier()
    assert torch.equal(t, torch.ones(4))  # the collective's result is the program's
    got = _collectives(spans)
    assert [s.name for s in got] == [
        "torch.distributed.all_reduce",
        "torch.distributed.all_reduce",
        "torch.distributed.broadcast",
        "torch.distributed.barrier",
    ]
    assert [s.attributes["otel_gpu.collective.seq"] for s in got] == [1, 2, 3, 4]
    first = got[0].attributes
    assert first["otel_gpu.collective.op"] == "all_reduce"
    assert first["otel_gpu.collective.group.id"] == "0"
    assert first["otel_gpu.collective.group.name"] == "default_pg"
    assert tuple(first["otel_gpu.collective.group.ranks"]) == (0,)
    assert first["otel_gpu.collective.group.size"] == 1
    assert first["otel_gpu.collective.group.rank"] == 0
    assert first["otel_gpu.collective.async_op"] is False
    assert tuple(first["otel_gpu.input.tensor.shape"]) == (4,)  # level >= 3: tensor metadata
    assert first["otel_gpu.input.tensor.dtype"] == "torch.float32"
    assert got[2].attributes["otel_gpu.collective.peer"] == 0  # broadcast's src


def test_each_group_has_its_own_sequence(otel_gpu_spans, world):
    """A second group counts from 1 on its own; the default group's count goes on."""
    spans = otel_gpu_spans(level=1)
    otel_gpu.instrument("torch.distributed")
    other = dist.new_group([0], backend="gloo")
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.all_reduce(t, group=other)
    dist.all_reduce(t, group=other)
    dist.all_reduce(t)
    seqs = [
        (s.attributes["otel_gpu.collective.group.id"], s.attributes["otel_gpu.collective.seq"])
        for s in _collectives(spans)
    ]
    other_id = seqs[1][0]
    assert other_id != "0"
    assert seqs == [("0", 1), (other_id, 1), (other_id, 2), ("0", 2)]


def test_an_async_collective_ends_when_its_work_completes(otel_gpu_spans, world):
    """async_op=True: the span ends when the work's future completes, not when the call
    returns, and says so; the program gets the very Work torch returned."""
    spans = otel_gpu_spans(level=1)
    future: torch.futures.Future = torch.futures.Future()

    class Work:
        def get_future(self):
            return future

    work = Work()

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return work

    wrapped = torch_distributed.wrap(all_reduce, "all_reduce")
    assert wrapped(torch.ones(1), async_op=True) is work
    otel_gpu.flush()
    assert _collectives(spans) == []  # in flight: no span yet
    time.sleep(0.01)  # so the completion time is visibly after the return
    returned = time.time_ns()
    future.set_result(None)
    otel_gpu.flush()
    (span,) = _collectives(spans)
    assert span.attributes["otel_gpu.collective.async_op"] is True
    assert span.attributes["otel_gpu.collective.async_end"] == "work_completed"
    assert span.end_time >= returned


def test_an_async_collective_without_a_future_ends_at_return_and_says_so(otel_gpu_spans, world):
    """A backend whose work has no future: the span ends as the call returns, marked so."""
    spans = otel_gpu_spans(level=1)

    class Work:
        def get_future(self):
            raise RuntimeError("not supported by this backend")

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        return Work()

    torch_distributed.wrap(isend, "isend")(torch.ones(1), 0)
    otel_gpu.flush()
    (span,) = _collectives(spans)
    assert span.attributes["otel_gpu.collective.async_end"] == "call_returned"
    assert span.attributes["otel_gpu.collective.peer"] == 0


@pytest.mark.parametrize("async_op", [False, True])
def test_the_programs_exception_passes_through_as_the_same_object(otel_gpu_spans, world, async_op):
    """A collective that raises: the caller gets its very exception, the span is ERROR."""
    spans = otel_gpu_spans(level=1)
    error = RuntimeError("connection reset by peer")

    def all_reduce(tensor, op=None, group=None, async_op=False):
        raise error

    wrapped = torch_distributed.wrap(all_reduce, "all_reduce")
    with pytest.raises(RuntimeError) as caught:
        wrapped(torch.ones(1), async_op=async_op)
    assert caught.value is error
    otel_gpu.flush()
    (span,) = _collectives(spans)
    assert span.status.status_code.name == "ERROR"


def test_uninstrument_puts_back_torchs_own_functions(otel_gpu_spans, world):
    """uninstrument('torch.distributed') restores every function in every alias."""
    spans = otel_gpu_spans(level=1)
    otel_gpu.instrument("torch.distributed")
    assert dist.all_reduce is not ORIGINALS["all_reduce"]
    assert dist.all_reduce is c10d.all_reduce  # the alias got the same wrapper
    otel_gpu.uninstrument("torch.distributed")
    for op, original in ORIGINALS.items():
        assert getattr(c10d, op) is original
        assert getattr(dist, op) is original
    dist.all_reduce(torch.ones(1))
    assert _collectives(spans) == []


def test_level_zero_patches_nothing(otel_gpu_spans):
    """At level 0 the target patches nothing: torch's functions stay themselves."""
    otel_gpu_spans(level=0)
    assert otel_gpu.instrument("torch.distributed") == []
    assert dist.all_reduce is ORIGINALS["all_reduce"]


def test_point_to_point_calls_are_counted_apart_per_pair(otel_gpu_spans, world):
    """send/recv numbering is per pair of ranks, so it never shifts the group's collective
    numbering (ranks not involved in a send never see it)."""
    spans = otel_gpu_spans(level=1)

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        return None

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    send_ = torch_distributed.wrap(send, "send")
    all_reduce_ = torch_distributed.wrap(all_reduce, "all_reduce")
    t = torch.ones(1)
    all_reduce_(t)
    send_(t, 0)
    send_(t, group_dst=0)
    all_reduce_(t)
    got = [
        (s.attributes["otel_gpu.collective.op"], s.attributes["otel_gpu.collective.seq"])
        for s in _collectives(spans)
    ]
    assert got == [("all_reduce", 1), ("send", 1), ("send", 2), ("all_reduce", 2)]
    assert all(s.attributes.get("otel_gpu.collective.peer", 0) == 0 for s in _collectives(spans))


def test_a_module_imported_after_instrument_is_patched_when_imported(
    otel_gpu_spans, world, tmp_path, monkeypatch
):
    """Before the import: the target waits (post-import hook) and patches the functions when
    the module that defines them is imported, and the package that re-exports them too.

    ``import otel_gpu`` imports torch, hence torch.distributed, today, so this stands in a
    fresh package for distributed_c10d."""
    import importlib
    import sys
    import uuid

    name = f"fakedist_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text(f"from {name}.c10d import *\n")
    ops = "\n".join(
        f"def {op}(tensor=None, op=None, group=None, async_op=False):\n    return None\n"
        for op in torch_distributed.OPS
    )
    (tmp_path / name / "c10d.py").write_text(f"__all__ = {list(torch_distributed.OPS)!r}\n{ops}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch_distributed, "MODULE", f"{name}.c10d")
    spans = otel_gpu_spans(level=1)
    try:
        assert otel_gpu.instrument("torch.distributed") == ["torch.distributed (on import)"]
        assert f"{name}.c10d" not in sys.modules  # instrumenting never imports it
        package = importlib.import_module(name)
        package.all_reduce(torch.ones(1))
        sys.modules[f"{name}.c10d"].barrier()
        got = [(s.name, s.attributes["otel_gpu.collective.seq"]) for s in _collectives(spans)]
        assert got == [("torch.distributed.all_reduce", 1), ("torch.distributed.barrier", 2)]
    finally:
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]


def test_instrumenting_twice_patches_once_and_says_so(otel_gpu_spans, world):
    """A second instrument('torch.distributed') patches nothing more and reports nothing."""
    spans = otel_gpu_spans(level=1)
    assert otel_gpu.instrument("torch.distributed")
    assert otel_gpu.instrument("torch.distributed") == []
    dist.all_reduce(torch.ones(1))
    assert len(_collectives(spans)) == 1


def test_a_real_async_all_reduce_on_gloo_ends_by_its_future(otel_gpu_spans, world):
    """gloo's work has a future: a real async all_reduce's span says work_completed, and the
    program's wait() and result are torch's own."""
    spans = otel_gpu_spans(level=1)
    otel_gpu.instrument("torch.distributed")
    t = torch.full((3,), 2.0)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert torch.equal(t, torch.full((3,), 2.0))

    def exported() -> bool:  # the future's callback may run just after wait() returns
        otel_gpu.flush()
        return bool(_collectives(spans))

    wait_for(exported, "the async all_reduce's span")
    (span,) = _collectives(spans)
    assert span.attributes["otel_gpu.collective.async_op"] is True
    assert span.attributes["otel_gpu.collective.async_end"] == "work_completed"


def test_a_collective_torch_implements_through_another_is_one_span(otel_gpu_spans, world):
    """torch 2.13's send/recv call the patched isend/irecv inside: each blocking call is one span
    (the outer, the one the program called) and advances its pair's sequence once, so the peer's
    irecv lines up with it."""
    spans = otel_gpu_spans(level=1)

    class Work:
        def wait(self):
            return True

        def get_future(self):
            return None

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        return Work()

    isend_ = torch_distributed.wrap(isend, "isend")

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        isend_(tensor, dst, group, tag, group_dst).wait()  # as torch implements it

    send_ = torch_distributed.wrap(send, "send")
    t = torch.ones(1)
    send_(t, 0)
    send_(t, 0)
    isend_(t, 0).wait()  # the program's own isend is still a span
    got = [
        (s.attributes["otel_gpu.collective.op"], s.attributes["otel_gpu.collective.seq"])
        for s in _collectives(spans)
    ]
    assert got == [("send", 1), ("send", 2), ("isend", 3)]


def test_armed_at_level_0_live_control_raises_sync_and_async_collectives(
    otel_gpu_spans, world, tmp_path
):
    """Under OTEL_GPU_CONTROL=on at level 0 the target is patched (armed) and records nothing;
    raised by control, sync and async collectives are spans numbered after the calls made at
    level 0 (so ranks raised at different moments agree); lowered again, neither records, and
    no collective attribute lands on the program's own span meanwhile."""
    from opentelemetry import trace

    from otel_gpu.control import document, state

    spans = otel_gpu_spans(level=0, control="on", journal_dir=str(tmp_path / "journal"))
    try:
        assert otel_gpu.instrument("torch.distributed")
        assert dist.all_reduce is not ORIGINALS["all_reduce"]
        t = torch.ones(2)
        tracer = spans.provider.get_tracer("app")
        with tracer.start_as_current_span("app.step"):
            dist.all_reduce(t)
            dist.all_reduce(t, async_op=True).wait()
        otel_gpu.flush()
        assert _collectives(spans) == []
        (app,) = [s for s in spans.get() if s.name == "app.step"]
        assert not any(k.startswith("otel_gpu.") for k in app.attributes)

        state.apply(document.parse({"level": 1, "for": None}), "test")
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()

        def both() -> bool:  # the async span ends in its future's callback
            otel_gpu.flush()
            return len(_collectives(spans)) == 2

        wait_for(both, "the raised collectives' spans")
        got = {s.attributes["otel_gpu.collective.async_op"]: s for s in _collectives(spans)}
        assert got[False].attributes["otel_gpu.collective.seq"] == 3
        assert got[True].attributes["otel_gpu.collective.seq"] == 4
        assert got[True].attributes["otel_gpu.collective.async_end"] == "work_completed"

        state.apply(document.parse({"level": 0, "for": None}), "test")
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        time.sleep(0.05)
        otel_gpu.flush()
        assert len(_collectives(spans)) == 2
        state.apply(document.parse({"level": 1, "for": None}), "test")
        dist.all_reduce(t)
        otel_gpu.flush()
        assert _collectives(spans)[-1].attributes["otel_gpu.collective.seq"] == 7
        assert trace.get_current_span() is trace.INVALID_SPAN
    finally:
        state.reset("test teardown")


def test_an_async_collective_follows_control_when_started_above_level_0(
    otel_gpu_spans, world, tmp_path
):
    """Armed at level 1 and raised to 3, an async collective records its inputs; lowered to 0,
    it records nothing."""
    from otel_gpu.control import document, state

    spans = otel_gpu_spans(level=1, control="on", journal_dir=str(tmp_path / "journal"))
    try:
        otel_gpu.instrument("torch.distributed")
        t = torch.ones(2)
        state.apply(document.parse({"level": 3, "for": None}), "test")
        dist.all_reduce(t, async_op=True).wait()

        def one() -> bool:
            otel_gpu.flush()
            return len(_collectives(spans)) == 1

        wait_for(one, "the async collective's span at level 3")
        (span,) = _collectives(spans)
        assert span.attributes["otel_gpu.input.tensor.shape"] == (2,)
        state.apply(document.parse({"level": 0, "for": None}), "test")
        dist.all_reduce(t, async_op=True).wait()
        time.sleep(0.05)
        otel_gpu.flush()
        assert len(_collectives(spans)) == 1
    finally:
        state.reset("test teardown")
