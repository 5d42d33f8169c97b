"""``otel_gpu.instrument()``: spans for code you do not own, without editing it.

A target is a module (its public functions and the public methods of its public classes), a
class, a function or method, or a dotted path string. A string whose module is not imported yet
is instrumented when it is first imported (a post-import hook), so the order of imports does
not matter; glob patterns (``transformers.models.*.modeling_*``) match module names.

Patching replaces the attribute in its owner (module or class) with ``@otel_gpu.api``'s wrapper,
named after the library's own ``module.qualname``; other modules that imported the same object
under the same top-level package are patched too. Instrumenting twice never wraps twice, and
:func:`uninstrument` puts back exactly the objects that were there. At level 0 nothing is
patched at all, unless the process is controllable (``OTEL_GPU_CONTROL=on``, triggers): then
every target gets an armed trampoline at level 0 that live control can raise (calls/armed.py).
``OTEL_GPU_INSTRUMENT`` lists targets for :func:`instrument_from_settings`, which
``otel-gpu run`` and the ``opentelemetry-instrument`` entry point call.
"""

from __future__ import annotations

import atexit
import fnmatch
import inspect
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from otel_gpu import _guard, config
from otel_gpu.instrumentation import import_hook
from otel_gpu.instrumentation.refused import RefusedTarget, refusal, refused_module

__all__ = [
    "applied_how",
    "apply_settings",
    "decorate",
    "instrument",
    "instrument_from_settings",
    "instrumented",
    "never_imported",
    "report_at_exit",
    "uninstrument",
]

_GLOB = set("*?[")
_lock = threading.RLock()
# (id(owner), attribute) -> (owner, attribute, original object, spec)
_patches: dict[tuple[int, str], tuple[Any, str, Any, str]] = {}
# pending string targets: spec -> (include, exclude, name)
_pending: dict[str, tuple[tuple[str, ...], tuple[str, ...], str | None]] = {}
_special: dict[str, Callable[[], None]] = {}  # targets with their own routing (flashinfer)
# spec -> the wrapper factory of a target that patches with its own wrapper (torch.distributed)
_wrappers: dict[str, Callable[[Any], Any]] = {}
_matched_globs: set[str] = set()  # glob targets that matched at least one imported module
# the process that warns at exit about targets never imported (None: none, e.g. a run helper)
_report_pid: int | None = os.getpid()
_exit_hook = False
# OTEL_GPU_INSTRUMENT: the targets applied in this process, and by what (apply_settings)
_applied: set[str] = set()
_applied_how: str | None = None
_seen_settings: config.Settings | None = None


def instrument(
    target: Any,
    *,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
    name: str | None = None,
) -> list[str]:
    """Turn the calls of ``target`` into spans, at the level in force. Returns what was patched.

    ``target``: a module, a class, a function or method, or a dotted path string (``"pkg.mod"``,
    ``"pkg.mod.Class.method"``, ``"pkg.*"``), instrumented now if imported, else on import.
    ``include``/``exclude``: fnmatch patterns on ``module.qualname`` of each function found.
    ``name``: the span name, for a single function target only.
    """
    settings = config.current()
    if settings.level == 0 and not settings.controllable:
        return []  # level 0 stays free: nothing is patched (armed: trampolines control swaps)
    apply_settings(settings)
    inc, exc = _patterns(include), _patterns(exclude)
    spec = target.strip() if isinstance(target, str) else _spec_of(target)
    why = refusal(spec)
    if why is not None:
        raise RefusedTarget(why)
    with _lock:
        if isinstance(target, str):
            return _instrument_spec(spec, inc, exc, name)
        return _apply(target, spec, inc, exc, name)


def uninstrument(target: Any = None) -> int:
    """Restore what :func:`instrument` patched for ``target`` (everything when None). Returns the count."""
    with _lock:
        if target is None:
            specs = None
        elif isinstance(target, str):
            specs = {target.strip()}
            _pending.pop(target.strip(), None)
            _matched_globs.discard(target.strip())
        else:
            specs = {_spec_of(target)}
        if target is None:
            _pending.clear()
            _matched_globs.clear()
            _applied.clear()  # instrument_from_settings() applies them again
        restored = 0
        for key, (owner, attr, original, spec) in list(_patches.items()):
            if specs is None or spec in specs or any(_spec_covers(s, spec) for s in specs):
                try:
                    setattr(owner, attr, original)
                except (AttributeError, TypeError):
                    continue
                del _patches[key]
                restored += 1
        for spec_name, undo in list(_special.items()):
            if specs is None or spec_name in specs:
                undo()
                del _special[spec_name]
        return restored


