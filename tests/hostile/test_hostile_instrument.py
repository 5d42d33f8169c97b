"""Hostile ``OTEL_GPU_INSTRUMENT`` targets: the code otel-gpu and torch run on themselves.

* ``logging``, ``os``, ``threading`` or a bare ``*`` deadlocked the first decorated call: building
  the pipeline went through the instrumented functions, which waited for the pipeline.
* ``numpy`` (and ``torch.*``) under ``otel-gpu run`` crashed ``import torch``: the wrapper was
  built from a half-initialised torch.

Each is refused with one line naming the target, why and what is allowed, and the program runs
to the end, exit code 0. A target otel-gpu allows is still safe when the pipeline's construction
calls it, and when torch imports it while it initialises. Every program runs in a child process
under a generous timeout that only guards against a hang.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otel_gpu import config
from otel_gpu.instrumentation import refused

PYTHON_PROG = [sys.executable, "prog.py"]
HANG_GUARD = 240  # seconds; a hang guard only, each program takes a few seconds

# the program: torch imported after otel-gpu's bootstrap ran (as a real program does), then a
# decorated call, a log line, a thread, os calls and a Python child process
PROGRAM = textwrap.dedent(
    """
    import logging, os, subprocess, sys, threading
    import torch
    import otel_gpu
    import allowedpkg

    @otel_gpu.api
    def step(x):
        return x * 2

    print("sum", float(step(torch.ones(2)).sum()))
    logging.getLogger("app").warning("app log line")
    t = threading.Thread(target=lambda: os.getcwd()); t.start(); t.join()
    allowedpkg.work(3)
    subprocess.run([sys.executable, "-c", "import os; os.getpid()"], check=True)
    otel_gpu.flush()
    print("done")
    """
)


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in config.child_environment().items() if not k.startswith("OTEL_")}
    env.update(OTEL_GPU_LOGLEVEL="1", OTEL_GPU_JOURNAL="false", PYTHONPATH=str(tmp))
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=HANG_GUARD
        )
    except subprocess.TimeoutExpired as exc:  # a deadlock: say so rather than a bare timeout
        pytest.fail(f"{cmd[-1]!r} hung (no exit in {HANG_GUARD}s): {exc.stderr!r}")


def _run_instrumented(
    targets: str, program: list[str], env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """`otel-gpu run --instrument TARGETS -- PROGRAM` (see :func:`_run`)."""
    otel_gpu_run = [sys.executable, "-m", "otel_gpu", "run", "--instrument", targets, "--"]
    return _run([*otel_gpu_run, *program], env, cwd)


@pytest.fixture
def program(tmp_path: Path) -> Path:
    (tmp_path / "allowedpkg.py").write_text("def work(n):\n    return n + 1\n")
    (tmp_path / "prog.py").write_text(PROGRAM)
    return tmp_path


@pytest.mark.parametrize(
    "target", ["logging", "os", "threading", "numpy", "*", "importlib", "opentelemetry.sdk"]
)
def test_a_target_otel_gpu_runs_on_is_refused_under_run(program, target):
    """`otel-gpu run --instrument T` for the standard library, numpy, OpenTelemetry or a bare `*`
    hung or crashed; now the program runs to its end with exit code 0, and exactly one line names
    the target, why, and what is allowed (from `otel-gpu run`; the program and its Python child
    stay quiet). The allowed target beside it is still applied."""
    spans = program / "spans.jsonl"
    env = _env(program, OTEL_GPU_LOGDEST=str(spans))
    done = _run_instrumented(f"{target},allowedpkg", PYTHON_PROG, env, program)
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout
    lines = [line for line in done.stderr.splitlines() if "refused" in line]
    assert len(lines) == 1, done.stderr
    assert f"OTEL_GPU_INSTRUMENT target {target!r} refused: " in lines[0]
    assert "allowed: " in lines[0]
    text = spans.read_text()
    assert '"__main__.step"' in text and '"allowedpkg.work"' in text


def test_a_refusal_is_said_once_when_the_program_is_not_python(program):
    """`otel-gpu run -- sh -c "python prog.py"`: the program is a shell, every Python process is
    its child. The refusal is still said exactly once, by `otel-gpu run` itself."""
    env = _env(program, OTEL_GPU_LOGDEST=str(program / "spans.jsonl"))
    shell = ["sh", "-c", f"{sys.executable} prog.py"]
    done = _run_instrumented("logging,allowedpkg", shell, env, program)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "refused" in line]
    assert lines == [
        f"otel-gpu run: OTEL_GPU_INSTRUMENT {refused.refusal('logging')}",
    ], done.stderr
    assert '"allowedpkg.work"' in (program / "spans.jsonl").read_text()


@pytest.mark.parametrize(
    "spec",
    [
        "logging",
        "logging.Logger.info",
        "os.path",
        "threading:Thread.start",
        "numpy",
        "numpy.linalg.*",
        "otel_gpu.calls.decorator",
        "opentelemetry",
        "torch",
        "torch._C",
        "torch.utils._pytree",
        "torch.cuda.*",
        "torch.compiler.is_compiling",
        "google.protobuf",
        "*",
        "*.modeling_*",
        "?orch.nn",
    ],
)
def test_refused_targets_say_why_and_what_is_allowed(otel_gpu_spans, spec):
    """`instrument()` refuses what otel-gpu, OpenTelemetry and torch run on with a ValueError
    naming the target, why and what is allowed, before anything is patched."""
    import otel_gpu
    from otel_gpu.instrumentation import targets

    otel_gpu_spans(level=1)
    with pytest.raises(ValueError) as info:
        otel_gpu.instrument(spec)
    message = str(info.value)
    assert message.startswith(f"target {spec!r} refused: ") and refused.ALLOWED in message
    assert "\n" not in message
    assert targets.instrumented() == []


@pytest.mark.parametrize(
    "spec",
    [
        "torch.nn.functional",
        "torch.nn.functional.relu",
        "torch.distributed",
        "torch.distributed.distributed_c10d.all_reduce",
        "torch.*",
        "torch.nn.*",
        "transformers.models.*.modeling_*",
        "flashinfer",
        "mypkg.ops:Decoder.run",
        "osmium",  # a package whose name starts like a standard module's
    ],
)
def test_library_targets_are_not_refused(spec):
    """The libraries users trace stay allowed; `torch.*` is allowed and skips torch's internals."""
    assert refused.refusal(spec) is None


