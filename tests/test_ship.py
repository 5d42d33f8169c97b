"""``otel-gpu ship``: OTLP JSON Lines files in, the same spans out over OTLP (fast, in-process receivers).

The end-to-end run against a real backend (Phoenix) is in ``test_e2e_phoenix.py``.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from commands import otel_gpu_command, without_otel
from opentelemetry import trace
from opentelemetry.exporter.otlp.json.file import FileSpanExporter
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState
from otlp_receiver import attrs_of, grpc_receiver, hex_id, http_receiver
from recording_exporter import RecordingExporter

from otel_gpu.traces import ship

REPO = Path(__file__).resolve().parent.parent
PROTOCOLS = ["grpc", "http/protobuf"]


# --------------------------------------------------------------------------- fixtures


def _write_rich_file(path: Path) -> None:
    """Spans written by the official OTLP JSON file exporter, covering every field ship rebuilds:
    kinds, a remote parent with trace state, links, events, typed attributes, ERROR status,
    two scopes and (in a second line) a second resource."""
    resource = Resource.create({"service.name": "ship-test", "otel_gpu.gpu.count": 2})
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    tracer = provider.get_tracer(
        "scope.a", "1.0", schema_url="https://opentelemetry.io/schemas/1.21.0"
    )
    other = provider.get_tracer("scope.b")
    remote = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0x00F067AA0BA902B7,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "v1")]),
    )
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    with tracer.start_as_current_span("root", context=ctx, kind=SpanKind.SERVER) as root:
        root.set_attributes(
            {"s": "x", "b": True, "i": -3, "f": 0.5, "ints": [1, 2], "strs": ["a", "b"]}
        )
        root.add_event("otel_gpu.stats", {"nan_count": 3, "otel_gpu.tensor": "output.0"})
        with other.start_as_current_span(
            "child", kind=SpanKind.CLIENT, links=[Link(remote, {"why": "batch"})]
        ) as child:
            child.set_status(Status(StatusCode.ERROR, "IndexError: boom"))
    provider.shutdown()
    provider2 = TracerProvider(
        resource=Resource({"service.name": "second"}), shutdown_on_exit=False
    )
    provider2.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    with provider2.get_tracer("scope.c").start_as_current_span("lonely", kind=SpanKind.PRODUCER):
        pass
    provider2.shutdown()


@pytest.fixture(scope="module")
def rich_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ship") / "rich.jsonl"
    _write_rich_file(path)
    return path


@pytest.fixture(scope="module")
def demo_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's spans at level 5, as ``OTEL_GPU_LOGDEST=FILE.jsonl`` writes them."""
    path = tmp_path_factory.mktemp("demo") / "demo.jsonl"
    _run_demo(path, "5")
    return path


def _run_demo(path: Path, level: str, **env: str) -> None:
    """The demo in a process of its own, its spans to ``path`` at ``level``."""
    subprocess.run(
        [sys.executable, "-c", "from otel_gpu.cli import demo; demo.run()"],
        env=without_otel(OTEL_GPU_LOGDEST=str(path), OTEL_GPU_LOGLEVEL=level, **env),
        check=True,
        capture_output=True,
        timeout=120,
    )


def _file_spans(path: Path) -> list[tuple[dict[str, Any], Any]]:
    """(resource attributes, span proto) for every span of a file, via the module's parser."""
    return [
        (attrs_of(rs.resource.attributes), span)
        for _, traces in ship.read_traces(str(path))
        for rs in traces.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]


@pytest.fixture
def otlp_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, Any], None]:
    """Point the standard OTLP variables at a receiver, as a user would for a collector."""

    def point(protocol: str, rx: Any) -> None:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")

    return point


def _receiver(protocol: str) -> Any:
    return grpc_receiver if protocol == "grpc" else http_receiver


# --------------------------------------------------------------------------- fidelity


def test_official_exporter_lines_round_trip_exactly(rich_file: Path) -> None:
    """Every line the official file exporter wrote, rebuilt by ship and re-encoded by the official
    OTLP encoder, equals the line itself: ids, parents, remote flag, trace state, kinds, links,
    events, attributes, status, scopes, schema URLs and resources."""
    lines = list(ship.read_traces(str(rich_file)))
    assert len(lines) == 3  # SimpleSpanProcessor: one export call, one line, per span
    for _, traces in lines:
        assert list(encode_spans(ship.to_spans(traces)).resource_spans) == list(
            traces.resource_spans
        )