def instrumented() -> list[str]:
    """``module.qualname`` of every function currently patched, and the pending targets."""
    with _lock:
        done = sorted(f"{_owner_name(o)}.{a}" for o, a, _, _ in _patches.values())
        return done + [f"{spec} (on import)" for spec in sorted(_pending)]


def never_imported() -> list[str]:
    """Targets still waiting for their module, for which nothing was instrumented: a dotted path
    whose module was never imported, a glob that matched no imported module."""
    with _lock:
        return sorted(s for s in _pending if not (_GLOB & set(s)) or s not in _matched_globs)


def report_at_exit(enabled: bool) -> None:
    """Whether this process warns at exit about :func:`never_imported` targets (it does by default).

    ``otel-gpu run``'s bootstrap turns it off in the Python processes the program starts: a
    compile worker that never imports the model is not news.
    """
    global _report_pid
    _report_pid = os.getpid() if enabled else None


def _warn_never_imported() -> None:
    """At exit: one line naming the targets that instrumented nothing, so a typo is not silent."""
    if _report_pid != os.getpid():  # a forked child exiting normally: its parent reports
        return
    names = never_imported()
    if not names:
        return
    listed = ", ".join(repr(n) for n in names)
    one = len(names) == 1
    _guard.warn_once(
        "instrument.never_imported",
        "otel-gpu: instrument target%s %s %s never imported in this process; nothing was "
        "instrumented for %s",
        "" if one else "s",
        listed,
        "was" if one else "were",
        "it" if one else "them",
    )


def _ensure_exit_report() -> None:
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_warn_never_imported)


def instrument_from_settings(
    settings: config.Settings | None = None, *, via: str = "otel_gpu.instrument_from_settings()"
) -> list[str]:
    """Instrument every target of ``OTEL_GPU_INSTRUMENT`` (comma-separated; globs allowed).

    ``via`` names what applied them, for ``otel-gpu info`` (``otel-gpu run``,
    ``opentelemetry-instrument``)."""
    global _applied_how, _seen_settings
    settings = settings or config.current()
    if settings.level == 0 and not settings.controllable:
        return []
    with _lock:
        if settings is not _seen_settings:
            _start_live(settings)
        _seen_settings = settings  # apply_settings() has nothing left to do for these
        specs = [s for s in settings.instrument if s not in _applied]
        _applied.update(specs)
        if specs and _applied_how is None:
            _applied_how = via
    # under otel-gpu run, the command itself said which targets are refused
    return _apply_targets(specs, refusals_said=via == "otel-gpu run")


_OPAMP = "otel_gpu.control.opamp"


def _start_live(settings: config.Settings) -> None:
    """At otel-gpu's first configuration with ``settings``, however it comes (a decorated
    function, ``configure()``, ``otel-gpu run``, ``opentelemetry-instrument``): live control's
    listener where ``OTEL_GPU_CONTROL=on``, and the OpAMP agent where an endpoint is set."""
    if settings.control == "on":  # live control listens from the first decorated function
        from otel_gpu.control import channel  # imported only where control is on

        channel.start(settings)
    if settings.opamp_endpoint or _OPAMP in sys.modules:  # start, or stop (configure())
        from otel_gpu.control import opamp  # imported only where an endpoint is set

        opamp.start_soon(settings)  # the fleet's server, on a thread of its own


