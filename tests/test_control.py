"""Live control (``OTEL_GPU_CONTROL=on``, ``otel-gpu control``): armed functions whose path is
swapped for another level's, per function by glob, for a window; the control document and the
state in force; one ``otel_gpu.control`` span per change; the command's exit codes.

Malformed requests and planted files are in ``tests/hostile/test_hostile_control.py``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch
from commands import otel_gpu_command, without_otel
from distributed_job import wait_for
from jsonl_spans import read_spans
from lib_sources import ALPHA_BETA_LOOP
from lib_sources import progress as _progress

import otel_gpu
from otel_gpu.calls import armed
from otel_gpu.control import channel, document, state


@pytest.fixture
def controlled(otel_gpu_spans, tmp_path):
    """``start(level=0, **settings)``: otel-gpu configured with OTEL_GPU_CONTROL=on; the
    configured state is put back afterwards."""

    def start(level: int = 0, **settings):
        settings.setdefault("journal_dir", str(tmp_path / "journal"))
        return otel_gpu_spans(level=level, control="on", **settings)

    yield start
    state.reset("test teardown")


def _names(spans):
    return [s.name for s in spans.get() if s.name != "otel_gpu.control"]


def _apply(doc, source="test"):
    return state.apply(document.parse(doc), source)


def test_without_control_level_0_is_the_function_itself(otel_gpu_spans):
    """OTEL_GPU_CONTROL off (the default): level 0 returns the function object, unchanged."""
    otel_gpu_spans(level=0)

    def f(x):
        return x

    assert otel_gpu.api(f) is f


def test_armed_level_0_records_nothing_until_control_raises_it(controlled):
    """At armed level 0 a call records nothing; raised to 5 for the function, its calls are
    spans with statistics; reset, they record nothing again. The result is the function's."""
    spans = controlled(level=0)

    @otel_gpu.api
    def alpha(x):
        return x * 2

    t = torch.ones(3)
    assert alpha is not alpha.__wrapped__ and torch.equal(alpha(t), t * 2)
    otel_gpu.flush()
    assert _names(spans) == []
    _apply({"level": 5, "include": ["*alpha"], "for": None})
    assert torch.equal(alpha(t), t * 2)
    otel_gpu.flush()
    (span,) = [s for s in spans.get() if s.name.endswith("alpha")]
    assert any(e.name == "otel_gpu.stats" for e in span.events)
    state.reset("test")
    alpha(t)
    otel_gpu.flush()
    assert len([n for n in _names(spans) if n.endswith("alpha")]) == 1


def test_include_and_exclude_choose_the_functions_by_qualified_or_span_name(controlled):
    """Only functions matching an include glob and no exclude glob change level; a glob may
    match the span name given with name=."""
    spans = controlled(level=0)

    @otel_gpu.api
    def alpha_attention(x):
        return x

    @otel_gpu.api
    def alpha_norm(x):
        return x

    @otel_gpu.api(name="Decode.run")
    def beta(x):
        return x

    _apply({"level": 1, "include": ["*alpha*", "Decode.*"], "exclude": ["*norm"]})
    for fn in (alpha_attention, alpha_norm, beta):
        fn(1)
    otel_gpu.flush()
    assert sorted(n.rsplit(".", 1)[-1] for n in _names(spans)) == ["alpha_attention", "run"]


def test_a_function_decorated_at_level_1_can_be_lowered_raised_and_restored(controlled):
    """Control is not only for level 0: a level-1 function turned to 0 records nothing, to 3
    records its inputs, and after a reset records at level 1 again."""
    spans = controlled(level=1)

    @otel_gpu.api
    def gamma(x):
        return x

    _apply({"level": 0})
    gamma(1)
    otel_gpu.flush()
    assert _names(spans) == []
    _apply({"level": 3})
    gamma(2)
    otel_gpu.flush()
    (raised,) = [s for s in spans.get() if s.name.endswith("gamma")]
    assert raised.attributes["otel_gpu.input.x.value"] == 2
    state.reset("test")
    gamma(3)
    otel_gpu.flush()
    last = [s for s in spans.get() if s.name.endswith("gamma")][-1]
    assert "otel_gpu.input.x.value" not in last.attributes


def test_a_function_decorated_while_a_change_is_in_force_follows_it(controlled):
    """The rule is kept: a function armed after the change records at the changed level."""
    spans = controlled(level=0)
    _apply({"level": 1, "include": ["*late*"]})

    @otel_gpu.api
    def late(x):
        return x

    late(1)
    otel_gpu.flush()
    assert [n for n in _names(spans) if n.endswith("late")]


