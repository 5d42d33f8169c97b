"""What a trace reader shows of a span's device readings: its device time, else the host's; memory.

A span's own start and end are the host's: when the call was entered and when it returned. A
CUDA kernel runs after its launch returns, so for an asynchronous call the host duration is its
launch time. Where the device-time resolver measured the call's GPU work, the span carries
``otel_gpu.device.duration`` (seconds); where it gave up waiting, ``otel_gpu.device.unresolved``.
The readers (``show``, ``ranks``) show the device time when it is there and say which they show.
Memory per call (``otel_gpu.device.memory.*``) is shown as the allocated delta, the peak, and on
an out-of-memory error the allocator's summary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from otel_gpu.attributes import (
    MEMORY_ALLOCATED,
    MEMORY_ALLOCATED_DELTA,
    MEMORY_DEVICE_FREE,
    MEMORY_LARGEST_FREE_BLOCK,
    MEMORY_PEAK,
    MEMORY_RESERVED,
)

__all__ = [
    "DEVICE_DURATION",
    "DEVICE_UNRESOLVED",
    "Clocks",
    "human",
    "memory",
    "seconds",
    "unresolved",
]

DEVICE_DURATION = "otel_gpu.device.duration"  # seconds of GPU work (the device-time resolver)
DEVICE_UNRESOLVED = "otel_gpu.device.unresolved"  # true: its GPU work had not finished in time
DEVICE_PREFIX = "otel_gpu.device."  # the keys the readers keep when they read a span


def seconds(attrs: Mapping[str, Any]) -> float | None:
    """The span's device duration in seconds, or None when it has none (or not a number ≥ 0)."""
    value = attrs.get(DEVICE_DURATION)
    if (type(value) is float or type(value) is int) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def unresolved(attrs: Mapping[str, Any]) -> bool:
    """Whether the span says its device time was not resolved (its GPU work had not finished
    when the span was exported)."""
    return attrs.get(DEVICE_UNRESOLVED) is True


def human(ns: float) -> str:
    """``8.27 ms``, ``72.1 µs``, ``950 ns``: three significant digits."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns" if ns != int(ns) else f"{int(ns)} ns"


class Clocks:
    """Which clocks the durations of a listing or an aggregate came from, to label it."""

    __slots__ = ("device", "host")

    def __init__(self) -> None:
        self.device = 0
        self.host = 0

    def add(self, device: bool) -> None:
        if device:
            self.device += 1
        else:
            self.host += 1

    @property
    def name(self) -> str:
        """``host``, ``device`` or ``mixed`` (``""`` when nothing was added)."""
        if self.device and self.host:
            return "mixed"
        return "device" if self.device else ("host" if self.host else "")

    def label(self) -> str:
        """A phrase naming the clocks: ``host time``, ``device time`` or, mixed, both."""
        name = self.name
        if name == "mixed":
            return "device time where measured, host time otherwise"
        return f"{name} time" if name else ""


def _bytes(n: int) -> str:
    """``64 MiB``, ``1.5 GiB``, ``512 B``: binary units, three significant digits."""
    size = float(abs(n))
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{'-' if n < 0 else ''}{size / scale:.3g} {unit}"
    return f"{n} B"


def memory(attrs: Mapping[str, Any]) -> str:
    """``mem +64 MiB peak 1.2 GiB``; on an out-of-memory error also ``reserved …, allocated …,
    largest free block …, device free …``; ``""`` when the span has no memory attribute."""
    parts = []
    delta = attrs.get(MEMORY_ALLOCATED_DELTA)
    if type(delta) is int:
        parts.append(f"mem {'+' if delta >= 0 else ''}{_bytes(delta)}")
    peak = attrs.get(MEMORY_PEAK)
    if type(peak) is int:
        parts.append(f"peak {_bytes(peak)}")
    summary = [
        f"{label} {_bytes(value)}"
        for key, label in (
            (MEMORY_RESERVED, "reserved"),
            (MEMORY_ALLOCATED, "allocated"),
            (MEMORY_LARGEST_FREE_BLOCK, "largest free block"),
            (MEMORY_DEVICE_FREE, "device free"),
        )
        if type(value := attrs.get(key)) is int
    ]
    if summary:
        parts.append("out of memory: " + ", ".join(summary))
    return " ".join(parts)
