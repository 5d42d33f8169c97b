"""Live control by request: a control document's ``requests`` (globs on request ids and trace
ids) and ``request_attributes`` (globs on request attributes, e.g. a tenant) raise the level only
during the serving steps (``otel_gpu.batch``) that serve a matching request: "debug this one
customer"."""

from __future__ import annotations

from typing import Any

import pytest

import otel_gpu
from otel_gpu.attributes import INPUT_PREFIX
from otel_gpu.calls import armed
from otel_gpu.control import document, state

TP = {
    "tenant-a:1": "00-" + "a" * 32 + "-" + "1" * 16 + "-01",
    "tenant-b:1": "00-" + "b" * 32 + "-" + "2" * 16 + "-01",
}


@pytest.fixture
def controlled(otel_gpu_spans: Any, tmp_path: Any) -> Any:
    """otel-gpu at level 1 with OTEL_GPU_CONTROL=on; the configured state put back afterwards."""
    spans = otel_gpu_spans(level=1, control="on", journal_dir=str(tmp_path / "journal"))
    yield spans
    state.reset("test teardown")


def _detailed(span: Any) -> bool:
    """Recorded at level 3: the call's inputs are attributes."""
    return any(k.startswith(INPUT_PREFIX) for k in span.attributes)


def test_steps_serving_a_matching_request_run_at_the_raised_level(controlled: Any) -> None:
    """{"requests": ["tenant-a:*"], "level": 3}: a step serving tenant-a's request records its
    calls at level 3; a step serving only tenant-b's, and calls outside steps, stay at level 1;
    after the matching step the functions are back on their configured path."""

    @otel_gpu.api(name="lib.forward")
    def forward(x: int) -> int:
        return x + 1

    state.apply(document.parse({"requests": ["tenant-a:*"], "level": 3, "for": None}), "test")
    assert armed.rule_in_force() is None  # nothing raised outside the steps
    with otel_gpu.batch(requests={"tenant-b:1": TP["tenant-b:1"]}):
        forward(1)
    with otel_gpu.batch(requests=TP):
        forward(2)
    assert armed.rule_in_force() is None
    forward(3)
    calls = sorted(
        (s for s in controlled.get() if s.name == "lib.forward"), key=lambda s: s.start_time
    )
    assert [_detailed(s) for s in calls] == [False, True, False]
    assert state.effective()["requests"] == ["tenant-a:*"]


def test_a_trace_id_matches_too_and_reset_ends_it(controlled: Any) -> None:
    """A glob on the request's trace id (32 hex digits) matches a list of traceparents; after a
    reset no step is raised."""

    @otel_gpu.api(name="lib.forward")
    def forward(x: int) -> int:
        return x

    state.apply(document.parse({"requests": ["a" * 32], "level": 3, "for": None}), "test")
    with otel_gpu.batch(requests=list(TP.values())):
        forward(1)
    state.reset("test")
    with otel_gpu.batch(requests=list(TP.values())):
        forward(2)
    calls = sorted(
        (s for s in controlled.get() if s.name == "lib.forward"), key=lambda s: s.start_time
    )
    assert [_detailed(s) for s in calls] == [True, False]


@pytest.mark.parametrize(
    ("doc", "complaint"),
    [
        ({"requests": ["x*"]}, "requests needs a level"),
        ({"requests": [], "level": 3}, "requests must be a list of 1 to"),
        ({"requests": [7], "level": 3}, "requests must be a list of 1 to"),
        ({"requests": {"a": 1}, "level": 3}, "requests must be a list of 1 to"),
    ],
)
def test_a_bad_requests_field_is_refused_whole(doc: dict, complaint: str) -> None:
    """A document whose ``requests`` is not a non-empty list of short globs, or that gives no
    level, is refused with a message naming what is allowed."""
    with pytest.raises(document.ControlError, match=complaint):
        document.parse(doc)


def test_the_command_sends_requests_and_counts_it_as_a_change(capsys: Any) -> None:
    """``otel-gpu control --requests GLOB --level N`` puts ``requests`` in the document it sends,
    which parses; with --show it is refused as a change (exit 2)."""
    from otel_gpu import cli
    from otel_gpu.cli import control as control_cli

    args = cli.build_parser().parse_args(
        ["control", "1", "--requests", "tenant-a:*", "--level", "5", "--for", "10m"]
    )
    doc = control_cli._document(args)
    assert doc == {"level": 5, "requests": ["tenant-a:*"], "for": "10m"}
    assert document.parse(doc).requests == ("tenant-a:*",)
    assert cli.main(["control", "--requests", "tenant-a:*", "--show", "1"]) == 2
    assert "--requests" in capsys.readouterr().err


def _forward() -> Any:
    @otel_gpu.api(name="lib.forward")
    def forward(x: int) -> int:
        return x + 1

    return forward


def _detail_in_order(spans: Any) -> list[bool]:
    calls = sorted((s for s in spans.get() if s.name == "lib.forward"), key=lambda s: s.start_time)
    return [_detailed(s) for s in calls]