def test_an_async_function_is_armed_too(controlled):
    """A coroutine function stays one (awaitable, iscoroutinefunction) and follows control."""
    spans = controlled(level=0)

    @otel_gpu.api
    async def fetch(x):
        return x + 1

    import inspect

    assert inspect.iscoroutinefunction(fetch)
    assert asyncio.run(fetch(1)) == 2
    _apply({"level": 1})
    assert asyncio.run(fetch(2)) == 3
    otel_gpu.flush()
    assert [n for n in _names(spans) if n.endswith("fetch")]


def test_sample_decides_the_share_of_calls_recorded(controlled):
    """sample=0 records none of the calls it turns on, sample=1 all of them."""
    spans = controlled(level=0)

    @otel_gpu.api
    def delta(x):
        return x

    _apply({"level": 1, "sample": 0})
    for i in range(50):
        assert delta(i) == i
    otel_gpu.flush()
    assert _names(spans) == []
    _apply({"sample": 1})
    for i in range(5):
        delta(i)
    otel_gpu.flush()
    assert len(_names(spans)) == 5


def test_a_refused_document_changes_nothing(controlled):
    """A document with a valid level and a bad sample is refused naming sample; the state in
    force (an earlier change) is the same before and after, and no span is made for it."""
    spans = controlled(level=0)
    before = _apply({"level": 3, "include": ["x.*"], "for": None})
    otel_gpu.flush()
    controls = len([s for s in spans.get() if s.name == "otel_gpu.control"])
    reply = channel.answer(json.dumps({"document": {"level": 5, "sample": 3}}).encode())
    assert reply["applied"] is False and reply["refused"].startswith("sample must be")
    assert state.effective() == before
    otel_gpu.flush()
    assert len([s for s in spans.get() if s.name == "otel_gpu.control"]) == controls


def test_the_window_lapses_back_to_the_configured_state(controlled):
    """After ``for`` seconds the configured state is back, with a span saying so."""
    spans = controlled(level=0)

    @otel_gpu.api
    def eps(x):
        return x

    result = _apply({"level": 1, "include": ["*.eps"], "for": "0.3s"})
    assert result["until"] is not None and result["functions_changed"] == 1
    wait_for(lambda: not state.effective()["changed"], "the window's end")
    assert eps.__otel_gpu_armed__.level == 0
    otel_gpu.flush()
    sources = [
        s.attributes["otel_gpu.control.source"] for s in spans.get() if s.name == "otel_gpu.control"
    ]
    assert sources == ["test", "window end"]


def test_each_change_is_a_control_span_saying_who_what_and_until_when(controlled):
    """The span carries the source, the change and the configuration in force as JSON, the
    window's end and how many functions changed level."""
    spans = controlled(level=0)

    @otel_gpu.api
    def zeta(x):
        return x

    result = _apply({"level": 5, "include": ["*zeta"], "for": "2m"}, source="runbook 7")
    otel_gpu.flush()
    (span,) = [s for s in spans.get() if s.name == "otel_gpu.control"]
    attrs = span.attributes
    assert attrs["otel_gpu.control.source"] == "runbook 7"
    assert json.loads(attrs["otel_gpu.control.change"]) == {"include": ["*zeta"], "level": 5}
    assert json.loads(attrs["otel_gpu.control.effective"]) == result
    assert attrs["otel_gpu.control.until"] == pytest.approx(time.time() + 120, abs=60)
    assert attrs["otel_gpu.control.functions"] == 1


def test_ring_size_needs_a_ring_and_changes_it(controlled):
    """ring_size is refused, naming it, where the process keeps no ring; with a ring (even at
    armed level 0 before any call), it resizes it and the reset puts the configured size back."""
    controlled(level=3)

    @otel_gpu.api
    def eta(x):
        return x

    eta(1)  # builds the pipeline: no ring
    before = state.effective()
    with pytest.raises(document.ControlError, match="ring_size"):
        _apply({"level": 5, "ring_size": 4})
    assert state.effective() == before  # the level was not applied either
    state.reset("test")
    from otel_gpu.export import pipeline

    pipeline.reset()
    otel_gpu.configure(level=0, control="on", ring=8)  # no call yet: no pipeline, no ring
    assert _apply({"ring_size": 2})["ring_size"] == 2
    assert state.reset("test")["ring_size"] == 8


