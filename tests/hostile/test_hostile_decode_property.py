"""Property: whatever value a manifest holds, replay imports nothing outside the allowed set and
calls nothing but the constructors of allowed classes (and the decorated function itself).

Manifests are drawn from the whole value grammar of ``docs/flight-recorder.md`` (every tag,
random nesting, malformed nodes) with type references drawn from a mix of allowed test
classes, denylisted names, functions, classes of an imported but not allowed module, a module
never imported, and names that do not exist.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_gpu.replay import VERDICTS, Allow, Options, replay

ALLOWED = """
import collections
import dataclasses
import enum

import otel_gpu

BUILT = []  # (class name) for every construction of a class of this module
CALLED = []  # every call of a plain function of this module

class Mode(enum.Enum):
    A = 1
    B = 2

class Pair(collections.namedtuple("Pair", "a b")):
    def __new__(cls, *args):
        BUILT.append("Pair")
        return super().__new__(cls, *args)

class Box(dict):
    def __init__(self, *args, **kwargs):
        BUILT.append("Box")
        super().__init__(*args, **kwargs)

class Conf:
    def __init__(self, **kwargs):
        BUILT.append("Conf")
        self.kwargs = kwargs

    @classmethod
    def from_dict(cls, data):
        return cls(**data)

    def to_dict(self):
        return dict(self.kwargs)

class Plain:
    def __init__(self, *args, **kwargs):
        BUILT.append("Plain")

def helper(*args, **kwargs):
    CALLED.append("helper")

RECEIVED = []

@otel_gpu.api
def take(obj=None):
    RECEIVED.append(obj)
    return None
"""

FAR = """
CALLED = []

class Box(dict):
    def __init__(self, *args, **kwargs):
        CALLED.append("Box")
        super().__init__(*args, **kwargs)

def helper(*args, **kwargs):
    CALLED.append("helper")
