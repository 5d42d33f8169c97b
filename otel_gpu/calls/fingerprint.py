"""The ``fingerprint`` statistic: a 64-bit hash of a tensor's bytes, computed on its device.

The tensor's logical contents, in row-major order (strides, offsets and broadcasting do not
matter, only the values), are read as words: each element's bytes as one signed integer of
its width (1, 2, 4 or 8 bytes; two 8-byte words for a 16-byte element), sign-extended to 64
bits. With ``n`` words ``v_0 .. v_{n-1}``::

    sum = (v_0 * w(0) + ... + v_{n-1} * w(n-1)) mod 2**64
    w(i) = t(i mod 65536) * m(i div 65536) mod 2**64

``t`` and ``m`` odd 64-bit mixes of their argument (:func:`mix`, ``m(0) = 1``), so every
weight is odd. The host adds ``n`` times a constant and applies a bijective finaliser
(:func:`otel_gpu.core.stats.fingerprint_hex`): 16 hex digits. Equal bytes give equal
fingerprints, in every process and on every device (the sum wraps, so the order a reduction
adds in does not matter); one word changed always changes it (its weight is odd); it is not
cryptographic.

Cost: for a tensor of up to 65,536 words two kernels (a multiply by a cached table of ``t``
and a sum) and no host read: the sum's two 32-bit halves ride in the statistics vector that
:mod:`otel_gpu.calls.stats` reads back once per call. A larger tensor is read as rows of
65,536 words, multiplied by the same table (broadcast, nothing materialised), summed per row
and weighted by ``m``, in chunks of 2**24 words (2**18 on CPU) that bound the temporaries; a non-contiguous
one is first copied contiguous. Only capturable ops (no host read, no data-dependent shape):
the same code runs at CUDA graph capture, where the table is made inline instead of cached
(a cached one would live in the graph's pool).
"""

from __future__ import annotations

import torch

__all__ = ["MAX_BROADCAST", "launch", "mix", "words"]

_MIX1 = 0x9E3779B97F4A7C15 - (1 << 64)  # as signed int64: torch multiplies int64 wrapping
_MIX2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_ROW = 1 << 16  # words per row of the weight table (512 KiB per device)
_CHUNK = 1 << 24  # words per chunk of a large tensor on a GPU: a multiple of _ROW
_CHUNK_CPU = 1 << 18  # on CPU smaller chunks stay in malloc's reused memory (measured ~6x faster)
_MASK = (1 << 64) - 1
MAX_BROADCAST = 1 << 24
"""A broadcast view (``expand``) with more logical elements is not fingerprinted: hashing reads
every logical element, where its other statistics read only the stored ones."""

_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_tables: dict[torch.device, torch.Tensor] = {}


def mix(w: torch.Tensor) -> torch.Tensor:
    """An odd 64-bit mix of each int64 in ``w``, in place (splitmix-style; ``mix(0) = 1``)."""
    w.mul_(_MIX1)
    w.bitwise_xor_(w >> 31)
    w.mul_(_MIX2)
    return w.bitwise_or_(1)


def _mix_int(i: int) -> int:
    """:func:`mix` of one position, on the host, as torch computes it (signed, wrapping)."""
    w = (i * _MIX1) & _MASK
    w = w - (1 << 64) if w >> 63 else w
    w = (w ^ (w >> 31)) & _MASK  # arithmetic shift of the signed value, as torch's >>
    w = (w * _MIX2) & _MASK
    w |= 1
    return w - (1 << 64) if w >> 63 else w


def words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` viewed (no copy) as signed integers of its element's width, and words per element.

    A same-width view works for any strides and for dtypes torch cannot copy (``uint4``, the
    ``bits`` types); a quantized tensor is read through its integer representation."""
    if t.is_quantized:
        t = t.int_repr()
    size = t.element_size()
    word = _WORD.get(size)
    if word is not None:
        return (t if t.dtype is word else t.view(word)), 1
    if size == 16 and t.dtype is torch.complex128:
        return t, 2  # viewed as int64 pairs once contiguous (a width change needs stride 1)
    raise TypeError(f"no fingerprint for {t.dtype}: {size}-byte elements")


def _table(device: torch.device, cache: bool) -> torch.Tensor:
    """``t(0) .. t(65535)`` on ``device``, cached unless ``cache`` is False."""
    table = _tables.get(device) if cache else None
    if table is None:
        table = mix(torch.arange(_ROW, dtype=torch.int64, device=device))
        if cache:
            table = _tables.setdefault(device, table)
    return table


def launch(t: torch.Tensor, cache: bool = True) -> tuple[torch.Tensor, int]:
    """The fingerprint's wrapped sum as two float64 (its low and high signed 32-bit halves,
    exact) on ``t``'s device, and the number of words ``n``; nothing is read back.

    ``cache``: use the per-device weight table (False during CUDA graph capture)."""
    w_t, per = words(t)
    flat = w_t.contiguous().reshape(-1)
    if per == 2:
        flat = flat.view(torch.int64)
    n = flat.numel()
    table = _table(flat.device, cache)
    total: torch.Tensor | None = None
    if n <= _ROW:
        total = torch.mul(flat, table[:n]).sum()  # promotes to int64: the common case
    else:
        rows = n // _ROW
        step = (_CHUNK_CPU if flat.device.type == "cpu" else _CHUNK) // _ROW
        for a in range(0, rows, step):  # the grouping of the sum does not change it
            b = min(rows, a + step)
            block = flat[a * _ROW : b * _ROW].view(b - a, _ROW)
            per_row = torch.mul(block, table).sum(dim=1)  # the table broadcast, not copied
            m = mix(torch.arange(a, b, dtype=torch.int64, device=flat.device))
            part = per_row.mul_(m).sum()
            total = part if total is None else total.add_(part)
        rest = n - rows * _ROW
        if rest:
            tail = torch.mul(flat[rows * _ROW :], table[:rest]).sum().mul_(_mix_int(rows))
            total = tail if total is None else total.add_(tail)
    assert total is not None
    return total.reshape(1).view(torch.int32).to(torch.float64), n
