"""The flight recorder (level 10): layout, manifest, crash safety, limits, filters and failures."""

from __future__ import annotations

import errno
import logging
import os
import re
import stat

import pytest
import torch
from dump_files import RECORDER_PROBES, start_recording
from dump_files import call_dirs as _dirs
from dump_files import finish as _finish
from dump_files import read_manifest as _manifest_of
from lib_sources import RECEIVERS

import otel_gpu
from otel_gpu.devices import cuda
from otel_gpu.recorder import recorder as dump
from otel_gpu.recorder import tensor_files

LIB = (
    """
import collections
import enum
import torch
import otel_gpu

class Mode(enum.Enum):
    SUM = "sum"
    MAX = "max"

Pair = collections.namedtuple("Pair", "a b")
SEEN = {}

@otel_gpu.api
def combine(x, y, scale=1.0, *, mode=Mode.SUM, extra=None):
    out = x * scale + y
    return out if mode is Mode.SUM else torch.maximum(x, y)

@otel_gpu.api
def big(x):
    return torch.cat([x, x])

@otel_gpu.api
def inplace(x, out):
    out.copy_(x * 2)

@otel_gpu.api
def login(x, api_key="default"):
    return x
"""
    + RECEIVERS
    + RECORDER_PROBES
)


@pytest.fixture
def lib(module_factory):
    """Returns ``load()``: writes LIB as a fresh module and imports it (decorating at the current level)."""
    return lambda source=LIB: module_factory(source, "dumplib")


def test_one_directory_per_call_linked_to_its_span(otel_gpu_spans, lib, tmp_path):
    """Directory name = sequence-time-spanid-api name, mode 0700; manifest ids match the span; the span names the directory."""
    root = tmp_path / "d"
    spans = otel_gpu_spans(level=10, dump_dir=str(root))
    m = lib()
    from opentelemetry.sdk.trace import TracerProvider

    parent_tracer = TracerProvider().get_tracer("t")
    with parent_tracer.start_as_current_span("outer") as outer:
        m.combine(torch.ones(2), torch.ones(2), 3.0)
    got = spans.get()
    _finish()
    (directory,) = _dirs(root)
    span = got[0]
    ctx = span.get_span_context()
    name = os.path.basename(directory)
    assert re.fullmatch(
        rf"\d{{6}}-\d{{8}}T\d{{6}}\.\d{{6}}-{ctx.span_id:016x}-{m.__name__}\.combine", name
    )
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert span.attributes["otel_gpu.dump.dir"] == directory
    man = _manifest_of(directory)
    assert man["schema_version"] == 1
    assert man["status"] == "completed"
    assert man["trace_id"] == f"{ctx.trace_id:032x}"
    assert man["span_id"] == f"{ctx.span_id:016x}"
    assert man["parent_span_id"] == f"{outer.get_span_context().span_id:016x}"
    assert man["function"]["module"] == m.__name__
    assert man["function"]["qualname"] == "combine"
    assert man["process"]["pid"] == os.getpid()
    assert man["resource"]["torch"] == torch.__version__
    params = {p["name"]: p for p in man["params"]}
    assert params["scale"] == {"name": "scale", "default": False, "value": {"t": "float", "v": 3.0}}
    assert params["mode"]["default"] is True
    assert params["mode"]["value"] == {
        "t": "enum",
        "type": f"{m.__name__}:Mode",
        "name": "SUM",
        "value": "sum",
    }
    assert set(os.listdir(directory)) == {"manifest.json", "inputs.pt", "outputs.pt", "returned"}