def test_demo_file_round_trips_exactly(demo_file: Path) -> None:
    """The demo's own file (tensor attributes, stats events, an ERROR span) re-encodes unchanged."""
    lines = list(ship.read_traces(str(demo_file)))
    assert (
        sum(len(ss.spans) for _, t in lines for rs in t.resource_spans for ss in rs.scope_spans)
        == 5
    )
    for _, traces in lines:
        assert list(encode_spans(ship.to_spans(traces)).resource_spans) == list(
            traces.resource_spans
        )


def test_any_value_kinds_and_structure_survive() -> None:
    """Hand-written OTLP/JSON: kvlist, bytes, mixed arrays and empty values, dropped counts, an
    unspecified kind, snake_case keys, unknown fields and two resources in one line are all
    accepted; values and the resource structure are kept."""
    line = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": "a"}}]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "s"},
                        "spans": [
                            {
                                "traceId": "0af7651916cd43dd8448eb211c80319c",
                                "spanId": "b7ad6b7169203331",
                                "parentSpanId": "",
                                "name": "kinds",
                                "startTimeUnixNano": "1",
                                "endTimeUnixNano": "2",
                                "droppedAttributesCount": 4,
                                "droppedEventsCount": 1,
                                "attributes": [
                                    {
                                        "key": "kv",
                                        "value": {
                                            "kvlistValue": {
                                                "values": [
                                                    {"key": "in", "value": {"intValue": "7"}}
                                                ]
                                            }
                                        },
                                    },
                                    {"key": "raw", "value": {"bytesValue": "AAE="}},
                                    {
                                        "key": "mixed",
                                        "value": {
                                            "arrayValue": {
                                                "values": [
                                                    {"intValue": "1"},
                                                    {"stringValue": "two"},
                                                ]
                                            }
                                        },
                                    },
                                    {"key": "empty", "value": {}},
                                ],
                                "someFutureField": 1,
                            }
                        ],
                    }
                ],
            },
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": "b"}}]
                },
                "scope_spans": [
                    {
                        "scope": {"name": "s"},
                        "spans": [
                            {
                                "trace_id": "0af7651916cd43dd8448eb211c80319c",
                                "span_id": "00f067aa0ba902b7",
                                "name": "second",
                            }
                        ],
                    }
                ],
            },
        ]
    }
    traces = ship.parse_line(json.dumps(line), "hand.jsonl:1")
    request = encode_spans(ship.to_spans(traces))
    assert [attrs_of(rs.resource.attributes)["service.name"] for rs in request.resource_spans] == [
        "a",
        "b",
    ]
    span = request.resource_spans[0].scope_spans[0].spans[0]
    assert attrs_of(span.attributes) == {
        "kv": {"in": 7},
        "raw": b"\x00\x01",
        "mixed": [1, "two"],
        "empty": None,
    }
    assert (span.dropped_attributes_count, span.dropped_events_count) == (4, 1)
    assert hex_id(span.span_id) == "b7ad6b7169203331"
    assert span.parent_span_id == b""
    assert span.kind == span.SPAN_KIND_INTERNAL  # UNSPECIFIED has no SDK equivalent


# --------------------------------------------------------------------------- sending


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_ship_sends_the_files_spans_with_original_ids(
    protocol: str, rich_file: Path, demo_file: Path, otlp_env: Callable[[str, Any], None]
) -> None:
    """Over gRPC and HTTP/protobuf, the receiver gets exactly the files' spans: same trace/span/
    parent ids, names, attributes, events, status and resources; the result counts them sent."""
    expected = _file_spans(rich_file) + _file_spans(demo_file)
    with _receiver(protocol)() as rx:
        otlp_env(protocol, rx)
        out = io.StringIO()
        result = ship.ship([str(rich_file), str(demo_file)], out=out)
        received = rx.received.wait_for_spans(len(expected))
    assert (result.sent, result.failed, result.exit_code) == (len(expected), 0, 0)
    key = lambda item: hex_id(item[1].span_id)  # noqa: E731
    assert len(received) == len(expected)
    for (want_res, want), (got_res, got) in zip(
        sorted(expected, key=key),
        sorted(((attrs_of(r.attributes), s) for r, s in received), key=key),
    ):
        assert got == want
        assert got_res == want_res
    names = {s.name for _, s in received}
    assert {"demo.Decoder.run", "otel_gpu.demo.gather_rows", "root", "child"} <= names
    assert f"{len(expected)} spans sent, 0 failed" in out.getvalue()


