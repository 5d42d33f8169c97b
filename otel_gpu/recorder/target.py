"""Which function a recorded call belongs to, and its ``self``/``cls``: what replay needs to find it again."""

from __future__ import annotations

import os
import sys
import types
from typing import TYPE_CHECKING, Any

import torch

from otel_gpu import _guard
from otel_gpu.attributes import CODE_FILE_PATH
from otel_gpu.recorder import manifest, values

if TYPE_CHECKING:
    from otel_gpu.core.plan import Plan
    from otel_gpu.core.record import Call

__all__ = ["Target", "receiver"]


class Target:
    """How a decorated function can be found again: module, qualname, whether it takes self/cls."""

    __slots__ = ("file", "found", "module", "qualname", "receiver", "why_not")

    def __init__(self, plan: Plan) -> None:
        full = f"{plan.module}.{plan.qualname}"
        self.file = plan.attributes.get(CODE_FILE_PATH)
        if plan.module in sys.modules:  # the plan names the function as decoration found it
            self.module, self.qualname = plan.module, plan.qualname
        else:  # a module loaded without registering it: nothing replay could import
            self.module, self.qualname = "", full
        self.receiver = False
        self.why_not: str | None = None
        if self.module == "__main__":
            self.why_not = "defined in __main__ (a script); replay imports modules only"
        elif "<locals>" in self.qualname or not self.module:
            self.why_not = (
                "not importable by name (defined inside a function, or in a module "
                "missing from sys.modules); replay cannot import it"
            )
        obj: Any = sys.modules.get(self.module)
        for part in self.qualname.split(".") if obj is not None else ():
            obj = getattr(obj, part, None)
        fn = getattr(obj, "__func__", obj)
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        code = getattr(fn, "__code__", None)
        self.found = code is not None
        note = plan.replay_note
        if note is not None and self.why_not is None:
            self.why_not = note
        if code is not None and code.co_argcount:
            self.receiver = code.co_varnames[0] in ("self", "cls")
        elif code is None and self.why_not is None:
            self.why_not = _why_no_code(full, fn)
        if plan.receiver is not None:  # a bound method or a callable object
            self.receiver = True


def _why_no_code(full: str, fn: Any) -> str:
    """Why a function without ``__code__`` cannot be replayed: the true reason, not a guess."""
    if fn is None:
        return f"{full} could not be found by its import path"
    if isinstance(fn, _BUILTIN_TYPES) or type(fn).__name__ in _BUILTIN_NAMES:
        return f"builtin: {full} has no Python code (a compiled function); replay re-runs Python functions only"
    return f"{full} is a {type(fn).__qualname__}, not a Python function; replay re-runs Python functions only"


_BUILTIN_TYPES = (
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
)
# torch's C++ operators and pybind11 functions are builtins by nature but of their own types
_BUILTIN_NAMES = frozenset({"OpOverloadPacket", "OpOverload", "builtin_function_or_method"})


def receiver(call: Call, enc: values.Encoder) -> dict[str, Any]:
    """Encode ``self``/``cls`` of a method: a class by reference, an object by its opt-in state hook.

    The receiver is the bound method's ``__self__`` (or the callable object) when the decorated
    callable carries it, else the first positional argument of the call.
    """
    obj = call.plan.receiver
    if obj is None:
        args = call.args
        if not args:
            return {
                "t": "unsupported",
                "type": "?",
                "why": "receiver not available to the recorder",
            }
        obj = args[0]
    if isinstance(obj, type):
        return {"t": "class", "type": manifest.type_ref(obj)}
    hook = getattr(obj, "__otel_gpu_state__", None)
    if hook is None and isinstance(obj, torch.nn.Module):
        return _module_receiver(obj, enc)
    if hook is None:
        return {
            "t": "unsupported",
            "type": manifest.type_ref(type(obj)),
            "why": f"{manifest.type_ref(type(obj))} has no __otel_gpu_state__ hook",
        }
    try:
        state = hook()
        if not isinstance(state, dict):
            raise TypeError(f"__otel_gpu_state__ returned {type(state).__name__}, not dict")
    except Exception as exc:
        _guard.warn_once(
            "dump.state_hook", "otel-gpu: %r.__otel_gpu_state__ failed: %s", type(obj), exc
        )
        return {
            "t": "unsupported",
            "type": manifest.type_ref(type(obj)),
            "why": f"state hook failed: {exc}",
        }
    return {"t": "state", "type": manifest.type_ref(type(obj)), "state": enc.encode(state, "self")}


def _module_receiver(module: torch.nn.Module, enc: values.Encoder) -> dict[str, Any]:
    """A module receiver: rebuilt by replay from its state_dict when OTEL_GPU_DUMP_MODULES is on."""

    from otel_gpu import config
    from otel_gpu.recorder import module_state

    ref = manifest.type_ref(type(module))
    settings = config.current()
    if not settings.dump_modules:
        why = (
            f"{ref} has no __otel_gpu_state__ hook (for a torch.nn.Module, "
            "OTEL_GPU_DUMP_MODULES=true records its state_dict so replay can rebuild it)"
        )
        return {"t": "unsupported", "type": ref, "why": why}
    root = os.path.abspath(os.path.expanduser(config.expand_path(settings.dump_dir)))
    try:
        return module_state.record(module, root, enc, int(settings.dump_modules_max_mb * 2**20))
    except module_state.CannotRebuild as exc:
        return {"t": "unsupported", "type": ref, "why": f"{ref} cannot be rebuilt: {exc}"}
