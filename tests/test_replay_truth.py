"""Replay never says ``pass`` without comparing, and every message it prints says what is true.

Outputs that are dict subclasses (transformers' ``ModelOutput``), pytree-registered types and
objects holding tensors are recorded and compared leaf by leaf; what cannot be recorded makes
the call ``unverified``, a failure unless ``--allow-unverified``; the span says why.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from otel_gpu import cli
from otel_gpu.export import pipeline
from otel_gpu.replay import Allow, Options, exit_code, replay

LIB = """
import collections
import torch
import torch.utils._pytree as pytree
import otel_gpu

W = {"scale": torch.tensor(2.0)}

class Output(collections.OrderedDict):
    '''A dict subclass returned by a model, like transformers' ModelOutput.'''

class Boxed:
    '''Registered with torch's pytree: its leaves are known to torch.'''
    def __init__(self, a, b):
        self.a, self.b = a, b

pytree.register_pytree_node(
    Boxed,
    lambda box: ([box.a, box.b], None),
    lambda leaves, ctx: Boxed(*leaves),
    flatten_with_keys_fn=lambda box: (
        [(pytree.GetAttrKey("a"), box.a), (pytree.GetAttrKey("b"), box.b)], None
    ),
)

class Layer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values

class Cache:
    '''Holds tensors in public attributes, like transformers' DynamicCache; not registered.'''
    def __init__(self, layers):
        self.layers = layers
        self.offloading = False

class Handle:
    '''An object with no tensors: the recorder cannot record it.'''
    def __init__(self):
        self.name = "h"

@otel_gpu.api
def model(x):
    return Output(logits=x * W["scale"], hidden=x + 1)

@otel_gpu.api
def boxed(x):
    return Boxed(x * W["scale"], x)

@otel_gpu.api
def cached(x):
    return x * W["scale"], Cache([Layer(x * W["scale"], x), Layer(x, x)])

@otel_gpu.api
def with_handle(x):
    return x * W["scale"], Handle()

@otel_gpu.api
def builtin_like(x):
    return x
"""


@pytest.fixture
def recorded(otel_gpu_spans, module_factory, tmp_path):
    """Record calls of the library at level 10; returns (module, dump root, captured spans)."""
    root = tmp_path / "d"
    spans = otel_gpu_spans(level=10, dump_dir=str(root))
    m = module_factory(LIB, "truthlib")
    return m, root, spans


def _replay(m, root, **kw):
    pipeline.reset(timeout=2.0)
    return replay(str(root), Options(allow=Allow([m.__name__]), **kw))


@pytest.mark.parametrize("fn", ["model", "boxed", "cached"])
def test_containers_are_compared_leaf_by_leaf_pass_then_mismatch(recorded, fn):
    """A dict subclass, a pytree type and a tensor-holding object: pass when unchanged; after the
    weights change, mismatch naming the leaf — never pass."""
    m, root, _ = recorded
    getattr(m, fn)(torch.ones(3))
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["pass"], results[0].detail
    m.W["scale"] = torch.tensor(2.74)  # the weights changed since the recording
    results = _replay(m, root)
    assert [r.verdict for r in results] == ["mismatch"]
    first = results[0].mismatches[0]
    assert first["max_abs"] == pytest.approx(0.74, rel=1e-4)
    expected_leaf = {
        "model": "output['logits']",
        "boxed": "output.a",
        "cached": "output[0]",
    }[fn]
    assert first["output"] == expected_leaf


def test_a_kv_cache_inside_the_output_is_compared_too(recorded):
    """A change only inside the cache object's tensors is a mismatch on that leaf."""
    m, root, _ = recorded
    m.cached(torch.ones(3))
    pipeline.reset(timeout=2.0)
    original = m.Layer

    class Shifted(original):
        def __init__(self, keys, values):
            super().__init__(keys, values + 1)

    m.Layer = Shifted
    try:
        results = _replay(m, root)
    finally:
        m.Layer = original
    # the class itself changed: the recorded type no longer matches the object returned
    assert results[0].verdict == "mismatch"
    assert "output[1].layers[0]" in results[0].detail


def test_real_transformers_model_output_is_compared(otel_gpu_spans, module_factory, tmp_path):
    """transformers' ModelOutput (an OrderedDict subclass registered with pytree) is compared by
    key: a changed weight gives a mismatch on ``output['logits']``, never a pass."""
    pytest.importorskip("transformers")
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root))
    m = module_factory(
        """
import torch
import otel_gpu
from transformers.modeling_outputs import CausalLMOutput

W = {"w": torch.tensor(1.0)}

@otel_gpu.api
def run_model(x):
    return CausalLMOutput(logits=x * W["w"])
""",
        "hflib",
    )
    m.run_model(torch.ones(2))
    assert _replay(m, root)[0].verdict == "pass"
    m.W["w"] = torch.tensor(1.74)
    result = _replay(m, root)[0]
    assert result.verdict == "mismatch" and result.mismatches[0]["output"] == "output['logits']"


