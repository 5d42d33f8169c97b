"""Live control's changes stack: a change made until changed is the baseline, a change with a
window is an overlay on top of it, and when a window ends the process returns to what was in
force before it (the baseline and the other windows), not to its configured state. Overlapping
windows resolve by the documented rule: for each function, the latest window that selects it
and sets a level decides. ``--show``, the control spans and ``state.effective()`` report the
baseline and each window."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from commands import otel_gpu_command, without_otel
from distributed_job import wait_for
from lib_sources import ALPHA_BETA_LOOP
from lib_sources import progress as _progress

import otel_gpu
from otel_gpu.cli import control as control_cli
from otel_gpu.control import document, state

LATER = 3600.0  # a window's length the test never waits out: it ends windows itself


@pytest.fixture
def controlled(otel_gpu_spans, tmp_path):
    def start(level: int = 0, **settings):
        settings.setdefault("journal_dir", str(tmp_path / "journal"))
        return otel_gpu_spans(level=level, control="on", **settings)

    yield start
    state.reset("test teardown")


def _apply(doc, source):
    return state.apply(document.parse(doc), source)


def _end_windows(after: float = LATER + 60) -> None:
    """End the windows due ``after`` seconds from now, as their timer would then."""
    state._lapse(state._generation, now=time.time() + after)


def _mlp():
    """A method named as the issue's: ``...LlamaMLP.forward`` (decorated once control is on)."""

    class LlamaMLP:
        @otel_gpu.api
        def forward(self, x):
            return x + 1

    return LlamaMLP.forward


def _functions():
    @otel_gpu.api
    def attention(x):
        return x * 2

    @otel_gpu.api
    def norm(x):
        return x - 1

    return attention, norm


def test_a_window_ends_back_at_the_baseline_not_the_configured_level(controlled):
    """Started at level 1: --level 0 --until-changed, then --level 5 --include
    '*LlamaMLP.forward' --for a window. During the window only that function is at 5 and the
    others at 0; when it ends every function is at 0 (the baseline), not back at 1."""
    spans = controlled(level=1)
    attention, norm = _functions()
    mlp = _mlp()
    _apply({"level": 0, "for": None}, "control (pid 1)")
    during = _apply({"level": 5, "include": ["*LlamaMLP.forward"], "for": LATER}, "control (pid 2)")
    levels = {f.__name__: f.__otel_gpu_armed__.level for f in (attention, norm, mlp)}
    assert levels == {"attention": 0, "norm": 0, "forward": 5}
    assert during["baseline"]["level"] == 0 and during["baseline"]["until"] is None
    (window,) = during["overlays"]
    assert window["level"] == 5 and window["include"] == ["*LlamaMLP.forward"]
    assert window["until"] == pytest.approx(time.time() + LATER, abs=120)
    _end_windows()
    levels = {f.__name__: f.__otel_gpu_armed__.level for f in (attention, norm, mlp)}
    assert levels == {"attention": 0, "norm": 0, "forward": 0}
    after = state.effective()
    assert after["changed"] and after["overlays"] == [] and after["baseline"]["level"] == 0
    otel_gpu.flush()
    controls = [s for s in spans.get() if s.name == "otel_gpu.control"]
    assert [c.attributes["otel_gpu.control.source"] for c in controls][-1] == "window end"
    ended = json.loads(controls[-1].attributes["otel_gpu.control.change"])
    assert ended["window_end"][0]["include"] == ["*LlamaMLP.forward"]
    # the span's configuration in force is effective()'s: the same baseline and windows
    assert json.loads(controls[-1].attributes["otel_gpu.control.effective"]) == after
    assert json.loads(controls[1].attributes["otel_gpu.control.effective"]) == during


def test_a_real_window_timer_returns_to_the_baseline(controlled):
    """The window's own timer (not the test) ends it, and the functions go back to the
    baseline's level."""
    controlled(level=1)
    attention, _ = _functions()
    _apply({"level": 0, "for": None}, "a")
    _apply({"level": 3, "include": ["*attention"], "for": "0.3s"}, "b")
    wait_for(lambda: state.effective()["overlays"] == [], "the window's end")
    assert attention.__otel_gpu_armed__.level == 0
    assert state.effective()["baseline"]["level"] == 0


def test_overlapping_windows_the_latest_that_selects_a_function_decides(controlled):
    """Two windows in force: the later one decides for the functions it selects, the earlier
    one for the rest; when the later ends first, its functions go back to the earlier window's
    level; when that one ends too, to the configured level."""
    controlled(level=0)
    attention, norm = _functions()
    _apply({"level": 3, "include": ["*attention", "*norm"], "for": LATER}, "a")
    _apply({"level": 5, "include": ["*attention"], "for": LATER / 2}, "b")
    assert (attention.__otel_gpu_armed__.level, norm.__otel_gpu_armed__.level) == (5, 3)
    assert [o["source"] for o in state.effective()["overlays"]] == ["a", "b"]
    _end_windows(after=LATER / 2 + 60)  # b ends, a still runs
    assert (attention.__otel_gpu_armed__.level, norm.__otel_gpu_armed__.level) == (3, 3)
    _end_windows()
    assert (attention.__otel_gpu_armed__.level, norm.__otel_gpu_armed__.level) == (0, 0)
    assert not state.effective()["changed"]


