"""Input/output metadata for level 3: raw capture on the caller's thread, attributes later.

The caller's thread only *captures*: it walks the bound arguments and appends
compact tuples (``(key, kind, payload)``) holding raw values such as
``torch.Size``, ``torch.dtype`` and the stride tuple. Turning those into
attribute strings and arrays (:func:`to_attributes`) happens on the export
thread, where it does not cost the caller.

Keys are relative (``q``, ``kv.0``, ``0``); the caller of :func:`to_attributes`
adds ``otel_gpu.input.`` or ``otel_gpu.output.``.
"""

from __future__ import annotations

import dataclasses
import decimal
import enum
import fractions
import inspect
import itertools
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree  # torch imports it itself; its registry is read per structure

from otel_gpu.calls import _subclass

# the record kinds and their conversion live in the core; re-exported (its whole ``__all__``)
# for the capture's readers
from otel_gpu.core import raw as _raw
from otel_gpu.core.raw import *  # noqa: F403
from otel_gpu.core.raw import CONTAINER, OBJECT, REDACTED, TENSOR, VALUE, kind_of, payload_of

__all__ = [
    *_raw.__all__,
    "Binder",
    "capture",
    "capture_output",
    "instance_dict",
    "make_binder",
    "shared",
]

MAX_DEPTH = 4

# a set: `type in tuple` compares with each of the five in turn (0.14 µs for a tensor, 0.03 here)
_SCALARS = frozenset((type(None), bool, int, float, str))
_Raw = list[tuple[str, int, Any]]

Binder = Callable[[tuple[Any, ...], Mapping[str, Any]], list[tuple[str, Any, bool]]]


