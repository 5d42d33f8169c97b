"""What a dump may name, and how replay resolves it: the denylist, the allow list, types, functions.

Everything a manifest names is treated as untrusted. A type reference resolves only to a class,
from a module the :class:`Allow` list admits (a module being imported already allows nothing),
and never from the :data:`DENIED` machinery of processes, files and imports; a function only to
one that carries otel-gpu's decorator.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from otel_gpu.recorder import manifest as _manifest

__all__ = [
    "DENIED",
    "VALUE_TYPES",
    "Allow",
    "Refused",
    "Skip",
    "denied",
    "denied_text",
    "resolve_function",
    "resolve_type",
]


class Skip(Exception):
    """The call cannot be replayed here; the message says why (verdict ``skipped``)."""


class Refused(Exception):
    """The dump asks for something replay will not do (verdict ``error``)."""


DENIED: frozenset[str] = frozenset(
    {
        # processes, shells and signals
        "os", "posix", "nt", "posixpath", "ntpath", "genericpath", "subprocess",
        "_posixsubprocess", "pty", "tty", "signal", "_signal", "multiprocessing",
        "_multiprocessing", "concurrent", "asyncio", "threading", "_thread", "platform",
        # files
        "io", "_io", "pathlib", "shutil", "tempfile", "fileinput", "glob", "shelve", "dbm",
        "sqlite3", "zipfile", "tarfile", "mmap", "fcntl", "resource",
        # loading and running code
        "builtins", "importlib", "imp", "pkgutil", "zipimport", "runpy", "code", "codeop",
        "compileall", "py_compile", "pickle", "_pickle", "pickletools", "copyreg", "marshal",
        "ctypes", "_ctypes", "sys", "gc", "types", "inspect", "ast", "dis", "timeit", "pdb",
        "bdb", "trace", "cProfile", "profile", "doctest", "unittest", "site", "sysconfig",
        # the network
        "socket", "_socket", "ssl", "select", "selectors", "socketserver", "http", "urllib",
        "ftplib", "smtplib", "poplib", "imaplib", "xmlrpc", "webbrowser",
        # torch's own loaders and writers of files, code and pickles
        "torch.load", "torch.save", "torch.serialization", "torch.hub", "torch.package",
        "torch.utils.cpp_extension", "torch.jit.load", "torch.jit.save",
        "torch.jit._serialization", "torch.ops.load_library", "torch._ops._Ops.load_library",
        "torch.classes.load_library", "torch.distributed.rpc",
    }
)  # fmt: skip
"""Dotted names (and everything below them) that no dump and no flag can make replay import,
resolve, instrument or call: the standard library's process, shell, file, import and network
machinery, and torch's loaders. The rule is the allow-list; this is the floor under it."""

_DOCS = "see 'Threat model' in docs/flight-recorder.md"


def denied(name: str) -> str | None:
    """The :data:`DENIED` entry covering ``name`` (``pkg.mod``, ``pkg.mod:Qual.name``), else None."""
    parts = name.replace(":", ".").split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in DENIED:
            return prefix
    return None


def denied_text(what: str, entry: str) -> str:
    return (
        f"refused: {what} is in {entry!r}, which replay never imports, resolves or calls "
        f"from a dump, whatever the flags ({_DOCS})"
    )


class Allow:
    """Module prefixes replay may import: ``pkg`` admits ``pkg`` and ``pkg.sub``.

    ``instrument``: the ``otel_gpu.instrument()`` targets replay may apply again to find a call
    recorded through them (``any_instrument``: every target a dump names, for dumps you made).
    Instrumenting turns any function into one replay would call, so a dump cannot choose it.
    A prefix on :data:`DENIED` is a ``ValueError``: no flag lifts the denylist.
    """

    def __init__(
        self,
        prefixes: tuple[str, ...] | list[str] = (),
        instrument: tuple[str, ...] | list[str] = (),
        any_instrument: bool = False,
    ) -> None:
        self.prefixes = tuple(p.strip() for p in prefixes if p.strip())
        self.instrument = tuple(t.strip() for t in instrument if t.strip())
        self.any_instrument = any_instrument
        for prefix in self.prefixes:
            entry = denied(prefix)
            if entry is not None:
                raise ValueError(
                    f"module {prefix!r} cannot be allowed: {entry!r} is on replay's denylist "
                    f"(process, shell, file, import and network machinery; {_DOCS})"
                )

    def __call__(self, module: str) -> bool:
        if denied(module) is not None:
            return False
        return any(module == p or module.startswith(p + ".") for p in self.prefixes)

    def instrumentation(self, spec: str) -> bool:
        return self.any_instrument or spec in self.instrument


