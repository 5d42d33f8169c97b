"""``otel_gpu.instrument()``: spans for code nobody decorated, in any import order, idempotent,
undoable, and free at level 0."""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap
import uuid

import pytest
from commands import python_command

import otel_gpu
from otel_gpu import config

MOD = """
import functools

def attention(q, k, scale=1.0):
    return q * scale

def fails(x):
    raise KeyError(x)

def _private(x):
    return x

class Decoder:
    def run(self, x, *, steps=1):
        return x + steps

    def _helper(self, x):
        return x

    @staticmethod
    def pack(x):
        return [x]

    @classmethod
    def make(cls, n):
        return cls()
"""


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh package ``<name>`` with ``<name>.ops`` (the code) re-exported by ``<name>/__init__``;
    not imported. Returns its name."""
    name = f"instpkg_{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text(f"from {name}.ops import attention, Decoder\n")
    (root / "ops.py").write_text(textwrap.dedent(MOD))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def _names(spans) -> list[str]:
    return [s.name for s in spans.get()]


def test_a_module_target_instruments_public_functions_and_methods(otel_gpu_spans, package):
    """Public functions and public methods of public classes; private ones are left alone; span
    names are the library's own module.qualname; the package re-export is patched too."""
    spans = otel_gpu_spans(level=3)
    ops = importlib.import_module(f"{package}.ops")
    pkg = sys.modules[package]
    done = otel_gpu.instrument(ops)
    assert f"{package}.ops.attention" in done and f"{package}.ops.Decoder.run" in done
    assert not any("_private" in d or "_helper" in d for d in done)
    ops.attention(2.0, 1.0)
    pkg.attention(2.0, 1.0)  # the same function, imported by the package before we patched
    ops.Decoder().run(1, steps=2)
    ops.Decoder.pack(1)
    ops.Decoder.make(3)
    ops._private(1)
    assert _names(spans) == [
        f"{package}.ops.attention",
        f"{package}.ops.attention",
        f"{package}.ops.Decoder.run",
        f"{package}.ops.Decoder.pack",
        f"{package}.ops.Decoder.make",
    ]
    run = spans.get()[2]
    assert run.attributes["otel_gpu.input.x.value"] == 1
    assert run.attributes["otel_gpu.input.steps.value"] == 2


@pytest.mark.parametrize("order", ["instrument-then-import", "import-then-instrument"])
@pytest.mark.parametrize("target", ["{p}.ops", "{p}.ops.attention", "{p}.ops.Decoder.run", "{p}.*"])
def test_a_dotted_path_works_in_any_import_order(otel_gpu_spans, package, order, target):
    """A string target is instrumented now if imported, else when first imported (post-import
    hook), so the order of imports does not matter; globs match module names."""
    spans = otel_gpu_spans(level=1)
    spec = target.format(p=package)
    if order == "import-then-instrument":
        importlib.import_module(package)
        otel_gpu.instrument(spec)
    else:
        assert otel_gpu.instrument(spec) == []  # nothing imported yet: pending
        assert f"{package}.ops" not in sys.modules  # instrumenting never imports the target
        importlib.import_module(package)
    ops = sys.modules[f"{package}.ops"]
    ops.attention(1.0, 1.0)
    ops.Decoder().run(1)
    names = _names(spans)
    if spec.endswith("attention"):
        assert names == [f"{package}.ops.attention"]
    elif spec.endswith("run"):
        assert names == [f"{package}.ops.Decoder.run"]
    else:
        assert names == [f"{package}.ops.attention", f"{package}.ops.Decoder.run"]


def test_instrumenting_twice_makes_one_span_per_call(otel_gpu_spans, package):
    """Idempotent: a second instrument() of the same or an overlapping target patches nothing."""
    spans = otel_gpu_spans(level=1)
    ops = importlib.import_module(f"{package}.ops")
    first = otel_gpu.instrument(ops)
    assert otel_gpu.instrument(ops) == [] and otel_gpu.instrument(f"{package}.ops.attention") == []
    assert first
    ops.attention(1.0, 1.0)
    assert len(spans.get()) == 1


def test_uninstrument_restores_the_very_same_objects(otel_gpu_spans, package):
    """After uninstrument(), every attribute is the original object again, and calls make no span."""
    spans = otel_gpu_spans(level=1)
    ops = importlib.import_module(f"{package}.ops")
    pkg = sys.modules[package]
    before = (
        ops.attention,
        pkg.attention,
        ops.Decoder.__dict__["run"],
        ops.Decoder.__dict__["pack"],
    )
    otel_gpu.instrument(ops)
    assert ops.attention is not before[0]
    assert otel_gpu.uninstrument(ops) >= 5
    after = (
        ops.attention,
        pkg.attention,
        ops.Decoder.__dict__["run"],
        ops.Decoder.__dict__["pack"],
    )
    assert all(a is b for a, b in zip(after, before))
    ops.attention(1.0, 1.0)
    assert spans.get() == []