def test_a_later_window_ending_after_an_earlier_one_still_wins_while_both_run(controlled):
    """The order the windows were applied decides, not when they end: an earlier, longer
    window under a later, shorter one shows again when the later one ends; a baseline set while
    windows run goes under them."""
    controlled(level=0)
    attention, norm = _functions()
    _apply({"level": 1, "for": LATER}, "a")
    _apply({"level": 10, "include": ["*norm"], "for": LATER / 2}, "b")
    _apply({"level": 5, "for": None}, "c")  # the baseline: under both windows
    assert (attention.__otel_gpu_armed__.level, norm.__otel_gpu_armed__.level) == (1, 10)
    _end_windows(after=LATER / 2 + 60)
    assert (attention.__otel_gpu_armed__.level, norm.__otel_gpu_armed__.level) == (1, 1)
    _end_windows()
    assert (attention.__otel_gpu_armed__.level, norm.__otel_gpu_armed__.level) == (5, 5)


def test_a_window_from_the_same_source_is_merged_and_the_number_of_windows_is_bounded(controlled):
    """A second window from the source of one in force is merged into it (one window, the
    fields of both); at most MAX_OVERLAYS windows run at once, and one more is refused naming
    the bound, changing nothing; reset removes the baseline and every window."""
    controlled(level=0)
    attention, _ = _functions()
    _apply({"level": 3, "for": LATER}, "a")
    _apply({"include": ["*attention"], "for": LATER}, "a")
    (window,) = state.effective()["overlays"]
    assert window["level"] == 3 and window["include"] == ["*attention"]
    for n in range(1, state.MAX_OVERLAYS):
        _apply({"level": 1, "include": [f"nothing{n}"], "for": LATER}, f"s{n}")
    before = state.effective()
    with pytest.raises(document.ControlError, match=f"at most {state.MAX_OVERLAYS} windows"):
        _apply({"level": 5, "for": LATER}, "one too many")
    assert state.effective() == before
    after = state.reset("test")
    assert after["overlays"] == [] and after["baseline"] is None
    assert attention.__otel_gpu_armed__.level == 0


def test_show_prints_the_baseline_and_each_window_with_its_time_left():
    """``otel-gpu control --show``'s lines: the baseline 'until changed', then each window in
    the order applied with what it sets, its source and the seconds it has left."""
    now = time.time()
    effective = {
        "changed": True,
        "level": 5,
        "include": ["*LlamaMLP.forward"],
        "until": now + 20,
        "functions": 13,
        "functions_changed": 13,
        "baseline": {"level": 0, "include": [], "exclude": [], "source": "ctl (pid 7)"},
        "overlays": [
            {
                "level": 5,
                "include": ["*LlamaMLP.forward"],
                "exclude": [],
                "until": now + 20.4,
                "source": "ctl (pid 8)",
            }
        ],
    }
    lines = control_cli._stack(effective)
    assert lines[0] == "baseline: level 0 (from ctl (pid 7)), until changed"
    assert lines[1].startswith(
        "window 1 of 1: level 5, include *LlamaMLP.forward (from ctl (pid 8))"
    )
    assert " s left (until " in lines[1]
    left = float(lines[1].split(", ")[-1].split(" s left")[0])
    assert 0 <= left <= 21


def test_control_show_of_a_running_process_lists_the_stack(tmp_path):
    """End to end: a child at level 1 given a baseline at 0 and a window at 5 for one function;
    --show prints both, the window with its time left; --show --json carries them as the
    process reports them."""
    journal, progress = tmp_path / "j", tmp_path / "n"
    program = tmp_path / "child.py"
    program.write_text(ALPHA_BETA_LOOP)
    env = without_otel(
        OTEL_GPU_CONTROL="on",
        OTEL_GPU_LOGLEVEL="1",
        OTEL_GPU_LOGDEST=str(tmp_path / "s.jsonl"),
        OTEL_GPU_JOURNAL_DIR=str(journal),
    )
    child = subprocess.Popen([sys.executable, str(program), str(progress)], env=env)
    ask_env = without_otel(OTEL_GPU_JOURNAL_DIR=str(journal))
    pid = str(child.pid)
    try:
        wait_for(lambda: _progress(progress) > 0, "the child's first calls")
        base = ["control", pid, "--timeout", "120"]
        first = otel_gpu_command([*base, "--level", "0", "--until-changed"], ask_env)
        assert first.returncode == 0, first.stderr
        window = [*base, "--level", "5", "--include", "__main__.alpha", "--for", "10m"]
        assert otel_gpu_command(window, ask_env).returncode == 0
        shown = otel_gpu_command([*base, "--show"], ask_env)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[1].startswith("  baseline: level 0 (from otel-gpu control (pid ")
        assert lines[2].startswith("  window 1 of 1: level 5, include __main__.alpha (from ")
        assert " s left (until " in lines[2]
        as_json = otel_gpu_command([*base, "--show", "--json"], ask_env)
        effective = json.loads(as_json.stdout)["effective"]
        assert effective["baseline"]["level"] == 0
        assert [o["level"] for o in effective["overlays"]] == [5]
        assert effective["functions_changed"] == 2  # alpha at 5, beta at 0, both off level 1
    finally:
        progress.with_name(progress.name + ".stop").touch()
        try:
            child.wait(timeout=240)
        finally:
            if child.poll() is None:
                child.kill()


def test_a_change_until_changed_from_a_windows_source_makes_that_window_last(controlled):
    """One source (a remote server) sends a window, then a change until changed: the window is
    folded into the baseline (its fields, then the change's) and no longer ends by itself, as
    one source's changes always merged."""
    controlled(level=0)
    attention, norm = _functions()
    _apply({"level": 5, "include": ["*attention"], "for": LATER}, "opamp")
    after = _apply({"sample": 1, "for": None}, "opamp")
    assert after["overlays"] == [] and after["until"] is None
    assert after["baseline"]["level"] == 5 and after["baseline"]["include"] == ["*attention"]
    assert after["baseline"]["sample"] == 1.0
    _end_windows()
    assert (attention.__otel_gpu_armed__.level, norm.__otel_gpu_armed__.level) == (5, 0)
