"""CUDA caching-allocator seams: the readings behind the memory attributes of a call.

Every function here reads PyTorch's caching allocator on the host: none launches work on the
GPU or waits for it, and none initialises CUDA (each is called only once
:func:`initialized` is true). Tests replace them with fakes (``monkeypatch.setattr``), as
docs/gpu.md describes; :mod:`otel_gpu.calls.memory` turns the readings into span attributes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "OUT_OF_MEMORY",
    "counters",
    "current_device",
    "initialized",
    "summary",
]

OUT_OF_MEMORY: tuple[type[BaseException], ...] = tuple(
    {
        cls
        for cls in (getattr(torch, "OutOfMemoryError", None), torch.cuda.OutOfMemoryError)
        if isinstance(cls, type)
    }
)
"""The exceptions of a failed CUDA allocation (``torch.OutOfMemoryError``, which
``torch.cuda.OutOfMemoryError`` names too)."""


def initialized() -> bool:
    """Whether this process has initialised CUDA: only then can a call have allocated on a GPU.

    ``torch.cuda.is_initialized()`` reads a module flag (0.06 µs on an H100 host): cheap enough
    to ask per call, and it never creates a CUDA context."""
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def current_device() -> int:
    """The index of the current CUDA device (``torch.cuda.current_device()``)."""
    return int(torch.cuda.current_device())


def counters(device: int) -> tuple[int, int]:
    """The caching allocator's ``allocated_bytes.all.current`` and ``.peak`` on ``device``.

    Host counters kept by the allocator as it hands out and takes back blocks: no
    synchronisation. One ``torch.cuda.memory_stats_as_nested_dict`` (~11 µs on an H100 host
    with torch 2.11: the binding builds every statistic, there is no narrower one).
    """
    allocated = torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]
    return int(allocated["current"]), int(allocated["peak"])


def summary(device: int) -> dict[str, int]:
    """The allocator's state on ``device`` after an out-of-memory error, in bytes.

    ``reserved`` and ``allocated``: the allocator's current reserved and allocated bytes;
    ``largest_free_block``: the largest block the allocator holds reserved and unused on the
    device (``memory_snapshot()``'s ``inactive`` blocks; 0 when it holds none), the largest
    request it could have served without asking the driver; ``device_free`` and
    ``device_total``: the driver's free and total memory of the device (``mem_get_info``).
    A reading that fails is left out. Called only on an error, so the snapshot's walk of
    every segment is paid only then.
    """
    out: dict[str, int] = {}
    try:
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        out["reserved"] = int(stats["reserved_bytes"]["all"]["current"])
        out["allocated"] = int(stats["allocated_bytes"]["all"]["current"])
    except Exception:
        pass
    try:
        out["largest_free_block"] = _largest_free_block(device)
    except Exception:
        pass
    try:
        free, total = torch.cuda.mem_get_info(device)
        out["device_free"], out["device_total"] = int(free), int(total)
    except Exception:
        pass
    return out


def _largest_free_block(device: int) -> int:
    try:
        segments: Any = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # a torch without the include_traces argument
        segments = torch.cuda.memory_snapshot()
    largest = 0
    for segment in segments:
        if segment.get("device") != device:
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "inactive":
                largest = max(largest, int(block.get("size", 0)))
    return largest
