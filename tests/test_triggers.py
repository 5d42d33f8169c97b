"""Triggers (``OTEL_GPU_TRIGGERS``, a control document's ``triggers``): a rule that fires on a
non-finite result, an exception of a given type or a slow call raises the level of the next
calls, bounded by a count and a time, and/or dumps the ring; each firing is an
``otel_gpu.control`` span. Bad rules are refused whole, naming the entry and the field."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from distributed_job import wait_for

import otel_gpu
from otel_gpu import config, trigger_rules
from otel_gpu.anomalies import triggers
from otel_gpu.attributes import CONTROL_CHANGE, CONTROL_SOURCE, DUMP_DIR, RING_DUMP_DIR
from otel_gpu.control import document, state


@pytest.fixture
def triggered(otel_gpu_spans, tmp_path):
    """``start(level, rules, **settings)``: otel-gpu with these triggers; state put back after."""

    def start(level: int, rules: list, **settings):
        settings.setdefault("journal_dir", str(tmp_path / "journal"))
        settings.setdefault("dump_dir", str(tmp_path / "dumps"))
        return otel_gpu_spans(level=level, triggers=rules, **settings)

    yield start
    state.reset("test teardown")
    triggers.set_triggers(None)


def _calls(spans, suffix):
    return [s for s in spans.get() if s.name.endswith(suffix)]


def _control(spans):
    return [s for s in spans.get() if s.name == "otel_gpu.control"]


def test_a_nan_records_the_next_calls_at_level_10_then_goes_back(triggered, tmp_path):
    """At level 5 with {"on": "nonfinite", "level": 10, "calls": 3}: the call that returns NaN
    fires it; the next 3 calls are level-10 calls (each with a flight-recorder dump), the 4th is
    level 5 again; results are untouched; one control span names the trigger and the function."""
    spans = triggered(5, [{"on": "nonfinite", "level": 10, "calls": 3}])

    @otel_gpu.api
    def scale(x):
        return x * 2

    ok = torch.ones(4)
    bad = torch.tensor([1.0, float("nan")])
    assert torch.equal(scale(ok), ok * 2)
    out = scale(bad)
    assert torch.isnan(out[1]) and out[0] == 2
    for _ in range(4):
        assert torch.equal(scale(ok), ok * 2)
    otel_gpu.flush()
    calls = sorted(_calls(spans, "scale"), key=lambda s: s.start_time)
    assert len(calls) == 6
    dumped = [DUMP_DIR in (s.attributes or {}) for s in calls]
    assert dumped == [False, False, True, True, True, False]
    for s in calls[2:5]:
        assert os.path.isdir(s.attributes[DUMP_DIR])
    assert all(any(e.name == "otel_gpu.stats" for e in s.events) for s in calls)
    (control,) = _control(spans)
    assert control.attributes[CONTROL_SOURCE] == "trigger"
    change = json.loads(control.attributes[CONTROL_CHANGE])
    assert change["trigger"]["on"] == "nonfinite" and change["function"].endswith("scale")
    assert change["span_id"] == format(calls[1].context.span_id, "016x")


def test_an_exception_trigger_boosts_only_that_function_and_matches_types_by_name(triggered):
    """{"on": "exception", "types": ["KeyError"], "level": 5, "calls": 2} at level 1: a
    ValueError fires nothing; a KeyError subclass fires it for the raising function only (the
    user's exception passes through as the same object); the other function stays at level 1."""
    spans = triggered(1, [{"on": "exception", "types": ["KeyError"], "level": 5, "calls": 2}])

    class Missing(KeyError):
        pass

    @otel_gpu.api
    def lookup(kind, x):
        if kind:
            raise kind("no")
        return x + 1

    @otel_gpu.api
    def other(x):
        return x - 1

    t = torch.zeros(2)
    with pytest.raises(ValueError):
        lookup(ValueError, t)
    err = None
    try:
        lookup(Missing, t)
    except Missing as exc:
        err = exc
    assert isinstance(err, Missing)
    lookup(None, t)
    other(t)
    lookup(None, t)
    lookup(None, t)
    otel_gpu.flush()
    looked = sorted(_calls(spans, "lookup"), key=lambda s: s.start_time)
    stats = [any(e.name == "otel_gpu.stats" for e in s.events) for s in looked]
    assert stats == [False, False, True, True, False]
    (o,) = _calls(spans, "other")
    assert not any(e.name == "otel_gpu.stats" for e in o.events)
    assert len(_control(spans)) == 1


def test_a_slow_trigger_lapses_after_its_window_when_the_calls_do_not_come(triggered):
    """{"on": "slow", "threshold": "20ms", "level": 3, "calls": 1000, "for": 0.5}: a fast call
    fires nothing, a slow one raises the function to level 3 (input attributes appear); after
    the window it records at level 1 again although far fewer than 1000 calls came."""
    spans = triggered(
        1, [{"on": "slow", "threshold": "20ms", "level": 3, "calls": 1000, "for": 0.5}]
    )

    @otel_gpu.api
    def work(x, delay):
        time.sleep(delay)
        return x

    t = torch.ones(1)
    work(t, 0.0)
    work(t, 0.05)
    work(t, 0.0)
    wait_for(lambda: triggers.boosted_count() == 0, "the trigger's window to lapse", 60)
    work(t, 0.0)
    otel_gpu.flush()
    calls = sorted(_calls(spans, "work"), key=lambda s: s.start_time)
    has_inputs = [any(k.startswith("otel_gpu.input.") for k in s.attributes or {}) for s in calls]
    assert has_inputs == [False, False, True, False]


def test_scope_all_boosts_every_function_and_a_firing_rule_does_not_stack(triggered):
    """scope "all": one NaN raises every armed function; a second NaN while they are boosted
    changes nothing more (one control span), and each goes back after its calls."""
    spans = triggered(5, [{"on": "nonfinite", "level": 10, "calls": 2, "scope": "all"}])

    @otel_gpu.api
    def a(x):
        return x

    @otel_gpu.api
    def b(x):
        return x

    nan = torch.tensor([float("nan")])
    a(nan)
    a(nan)  # boosted call 1 of a (NaN again: no second firing)
    b(torch.ones(1))
    b(torch.ones(1))
    b(torch.ones(1))
    otel_gpu.flush()
    bs = sorted(_calls(spans, ".b"), key=lambda s: s.start_time)
    assert [DUMP_DIR in (s.attributes or {}) for s in bs] == [True, True, False]
    assert len(_control(spans)) == 1


def test_a_dump_trigger_writes_the_ring(triggered, tmp_path):
    """{"on": "nonfinite", "dump": true} with a ring of 4 at level 5: the call that returned NaN
    and the calls before it are written as a ring dump named on the control span, and no level
    changes. A raising call under {"on": "exception", "dump": true} names the ring's own dump."""
    spans = triggered(
        5, [{"on": "nonfinite", "dump": True}, {"on": "exception", "dump": True}], ring=4
    )

    @otel_gpu.api
    def step(x):
        return x / x

    @otel_gpu.api
    def fail(x):
        raise RuntimeError("boom")

    step(torch.ones(2))
    step(torch.zeros(2))  # 0/0: NaN
    with pytest.raises(RuntimeError):
        fail(torch.ones(1))
    otel_gpu.flush()
    nan_control, raised_control = sorted(_control(spans), key=lambda s: s.start_time)
    change = json.loads(nan_control.attributes[CONTROL_CHANGE])
    assert "boosted" not in change
    dumped = sorted(os.listdir(change["dump"]))
    assert len(dumped) == 2  # both calls of step, the NaN one last
    (call,) = _calls(spans, "fail")
    assert (
        json.loads(raised_control.attributes[CONTROL_CHANGE])["dump"]
        == call.attributes[RING_DUMP_DIR]
    )


def test_control_sets_triggers_for_a_window_and_reset_removes_them(triggered):
    """A control document's triggers replace OTEL_GPU_TRIGGERS while the change lasts; the
    effective configuration lists them; reset puts the configured ones back."""
    triggered(5, [{"on": "nonfinite", "level": 10}])
    assert state.effective()["triggers"][0]["on"] == "nonfinite"
    doc = {"triggers": [{"on": "slow", "threshold": 1, "level": 5}], "for": None}
    state.apply(document.parse(doc), "test")
    assert [t["on"] for t in state.effective()["triggers"]] == ["slow"]
    state.reset("test")
    assert [t["on"] for t in state.effective()["triggers"]] == ["nonfinite"]


@pytest.mark.parametrize(
    ("rules", "said"),
    [
        ('[{"on": "nan", "level": 5}]', "trigger 0: on must be one of nonfinite, exception, slow"),
        ('[{"on": "slow", "level": 5}]', "trigger 0: on: slow needs a threshold"),
        ('[{"on": "nonfinite"}]', "give a level (1, 3, 5, 10) or dump: true"),
        ('[{"on": "nonfinite", "level": 7}]', "level must be one of 1, 3, 5, 10, not 7"),
        ('[{"on": "nonfinite", "level": 5, "calls": 0}]', "calls must be a whole number"),
        ('[{"on": "nonfinite", "level": 5, "run": "x"}]', "unknown field 'run'"),
        (
            '[{"on": "exception", "types": "ValueError", "threshold": 1, "level": 5}]',
            "threshold goes with on: slow only",
        ),
        ('[{"on": "nonfinite", "clock": "device", "level": 5}]', "clock goes with on: slow only"),
        (
            '[{"on": "slow", "threshold": 1, "clock": "gpu", "level": 5}]',
            "clock must be host or device",
        ),
        ("{not json", "not JSON"),
        ("[" + ",".join(['{"on": "nonfinite", "level": 5}'] * 17) + "]", "at most 16 triggers"),
    ],
)
def test_bad_triggers_are_refused_naming_the_entry_and_field(rules, said):
    """OTEL_GPU_TRIGGERS that cannot be honoured is a ConfigError naming the variable, the entry
    and what is allowed; the same rules in a control document are a ControlError, nothing
    applied."""
    with pytest.raises(config.ConfigError) as err:
        config.load(env={"OTEL_GPU_TRIGGERS": rules})
    assert "OTEL_GPU_TRIGGERS" in str(err.value) and said in str(err.value)
    try:
        parsed = json.loads(rules)
    except ValueError:
        return
    with pytest.raises(document.ControlError) as refused:
        document.parse({"triggers": parsed})
    assert str(refused.value).startswith("triggers: ") and said in str(refused.value)


def test_trigger_types_are_compared_by_name_and_never_imported():
    """A type named in a trigger is matched along the exception's bases by bare or dotted name;
    a name that does not exist is simply never matched (nothing is imported)."""
    (rule,) = trigger_rules.parse(
        [{"on": "exception", "types": ["no.such.Module.Error", "LookupError"], "level": 5}]
    )
    assert rule.matches_type(KeyError("x"))  # KeyError -> LookupError
    assert not rule.matches_type(ValueError("x"))
    (dotted,) = trigger_rules.parse(
        [{"on": "exception", "types": ["builtins.ValueError"], "dump": True}]
    )
    assert dotted.matches_type(ValueError("x"))
    assert "no.such" not in " ".join(__import__("sys").modules)


def test_durations_take_units_and_bare_seconds():
    """threshold and for take a number of seconds or a string ending in us, ms, s or m."""
    assert trigger_rules.parse_duration("250us", "x", 10) == pytest.approx(250e-6)
    assert trigger_rules.parse_duration("5ms", "x", 10) == pytest.approx(0.005)
    assert trigger_rules.parse_duration("2m", "x", 1000) == 120
    assert trigger_rules.parse_duration(3, "x", 10) == 3
    with pytest.raises(ValueError, match="a duration such as"):
        trigger_rules.parse_duration("5 hours", "x", 10)


def test_a_slow_trigger_on_the_device_clock_fires_when_device_time_is_resolved(
    triggered, module_factory
):
    """{"on": "slow", "clock": "device", "threshold": "2ms", "level": 3, "calls": 1} with fake
    CUDA events: a call whose kernels took 1 ms fires nothing, one that took 5 ms (its host time
    far shorter) fires when its device time is resolved on the export thread; the next call
    records at level 3, the one after at level 1 again."""
    from otel_gpu.devices import events
    from otel_gpu.export import pipeline

    fake = events.FakeEvents()
    events.use(fake)
    spans = triggered(
        1, [{"on": "slow", "clock": "device", "threshold": "2ms", "level": 3, "calls": 1}]
    )
    lib = module_factory("import otel_gpu\n\n@otel_gpu.api\ndef kernel(x):\n    return x + 1\n")

    def run_and_resolve(device_ms: float) -> None:
        before = len(fake.recorded)
        lib.kernel(torch.ones(1))
        start, end = fake.recorded[before:]
        now = time.time_ns()
        fake.complete(start, now, 0.0)
        fake.complete(end, now, device_ms)
        pipe = pipeline.current()
        assert pipe is not None
        pipe.drain()

    run_and_resolve(1.0)
    run_and_resolve(5.0)
    lib.kernel(torch.ones(1))  # boosted: level 3
    lib.kernel(torch.ones(1))  # back to level 1
    otel_gpu.flush()
    calls = sorted(_calls(spans, "kernel"), key=lambda s: s.start_time)
    has_inputs = [any(k.startswith("otel_gpu.input.") for k in s.attributes or {}) for s in calls]
    assert has_inputs == [False, False, True, False]
    (control,) = _control(spans)
    assert json.loads(control.attributes[CONTROL_CHANGE])["trigger"]["clock"] == "device"
