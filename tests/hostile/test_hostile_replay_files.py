"""Crafted dump files: every file a manifest names stays inside the dump, and a missing, corrupt
or malformed file costs its own call a verdict (``error``, naming the problem), never the run.

Each test records three calls, tampers with the middle one, and checks that replay judges the
tampered call with a one-line reason, reads nothing outside the dump, and still replays the
other two.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from dump_files import MODULE_BLOCK, record_script

import otel_gpu
from otel_gpu import cli
from otel_gpu.export import pipeline
from otel_gpu.replay import Allow, Options, Result, exit_code, replay

LIB = (
    """
import torch
import otel_gpu
from torch import nn

@otel_gpu.api
def add(x, y):
    return x + y

"""
    + MODULE_BLOCK
)


pytestmark = pytest.mark.usefixtures("fresh_module_states")


@pytest.fixture
def dump(otel_gpu_spans, module_factory, tmp_path):
    """Three recorded calls of ``add``: returns (module, dump root, the middle call's dir)."""
    root = tmp_path / "dump"
    otel_gpu_spans(level=10, dump_dir=str(root))
    m = module_factory(LIB, "hostfiles")
    for i in range(3):
        m.add(torch.full((4,), float(i)), torch.ones(4))
    pipeline.reset(timeout=2.0)
    otel_gpu_spans(level=1)
    calls = sorted(p for p in root.iterdir() if p.is_dir())
    assert len(calls) == 3
    return m, root, calls[1]


@pytest.fixture
def module_dump(otel_gpu_spans, module_factory, tmp_path):
    """Three calls of ``Block.forward`` with its state recorded: (module, root, middle call)."""
    root = tmp_path / "dump"
    otel_gpu_spans(level=10, dump_dir=str(root), dump_modules=True)
    m = module_factory(LIB, "hostmods")
    otel_gpu.instrument(m.Block)
    torch.manual_seed(0)
    block = m.Block(4)
    for i in range(3):
        block(torch.full((2, 4), float(i)))
    pipeline.reset(timeout=2.0)
    otel_gpu_spans(level=1)
    calls = sorted(p for p in root.iterdir() if p.is_dir() and p.name != "modules")
    assert len(calls) == 3
    return m, root, calls[1]


def _replay(m, root, **kw) -> list[Result]:
    return replay(str(root), Options(allow=Allow([m.__name__], any_instrument=True), **kw))


def _edit(call, change) -> None:
    path = call / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _judged(m, root, call) -> Result:
    """The tampered call's result; the other two calls still pass."""
    results = _replay(m, root)
    assert len(results) == 3
    others = [r for r in results if r.dir != str(call)]
    assert [r.verdict for r in others] == ["pass", "pass"], [r.detail for r in others]
    (mine,) = [r for r in results if r.dir == str(call)]
    assert "\n" not in mine.detail and "Traceback" not in mine.detail
    return mine


def _outside(tmp_path, call, name) -> str:
    """A copy of the call's own file outside the dump: following a link to it would pass."""
    target = tmp_path / f"outside-{name}"
    shutil.copy(call / name, target)
    return str(target)


# ----------------------------------------------------------------------------- file fields


@pytest.mark.parametrize("field", ["inputs", "outputs"])
@pytest.mark.parametrize(
    "name", ["../../../etc/passwd.pt", "../outside.pt", "/etc/passwd.pt", "sub/outputs.pt", ".."]
)
def test_a_file_field_naming_a_path_is_refused(dump, tmp_path, field, name):
    """Attack: traversal or an absolute path in files.inputs/files.outputs. The call is an error
    naming the field and the refused name; the other calls replay."""
    m, root, call = dump
    (root / "outside.pt").write_bytes((call / f"{field}.pt").read_bytes())  # would pass if read
    _edit(call, lambda man: man["files"].__setitem__(field, name))
    result = _judged(m, root, call)
    assert result.verdict == "error"
    assert result.detail.startswith(f"files.{field}: refusing tensor file name {name!r}")


@pytest.mark.parametrize("field", ["inputs", "outputs"])
def test_a_tensor_file_that_is_a_symlink_out_of_the_call_dir_is_not_followed(dump, tmp_path, field):
    """Attack: inputs.pt/outputs.pt replaced by a symlink to a file outside the dump (a valid
    copy, so following it would pass). Refused as a symlink; nothing outside is read."""
    m, root, call = dump
    target = _outside(tmp_path, call, f"{field}.pt")
    os.remove(call / f"{field}.pt")
    os.symlink(target, call / f"{field}.pt")
    result = _judged(m, root, call)
    assert result.verdict == "error"
    assert result.detail == (
        f"files.{field}: refusing {field}.pt: it is a symlink (replay reads only files inside "
        "the dump)"
    )


def test_a_manifest_that_is_a_symlink_out_of_the_call_dir_is_not_followed(dump, tmp_path):
    """Attack: manifest.json is a symlink to a valid manifest outside the dump."""
    m, root, call = dump
    target = _outside(tmp_path, call, "manifest.json")
    os.remove(call / "manifest.json")
    os.symlink(target, call / "manifest.json")
    result = _judged(m, root, call)
    assert result.verdict == "error"
    assert "refusing manifest.json: it is a symlink" in result.detail


def test_a_fifo_named_as_a_tensor_file_is_refused_without_blocking(dump):
    """Attack: outputs.pt is a FIFO, which would block a reader forever. Refused at once."""
    m, root, call = dump
    os.remove(call / "outputs.pt")
    os.mkfifo(call / "outputs.pt")
    result = _judged(m, root, call)
    assert (result.verdict, result.detail) == (
        "error",
        "files.outputs: refusing outputs.pt: not a regular file",
    )


@pytest.mark.parametrize("field", ["inputs", "outputs"])
def test_a_missing_tensor_file_is_an_error_for_its_call_only(dump, field):
    """A deleted inputs.pt/outputs.pt: that call is an error naming the file; the run goes on
    (it used to end the whole replay with a traceback)."""
    m, root, call = dump
    os.remove(call / f"{field}.pt")
    result = _judged(m, root, call)
    assert (result.verdict, result.detail) == (
        "error",
        f"files.{field}: {field}.pt is missing from the dump",
    )


@pytest.mark.parametrize("field", ["inputs", "outputs"])
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_corrupt_tensor_file_is_an_error_naming_it(dump, field, damage):
    """Attack: a truncated, garbage or empty inputs.pt/outputs.pt. An error naming the file as
    unreadable; no traceback, no advice to unpickle."""
    m, root, call = dump
    path = call / f"{field}.pt"
    data = path.read_bytes()
    path.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": os.urandom(300)}.get(damage, b"")
    )
    result = _judged(m, root, call)
    assert result.verdict == "error"
    assert result.detail.startswith(
        f"files.{field}: {field}.pt is not a readable torch file (truncated or corrupt: "
    )
    assert "weights_only=False" not in result.detail


