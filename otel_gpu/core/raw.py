"""Raw metadata records: the kinds the caller's thread captures, and their attributes.

A call's inputs and outputs are captured as ``(key, kind, payload)`` tuples of atoms
(:mod:`otel_gpu.calls.metadata`); the export thread turns them into span attributes with
:func:`to_attributes`. Part of the core: it imports nothing of otel-gpu and no torch (a
payload that is a torch dtype or device implies torch is imported).
"""

from __future__ import annotations

import enum
import operator
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CONTAINER",
    "DEFAULT",
    "MAX_VALUE_BYTES",
    "OBJECT",
    "REDACTED",
    "TENSOR",
    "VALUE",
    "enum_value",
    "kind_of",
    "payload_of",
    "scalar_value",
    "to_attributes",
    "truncate",
]

# Raw record kinds.
TENSOR = (
    0  # payload: (shape, dtype, device, stride, requires_grad, is_contiguous) or an error string
)
VALUE = 1  # payload: a scalar, enum, dtype or device
CONTAINER = 2  # payload: (type name, length)
OBJECT = 3  # payload: (type qualname, repr or None, id), taken at call time
DEFAULT = 4  # payload: True, marks a parameter whose default was used
REDACTED = 5  # payload: None

MAX_VALUE_BYTES = 2048  # Tempo's default cut for attribute values

kind_of = operator.itemgetter(1)
"""The kind of a raw record (a C-level getter: mapped over every record of a call)."""
payload_of = operator.itemgetter(2)
"""The payload of a raw record (a C-level getter: mapped over every record of a call)."""


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` UTF-8 bytes, ending in ``...`` when cut."""
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
    torch = sys.modules.get("torch")  # a dtype or device payload means torch is imported
    if torch is not None and isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, str):
        return truncate(value, limit)
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        if value.bit_length() > 4000:  # str() refuses ints past 4300 digits
            return f"<int of {value.bit_length()} bits>"
        return truncate(str(value), limit)  # OTLP ints are 64-bit
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
                        truncate(inner, limit) if type(inner) is str else inner
                    )
        elif kind == CONTAINER:
            attrs[base + ".type"] = payload[0]
            attrs[base + ".length"] = payload[1]
        elif kind == OBJECT:
            qualname, text, oid = payload
            attrs[base + ".type"] = truncate(qualname, limit)
            if text is not None:
                attrs[base + ".repr"] = truncate(text, limit)
            else:
                attrs[base + ".id"] = f"0x{oid:x}"
        elif kind == DEFAULT:
            attrs[base + ".default"] = True
        elif kind == REDACTED:
            attrs[base + ".value"] = "<redacted>"
