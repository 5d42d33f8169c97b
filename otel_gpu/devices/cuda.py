"""GPU seams: the few calls that only mean something on a real GPU.

Everything that would need CUDA hardware goes through these small functions, so
tests can replace them with fakes on a CPU-only machine (``monkeypatch.setattr``).
Behaviour behind them is unverified on real GPUs unless docs/gpu.md says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "copy_to_host",
    "cuda_available",
    "host_reads",
    "is_capturing",
    "is_cuda_tensor",
    "pinned_empty",
    "read_scalars",
    "wait_copy",
]

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
        # vectors differ in length (a fingerprint, low-precision statistics): one flat read
        flat = torch.cat([vectors[i] for i in indices]) if len(indices) > 1 else vectors[indices[0]]
        host_reads += 1
        values = flat.tolist()
        start = 0
        for i in indices:
            end = start + vectors[i].shape[0]
            out[i] = values[start:end]
            start = end
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------- flight recorder copies


def is_cuda_tensor(t: torch.Tensor) -> bool:
    """Whether the flight recorder copies ``t`` with :func:`copy_to_host` (asynchronously)."""
    return t.device.type == "cuda"


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A page-locked host buffer of ``nbytes`` bytes: device-to-host copies into it can be asynchronous."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> Any:
    """Start copying device tensor ``src`` into pinned ``dst``; returns what :func:`wait_copy` waits on.

    The copy is queued on ``src``'s device's current stream, after the kernels that produced
    ``src`` and before any the program launches later on that stream; the caller does not wait.
    """
    stream = torch.cuda.current_stream(src.device)
    dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_copy(event: Any) -> None:
    """Block until a copy started by :func:`copy_to_host` has finished (on the recorder's writer thread)."""
    event.synchronize()
