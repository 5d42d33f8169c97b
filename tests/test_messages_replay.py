"""Every message of ``otel-gpu replay`` says what is true: the right reason, the right names and
numbers, a flag that exists, and nothing that was not checked.

Each test records a real call (or builds the real situation from one), replays it and pins the
message's meaning. Messages already pinned in ``test_replay.py``, ``test_replay_truth.py`` and
``test_replay_process.py`` are not repeated here.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import sys

import pytest
import torch
from dump_files import record_script

from otel_gpu import cli
from otel_gpu.export import pipeline
from otel_gpu.recorder import recorder
from otel_gpu.replay import Allow, Options, replay

LIB = """
import collections
import enum
import os
import time
import torch
import otel_gpu

HANG = {hang!r}

class Mode(enum.Enum):
    A = 1

Pair = collections.namedtuple("Pair", "a b")

class Handle:
    '''No tensor inside: the recorder cannot record it.'''
    def __init__(self):
        self.name = "h"

class Holder:
    '''Holds a tensor in a public attribute: recorded leaf by leaf, not rebuildable.'''
    def __init__(self, t):
        self.t = t

class Strict(dict):
    '''A dict subclass whose constructor does not take its items.'''
    def __init__(self, data, flag):
        super().__init__(data)
        self.flag = flag

@otel_gpu.api
def scale(x, factor=2.0):
    return x * factor

@otel_gpu.api
def take(x, obj):
    return x + 1

@otel_gpu.api
def login(x, api_token):
    return x + 1

@otel_gpu.api
def fails(x):
    raise ValueError("bad input")

@otel_gpu.api
def slow(x):
    if os.path.exists(HANG):
        time.sleep(600)
    return x + 1

@otel_gpu.api
def noisy(x):
    print("library chatter on stdout", flush=True)
    os.write(1, b"native chatter on stdout\\n")
    return x + 1

def make():
    @otel_gpu.api
    def inner(x):
        return x + 1
    return inner

class Stateful:
    def __init__(self, factor):
        self.factor = factor

    def __otel_gpu_state__(self):
        return {{"factor": self.factor}}

class Scaler(Stateful):
    @otel_gpu.api
    def run(self, x):
        return x * self.factor

class Other(Stateful):
    pass
"""


@pytest.fixture
def rec(otel_gpu_spans, module_factory, tmp_path):
    """Record at level 10 into ``tmp_path/d``; returns (module, dump root)."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root))
    source = LIB.format(hang=str(tmp_path / "hang.flag"))
    return module_factory(source, "msglib"), root


def _dirs(root) -> list[str]:
    pipeline.reset(timeout=2.0)
    return sorted(os.path.join(root, d) for d in os.listdir(root))


def _edit(directory: str, change) -> None:
    """Rewrite one call's manifest through ``change(manifest)``, as a crash or an attacker would."""
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    change(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)


def _replay(m, root, **kw):
    pipeline.reset(timeout=2.0)
    return replay(str(root), Options(allow=Allow([m.__name__]), **kw))


def _only(results):
    (result,) = results
    return result


# ----------------------------------------------------------------------------- the dump itself


def test_a_truncated_or_foreign_manifest_is_an_error_that_says_why(rec):
    """A manifest cut short is 'unreadable manifest: <JSON error>', one of another schema says
    so; the call keeps the span name its directory spells, and the other calls still replay."""
    m, root = rec
    m.scale(torch.ones(2))
    m.scale(torch.ones(3))
    m.scale(torch.ones(4))
    first, second, _third = _dirs(root)
    path = os.path.join(first, "manifest.json")
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 2])
    _edit(second, lambda man: man.update(schema_version=99))
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["error", "error", "pass"]
    assert results[0].detail.startswith("unreadable manifest: ")
    assert "line" in results[0].detail and "column" in results[0].detail  # where the JSON broke
    assert results[1].detail == (
        "unreadable manifest: not an otel-gpu dump manifest of schema version 1"
    )
    assert results[0].span_name == results[1].span_name == f"{m.__name__}.scale"


