"""``otel_gpu.batch(requests=...)``: the calls of one serving step, joined to the requests it serves.

A step span parents the step's calls; the step span and every call span under it link to the
requests (capped by ``OTEL_GPU_BATCH_MAX_LINKS``) and count them; with one request the calls are
its children; a malformed ``traceparent`` is refused with one warning and its request still runs.
The links decode the same through otel-gpu's native encoders as through the official ones, and
the native encoders encode a step's links once.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as official_json
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as official_proto,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags
from otel_gpu.exporters.console import ConsoleSpanExporter
from otel_gpu.exporters.otlp_json import JsonEncoder
from otel_gpu.exporters.otlp_proto import ProtoEncoder

import otel_gpu
from otel_gpu.attributes import (
    BATCH_LINKS,
    BATCH_REQUEST_IDS,
    BATCH_REQUEST_TRACE_IDS,
    BATCH_REQUESTS,
    REQUEST_ID,
)
from otel_gpu.calls import batch as batch_module
from otel_gpu.export import pipeline

try:
    from otlp_receiver import hex_ids_to_base64
    from test_native_export import assert_same_message
except ModuleNotFoundError:  # tests/ imported as a package
    from tests.otlp_receiver import hex_ids_to_base64
    from tests.test_native_export import assert_same_message

from google.protobuf import json_format

TP = [f"00-{i + 1:032x}-{i + 0xA0:016x}-01" for i in range(8)]


def _ctx(tp: str) -> tuple[int, int]:
    _, trace_id, span_id, _ = tp.split("-")
    return int(trace_id, 16), int(span_id, 16)


def _lib() -> tuple[Any, Any]:
    def leaf(x):
        return x + 1

    def forward(x):
        return lib_leaf(x) * 2

    lib_leaf = otel_gpu.api(leaf)
    return otel_gpu.api(forward), lib_leaf


def _linked(span: Any) -> list[tuple[int, int]]:
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


def test_calls_in_a_step_link_to_its_requests_under_one_step_span(otel_gpu_spans) -> None:
    """Every call span of a step (nested ones too) and the step span link to exactly the step's
    requests, in order, say how many requests and links there are, and hang under one
    ``otel_gpu.batch`` span; calls outside the step carry nothing of it."""
    spans = otel_gpu_spans(level=1)
    forward, _ = _lib()
    ids = ["a", "b", "c"]
    with otel_gpu.batch(requests=dict(zip(ids, TP[:3]))):
        forward(1)
    forward(2)
    got = spans.get()
    (step,) = [s for s in got if s.name == "otel_gpu.batch"]
    inside = [s for s in got if s.context.trace_id == step.context.trace_id and s is not step]
    assert len(inside) == 2  # forward and its leaf
    want = [_ctx(tp) for tp in TP[:3]]
    for span in [step, *inside]:
        assert _linked(span) == want
        assert [dict(link.attributes) for link in span.links] == [{REQUEST_ID: rid} for rid in ids]
        assert span.attributes[BATCH_REQUESTS] == 3
        assert span.attributes[BATCH_LINKS] == 3
    outer = next(s for s in inside if s.name.endswith("forward"))
    assert outer.parent.span_id == step.context.span_id
    outside = [s for s in got if s.context.trace_id != step.context.trace_id]
    assert len(outside) == 2
    assert all(not s.links and BATCH_REQUESTS not in s.attributes for s in outside)


def test_the_step_span_alone_names_its_linked_requests(otel_gpu_spans, monkeypatch) -> None:
    """For backends that drop links (Phoenix) and searches by attribute, the step span (not its
    calls) carries the linked requests' trace ids, and their ids when named, in link order and
    within the cap; a list of requests has no ids to name."""
    monkeypatch.setenv("OTEL_GPU_BATCH_MAX_LINKS", "2")
    spans = otel_gpu_spans(level=1)
    forward, _ = _lib()
    with otel_gpu.batch(requests={"a": TP[0], "b": "00-malformed-01", "c": TP[2], "d": TP[3]}):
        forward(1)
    with otel_gpu.batch(requests=[TP[4], TP[5]]):
        forward(2)
    named, listed = spans.by_name("otel_gpu.batch")
    assert named.attributes[BATCH_REQUEST_TRACE_IDS] == (TP[0].split("-")[1], TP[2].split("-")[1])
    assert named.attributes[BATCH_REQUEST_IDS] == ("a", "c")
    assert listed.attributes[BATCH_REQUEST_TRACE_IDS] == (TP[4].split("-")[1], TP[5].split("-")[1])
    assert BATCH_REQUEST_IDS not in listed.attributes
    calls = [s for s in spans.get() if s.name != "otel_gpu.batch"]
    assert len(calls) == 4
    assert all(BATCH_REQUEST_TRACE_IDS not in s.attributes for s in calls)


def test_one_request_makes_the_calls_its_children(otel_gpu_spans) -> None:
    """With one request (a traceparent or a user's span) no step span is made: the calls are
    children of the request's span, in its trace, and link to nothing."""
    spans = otel_gpu_spans(level=1)
    forward, _ = _lib()
    with otel_gpu.batch(requests=[TP[0]]):
        forward(1)
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("request") as request:
        pass
    with otel_gpu.batch(requests=[request]):
        forward(2)
    got = spans.get()
    assert not [s for s in got if s.name == "otel_gpu.batch"]
    first = [s for s in got if s.context.trace_id == _ctx(TP[0])[0]]
    second = [s for s in got if s.context.trace_id == request.get_span_context().trace_id]
    for calls, parent_id in ((first, _ctx(TP[0])[1]), (second, request.get_span_context().span_id)):
        assert len(calls) == 2
        top = next(s for s in calls if s.name.endswith("forward"))
        assert top.parent.span_id == parent_id
        assert all(not s.links and s.attributes[BATCH_REQUESTS] == 1 for s in calls)


def test_a_malformed_traceparent_is_refused_once_and_its_request_still_runs(
    otel_gpu_spans, caplog
) -> None:
    """A malformed traceparent is not linked and warns once however many steps name it; the
    step still runs and links the well-formed requests; the count says how many were given."""
    spans = otel_gpu_spans(level=1)
    forward, _ = _lib()
    batch_module._parsed.clear()
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        for _ in range(3):
            with otel_gpu.batch(requests=[TP[0], "00-not-a-trace-01", TP[1]]):
                assert forward(1) == 4
    refusals = [r for r in caplog.records if "not-a-trace" in r.getMessage()]
    assert len(refusals) == 1
    steps = spans.by_name("otel_gpu.batch")
    assert len(steps) == 3
    for step in steps:
        assert _linked(step) == [_ctx(TP[0]), _ctx(TP[1])]
        assert step.attributes[BATCH_REQUESTS] == 3
        assert step.attributes[BATCH_LINKS] == 2


def test_one_malformed_request_alone_starts_no_trace_of_a_request(otel_gpu_spans) -> None:
    """A step of one malformed request is a step of its own trace, linked to nothing: its
    calls do not pretend to belong to a request."""
    spans = otel_gpu_spans(level=1)
    forward, _ = _lib()
    with otel_gpu.batch(requests=["garbage"]):
        forward(1)
    (step,) = spans.by_name("otel_gpu.batch")
    assert step.parent is None and not step.links
    assert step.attributes[BATCH_REQUESTS] == 1 and step.attributes[BATCH_LINKS] == 0


@pytest.mark.parametrize(("cap", "kept"), [(2, 2), (0, 0), (128, 5)])
def test_the_links_are_capped_by_the_setting(otel_gpu_spans, cap, kept) -> None:
    """At most ``OTEL_GPU_BATCH_MAX_LINKS`` links, the first requests given, duplicates once;
    the request count is always the number given."""
    spans = otel_gpu_spans(level=1, batch_max_links=cap)
    forward, _ = _lib()
    requests = [*TP[:5], TP[0]]  # a duplicate
    with otel_gpu.batch(requests=requests):
        forward(1)
    for span in spans.get():
        assert _linked(span) == [_ctx(tp) for tp in TP[:kept]]
        assert span.attributes[BATCH_REQUESTS] == 6
        assert span.attributes[BATCH_LINKS] == kept


def test_requests_of_every_kind_are_linked(otel_gpu_spans) -> None:
    """A SpanContext, a Span and a traceparent string are all requests; the step span is a
    child of the span current when the step began."""
    spans = otel_gpu_spans(level=1)
    forward, _ = _lib()
    tracer = TracerProvider().get_tracer("t")
    ctx = SpanContext(0xABC, 0xDEF, True, TraceFlags(1))
    with tracer.start_as_current_span("request") as request:
        pass
    with tracer.start_as_current_span("engine loop") as loop:
        with otel_gpu.batch(requests=[ctx, request, TP[2]]):
            forward(1)
    (step,) = spans.by_name("otel_gpu.batch")
    assert _linked(step) == [
        (0xABC, 0xDEF),
        (request.get_span_context().trace_id, request.get_span_context().span_id),
        _ctx(TP[2]),
    ]
    assert step.parent.span_id == loop.get_span_context().span_id


def test_calls_under_a_span_of_the_users_inside_a_step_still_link(otel_gpu_spans) -> None:
    """A call whose parent is the user's own span, opened inside the step, still carries the
    step's links."""
    spans = otel_gpu_spans(level=1)
    _, leaf = _lib()
    tracer = TracerProvider().get_tracer("t")
    with otel_gpu.batch(requests=TP[:2]):
        with tracer.start_as_current_span("engine forward"):
            leaf(1)
    (call,) = [s for s in spans.get() if s.name.endswith("leaf")]
    assert _linked(call) == [_ctx(tp) for tp in TP[:2]]


def test_a_step_that_raises_is_an_error_and_the_exception_passes_through(otel_gpu_spans) -> None:
    """The user's exception leaves the step as the same object; the step span says ERROR."""
    spans = otel_gpu_spans(level=1)
    boom = RuntimeError("step failed")
    with pytest.raises(RuntimeError) as caught:
        with otel_gpu.batch(requests=TP[:2]):
            raise boom
    assert caught.value is boom
    (step,) = spans.by_name("otel_gpu.batch")
    assert step.status.status_code is StatusCode.ERROR


@pytest.mark.parametrize("bad", ["00-" + "1" * 32 + "-" + "2" * 16 + "-01", 42, [object()]])
def test_a_request_of_the_wrong_type_is_a_type_error(otel_gpu_spans, bad) -> None:
    """``requests=`` takes a list or mapping of SpanContext, Span or str: anything else is named."""
    otel_gpu_spans(level=1)
    with pytest.raises(TypeError, match=r"otel_gpu\.batch"):
        with otel_gpu.batch(requests=bad):
            pass


def test_at_level_0_a_step_records_nothing() -> None:
    """Level 0: the context manager does nothing and the body runs."""
    otel_gpu.configure(level=0)
    try:
        with otel_gpu.batch(requests=TP[:2]) as step:
            ran = True
        assert ran and step._call is None and step._tokens is None
    finally:
        from otel_gpu import config

        config.reset_overrides()


# --------------------------------------------------------------------------- encoders


@pytest.fixture
def deferred(monkeypatch):
    """The export thread never wakes on its own: call records stay queued until read."""
    monkeypatch.setattr(pipeline, "_WAKE_EVERY", 10**9)
    monkeypatch.setattr(pipeline, "_WAKE_AT", -1)


def _parse_json(text: str) -> ExportTraceServiceRequest:
    return json_format.Parse(
        json.dumps(hex_ids_to_base64(json.loads(text), strict=True)), ExportTraceServiceRequest()
    )


def test_links_decode_to_the_official_encoders_message_and_are_encoded_once(
    tmp_path: Path, deferred, monkeypatch
) -> None:
    """The step's spans built natively decode (protobuf and JSON) to the message the official
    encoders make of the official path's spans; the spans share one links tuple and each
    native encoder encodes it once for the whole step."""
    otel_gpu.configure(level=3, dest=str(tmp_path / "t.jsonl"), provider="own")
    try:
        forward, _ = _lib()
        with otel_gpu.batch(requests=dict(zip("xyz", TP[:3]))):
            forward(1)
            forward(2)
        pipe = pipeline.current()
        assert pipe is not None
        calls = list(pipe.queue)
        assert len(calls) == 5
        readable = [pipe.materialise(c) for c in calls]
        native = [pipe.materialise_native(c) for c in calls]
        assert len({id(s.links) for s in native}) == 1
        encoded: list[int] = []
        for encoder in (ProtoEncoder, JsonEncoder):
            real = encoder._encode_links
            monkeypatch.setattr(
                encoder,
                "_encode_links",
                lambda self, links, real=real: encoded.append(1) or real(self, links),
            )
        proto, text = ProtoEncoder(), JsonEncoder()
        assert_same_message(
            ExportTraceServiceRequest.FromString(proto.encode(native)), official_proto(readable)
        )
        theirs = json.dumps(official_json(readable).to_dict(), separators=(",", ":"))
        assert_same_message(_parse_json(text.encode(native)), _parse_json(theirs))
        assert len(encoded) == 2  # once per encoder, not once per span
        message = official_proto(readable)
        spans = message.resource_spans[0].scope_spans[0].spans
        assert all(len(s.links) == 3 for s in spans)
    finally:
        pipeline.reset(timeout=2.0)
        from otel_gpu import config

        config.reset_overrides()


def test_the_console_shows_a_spans_links(otel_gpu_spans) -> None:
    """The console renderer names how many links a span has and the first ones."""
    spans = otel_gpu_spans(level=1)
    forward, _ = _lib()
    with otel_gpu.batch(requests={"req-7": TP[0], "req-8": TP[1]}):
        forward(1)
    (step,) = spans.by_name("otel_gpu.batch")
    out = io.StringIO()
    text = ConsoleSpanExporter(stream=out, color="never").render(step)
    assert f"links: 2 → {TP[0].split('-')[1]}/{TP[0].split('-')[2]} (req-7)" in text


def test_the_current_span_inside_a_step_is_the_step(otel_gpu_spans) -> None:
    """Inside a step of several requests, ``trace.get_current_span()`` is the step span, so
    attributes set on it reach the exported step."""
    spans = otel_gpu_spans(level=1)
    with otel_gpu.batch(requests=TP[:2]):
        trace.get_current_span().set_attribute("engine.step", 7)
    (step,) = spans.by_name("otel_gpu.batch")
    assert step.attributes["engine.step"] == 7


def test_the_bench_row_times_calls_inside_a_step_and_writes_every_span(
    tmp_path: Path, monkeypatch
) -> None:
    """``ours1batch``'s worker runs every timed call inside one step of N requests: each call's
    span reaches the file with N links, and the budget compares it with ``ours1``."""
    import torch

    from otel_gpu.bench import report, worker

    monkeypatch.setattr(pipeline, "_WAKE_EVERY", pipeline._WAKE_EVERY)
    monkeypatch.setattr(pipeline, "_WAKE_AT", pipeline._WAKE_AT)
    q, k = torch.zeros(2, 3), torch.zeros(2, 3)
    try:
        cfg = worker.Ours({"level": 1, "dir": str(tmp_path), "batch": 4}, q, k)
        worker._timed_round(cfg, 3, "cpu")
        assert cfg.count() == 3 == cfg.calls
        with open(cfg.spans_file, encoding="utf-8") as f:
            spans = [
                s
                for line in f
                for r in json.loads(line)["resourceSpans"]
                for ss in r["scopeSpans"]
                for s in ss["spans"]
            ]
        assert len(spans) == 3 and all(len(s["links"]) == 4 for s in spans)
    finally:
        cfg.step.__exit__(None, None, None)
        pipeline.reset(timeout=2.0)
        from otel_gpu import config

        config.reset_overrides()
    (budget,) = [b for b in report.BUDGETS if b.ours == "ours1batch"]
    assert (budget.other, budget.cost, budget.limit) == ("ours1", "caller", 1.1)


def test_hostile_requests_cost_their_own_link_only(otel_gpu_spans, caplog) -> None:
    """A span whose context cannot be read, a megabyte-long string and a generator of requests:
    the step runs, the good requests are linked, nothing raises into the host (strict mode off:
    an unreadable span is an internal error reported once, not an exception)."""
    from otel_gpu import _guard

    class Broken(trace.NonRecordingSpan):
        def get_span_context(self):
            raise RuntimeError("no context")

    spans = otel_gpu_spans(level=1, strict=False)
    _guard.set_strict(False)
    forward, _ = _lib()
    huge = "00-" + "a" * 1_000_000
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        with otel_gpu.batch(requests=(r for r in [Broken(None), huge, TP[0], TP[1]])):
            forward(1)
    (step,) = spans.by_name("otel_gpu.batch")
    assert _linked(step) == [_ctx(TP[0]), _ctx(TP[1])]
    assert step.attributes[BATCH_REQUESTS] == 4
    assert huge not in batch_module._parsed
    assert any("1000003 characters refused" in r.getMessage() for r in caplog.records)
