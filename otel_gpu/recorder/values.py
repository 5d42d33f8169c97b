"""The value encoder of the flight recorder's manifests: a call's arguments and results as
tagged JSON (``{"t": "int", "v": 3}``), tensors collected under unique keys for the tensor file.

The format itself (names, limits, reading a manifest back) is :mod:`otel_gpu.recorder.manifest`;
replay's decoder is :mod:`otel_gpu.replay.call`. The encoder runs user code only where the
format says so (``to_dict``, registered pytree flatteners), each guarded.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from otel_gpu.calls import describe
from otel_gpu.calls.metadata import instance_dict
from otel_gpu.recorder.kernel_choices import implementation_choices
from otel_gpu.recorder.manifest import MAX_BYTES, MAX_DEPTH, MAX_ITEMS

__all__ = ["Encoder", "broadcast_dims", "public_fields", "pytree_children", "stored_nbytes"]

_MAX_FIELDS = 64


def pytree_children(value: Any) -> list[tuple[str, Any]] | None:
    """``(key, child)`` pairs of a type registered with ``torch.utils._pytree``, else None.

    The flatten function is registered code: anything it raises, ``SystemExit`` included,
    means None.
    """
    from torch.utils import _pytree as pytree

    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is None:
        return None
    try:
        if node.flatten_with_keys_fn is not None:
            pairs, _ = node.flatten_with_keys_fn(value)
            return [(_key_name(k, i), child) for i, (k, child) in enumerate(pairs)]
        children, _ = node.flatten_fn(value)
        return [(str(i), child) for i, child in enumerate(children)]
    except BaseException:  # registered user code
        return None


def _from_dict(value: Any, tp: type) -> dict[str, Any] | None:
    """The fields of a ``from_dict`` encoding, when ``tp.from_dict`` exists and ``value.to_dict()``
    is plain JSON, else None: ``v`` (the dict) and ``implementation`` (the kernel choices the
    config carries outside it, such as ``_attn_implementation``; replay restores them, see
    :mod:`otel_gpu.recorder.kernel_choices`)."""
    to_dict = getattr(value, "to_dict", None)
    if not callable(to_dict) or not callable(getattr(tp, "from_dict", None)):
        return None
    try:
        data = to_dict()
        choices = implementation_choices(value)
        json.dumps([data, choices], allow_nan=False)
    except Exception:
        return None
    return {"v": data, "implementation": choices} if isinstance(data, dict) else None


def _key_name(key: Any, index: int) -> str:
    """A pytree key entry (``MappingKey``, ``GetAttrKey``, ``SequenceKey``) as a path part.

    Only atoms are formatted: anything else is user code, and the child's index stands in.
    """
    for attr in ("key", "name", "idx"):
        part = getattr(key, attr, None)
        if part is not None:
            return _part(part, index)
    return str(index)


def _part(key: Any, index: int) -> str:
    """A dict key as a path part: atoms as text (bounded), anything else by its index."""
    tp = type(key)
    if tp is str:
        return key[:64]
    if tp is int and -(10**18) < key < 10**18:
        return str(key)
    if tp in (bool, float, type(None)):
        return repr(key)
    return str(index)


_NOT_WALKED = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    torch.nn.Module,
)


def public_fields(value: Any) -> list[tuple[str, Any]] | None:
    """Public instance attributes of a plain object, None for what is not walked.

    Read through the interpreter's own ``__dict__`` descriptor (``instance_dict``), never
    ``vars()``, which runs a ``__dict__`` property: user code that may sleep or end the process.
    At most :data:`_MAX_FIELDS` attributes are looked at.
    """
    if issubclass(type(value), _NOT_WALKED) or callable(value):
        return None
    attrs = instance_dict(value)
    if attrs is None:
        return None
    return [
        (k, v)
        for k, v in _first(dict.items(attrs), _MAX_FIELDS)
        if type(k) is str and not k.startswith("_")
    ]


def _first(items: Any, n: int) -> Iterator[Any]:
    """The first ``n`` of ``items``: never more is iterated (a generator may be endless)."""
    return itertools.islice(items, n)


def _type_ref(tp: type) -> str:
    """:func:`type_ref` read through ``type``'s own descriptors: a metaclass property cannot run."""
    module = type.__dict__["__module__"].__get__(tp)
    qualname = type.__dict__["__qualname__"].__get__(tp)
    return f"{module}:{qualname}"


