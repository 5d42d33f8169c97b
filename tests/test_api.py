"""The decorator's contract at levels 0, 1 and 3: spans, names, nesting, exceptions, metadata keys."""

from __future__ import annotations

import asyncio
import enum
from collections import namedtuple

import pytest
import torch
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import StatusCode

import otel_gpu


def _attrs(span):
    return dict(span.attributes or {})


# ----------------------------------------------------------------------------- level 0


def test_level_0_returns_the_function_itself():
    """At level 0 the decorator is the identity: no wrapper, no per-call check."""

    def f(x):
        return x

    assert otel_gpu.api(f) is f
    assert otel_gpu.api(name="x")(f) is f


def test_level_0_is_the_default_from_an_empty_environment():
    """Without OTEL_GPU_LOGLEVEL nothing is instrumented."""
    assert otel_gpu.settings().level == 0


# ----------------------------------------------------------------------------- level 1


def test_level_1_one_span_per_call_with_qualified_name_and_code_attributes(otel_gpu_spans):
    """Each call is one span named module.qualname, with the current code.* semantic conventions."""
    spans = otel_gpu_spans(level=1)

    @otel_gpu.api
    def scale(x, factor=2.0):
        return x * factor

    for _ in range(3):
        scale(torch.ones(2))
    got = spans.get()
    assert len(got) == 3
    span = got[0]
    assert (
        span.name
        == f"{__name__}.test_level_1_one_span_per_call_with_qualified_name_and_code_attributes.<locals>.scale"
    )
    attrs = _attrs(span)
    assert attrs["code.function.name"] == span.name
    assert attrs["code.file.path"] == __file__
    assert attrs["code.line.number"] == scale.__wrapped__.__code__.co_firstlineno
    assert "code.function" not in attrs and "code.namespace" not in attrs
    assert not any(k.startswith("otel_gpu.input") for k in attrs)  # level 1: no metadata
    assert span.status.status_code is StatusCode.UNSET
    assert span.end_time >= span.start_time
    assert len({s.context.span_id for s in got}) == 3


def test_explicit_name_and_methods(otel_gpu_spans):
    """@api(name=...) names the span; methods get module.Class.method; static/class methods work."""
    spans = otel_gpu_spans(level=1)

    class Decode:
        @otel_gpu.api(name="BatchDecode.run")
        def run(self, x):
            return x + 1

        @otel_gpu.api
        def plan(self, x):
            return x

        @otel_gpu.api
        @staticmethod
        def helper(x):
            return x

        @otel_gpu.api
        @classmethod
        def create(cls):
            return cls()

    d = Decode.create()
    assert d.run(1) == 2
    d.plan(3)
    assert Decode.helper(5) == 5
    names = [s.name for s in spans.get()]
    prefix = f"{__name__}.test_explicit_name_and_methods.<locals>.Decode"
    assert names == [f"{prefix}.create", "BatchDecode.run", f"{prefix}.plan", f"{prefix}.helper"]


def test_wraps_keeps_metadata():
    """The wrapper keeps __name__, __doc__ and __wrapped__ so docs and introspection still work."""
    otel_gpu.configure(level=1, dest="stderr")

    @otel_gpu.api
    def documented(a, b=1):
        """Doc."""
        return a + b

    assert documented.__name__ == "documented"
    assert documented.__doc__ == "Doc."
    assert documented.__wrapped__(1) == 2


def test_exception_passes_through_as_the_same_object_and_span_is_error(otel_gpu_spans):
    """The caller gets the very same exception object with its traceback; the span is ERROR with an exception event."""
    spans = otel_gpu_spans(level=3)
    boom = ValueError("bad shape (64 vs 128)")

    @otel_gpu.api
    def kernel(x):
        raise boom

    with pytest.raises(ValueError) as info:
        kernel(torch.zeros(3))
    assert info.value is boom
    frames = []
    tb = info.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-1] == "kernel"  # the original raising frame is still there
    (span,) = spans.get()
    assert span.status.status_code is StatusCode.ERROR
    assert "ValueError: bad shape" in span.status.description
    (event,) = [e for e in span.events if e.name == "exception"]
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "bad shape (64 vs 128)"
    assert "raise boom" in event.attributes["exception.stacktrace"]
    assert _attrs(span)["otel_gpu.input.x.shape"] == (3,)