def test_level_0_patches_nothing(package):
    """At level 0 instrument() returns at once: no attribute changes, no import hook."""
    otel_gpu.configure(level=0)
    ops = importlib.import_module(f"{package}.ops")
    original = ops.attention
    hooks = list(sys.meta_path)
    assert otel_gpu.instrument(ops) == [] and otel_gpu.instrument("not_imported_pkg") == []
    assert ops.attention is original and sys.meta_path == hooks


def test_include_and_exclude_filter_by_qualified_name(otel_gpu_spans, package):
    """include/exclude are fnmatch patterns on module.qualname."""
    otel_gpu_spans(level=1)
    ops = importlib.import_module(f"{package}.ops")
    done = otel_gpu.instrument(ops, include=["*.Decoder.*"], exclude=["*.make"])
    assert sorted(d.rsplit(".", 1)[1] for d in done) == ["pack", "run"]


def test_the_users_exception_passes_through_as_the_same_object(otel_gpu_spans, package):
    """An instrumented function that raises: the caller gets the very same exception object, and
    the span records it."""
    spans = otel_gpu_spans(level=3)
    ops = importlib.import_module(f"{package}.ops")
    otel_gpu.instrument(f"{package}.ops.fails")
    marker = object()
    with pytest.raises(KeyError) as info:
        ops.fails(marker)
    assert info.value.args[0] is marker
    (span,) = spans.get()
    assert span.status.status_code.name == "ERROR"


def test_otel_gpu_instrument_setting_needs_no_code(otel_gpu_spans, package, monkeypatch):
    """OTEL_GPU_INSTRUMENT lists targets (comma-separated, globs allowed) for
    instrument_from_settings(), which the run command and the OTel entry point call."""
    monkeypatch.setenv("OTEL_GPU_INSTRUMENT", f"{package}.ops.attention, {package}.ops.Decoder")
    spans = otel_gpu_spans(level=1)
    assert config.current().instrument == (f"{package}.ops.attention", f"{package}.ops.Decoder")
    otel_gpu.instrument_from_settings()
    ops = importlib.import_module(f"{package}.ops")
    ops.attention(1.0, 1.0)
    ops.Decoder().run(1)
    assert _names(spans) == [f"{package}.ops.attention", f"{package}.ops.Decoder.run"]


def test_a_bad_target_warns_once_and_the_program_runs_on(otel_gpu_spans, package, caplog):
    """A target naming a missing attribute: one warning naming the target and the attribute; the
    other targets are still instrumented; nothing raises into the program."""
    spans = otel_gpu_spans(level=1, strict=False)
    importlib.import_module(package)
    settings = config.with_changes(
        config.current(), instrument=(f"{package}.ops.nope", f"{package}.ops.attention")
    )
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        otel_gpu.instrument_from_settings(settings)
    (record,) = [r for r in caplog.records if "nope" in r.getMessage()]
    assert "has no attribute 'nope'" in record.getMessage()
    sys.modules[f"{package}.ops"].attention(1.0, 1.0)
    assert len(spans.get()) == 1


def test_a_function_not_reachable_by_its_import_path_is_refused_clearly(otel_gpu_spans):
    """A local function cannot be patched where it lives: the error says so and what to do."""
    otel_gpu_spans(level=1)

    def local(x):
        return x

    with pytest.raises(ValueError, match="not reachable by its import path"):
        otel_gpu.instrument(local)


@pytest.mark.parametrize(
    "target", ["torch.nn.functional.relu", "torch.distributed.distributed_c10d.all_reduce"]
)
def test_a_torch_target_named_before_torch_is_imported_is_instrumented(tmp_path, target):
    """`import otel_gpu` imports no torch, so a torch target can be pending when torch is first
    imported; torch imports these submodules from its own __init__, while half initialised.
    Wrapping them then failed ("partially initialized module 'torch' has no attribute 'nn'")
    and left them uninstrumented; they must be instrumented once torch is whole."""
    import subprocess

    out = tmp_path / "spans.jsonl"
    program = textwrap.dedent(
        f"""
        import sys
        import otel_gpu
        assert "torch" not in sys.modules
        otel_gpu.instrument({target!r})
        import torch
        import torch.distributed.distributed_c10d as c10d
        fn = torch.nn.functional.relu if {target!r}.endswith("relu") else c10d.all_reduce
        assert otel_gpu.instrumentation.targets._is_ours(fn), fn
        if fn is torch.nn.functional.relu:
            fn(torch.ones(2))
        otel_gpu.flush()
        """
    )
    env = {k: v for k, v in config.child_environment().items() if not k.startswith("OTEL_")}
    env.update(OTEL_GPU_LOGLEVEL="1", OTEL_GPU_LOGDEST=str(out), OTEL_GPU_JOURNAL="false")
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "could not instrument" not in done.stderr
    if target.endswith("relu"):
        assert '"torch.nn.functional.relu"' in out.read_text()