def broadcast_dims(t: torch.Tensor) -> list[int]:
    """The dimensions of ``t`` broadcast with stride 0: stored once, expanded again on load."""
    return [d for d, (n, s) in enumerate(zip(t.shape, t.stride())) if s == 0 and n > 1]


def stored_nbytes(t: torch.Tensor) -> int:
    """Bytes the recorder writes for ``t``: its elements, broadcast (stride 0) dimensions once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= 1 if stride == 0 else size
    return n * t.element_size()


class Encoder:
    """Encodes values into tagged JSON, collecting tensors (not copied) under unique keys.

    The same tensor object passed twice is stored once and referenced twice, so replay
    passes one object twice, as the original call did. Containers the flight recorder
    cannot rebuild but can compare are walked leaf by leaf: dicts of any dict type
    (transformers' ``ModelOutput``), types registered with ``torch.utils._pytree``, and
    objects that hold tensors in public attributes (a KV cache). What cannot be recorded
    is encoded as ``unsupported`` and listed in :attr:`unsupported` with its path.

    It runs on the caller's thread, so it never runs a user object's ``__repr__``,
    ``__len__``, ``__iter__``, ``__eq__`` or ``__hash__``: builtin containers are read
    through the builtin methods (at most :data:`MAX_ITEMS` items each, and about
    :data:`MAX_BYTES` of values in all), and an unsupported object is recorded by type and
    ``id``, its repr filled in later by :mod:`otel_gpu.calls.describe`. A cut container is
    encoded as ``unsupported`` with ``truncated`` (its length) and the items kept, so
    replay skips the call and says why.
    """

    def __init__(
        self,
        prefix: str,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        secret: Any = None,
    ) -> None:
        self.prefix = prefix
        self.tensors = tensors
        self.meta = meta
        self.secret = secret  # name -> bool: strings under such a key are never written
        self.seen: dict[int, str] = {}
        self.unsupported: list[str] = []
        """``"<path> (<module:Type>): <why>"`` for every part that was not recorded."""
        self._tensor_refs = 0
        self.budget = MAX_BYTES  # bytes of values left; below 0 the rest is cut

    def encode(self, value: Any, path: str, depth: int = 0) -> dict[str, Any]:
        """Encode ``value``; never raises, whatever user code ``value`` carries."""
        try:
            return self._encode(value, path, depth)
        except BaseException as exc:  # a user hook (a property, a flatten)
            return self._unsupported(value, path, f"encoding failed: {type(exc).__name__}")

    def _encode(self, value: Any, path: str, depth: int) -> dict[str, Any]:
        tp = type(value)
        self.budget -= 16  # a tag, a number: the small part of every encoded value
        if value is None:
            return {"t": "none"}
        if tp is bool:
            return {"t": "bool", "v": value}
        if tp is int:
            if value.bit_length() > 8192:  # JSON and str() refuse ints past 4300 digits
                return self._unsupported(value, path, f"an int of {value.bit_length()} bits")
            return {"t": "int", "v": value}
        if tp is float:
            return {"t": "float", "v": value if math.isfinite(value) else repr(value)}
        if tp is str:
            if self.secret is not None and self.secret(path.rsplit(".", 1)[-1]):
                return {"t": "redacted"}
            if len(value) > self.budget:
                return self._cut(value, path, f"a str of {len(value)} characters")
            self.budget -= len(value)
            return {"t": "str", "v": value}
        if self.budget < 0:
            return self._cut(value, path, f"a {tp.__name__}")
        if issubclass(tp, torch.Tensor):  # never isinstance: a __class__ property can lie
            return self._tensor(value, path)
        if issubclass(tp, enum.Enum):
            out: dict[str, Any] = {"t": "enum", "type": _type_ref(tp), "name": value._name_}
            inner = value._value_
            if type(inner) in (int, str, bool):
                out["value"] = inner
            return out
        if tp is torch.dtype:
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if tp is torch.device:
            return {"t": "device", "v": str(value)}
        if issubclass(tp, type):
            return {"t": "type", "v": _type_ref(value)}
        if depth >= MAX_DEPTH:
            return self._unsupported(value, path, "nested too deeply")
        if tp is torch.Size:
            return {"t": "size", "v": [int(n) for n in value]}
        if tp is list or tp is tuple:
            node = {"t": tp.__name__, "items": self._items(value, path, depth)}
            return self._maybe_cut(node, value, tp.__len__(value), path)
        if issubclass(tp, tuple) and type(getattr(tp, "_fields", None)) is tuple:
            names = [f if type(f) is str else str(i) for i, f in enumerate(tp._fields)]  # type: ignore[attr-defined]
            items = [
                self.encode(v, f"{path}.{f}", depth + 1)
                for f, v in _first(zip(names, tuple.__iter__(value)), MAX_ITEMS)
                if self.budget >= 0
            ]
            node = {"t": "namedtuple", "type": _type_ref(tp), "items": items}
            return self._maybe_cut(node, value, tuple.__len__(value), path)
        if issubclass(tp, dict):  # dict's own methods: a subclass's overrides never run
            pairs = [
                [
                    self._key(k, path, depth),
                    self.encode(v, f"{path}.{_part(k, i)}", depth + 1),
                ]
                for i, (k, v) in _first(enumerate(dict.items(value)), MAX_ITEMS)
                if self.budget >= 0
            ]
            node = (
                {"t": "dict", "items": pairs}
                if tp is dict
                else {"t": "mapping", "type": _type_ref(tp), "items": pairs}
            )
            return self._maybe_cut(node, value, dict.__len__(value), path)
        if issubclass(tp, (list, tuple, Mapping, set, frozenset)):
            # a user-defined container: reading it means running its __len__/__iter__
            return self._unsupported(value, path, "type not supported by the flight recorder")
        children = pytree_children(value)
        if children is not None:
            named = [
                [k, self.encode(v, f"{path}.{k}", depth + 1)]
                for k, v in _first(children, MAX_ITEMS)
                if self.budget >= 0
            ]
            node = {"t": "pytree", "type": _type_ref(tp), "items": named}
            return self._maybe_cut(node, value, len(children), path)
        if callable(getattr(tp, "to_dict", None)):  # looked up on the type: no __getattr__ runs
            rebuilt = _from_dict(value, tp)
            if rebuilt is not None:  # a transformers config: rebuilt by Type.from_dict(v)
                return {"t": "from_dict", "type": _type_ref(tp), **rebuilt}
        fields = public_fields(value)
        if fields is not None:
            refs, noted, budget = self._tensor_refs, len(self.unsupported), self.budget
            named = [[k, self.encode(v, f"{path}.{k}", depth + 1)] for k, v in fields]
            if self._tensor_refs > refs:  # it holds tensors: worth comparing leaf by leaf
                return {"t": "object", "type": _type_ref(tp), "fields": named}
            del self.unsupported[noted:]
            self.budget = budget
        return self._unsupported(value, path, "type not supported by the flight recorder")

    def _items(self, value: list[Any] | tuple[Any, ...], path: str, depth: int) -> list[Any]:
        """The first :data:`MAX_ITEMS` items within the budget; ints and floats inline, since
        lists of numbers (sequence lengths, offsets) are the common long argument."""
        items: list[Any] = []
        append = items.append
        for i, v in _first(enumerate(value), MAX_ITEMS):
            if self.budget < 0:
                break
            tp = type(v)
            if tp is int and -(2**63) <= v < 2**63:
                self.budget -= 16
                append({"t": "int", "v": v})
            elif tp is float and math.isfinite(v):
                self.budget -= 16
                append({"t": "float", "v": v})
            else:
                append(self.encode(v, f"{path}.{i}", depth + 1))
        return items

    def _key(self, key: Any, path: str, depth: int) -> dict[str, Any]:
        if type(key) is str:  # a key is a name, never redacted itself
            self.budget -= len(key)
            return {"t": "str", "v": key}
        return self.encode(key, path, depth + 1)

    def _maybe_cut(
        self, node: dict[str, Any], value: Any, length: int, path: str
    ) -> dict[str, Any]:
        """``node`` as is, or, when items were left out, marked ``unsupported`` with the cut."""
        kept = len(node["items"])
        if kept >= length:
            return node
        why = (
            f"cut at {kept} of {length} items when recorded (the flight recorder keeps at most "
            f"{MAX_ITEMS} items of a container and about {MAX_BYTES >> 20} MiB of values a call)"
        )
        ref = _type_ref(type(value))
        self.unsupported.append(f"{self.prefix}{path} ({ref}): {why}")
        cut = {"t": "unsupported", "type": ref, "why": why, "truncated": length}
        cut["container"] = node["t"]
        cut["items"] = node["items"]
        return cut

    def _cut(self, value: Any, path: str, what: str) -> dict[str, Any]:
        why = (
            f"{what}, left out when recorded: the call's values passed the flight recorder's "
            f"budget of about {MAX_BYTES >> 20} MiB"
        )
        ref = _type_ref(type(value))
        self.unsupported.append(f"{self.prefix}{path} ({ref}): {why}")
        return {"t": "unsupported", "type": ref, "why": why, "truncated": True}

    def _unsupported(self, value: Any, path: str, why: str) -> dict[str, Any]:
        """Type and id now; the repr later, off the caller's thread (:mod:`otel_gpu.calls.describe`)."""
        tp = type(value)
        ref = _type_ref(tp)
        self.unsupported.append(f"{self.prefix}{path} ({ref}): {why}")
        node = {"t": "unsupported", "type": ref, "id": f"0x{id(value):x}", "repr": "", "why": why}
        if tp is torch.Tensor or tp is torch.nn.Parameter:
            node["repr"] = _tensor_text(value)  # builtin accessors only: no user code
        elif issubclass(tp, torch.Tensor):
            del node["repr"]  # a subclass's repr may read every value: not taken
        else:
            describe.later(node, "repr", value)
        return node

    def _tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        known = self.seen.get(id(t))
        if known is not None:
            self._tensor_refs += 1
            return {"t": "tensor", "key": known}
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            return self._unsupported(t, path, "only plain strided tensors are recorded")
        if t.is_meta or t.device.type == "meta":
            return self._unsupported(t, path, "meta tensors have no data")
        key = self.prefix + path
        while key in self.tensors:
            key += "_"
        self.seen[id(t)] = key
        self.tensors[key] = t
        self._tensor_refs += 1
        self.meta[key] = {
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "stride": list(t.stride()),
            "storage_offset": t.storage_offset(),
            "device": str(t.device),
            "requires_grad": t.requires_grad,
            "nbytes": stored_nbytes(t),
        }
        return {"t": "tensor", "key": key}


def _tensor_text(t: torch.Tensor) -> str:
    """A short description of a tensor the recorder does not store (sparse, nested, meta)."""
    try:
        shape = ", ".join(str(n) for n in t.shape)
        return f"tensor(shape=({shape}), dtype={t.dtype}, layout={t.layout}, device={t.device})"
    except Exception as exc:
        return f"tensor (metadata unavailable: {type(exc).__name__})"