def test_base_exceptions_also_pass_through(otel_gpu_spans):
    """KeyboardInterrupt-style exceptions are re-raised untouched and still end the span."""
    spans = otel_gpu_spans(level=1)

    @otel_gpu.api
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert spans.get()[0].status.status_code is StatusCode.ERROR


def _with_app_tracer(otel_gpu_spans, name: str):
    """Level 1 into an application's own provider: (otel-gpu's spans, the app's tracer ``name``)."""
    provider = TracerProvider()
    spans = otel_gpu_spans(level=1, tracer_provider=provider)
    return spans, provider.get_tracer(name)


def test_nested_calls_are_children_and_user_spans_inside_are_children(otel_gpu_spans):
    """Decorated call inside another → child; a user span opened inside a call → child of that call."""
    spans, tracer = _with_app_tracer(otel_gpu_spans, "app")

    @otel_gpu.api
    def inner(x):
        with tracer.start_as_current_span("user-work"):
            return x

    @otel_gpu.api
    def outer(x):
        return inner(x) + inner(x)

    outer(1)
    got = {s.name.rsplit(".", 1)[-1]: s for s in spans.get()}
    by_id = {s.context.span_id: s for s in spans.get()}
    outer_span = got["outer"]
    inners = [s for s in spans.get() if s.name.endswith(".inner")]
    users = [s for s in spans.get() if s.name == "user-work"]
    assert len(inners) == 2 and len(users) == 2
    assert outer_span.parent is None
    for s in inners:
        assert s.parent.span_id == outer_span.context.span_id
        assert s.context.trace_id == outer_span.context.trace_id
    for u in users:
        assert by_id[u.parent.span_id].name.endswith(".inner")


def test_call_inside_application_span_becomes_its_child(otel_gpu_spans):
    """A call made inside an application's span (a serving request) is that span's child, same trace."""
    spans, tracer = _with_app_tracer(otel_gpu_spans, "server")

    @otel_gpu.api
    def decode(x):
        return x

    with tracer.start_as_current_span("POST /generate") as request:
        decode(1)
    got = spans.get()
    (call,) = [s for s in got if s.name.endswith("decode")]
    assert call.parent.span_id == request.get_span_context().span_id
    assert call.context.trace_id == request.get_span_context().trace_id


def test_unsampled_parent_means_no_span(otel_gpu_spans):
    """The parent's sampling decision is kept: inside an unsampled trace no call span is recorded."""
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    spans = otel_gpu_spans(level=1, tracer_provider=provider)

    @otel_gpu.api
    def work(x):
        return x * 2

    with provider.get_tracer("t").start_as_current_span("dropped"):
        assert work(2) == 4
    assert work(3) == 6  # a root call: ALWAYS_OFF root sampler also drops it
    assert spans.get() == []


def test_user_attributes_and_events_on_the_current_span_are_kept(otel_gpu_spans):
    """trace.get_current_span() inside a call is the call's span; what users add to it is exported."""
    from opentelemetry import trace

    spans = otel_gpu_spans(level=1)

    @otel_gpu.api
    def kernel():
        span = trace.get_current_span()
        span.set_attribute("kernel.backend", "cutlass")
        span.add_event("tuned", {"tile": 128})
        return span.get_span_context()

    ctx = kernel()
    (span,) = spans.get()
    assert span.context.span_id == ctx.span_id
    assert _attrs(span)["kernel.backend"] == "cutlass"
    assert [e.name for e in span.events] == ["tuned"]


