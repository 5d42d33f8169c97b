"""The flight recorder's limits: how many calls and bytes it may dump, changed at runtime.

``OTEL_GPU_DUMP_MAX_COUNT`` and ``OTEL_GPU_DUMP_MAX_SIZE_GB`` set them at configuration;
:func:`set_limits` changes them while the program runs (for the running recorder and those built
later in this process), and ``None`` returns a limit to its configured value.

Every path that writes a dump counts against them, in one :class:`Budget` per configuration:
the level-10 recorder's calls, its CUDA-graph snapshots, and the ring's dumps (a trigger rule's
``dump``, a raised or non-finite call, a stuck call, SIGTERM, ``otel-gpu snapshot``). The first
time a limit is reached one warning line says so, whichever path reached it; later refusals cost
a lock and a comparison.

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

from otel_gpu import _files, _guard
from otel_gpu.config import Settings

__all__ = [
    "NOTE_PREFIX",
    "Budget",
    "Limits",
    "budget",
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


class Budget:
    """The dump limits in force for one configuration and what its dump paths have used.

    :func:`budget` hands the recorder and the ring built from one ``Settings`` the same budget,
    so the calls and bytes they write below the dump folder add up against one limit.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        limits = in_force(settings)  # the settings', or what set_limits() set since
        self.max_calls = limits.max_calls
        self.max_bytes = limits.max_bytes
        self.count = 0
        """Calls written (or being written) by every path."""
        self.used = 0
        """Bytes of tensors counted for them."""
        self.skipped = 0
        """Calls not written because a limit was reached."""
        self._warned: set[str] = set()  # the limits warned about since they last changed
        self._lock = threading.Lock()

    def reserve(self, calls: int, nbytes: int) -> tuple[str | None, bool]:
        """Count ``calls`` calls and ``nbytes`` bytes, before anything is copied: ``(None,
        False)`` when they fit; else ``(reason, first)``, ``reason`` ``max_count`` or
        ``max_size`` and nothing counted, ``first`` true the first time that limit refused
        (since the limits last changed). The first refusal of each limit logs one warning."""
        with self._lock:
            if calls and self.count + calls > self.max_calls:
                reason = "max_count"
            elif self.used + nbytes > self.max_bytes:
                reason = "max_size"
            else:
                self.count += calls
                self.used += nbytes
                return None, False
            self.skipped += calls
            first = reason not in self._warned
            self._warned.add(reason)
            limit = self.limit_text(reason)
        if first:  # once per limit, and once more after set_limits() changed them
            _guard.logger.warning(
                "otel-gpu dumps: %s reached; further dumps are not written (level-10 calls carry "
                "otel_gpu.dump.skipped=%s and otel-gpu replay says they have no dump; ring and "
                "trigger dumps are left out). This is reported once (again if the limits change "
                "at runtime).",
                limit,
                reason,
            )
        return reason, first

    def limit_text(self, reason: str) -> str:
        """The limit ``reason`` names, as the user set it."""
        base = configured(self.settings)
        if reason == "max_count":
            if self.max_calls == base.max_calls:
                return f"OTEL_GPU_DUMP_MAX_COUNT={self.max_calls}"
            return f"the dump limit of {self.max_calls} calls (set at runtime)"
        if self.max_bytes == base.max_bytes:
            return f"OTEL_GPU_DUMP_MAX_SIZE_GB={self.settings.dump_max_size_gb:g}"
        return f"the dump limit of {self.max_bytes} bytes (set at runtime)"

    def apply_limits(self, limits: Limits) -> None:
        """New limits (:func:`set_limits`), from the next reservation on."""
        with self._lock:
            self.max_calls, self.max_bytes = limits.max_calls, limits.max_bytes
            self._warned.clear()


_budgets: dict[int, weakref.ref[Budget]] = {}


def budget(settings: Settings) -> Budget:
    """The budget of the observers built from ``settings`` (this very object): one shared by
    the recorder and the ring; a reconfiguration (new settings) starts a new one."""
    made = Budget(settings)  # reads the limits in force, under the lock: built before taking it
    with _lock:
        ref = _budgets.get(id(settings))
        found = ref() if ref is not None else None
        if found is not None and found.settings is settings:
            return found
        for key in [k for k, r in _budgets.items() if r() is None]:
            del _budgets[key]
        _budgets[id(settings)] = weakref.ref(made)
        _live.add(made)  # as watch() does, under the lock already held
    return made


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