def test_directory_names_sort_in_call_order(otel_gpu_spans, lib, tmp_path):
    """Sorting the dump root's entries by name gives the calls in the order they were made."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path)
    for i in range(12):
        m.combine(torch.full((1,), float(i)), torch.zeros(1))
    _finish()
    firsts = [float(torch.load(os.path.join(d, "inputs.pt"))["input.x"][0]) for d in _dirs(root)]
    assert firsts == [float(i) for i in range(12)]


def test_values_are_encoded_so_replay_can_rebuild_them(otel_gpu_spans, lib, tmp_path):
    """None, bool, int, float (also inf), str, enums, dtypes, devices, lists, tuples, dicts, namedtuples and Size are tagged; other objects are marked unsupported."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path)
    extra = {
        "n": None,
        "flags": [True, 3, float("inf"), "s"],
        "kinds": (m.Mode.MAX, torch.float16, torch.device("cpu")),
        "pair": m.Pair(1, torch.ones(1)),
        "size": torch.Size([2, 3]),
        "obj": object(),
    }
    m.combine(torch.ones(1), torch.ones(1), extra=extra)
    _finish()
    man = _manifest_of(_dirs(root)[0])
    value = next(p for p in man["params"] if p["name"] == "extra")["value"]
    items = {k["v"]: v for k, v in value["items"]}
    assert items["n"] == {"t": "none"}
    assert items["flags"]["items"] == [
        {"t": "bool", "v": True},
        {"t": "int", "v": 3},
        {"t": "float", "v": "inf"},
        {"t": "str", "v": "s"},
    ]
    assert items["kinds"]["t"] == "tuple"
    assert [k["t"] for k in items["kinds"]["items"]] == ["enum", "dtype", "device"]
    assert items["kinds"]["items"][1]["v"] == "float16"
    assert items["pair"]["t"] == "namedtuple" and items["pair"]["items"][1]["t"] == "tensor"
    assert items["size"] == {"t": "size", "v": [2, 3]}
    assert items["obj"]["t"] == "unsupported" and items["obj"]["type"] == "builtins:object"


def test_inputs_and_manifest_are_on_disk_before_the_call_runs(otel_gpu_spans, lib, tmp_path):
    """Inside the call, the manifest already says inputs_saved and the inputs load (crash safety)."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path)
    seen = {}

    def check(x):
        (directory,) = _dirs(root)
        seen["status"] = _manifest_of(directory)["status"]
        seen["x"] = torch.load(os.path.join(directory, "inputs.pt"), weights_only=True)["input.x"]

    m.probe(torch.arange(4.0), check)
    assert seen["status"] == "inputs_saved"
    assert torch.equal(seen["x"], torch.arange(4.0))


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_strides_are_recorded_and_kept_by_the_torch_format(otel_gpu_spans, lib, tmp_path, fmt):
    """Both formats record shape/stride/offset; the torch file keeps a transposed layout; a slice is stored compactly."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_format=fmt)
    base = torch.arange(12.0).view(3, 4)
    m.combine(base.t(), torch.zeros(1))
    m.combine(base[:, 1:], torch.zeros(1))
    _finish()
    transposed, sliced = _dirs(root)
    man = _manifest_of(transposed)
    assert man["tensors"]["input.x"]["stride"] == [1, 4]
    ext = ".pt" if fmt == "torch" else ".safetensors"
    assert man["files"]["inputs"] == "inputs" + ext
    stored = tensor_files.load_tensors(transposed, man["files"]["inputs"])["input.x"]
    assert torch.equal(stored, base.t())
    assert stored.is_contiguous() is (fmt == "safetensors")
    man = _manifest_of(sliced)
    meta = man["tensors"]["input.x"]
    assert (meta["shape"], meta["stride"], meta["storage_offset"]) == ([3, 3], [4, 1], 1)
    stored = tensor_files.load_tensors(sliced, man["files"]["inputs"])["input.x"]
    assert torch.equal(stored, base[:, 1:]) and stored.untyped_storage().nbytes() == 9 * 4


