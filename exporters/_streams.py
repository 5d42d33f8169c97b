"""The text stream an exporter writes to: flushed and closed under the exporter's lock."""

from __future__ import annotations

import threading
from typing import IO

__all__ = ["close", "flush"]


def flush(stream: IO[str], lock: threading.Lock) -> bool:
    """Flush ``stream`` unless it is closed; False when flushing failed (never raises)."""
    try:
        with lock:
            if not stream.closed:
                stream.flush()
    except Exception:
        return False
    return True


def close(stream: IO[str], lock: threading.Lock, owned: bool) -> None:
    """Close ``stream`` if the exporter opened or was given ownership of it."""
    if owned:
        with lock:
            stream.close()
