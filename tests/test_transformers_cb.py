"""The ``transformers.continuous_batching`` target, end to end on CPU with a tiny Llama from a config.

16 requests, each submitted with its own ``traceparent`` (queued through the manager's
``add_requests`` before its loop starts, so the steps are the same on every run; the malformed
case goes through ``generate_batch``); the scheduler's own record of which requests were in which step (its ``schedule_batch`` results, read
by a spy of the test's own) is the reference:

- every request has its span, in the trace its traceparent names, a child of the traceparent's span;
- every step's calls link to exactly the requests of that step (a step of one request: its calls
  are the request span's children);
- ``otel-gpu show --request`` lists exactly the calls of the steps that served three chosen
  requests;
- the generated tokens are those of a run without otel-gpu.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from tiny_serving import run_queued, workload

pytestmark = [
    pytest.mark.transformers,
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
    ),
]

N = 16
TRACEPARENTS = [f"00-{0xA000 + i:032x}-{0xB000 + i:016x}-01" for i in range(N)]


def _setup() -> tuple[Any, Any, Any, list[list[int]]]:
    # small batches, so the scheduler mixes requests differently from step to step, and 16 = 5+5+5+1
    # leaves steps of a single request at the end
    return workload(N, new_tokens=5, batch_tokens=32, per_batch=5, lengths=5)


@pytest.fixture
def scheduled(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The request ids of each step, in order, as the scheduler returned them."""
    from transformers.generation.continuous_batching import scheduler

    steps: list[list[str]] = []
    original = scheduler.FIFOScheduler.schedule_batch

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if result and result[0]:
            steps.append([future.state.request_id for future in result[0]])
        return result

    monkeypatch.setattr(scheduler.FIFOScheduler, "schedule_batch", spy)
    return steps


