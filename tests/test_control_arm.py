"""Every instrumentation path arms at level 0 under ``OTEL_GPU_CONTROL=on``, and what a change
would select is visible before it applies.

Promises: ``instrument()``, ``OTEL_GPU_INSTRUMENT`` (``import otel_gpu.auto``, the first
configuration, ``otel-gpu run``) and ``instrument_module()`` install armed trampolines at level
0 that record nothing, the process listens for control, and ``uninstrument`` restores the
originals; a program that sets ``OTEL_GPU_INSTRUMENT`` but never applies it is told so; the
control channel lists the controllable names (a module's path among them), previews a change
without applying it, and refuses one that selects nothing, naming the closest names; the
command imports no torch; the control span starts before any span of the level it sets.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from commands import otel_gpu_command, python_command, without_otel

import otel_gpu
from otel_gpu.calls import armed
from otel_gpu.control import channel, document, state

MOD = """
def attention(q, k, scale=1.0):
    return q * scale

class Decoder:
    def run(self, x, *, steps=1):
        return x + steps
"""


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh package ``<name>`` with ``<name>.ops``, not imported. Returns its name."""
    name = f"armpkg_{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "ops.py").write_text(textwrap.dedent(MOD))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


@pytest.fixture
def armed_level_0(otel_gpu_spans, tmp_path):
    """otel-gpu at level 0 with OTEL_GPU_CONTROL=on; the configured state put back after."""
    spans = otel_gpu_spans(level=0, control="on", journal_dir=str(tmp_path / "journal"))
    yield spans
    state.reset("test teardown")


def _calls(spans):
    return [s for s in spans.get() if s.name != "otel_gpu.control"]


def _apply(doc):
    return state.apply(document.parse(doc), "test")


def test_instrument_arms_at_level_0_and_uninstrument_restores(armed_level_0, package):
    """instrument() at armed level 0 patches the module's functions with trampolines that record
    nothing and listen for control; raised to 5, their calls are spans; uninstrument() puts the
    original objects back."""
    ops = importlib.import_module(f"{package}.ops")
    original = ops.attention
    done = otel_gpu.instrument(ops)
    assert f"{package}.ops.attention" in done and f"{package}.ops.Decoder.run" in done
    assert ops.attention is not original and ops.attention(2.0, 1.0) == 2.0
    assert channel.running() is not None
    otel_gpu.flush()
    assert _calls(armed_level_0) == []
    _apply({"level": 5, "include": ["*ops.attention"], "for": None})
    assert ops.attention(2.0, 1.0) == 2.0
    otel_gpu.flush()
    assert [s.name for s in _calls(armed_level_0)] == [f"{package}.ops.attention"]
    assert otel_gpu.uninstrument() == 2
    assert ops.attention is original


def test_instrument_module_arms_each_module_by_its_path(armed_level_0):
    """instrument_module() at armed level 0 wraps every module; each answers to its path in the
    tree, and a change on one path records that module only, with the path as an attribute."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.ones(1, 4)
    expected = model(x)
    assert otel_gpu.instrument_module(model) == 4
    names = {e.name for e in armed.entries()}
    assert {"Sequential", "0", "1", "2"} <= names
    _apply({"level": 5, "include": ["2"], "for": None})
    assert torch.equal(model(x), expected)
    otel_gpu.flush()
    (span,) = _calls(armed_level_0)
    assert span.name == "2" and span.attributes["otel_gpu.module.path"] == "2"
    assert any(e.name == "otel_gpu.stats" for e in span.events)
    state.reset("test")
    assert otel_gpu.uninstrument_module(model) == 4
    assert "forward" not in model[2].__dict__


def test_list_names_every_armed_function_with_its_level(armed_level_0, package):
    """A list request answers every controllable name: span name, module.qualname, level now."""
    otel_gpu.instrument(importlib.import_module(f"{package}.ops"))
    reply = channel.answer(json.dumps({"from": 1, "list": True}).encode())
    assert reply["applied"] is True
    rows = {r["name"]: r for r in reply["functions"]}
    assert rows[f"{package}.ops.attention"]["level"] == 0
    assert rows[f"{package}.ops.Decoder.run"]["configured_level"] == 0


def test_dry_run_previews_and_applies_nothing(armed_level_0, package):
    """A dry run answers which functions the change selects and the level each would take; the
    state in force and every function's level stay as they were."""
    otel_gpu.instrument(importlib.import_module(f"{package}.ops"))
    before = state.effective()
    request = {"document": {"level": 5, "include": ["*attention"]}, "dry_run": True}
    reply = channel.answer(json.dumps(request).encode())
    assert reply["applied"] is False and reply["dry_run"] is True
    (row,) = reply["preview"]["selected"]
    assert row["name"] == f"{package}.ops.attention" and row["would_be"] == 5
    assert reply["preview"]["changed"] == 1
    assert state.effective() == before
    assert all(e.level == 0 for e in armed.entries())


