"""Grouping spans by resource, then scope, as an ``ExportTraceServiceRequest`` nests them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["group_spans"]

T = TypeVar("T")


def group_spans(spans: Iterable[Any], encode: Callable[[Any], T]) -> dict[Any, dict[Any, list[T]]]:
    """``{resource: {scope: [encode(span), ...]}}`` in first-seen order, as the official encoders do."""
    groups: dict[Any, dict[Any, list[T]]] = {}
    last_resource: Any = groups  # a sentinel no span carries
    last_scope: Any = groups
    bucket: list[T] = []
    for span in spans:
        resource = span.resource
        scope = span.instrumentation_scope or None
        if resource is not last_resource or scope is not last_scope:
            # a batch mostly shares one resource and scope: hash them (Resource's hash dumps
            # its attributes as JSON) only when they change
            bucket = groups.setdefault(resource, {}).setdefault(scope, [])
            last_resource, last_scope = resource, scope
        bucket.append(encode(span))
    return groups
