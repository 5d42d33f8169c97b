"""Behaviour of ``OTEL_GPU_LOGDEST``: where otel-gpu's own TracerProvider sends spans.

Every test configures first and decorates afterwards (the level is fixed when a
function is decorated), calls, flushes, and then reads what the destination got:
OTLP JSON Lines files parsed with the official protobuf JSON parser, OTLP over
gRPC and HTTP/protobuf received by the in-process receivers of ``otlp_receiver``,
and the human-readable text file.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourceProto
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import Status as StatusProto
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_gpu
from otel_gpu import ConfigError
from otel_gpu.export import pipeline

try:
    from otlp_receiver import attrs_of, grpc_receiver, hex_ids_to_base64, http_receiver
except ModuleNotFoundError:  # tests/ imported as a package
    from tests.otlp_receiver import attrs_of, grpc_receiver, hex_ids_to_base64, http_receiver

ANSI = "\x1b["
THIS_FILE = Path(__file__).resolve()


# --------------------------------------------------------------------------- helpers


def _def_line(marker: str) -> int:
    """1-based line of this file that contains ``marker`` (a ``def`` line), read from the source."""
    for number, line in enumerate(THIS_FILE.read_text(encoding="utf-8").splitlines(), 1):
        if marker in line:
            return number
    raise AssertionError(f"{marker!r} not found in {THIS_FILE}")


def _make_lib() -> dict[str, Callable[..., Any]]:
    """A small 'library' decorated with the settings in force *now* (call after configure)."""

    def scale(x, factor=2.0):  # def-scale
        return x * factor

    def outer(x, w):  # def-outer
        return lib["scale"](x) + w

    def boom(n, tag="t"):  # def-boom
        raise ValueError(f"boom {n}")

    def poison(x):  # def-poison
        y = x.clone()
        y[1] = float("nan")
        y[2] = float("inf")
        return y

    lib = {
        name: otel_gpu.api(fn)
        for name, fn in [("scale", scale), ("outer", outer), ("boom", boom), ("poison", poison)]
    }
    return lib


def _span_name(local: str) -> str:
    return f"{__name__}._make_lib.<locals>.{local}"


def _read_jsonl(path: Path) -> list[tuple[ResourceProto, SpanProto, dict[str, str]]]:
    """Parse every line as ``TracesData`` (strictly: unknown fields fail) and flatten the spans.

    Each span comes with the hex ids the file carried, checked against the parsed bytes.
    """
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n"), "JSON Lines: every record ends with a newline"
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        assert line.strip(), f"line {number} of {path} is empty"
        raw = json.loads(line)
        message = json_format.Parse(json.dumps(hex_ids_to_base64(raw, strict=True)), TracesData())
        raw_spans = [
            span for rs in raw["resourceSpans"] for ss in rs["scopeSpans"] for span in ss["spans"]
        ]
        parsed = [
            (rs.resource, span, ss.scope.name)
            for rs in message.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]
        assert len(raw_spans) == len(parsed)
        for raw_span, (resource, span, scope) in zip(raw_spans, parsed):
            assert span.trace_id.hex() == raw_span["traceId"]
            assert span.span_id.hex() == raw_span["spanId"]
            assert span.parent_span_id.hex() == raw_span.get("parentSpanId", "")
            assert scope == "otel_gpu"
            ids = {"trace": raw_span["traceId"], "span": raw_span["spanId"]}
            out.append((resource, span, ids))
    return out


def _by_name(spans: list[tuple[Any, SpanProto, Any]]) -> dict[str, list[SpanProto]]:
    found: dict[str, list[SpanProto]] = {}
    for _, span, *_ in spans:
        found.setdefault(span.name, []).append(span)
    return found


def _events(span: SpanProto, name: str) -> list[dict[str, Any]]:
    return [attrs_of(e.attributes) for e in span.events if e.name == name]


def _stats_of(span: SpanProto) -> dict[str, dict[str, Any]]:
    return {e["otel_gpu.tensor"]: e for e in _events(span, "otel_gpu.stats")}


# --------------------------------------------------------------------------- 1. JSON Lines


def test_jsonl_file_is_valid_otlp_json_with_metadata_stats_errors_and_resource(tmp_path):
    """A ``.jsonl`` destination holds OTLP JSON that the official protobuf parser accepts line by
    line, with every call's span: ``module.qualname`` names, parent/child ids, ``code.*``
    attributes, input/output tensor metadata, ``.default`` markers, ``otel_gpu.stats`` events,
    ``otel_gpu.nonfinite``, ERROR status with an ``exception`` event, and the process resource."""
    dest = tmp_path / "t.jsonl"
    otel_gpu.configure(level=5, dest=str(dest), provider="own")
    lib = _make_lib()

    x = torch.arange(6.0).reshape(2, 3).t()  # non-contiguous, shape (3, 2), stride (1, 3)
    w = torch.ones(3, 2, requires_grad=True)
    lib["outer"](x, w)  # outer -> scale(x) with factor defaulted
    lib["scale"](torch.ones(4), factor=3.0)  # factor passed: no .default marker
    with pytest.raises(ValueError, match="boom 7"):
        lib["boom"](7)
    lib["poison"](torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert otel_gpu.flush() is True

    spans = _read_jsonl(dest)
    assert len(spans) == 5
    names = _by_name(spans)
    assert sorted(names) == sorted(_span_name(n) for n in ("scale", "outer", "boom", "poison"))

    # parent/child: scale called from outer is outer's child in outer's trace; the rest are roots
    [outer] = names[_span_name("outer")]
    nested, direct = sorted(names[_span_name("scale")], key=lambda s: len(s.parent_span_id) == 0)
    assert outer.parent_span_id == b""
    assert nested.parent_span_id == outer.span_id
    assert nested.trace_id == outer.trace_id
    assert direct.parent_span_id == b"" and direct.trace_id != outer.trace_id
    assert len({s.span_id for _, s, _ in spans}) == 5
    assert all(len(s.trace_id) == 16 and len(s.span_id) == 8 for _, s, _ in spans)
    assert all(s.start_time_unix_nano <= s.end_time_unix_nano for _, s, _ in spans)
    assert outer.start_time_unix_nano <= nested.start_time_unix_nano
    assert nested.end_time_unix_nano <= outer.end_time_unix_nano

    # code.* attributes
    for local in ("scale", "outer", "boom", "poison"):
        for span in names[_span_name(local)]:
            a = attrs_of(span.attributes)
            assert a["code.function.name"] == _span_name(local)
            assert Path(a["code.file.path"]).resolve() == THIS_FILE
            assert a["code.line.number"] == _def_line(f"# def-{local}")

    # tensor metadata of inputs and outputs
    a = attrs_of(outer.attributes)
    assert a["otel_gpu.input.x.shape"] == [3, 2]
    assert a["otel_gpu.input.x.dtype"] == "torch.float32"
    assert a["otel_gpu.input.x.device"] == "cpu"
    assert a["otel_gpu.input.x.stride"] == [1, 3]
    assert a["otel_gpu.input.x.requires_grad"] is False
    assert a["otel_gpu.input.x.is_contiguous"] is False
    assert a["otel_gpu.input.w.requires_grad"] is True
    assert a["otel_gpu.input.w.is_contiguous"] is True
    assert a["otel_gpu.output.0.shape"] == [3, 2]
    assert a["otel_gpu.output.0.requires_grad"] is True
    assert not any(k.endswith(".default") for k in a)

    # defaults not passed are marked; passed values are not
    n = attrs_of(nested.attributes)
    assert n["otel_gpu.input.factor.value"] == 2.0
    assert n["otel_gpu.input.factor.default"] is True
    d = attrs_of(direct.attributes)
    assert d["otel_gpu.input.factor.value"] == 3.0
    assert "otel_gpu.input.factor.default" not in d

    # statistics events (finite inputs): one per tensor, sample std
    stats = _stats_of(outer)
    assert set(stats) == {"input.x", "input.w", "output.0"}
    sx = stats["input.x"]
    assert sx["numel"] == 6
    assert sx["min"] == 0.0 and sx["max"] == 5.0
    assert sx["mean"] == pytest.approx(2.5)
    assert sx["std"] == pytest.approx(math.sqrt(3.5))
    assert sx["nan_count"] == 0 and sx["inf_count"] == 0
    assert "otel_gpu.nonfinite" not in a

    # NaN/Inf producing call
    [poison] = names[_span_name("poison")]
    p = attrs_of(poison.attributes)
    assert p["otel_gpu.nonfinite"] is True
    out_stats = _stats_of(poison)["output.0"]
    assert out_stats["nan_count"] == 1
    assert out_stats["inf_count"] == 1
    assert out_stats["numel"] == 4
    assert out_stats["min"] == 1.0 and out_stats["max"] == 4.0  # over finite values only
    assert out_stats["mean"] == pytest.approx(2.5)
    assert out_stats["std"] == pytest.approx(math.sqrt(4.5))
    assert _stats_of(poison)["input.x"]["nan_count"] == 0
    assert poison.status.code == StatusProto.STATUS_CODE_UNSET

    # the raising call
    [boom] = names[_span_name("boom")]
    assert boom.status.code == StatusProto.STATUS_CODE_ERROR
    assert "ValueError" in boom.status.message and "boom 7" in boom.status.message
    [exc] = _events(boom, "exception")
    assert exc["exception.type"] == "ValueError"
    assert exc["exception.message"] == "boom 7"
    assert "raise ValueError" in exc["exception.stacktrace"]
    b = attrs_of(boom.attributes)
    assert b["otel_gpu.input.n.value"] == 7
    assert b["otel_gpu.input.tag.default"] is True
    assert not any(k.startswith("otel_gpu.output.") for k in b)
    assert outer.status.code == StatusProto.STATUS_CODE_UNSET

    # resource
    for resource, _, _ in spans:
        r = attrs_of(resource.attributes)
        assert isinstance(r["service.name"], str) and r["service.name"]
        assert r["process.pid"] == os.getpid()
        assert isinstance(r["otel_gpu.gpu.count"], int) and r["otel_gpu.gpu.count"] >= 0


@pytest.mark.parametrize("suffix", [".jsonl", ".log"])
def test_path_expands_pid_and_rank(tmp_path, monkeypatch, suffix):
    """``%i`` in a destination path becomes the process id and ``%r`` the ``RANK`` variable (in
    the metrics file beside a ``.jsonl`` one too, on by default there)."""
    monkeypatch.setenv("RANK", "3")
    otel_gpu.configure(level=1, dest=str(tmp_path / f"trace-%i-rank%r{suffix}"), provider="own")

    def work(x):
        return x

    otel_gpu.api(work)(1)
    assert otel_gpu.flush() is True

    expected = tmp_path / f"trace-{os.getpid()}-rank3{suffix}"
    metrics = [f"trace-{os.getpid()}-rank3.metrics.jsonl"] if suffix == ".jsonl" else []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([expected.name, *metrics])
    assert f"{__name__}.{work.__qualname__}" in expected.read_text(encoding="utf-8")


def test_rank_defaults_to_zero(tmp_path, monkeypatch):
    """Without ``RANK`` in the environment, ``%r`` becomes ``0``."""
    monkeypatch.delenv("RANK", raising=False)
    otel_gpu.configure(level=1, dest=str(tmp_path / "r%r.jsonl"), provider="own")
    otel_gpu.api(lambda: None)()
    assert otel_gpu.flush() is True
    assert _read_jsonl(tmp_path / "r0.jsonl")


def test_new_destination_takes_effect_at_next_call(tmp_path):
    """A destination given to ``configure()`` after functions were decorated takes effect at
    their next call; spans recorded before go to the old destination (configure's docstring)."""
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    otel_gpu.configure(level=1, dest=str(first), provider="own")
    lib = _make_lib()
    lib["scale"](1)
    assert otel_gpu.flush() is True
    otel_gpu.configure(dest=str(second))
    lib["scale"](2)
    lib["scale"](3)
    assert otel_gpu.flush() is True

    assert second.exists(), "spans after configure(dest=...) did not go to the new destination"
    assert len(_read_jsonl(second)) == 2
    assert len(_read_jsonl(first)) == 1


def test_rejected_configure_changes_nothing(tmp_path):
    """A ``configure()`` that raises ``ConfigError`` leaves the previous destination in force."""
    dest = tmp_path / "keep.jsonl"
    otel_gpu.configure(level=1, dest=str(dest), provider="own")
    lib = _make_lib()
    lib["scale"](1)
    with pytest.raises(ConfigError):
        otel_gpu.configure(dest=str(tmp_path / "missing" / "x.jsonl"))
    lib["scale"](2)
    assert otel_gpu.flush() is True
    assert len(_read_jsonl(dest)) == 2
    assert not (tmp_path / "missing").exists()


@pytest.fixture
def fresh_resource(monkeypatch):
    """Make otel-gpu detect its resource again in this test (restored afterwards)."""
    from otel_gpu import resource

    monkeypatch.setattr(resource, "_cache", None)


def test_otel_service_name_sets_resource_service_name(tmp_path, monkeypatch, fresh_resource):
    """``OTEL_SERVICE_NAME`` in the environment becomes the resource's ``service.name``."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "svc-from-env")
    dest = tmp_path / "svc.jsonl"
    otel_gpu.configure(level=1, dest=str(dest), provider="own")
    otel_gpu.api(lambda: None)()
    assert otel_gpu.flush() is True
    [(resource, _, _)] = _read_jsonl(dest)
    assert attrs_of(resource.attributes)["service.name"] == "svc-from-env"


def test_configure_service_name_sets_resource_service_name(tmp_path, fresh_resource):
    """``configure(service_name=...)`` (the ``OTEL_SERVICE_NAME`` setting, set from code, which
    wins over the environment) becomes the resource's ``service.name``."""
    dest = tmp_path / "svc.jsonl"
    otel_gpu.configure(level=1, dest=str(dest), provider="own", service_name="svc-from-code")
    otel_gpu.api(lambda: None)()
    assert otel_gpu.flush() is True
    [(resource, _, _)] = _read_jsonl(dest)
    assert attrs_of(resource.attributes)["service.name"] == "svc-from-code"


# --------------------------------------------------------------------------- 2. OTLP


def _otlp_round_trip(monkeypatch, receiver, env: dict[str, str]) -> tuple[list, list]:
    for name, value in env.items():
        monkeypatch.setenv(name, value.replace("{endpoint}", receiver.endpoint))
    # spans only: the metrics (on by default) would take their own protocol, gRPC by default
    otel_gpu.configure(level=3, dest="otlp", provider="own", metrics=False)
    lib = _make_lib()
    lib["outer"](torch.ones(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError):
        lib["boom"](1)
    assert otel_gpu.flush() is True
    spans = receiver.received.wait_for_spans(3, timeout=10)
    requests = receiver.received.requests()
    pipeline.reset(timeout=2.0)  # shut the exporter down while the receiver still runs
    return spans, requests


_GRPC_ENV = {
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "{endpoint}",
    "OTEL_EXPORTER_OTLP_INSECURE": "true",
}
_HTTP_ENV = {
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "{endpoint}",
}


@pytest.mark.parametrize(
    ("receiver_factory", "env"),
    [
        pytest.param(grpc_receiver, _GRPC_ENV, id="grpc"),
        pytest.param(http_receiver, _HTTP_ENV, id="http-protobuf"),
        pytest.param(
            http_receiver,
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "{endpoint}",
            },
            id="http-protobuf-generic-variable",
        ),
        pytest.param(
            grpc_receiver,
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "{endpoint}", "OTEL_EXPORTER_OTLP_INSECURE": "true"},
            id="grpc-by-default",
        ),
    ],
)
def test_otlp_destination_exports_over_the_wire(monkeypatch, receiver_factory, env):
    """``otlp`` sends spans with the official OTLP exporter over the protocol the standard
    ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` variables choose (gRPC by default) to the standard
    endpoint; ``flush()`` forces the batch out and the receiver gets names, parent links,
    attributes, status and otel-gpu's resource."""
    with receiver_factory() as rx:
        spans, requests = _otlp_round_trip(monkeypatch, rx, env)

    assert len(spans) == 3
    by_name = {span.name: (resource, span) for resource, span in spans}
    assert set(by_name) == {_span_name("outer"), _span_name("scale"), _span_name("boom")}
    _, outer = by_name[_span_name("outer")]
    _, scale = by_name[_span_name("scale")]
    _, boom = by_name[_span_name("boom")]
    assert outer.parent_span_id == b""
    assert scale.parent_span_id == outer.span_id and scale.trace_id == outer.trace_id

    a = attrs_of(outer.attributes)
    assert a["code.function.name"] == _span_name("outer")
    assert a["code.line.number"] == _def_line("# def-outer")
    assert a["otel_gpu.input.x.shape"] == [2, 3]
    assert a["otel_gpu.input.x.dtype"] == "torch.float32"
    assert a["otel_gpu.input.w.device"] == "cpu"
    assert a["otel_gpu.output.0.shape"] == [2, 3]
    s = attrs_of(scale.attributes)
    assert s["otel_gpu.input.factor.value"] == 2.0 and s["otel_gpu.input.factor.default"] is True
    assert not any(e.name == "otel_gpu.stats" for _, sp in spans for e in sp.events)  # level 3

    assert boom.status.code == StatusProto.STATUS_CODE_ERROR
    assert [e.name for e in boom.events] == ["exception"]

    for resource, _ in spans:
        r = attrs_of(resource.attributes)
        assert r["process.pid"] == os.getpid()
        assert isinstance(r["service.name"], str) and r["service.name"]
        assert isinstance(r["otel_gpu.gpu.count"], int)
    scopes = {
        ss.scope.name for req in requests for rs in req.resource_spans for ss in rs.scope_spans
    }
    assert scopes == {"otel_gpu"}


