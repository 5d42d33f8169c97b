"""The statistics record of one tensor and its span event's attributes.

Filled on the caller's thread by :mod:`otel_gpu.calls.stats` (or from a CUDA graph's replay by
:mod:`otel_gpu.devices.cuda_graphs`), turned into an ``otel_gpu.stats`` event on the export
thread. Part of the core: no torch, nothing of otel-gpu but ``attributes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.attributes import (
    STATS_AMAX,
    STATS_DYNAMIC_RANGE,
    STATS_FINGERPRINT,
    STATS_INF_COUNT,
    STATS_MAX,
    STATS_MEAN,
    STATS_MIN,
    STATS_NAN_COUNT,
    STATS_NONFINITE_SEEN,
    STATS_NOTE,
    STATS_NUMEL,
    STATS_OVERFLOW,
    STATS_SATURATION,
    STATS_SIMULATED_FORMAT,
    STATS_STD,
    STATS_TENSOR,
    STATS_UNDERFLOW,
    STATS_ZERO_FRACTION,
)

__all__ = [
    "CAPTURED_ROW",
    "Extra",
    "FingerprintSpec",
    "IntExtremesSpec",
    "LowpSpec",
    "TensorStats",
    "captured_stats",
    "event_attributes",
    "fill",
    "fill_extras",
    "fingerprint_hex",
    "join_note",
]

CAPTURED_ROW = 7
"""Values per tensor in a captured call's buffer: NaN and Inf counts, finite count, min, max,
mean and the sum of squared deviations."""


_MASK = (1 << 64) - 1
_LENGTH = 0x2545F4914F6CDD1D  # the fingerprint's length term: n words add n * _LENGTH


def fingerprint_hex(lo: float, hi: float, words: int) -> str:
    """The fingerprint (:mod:`otel_gpu.calls.fingerprint`) from its sum's two signed 32-bit
    halves, read back as floats, and its word count: 16 hex digits."""
    h = (((int(hi) & 0xFFFFFFFF) << 32 | (int(lo) & 0xFFFFFFFF)) + words * _LENGTH) & _MASK
    # a bijective finaliser (splitmix64's): equal sums stay equal, the digits look random
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return format(h ^ (h >> 31), "016x")


@dataclass(frozen=True)
class FingerprintSpec:
    """Two columns of a statistics vector: the fingerprint's sum over ``words`` words."""

    words: int
    width = 2

    def fill(self, values: dict[str, Any], part: list[float]) -> None:
        values[STATS_FINGERPRINT] = fingerprint_hex(part[0], part[1], self.words)


@dataclass(frozen=True)
class IntExtremesSpec:
    """Four columns of a 64-bit integer tensor's vector: its min and max, each as a high half
    (floor of x / 2**32) and a low half (x mod 2**32), every half exact in a float64. The
    moments' min and max pass through float64, which rounds above 2**53 (2**63 - 1 becomes
    2**63, beyond int64); these replace them with the exact values."""

    width = 4

    def fill(self, values: dict[str, Any], part: list[float]) -> None:
        values[STATS_MIN] = int(part[0]) * 2**32 + int(part[1])
        values[STATS_MAX] = int(part[2]) * 2**32 + int(part[3])


@dataclass(frozen=True)
class LowpSpec:
    """Low-precision statistics' columns (:mod:`otel_gpu.calls.lowp`): amax, the smallest
    non-zero magnitude, the zero count, the count at the format's max (stored) or beyond it
    (``simulated``), and, simulated, the underflow count; ``count`` values in all."""

    format: str
    max: float
    simulated: bool
    count: int

    @property
    def width(self) -> int:
        return 5 if self.simulated else 4

    def fill(self, values: dict[str, Any], part: list[float]) -> None:
        amax, smallest, zeros, top = part[:4]
        n = self.count
        if amax >= 0:  # -1: no finite value
            values[STATS_AMAX] = amax
            if amax > 0 and 0 < smallest < math.inf:
                values[STATS_DYNAMIC_RANGE] = math.log2(amax / smallest)
        values[STATS_ZERO_FRACTION] = zeros / n
        if self.simulated:
            values[STATS_UNDERFLOW] = part[4] / n
            values[STATS_OVERFLOW] = top / n
            values[STATS_SIMULATED_FORMAT] = self.format
        else:
            values[STATS_SATURATION] = top / n