def test_a_pickle_in_a_tensor_file_is_refused(dump, tmp_path):
    """Attack: outputs.pt holds a pickled object that would run code when unpickled."""
    m, root, call = dump
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"output": Payload()}, call / "outputs.pt")
    result = _judged(m, root, call)
    assert result.verdict == "error"
    assert result.detail.startswith("files.outputs: refusing outputs.pt: it holds objects other")
    assert not marker.exists()


# ----------------------------------------------------------------------------- manifests


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "manifest.json is not JSON ("),
        (b"\xff\xfe\x00garbage", "manifest.json is not UTF-8 text"),
        (b"[1, 2, 3]", "manifest.json holds an array, not an object"),
        (b'"a string"', "manifest.json holds a string, not an object"),
        (b"[" * 100_000 + b"]" * 100_000, "manifest.json is nested too deeply"),
    ],
    ids=["not-json", "not-utf8", "a-list", "a-string", "nesting-bomb"],
)
def test_a_manifest_that_is_not_a_json_object_is_an_error(dump, content, why):
    """Attack: manifest.json that is not JSON, not UTF-8, not an object, or nested 100,000 deep.
    'unreadable manifest: <why>', one line; the other calls replay."""
    m, root, call = dump
    (call / "manifest.json").write_bytes(content)
    result = _judged(m, root, call)
    assert result.verdict == "error"
    assert result.detail.startswith(f"unreadable manifest: {why}")


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("files", "outputs.pt", "manifest field files must be an object, not a string"),
        ("function", ["os", "system"], "manifest field function must be an object, not an array"),
        ("params", {"x": 1}, "manifest field params must be an array, not an object"),
        ("replayable", "yes", "manifest field replayable must be true/false, not a string"),
        ("positional", True, "manifest field positional must be a number or null, not true/false"),
        ("tensors", [], "manifest field tensors must be an object, not an array"),
        ("result", 3, "manifest field result must be an object or null, not a number"),
    ],
)
def test_a_manifest_field_of_the_wrong_type_is_an_error_naming_it(dump, field, value, why):
    """Attack: a manifest whose fields have the wrong JSON types. The error names the field, the
    expected type and the one found."""
    m, root, call = dump
    _edit(call, lambda man: man.__setitem__(field, value))
    result = _judged(m, root, call)
    assert (result.verdict, result.detail) == ("error", f"unreadable manifest: {why}")


