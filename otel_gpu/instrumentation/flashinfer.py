"""Target ``flashinfer``: FlashInfer's own ``@flashinfer_api`` decorator, routed to otel-gpu.

FlashInfer marks its public APIs with ``@flashinfer_api`` (``flashinfer.api_logging``). That
decorator reads ``FLASHINFER_LOGLEVEL`` once, when ``api_logging`` is imported: at 0 it returns
the function itself (or a thin ``fi_trace`` auto-dump wrapper when the API declares a trace
template), above 0 a ``functools.wraps`` logging wrapper. This target turns each such API into
one otel-gpu span named ``flashinfer.<qualname>`` (``flashinfer.rmsnorm``,
``flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan``) and keeps FlashInfer's logging from
running as well. Two routes, chosen by whether ``flashinfer.api_logging`` is imported yet:

* not yet: an import hook imports FlashInfer as at its level 0 and, right after ``api_logging``
  runs, replaces its ``flashinfer_api`` with ours, so every module imported afterwards
  decorates with ours;
* already: the decorated APIs are found in FlashInfer's source (at level 0 they are plain
  functions, so only the source tells), FlashInfer's logging wrapper is cut out, and every
  reference to each API in FlashInfer's modules, classes and outer decorators' closures is
  swapped for ours. ``api_logging.flashinfer_api`` is replaced too, for modules imported later.

:func:`uninstall` puts back every object it replaced.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_gpu import _guard

__all__ = ["DecoratedApi", "decorated_apis", "install", "span_name", "uninstall"]

Decorate = Callable[[Callable[..., Any], str], Callable[..., Any]]

_PACKAGE = "flashinfer"
_API_MODULE = "flashinfer.api_logging"
_DECORATORS = {"flashinfer_api": False, "flashinfer_experimental_api": True}
# FlashInfer's own variable, read by FlashInfer at import; otel-gpu's settings live in config.py.
_FLASHINFER_LOGLEVEL = "FLASHINFER_LOGLEVEL"
_CHAIN_DEPTH = 8  # decorator layers followed through __wrapped__ when looking for closures
_EMPTY = object()


@dataclass(frozen=True)
class DecoratedApi:
    """One ``def`` in FlashInfer's source that carries ``@flashinfer_api``."""

    module: str
    qualname: str
    outer: tuple[str, ...]  # decorators applied on top of FlashInfer's, outermost first
    experimental: bool  # @flashinfer_experimental_api, which wraps @flashinfer_api once more


def span_name(qualname: str) -> str:
    """``flashinfer.<qualname>``: FlashInfer logs ``Class.method`` for its wrapper classes and
    the bare name for functions; the qualname gives both, fixed at decoration time."""
    return f"{_PACKAGE}.{qualname}"


