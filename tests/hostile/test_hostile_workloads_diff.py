"""``otel-gpu workloads --emit`` and ``otel-gpu diff`` on hostile traces and dumps.

A trace travels and its span names, attribute values and dump paths are whoever wrote it.
Each test names the attack. The promises: ``--emit`` writes only plain-named files inside its
own folder (never through a symlink, never outside), no name reaches FlashInfer unless it is an
identifier path to an API with ``fi_trace``; ``diff`` never unpickles a dumped file, never
loops on a cyclic tree, and an infinity read from a file does not widen a tolerance.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
from crafted_calls import call, stats, tensor, write
from crafted_dumps import crafted_manifest, write_call

from otel_gpu.traces.diff import diff
from otel_gpu.traces.diff_values import compare_stats
from otel_gpu.traces.workloads import workloads

_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
HOSTILE_NAMES = [
    "../../escaped",
    "/etc/passwd",
    ".hidden",
    "a/../../b",
    "a/b",
    "a_b",
    "nul\x00byte",
    "new\nline \x1b]0;title\x07",
    "\u202eevil",
    "x" * 5000,
    "",
]


def _emit(paths: list[str], out: Path) -> tuple[int, str]:
    err = io.StringIO()
    code = workloads(paths, emit=str(out), out=io.StringIO(), err=err)
    return code, err.getvalue()


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def test_hostile_function_names_become_plain_distinct_files_inside_the_folder(tmp_path):
    """Attack: span names with path separators, dot-dot, NUL, escapes, bidi controls, 5000
    characters, or nothing: every file written is inside DIR with a plain name, the folder
    beside it is untouched, and names that clean up alike (a/b, a_b) do not share a file."""
    spans = [call(name, inputs={"x": tensor([2])}) for name in HOSTILE_NAMES]
    trace = write(tmp_path / "t.jsonl", spans)
    out = tmp_path / "inner" / "out"
    before = _files(tmp_path) - _files(out)
    code, err = _emit([trace], out)
    assert code == 0, err
    assert _files(tmp_path) - _files(out) == before | {out, out.parent}
    written = [p for p in _files(out) if p.is_file()]
    for path in written:
        assert path.resolve().is_relative_to(out.resolve())
        assert _PLAIN.fullmatch(path.name) and len(path.name) < 200, path.name
    workload_files = [p for p in written if p.parent.name == "workloads"]
    assert len(workload_files) == len(HOSTILE_NAMES)  # one per function, none shared
    functions = {json.loads(p.read_text())["otel_gpu"]["function"] for p in workload_files}
    assert functions == set(HOSTILE_NAMES)


def test_a_symlink_planted_in_the_folder_is_replaced_not_written_through(tmp_path):
    """Attack: DIR/workloads/<the function's file> is a symlink to a file outside: it is
    replaced by the workload file; the outside file keeps its content. A symlinked sub-folder
    is refused (exit 2) rather than written into."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    trace = write(tmp_path / "t.jsonl", [call("lib.f", inputs={"x": tensor([2])})])
    out = tmp_path / "out"
    (out / "workloads").mkdir(parents=True)
    os.symlink(victim, out / "workloads" / "lib.f.jsonl")
    code, err = _emit([trace], out)
    assert code == 0, err
    assert victim.read_text() == "precious"
    assert not (out / "workloads" / "lib.f.jsonl").is_symlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out2 = tmp_path / "out2"
    out2.mkdir()
    os.symlink(elsewhere, out2 / "definitions")
    code, err = _emit([trace], out2)
    assert code == 2 and "cannot write" in err
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(
    "name", ["flashinfer.os.system", "flashinfer.__builtins__", "flashinfer..x", "flashinfer"]
)
def test_names_that_are_not_a_flashinfer_api_with_fi_trace_are_never_called(tmp_path, name):
    """Attack: a span named after something reachable from the flashinfer package (os.system)
    with a shell command as its argument: nothing is called, no FlashInfer definition is
    written, and the command never runs."""
    pytest.importorskip("flashinfer")
    marker = tmp_path / "pwned"
    inputs = {"command": {"value": f"touch {marker}"}, "x": tensor([2])}
    trace = write(tmp_path / "t.jsonl", [call(name, inputs=inputs)])
    code, err = _emit([trace], tmp_path / "out")
    assert code == 0, err
    assert not marker.exists()
    assert not (tmp_path / "out" / "flashinfer").exists()


def _evil_dump(root: Path, marker: Path) -> Path:
    import torch

    manifest = crafted_manifest(
        {"span_name": "lib.f", "module": "lib", "qualname": "f"},
        [("x", {"t": "tensor", "key": "input.x"})],
        files={"inputs": "inputs.pt", "outputs": None},
        tensors={"input.x": {"shape": [1], "dtype": "float32", "stride": [1]}},
    )
    folder = write_call(root, manifest)

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"input.x": Evil()}, folder / "inputs.pt")
    return folder


def test_a_pickle_in_a_dump_is_never_unpickled_by_diff(tmp_path):
    """Attack: the dump a span's otel_gpu.dump.dir names (and a dump folder given directly)
    holds a pickle whose __reduce__ runs a command: diff refuses the file (weights-only
    loading), falls back to what else it has, and the command never runs."""
    marker = tmp_path / "pwned"
    dumps = tmp_path / "dumps"
    folder = _evil_dump(dumps, marker)
    spans = [
        call(
            "lib.f",
            inputs={"x": tensor([1])},
            stats={"input.x": stats(0, 1, 0.5, 0.1)},
            extra={"otel_gpu.dump.dir": str(folder)},
        )
    ]
    a = write(tmp_path / "a.jsonl", spans)
    out, err = io.StringIO(), io.StringIO()
    assert diff(a, a, as_json=True, out=out, err=err) == 0
    assert json.loads(out.getvalue())["tensors"]["same"] == 1  # by statistics
    assert not marker.exists()
    out, err = io.StringIO(), io.StringIO()
    assert diff(str(dumps), str(dumps), out=out, err=err) == 2
    assert "not compared" in err.getvalue()
    assert not marker.exists()


def test_a_cyclic_parent_chain_does_not_hang_diff(tmp_path):
    """Attack: two spans each naming the other as parent (and one its own parent): diff ends,
    lining every span up once."""
    a = call("lib.a", inputs={"x": tensor([1])}, stats={"input.x": stats(0, 1, 0.5, 0.1)})
    b = call("lib.b", parent=a, inputs={"x": tensor([1])}, stats={"input.x": stats(0, 1, 0.5, 0.1)})
    a["parentSpanId"] = b["spanId"]
    a["traceId"] = b["traceId"]
    c = call("lib.c", inputs={"x": tensor([1])})
    c["parentSpanId"] = c["spanId"]
    path = write(tmp_path / "a.jsonl", [a, b, c])
    out = io.StringIO()
    assert diff(path, path, as_json=True, out=out, err=io.StringIO()) == 0
    assert json.loads(out.getvalue())["calls"]["paired"] == 3


def test_an_infinite_statistic_does_not_widen_the_tolerance():
    """Attack: max = Infinity in both runs' statistics, which would make a magnitude-scaled
    tolerance infinite: a mean 1e-3 apart still differs."""
    inf = float("inf")
    a = {"numel": 4, "min": 0.0, "max": inf, "mean": 0.5, "std": 0.1}
    b = {**a, "mean": 0.501}
    assert compare_stats("output.0", a, b, "torch.float32")["status"] == "differ"
