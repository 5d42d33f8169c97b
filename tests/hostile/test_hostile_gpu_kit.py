"""Hostile GPU kits: ``tests/gpu/run.sh`` installs only the wheels ``make gpu-kit`` wrote.

Each kit is crafted here in a temporary folder: a wheel the manifest does not name, one whose
bytes changed since, one the manifest names but the kit lacks, no manifest at all, and wheels
the manifest names rightly but which carry a file Python would run at every start of the GPU
machine's interpreter once installed (``sitecustomize``, ``usercustomize``, a ``.pth`` file at
the top, also through a wheel's ``.data/purelib``). Each is refused with exit 2 and a line
naming what was wrong, before anything else runs: no output folder made, no torch imported,
nothing installed. docs/gpu.md, "The kit".
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
RUN = ROOT / "tests" / "gpu" / "run.sh"
NAME = "clean_pkg-1.0-py3-none-any.whl"


def _wheel(path: Path, extra: dict[str, str] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("clean_pkg/__init__.py", "VALUE = 1\n")
        archive.writestr("clean_pkg-1.0.dist-info/METADATA", "Name: clean-pkg\nVersion: 1.0\n")
        for name, text in (extra or {}).items():
            archive.writestr(name, text)
    return path


def _manifest(kit: Path, names: list[str] | None = None) -> None:
    lines = ["# crafted"]
    for name in names if names is not None else sorted(p.name for p in kit.glob("*.whl")):
        wheel = kit / name
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest() if wheel.exists() else "0" * 64
        lines.append(f"{digest}  {name}")
    (kit / "MANIFEST.txt").write_text("\n".join(lines) + "\n")


def _run(kit: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """run.sh against ``kit``, with a ``torch`` on PYTHONPATH that fails to import: the
    script's torch check comes after the kit check, so its message shows the kit passed."""
    fake = tmp / "no-torch" / "torch"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text("raise ImportError('no torch in this test')\n")
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(fake.parent))
    return subprocess.run(
        ["bash", str(RUN), "--kit", str(kit), "--out", str(tmp / "out"), "--short"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_kit_that_passes_the_check_goes_on_to_the_torch_check(tmp_path):
    """A kit whose wheels are all in the manifest, hashes right, with nothing run at start:
    the check passes and the script goes on (here to its torch check, which fails on the
    crafted torch: exit 2 with that message, not the kit's)."""
    kit = tmp_path / "kit"
    kit.mkdir()
    _wheel(kit / NAME)
    _manifest(kit)
    proc = _run(kit, tmp_path)
    assert proc.returncode == 2
    assert "cannot import torch" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "the kit is not installed" not in proc.stderr


def _refused(kit: Path, tmp: Path, *words: str) -> None:
    proc = _run(kit, tmp)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "the kit is not installed" in proc.stderr, output
    for word in words:
        assert word in proc.stderr, output
    assert "cannot import torch" not in output  # refused before anything else
    assert not (tmp / "out").exists()


def test_a_wheel_not_in_the_manifest_is_refused(tmp_path):
    """A wheel dropped into the kit after ``make gpu-kit`` (not in the manifest): refused,
    naming it."""
    kit = tmp_path / "kit"
    kit.mkdir()
    _wheel(kit / NAME)
    _manifest(kit)
    _wheel(kit / "planted-1.0-py3-none-any.whl")
    _refused(kit, tmp_path, "planted-1.0-py3-none-any.whl", "is not in")


def test_a_wheel_changed_since_the_manifest_is_refused(tmp_path):
    """A wheel whose bytes changed after the manifest was written: refused, naming it."""
    kit = tmp_path / "kit"
    kit.mkdir()
    _wheel(kit / NAME)
    _manifest(kit)
    _wheel(kit / NAME, {"clean_pkg/extra.py": "X = 2\n"})
    _refused(kit, tmp_path, NAME, "SHA-256")


def test_a_kit_without_a_manifest_is_refused(tmp_path):
    """A folder of wheels with no manifest (an old kit, or one put together by hand)."""
    kit = tmp_path / "kit"
    kit.mkdir()
    _wheel(kit / NAME)
    _refused(kit, tmp_path, "MANIFEST.txt is missing")


def test_a_wheel_the_manifest_lists_but_the_kit_lacks_is_refused(tmp_path):
    """A kit missing a wheel its manifest lists (a copy cut short): refused, naming it."""
    kit = tmp_path / "kit"
    kit.mkdir()
    _wheel(kit / NAME)
    _manifest(kit, [NAME, "gone-1.0-py3-none-any.whl"])
    _refused(kit, tmp_path, "gone-1.0-py3-none-any.whl", "not in")


@pytest.mark.parametrize(
    "entry",
    [
        "sitecustomize.py",
        "usercustomize.py",
        "sitecustomize/__init__.py",
        "zz_hook.pth",
        "clean_pkg-1.0.data/purelib/zz_hook.pth",
        "clean_pkg-1.0.data/platlib/sitecustomize.py",
    ],
)
def test_a_wheel_carrying_a_start_up_hook_is_refused_even_in_the_manifest(tmp_path, entry):
    """A wheel the manifest names with the right hash, which carries a file Python would run
    at every start once installed at the top of the folder: refused, naming the wheel and the
    file (the manifest proves where a wheel came from, not what it does)."""
    kit = tmp_path / "kit"
    kit.mkdir()
    _wheel(kit / NAME, {entry: "import os\n"})
    _manifest(kit)
    _refused(kit, tmp_path, NAME, entry, "would run at every start")


def test_a_pth_file_inside_a_package_is_not_a_start_up_hook(tmp_path):
    """A ``.pth`` file below the top (inside a package) is not read at start: accepted."""
    kit = tmp_path / "kit"
    kit.mkdir()
    _wheel(kit / NAME, {"clean_pkg/data/table.pth": "weights\n"})
    _manifest(kit)
    proc = _run(kit, tmp_path)
    assert "cannot import torch" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
