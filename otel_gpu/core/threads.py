"""Running a step that may block (a network flush, user code) without holding the caller."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from otel_gpu import _guard

__all__ = ["bounded_call"]


def bounded_call(fn: Callable[[], Any], timeout: float) -> Any:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` s: exit must never hang on a
    network. Returns what ``fn`` returned, or None when it failed or did not finish in time."""
    result: list[Any] = []

    def target() -> None:
        try:
            result.append(fn())
        except Exception as exc:
            _guard.logger.debug("otel-gpu flush failed: %s", exc)

    worker = threading.Thread(target=target, name="otel-gpu-flush", daemon=True)
    worker.start()
    worker.join(timeout)
    return result[0] if result else None
