"""End to end against a real, independent OTLP backend: Arize Phoenix.

The demo runs in a subprocess with ``OTEL_GPU_LOGDEST=otlp`` over gRPC and over HTTP/protobuf,
and its spans are read back from Phoenix's REST API. ``otel-gpu ship`` is checked the same way,
and so is a serving run (``tiny_serving.py``: transformers' continuous batching), whose links
Phoenix drops: a request's steps are found by the step spans' attributes instead.
Marked ``e2e`` (``-m "not e2e"`` skips them); see ``tests/phoenix_server.py`` for how Phoenix is
found (``OTEL_GPU_TEST_PHOENIX``), started and queried, and what it keeps of OTLP.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import phoenix_server
import pytest
import tiny_serving
from commands import otel_gpu_command, python_command
from jsonl_spans import read_spans
from otlp_receiver import attrs_of

from otel_gpu.attributes import BATCH_REQUEST_IDS, BATCH_REQUEST_TRACE_IDS, REQUEST_ID
from otel_gpu.calls.batch import BATCH_SPAN_NAME
from otel_gpu.instrumentation.transformers_cb import REQUEST_SPAN_NAME as REQUEST
from otel_gpu.traces import ship, show

REPO = Path(__file__).resolve().parent.parent
PROTOCOLS = ["grpc", "http/protobuf"]
ROOT, ERROR = "demo.Decoder.run", "otel_gpu.demo.gather_rows"
CHILDREN = {f"otel_gpu.demo.{n}" for n in ("rms_norm", "attention", "log_probs")}
DEMO_SPANS = {ROOT, ERROR} | CHILDREN
FORWARD = "transformers.continuous_batching.compute_batch"  # one call per step


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[phoenix_server.PhoenixServer]:
    """One Phoenix for the module, on free loopback ports, stopped at the end."""
    executable = phoenix_server.phoenix_executable()
    with phoenix_server.run_phoenix(executable, tmp_path_factory.mktemp("phoenix")) as server:
        yield server


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(extra)
    return env


def _otlp_env(server: phoenix_server.PhoenixServer, protocol: str) -> dict[str, str]:
    # For http/protobuf the official exporter appends /v1/traces to OTEL_EXPORTER_OTLP_ENDPOINT.
    endpoint = server.grpc_endpoint if protocol == "grpc" else server.base_url
    return {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        # Phoenix takes traces only: the standard "no metrics", which the default honours
        "OTEL_METRICS_EXPORTER": "none",
    }


def _project(kind: str, protocol: str) -> str:
    return f"otel-gpu-e2e-{kind}-{protocol.replace('/', '-')}-{uuid.uuid4().hex[:8]}"


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = otel_gpu_command(args, env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, f"otel-gpu {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@dataclass
class DemoRun:
    protocol: str
    project: str
    service: str
    spans: dict[str, dict[str, Any]]
    """Phoenix's spans by name."""
    file_resource: dict[str, Any]
    """The resource of the same run, from its ``.jsonl`` copy (Phoenix does not keep it)."""
    file_spans: dict[str, Any]
    """The same run's spans as written to the ``.jsonl`` copy, by name."""


