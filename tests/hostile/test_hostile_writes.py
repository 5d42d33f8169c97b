"""Files otel-gpu creates: never written through a planted symlink, private whatever the umask.

Each attack plants a symlink at a name the recorder, the ring, the module-state writer or the
journal is about to create, pointing at a victim file (or a victim folder) outside the dump. The
victim must come out unchanged, and nothing may appear outside the dump.
"""

from __future__ import annotations

import logging
import os
import re
import stat

import pytest
import torch
from dump_files import MODULE_BLOCK

import otel_gpu
from otel_gpu import _files
from otel_gpu.export import pipeline
from otel_gpu.journal import writer as journal
from otel_gpu.recorder import module_state, ring
from otel_gpu.replay import Allow, Options, replay

LIB = (
    """
import torch
from torch import nn
import otel_gpu

HOOKS = []  # run inside probe(): a test plants its links while the call is in flight

@otel_gpu.api
def probe(x):
    for hook in HOOKS:
        hook()
    return x + 1

@otel_gpu.api
def fail(x):
    raise ValueError("boom")

"""
    + MODULE_BLOCK
)

VICTIM_BYTES = b"the victim's own data\n"


pytestmark = pytest.mark.usefixtures("fresh_module_states")


@pytest.fixture
def load(module_factory):
    """Returns ``load()``: imports LIB afresh, decorated at the level configured before it."""
    return lambda: module_factory(LIB, "hostile_writes_lib")


@pytest.fixture
def victim(tmp_path):
    """A file outside the dump that an attacker wants otel-gpu to overwrite."""
    path = tmp_path / "victim" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(VICTIM_BYTES)
    os.chmod(path, 0o640)
    return path


def _untouched(victim) -> None:
    assert victim.read_bytes() == VICTIM_BYTES
    assert stat.S_IMODE(os.lstat(victim).st_mode) == 0o640
    assert os.listdir(victim.parent) == [victim.name]  # nothing else written beside it


def _tree_modes(root) -> dict[str, int]:
    """Every path below ``root`` (not following links) and its mode."""
    modes = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            modes[os.path.relpath(path, root)] = os.lstat(path).st_mode
    return modes


def _call_dir(root):
    (directory,) = [p for p in root.iterdir() if re.match(r"\d{6}-", p.name)]
    return directory


# --------------------------------------------------------------------------- module states


def test_a_symlink_at_the_old_predictable_state_temp_name_is_not_written_through(
    otel_gpu_spans, load, tmp_path, victim
):
    """Attack: a symlink at ``modules/<sha256>.pt.<pid>.tmp`` (the name the state writer used to
    write to, then rename) pointing at a victim file. The victim is unchanged, and the state
    file is a regular file of the recorder's, loadable, not the planted link."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root), dump_modules=True)
    lib = load()
    otel_gpu.instrument(lib.Block)
    torch.manual_seed(0)
    block = lib.Block(4)
    state = {k: v.detach().contiguous() for k, v in block.state_dict().items()}
    name = module_state._content_hash(state) + ".pt"
    (root / "modules").mkdir(parents=True)
    os.symlink(victim, root / "modules" / f"{name}.{os.getpid()}.tmp")
    block(torch.ones(2, 4))
    pipeline.reset(timeout=2.0)
    _untouched(victim)
    saved = root / "modules" / name
    assert stat.S_ISREG(os.lstat(saved).st_mode)
    assert torch.equal(torch.load(saved, weights_only=True)["proj.weight"], block.proj.weight)
    results = replay(str(root), Options(allow=Allow([lib.__name__], any_instrument=True)))
    assert [r.verdict for r in results] == ["pass"], [r.detail for r in results]


def test_a_symlink_at_the_state_final_name_is_replaced_not_followed(
    otel_gpu_spans, load, tmp_path, victim
):
    """Attack: a symlink at ``modules/<sha256>.pt`` itself pointing at a victim file (the writer
    used to see "exists" and refer to it; a writer opening it would overwrite the victim). The
    link is replaced by the state (the link itself, as ``rename`` does) and the victim is
    unchanged."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root), dump_modules=True)
    lib = load()
    otel_gpu.instrument(lib.Block)
    block = lib.Block(3)
    state = {k: v.detach().contiguous() for k, v in block.state_dict().items()}
    name = module_state._content_hash(state) + ".pt"
    (root / "modules").mkdir(parents=True)
    os.symlink(victim, root / "modules" / name)
    block(torch.ones(1, 3))
    pipeline.reset(timeout=2.0)
    _untouched(victim)
    saved = root / "modules" / name
    assert not saved.is_symlink()
    assert stat.S_IMODE(os.lstat(saved).st_mode) == 0o600
    assert set(torch.load(saved, weights_only=True)) == {"proj.weight", "proj.bias"}


