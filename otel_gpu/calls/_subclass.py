"""Tensor subclasses: whose code runs when otel-gpu reads a tensor, decided once per type.

Reading a tensor subclass's ``shape`` or reducing it for statistics goes through its
``__torch_function__`` (and, for a wrapper subclass, its ``__torch_dispatch__``): code of the
subclass's author, which may sleep, raise ``SystemExit`` or call ``os._exit``. otel-gpu runs
that code only for torch's own subclasses (``Parameter``, nested, fake, functional and
distributed tensors), whose contract it knows. For any other subclass:

* metadata is read with torch functions disabled for subclasses
  (``torch._C.DisableTorchFunctionSubclass``): the sizes, strides, dtype and device the tensor
  holds, without its ``__torch_function__``;
* statistics of a subclass with only its own ``__torch_function__`` are computed over a plain
  view of its data (``as_subclass(torch.Tensor)``, taken with torch functions disabled: no copy);
* statistics of a subclass with its own ``__torch_dispatch__`` are skipped with a note: every
  operation on it, a reduction included, is its author's code.

A wrapper subclass that asks torch for custom sizes or strides
(``dispatch_sizes_strides_policy``) still answers ``shape`` through its ``__torch_dispatch__``:
torch offers no way to read them without it.
"""

from __future__ import annotations

import torch

__all__ = ["DISPATCH", "FUNCTION", "TORCH", "kind", "no_torch_function"]

TORCH = 0  # torch.Tensor, Parameter, or a subclass whose hooks are torch's own code
FUNCTION = 1  # its own __torch_function__, torch's __torch_dispatch__
DISPATCH = 2  # its own __torch_dispatch__

no_torch_function = torch._C.DisableTorchFunctionSubclass
"""Context manager: torch functions run without any subclass's ``__torch_function__``."""

_KINDS: dict[type, int] = {torch.Tensor: TORCH, torch.nn.Parameter: TORCH}
_TORCH_DEFAULTS = (torch._C._disabled_torch_function_impl, torch._C._disabled_torch_dispatch_impl)
_mro = type.__dict__["__mro__"].__get__
_type_dict = type.__dict__["__dict__"].__get__
_module = type.__dict__["__module__"].__get__


def kind(tp: type) -> int:
    """:data:`TORCH`, :data:`FUNCTION` or :data:`DISPATCH` for a ``torch.Tensor`` subclass."""
    found = _KINDS.get(tp)
    if found is None:
        if _foreign(tp, "__torch_dispatch__"):
            found = DISPATCH
        elif _foreign(tp, "__torch_function__"):
            found = FUNCTION
        else:
            found = TORCH
        if len(_KINDS) >= 1024:  # types made in a loop must not grow this without bound
            _KINDS.clear()
            _KINDS.update({torch.Tensor: TORCH, torch.nn.Parameter: TORCH})
        _KINDS[tp] = found
    return found


def _foreign(tp: type, name: str) -> bool:
    """Whether ``name`` resolves, along the MRO, to code defined outside torch.

    Read from the classes' own dicts: no metaclass ``__getattribute__`` runs.
    """
    for cls in _mro(tp):
        namespace = _type_dict(cls)
        if name not in namespace:
            continue
        value = namespace[name]
        if type(value) in (classmethod, staticmethod):
            value = value.__func__
        if value is _TORCH_DEFAULTS[0] or value is _TORCH_DEFAULTS[1]:  # identity: no __eq__
            return False
        module = _module(cls)
        return not (type(module) is str and (module == "torch" or module.startswith("torch.")))
    return False