Extra = FingerprintSpec | IntExtremesSpec | LowpSpec
"""What follows the moments in a tensor's statistics vector, one spec per group of columns."""


def fill_extras(stats: TensorStats, extras: tuple[Extra, ...], tail: list[float]) -> None:
    """The values of ``extras`` from ``tail``, the vector's columns after the moments."""
    i = 0
    for spec in extras:
        spec.fill(stats.values, tail[i : i + spec.width])
        i += spec.width


@dataclass
class TensorStats:
    """The statistics of one tensor, as plain Python values ready for a span event."""

    key: str
    numel: int
    values: dict[str, float | int] = field(default_factory=dict)
    note: str | None = None

    @property
    def nonfinite(self) -> bool:
        values = self.values
        return bool(
            values.get(STATS_NAN_COUNT, 0)
            or values.get(STATS_INF_COUNT, 0)
            or values.get(STATS_NONFINITE_SEEN, False)
        )


def event_attributes(stats: TensorStats) -> dict[str, Any]:
    """The attributes of one ``otel_gpu.stats`` span event."""
    attrs: dict[str, Any] = {STATS_TENSOR: stats.key, STATS_NUMEL: stats.numel}
    attrs.update(stats.values)
    if stats.note:
        attrs[STATS_NOTE] = stats.note
    return attrs


def captured_stats(
    key: str,
    numel: int,
    note: str | None,
    integer: bool,
    row: list[float],
    extras: tuple[Extra, ...] = (),
    moments: bool = True,
) -> TensorStats:
    """The statistics of one tensor from its row of a captured call's buffer, read after a
    replay: :data:`CAPTURED_ROW` moments (unless ``moments`` is False: a dtype torch has no
    arithmetic for), then the columns of ``extras``."""
    stats = TensorStats(key, numel, note=note)
    if not moments:
        fill_extras(stats, extras, row)
        return stats
    nan_n, inf_n, n_finite, lo, hi, mean, m2 = row[:CAPTURED_ROW]
    values = stats.values
    if not integer:
        values[STATS_NAN_COUNT] = int(nan_n)
        values[STATS_INF_COUNT] = int(inf_n)
    if n_finite == 0:
        stats.note = join_note(stats.note, "no finite values: min/max/mean/std left out")
    else:
        std = math.sqrt(max(m2, 0.0) / (n_finite - 1)) if n_finite > 1 else None
        fill(stats, integer, lo, hi, mean, std)
        if nan_n or inf_n:
            stats.note = join_note(stats.note, "min/max/mean/std over finite values only")
    fill_extras(stats, extras, row[CAPTURED_ROW:])  # last: exact int extremes replace min/max
    return stats


def fill(
    stats: TensorStats, integer: bool, mn: float, mx: float, mean: float, std: float | None
) -> None:
    """min/max (ints for integer tensors), mean, std or why not, and zero NaN/Inf counts."""
    values = stats.values
    if integer and stats.note and stats.note.startswith("integer"):
        values[STATS_MIN], values[STATS_MAX] = int(mn), int(mx)
    else:
        values[STATS_MIN], values[STATS_MAX] = mn, mx
    values[STATS_MEAN] = mean
    if std is not None:
        values[STATS_STD] = std
    elif stats.note is None:
        stats.note = "std needs at least 2 elements"
    if not integer:
        values.setdefault(STATS_NAN_COUNT, 0)
        values.setdefault(STATS_INF_COUNT, 0)


def join_note(a: str | None, b: str) -> str:
    """Two notes as one (``a; b``), or ``b`` alone."""
    return b if not a else f"{a}; {b}"
