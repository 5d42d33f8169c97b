"""Never break the host: one place that decides what an internal error does.

An internal failure (metadata, statistics, rendering, export) is logged once per
kind and swallowed, so the observed program keeps running. In strict mode
(``OTEL_GPU_STRICT=true``, or ``configure(strict=True)``, which the pytest plugin's
``otel_gpu_spans`` fixture sets by default)
it is re-raised instead, so tests catch it.

The user's own exceptions never pass through here: the wrapper re-raises them
itself, untouched.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

__all__ = ["internal_error", "internal_error_counts", "set_strict", "warn_once"]

logger = logging.getLogger("otel_gpu")

_strict = False
_seen: set[str] = set()
_counts: Counter[str] = Counter()
_lock = threading.Lock()


def set_strict(strict: bool) -> None:
    """Re-raise internal errors (tests) or log them once per kind (default)."""
    global _strict
    _strict = bool(strict)


def is_strict() -> bool:
    return _strict


def internal_error(kind: str, exc: BaseException) -> None:
    """Report an internal error of ``kind``. Call from an ``except`` block in otel-gpu's own code."""
    with _lock:
        _counts[kind] += 1
        first = kind not in _seen
        _seen.add(kind)
    if _strict:
        raise exc
    if first:
        logger.warning(
            "otel-gpu internal error in %s (reported once; your code should still be running "
            "fine): %s: %s",
            kind,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )


def warn_once(kind: str, message: str, *args: object) -> None:
    """Log a warning the first time ``kind`` occurs in this process."""
    with _lock:
        if kind in _seen:
            _counts[kind] += 1
            return
        _seen.add(kind)
        _counts[kind] += 1
    logger.warning(message, *args)


def internal_error_counts() -> dict[str, int]:
    """How often each kind of internal error or warning happened in this process."""
    with _lock:
        return dict(_counts)


def _reset() -> None:
    with _lock:
        _seen.clear()
        _counts.clear()
