"""The crash journal (otel_gpu.journal.writer): what is on disk while calls are in flight, and when.

These tests read the journal file with ``otel_gpu.journal.reader.read`` from inside and
outside decorated calls; the fault suite (tests/test_faults_crash.py) kills real
processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import tempfile
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.trace import SpanContext, TraceFlags

import otel_gpu
from otel_gpu import _guard, config
from otel_gpu.calls import metadata
from otel_gpu.core.record import Call, CallSpan
from otel_gpu.export import pipeline
from otel_gpu.journal import writer
from otel_gpu.journal.reader import read


def _journal() -> writer.Journal:
    pipe = pipeline.current()
    assert pipe is not None
    found = [o for o in pipe.observers if isinstance(o, writer.Journal)]
    assert len(found) == 1
    return found[0]


def _records() -> list[Any]:
    return read(_journal().path).records


@pytest.fixture
def jdir(tmp_path):
    return tmp_path / "journal"


def test_calls_in_flight_are_on_disk_with_ids_parent_name_and_inputs(otel_gpu_spans, jdir):
    """While nested calls run, the file holds one complete record each; after they return, none."""
    otel_gpu_spans(level=3, journal_dir=str(jdir))
    seen: dict[str, Any] = {}

    @otel_gpu.api
    def inner(q, *, scale=0.5, mode="fast"):
        seen["inner"] = trace.get_current_span().get_span_context()
        seen["records"] = _records()
        return q

    @otel_gpu.api
    def outer(x):
        seen["outer"] = trace.get_current_span().get_span_context()
        return inner(x[:, :2], mode="slow")

    before = time.time_ns()
    outer(torch.zeros(4, 3, dtype=torch.float16))
    records = {r.span_id: r for r in seen["records"]}
    assert set(records) == {seen["outer"].span_id, seen["inner"].span_id}
    rin, rout = records[seen["inner"].span_id], records[seen["outer"].span_id]
    assert rin.trace_id == rout.trace_id == seen["outer"].trace_id
    assert rin.parent_span_id == seen["outer"].span_id and rout.parent_span_id is None
    assert rin.name.endswith("inner") and rout.name.endswith("outer")
    assert rin.code["code.function.name"].endswith("inner")
    assert before <= rout.start_ns <= rin.start_ns <= time.time_ns()
    assert rin.thread_id == threading.get_ident()
    entries = {(e[0], e[1]): e for e in rin.inputs}
    assert entries[("q", metadata.TENSOR)][2:6] == ((4, 2), "torch.float16", "cpu", (3, 1))
    assert entries[("mode", metadata.VALUE)][2] == "slow"
    assert ("scale", metadata.DEFAULT) in entries
    assert _records() == []


def test_exception_and_base_exception_clear_the_record(otel_gpu_spans, jdir):
    """A call that raises (even KeyboardInterrupt) is over: it leaves no record behind."""
    otel_gpu_spans(level=1, journal_dir=str(jdir))

    @otel_gpu.api
    def boom(exc):
        assert len(_records()) == 1
        raise exc

    for exc in (ValueError("x"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            boom(exc)
        assert _records() == []


def test_level_1_records_ids_without_inputs(otel_gpu_spans, jdir):
    """At level 1 a record carries ids, name and clock but no input metadata (64-byte slots)."""
    otel_gpu_spans(level=1, journal_dir=str(jdir))
    got = []

    @otel_gpu.api
    def f(x):
        got.extend(_records())

    f(torch.ones(2))
    assert len(got) == 1 and got[0].inputs is None and not got[0].inputs_truncated
    assert _journal().stride == writer.SMALL_SLOT


def test_journal_and_directory_are_private(otel_gpu_spans, jdir):
    """The journal directory is created 0700 and the file 0600, whatever the umask."""
    old = os.umask(0)
    try:
        otel_gpu_spans(level=1, journal_dir=str(jdir / "nested"))

        @otel_gpu.api
        def f():
            return None

        f()
    finally:
        os.umask(old)
    path = _journal().path
    assert stat.S_IMODE(os.stat(jdir / "nested").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.path.dirname(path) == str(jdir / "nested")


def test_default_location_follows_xdg_runtime_dir_then_tmpdir(monkeypatch, tmp_path):
    """Default: $XDG_RUNTIME_DIR/otel-gpu; without it (or if it is not a directory) <tmp>/otel-gpu-<uid>."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert writer.default_dir() == str(tmp_path / "otel-gpu")
    assert writer.journal_dir(config.load()) == str(tmp_path / "otel-gpu")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert writer.default_dir() == str(tmp_path / "tmp" / f"otel-gpu-{os.getuid()}")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert writer.default_dir() == str(tmp_path / "tmp" / f"otel-gpu-{os.getuid()}")
    explicit = config.load(env={"OTEL_GPU_JOURNAL_DIR": "~/j"})
    assert writer.journal_dir(explicit) == os.path.expanduser("~/j")


