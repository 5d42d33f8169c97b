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

import decimal
import enum
import fractions
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Binder", "capture", "capture_output", "make_binder", "to_attributes"]

# Raw record kinds.
TENSOR = (
    0  # payload: (shape, dtype, device, stride, requires_grad, is_contiguous) or an error string
)
VALUE = 1  # payload: a scalar, enum, dtype or device
CONTAINER = 2  # payload: (type name, length)
OBJECT = 3  # payload: (type qualname, repr or None, id), taken at call time (see _describe_object)
DEFAULT = 4  # payload: True, marks a parameter whose default was used
REDACTED = 5  # payload: None

MAX_DEPTH = 4
MAX_VALUE_BYTES = 2048  # Tempo's default cut for attribute values

_SCALARS = (type(None), bool, int, float, str)
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
    for i, (key, kind, payload) in enumerate(raw):
        if kind == VALUE and isinstance(payload, str) and is_secret(key.rsplit(".", 1)[-1], words):
            raw[i] = (key, REDACTED, None)


def _tensor_meta(t: torch.Tensor) -> Any:
    # A plain tuple, not torch.Size: records wait for export, and the GC untracks tuples of
    # atoms but keeps tracking (and promoting) tuple subclasses and whatever holds them.
    try:
        return (tuple(t.shape), t.dtype, t.device, t.stride(), t.requires_grad, t.is_contiguous())
    except Exception:
        # sparse, nested and some subclass tensors have no strides
        try:
            return (tuple(t.shape), t.dtype, t.device, None, t.requires_grad, False)
        except Exception as exc:
            return f"{type(t).__name__} (metadata unavailable: {type(exc).__name__})"


def capture(
    out: _Raw,
    key: str,
    value: Any,
    max_items: int,
    tensors: list[tuple[str, torch.Tensor]] | None,
    depth: int = 0,
) -> None:
    """Append raw metadata for ``value`` under ``key``; collect tensors for statistics if asked."""
    tp = type(value)
    if tp in _SCALARS:
        out.append((key, VALUE, value))
    elif isinstance(value, torch.Tensor):
        out.append((key, TENSOR, _tensor_meta(value)))
        if tensors is not None:
            tensors.append((key, value))
    elif isinstance(value, (enum.Enum, torch.dtype, torch.device)):
        out.append((key, VALUE, value))
    elif tp in (list, tuple) or (
        isinstance(value, (list, tuple)) and not hasattr(value, "_fields")
    ):
        n = len(value)
        out.append((key, CONTAINER, (tp.__name__, n)))
        if depth < MAX_DEPTH:
            for i, item in enumerate(value[:max_items]):
                capture(out, f"{key}.{i}", item, max_items, tensors, depth + 1)
    elif isinstance(value, tuple):  # namedtuple: field names are better keys than indices
        n = len(value)
        out.append((key, CONTAINER, (tp.__name__, n)))
        if depth < MAX_DEPTH:
            for name, item in list(zip(value._fields, value))[:max_items]:  # type: ignore[attr-defined]
                capture(out, f"{key}.{name}", item, max_items, tensors, depth + 1)
    elif isinstance(value, Mapping):
        n = len(value)
        out.append((key, CONTAINER, (tp.__name__, n)))
        if depth < MAX_DEPTH:
            for i, (k, item) in enumerate(value.items()):
                if i >= max_items:
                    break
                capture(out, f"{key}.{_key_part(k, i)}", item, max_items, tensors, depth + 1)
    elif not _capture_structure(out, key, value, max_items, tensors, depth):
        out.append((key, OBJECT, _describe_object(value)))


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
    if depth >= MAX_DEPTH or isinstance(value, _NOT_WALKED):
        return False
    try:
        fields = vars(value)
    except TypeError:
        return False
    mark = len(out)
    out.append((key, CONTAINER, (tp.__name__, len(fields))))
    walked = 0
    for name, item in fields.items():
        if name.startswith("_") or type(item) in _SCALARS or callable(item):
            continue  # a cache's flags and settings are not what its span is about
        walked += 1
        if walked > max_items:
            break
        capture(out, f"{key}.{name}", item, max_items, tensors, depth + 1)
    if not any(kind == TENSOR for _, kind, _ in out[mark:]):
        del out[mark:]
        return False
    return True


_NOT_WALKED = (torch.nn.Module, type, enum.Enum)


def _pytree_children(value: Any, tp: type) -> list[tuple[str, Any]] | None:
    node = _pytree_nodes().get(tp)
    if node is None:
        return None
    if node.flatten_with_keys_fn is not None:
        pairs, _ = node.flatten_with_keys_fn(value)
        return [(_pytree_key(k, i), child) for i, (k, child) in enumerate(pairs)]
    items, _ = node.flatten_fn(value)
    return [(str(i), child) for i, child in enumerate(items)]


def _pytree_key(entry: Any, index: int) -> str:
    for attr in ("key", "name", "idx"):
        part = getattr(entry, attr, None)
        if part is not None:
            return _key_part(part, index)
    return str(index)


def _pytree_nodes() -> dict[type, Any]:
    from torch.utils import _pytree

    return _pytree.SUPPORTED_NODES