def test_async_functions_get_a_span_covering_the_await(otel_gpu_spans):
    """Coroutine functions are wrapped with an async wrapper: the span covers the awaited work."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    async def fetch(x, delay=0.01):
        await asyncio.sleep(delay)
        return x

    assert asyncio.run(fetch(torch.ones(1))).item() == 1.0
    (span,) = spans.get()
    assert span.end_time - span.start_time >= 10_000_000
    assert _attrs(span)["otel_gpu.input.delay.default"] is True


def test_async_level_1_without_observers_keeps_spans_nesting_and_the_exception(otel_gpu_spans):
    """The async wrapper's level-1 fast path (no observer: no before/after work) still gives
    each call its span, nested under the caller's, and re-raises the user's exception as the
    same object with the span marked ERROR."""
    from otel_gpu.export import pipeline

    spans = otel_gpu_spans(level=1, journal=False)
    boom = KeyError("missing")

    @otel_gpu.api
    async def inner(fail):
        await asyncio.sleep(0)
        if fail:
            raise boom
        return 1

    @otel_gpu.api
    async def outer():
        first = await inner(False)
        try:
            await inner(True)
        except KeyError as exc:
            return first, exc

    first, caught = asyncio.run(outer())
    assert pipeline.get().observers_at[1] == ()  # the fast path is the one taken
    assert first == 1 and caught is boom
    got = spans.get()
    by_name = {}
    for span in got:
        by_name.setdefault(span.name.rsplit(".", 1)[-1], []).append(span)
    assert len(by_name["inner"]) == 2
    (top,) = by_name["outer"]
    assert all(s.parent.span_id == top.context.span_id for s in by_name["inner"])
    assert sorted(s.status.status_code.name for s in by_name["inner"]) == ["ERROR", "UNSET"]


def test_decorating_with_a_string_positionally_is_a_clear_error():
    """@api("name") is a mistake with a message that shows the right form."""
    otel_gpu.configure(level=1, dest="stderr")
    with pytest.raises(TypeError, match=r"@otel_gpu.api\(name=...\)"):
        otel_gpu.api("BatchDecode.run")


# ----------------------------------------------------------------------------- level 3


class Mode(enum.Enum):
    FAST = 1


Pair = namedtuple("Pair", "lo hi")


def test_level_3_tensor_metadata_keys_and_values(otel_gpu_spans):
    """Tensors: shape/stride int arrays, dtype 'torch.bfloat16', device, requires_grad, is_contiguous."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def attn(q, kv):
        return q

    q = torch.zeros(4, 8, dtype=torch.bfloat16).t()  # non-contiguous
    kv = torch.zeros(2, 3, requires_grad=True)
    attn(q, kv=kv)
    a = _attrs(spans.get()[0])
    assert a["otel_gpu.input.q.shape"] == (8, 4)
    assert a["otel_gpu.input.q.stride"] == (1, 8)
    assert a["otel_gpu.input.q.dtype"] == "torch.bfloat16"
    assert a["otel_gpu.input.q.device"] == "cpu"
    assert a["otel_gpu.input.q.is_contiguous"] is False
    assert a["otel_gpu.input.q.requires_grad"] is False
    assert a["otel_gpu.input.kv.requires_grad"] is True
    assert a["otel_gpu.output.0.shape"] == (8, 4)


def test_level_3_binding_defaults_scalars_containers_objects(otel_gpu_spans):
    """Parameters are bound by signature; defaults appear marked; scalars, enums, dtypes, containers, objects."""
    spans = otel_gpu_spans(level=3, max_items=2)

    class Cfg:  # a mutable object: recorded by type and id, its repr never taken
        def __repr__(self):
            raise AssertionError("repr of a mutable argument must not be taken")

    @otel_gpu.api
    def op(
        x,
        tensors,
        /,
        scale=0.5,
        *,
        mode=Mode.FAST,
        dtype=torch.float16,
        dev=None,
        cfg=None,
        **extra,
    ):
        return Pair(x, x)

    op(
        torch.ones(1),
        [torch.ones(2), torch.ones(3), torch.ones(4)],
        dev=torch.device("cpu"),
        cfg=Cfg(),
        flag=True,
    )
    a = _attrs(spans.get()[0])
    assert a["otel_gpu.input.scale.value"] == 0.5 and a["otel_gpu.input.scale.default"] is True
    assert (
        a["otel_gpu.input.mode.value"] == "Mode.FAST" and a["otel_gpu.input.mode.default"] is True
    )
    assert a["otel_gpu.input.dtype.value"] == "torch.float16"
    assert a["otel_gpu.input.dev.value"] == "cpu" and "otel_gpu.input.dev.default" not in a
    assert a["otel_gpu.input.tensors.type"] == "list"
    assert a["otel_gpu.input.tensors.length"] == 3  # the rest are counted…
    assert a["otel_gpu.input.tensors.1.shape"] == (3,)
    assert "otel_gpu.input.tensors.2.shape" not in a  # …not expanded beyond max_items
    assert a["otel_gpu.input.cfg.type"].endswith("Cfg")
    assert a["otel_gpu.input.cfg.id"].startswith("0x") and "otel_gpu.input.cfg.repr" not in a
    assert a["otel_gpu.input.extra.flag.value"] is True
    assert a["otel_gpu.output.lo.shape"] == (1,) and a["otel_gpu.output.hi.shape"] == (1,)


