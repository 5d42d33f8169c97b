"""The call whose kernel faulted (``otel_gpu.cuda.fault``), through fake CUDA events: the
innermost call the resolver saw running and never saw finish is the suspect, the call the error
surfaced in names it; when the resolver saw nothing that tells the calls apart, the range of
candidates is named and the status says so. The crash journal keeps the verdict."""

from __future__ import annotations

import time

import pytest
from lib_sources import NESTED
from opentelemetry.trace import StatusCode
from pipelines import drain

from otel_gpu.attributes import (
    CUDA_FAULT,
    CUDA_FAULT_CANDIDATES,
    CUDA_FAULT_SUSPECT,
    DEVICE_DURATION,
    DEVICE_UNRESOLVED,
)
from otel_gpu.devices import events
from otel_gpu.export import pipeline

LIB = (
    NESTED
    + """
@otel_gpu.api
def sync(exc):
    if exc is not None:
        raise exc
"""
)

_ERROR = RuntimeError("CUDA error: device-side assert triggered")


def _hex(span) -> str:
    return format(span.context.span_id, "016x")


def _by_name(spans) -> dict:
    out: dict = {}
    for s in spans:
        out.setdefault(s.name.rsplit(".", 1)[1], []).append(s)
    return out


def test_the_call_seen_running_and_never_finished_is_the_suspect(
    otel_gpu_spans, module_factory, fake_events
):
    """inner #1 finished, inner #2 was seen started and never finished, inner #3 never started:
    after the sticky error, inner #2 is ERROR with fault = "kernel"; the call that raised names
    it in otel_gpu.cuda.fault.suspect, and its status says the error surfaced there."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    for i in range(3):
        lib.inner(i)
    e = fake_events.recorded
    now = time.time_ns() - 50_000_000
    fake_events.complete(e[0], now, 0)
    fake_events.complete(e[1], now, 1)  # inner 1 done
    fake_events.complete(e[2], now, 2)  # inner 2 started
    drain()  # the resolver looks
    fake_events.fail("device-side assert triggered")
    with pytest.raises(RuntimeError) as raised:
        lib.sync(_ERROR)
    assert raised.value is _ERROR
    got = _by_name(spans.get())
    first, second, third = got["inner"]
    (surfaced,) = got["sync"]
    assert DEVICE_DURATION in first.attributes and CUDA_FAULT not in first.attributes
    assert second.attributes[CUDA_FAULT] == "kernel"
    assert second.status.status_code is StatusCode.ERROR
    assert "device-side assert" in second.status.description
    assert CUDA_FAULT not in third.attributes and third.attributes[DEVICE_UNRESOLVED] is True
    assert surfaced.attributes[CUDA_FAULT] == "surfaced"
    assert surfaced.attributes[CUDA_FAULT_SUSPECT] == _hex(second)
    assert surfaced.status.description.startswith(
        f"CUDA error surfaced here, caused earlier by span {_hex(second)}"
    )


def test_when_nothing_tells_the_calls_apart_the_range_of_candidates_is_named(
    otel_gpu_spans, module_factory, fake_events
):
    """The fault came before the resolver looked: no call was seen running, so every call not
    seen finished is a candidate, earliest first, the raising call included; each candidate's
    span says so, and the raising call's status says they could not be told apart."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    lib.inner(0)
    now = time.time_ns() - 50_000_000
    fake_events.complete(fake_events.recorded[0], now, 0)
    fake_events.complete(fake_events.recorded[1], now, 1)
    drain()  # inner 0 seen finished
    lib.inner(1)
    lib.inner(2)
    fake_events.fail()
    with pytest.raises(RuntimeError):
        lib.sync(_ERROR)
    got = _by_name(spans.get())
    ok, one, two = got["inner"]
    (surfaced,) = got["sync"]
    ids = [_hex(one), _hex(two), _hex(surfaced)]
    assert surfaced.attributes[CUDA_FAULT_CANDIDATES] == tuple(ids)
    assert CUDA_FAULT_SUSPECT not in surfaced.attributes
    assert "one of 3 calls that could not be told apart" in surfaced.status.description
    for span in (one, two):
        assert span.attributes[CUDA_FAULT] == "candidate"
        assert span.attributes[CUDA_FAULT_CANDIDATES] == tuple(ids)
    assert CUDA_FAULT not in ok.attributes


