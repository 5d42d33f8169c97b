"""Packaging: `exporters/` ships as `otel_gpu.exporters` in wheels and editable installs alike,
and a wheel holds every package of the source tree.

The tests import otel-gpu from the source tree (an editable install), so a package missing from
pyproject's list goes unnoticed until someone installs a wheel: the first run on a GPU machine
found ``otel_gpu.metrics`` missing that way."""

from __future__ import annotations

import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_exporters_subpackage_imports_from_the_install():
    """`otel_gpu.exporters` resolves to the repository's exporters/ directory; no top-level `exporters` of ours."""
    import otel_gpu.exporters
    import otel_gpu.exporters.console

    assert pathlib.Path(otel_gpu.exporters.__file__).parent.name == "exporters"
    assert otel_gpu.exporters.ConsoleSpanExporter is otel_gpu.exporters.console.ConsoleSpanExporter
    # Outside the source tree (where `python -m` puts the cwd on sys.path) a bare
    # `exporters` must not resolve to our directory.
    probe = (
        "import importlib.util, sys; spec = importlib.util.find_spec('exporters'); "
        "print(spec.origin if spec else '')"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd="/", timeout=60
    )
    assert out.returncode == 0, out.stderr
    origin = out.stdout.strip()
    assert not origin or not pathlib.Path(origin).resolve().is_relative_to(ROOT), origin


def test_entry_points_are_registered():
    """The console renderer, resource detector, CLI and pytest plugin are discoverable by entry point."""
    eps = importlib.metadata.entry_points()
    assert {e.name for e in eps.select(group="opentelemetry_traces_exporter")} >= {
        "otel_gpu_console"
    }
    assert {e.name for e in eps.select(group="opentelemetry_resource_detector")} >= {"otel_gpu"}
    assert {e.name for e in eps.select(group="console_scripts")} >= {"otel-gpu"}
    (console,) = [
        e for e in eps.select(group="opentelemetry_traces_exporter") if e.name == "otel_gpu_console"
    ]
    from otel_gpu.exporters.console import ConsoleSpanExporter

    assert console.load() is ConsoleSpanExporter


def _wheel(tmp_path: pathlib.Path) -> pathlib.Path:
    """A wheel built from a copy of the tree: a stale build/ folder in the tree would otherwise
    lend the wheel its files."""
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("otel_gpu", "exporters"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*pip, "--no-index", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("otel_gpu-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_contains_otel_gpu_exporters_and_no_top_level_exporters(tmp_path):
    """A built wheel places exporters/ under otel_gpu/ and declares the entry points."""
    wheel = _wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "otel_gpu/exporters/console.py" in names
    assert "otel_gpu/exporters/destinations.py" in names
    assert not any(n.startswith("exporters/") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "[opentelemetry_traces_exporter]" in text and "[opentelemetry_resource_detector]" in text


def _tree_packages() -> set[str]:
    found = {"otel_gpu.exporters"}
    for init in (ROOT / "otel_gpu").rglob("__init__.py"):
        if "__pycache__" not in init.parts:
            found.add(".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_every_package_of_the_tree_is_listed_in_pyproject():
    """A folder with an ``__init__.py`` under otel_gpu/ that pyproject does not list is left out of
    every wheel: the list must name exactly the tree's packages."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == _tree_packages()
    assert config["package-dir"]["otel_gpu.exporters"] == "exporters"


@pytest.mark.slow
def test_the_wheel_holds_every_module_of_the_tree(tmp_path):
    """The wheel built from the tree holds every module of otel_gpu/ and exporters/ (the latter as
    otel_gpu/exporters/), and the bootstrap file of ``otel-gpu run``."""
    wheel = _wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "otel_gpu").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    expected |= {
        "otel_gpu/exporters/" + str(p.relative_to(ROOT / "exporters"))
        for p in (ROOT / "exporters").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert expected - names == set()
    assert "otel_gpu/py.typed" in names