def test_default_directory_is_created_private_and_loose_modes_are_tightened(
    otel_gpu_spans, monkeypatch, tmp_path
):
    """In a shared tmp, an existing otel-gpu-<uid> of ours with a loose mode is reset to 0700."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    default = tmp_path / f"otel-gpu-{os.getuid()}"
    default.mkdir(mode=0o777)
    default.chmod(0o777)
    otel_gpu_spans(level=1)

    @otel_gpu.api
    def f():
        return None

    f()
    assert os.path.dirname(_journal().path) == str(default)
    assert stat.S_IMODE(default.stat().st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create another user's directory")
def test_default_directory_of_another_user_or_a_symlink_is_refused(
    otel_gpu_spans, monkeypatch, tmp_path, caplog
):
    """A squatted otel-gpu-<uid> (another owner, or a symlink) is never used: one warning, no journal,
    and the calls run normally."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    default = tmp_path / f"otel-gpu-{os.getuid()}"
    for squat in ("chown", "symlink"):
        if squat == "chown":
            default.mkdir(mode=0o700)
            os.chown(default, 4242, 4242)
        else:
            target = tmp_path / "elsewhere"
            target.mkdir()
            default.symlink_to(target)
        _guard._reset()
        spans = otel_gpu_spans(level=1)

        @otel_gpu.api
        def f(x):
            return x + 1

        with caplog.at_level("WARNING", logger="otel_gpu"):
            assert [f(i) for i in range(3)] == [1, 2, 3]
        assert not any(isinstance(o, writer.Journal) for o in pipeline.current().observers)
        assert sum("crash journal disabled" in r.getMessage() for r in caplog.records) == 1
        assert len(spans.get()) == 3
        assert os.listdir(default) == []
        caplog.clear()
        pipeline.reset()
        if squat == "chown":
            default.rmdir()
        else:
            default.unlink()


def test_unusable_journal_directory_disables_the_journal_not_the_program(
    otel_gpu_spans, tmp_path, caplog
):
    """A journal directory that became unusable after configuration (a file took its place):
    warned once, spans still exported, calls unaffected. (A file there at configuration time
    is a ConfigError: see test_faults_config.)"""
    blocker = tmp_path / "file"
    spans = otel_gpu_spans(level=3, journal_dir=str(blocker))
    blocker.write_text("")

    @otel_gpu.api
    def f(x):
        return x * 2

    with caplog.at_level("WARNING", logger="otel_gpu"):
        assert [f(i) for i in range(5)] == [0, 2, 4, 6, 8]
    assert len(spans.get()) == 5
    assert sum("crash journal disabled" in r.getMessage() for r in caplog.records) == 1


def test_journal_off_writes_nothing(otel_gpu_spans, jdir):
    """OTEL_GPU_JOURNAL=false: no journal observer, no file."""
    otel_gpu_spans(level=3, journal=False, journal_dir=str(jdir))

    @otel_gpu.api
    def f():
        return 1

    f()
    assert not any(isinstance(o, writer.Journal) for o in pipeline.current().observers)
    assert not jdir.exists() or list(jdir.iterdir()) == []