def test_nested_calls_blame_the_innermost_open_one(otel_gpu_spans, module_factory, fake_events):
    """outer(inner): both seen started, neither finished: the inner call holds the kernel."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    lib.outer(1)
    o_start, i_start, _, _ = fake_events.recorded
    now = time.time_ns() - 50_000_000
    fake_events.complete(o_start, now, 0)
    fake_events.complete(i_start, now, 1)
    drain()
    fake_events.fail()
    with pytest.raises(RuntimeError):
        lib.sync(_ERROR)
    got = _by_name(spans.get())
    assert got["inner"][0].attributes[CUDA_FAULT] == "kernel"
    assert CUDA_FAULT not in got["outer"][0].attributes
    assert got["sync"][0].attributes[CUDA_FAULT_SUSPECT] == _hex(got["inner"][0])


def test_the_resolver_finding_the_error_first_marks_the_suspect(
    otel_gpu_spans, module_factory, fake_events
):
    """No call raised yet: the resolver's own query hits the sticky error; the call it saw
    running is ERROR with fault = "kernel" and unresolved, and a call raising later names it."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    lib.inner(1)
    fake_events.complete(fake_events.recorded[0], time.time_ns(), 0)
    drain()
    fake_events.fail()
    drain()
    with pytest.raises(RuntimeError):
        lib.sync(_ERROR)
    got = _by_name(spans.get())
    (inner,) = got["inner"]
    assert inner.attributes[CUDA_FAULT] == "kernel" and inner.attributes[DEVICE_UNRESOLVED]
    assert got["sync"][0].attributes[CUDA_FAULT_SUSPECT] == _hex(inner)


def test_a_call_that_faulted_itself_is_the_suspect_without_a_surfaced_note(
    otel_gpu_spans, module_factory, fake_events
):
    """The raising call was itself seen running (it synchronised inside): it is the suspect."""
    spans = otel_gpu_spans(level=1)
    seen = []

    def hook():
        fake_events.complete(fake_events.recorded[0], time.time_ns(), 0)
        drain()
        fake_events.fail()
        seen.append(True)
        raise _ERROR

    # the error raised from inside the call, after the resolver saw its start
    import otel_gpu

    @otel_gpu.api
    def synchronising():
        hook()

    with pytest.raises(RuntimeError):
        synchronising()
    (span,) = [s for s in spans.get() if s.name.endswith("synchronising")]
    assert span.attributes[CUDA_FAULT] == "kernel"
    assert CUDA_FAULT_SUSPECT not in span.attributes
    assert span.status.status_code is StatusCode.ERROR