def _file_view(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    resources, spans = [], {}
    for _, traces in ship.read_traces(str(path)):
        for rs in traces.resource_spans:
            resources.append(attrs_of(rs.resource.attributes))
            spans.update({s.name: s for ss in rs.scope_spans for s in ss.spans})
    assert resources and all(r == resources[0] for r in resources)
    return resources[0], spans


@pytest.fixture(scope="module", params=PROTOCOLS)
def demo_run(
    request: pytest.FixtureRequest,
    phoenix: phoenix_server.PhoenixServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> DemoRun:
    """``python -m otel_gpu demo`` exporting over OTLP to Phoenix (and, in the same process, to a
    ``.jsonl`` copy that shows the resource Phoenix drops); its spans read back from Phoenix."""
    protocol = request.param
    project = _project("demo", protocol)
    service = f"otel-gpu-e2e-{uuid.uuid4().hex[:6]}"
    copy = tmp_path_factory.mktemp("demo") / "copy.jsonl"
    _run(
        ["demo"],
        _env(
            OTEL_GPU_LOGDEST=f"otlp,{copy}",
            OTEL_GPU_LOGLEVEL="5",
            OTEL_SERVICE_NAME=service,
            OTEL_RESOURCE_ATTRIBUTES=f"openinference.project.name={project}",
            **_otlp_env(phoenix, protocol),
        ),
    )
    spans = phoenix.wait_for_spans(project, len(DEMO_SPANS))
    file_resource, file_spans = _file_view(copy)
    return DemoRun(
        protocol, project, service, {s["name"]: s for s in spans}, file_resource, file_spans
    )


# --------------------------------------------------------------------------- the demo over OTLP


@pytest.mark.e2e
def test_demo_spans_arrive_with_names_and_parent_links(demo_run: DemoRun) -> None:
    """All five demo spans arrive; the three library calls are children of demo.Decoder.run in
    its trace, gather_rows is a root of its own trace; ids are the ones the process generated."""
    spans = demo_run.spans
    assert set(spans) == DEMO_SPANS
    root = spans[ROOT]
    assert root["parent_id"] is None
    for name in CHILDREN:
        assert spans[name]["parent_id"] == root["context"]["span_id"], name
        assert spans[name]["context"]["trace_id"] == root["context"]["trace_id"], name
    assert spans[ERROR]["parent_id"] is None
    assert spans[ERROR]["context"]["trace_id"] != root["context"]["trace_id"]
    for name, span in spans.items():
        recorded = demo_run.file_spans[name]
        assert span["context"] == {
            "trace_id": recorded.trace_id.hex(),
            "span_id": recorded.span_id.hex(),
        }


@pytest.mark.e2e
def test_tensor_attributes_arrive_typed(demo_run: DemoRun) -> None:
    """Level-3 metadata arrives with its types: shapes and strides as int arrays, dtype and
    device as strings, flags as booleans, defaults marked, code location attributes present."""
    rms = demo_run.spans["otel_gpu.demo.rms_norm"]["attributes"]
    assert rms["otel_gpu.input.x.shape"] == [2, 8, 32]
    assert rms["otel_gpu.input.x.stride"] == [256, 32, 1]
    assert rms["otel_gpu.input.x.dtype"] == "torch.float32"
    assert rms["otel_gpu.input.x.device"] == "cpu"
    assert rms["otel_gpu.input.x.is_contiguous"] is True
    assert rms["otel_gpu.input.eps.value"] == pytest.approx(1e-6)
    assert rms["otel_gpu.input.eps.default"] is True
    assert rms["otel_gpu.output.0.shape"] == [2, 8, 32]
    assert rms["code.function.name"] == "otel_gpu.demo.rms_norm"
    attention = demo_run.spans["otel_gpu.demo.attention"]["attributes"]
    assert attention["otel_gpu.input.q.shape"] == [2, 4, 8, 8]
    assert attention["otel_gpu.input.q.is_contiguous"] is False


@pytest.mark.e2e
def test_stats_events_and_nonfinite_flag(demo_run: DemoRun) -> None:
    """Level-5 statistics arrive as ``otel_gpu.stats`` span events: log_probs' output reports its
    NaNs in ``nan_count``, and ``otel_gpu.nonfinite`` marks that span (for tail sampling)."""
    log_probs = demo_run.spans["otel_gpu.demo.log_probs"]
    stats = {
        e["attributes"]["otel_gpu.tensor"]: e["attributes"]
        for e in log_probs["events"]
        if e["name"] == "otel_gpu.stats"
    }
    assert set(stats) == {"input.logits", "output.0"}
    assert stats["output.0"]["nan_count"] > 0
    assert stats["input.logits"]["nan_count"] == 0
    assert stats["output.0"]["numel"] == 512
    assert log_probs["attributes"]["otel_gpu.nonfinite"] is True
    assert "otel_gpu.nonfinite" not in demo_run.spans["otel_gpu.demo.rms_norm"]["attributes"]


@pytest.mark.e2e
def test_gather_rows_is_an_error_span_with_its_exception(demo_run: DemoRun) -> None:
    """The failing call arrives with status ERROR, the exception's message as status message,
    and an ``exception`` event naming the type; the other spans are not errors."""
    span = demo_run.spans[ERROR]
    assert span["status_code"] == "ERROR"
    assert span["status_message"].startswith("IndexError: index 9 is out of bounds")
    [exception] = [e for e in span["events"] if e["name"] == "exception"]
    assert exception["attributes"]["exception.type"] == "IndexError"
    assert "gather_rows" in exception["attributes"]["exception.stacktrace"]
    assert {s["status_code"] for n, s in demo_run.spans.items() if n != ERROR} == {"UNSET"}


@pytest.mark.e2e
def test_resource_reaches_phoenix(demo_run: DemoRun, phoenix: phoenix_server.PhoenixServer) -> None:
    """The resource crosses the wire: Phoenix files the spans under the project named by the
    resource attribute ``openinference.project.name`` (set through OTEL_RESOURCE_ATTRIBUTES and
    merged into otel-gpu's resource). Phoenix keeps no other resource attribute, so the rest of
    the same resource object is checked in the run's ``.jsonl`` copy: ``service.name`` from
    OTEL_SERVICE_NAME and the GPU inventory ``otel_gpu.gpu.count``."""
    projects = {p["name"] for p in phoenix.get_json("/v1/projects", limit=1000)["data"]}
    assert demo_run.project in projects
    assert len(demo_run.spans) == len(DEMO_SPANS)  # all of them, none left in "default"
    resource = demo_run.file_resource
    assert resource["openinference.project.name"] == demo_run.project
    assert resource["service.name"] == demo_run.service
    assert isinstance(resource["otel_gpu.gpu.count"], int)
    assert resource["otel_gpu.torch.version"]
    assert resource["telemetry.sdk.language"] == "python"


# --------------------------------------------------------------------------- otel-gpu ship


def _iso_to_ns(text: str) -> int:
    moment = datetime.fromisoformat(text).astimezone(timezone.utc)
    return int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_ship_puts_a_files_spans_in_phoenix_unchanged(
    protocol: str, phoenix: phoenix_server.PhoenixServer, tmp_path: Path
) -> None:
    """A demo run written to ``.jsonl`` (no network), then ``otel-gpu ship FILE`` over each
    protocol: Phoenix holds the same spans with the same ids, parents, names, start times (within
    the microsecond Phoenix keeps), status, attributes and events as the file."""
    project = _project("ship", protocol)
    path = tmp_path / "air-gapped.jsonl"
    _run(
        ["demo"],
        _env(
            OTEL_GPU_LOGDEST=str(path),
            OTEL_GPU_LOGLEVEL="5",
            OTEL_RESOURCE_ATTRIBUTES=f"openinference.project.name={project}",
        ),
    )
    proc = _run(["ship", str(path)], _env(**_otlp_env(phoenix, protocol)))
    assert f"{len(DEMO_SPANS)} spans sent, 0 failed" in proc.stderr
    stored = {s["name"]: s for s in phoenix.wait_for_spans(project, len(DEMO_SPANS))}
    _resource, recorded = _file_view(path)
    assert set(stored) == set(recorded) == DEMO_SPANS
    for name, span in recorded.items():
        got = stored[name]
        assert got["context"] == {"trace_id": span.trace_id.hex(), "span_id": span.span_id.hex()}
        assert got["parent_id"] == (span.parent_span_id.hex() or None)
        assert abs(_iso_to_ns(got["start_time"]) - span.start_time_unix_nano) <= 1000
        assert got["status_code"] == ("ERROR" if span.status.code == 2 else "UNSET")
        assert _close(got["attributes"], attrs_of(span.attributes))
        assert [e["name"] for e in got["events"]] == [e.name for e in span.events]
        for stored_event, event in zip(got["events"], span.events, strict=True):
            assert _close(stored_event["attributes"], attrs_of(event.attributes))


def _close(got: dict, want: dict) -> bool:
    """Equal mappings, floats compared with a relative tolerance (Phoenix stores JSON numbers)."""
    if set(got) != set(want):
        return False
    for key, value in want.items():
        other = got[key]
        if isinstance(value, float) and not isinstance(other, bool):
            if other != pytest.approx(value, rel=1e-9, nan_ok=True):
                return False
        elif other != value:
            return False
    return True


# --------------------------------------------------------------------------- serving


@dataclass
class ServingRun:
    project: str
    spans: dict[str, dict[str, Any]]
    """Phoenix's spans by span id."""
    otlp_spans: dict[str, dict[str, Any]]
    """The same spans as Phoenix's ``/spans/otlpv1`` view returns them, by span id."""
    copy: Path
    file_spans: dict[str, dict[str, Any]]
    """The run's spans as written to its ``.jsonl`` copy (links included), by span id."""


@pytest.fixture(scope="module")
def serving_run(
    phoenix: phoenix_server.PhoenixServer, tmp_path_factory: pytest.TempPathFactory
) -> ServingRun:
    """``tests/tiny_serving.py`` (transformers' continuous batching, each request with its own
    ``traceparent``) at level 1, exporting over OTLP/gRPC to Phoenix and to a ``.jsonl`` copy."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    project = _project("serving", "grpc")
    workdir = tmp_path_factory.mktemp("serving")
    copy = workdir / "copy.jsonl"
    env = _env(
        OTEL_GPU_LOGDEST=f"otlp,{copy}",
        OTEL_GPU_LOGLEVEL="1",
        OTEL_GPU_STRICT="true",
        OTEL_RESOURCE_ATTRIBUTES=f"openinference.project.name={project}",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        **_otlp_env(phoenix, "grpc"),
    )
    proc = python_command([str(REPO / "tests" / "tiny_serving.py")], env, cwd=workdir, timeout=300)
    assert proc.returncode == 0, f"tiny_serving.py failed:\n{proc.stdout}\n{proc.stderr}"
    file_spans = {s["spanId"]: s for s in read_spans(copy, plain=True)}
    spans = phoenix.wait_for_spans(project, len(file_spans))
    otlp_spans = phoenix.spans(project, otlp=True)
    return ServingRun(
        project,
        {s["context"]["span_id"]: s for s in spans},
        {s["span_id"]: s for s in otlp_spans},
        copy,
        file_spans,
    )


def _traceparent(rid: str) -> tuple[str, str]:
    """The trace id and span id of the ``traceparent`` request ``rid`` (``req_I``) was given."""
    _, trace_id, span_id, _ = tiny_serving.TRACEPARENTS[int(rid.removeprefix("req_"))].split("-")
    return trace_id, span_id


def _descendants(spans: dict[str, dict[str, Any]], parent: str, roots: set[str]) -> set[str]:
    """The span ids under any of ``roots``, following ``parent`` (the field naming a parent)."""
    children: dict[str, list[str]] = {}
    for span_id, span in spans.items():
        children.setdefault(span.get(parent) or "", []).append(span_id)
    found: set[str] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


@pytest.mark.e2e
@pytest.mark.transformers
def test_request_spans_arrive_in_their_traceparents_trace(serving_run: ServingRun) -> None:
    """Every request span arrives in the trace its ``traceparent`` names, a child of the
    traceparent's span, carrying ``otel_gpu.request.id``."""
    requests = {
        s["attributes"][REQUEST_ID]: s for s in serving_run.spans.values() if s["name"] == REQUEST
    }
    assert sorted(requests) == sorted(f"req_{i}" for i in range(tiny_serving.N))
    for rid, span in requests.items():
        trace_id, span_id = _traceparent(rid)
        assert span["context"]["trace_id"] == trace_id, rid
        assert span["parent_id"] == span_id, rid


@pytest.mark.e2e
@pytest.mark.transformers
def test_every_serving_span_arrives_in_its_trace_under_its_parent(serving_run: ServingRun) -> None:
    """Every span of the run arrives with the trace id, parent and name of its ``.jsonl`` copy:
    the calls of a step of several requests under its step span, those of a step of one request
    under the request span; a step span with ``otel_gpu.batch.request.trace_ids`` and
    ``.ids`` as arrays of strings, as in the copy."""
    phoenix_spans, file_spans = serving_run.spans, serving_run.file_spans
    assert set(phoenix_spans) == set(file_spans)
    for span_id, recorded in file_spans.items():
        got = phoenix_spans[span_id]
        assert got["name"] == recorded["name"]
        assert got["context"]["trace_id"] == recorded["traceId"], recorded["name"]
        assert got["parent_id"] == (recorded.get("parentSpanId") or None), recorded["name"]
    steps = [s for s in file_spans.values() if s["name"] == BATCH_SPAN_NAME]
    assert any(len(s["links"]) > 1 for s in steps), "no step served several requests"
    calls_of_steps = {s["parentSpanId"] for s in file_spans.values() if s["name"] == FORWARD}
    assert calls_of_steps - {s["spanId"] for s in steps}, "no step served one request alone"
    for step in steps:
        attributes = phoenix_spans[step["spanId"]]["attributes"]
        for key in (BATCH_REQUEST_TRACE_IDS, BATCH_REQUEST_IDS):
            assert key in step["attrs"], f"the step span of the copy carries no {key}"
            assert attributes.get(key) == step["attrs"][key], key
        assert all(isinstance(t, str) for t in attributes[BATCH_REQUEST_TRACE_IDS])


@pytest.mark.e2e
@pytest.mark.transformers
# here req_0's last step serves it alone: its calls hang under its request span
@pytest.mark.parametrize("rid", ["req_0", "req_3", "req_7"])
def test_a_requests_steps_and_calls_are_found_in_phoenix_by_attribute(
    rid: str, serving_run: ServingRun, phoenix: phoenix_server.PhoenixServer
) -> None:
    """Without links, Phoenix still finds a request's steps: the step spans whose
    ``otel_gpu.batch.request.trace_ids`` hold the request's trace id (and whose ``.ids`` hold its
    id) are exactly those that link to the request in the ``.jsonl`` copy, read from the spans
    and through Phoenix's own span filter with the conditions docs/serving.md gives; the spans
    under them and under the request span are exactly the calls the copy says served it, as many
    as ``otel-gpu show --request`` counts."""
    trace_id, _ = _traceparent(rid)
    file_spans, phoenix_spans = serving_run.file_spans, serving_run.spans
    # the reference: the copy's links (calls of several requests' steps) and its request span's
    # descendants (calls of a step of that request alone)
    linked = {
        span_id
        for span_id, span in file_spans.items()
        if any(link["traceId"] == trace_id for link in span.get("links", ()))
    }
    want_steps = {i for i in linked if file_spans[i]["name"] == BATCH_SPAN_NAME}
    [request] = [
        i for i, s in file_spans.items() if s["name"] == REQUEST and s["attrs"][REQUEST_ID] == rid
    ]
    want_calls = (linked - want_steps) | _descendants(file_spans, "parentSpanId", {request})
    assert want_steps and want_calls

    def steps_holding(key: str, value: str) -> set[str]:
        return {
            i
            for i, s in phoenix_spans.items()
            if s["name"] == BATCH_SPAN_NAME and value in s["attributes"].get(key, ())
        }

    assert steps_holding(BATCH_REQUEST_TRACE_IDS, trace_id) == want_steps
    assert steps_holding(BATCH_REQUEST_IDS, rid) == want_steps
    by_filter = {
        f'"{trace_id}" in otel_gpu.batch.request.trace_ids',
        f"""'"{rid}"' in otel_gpu.batch.request.ids""",
    }
    for condition in by_filter:
        found = phoenix.search(serving_run.project, condition)
        assert {s["span_id"] for s in found} == want_steps, condition
    # a dotted key inside attributes[...] is one key to Phoenix, which stores the path nested
    misspelt = f'"{trace_id}" in attributes["otel_gpu.batch.request.trace_ids"]'
    assert phoenix.search(serving_run.project, misspelt) == [], (
        f"Phoenix now finds steps with {misspelt}: docs/serving.md says it finds none"
    )
    calls = _descendants(phoenix_spans, "parent_id", want_steps | {request})
    assert calls == want_calls
    out = io.StringIO()
    code = show.show([str(serving_run.copy)], request=trace_id, limit=0, out=out, err=io.StringIO())
    assert code == 0
    header = out.getvalue().splitlines()[0]
    assert header.endswith(f"{len(want_calls)} calls"), header


@pytest.mark.e2e
@pytest.mark.transformers
def test_pinned_phoenix_returns_no_links(serving_run: ServingRun) -> None:
    """A documented fact of the pinned Phoenix: the spans that carry links in the ``.jsonl``
    copy come back from Phoenix's REST API without them, in its span model (no ``links``) and in
    its OTLP view (``links`` null). The day Phoenix keeps links, this test fails, asking for the
    docs that say it drops them to be updated."""
    linked = [i for i, s in serving_run.file_spans.items() if s.get("links")]
    assert linked, "the run made no links"
    kept = [
        i
        for i in linked
        if serving_run.spans[i].get("links") or serving_run.otlp_spans[i].get("links")
    ]
    assert not kept, (
        f"Phoenix's REST API now returns span links ({len(kept)} of the {len(linked)} linked "
        "spans, in /spans or /spans/otlpv1): the pinned Phoenix dropped them. Update "
        'docs/serving.md ("In Phoenix") and tests/phoenix_server.py, which say Phoenix keeps '
        "no links."
    )


# --------------------------------------------------------------------------- the fixture's contract


def test_missing_phoenix_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without OTEL_GPU_TEST_PHOENIX a local run skips, naming the variable and the installer."""
    monkeypatch.delenv(phoenix_server.ENV_EXECUTABLE, raising=False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"OTEL_GPU_TEST_PHOENIX.*install-phoenix\.sh"):
        phoenix_server.phoenix_executable()


def test_missing_phoenix_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CI=true a missing Phoenix fails the tests instead of skipping them."""
    monkeypatch.delenv(phoenix_server.ENV_EXECUTABLE, raising=False)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"CI=true and .*OTEL_GPU_TEST_PHOENIX"):
        phoenix_server.phoenix_executable()


def test_wrong_phoenix_path_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A path that is not an executable file is a failure even locally (a typo must not skip)."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv(phoenix_server.ENV_EXECUTABLE, str(tmp_path / "phoenix"))
    with pytest.raises(pytest.fail.Exception, match="is not an executable file"):
        phoenix_server.phoenix_executable()