def test_a_change_that_selects_nothing_is_refused_with_the_closest_names(armed_level_0, package):
    """A glob that matches no controllable name is refused, naming the closest names, and
    nothing is applied (today's "0 of N function(s) changed" said nothing was wrong)."""
    otel_gpu.instrument(importlib.import_module(f"{package}.ops"))
    before = state.effective()
    reply = channel.answer(
        json.dumps({"document": {"level": 5, "include": ["*atention"]}}).encode()
    )
    assert reply["applied"] is False
    assert "selects none of the 2 controllable function(s)" in reply["refused"]
    assert f"closest: {package}.ops.attention" in reply["refused"]
    assert state.effective() == before


def test_a_change_of_the_ring_alone_is_not_refused_for_selecting_no_function(armed_level_0):
    """The refusal is for changes that choose functions: one that sets only the recorder's
    limits is applied in a process with no armed function."""
    reply = channel.answer(json.dumps({"document": {"dump_max_calls": 5}}).encode())
    assert reply["applied"] is True, reply


def test_no_span_of_a_new_level_starts_before_the_control_span(armed_level_0):
    """A call that takes the new path the moment it is swapped in (before apply() returns)
    starts after the otel_gpu.control span that explains it."""

    @otel_gpu.api
    def alpha(x):
        return x + 1

    real = armed.set_rule

    def swap_then_call(rule):
        changed = real(rule)
        alpha(1)  # another thread's call, arriving right after the swap
        return changed

    armed.set_rule = swap_then_call
    try:
        _apply({"level": 1, "for": None})
    finally:
        armed.set_rule = real
    otel_gpu.flush()
    spans = armed_level_0.get()
    (control,) = [s for s in spans if s.name == "otel_gpu.control"]
    (call,) = [s for s in spans if s.name.endswith("alpha")]
    assert control.start_time <= call.start_time


def test_the_control_command_imports_no_torch(tmp_path):
    """`otel-gpu control` (and `snapshot`) import neither torch nor the process side: the
    command answers in a fraction of a second even where torch takes seconds to import."""
    code = textwrap.dedent(
        """
        import sys
        from otel_gpu.cli import main
        for args in (["control", "999999", "--show"], ["control", "999999", "--list"],
                     ["snapshot", "999999"]):
            try:
                main(args)
            except SystemExit:
                pass
        loaded = [m for m in ("torch", "otel_gpu.control.state", "otel_gpu.calls.armed")
                  if m in sys.modules]
        print("loaded:", loaded)
        """
    )
    env = without_otel(OTEL_GPU_JOURNAL_DIR=str(tmp_path / "journal"))
    done = python_command(["-c", code], env, timeout=120)
    assert "loaded: []" in done.stdout, done.stdout + done.stderr


def test_control_flags_list_and_dry_run_are_checked_before_sending(tmp_path):
    """--list takes no change, --dry-run needs one: usage errors (exit 2), nothing sent."""
    env = without_otel(OTEL_GPU_JOURNAL_DIR=str(tmp_path / "journal"))
    listed = otel_gpu_command(["control", "1", "--list", "--level", "5"], env)
    assert listed.returncode == 2 and "--list takes no change" in listed.stderr
    dry = otel_gpu_command(["control", "1", "--dry-run"], env)
    assert dry.returncode == 2 and "--dry-run previews a change" in dry.stderr


SCRIPT = """
import sys
sys.path.insert(0, {root!r})
{first}
import {package}.ops as ops
print("patched:", ops.attention.__name__, hasattr(ops.attention, "__otel_gpu_plan__"))
"""


@pytest.mark.parametrize("first", ["import otel_gpu", "import otel_gpu.auto"])
def test_otel_gpu_instrument_with_import_otel_gpu_alone_is_not_silent(tmp_path, package, first):
    """With OTEL_GPU_INSTRUMENT set, `import otel_gpu.auto` applies it (the target is armed at
    level 0 under control); `import otel_gpu` alone applies nothing and warns at exit, naming
    the target and what to do."""
    env = without_otel(
        OTEL_GPU_INSTRUMENT=f"{package}.ops",
        OTEL_GPU_CONTROL="on",
        OTEL_GPU_LOGLEVEL="0",
        OTEL_GPU_JOURNAL_DIR=str(tmp_path / "journal"),
    )
    code = SCRIPT.format(root=str(tmp_path), first=first, package=package)
    done = python_command(["-c", code], env, timeout=120)
    assert done.returncode == 0, done.stderr
    if first == "import otel_gpu.auto":
        assert "patched: attention True" in done.stdout
        assert "nothing applied it" not in done.stderr
    else:
        assert "patched: attention False" in done.stdout
        assert f"OTEL_GPU_INSTRUMENT names '{package}.ops'" in done.stderr
        assert "import otel_gpu.auto" in done.stderr