def test_broadcast_inputs_are_stored_once_and_counted_once(otel_gpu_spans, lib, tmp_path):
    """An expanded (stride 0) input is written and counted at its real size, not its broadcast size."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path)
    m.combine(torch.ones(1, 1000).expand(1000, 1000), torch.zeros(1))
    _finish()
    man = _manifest_of(_dirs(root)[0])
    assert man["tensors"]["input.x"]["nbytes"] == 4000
    assert man["tensors"]["input.x"]["stride"] == [0, 1]
    assert os.path.getsize(os.path.join(_dirs(root)[0], "inputs.pt")) < 20_000


def test_count_limit_skips_later_calls_with_one_warning(otel_gpu_spans, lib, tmp_path, caplog):
    """OTEL_GPU_DUMP_MAX_COUNT=2: two directories, later spans say max_count, one warning naming the limit."""
    root = tmp_path / "d"
    spans = otel_gpu_spans(level=10, dump_dir=str(root), dump_max_count=2)
    m = lib()
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        for _ in range(5):
            m.combine(torch.ones(2), torch.ones(2))
    got = spans.get()
    _finish()
    assert len(_dirs(root)) == 2
    assert [s.attributes.get("otel_gpu.dump.skipped") for s in got] == [None, None] + [
        "max_count"
    ] * 3
    warnings = [r for r in caplog.records if "OTEL_GPU_DUMP_MAX_COUNT=2" in r.getMessage()]
    assert len(warnings) == 1


def test_size_limit_counts_inputs_and_outputs_before_copying(
    otel_gpu_spans, lib, tmp_path, caplog, monkeypatch
):
    """Outputs that would exceed the size limit are not copied; a call whose inputs do not fit copies nothing; one warning."""
    root = tmp_path / "d"
    x = torch.ones(1000)  # 4000 bytes in, 8000 out
    spans = otel_gpu_spans(level=10, dump_dir=str(root), dump_max_size_gb=10_000 / 2**30)
    m = lib()
    copied = []
    real = tensor_files.host_copy
    monkeypatch.setattr(
        tensor_files, "host_copy", lambda t, **kw: copied.append(t.numel()) or real(t, **kw)
    )
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        m.big(x)  # inputs fit (4000), outputs would make 12000: not copied
        m.big(torch.ones(2000))  # 4000 + 8000 > 10000: nothing copied
    got = spans.get()
    _finish()
    assert copied == [1000]
    (directory,) = _dirs(root)
    man = _manifest_of(directory)
    assert man["status"] == "completed" and man["outputs_skipped"] == "max_size"
    assert man["files"]["outputs"] is None
    assert got[0].attributes["otel_gpu.dump.outputs_skipped"] == "max_size"
    assert got[1].attributes["otel_gpu.dump.skipped"] == "max_size"
    assert len([r for r in caplog.records if "OTEL_GPU_DUMP_MAX_SIZE_GB" in r.getMessage()]) == 1


def test_include_and_exclude_patterns_select_calls_by_span_name(otel_gpu_spans, lib, tmp_path):
    """Only span names matching an include pattern and no exclude pattern are dumped; others say filtered."""
    root = tmp_path / "d"
    spans = otel_gpu_spans(
        level=10, dump_dir=str(root), dump_include=("*.combine", "*.big"), dump_exclude=("*.big",)
    )
    m = lib()
    m.combine(torch.ones(1), torch.ones(1))
    m.big(torch.ones(1))
    m.inplace(torch.ones(1), torch.ones(1))
    got = {s.name.rsplit(".", 1)[1]: s.attributes for s in spans.get()}
    _finish()
    assert [os.path.basename(d).rsplit(".", 1)[1] for d in _dirs(root)] == ["combine"]
    assert got["big"]["otel_gpu.dump.skipped"] == "filtered"
    assert got["inplace"]["otel_gpu.dump.skipped"] == "filtered"
    assert "otel_gpu.dump.skipped" not in got["combine"]


def test_nothing_is_copied_during_cuda_graph_capture(otel_gpu_spans, lib, tmp_path, monkeypatch):
    """While a CUDA graph is being captured the call is not dumped and its span says cuda_graph_capture."""
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "is_capturing", lambda: True)
    root = tmp_path / "d"
    spans = otel_gpu_spans(level=10, dump_dir=str(root))
    m = lib()
    copied = []
    monkeypatch.setattr(tensor_files, "host_copy", lambda t, **kw: copied.append(t))
    m.combine(torch.ones(2), torch.ones(2))
    (span,) = spans.get()
    _finish()
    assert span.attributes["otel_gpu.dump.skipped"] == "cuda_graph_capture"
    assert copied == [] and _dirs(root) == []


def test_unwritable_dump_dir_warns_once_and_the_program_runs(otel_gpu_spans, lib, tmp_path, caplog):
    """A dump dir that cannot be created: results unchanged, spans say write_failed, one warning."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        spans = otel_gpu_spans(level=10, dump_dir=str(blocker / "d"))
        m = lib()
        results = [m.combine(torch.ones(2), torch.ones(2)) for _ in range(3)]
        got = spans.get()
    assert all(torch.equal(r, torch.full((2,), 2.0)) for r in results)
    assert [s.attributes["otel_gpu.dump.skipped"] for s in got] == ["write_failed"] * 3
    assert len([r for r in caplog.records if "flight recorder stopped" in r.getMessage()]) == 1


