"""A dump folder that ships Python modules: replay never imports code from it.

The payload is a dump whose folder also holds modules named like the standard library's and
the SDK's imports (``json``, ``psutil``, ``typing_extensions``, ``numpy``, ``rich``,
``safetensors``, ``sitecustomize``), like otel-gpu and torch themselves, and like the module
the user allows. Each writes a marker file ``RAN-<name>`` next to itself when imported (then
loads the real module, so nothing else would look wrong). The user does what a user does:
``cd dump && otel-gpu replay --dir . --allow-module mylib``. Replay of a completed call runs in the
process, replay of a call that crashed when recorded (and every call with ``--isolate``) in a
child: no marker may appear in either, and the verdicts come from the real modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from commands import python_command, without_otel
from dump_files import finish

from otel_gpu import cli

LIB = """
import torch
import otel_gpu

@otel_gpu.api
def add(x, y):
    return x + y
"""

PLANTED = """
import importlib.machinery, importlib.util, os, sys
_here = os.path.dirname(os.path.abspath(__file__))
if os.path.basename(__file__) == "__init__.py":
    _here = os.path.dirname(_here)
open(os.path.join(_here, "RAN-" + __name__), "w").close()
_spec = importlib.machinery.PathFinder.find_spec(
    __name__, [p for p in sys.path if os.path.abspath(p or ".") != _here]
)
if _spec is None:
    raise ModuleNotFoundError(f"No module named {__name__!r}", name=__name__)
