"""What the native OTLP encoders (JSON and protobuf) share: value rules, caches, warnings.

The per-attribute loops stay in each encoder (``_attributes``): a helper there would cost a
Python call per attribute on the export thread's hottest path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from opentelemetry.attributes import BoundedAttributes

__all__ = [
    "CACHE_MAX",
    "INT64_MAX",
    "INT64_MIN",
    "SMALL_CACHE_MAX",
    "CachingEncoder",
    "Unencodable",
    "attribute_items",
    "plain",
]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
CACHE_MAX = 4096  # attribute fragments kept per encoder; cleared wholesale when full
SMALL_CACHE_MAX = 256  # resources, scopes, names

_logger = logging.getLogger("otel_gpu.exporters")
T = TypeVar("T")


class Unencodable(Exception):
    """A value the OTLP encoders refuse (an int outside int64, an unknown type)."""


def attribute_items(attributes: Any) -> Iterable[tuple[str, Any]]:
    if type(attributes) is BoundedAttributes:
        # its Mapping-ABC items() costs a Python-level __getitem__ per key
        return attributes._dict.items()
    return attributes.items()


def plain(v: Any) -> Any:
    """A value of a type otel-gpu never produces, in the official encoder's order: subclasses of
    bool, str, int and float as their base type, other sequences as lists; ``None``, bytes and
    mappings unchanged (each format encodes those itself). :class:`Unencodable` otherwise."""
    if v is None:
        return v
    for base in (bool, str, int, float):
        if isinstance(v, base):
            return base(v)
    if isinstance(v, (bytes, Mapping)):
        return v
    if isinstance(v, Sequence):
        return list(v)
    raise Unencodable(f"invalid attribute type {type(v).__name__}")


class CachingEncoder:
    """The caches and the once-per-key warning both native encoders keep."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def _skip(self, key: str, exc: Exception) -> None:
        """An attribute that cannot be encoded is left out, with one warning per key."""
        if key not in self._warned and len(self._warned) < SMALL_CACHE_MAX:
            self._warned.add(key)
            _logger.warning("attribute %r not exported: %s", key, exc)

    @staticmethod
    def _remember(cache: dict[Any, T], key: Any, value: T, limit: int = SMALL_CACHE_MAX) -> T:
        """Keep ``value`` under ``key``; a full cache is cleared wholesale (names, resources
        and scopes repeat, so it refills with what is in use)."""
        if len(cache) >= limit:
            cache.clear()
        cache[key] = value
        return value