def test_otel_gpu_run_arms_targets_at_level_0_under_control(tmp_path, package):
    """`otel-gpu run` at level 0 with OTEL_GPU_CONTROL=on instruments its targets (armed) instead
    of saying that nothing is instrumented."""
    env = without_otel(
        OTEL_GPU_CONTROL="on",
        OTEL_GPU_LOGLEVEL="0",
        OTEL_GPU_JOURNAL_DIR=str(tmp_path / "journal"),
    )
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import {package}.ops as ops; "
        "print('patched:', hasattr(ops.attention, '__otel_gpu_armed__'))"
    )
    done = otel_gpu_command(
        ["run", "--instrument", f"{package}.ops", "--", sys.executable, "-c", code], env
    )
    assert done.returncode == 0, done.stderr
    assert "nothing is instrumented" not in done.stderr
    assert "patched: True" in done.stdout, done.stdout + done.stderr


def test_control_process_listens_once_instrument_module_arms(tmp_path):
    """A process whose only instrumentation is instrument_module() at armed level 0 leaves its
    marker: `otel-gpu control PID --show` reaches it; through the real channel, --list names its
    modules, --dry-run previews and applies nothing, and a glob matching nothing exits 1."""
    code = textwrap.dedent(
        """
        import os, sys, time, torch, otel_gpu
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        print(otel_gpu.instrument_module(model), flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.05)
        """
    )
    env = without_otel(
        OTEL_GPU_CONTROL="on",
        OTEL_GPU_LOGLEVEL="0",
        OTEL_GPU_JOURNAL_DIR=str(tmp_path / "journal"),
    )
    stop = tmp_path / "stop"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(stop)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "2"
        pid = str(proc.pid)
        shown = otel_gpu_command(["control", pid, "--show", "--timeout", "60"], env)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert "2 controllable function(s)" in shown.stdout
        listed = otel_gpu_command(["control", pid, "--list", "--json", "--timeout", "60"], env)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        names = {f["name"] for f in json.loads(listed.stdout)["functions"]}
        assert names == {"Sequential", "0"}
        dry = ["control", pid, "--level", "3", "--include", "0", "--dry-run", "--json"]
        preview = otel_gpu_command([*dry, "--timeout", "60"], env)
        assert preview.returncode == 0, preview.stdout + preview.stderr
        (row,) = json.loads(preview.stdout)["preview"]["selected"]
        assert row["name"] == "0" and row["would_be"] == 3
        refused = otel_gpu_command(
            ["control", pid, "--level", "3", "--include", "*attn*", "--timeout", "60"], env
        )
        assert refused.returncode == 1 and "selects none of the 2" in refused.stderr
        again = otel_gpu_command(["control", pid, "--show", "--json", "--timeout", "60"], env)
        assert json.loads(again.stdout)["effective"]["changed"] is False
    finally:
        stop.write_text("")
        proc.wait(timeout=120)


def test_the_opentelemetry_instrument_entry_point_arms_at_level_0(tmp_path, package, monkeypatch):
    """The `opentelemetry_instrumentor` entry point applies OTEL_GPU_INSTRUMENT at armed level 0:
    the target's functions are trampolines, and it says it applied them."""
    pytest.importorskip("opentelemetry.instrumentation.instrumentor")
    from otel_gpu import config
    from otel_gpu.instrumentation import targets
    from otel_gpu.instrumentation.entry_point import GpuInstrumentor

    monkeypatch.setenv("OTEL_GPU_INSTRUMENT", f"{package}.ops")
    monkeypatch.setenv("OTEL_GPU_CONTROL", "on")
    monkeypatch.setenv("OTEL_GPU_LOGLEVEL", "0")
    monkeypatch.setenv("OTEL_GPU_JOURNAL_DIR", str(tmp_path / "journal"))
    config.reset_overrides()
    instrumentor = GpuInstrumentor()
    instrumentor.instrument()
    try:
        ops = importlib.import_module(f"{package}.ops")
        assert hasattr(ops.attention, "__otel_gpu_armed__")
        assert targets.applied_how() == "opentelemetry-instrument"
        assert ops.attention(2.0, 1.0) == 2.0
    finally:
        instrumentor.uninstrument()
        state.reset("test teardown")
    assert not hasattr(ops.attention, "__otel_gpu_armed__")