def test_a_symlinked_modules_folder_is_refused_and_the_call_is_still_dumped(
    otel_gpu_spans, load, tmp_path, victim
):
    """Attack: ``modules`` planted as a symlink to a victim folder, so states land (and could be
    replaced) there. The folder is refused: nothing is written into the victim folder, the
    call is dumped without its module, and the manifest says why."""
    root = tmp_path / "d"
    root.mkdir(mode=0o700)
    os.symlink(victim.parent, root / "modules")
    otel_gpu_spans(level=10, dump_dir=str(root), dump_modules=True)
    lib = load()
    otel_gpu.instrument(lib.Block)
    lib.Block(2)(torch.ones(1, 2))
    pipeline.reset(timeout=2.0)
    _untouched(victim)
    receiver = _manifest_of(_call_dir(root))["receiver"]
    assert receiver["t"] == "unsupported"
    assert "is not a directory (a symlink or a file is refused)" in receiver["why"]


def _manifest_of(directory):
    import json

    return json.loads((directory / "manifest.json").read_text())


# --------------------------------------------------------------------------- call files


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_symlinks_planted_in_a_call_dir_during_the_call_are_never_written_through(
    otel_gpu_spans, load, tmp_path, victim, fmt
):
    """Attack: while the call runs, symlinks at the names the recorder writes after it
    (``outputs.pt``/``.safetensors``, ``manifest.json``, the old predictable manifest temp
    ``.manifest.json.tmp``, the ``returned`` marker) pointing at a victim file, and one at the
    marker pointing at a file that does not exist yet (an open with O_CREAT would create it).
    The victim is unchanged, no new file appears, and the dump is whole: outputs and manifest are
    regular files that replay passes."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root), dump_format=fmt, dump_durability="process")
    lib = load()
    ext = ".pt" if fmt == "torch" else ".safetensors"
    absent = victim.parent / "created-by-otel-gpu"

    def plant() -> None:
        call = _call_dir(root)
        for name in ("outputs" + ext, "manifest.json", ".manifest.json.tmp"):
            if (call / name).exists():
                (call / name).unlink()
            os.symlink(victim, call / name)
        os.symlink(absent, call / "returned")

    lib.HOOKS.append(plant)
    lib.probe(torch.ones(3))
    lib.HOOKS.clear()  # replay runs probe again
    pipeline.reset(timeout=2.0)
    _untouched(victim)
    assert not absent.exists()
    call = _call_dir(root)
    for name in ("outputs" + ext, "manifest.json"):
        assert stat.S_ISREG(os.lstat(call / name).st_mode), name
        assert stat.S_IMODE(os.lstat(call / name).st_mode) == 0o600, name
    manifest = _manifest_of(call)
    assert manifest["status"] == "completed"
    assert manifest["files"]["outputs"] == "outputs" + ext
    results = replay(str(root), Options(allow=Allow([lib.__name__])))
    assert [r.verdict for r in results] == ["pass"], [r.detail for r in results]


def test_a_link_at_the_exact_temporary_name_fails_the_write_and_leaves_its_target(
    tmp_path, victim, monkeypatch
):
    """Attack: a symlink at the very temporary name the writer picks (made predictable here by
    fixing the random part). The exclusive, no-follow create refuses it: the write fails with
    FileExistsError, the victim is unchanged and the final name is not created."""
    monkeypatch.setattr(_files.secrets, "token_hex", lambda n: "00" * n)
    folder = tmp_path / "d"
    folder.mkdir(mode=0o700)
    os.symlink(victim, folder / f".manifest.json.{'00' * 8}.tmp")
    with pytest.raises(FileExistsError):
        _files.write_atomic(str(folder), "manifest.json", lambda f: f.write(b"{}"))
    _untouched(victim)
    assert sorted(os.listdir(folder)) == [f".manifest.json.{'00' * 8}.tmp"]


def test_a_writer_that_takes_a_path_writes_where_nobody_else_can_plant_a_link(tmp_path, victim):
    """Attack: a writer that opens a path itself (safetensors) follows a link planted at that
    path. It is handed a path inside a folder created for it (exclusive, 0700, empty), and a
    symlink at the final name is replaced, never written through; the folder is removed."""
    folder = tmp_path / "d"
    folder.mkdir(mode=0o700)
    os.symlink(victim, folder / "inputs.safetensors")
    seen = {}

    def writer(path: str) -> None:
        parent = os.path.dirname(path)
        seen["parent"] = (os.path.dirname(parent), stat.S_IMODE(os.lstat(parent).st_mode))
        seen["empty"] = os.listdir(parent) == []
        with open(path, "wb") as f:
            f.write(b"tensors")

    _files.write_atomic_path(str(folder), "inputs.safetensors", writer)
    _untouched(victim)
    assert seen == {"parent": (str(folder), 0o700), "empty": True}
    assert os.listdir(folder) == ["inputs.safetensors"]
    assert not (folder / "inputs.safetensors").is_symlink()
    assert (folder / "inputs.safetensors").read_bytes() == b"tensors"
    assert stat.S_IMODE(os.lstat(folder / "inputs.safetensors").st_mode) == 0o600


# --------------------------------------------------------------------------- ring


def _next_trigger() -> int:
    """The number the ring's next dump will take (read without consuming it)."""
    match = re.fullmatch(r"count\((\d+)\)", repr(ring._TRIGGERS))
    assert match
    return int(match.group(1))