def apply_settings(settings: config.Settings) -> None:
    """``OTEL_GPU_INSTRUMENT`` in a process that neither ``otel-gpu run`` nor
    ``opentelemetry-instrument`` started: its targets are applied when otel-gpu is first
    configured (the first ``@otel_gpu.api`` decoration, ``configure()``, ``instrument()``).

    With ``OTEL_GPU_CONTROL=on`` it also starts live control's listener, and with
    ``OTEL_GPU_OPAMP_ENDPOINT`` the OpAMP agent (docs/control.md).

    Decided once per settings object: later decorations cost one identity test."""
    global _applied_how, _seen_settings
    if settings is _seen_settings:
        return
    with _lock:
        if settings is _seen_settings:
            return
        _seen_settings = settings
        _start_live(settings)
        if settings.level == 0 and not settings.controllable:
            return
        specs = [s for s in settings.instrument if s not in _applied]
        if not specs:
            return
        _applied.update(specs)
        if _applied_how is None:
            _applied_how = "first configuration"
        early = [s for s in specs if _split_imported(s)[0] is not None]
    _apply_targets(specs)
    if early:
        _guard.logger.info(
            "otel-gpu: OTEL_GPU_INSTRUMENT applied at otel-gpu's first configuration in this "
            "process, after %s was imported: names bound earlier with `from ... import` keep "
            "the originals; `otel-gpu run` or `opentelemetry-instrument` apply it at start-up",
            ", ".join(repr(s) for s in early),
        )


def applied_how() -> str | None:
    """What applied ``OTEL_GPU_INSTRUMENT`` in this process (``otel-gpu run``,
    ``opentelemetry-instrument``, ``first configuration``…), or None: not applied (yet)."""
    return _applied_how


def _apply_targets(specs: Iterable[str], refusals_said: bool = False) -> list[str]:
    done: list[str] = []
    for spec in specs:
        try:
            done += instrument(spec)
        except RefusedTarget as exc:  # one line naming the target, why and what is allowed
            if refusals_said:
                _guard.logger.debug("otel-gpu: OTEL_GPU_INSTRUMENT %s", exc)
            else:
                _guard.warn_once(f"instrument.{spec}", "otel-gpu: OTEL_GPU_INSTRUMENT %s", exc)
        except Exception as exc:  # one bad target must not stop the program or the others
            _guard.warn_once(
                f"instrument.{spec}",
                "otel-gpu: OTEL_GPU_INSTRUMENT target %r could not be instrumented: %s: %s",
                spec,
                type(exc).__name__,
                exc,
            )
    return done


# --------------------------------------------------------------------------- resolution


