"""Crafted dumps: a manifest decodes to data, never to behaviour.

Each payload is a dump an attacker could attach to a bug report. Every test asserts that the
command it carries never ran (its marker file does not exist, and no process, shell or pickle
audit event fired), that nothing was written outside the dump, and that the call got a verdict
(``skipped`` or ``error``) with a one-line reason rather than a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from commands import python_command
from crafted_dumps import crafted_manifest, write_call

import otel_gpu
from otel_gpu.instrumentation import targets
from otel_gpu.replay import Allow, Options, Result, replay

VICTIM = """
import collections
import enum
from collections.abc import Mapping
from os import _Environ  # re-exported by an allowed module: still os's class
from os import system as run_shell  # re-exported by an allowed module: still os.system

import otel_gpu

COMMAND = {command!r}
CALLS = []

class Mode(enum.Enum):
    A = 1

Pair = collections.namedtuple("Pair", "a b")

def helper(*args, **kwargs):
    '''A plain function of an allowed module: never a type, never called by replay.'''
    CALLS.append(args)
    return 0

@otel_gpu.api
def take(x, obj=None):
    '''A callback API: calls the callable it is given, and reads the mapping it is given.'''
    if callable(obj) and not isinstance(obj, type):
        obj(COMMAND)
    if isinstance(obj, Mapping):
        list(obj.items())
    return x

class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def __otel_gpu_state__(self):
        return {{"factor": self.factor}}

    @otel_gpu.api
    def run(self, x):
        return x
"""

FAR = """
from collections.abc import Mapping

MARKER = {marker!r}

class Gadget(dict):
    '''A Mapping whose constructor writes a file: imported by the program, never allowed.'''
    def __init__(self, *args, **kwargs):
        open(MARKER, "w").close()
        super().__init__(*args, **kwargs)
