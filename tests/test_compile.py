"""Under ``torch.compile(fullgraph=True)``: no graph break, no warning, eager results, and one span
per runtime call of every decorated function inside the graph, nested as called."""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from torch._dynamo.utils import counters

import otel_gpu

LIB = """
import torch
import otel_gpu

@otel_gpu.api
def scale(x, factor: float = 2.0):
    return x * factor

@otel_gpu.api
def block(x, y):
    return scale(x) + y.sin()

def picked(x, idx):
    return x[idx]

def plain(x, y):
    return x.cos() - y
"""


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _compile(fn, backend):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, backend=backend, fullgraph=True)


# torch's own: inductor compiles raise it with or without otel-gpu (checked with a bare model)
_TORCH_OWN = ("`torch.jit.script_method` is deprecated",)


@contextlib.contextmanager
def _eager_threads(n: int = 3):
    """``n`` threads calling a decorated ``served(x)`` eagerly at full speed until the block
    ends; yields the list of their call counts (final once the block has ended)."""

    @otel_gpu.api
    def served(x):
        return x + 1

    stop = threading.Event()
    calls = [0] * n

    def serve(i: int) -> None:
        x = torch.ones(8)
        while not stop.is_set():
            torch.testing.assert_close(served(x), x + 1)
            calls[i] += 1

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        yield calls
    finally:
        stop.set()
        for t in threads:
            t.join()


def _otel_warnings(caught) -> list[str]:
    """Every warning of the compiled run except torch's own known deprecation."""
    return [str(w.message) for w in caught if not str(w.message).startswith(_TORCH_OWN)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("level", [1, 3, 5, 10])
def test_decorated_calls_compile_fullgraph_and_each_runtime_call_is_a_span(
    otel_gpu_spans, module_factory, tmp_path, level, backend
):
    """Every level compiles with fullgraph under both backends with zero graph breaks and no
    warning; results equal eager; two runs of a graph with two decorated calls give four
    spans, each nested under the caller's span and its enclosing call, marked compiled, with
    level-3 metadata and level-5 statistics taken from the runtime tensors."""
    dumps = tmp_path / "dumps"
    spans = otel_gpu_spans(level=level, dump_dir=str(dumps))
    lib = module_factory(LIB)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    expected, expected_next = lib.block(x, y), lib.block(x + 1, y)
    otel_gpu.flush()
    spans.clear()
    dumped = sorted(dumps.rglob("*")) if dumps.exists() else []
    assert bool(dumped) == (level >= 10)  # the eager call is dumped at level 10
    compiled = _compile(lib.block, backend)
    tracer = TracerProvider().get_tracer("test")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer.start_as_current_span("caller") as caller:
            first = compiled(x, y)
            second = compiled(x + 1, y)
    assert _graph_breaks() == 0
    assert _otel_warnings(caught) == []
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected_next)
    otel_gpu.flush()
    got = [s for s in spans.get() if s.attributes.get("otel_gpu.compiled")]
    assert sorted(s.name.rsplit(".", 1)[-1] for s in got) == ["block", "block", "scale", "scale"]
    outer = [s for s in got if s.name.endswith("block")]
    inner = [s for s in got if s.name.endswith("scale")]
    caller_id = caller.get_span_context().span_id
    assert all(s.parent.span_id == caller_id for s in outer)
    assert {s.parent.span_id for s in inner} == {s.context.span_id for s in outer}
    assert all(s.start_time <= s.end_time for s in got)
    if level >= 3:
        assert all(s.attributes["otel_gpu.input.x.shape"] == (3, 4) for s in got), [
            dict(s.attributes) for s in got
        ]
        assert all(s.attributes["otel_gpu.output.0.dtype"] == "torch.float32" for s in got)
        assert all(s.attributes["otel_gpu.input.y.shape"] == (3, 4) for s in outer)
    else:
        assert not any("otel_gpu.input.x.shape" in s.attributes for s in got)
    if level >= 5:
        for s in inner:
            keys = {e.attributes.get("otel_gpu.tensor") for e in s.events}
            assert {"input.x", "output.0"} <= keys, s.events
        # statistics are the runtime tensors' own: the second run saw x + 1
        means = sorted(
            e.attributes["mean"]
            for s in inner
            for e in s.events
            if e.attributes.get("otel_gpu.tensor") == "input.x"
        )
        assert means[1] == pytest.approx(means[0] + 1, abs=1e-4)
    # calls inside a graph are never dumped (docs/compile.md): nothing new on disk
    assert (sorted(dumps.rglob("*")) if dumps.exists() else []) == dumped