def test_raised_to_10_from_armed_level_0_the_flight_recorder_writes_dumps(controlled, tmp_path):
    """With control on, the pipeline builds the observers of every level: a process started at
    level 0 and raised to 10 writes a flight-recorder dump of the call."""
    controlled(level=0, dump_dir=str(tmp_path / "dumps"))

    @otel_gpu.api
    def mul(x):
        return x * 3

    mul(torch.ones(2))
    _apply({"level": 10, "for": None})
    mul(torch.ones(2))
    otel_gpu.flush()
    from otel_gpu.export import pipeline

    pipe = pipeline.current()
    assert pipe is not None
    for observer in pipe.observers:
        assert observer.flush(120)
    assert len(list((tmp_path / "dumps").iterdir())) == 1


def test_a_level_change_after_torch_compile_recompiles_without_a_graph_break(controlled):
    """Under torch.compile (fullgraph=True: a graph break would raise), raising the level of a
    compiled function's armed callee makes Dynamo's guard on the trampoline recompile: the
    compiled call is then recorded, and the result is right before and after, and after the
    switch back (the trampoline's own parameters change with its path)."""
    import torch._dynamo.testing

    spans = controlled(level=0)

    @otel_gpu.api
    def scale(x):
        return x * 2

    def model(x):
        return scale(x) + 1

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    x = torch.ones(3)
    assert torch.equal(compiled(x), x * 3) and counter.frame_count == 1
    _apply({"level": 1, "for": None})
    assert torch.equal(compiled(x), x * 3)
    assert counter.frame_count == 2
    otel_gpu.flush()
    assert [n for n in _names(spans) if n.endswith("scale")]
    # compiled while switched, then switched back: the trampoline's parameters change again
    late = torch.compile(lambda x: scale(x) - 1, fullgraph=True, backend=counter)
    assert torch.equal(late(x), x)
    state.reset("test")
    assert torch.equal(late(x), x) and torch.equal(compiled(x), x * 3)
    torch._dynamo.reset()


def test_the_armed_registry_is_weak(controlled):
    """A dropped armed function leaves the registry: control holds no user function alive."""
    import gc

    controlled(level=0)

    def make():
        @otel_gpu.api
        def theta(x):
            return x

        return theta

    fn = make()
    entry = weakref.ref(fn.__otel_gpu_armed__)
    assert entry() in armed.entries()
    del fn
    gc.collect()
    assert entry() is None


# --------------------------------------------------------------------------- the command

CHILD = ALPHA_BETA_LOOP


def _stop(child, progress) -> None:
    """Ask the looping child to finish (its ``.stop`` file) and wait for it; kill it if not."""
    progress.with_name(progress.name + ".stop").touch()
    try:
        child.wait(timeout=240)
    finally:
        if child.poll() is None:
            child.kill()


def test_otel_gpu_control_turns_one_function_of_a_running_process_to_level_5_for_a_window(
    tmp_path,
):
    """A child at armed level 0: `otel-gpu control PID --level 5 --include ... --for 2s` makes
    that function's calls spans with statistics, and only that function's; after the window
    its calls record nothing again; the changes and the window's end are control spans."""
    journal, spans_file, progress = tmp_path / "j", tmp_path / "spans.jsonl", tmp_path / "n"
    program = tmp_path / "child.py"
    program.write_text(CHILD)
    env = without_otel(
        OTEL_GPU_CONTROL="on", OTEL_GPU_LOGDEST=str(spans_file), OTEL_GPU_JOURNAL_DIR=str(journal)
    )
    child = subprocess.Popen([sys.executable, str(program), str(progress)], env=env)
    ask_env = without_otel(OTEL_GPU_JOURNAL_DIR=str(journal))
    try:
        wait_for(lambda: _progress(progress) > 0, "the child's first calls")
        result = otel_gpu_command(
            [
                "control",
                str(child.pid),
                "--level",
                "5",
                "--include",
                "__main__.alpha",
                "--for",
                "2s",
                "--timeout",
                "120",
            ],
            ask_env,
        )
        assert result.returncode == 0, result.stderr
        assert f"pid {child.pid}: applied: level 5" in result.stdout

        def lapsed():
            shown = otel_gpu_command(
                ["control", str(child.pid), "--show", "--json", "--timeout", "120"], ask_env
            )
            assert shown.returncode == 0, shown.stderr
            return not json.loads(shown.stdout)["effective"]["changed"]

        wait_for(lapsed, "the window's end")
        after = _progress(progress)
        wait_for(lambda: _progress(progress) > after + 20, "calls after the window")
    finally:
        _stop(child, tmp_path / "n")
    spans = read_spans(spans_file, plain=True)
    controls = [s for s in spans if s["name"] == "otel_gpu.control"]
    sources = [c["attrs"]["otel_gpu.control.source"] for c in controls]
    assert len(sources) == 2 and sources[0].startswith("otel-gpu control (pid ")
    assert sources[1] == "window end"
    calls = [s for s in spans if s["name"] != "otel_gpu.control"]
    assert calls and {s["name"] for s in calls} == {"__main__.alpha"}
    assert all(any(e["name"] == "otel_gpu.stats" for e in s.get("events", [])) for s in calls)
    window_end = int(controls[-1]["startTimeUnixNano"])
    assert all(int(s["startTimeUnixNano"]) < window_end for s in calls)