def test_a_non_cuda_exception_names_no_suspect(otel_gpu_spans, module_factory, fake_events):
    """A ValueError is the user's, not a CUDA fault: no fault attribute anywhere."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    lib.inner(1)
    with pytest.raises(ValueError):
        lib.sync(ValueError("bad"))
    fake_events.fail()
    assert not any(CUDA_FAULT in s.attributes for s in spans.exporter.get_finished_spans())


@pytest.mark.parametrize(
    "exc, expected",
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA error: unspecified launch failure"), True),
        (RuntimeError("shape mismatch"), False),
        (RuntimeError("CUDA error: invalid argument"), False),  # not sticky: no kernel blamed
        (RuntimeError("CUDA error: misaligned address"), True),
        (ValueError("CUDA error: looks like one but is not a RuntimeError"), False),
        (type("AcceleratorError", (RuntimeError,), {})("device-side assert triggered"), True),
    ],
)
def test_cuda_errors_are_recognised_by_type_and_message(exc, expected):
    """A RuntimeError (torch.AcceleratorError is one) whose message names a sticky kernel
    fault: device-side assert, illegal memory access, launch failure, misaligned address."""
    assert events.is_cuda_error(exc) is expected


def test_the_crash_journal_keeps_the_suspect_for_recovery(
    otel_gpu_spans, module_factory, fake_events
):
    """The verdict is written to the process's journal when the error surfaces, so the spans
    `otel-gpu recover` rebuilds of a process that then died name the suspect."""
    from otel_gpu.journal import reader, recover
    from otel_gpu.journal.writer import Journal

    otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    lib.inner(1)
    fake_events.complete(fake_events.recorded[0], time.time_ns(), 0)
    drain()
    pairs = list(pipeline.current().device_time.active)
    suspect = format(pairs[0].call.span.span_id, "016x")
    fake_events.fail()
    with pytest.raises(RuntimeError):
        lib.sync(_ERROR)
    (journal,) = [o for o in pipeline.current().observers if isinstance(o, Journal)]
    read = reader.read(journal.path)
    assert read.fault is not None and read.fault["suspect"] == suspect
    assert "inner" in read.fault["names"][0]
    # a call in flight when the process died: its recovered span names the suspect
    attrs: dict = {}
    recover._fault_attributes(read.fault, "00000000000000aa", attrs)
    assert attrs[CUDA_FAULT] == "surfaced" and attrs[CUDA_FAULT_SUSPECT] == suspect
    # and `otel-gpu recover` says it in its own line, naming the span and the function
    line = recover.fault_text(read.fault)
    assert line.startswith(f"a CUDA kernel fault, caused by span {suspect} (") and "inner" in line


def test_recover_names_the_candidates_when_no_call_was_singled_out():
    """A verdict with candidates only: recover's line gives their count and the first names,
    never a suspect; no verdict, no line; names from the journal are made printable."""
    from otel_gpu.journal import recover

    fault = {
        "suspect": None,
        "candidates": ["00000000000000a1", "00000000000000a2", "00000000000000a3", "a4" * 8],
        "names": ["lib.one", "lib.two", "lib.three\x1b[2J", "lib.four"],
        "error": "CUDA error: an illegal memory access was encountered",
    }
    line = recover.fault_text(fault)
    assert line.startswith("a CUDA kernel fault, caused by one of 4 calls that could not be told")
    assert "lib.one, lib.two" in line and "lib.four" not in line and "\x1b" not in line
    assert "span" not in line
    assert recover.fault_text(None) == "" and recover.fault_text({"candidates": []}) == ""


@pytest.mark.parametrize("looked", [True, False], ids=["suspect", "candidates"])
def test_show_fault_prints_the_suspect_with_its_inputs(
    tmp_path, module_factory, fake_events, capsys, looked
):
    """`otel-gpu show --fault FILE`: where the error surfaced, then the suspect call with its
    inputs' metadata (level 3), or each candidate when no single call was singled out."""
    import otel_gpu
    from otel_gpu.cli import main

    path = tmp_path / "trace.jsonl"
    otel_gpu.configure(level=3, dest=str(path), strict=True)
    lib = module_factory(LIB)
    lib.inner(41)
    if looked:
        fake_events.complete(fake_events.recorded[0], time.time_ns(), 0)
        drain()
    fake_events.fail()
    with pytest.raises(RuntimeError):
        lib.sync(_ERROR)
    assert otel_gpu.flush()
    assert main(["show", "--fault", str(path)]) == 0
    text = capsys.readouterr().out
    assert "CUDA fault surfaced in " in text and ".sync (span " in text
    assert "x.value = 41" in text
    if looked:
        assert "caused by span " in text
    else:
        assert "could not be told apart" in text


def test_show_fault_without_a_fault_says_so(tmp_path, module_factory, fake_events, capsys):
    """A trace with no CUDA fault: exit 1 and one line saying why nothing is shown."""
    import otel_gpu
    from otel_gpu.cli import main

    path = tmp_path / "trace.jsonl"
    otel_gpu.configure(level=1, dest=str(path), strict=True)
    module_factory(LIB).inner(1)
    for event in fake_events.recorded:
        fake_events.complete(event, time.time_ns())
    assert otel_gpu.flush()
    assert main(["show", "--fault", str(path)]) == 1
    assert "No CUDA fault in" in capsys.readouterr().out


def test_a_fault_the_resolver_finds_is_journaled_before_any_call_raises(
    otel_gpu_spans, module_factory, fake_events
):
    """The export thread's query hits the sticky error first: the verdict is in the journal at
    once, for a process killed before its program ever raises."""
    from otel_gpu.journal import reader
    from otel_gpu.journal.writer import Journal

    otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    lib.inner(1)
    fake_events.complete(fake_events.recorded[0], time.time_ns(), 0)
    drain()
    (pair,) = list(pipeline.current().device_time.active)
    suspect = format(pair.call.span.span_id, "016x")
    fake_events.fail()
    drain()
    (journal,) = [o for o in pipeline.current().observers if isinstance(o, Journal)]
    assert reader.read(journal.path).fault["suspect"] == suspect
