"""A manifest that names a function the user did not allow, through a module the user did allow.

The user allows ``gate``. ``gate`` imports another package, ``helper`` (not allowed), whose
decorated functions take dump-chosen arguments: ``helper.wipe(path)`` stands for any such
function (it writes a marker file). The payloads reach it through the allowed module: as a
name ``gate`` imported, as ``gate``'s module attribute, through a class's ``__base__``, and,
for a plain function, a receiver of a hook class built from dump-chosen state. None may run:
the function's home module must be allowed, its path is plain names through allowed modules
and classes, and only a method gets a receiver, of its own class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from crafted_dumps import crafted_manifest, write_call

from otel_gpu.replay import Allow, Options, replay

HELPER = """
import otel_gpu

@otel_gpu.api
def wipe(path):
    open(path, "w").close()
    return 1

class Base:
    @staticmethod
    @otel_gpu.api
    def wipe(path):
        open(path, "w").close()
        return 1
"""

GATE = """
import otel_gpu
import {helper} as helper
from {helper} import wipe

class Box(helper.Base):
    pass

class Launcher:
    '''A class that opts in to being rebuilt from recorded state; building it runs code.'''
    def __init__(self, path):
        open(path, "w").close()

    def __otel_gpu_state__(self):
        return {{}}

@otel_gpu.api
def plain(x):
    return x
"""


@pytest.fixture
def modules(otel_gpu_spans, module_factory) -> tuple[Any, Any]:
    """The allowed ``gate`` and the not-allowed ``helper`` it imports (decorated at level 1)."""
    otel_gpu_spans(level=1)
    helper = module_factory(HELPER, "helper")
    gate = module_factory(GATE.format(helper=helper.__name__), "gate")
    return gate, helper


def _replay(tmp_path: Path, gate: Any, manifest: dict[str, Any]) -> Any:
    root = tmp_path / "dump"
    write_call(root, manifest)
    (result,) = replay(str(root), Options(allow=Allow([gate.__name__])))
    return result


@pytest.mark.parametrize(
    "qualname",
    ["wipe", "helper.wipe", "Box.__base__.wipe", "Box.wipe"],
    ids=["imported-name", "module-attribute", "dunder-base", "inherited-from-helper"],
)
def test_a_function_of_a_module_not_allowed_is_never_called(tmp_path, modules, qualname):
    """gate allowed, helper not: gate.<path to helper's wipe> is refused or skipped, naming the
    module or the step, and wipe never runs."""
    gate, helper = modules
    marker = tmp_path / "wiped"
    manifest = crafted_manifest(
        {"span_name": "x", "module": gate.__name__, "qualname": qualname},
        [("path", {"t": "str", "v": str(marker)})],
    )
    result = _replay(tmp_path, gate, manifest)
    assert not marker.exists(), "a function of a module that was not allowed ran"
    assert result.verdict in ("skipped", "error"), (result.verdict, result.detail)
    assert helper.__name__ in result.detail or "__base__" in result.detail, result.detail


def test_a_plain_function_gets_no_receiver_built_from_the_dump(tmp_path, modules):
    """A plain function whose manifest claims a receiver of gate's hook class: refused, the
    class is never built from the dump's state."""
    gate, _ = modules
    marker = tmp_path / "built"
    state = {"t": "dict", "items": [[{"t": "str", "v": "path"}, {"t": "str", "v": str(marker)}]]}
    manifest = crafted_manifest(
        {"span_name": "x", "module": gate.__name__, "qualname": "plain", "receiver": True},
        [("x", {"t": "int", "v": 1})],
        receiver={"t": "state", "type": f"{gate.__name__}:Launcher", "state": state},
    )
    result = _replay(tmp_path, gate, manifest)
    assert not marker.exists(), "a class of the dump's choosing was built"
    assert result.verdict == "error", (result.verdict, result.detail)
    assert "not a method" in result.detail


def test_the_allowed_modules_own_function_still_replays(tmp_path, modules):
    """The rule takes nothing from a function the allowed module defines: gate.plain passes."""
    gate, _ = modules
    manifest = crafted_manifest(
        {"span_name": "x", "module": gate.__name__, "qualname": "plain"},
        [("x", {"t": "int", "v": 1})],
    )
    result = _replay(tmp_path, gate, manifest)
    assert result.verdict == "pass", result.detail
