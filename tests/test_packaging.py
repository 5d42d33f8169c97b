"""Packaging: `exporters/` ships as `otel_gpu.exporters` in wheels and editable installs alike."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys
import zipfile

import pytest

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


@pytest.mark.slow
def test_wheel_contains_otel_gpu_exporters_and_no_top_level_exporters(tmp_path):
    """A built wheel places exporters/ under otel_gpu/ and declares the entry points."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("otel_gpu-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "otel_gpu/exporters/console.py" in names
    assert "otel_gpu/exporters/destinations.py" in names
    assert not any(n.startswith("exporters/") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "[opentelemetry_traces_exporter]" in text and "[opentelemetry_resource_detector]" in text


def test_every_package_folder_is_listed_for_the_wheel():
    """pyproject lists packages explicitly, so a folder left out of the list is left out of every
    wheel (``otel_gpu.metrics`` was): each folder of ``otel_gpu/`` with an ``__init__.py`` is listed."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {"otel_gpu." + p.parent.name for p in (ROOT / "otel_gpu").glob("*/__init__.py")}
    assert folders - listed == set(), f"not in pyproject's packages: {sorted(folders - listed)}"
