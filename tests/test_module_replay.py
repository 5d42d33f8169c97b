"""Replay of torch.nn.Module methods: with OTEL_GPU_DUMP_MODULES the recorder saves each module's
state_dict at its first call and again whenever it changed, and replay constructs the module
again from its attributes and the state of that call's moment."""

from __future__ import annotations

import os

import pytest
import torch

import otel_gpu
from otel_gpu.export import pipeline
from otel_gpu.replay import Allow, Options, replay

LIB = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, width, scale=1.0, bias=True):
        super().__init__()
        self.width, self.scale = width, scale
        self.proj = nn.Linear(width, width, bias=bias)

    def forward(self, x):
        return self.proj(x) * self.scale

class Opaque(nn.Module):
    '''Its constructor argument is not kept as an attribute: it cannot be built again.'''
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * self.weight
"""


pytestmark = pytest.mark.usefixtures("fresh_module_states")


def _record(otel_gpu_spans, module_factory, tmp_path, **settings):
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root), **settings)
    m = module_factory(LIB, "modlib")
    otel_gpu.instrument(m.Block)
    otel_gpu.instrument(m.Opaque)
    return m, root


def _replay(m, root):
    pipeline.reset(timeout=2.0)
    return replay(str(root), Options(allow=Allow([m.__name__], any_instrument=True)))


def test_a_module_method_replays_from_its_recorded_state(otel_gpu_spans, module_factory, tmp_path):
    """The module is rebuilt (Block(width=4, scale=2.0, bias=True)), its weights loaded from the
    dump — not from the live object — and the call passes."""
    m, root = _record(otel_gpu_spans, module_factory, tmp_path, dump_modules=True)
    torch.manual_seed(0)
    block = m.Block(4, scale=2.0)
    block(torch.ones(2, 4))
    block(torch.zeros(2, 4))
    with torch.no_grad():
        block.proj.weight.zero_()  # the live module changes: replay must not depend on it
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["pass", "pass"], [r.detail for r in results]
    states = os.listdir(root / "modules")
    assert len(states) == 1 and states[0].endswith(".pt")  # once per module instance


def test_a_weight_poisoned_in_place_between_calls_replays_with_the_poison(
    otel_gpu_spans, module_factory, tmp_path
):
    """A NaN planted in the weight in place (no_grad fill_) between two calls: the second call's
    state is recorded again, so replaying the NaN-producing call reproduces its NaN (pass),
    not finite values from the state of the first call; the first call still passes."""
    m, root = _record(otel_gpu_spans, module_factory, tmp_path, dump_modules=True)
    torch.manual_seed(0)
    block = m.Block(4)
    assert torch.isfinite(block(torch.ones(2, 4))).all()
    with torch.no_grad():
        block.proj.weight.fill_(float("nan"))  # in place: the version counter moves
    assert torch.isnan(block(torch.ones(2, 4))).all()
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["pass", "pass"], [r.detail for r in results]
    assert len(os.listdir(root / "modules")) == 2  # the state of each moment


@pytest.mark.parametrize(
    "change",
    [
        "param_data",  # proj.weight.data = another tensor: the storage pointer moves
        "new_parameter",  # proj.weight = nn.Parameter(...): another object in its slot
        "new_submodule",  # proj = nn.Linear(...): another module
        "buffer_added",  # register_buffer: one more entry
    ],
)
def test_each_kind_of_state_change_is_recorded_again(
    otel_gpu_spans, module_factory, tmp_path, change
):
    """Whatever moved the state (a storage swapped, a parameter, submodule or buffer replaced
    or added), the next call records it again and replays with it: pass, pass."""
    m, root = _record(otel_gpu_spans, module_factory, tmp_path, dump_modules=True)
    torch.manual_seed(0)
    block = m.Block(4)
    block(torch.ones(2, 4))
    if change == "param_data":
        block.proj.weight.data = torch.full((4, 4), 2.0)
    elif change == "new_parameter":
        block.proj.weight = torch.nn.Parameter(torch.full((4, 4), 3.0))
    elif change == "new_submodule":
        block.proj = torch.nn.Linear(4, 4)
    else:
        block.register_buffer("extra", torch.ones(1), persistent=False)
    block(torch.ones(2, 4))
    if change == "buffer_added":  # the rebuilt Block has no such buffer: said, never passed
        results = _replay(m, root)
        assert results[0].verdict == "pass"
        assert results[1].verdict == "skipped" and "extra" in results[1].detail
        return
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["pass", "pass"], [r.detail for r in results]
    assert len(os.listdir(root / "modules")) == 2


def test_the_change_check_costs_no_state_copy_when_nothing_changed(
    otel_gpu_spans, module_factory, tmp_path, monkeypatch
):
    """Ten calls of an unchanged module: its state is copied (state_dict) once, not per call."""
    from otel_gpu.recorder import module_state

    m, _ = _record(otel_gpu_spans, module_factory, tmp_path, dump_modules=True)
    block = m.Block(4)
    copies = []
    real = module_state._record_state
    monkeypatch.setattr(module_state, "_record_state", lambda *a: copies.append(1) or real(*a))
    for _ in range(10):
        block(torch.ones(1, 4))
    assert len(copies) == 1


def test_a_replaced_weight_is_not_kept_alive_by_the_record(
    otel_gpu_spans, module_factory, tmp_path
):
    """The change check holds the module's tensors weakly: a submodule replaced after a call is
    freed with its weights (on a GPU, their memory), not kept until the module's next call."""
    import gc
    import weakref

    m, _ = _record(otel_gpu_spans, module_factory, tmp_path, dump_modules=True)
    block = m.Block(4)
    block(torch.ones(1, 4))
    old = weakref.ref(block.proj.weight)
    block.proj = torch.nn.Linear(4, 4)
    gc.collect()
    assert old() is None