def _decorator_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _scan(tree: ast.AST, module: str, prefix: str, out: list[DecoratedApi]) -> None:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            _scan(node, module, f"{prefix}{node.name}.", out)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [_decorator_name(d) for d in node.decorator_list]
            for i, name in enumerate(names):
                if name in _DECORATORS:
                    outer = tuple(n or "?" for n in names[:i])
                    out.append(DecoratedApi(module, prefix + node.name, outer, _DECORATORS[name]))
                    break
            # functions defined inside functions are not reachable from outside: not listed
        elif not isinstance(node, ast.Lambda):
            _scan(node, module, prefix, out)  # if/try blocks at module or class level


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """ast.parse allocates millions of nodes: with torch loaded, GC passes cost 5x the parse."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@functools.cache
def decorated_apis() -> tuple[DecoratedApi, ...]:
    """Every ``@flashinfer_api`` (or experimental) ``def`` in the installed FlashInfer, from its
    source; empty when FlashInfer is not installed. Does not import FlashInfer."""
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return ()
    if spec is None or not spec.submodule_search_locations:
        return ()
    found: list[DecoratedApi] = []
    for location in spec.submodule_search_locations:
        root = Path(location)
        for path in sorted(root.rglob("*.py")):
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if "flashinfer_api" not in source and "flashinfer_experimental_api" not in source:
                continue
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            try:
                with _no_gc():
                    tree = ast.parse(source, str(path))
            except (SyntaxError, ValueError):
                continue
            _scan(tree, ".".join((_PACKAGE, *parts)), "", found)
    return tuple(found)


def _nested_codes(fn: Any, name: str) -> frozenset[types.CodeType]:
    """Code objects called ``name`` defined (at any depth) inside ``fn``."""
    out: set[types.CodeType] = set()
    todo = [getattr(fn, "__code__", None)]
    while todo:
        code = todo.pop()
        if not isinstance(code, types.CodeType):
            continue
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                if const.co_name == name:
                    out.add(const)
                todo.append(const)
    return frozenset(out)


@dataclass(frozen=True)
class _Layers:
    """FlashInfer's wrapper functions, told apart by code object (wraps() copies the names)."""

    logging: frozenset[types.CodeType]
    auto_dump: frozenset[types.CodeType]
    experimental: frozenset[types.CodeType]

    @classmethod
    def of(cls, api_logging: types.ModuleType, decorator: Any) -> _Layers:
        return cls(
            _nested_codes(decorator, "wrapper"),
            _nested_codes(getattr(api_logging, "_attach_fi_trace", None), "_auto_dump_wrapper"),
            _nested_codes(getattr(api_logging, "flashinfer_experimental_api", None), "wrapper"),
        )

    def kind(self, fn: Any) -> str | None:
        code = getattr(fn, "__code__", None)
        if code in self.logging:
            return "logging"
        if code in self.auto_dump:
            return "auto_dump"
        if code in self.experimental:
            return "experimental"
        return None


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _rebind(fn: types.FunctionType, old: Any, new: Any) -> types.FunctionType:
    """A copy of ``fn`` whose closure holds ``new`` where it held ``old``; other cells shared."""
    cells = tuple(types.CellType(new) if _contents(c) is old else c for c in (fn.__closure__ or ()))
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    copy.__module__ = fn.__module__
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__wrapped__ = new  # type: ignore[attr-defined]
    return copy


def _strip(obj: Any, layers: _Layers) -> Any:
    """What ``@flashinfer_api`` would have returned at FlashInfer's level 0."""
    kind = layers.kind(obj)
    if kind == "logging":
        return obj.__wrapped__
    if kind == "auto_dump":
        inner: Any = getattr(obj, "__wrapped__", None)
        if layers.kind(inner) == "logging":
            return _rebind(obj, inner, inner.__wrapped__)
    return obj


def _locate(top: Any, api: DecoratedApi, layers: _Layers) -> Any:
    """The object ``@flashinfer_api`` returned, under the decorators applied on top of it."""
    obj = top
    for name in api.outer:
        if name in ("staticmethod", "classmethod") or layers.kind(obj) is not None:
            continue
        # a decorator without __wrapped__ returned its argument (register_custom_op does)
        obj = getattr(obj, "__wrapped__", obj)
    if api.experimental and layers.kind(obj) == "experimental":
        obj = getattr(obj, "__wrapped__", obj)
    return obj


# --- swapping references ------------------------------------------------------------------

Swap = dict[int, tuple[Any, Any]]  # id(old) -> (old, new); the tuple keeps both alive


@dataclass
class _Undo:
    kind: str  # "attr" (owner, key), "cell" (cell), "wrapped" (function's __wrapped__)
    where: Any
    key: str
    old: Any
    new: Any

    def revert(self) -> None:
        if self.kind == "attr":
            if vars(self.where).get(self.key) is self.new:
                setattr(self.where, self.key, self.old)
        elif self.kind == "cell":
            if _contents(self.where) is self.new:
                self.where.cell_contents = self.old
        elif self.where.__dict__.get("__wrapped__") is self.new:
            self.where.__wrapped__ = self.old


def _flashinfer_modules() -> list[types.ModuleType]:
    prefix = _PACKAGE + "."
    return [
        m
        for name, m in list(sys.modules.items())
        if isinstance(m, types.ModuleType) and (name == _PACKAGE or name.startswith(prefix))
    ]


def _replacement(value: Any, swap: Swap) -> Any:
    if isinstance(value, (staticmethod, classmethod)):
        pair = swap.get(id(value.__func__))
        if pair is not None and pair[0] is value.__func__:
            return type(value)(pair[1])
        return None
    pair = swap.get(id(value))
    return pair[1] if pair is not None and pair[0] is value else None


