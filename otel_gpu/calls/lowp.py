"""Low-precision statistics at level 5: float8, float4 and block-scale tensors, and what a wide
tensor would lose if cast to one of those formats (``OTEL_GPU_LOWP_SIMULATE``).

For a tensor stored in a low-precision format, over its finite values: ``amax`` (the largest
magnitude), ``dynamic_range`` (log2 of ``amax`` over the smallest non-zero magnitude),
``zero_fraction`` and ``saturation`` (the fraction at the format's largest magnitude). For a
float16/bfloat16/float32/float64 tensor with ``OTEL_GPU_LOWP_SIMULATE`` set: ``amax``,
``dynamic_range``, ``zero_fraction``, and the fractions a plain cast to the format (no scaling)
would flush to zero (``underflow``: non-zero, at most half the smallest subnormal) or could not
represent (``overflow``: beyond the largest magnitude, infinities included), with
``simulated_format`` naming it.

The device side (:func:`vector`) is elementwise kernels and full reductions only, so it runs
unchanged at CUDA graph capture; the host side (:class:`otel_gpu.core.stats.LowpSpec`) turns
the counts into fractions.

``float4_e2m1fn_x2`` packs two e2m1 values per byte; torch 2.13 has no arithmetic on it, so
:func:`unpack_e2m1` decodes the nibbles with elementwise integer ops (no lookup table: a
table would be a host-to-device copy at capture).
"""

from __future__ import annotations

import math

import torch

from otel_gpu.core.stats import LowpSpec

__all__ = ["FORMATS", "SIMULATED", "spec_for", "unpack_e2m1", "vector"]

FORMATS: dict[str, tuple[float, float]] = {
    "float8_e4m3fn": (448.0, 2.0**-9),
    "float8_e4m3fnuz": (240.0, 2.0**-10),
    "float8_e5m2": (57344.0, 2.0**-16),
    "float8_e5m2fnuz": (57344.0, 2.0**-17),
    "float8_e8m0fnu": (2.0**127, 2.0**-127),
    "float4_e2m1fn": (6.0, 0.5),
}
"""Format -> (largest finite magnitude, smallest non-zero magnitude)."""

SIMULATED = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "e2m1": "float4_e2m1fn"}
"""``OTEL_GPU_LOWP_SIMULATE`` value -> the format a wide tensor is measured against."""

_STORED = {
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
}
_WIDE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def spec_for(dtype: torch.dtype, simulate: str, count: int) -> LowpSpec | None:
    """What to compute for a tensor of ``dtype`` whose values tensor has ``count`` elements:
    its own format's statistics, a simulated cast's (wide floats, ``simulate`` not ``off``),
    or nothing."""
    name = str(dtype).removeprefix("torch.")
    if name in _STORED:
        fmt = name.removesuffix("_x2")
        return LowpSpec(fmt, FORMATS[fmt][0], False, count)
    if simulate != "off" and dtype in _WIDE:
        fmt = SIMULATED[simulate]
        return LowpSpec(fmt, FORMATS[fmt][0], True, count)
    return None


def unpack_e2m1(t: torch.Tensor) -> torch.Tensor:
    """The float32 values of a ``float4_e2m1fn_x2`` tensor: shape ``(*t.shape, 2)``, low nibble
    first. Each nibble is sign, two exponent bits and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3,
    4, 6 and their negatives."""
    b = t.view(torch.uint8).to(torch.int32)
    nib = torch.stack([b & 0xF, b >> 4], dim=-1)
    exp = (nib >> 1) & 3
    man = (nib & 1).to(torch.float32)
    normal = torch.exp2((exp - 1).to(torch.float32)) * (1.0 + 0.5 * man)
    mag = torch.where(exp == 0, 0.5 * man, normal)
    return torch.where((nib & 8) != 0, -mag, mag)


def vector(x: torch.Tensor, spec: LowpSpec) -> torch.Tensor:
    """[amax, smallest non-zero magnitude, zeros, at max (stored) or beyond it (simulated)
    and, simulated, underflows] in float64, over ``x``'s finite values (counts of all)."""
    a = x.abs()
    finite = torch.isfinite(a)
    amax = torch.where(finite, a, -1.0).amax()  # -1: nothing finite
    nonzero = finite & (a > 0)
    smallest = torch.where(nonzero, a, math.inf).amin()
    zeros = (a == 0).sum()
    if spec.simulated:
        top = (a > spec.max).sum()
        half = FORMATS[spec.format][1] / 2  # round to nearest even: half the step rounds to 0
        under = (nonzero & (a <= half)).sum()
        counts = torch.stack([zeros, top, under])
    else:
        top = (a == spec.max).sum()
        counts = torch.stack([zeros, top])
    return torch.cat([torch.stack([amax, smallest]).to(torch.float64), counts.to(torch.float64)])
