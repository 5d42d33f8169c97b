"""``otel_gpu.instrument_module()``: one span per submodule call, named by its path in the tree."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import otel_gpu


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, hidden_states, mask=None):
        return self.q(hidden_states)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()
        self.norm = nn.LayerNorm(4)

    def forward(self, hidden_states):
        return self.norm(self.self_attn(hidden_states))


class Model(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _by_name(spans):
    return {s.name: s for s in spans.get()}


def test_every_submodule_call_is_a_span_named_by_its_path_and_nested_as_called(otel_gpu_spans):
    """Root named by its class, children by path (layers.1.self_attn.q); the class is an
    attribute; parent/child links follow the calls; parameters are not recorded as inputs."""
    spans = otel_gpu_spans(level=3)
    model = Model()
    assert otel_gpu.instrument_module(model) == 9  # the ModuleList has no forward
    model(torch.ones(2, 4))
    got = _by_name(spans)
    assert set(got) == {
        "Model",
        "layers.0",
        "layers.0.self_attn",
        "layers.0.self_attn.q",
        "layers.0.norm",
        "layers.1",
        "layers.1.self_attn",
        "layers.1.self_attn.q",
        "layers.1.norm",
    }
    attn = got["layers.1.self_attn"]
    assert attn.attributes["otel_gpu.module.class"] == f"{__name__}.Attention"
    assert attn.attributes["otel_gpu.module.path"] == "layers.1.self_attn"
    assert attn.attributes["otel_gpu.input.hidden_states.shape"] == (2, 4)
    assert attn.attributes["otel_gpu.input.mask.default"] is True
    assert attn.parent.span_id == got["layers.1"].context.span_id
    assert got["layers.1.self_attn.q"].parent.span_id == attn.context.span_id
    assert got["layers.1"].parent.span_id == got["Model"].context.span_id
    assert not any(
        "weight" in k or "self" in k.split(".")[2] for k in attn.attributes if "input" in k
    )


def test_outputs_are_bit_identical_and_the_exception_passes_through(otel_gpu_spans):
    """Wrapping changes nothing the model computes; a raising forward gives the same object."""
    otel_gpu_spans(level=5)
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(3, 4)
    expected = model(x)
    otel_gpu.instrument_module(model)
    assert torch.equal(model(x), expected)
    error = ValueError("bad")

    def boom(hidden_states, mask=None):
        raise error

    model.layers[0].self_attn.q.forward = boom  # replaced below our wrapper of self_attn
    with pytest.raises(ValueError) as info:
        model(x)
    assert info.value is error


def test_depth_include_idempotence_and_uninstrument(otel_gpu_spans):
    """depth limits how deep, include filters by path or class pattern; twice wraps once;
    uninstrument_module restores the class forward."""
    spans = otel_gpu_spans(level=1)
    model = Model()
    assert otel_gpu.instrument_module(model, depth=2) == 3
    assert otel_gpu.instrument_module(model, depth=2) == 0
    model(torch.ones(1, 4))
    assert sorted(_by_name(spans)) == ["Model", "layers.0", "layers.1"]
    assert otel_gpu.uninstrument_module(model) == 3
    assert "forward" not in model.__dict__
    spans.clear()
    assert otel_gpu.instrument_module(model, include=["*Attention"]) == 2
    model(torch.ones(1, 4))
    assert sorted(_by_name(spans)) == ["layers.0.self_attn", "layers.1.self_attn"]


def test_deepcopy_of_an_instrumented_model_calls_its_own_modules(otel_gpu_spans):
    """copy.deepcopy(model) rebinds the wrappers to the copy: the copy computes with its own weights."""
    otel_gpu_spans(level=1)
    model = Model(1)
    otel_gpu.instrument_module(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.layers[0].self_attn.q.weight.zero_()
        clone.layers[0].self_attn.q.bias.fill_(1.0)
    x = torch.randn(2, 4)
    assert not torch.equal(clone(x), model(x))
    assert torch.equal(clone.layers[0].self_attn(x), torch.ones(2, 4))


def test_level_0_wraps_nothing():
    """At level 0 the model is untouched."""
    otel_gpu.configure(level=0)
    model = Model()
    assert otel_gpu.instrument_module(model) == 0
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_parameter_statistics_show_a_weight_that_turned_nan(otel_gpu_spans, monkeypatch):
    """OTEL_GPU_MODULE_PARAM_STATS at level 5: each module's first call carries statistics of its
    own parameters, once, and a NaN weight marks the span nonfinite."""
    spans = otel_gpu_spans(level=5, module_param_stats=True)
    model = Model(1)
    with torch.no_grad():
        model.layers[0].self_attn.q.weight[0, 0] = float("nan")
    otel_gpu.instrument_module(model)
    model(torch.ones(1, 4))
    model(torch.ones(1, 4))
    q_spans = [s for s in spans.get() if s.name == "layers.0.self_attn.q"]
    first, second = q_spans
    events = {
        e.attributes["otel_gpu.tensor"]: e for e in first.events if e.name == "otel_gpu.param_stats"
    }
    assert set(events) == {"param.weight", "param.bias"}
    assert events["param.weight"].attributes["nan_count"] == 1
    assert first.attributes["otel_gpu.nonfinite"] is True
    assert not [e for e in second.events if e.name == "otel_gpu.param_stats"]


def test_level_10_under_instrument_module_warns_once_that_replay_will_skip(
    otel_gpu_spans, tmp_path, caplog
):
    """Level 10 dumps of instance-wrapped module forwards can never be replayed: recording says
    so once, at instrument_module(), naming the layout that replays, instead of leaving the user
    to find out from a replay that skips every call."""
    from otel_gpu import _guard

    _guard._reset()  # warned once per process: an earlier test may have warned already
    otel_gpu_spans(level=10, dump_dir=str(tmp_path / "dumps"))
    with caplog.at_level("WARNING", logger="otel_gpu"):
        otel_gpu.instrument_module(nn.Sequential(nn.Linear(4, 4)))
        otel_gpu.instrument_module(nn.Sequential(nn.Linear(4, 4)))
    warnings = [r.getMessage() for r in caplog.records if "instrument_module" in r.getMessage()]
    assert len(warnings) == 1
    assert "replay" in warnings[0] and "OTEL_GPU_DUMP_MODULES=true" in warnings[0]


def test_parameter_statistics_follow_live_control_raising_a_module_to_level_5(
    otel_gpu_spans, tmp_path
):
    """Instrumented at level 0 with live control on, a module gets its parameter statistics on
    the first call recorded after control raised it to level 5, once; a module left at level 0
    under a raised parent adds nothing to its parent's span."""
    from otel_gpu.control import document, state

    spans = otel_gpu_spans(
        level=0, module_param_stats=True, control="on", journal_dir=str(tmp_path / "journal")
    )
    try:
        model = Model(1)
        otel_gpu.instrument_module(model)
        model(torch.ones(1, 4))  # level 0: nothing recorded, no statistics taken
        doc = {"level": 5, "include": ["layers.0.self_attn.q", "layers.0"], "for": None}
        state.apply(document.parse(doc), "test")
        model(torch.ones(1, 4))
        model(torch.ones(1, 4))
    finally:
        state.reset("test")
    by_name: dict[str, list] = {}
    for span in sorted(spans.get(), key=lambda s: s.start_time):
        by_name.setdefault(span.name, []).append(span)
    first, second = by_name["layers.0.self_attn.q"]
    events = [e for e in first.events if e.name == "otel_gpu.param_stats"]
    assert {e.attributes["otel_gpu.tensor"] for e in events} == {"param.weight", "param.bias"}
    assert not [e for e in second.events if e.name == "otel_gpu.param_stats"]
    # layers.0 (no parameters of its own) was raised; its norm, left at level 0, ran under it
    assert len(by_name["layers.0"]) == 2 and "layers.0.norm" not in by_name
    assert not [
        e for s in by_name["layers.0"] for e in s.events if e.name == "otel_gpu.param_stats"
    ]