def test_level_3_tuple_outputs_and_none(otel_gpu_spans):
    """Tuple outputs are indexed 0, 1…; None returns add no output attributes."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def two(x):
        return x, 3

    @otel_gpu.api
    def nothing(x):
        return None

    two(torch.ones(2))
    nothing(torch.ones(2))
    a, b = (_attrs(s) for s in spans.get())
    assert a["otel_gpu.output.0.shape"] == (2,) and a["otel_gpu.output.1.value"] == 3
    assert not any(k.startswith("otel_gpu.output") for k in b)


def test_method_self_is_not_recorded(otel_gpu_spans):
    """self/cls are the object, not an argument: they are left out of the inputs."""
    spans = otel_gpu_spans(level=3)

    class Wrapper:
        @otel_gpu.api
        def run(self, x):
            return x

    Wrapper().run(torch.ones(1))
    a = _attrs(spans.get()[0])
    assert not any(k.startswith("otel_gpu.input.self") for k in a)
    assert a["otel_gpu.input.x.shape"] == (1,)


def test_attribute_values_never_exceed_2048_bytes(otel_gpu_spans):
    """Long strings and reprs are truncated to the limit (max 2048 bytes, Tempo's default cut)."""
    spans = otel_gpu_spans(level=3, repr_limit=100000)

    class Huge:
        def __repr__(self):
            return "é" * 10000

    @otel_gpu.api
    def f(text, obj):
        return None

    f("x" * 10000, Huge())
    a = _attrs(spans.get()[0])
    for value in a.values():
        if isinstance(value, str):
            assert len(value.encode()) <= 2048


def test_attribute_count_limit_is_summarised_not_silently_dropped(otel_gpu_spans):
    """More attributes than the SDK limit: the span keeps within it and says what was omitted."""
    provider = TracerProvider(span_limits=SpanLimits(max_span_attributes=20))
    spans = otel_gpu_spans(level=3, tracer_provider=provider, max_items=50)

    @otel_gpu.api
    def many(xs):
        return None

    many([torch.ones(1)] * 10)
    (span,) = spans.get()
    a = _attrs(span)
    assert len(a) <= 20
    assert span.dropped_attributes == 0
    assert "attributes omitted" in a["otel_gpu.attributes.omitted"]
    assert "otel_gpu.input.xs.9.shape" in a["otel_gpu.attributes.omitted"]


def test_secret_named_string_arguments_are_redacted(otel_gpu_spans):
    """String values of parameters whose names look like secrets are recorded as <redacted>."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def connect(url, api_token, password=None, key=None):
        return None

    connect("http://h", "s3cr3t", password="hunter2", key=torch.ones(1))
    a = _attrs(spans.get()[0])
    assert a["otel_gpu.input.api_token.value"] == "<redacted>"
    assert a["otel_gpu.input.password.value"] == "<redacted>"
    assert a["otel_gpu.input.url.value"] == "http://h"
    assert a["otel_gpu.input.key.shape"] == (1,)  # a tensor named key is data, not a secret


def test_secrets_nested_or_in_str_enums_are_redacted(otel_gpu_spans):
    """A secret-named string inside a dict argument, and a secret-named parameter holding a
    str-based enum member, are redacted too; other values of the same call are kept."""
    import enum

    class Mode(str, enum.Enum):
        FAST = "fast"

    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def call(x, options, auth_mode, scale=1.0):
        return x

    call(torch.ones(2), {"token": "abc", "depth": 3}, Mode.FAST, scale=0.5)
    a = _attrs(spans.get()[0])
    assert a["otel_gpu.input.options.token.value"] == "<redacted>"
    assert a["otel_gpu.input.auth_mode.value"] == "<redacted>"
    assert a["otel_gpu.input.options.depth.value"] == 3
    assert a["otel_gpu.input.scale.value"] == 0.5


def test_every_kind_of_tensor_keeps_its_metadata(otel_gpu_spans):
    """Plain tensors and parameters, sparse and nested tensors are described alike by the
    capture's fast path for plain tensors and its checked path: shapes and strides as ints
    (as text for a jagged tensor's symbolic sizes), no strides for a layout without them."""
    import warnings

    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def take(t):
        return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the prototype and beta layouts' warnings
        strided = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)])
        csr = torch.ones(4, 4).to_sparse_csr()
    jagged = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
    tensors = [
        torch.ones(2, 3),
        torch.nn.Parameter(torch.ones(2, 3)),
        csr,
        strided,
        jagged,
    ]
    for t in tensors:
        take(t)
    plain, param, sparse, nested, ragged = (_attrs(s) for s in spans.get())
    assert plain["otel_gpu.input.t.shape"] == (2, 3) and plain["otel_gpu.input.t.stride"] == (3, 1)
    assert param["otel_gpu.input.t.requires_grad"] is True
    assert param["otel_gpu.input.t.shape"] == (2, 3)
    assert sparse["otel_gpu.input.t.shape"] == (4, 4)
    assert "otel_gpu.input.t.stride" not in sparse
    assert nested["otel_gpu.input.t.type"].startswith("Tensor (metadata unavailable")
    ragged_dim = ragged["otel_gpu.input.t.shape"][1]  # symbolic: j1, j2… in creation order
    assert type(ragged_dim) is str and ragged_dim.startswith("j")
    assert all(type(d) is str for d in ragged["otel_gpu.input.t.stride"])