def test_a_call_that_returned_but_whose_outputs_were_never_written_is_skipped(
    rec, monkeypatch, caplog
):
    """The ``returned`` marker without outputs: skipped, 'returned, but its outputs were never
    written', never crashed-originally; true both when the process died and when writing failed
    (the process lived on), so the message does not claim the process ended."""
    m, root = rec

    def disk_full(self, *args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(recorder.Recorder, "_write_outputs", disk_full)
    m.scale(torch.ones(2))
    (directory,) = _dirs(root)
    monkeypatch.undo()
    manifest = json.load(open(os.path.join(directory, "manifest.json")))
    assert manifest["status"] == "inputs_saved"
    assert os.path.exists(os.path.join(directory, "returned"))
    result = _only(_replay(m, root))
    assert result.verdict == "skipped"
    assert result.detail == (
        "the call returned, but its outputs were never written "
        "(the process ended or the recorder stopped writing first): nothing to compare"
    )
    assert "crash" not in result.detail and result.now is None


def test_a_tensor_file_holding_objects_is_refused_without_suggesting_unpickling(rec):
    """An inputs file holding a pickled object: error 'refusing inputs.pt: it holds objects other
    than tensors', naming the class; torch's advice to load with weights_only=False never
    reaches the user. A file of plain values is 'does not hold a dict of tensors'."""
    m, root = rec
    m.scale(torch.ones(2))
    (directory,) = _dirs(root)
    torch.save({"input.x": m.Handle()}, os.path.join(directory, "inputs.pt"))
    result = _only(_replay(m, root))
    assert result.verdict == "error"
    assert "refusing inputs.pt: it holds objects other than tensors" in result.detail
    assert f"{m.__name__}.Handle" in result.detail
    assert "weights_only=False" not in result.detail
    torch.save({"input.x": 3}, os.path.join(directory, "inputs.pt"))
    result = _only(_replay(m, root))
    assert result.verdict == "error"
    assert result.detail.endswith("inputs.pt does not hold a dict of tensors")


def test_a_manifest_naming_no_function_is_skipped_saying_so(rec):
    """A manifest without module/qualname is skipped: 'names no function', not 'not allowed'."""
    m, root = rec
    m.scale(torch.ones(2))
    (directory,) = _dirs(root)
    _edit(directory, lambda man: man.update(function={"span_name": "x"}))
    result = _only(_replay(m, root))
    assert (result.verdict, result.detail) == (
        "skipped",
        "the manifest names no function (its module or qualname is missing)",
    )


# ----------------------------------------------------------------------------- what may run


def test_a_module_not_allowed_is_skipped_naming_the_flag_that_allows_it(rec):
    """'module <m> is not allowed (pass --allow-module <m>)': the module recorded, a real flag."""
    m, root = rec
    m.scale(torch.ones(2))
    pipeline.reset(timeout=2.0)
    result = _only(replay(str(root), Options(allow=Allow(["otherlib"]))))
    assert (result.verdict, result.detail) == (
        "skipped",
        f"module {m.__name__!r} is not allowed (pass --allow-module {m.__name__})",
    )


def test_cli_without_an_allowed_module_lists_the_recorded_modules_and_imports_nothing(
    otel_gpu_spans, module_factory, tmp_path, capsys
):
    """Non-interactive, no --allow-module: exit 2, 'not importing any module', the two flags that
    exist, every recorded module (sorted, once); no call is run and no module imported."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root))
    source = LIB.format(hang="")
    b = module_factory(source, "zzlib")
    a = module_factory(source, "aalib")
    a.scale(torch.ones(1))
    b.scale(torch.ones(1))
    a.scale(torch.ones(2))
    pipeline.reset(timeout=2.0)
    del sys.modules[a.__name__], sys.modules[b.__name__]
    assert cli.main(["replay", "--dir", str(root), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("otel-gpu replay: not importing any module.")
    assert "--allow-module PREFIX" in err and "--trust-dump" in err
    assert err.rstrip().endswith(f"Recorded modules: {a.__name__}, {b.__name__}")
    assert a.__name__ not in sys.modules and b.__name__ not in sys.modules


def test_cli_with_no_module_named_needs_no_allow_list(tmp_path, capsys):
    """Dumps that name no module (a process that died while saving inputs) need nothing allowed:
    no 'not importing any module' refusal, even with --trust-dump; the call is reported (and,
    as nothing was verified, the run exits 1)."""
    call = tmp_path / "000001-20250101T000000.000000-0123456789abcdef-mylib.f"
    call.mkdir()
    (call / "inputs.pt").write_bytes(b"")
    for extra in ([], ["--trust-dump"]):
        assert cli.main(["replay", "--dir", str(tmp_path), "--no-progress", *extra]) == 1
        out, err = capsys.readouterr()
        assert "not importing" not in err
        assert out.splitlines()[0].startswith("SKIPPED            mylib.f  [")
        assert "incomplete dump: the process ended while saving inputs" in out


def test_a_function_defined_in_a_script_is_skipped_as_defined_in_main(otel_gpu_spans, tmp_path):
    """A function of a script run as __main__ is recorded not replayable, and replay skips it
    with that reason: 'defined in __main__ (a script); replay imports modules only'."""
    root = tmp_path / "d"
    proc = record_script(tmp_path, calls=1)
    assert proc.returncode == 0, proc.stderr
    (directory,) = _dirs(root)
    manifest = json.load(open(os.path.join(directory, "manifest.json")))
    why = "defined in __main__ (a script); replay imports modules only"
    assert (manifest["replayable"], manifest["why_not_replayable"]) == (False, why)
    otel_gpu_spans(level=1)
    result = _only(replay(str(root), Options(allow=Allow(["__main__"]))))
    assert (result.verdict, result.detail) == ("skipped", why)


def test_functions_replay_cannot_import_by_name_are_skipped_with_a_true_reason(rec, tmp_path):
    """A function defined inside a function, and one from a module loaded without registering it
    in sys.modules, are both 'not importable by name'; the second is not called 'defined inside
    a function'."""
    m, root = rec
    m.make()(torch.ones(1))
    source = tmp_path / "ghostlib.py"
    source.write_text("import otel_gpu\n\n@otel_gpu.api\ndef f(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location("ghostlib", source)
    ghost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ghost)  # a plugin loader's way: never put in sys.modules
    ghost.f(torch.ones(1))
    why = (
        "not importable by name (defined inside a function, or in a module missing from "
        "sys.modules); replay cannot import it"
    )
    for directory in _dirs(root):
        manifest = json.load(open(os.path.join(directory, "manifest.json")))
        assert (manifest["replayable"], manifest["why_not_replayable"]) == (False, why)
    results = replay(str(root), Options(allow=Allow([m.__name__, "ghostlib"])))
    assert [(r.verdict, r.detail) for r in results] == [("skipped", why)] * 2


def test_a_type_in_a_manifest_that_is_not_what_it_claims_is_refused(rec):
    """An enum naming os:system: error, os is denylisted; a namedtuple naming an Enum: error
    'refused: <type> is not a namedtuple'; a type from a module not allowed is skipped, naming
    the module and the flag."""
    m, root = rec
    m.take(torch.ones(1), m.Mode.A)
    m.take(torch.ones(1), m.Pair(1, 2))
    m.take(torch.ones(1), m.Mode.A)
    enum_dir, pair_dir, far_dir = _dirs(root)

    def retype(ref):
        def change(man):
            (obj,) = [p for p in man["params"] if p["name"] == "obj"]
            obj["value"]["type"] = ref

        return change

    _edit(enum_dir, retype("os:system"))
    _edit(pair_dir, retype(f"{m.__name__}:Mode"))
    _edit(far_dir, retype("farawaylib:Mode"))
    results = _replay(m, root)
    assert [(r.verdict, r.detail) for r in results] == [
        (
            "error",
            "refused: type os:system is in 'os', which replay never imports, resolves or calls "
            "from a dump, whatever the flags (see 'Threat model' in docs/flight-recorder.md)",
        ),
        ("error", f"refused: {m.__name__}:Mode is not a namedtuple"),
        (
            "skipped",
            "type farawaylib:Mode is from module 'farawaylib', which is not allowed "
            "(pass --allow-module farawaylib)",
        ),
    ]
    assert "farawaylib" not in sys.modules


def test_a_receiver_type_that_is_not_a_subclass_is_refused(rec):
    """A receiver rebuilt as a class unrelated to the method's: error naming that type."""
    m, root = rec
    m.Scaler(torch.tensor(2.0)).run(torch.ones(2))
    (directory,) = _dirs(root)
    _edit(directory, lambda man: man["receiver"].update(type=f"{m.__name__}:Other"))
    result = _only(_replay(m, root))
    assert (result.verdict, result.detail) == (
        "error",
        f"refused: receiver type {m.__name__}:Other is not a subclass of the method's class",
    )


# ----------------------------------------------------------------------------- arguments


def test_a_redacted_argument_is_skipped_and_never_written(rec):
    """A secret-looking string argument is not in the manifest, and replay skips the call with
    'argument <name> was redacted when recorded (OTEL_GPU_REDACT)'."""
    m, root = rec
    m.login(torch.ones(1), api_token="hunter2")
    (directory,) = _dirs(root)
    assert "hunter2" not in open(os.path.join(directory, "manifest.json")).read()
    result = _only(_replay(m, root))
    assert (result.verdict, result.detail) == (
        "skipped",
        "argument api_token was redacted when recorded (OTEL_GPU_REDACT)",
    )


def test_an_argument_that_was_not_recorded_is_skipped_with_the_recorders_reason(rec):
    """'argument <path> (a <type>) was not recorded: <why>' with the recorder's own reason: an
    object without tensors is 'type not supported', a list nested too deeply is 'nested too
    deeply' (lists are supported: the type is not the reason)."""
    m, root = rec
    m.take(torch.ones(1), m.Handle())
    deep: list = [1]
    for _ in range(20):
        deep = [deep]
    m.take(torch.ones(1), deep)
    handle, nested = _replay(m, root)
    assert (handle.verdict, handle.detail) == (
        "skipped",
        f"argument obj (a {m.__name__}:Handle) was not recorded: "
        "type not supported by the flight recorder",
    )
    assert nested.verdict == "skipped"
    assert nested.detail.startswith("argument obj[0][0]")
    assert nested.detail.endswith("(a builtins:list) was not recorded: nested too deeply")
    assert "not supported" not in nested.detail


def test_an_argument_holding_tensors_in_an_object_is_skipped_as_not_rebuildable(rec):
    """'argument obj is an object holding tensors of type <T>: replay cannot rebuild such an
    argument' — no claim that it is compared (arguments are not outputs)."""
    m, root = rec
    m.take(torch.ones(1), m.Holder(torch.ones(2)))
    result = _only(_replay(m, root))
    assert (result.verdict, result.detail) == (
        "skipped",
        f"argument obj is an object holding tensors of type {m.__name__}:Holder: "
        "replay cannot rebuild such an argument",
    )


def test_a_mapping_argument_that_cannot_be_rebuilt_is_skipped_with_the_constructor_error(rec):
    """A dict subclass whose constructor does not take its items: skipped, naming the type and
    the exception its constructor raised."""
    m, root = rec
    m.take(torch.ones(1), m.Strict({"a": 1}, True))
    result = _only(_replay(m, root))
    assert result.verdict == "skipped"
    assert result.detail.startswith(
        f"argument obj is a {m.__name__}:Strict that replay could not rebuild from its items "
        "(TypeError: "
    )
    assert "'a'" in result.detail


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_recording_on_a_cpu_machine_is_skipped_with_a_device_flag_that_works(rec, capsys):
    """A tensor recorded on cuda:0: skipped, naming the argument, the device it would go to and
    the recorded one; the hinted --device cuda=cpu then replays the call to pass."""
    m, root = rec
    m.scale(torch.ones(3), factor=2.0)
    (directory,) = _dirs(root)

    def on_cuda(man):
        for meta in man["tensors"].values():
            meta["device"] = "cuda:0"

    _edit(directory, on_cuda)
    result = _only(_replay(m, root))
    assert (result.verdict, result.detail) == (
        "skipped",
        "argument x would be placed on cuda:0 (recorded on cuda:0), but this machine has no "
        "CUDA device; map it with --device, e.g. --device cuda=cpu",
    )
    result = _only(_replay(m, root, device_map={"cuda:0": "cuda:1"}))
    assert "would be placed on cuda:1 (recorded on cuda:0)" in result.detail
    base = ["replay", "--dir", str(root), "--allow-module", m.__name__, "--no-progress"]
    assert cli.main([*base, "--device", "cuda=cpu"]) == 0
    assert capsys.readouterr().out.startswith("PASS")


def test_a_malformed_device_flag_is_a_usage_error_naming_the_item(rec, capsys):
    """A bad TO or FROM device: exit 2, 'bad --device <item>' with torch's reason and the
    accepted forms; nothing is replayed."""
    m, root = rec
    m.scale(torch.ones(1))
    pipeline.reset(timeout=2.0)
    base = ["replay", "--dir", str(root), "--allow-module", m.__name__, "--no-progress"]
    for item in ("cuda=gpu0", "gpu0=cpu", "cuda:x=cpu"):
        assert cli.main([*base, "--device", item]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith(f"otel-gpu replay: bad --device {item!r}: ")
        assert "expected FROM=TO such as cuda=cpu" in err
        assert err.count("bad --device") == 1
    assert cli.main([*base, "--device", "cpu"]) == 0


# ----------------------------------------------------------------------------- outcomes


def _replayed_with(m, root, monkeypatch, function: str, body) -> tuple[str, str]:
    """Replay the one recorded call with ``body`` in place of ``function``: (verdict, detail)."""
    monkeypatch.setattr(getattr(m, function), "__wrapped__", body)
    result = _only(_replay(m, root))
    return result.verdict, result.detail


def _raising(exc: BaseException):
    def body(*args, **kwargs):
        raise exc

    return body


def test_a_call_recorded_as_raising_that_now_returns_is_a_mismatch_naming_the_exception(
    rec, monkeypatch
):
    """'returned, but the recorded call raised builtins.ValueError': the full type, once."""
    m, root = rec
    with pytest.raises(ValueError):
        m.fails(torch.ones(1))
    assert _replayed_with(m, root, monkeypatch, "fails", lambda x: x) == (
        "mismatch",
        "returned, but the recorded call raised builtins.ValueError",
    )


def test_a_call_that_now_raises_another_type_names_both_types_alike(rec, monkeypatch):
    """'raised builtins.TypeError: <msg>; the recorded call raised builtins.ValueError' — both
    types spelled the same way, so two classes of one name cannot be confused."""
    m, root = rec
    with pytest.raises(ValueError):
        m.fails(torch.ones(1))
    assert _replayed_with(m, root, monkeypatch, "fails", _raising(TypeError("wrong kind"))) == (
        "mismatch",
        "raised builtins.TypeError: wrong kind; the recorded call raised builtins.ValueError",
    )


def test_a_call_that_now_raises_where_the_recording_returned_says_both(rec, monkeypatch):
    """error: 'raised RuntimeError: <msg>; the recorded call returned' — not a bare exception."""
    m, root = rec
    m.scale(torch.ones(1))
    broken = _raising(RuntimeError("kernel exploded"))
    assert _replayed_with(m, root, monkeypatch, "scale", broken) == (
        "error",
        "raised RuntimeError: kernel exploded; the recorded call returned",
    )


def test_a_crashed_call_that_now_raises_or_returns_says_so_and_stays_crashed(rec, monkeypatch):
    """crashed-originally: 'the recorded call never completed; now it raises <T>: <msg>' with
    the exception in the report (now=raises), or '...; now it returns' (now=returns)."""
    m, root = rec
    m.scale(torch.ones(2))
    (directory,) = _dirs(root)
    _edit(directory, lambda man: man.update(status="inputs_saved", result=None))
    os.remove(os.path.join(directory, "returned"))

    def broken(x, factor=2.0):
        raise IndexError("index 9 out of range")

    monkeypatch.setattr(m.scale, "__wrapped__", broken)
    result = _only(_replay(m, root, in_process=True))
    assert (result.verdict, result.now, result.completes_now) == (
        "crashed-originally",
        "raises",
        False,
    )
    assert result.detail == (
        "the recorded call never completed; now it raises IndexError: index 9 out of range"
    )
    assert result.exception == {"type": "builtins.IndexError", "message": "index 9 out of range"}
    monkeypatch.undo()
    result = _only(_replay(m, root, in_process=True))
    assert (result.verdict, result.now, result.detail) == (
        "crashed-originally",
        "returns",
        "the recorded call never completed; now it returns",
    )
    assert result.exception is None


# ----------------------------------------------------------------------------- isolated runs


def test_an_isolated_call_that_hangs_is_an_error_naming_the_timeout(rec, tmp_path):
    """--isolate past --timeout: error 'the call does not complete within --timeout <S> s (its
    process was killed)', now=hangs; the flag named is the real one, the number the one given."""
    m, root = rec
    m.slow(torch.ones(1))
    pipeline.reset(timeout=2.0)
    (tmp_path / "hang.flag").touch()
    result = _only(_replay(m, root, isolate=True, timeout=6.0))
    assert (result.verdict, result.now, result.completes_now) == ("error", "hangs", False)
    assert (
        result.detail == "the call does not complete within --timeout 6 s (its process was killed)"
    )


def test_an_isolated_call_of_a_printing_library_is_judged_not_an_unreadable_report(rec):
    """What the replayed code prints on stdout (Python or native) does not corrupt the isolated
    child's report: the call passes, never 'without a readable report'."""
    m, root = rec
    m.noisy(torch.ones(1))
    result = _only(_replay(m, root, isolate=True))
    assert (result.verdict, result.detail) == ("pass", ""), result.detail


# ----------------------------------------------------------------------------- naming the dump


def test_the_dump_folder_may_be_named_positionally_or_with_dir(tmp_path, capsys):
    """`otel-gpu replay DIR` works as `--dir DIR` does (an empty folder: 'no call directories'
    either way); naming none says how to name one; naming two different ones is refused."""
    for argv in (["replay", str(tmp_path)], ["replay", "--dir", str(tmp_path)]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "no call directories" in err and "required" not in err
    assert cli.main(["replay"]) == 2
    assert "name the dump folder to replay: otel-gpu replay DIR" in capsys.readouterr().err
    assert cli.main(["replay", str(tmp_path), "--dir", str(tmp_path / "other")]) == 2
    assert "give the dump folder once" in capsys.readouterr().err


def test_a_file_where_the_dump_folder_is_expected_is_named_as_a_file(tmp_path, capsys):
    """`--dir trace.jsonl`: the message says it is a file (a trace file: read it with
    otel-gpu show) and what replay expects, not 'no such directory'."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("{}\n")
    assert cli.main(["replay", "--dir", str(trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"otel-gpu replay: {trace} is a file (a trace file: read it with otel-gpu show); "
        "replay expects a dump folder: the folder OTEL_GPU_DUMP_DIR names, or one call's "
        "folder below it"
    )
    assert "no such directory" not in err
