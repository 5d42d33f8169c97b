"""GPU seams: the few calls that only mean something on a real GPU.

Everything that would need CUDA hardware goes through these small functions, so
tests can replace them with fakes on a CPU-only machine (``monkeypatch.setattr``).
Behaviour behind them is unverified on real GPUs unless docs/gpu.md says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["cuda_available", "host_reads", "is_capturing", "read_scalars"]

host_reads = 0
"""How many device-to-host reads :func:`read_scalars` made (one per device per batch); tests read it."""


def cuda_available() -> bool:
    """Whether CUDA can be used at all. Does not create a CUDA context."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def is_capturing() -> bool:
    """True while the current CUDA stream is capturing a graph: no syncs or copies allowed then."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def read_scalars(vectors: Sequence[torch.Tensor]) -> list[list[float]]:
    """Bring small per-tensor result vectors to the host with one read per device.

    This is the one host synchronisation of a call at level 5: every statistic of
    every tensor of the call is stacked and copied together.
    """
    global host_reads
    out: list[list[float] | None] = [None] * len(vectors)
    by_device: dict[torch.device, list[int]] = {}
    for i, vec in enumerate(vectors):
        by_device.setdefault(vec.device, []).append(i)
    for indices in by_device.values():
        stacked = (
            torch.stack([vectors[i] for i in indices])
            if len(indices) > 1
            else vectors[indices[0]][None]
        )
        host_reads += 1
        rows = stacked.tolist()
        for i, row in zip(indices, rows):
            out[i] = row
    return out  # type: ignore[return-value]