def test_control_show_and_reset_of_a_running_process(tmp_path):
    """--show prints the configuration in force; --reset puts the configured state back at
    once (a change made --until-changed included); both exit 0."""
    journal, progress = tmp_path / "j", tmp_path / "n"
    program = tmp_path / "child.py"
    program.write_text(CHILD)
    env = without_otel(
        OTEL_GPU_CONTROL="on",
        OTEL_GPU_LOGDEST=str(tmp_path / "s.jsonl"),
        OTEL_GPU_JOURNAL_DIR=str(journal),
    )
    child = subprocess.Popen([sys.executable, str(program), str(progress)], env=env)
    ask_env = without_otel(OTEL_GPU_JOURNAL_DIR=str(journal))
    try:
        wait_for(lambda: _progress(progress) > 0, "the child's first calls")
        raised = otel_gpu_command(
            ["control", "--all", "--level", "1", "--until-changed", "--json", "--timeout", "120"],
            ask_env,
        )
        assert raised.returncode == 0, raised.stderr
        effective = json.loads(raised.stdout)["effective"]
        assert effective["level"] == 1 and effective["until"] is None
        assert effective["functions_changed"] == 2
        shown = otel_gpu_command(["control", str(child.pid), "--show", "--timeout", "120"], ask_env)
        assert shown.returncode == 0 and "in force: level 1" in shown.stdout
        reset = otel_gpu_command(
            ["control", str(child.pid), "--reset", "--timeout", "120"], ask_env
        )
        assert reset.returncode == 0, reset.stderr
        assert "configured state (level 0)" in reset.stdout
    finally:
        _stop(child, tmp_path / "n")
    assert not list(journal.glob("*.controllable"))  # the marker leaves with the process


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--level", "7"], "--level: must be one of 0, 1, 3, 5, 10"),
        (["--level", "5", "--for", "3h"], "--for"),
        (["--sample", "2"], "--sample: must be a ratio"),
        (["--show", "--level", "1"], "--show and --reset take no other change"),
        ([], "changes something"),
    ],
)
def test_bad_usage_exits_2_naming_what_is_wrong(tmp_path, args, says):
    """Flags are checked before anything is sent: exit 2 with a line naming the flag."""
    env = without_otel(OTEL_GPU_JOURNAL_DIR=str(tmp_path / "j"))
    result = otel_gpu_command(["control", str(os.getpid()), *args], env)
    assert result.returncode == 2
    assert says in result.stderr
    assert "Traceback" not in result.stderr


def test_a_process_that_does_not_listen_says_so_and_exits_1(tmp_path):
    """A live process of this user that is not listening for control (no marker) is named
    as such at once, exit 1; --all with none listening, exit 1."""
    env = without_otel(OTEL_GPU_JOURNAL_DIR=str(tmp_path / "j"))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        result = otel_gpu_command(["control", str(sleeper.pid), "--show"], env)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert result.returncode == 1
    assert "is not an otel-gpu process listening for control" in result.stderr
    none = otel_gpu_command(["control", "--all", "--show"], env)
    assert none.returncode == 1 and "no live otel-gpu process" in none.stderr


