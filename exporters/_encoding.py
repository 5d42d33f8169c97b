"""What the native OTLP encoders (JSON and protobuf) share: value rules, caches, the
per-attribute loop, warnings.

The loop (:meth:`CachingEncoder._attributes`) is one for both formats: each format's pieces are
bound before it starts, so a float or a cached attribute costs no Python call of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
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
    """What both native encoders keep: the caches, the per-attribute loop and the once-per-key
    warning. A format supplies its pieces: :attr:`_pack` or :attr:`_close` (a float after its
    key's prefix), :attr:`_sep`, :meth:`_double_prefix`, :meth:`_nonfinite`,
    :meth:`_fragment`, :meth:`_encode_resource` and :meth:`_encode_scope`. ``tag`` is the field that holds the attributes (the protobuf encoder's
    KeyValue fields differ by it; the JSON encoder passes one tag for all)."""

    _pack: Callable[[float], bytes] | None = None
    """A binary format's C-level packer of a float, NaN and the infinities included; None for a
    text format, where a finite float is its repr followed by :attr:`_close`."""
    _close = ""
    _sep: Any
    """What joins the encoded attributes of one list."""

    def __init__(self) -> None:
        self._warned: set[str] = set()
        # per tag (a protobuf fragment holds its field's tag byte): the attributes' fragments,
        # and the prefixes of float-valued ones by key
        self._caches: dict[Any, tuple[dict[Any, Any], dict[str, Any]]] = {}
        self._fixed: dict[Any, Any] = {}
        self._resources: dict[int, tuple[Any, Any]] = {}
        self._scopes: dict[int, tuple[Any, Any]] = {}
        self._link_lists: dict[int, tuple[Any, Any]] = {}

    def _double_prefix(self, tag: Any, key: str) -> Any:
        """Everything of a float-valued attribute before the float, kept in
        ``self._caches[tag][1]``."""
        raise NotImplementedError

    def _nonfinite(self, prefix: Any, value: float) -> Any:
        """A NaN or infinite float attribute of a text format, after its :meth:`_double_prefix`."""
        raise NotImplementedError

    def _fragment(self, tag: Any, key: str, value: Any) -> Any:
        """One whole attribute; :class:`Unencodable` (or any error) leaves it out."""
        raise NotImplementedError

    def _attributes(self, tag: Any, items: Iterable[tuple[str, Any]], out: list[Any]) -> None:
        """Append one encoded attribute per item; floats are never cached (-0.0 == 0.0)."""
        caches = self._caches.get(tag)
        if caches is None:
            caches = self._caches[tag] = ({}, {})
        cache, doubles = caches
        pack, close = self._pack, self._close
        # One loop for both formats, with the format's pieces bound above: a float or a cache
        # hit costs no Python call of its own (this is the export thread's hottest loop).
        for k, v in items:
            t = type(v)
            if t is float:  # statistics: never repeat, so skip the cache and the dispatch
                prefix = doubles.get(k) or self._double_prefix(tag, k)
                if pack is not None:  # the bytes of a double hold NaN and the infinities as is
                    out.append(prefix + pack(v))
                elif v - v == 0:  # text: a finite float is its repr
                    out.append(f"{prefix}{v!r}{close}")
                else:
                    out.append(self._nonfinite(prefix, v))
                continue
            if t is str:
                ck: Any = (k, v)
            elif t is int or t is bool:
                ck = (k, v, t)
            elif (t is list or t is tuple) and v and type(v[0]) is not float:
                ck = (k, tuple(v), type(v[0]))
            else:
                ck = None
            if ck is not None:
                fragment = cache.get(ck)
                if fragment is not None:  # hit: a dict lookup instead of encoding
                    out.append(fragment)
                    continue
            try:
                fragment = self._fragment(tag, k, v)
            except Exception as exc:
                self._skip(k, exc)
                continue
            if ck is not None:  # a miss: the call is paid once per new fragment
                self._remember(cache, ck, fragment, CACHE_MAX)
            out.append(fragment)

    def _joined(self, tag: Any, attributes: Any) -> Any:
        """A list of attributes encoded and joined (empty for none)."""
        if not attributes:
            return self._sep[:0]
        out: list[Any] = []
        self._attributes(tag, attribute_items(attributes), out)
        return self._sep.join(out)

    def _span_attributes(self, tag: Any, span: Any, out: list[Any]) -> None:
        """Append a span's attributes; those its ``fixed`` hint ``(key, n)`` marks constant are
        encoded once per key, as one piece."""
        attributes = span.attributes
        fixed = getattr(span, "fixed", None)
        items = attribute_items(attributes)
        if fixed is not None and fixed[1] > 0:
            constant = self._fixed.get(fixed)
            if constant is None:  # first span of this key: encode its constant head once
                head: list[Any] = []
                self._attributes(tag, islice(items, fixed[1]), head)
                constant = self._sep.join(head)
                self._remember(self._fixed, fixed, constant, CACHE_MAX)
                items = attribute_items(attributes)
            if constant:
                out.append(constant)
            if len(attributes) <= fixed[1]:
                return  # all constant (level 1): no loop over nothing
            items = islice(items, fixed[1], None)
        self._attributes(tag, items, out)

    def _resource(self, resource: Any) -> Any:
        """:meth:`_encode_resource`, once per resource object."""
        return self._once(self._resources, resource, self._encode_resource)

    def _scope(self, scope: Any) -> Any:
        """:meth:`_encode_scope`, once per scope object."""
        return self._once(self._scopes, scope, self._encode_scope)

    def _links(self, links: Any) -> Any:
        """:meth:`_encode_links`; a tuple once per tuple object: a batch step's spans share one
        (otel_gpu.batch), so its links are encoded once per step, not once per span."""
        if type(links) is not tuple:
            return self._encode_links(links)
        return self._once(self._link_lists, links, self._encode_links)

    def _once(self, table: dict[int, Any], obj: Any, encode: Callable[[Any], Any]) -> Any:
        """``encode(obj)``, kept in ``table`` by the object's identity (the entry holds the
        object, so a reused id is never taken for it)."""
        hit = table.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        encoded = encode(obj)
        self._remember(table, id(obj), (obj, encoded))
        return encoded

    def _encode_links(self, links: Any) -> Any:
        """A span's links, encoded and joined (a format's field tags included)."""
        raise NotImplementedError

    def _encode_resource(self, resource: Any) -> Any:
        raise NotImplementedError

    def _encode_scope(self, scope: Any) -> Any:
        raise NotImplementedError

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
