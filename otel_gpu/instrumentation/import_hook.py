"""The post-import hook behind string targets: a module that a pending target names is handed
to :mod:`otel_gpu.instrumentation.targets` once it has executed, whatever the order of imports.

The hook wraps the loader of such modules (and of the gates, torch and otel-gpu's wrapper
module, while any target is pending). A module executed while a gate or its own package is
still initialising waits for it: instrumenting it then would import a half-initialised torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ["install", "remove"]


def _nothing_wanted(modname: str) -> bool:
    return False


def _nothing_pending() -> bool:
    return False


def _ignore(module: types.ModuleType) -> None:
    return None


# set by install(): which modules a pending target names, whether any target is pending, and
# what to do with a module once executed
_wanted: Callable[[str], bool] = _nothing_wanted
_pending: Callable[[], bool] = _nothing_pending
_on_import: Callable[[types.ModuleType], None] = _ignore


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of modules a pending target names, to instrument them once executed."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if getattr(self._busy, "on", False):
            return None
        if not _wanted(fullname) and not (fullname in _GATES and _pending()):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        name = module.__name__
        if _gates_busy(name):
            # imported while torch or otel-gpu's wrapper module is still initialising (torch
            # imports its dependencies from its __init__): building a wrapper now would import
            # a half-initialised torch, which can crash. It waits for the gate to finish.
            if name not in _GATES:
                _waiting.append(name)
            return
        waiting, _waiting[:] = list(_waiting), []
        for other in waiting:
            if other in sys.modules:
                _deliver(sys.modules[other])
        if name in _GATES and not _wanted(name):
            return
        _deliver(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, …
        return getattr(self.loader, name)


_GATES = ("torch", "otel_gpu.calls.decorator")
"""Modules whose loader is wrapped whenever a target is pending: a module imported while one
of them initialises is instrumented once it has finished."""
_waiting: list[str] = []


def _gates_busy(name: str) -> bool:
    """Whether a gate other than ``name`` is still initialising (its own flag stays set until
    its loader returns)."""
    return any(_initializing(gate) for gate in _GATES if gate != name)


def _deliver(module: types.ModuleType) -> None:
    """Instrument a freshly executed module, or defer it to its still-initialising package."""
    name = module.__name__
    top = name.partition(".")[0]
    if top != name and _initializing(top) and _wanted(top):
        # imported by its own package's __init__ (torch imports torch.distributed): wrapping
        # now would import otel-gpu's torch-using modules from a half-initialised torch, so
        # it waits for the package, whose loader is wrapped too (_wanted(top)).
        _deferred.append(name)
        return
    if top == name and _deferred:
        for sub in _take_deferred(top):
            _on_import(sub)
    _on_import(module)


_deferred: list[str] = []
"""Modules executed while their top-level package was still initialising, in import order."""


def _initializing(top: str) -> bool:
    module = sys.modules.get(top)
    return module is not None and bool(getattr(module.__spec__, "_initializing", False))


def _take_deferred(top: str) -> list[types.ModuleType]:
    names = [n for n in _deferred if n.partition(".")[0] == top]
    _deferred[:] = [n for n in _deferred if n.partition(".")[0] != top]
    return [sys.modules[n] for n in names if n in sys.modules]


_finder: _PostImportFinder | None = None


def install(
    wanted: Callable[[str], bool],
    pending: Callable[[], bool],
    on_import: Callable[[types.ModuleType], None],
) -> None:
    """Put the hook first on ``sys.meta_path`` (once): modules ``wanted`` names go to
    ``on_import`` when executed; ``pending`` says whether any target waits at all."""
    global _finder, _wanted, _pending, _on_import
    _wanted, _pending, _on_import = wanted, pending, on_import
    if _finder is None:
        _finder = _PostImportFinder()
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def remove() -> None:
    """Take the hook off ``sys.meta_path`` and forget the modules it was holding back (tests)."""
    _deferred.clear()
    _waiting.clear()
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