def test_full_disk_stops_dumping_with_one_warning(
    otel_gpu_spans, lib, tmp_path, caplog, monkeypatch
):
    """ENOSPC while writing: that call and all later ones are not dumped, the user sees no error, one warning."""
    root = tmp_path / "d"
    spans = otel_gpu_spans(level=10, dump_dir=str(root))
    m = lib()
    m.combine(torch.ones(2), torch.ones(2))
    real = tensor_files.save_tensors

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tensor_files, "save_tensors", full)
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        out = [m.combine(torch.ones(2), torch.ones(2)) for _ in range(3)]
    monkeypatch.setattr(tensor_files, "save_tensors", real)
    m.combine(torch.ones(2), torch.ones(2))
    got = spans.get()
    _finish()
    assert all(torch.equal(o, torch.full((2,), 2.0)) for o in out)
    assert [s.attributes.get("otel_gpu.dump.skipped") for s in got] == [None] + ["write_failed"] * 4
    assert len([r for r in caplog.records if "ENOSPC" in r.getMessage()]) == 1


def test_raised_exception_is_recorded_and_reaches_the_caller_untouched(
    otel_gpu_spans, lib, tmp_path
):
    """Status raised with the exception's type, message and traceback; the caller gets the same object."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path)
    with pytest.raises(ValueError, match="bad input"):
        m.fails(torch.ones(1))
    _finish()
    man = _manifest_of(_dirs(root)[0])
    assert man["status"] == "raised"
    assert man["exception"]["type"] == "builtins.ValueError"
    assert man["exception"]["message"] == "bad input"
    assert 'raise ValueError("bad input")' in man["exception"]["traceback"]


def test_queued_outputs_are_complete_after_shutdown(otel_gpu_spans, lib, tmp_path):
    """Every call's outputs and completed manifest are on disk once the pipeline shuts down."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path)
    for i in range(40):
        m.combine(torch.full((64,), float(i)), torch.zeros(64))
    _finish()
    for i, directory in enumerate(_dirs(root)):
        man = _manifest_of(directory)
        assert man["status"] == "completed"
        out = torch.load(os.path.join(directory, man["files"]["outputs"]), weights_only=True)
        assert torch.equal(out["output"], torch.full((64,), float(i)))


def test_outputs_are_copied_when_the_call_returns(otel_gpu_spans, lib, tmp_path):
    """Changing a returned tensor after the call does not change what was recorded."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path)
    out = m.combine(torch.ones(3), torch.ones(3))
    out.fill_(-1)
    _finish()
    d = _dirs(root)[0]
    assert torch.equal(torch.load(os.path.join(d, "outputs.pt"))["output"], torch.full((3,), 2.0))


def test_inputs_modified_in_place_are_recorded_as_outputs(otel_gpu_spans, lib, tmp_path):
    """An argument the call writes into (out=) is saved after the call under mutated.<name>."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path)
    m.inplace(torch.ones(2), torch.zeros(2))
    _finish()
    d = _dirs(root)[0]
    man = _manifest_of(d)
    assert list(man["mutated"]) == ["input.out"]
    saved = torch.load(os.path.join(d, "outputs.pt"))
    assert torch.equal(saved[man["mutated"]["input.out"]["key"]], torch.full((2,), 2.0))
    assert torch.equal(torch.load(os.path.join(d, "inputs.pt"))["input.out"], torch.zeros(2))