def test_without_the_setting_the_call_is_skipped_saying_how_to_enable_it(
    otel_gpu_spans, module_factory, tmp_path
):
    """No state recorded: skipped as a stateful method, and the reason names the setting."""
    m, root = _record(otel_gpu_spans, module_factory, tmp_path)
    m.Block(4)(torch.ones(1, 4))
    (result,) = _replay(m, root)
    assert result.verdict == "skipped"
    assert "OTEL_GPU_DUMP_MODULES=true" in result.detail
    assert result.detail.count("stateful method") == 1


def test_a_module_whose_constructor_cannot_be_recovered_is_skipped_with_the_reason(
    otel_gpu_spans, module_factory, tmp_path
):
    """Opaque(hidden) keeps no `hidden` attribute: the dump says so, replay skips, no error."""
    m, root = _record(otel_gpu_spans, module_factory, tmp_path, dump_modules=True)
    m.Opaque(3)(torch.ones(3))
    (result,) = _replay(m, root)
    assert result.verdict == "skipped"
    assert "constructor parameter 'hidden'" in result.detail


def test_the_size_limit_records_the_call_without_its_module(
    otel_gpu_spans, module_factory, tmp_path
):
    """A state over OTEL_GPU_DUMP_MODULES_MAX_MB is not written; the call is skipped, saying why."""
    m, root = _record(
        otel_gpu_spans, module_factory, tmp_path, dump_modules=True, dump_modules_max_mb=0.00001
    )
    m.Block(64)(torch.ones(1, 64))
    (result,) = _replay(m, root)
    assert result.verdict == "skipped" and "OTEL_GPU_DUMP_MODULES_MAX_MB" in result.detail
    assert not (root / "modules").exists()


def test_a_state_that_cannot_be_written_leaves_no_empty_modules_folder(
    otel_gpu_spans, module_factory, tmp_path, monkeypatch
):
    """A full disk while the state is written: the call is skipped saying why, and the
    ``modules/`` folder made for it is not left behind empty."""
    from otel_gpu import _files
    from otel_gpu.recorder import module_state

    class FullDisk:  # the module states' files only: the call's own dump is written
        def __getattr__(self, name):
            return getattr(_files, name)

        def write_atomic(self, *args, **options):
            raise OSError(28, "No space left on device")

    m, root = _record(otel_gpu_spans, module_factory, tmp_path, dump_modules=True)
    monkeypatch.setattr(module_state, "_files", FullDisk())
    m.Block(64)(torch.ones(1, 64))
    monkeypatch.undo()
    (result,) = _replay(m, root)
    assert result.verdict == "skipped" and "could not be written" in result.detail
    assert not (root / "modules").exists()


def test_a_transformers_module_with_a_config_replays(otel_gpu_spans, module_factory, tmp_path):
    """LlamaMLP(config): the config is recorded with to_dict() and rebuilt with from_dict()."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root), dump_modules=True)
    otel_gpu.instrument(modeling_llama.LlamaMLP)
    torch.manual_seed(0)
    mlp = modeling_llama.LlamaMLP(
        LlamaConfig(
            hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2
        )
    ).eval()
    mlp(torch.randn(2, 16))
    pipeline.reset(timeout=2.0)
    (result,) = replay(str(root), Options(allow=Allow(["transformers"], any_instrument=True)))
    assert result.verdict == "pass", result.detail