def test_nonfinite_values_mark_the_span_but_never_raise_inside_a_graph(
    otel_gpu_spans, module_factory
):
    """OTEL_GPU_ON_NONFINITE=raise raises after an eager call, but inside a compiled graph the
    program runs on: the span is marked otel_gpu.nonfinite and holds the NaN count."""
    spans = otel_gpu_spans(level=5, on_nonfinite="raise")
    lib = module_factory(LIB)
    x = torch.tensor([1.0, float("nan")])
    with pytest.raises(otel_gpu.NonFiniteError):
        lib.scale(x)
    otel_gpu.flush()
    spans.clear()
    compiled = _compile(lambda t: lib.scale(t) + 1, "aot_eager")
    out = compiled(x)
    assert out[0].item() == 3.0 and out[1].isnan()
    otel_gpu.flush()
    (span,) = spans.get()
    assert span.attributes["otel_gpu.nonfinite"] is True
    nan = {e.attributes["otel_gpu.tensor"]: e.attributes.get("nan_count") for e in span.events}
    assert nan["input.x"] == 1 and nan["output.0"] == 1


def test_level_0_compiles_to_the_same_graph_with_no_span(otel_gpu_spans, module_factory):
    """Level 0 leaves the function itself: nothing in the graph, no span."""
    spans = otel_gpu_spans(level=0)
    lib = module_factory(LIB)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(_compile(lib.block, "aot_eager")(x, y), lib.block(x, y))
    assert _graph_breaks() == 0
    otel_gpu.flush()
    assert spans.get() == []


@pytest.mark.parametrize(
    ("level", "backend"),
    [(1, "aot_eager"), (3, "aot_eager"), (5, "aot_eager"), (10, "aot_eager"), (3, "inductor")],
)
def test_instrumented_targets_compile_fullgraph(
    otel_gpu_spans, module_factory, tmp_path, level, backend
):
    """A function patched by otel_gpu.instrument() compiles with fullgraph inside a caller's graph,
    gives eager results, and each runtime call is a compiled span with its metadata."""
    spans = otel_gpu_spans(level=level, dump_dir=str(tmp_path / "dumps"))
    lib = module_factory(LIB)
    assert otel_gpu.instrument(lib.plain)

    def model(x, y):
        return lib.plain(x, y) * 3

    x, y = torch.randn(5), torch.randn(5)
    expected = model(x, y)
    otel_gpu.flush()
    spans.clear()
    compiled = _compile(model, backend)
    for _ in range(3):
        torch.testing.assert_close(compiled(x, y), expected)
    assert _graph_breaks() == 0
    otel_gpu.flush()
    got = spans.get()
    assert len(got) == 3
    assert all(s.attributes["otel_gpu.compiled"] is True for s in got)
    if level >= 3:
        assert all(s.attributes["otel_gpu.input.x.shape"] == (5,) for s in got)