def _patterns(value: Sequence[str] | str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    return tuple(v.strip() for v in value if v.strip())


def _instrument_spec(
    spec: str, inc: tuple[str, ...], exc: tuple[str, ...], name: str | None
) -> list[str]:
    if not spec:
        raise ValueError("empty instrumentation target")
    special = _special_target(spec)
    if special is not None:
        return special
    if _GLOB & set(spec):
        done: list[str] = []
        for modname in sorted(sys.modules):
            module = sys.modules.get(modname)
            if (
                module is not None
                and fnmatch.fnmatchcase(modname, spec)
                and refused_module(modname) is None
            ):
                _matched_globs.add(spec)
                done += _apply(module, spec, inc, exc, None)
        _pending[spec] = (inc, exc, name)
        _ensure_hook()
        _ensure_exit_report()
        return done
    module_name, attr_path = _split_imported(spec)
    if module_name is None:  # not imported yet: on import, so import order does not matter
        _pending[spec] = (inc, exc, name)
        _ensure_hook()
        _ensure_exit_report()
        return []
    obj: Any = sys.modules[module_name]
    owner: Any = None
    for part in attr_path:
        owner, obj = obj, getattr(obj, part, _MISSING)
        if obj is _MISSING:
            raise ValueError(
                f"{spec!r}: module {module_name!r} has no attribute {'.'.join(attr_path)!r}"
            )
    if owner is not None and not isinstance(obj, (type, types.ModuleType)):
        return _patch(owner, attr_path[-1], spec, name)
    return _apply(obj, spec, inc, exc, name)


_MISSING = object()


def _split_imported(spec: str) -> tuple[str | None, list[str]]:
    """The longest imported module prefix of ``spec`` and the attribute path after it."""
    parts = spec.replace(":", ".").split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in sys.modules:
            return ".".join(parts[:i]), parts[i:]
    return None, parts


def _spec_of(target: Any) -> str:
    if isinstance(target, types.ModuleType):
        return target.__name__
    fn = getattr(target, "__func__", target)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def _spec_covers(spec: str, patched_spec: str) -> bool:
    return patched_spec == spec or patched_spec.startswith(spec + ".")


def _owner_name(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    return f"{owner.__module__}.{owner.__qualname__}"


def _special_target(spec: str) -> list[str] | None:
    """Targets that route a library's own decorator to ours instead of patching attributes."""
    if spec == "torch.distributed":
        return _torch_distributed()
    if spec == "transformers.continuous_batching":
        from otel_gpu.instrumentation import transformers_cb

        done = transformers_cb.install(lambda fn, span_name: _wrap(fn, span_name, spec))
        _special[spec] = transformers_cb.uninstall
        return done
    if spec != "flashinfer":
        return None
    from otel_gpu.instrumentation import flashinfer

    flashinfer.install(lambda fn, span_name: _wrap(fn, span_name, "flashinfer"))
    _special["flashinfer"] = flashinfer.uninstall
    return ["flashinfer (its @flashinfer_api decorator)"]


def _torch_distributed() -> list[str]:
    """The collectives, patched with their own wrapper (instrumentation/torch_distributed.py)."""
    from otel_gpu.instrumentation import torch_distributed

    specs: list[str] = []

    def register(spec: str, span_name: str, make: Callable[[Any], Any]) -> list[str]:
        _wrappers[spec] = make
        specs.append(spec)
        return _instrument_spec(spec, (), (), span_name)

    done = torch_distributed.install(register)

    def undo() -> None:
        for spec in specs:
            _pending.pop(spec, None)
            _wrappers.pop(spec, None)

    _special["torch.distributed"] = undo
    if not done and any(spec in _pending for spec in specs):
        return ["torch.distributed (on import)"]
    return done


# --------------------------------------------------------------------------- patching


def _apply(
    target: Any, spec: str, inc: tuple[str, ...], exc: tuple[str, ...], name: str | None
) -> list[str]:
    if isinstance(target, types.ModuleType):
        done: list[str] = []
        for attr, value in list(vars(target).items()):
            if attr.startswith("_"):
                continue
            # type(), not isinstance(): an object that warns on attribute access (torch's
            # deprecated torch.distributed.reduce_op) is not asked for its __class__
            kind = type(value)
            if kind is types.FunctionType and value.__module__ == target.__name__:
                if _selected(f"{target.__name__}.{value.__qualname__}", inc, exc):
                    done += _patch(target, attr, spec, None)
            elif issubclass(kind, type) and value.__module__ == target.__name__:
                done += _apply_class(value, spec, inc, exc)
        return done
    if isinstance(target, type):
        return _apply_class(target, spec, inc, exc)
    fn = getattr(target, "__func__", target)
    owner_name, _, attr = getattr(fn, "__qualname__", "").rpartition(".")
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    owner: Any = module
    for part in owner_name.split(".") if owner_name else ():
        owner = getattr(owner, part, None)
    if owner is None or "<locals>" in owner_name or getattr(owner, attr, None) is None:
        raise ValueError(
            f"cannot instrument {target!r}: it is not reachable by its import path "
            f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}; "
            "decorate it with @otel_gpu.api, or pass the object that holds it"
        )
    return _patch(owner, attr, spec, name)


def _apply_class(cls: type, spec: str, inc: tuple[str, ...], exc: tuple[str, ...]) -> list[str]:
    done: list[str] = []
    for attr, value in list(vars(cls).items()):
        if attr.startswith("_"):
            continue
        fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if inspect.isfunction(fn) and _selected(f"{cls.__module__}.{fn.__qualname__}", inc, exc):
            done += _patch(cls, attr, spec, None)
    return done


def _selected(full: str, inc: tuple[str, ...], exc: tuple[str, ...]) -> bool:
    if inc and not any(fnmatch.fnmatchcase(full, p) for p in inc):
        return False
    return not any(fnmatch.fnmatchcase(full, p) for p in exc)


def _patch(owner: Any, attr: str, spec: str, name: str | None) -> list[str]:
    """Replace ``owner.attr`` with our wrapper (once), and the same object elsewhere in its package."""
    key = (id(owner), attr)
    if key in _patches:
        return []  # idempotent: one span per call, however often it is instrumented
    raw = inspect.getattr_static(owner, attr)  # keeps staticmethod/classmethod objects
    if _is_ours(raw):
        return []  # decorated with @otel_gpu.api already
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    full = f"{getattr(fn, '__module__', None) or _owner_name(owner)}.{getattr(fn, '__qualname__', attr)}"
    wrapped = _wrap(raw, name or full, spec)
    if wrapped is raw:
        return []
    try:
        setattr(owner, attr, wrapped)
    except (TypeError, AttributeError):  # a C extension's immutable type (torch.sparse.ByteTensor)
        return []
    _patches[key] = (owner, attr, raw, spec)
    if isinstance(owner, types.ModuleType):
        _patch_aliases(owner, raw, wrapped, spec)
    return [full]


def decorate(
    fn: Any,
    name: str | None,
    attributes: dict[str, Any] | None = None,
    instrumented: str | None = None,
) -> Any:
    """What ``@otel_gpu.api`` and every instrumentation path do to ``fn``: the calls layer's
    :func:`otel_gpu.calls.decorator.decorate`, after applying ``OTEL_GPU_INSTRUMENT`` where no
    start-up hook did (at the first function decorated at a level above 0), with the pipeline
    module imported so that the wrapper binds its accessor."""
    from otel_gpu.calls import decorator
    from otel_gpu.export import pipeline  # noqa: F401  (installs the sink's accessors)

    settings = config.current()
    if settings.level != 0 or settings.controllable:  # control: starts its listener
        apply_settings(settings)
    return decorator.decorate(fn, name, attributes, instrumented)


def _wrap(fn: Any, span_name: str, spec: str) -> Any:
    make = _wrappers.get(spec)
    if make is not None:
        return make(fn)

    return decorate(fn, span_name, instrumented=spec)


def _is_ours(obj: Any) -> bool:
    inner = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    return "__otel_gpu_plan__" in getattr(inner, "__dict__", {})


def _patch_aliases(owner: types.ModuleType, raw: Any, wrapped: Any, spec: str) -> None:
    """``pkg.f`` re-exported from ``pkg.mod.f``: callers through the package get spans too."""
    top = owner.__name__.split(".", 1)[0]
    for modname, module in list(sys.modules.items()):
        if module is None or module is owner or modname.split(".", 1)[0] != top:
            continue
        for attr, value in list(vars(module).items()):
            if value is raw and (id(module), attr) not in _patches:
                setattr(module, attr, wrapped)
                _patches[(id(module), attr)] = (module, attr, raw, spec)


# --------------------------------------------------------------------------- on import


def _wanted(modname: str) -> bool:
    """Whether a pending target names this module or something inside it (cheap string tests)."""
    for spec in _pending:
        if _GLOB & set(spec):
            if fnmatch.fnmatchcase(modname, spec):
                return True
        else:
            dotted = spec.replace(":", ".")
            if dotted == modname or dotted.startswith(modname + "."):
                return True
    return False


def _on_import(module: types.ModuleType) -> None:
    name = module.__name__
    with _lock:
        for spec, (inc, exc, fn_name) in list(_pending.items()):
            try:
                if _GLOB & set(spec):
                    if fnmatch.fnmatchcase(name, spec) and refused_module(name) is None:
                        _matched_globs.add(spec)
                        _apply(module, spec, inc, exc, None)
                    continue
                dotted = spec.replace(":", ".")
                if dotted == name:
                    del _pending[spec]
                    _apply(module, spec, inc, exc, None)
                elif dotted.startswith(name + "."):
                    first = dotted[len(name) + 1 :].split(".")[0]
                    value = getattr(module, first, _MISSING)
                    # a submodule of a package imported first: wait for the module that owns it
                    if value is _MISSING or isinstance(value, types.ModuleType):
                        continue
                    del _pending[spec]
                    _instrument_spec(spec, inc, exc, fn_name)
            except Exception as err:  # instrumentation must never break the user's import
                _guard.warn_once(
                    f"instrument.{spec}",
                    "otel-gpu: could not instrument %r when %s was imported: %s: %s",
                    spec,
                    name,
                    type(err).__name__,
                    err,
                )


def _any_pending() -> bool:
    return bool(_pending)


def _ensure_hook() -> None:
    import_hook.install(_wanted, _any_pending, _on_import)


def _reset_for_tests(targets: Iterable[str] = ()) -> None:
    uninstrument()
    _matched_globs.clear()
    global _applied_how, _seen_settings
    _applied.clear()
    _applied_how = _seen_settings = None
    import_hook.remove()
