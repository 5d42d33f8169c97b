"""The GPU kit: `make gpu-kit` here, `bash tests/gpu/run.sh` on a GPU machine with no network.

The kit is downloaded from the package registries (as `make gpu-kit` does), so these tests need
them, as `make test` does anyway.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _kit(tmp: Path, python: str) -> Path:
    kit = tmp / f"kit-{python}"
    env = dict(os.environ, GPU_KIT_PYTHON=python, GPU_KIT_DIR=str(kit), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu-kit.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return kit


def test_the_kit_resolves_for_the_gpu_machines_python_and_never_carries_torch(tmp_path):
    """For CPython 3.12 on manylinux x86_64 the kit alone satisfies otel-gpu's OpenTelemetry
    requirements (the script's own --no-index check), and it holds no torch, CUDA or numpy wheel
    that would shadow the GPU machine's own."""
    kit = _kit(tmp_path, "3.12")
    wheels = sorted(p.name for p in kit.glob("*.whl"))
    assert any(w.startswith("opentelemetry_sdk-") for w in wheels)
    assert any(w.startswith("opentelemetry_exporter_otlp_proto_grpc-") for w in wheels)
    assert not [w for w in wheels if re.match(r"(torch|nvidia_|triton|numpy)[-_]", w)]
    for wheel in wheels:
        tags = wheel[: -len(".whl")].split("-")[-3:]
        assert tags[2] == "any" or "x86_64" in tags[2], wheel
        assert tags[0] in ("py3", "cp312") or tags[1] == "abi3", wheel
    assert (kit / "MANIFEST.txt").read_text().count(".whl") == len(wheels)


def test_run_sh_runs_end_to_end_without_network_and_leaves_torch_alone(tmp_path):
    """On a CPU machine, in a Python without otel-gpu: the kit installs with --no-index into a
    temporary folder, otel-gpu is built from the tree into it (and imported from there, not from
    the tree), the versions are printed, every GPU test reports a skip and the workload says it
    was skipped; exit 0, with the log and the JUnit file in --out."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    kit = _kit(tmp_path, version)
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300
    )
    # torch, pytest, pip and setuptools from this environment, through a path entry: its .pth files
    # (the editable install of otel-gpu among them) are not run, so otel-gpu is not importable
    (next((venv / "lib").glob("python*")) / "site-packages" / "zz_host.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    python = venv / "bin" / "python"
    probe = subprocess.run(
        [str(python), "-c", "import otel_gpu"], cwd=tmp_path, capture_output=True, timeout=120
    )
    assert probe.returncode != 0  # the premise: only the kit's build can provide it
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHONPATH"))}
    env["PYTHON"] = str(python)
    proc = subprocess.run(
        ["bash", str(ROOT / "tests" / "gpu" / "run.sh"), "--out", str(out), "--kit", str(kit)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = (out / "run.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "cuda available: False" in log
    line = next(x for x in log.splitlines() if x.startswith("otel-gpu "))
    assert "/site/otel_gpu/" in line and str(ROOT / "otel_gpu") not in line, line
    torch_line = next(x for x in log.splitlines() if x.startswith("torch ") and " from " in x)
    import torch

    assert torch_line.endswith(torch.__file__)
    suite = ET.parse(out / "suite.xml").getroot()
    counts = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert counts is not None
    assert int(counts.get("tests", "0")) >= 12
    assert counts.get("skipped") == counts.get("tests")
    assert counts.get("errors") == "0" and counts.get("failures") == "0"
    assert "workload: skipped (no CUDA device)" in log


def test_run_sh_without_a_kit_says_how_to_make_one(tmp_path):
    """No wheels where the kit should be: exit 2 and the command that makes the kit."""
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "tests" / "gpu" / "run.sh"),
            "--kit",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "make gpu-kit" in proc.stderr