def test_otlp_unsupported_protocol_is_a_config_error_naming_the_variable(monkeypatch):
    """An ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` otel-gpu cannot honour (here ``http/json``) is a
    ``ConfigError`` (at the latest at the first decorated call) naming the variable, the value
    and the supported protocols, not a silent fallback."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    ran = []
    with pytest.raises(ConfigError) as info:
        otel_gpu.configure(level=1, dest="otlp", provider="own")
        otel_gpu.api(lambda: ran.append(1))()
    message = str(info.value)
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" in message
    assert "http/json" in message
    assert "grpc" in message and "http/protobuf" in message
    assert ran == []


def test_otlp_unsupported_protocol_is_rejected_at_configure(monkeypatch):
    """Like an unwritable path, an unsupported OTLP protocol for ``dest="otlp"`` fails at
    ``configure()``, not inside the application's calls."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        otel_gpu.configure(level=1, dest="otlp", provider="own")


def test_otlp_protocol_error_names_the_variable_that_was_set(monkeypatch):
    """When the unsupported protocol comes from the generic ``OTEL_EXPORTER_OTLP_PROTOCOL``, the
    error names that variable (the one the user set), not the traces-specific one."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ConfigError) as info:
        otel_gpu.configure(level=1, dest="otlp", provider="own")
        otel_gpu.api(lambda: None)()
    message = str(info.value)
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=" in message
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in message


# --------------------------------------------------------------------------- 3. several at once


def test_several_destinations_each_get_every_span(tmp_path, monkeypatch, capsys):
    """A comma-separated ``OTEL_GPU_LOGDEST`` (here from the environment) sends every span to each
    destination: stdout, a JSON Lines file and a text file."""
    jsonl, text = tmp_path / "a.jsonl", tmp_path / "b.log"
    monkeypatch.setenv("OTEL_GPU_LOGDEST", f"stdout, {jsonl} ,{text}")
    monkeypatch.setenv("OTEL_GPU_LOGLEVEL", "3")
    monkeypatch.setenv("OTEL_GPU_PROVIDER", "own")
    lib = _make_lib()
    lib["outer"](torch.ones(2), torch.ones(2))
    lib["scale"](5)
    with pytest.raises(ValueError):
        lib["boom"](2)
    assert otel_gpu.flush() is True

    names = [_span_name(n) for n in ("outer", "scale", "scale", "boom")]
    spans = _read_jsonl(jsonl)
    assert sorted(s.name for _, s, _ in spans) == sorted(names)
    out = capsys.readouterr().out
    log = text.read_text(encoding="utf-8")
    for rendered in (out, log):
        for local in ("outer", "boom"):
            assert rendered.count(f"◀ {_span_name(local)}") == 1
        assert rendered.count(f"◀ {_span_name('scale')}") == 2
        for _, _, ids in spans:
            assert f"span {ids['span']}" in rendered


# --------------------------------------------------------------------------- 4. text file


def test_text_file_gets_readable_blocks_with_inputs_flushed_before_the_call(tmp_path):
    """A path not ending in ``.jsonl`` gets the console's text without ANSI codes; at level 3 a
    call's header and inputs are in the file *before* its body runs (they survive a crash in
    the call), and the completion block (outputs, status, duration) follows after."""
    dest = tmp_path / "calls.log"
    otel_gpu.configure(level=3, dest=str(dest), provider="own")
    seen_inside: list[str] = []

    def kernel(q, n, causal=True):
        seen_inside.append(dest.read_text(encoding="utf-8"))
        return q + n

    def failing(q):
        seen_inside.append(dest.read_text(encoding="utf-8"))
        raise RuntimeError("device lost")

    name = f"{__name__}.{kernel.__qualname__}"
    kernel_api = otel_gpu.api(kernel)
    kernel_api(torch.zeros(2, 3), 4)

    inside = seen_inside[0]
    assert "otel-gpu · system information" in inside
    assert f"▶ {name}" in inside
    assert "q = Tensor[2, 3] float32 cpu" in inside
    assert "n = 4" in inside
    assert "causal = True (default)" in inside
    assert f"◀ {name}" not in inside
    assert "✔ OK" not in inside

    with pytest.raises(RuntimeError):
        otel_gpu.api(failing)(torch.ones(1))
    assert f"▶ {__name__}.{failing.__qualname__}" in seen_inside[1]
    assert otel_gpu.flush() is True

    text = dest.read_text(encoding="utf-8")
    assert ANSI not in text
    assert text.count("otel-gpu · system information") == 1
    assert text.index(f"▶ {name}") < text.index(f"◀ {name}")
    done = text[text.index(f"◀ {name}") :]
    assert "outputs:" in done and "0 = Tensor[2, 3] float32 cpu" in done
    assert "✔ OK" in done and " ms" in done
    assert "✘ ERROR RuntimeError: device lost" in text


def test_text_file_is_closed_when_destination_is_dropped(tmp_path):
    """When otel-gpu drops a text-file destination (reconfiguration, shutdown) it closes the file
    itself instead of leaking it to the garbage collector."""
    dest = tmp_path / "calls.log"
    otel_gpu.configure(level=1, dest=str(dest), provider="own")
    otel_gpu.api(lambda: None)()
    assert otel_gpu.flush() is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        pipeline.reset(timeout=2.0)
        gc.collect()
    leaks = [
        w for w in caught if issubclass(w.category, ResourceWarning) and str(dest) in str(w.message)
    ]
    assert leaks == []


# --------------------------------------------------------------------------- 6. providers


def _memory_provider(service: str) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_fixture_provider_gets_spans_and_logdest_gets_none(tmp_path, monkeypatch, otel_gpu_spans):
    """With the ``otel_gpu_spans`` fixture (an explicit ``tracer_provider``) spans go to that
    provider and nothing is written to ``OTEL_GPU_LOGDEST``, even with ``provider="own"``."""
    dest = tmp_path / "never.jsonl"
    monkeypatch.setenv("OTEL_GPU_LOGDEST", str(dest))
    captured = otel_gpu_spans(level=3, provider="own")
    lib = _make_lib()
    lib["outer"](torch.ones(2), torch.ones(2))
    spans = captured.get()
    assert sorted(s.name for s in spans) == sorted([_span_name("outer"), _span_name("scale")])
    outer = next(s for s in spans if s.name == _span_name("outer"))
    assert outer.attributes["otel_gpu.input.x.shape"] == (2,)
    assert not dest.exists()


def test_configure_tracer_provider_wins_over_provider_own(tmp_path):
    """``configure(tracer_provider=tp)`` names the target explicitly: it wins over
    ``provider="own"`` and over ``dest``; spans carry ``tp``'s resource."""
    dest = tmp_path / "never.jsonl"
    provider, exporter = _memory_provider("app-explicit")
    otel_gpu.configure(level=1, dest=str(dest), provider="own", tracer_provider=provider)
    _make_lib()["scale"](1)
    assert otel_gpu.flush() is True
    [span] = exporter.get_finished_spans()
    assert span.name == _span_name("scale")
    assert span.resource.attributes["service.name"] == "app-explicit"
    assert not dest.exists()


