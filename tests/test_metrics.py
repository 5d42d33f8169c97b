"""Call metrics (``OTEL_GPU_METRICS=true``): what reaches a file and an OTLP receiver, read back
with the official protobuf parser, and checked against the spans of the same calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from opentelemetry.proto.metrics.v1.metrics_pb2 import MetricsData

import otel_gpu
from otel_gpu import ConfigError
from otel_gpu.export import pipeline
from otel_gpu.metrics import names, provider, summary

try:
    from jsonl_spans import read_spans
    from otlp_receiver import attrs_of, grpc_receiver, hex_ids_to_base64, http_receiver
except ModuleNotFoundError:  # tests/ imported as a package
    from tests.jsonl_spans import read_spans
    from tests.otlp_receiver import attrs_of, grpc_receiver, hex_ids_to_base64, http_receiver

LIB = """
import otel_gpu, torch

@otel_gpu.api
def scale(x, factor=2.0):
    return x * factor

@otel_gpu.api
def boom(x):
    raise KeyError("no such kernel")

@otel_gpu.api
def fail(x):
    raise ValueError("bad shape")
"""


def _read(path: Path) -> list[MetricsData]:
    """Every line of an OTLP JSON Lines metrics file, parsed by the official proto parser."""
    out = []
    for line in path.read_text().splitlines():
        data = MetricsData()
        json_format.ParseDict(hex_ids_to_base64(json.loads(line), strict=True), data)
        out.append(data)
    return out


def _latest(datas: list[Any]) -> dict[str, Any]:
    """The last collection of each metric (cumulative: the last one holds every call)."""
    latest: dict[str, Any] = {}
    for data in datas:
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                assert sm.scope.name == names.METER
                for metric in sm.metrics:
                    latest[metric.name] = metric
    return latest


def _points(metric: Any) -> dict[tuple[tuple[str, Any], ...], Any]:
    field = metric.WhichOneof("data")
    return {
        tuple(sorted(attrs_of(p.attributes).items())): p for p in getattr(metric, field).data_points
    }


def _run(module_factory: Any, tmp_path: Path, level: int = 5, **settings: Any) -> Any:
    otel_gpu.configure(level=level, dest=str(tmp_path / "spans.jsonl"), metrics=True, **settings)
    lib = module_factory(LIB)
    import torch

    for _ in range(40):
        lib.scale(torch.ones(4))
    lib.scale(torch.tensor([1.0, float("nan")]))
    lib.scale(torch.tensor([float("inf")]))
    errors = []
    for fn, n in ((lib.boom, 3), (lib.fail, 2)):
        for _ in range(n):
            try:
                fn(1)
            except Exception as exc:
                errors.append(exc)
    assert otel_gpu.flush(timeout=10)
    return lib, errors


def test_file_destination_metrics_match_the_spans(module_factory, tmp_path):
    """A ``.jsonl`` destination gets ``<name>.metrics.jsonl`` beside it, in OTLP JSON that the
    official parser reads: the histogram counts each function's calls (the spans in the trace
    file), failed calls carry ``error.type``, the counters agree, NaN/Inf calls are counted at
    level 5, and every exemplar names a span of the trace file with its trace id."""
    lib, errors = _run(module_factory, tmp_path)
    assert [type(e) for e in errors] == [KeyError] * 3 + [ValueError] * 2
    spans = read_spans(tmp_path / "spans.jsonl", plain=True)
    metrics = _latest(_read(tmp_path / "spans.metrics.jsonl"))
    scale = f"{lib.__name__}.scale"
    boom = f"{lib.__name__}.boom"
    fail = f"{lib.__name__}.fail"

    per_function: dict[str, int] = {}
    for span in spans:
        name = span["attrs"]["code.function.name"]
        per_function[name] = per_function.get(name, 0) + 1
    assert per_function == {scale: 42, boom: 3, fail: 2}

    duration = metrics["otel_gpu.call.duration"]
    assert duration.unit == "s"
    points = _points(duration)
    assert {k: p.count for k, p in points.items()} == {
        (("code.function.name", scale),): 42,
        (("code.function.name", boom), ("error.type", "KeyError")): 3,
        (("code.function.name", fail), ("error.type", "ValueError")): 2,
    }
    for point in points.values():
        assert list(point.explicit_bounds) == list(names.DURATION_BUCKETS)
        assert sum(point.bucket_counts) == point.count
        assert 0 < point.min <= point.max
    durations = sorted(
        (int(s["endTimeUnixNano"]) - int(s["startTimeUnixNano"])) / 1e9
        for s in spans
        if s["attrs"]["code.function.name"] == scale
    )
    assert points[(("code.function.name", scale),)].max == pytest.approx(durations[-1])

    calls = {k: p.as_int for k, p in _points(metrics["otel_gpu.calls"]).items()}
    assert calls == {
        (("code.function.name", scale),): 42,
        (("code.function.name", boom),): 3,
        (("code.function.name", fail),): 2,
    }
    errs = {k: p.as_int for k, p in _points(metrics["otel_gpu.call.errors"]).items()}
    assert errs == {
        (("code.function.name", boom), ("error.type", "KeyError")): 3,
        (("code.function.name", fail), ("error.type", "ValueError")): 2,
    }
    nonfinite = {k: p.as_int for k, p in _points(metrics["otel_gpu.call.nonfinite"]).items()}
    assert nonfinite[(("code.function.name", scale),)] == 2
    assert sum(1 for s in spans if s["attrs"].get("otel_gpu.nonfinite")) == 2

    ids = {(s["traceId"], s["spanId"]) for s in spans}
    exemplars = [e for p in points.values() for e in p.exemplars]
    assert exemplars, "the trace-based exemplar filter keeps sampled calls"
    for exemplar in exemplars:
        assert (exemplar.trace_id.hex(), exemplar.span_id.hex()) in ids
    # an exemplar of a failed call names a failed span
    failed = points[(("code.function.name", boom), ("error.type", "KeyError"))].exemplars
    boom_ids = {s["spanId"] for s in spans if s["attrs"]["code.function.name"] == boom}
    assert failed and all(e.span_id.hex() in boom_ids for e in failed)


def test_level_below_5_claims_no_nan_count(module_factory, tmp_path):
    """Below level 5 NaN/Inf is not checked, so no ``otel_gpu.call.nonfinite`` point exists (a
    zero would claim it was checked); the other call metrics are there."""
    _run(module_factory, tmp_path, level=1)
    metrics = _latest(_read(tmp_path / "spans.metrics.jsonl"))
    assert "otel_gpu.call.nonfinite" not in metrics
    assert sum(p.count for p in _points(metrics["otel_gpu.call.duration"]).values()) == 47


def test_own_metrics_count_spans_and_drops(module_factory, tmp_path):
    """``otel.sdk.processor.span.processed`` counts the spans handed over and, with
    ``OTEL_GPU_QUEUE_FULL=drop``, the dropped ones under ``error.type=queue_full``; the queue's
    capacity is ``OTEL_GPU_QUEUE_SIZE``."""
    otel_gpu.configure(
        level=1, dest=str(tmp_path / "s.jsonl"), metrics=True, queue_size=4, queue_full="drop"
    )
    lib = module_factory(LIB)
    pipe = pipeline.get()
    assert pipe is not None
    with pipe._drain_lock:  # hold the export: the queue fills and the rest is dropped
        for _ in range(10):
            lib.scale(1.0)
    assert otel_gpu.flush(timeout=10)
    metrics = _latest(_read(tmp_path / "s.metrics.jsonl"))
    processed = {
        dict(k).get("error.type"): p.as_int
        for k, p in _points(metrics["otel.sdk.processor.span.processed"]).items()
    }
    assert processed == {None: 4, "queue_full": 6, "export_stalled": 0}
    [capacity] = _points(metrics["otel.sdk.processor.span.queue.capacity"]).values()
    assert capacity.as_int == 4
    spans = read_spans(tmp_path / "s.jsonl")
    assert len(spans) == 4
    # the call metrics hold the calls whose span was built, as documented
    assert sum(p.count for p in _points(metrics["otel_gpu.call.duration"]).values()) == 4


def test_recorder_bytes_written_counts_the_dump_files(module_factory, tmp_path):
    """``otel_gpu.recorder.written`` grows by the bytes of the files a level-10 call wrote."""
    dumps = tmp_path / "dumps"
    otel_gpu.configure(level=10, dest=str(tmp_path / "s.jsonl"), metrics=True, dump_dir=str(dumps))
    lib = module_factory(LIB)
    import torch

    before = otel_gpu._files.bytes_written()
    lib.scale(torch.ones(64))
    assert otel_gpu.flush(timeout=10)
    on_disk = sum(p.stat().st_size for p in dumps.rglob("*") if p.is_file())
    assert on_disk > 0
    [point] = _points(
        _latest(_read(tmp_path / "s.metrics.jsonl"))["otel_gpu.recorder.written"]
    ).values()
    # the manifest is written twice a call (before and after): every write counts
    assert point.as_int - before >= on_disk


@pytest.mark.parametrize(
    ("receiver_factory", "protocol"),
    [
        pytest.param(grpc_receiver, "grpc", id="grpc"),
        pytest.param(http_receiver, "http/protobuf", id="http"),
    ],
)
def test_otlp_destination_sends_metrics(module_factory, monkeypatch, receiver_factory, protocol):
    """``otlp`` sends the metrics with the official OTLP metric exporter over the protocol the
    standard variables choose, to the same endpoint as the spans."""
    with receiver_factory() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        otel_gpu.configure(level=1, dest="otlp", metrics=True)
        lib = module_factory(LIB)
        for _ in range(5):
            lib.scale(1.0)
        assert otel_gpu.flush(timeout=10)
        spans = rx.received.wait_for_spans(5)
        requests = rx.received.metrics()
    assert requests, "a flush exports a collection"
    counts = {}
    for request in requests:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == "otel_gpu.call.duration":
                        for p in metric.histogram.data_points:
                            counts[attrs_of(p.attributes)["code.function.name"]] = p.count
                            span_ids = {s.span_id for _, s in spans}
                            assert all(e.span_id in span_ids for e in p.exemplars)
    assert counts == {f"{lib.__name__}.scale": 5}


def test_a_traces_only_endpoint_gets_one_line_naming_how_to_turn_metrics_off(
    module_factory, monkeypatch, caplog
):
    """Metrics on by default, spans and metrics to an OTLP/gRPC endpoint that takes traces
    only (its metrics service answers UNIMPLEMENTED): the spans arrive, and one warning says
    the endpoint took the spans but not the metrics, naming OTEL_METRICS_EXPORTER=none."""
    import logging

    from otel_gpu import _guard

    _guard._seen.discard("metrics.refused")
    with grpc_receiver(traces_only=True) as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        otel_gpu.configure(level=1, dest="otlp", provider="own", strict=False)
        lib = module_factory(LIB)
        with caplog.at_level(logging.WARNING, logger="otel_gpu"):
            for _ in range(3):
                lib.scale(1.0)
                otel_gpu.flush(timeout=10)  # spans confirmed, then a collection refused
        assert len(rx.received.wait_for_spans(3)) == 3
        assert rx.received.metrics() == []
    advice = [
        r.getMessage() for r in caplog.records if "OTEL_METRICS_EXPORTER=none" in r.getMessage()
    ]
    assert len(advice) == 1
    assert "took otel-gpu's spans but not its metrics" in advice[0]


def test_bad_metrics_protocol_is_a_config_error(monkeypatch):
    """An unsupported ``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL`` names the variable and what is
    allowed."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/json")
    with pytest.raises(
        ConfigError, match=r"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL.*grpc, http/protobuf"
    ):
        provider.metrics_protocol()