# ------------------------------------------------- OTEL_GPU_INSTRUMENT without a start-up hook

NOT_UNDER_RUN = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import otel_gpu

    @otel_gpu.api
    def step(x):
        return x * 2

    dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
    t = step(torch.ones(2))
    dist.all_reduce(t)
    dist.destroy_process_group()
    otel_gpu.flush()
    from otel_gpu.instrumentation import targets
    print("applied by", targets.applied_how())
    """
)


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in config.child_environment().items() if not k.startswith("OTEL_")}
    env.update(OTEL_GPU_LOGLEVEL="1", OTEL_GPU_JOURNAL="false", **extra)
    return env


def test_the_setting_applies_in_a_program_not_started_by_run(tmp_path):
    """OTEL_GPU_INSTRUMENT=torch.distributed in a program that imports otel-gpu and decorates
    functions, started by plain `python`: the setting did nothing, silently. It is applied at the
    first decoration, so the collective is a span, and nothing warns that it was ignored."""
    out = tmp_path / "spans.jsonl"
    (tmp_path / "prog.py").write_text(NOT_UNDER_RUN)
    env = _child_env(OTEL_GPU_INSTRUMENT="torch.distributed", OTEL_GPU_LOGDEST=str(out))
    store = f"file://{tmp_path / 'store'}"
    done = python_command(["prog.py", store], env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "applied by first configuration" in done.stdout
    text = out.read_text()
    assert '"name":"torch.distributed.all_reduce"' in text and '"name":"__main__.step"' in text


def test_configure_alone_applies_the_setting(tmp_path):
    """A program that only calls configure() (no decorated function): the targets of
    OTEL_GPU_INSTRUMENT are applied then, and a module imported afterwards makes spans."""
    out = tmp_path / "spans.jsonl"
    (tmp_path / "lib_late.py").write_text("def work(n):\n    return n + 1\n")
    code = (
        f"import otel_gpu; otel_gpu.configure(level=1, dest={str(out)!r}); "
        "import lib_late; lib_late.work(1); otel_gpu.flush()"
    )
    done = python_command(
        ["-c", code], env=_child_env(OTEL_GPU_INSTRUMENT="lib_late"), cwd=tmp_path, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert '"name":"lib_late.work"' in out.read_text()


def test_the_setting_is_decided_once_per_configuration(otel_gpu_spans, package, monkeypatch):
    """The setting is applied once per configuration, not at every decoration: a target the
    program took back with uninstrument() stays off when further functions are decorated."""
    monkeypatch.setenv("OTEL_GPU_INSTRUMENT", f"{package}.ops.attention")
    otel_gpu_spans(level=1)
    ops = importlib.import_module(f"{package}.ops")
    assert otel_gpu.instrumentation.targets._is_ours(ops.attention)
    otel_gpu.uninstrument()
    otel_gpu.api(lambda: None)
    assert not otel_gpu.instrumentation.targets._is_ours(ops.attention)


def test_info_says_whether_and_how_the_setting_is_applied(tmp_path):
    """`otel-gpu info` with OTEL_GPU_INSTRUMENT set showed the value with no note. It now says
    the targets are not applied in its own process and how a program applies them; under
    `otel-gpu run` it says they were applied, and by what. A refused target is named."""
    from commands import otel_gpu_command

    env = _child_env(OTEL_GPU_INSTRUMENT="torch.distributed,logging")
    plain = otel_gpu_command(["info"], env, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert (
        "note: OTEL_GPU_INSTRUMENT applied in this process: no (this command instruments "
        "nothing); a program applies them at start-up under `otel-gpu run` or "
        "`opentelemetry-instrument`; started otherwise, at its first @otel_gpu.api decoration"
    ) in plain.stdout
    assert "note: OTEL_GPU_INSTRUMENT target 'logging' refused: the standard library" in (
        plain.stdout
    )
    as_json = otel_gpu_command(["info", "--json"], env, cwd=tmp_path)
    import json

    instrument = json.loads(as_json.stdout)["instrument"]
    assert instrument["targets"] == ["torch.distributed", "logging"]
    assert list(instrument["refused"]) == ["logging"]
    run = otel_gpu_command(
        ["run", "--", sys.executable, "-m", "otel_gpu", "info"],
        _child_env(OTEL_GPU_INSTRUMENT="torch.distributed"),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert "OTEL_GPU_INSTRUMENT applied in this process: yes, by otel-gpu run" in run.stdout
