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
    "Read",
    "copy_to_host",
    "cuda_available",
    "host_reads",
    "is_capturing",
    "is_cuda_tensor",
    "on_stream",
    "pinned_empty",
    "read_later",
    "read_rows",
    "read_scalars",
    "readable_later",
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


class Read:
    """Vectors on their way to the host (:func:`read_later`): the host copies, which vectors
    each holds, the event that completes with them and the stream they were queued on."""

    __slots__ = ("event", "hosts", "indices", "lengths", "stream")

    def __init__(self) -> None:
        self.hosts: list[torch.Tensor] = []
        self.indices: list[list[int]] = []
        self.lengths: list[int] = []
        self.event: Any = None
        self.stream: Any = None


def readable_later(t: torch.Tensor) -> bool:
    """Whether :func:`read_later` can bring ``t`` back without a host sync: it is on a CUDA
    device (``t.is_cuda``)."""
    return bool(t.is_cuda)


def read_later(vectors: Sequence[torch.Tensor]) -> Read:
    """Start bringing CUDA vectors to the host without waiting: per device, one ``torch.cat``
    and one non-blocking copy into page-locked host memory (``.to("cpu", non_blocking=True)``),
    then an event recorded on the current stream. The caller's thread never synchronises;
    another thread waits for the event (:func:`wait_copy`) and reads the copies
    (:func:`read_rows`)."""
    read = Read()
    read.lengths = [int(v.shape[0]) for v in vectors]
    by_device: dict[torch.device, list[int]] = {}
    for i, vec in enumerate(vectors):
        by_device.setdefault(vec.device, []).append(i)
    for indices in by_device.values():
        flat = torch.cat([vectors[i] for i in indices]) if len(indices) > 1 else vectors[indices[0]]
        read.hosts.append(flat.to("cpu", non_blocking=True))  # pinned, queued after the stats
        read.indices.append(indices)
    read.stream = torch.cuda.current_stream()
    read.event = torch.cuda.Event()
    read.event.record(read.stream)
    return read


def read_rows(read: Read) -> list[list[float]]:
    """The vectors of ``read`` as host lists, in the order given to :func:`read_later`; call it
    once :func:`wait_copy` returned for ``read.event`` (it then reads host memory only)."""
    out: list[list[float] | None] = [None] * len(read.lengths)
    for host, indices in zip(read.hosts, read.indices):
        values = host.tolist()
        start = 0
        for i in indices:
            end = start + read.lengths[i]
            out[i] = values[start:end]
            start = end
    return out  # type: ignore[return-value]


def on_stream(stream: Any) -> Any:
    """A context in which this thread launches on ``stream`` (``torch.cuda.stream``): a
    statistic computed off the caller's thread runs after the caller's work on its stream."""
    return torch.cuda.stream(stream)


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
