"""``OTEL_GPU_WORKLOADS_DIR``: a definition per (function, input signature), written at call time.

Promises: before a call runs, its signature's definition is in the folder, written once across
the processes sharing it (never rewritten), with a count per signature that adds up across
processes; a process killed mid-write leaves no torn definition; after the first call of a
signature, later calls only look it up; a folder that cannot be written is one warning and the
calls go on; a tiny transformers model gives the same definitions as ``otel-gpu workloads
--emit`` on its level-3 trace.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import otel_gpu
from otel_gpu.export import pipeline
from otel_gpu.traces.workloads import workloads
from otel_gpu.workloads import folder as workloads_dir
from otel_gpu.workloads.folder import read_counts

SCRIPT = """
import sys, torch, otel_gpu

@otel_gpu.api
def scale(x, factor=2.0, mode="fast"):
    return x * factor

n = int(sys.argv[1])
for i in range(n):
    scale(torch.ones(2, 3))
    scale(torch.ones(4, 3), mode="slow")
    scale(torch.ones(4, 3).t())
"""


def _env(folder: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLASHINFER_"))}
    env.update(
        OTEL_GPU_LOGLEVEL="3",
        OTEL_GPU_LOGDEST=str(folder.parent / "spans-%i.jsonl"),
        OTEL_GPU_WORKLOADS_DIR=str(folder),
        OTEL_GPU_STRICT="true",
        OTEL_GPU_JOURNAL="false",
        **extra,
    )
    return env


def _script(tmp_path: Path, body: str = SCRIPT) -> Path:
    path = tmp_path / "scaled.py"
    path.write_text(textwrap.dedent(body))
    return path


def _definitions(folder: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in (folder / "definitions").glob("*.json")}


@pytest.mark.slow
def test_processes_sharing_the_folder_write_each_signature_once_and_counts_add_up(tmp_path):
    """Three signatures, two processes at once and then a third: three definition files, never
    rewritten by a later process (same inode), no temporary file left; the counts of all
    processes add up to every call made."""
    folder, script = tmp_path / "wl", _script(tmp_path)
    runs = [
        subprocess.Popen([sys.executable, str(script), "40"], env=_env(folder), cwd=tmp_path)
        for _ in range(2)
    ]
    assert [p.wait(timeout=300) for p in runs] == [0, 0]
    first = _definitions(folder)
    assert len(first) == 3
    inodes = {n: (folder / "definitions" / n).stat().st_ino for n in first}
    done = subprocess.run([sys.executable, str(script), "5"], env=_env(folder), cwd=tmp_path)
    assert done.returncode == 0
    assert _definitions(folder) == first
    assert {n: (folder / "definitions" / n).stat().st_ino for n in first} == inodes
    assert sorted(os.listdir(folder / "definitions")) == sorted(first)  # no .tmp left
    counts = read_counts(str(folder))
    assert sorted(counts) == sorted(n.removesuffix(".json") for n in first)
    assert sorted(counts.values()) == [85, 85, 85]
    assert len(os.listdir(folder / "counts")) == 3  # one file per process
    strided = [d for d in first.values() if "stride" in d["inputs"]["x"]]
    assert len(strided) == 1 and strided[0]["inputs"]["x"]["stride"] == [1, 3]


@pytest.mark.slow
def test_a_process_killed_mid_write_leaves_no_torn_definition(tmp_path):
    """The process dies after writing half of a definition: the folder holds no definition by
    that name (only a hidden temporary file), and the next process writes the whole one."""
    folder = tmp_path / "wl"
    killer = (
        "import os\n"
        "real = os.write\n"
        "def half(fd, data):\n"
        "    if len(data) > 20 and b'otel-gpu.workload/1' in bytes(data):\n"
        "        real(fd, bytes(data)[: len(data) // 2])\n"
        "        os._exit(9)\n"
        "    return real(fd, data)\n"
        "os.write = half\n"
    )
    script = _script(tmp_path, killer + SCRIPT)
    died = subprocess.run([sys.executable, str(script), "1"], env=_env(folder), cwd=tmp_path)
    assert died.returncode == 9
    assert _definitions(folder) == {}
    left = os.listdir(folder / "definitions")
    assert left and all(n.startswith(".") and n.endswith(".tmp") for n in left)
    script = _script(tmp_path)
    done = subprocess.run([sys.executable, str(script), "1"], env=_env(folder), cwd=tmp_path)
    assert done.returncode == 0
    assert len(_definitions(folder)) == 3  # each parses: json.loads above


LIB = """
import otel_gpu

@otel_gpu.api
def scale(x, factor=2.0):
    return x * factor
