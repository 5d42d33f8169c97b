"""Tiny transformers models built from a config (no download), for tests of code nobody wrote
for otel-gpu. As a script: run a forward pass and generate() on a GPT2 and a Llama and save the
outputs to the file named by argv[1], so runs with and without instrumentation can be compared.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

SPECIAL = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, **SPECIAL)
    return GPT2LMHeadModel(cfg).eval()


def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=128,
        **SPECIAL,
    )
    return LlamaForCausalLM(cfg).eval()


def gemma3() -> Any:
    """A one-layer Gemma3 text model: its embedding scales by sqrt(hidden_size), a constructor
    argument kept as a non-persistent buffer."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    cfg = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Gemma3TextModel(cfg).eval()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 1000, (2, 8), generator=torch.Generator().manual_seed(1))
    return ids, torch.ones_like(ids)


def run() -> dict[str, torch.Tensor]:
    from transformers.utils import logging

    logging.set_verbosity_error()
    ids, mask = inputs()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, model in (("gpt2", gpt2()), ("llama", llama())):
            out[f"{name}.logits"] = model(ids, attention_mask=mask).logits
            out[f"{name}.generate"] = model.generate(
                ids, attention_mask=mask, max_new_tokens=3, do_sample=False
            )
    return out


if __name__ == "__main__":
    torch.save(run(), sys.argv[1])