# Types whose instances cannot change after the call, so a repr taken now stays true. The repr of
# anything else is not taken: it could show a later state (the span is exported after the call
# returns) and it is user code on the caller's thread. Such objects are recorded as type plus id.
_IMMUTABLE: set[type] = {
    complex,
    bytes,
    range,
    slice,
    type(Ellipsis),
    type(NotImplemented),
    frozenset,
    decimal.Decimal,
    fractions.Fraction,
    torch.layout,
    torch.memory_format,
}
_REPR_INPUT_LIMIT = 4096  # bytes/frozensets longer than this are described by type and length


def _describe_object(value: Any) -> tuple[str, str | None, int]:
    """(type qualname, call-time repr for immutable types else None, id) — nothing kept alive."""
    tp = type(value)
    qualname = getattr(tp, "__qualname__", None) or tp.__name__
    if tp in _IMMUTABLE or _is_numpy_scalar(tp) or _is_frozen_record(value, tp):
        if tp in (bytes, frozenset) and len(value) > _REPR_INPUT_LIMIT:
            return qualname, f"<{qualname} of length {len(value)}>", id(value)
        try:
            return qualname, repr(value), id(value)
        except Exception as exc:
            return qualname, f"<repr failed: {type(exc).__name__}>", id(value)
    return qualname, None, id(value)


_ATOMS = (type(None), bool, int, float, str, enum.Enum, torch.dtype, torch.device)


def _is_frozen_record(value: Any, tp: type) -> bool:
    """A frozen dataclass with the generated repr and only atomic fields: its repr cannot change."""
    params = getattr(tp, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.repr:
        return False
    fields = getattr(tp, "__dataclass_fields__", {})
    if len(fields) > 32:
        return False
    return all(isinstance(getattr(value, name, None), _ATOMS) for name in fields)


def _is_numpy_scalar(tp: type) -> bool:
    numpy = sys.modules.get("numpy")  # only when the program imported numpy itself
    return numpy is not None and issubclass(tp, numpy.generic)


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
    if tp is tuple or tp is list:
        if len(result) > max_items:
            out.append(("", CONTAINER, (tp.__name__, len(result))))
        for i, item in enumerate(result[:max_items]):
            capture(out, str(i), item, max_items, tensors, 1)
    elif isinstance(result, tuple) and hasattr(result, "_fields"):
        for name, item in list(zip(result._fields, result))[:max_items]:
            capture(out, name, item, max_items, tensors, 1)
    elif isinstance(result, dict):
        for i, (k, item) in enumerate(result.items()):
            if i >= max_items:
                out.append(("", CONTAINER, (tp.__name__, len(result))))
                break
            capture(out, _key_part(k, i), item, max_items, tensors, 1)
    else:
        capture(out, "0", result, max_items, tensors, 0)
    return out


def _truncate(text: str, limit: int) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return data[: max(limit - 3, 0)].decode("utf-8", "ignore") + "..."


def enum_value(value: enum.Enum) -> Any:
    """The value of an enum member when it is an attribute-safe scalar (``1``, ``"nhd"``), else None."""
    inner = value.value
    tp = type(inner)
    if tp is bool or tp is float or tp is str:
        return inner
    if tp is int:
        return inner if -(2**63) <= inner < 2**63 else str(inner)
    return None


def scalar_value(value: Any, limit: int) -> Any:
    """An attribute-safe form of a scalar: enums by name, dtypes and devices as strings."""
    if value is None:
        return "None"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, str):
        return _truncate(value, limit)
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        if value.bit_length() > 4000:  # str() refuses ints past 4300 digits
            return f"<int of {value.bit_length()} bits>"
        return _truncate(str(value), limit)  # OTLP ints are 64-bit
    return value


def to_attributes(
    prefix: str, raw: Sequence[tuple[str, int, Any]], limit: int, attrs: dict[str, Any]
) -> None:
    """Expand raw records into ``attrs`` under ``prefix`` (``otel_gpu.input.`` …)."""
    for key, kind, payload in raw:
        base = prefix + key if key else prefix.rstrip(".")
        if kind == TENSOR:
            if isinstance(payload, str):
                attrs[base + ".type"] = payload
                continue
            shape, dtype, device, stride, requires_grad, contiguous = payload
            attrs[base + ".shape"] = list(shape)[:64]
            attrs[base + ".dtype"] = str(dtype)
            attrs[base + ".device"] = str(device)
            if stride is not None:
                attrs[base + ".stride"] = list(stride)[:64]
            attrs[base + ".requires_grad"] = bool(requires_grad)
            attrs[base + ".is_contiguous"] = bool(contiguous)
        elif kind == VALUE:
            attrs[base + ".value"] = scalar_value(payload, limit)
            if isinstance(payload, enum.Enum):
                inner = enum_value(payload)
                if inner is not None:
                    attrs[base + ".enum_value"] = (
                        _truncate(inner, limit) if type(inner) is str else inner
                    )
        elif kind == CONTAINER:
            attrs[base + ".type"] = payload[0]
            attrs[base + ".length"] = payload[1]
        elif kind == OBJECT:
            qualname, text, oid = payload
            attrs[base + ".type"] = _truncate(qualname, limit)
            if text is not None:
                attrs[base + ".repr"] = _truncate(text, limit)
            else:
                attrs[base + ".id"] = f"0x{oid:x}"
        elif kind == DEFAULT:
            attrs[base + ".default"] = True
        elif kind == REDACTED:
            attrs[base + ".value"] = "<redacted>"
