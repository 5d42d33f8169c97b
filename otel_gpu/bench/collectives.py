"""The ``gloo*`` rows of ``otel-gpu bench``: an ``all_reduce`` of a small tensor on gloo.

``gloo0`` is the bare call (level 0: the ``torch.distributed`` target patches nothing);
``gloo1`` and ``gloo3`` are the same call instrumented by the target at levels 1 and 3. The
group is a one-rank gloo group in the worker process (a ``HashStore``, no network): the call
goes through c10d and the gloo backend (work queued to gloo's thread, then waited for) with no
peer to wait on, so the difference between the rows is what the span costs, not the network.
"""

from __future__ import annotations

import datetime
from typing import Any

from otel_gpu.bench import worker

__all__ = ["NUMEL", "Gloo"]

NUMEL = 4
"""Floats in the reduced tensor: small, so the call's own cost is mostly c10d's."""


class Gloo(worker.Ours):
    """``dist.all_reduce`` of :data:`NUMEL` floats, instrumented at the row's level."""

    def __init__(self, spec: dict[str, Any], q: Any, k: Any) -> None:
        super().__init__(spec, q, k)  # configures otel-gpu at the row's level, export deferred
        import torch
        import torch.distributed as dist

        import otel_gpu

        if not dist.is_available() or not dist.is_gloo_available():
            raise worker.Unavailable("torch.distributed with gloo is not available")
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                rank=0,
                world_size=1,
                store=dist.HashStore(),
                timeout=datetime.timedelta(seconds=60),
            )
        otel_gpu.instrument("torch.distributed")
        self.tensor = torch.ones(NUMEL)
        self.all_reduce = dist.all_reduce  # looked up after instrumenting: the patched alias
        self.identity = spec["level"] == 0

    def loop(self, n: int) -> None:
        all_reduce, t = self.all_reduce, self.tensor
        for _ in range(n):
            all_reduce(t)