def make_binder(fn: Callable[..., Any], skip_self: bool) -> Binder:
    """Build, once per function, a binder from call arguments to ``(name, value, is_default)``.

    Cheaper than ``Signature.bind`` (which costs several microseconds) and, unlike it,
    never raises: a call with wrong arguments is bound as far as possible and the
    function itself raises its usual TypeError.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return lambda args, kwargs: (
            [(f"arg{i}", a, False) for i, a in enumerate(args)]
            + [(k, v, False) for k, v in kwargs.items()]
        )
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    skip = 1 if skip_self and positional and positional[0].name in ("self", "cls") else 0
    pos_names = tuple(p.name for p in positional)
    pos_only = {p.name for p in positional if p.kind is P.POSITIONAL_ONLY}
    kwonly = tuple(p.name for p in params if p.kind is P.KEYWORD_ONLY)
    var_pos = next((p.name for p in params if p.kind is P.VAR_POSITIONAL), None)
    var_kw = next((p.name for p in params if p.kind is P.VAR_KEYWORD), None)
    defaults = {p.name: p.default for p in params if p.default is not P.empty}
    named = set(pos_names) - pos_only | set(kwonly)
    npos = len(pos_names)

    def bind(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[tuple[str, Any, bool]]:
        out = [(name, value, False) for name, value in zip(pos_names[skip:], args[skip:])]
        nargs = len(args)
        if nargs > npos and var_pos is not None:
            out.append((var_pos, args[npos:], False))
        for name in pos_names[nargs:] if nargs < npos else ():
            if name in kwargs and name not in pos_only:
                out.append((name, kwargs[name], False))
            elif name in defaults:
                out.append((name, defaults[name], True))
        for name in kwonly:
            if name in kwargs:
                out.append((name, kwargs[name], False))
            elif name in defaults:
                out.append((name, defaults[name], True))
        if var_kw is not None and kwargs:
            extra = {k: v for k, v in kwargs.items() if k not in named}
            if extra:
                out.append((var_kw, extra, False))
        return out

    if skip and npos == 1 and not (kwonly or var_pos or var_kw):
        return lambda args, kwargs: []
    return bind


def is_secret(name: str, words: tuple[str, ...]) -> bool:
    """Whether a parameter, dict key or kwarg name looks like a secret (OTEL_GPU_REDACT)."""
    lowered = name.lower()
    return any(word in lowered for word in words)


def redact(raw: _Raw, words: tuple[str, ...]) -> None:
    """Replace string values whose key (parameter, dict key or kwarg name) looks like a secret."""
    if _NO_TEXT.issuperset(map(type, map(payload_of, raw))):
        return  # no string among the payloads (one C-level pass): nothing to redact
    for i, (key, kind, payload) in enumerate(raw):
        if kind == VALUE and isinstance(payload, str) and is_secret(key.rsplit(".", 1)[-1], words):
            raw[i] = (key, REDACTED, None)


# payload types that are never a string nor a str-based enum: a tensor's or a container's
# tuple, an object's description tuple, and the atoms other than str
_NO_TEXT = frozenset((tuple, type(None), bool, int, float, torch.dtype, torch.device))


def _tensor_meta(t: torch.Tensor) -> Any:
    # A plain tuple, not torch.Size: records wait for export, and the GC untracks tuples of
    # atoms but keeps tracking (and promoting) tuple subclasses and whatever holds them.
    if type(t) in _PLAIN_TENSORS:
        # A plain dense tensor's sizes and strides are ints: no symbolic-size check (0.4 µs a
        # tensor). Subclasses (fake, functional, jagged) take the checked path below; a plain
        # tensor without strides (sparse, strided nested) raises here and takes it too.
        try:
            return (
                tuple(t.shape),
                t.dtype,
                t.device,
                t.stride(),
                t.requires_grad,
                t.is_contiguous(),
            )
        except Exception:
            pass
    try:
        shape = _dims(t.shape)
        return (shape, t.dtype, t.device, _dims(t.stride()), t.requires_grad, t.is_contiguous())
    except Exception:
        # sparse, nested and some subclass tensors have no strides
        try:
            return (_dims(t.shape), t.dtype, t.device, None, t.requires_grad, False)
        except Exception as exc:
            return f"{type(t).__name__} (metadata unavailable: {type(exc).__name__})"


def _dims(dims: Any) -> tuple[int, ...] | tuple[str, ...]:
    """Sizes or strides as ints, or all as text when one is symbolic (a jagged tensor's ``j1``).

    An attribute array holds one type: a SymInt among ints would reach the SDK as an invalid
    value (a warning per call, and the value replaced).
    """
    out = tuple(dims)
    # one C-level pass over the types (a generator in all() cost 0.15 µs more, 6 per call)
    if _INT_ONLY.issuperset(map(type, out)):
        return out
    return tuple(str(d) for d in out)


_INT_ONLY = frozenset((int,))
_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))


def capture(
    out: _Raw,
    key: str,
    value: Any,
    max_items: int,
    tensors: list[tuple[str, torch.Tensor]] | None,
    depth: int = 0,
) -> None:
    """Append raw metadata for ``value`` under ``key``; collect tensors for statistics if asked."""
    # Types are tested with issubclass(type(value), ...), never isinstance: isinstance reads
    # __class__, which a property can fake. Containers are read through the builtin methods
    # (list.__len__, dict.items): a subclass's __len__/__iter__ is user code, never run here.
    tp = type(value)
    if tp in _PLAIN_TENSORS:
        # the commonest value, its metadata inline: _tensor_meta's fast path without the call
        try:
            meta: Any = (
                tuple(value.shape),
                value.dtype,
                value.device,
                value.stride(),
                value.requires_grad,
                value.is_contiguous(),
            )
        except Exception:  # sparse, strided nested: the checked path
            meta = _tensor_meta(value)
        out.append((key, TENSOR, meta))
        if tensors is not None:
            tensors.append((key, value))
    elif tp in _SCALARS:
        out.append((key, VALUE, value))
    else:
        branch = _BRANCHES.get(tp)
        if branch is None:
            branch = _branch_of(tp)
        if branch == _B_TENSOR:
            out.append((key, TENSOR, _tensor_meta(value)))
            if tensors is not None:
                tensors.append((key, value))
        elif branch == _B_FOREIGN_TENSOR:  # its __torch_function__ is not torch's: not run
            with _subclass.no_torch_function():
                out.append((key, TENSOR, _tensor_meta(value)))
            if tensors is not None:
                tensors.append((key, value))
        elif branch == _B_VALUE:
            out.append((key, VALUE, value))
        elif branch == _B_LIST or branch == _B_TUPLE:
            base: Any = list if branch == _B_LIST else tuple
            out.append((key, CONTAINER, (tp.__name__, base.__len__(value))))
            if depth < MAX_DEPTH:
                for i, item in enumerate(itertools.islice(base.__iter__(value), max_items)):
                    capture(out, f"{key}.{i}", item, max_items, tensors, depth + 1)
        elif branch == _B_NAMEDTUPLE:  # field names are better keys than indices
            out.append((key, CONTAINER, (tp.__name__, tuple.__len__(value))))
            if depth < MAX_DEPTH:
                pairs = zip(_field_names(tp), tuple.__iter__(value))
                for name, item in itertools.islice(pairs, max_items):
                    capture(out, f"{key}.{name}", item, max_items, tensors, depth + 1)
        elif branch == _B_DICT:
            out.append((key, CONTAINER, (tp.__name__, dict.__len__(value))))
            if depth < MAX_DEPTH:
                for i, (k, item) in enumerate(itertools.islice(dict.items(value), max_items)):
                    capture(out, f"{key}.{_key_part(k, i)}", item, max_items, tensors, depth + 1)
        elif branch == _B_MAPPING:  # a user-defined mapping: its length and items are user code
            out.append((key, OBJECT, _describe_object(value)))
        elif not _capture_structure(out, key, value, max_items, tensors, depth):
            out.append((key, OBJECT, _describe_object(value)))


# How capture() treats a type, decided once per type: a KV cache's walk met ~40 issubclass
# checks a call (the Mapping one through the ABC machinery). A class's bases do not change.
(
    _B_TENSOR,
    _B_VALUE,
    _B_LIST,
    _B_TUPLE,
    _B_NAMEDTUPLE,
    _B_DICT,
    _B_MAPPING,
    _B_OTHER,
    _B_FOREIGN_TENSOR,
) = range(9)
_BRANCHES: dict[type, int] = {}


def _branch_of(tp: type) -> int:
    if issubclass(tp, torch.Tensor):
        branch = _B_TENSOR if _subclass.kind(tp) == _subclass.TORCH else _B_FOREIGN_TENSOR
    elif issubclass(tp, (enum.Enum, torch.dtype, torch.device)):
        branch = _B_VALUE
    elif issubclass(tp, list):
        branch = _B_LIST
    elif issubclass(tp, tuple):
        branch = _B_NAMEDTUPLE if _is_namedtuple(tp) else _B_TUPLE
    elif issubclass(tp, dict):
        branch = _B_DICT
    elif issubclass(tp, Mapping):
        branch = _B_MAPPING
    else:
        branch = _B_OTHER
    if len(_BRANCHES) >= 1024:  # types made in a loop must not grow this without bound
        _BRANCHES.clear()
    _BRANCHES[tp] = branch
    return branch


def _is_namedtuple(tp: type) -> bool:
    return type(getattr(tp, "_fields", None)) is tuple  # looked up on the class: no __getattr__


def _field_names(tp: type) -> list[str]:
    return [f if type(f) is str else str(i) for i, f in enumerate(tp._fields)]  # type: ignore[attr-defined]


def _capture_structure(
    out: _Raw,
    key: str,
    value: Any,
    max_items: int,
    tensors: list[tuple[str, torch.Tensor]] | None,
    depth: int,
) -> bool:
    """Containers torch's pytree knows (ModelOutput…), and objects holding tensors in public
    attributes (a KV cache's ``layers[i].keys``), walked into their leaves with their keys.

    Returns False, recording nothing, for an object with no tensor inside: it is then described
    as an object (type and id).
    """
    tp = type(value)
    children = _pytree_children(value, tp)
    if children is not None:
        out.append((key, CONTAINER, (tp.__name__, len(children))))
        if depth < MAX_DEPTH:
            for name, item in children[:max_items]:
                capture(out, f"{key}.{name}", item, max_items, tensors, depth + 1)
        return True
    if depth >= MAX_DEPTH or issubclass(tp, _NOT_WALKED):
        return False
    fields = instance_dict(value)
    if fields is None:
        return False
    mark = len(out)
    out.append((key, CONTAINER, (tp.__name__, len(fields))))
    walked = 0
    for name, item in itertools.islice(dict.items(fields), 256):
        if type(name) is not str or name.startswith("_") or type(item) in _SCALARS:
            continue
        if callable(item):
            continue  # a cache's flags and settings are not what its span is about
        walked += 1
        if walked > max_items:
            break
        capture(out, f"{key}.{name}", item, max_items, tensors, depth + 1)
    if TENSOR not in map(kind_of, out[mark:]):  # one C-level pass
        del out[mark:]
        return False
    return True


_NOT_WALKED = (torch.nn.Module, type, enum.Enum)


def instance_dict(value: Any) -> dict[str, Any] | None:
    """``value``'s instance ``__dict__``, read without running any of its class's code; None when
    it has none, or when its class replaces it (a ``__dict__`` property is user code).

    Not ``vars()``: that looks ``__dict__`` up through the class's ``__getattribute__`` and runs
    a ``__dict__`` property, which may sleep or end the process (``os._exit`` cannot be caught).
    The descriptor is found along the type's MRO, once per type, and used only when it is the
    interpreter's own (a getset or member descriptor).
    """
    reader = _DICT_READERS.get(type(value))
    if reader is None:
        reader = _remember_reader(type(value))
    if reader is False:
        return None
    try:
        fields = reader(value)
    except Exception:  # a C-level descriptor refusing this instance
        return None
    return fields if type(fields) is dict else None


def _remember_reader(tp: type) -> Any:
    reader = _dict_reader(tp) or False  # False: decided, none to use
    if len(_DICT_READERS) >= 1024:  # types made in a loop must not grow this without bound
        _DICT_READERS.clear()
    _DICT_READERS[tp] = reader
    return reader


_DICT_READERS: dict[type, Any] = {}
_C_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)
_mro = type.__dict__["__mro__"].__get__
_type_dict = type.__dict__["__dict__"].__get__


def _dict_reader(tp: type) -> Any:
    """The ``__get__`` of the ``__dict__`` descriptor ``tp`` inherits, if it is the interpreter's."""
    for cls in _mro(tp):
        namespace = _type_dict(cls)
        if "__dict__" in namespace:
            descriptor = namespace["__dict__"]
            return descriptor.__get__ if type(descriptor) in _C_DESCRIPTORS else None
    return None


def _pytree_children(value: Any, tp: type) -> list[tuple[str, Any]] | None:
    node = _pytree.SUPPORTED_NODES.get(tp)
    if node is None:
        return None
    try:  # registered code: whatever it raises, SystemExit included, costs only this structure
        if node.flatten_with_keys_fn is not None:
            pairs, _ = node.flatten_with_keys_fn(value)
            return [(_pytree_key(k, i), child) for i, (k, child) in enumerate(pairs)]
        items, _ = node.flatten_fn(value)
        return [(str(i), child) for i, child in enumerate(items)]
    except BaseException:
        return None


def _pytree_key(entry: Any, index: int) -> str:
    for attr in ("key", "name", "idx"):
        part = getattr(entry, attr, None)
        if part is not None:
            return _key_part(part, index)
    return str(index)


# Types whose instances cannot change after the call, so a repr taken now stays true, and whose
# repr is builtin code of bounded cost. The repr of anything else is not taken: it could show a
# later state (the span is exported after the call returns) and it is user code on the caller's
# thread. Such objects are recorded as type plus id.
_IMMUTABLE: set[type] = {
    complex,
    range,
    type(Ellipsis),
    type(NotImplemented),
    decimal.Decimal,
    fractions.Fraction,
    torch.layout,
    torch.memory_format,
}
_REPR_INPUT_LIMIT = 4096  # bytes/frozensets longer than this are described by type and length
_ATOM_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)
_ATOM_TEXT = 256  # longer str fields (and ints past this many bits) make a record not described


def _describe_object(value: Any) -> tuple[str, str | None, int]:
    """(type qualname, call-time repr for immutable types else None, id) — nothing kept alive.

    No user code runs: the repr is taken only of builtin immutable types whose members are
    atoms, and a frozen dataclass's is formatted here from its atomic fields, as the
    dataclass-generated ``__repr__`` would print it.
    """
    tp = type(value)
    qualname = str(type.__dict__["__qualname__"].__get__(tp))
    try:
        text = _immutable_repr(value, tp, qualname)
    except Exception as exc:  # Decimal/Fraction of absurd size and the like
        text = f"<repr failed: {type(exc).__name__}>"
    return qualname, text, id(value)


def _immutable_repr(value: Any, tp: type, qualname: str) -> str | None:
    if tp in _IMMUTABLE or _is_numpy_scalar(tp):
        if tp is decimal.Decimal and len(value.as_tuple().digits) > _REPR_INPUT_LIMIT:
            return f"<Decimal of {len(value.as_tuple().digits)} digits>"
        return repr(value)
    if tp is bytes:
        if len(value) > _REPR_INPUT_LIMIT:
            return f"<bytes of length {len(value)}>"
        return repr(value)
    if tp is frozenset:
        if len(value) > _REPR_INPUT_LIMIT:
            return f"<frozenset of length {len(value)}>"
        return repr(value) if all(_is_atom(v) for v in value) else None
    if tp is slice:
        parts = (value.start, value.stop, value.step)
        return repr(value) if all(_is_atom(v) for v in parts) else None
    return _frozen_record(value, tp, qualname)


def _is_atom(value: Any) -> bool:
    """A value whose repr is builtin code of bounded cost."""
    tp = type(value)
    if tp is str:
        return len(value) <= _ATOM_TEXT
    if tp is int:
        return value.bit_length() <= _ATOM_TEXT
    return tp in _ATOM_TYPES


def _frozen_record(value: Any, tp: type, qualname: str) -> str | None:
    """A frozen dataclass's repr when it is the generated one and every field is an atom.

    Formatted here, not by calling ``repr``: the fields are read through ``object``'s own
    attribute lookup and printed as the generated ``__repr__`` prints them.
    """
    params = tp.__dict__.get("__dataclass_params__")
    fields = tp.__dict__.get("__dataclass_fields__")
    if params is None or not params.frozen or type(fields) is not dict or len(fields) > 32:
        return None
    generated = getattr(tp.__dict__.get("__repr__"), "__code__", None)
    if generated is None or generated.co_filename != dataclasses.__file__:
        return None  # no repr, or one the class wrote itself
    parts = []
    for name, field in dict.items(fields):
        if field._field_type is not dataclasses._FIELD or not field.repr:  # type: ignore[attr-defined]
            continue
        item = object.__getattribute__(value, name)
        text = repr(item) if _is_atom(item) else _enum_repr(item)
        if text is None:
            return None
        parts.append(f"{name}={text}")
    return f"{qualname}({', '.join(parts)})"


_VALUE_REPRS = (None, int.__repr__, str.__repr__, float.__repr__)


def _enum_repr(member: Any) -> str | None:
    """``<Mode.A: 0>`` for a member of an enum with the standard repr and an atomic value."""
    tp = type(member)
    if not issubclass(tp, enum.Enum) or issubclass(tp, enum.Flag):
        return None
    if tp.__repr__ is not enum.Enum.__repr__ or tp._value_repr_ not in _VALUE_REPRS:  # type: ignore[attr-defined]
        return None
    inner = member._value_
    if not _is_atom(inner):
        return None
    return f"<{type.__dict__['__name__'].__get__(tp)}.{member._name_}: {inner!r}>"


def _is_numpy_scalar(tp: type) -> bool:
    numpy = sys.modules.get("numpy")  # only when the program imported numpy itself
    return (
        numpy is not None
        and issubclass(tp, numpy.generic)
        and type.__dict__["__module__"].__get__(tp) == "numpy"
    )


def _key_part(k: Any, index: int) -> str:
    """A dict key as part of an attribute name: str/int keys (bounded), else the item's index.

    Other keys are never formatted on the caller's thread: their __repr__ is user code.
    """
    tp = type(k)
    if tp is str:
        return k[:64]
    if tp is int:
        return str(k) if -(10**18) < k < 10**18 else f"int{index}"
    return str(index)


def capture_output(
    result: Any, max_items: int, tensors: list[tuple[str, torch.Tensor]] | None
) -> _Raw:
    """Raw metadata of a return value: keys ``0``, ``1``… for tuples, field or dict keys by name."""
    out: _Raw = []
    if result is None:
        return out
    tp = type(result)
    if tp is torch.Tensor:  # the common result, without the container checks below
        capture(out, "0", result, max_items, tensors, 0)
    elif tp is tuple or tp is list:
        if len(result) > max_items:
            out.append(("", CONTAINER, (tp.__name__, len(result))))
        for i, item in enumerate(result[:max_items]):
            capture(out, str(i), item, max_items, tensors, 1)
    elif issubclass(tp, tuple) and _is_namedtuple(tp):  # tuple's own iterator, as capture() does
        pairs = zip(_field_names(tp), tuple.__iter__(result))
        for name, item in itertools.islice(pairs, max_items):
            capture(out, name, item, max_items, tensors, 1)
    elif issubclass(tp, dict):  # dict's own methods: a subclass's items()/__len__ never run
        for i, (k, item) in enumerate(dict.items(result)):
            if i >= max_items:
                out.append(("", CONTAINER, (tp.__name__, dict.__len__(result))))
                break
            capture(out, _key_part(k, i), item, max_items, tensors, 1)
    else:
        capture(out, "0", result, max_items, tensors, 0)
    return out


# Records kept for sharing: a model's module repeats a few layouts, each a few hundred bytes.
_SHARED: dict[tuple, tuple] = {}
_SHARED_MAX = 1024
# payload types whose equal values are interchangeable (no user __eq__/__hash__ runs); floats
# also, but for zero (-0.0 == 0.0); an object's payload carries its id and is never shared
_ATOMS = frozenset((type(None), bool, int, float, str, tuple, torch.dtype, torch.device, *_SCALARS))
_all_atomic = _ATOMS.issuperset
_SHARED_TEXT = 1024  # a longer string argument is not kept past its call's export


def _kept_small(raw: tuple) -> bool:
    """No float zero and no string longer than ``_SHARED_TEXT``: a shared record is exact and
    stays small (the journal's and the layouts' caches hold the same records)."""
    for p in map(payload_of, raw):
        tp = type(p)
        if (tp is float and p == 0.0) or (tp is str and len(p) > _SHARED_TEXT):
            return False
    return True


def shared(raw: tuple) -> tuple:
    """``raw``, or the equal record of an earlier call, payload types included.

    A queued call keeps its records until export. Fresh ones are nested tuples that the
    collector untracks a level per pass, so most reach the oldest generation still tracked, and
    every object promoted there brings the next full collection nearer (~150 per tiny GPT2
    forward at level 3, ~550 µs of the ~3 ms that level 3 added to it). A shared record is one
    long-lived object instead: the call's own are freed at once. A record holding an object
    (its id differs per call) shares its tensors' entries.
    """
    if not raw:
        return raw
    kinds = tuple(map(type, map(payload_of, raw)))
    if not _all_atomic(kinds) or ((float in kinds or str in kinds) and not _kept_small(raw)):
        return raw
    if OBJECT in map(kind_of, raw):
        return tuple([_shared_entry(e) if e[1] == TENSOR else e for e in raw])
    return _share((raw, kinds), raw)


def _shared_entry(entry: tuple) -> tuple:
    # a tensor's entry: a key, and a payload of ints, a dtype, a device and bools (or a string)
    return _share(entry, entry)


def _share(key: tuple, raw: tuple) -> tuple:
    try:
        hit = _SHARED.get(key)
    except Exception:  # an unhashable payload (a symbolic size)
        return raw
    if hit is not None:
        return hit
    if len(_SHARED) >= _SHARED_MAX:
        _SHARED.clear()
    _SHARED[key] = raw
    return raw
