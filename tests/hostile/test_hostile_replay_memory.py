"""Files replay reads cost bounded memory, whatever their size or shape claims.

Payloads, each a dump a few bytes to a few MB on disk:

- ``outputs.pt`` holding an expanded view (``zeros(1, 1).expand(N, N)``: 4 bytes of storage);
  replay used to materialise it (``isfinite``, then float64 copies) and call the call a pass;
- ``inputs.pt`` replaced by a sparse file of 1 GiB (no block used on disk), which replay read
  whole and then joined (twice its size in memory);
- a manifest of tens of MB of empty objects (``[{},{},...]``: 3 bytes of text, a 64-byte dict
  each), and a sparse manifest of 100 MB;
- ``dtype`` tags naming torch's lazily imported submodules (``_dynamo``, ``_inductor``).

Each runs the command in a child whose peak RSS is measured (``ru_maxrss`` of the children of
a small wrapper process); the bounds are generous, far above what replay needs and far below
what the payloads cost before.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from commands import python_command, without_otel
from crafted_dumps import crafted_manifest, write_call
from dump_files import finish

from otel_gpu.replay import Allow, Options, replay

LIB = """
import torch
import otel_gpu

@otel_gpu.api
def grow(x, n):
    return x.expand(n, n)

@otel_gpu.api
def add(x, y):
    return x + y

@otel_gpu.api
def total(xs):
    return torch.cat([torch.cat(row) for row in xs])