def test_requests_are_split_by_batch_size(
    demo_file: Path, otlp_env: Callable[[str, Any], None]
) -> None:
    """``batch_size`` bounds the spans per request: 5 demo spans at 2 per request are 3 requests."""
    with grpc_receiver() as rx:
        otlp_env("grpc", rx)
        result = ship.ship([str(demo_file)], batch_size=2, out=io.StringIO())
        rx.received.wait_for_spans(5)
        sizes = [
            sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            for req in rx.received.requests()
        ]
    assert sizes == [2, 2, 1]
    assert result.requests == 3


def test_refusing_endpoint_counts_failures_and_stops(
    tmp_path: Path,
    demo_file: Path,
    otlp_env: Callable[[str, Any], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An endpoint that refuses every export: each span is counted failed, shipping stops after
    ``max_failures`` failed requests in a row (later files are not attempted), exit code 1."""
    second = tmp_path / "second.jsonl"
    second.write_text(demo_file.read_text())
    with grpc_receiver(behaviour="refuse") as rx:
        otlp_env("grpc", rx)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")
        out = io.StringIO()
        result = ship.ship([str(demo_file), str(second)], batch_size=1, max_failures=2, out=out)
    assert (result.sent, result.failed, result.exit_code) == (0, 10, 1)
    assert result.aborted and result.requests == 2
    assert "stopped after 2 failed requests in a row" in out.getvalue()
    assert f"{second}: not sent (5 spans)" in out.getvalue()


def _big_file(path: Path, spans: int, per_line: int = 100) -> set[tuple[str, str, str]]:
    """``spans`` level-1-like spans, ``per_line`` a line, each line one trace (a root and its
    children); returns every (trace id, span id, parent id) written, in hex."""
    written = set()
    with path.open("w") as f:
        for first in range(0, spans, per_line):
            trace_id = f"{first + 1:032x}"
            root = f"{first + 1:016x}"
            batch = []
            for i in range(first, min(first + per_line, spans)):
                span_id = f"{i + 1:016x}"
                parent = "" if span_id == root else root
                written.add((trace_id, span_id, parent))
                batch.append(
                    {
                        "traceId": trace_id,
                        "spanId": span_id,
                        "parentSpanId": parent,
                        "name": f"op{i % 7}",
                        "kind": 1,
                        "startTimeUnixNano": str(10**18 + i),
                        "endTimeUnixNano": str(10**18 + i + 5),
                        "attributes": [{"key": "i", "value": {"intValue": str(i)}}],
                        "status": {},
                    }
                )
            line = {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": batch}]}]}
            f.write(json.dumps(line) + "\n")
    return written


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_50k_span_file_arrives_whole_with_ids_intact(
    protocol: str,
    tmp_path: Path,
    otlp_env: Callable[[str, Any], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every one of 50,000 spans reaches a loopback receiver once, with its trace, span and
    parent ids, in requests of at most ``batch_size`` spans (counts and ids, not times)."""
    path = tmp_path / "big.jsonl"
    written = _big_file(path, 50_000)
    with _receiver(protocol)() as rx:
        otlp_env(protocol, rx)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "10")  # a loaded machine is slow
        result = ship.ship([str(path)], out=io.StringIO())
        received = rx.received.wait_for_spans(50_000, timeout=60)
        sizes = [
            sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            for req in rx.received.requests()
        ]
    assert (result.spans, result.sent, result.failed, result.exit_code) == (50_000, 50_000, 0, 0)
    got = [(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex()) for _, s in received]
    assert len(got) == 50_000 and set(got) == written
    assert max(sizes) == ship.BATCH_SIZE and sum(sizes) == 50_000
    assert result.requests == len(sizes) == -(-50_000 // ship.BATCH_SIZE)


def test_spans_under_the_pre_0_15_scope_key_are_shipped() -> None:
    """``instrumentationLibrarySpans`` (which ``show`` reads) is shipped as ``scopeSpans``, its
    ``instrumentationLibrary`` as the scope, by the fast path and the exact path alike."""
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    from otel_gpu.traces import decode

    line = {
        "resourceSpans": [
            {
                "resource": {},
                "instrumentationLibrarySpans": [
                    {
                        "instrumentationLibrary": {"name": "old.lib", "version": "0.9"},
                        "spans": [
                            {
                                "traceId": "0af7651916cd43dd8448eb211c80319c",
                                "spanId": "b7ad6b7169203331",
                                "name": "legacy",
                            }
                        ],
                    }
                ],
            }
        ]
    }
    traces = ship.parse_line(json.dumps(line), "old.jsonl:1")
    scope = traces.resource_spans[0].scope_spans[0]
    assert (scope.scope.name, scope.scope.version) == ("old.lib", "0.9")
    assert [s.name for s in scope.spans] == ["legacy"]
    fast = TracesData.FromString(decode.request_bytes(decode._decode_fast(line)))
    assert fast == decode.parse_slow(json.loads(json.dumps(line)), "old.jsonl:1") == traces


def test_the_fast_decoder_builds_what_json_format_builds(rich_file: Path, demo_file: Path) -> None:
    """On every line of the official exporter's file, otel-gpu's demo file and a hand-written
    line (snake_case keys, enum names, NaN/Infinity doubles, bytes, kvlists, arrays, unknown
    keys, schema urls, links with flags), the native decoder's bytes parse to the message that
    ``json_format.ParseDict`` builds, and it takes its fast path (no fallback)."""
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    from otel_gpu.traces import decode

    hand = {
        "resource_spans": [
            {
                "resource": {"attributes": [], "dropped_attributes_count": 2},
                "schemaUrl": "https://r",
                "scope_spans": [
                    {
                        "scope": {"name": "s", "version": "1", "attributes": []},
                        "schema_url": "https://s",
                        "spans": [
                            {
                                "trace_id": "0af7651916cd43dd8448eb211c80319c",
                                "span_id": "b7ad6b7169203331",
                                "parent_span_id": "00f067aa0ba902b7",
                                "trace_state": "v=1",
                                "flags": 769,
                                "kind": "SPAN_KIND_CONSUMER",
                                "start_time_unix_nano": 5,
                                "status": {"code": "STATUS_CODE_ERROR", "message": "m"},
                                "attributes": [
                                    {"key": "nan", "value": {"doubleValue": "NaN"}},
                                    {"key": "inf", "value": {"double_value": "-Infinity"}},
                                    {"key": "d", "value": {"doubleValue": 0.25}},
                                    {"key": "b", "value": {"bytesValue": "AAE="}},
                                    {"key": "t", "value": {"boolValue": True}},
                                    {"key": "n", "value": {"intValue": -3}},
                                    {
                                        "key": "kv",
                                        "value": {
                                            "kvlistValue": {
                                                "values": [
                                                    {
                                                        "key": "a",
                                                        "value": {"arrayValue": {"values": []}},
                                                    }
                                                ]
                                            }
                                        },
                                    },
                                ],
                                "events": [{"time_unix_nano": "7", "name": "e"}],
                                "links": [
                                    {
                                        "traceId": "0af7651916cd43dd8448eb211c80319c",
                                        "spanId": "00f067aa0ba902b7",
                                        "traceState": "x=y",
                                        "flags": 257,
                                        "droppedAttributesCount": 1,
                                    }
                                ],
                                "unknownKey": {"nested": 1},
                            }
                        ],
                    }
                ],
            }
        ]
    }
    payloads = [json.loads(text) for path in (rich_file, demo_file) for text in path.open()]
    payloads.append(hand)
    for payload in payloads:
        fast = TracesData.FromString(decode.request_bytes(decode._decode_fast(payload)))
        assert fast == decode.parse_slow(payload, "x:1")
    assert len(payloads) >= 4


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json\n", r"bad\.jsonl:2: not JSON"),
        ('{"resourceMetrics": []}\n', r"bad\.jsonl:2: not OTLP trace data \(resourceMetrics found"),
        ("[1, 2]\n", r"bad\.jsonl:2: expected a JSON object"),
        (
            '{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"n","traceId":"xyz","spanId":"b7ad6b7169203331"}]}]}]}\n',
            r"bad\.jsonl:2: span 'n' \(resourceSpans\[0\]\.scopeSpans\[0\]\.spans\[0\]\): traceId 'xyz' is not 32 hex digits",
        ),
        (
            '{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"n","traceId":"00000000000000000000000000000000","spanId":"b7ad6b7169203331"}]}]}]}\n',
            r"traceId is all zeros",
        ),
        (
            '{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"n","traceId":"0af7651916cd43dd8448eb211c80319c"}]}]}]}\n',
            r"no spanId",
        ),
        (
            '{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"n","traceId":"0af7651916cd43dd8448eb211c80319c","spanId":"b7ad6b7169203331","startTimeUnixNano":"soon"}]}]}]}\n',
            r"bad\.jsonl:2: not OTLP trace data: .*startTimeUnixNano",
        ),
    ],
)
def test_invalid_line_is_named_and_nothing_is_sent(
    tmp_path: Path, demo_file: Path, text: str, message: str
) -> None:
    """A bad line is reported as FILE:LINE with the reason; nothing is sent and the exit code is 2."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(demo_file.read_text() + text)
    sent: list[Any] = []
    out = io.StringIO()
    result = ship.ship([str(bad)], exporter_factory=lambda: RecordingExporter(into=sent), out=out)
    assert result.exit_code == 2
    assert sent == []
    assert len(result.invalid) == 1
    assert re.search(message, result.invalid[0]), result.invalid[0]
    assert "nothing sent" in out.getvalue()


def test_skip_invalid_ships_the_valid_lines(tmp_path: Path, demo_file: Path) -> None:
    """With ``skip_invalid``, a truncated last line (a crash mid-write) is reported and skipped,
    the valid spans are sent, and the exit code is 1 (not everything was shipped)."""
    bad = tmp_path / "crashed.jsonl"
    text = demo_file.read_text()
    bad.write_text(text + text[: len(text) // 2])
    sent: list[Any] = []
    out = io.StringIO()
    result = ship.ship(
        [str(bad)],
        exporter_factory=lambda: RecordingExporter(into=sent),
        skip_invalid=True,
        out=out,
    )
    assert (result.sent, result.failed, result.exit_code) == (5, 0, 1)
    assert [msg.split(": ")[0] for msg in result.invalid] == [f"{bad}:2"]
    assert "1 invalid line skipped" in out.getvalue()


def test_metrics_files_beside_the_spans_are_left_out_with_a_note(
    tmp_path: Path, demo_file: Path
) -> None:
    """``ship spool/*.jsonl`` also matches the ``NAME.metrics.jsonl`` files otel-gpu writes
    beside its spans (``OTEL_GPU_METRICS``): they are left out with one note, not counted as
    invalid, and the spans are sent (exit 0). A file so named that holds spans is shipped."""
    import shutil

    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(demo_file, spool / "demo.jsonl")
    _run_demo(spool / "run.jsonl", "1", OTEL_GPU_METRICS="true")
    assert (spool / "run.metrics.jsonl").is_file()
    paths = sorted(str(p) for p in spool.glob("*.jsonl"))
    assert len(paths) == 3
    spans = len(_file_spans(spool / "demo.jsonl")) + len(_file_spans(spool / "run.jsonl"))
    sent: list[Any] = []
    out = io.StringIO()
    result = ship.ship(paths, exporter_factory=lambda: RecordingExporter(into=sent), out=out)
    assert (result.sent, result.failed, result.exit_code, result.invalid) == (spans, 0, 0, [])
    assert result.files == 2
    assert "1 metrics file left out" in out.getvalue()
    odd = spool / "odd.metrics.jsonl"
    shutil.copy(demo_file, odd)
    out = io.StringIO()
    result = ship.ship([str(odd)], exporter_factory=lambda: RecordingExporter(into=sent), out=out)
    assert result.sent == len(_file_spans(demo_file)) and "left out" not in out.getvalue()


def test_missing_file_and_directory_are_problems_before_sending(tmp_path: Path) -> None:
    """A missing file or a directory is named; with it nothing else is sent (exit code 2)."""
    sent: list[Any] = []
    result = ship.ship(
        [str(tmp_path / "nope.jsonl"), str(tmp_path)],
        exporter_factory=lambda: RecordingExporter(into=sent),
        out=io.StringIO(),
    )
    assert result.invalid == [
        f"{tmp_path / 'nope.jsonl'}: no such file",
        f"{tmp_path}: is a directory, not a file",
    ]
    assert result.exit_code == 2 and sent == []


def test_check_only_validates_without_building_an_exporter(demo_file: Path) -> None:
    """``check_only`` reads and validates, never creates an exporter, and exits 0 for good files."""
    result = ship.ship(
        [str(demo_file)], exporter_factory=_fail_if_called, check_only=True, out=io.StringIO()
    )
    assert (result.spans, result.sent, result.exit_code) == (5, 0, 0)


def test_gzip_files_are_read(tmp_path: Path, demo_file: Path) -> None:
    """``FILE.jsonl.gz`` (compressed for carrying) ships like the plain file."""
    packed = tmp_path / "demo.jsonl.gz"
    packed.write_bytes(gzip.compress(demo_file.read_bytes()))
    sent: list[Any] = []
    result = ship.ship(
        [str(packed)], exporter_factory=lambda: RecordingExporter(into=sent), out=io.StringIO()
    )
    assert result.sent == 5 and len(sent) == 5


def test_hex_ids_become_the_bytes_they_spell() -> None:
    """OTLP/JSON hex ids are decoded as hex, never as base64 (the canonical protobuf JSON form)."""
    line = (
        '{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"n",'
        '"traceId":"0af7651916cd43dd8448eb211c80319c","spanId":"b7ad6b7169203331",'
        '"parentSpanId":"00f067aa0ba902b7"}]}]}]}'
    )
    span = ship.parse_line(line, "x:1").resource_spans[0].scope_spans[0].spans[0]
    assert (span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex()) == (
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
        "00f067aa0ba902b7",
    )


def test_describe_target_follows_the_standard_variables() -> None:
    """The endpoint shown to the user is the one the official exporters resolve: the traces
    endpoint as is, else the base endpoint (plus /v1/traces for HTTP), else the defaults."""
    assert ship.describe_target({}) == "grpc http://localhost:4317"
    assert (
        ship.describe_target({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
        == "http/protobuf http://localhost:4318/v1/traces"
    )
    assert (
        ship.describe_target(
            {
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/",
            }
        )
        == "http/protobuf http://c:4318/v1/traces"
    )
    assert (
        ship.describe_target(
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:2",
            }
        )
        == "grpc http://b:2"
    )


# --------------------------------------------------------------------------- command line


def ship_cli(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """``otel-gpu ship ARGS`` in a subprocess, without the caller's OTEL_* variables."""
    return otel_gpu_command(["ship", *args], without_otel(**env), cwd=REPO)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cli_ships_and_summarises(protocol: str, demo_file: Path) -> None:
    """``otel-gpu ship FILE`` sends to OTEL_EXPORTER_OTLP_ENDPOINT with the protocol the standard
    variable names, prints the target, per-file progress and the summary, and exits 0."""
    with _receiver(protocol)() as rx:
        proc = ship_cli(
            [str(demo_file)],
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=protocol,
            OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint,
        )
        assert proc.returncode == 0, proc.stderr
        assert len(rx.received.wait_for_spans(5)) == 5
    assert f"-> {protocol} {rx.endpoint}" in proc.stderr
    assert f"{demo_file}: 5 sent, 0 failed" in proc.stderr
    assert "otel-gpu ship: 5 spans sent, 0 failed" in proc.stderr


def test_cli_exit_codes_for_bad_input_and_configuration(
    tmp_path: Path,
    demo_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit 2 with the file named for a missing file (also with ``-q``), and with the setting named for an
    unsupported protocol; ``--check -q`` exits 0 silently without any endpoint; a bad flag value
    is a usage error (exit 2)."""
    from otel_gpu.cli import main

    for quiet in ([], ["-q"]):
        assert main(["ship", *quiet, str(tmp_path / "gone.jsonl")]) == 2
        assert f"{tmp_path / 'gone.jsonl'}: no such file" in capsys.readouterr().err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    assert main(["ship", str(demo_file)]) == 2
    assert (
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json' is not supported" in capsys.readouterr().err
    )
    assert main(["ship", "--check", "-q", str(demo_file)]) == 0
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as usage:
        main(["ship", "--batch-size", "0", str(demo_file)])
    assert usage.value.code == 2


# --------------------------------------------------------------------------- helpers


def _fail_if_called() -> Iterator[Any]:
    raise AssertionError("check_only must not build an exporter")
