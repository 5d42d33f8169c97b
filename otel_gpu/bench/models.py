"""The models of ``otel-gpu bench``: a tiny GPT2 and a tiny Mixtral built from a config (no
download), and the count of module calls one forward makes (the spans to expect)."""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = [
    "GPT2_CONFIG",
    "GPT2_IDS",
    "MIXTRAL_CONFIG",
    "Unavailable",
    "import_transformers",
    "module_calls",
    "tiny_gpt2",
    "tiny_mixtral",
]


class Unavailable(Exception):
    """This configuration cannot run here (library missing, feature not built)."""


GPT2_CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
GPT2_IDS = (2, 8)  # batch, sequence


def import_transformers() -> Any:
    """transformers, or Unavailable with the reason (it is a test dependency, not a runtime one)."""
    if importlib.util.find_spec("transformers") is None:
        raise Unavailable("transformers is not installed (pip install transformers)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers = importlib.import_module("transformers")
    except Exception as exc:
        raise Unavailable(f"import transformers failed: {type(exc).__name__}: {exc}") from exc
    transformers.logging.set_verbosity_error()  # the tiny config's token-id warnings
    return transformers


def tiny_gpt2(device: Any = "cpu") -> tuple[Any, Any]:
    """The tiny GPT2 of the bench, built from a config (no download), and its [2, 8] input ids."""
    import torch

    transformers = import_transformers()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_CONFIG)).eval()
    ids = torch.randint(0, GPT2_CONFIG["vocab_size"], GPT2_IDS)
    return model.to(device), ids.to(device)


MIXTRAL_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def tiny_mixtral(device: Any = "cpu") -> tuple[Any, Any]:
    """The tiny Mixtral (4 experts, 2 a token) of the bench, from a config, and its [2, 8] ids."""
    import torch

    transformers = import_transformers()
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**MIXTRAL_CONFIG)
    model = transformers.MixtralForCausalLM(config).eval()
    ids = torch.randint(0, MIXTRAL_CONFIG["vocab_size"], GPT2_IDS)
    return model.to(device), ids.to(device)


def module_calls(model: Any, *args: Any, include: Sequence[str] | None = None) -> int:
    """Submodule calls one forward makes, counted with forward hooks (independently of otel-gpu).

    Not every module runs: a ``ModuleList`` is only iterated, and attention implementations
    other than eager never call ``attn_dropout``. This is the spans-per-forward to expect.
    ``include``: count only the modules whose path or class name matches one of these fnmatch
    patterns, as ``instrument_module(include=...)`` selects them.
    """
    import torch

    seen = [0]

    def hook(module: Any, inputs: Any, output: Any) -> None:
        seen[0] += 1

    def selected(path: str, module: Any) -> bool:
        return not include or any(
            fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(type(module).__name__, p)
            for p in include
        )

    handles = [
        m.register_forward_hook(hook) for path, m in model.named_modules() if selected(path, m)
    ]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for handle in handles:
            handle.remove()
    return seen[0]