"""


def test_a_known_signature_costs_a_lookup_not_a_signature(tmp_path, module_factory, monkeypatch):
    """After a signature's first call, its later calls neither compute the signature nor touch
    the folder: they are counted in memory (and written with the counts)."""
    import torch

    folder = tmp_path / "wl"
    otel_gpu.configure(
        level=3, dest=str(tmp_path / "t.jsonl"), workloads_dir=str(folder), journal=False
    )
    lib = module_factory(LIB)
    lib.scale(torch.ones(2))

    def refuse(*args, **kwargs):
        raise AssertionError("computed again")

    monkeypatch.setattr(workloads_dir._sig, "signature", refuse)
    monkeypatch.setattr(workloads_dir, "_create", refuse)
    for _ in range(10):
        lib.scale(torch.ones(2))
    otel_gpu.flush()
    assert list(read_counts(str(folder)).values()) == [11]


def test_an_unwritable_folder_is_one_warning_and_the_calls_go_on(tmp_path, module_factory, caplog):
    """``definitions`` is a file, not a folder: one warning naming the folder, no definition,
    and every call returns its result; a disk that fills later stops the writing the same way."""
    import torch

    folder = tmp_path / "wl"
    folder.mkdir(mode=0o700)
    (folder / "definitions").write_text("not a folder")
    otel_gpu.configure(
        level=3, dest=str(tmp_path / "t.jsonl"), workloads_dir=str(folder), journal=False
    )
    lib = module_factory(LIB)
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        assert [lib.scale(torch.ones(2)).tolist() for _ in range(3)] == [[2.0, 2.0]] * 3
        otel_gpu.flush()
    said = [r.getMessage() for r in caplog.records if "WORKLOADS_DIR stopped" in r.getMessage()]
    assert len(said) == 1 and str(folder) in said[0]


def test_a_full_disk_later_is_one_warning_then_off(tmp_path, module_factory, monkeypatch, caplog):
    """A write that fails with ENOSPC after the folder was set up: one warning, the observer
    is off (no further write tried), every call returns its result."""
    import errno

    import torch

    folder = tmp_path / "wl"
    otel_gpu.configure(
        level=3, dest=str(tmp_path / "t.jsonl"), workloads_dir=str(folder), journal=False
    )
    lib = module_factory(LIB)
    tries = []

    def full(*args, **kwargs):
        tries.append(args)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(workloads_dir, "_create", full)
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        results = [lib.scale(torch.ones(n)).shape[0] for n in (1, 2, 3)]
        otel_gpu.flush()
    assert results == [1, 2, 3] and len(tries) == 1
    said = [r.getMessage() for r in caplog.records if "WORKLOADS_DIR stopped" in r.getMessage()]
    assert len(said) == 1 and "No space left" in said[0]
    assert pipeline.current() is not None


def test_read_counts_skips_files_that_are_not_counts(tmp_path):
    """Counts files are added up; a file that is not JSON, of another format, or with a count
    that is not a whole number >= 0 is skipped, never an error."""
    counts = tmp_path / "counts"
    counts.mkdir()
    body = {"format": "otel-gpu.workload/1", "counts": {"f-1": 2, "g-2": 1}}
    (counts / "a.json").write_text(json.dumps(body))
    (counts / "b.json").write_text(json.dumps({**body, "counts": {"f-1": 3, "g-2": -1}}))
    (counts / "c.json").write_text("{torn")
    (counts / "d.json").write_text(json.dumps({"format": "other", "counts": {"f-1": 100}}))
    (counts / "e.json").write_text(json.dumps([1, 2]))
    (counts / ".f.json.tmp").write_text(json.dumps(body))
    assert read_counts(str(tmp_path)) == {"f-1": 5, "g-2": 1}
    assert read_counts(str(tmp_path / "missing")) == {}


@pytest.mark.transformers
@pytest.mark.slow
def test_a_tiny_model_gives_the_definitions_workloads_emit_gives(tmp_path):
    """The tiny GPT2 at level 3 with OTEL_GPU_WORKLOADS_DIR: the same definition files (name,
    function, signature and inputs) as ``otel-gpu workloads --emit`` on the run's own trace,
    and the same count per signature."""
    pytest.importorskip("transformers")
    from tiny_runs import traced

    folder = tmp_path / "wl"
    trace = traced(tmp_path / "run", 3, 2, OTEL_GPU_WORKLOADS_DIR=str(folder))
    out, err = io.StringIO(), io.StringIO()
    emitted = tmp_path / "emit"
    assert workloads([str(trace)], as_json=True, emit=str(emitted), out=out, err=err) == 0
    report = json.loads(out.getvalue())
    ours, theirs = _definitions(folder), _definitions(emitted)
    assert sorted(ours) == sorted(theirs) and len(ours) == len(report["workloads"]) > 3
    same = ("format", "name", "function", "signature", "inputs")
    for name, definition in ours.items():
        assert {k: definition[k] for k in same} == {k: theirs[name][k] for k in same}
    expected = {f"{d['name']}": d["calls"] for d in theirs.values()}
    assert read_counts(str(folder)) == expected