def test_method_receivers_are_recorded_by_hook_or_marked_stateful(otel_gpu_spans, lib, tmp_path):
    """self with __otel_gpu_state__ is recorded as state; without it, as unsupported; cls by reference."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path)
    m.Scaler(torch.ones(1)).run(torch.ones(1))
    m.Opaque().run(torch.ones(1))
    m.Factory.make(2)
    _finish()
    with_state, no_state, factory = (_manifest_of(d) for d in _dirs(root))
    assert with_state["receiver"]["t"] == "state"
    assert with_state["receiver"]["state"]["items"][0][1] == {
        "t": "tensor",
        "key": "input.self.factor",
    }
    assert no_state["receiver"]["t"] == "unsupported"
    assert no_state["receiver"]["why"] == f"{m.__name__}:Opaque has no __otel_gpu_state__ hook"
    assert factory["receiver"] == {"t": "class", "type": f"{m.__name__}:Factory"}
    assert [p["name"] for p in factory["params"]] == ["n"]


def test_redacted_string_arguments_are_not_written(otel_gpu_spans, lib, tmp_path):
    """A string whose parameter or dict key name matches OTEL_GPU_REDACT never reaches the dump."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path)
    m.login(torch.ones(1), api_key="s3cr3t")
    m.combine(torch.ones(1), torch.ones(1), extra={"auth_token": "t0k3n", "name": "kept"})
    _finish()
    first, second = _dirs(root)
    assert "s3cr3t" not in open(os.path.join(first, "manifest.json")).read()
    assert {"t": "redacted"} in [p["value"] for p in _manifest_of(first)["params"]]
    text = open(os.path.join(second, "manifest.json")).read()
    assert "t0k3n" not in text and "kept" in text


def test_local_functions_are_dumped_but_marked_not_replayable(otel_gpu_spans, tmp_path):
    """A function defined inside another cannot be imported by replay; the manifest says so."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root))

    @otel_gpu.api
    def local(x):
        return x

    local(torch.ones(1))
    _finish()
    man = _manifest_of(_dirs(root)[0])
    assert man["replayable"] is False
    assert "inside a function" in man["why_not_replayable"]


def test_safetensors_falls_back_to_torch_for_dtypes_it_lacks(otel_gpu_spans, lib, tmp_path):
    """complex128 cannot be stored as safetensors: that call's inputs are written as inputs.pt instead."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_format="safetensors")
    m.combine(torch.ones(2, dtype=torch.complex128), torch.ones(2, dtype=torch.complex128))
    m.combine(torch.ones(2), torch.ones(2))
    _finish()
    first, second = (_manifest_of(d)["files"] for d in _dirs(root))
    assert first == {"inputs": "inputs.pt", "outputs": "outputs.pt"}
    assert second == {"inputs": "inputs.safetensors", "outputs": "outputs.safetensors"}


def test_make_observer_returns_a_recorder_for_level_10(tmp_path):
    """The pipeline's extension hook: make_observer builds a Recorder writing below dump_dir (%i expanded)."""
    from otel_gpu import config

    settings = config.load({"level": 10, "dump_dir": str(tmp_path / "d%i")})
    recorder = dump.make_observer(settings, None)
    try:
        assert isinstance(recorder, dump.Recorder)
        assert recorder.root == str(tmp_path / f"d{os.getpid()}")
        assert not os.path.exists(recorder.root)  # created by the first call it dumps, not before
    finally:
        recorder.close()