def test_an_output_that_cannot_be_recorded_makes_the_call_unverified(recorded):
    """An object without tensors in the result: recorded parts are compared, the rest listed; the
    verdict is unverified (a failure), and the span says what was skipped and why."""
    m, root, spans = recorded
    m.with_handle(torch.ones(2))
    (span,) = spans.get()
    assert span.attributes["otel_gpu.dump.outputs_skipped"] == "unsupported_type"
    (why,) = span.attributes["otel_gpu.dump.outputs_unsupported"]
    assert why.startswith("output.1 (") and "Handle" in why
    results = _replay(m, root)
    (result,) = results
    assert result.verdict == "unverified"
    assert "output[1]" in result.detail and "Handle" in result.detail
    assert "everything recorded matched" in result.detail
    assert exit_code(results) == 1 and exit_code(results, allow_unverified=True) == 0


def test_unverified_is_reported_even_when_recorded_parts_changed_it_is_a_mismatch(recorded):
    """A mismatch on what was recorded wins over unverified: the difference is a fact."""
    m, root, _ = recorded
    m.with_handle(torch.ones(2))
    m.W["scale"] = torch.tensor(3.0)
    assert _replay(m, root)[0].verdict == "mismatch"


def test_outputs_not_written_for_a_limit_make_the_call_unverified(
    otel_gpu_spans, module_factory, tmp_path
):
    """Outputs skipped at max_size: the call ran, but nothing was compared: unverified, not pass."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root), dump_max_size_gb=200 / 2**30)
    m = module_factory(LIB, "truthlib")
    m.model(torch.ones(20))  # 80 bytes in fit the 200-byte budget; 160 bytes out do not
    (result,) = _replay(m, root)
    assert result.verdict == "unverified"
    assert "outputs were not recorded (max_size): nothing was compared" in result.detail


def test_cli_unverified_fails_unless_allowed_and_is_counted(recorded, capsys):
    """The command prints UNVERIFIED with the reason, counts it, exits 1; 0 with --allow-unverified."""
    m, root, _ = recorded
    m.with_handle(torch.ones(2))
    pipeline.reset(timeout=2.0)
    base = ["replay", "--dir", str(root), "--allow-module", m.__name__]
    assert cli.main(base) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("UNVERIFIED")
    assert "1 unverified" in out.splitlines()[-1]
    assert cli.main([*base, "--allow-unverified"]) == 0
    capsys.readouterr()
    assert cli.main([*base, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["unverified"] == 1
    assert report["results"][0]["unchecked"][0].startswith("output[1]")


# ----------------------------------------------------------------------------- messages


STATEFUL = """
import otel_gpu

class Opaque:
    @otel_gpu.api
    def run(self, x):
        return x
"""


def test_stateful_method_message_has_its_prefix_once(otel_gpu_spans, module_factory, tmp_path):
    """'stateful method: <module:Type> has no __otel_gpu_state__ hook' — the prefix appears once."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root))
    m = module_factory(STATEFUL, "statelib")
    m.Opaque().run(torch.ones(1))
    (result,) = _replay(m, root)
    assert result.verdict == "skipped"
    assert result.detail == f"stateful method: {m.__name__}:Opaque has no __otel_gpu_state__ hook"


def test_a_builtin_is_skipped_as_builtin_never_as_not_found(otel_gpu_spans, tmp_path):
    """A builtin decorated directly (no Python code) is not replayable because it is a builtin."""
    import otel_gpu

    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root))
    sdpa = otel_gpu.api(torch._C._nn.scaled_dot_product_attention)
    q = torch.ones(1, 1, 2, 4)
    sdpa(q, q, q)
    pipeline.reset(timeout=2.0)
    (directory,) = [p for p in root.iterdir() if p.is_dir()]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["replayable"] is False
    why = manifest["why_not_replayable"]
    assert why.startswith("builtin: ") and "has no Python code" in why
    assert "could not be found" not in why
    (result,) = replay(str(root), Options(allow=Allow(["torch"])))
    assert result.verdict == "skipped" and result.detail.startswith("builtin: ")


def test_a_missing_directory_and_an_empty_one_are_told_apart(tmp_path, capsys):
    """'no such directory' when --dir does not exist; 'no call directories' when it has none."""
    assert cli.main(["replay", "--dir", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert cli.main(["replay", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no call directories" in err and "no such directory" not in err


def test_an_isolated_call_that_crashes_for_the_first_time_does_not_crash_again(
    otel_gpu_spans, module_factory, tmp_path
):
    """--isolate on a call that completed when recorded but now dies: 'crashes', never 'again'."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root))
    m = module_factory(
        """
import os
import otel_gpu

@otel_gpu.api
def flaky(x):
    if os.environ.get("FLAKY_DIE"):
        os._exit(3)
    return x
""",
        "flakylib",
    )
    m.flaky(torch.ones(1))
    pipeline.reset(timeout=2.0)
    os.environ["FLAKY_DIE"] = "1"
    try:
        (result,) = replay(str(root), Options(allow=Allow([m.__name__]), isolate=True))
    finally:
        del os.environ["FLAKY_DIE"]
    assert result.verdict == "error"
    assert result.detail.startswith("the call crashes (exit code 3)")
    assert "again" not in result.detail