def _swap_cells(
    value: Any, swap: Swap, log: list[_Undo] | None, done: set[int], replacements: set[int]
) -> None:
    """Outer decorators (backend_requirement, experimental…) hold the API in a closure cell.

    ``replacements``: their ids. The walk down ``__wrapped__`` stops at one: a replacement
    wraps the very object it replaces, and swapping it inside its own closure makes it call
    itself (an outer decorator reached twice, through a re-export, leads there).
    """
    fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    for _ in range(_CHAIN_DEPTH):
        if not isinstance(fn, types.FunctionType):
            return
        # The next layer is read before this one is swapped: once ``__wrapped__`` points at our
        # wrapper, following it would swap our own wrapper's function for itself (a recursion).
        below = fn.__dict__.get("__wrapped__")
        for cell in fn.__closure__ or ():
            old = _contents(cell)
            pair = swap.get(id(old))
            if pair is None or pair[0] is not old:
                continue
            cell.cell_contents = pair[1]
            done.add(id(old))
            if log is not None:
                log.append(_Undo("cell", cell, "", old, pair[1]))
            if fn.__dict__.get("__wrapped__") is old:
                fn.__wrapped__ = pair[1]  # type: ignore[attr-defined]
                if log is not None:
                    log.append(_Undo("wrapped", fn, "", old, pair[1]))
                else:  # uninstall: drop what wraps() copied from ours and theirs lacks
                    copied = set(getattr(old, "__dict__", {})) - set(vars(pair[1]))
                    for key in copied - {"__wrapped__"}:
                        if fn.__dict__.get(key) is old.__dict__[key]:
                            del fn.__dict__[key]
        fn = below
        if fn is None or id(fn) in swap or id(fn) in replacements:
            return


def _swap_namespace(
    owner: Any,
    swap: Swap,
    log: list[_Undo] | None,
    done: set[int],
    seen: set[int],
    replacements: set[int],
) -> None:
    if id(owner) in seen:
        return
    seen.add(id(owner))
    try:
        items = list(vars(owner).items())
    except TypeError:
        return
    for key, value in items:
        if isinstance(value, type):
            module = getattr(value, "__module__", None)
            if isinstance(module, str) and (
                module == _PACKAGE or module.startswith(_PACKAGE + ".")
            ):
                _swap_namespace(value, swap, log, done, seen, replacements)
            continue
        new = _replacement(value, swap)
        if new is None:
            _swap_cells(value, swap, log, done, replacements)
            continue
        setattr(owner, key, new)
        old = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        done.add(id(old))
        if log is not None:
            log.append(_Undo("attr", owner, key, value, new))


def _swap(swap: Swap, log: list[_Undo] | None) -> set[int]:
    """Replace each old object by its new one wherever FlashInfer refers to it; ids swapped."""
    done: set[int] = set()
    seen: set[int] = set()
    replacements = {id(pair[1]) for pair in swap.values()}
    if swap:
        for module in _flashinfer_modules():
            _swap_namespace(module, swap, log, done, seen, replacements)
    return done


# --- the target ---------------------------------------------------------------------------