def test_user_exceptions_pass_through_unchanged(tmp_path):
    """With metrics on, a failing call raises the very same exception object."""
    otel_gpu.configure(level=3, dest=str(tmp_path / "s.jsonl"), metrics=True)
    mine = ValueError("mine")

    @otel_gpu.api
    def raiser():
        raise mine

    with pytest.raises(ValueError) as caught:
        raiser()
    assert caught.value is mine


def test_metrics_path_is_beside_the_span_file():
    """``<name>.jsonl`` → ``<name>.metrics.jsonl``, in the same directory."""
    assert provider.metrics_path("/d/spans-%i.jsonl") == "/d/spans-%i.metrics.jsonl"


def test_bucket_quantile_reports_the_bucket_upper_bound():
    """The console's percentiles are bucket bounds, and the overflow bucket is infinity."""
    bounds = (1.0, 2.0, 5.0)
    assert summary.bucket_quantile(0.5, bounds, (0, 0, 0, 0)) is None
    assert summary.bucket_quantile(0.5, bounds, (1, 8, 1, 0)) == 2.0
    assert summary.bucket_quantile(0.99, bounds, (1, 8, 1, 0)) == 5.0
    assert summary.bucket_quantile(0.99, bounds, (0, 0, 0, 3)) == float("inf")