def test_a_symlink_at_the_next_ring_dump_name_is_never_used(otel_gpu_spans, load, tmp_path, victim):
    """Attack: symlinks to a victim folder at the next ring dump names
    (``ring-<pid>-<n>-stuck-0000000000000000``, predictable for a dump without a triggering
    span). The ring skips the planted names and writes its dump to a fresh 0700 folder of its
    own; nothing lands in the victim folder and the links are left as they were."""
    root = tmp_path / "d"
    otel_gpu_spans(level=5, ring=2, dump_dir=str(root))
    lib = load()
    lib.probe(torch.ones(2))
    lib.probe(torch.zeros(2))
    root.mkdir(mode=0o700)
    n = _next_trigger()
    planted = [root / f"ring-{os.getpid()}-{i:04d}-stuck-{'0' * 16}" for i in (n, n + 1)]
    for link in planted:
        os.symlink(victim.parent, link)
    directory = pipeline.current().ring.dump("stuck", None)
    pipeline.reset(timeout=2.0)
    _untouched(victim)
    assert all(os.readlink(link) == str(victim.parent) for link in planted)
    assert directory == str(root / f"ring-{os.getpid()}-{n + 2:04d}-stuck-{'0' * 16}")
    assert stat.S_ISDIR(os.lstat(directory).st_mode)
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    assert len(os.listdir(directory)) == 2  # both calls the ring kept


# --------------------------------------------------------------------------- journal


def test_a_symlink_at_the_journal_name_is_refused(
    otel_gpu_spans, tmp_path, victim, monkeypatch, caplog
):
    """Attack: a symlink at the journal's file name (made predictable here by fixing its random
    part) pointing at a victim file; the journal mmaps and writes its file. The create is
    exclusive and does not follow links: the journal is off with one warning, the victim is
    unchanged, and the program's call still returns."""
    jdir = tmp_path / "j"
    jdir.mkdir(mode=0o700)
    monkeypatch.setattr(journal.os, "urandom", lambda n: b"\xab" * n)
    os.symlink(victim, jdir / f"{journal.PREFIX}{os.getpid()}-{'ab' * 4}{journal.SUFFIX}")
    otel_gpu_spans(level=1, journal_dir=str(jdir))

    @otel_gpu.api
    def f(x):
        return x * 2

    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        assert f(21) == 42
    monkeypatch.undo()
    pipeline.reset(timeout=2.0)
    _untouched(victim)
    warnings = [r.getMessage() for r in caplog.records if "journal disabled" in r.getMessage()]
    assert len(warnings) == 1 and str(jdir) in warnings[0]


# --------------------------------------------------------------------------- modes