def test_an_object_target_in_a_refused_module_is_refused(otel_gpu_spans):
    """An object is judged by its import path: `instrument(logging.info)` is refused too."""
    import logging

    import otel_gpu

    otel_gpu_spans(level=1)
    with pytest.raises(ValueError, match=r"target 'logging\.info' refused"):
        otel_gpu.instrument(logging.info)
    assert logging.info.__module__ == "logging" and not hasattr(logging.info, "__otel_gpu_plan__")


def test_a_torch_glob_skips_torch_internals(otel_gpu_spans):
    """`torch.*` instruments torch's public modules but none of the refused ones (torch.cuda,
    torch._tensor, torch.compiler…): the wrapper calls those on every call."""
    import torch  # noqa: F401

    import otel_gpu
    from otel_gpu.instrumentation import targets

    otel_gpu_spans(level=1)
    otel_gpu.instrument("torch.nn.*", include=["*.relu"])
    patched = targets.instrumented()
    assert "torch.nn.functional.relu" in patched
    assert all(refused.refused_module(name) is None for name in patched)


IMPORTS_TORCH_AT_INIT = textwrap.dedent(
    """
    import sys
    import otel_gpu
    import torch
    from otel_gpu.instrumentation import targets
    print("torch", float(torch.ones(2).sum()))
    print("patched", len(targets.instrumented()))
    """
)


@pytest.mark.parametrize("target", ["torch.*", "tqdm.std"])
def test_a_target_torch_imports_while_it_initialises_is_instrumented_after(tmp_path, target):
    """A pending target whose module torch imports from its own __init__ (its submodules under
    `torch.*`; a dependency such as tqdm): wrapping it then built otel-gpu's wrapper from a
    half-initialised torch ("partially initialized module", an abort). It now waits for torch
    to finish, and is instrumented then."""
    if target == "tqdm.std":
        pytest.importorskip("tqdm")
    (tmp_path / "prog.py").write_text(IMPORTS_TORCH_AT_INIT)
    env = _env(tmp_path, OTEL_GPU_LOGDEST=str(tmp_path / "spans.jsonl"))
    done = _run_instrumented(target, PYTHON_PROG, env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "could not instrument" not in done.stderr, done.stderr
    patched = int(done.stdout.split("patched", 1)[1].split()[0])
    if target == "tqdm.std" and "never imported" in done.stderr:
        pytest.skip("this torch does not import tqdm while it initialises")
    assert patched > 0, done.stdout


REENTRANT = textwrap.dedent(
    """
    import otel_gpu
    import hostpkg
    from otel_gpu.export import pipeline

    otel_gpu.instrument("hostpkg")
    build = pipeline.Pipeline._resolve

    def resolve(self, provider):  # as a resource detector or exporter of that package would
        hostpkg.helper()
        return build(self, provider)

    pipeline.Pipeline._resolve = resolve
    print("result", hostpkg.helper())  # the first call builds the pipeline
    otel_gpu.flush()
    print("done")
    """
)


def test_building_the_pipeline_through_an_instrumented_function_does_not_deadlock(tmp_path):
    """The first call of an instrumented function builds the pipeline; when building it calls an
    instrumented function (a resource detector, an exporter of an instrumented package), that
    call waited for the pipeline being built: a deadlock. It now runs as it is (no span) and the
    first call itself is a span."""
    (tmp_path / "hostpkg.py").write_text("def helper():\n    return 7\n")
    (tmp_path / "prog.py").write_text(REENTRANT)
    spans = tmp_path / "spans.jsonl"
    done = _run([sys.executable, "prog.py"], _env(tmp_path, OTEL_GPU_LOGDEST=str(spans)), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "result 7" in done.stdout and "done" in done.stdout
    assert spans.read_text().count('"name":"hostpkg.helper"') == 1