"""

_EVENTS: list[tuple[str, str]] = []
_WATCHING: list[bool] = [False]
_DANGEROUS = (
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "subprocess.Popen",
    "pickle.find_class",
    "ctypes.dlopen",
)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _WATCHING[0] and event in _DANGEROUS:
        _EVENTS.append((event, repr(args)[:200]))


sys.addaudithook(_audit)


@pytest.fixture
def watch() -> Iterator[list[tuple[str, str]]]:
    """Process, shell and unpickling audit events raised while the test replays."""
    _EVENTS.clear()
    _WATCHING[0] = True
    yield _EVENTS
    _WATCHING[0] = False


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


@pytest.fixture
def victim(otel_gpu_spans, module_factory, marker: Path):
    """An allowed library with a decorated callback API, imported at level 1 (as replay runs)."""
    otel_gpu_spans(level=1)
    return module_factory(VICTIM.format(command=f"touch {marker}"), "victimlib")


@pytest.fixture
def far(module_factory, marker: Path):
    """A module the program imported already, which the user did not allow."""
    return module_factory(FAR.format(marker=str(marker)), "farlib")


def _call(root: Path, function: dict[str, Any], params: list[Any], **extra: Any) -> Path:
    """Write one crafted call directory below ``root``, its parameters named x and obj."""
    return write_call(root, crafted_manifest(function, list(zip(("x", "obj"), params)), **extra))


def _take(victim, obj: Any) -> tuple[dict[str, Any], list[Any]]:
    fn = {"span_name": "take", "module": victim.__name__, "qualname": "take"}
    return fn, [{"t": "int", "v": 1}, obj]


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``root`` (bytecode caches aside), with its size and modification time."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            st = os.stat(os.path.join(dirpath, f))
            out[os.path.relpath(os.path.join(dirpath, f), root)] = (st.st_size, st.st_mtime_ns)
    return out


def _replay_api(
    tmp_path: Path, dump: Path, allow: Allow, marker: Path, watch: list[tuple[str, str]]
) -> Result:
    """Replay ``dump`` in this process; asserts nothing ran and nothing was written."""
    before = _snapshot(tmp_path)
    (result,) = replay(str(dump), Options(allow=allow))
    assert not marker.exists(), "the dump's command ran"
    assert watch == [], f"process or unpickling events fired: {watch}"
    assert _snapshot(tmp_path) == before, "replay wrote a file"
    assert result.verdict in ("skipped", "error"), (result.verdict, result.detail)
    assert "\n" not in result.detail and "Traceback" not in result.detail
    return result


def _replay_cli(tmp_path: Path, dump: Path, *flags: str) -> tuple[int, dict[str, Any], str]:
    """``python -m otel_gpu replay --json`` in a child process; returns (exit code, report, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    before = _snapshot(tmp_path)
    proc = python_command(
        ["-m", "otel_gpu", "replay", "--dir", str(dump), "--json", *flags],
        env=env,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert _snapshot(tmp_path) == before, "replay wrote a file"
    assert "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, report, proc.stderr


def _environ_gadget(type_ref: str, marker: Path) -> dict[str, Any]:
    """os._Environ(data, encodekey, decodekey, encodevalue, decodevalue): reading a key runs
    ``decodekey(key)``, here os.system on the command stored as the key."""
    shell = {"t": "type", "v": "os:system"}
    return {
        "t": "mapping",
        "type": type_ref,
        "items": [
            [
                {"t": "str", "v": "data"},
                {
                    "t": "dict",
                    "items": [[{"t": "str", "v": f"touch {marker}"}, {"t": "int", "v": 1}]],
                },
            ],
            [{"t": "str", "v": "encodekey"}, shell],
            [{"t": "str", "v": "decodekey"}, shell],
            [{"t": "str", "v": "encodevalue"}, {"t": "type", "v": "builtins:str"}],
            [{"t": "str", "v": "decodevalue"}, {"t": "type", "v": "builtins:str"}],
        ],
    }


# ----------------------------------------------------------------------------- the mapping gadget


def test_environ_mapping_gadget_with_a_victim_module_allowed(tmp_path, victim, marker, watch):
    """Attack: {"t":"mapping","type":"os:_Environ"} with decodekey=os:system, replayed with
    only the victim module allowed (the reported code execution). Refused: os is denylisted."""
    dump = tmp_path / "d"
    _call(dump, *_take(victim, _environ_gadget("os:_Environ", marker)))
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.verdict == "error"
    assert result.detail.startswith("refused: type os:_Environ is in 'os'")


def test_environ_gadget_reexported_by_an_allowed_module(tmp_path, victim, marker, watch):
    """Attack: the same gadget named through the allowed module that re-exports it
    (victimlib:_Environ): the class is os's, and os stays denied."""
    dump = tmp_path / "d"
    _call(dump, *_take(victim, _environ_gadget(f"{victim.__name__}:_Environ", marker)))
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.verdict == "error"
    assert f"type {victim.__name__}:_Environ (defined in os) is in 'os'" in result.detail


def test_environ_mapping_gadget_under_trust_dump_from_the_command_line(tmp_path, victim, marker):
    """Attack: the mapping gadget replayed with `otel-gpu replay --trust-dump`: the dump names
    os for an argument type, and --trust-dump never allows a denylisted module (exit 1, error)."""
    dump = tmp_path / "d"
    _call(dump, *_take(victim, _environ_gadget("os:_Environ", marker)))
    code, report, _ = _replay_cli(tmp_path, dump, "--trust-dump")
    assert not marker.exists()
    (result,) = report["results"]
    assert (code, result["verdict"]) == (1, "error")
    assert result["detail"].startswith("refused: type os:_Environ is in 'os'")


def test_allow_module_os_is_a_usage_error_from_the_command_line(tmp_path, victim, marker):
    """Attack: a bug report that tells the maintainer to pass --allow-module os for the gadget.
    No flag lifts the denylist: exit 2, one line naming the denylist, nothing replayed."""
    dump = tmp_path / "d"
    _call(dump, *_take(victim, _environ_gadget("os:_Environ", marker)))
    code, report, err = _replay_cli(tmp_path, dump, "--allow-module", f"{victim.__name__},os.path")
    assert (code, report) == (2, {})
    assert not marker.exists()
    (line,) = err.strip().splitlines()
    assert line.startswith("otel-gpu replay: --allow-module os.path: 'os' is on replay's denylist")


# ----------------------------------------------------------------------------- type tags


@pytest.mark.parametrize(
    "ref",
    ["os:system", "posix:system", "builtins:eval", "builtins:__import__", "subprocess:getoutput"],
)
def test_type_tag_naming_a_denied_function_is_refused(tmp_path, victim, marker, watch, ref):
    """Attack: {"t":"type","v":"os:system"} (and eval, __import__, subprocess.getoutput) handed
    to a callback API that calls what it is given: refused before anything resolves."""
    dump = tmp_path / "d"
    _call(dump, *_take(victim, {"t": "type", "v": ref}))
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.verdict == "error" and result.detail.startswith(f"refused: type {ref} is in")


def test_type_tag_naming_a_function_of_an_allowed_module_is_refused(
    tmp_path, victim, marker, watch
):
    """Attack: a type tag naming a plain function of the allowed module (victimlib:helper):
    a type tag resolves only to a class, so it is refused and the function never runs."""
    dump = tmp_path / "d"
    _call(dump, *_take(victim, {"t": "type", "v": f"{victim.__name__}:helper"}))
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.detail == (
        f"refused: type {victim.__name__}:helper is not a class (a dump names only classes)"
    )
    assert victim.CALLS == []


def test_type_tag_naming_os_system_through_an_allowed_module_is_refused(
    tmp_path, victim, marker, watch
):
    """Attack: victimlib:run_shell, os.system re-exported by the allowed module: not a class."""
    dump = tmp_path / "d"
    _call(dump, *_take(victim, {"t": "type", "v": f"{victim.__name__}:run_shell"}))
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.verdict == "error" and "is not a class" in result.detail


def test_type_tag_walking_dunders_to_reach_builtins_is_refused(tmp_path, victim, marker, watch):
    """Attack: victimlib:Mode.__init__.__globals__ and victimlib:Mode.__class__ walk from an
    allowed class to other objects: dunder steps are refused."""
    dump = tmp_path / "d"
    name = victim.__name__
    _call(dump, *_take(victim, {"t": "type", "v": f"{name}:Mode.__init__.__globals__"}))
    result = _replay_api(tmp_path, dump, Allow([name]), marker, watch)
    assert result.detail == f"refused: type {name}:Mode.__init__.__globals__ is not a class " + (
        "(a dump names only classes)"
    )


def test_a_module_imported_already_but_not_allowed_is_never_used(
    tmp_path, victim, far, marker, watch
):
    """Attack: a Mapping class of a module the program imported (farlib:Gadget) whose
    constructor writes a file: being imported allows nothing; skipped, naming the flag."""
    dump = tmp_path / "d"
    gadget = {"t": "mapping", "type": f"{far.__name__}:Gadget", "items": []}
    _call(dump, *_take(victim, gadget))
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert (result.verdict, result.detail) == (
        "skipped",
        f"type {far.__name__}:Gadget is from module {far.__name__!r}, which is not allowed "
        f"(pass --allow-module {far.__name__})",
    )


def test_a_module_never_imported_is_not_imported(tmp_path, victim, marker, watch):
    """Attack: a type from an importable module with import-time code (ghostlib writes the
    marker on import): not allowed, so never imported."""
    (tmp_path / "ghostlib_hostile.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    dump = tmp_path / "d"
    _call(dump, *_take(victim, {"t": "type", "v": "ghostlib_hostile:X"}))
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.verdict == "skipped" and "ghostlib_hostile" not in sys.modules


# ----------------------------------------------------------------------------- enum, from_dict, namedtuple


@pytest.mark.parametrize(
    ("tag", "extra"),
    [
        ("enum", {"name": "A"}),
        ("from_dict", {"v": {"command": "x"}}),
        ("namedtuple", {"items": [{"t": "str", "v": "touch pwned"}]}),
        ("mapping", {"items": [[{"t": "str", "v": "command"}, {"t": "str", "v": "x"}]]}),
    ],
)
@pytest.mark.parametrize("ref", ["os:system", "os.system", "builtins:exec"])
def test_typed_tags_naming_os_system_are_refused(tmp_path, victim, marker, watch, tag, extra, ref):
    """Attack: enum, from_dict, namedtuple and mapping tags whose type is os:system (or the
    dotted os.system, or exec): each would call or index what it names; all refused."""
    dump = tmp_path / "d"
    _call(dump, *_take(victim, {"t": tag, "type": ref, **extra}))
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.verdict == "error" and result.detail.startswith("refused: ")


@pytest.mark.parametrize(
    ("tag", "extra", "why"),
    [
        ("enum", {"name": "A"}, "is not a class"),
        ("from_dict", {"v": {}}, "is not a class"),
        ("namedtuple", {"items": []}, "is not a class"),
    ],
)
def test_typed_tags_naming_a_reexported_shell_function_are_refused(
    tmp_path, victim, marker, watch, tag, extra, why
):
    """Attack: the typed tags naming victimlib:run_shell (os.system re-exported by the
    allowed module): a function is never a type."""
    dump = tmp_path / "d"
    _call(dump, *_take(victim, {"t": tag, "type": f"{victim.__name__}:run_shell", **extra}))
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.verdict == "error" and why in result.detail


# ----------------------------------------------------------------------------- instrumented targets


@pytest.mark.parametrize(
    ("module", "qualname", "target", "command"),
    [
        ("subprocess", "getoutput", "subprocess", "touch {marker}"),
        ("os", "system", "os", "touch {marker}"),
        ("builtins", "eval", "builtins.eval", "__import__('os').system('touch {marker}')"),
    ],
)
def test_instrumented_denied_targets_are_refused_under_trust_dump(
    tmp_path, victim, marker, watch, module, qualname, target, command
):
    """Attack: function.instrumented names subprocess, os or builtins.eval and --trust-dump is
    given: replay would instrument the target and then call it with the dump's command.
    Refused; the target is never instrumented."""
    dump = tmp_path / "d"
    fn = {"span_name": qualname, "module": module, "qualname": qualname, "instrumented": target}
    _call(dump, fn, [{"t": "str", "v": command.format(marker=marker)}])
    result = _replay_api(tmp_path, dump, Allow(any_instrument=True), marker, watch)
    assert result.verdict == "error"
    assert result.detail.startswith(f"refused: function {module}.{qualname} is in {module!r}")
    assert targets.instrumented() == []


def test_instrumented_target_reexporting_os_system_is_refused(tmp_path, victim, marker, watch):
    """Attack: instrumented=victimlib.run_shell under --trust-dump: the allowed module
    re-exports os.system; instrumenting it would make it callable. Refused by what the
    function is (posix.system), and the command never runs."""
    dump = tmp_path / "d"
    name = victim.__name__
    fn = {
        "span_name": "s",
        "module": name,
        "qualname": "run_shell",
        "instrumented": f"{name}.run_shell",
    }
    _call(dump, fn, [{"t": "str", "v": f"touch {marker}"}])
    try:
        result = _replay_api(tmp_path, dump, Allow([name], any_instrument=True), marker, watch)
    finally:
        otel_gpu.uninstrument()
    assert result.verdict == "error"
    assert f"function {name}.run_shell (defined as posix.system) is in 'posix'" in result.detail


@pytest.mark.parametrize("target", ["*", "o*", "[o]s.system"])
def test_instrumented_patterns_with_no_package_are_refused(tmp_path, victim, marker, watch, target):
    """Attack: instrumented="*" under --trust-dump would instrument every imported module,
    os and subprocess included: a pattern needs a package before it."""
    dump = tmp_path / "d"
    fn = {"span_name": "t", "module": victim.__name__, "qualname": "take", "instrumented": target}
    _call(dump, fn, [{"t": "int", "v": 1}])
    result = _replay_api(
        tmp_path, dump, Allow([victim.__name__], any_instrument=True), marker, watch
    )
    assert result.verdict == "error" and "is a pattern with no package before it" in result.detail
    assert targets.instrumented() == []


def test_instrumented_subprocess_from_the_command_line(tmp_path, victim, marker):
    """Attack: `otel-gpu replay --trust-dump` on function.instrumented="subprocess" (the
    reported run of subprocess.getoutput): error, exit 1, the command never runs."""
    dump = tmp_path / "d"
    fn = {
        "span_name": "g",
        "module": "subprocess",
        "qualname": "getoutput",
        "instrumented": "subprocess",
    }
    _call(dump, fn, [{"t": "str", "v": f"touch {marker}"}])
    code, report, _ = _replay_cli(tmp_path, dump, "--trust-dump", "--allow-unverified")
    assert not marker.exists()
    (result,) = report["results"]
    assert (code, result["verdict"]) == (1, "error")
    assert "refused: function subprocess.getoutput is in 'subprocess'" in result["detail"]


# ----------------------------------------------------------------------------- receivers


@pytest.mark.parametrize(
    ("ref", "verdict", "why"),
    [
        ("os:_Environ", "error", "refused: type os:_Environ is in 'os'"),
        ("builtins:dict", "error", "is not a subclass of the method's class"),
        ("{far}:Gadget", "skipped", "which is not allowed"),
    ],
)
def test_receiver_types_outside_the_allowed_set(
    tmp_path, victim, far, marker, watch, ref, verdict, why
):
    """Attack: a method's receiver recorded as a class outside the allowed set (os._Environ,
    a builtin, a class of an imported but not allowed module): never constructed."""
    dump = tmp_path / "d"
    fn = {"span_name": "run", "module": victim.__name__, "qualname": "Scaler.run", "receiver": True}
    state = {"t": "dict", "items": [[{"t": "str", "v": "data"}, {"t": "dict", "items": []}]]}
    receiver = {"t": "state", "type": ref.format(far=far.__name__), "state": state}
    _call(dump, fn, [{"t": "int", "v": 1}], receiver=receiver)
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.verdict == verdict and why in result.detail


# ----------------------------------------------------------------------------- nesting bombs


@pytest.mark.parametrize("depth", [40, 400, 200_000])
def test_nesting_bomb_gets_a_verdict_not_a_recursion_error(tmp_path, victim, marker, watch, depth):
    """Attack: a list nested 40, 400 and 200,000 levels deep in one argument: deeper than the
    recorder ever writes (16). The first two are refused by the decoder's depth bound; the
    last cannot even be parsed as JSON: an unreadable manifest. Never a RecursionError."""
    dump = tmp_path / "d"
    call = _call(dump, *_take(victim, {"t": "none"}))
    text = (call / "manifest.json").read_text()
    bomb = '{"t": "list", "items": [' * depth + "]}" * depth
    (call / "manifest.json").write_text(text.replace('{"t": "none"}', bomb))
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.verdict == "error"
    if depth < 1000:
        assert result.detail == "refused: argument obj" + "[0]" * 33 + (
            " is nested more than 32 levels deep (the recorder writes at most 16)"
        )
    else:
        assert result.detail == "unreadable manifest: manifest.json is nested too deeply " + (
            "to be a dump manifest"
        )


def test_nesting_bomb_from_the_command_line(tmp_path, victim):
    """Attack: the 200,000-level bomb through `otel-gpu replay`: a verdict (error, exit 1) and
    no traceback, also while --trust-dump reads the dump for the modules it names."""
    dump = tmp_path / "d"
    call = _call(dump, *_take(victim, {"t": "none"}))
    text = (call / "manifest.json").read_text()
    bomb = '{"t": "list", "items": [' * 200_000 + "]}" * 200_000
    (call / "manifest.json").write_text(text.replace('{"t": "none"}', bomb))
    code, report, _ = _replay_cli(tmp_path, dump, "--trust-dump", "--allow-module", victim.__name__)
    (result,) = report["results"]
    assert (code, result["verdict"]) == (1, "error")


# ----------------------------------------------------------------------------- pickles


def test_a_pickle_in_inputs_pt_is_refused_by_weights_only_loading(tmp_path, victim, marker, watch):
    """Attack: inputs.pt holds a pickle whose __reduce__ runs os.system on load: weights_only
    loading refuses it (error), and the command never runs."""
    dump = tmp_path / "d"
    call = _call(dump, *_take(victim, {"t": "tensor", "key": "input.x"}))
    manifest = json.loads((call / "manifest.json").read_text())
    manifest["files"]["inputs"] = "inputs.pt"
    manifest["tensors"] = {"input.x": {"shape": [1], "dtype": "float32", "stride": [1]}}
    (call / "manifest.json").write_text(json.dumps(manifest))

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"input.x": Evil()}, call / "inputs.pt")
    result = _replay_api(tmp_path, dump, Allow([victim.__name__]), marker, watch)
    assert result.verdict == "error" and "holds objects other than tensors" in result.detail


# ----------------------------------------------------------------------------- --trust-dump's list


def test_trust_dump_allows_named_modules_but_never_denylisted_ones(tmp_path):
    """--trust-dump allows the modules a dump names for its function, its receiver's class and
    its argument types (nested ones included), and leaves out denylisted ones (os, builtins)
    and the plain value types, which need no allowing."""
    from otel_gpu.replay.cli import _recorded_modules

    dump = tmp_path / "d"
    fn = {"span_name": "run", "module": "mylib", "qualname": "Scaler.run", "receiver": True}
    nested = {"t": "list", "items": [{"t": "enum", "type": "enumlib.sub:Mode", "name": "A"}]}
    obj = {
        "t": "mapping",
        "type": "os:_Environ",
        "items": [
            [{"t": "str", "v": "k"}, nested],
            [{"t": "str", "v": "f"}, {"t": "type", "v": "builtins:eval"}],
        ],
    }
    receiver = {"t": "state", "type": "recvlib:Sub", "state": {"t": "dict", "items": []}}
    _call(dump, fn, [{"t": "type", "v": "builtins:int"}, obj], receiver=receiver)
    dirs = [str(p) for p in dump.iterdir()]
    assert _recorded_modules(dirs) == ["enumlib.sub", "mylib", "recvlib"]


def test_escapes_in_a_dump_are_printed_visibly(tmp_path, victim):
    """Attack: terminal escapes (an OSC title, a screen clear, a bell, a bidi override) in a dump's
    span name and in the module it names, aimed at the maintainer's terminal. Replay's verdict
    lines and its module list, written to a pipe, carry them as visible escapes, never raw."""
    evil = "\x1b]0;pwned\x07\x1b[2J\u202e"
    dump = tmp_path / "dump"
    function = {"span_name": "take" + evil, "module": victim.__name__ + evil, "qualname": "take"}
    _call(dump, function, [{"t": "int", "v": 1}])
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    runs = [
        ["--allow-module", victim.__name__],  # the verdict line names the span and the module
        [],  # nothing allowed: the refusal lists the recorded modules
    ]
    for flags in runs:
        proc = python_command(
            ["-m", "otel_gpu", "replay", "--dir", str(dump), *flags],
            env=env,
            cwd=str(tmp_path),
            timeout=120,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode in (1, 2), out
        assert not any(c in out for c in "\x1b\x07\u202e"), repr(out)
        assert "\\x1b]0;pwned\\x07\\x1b[2J\\u202e" in out, out
