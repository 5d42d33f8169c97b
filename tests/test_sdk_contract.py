"""The OpenTelemetry API/SDK internals otel-gpu reads: one contract test per private name.

otel-gpu reaches past the public API in a few places, each to save per-call or per-span cost
(the comments at each use say how much). A new SDK release may move any of them without notice;
each test below fails with a message naming the internal, the installed release and the
otel-gpu modules that read it, so the day it moves is a red test, not a slower or broken export.
pyproject.toml bounds opentelemetry-api and -sdk below the next minor release that has not been
tested against these contracts.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from contextvars import ContextVar

from opentelemetry import context, trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState


def _check(package: str, name: str, users: str, holds: Callable[[], object]) -> None:
    """Run ``holds``; on any failure or a false result, fail naming the internal and release."""
    version = importlib.metadata.version(package)
    try:
        ok = holds()
        why = "" if ok else "it no longer behaves as otel-gpu relies on"
    except Exception as exc:  # AttributeError, ImportError, TypeError: all mean "moved"
        ok, why = False, f"{type(exc).__name__}: {exc}"
    assert ok, (
        f"{package} {version} moved the internal `{name}` ({why}); otel-gpu reads it in {users}. "
        "Adapt those modules, then raise the upper bound in pyproject.toml."
    )


def test_span_key_is_where_the_api_keeps_the_current_span():
    """``opentelemetry.trace.propagation._SPAN_KEY`` is the context key of the current span: the
    call path reads and sets it directly (calls/_context.py)."""

    def holds() -> bool:
        from opentelemetry.trace.propagation import _SPAN_KEY

        span = NonRecordingSpan(SpanContext(3, 5, False))
        return isinstance(_SPAN_KEY, str) and trace.set_span_in_context(span).get(_SPAN_KEY) is span

    _check(
        "opentelemetry-api", "opentelemetry.trace.propagation._SPAN_KEY", "calls/_context.py", holds
    )


def test_runtime_context_is_a_context_var_read_directly():
    """``opentelemetry.context._RUNTIME_CONTEXT`` is the default ``ContextVarsRuntimeContext``
    and its ``_current_context`` the ``ContextVar`` holding the current context, which the call
    path reads and sets without the API's layers (calls/_context.py)."""

    def holds() -> bool:
        runtime = context._RUNTIME_CONTEXT  # type: ignore[attr-defined]
        var = runtime._current_context
        token = context.attach(context.set_value("otel-gpu-contract", 1))
        try:
            seen = var.get().get("otel-gpu-contract")
        finally:
            context.detach(token)
        return (
            type(runtime) is ContextVarsRuntimeContext and isinstance(var, ContextVar) and seen == 1
        )

    _check(
        "opentelemetry-api",
        "opentelemetry.context._RUNTIME_CONTEXT._current_context",
        "calls/_context.py",
        holds,
    )


def test_span_context_is_the_tuple_its_properties_read():
    """A ``SpanContext`` is the tuple ``(trace_id, span_id, is_remote, trace_flags, trace_state,
    is_valid)``: calls build it directly (calls/record.py) and the journal unpacks a parent's
    (journal/writer.py); both check the layout once and fall back to the properties."""

    def holds() -> bool:
        flags, state = TraceFlags(TraceFlags.SAMPLED), TraceState()
        ctx = SpanContext(3, 5, True, flags, state)
        built = tuple.__new__(SpanContext, (3, 5, True, flags, state, True))
        return (
            isinstance(ctx, tuple)
            and tuple(ctx) == (3, 5, True, flags, state, True)
            and (
                built.trace_id,
                built.span_id,
                built.is_remote,
                built.trace_flags,
                built.is_valid,
            )
            == (3, 5, True, flags, True)
        )

    _check(
        "opentelemetry-api",
        "SpanContext's tuple layout",
        "calls/record.py, journal/writer.py",
        holds,
    )


def test_bounded_attributes_keep_their_values_in_a_dict():
    """``BoundedAttributes._dict`` is the plain dict of its cleaned values: the exporters iterate
    it (exporters/_encoding.py) and the span builder takes it (export/spans.py) instead of the
    Mapping ABC's per-key ``__getitem__``."""

    def holds() -> bool:
        bounded = BoundedAttributes(2, {"a": 1, "b": "x", "c": 3.0}, immutable=True)
        inner = bounded._dict
        return type(inner) is dict and inner == dict(bounded) and bounded.dropped == 1

    _check(
        "opentelemetry-api",
        "BoundedAttributes._dict",
        "export/spans.py, exporters/_encoding.py",
        holds,
    )


class _Seen(SpanProcessor):
    def __init__(self) -> None:
        self.ended: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.append(span)


def test_provider_active_span_processor_reaches_every_processor():
    """``TracerProvider._active_span_processor`` is the processor every added one sits behind:
    the pipeline hands finished spans to it (export/pipeline.py) and ``otel-gpu recover``
    hands it the recovered spans (journal/recover.py)."""

    def holds() -> bool:
        provider, seen = TracerProvider(), _Seen()
        provider.add_span_processor(seen)
        span = ReadableSpan(name="contract")
        provider._active_span_processor.on_end(span)
        return seen.ended == [span]

    _check(
        "opentelemetry-sdk",
        "TracerProvider._active_span_processor",
        "export/pipeline.py, journal/recover.py",
        holds,
    )


def test_multi_span_processor_lists_its_processors():
    """``SynchronousMultiSpanProcessor._span_processors`` is the tuple of added processors: the
    pipeline hands otel-gpu's own destinations a chunk of spans in one call (export/pipeline.py)."""

    def holds() -> bool:
        provider, seen = TracerProvider(), _Seen()
        provider.add_span_processor(seen)
        processors = provider._active_span_processor._span_processors
        return isinstance(processors, tuple) and processors == (seen,)

    _check(
        "opentelemetry-sdk",
        "SynchronousMultiSpanProcessor._span_processors",
        "export/pipeline.py",
        holds,
    )


def test_provider_span_limits_are_the_ones_given():
    """``TracerProvider._span_limits`` holds the provider's limits: the span builder applies
    them to the spans it builds without the SDK (export/pipeline.py; default limits if absent)."""

    def holds() -> bool:
        limits = SpanLimits(max_span_attributes=5, max_events=7)
        got = TracerProvider(span_limits=limits)._span_limits
        return got.max_span_attributes == 5 and got.max_events == 7

    _check("opentelemetry-sdk", "TracerProvider._span_limits", "export/pipeline.py", holds)


def test_parent_based_sampler_keeps_its_root():
    """``ParentBased._root`` is the sampler for spans without a parent: the pipeline decides a
    root call's sampling with it alone (export/pipeline.py)."""

    def holds() -> bool:
        return ParentBased(root=ALWAYS_OFF)._root is ALWAYS_OFF

    _check("opentelemetry-sdk", "ParentBased._root", "export/pipeline.py", holds)


def test_a_moved_internal_fails_naming_it_and_the_release():
    """The failure message names the internal, the installed release and the readers (what a
    maintainer sees the day a release moves one)."""
    version = importlib.metadata.version("opentelemetry-sdk")
    try:
        _check("opentelemetry-sdk", "X._gone", "somewhere.py", lambda: TracerProvider()._gone)  # type: ignore[attr-defined]
    except AssertionError as exc:
        text = str(exc)
    else:  # pragma: no cover - the check must fail
        raise AssertionError("a missing internal passed its contract")
    assert f"opentelemetry-sdk {version} moved the internal `X._gone`" in text
    assert "AttributeError" in text and "somewhere.py" in text