def test_under_umask_000_folders_are_0700_and_files_0600_nested_parents_included(
    otel_gpu_spans, load, tmp_path
):
    """Attack: a process running with ``umask 000`` (as some containers and daemons do); dumps,
    module states, ring dumps and journals in nested folders that do not exist yet. Every folder
    otel-gpu creates, parents included, is 0700 and every file it writes is 0600."""
    dumps = tmp_path / "a" / "b" / "dumps"
    rings = tmp_path / "r1" / "r2" / "rings"
    journals = tmp_path / "j1" / "j2" / "journals"
    old = os.umask(0)
    try:
        otel_gpu_spans(level=10, dump_dir=str(dumps), dump_modules=True, journal_dir=str(journals))
        lib = load()
        otel_gpu.instrument(lib.Block)
        lib.Block(2)(torch.ones(1, 2))
        lib.probe(torch.ones(2))
        (journal_file,) = [o.path for o in pipeline.current().observers if hasattr(o, "path")]
        journal_mode = os.stat(journal_file).st_mode
        pipeline.reset(timeout=2.0)
        otel_gpu_spans(level=5, ring=2, dump_dir=str(rings), journal_dir=str(journals))
        lib = load()
        lib.probe(torch.ones(2))
        with pytest.raises(ValueError):
            lib.fail(torch.ones(2))
        pipeline.reset(timeout=2.0)
    finally:
        os.umask(old)
    assert stat.S_IMODE(journal_mode) == 0o600
    created = {"a": tmp_path / "a", "r1": tmp_path / "r1", "j1": tmp_path / "j1"}
    seen: dict[str, int] = {}
    for top, path in created.items():
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700, top
        seen.update({f"{top}/{k}": v for k, v in _tree_modes(path).items()})
    assert any(k.startswith("a/b/dumps/modules/") and k.endswith(".pt") for k in seen)
    assert any(re.match(r"r1/r2/rings/ring-\d+-\d+-raised-.*/.*manifest\.json$", k) for k in seen)
    for path, mode in seen.items():
        if stat.S_ISDIR(mode):
            assert stat.S_IMODE(mode) == 0o700, path
        else:
            assert stat.S_ISREG(mode), path
            assert stat.S_IMODE(mode) == 0o600, path


def test_a_umask_that_removes_the_owners_bits_still_gives_0700_folders(tmp_path):
    """Attack: ``umask 0277`` would make new folders 0500, unwritable by their owner; the folders
    otel-gpu creates are set to exactly 0700."""
    old = os.umask(0o277)
    try:
        assert _files.make_dirs(str(tmp_path / "x" / "y"))
    finally:
        os.umask(old)
    for path in (tmp_path / "x", tmp_path / "x" / "y"):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700


def test_an_existing_loose_dump_dir_gets_one_warning_and_keeps_its_mode(
    otel_gpu_spans, load, tmp_path, caplog
):
    """Attack surface: a dump dir the user made world-writable (0777). otel-gpu does not chmod the
    user's folder; it warns exactly once (across reconfiguration and the ring), naming the folder
    and its mode, and still dumps into private call folders."""
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        otel_gpu_spans(level=10, dump_dir=str(root), ring=2)
        lib = load()
        lib.probe(torch.ones(2))
        pipeline.reset(timeout=2.0)
        otel_gpu_spans(level=10, dump_dir=str(root), ring=2)
        lib.probe(torch.ones(2))
        with pytest.raises(ValueError):
            lib.fail(torch.ones(2))  # the ring writes below the same folder
        pipeline.reset(timeout=2.0)
    warnings = [r.getMessage() for r in caplog.records if str(root) + " " in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "0777" in warnings[0] and "other users" in warnings[0]
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o777
    calls = [p for p in root.iterdir() if p.is_dir()]
    assert len(calls) >= 3 and all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in calls)


def test_a_private_existing_dump_dir_gets_no_warning(otel_gpu_spans, load, tmp_path, caplog):
    """The one warning above is not noise: a 0700 dump dir of the user's own gives none."""
    root = tmp_path / "mine"
    root.mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        otel_gpu_spans(level=10, dump_dir=str(root))
        lib = load()
        lib.probe(torch.ones(2))
        pipeline.reset(timeout=2.0)
    assert not [r for r in caplog.records if "other users" in r.getMessage()]