VALUE_TYPES: dict[str, type] = {
    _manifest.type_ref(tp): tp
    for tp in (
        bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset,
        collections.OrderedDict, collections.defaultdict, collections.Counter,
        torch.Tensor, torch.dtype, torch.device, torch.Size,
    )
}  # fmt: skip
"""Plain value types a dump may name without any module allowed: atoms, containers, torch's."""


def resolve_type(ref: Any, allow: Allow) -> type:
    """The class named ``module:Qualname``, from an allowed module, never a denied one.

    The qualname is walked with static attribute lookups on modules and classes only (no
    ``__getattr__``, no property runs), and what it names must be a class: a dump names
    data types, never functions. A module being imported already allows nothing.
    """
    if not isinstance(ref, str):
        raise Refused(
            f"refused: a type must be written 'module:Qualname', not {type(ref).__name__}"
        )
    fixed = VALUE_TYPES.get(ref)
    if fixed is not None:
        return fixed
    module, colon, qualname = ref.partition(":")
    if not (colon and module and qualname):
        raise Refused(f"refused: type {ref!r} is not written 'module:Qualname'")
    _admit(allow, module, denied(f"{module}.{qualname}"), f"type {ref}", f"type {ref} is from")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        if part.startswith("__") or not isinstance(obj, (types.ModuleType, type)):
            raise Refused(f"refused: type {ref} is not a class (a dump names only classes)")
        obj = inspect.getattr_static(obj, part, None)
        if obj is None:
            raise Skip(f"type {ref} does not exist in this process (no {part!r} in its path)")
    if not isinstance(obj, type):
        raise Refused(f"refused: type {ref} is not a class (a dump names only classes)")
    home = str(type.__dict__["__module__"].__get__(obj, type(obj)))
    _admit(allow, home, None, f"type {ref} (defined in {home})", f"type {ref} is defined in")
    return obj


def _admit(allow: Allow, module: str, entry: str | None, what: str, skipped: str) -> None:
    """Refused naming ``what`` when ``module`` (or ``entry``, a denylist entry found already) is
    denied; Skip (``<skipped> module M, which is not allowed``) when the allow list does not
    admit it."""
    entry = denied(module) or entry
    if entry is not None:
        raise Refused(denied_text(what, entry))
    if not allow(module):
        raise Skip(
            f"{skipped} module {module!r}, which is not allowed (pass --allow-module {module})"
        )


def _check_target(spec: str) -> None:
    """Refuse an ``instrument()`` target on the denylist, or a glob with no module to anchor it."""
    entry = denied(spec)
    if entry is not None:
        raise Refused(denied_text(f"instrumentation target {spec!r}", entry))
    dotted = spec.replace(":", ".")
    literal = dotted.split("*")[0].split("?")[0].split("[")[0]
    if literal != dotted and "." not in literal:  # "*", "o*": every imported module, os included
        raise Refused(
            f"refused: instrumentation target {spec!r} is a pattern with no package before it "
            "(replay applies a pattern only below a named package, such as 'pkg.*')"
        )
    entry = denied(literal.rstrip(".")) if literal != dotted else None
    if entry is not None:
        raise Refused(denied_text(f"instrumentation target {spec!r}", entry))