@pytest.fixture
def app_global_provider(monkeypatch):
    """Simulate an application that set a global SDK TracerProvider (the real global can be set
    only once per process, so ``trace.get_tracer_provider`` is patched for this test)."""
    provider, exporter = _memory_provider("app-global")
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    return exporter


@pytest.mark.parametrize("mode", ["auto", "global"])
def test_application_global_provider_is_used_by_auto_and_global(
    tmp_path, app_global_provider, mode
):
    """``OTEL_GPU_PROVIDER=auto`` (default) and ``global`` feed the application's global SDK
    TracerProvider, not ``OTEL_GPU_LOGDEST``."""
    dest = tmp_path / "never.jsonl"
    otel_gpu.configure(level=1, dest=str(dest), provider=mode)
    _make_lib()["scale"](1)
    assert otel_gpu.flush() is True
    [span] = app_global_provider.get_finished_spans()
    assert span.resource.attributes["service.name"] == "app-global"
    assert not dest.exists()


def test_provider_own_ignores_application_global_provider(tmp_path, app_global_provider):
    """``OTEL_GPU_PROVIDER=own`` sends to ``OTEL_GPU_LOGDEST`` even inside an application that set
    a global SDK TracerProvider, which gets nothing."""
    dest = tmp_path / "own.jsonl"
    otel_gpu.configure(level=1, dest=str(dest), provider="own")
    _make_lib()["scale"](1)
    assert otel_gpu.flush() is True
    [(resource, span, _)] = _read_jsonl(dest)
    assert span.name == _span_name("scale")
    assert attrs_of(resource.attributes)["service.name"] != "app-global"
    assert app_global_provider.get_finished_spans() == ()