"""

MiB = 1 << 20
BOUND_KB = 1024 * 1024  # 1 GiB of peak RSS: replay needs about a quarter of it

_PEAK = (
    "import resource, subprocess, sys; proc = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, proc.returncode)"
)


def _meta(shape: list[int], stride: list[int]) -> dict[str, Any]:
    return {
        "shape": shape,
        "stride": stride,
        "storage_offset": 0,
        "dtype": "float32",
        "device": "cpu",
        "requires_grad": False,
    }


def expanded_output_dump(root: Path, module: str, n: int) -> Path:
    """A completed call of ``grow`` whose recorded output is ``zeros(1, 1).expand(n, n)``."""
    manifest = crafted_manifest(
        {"span_name": "grow", "module": module, "qualname": "grow"},
        [("x", {"t": "tensor", "key": "input.x"}), ("n", {"t": "int", "v": n})],
        tensors={"input.x": _meta([1, 1], [1, 1]), "output": _meta([n, n], [0, 0])},
        result={"t": "tensor", "key": "output"},
        files={"inputs": "inputs.pt", "outputs": "outputs.pt"},
    )
    call = write_call(root, manifest)
    torch.save({"input.x": torch.zeros(1, 1)}, call / "inputs.pt")
    torch.save({"output": torch.zeros(1, 1).expand(n, n)}, call / "outputs.pt")
    return call


def sparse_inputs_dump(root: Path, module: str, size: int) -> Path:
    """A completed call of ``add`` whose ``inputs.pt`` is a sparse file of ``size`` bytes."""
    manifest = crafted_manifest(
        {"span_name": "add", "module": module, "qualname": "add"},
        [("x", {"t": "tensor", "key": "input.x"}), ("y", {"t": "tensor", "key": "input.y"})],
        tensors={"input.x": _meta([4], [1]), "input.y": _meta([4], [1])},
        files={"inputs": "inputs.pt", "outputs": None},
    )
    call = write_call(root, manifest)
    with open(call / "inputs.pt", "wb") as f:
        f.truncate(size)
    return call


def empty_objects_manifest_dump(root: Path, module: str, size: int) -> Path:
    """A call whose manifest is ``size`` bytes, nearly all of it ``{},`` (no sparse blocks)."""
    call = write_call(root, crafted_manifest({"span_name": "add", "module": module}, []))
    head = json.dumps(crafted_manifest({"span_name": "add", "module": module}, []))[:-1]
    count = (size - len(head)) // 3
    with open(call / "manifest.json", "w") as f:
        f.write(head + ', "pad": [')
        f.write("{}," * (count - 1) + "{}]}")
    return call


def sparse_manifest_dump(root: Path, module: str, size: int) -> Path:
    """A call whose manifest is a sparse file of ``size`` bytes."""
    call = write_call(root, crafted_manifest({"span_name": "add", "module": module}, []))
    with open(call / "manifest.json", "r+b") as f:
        f.truncate(size)
    return call


def _replay_peak(tmp_path: Path, dump: Path, module: str) -> tuple[int, int, dict[str, Any]]:
    """``otel-gpu replay DUMP --json`` in a child: (peak RSS in KiB, exit code, report)."""
    out = tmp_path / "report.json"
    argv = [sys.executable, "-m", "otel_gpu", "replay", "--dir", str(dump), "--json"]
    argv += ["--allow-module", module, "--no-progress"]
    proc = python_command(
        ["-c", _PEAK, sys.executable, "-c", _TEE, str(out), *argv],
        env=without_otel(PYTHONPATH=str(tmp_path)),
        cwd=tmp_path,
        timeout=600,
    )
    peak, code = (int(v) for v in proc.stdout.split()[-2:])
    text = out.read_text()
    return peak, code, json.loads(text) if text.strip() else {}


_TEE = (
    "import subprocess, sys; out = open(sys.argv[1], 'w'); "
    "sys.exit(subprocess.run(sys.argv[2:], stdout=out).returncode)"
)


def _module(tmp_path: Path) -> str:
    (tmp_path / "memlib.py").write_text(LIB)
    return "memlib"


def _refused(tmp_path: Path, craft: Callable[[Path, str, int], object], size: int):
    """(peak RSS in KiB, exit code, result) of replaying in a child the dump that
    ``craft(folder, module, size)`` wrote; its one call must be an error."""
    module = _module(tmp_path)
    craft(tmp_path / "dump", module, size)
    peak, code, report = _replay_peak(tmp_path, tmp_path / "dump", module)
    (result,) = report["results"]
    assert result["verdict"] == "error", result
    return peak, code, result


def test_an_expanded_view_in_the_outputs_file_is_refused_unmaterialised(tmp_path):
    """outputs.pt holds zeros(1, 1).expand(12000, 12000) (4 bytes of storage; 576 MB as
    float32, 1.2 GB as float64): the call is an error naming the expanded view, never a pass,
    and the peak RSS stays under 1 GiB."""
    peak, code, result = _refused(tmp_path, expanded_output_dump, 12000)
    assert "expanded or overlapping view" in result["detail"]
    assert code == 1 and peak < BOUND_KB, peak


def test_a_sparse_tensor_file_is_refused_unread(tmp_path):
    """inputs.pt is a sparse file of 1 GiB where the manifest states 32 bytes of tensors: an
    error naming the size and what the manifest states, read no further than its size; the
    peak RSS stays under 1 GiB (reading it whole cost over 2 GB)."""
    peak, code, result = _refused(tmp_path, sparse_inputs_dump, 1 << 30)
    assert "1073741824 bytes on disk, more than the 32 bytes of tensors" in result["detail"]
    assert code == 1 and peak < BOUND_KB, peak


def test_a_manifest_of_empty_objects_is_refused_before_it_is_parsed(tmp_path):
    """A 48 MB manifest of '{},' (16 million dicts once parsed): refused as holding too many
    JSON values for a manifest, before json parses it; the peak RSS stays under 1 GiB."""
    peak, _, result = _refused(tmp_path, empty_objects_manifest_dump, 48 * MiB)
    assert "JSON values, over the 2000000 replay parses" in result["detail"]
    assert peak < BOUND_KB, peak


def test_a_manifest_over_the_size_cap_is_refused_unread(tmp_path):
    """A sparse 100 MB manifest: refused by its size (over 64 MiB) before a byte is read."""
    peak, _, result = _refused(tmp_path, sparse_manifest_dump, 100 * MiB)
    assert f"{100 * MiB} bytes, over the {64 * MiB} replay reads" in result["detail"]
    assert peak < BOUND_KB, peak


DTYPE_PROBE = """
import sys
import otel_gpu
from otel_gpu.replay import Allow, Options, replay
otel_gpu.configure(level=1, journal=False)  # as the command does: decorated functions replay
(result,) = replay(sys.argv[1], Options(allow=Allow([sys.argv[2]])))
print(result.verdict, sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_a_dtype_tag_resolves_from_the_table_of_dtypes_and_imports_nothing(tmp_path):
    """dtype tags '_dynamo' (an argument) and '_inductor' (the recorded default dtype): the
    call is an error (unknown dtype), and neither torch._dynamo nor torch._inductor is imported
    (getattr(torch, name) imported them, hundreds of modules)."""
    module = _module(tmp_path)
    manifest = crafted_manifest(
        {"span_name": "add", "module": module, "qualname": "add"},
        [("x", {"t": "dtype", "v": "_dynamo"}), ("y", {"t": "int", "v": 1})],
        torch_state={"default_dtype": "_inductor", "grad_enabled": True},
    )
    write_call(tmp_path / "dump", manifest)
    proc = python_command(
        ["-c", DTYPE_PROBE, str(tmp_path / "dump"), module],
        env=without_otel(PYTHONPATH=str(tmp_path)),
        timeout=300,
    )
    assert proc.stdout.split("\n")[-2] == "error []", proc.stdout + proc.stderr
    assert os.path.exists(tmp_path / "dump")


def test_a_dump_of_many_small_tensors_is_within_the_limits(otel_gpu_spans, tmp_path, monkeypatch):
    """The limits refuse nothing the recorder writes: a call of 4000 one-element tensors (a
    1.2 MB inputs.pt for 16 KB of data: the format's bytes per tensor) replays to pass."""
    import importlib

    module = _module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(module, None)
    otel_gpu_spans(level=10, dump_dir=str(tmp_path / "dump"))
    lib = importlib.import_module(module)
    try:
        lib.total([[torch.full((1,), float(i)) for i in range(1000)] for _ in range(4)])
        finish()
        (call,) = (tmp_path / "dump").iterdir()
        assert (call / "inputs.pt").stat().st_size > (1 << 20) + 4000 * 4
        (result,) = replay(str(tmp_path / "dump"), Options(allow=Allow([module])))
    finally:
        sys.modules.pop(module, None)
    assert result.verdict == "pass", result.detail