_real = importlib.util.module_from_spec(_spec)
sys.modules[__name__] = _real
_spec.loader.exec_module(_real)
"""

MODULES = ("json", "psutil", "typing_extensions", "numpy", "rich", "safetensors", "sitecustomize")
PACKAGES = ("otel_gpu", "opentelemetry", "torch")


def _dump(tmp_path: Path, otel_gpu_spans: Any, module_factory: Any) -> tuple[Any, Path]:
    """Two recorded calls of ``add`` (the second marked as crashed), and the planted modules."""
    root = tmp_path / "dump"
    otel_gpu_spans(level=10, dump_dir=str(root))
    m = module_factory(LIB, "isolib")
    m.add(torch.ones(3), torch.ones(3))
    m.add(torch.zeros(3), torch.ones(3))
    finish()
    crashed = sorted(p for p in root.iterdir() if p.is_dir())[1]
    manifest = json.loads((crashed / "manifest.json").read_text())
    manifest.update(status="inputs_saved", result=None)
    manifest["files"]["outputs"] = None
    (crashed / "manifest.json").write_text(json.dumps(manifest))
    for name in ("returned", "outputs.pt", "outputs.safetensors"):
        (crashed / name).unlink(missing_ok=True)
    for name in (*MODULES, m.__name__):
        (root / f"{name}.py").write_text(PLANTED)
    for name in PACKAGES:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(PLANTED)
    return m, root


def _ran(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("RAN-"))


def _verdicts(report: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(r["verdict"], r.get("now")) for r in report["results"]]


def _console_script() -> str:
    script = os.path.join(os.path.dirname(sys.executable), "otel-gpu")
    if not os.path.exists(script):
        pytest.skip("the otel-gpu console script is not installed next to this Python")
    return script


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolate"])
def test_replay_from_inside_a_dump_imports_nothing_from_it(
    tmp_path, otel_gpu_spans, module_factory, isolate
):
    """`cd dump && otel-gpu replay --dir . --allow-module mylib` (the user's project on PYTHONPATH):
    no module the dump folder ships is imported, in the process or in the isolated child; the
    calls are judged with the real modules (pass; crashed-originally, now it returns)."""
    m, root = _dump(tmp_path, otel_gpu_spans, module_factory)
    flags = ["--isolate"] if isolate else []
    proc = subprocess.run(
        [_console_script(), "replay", "--dir", ".", "--allow-module", m.__name__, "--json", *flags],
        cwd=root,
        env=without_otel(PYTHONPATH=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert _ran(root) == [], proc.stderr
    assert proc.returncode == 1, proc.stderr  # a crashed-originally call fails the run
    assert _verdicts(json.loads(proc.stdout)) == [
        ("pass", None),
        ("crashed-originally", "returns"),
    ]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P is new in 3.11")
def test_python_m_replay_of_a_dump_imports_nothing_from_it(
    tmp_path, otel_gpu_spans, module_factory
):
    """`python -P -m otel_gpu replay --dir .` from inside the dump: the child that replays the
    crashed call does not import the dump's modules either (it starts isolated)."""
    m, root = _dump(tmp_path, otel_gpu_spans, module_factory)
    allow = ["--allow-module", m.__name__]
    proc = python_command(
        ["-P", "-m", "otel_gpu", "replay", "--dir", ".", "--json", *allow],
        env=without_otel(PYTHONPATH=str(tmp_path)),
        cwd=root,
        timeout=300,
    )
    assert _ran(root) == [], proc.stderr
    assert _verdicts(json.loads(proc.stdout))[1] == ("crashed-originally", "returns")


def test_in_process_replay_adds_no_import_path_and_opens_no_module_of_the_dump(
    tmp_path, otel_gpu_spans, module_factory, monkeypatch, capsys
):
    """The command run in this process from inside the dump: sys.path gains neither the current
    directory nor the dump, no file of the dump is opened as a module (audit events 'open' and
    'import'), and the isolated child for the crashed call imports nothing from it."""
    m, root = _dump(tmp_path, otel_gpu_spans, module_factory)
    seen: list[str] = []
    watching = [True]
    folder = str(root.resolve())

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if not watching[0]:
            return
        if event == "open" and isinstance(args[0], str):
            path = os.path.abspath(args[0])
            if path.startswith(folder) and path.endswith((".py", ".pyc")):
                seen.append(path)
        elif event == "import" and len(args) > 1 and isinstance(args[1], str):
            if os.path.abspath(args[1]).startswith(folder):
                seen.append(args[1])

    sys.addaudithook(audit)  # hooks cannot be removed: this one stops watching after the test
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        code = cli.main(["replay", "--dir", ".", "--allow-module", m.__name__, "--json"])
        try:
            import psutil  # noqa: F401  (what the SDK's resource detection imports)
        except ImportError:
            pass
    finally:
        watching[0] = False
    report = json.loads(capsys.readouterr().out)
    assert seen == [] and _ran(root) == []
    assert str(root) not in sys.path and folder not in sys.path and "" not in sys.path
    assert code == 1
    assert _verdicts(report) == [("pass", None), ("crashed-originally", "returns")]


def test_a_path_inside_the_dump_is_refused(tmp_path, otel_gpu_spans, module_factory, capsys):
    """--path names folders of the user's own modules: the dump folder itself is refused with a
    one-line usage error, and nothing of it is imported."""
    m, root = _dump(tmp_path, otel_gpu_spans, module_factory)
    code = cli.main(
        ["replay", "--dir", str(root), "--path", str(root), "--allow-module", m.__name__]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "inside the dump being replayed" in err and "\n" not in err.strip()
    assert _ran(root) == []


def test_the_users_modules_are_found_through_path_never_the_current_directory(
    tmp_path, otel_gpu_spans, module_factory
):
    """Run from the project's folder (where the allowed module lives) without PYTHONPATH: the
    module is not found there (skipped, naming --path and PYTHONPATH); with --path . it is."""
    m, root = _dump(tmp_path, otel_gpu_spans, module_factory)
    argv = [_console_script(), "replay", str(root), "--allow-module", m.__name__, "--json"]
    for flags, verdict in (([], "skipped"), (["--path", "."], "pass")):
        proc = subprocess.run(
            [*argv, *flags],
            cwd=tmp_path,
            env=without_otel(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        first = json.loads(proc.stdout)["results"][0]
        assert first["verdict"] == verdict, first
        if verdict == "skipped":
            assert "--path DIR or PYTHONPATH" in first["detail"]
    assert _ran(root) == []