def test_a_graph_that_raises_leaves_no_stale_parent(otel_gpu_spans, module_factory):
    """A runtime error inside a compiled graph passes through; the calls it left open never
    become parents: the next run's spans nest under the caller's span, as in a clean run."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)

    @otel_gpu.api
    def outer(x, idx):
        return lib.scale(lib.picked(x, idx))

    compiled = _compile(outer, "aot_eager")
    x = torch.randn(4)
    with pytest.raises(IndexError):
        compiled(x, torch.tensor([7]))
    otel_gpu.flush()
    spans.clear()
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        torch.testing.assert_close(compiled(x, torch.tensor([1])), x[[1]] * 2)
    otel_gpu.flush()
    got = {s.name.rsplit(".", 1)[-1]: s for s in spans.get()}
    assert set(got) == {"outer", "scale"}
    assert got["outer"].parent.span_id == caller.get_span_context().span_id
    assert got["scale"].parent.span_id == got["outer"].context.span_id
    assert trace.get_current_span() is trace.INVALID_SPAN  # no context left attached


@pytest.fixture(scope="module")
def gpt2_reference():
    pytest.importorskip("transformers")
    import tiny_models

    model = tiny_models.gpt2()
    ids, mask = tiny_models.inputs()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    return ids, mask, expected


@pytest.mark.transformers
@pytest.mark.parametrize(
    ("level", "backend"),
    [(1, "aot_eager"), (3, "aot_eager"), (5, "aot_eager"), (10, "aot_eager"), (3, "inductor")],
)
def test_tiny_gpt2_under_instrument_module_compiles_fullgraph(
    otel_gpu_spans, gpt2_reference, tmp_path, level, backend
):
    """A transformers GPT2 instrumented whole compiles with fullgraph and no graph break, gives
    the eager logits, and every run gives one span per submodule call, as an eager run does."""
    import tiny_models

    spans = otel_gpu_spans(level=level, dump_dir=str(tmp_path / "dumps"))
    ids, mask, expected = gpt2_reference
    model = tiny_models.gpt2()
    assert otel_gpu.instrument_module(model) > 20
    with torch.no_grad():
        model(ids, attention_mask=mask)
    otel_gpu.flush()
    eager = sorted(s.name for s in spans.get())
    spans.clear()
    compiled = _compile(model, backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(
                    compiled(ids, attention_mask=mask).logits, expected, rtol=1e-4, atol=1e-5
                )
    assert _graph_breaks() == 0
    assert _otel_warnings(caught) == []
    otel_gpu.flush()
    got = spans.get()
    assert sorted(s.name for s in got) == sorted(eager * 2)
    assert all(s.attributes["otel_gpu.compiled"] is True for s in got)
    by_id = {s.context.span_id: s for s in got}
    attn = [s for s in got if s.name == "transformer.h.0.attn"]
    assert len(attn) == 2
    assert all(by_id[s.parent.span_id].name == "transformer.h.0" for s in attn)
    if level >= 3:
        assert all(s.attributes["otel_gpu.input.hidden_states.shape"] == (2, 8, 64) for s in attn)


def test_module_parameter_statistics_are_left_out_under_compile(otel_gpu_spans):
    """OTEL_GPU_MODULE_PARAM_STATS at level 5: an eager first call gets them; under compile the
    tree still compiles with fullgraph and its spans carry the call's statistics, not the
    parameters' (documented in docs/compile.md)."""
    spans = otel_gpu_spans(level=5, module_param_stats=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert otel_gpu.instrument_module(model) == 3
    x = torch.randn(2, 4)
    # not model(x): an eager first call would take the parameter statistics itself
    expected = torch.relu(torch.nn.functional.linear(x, model[0].weight, model[0].bias))
    compiled = _compile(model, "aot_eager")
    torch.testing.assert_close(compiled(x), expected)
    assert _graph_breaks() == 0
    otel_gpu.flush()
    got = [s for s in spans.get() if s.attributes.get("otel_gpu.compiled")]
    assert len(got) == 3
    assert all(any(e.name == "otel_gpu.stats" for e in s.events) for s in got)
    assert not any(e.name == "otel_gpu.param_stats" for s in got for e in s.events)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_training_through_a_compiled_graph_keeps_gradients(otel_gpu_spans, backend):
    """Backward through a compiled graph with decorated calls gives eager's gradients; the
    forward calls are spans, with the metadata of tensors that require grad."""
    spans = otel_gpu_spans(level=5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    reference.load_state_dict(model.state_dict())
    assert otel_gpu.instrument_module(model) == 3
    x = torch.randn(5, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).square().sum().backward()
    compiled = _compile(model, backend)
    compiled(x).square().sum().backward()
    assert _graph_breaks() == 0
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)
    otel_gpu.flush()
    got = spans.get()
    assert len(got) == 3
    assert all(s.attributes["otel_gpu.compiled"] is True for s in got)
    root = next(s for s in got if s.name == "Sequential")
    assert root.attributes["otel_gpu.input.input.requires_grad"] is True


def test_calls_in_an_unsampled_trace_record_nothing(otel_gpu_spans, module_factory):
    """Inside a trace the application's sampler dropped, compiled calls make no span, as eager
    calls do."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    spans = otel_gpu_spans(level=3)
    lib = module_factory(LIB)
    compiled = _compile(lib.block, "aot_eager")
    x = torch.randn(3)
    with TracerProvider(sampler=ALWAYS_OFF).get_tracer("t").start_as_current_span("dropped"):
        torch.testing.assert_close(compiled(x, x), lib.block(x, x))
    otel_gpu.flush()
    assert spans.get() == []
    compiled(x, x)
    otel_gpu.flush()
    assert len(spans.get()) == 2


def test_tensors_of_long_arguments_and_results_stop_at_max_items(otel_gpu_spans):
    """OTEL_GPU_MAX_ITEMS bounds the tensors recorded from a list argument and a tuple result,
    as in eager capture."""
    spans = otel_gpu_spans(level=3, max_items=2)

    @otel_gpu.api
    def split(parts):
        return tuple(p * 2 for p in parts)

    compiled = _compile(lambda parts: split(parts), "aot_eager")
    parts = [torch.randn(2) for _ in range(5)]
    for got, part in zip(compiled(parts), parts):
        torch.testing.assert_close(got, part * 2)
    otel_gpu.flush()
    (span,) = spans.get()
    shapes = sorted(k for k in span.attributes if k.endswith(".shape"))
    assert shapes == [
        "otel_gpu.input.parts.0.shape",
        "otel_gpu.input.parts.1.shape",
        "otel_gpu.output.0.shape",
        "otel_gpu.output.1.shape",
    ]


def test_a_compiled_callable_called_inside_a_decorated_eager_call_nests_under_it(
    otel_gpu_spans, module_factory
):
    """An eager decorated call's span is current while it calls a compiled callable: the
    compiled graph's calls become its children."""
    spans = otel_gpu_spans(level=1)
    lib = module_factory(LIB)
    compiled = _compile(lib.block, "aot_eager")

    @otel_gpu.api
    def step(x):
        return compiled(x, x)

    x = torch.randn(3)
    expected = lib.block(x, x)
    otel_gpu.flush()
    spans.clear()
    torch.testing.assert_close(step(x), expected)
    otel_gpu.flush()
    got = {s.name.rsplit(".", 1)[-1]: s for s in spans.get() if s.name.endswith(("step", "block"))}
    assert got["block"].parent.span_id == got["step"].context.span_id
    assert got["block"].attributes["otel_gpu.compiled"] is True
    assert "otel_gpu.compiled" not in got["step"].attributes


def test_torch_export_leaves_no_otel_gpu_operator_in_the_exported_program(otel_gpu_spans):
    """An exported program outlives the process: exporting an instrumented model gives the graph
    of the bare model, with no otel-gpu operator, and the same results."""
    spans = otel_gpu_spans(level=3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    bare = torch.export.export(model, (x,))
    assert otel_gpu.instrument_module(model) == 3
    exported = torch.export.export(model, (x,))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if "otel_gpu" in t]
    assert targets == [str(n.target) for n in bare.graph.nodes if n.op == "call_function"]
    torch.testing.assert_close(exported.module()(x), bare.module()(x))
    otel_gpu.flush()
    assert spans.get() == []


@pytest.mark.parametrize(
    ("level", "backend"),
    [(level, backend) for backend in ("eager", "aot_eager") for level in (1, 3, 5)]
    + [(3, "inductor")],
)
def test_a_compile_beside_eager_threads_keeps_both_correct(
    otel_gpu_spans, module_factory, level, backend
):
    """A server recompiling on one thread while others keep serving: the compile (fullgraph)
    succeeds every time; every eager call on the other threads is an eager span with its
    arguments, never marked compiled; every compiled runtime call is a compiled span; no span
    is lost and no internal error happens (strict mode). ``torch.compiler.is_compiling()`` is
    true on every thread while any thread compiles: eager calls took the compiled path, lost
    their arguments and spans, and broke the compile's guards."""
    spans = otel_gpu_spans(level=level)
    lib = module_factory(LIB)
    compiled_runs = 0
    with _eager_threads() as eager_calls:
        for _ in range(3):  # each a fresh compile while the threads run
            compiled = _compile(lib.block, backend)
            x, y = torch.randn(4), torch.randn(4)
            for _ in range(2):
                torch.testing.assert_close(compiled(x, y), x * 2 + y.sin())
                compiled_runs += 1
    got = spans.get()
    eager = [s for s in got if s.name.endswith(".served")]
    assert len(eager) == sum(eager_calls)
    assert not any(s.attributes.get("otel_gpu.compiled") for s in eager)
    if level >= 3:
        assert all("otel_gpu.input.x.shape" in s.attributes for s in eager)
    blocks = [s for s in got if s.name.endswith(".block")]
    scales = [s for s in got if s.name.endswith(".scale")]
    assert len(blocks) == len(scales) == compiled_runs
    assert all(s.attributes.get("otel_gpu.compiled") is True for s in blocks + scales)
    by_id = {s.context.span_id: s for s in blocks}
    assert all(s.parent is not None and s.parent.span_id in by_id for s in scales)


@pytest.mark.transformers
def test_a_tiny_gpt2_compiles_beside_eager_threads(otel_gpu_spans, gpt2_reference):
    """The same with a transformers GPT2 instrumented whole (level 3, aot_eager): the compile
    succeeds with no graph break, gives the eager logits, and each run is one compiled span per
    submodule call, while the eager threads' spans keep their arguments."""
    import tiny_models

    spans = otel_gpu_spans(level=3)
    ids, mask, expected = gpt2_reference
    model = tiny_models.gpt2()
    otel_gpu.instrument_module(model)
    with torch.no_grad():
        model(ids, attention_mask=mask)
    per_forward = sorted(s.name for s in spans.get())  # one span per submodule called
    spans.clear()
    with _eager_threads() as eager_calls:
        compiled = _compile(model, "aot_eager")
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(
                    compiled(ids, attention_mask=mask).logits, expected, rtol=1e-4, atol=1e-5
                )
    assert _graph_breaks() == 0
    got = spans.get()
    eager = [s for s in got if s.name.endswith(".served")]
    assert len(eager) == sum(eager_calls)
    assert all(
        "otel_gpu.input.x.shape" in s.attributes and not s.attributes.get("otel_gpu.compiled")
        for s in eager
    )
    compiled_spans = [s for s in got if not s.name.endswith(".served")]
    assert sorted(s.name for s in compiled_spans) == sorted(per_forward * 2)
    assert all(s.attributes["otel_gpu.compiled"] is True for s in compiled_spans)


MODEL = """
import torch
import otel_gpu

@otel_gpu.api
def norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

@otel_gpu.api
def mlp(x, a, b):
    return torch.nn.functional.gelu(x @ a) @ b

def block(x, w, a, b):
    h = x + mlp(norm(x, w), a, b)
    return torch.softmax(norm(h, w) @ h.transpose(-1, -2), -1) @ h
"""


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_results_against_the_same_program_compiled_without_otel_gpu(
    otel_gpu_spans, module_factory, backend
):
    """What docs/compile.md claims: with the eager and aot_eager backends the instrumented
    compiled program's results are bit-identical to the same program compiled without
    otel-gpu; with inductor, otel-gpu's operators take each call's inputs and outputs, which
    changes what inductor fuses across a call's boundary, so results agree within
    torch.testing.assert_close's default tolerances, not necessarily bit for bit."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 16, 64), torch.randn(64)
    a, b = torch.randn(64, 256) / 8, torch.randn(256, 64) / 16
    otel_gpu.configure(level=0)
    bare = _compile(module_factory(MODEL).block, backend)(x, w, a, b)
    otel_gpu_spans(level=3)
    instrumented = _compile(module_factory(MODEL).block, backend)(x, w, a, b)
    if backend == "inductor":
        torch.testing.assert_close(instrumented, bare)
    else:
        assert torch.equal(instrumented, bare)