def test_redaction_is_configurable(otel_gpu_spans):
    """OTEL_GPU_REDACT replaces the list of secret-looking names; empty disables redaction."""
    spans = otel_gpu_spans(level=3, redact=["session"])

    @otel_gpu.api
    def f(session_id, token):
        return None

    f("abc", "tok")
    a = _attrs(spans.get()[0])
    assert a["otel_gpu.input.session_id.value"] == "<redacted>"
    assert a["otel_gpu.input.token.value"] == "tok"


def test_internal_errors_never_reach_the_caller_outside_strict_mode(otel_gpu_spans, caplog):
    """A failure inside otel-gpu is logged once per kind; the call returns its normal result."""
    from otel_gpu import _guard
    from otel_gpu.calls import metadata

    spans = otel_gpu_spans(level=3, strict=False)
    _guard.set_strict(False)

    @otel_gpu.api
    def f(x):
        return x + 1

    original = metadata.capture

    def broken(*a, **k):
        raise RuntimeError("metadata exploded")

    metadata.capture = broken
    try:
        assert f(1) == 2
        assert f(2) == 3
    finally:
        metadata.capture = original
    assert len(spans.get()) == 2  # the spans still exist
    messages = [r.getMessage() for r in caplog.records if "metadata exploded" in r.getMessage()]
    assert len(messages) == 1
    assert _guard.internal_error_counts()["metadata"] == 4  # inputs and outputs of 2 calls


def test_ratio_root_sampler_of_the_provider_is_honoured(otel_gpu_spans):
    """Root calls follow the provider's root sampler (here a 0-ratio sampler drops them all)."""
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)))
    spans = otel_gpu_spans(level=1, tracer_provider=provider)

    @otel_gpu.api
    def f():
        return 1

    assert [f() for _ in range(20)] == [1] * 20
    assert spans.get() == []