@dataclass
class _State:
    decorate: Decorate
    finder: _Finder | None = None
    original: Any = None  # FlashInfer's flashinfer_api
    ours: Any = None  # the decorator that replaced it
    layers: _Layers | None = None
    undo: list[_Undo] = field(default_factory=list)
    made: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # by our decorator
    patched: int = 0  # APIs already loaded at install that now make spans
    unreached: list[DecoratedApi] = field(default_factory=list)

    def route(self, theirs: Any, name: str) -> Any:
        """Ours for FlashInfer's decorated ``theirs``; ``theirs`` itself if anything fails."""
        try:
            assert self.layers is not None
            inner = _strip(theirs, self.layers)
            ours = self.decorate(inner, name)
            if ours is not inner and ours is not theirs:
                for attr in ("fi_trace", "fi_init"):  # set on the logging wrapper at level > 0
                    if hasattr(theirs, attr) and not hasattr(ours, attr):
                        setattr(ours, attr, getattr(theirs, attr))
            return ours
        except Exception as exc:
            _guard.internal_error("flashinfer", exc)
            return theirs

    def route_module(self, api_logging: types.ModuleType) -> None:
        """Make ``api_logging.flashinfer_api`` ours; later ``from .api_logging import`` get it."""
        original = getattr(api_logging, "flashinfer_api", None)
        if original is None or self.ours is not None:
            return
        self.original = original
        self.layers = _Layers.of(api_logging, original)
        made = self.made

        def flashinfer_api(func: Any = None, **options: Any) -> Any:
            def decorator(f: Any) -> Any:
                theirs = original(f, **options)
                qualname = str(getattr(f, "__qualname__", None) or getattr(f, "__name__", f))
                ours = self.route(theirs, span_name(qualname))
                if ours is not theirs:
                    made[id(ours)] = (ours, theirs)
                return ours

            return decorator if func is None else decorator(func)

        functools.update_wrapper(flashinfer_api, original)
        self.ours = flashinfer_api
        api_logging.flashinfer_api = flashinfer_api  # type: ignore[attr-defined]
        self.undo.append(_Undo("attr", api_logging, "flashinfer_api", original, flashinfer_api))

    def patch_loaded(self) -> None:
        """Swap in ours for every decorated API whose module is already imported."""
        assert self.layers is not None
        swap: Swap = {}
        targets: list[tuple[DecoratedApi, int]] = []
        for api in decorated_apis():
            module = sys.modules.get(api.module)
            if module is None:
                continue
            owner: Any = module
            for part in api.qualname.split(".")[:-1]:
                owner = vars(owner).get(part) if hasattr(owner, "__dict__") else None
            raw = vars(owner).get(api.qualname.rsplit(".", 1)[-1]) if owner is not None else None
            if raw is None:
                continue  # defined under a condition that did not hold
            top = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            theirs = _locate(top, api, self.layers)
            if id(theirs) in self.made or id(theirs) in swap:
                continue  # already ours (imported after install) or listed twice
            ours = self.route(theirs, span_name(api.qualname))
            if ours is not theirs:
                swap[id(theirs)] = (theirs, ours)
                targets.append((api, id(theirs)))
        done = _swap(swap, self.undo)
        self.patched = sum(1 for _, key in targets if key in done)
        self.unreached = [api for api, key in targets if key not in done]


def _flashinfer_level_zero() -> Any:
    """FlashInfer reads its level at import: show it 0, so it neither wraps nor prints."""
    from otel_gpu import config

    return config.another_library_setting(_FLASHINFER_LOGLEVEL, "0")


class _Loader(importlib.abc.Loader):
    """Runs FlashInfer's own loader, then routes ``api_logging`` before anyone imports from it."""

    def __init__(self, inner: Any, state: _State) -> None:
        self._inner = inner
        self._state = state

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: FlashInfer's own
        return getattr(self._inner, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            with _flashinfer_level_zero():
                self._inner.exec_module(module)
        finally:
            module.__loader__ = self._inner
            if module.__spec__ is not None:
                module.__spec__.loader = self._inner
        if module.__name__ == _API_MODULE and _state is self._state:
            with _lock:
                self._state.route_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Import hook for ``flashinfer`` and ``flashinfer.api_logging`` only."""

    def __init__(self, state: _State) -> None:
        self._state = state

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in (_PACKAGE, _API_MODULE):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self._state)
                return spec
        return None


_lock = threading.RLock()
_state: _State | None = None


def install(decorate: Decorate) -> None:
    """Route ``@flashinfer_api`` to ``decorate(fn, span_name)``. A second call does nothing."""
    global _state
    with _lock:
        if _state is not None:
            return
        state = _State(decorate)
        _state = state
        api_logging = sys.modules.get(_API_MODULE)
        if api_logging is None:
            state.finder = _Finder(state)
            sys.meta_path.insert(0, state.finder)
            return
        try:
            state.route_module(api_logging)
            if state.layers is not None:
                state.patch_loaded()
        except Exception as exc:  # half a target is worse than none: put everything back
            uninstall()
            _guard.internal_error("flashinfer", exc)


def uninstall() -> None:
    """Put back every object :func:`install` replaced. Does nothing when not installed."""
    global _state
    with _lock:
        state, _state = _state, None
        if state is None:
            return
        if state.finder is not None and state.finder in sys.meta_path:
            sys.meta_path.remove(state.finder)
        for undo in reversed(state.undo):
            undo.revert()
        # What our decorator made while modules were imported: found wherever it ended up.
        swap: Swap = {key: pair for key, pair in state.made.items()}
        if state.ours is not None:
            swap[id(state.ours)] = (state.ours, state.original)
        _swap(swap, None)