def _script(tmp_path: Path, body: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(body))
    full = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, str(script)], env=full, capture_output=True, text=True, timeout=120
    )


def test_console_prints_a_table_at_exit(tmp_path):
    """A console destination has no metrics backend: a table per function is printed at exit,
    with calls, errors and NaN/Inf counts and bucket-bounded percentiles."""
    done = _script(
        tmp_path,
        """
        import otel_gpu, torch

        @otel_gpu.api
        def scale(x):
            return x * 2

        @otel_gpu.api
        def boom():
            raise RuntimeError("x")

        for _ in range(7):
            scale(torch.ones(2))
        scale(torch.tensor([float("nan")]))
        try:
            boom()
        except RuntimeError:
            pass
        """,
        {"OTEL_GPU_LOGLEVEL": "5", "OTEL_GPU_METRICS": "true", "OTEL_GPU_LOGDEST": "stderr"},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("otel-gpu metrics: 9 calls"))
    table = {line.split()[0]: line.split()[1:4] for line in lines[start + 2 : start + 4]}
    assert table == {"__main__.boom": ["1", "1", "0"], "__main__.scale": ["8", "0", "1"]}


def test_metrics_off_creates_nothing(tmp_path):
    """With ``OTEL_GPU_METRICS=false``, no metrics module is imported, no instrument exists and
    no metrics file is written, even beside a ``.jsonl`` destination."""
    done = _script(
        tmp_path,
        """
        import sys, otel_gpu

        @otel_gpu.api
        def f(x):
            return x

        for _ in range(5):
            f(1)
        otel_gpu.flush()
        from otel_gpu.export import pipeline
        assert pipeline.get().metrics is None
        print(sorted(m for m in sys.modules if m.startswith("otel_gpu.metrics")))
        """,
        {
            "OTEL_GPU_LOGLEVEL": "1",
            "OTEL_GPU_METRICS": "false",
            "OTEL_GPU_LOGDEST": str(tmp_path / "s.jsonl"),
        },
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prog.py", "s.jsonl"]


def test_application_meter_provider_is_used(tmp_path):
    """An application that set an SDK ``MeterProvider`` (and ``TracerProvider``) gets the call
    metrics on its own readers; otel-gpu writes no metrics of its own."""
    done = _script(
        tmp_path,
        """
        import otel_gpu
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider

        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        trace.set_tracer_provider(TracerProvider())

        @otel_gpu.api
        def f(x):
            return x

        for _ in range(6):
            f(1)
        otel_gpu.flush()
        data = reader.get_metrics_data()
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == "otel_gpu.call.duration":
                        print(sm.scope.name, [p.count for p in m.data.data_points])
        """,
        {
            "OTEL_GPU_LOGLEVEL": "1",
            "OTEL_GPU_METRICS": "true",
            "OTEL_GPU_LOGDEST": str(tmp_path / "s.jsonl"),
        },
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "otel_gpu [6]"
    assert not (tmp_path / "s.metrics.jsonl").exists()


def test_forked_child_does_not_export_the_parents_measurements(tmp_path):
    """A forked child inherits the parent's readers, whose threads the SDK restarts in the
    child: they stop at once there, so the child never exports the parent's measurements again
    (it builds its own pipeline and metrics at its first call)."""
    done = _script(
        tmp_path,
        f"""
        import os, threading, time, otel_gpu

        @otel_gpu.api
        def f(x):
            return x

        for _ in range(3):
            f(1)
        otel_gpu.flush()
        pid = os.fork()
        if pid == 0:
            time.sleep(0.5)
            names = [t.name for t in threading.enumerate()]
            with open({str(tmp_path / "child.txt")!r}, "w") as out:
                out.write(repr(names))
            os._exit(0)
        os.waitpid(pid, 0)
        print([t.name for t in threading.enumerate()].count("OtelPeriodicExportingMetricReader"))
        """,
        {
            "OTEL_GPU_LOGLEVEL": "1",
            "OTEL_GPU_METRICS": "true",
            "OTEL_GPU_METRICS_INTERVAL": "0.1",
            "OTEL_GPU_LOGDEST": str(tmp_path / "s.jsonl"),
        },
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"  # the parent's reader runs
    child = (tmp_path / "child.txt").read_text()
    assert "OtelPeriodicExportingMetricReader" not in child


def test_calls_inside_a_compiled_graph_are_counted(module_factory, tmp_path):
    """A decorated call inside a ``torch.compile(fullgraph=True)`` graph becomes a span at
    runtime, and so a point of the call metrics: counts equal the compiled spans."""
    import torch

    otel_gpu.configure(level=1, dest=str(tmp_path / "s.jsonl"), metrics=True)
    lib = module_factory(LIB)
    compiled = torch.compile(lambda x: lib.scale(x) + 1, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        compiled(torch.ones(3))
    assert otel_gpu.flush(timeout=10)
    spans = read_spans(tmp_path / "s.jsonl", plain=True)
    assert sum(1 for s in spans if s["attrs"].get("otel_gpu.compiled")) == 3
    [point] = _points(
        _latest(_read(tmp_path / "s.metrics.jsonl"))["otel_gpu.call.duration"]
    ).values()
    assert point.count == 3


def test_journal_bytes_written_is_the_journals_count(module_factory, tmp_path):
    """``otel_gpu.journal.written`` is the crash journal's own count of the bytes it stored (it
    grows with calls); with the journal off there is no point at all, not a zero."""
    otel_gpu.configure(level=3, dest=str(tmp_path / "s.jsonl"), metrics=True)
    lib = module_factory(LIB)
    import torch

    for _ in range(5):
        lib.scale(torch.ones(4))
    assert otel_gpu.flush(timeout=10)
    pipe = pipeline.get()
    assert pipe is not None
    [journal] = [o for o in pipe.observers if type(o).__name__ == "Journal"]
    [point] = _points(
        _latest(_read(tmp_path / "s.metrics.jsonl"))["otel_gpu.journal.written"]
    ).values()
    assert point.as_int == journal.bytes_written > 5 * 64

    otel_gpu.configure(level=3, dest=str(tmp_path / "t.jsonl"), metrics=True, journal=False)
    lib = module_factory(LIB)
    lib.scale(torch.ones(4))
    assert otel_gpu.flush(timeout=10)
    assert "otel_gpu.journal.written" not in _latest(_read(tmp_path / "t.metrics.jsonl"))


def test_calls_the_head_sampler_drops_are_still_counted(module_factory, tmp_path, monkeypatch):
    """With head sampling (``OTEL_TRACES_SAMPLER=traceidratio``) only some calls become spans,
    but the call metrics count every call: the histogram's count is all of them, failed
    unsampled calls carry ``error.type``, and exemplars name only spans that exist. The user's
    exception passes through an unsampled call unchanged."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    otel_gpu.configure(level=1, dest=str(tmp_path / "s.jsonl"), metrics=True)
    lib = module_factory(LIB)
    for _ in range(200):
        lib.scale(1.0)
    raised = []
    for _ in range(40):
        try:
            lib.fail(1)
        except ValueError as exc:
            raised.append(exc)
    assert len({id(e) for e in raised}) == 40
    assert otel_gpu.flush(timeout=10)
    spans = read_spans(tmp_path / "s.jsonl")
    assert 0 < len(spans) < 240  # the sampler kept some, not all
    points = _points(_latest(_read(tmp_path / "s.metrics.jsonl"))["otel_gpu.call.duration"])
    scale = (("code.function.name", f"{lib.__name__}.scale"),)
    fail = (("code.function.name", f"{lib.__name__}.fail"), ("error.type", "ValueError"))
    assert {k: p.count for k, p in points.items()} == {scale: 200, fail: 40}
    ids = {s["spanId"] for s in spans}
    assert all(e.span_id.hex() in ids for p in points.values() for e in p.exemplars)


def test_metrics_are_on_by_default_beside_a_jsonl_destination(module_factory, tmp_path):
    """Without ``OTEL_GPU_METRICS`` (``auto``), otel-gpu's own provider writes the metrics
    beside a ``.jsonl`` destination, aggregated by otel-gpu, not by SDK instruments."""
    from otel_gpu.metrics.aggregation import CallAggregation

    assert otel_gpu.config.load(env={}).metrics == "auto"
    otel_gpu.configure(level=1, dest=str(tmp_path / "s.jsonl"))
    lib = module_factory(LIB)
    for _ in range(3):
        lib.scale(1.0)
    assert otel_gpu.flush(timeout=10)
    pipe = pipeline.get()
    assert pipe is not None and isinstance(pipe.metrics.calls, CallAggregation)
    [point] = _points(
        _latest(_read(tmp_path / "s.metrics.jsonl"))["otel_gpu.call.duration"]
    ).values()
    assert point.count == 3


def test_default_builds_no_metrics_for_a_console_destination(module_factory, tmp_path):
    """``auto`` on a console or text destination builds no metrics (no table at exit, no
    reader thread); ``OTEL_GPU_METRICS=true`` asks for the table."""
    otel_gpu.configure(level=1, dest=str(tmp_path / "spans.txt"))
    lib = module_factory(LIB)
    lib.scale(1.0)
    assert otel_gpu.flush(timeout=10)
    pipe = pipeline.get()
    assert pipe is not None and pipe.metrics is None

    otel_gpu.configure(level=1, dest=str(tmp_path / "spans.txt"), metrics=True)
    lib = module_factory(LIB)
    lib.scale(1.0)
    assert otel_gpu.flush(timeout=10)
    pipe = pipeline.get()
    assert pipe is not None and pipe.metrics is not None and pipe.metrics.summary is not None


def test_default_leaves_the_applications_meter_provider_alone(tmp_path):
    """``auto`` with the spans on the application's providers records nothing there: SDK
    instruments would cost 10-13 µs a call; ``OTEL_GPU_METRICS=true`` asks for them."""
    done = _script(
        tmp_path,
        """
        import otel_gpu
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider

        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        trace.set_tracer_provider(TracerProvider())

        @otel_gpu.api
        def f(x):
            return x

        f(1)
        otel_gpu.flush()
        from otel_gpu.export import pipeline
        print(pipeline.get().metrics, reader.get_metrics_data())
        """,
        {"OTEL_GPU_LOGLEVEL": "1", "OTEL_GPU_LOGDEST": str(tmp_path / "s.jsonl")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None None"
    assert not (tmp_path / "s.metrics.jsonl").exists()


def test_default_honours_otel_metrics_exporter_none(module_factory, tmp_path, monkeypatch):
    """``OTEL_METRICS_EXPORTER=none``, the standard "no metrics" (a traces-only backend), turns
    the default off; ``OTEL_GPU_METRICS=true`` still asks for them."""
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    otel_gpu.configure(level=1, dest=str(tmp_path / "s.jsonl"))
    lib = module_factory(LIB)
    lib.scale(1.0)
    assert otel_gpu.flush(timeout=10)
    assert pipeline.get().metrics is None  # type: ignore[union-attr]
    assert not (tmp_path / "s.metrics.jsonl").exists()

    otel_gpu.configure(level=1, dest=str(tmp_path / "t.jsonl"), metrics=True)
    lib = module_factory(LIB)
    lib.scale(1.0)
    assert otel_gpu.flush(timeout=10)
    assert (tmp_path / "t.metrics.jsonl").exists()