def _spans(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [
            s
            for line in f
            for r in json.loads(line)["resourceSpans"]
            for ss in r["scopeSpans"]
            for s in ss["spans"]
        ]


def _attr(span: dict[str, Any], key: str) -> Any:
    for kv in span.get("attributes", []):
        if kv["key"] == key:
            kind, value = next(iter(kv["value"].items()))
            return int(value) if kind == "intValue" else value  # OTLP/JSON: int64 as a string
    return None


def _run(
    tmp_path: Path, traceparents: list[str], scheduled: list[list[str]], queued: bool = True
) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """The outputs of a run without otel-gpu, of one with the target (and every module of the
    model instrumented), and the instrumented run's trace file; ``scheduled`` keeps only the
    instrumented run's steps. ``queued``: through the manager, every request queued before its
    loop starts (``add_requests(traceparents=)``); else through ``generate_batch``, whose loop
    starts first and takes requests as they arrive."""
    import otel_gpu
    from otel_gpu import config
    from otel_gpu.export import pipeline

    model, generation, batching, inputs = _setup()

    def generate(**kw: Any) -> Any:
        if queued:
            return run_queued(model, generation, batching, inputs, **kw)
        return model.generate_batch(
            inputs, generation_config=generation, continuous_batching_config=batching, **kw
        )

    bare = generate()
    del scheduled[:]
    path = tmp_path / "cb.jsonl"
    otel_gpu.configure(level=1, dest=str(path), provider="own", strict=True)
    try:
        assert otel_gpu.instrument("transformers.continuous_batching")
        otel_gpu.instrument_module(model)
        traced = generate(traceparents=traceparents)
        otel_gpu.flush()
    finally:
        otel_gpu.uninstrument("transformers.continuous_batching")
        otel_gpu.uninstrument_module(model)
        pipeline.reset(timeout=5.0)
        config.reset_overrides()
    return bare, traced, path


def test_requests_steps_and_calls_end_to_end(tmp_path: Path, scheduled: list[list[str]]) -> None:
    """Request spans, links per step against the scheduler's record, show --request for three
    requests, and outputs bit-identical to a run without otel-gpu."""
    from otel_gpu.instrumentation.transformers_cb import REQUEST_SPAN_NAME
    from otel_gpu.traces import show

    bare, traced, path = _run(tmp_path, TRACEPARENTS, scheduled)
    # outputs: the same tokens, request by request
    assert list(bare) == list(traced) and len(traced) == N
    for rid in bare:
        assert bare[rid].generated_tokens == traced[rid].generated_tokens
        assert traced[rid].error is None
    steps = scheduled

    spans = _spans(path)
    by_id = {s["spanId"]: s for s in spans}
    requests = {_attr(s, "otel_gpu.request.id"): s for s in spans if s["name"] == REQUEST_SPAN_NAME}
    # every request span exists, continuing its traceparent
    assert set(requests) == set(traced)
    for i, rid in enumerate(traced):
        _, trace_id, span_id, _ = TRACEPARENTS[i].split("-")
        assert requests[rid]["traceId"] == trace_id
        assert requests[rid]["parentSpanId"] == span_id
    span_of = {rid: (s["traceId"], s["spanId"]) for rid, s in requests.items()}

    def requests_of(span: dict[str, Any]) -> set[str]:
        """The requests a call served, from its links or (one request) its ancestors."""
        if span.get("links"):
            return {_attr(link, "otel_gpu.request.id") for link in span["links"]}
        node = span
        while node.get("parentSpanId") in by_id:
            node = by_id[node["parentSpanId"]]
            if node["name"] == REQUEST_SPAN_NAME:
                return {_attr(node, "otel_gpu.request.id")}
        return set()

    # one compute_batch call per step, in the scheduler's order
    forwards = sorted(
        (s for s in spans if s["name"] == "transformers.continuous_batching.compute_batch"),
        key=lambda s: int(s["startTimeUnixNano"]),
    )
    assert [requests_of(f) for f in forwards] == [set(step) for step in steps]
    assert any(len(step) == 1 for step in steps) and any(len(step) > 1 for step in steps)

    def step_of(span: dict[str, Any]) -> dict[str, Any]:
        node = span
        while node["name"] not in ("otel_gpu.batch", REQUEST_SPAN_NAME):
            node = by_id[node["parentSpanId"]]
        return node

    calls = [s for s in spans if s["name"] not in ("otel_gpu.batch", REQUEST_SPAN_NAME)]
    assert len(calls) > len(forwards)  # the model's modules too
    for call in calls:
        step = step_of(call)
        if step["name"] == "otel_gpu.batch":
            # links to exactly the step's requests, their request spans
            want = {span_of[rid] for rid in requests_of(step)}
            assert {(link["traceId"], link["spanId"]) for link in call["links"]} == want
            assert len(call["links"]) == len(want) == _attr(call, "otel_gpu.batch.links")
        else:
            assert not call.get("links")
            assert _attr(call, "otel_gpu.batch.requests") == 1

    # show --request: exactly the calls of the steps that served three chosen requests
    for rid in ("req_0", "req_7", "req_15"):
        trace_id = span_of[rid][0]
        out = io.StringIO()
        assert show.show([str(path)], request=trace_id, limit=0, out=out, err=io.StringIO()) == 0
        served_steps = [i for i, step in enumerate(steps) if rid in step]
        want_calls = sum(
            1 for c in calls if id(step_of(c)) in {id(step_of(forwards[i])) for i in served_steps}
        )
        header = out.getvalue().splitlines()[0]
        assert header.endswith(f"{want_calls} calls"), header
        multi = sum(1 for i in served_steps if len(steps[i]) > 1)
        assert f"{multi} step span" in header


def test_a_malformed_traceparent_is_refused_and_its_request_starts_a_new_trace(
    tmp_path: Path, scheduled: list[list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    """One malformed traceparent among 16: one warning, the request completes with the same
    tokens, and its span is the root of a trace of its own."""
    bad = list(TRACEPARENTS)
    bad[3] = "00-this-is-not-a-traceparent-01"
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        bare, traced, path = _run(tmp_path, bad, scheduled, queued=False)
    assert len([r for r in caplog.records if "not-a-traceparent" in r.getMessage()]) == 1
    assert traced["req_3"].generated_tokens == bare["req_3"].generated_tokens
    spans = _spans(path)
    (req3,) = [
        s for s in spans if _attr(s, "otel_gpu.request.id") == "req_3" and not s.get("links")
    ]
    assert "parentSpanId" not in req3
    assert req3["traceId"] not in {tp.split("-")[1] for tp in TRACEPARENTS}


def test_traceparents_must_match_the_inputs(tmp_path: Path) -> None:
    """``generate_batch(traceparents=...)`` with a count other than the inputs' is refused,
    naming both counts, before any request is submitted."""
    import otel_gpu
    from otel_gpu import config
    from otel_gpu.export import pipeline

    model, generation, batching, inputs = _setup()
    otel_gpu.configure(level=1, dest=str(tmp_path / "t.jsonl"), provider="own")
    try:
        otel_gpu.instrument("transformers.continuous_batching")
        with pytest.raises(ValueError, match="2 entries for 16 inputs"):
            model.generate_batch(
                inputs,
                generation_config=generation,
                continuous_batching_config=batching,
                traceparents=TRACEPARENTS[:2],
            )
    finally:
        otel_gpu.uninstrument("transformers.continuous_batching")
        pipeline.reset(timeout=5.0)
        config.reset_overrides()


def test_request_attributes_select_the_steps_live_control_raises(tmp_path: Path) -> None:
    """``add_requests(request_attributes=[...])`` puts each request's attributes on its span, and
    a control document's ``request_attributes`` ({"tenant": "acme"}) raises to level 3 exactly
    the steps (their ``compute_batch`` spans) that serve an acme request, per the links."""
    import otel_gpu
    from otel_gpu import config
    from otel_gpu.attributes import INPUT_PREFIX
    from otel_gpu.control import document, state
    from otel_gpu.export import pipeline
    from otel_gpu.instrumentation.transformers_cb import REQUEST_SPAN_NAME

    model, generation, batching, inputs = _setup()
    acme = {2, 9, 15}
    tenants = [{"tenant": "acme" if i in acme else "globex"} for i in range(N)]
    path = tmp_path / "cb.jsonl"
    otel_gpu.configure(level=1, dest=str(path), provider="own", strict=True, control="on")
    try:
        assert otel_gpu.instrument("transformers.continuous_batching")
        state.apply(
            document.parse({"request_attributes": {"tenant": "acme"}, "level": 3, "for": None}),
            "test",
        )
        traced = run_queued(
            model,
            generation,
            batching,
            inputs,
            traceparents=TRACEPARENTS,
            request_attributes=tenants,
        )
        otel_gpu.flush()
    finally:
        state.reset("test")
        otel_gpu.uninstrument("transformers.continuous_batching")
        pipeline.reset(timeout=5.0)
        config.reset_overrides()
    assert all(r.error is None for r in traced.values())
    spans = _spans(path)
    requests = {_attr(s, "otel_gpu.request.id"): s for s in spans if s["name"] == REQUEST_SPAN_NAME}
    acme_ids = {f"req_{i}" for i in acme}
    assert {rid for rid, s in requests.items() if _attr(s, "tenant") == "acme"} == acme_ids
    acme_spans = {(requests[r]["traceId"], requests[r]["spanId"]) for r in acme_ids}
    by_id = {s["spanId"]: s for s in spans}
    forwards = [s for s in spans if s["name"] == "transformers.continuous_batching.compute_batch"]
    served = []
    for forward in forwards:
        if forward.get("links"):
            linked = {(link["traceId"], link["spanId"]) for link in forward["links"]}
        else:  # a step of one request: under its span
            parent = by_id[forward["parentSpanId"]]
            linked = {(parent["traceId"], parent["spanId"])}
        detailed = any(kv["key"].startswith(INPUT_PREFIX) for kv in forward.get("attributes", []))
        served.append((bool(linked & acme_spans), detailed))
    assert any(m for m, _ in served) and any(not m for m, _ in served)
    assert all(matched == detailed for matched, detailed in served), served
