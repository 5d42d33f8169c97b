"""The flight recorder's limits: how many calls and bytes it may dump, changed at runtime.

``OTEL_GPU_DUMP_MAX_COUNT`` and ``OTEL_GPU_DUMP_MAX_SIZE_GB`` set them at configuration;
:func:`set_limits` changes them while the program runs (for the running recorder and those built
later in this process), and ``None`` returns a limit to its configured value.

When a limit is reached, the recorder leaves a note in its dump folder,
``.not-dumped-<pid>-<token>.json``, which ``otel-gpu replay`` reads to say that calls of that
process have no dump (:func:`write_note`, :func:`read_notes`: the note's writer and reader).
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from typing import Any, NamedTuple, Protocol

from otel_gpu import _files
from otel_gpu.config import Settings

__all__ = [
    "NOTE_PREFIX",
    "Limits",
    "configured",
    "in_force",
    "read_notes",
    "set_limits",
    "watch",
    "write_note",
]

NOTE_PREFIX = ".not-dumped-"
MAX_CALLS = 1_000_000  # as OTEL_GPU_DUMP_MAX_COUNT allows
MAX_BYTES = 1_048_576 << 30  # as OTEL_GPU_DUMP_MAX_SIZE_GB allows (1048576 GB)
_NOTE_FORMAT = "otel-gpu.not-dumped/1"
_MAX_NOTE_BYTES = 64 << 10
_MAX_NOTES = 1000


class Limits(NamedTuple):
    max_calls: int
    """Calls the recorder may dump."""
    max_bytes: int
    """Bytes of tensors it may write, inputs and outputs, counted before copying."""


class _Limited(Protocol):
    settings: Settings

    def apply_limits(self, limits: Limits) -> None: ...


_lock = threading.Lock()
_override: dict[str, int | None] = {"max_calls": None, "max_bytes": None}
_live: weakref.WeakSet[_Limited] = weakref.WeakSet()


def configured(settings: Settings) -> Limits:
    """The limits ``settings`` set (``OTEL_GPU_DUMP_MAX_COUNT``, ``OTEL_GPU_DUMP_MAX_SIZE_GB``)."""
    return Limits(settings.dump_max_count, int(settings.dump_max_size_gb * (1 << 30)))


def in_force(settings: Settings) -> Limits:
    """The limits a recorder built with ``settings`` starts with: those :func:`set_limits` set,
    else the configured ones."""
    base = configured(settings)
    with _lock:
        calls, nbytes = _override["max_calls"], _override["max_bytes"]
    return Limits(
        base.max_calls if calls is None else calls, base.max_bytes if nbytes is None else nbytes
    )


def watch(recorder: _Limited) -> None:
    """Tell ``recorder`` (``apply_limits``) when :func:`set_limits` changes the limits."""
    with _lock:
        _live.add(recorder)


def _whole(name: str, value: Any, low: int, high: int) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise ValueError(
            f"{name} must be a whole number >= {low} and <= {high}, or None, not {value!r}"
        )
    return value


def set_limits(max_calls: int | None = None, max_bytes: int | None = None) -> None:
    """Change the flight recorder's limits now, for the running recorder (level 10) and those
    built later in this process; ``None`` gives a limit back its configured value.

    A raised limit lets dumping resume; a lowered one applies from the next call. Each limit
    reached after a change is warned about once more. ``ValueError`` (naming the argument and
    what is allowed, nothing changed) for a value that is not a whole number in range.
    """
    calls = _whole("max_calls", max_calls, 1, MAX_CALLS)
    nbytes = _whole("max_bytes", max_bytes, 0, MAX_BYTES)
    with _lock:
        _override["max_calls"], _override["max_bytes"] = calls, nbytes
        recorders = list(_live)
    for recorder in recorders:
        recorder.apply_limits(in_force(recorder.settings))


def write_note(root: str, name: str, body: dict[str, Any]) -> None:
    """Write (or replace) the note ``name`` in the dump folder ``root``, atomically."""
    data = json.dumps({"format": _NOTE_FORMAT, **body}).encode("utf-8")
    _files.write_atomic_bytes(root, name, data)


def read_notes(path: str) -> list[dict[str, Any]]:
    """The notes in the dump folder ``path``, each ``{"pid", "reason", "limit", "skipped"}``
    checked (a file that is not such a note, or a link, is left out), by pid."""
    try:
        names = sorted(
            n for n in os.listdir(path) if n.startswith(NOTE_PREFIX) and n.endswith(".json")
        )
    except OSError:
        return []
    notes = []
    for name in names[:_MAX_NOTES]:
        try:
            fd = os.open(os.path.join(path, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                body = json.loads(f.read(_MAX_NOTE_BYTES + 1))
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(body, dict) or body.get("format") != _NOTE_FORMAT:
            continue
        pid, skipped, reason, limit = (body.get(k) for k in ("pid", "skipped", "reason", "limit"))
        if type(pid) is int and type(skipped) is int and skipped >= 0:
            if reason in ("max_count", "max_size") and isinstance(limit, str):
                notes.append(
                    {"pid": pid, "reason": reason, "limit": limit[:200], "skipped": skipped}
                )
    return sorted(notes, key=lambda n: n["pid"])