def test_nested_and_kwargs_secrets_are_redacted(otel_gpu_spans):
    """Redaction applies to dict keys and **kwargs names too, not only to top-level parameters."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def call(options, **extra):
        return None

    call({"auth_header": "Bearer x", "retries": "3"}, api_key="k-123", region="eu")
    a = _attrs(spans.get()[0])
    assert a["otel_gpu.input.options.auth_header.value"] == "<redacted>"
    assert a["otel_gpu.input.options.retries.value"] == "3"
    assert a["otel_gpu.input.extra.api_key.value"] == "<redacted>"
    assert a["otel_gpu.input.extra.region.value"] == "eu"


def test_partials_and_callable_objects_can_be_decorated(otel_gpu_spans):
    """A callable instance is named by its type; a functools.partial by the function it wraps, and
    its call binds to the parameters the partial leaves open."""
    import functools

    spans = otel_gpu_spans(level=3)

    class Kernel:
        def __call__(self, x):
            return x + 1

    k = otel_gpu.api(Kernel())
    p = otel_gpu.api(functools.partial(lambda a, b: a + b, 1))
    assert k(1) == 2 and p(2) == 3
    got = spans.get()
    names = [s.name for s in got]
    assert names[0].endswith("Kernel") and names[1].endswith("<lambda>")
    assert got[0].attributes["otel_gpu.input.x.value"] == 1
    assert got[1].attributes["otel_gpu.input.b.value"] == 2
    assert "otel_gpu.input.a.value" not in got[1].attributes


def test_functions_keep_their_decoration_level_with_respect_to_observers(
    otel_gpu_spans, tmp_path, capsys
):
    """A function decorated at level 1 gets no pre-call input block even if the level is raised later."""
    otel_gpu.configure(level=1, dest="stdout", color="never", provider="own", journal=False)

    @otel_gpu.api
    def quiet(x):
        return x

    otel_gpu.configure(level=3)

    @otel_gpu.api
    def loud(x):
        return x

    quiet(torch.ones(1))
    loud(torch.ones(1))
    otel_gpu.flush()
    out = capsys.readouterr().out
    assert "▶ " + loud.__wrapped__.__module__ in out  # loud printed its inputs before running
    assert (
        "quiet" in out
        and (
            "▶ "
            + f"{__name__}.test_functions_keep_their_decoration_level_with_respect_to_observers.<locals>.quiet"
        )
        not in out
    )


def test_nonfinite_flag_survives_the_attribute_count_limit(otel_gpu_spans):
    """otel_gpu.nonfinite is placed before metadata, so a tight attribute limit never cuts it."""
    provider = TracerProvider(span_limits=SpanLimits(max_span_attributes=8))
    spans = otel_gpu_spans(level=5, tracer_provider=provider)

    @otel_gpu.api
    def f(a, b, c):
        return torch.log(a)

    f(torch.tensor([-1.0]), torch.ones(1), torch.ones(1))
    a = _attrs(spans.get()[0])
    assert a["otel_gpu.nonfinite"] is True and len(a) <= 8


def test_a_pipeline_that_cannot_be_built_leaves_calls_running(otel_gpu_spans, monkeypatch):
    """If building the export pipeline fails, the call still runs and returns, and the error is reported once."""
    from otel_gpu import _guard
    from otel_gpu.export import pipeline

    otel_gpu.configure(level=1, dest="stderr", strict=False)
    _guard.set_strict(False)

    def broken(*a, **k):
        raise OSError("no space left")

    monkeypatch.setattr(pipeline.Pipeline, "__init__", broken)

    @otel_gpu.api
    def f(x):
        return x * 3

    assert f(2) == 6 and f(3) == 9
    assert _guard.internal_error_counts()["pipeline"] == 1


def test_exception_attributes_stay_within_2048_bytes(otel_gpu_spans):
    """A long message and a deep stack trace are cut to 2048 bytes; the trace keeps its innermost end."""
    spans = otel_gpu_spans(level=1)

    def deep(n):
        if n == 0:
            raise RuntimeError("é" * 5000)
        return deep(n - 1)

    @otel_gpu.api
    def kernel():
        return deep(100)

    with pytest.raises(RuntimeError):
        kernel()
    (span,) = spans.get()
    (event,) = [e for e in span.events if e.name == "exception"]
    for value in event.attributes.values():
        assert len(value.encode()) <= 2048
    assert event.attributes["exception.stacktrace"].rstrip().endswith("é")  # the raise line is last
    assert event.attributes["exception.message"].endswith("...")


def test_user_attributes_on_the_call_span_are_cut_to_2048(otel_gpu_spans):
    """Attributes users set on the call's span obey the same 2048 cut."""
    from opentelemetry import trace

    spans = otel_gpu_spans(level=1)

    @otel_gpu.api
    def kernel():
        trace.get_current_span().set_attribute("note", "x" * 10000)

    kernel()
    assert len(spans.get()[0].attributes["note"]) == 2048