def test_provider_global_without_sdk_provider_falls_back_to_logdest(tmp_path, monkeypatch, caplog):
    """``OTEL_GPU_PROVIDER=global`` when the application set no SDK provider falls back to
    otel-gpu's own provider with ``OTEL_GPU_LOGDEST``, with a warning saying so."""
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.NoOpTracerProvider())
    dest = tmp_path / "fallback.jsonl"
    otel_gpu.configure(level=1, dest=str(dest), provider="global")
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        _make_lib()["scale"](1)
        assert otel_gpu.flush() is True
    assert len(_read_jsonl(dest)) == 1
    assert any("OTEL_GPU_PROVIDER=global" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- 7. invalid destinations


def _assert_dest_error(error: BaseException, *fragments: str) -> None:
    message = str(error)
    assert "OTEL_GPU_LOGDEST" in message
    assert "Allowed:" in message and "stdout, stderr, otlp" in message and ".jsonl" in message
    for fragment in fragments:
        assert fragment in message, message


def test_missing_directory_is_rejected_at_configure(tmp_path):
    """A destination whose directory does not exist is a ``ConfigError`` at ``configure()``
    naming ``OTEL_GPU_LOGDEST``, the problem and the allowed values."""
    bad = tmp_path / "no" / "such" / "t.jsonl"
    with pytest.raises(ConfigError) as info:
        otel_gpu.configure(level=1, dest=str(bad))
    _assert_dest_error(info.value, "does not exist", str(bad))


def test_directory_as_destination_is_rejected_at_configure(tmp_path):
    """A destination that is an existing directory is a ``ConfigError`` at ``configure()``."""
    with pytest.raises(ConfigError) as info:
        otel_gpu.configure(level=1, dest=str(tmp_path))
    _assert_dest_error(info.value, "is a directory")


def test_one_bad_item_among_several_is_rejected(tmp_path):
    """In a comma-separated list, one bad item fails the whole setting and is named."""
    bad = tmp_path / "missing" / "b.log"
    with pytest.raises(ConfigError) as info:
        otel_gpu.configure(level=1, dest=f"stdout,{tmp_path / 'ok.jsonl'},{bad}")
    _assert_dest_error(info.value, str(bad))


def test_empty_destination_is_rejected():
    """A destination list with no items is a ``ConfigError``."""
    with pytest.raises(ConfigError) as info:
        otel_gpu.configure(level=1, dest=" , ")
    _assert_dest_error(info.value)


def test_bad_destination_from_environment_fails_at_configuration(tmp_path, monkeypatch):
    """A bad ``OTEL_GPU_LOGDEST`` in the environment fails when settings are loaded (decoration
    time), not on a later call; the message says it came from the environment."""
    monkeypatch.setenv("OTEL_GPU_LOGLEVEL", "1")
    monkeypatch.setenv("OTEL_GPU_LOGDEST", str(tmp_path / "nope" / "x.log"))
    with pytest.raises(ConfigError) as info:
        otel_gpu.api(lambda: None)
    _assert_dest_error(info.value, "environment", "does not exist")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory an unprivileged user can traverse (pytest's tmp_path may be private to root)."""
    path = Path(tempfile.mkdtemp(prefix="otel-gpu-dest-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _configure_unprivileged(dest: str) -> str | None:
    """``configure(dest=...)`` as a user without write access; the ConfigError text or None.

    As root (who may write anything) the check runs in a forked child that drops to ``nobody``.
    """
    if os.geteuid() != 0:
        try:
            otel_gpu.configure(level=1, dest=dest)
        except ConfigError as exc:
            return str(exc)
        return None
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 0
        try:
            os.close(read_fd)
            os.setgid(65534)
            os.setuid(65534)
            try:
                otel_gpu.configure(level=1, dest=dest)
                message = ""
            except ConfigError as exc:
                message = str(exc)
            os.write(write_fd, ("E" + message).encode("utf-8"))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe_in:
        data = pipe_in.read().decode("utf-8")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data.startswith("E"), "child failed"
    return data[1:] or None


def test_unwritable_file_is_rejected_at_configure(shared_dir):
    """An existing file the process may not write is a ``ConfigError`` at ``configure()``."""
    target = shared_dir / "ro.jsonl"
    target.write_text("")
    target.chmod(0o444)
    message = _configure_unprivileged(str(target))
    assert message is not None, "configure() accepted an unwritable file"
    assert "OTEL_GPU_LOGDEST" in message and "not writable" in message and "Allowed:" in message


def test_unwritable_directory_is_rejected_at_configure(shared_dir):
    """A new file in a directory the process may not write is a ``ConfigError`` at ``configure()``."""
    locked = shared_dir / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    message = _configure_unprivileged(str(locked / "t.log"))
    assert message is not None, "configure() accepted an unwritable directory"
    assert "OTEL_GPU_LOGDEST" in message and "not writable" in message and "Allowed:" in message
