"""Live control by request: a control document's ``requests`` raises the level only during the
serving steps (``otel_gpu.batch``) that serve a matching request: "debug this one customer"."""

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
    import argparse

    from otel_gpu import cli
    from otel_gpu.cli import control as control_cli

    args = argparse.Namespace(
        show=False,
        reset=False,
        list=False,
        dry_run=False,
        level=5,
        include=None,
        exclude=None,
        requests=["tenant-a:*"],
        sample=None,
        ring_size=None,
        triggers=None,
        dump_max_calls=None,
        dump_max_bytes=None,
        until_changed=False,
        window="10m",
    )
    doc = control_cli._document(args)
    assert doc == {"level": 5, "requests": ["tenant-a:*"], "for": "10m"}
    assert document.parse(doc).requests == ("tenant-a:*",)
    assert cli.main(["control", "--requests", "tenant-a:*", "--show", "1"]) == 2
    assert "--requests" in capsys.readouterr().err
