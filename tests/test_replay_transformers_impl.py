"""Replay judges the recorded program: transformers submodules rebuilt from a config run the
attention kernel the recording ran (sdpa), not the default of a bare config (eager).

Tiny BERT and T5 models built from a config (no download), instrumented module by module, with
their states recorded (OTEL_GPU_DUMP_MODULES).
"""

from __future__ import annotations

import json
import os

import pytest
import tiny_models
import torch

import otel_gpu
from otel_gpu.export import pipeline
from otel_gpu.recorder import manifest as _manifest
from otel_gpu.replay import Allow, Options, replay
from otel_gpu.replay.call import prepare_call

pytest.importorskip("transformers")

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("fresh_module_states")]


def _bert():
    from transformers import BertConfig, BertModel

    shape = tiny_models.sizes(hidden=32, ffn=64, layers=2, heads=4, vocab=100, positions=64)
    config = BertConfig(**shape, attn_implementation="sdpa")
    return "transformers.models.bert.modeling_bert", tiny_models.seeded(BertModel, config)


def _t5():
    from transformers import T5Config, T5Model

    cfg = T5Config(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        vocab_size=100,
        attn_implementation="sdpa",
    )
    return "transformers.models.t5.modeling_t5", tiny_models.seeded(T5Model, cfg)


def _record(otel_gpu_spans, tmp_path, build):
    """Record one forward pass with a padded batch (the mask is where eager and sdpa differ)."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root), dump_modules=True)
    torch.manual_seed(0)
    target, model = build()
    otel_gpu.instrument(target)
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        if build is _t5:
            model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :4])
        else:
            model(ids, attention_mask=mask)
    assert model.config._attn_implementation == "sdpa"
    pipeline.reset(timeout=5.0)
    otel_gpu_spans(level=1)
    return root


def _calls_with_config(root):
    """(call dir, manifest) of every recorded call whose receiver is rebuilt from a config."""
    for name in sorted(os.listdir(root)):
        path = root / name
        if not (path / _manifest.MANIFEST).is_file():
            continue
        manifest = json.loads((path / _manifest.MANIFEST).read_text())
        init = (manifest.get("receiver") or {}).get("init") or {}
        if (init.get("config") or {}).get("t") == "from_dict":
            yield str(path), manifest


@pytest.mark.parametrize("build", [_bert, _t5], ids=["bert", "t5"])
def test_attention_modules_replay_with_the_recorded_sdpa_and_pass(otel_gpu_spans, tmp_path, build):
    """Every replayed call passes (no false mismatch from eager attention), the attention
    modules among them; the rebuilt config's _attn_implementation is the recorded one."""
    root = _record(otel_gpu_spans, tmp_path, build)
    allow = Allow(["transformers"], any_instrument=True)
    results = replay(str(root), Options(allow=allow))
    judged = [r for r in results if r.verdict != "skipped"]
    assert judged and all(r.verdict == "pass" for r in judged), [
        (r.span_name, r.verdict, r.detail) for r in judged
    ]
    assert any("Attention.forward" in r.span_name for r in judged)
    rebuilt = 0
    passed = {r.dir for r in judged}
    for directory, manifest in _calls_with_config(root):
        if directory not in passed:  # skipped for another reason (an argument not recorded)
            continue
        recorded = manifest["receiver"]["init"]["config"]["implementation"]
        assert recorded["_attn_implementation"] == "sdpa"
        call = prepare_call(directory, manifest, allow, {})
        assert call.args[0].config._attn_implementation == recorded["_attn_implementation"]
        rebuilt += 1
    assert rebuilt


def test_a_recorded_kernel_unavailable_here_is_refused_with_the_reason(otel_gpu_spans, tmp_path):
    """A dump recorded with flash_attention_2 (edited in, as from a machine that has it) on a
    machine without FlashAttention: the call is not run on another kernel and passed; it is
    skipped, naming the recorded choice and why it cannot run."""
    from transformers.utils import is_flash_attn_2_available

    if is_flash_attn_2_available():
        pytest.skip("FlashAttention 2 is installed here")
    root = _record(otel_gpu_spans, tmp_path, _bert)
    edited = 0
    for directory, manifest in _calls_with_config(root):
        manifest["receiver"]["init"]["config"]["implementation"]["_attn_implementation"] = (
            "flash_attention_2"
        )
        with open(os.path.join(directory, _manifest.MANIFEST), "w") as f:
            json.dump(manifest, f)
        edited += 1
    assert edited
    results = replay(str(root), Options(allow=Allow(["transformers"], any_instrument=True)))
    refused = [r for r in results if "flash_attention_2" in r.detail]
    assert len(refused) == edited
    for r in refused:
        assert r.verdict == "skipped", (r.verdict, r.detail)
        assert "'flash_attention_2', which cannot run here" in r.detail
        assert "FlashAttention 2 is not installed" in r.detail
    assert not any(r.verdict in ("mismatch", "error") for r in results)
