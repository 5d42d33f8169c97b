"""Replay rebuilds a torch.nn.Module receiver as it was recorded, or says why it cannot.

The real case is transformers' Gemma3 scaled embedding: its ``embed_scale`` is a constructor
argument kept only as a non-persistent buffer, in neither the constructor arguments replay
recovers nor the ``state_dict``. A state file changed after it was recorded (weights scaled,
one bit flipped) must never give a pass.
"""

from __future__ import annotations

import json

import pytest
import tiny_models
import torch

import otel_gpu
from otel_gpu.export import pipeline
from otel_gpu.recorder import manifest as _manifest
from otel_gpu.recorder import module_state
from otel_gpu.replay import Allow, Options, replay

pytest.importorskip("transformers")

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("fresh_module_states")]

TARGET = "transformers.models.gemma3.modeling_gemma3"


def _record(otel_gpu_spans, tmp_path, part):
    """One call of one of the model's modules (``embed`` or ``mlp``), recorded with its module."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root), dump_modules=True)
    model = tiny_models.gemma3()
    assert float(model.embed_tokens.embed_scale) == 8.0  # sqrt(hidden_size), not the default 1
    otel_gpu.instrument(TARGET)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if part == "embed":
            model.embed_tokens(torch.randint(0, 64, (2, 12), generator=gen))
        else:
            model.layers[0].mlp(torch.randn(2, 12, 64, generator=gen))
    pipeline.reset(timeout=5.0)
    otel_gpu_spans(level=1)
    (call,) = [p for p in root.iterdir() if (p / _manifest.MANIFEST).is_file()]
    return root, call


def _replay(root, span):
    (result,) = replay(str(root), Options(allow=Allow(["transformers"], any_instrument=True)))
    assert span in result.span_name
    return result


def _state_file(call):
    manifest = json.loads((call / _manifest.MANIFEST).read_text())
    return call.parent / module_state.STATE_DIR / manifest["receiver"]["state"]


def _scaled(state, factor):
    return {
        k: v * factor if v.is_floating_point() and v.dim() == 2 else v for k, v in state.items()
    }


def test_gemma3_scaled_embedding_replays_with_its_recorded_embed_scale(otel_gpu_spans, tmp_path):
    """The non-persistent embed_scale buffer (8, not the constructor's default 1.0) is recorded
    and loaded into the rebuilt module: the correct call passes instead of a false mismatch."""
    root, _ = _record(otel_gpu_spans, tmp_path, "embed")
    result = _replay(root, "ScaledWordEmbedding.forward")
    assert result.verdict == "pass", result.detail


def test_weights_scaled_in_the_state_file_are_an_error_naming_the_file(otel_gpu_spans, tmp_path):
    """Weights multiplied by 1.0001 in modules/<sha256>.pt no longer match the hash the file's
    name carries: an error naming the file, never a pass."""
    root, call = _record(otel_gpu_spans, tmp_path, "mlp")
    path = _state_file(call)
    torch.save(_scaled(torch.load(path, weights_only=True), 1.0001), path)
    result = _replay(root, "Gemma3MLP.forward")
    assert result.verdict == "error", result.detail
    assert path.name in result.detail and "SHA-256" in result.detail


def test_scaled_weights_under_their_own_hash_are_a_mismatch_at_small_output_scale(
    otel_gpu_spans, tmp_path
):
    """The same ×1.0001 weights stored under their own hash (a consistent dump of a changed
    module) give outputs near 1e-3 that differ by about 1e-7: under an absolute 1e-5 they passed;
    the tolerance follows the outputs' scale, so they are a mismatch."""
    root, call = _record(otel_gpu_spans, tmp_path, "mlp")
    manifest_path = call / _manifest.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    path = _state_file(call)
    state = _scaled(torch.load(path, weights_only=True), 1.0001)
    name = module_state._content_hash(state) + ".pt"
    torch.save(state, path.parent / name)
    manifest["receiver"]["state"] = name
    manifest_path.write_text(json.dumps(manifest))
    result = _replay(root, "Gemma3MLP.forward")
    assert result.verdict == "mismatch", result.detail


def test_one_bit_flipped_in_the_state_file_is_an_error(otel_gpu_spans, tmp_path):
    """The lowest mantissa bit of one weight flipped on disk (outputs unchanged within any
    tolerance) is caught by the hash check: an error naming the file."""
    root, call = _record(otel_gpu_spans, tmp_path, "mlp")
    path = _state_file(call)
    weight = torch.load(path, weights_only=True)["gate_proj.weight"]
    data = bytearray(path.read_bytes())
    at = bytes(data).find(weight.numpy().tobytes()[:64])
    assert at > 0
    data[at] ^= 1
    path.write_bytes(bytes(data))
    result = _replay(root, "Gemma3MLP.forward")
    assert result.verdict == "error", result.detail
    assert path.name in result.detail


def _rewrite(call, change_state, change_receiver):
    """Change the recorded state and receiver, storing the state under its own (valid) hash."""
    manifest_path = call / _manifest.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    path = _state_file(call)
    state = change_state(torch.load(path, weights_only=True))
    name = module_state._content_hash(state) + ".pt"
    torch.save(state, path.parent / name)
    manifest["receiver"]["state"] = name
    change_receiver(manifest["receiver"])
    manifest_path.write_text(json.dumps(manifest))


def test_a_recorded_buffer_the_rebuilt_module_lacks_is_skipped_with_the_reason(
    otel_gpu_spans, tmp_path
):
    """A non-persistent buffer the module had when recorded and the rebuilt one has not: the call
    is skipped naming it, not replayed without it."""
    root, call = _record(otel_gpu_spans, tmp_path, "embed")
    _rewrite(
        call,
        lambda s: {**s, "ghost": torch.ones(1)},
        lambda r: r.__setitem__("buffers", [*r["buffers"], "ghost"]),
    )
    result = _replay(root, "ScaledWordEmbedding.forward")
    assert result.verdict == "skipped", result.detail
    assert "'ghost'" in result.detail and "lacks" in result.detail


def test_a_dump_without_the_non_persistent_buffers_is_skipped_not_replayed_with_defaults(
    otel_gpu_spans, tmp_path
):
    """A receiver recorded without its buffers (as older dumps were) whose rebuilt module has
    one (embed_scale): skipped saying so, never a verdict from the constructor's 1.0."""
    root, call = _record(otel_gpu_spans, tmp_path, "embed")
    _rewrite(
        call,
        lambda s: {k: v for k, v in s.items() if k != "embed_scale"},
        lambda r: [r.pop("buffers"), r.pop("attributes")],
    )
    result = _replay(root, "ScaledWordEmbedding.forward")
    assert result.verdict == "skipped", result.detail
    assert "embed_scale" in result.detail and "not recorded" in result.detail
