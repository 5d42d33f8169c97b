"""The input metadata of a journal slot: its encoding (the writer, on the caller's thread) and
its decoding (the reader, on anything a file may hold), one format in one place.

A record is a plain tuple of builtins, ``(key, kind, *atoms)``, one per entry of
:mod:`otel_gpu.calls.metadata`'s raw records; a slot holds their pickle. Objects keep only their
type name. The decoder loads no globals and accepts exactly the shapes :func:`compact` writes.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from otel_gpu.calls import metadata

__all__ = ["compact", "decode", "encode", "key_of"]

_kind = metadata.kind_of
_TENSOR, _VALUE, _CONTAINER, _OBJECT = (
    metadata.TENSOR,
    metadata.VALUE,
    metadata.CONTAINER,
    metadata.OBJECT,
)
_KEY_LIMIT = 256

# --------------------------------------------------------------------------- encoding

_texts: dict[Any, str] = {}


def _text(value: Any) -> str:
    # str(torch.dtype) costs ~0.3 µs; there are only a few dtypes and devices.
    try:
        text = _texts.get(value)
    except TypeError:
        return str(value)
    if text is None:
        text = str(value)
        if len(_texts) < 256:
            _texts[value] = text
    return text


def compact(raw: Any, limit: int) -> list[tuple[Any, ...]]:
    """Plain tuples of builtins for ``metadata`` records: cheap to pickle, safe to load.

    Objects keep only their type name: their repr could be slow or raise, and must not run
    on the caller's thread.
    """
    out: list[tuple[Any, ...]] = []
    append = out.append
    for key, kind, payload in raw:
        if len(key) > _KEY_LIMIT:
            key = key[:_KEY_LIMIT]
        if kind == _TENSOR:
            if type(payload) is tuple:
                shape, dtype, device, stride, grad, contiguous = payload
                append(
                    (
                        key,
                        kind,
                        tuple(shape) if len(shape) <= 64 else tuple(shape[:64]),
                        _text(dtype),
                        _text(device),
                        stride if stride is None or len(stride) <= 64 else tuple(stride[:64]),
                        bool(grad),
                        bool(contiguous),
                    )
                )
            else:
                append((key, kind, str(payload)[:limit]))
        elif kind == _VALUE:
            tp = type(payload)
            if tp is str:
                value: Any = payload[:limit]
            elif tp is int:
                value = (
                    payload
                    if -(2**63) <= payload < 2**63
                    else f"<int of {payload.bit_length()} bits>"
                )
            elif tp is float or tp is bool or payload is None:
                value = payload
            else:  # enum, torch.dtype, torch.device
                value = metadata.scalar_value(payload, limit)
                if type(value) is not str:
                    value = str(value)[:limit]
            append((key, kind, value))
        elif kind == _CONTAINER:
            append((key, kind, str(payload[0])[:limit], int(payload[1])))
        elif kind == _OBJECT:
            append((key, kind, str(payload[0])[:limit]))  # the type; its repr is not journaled
        else:  # DEFAULT, REDACTED: no payload (a redacted value is never written)
            append((key, kind))
    return out


def key_of(raw: Any) -> Any:
    """``raw`` with each object's payload cut to its type name (all that :func:`compact` keeps of
    it); ``raw`` itself when it holds no object."""
    if _OBJECT not in map(_kind, raw):  # one C-level pass
        return raw
    return tuple([(k, kind, p[0]) if kind == _OBJECT else (k, kind, p) for k, kind, p in raw])


def encode(raw: Any, limit: int, capacity: int) -> tuple[bytes, bool]:
    """Pickled compact records, cut to ``capacity`` bytes by dropping trailing records."""
    entries = compact(raw, limit)
    blob = pickle.dumps(entries, 5)
    truncated = False
    while len(blob) > capacity and entries:
        keep = min(len(entries) - 1, int(len(entries) * capacity / len(blob) * 0.9))
        entries = entries[: max(keep, 0)]
        blob = pickle.dumps(entries, 5)
        truncated = True
    return blob, truncated


# --------------------------------------------------------------------------- decoding


class _NoGlobals(pickle.Unpickler):
    """Journal entries are tuples of builtins: refuse anything that would import or call."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"journal entries hold no objects ({module}.{name})")


def decode(blob: bytes) -> list[tuple[Any, ...]]:
    """The compact input records of a journal slot (raises on anything malformed).

    Each record must have exactly the shape the journal writes (:func:`compact`): a key,
    a kind and atoms (str, int, float, bool, None, tuples of ints). Anything else, such as a
    nested container (a nesting bomb) or a shared reference expanding on a walk, is refused
    before it is used.
    """
    entries = _NoGlobals(io.BytesIO(blob)).load()
    if not isinstance(entries, list) or not all(map(_valid_record, entries)):
        raise ValueError("malformed journal input records")
    return entries


_ATOMS = (str, int, float, bool, type(None))


def _ints(value: Any) -> bool:
    return type(value) is tuple and all(type(v) is int for v in value)


def _valid_record(e: Any) -> bool:
    """Whether ``e`` is one of the record shapes :func:`compact` writes."""
    if type(e) is not tuple or len(e) < 2 or type(e[0]) is not str or type(e[1]) is not int:
        return False
    kind, payload = e[1], e[2:]
    if kind == metadata.TENSOR:
        if len(payload) == 1:
            return type(payload[0]) is str
        return (
            len(payload) == 6
            and _ints(payload[0])
            and type(payload[1]) is str
            and type(payload[2]) is str
            and (payload[3] is None or _ints(payload[3]))
            and type(payload[4]) is bool
            and type(payload[5]) is bool
        )
    if kind == metadata.VALUE:
        return len(payload) == 1 and type(payload[0]) in _ATOMS
    if kind == metadata.CONTAINER:
        return len(payload) == 2 and type(payload[0]) is str and type(payload[1]) is int
    if kind == metadata.OBJECT:
        return len(payload) == 1 and type(payload[0]) is str
    return kind in (metadata.DEFAULT, metadata.REDACTED) and not payload