def _one_call_journaled(otel_gpu_spans, jdir):
    """Level 1 with the journal in ``jdir``; returns a decorated ``f()`` already called once."""
    otel_gpu_spans(level=1, journal_dir=str(jdir))

    @otel_gpu.api
    def f():
        return 1

    f()
    return f


def test_reconfigure_and_shutdown_delete_the_journal(otel_gpu_spans, jdir):
    """A normal shutdown or reconfiguration leaves nothing to recover: the file is deleted."""
    f = _one_call_journaled(otel_gpu_spans, jdir)
    first = _journal().path
    assert os.path.exists(first)
    otel_gpu.configure(max_items=4)
    f()
    second = _journal().path
    assert second != first and not os.path.exists(first) and os.path.exists(second)
    pipeline.reset()
    assert list(jdir.iterdir()) == []


def test_calls_still_running_during_reconfigure_finish_cleanly(otel_gpu_spans, jdir):
    """A call in flight on another thread while the pipeline is rebuilt ends without error."""
    otel_gpu_spans(level=3, journal_dir=str(jdir))
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    @otel_gpu.api
    def slow(x):
        entered.set()
        release.wait(5)
        return x

    def run():
        try:
            slow(torch.ones(1))
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    assert entered.wait(5)
    otel_gpu.configure(max_items=3)  # closes the old journal under the running call
    release.set()
    worker.join(5)
    assert errors == []
    assert list(jdir.iterdir()) == []  # the old file is gone; no new pipeline was built yet


def test_heartbeat_tracks_the_export_thread(otel_gpu_spans, jdir):
    """The header's heartbeat advances every export-thread wake-up (the recovered spans' end time)."""
    _one_call_journaled(otel_gpu_spans, jdir)
    first = read(_journal().path).heartbeat_ns
    time.sleep(0.35)
    assert read(_journal().path).heartbeat_ns > first


def test_resource_of_the_process_is_in_the_header(otel_gpu_spans, jdir):
    """The first call stores the provider's resource (service.name, host, pid) for recovery."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=Resource({"service.name": "svc", "process.pid": 7}))
    otel_gpu_spans(level=1, journal_dir=str(jdir), tracer_provider=provider)

    @otel_gpu.api
    def f():
        return 1

    f()
    header = read(_journal().path)
    assert header.resource["service.name"] == "svc" and header.resource["process.pid"] == 7
    assert header.pid == os.getpid() and header.host and not header.closed


def test_secret_arguments_never_reach_the_journal_file(otel_gpu_spans, jdir):
    """A redacted argument's value is not written to disk, not even transiently."""
    otel_gpu_spans(level=3, journal_dir=str(jdir))
    secret = "hunter2-very-secret-value"
    raw: list[bytes] = []

    @otel_gpu.api
    def login(user, api_token):
        with open(_journal().path, "rb") as fh:
            raw.append(fh.read())
        return user

    login("ann", secret)
    assert raw and secret.encode() not in raw[0] and b"ann" in raw[0]


def test_object_reprs_are_never_called_on_the_callers_thread(otel_gpu_spans, jdir):
    """The journal keeps only the type name of arbitrary objects: no __repr__/__str__/__format__."""
    otel_gpu_spans(level=3, journal_dir=str(jdir))
    called: list[str] = []

    class Hostile:
        def __repr__(self):
            called.append(threading.current_thread().name)
            raise RuntimeError("repr")

        __str__ = __repr__

        def __format__(self, spec):
            return self.__repr__()

    got = []

    @otel_gpu.api
    def f(obj, items):
        got.extend(_records())

    f(Hostile(), [Hostile()])
    entries = {e[0]: e for e in got[0].inputs}
    assert entries["obj"] == (
        "obj",
        metadata.OBJECT,
        "test_object_reprs_are_never_called_on_the_callers_thread.<locals>.Hostile",
    )
    assert threading.main_thread().name not in called


