"""Every callable shape binds its arguments to the right names and records the right receiver.

The bug this pins: a bound method whose function carries ``__wrapped__`` (``functools.wraps``,
``torch.no_grad``) was bound as if ``self`` were passed, so every argument shifted by one.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

import otel_gpu
from otel_gpu.export import pipeline


def _decorator(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return fn(*args, **kwargs)

    return inner


class Block:
    def __init__(self, scale):
        self.scale = scale

    @_decorator
    def forward(self, hidden_states, cache=None, *, use_cache=False):
        return hidden_states * self.scale

    def plain(self, hidden_states, cache=None):
        return hidden_states

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens=2):
        return input_ids

    @staticmethod
    def static(x, y=1):
        return x

    @classmethod
    def build(cls, n, bias=0):
        return torch.arange(n) + bias

    def __call__(self, hidden_states):
        return hidden_states


def _inputs(span) -> dict:
    return {
        k.removeprefix("otel_gpu.input."): v
        for k, v in span.attributes.items()
        if k.startswith("otel_gpu.input.")
    }


@pytest.mark.parametrize("method", ["forward", "plain", "generate"])
def test_bound_methods_wrapped_or_not_bind_by_name(otel_gpu_spans, method):
    """``otel_gpu.api(obj.method)`` (bound; wrapped by functools.wraps or torch.no_grad, or not):
    the first argument is the first parameter after self, never shifted; self is not recorded."""
    spans = otel_gpu_spans(level=3)
    block = Block(2.0)
    fn = otel_gpu.api(getattr(block, method))
    x = torch.ones(2, 8)
    fn(x)
    a = _inputs(spans.get()[0])
    first = "input_ids" if method == "generate" else "hidden_states"
    assert a[f"{first}.shape"] == (2, 8)
    assert not any(k.startswith("self") for k in a)
    if method != "generate":
        assert a["cache.value"] == "None" and a["cache.default"] is True


def test_methods_patched_on_an_instance_bind_by_name(otel_gpu_spans):
    """``obj.forward = otel_gpu.api(obj.forward)``, as hand-patching does: names stay right."""
    spans = otel_gpu_spans(level=3)
    block = Block(2.0)
    block.forward = otel_gpu.api(block.forward)
    out = block.forward(torch.ones(3), cache=torch.zeros(1), use_cache=True)
    assert torch.equal(out, torch.full((3,), 2.0))
    a = _inputs(spans.get()[0])
    assert a["hidden_states.shape"] == (3,) and a["cache.shape"] == (1,)
    assert a["use_cache.value"] is True


def test_functions_decorated_in_a_class_body_skip_self(otel_gpu_spans, module_factory):
    """Decorated where defined, a method receives self as args[0], which is not recorded."""
    otel_gpu_spans(level=3)
    spans = otel_gpu_spans(level=3)
    m = module_factory(
        """
import otel_gpu

class K:
    @otel_gpu.api
    def run(self, q, k=None):
        return q

    @otel_gpu.api
    @staticmethod
    def s(q, k=None):
        return q

    @otel_gpu.api
    @classmethod
    def c(cls, q, k=None):
        return q
""",
        "bindlib",
    )
    m.K().run(1, k=2)
    m.K.s(1, 2)
    m.K.c(1)
    m.K().c(1)
    got = [_inputs(s) for s in spans.get()]
    assert [g["q.value"] for g in got] == [1, 1, 1, 1]
    assert got[0]["k.value"] == 2 and got[1]["k.value"] == 2 and got[2]["k.default"] is True
    assert not any(k.startswith(("self", "cls")) for g in got for k in g)


@pytest.mark.parametrize(
    "make, call, expected",
    [
        (lambda b: Block.static, lambda f: f(torch.ones(1), y=3), {"x.shape": (1,), "y.value": 3}),
        (lambda b: Block.build, lambda f: f(4, bias=1), {"n.value": 4, "bias.value": 1}),
        (
            lambda b: functools.partial(Block.static, torch.ones(2)),
            lambda f: f(y=5),
            {"y.value": 5},
        ),
        (lambda b: b, lambda f: f(torch.ones(4)), {"hidden_states.shape": (4,)}),
        (lambda b: torch.add, lambda f: f(torch.ones(1), torch.ones(1)), {"arg0.shape": (1,)}),
    ],
    ids=["staticmethod", "classmethod", "partial", "callable-object", "builtin"],
)
def test_every_callable_shape_binds_its_arguments(otel_gpu_spans, make, call, expected):
    """staticmethods, classmethods (bound to the class), partials (only the open parameters),
    callable objects (their __call__ minus self) and builtins without a signature (arg0…)."""
    spans = otel_gpu_spans(level=3)
    fn = otel_gpu.api(make(Block(1.0)))
    call(fn)
    a = _inputs(spans.get()[0])
    for key, value in expected.items():
        assert a[key] == value, key
    assert not any(k.startswith(("self", "cls")) for k in a)


def test_a_bound_methods_receiver_is_recorded_as_the_receiver_at_level_10(otel_gpu_spans, tmp_path):
    """At level 10 the receiver of a bound method is its __self__, not the first tensor argument:
    the first argument is recorded as the first parameter."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root))
    block = Block(2.0)
    fn = otel_gpu.api(block.forward)
    fn(torch.ones(2))
    pipeline.reset(timeout=2.0)
    (directory,) = [p for p in root.iterdir() if p.is_dir()]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert [p["name"] for p in manifest["params"]][:2] == ["hidden_states", "cache"]
    assert manifest["params"][0]["value"] == {"t": "tensor", "key": "input.hidden_states"}
    assert manifest["receiver"]["type"].endswith(":Block")
    assert manifest["function"]["receiver"] is True
