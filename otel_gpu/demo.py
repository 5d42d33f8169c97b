"""A tiny decorated "GPU library" for ``otel-gpu demo``: what a library author writes.

Its spans are named ``otel_gpu.demo.<function>``. Decorated at import time, so
``otel_gpu.configure`` must run before this module is imported.
"""

from __future__ import annotations

import enum

import torch

import otel_gpu


class MaskMode(enum.Enum):
    NONE = 0
    CAUSAL = 1


@otel_gpu.api
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@otel_gpu.api
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    mask: MaskMode = MaskMode.CAUSAL,
) -> torch.Tensor:
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is MaskMode.CAUSAL:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@otel_gpu.api
def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    # Deliberately wrong: log of raw scaled logits instead of log_softmax, so negative
    # logits become NaN and zeros -inf -- the kind of bug level 5 exists to catch.
    return torch.log(logits / temperature)


@otel_gpu.api(name="demo.Decoder.run")
def decoder_layer(
    x: torch.Tensor, weight: torch.Tensor, heads: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    b, n, d = x.shape
    h = rms_norm(x, weight)
    q = k = v = h.view(b, n, heads, d // heads).transpose(1, 2)
    out = attention(q, k, v).transpose(1, 2).reshape(b, n, d)
    return out, log_probs(out)


@otel_gpu.api
def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table[index]