def test_large_inputs_are_cut_to_the_slot_and_flagged(otel_gpu_spans, jdir):
    """Inputs beyond one 4 KiB slot are truncated (trailing arguments dropped) and marked so."""
    otel_gpu_spans(level=3, journal_dir=str(jdir), max_items=64)
    got = []

    @otel_gpu.api
    def f(**kwargs):
        got.extend(_records())

    f(**{f"k{i}": f"{i:03}" + "x" * 197 for i in range(40)})
    (record,) = got
    assert record.inputs_truncated
    assert 0 < len(record.inputs) < 41
    assert all(len(e[2]) == 200 for e in record.inputs if e[1] == metadata.VALUE)


def test_inputs_that_cannot_be_encoded_still_leave_a_record(otel_gpu_spans, jdir, monkeypatch):
    """If input metadata cannot be encoded, the call is journaled without inputs, the failure is
    reported once per kind, and the call's result is unchanged."""
    otel_gpu_spans(level=3, journal_dir=str(jdir), strict=False)
    _guard.set_strict(False)

    def broken(*args):
        raise RuntimeError("cannot encode")

    monkeypatch.setattr(writer, "_encode", broken)
    got = []

    @otel_gpu.api
    def f(w):
        got.extend(_records())
        return 5

    assert [f(object()), f(1)] == [5, 5]
    assert len(got) == 2 and all(r.inputs is None and r.inputs_error for r in got)
    assert _guard.internal_error_counts().get("journal") == 2


def test_slots_are_exhausted_gracefully(monkeypatch, otel_gpu_spans, jdir):
    """More calls in flight than slots: extra calls are counted in ``overflow``, others stay intact."""
    monkeypatch.setattr(writer, "SLOTS_SMALL", 3)
    otel_gpu_spans(level=1, journal_dir=str(jdir))
    depth_seen = []

    @otel_gpu.api
    def nest(n):
        if n:
            return nest(n - 1)
        depth_seen.append(sorted(r.name for r in _records()))
        return _journal().overflow

    assert nest(5) == 3
    assert len(depth_seen[0]) == 3
    assert _records() == [] and _journal().in_flight() == 0


def _fake_call(plan: Any, i: int, parent: SpanContext | None, inputs: list | None) -> Call:
    ctx = SpanContext(i * 7919 + 1, i + 1, False, TraceFlags(TraceFlags.SAMPLED))
    return Call(plan, CallSpan(ctx, plan.name), parent, 1_000_000 + i)


class _Plan:
    def __init__(self, name: str) -> None:
        self.name = name
        self.attributes = {"code.function.name": name}


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 50)), min_size=1, max_size=120))
def test_slot_reuse_never_mixes_records(tmp_path, ops):
    """Property: after any sequence of starts and ends, the file holds exactly the calls in flight,
    each with its own ids, parent, start time, plan and inputs, although slots are reused
    (4 slots, so the pool wraps and overflows constantly)."""
    settings_ = config.load(env={"OTEL_GPU_LOGLEVEL": "3"})
    old = writer.SLOTS_LARGE
    writer.SLOTS_LARGE = 4
    try:
        j = writer.Journal(str(tmp_path), settings_, None)
    finally:
        writer.SLOTS_LARGE = old
    plans = [_Plan(f"plan{n}") for n in range(3)]
    live: dict[int, Call] = {}
    counter = 0
    try:
        for is_start, pick in ops:
            if is_start or not live:
                counter += 1
                parent = None
                if live:
                    p = live[sorted(live)[pick % len(live)]]
                    parent = p.span.get_span_context()
                call = _fake_call(plans[pick % 3], counter, parent, None)
                call.inputs = [
                    ("n", metadata.VALUE, counter),
                    ("s", metadata.VALUE, "v" * (pick * 9)),
                ]
                j.start(call)
                if call.token is not None:
                    live[counter] = call
            else:
                key = sorted(live)[pick % len(live)]
                j.end(live.pop(key))
            on_disk = {r.span_id: r for r in read(j.path).records}
            assert set(on_disk) == {c.span.get_span_context().span_id for c in live.values()}
            for n, call in live.items():
                r = on_disk[call.span.get_span_context().span_id]
                assert r.trace_id == n * 7919 + 1 and r.start_ns == 1_000_000 + n
                assert r.name == call.plan.name
                assert r.parent_span_id == (call.parent.span_id if call.parent else None)
                assert r.inputs[0] == ("n", metadata.VALUE, n)
    finally:
        j.close()