def resolve_function(info: dict[str, Any], allow: Allow) -> tuple[Callable[..., Any], type | None]:
    """The undecorated function recorded in ``info`` and the class that defines it, if any."""
    module, qualname = info.get("module") or "", info.get("qualname") or ""
    if not module or not qualname:
        raise Skip("the manifest names no function (its module or qualname is missing)")
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise Refused("refused: the manifest's function module and qualname must be strings")
    entry = denied(module) or denied(f"{module}.{qualname}")
    if entry is not None:
        raise Refused(denied_text(f"function {module}.{qualname}", entry))
    if not allow(module):
        raise Skip(f"module {module!r} is not allowed (pass --allow-module {module})")
    spec = info.get("instrumented")
    if spec:  # recorded through otel_gpu.instrument(): instrument it again, the same way
        spec = str(spec)
        _check_target(spec)
        if not allow.instrumentation(spec):
            raise Skip(
                f"{module}.{qualname} was recorded through otel_gpu.instrument({spec!r}); replay "
                f"instruments code again only for targets you name: pass --instrument {spec} (or "
                "set OTEL_GPU_INSTRUMENT), or --trust-dump for dumps you made"
            )
        from otel_gpu.instrumentation.targets import instrument

        instrument(spec)
    obj: Any = _import(module)
    owner: Any = None
    for part in qualname.split("."):
        if not part.isidentifier() or part.startswith("__"):
            raise Refused(
                f"refused: function {module}.{qualname}: {part!r} is not a plain attribute name "
                "(a dump names a function by its module and a path of plain names)"
            )
        _admit_step(obj, allow, f"{module}.{qualname}")
        owner, obj = obj, inspect.getattr_static(obj, part, _MISSING)
        if obj is _MISSING:
            raise Skip(f"{module}.{qualname} does not exist in this process (no {part!r})")
    wrapper = None
    current = getattr(obj, "__func__", obj)
    while current is not None:  # the innermost carrier of the marker is otel-gpu's own wrapper
        if "__otel_gpu_plan__" in getattr(current, "__dict__", {}):
            wrapper = current
        current = getattr(current, "__wrapped__", None)
    if wrapper is None:
        raise Refused(
            f"refused: {module}.{qualname} is not an @otel_gpu.api function in this process "
            "(replay calls only decorated functions; was the module imported at level 0?)"
        )
    fn = wrapper.__wrapped__
    # the function's home as the decorator found it (its plan): the module that defines it,
    # whatever name an allowed module gives it, and whatever wrappers sit inside
    plan = wrapper.__dict__["__otel_gpu_plan__"]
    home = getattr(plan, "module", None)
    home = home if isinstance(home, str) else "?"
    where = f"{home}.{getattr(plan, 'qualname', '')}"
    _admit(
        allow,
        home,
        denied(where)
        or denied(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"),
        f"function {module}.{qualname} (defined as {where})",
        f"function {module}.{qualname} is defined in",
    )
    if not isinstance(owner, type):
        return fn, None
    if not _defined_in(plan, owner):
        raise Refused(
            f"refused: {module}.{qualname} is not a method of {owner.__qualname__} "
            "(replay gives a receiver only to a method of the class that defines it)"
        )
    return fn, owner


_MISSING = object()


def _import(module: str) -> Any:
    """The allowed ``module``, imported; Skip when it cannot be found on the import path."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            raise  # a module it imports is missing: an error of the module itself
        raise Skip(
            f"module {module!r} is not on the import path (replay never imports from the current "
            "directory or the dump: name the folder of your modules with --path DIR or "
            "PYTHONPATH)"
        ) from None


def _admit_step(obj: Any, allow: Allow, name: str) -> None:
    """A step of a function's path must be a module or a class, from an allowed module."""
    if isinstance(obj, types.ModuleType):
        home = obj.__name__
    elif isinstance(obj, type):
        home = str(type.__dict__["__module__"].__get__(obj, type(obj)))
    else:
        raise Refused(
            f"refused: function {name}: its path goes through a {type(obj).__name__}, not a "
            "module or a class"
        )
    _admit(allow, home, None, f"function {name} (through {home})", f"function {name} is found in")


def _defined_in(plan: Any, owner: type) -> bool:
    """Whether the decorated function is defined in ``owner`` or one of its bases (as its
    plan's qualname says)."""
    where = str(getattr(plan, "qualname", "")).rpartition(".")[0]
    module = getattr(plan, "module", None)
    for cls in owner.__mro__:
        cls_module = type.__dict__["__module__"].__get__(cls, type(cls))
        if type.__dict__["__qualname__"].__get__(cls, type(cls)) == where and cls_module == module:
            return True
    return False