def test_a_request_attribute_selects_the_steps_that_serve_it(controlled: Any) -> None:
    """{"request_attributes": {"tenant": "acme*"}, "level": 3}: a step whose requests include one
    with a matching ``tenant`` (given by ``batch(attributes=)`` by request id) runs at level 3;
    steps of other tenants, of requests without attributes, and calls outside steps stay at 1."""
    forward = _forward()
    doc = {"request_attributes": {"tenant": "acme*"}, "level": 3, "for": None}
    state.apply(document.parse(doc), "test")
    acme = {"tenant-a:1": {"tenant": "acme-eu"}}
    other = {"tenant-b:1": {"tenant": "globex"}}
    with otel_gpu.batch(requests={"tenant-b:1": TP["tenant-b:1"]}, attributes=other):
        forward(1)
    with otel_gpu.batch(requests=TP, attributes={**acme, **other}):
        forward(2)
    with otel_gpu.batch(requests=TP):  # no attributes given: nothing to match
        forward(3)
    assert armed.rule_in_force() is None
    forward(4)
    assert _detail_in_order(controlled) == [False, True, False, False]
    effective = state.effective()
    assert effective["request_attributes"] == {"tenant": ["acme*"]}
    assert effective["requests"] == []


def test_a_request_span_is_matched_on_its_own_attributes(controlled: Any) -> None:
    """A request given as a recording span of the OTel SDK is matched on the span's attributes:
    strings by glob, numbers and booleans by their text, arrays when any element matches."""
    from opentelemetry.sdk.trace import TracerProvider

    forward = _forward()
    tracer = TracerProvider().get_tracer("engine")
    made = {}
    for name, attributes in {
        "plain": {"tenant": "globex"},
        "priority": {"priority": 7},
        "vip": {"flags": ["beta", "vip"]},
    }.items():
        with tracer.start_as_current_span(name, attributes=attributes) as span:
            made[name] = span
    doc = {"request_attributes": {"priority": "7", "flags": "vi?"}, "level": 3, "for": None}
    state.apply(document.parse(doc), "test")
    for name in ("plain", "priority", "vip"):
        with otel_gpu.batch(requests=[made["plain"], made[name]]):
            forward(1)
    assert _detail_in_order(controlled) == [False, True, True]


def test_ids_and_attributes_together_match_either(controlled: Any) -> None:
    """``requests`` and ``request_attributes`` in one document: a step matching either is
    raised; the document's fields come back as given."""
    forward = _forward()
    doc = {
        "requests": ["tenant-b:*"],
        "request_attributes": {"tenant": ["acme", "initech"]},
        "level": 3,
        "for": None,
    }
    change = document.parse(doc)
    assert change.fields()["requests"] == ["tenant-b:*"]
    assert change.fields()["request_attributes"] == {"tenant": ["acme", "initech"]}
    state.apply(change, "test")
    with otel_gpu.batch(requests={"x": TP["tenant-a:1"]}, attributes={"x": {"tenant": "initech"}}):
        forward(1)
    with otel_gpu.batch(requests={"tenant-b:1": TP["tenant-b:1"]}):
        forward(2)
    with otel_gpu.batch(requests={"y": TP["tenant-a:1"]}, attributes={"y": {"tenant": "umbrella"}}):
        forward(3)
    assert _detail_in_order(controlled) == [True, True, False]


@pytest.mark.parametrize(
    ("doc", "complaint"),
    [
        ({"request_attributes": {"tenant": "a"}}, "request_attributes needs a level"),
        ({"request_attributes": {}, "level": 3}, "request_attributes must be an object"),
        ({"request_attributes": ["tenant=a"], "level": 3}, "request_attributes must be an object"),
        (
            {"request_attributes": {"tenant": []}, "level": 3},
            "request_attributes must be an object",
        ),
        ({"request_attributes": {"tenant": None}, "level": 3}, "request_attributes must be an"),
        ({"request_attributes": {"tenant": [3]}, "level": 3}, "request_attributes must be an"),
        ({"request_attributes": {"": "a"}, "level": 3}, "not the key ''"),
        (
            {"requests": ["r"] * 40, "request_attributes": {"t": ["a"] * 30}, "level": 3},
            "hold 70 patterns: at most 64",
        ),
    ],
)
def test_a_bad_request_attributes_field_is_refused_whole(doc: dict, complaint: str) -> None:
    """``request_attributes`` must be a non-empty object of keys to globs, with a level, and at
    most 64 patterns with ``requests``; else the document is refused naming what is allowed."""
    with pytest.raises(document.ControlError, match=complaint):
        document.parse(doc)


def test_the_command_sends_request_attributes(capsys: Any) -> None:
    """``otel-gpu control --request-attribute tenant=acme --request-attribute tenant=beta-*``
    sends ``{"request_attributes": {"tenant": ["acme", "beta-*"]}}``; a flag that is not
    KEY=GLOB is refused by the command (exit 2), naming the form."""
    from otel_gpu import cli
    from otel_gpu.cli import control as control_cli

    parser = cli.build_parser()
    args = parser.parse_args(
        [
            "control",
            "1",
            "--level",
            "5",
            "--request-attribute",
            "tenant=acme",
            "--request-attribute",
            "tenant=beta-*",
        ]
    )
    doc = control_cli._document(args)
    assert doc is not None and doc["request_attributes"] == {"tenant": ["acme", "beta-*"]}
    assert document.parse(doc).requests == (("tenant", "acme"), ("tenant", "beta-*"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["control", "1", "--level", "5", "--request-attribute", "tenant"])
    assert exit_.value.code == 2
    assert "is not KEY=GLOB" in capsys.readouterr().err
    assert cli.main(["control", "--request-attribute", "t=a", "--show", "1"]) == 2