def test_nested_fields_of_the_wrong_type_are_errors_naming_them(dump):
    """Attack: a files entry that is a number, a parameter without a name."""
    m, root, call = dump
    _edit(call, lambda man: man["files"].__setitem__("outputs", 7))
    result = _judged(m, root, call)
    assert result.detail == (
        "unreadable manifest: manifest field files.outputs must be a string or null, not a number"
    )
    _edit(
        call,
        lambda man: (
            man["files"].__setitem__("outputs", "outputs.pt"),
            man["params"][0].pop("name"),
        ),
    )
    result = _judged(m, root, call)
    assert result.detail == (
        "unreadable manifest: manifest field params[0].name must be a string, not null"
    )


def test_a_tensor_layout_that_does_not_fit_the_stored_tensor_is_an_error(dump):
    """Attack: tensor metadata asking for a view larger than the stored tensor (a read past its
    storage) or with negative strides."""
    m, root, call = dump

    def grow(man):
        for meta in man["tensors"].values():
            meta["shape"], meta["stride"] = [1000], [1]

    _edit(call, grow)
    result = _judged(m, root, call)
    assert result.verdict == "error"
    assert "the recorded shape [1000] does not fit the stored tensor of shape [4]" in result.detail

    def negative(man):
        for meta in man["tensors"].values():
            meta["shape"], meta["stride"] = [4], [-1]

    _edit(call, negative)
    result = _judged(m, root, call)
    assert result.verdict == "error"
    assert "is not one of non-negative integers" in result.detail


# ----------------------------------------------------------------------------- module states


def test_a_missing_module_state_is_an_error_naming_it(module_dump):
    """The modules/<sha256>.pt file of a receiver was deleted: an error naming it, for every call
    that needs it (all three share it)."""
    m, root, _ = module_dump
    (state,) = os.listdir(root / "modules")
    os.remove(root / "modules" / state)
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["error"] * 3
    assert results[0].detail == f"receiver.state (modules/): {state} is missing from the dump"


@pytest.mark.parametrize(
    "name",
    ["../../etc/passwd", "/etc/passwd", "../" + "a" * 64 + ".pt", "a" * 64 + ".pt\n", 42],
)
def test_a_module_state_name_that_is_not_a_content_hash_is_refused(module_dump, name):
    """Attack: receiver.state naming a path, an absolute path, or a hash with a trailing
    newline, or not a string."""
    m, root, call = module_dump
    _edit(call, lambda man: man["receiver"].__setitem__("state", name))
    result = _judged(m, root, call)
    assert (result.verdict, result.detail) == (
        "error",
        f"receiver.state: refusing module state name {name!r} (must be <sha256>.pt)",
    )


def test_a_module_state_that_inflates_in_memory_is_refused_unread(module_dump, tmp_path):
    """Attack: a 64 KiB state file whose archive holds a deflated 64 MiB weight (the recorder
    writes stored entries only): refused by its entries' sizes before torch reads any of it."""
    import zipfile

    m, root, _ = module_dump
    (state,) = os.listdir(root / "modules")
    plain = tmp_path / "plain.pt"
    torch.save({"proj.weight": torch.zeros(16 * 2**20)}, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(root / "modules" / state, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename), zipfile.ZIP_DEFLATED)
    assert os.path.getsize(root / "modules" / state) < 2**20
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["error"] * 3
    assert f"refusing {state}" in results[0].detail
    assert "by its archive's entries" in results[0].detail


def test_a_module_state_symlinked_out_of_the_dump_is_not_followed(module_dump, tmp_path):
    """Attack: modules/<sha256>.pt is a symlink to a valid copy outside the dump."""
    m, root, _ = module_dump
    (state,) = os.listdir(root / "modules")
    target = tmp_path / "outside-state.pt"
    shutil.move(root / "modules" / state, target)
    os.symlink(target, root / "modules" / state)
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["error"] * 3
    assert results[0].detail == (
        f"receiver.state (modules/): refusing {state}: it is a symlink (replay reads only files "
        "inside the dump)"
    )