def _shapes():
    """Functions of every parameter shape, and calls of each."""

    def positional_only(a, b=2, /, c=3):
        return (a, b, c)

    def keyword_only(a, *, scale=1.0, bias=None):
        return (a, scale, bias)

    def star_args(a, *rest, flag=False, **extra):
        return (a, rest, flag, extra)

    def named_like_the_cell(__otel_gpu_path, path=1):
        return (__otel_gpu_path, path)

    def generator(n):
        yield from range(n)

    return [
        (positional_only, [((1,), {}), ((1, 5), {"c": 7})]),
        (keyword_only, [((1,), {}), ((1,), {"scale": 0.5, "bias": 2})]),
        (star_args, [((1, 2, 3), {"flag": True, "z": 4}), ((1,), {})]),
        (named_like_the_cell, [((1,), {"path": 2})]),
        (generator, [((3,), {})]),
    ]


@pytest.mark.parametrize("index", range(5))
def test_an_armed_function_of_any_shape_answers_as_the_function_at_every_level(controlled, index):
    """Whatever its parameters (positional-only, keyword-only, *args/**kwargs, defaults, a
    generator, a parameter named like the trampoline's variable), the armed function returns
    what the function returns, at level 0, raised to 3 and back; at 3 it records the same
    input attributes as the function decorated at level 3 (defaults are still defaults)."""
    spans = controlled(level=0)
    fn, calls = _shapes()[index]

    def outcome(f, args, kwargs):
        got = f(*args, **kwargs)
        return list(got) if index == 4 else got

    armed_fn = otel_gpu.api(fn)
    for args, kwargs in calls:
        assert outcome(armed_fn, args, kwargs) == outcome(fn, args, kwargs)
    _apply({"level": 3, "for": None})
    for args, kwargs in calls:
        assert outcome(armed_fn, args, kwargs) == outcome(fn, args, kwargs)
    otel_gpu.flush()
    switched = [dict(s.attributes) for s in spans.get() if s.name != "otel_gpu.control"]
    state.reset("test")
    for args, kwargs in calls:
        assert outcome(armed_fn, args, kwargs) == outcome(fn, args, kwargs)
    otel_gpu.configure(level=3, control="off")
    decided = otel_gpu.api(fn)
    for args, kwargs in calls:
        decided(*args, **kwargs)
    otel_gpu.flush()
    direct = [dict(s.attributes) for s in spans.get() if s.name != "otel_gpu.control"]
    direct = direct[len(switched) :]

    def inputs(attrs):
        return {k: v for k, v in attrs.items() if k.startswith("otel_gpu.input.")}

    assert [inputs(a) for a in switched] == [inputs(a) for a in direct]


def test_a_method_armed_in_a_class_body_binds_self(controlled):
    """Decorated in a class body, the trampoline is a function: it binds as a method, at level 0
    and after a switch."""
    spans = controlled(level=0)

    class Model:
        @otel_gpu.api
        def forward(self, x, *, scale=2):
            return (self, x * scale)

    m = Model()
    assert m.forward(3) == (m, 6)
    _apply({"level": 1, "for": None})
    assert m.forward(3, scale=1) == (m, 3)
    otel_gpu.flush()
    assert [n for n in _names(spans) if n.endswith("Model.forward")]


def test_control_sets_the_flight_recorders_limits_for_its_window(controlled, tmp_path):
    """dump_max_calls in a control document limits the dumps while the change lasts (the
    third call at level 10 is skipped with otel_gpu.dump.skipped), shows in the configuration in
    force, and reset gives back OTEL_GPU_DUMP_MAX_COUNT; a bad limit is refused naming it."""
    from otel_gpu.recorder import limits

    spans = controlled(level=0, dump_dir=str(tmp_path / "d"), dump_max_count=50)

    @otel_gpu.api
    def dumped(x):
        return x + 1

    try:
        result = _apply({"level": 10, "dump_max_calls": 2, "for": None})
        assert result["dump_max_calls"] == 2
        for _ in range(3):
            dumped(torch.ones(2))
        otel_gpu.flush()
        calls = sorted(
            (s for s in spans.get() if s.name.endswith("dumped")), key=lambda s: s.start_time
        )
        skipped = [s.attributes.get("otel_gpu.dump.skipped") for s in calls]
        assert skipped == [None, None, "max_count"]
        assert state.reset("test")["dump_max_calls"] == 50
        with pytest.raises(document.ControlError, match="dump_max_bytes must be a whole number"):
            document.parse({"dump_max_bytes": -1})
        with pytest.raises(document.ControlError, match="dump_max_calls must be a whole number"):
            document.parse({"dump_max_calls": True})
    finally:
        limits.set_limits()