"""

_STATE: dict[str, Any] = {}
_DATA_MODULES = ("builtins", "collections", "torch")


def _behaviour(value: Any, ok: str, depth: int = 0) -> list[str]:
    """What in a decoded value is not data: functions, and classes or instances of classes
    from outside the allowed module and the plain value types."""
    import enum

    found: list[str] = []
    if depth > 40:
        return ["nested deeper than the decoder allows"]
    if isinstance(value, type):
        home = value.__module__
        if not (home == ok or home in _DATA_MODULES):
            found.append(f"class {home}:{value.__qualname__}")
        return found
    if callable(value) and not isinstance(value, enum.Enum):
        return [f"callable {value!r}"]
    home = type(value).__module__
    if not (home == ok or home.split(".")[0] in _DATA_MODULES):
        found.append(f"instance of {home}:{type(value).__qualname__}")
    if isinstance(value, dict):
        for k, v in value.items():
            found += _behaviour(k, ok, depth + 1) + _behaviour(v, ok, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            found += _behaviour(v, ok, depth + 1)
    elif hasattr(value, "kwargs"):  # Conf
        found += _behaviour(value.kwargs, ok, depth + 1)
    return found


_IMPORTS: list[str] = []
_WATCHING = [False]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _WATCHING[0] and event == "import":
        _IMPORTS.append(str(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it records only while watching


@pytest.fixture
def world(otel_gpu_spans, module_factory, tmp_path):
    """The allowed module (level 1), a module imported but not allowed, one never imported."""
    otel_gpu_spans(level=1)
    _STATE["ok"] = module_factory(ALLOWED, "proplib")
    _STATE["far"] = module_factory(FAR, "propfar")
    (tmp_path / "propghost_never.py").write_text("raise SystemExit('imported')\n")
    _STATE["dump"] = tmp_path / "dump"
    return _STATE


def _refs() -> st.SearchStrategy[str]:
    ok = _STATE["ok"].__name__
    far = _STATE["far"].__name__
    return st.sampled_from(
        [
            f"{ok}:Mode",
            f"{ok}:Pair",
            f"{ok}:Box",
            f"{ok}:Conf",
            f"{ok}:Plain",
            f"{ok}:helper",
            f"{ok}:take",
            f"{ok}:Mode.A",
            f"{ok}:Mode.__class__",
            f"{ok}:Conf.from_dict",
            f"{ok}:Missing",
            f"{ok}",
            f"{far}:Box",
            f"{far}:helper",
            "propghost_never:X",
            "nosuchmodule_xyz:Y",
            "os:system",
            "os:_Environ",
            "posix:system",
            "builtins:eval",
            "builtins:dict",
            "builtins:int",
            "subprocess:getoutput",
            "subprocess:Popen",
            "importlib:import_module",
            "pickle:loads",
            "shutil:rmtree",
            "collections:OrderedDict",
            "torch:load",
            "torch.serialization:load",
            "torch:Size",
            "",
            ":x",
        ]
    )


_atoms = st.one_of(
    st.just({"t": "none"}),
    st.builds(lambda v: {"t": "bool", "v": v}, st.booleans()),
    st.builds(lambda v: {"t": "int", "v": v}, st.integers(-5, 5)),
    st.builds(lambda v: {"t": "str", "v": v}, st.text(max_size=5)),
    st.builds(lambda v: {"t": "float", "v": v}, st.sampled_from([1.5, "nan", "-inf"])),
    st.builds(lambda v: {"t": "dtype", "v": v}, st.sampled_from(["float16", "bogus", "Tensor"])),
    st.builds(lambda v: {"t": "device", "v": v}, st.sampled_from(["cpu", "meta", "nope:9"])),
    st.builds(lambda v: {"t": "size", "v": v}, st.lists(st.integers(0, 3), max_size=3)),
    st.just({"t": "tensor", "key": "input.missing"}),
    st.just({"t": "redacted"}),
    st.just({"t": "unsupported", "type": "x:Y", "why": "w"}),
    st.just({"t": "pytree", "type": "x:Y", "items": []}),
    st.just({"t": "object", "type": "x:Y", "fields": []}),
    st.just({"t": "bogus"}),
    st.sampled_from([None, 3, "s", [], {}]),  # not a tagged value at all
)


def _values() -> st.SearchStrategy[Any]:
    refs = _refs()

    def nodes(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        keys = st.one_of(st.builds(lambda v: {"t": "str", "v": v}, st.text(max_size=3)), children)
        pairs = st.lists(st.tuples(keys, children).map(list), max_size=3)
        return st.one_of(
            st.builds(lambda i: {"t": "list", "items": i}, st.lists(children, max_size=3)),
            st.builds(lambda i: {"t": "tuple", "items": i}, st.lists(children, max_size=3)),
            st.builds(lambda i: {"t": "dict", "items": i}, pairs),
            st.builds(lambda r, i: {"t": "mapping", "type": r, "items": i}, refs, pairs),
            st.builds(
                lambda r, i: {"t": "namedtuple", "type": r, "items": i},
                refs,
                st.lists(children, max_size=2),
            ),
            st.builds(
                lambda r, n: {"t": "enum", "type": r, "name": n},
                refs,
                st.sampled_from(["A", "B", "C", "__class__"]),
            ),
            st.builds(
                lambda r, v: {"t": "from_dict", "type": r, "v": v},
                refs,
                st.sampled_from([{}, {"a": 1}, [], "x"]),
            ),
            st.builds(lambda r: {"t": "type", "v": r}, refs),
        )

    return st.recursive(_atoms, nodes, max_leaves=12)


def _write(value: Any) -> None:
    dump = _STATE["dump"]
    call = dump / "000001-20260101T000000.000000-0123456789abcdef-take"
    call.mkdir(parents=True, exist_ok=True)
    manifest = {
        "schema_version": 1,
        "status": "completed",
        "function": {"span_name": "take", "module": _STATE["ok"].__name__, "qualname": "take"},
        "replayable": True,
        "files": {"inputs": None, "outputs": None},
        "tensors": {},
        "params": [{"name": "obj", "default": False, "value": value}],
        "positional": None,
        "receiver": None,
        "result": {"t": "none"},
    }
    (call / "manifest.json").write_text(json.dumps(manifest))


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_replay_imports_and_calls_only_what_is_allowed(world, data):
    """Random manifests from the value grammar: no module outside the allowed set is imported,
    no plain function is called, no class outside the allowed module is constructed, what the
    decorated function receives holds no function and no foreign class, and every call gets a
    verdict (never an exception out of replay)."""
    ok, far = world["ok"], world["far"]
    value = data.draw(_values())
    _write(value)
    ok.BUILT.clear()
    ok.RECEIVED.clear()
    ok.CALLED.clear()
    far.CALLED.clear()
    before = set(sys.modules)
    _IMPORTS.clear()
    _WATCHING[0] = True
    try:
        (result,) = replay(str(world["dump"]), Options(allow=Allow([ok.__name__])))
    finally:
        _WATCHING[0] = False
    new = set(sys.modules) - before
    outside = sorted(
        m for m in new | set(_IMPORTS) if not (m == ok.__name__ or m.startswith(ok.__name__ + "."))
    )
    assert outside == [], f"imported {outside} for {value!r}"
    assert "propghost_never" not in sys.modules
    assert ok.CALLED == [] and far.CALLED == [], value
    assert set(ok.BUILT) <= {"Pair", "Box", "Conf"}, value  # Plain has no rebuilding tag
    for received in ok.RECEIVED:  # what the decorated function was given is data only
        assert _behaviour(received, ok.__name__) == [], value
    assert result.verdict in VERDICTS and "\n" not in result.detail
    assert not os.path.exists(world["dump"] / "pwned")