def test_a_modules_folder_symlinked_out_of_the_dump_is_not_followed(module_dump, tmp_path):
    """Attack: the dump's modules/ folder is a symlink to a folder outside it."""
    m, root, _ = module_dump
    target = tmp_path / "outside-modules"
    shutil.move(root / "modules", target)
    os.symlink(target, root / "modules")
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["error"] * 3
    assert "the modules/ folder is a symlink" in results[0].detail


def test_a_truncated_module_state_is_an_error_naming_it(module_dump):
    """Attack: a truncated modules/<sha256>.pt."""
    m, root, _ = module_dump
    (state,) = os.listdir(root / "modules")
    path = root / "modules" / state
    path.write_bytes(path.read_bytes()[:100])
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["error"] * 3
    assert results[0].detail.startswith(
        f"receiver.state (modules/): {state} is not a readable torch file (truncated or corrupt: "
    )


# ----------------------------------------------------------------------------- verdicts


def test_nan_where_the_recording_had_finite_values_is_counted_as_such(dump, monkeypatch, capsys):
    """A NaN that replaces a finite value has no size: the detail and the JSON report count it
    ('2 NaN where the recording had finite values'), and no max abs diff claims it is tiny."""
    m, root, _ = dump

    def nan_add(x, y):
        out = x + y
        out[:2] = float("nan")
        return out

    monkeypatch.setattr(m.add, "__wrapped__", nan_add)
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["mismatch"] * 3
    assert results[0].detail == (
        "output: 2 of 4 elements differ (rtol=1.3e-06, atol=1e-05): 2 NaN where the recording "
        "had finite values"
    )
    first = results[0].mismatches[0]
    assert first["nan_where_finite"] == 2 and first["max_abs"] is None
    code = cli.main(["replay", "--dir", str(root), "--allow-module", m.__name__, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert report["results"][0]["mismatches"][0]["nan_where_finite"] == 2


def test_a_run_that_verified_nothing_fails_unless_allowed(dump, capsys):
    """Every call skipped: exit 1, saying nothing was verified; 0 with --allow-unverified. The
    Python API's exit_code agrees."""
    m, root, _ = dump
    for call in (p for p in root.iterdir() if p.is_dir()):
        _edit(call, lambda man: man.update(replayable=False, why_not_replayable="a test"))
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["skipped"] * 3
    assert exit_code(results) == 1 and exit_code(results, allow_unverified=True) == 0
    base = ["replay", "--dir", str(root), "--allow-module", m.__name__, "--no-progress"]
    assert cli.main(base) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].endswith("3 skipped")
    assert "nothing was verified: every call was skipped or unverified; exit 1" in err
    assert cli.main([*base, "--allow-unverified"]) == 0
    assert exit_code([]) == 1  # no call at all verified nothing either


def test_a_function_in_main_is_reported_once_at_record_time(tmp_path):
    """A level-10 call of a function defined in the script itself: one warning, when recorded,
    that replay will not be able to import it, pointing to the layout that replays."""
    proc = record_script(tmp_path, calls=3)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("is defined in __main__") == 1, proc.stderr
    assert "`otel-gpu replay` imports functions from modules by name" in proc.stderr
    assert "A layout that replays" in proc.stderr


@pytest.mark.parametrize("where", ["call", "folder"])
def test_a_call_directory_that_is_a_symlink_out_of_the_dump_is_not_entered(
    dump, tmp_path, where, caplog
):
    """Attack: a call directory of the dump (or a folder of calls one level down) is a symlink
    to a valid call recorded elsewhere, so following it would replay that call and pass. A linked
    call is reported as an error naming the link, and nothing behind a linked folder is read; the
    other calls replay."""
    m, root, call = dump
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = elsewhere / call.name
    shutil.move(str(call), moved)
    if where == "call":
        os.symlink(moved, call)
    else:
        os.symlink(elsewhere, root / "more")
    results = _replay(m, root)
    verdicts = {os.path.basename(r.dir): (r.verdict, r.detail) for r in results}
    assert [v for v, _ in verdicts.values()].count("pass") == 2
    if where == "call":
        assert verdicts[call.name] == (
            "error",
            "refusing the call directory: it is a symlink (replay reads only calls inside the dump)",
        )
        assert len(results) == 3
    else:
        assert len(results) == 2  # the call behind the linked folder is never read
        assert f"not entering {root / 'more'}: a symbolic link" in caplog.text
