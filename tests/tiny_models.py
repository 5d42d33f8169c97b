"""Tiny transformers models built from a config (no download), for tests of code nobody wrote
for otel-gpu. As a script: run a forward pass and generate() on a GPT2 and a Llama and save the
outputs to the file named by argv[1], so runs with and without instrumentation can be compared.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

SPECIAL = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def sizes(
    *, hidden: int, ffn: int, layers: int, heads: int, vocab: int, positions: int, kv: int = 0
) -> dict[str, int]:
    """The size arguments of a config, under the names that Llama, Gemma3 and BERT share
    (``kv``: key/value heads, left out when 0)."""
    named = {
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": positions,
    }
    return {**named, "num_key_value_heads": kv} if kv else named


def seeded(model: Any, config: Any) -> Any:
    """``model(config)`` in eval mode, its weights drawn after ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    return model(config).eval()


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, **SPECIAL)
    return seeded(GPT2LMHeadModel, cfg)


def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = sizes(hidden=64, ffn=128, layers=2, heads=4, kv=2, vocab=1000, positions=128)
    return seeded(LlamaForCausalLM, LlamaConfig(**shape, **SPECIAL))


def gemma3() -> Any:
    """A one-layer Gemma3 text model: its embedding scales by sqrt(hidden_size), a constructor
    argument kept as a non-persistent buffer."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    shape = sizes(hidden=64, ffn=64, layers=1, heads=2, kv=1, vocab=64, positions=64)
    return seeded(Gemma3TextModel, Gemma3TextConfig(**shape, head_dim=32))


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