def test_forked_child_never_writes_its_parents_journal(otel_gpu_spans, jdir):
    """A child forked inside a call finishes that call in its own process without clearing the
    parent's record, and makes its own journal for its own calls."""
    otel_gpu_spans(level=1, journal_dir=str(jdir))

    @otel_gpu.api
    def g():
        return 1

    @otel_gpu.api
    def f():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            return ("child", w)
        os.close(w)
        os.read(r, 1)  # the child has finished f() and called g()
        os.waitpid(pid, 0)
        os.close(r)
        return ("parent", len(_records()))

    who, value = f()
    if who == "child":  # pragma: no cover - runs in the forked child
        try:
            g()
            os.write(value, b"x")
        finally:
            os._exit(0)
    assert value == 1  # the parent's own in-flight record of f survived the child's return


def test_async_calls_are_journaled_at_level_1(otel_gpu_spans, jdir):
    """An async decorated call in flight at level 1 is in the journal, like a sync one."""
    otel_gpu_spans(level=1, journal_dir=str(jdir))
    got = []

    @otel_gpu.api
    async def f():
        got.extend(_records())

    asyncio.run(f())
    assert len(got) == 1


def test_a_full_disk_disables_the_journal_at_creation(otel_gpu_spans, jdir, monkeypatch, caplog):
    """The journal's blocks are reserved when it is created: no space (ENOSPC) means no journal
    and one warning, never a SIGBUS in a later call; the calls and their spans go on."""
    import errno as errno_

    def full(fd, offset, length):
        raise OSError(errno_.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    spans = otel_gpu_spans(level=1, journal_dir=str(jdir))

    @otel_gpu.api
    def f(x):
        return x

    with caplog.at_level("WARNING", logger="otel_gpu"):
        assert [f(i) for i in range(3)] == [0, 1, 2]
    assert len(spans.get()) == 3
    assert any("crash journal disabled" in r.getMessage() for r in caplog.records)
    assert list(jdir.iterdir()) == []  # the half-made file is removed


def test_filesystems_without_fallocate_get_zeros_written(otel_gpu_spans, jdir, monkeypatch):
    """Where posix_fallocate is unsupported (EOPNOTSUPP), the file is filled with zeros instead,
    so the journal still exists with every block allocated."""
    import errno as errno_

    def unsupported(fd, offset, length):
        raise OSError(errno_.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    otel_gpu_spans(level=3, journal_dir=str(jdir))
    got = []

    @otel_gpu.api
    def f(x):
        got.extend(_records())

    f(1)
    info = os.stat(_journal().path)
    assert len(got) == 1 and info.st_blocks * 512 >= info.st_size


def test_a_full_plan_table_never_mislabels_a_record(tmp_path, monkeypatch):
    """Span names live in a table written once per function; when it is full, further functions'
    records read back as "unknown", and a small entry that still fits after a big one that did
    not keeps every record's name right."""
    monkeypatch.setattr(writer, "PLANS_SIZE", 160)
    j = writer.Journal(str(tmp_path), config.load(env={"OTEL_GPU_LOGLEVEL": "1"}), None)
    plans = [_Plan("a" * 40), _Plan("b" * 200), _Plan("c"), _Plan("d" * 300)]
    calls = [_fake_call(p, i, None, None) for i, p in enumerate(plans)]
    try:
        for call in calls:
            j.start(call)
        names = {r.span_id: r.name for r in read(j.path).records}
        got = [names[c.span.get_span_context().span_id] for c in calls]
        assert got == ["a" * 40, "unknown", "c", "unknown"]
    finally:
        j.close()


def test_the_encoding_cache_keeps_scalar_types_apart(tmp_path):
    """Cached encodings are keyed by the inputs, which compare 1 == 1.0 == True: a call with True
    after one with 1 (same layout) is journaled as True, not as the cached 1."""
    import pickle

    from otel_gpu import config
    from otel_gpu.journal import writer

    settings = config.load({"level": 3, "journal_dir": str(tmp_path)})
    j = writer.Journal(str(tmp_path), settings, None)
    try:
        decoded = []
        for value in (1, True, 1.0, 1):
            blob, truncated = j._encoded((("flag", metadata.VALUE, value),))
            assert not truncated
            decoded.append(pickle.loads(blob)[0][2])
        assert [type(v) for v in decoded] == [int, bool, float, int]
        assert j._encoded((("flag", metadata.VALUE, 1),)) is j._encoded(
            (("flag", metadata.VALUE, 1),)
        )
    finally:
        j.close()


def test_bytes_written_counts_records_inputs_and_plan_entries(tmp_path):
    """``bytes_written`` grows by what each call stores in the mapping: the plan's entry the first
    time a function is seen, the record and its encoded inputs at the start, the cleared commit
    word at the end; a call that finds every slot taken writes nothing and adds nothing."""
    old = writer.SLOTS_LARGE
    writer.SLOTS_LARGE = 1
    try:
        j = writer.Journal(str(tmp_path), config.load(env={"OTEL_GPU_LOGLEVEL": "3"}), None)
    finally:
        writer.SLOTS_LARGE = old
    try:
        assert j.bytes_written == 0
        plan = _Plan("f")
        first = _fake_call(plan, 1, None, None)
        first.inputs = (("n", metadata.VALUE, 7), ("s", metadata.VALUE, "abc"))
        j.start(first)
        record = read(j.path).records[0]
        assert record.inputs == [("n", metadata.VALUE, 7), ("s", metadata.VALUE, "abc")]
        blob, _ = j._encoded(first.inputs)
        entry = json.dumps(["f", {"code.function.name": "f"}]).encode()
        after_start = j.bytes_written
        assert after_start == (4 + len(entry)) + 64 + len(blob)
        second = _fake_call(plan, 2, None, None)
        j.start(second)  # the only slot is taken: not journaled
        assert second.token is None and j.overflow == 1
        assert j.bytes_written == after_start
        j.end(first)
        assert j.bytes_written == after_start + 8
        again = _fake_call(plan, 3, None, None)
        j.start(again)  # the plan is known: record only, no inputs
        assert j.bytes_written == after_start + 8 + 64
    finally:
        j.close()


def test_calls_differing_only_in_which_object_they_pass_share_one_encoding(tmp_path, monkeypatch):
    """An object argument is journaled by its type name only, so a new object each call (a
    model's KV cache) reuses the cached encoding, while a different type or value is encoded
    again; the record read back names the object's type."""
    settings = config.load({"level": 3, "journal_dir": str(tmp_path)})
    j = writer.Journal(str(tmp_path), settings, None)
    encoded = []
    real = writer._encode
    monkeypatch.setattr(writer, "_encode", lambda *a: encoded.append(1) or real(*a))

    class Cache:
        pass

    try:
        blobs = []
        for _ in range(3):
            raw: list = []
            metadata.capture(raw, "past", Cache(), 8, None)
            raw.append(("n", metadata.VALUE, 4))
            blobs.append(j._encoded(tuple(raw)))
        assert len(encoded) == 1 and blobs[0] is blobs[1] is blobs[2]
        raw = []
        metadata.capture(raw, "past", Cache(), 8, None)
        raw.append(("n", metadata.VALUE, 5))
        j._encoded(tuple(raw))
        assert len(encoded) == 2
        plan = _Plan("f")
        call = _fake_call(plan, 1, None, None)
        call.inputs = tuple(raw)
        j.start(call)
        (record,) = read(j.path).records
        assert record.inputs[0][:3] == ("past", metadata.OBJECT, Cache.__qualname__)
        assert record.inputs[1] == ("n", metadata.VALUE, 5)
    finally:
        j.close()
