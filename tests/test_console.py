"""Behaviour of the console renderer: ``OTEL_GPU_LOGDEST=stdout``/``stderr`` and the
``ConsoleSpanExporter`` used on its own through the OpenTelemetry SDK.

Functions are decorated after ``configure()`` (the level is fixed at decoration).
"""

from __future__ import annotations

import io
import re
import sys
from importlib.metadata import entry_points

import pytest
import torch
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otel_gpu.exporters.console import ConsoleSpanExporter

import otel_gpu

ANSI = "\x1b["
RED = "\x1b[1;31m"
RESET = "\x1b[0m"
HEADER = "otel-gpu · system information"
SPAN_LINE = re.compile(r"span ([0-9a-f]{16})")


class TtyStream(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _lib() -> dict:
    """Functions decorated with the settings in force now."""

    def attention(q, n, scale=0.5, mode="fast"):
        return q * scale

    def poison(x):
        y = x.clone()
        y[1] = float("nan")
        return y

    def broken(n):
        raise ValueError(f"broken {n}")

    def login(user, api_token):
        return user

    return {
        name: otel_gpu.api(fn)
        for name, fn in [
            ("attention", attention),
            ("poison", poison),
            ("broken", broken),
            ("login", login),
        ]
    }


def _name(local: str) -> str:
    return f"{__name__}._lib.<locals>.{local}"


def _run_calls(level: int, **settings) -> None:
    otel_gpu.configure(level=level, dest=settings.pop("dest", "stdout"), provider="own", **settings)
    lib = _lib()
    lib["attention"](torch.ones(2, 3), 4)
    lib["poison"](torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(ValueError):
        lib["broken"](9)
    assert otel_gpu.flush() is True


# --------------------------------------------------------------------------- blocks


def test_level3_stdout_prints_header_once_then_a_block_per_call(capsys):
    """On stdout at level 3: one system-information header, then per call a pre-call block
    (name, span id, inputs with tensor shape/dtype/device, scalars, defaults marked) and a
    completion block (outputs, duration, OK or ERROR with the exception)."""
    _run_calls(3)
    out = capsys.readouterr().out

    assert out.count(HEADER) == 1
    assert out.index(HEADER) == out.index("otel-gpu")  # header comes first
    assert f"torch {torch.__version__}" in out
    assert "service: " in out
    assert ANSI not in out  # captured stdout is not a terminal

    start = out.index(f"▶ {_name('attention')}")
    block = out[start : out.index("\n▶", start + 1)]
    assert "  inputs:" in block
    assert "    q = Tensor[2, 3] float32 cpu stride=(3, 1)" in block
    assert "    n = 4" in block
    assert "    scale = 0.5 (default)" in block
    assert "    mode = 'fast' (default)" in block

    done = out[out.index(f"◀ {_name('attention')}") :]
    done = done[: done.index("✔ OK")]
    assert "  outputs:" in done and "0 = Tensor[2, 3] float32 cpu" in done
    assert "inputs:" not in done  # already printed before the call
    assert re.search(
        re.escape(f"◀ {_name('attention')}") + r".*\n(?:.*\n)*?  ✔ OK  \d+\.\d{3} ms", out
    )

    assert re.search(r"  ✘ ERROR ValueError: broken 9  \d+\.\d{3} ms", out)
    assert out.count("✔ OK") == 2 and out.count("✘ ERROR") == 1
    # every call's pre-call and completion blocks name the same span id
    ids = SPAN_LINE.findall(out)
    assert len(ids) == 6 and len(set(ids)) == 3


def test_level5_stats_and_nonfinite_warning(capsys):
    """At level 5 each call lists min/max/mean/std, NaN/Inf counts and numel per tensor, and a
    call with non-finite values gets a warning line."""
    _run_calls(5, color="never")
    out = capsys.readouterr().out
    attention = out[out.index(f"◀ {_name('attention')}") :]
    attention = attention[: attention.index("✔ OK")]
    assert "  stats:" in attention
    assert "    input.q: min=1 max=1 mean=1 std=0 nan=0 inf=0 numel=6" in attention
    assert "    output.0: min=0.5 max=0.5 mean=0.5 std=0 nan=0 inf=0 numel=6" in attention
    assert "NaN/Inf" not in attention

    poison = out[out.index(f"◀ {_name('poison')}") :]
    poison = poison[: poison.index("✔ OK")]
    assert re.search(
        r"    output\.0: min=1 max=4 mean=2\.66667 std=1\.52753 nan=1 inf=0 numel=4", poison
    )
    assert "⚠ NaN/Inf found in this call's tensors" in poison


def test_forced_colour_highlights_nan_in_red(capsys):
    """With ``color="always"`` (even on a non-terminal) NaN counts and the non-finite warning are
    red; zero counts are not."""
    _run_calls(5, color="always")
    out = capsys.readouterr().out
    assert f"{RED}nan=1{RESET}" in out
    assert f"{RED}⚠ NaN/Inf found in this call's tensors{RESET}" in out
    assert f"{RED}nan=0" not in out and f"{RED}inf=0" not in out
    assert f"{RED}✘ ERROR{RESET}" in out


def test_colour_never_prints_no_escape_codes(capsys):
    """With ``color="never"`` nothing, NaN included, carries ANSI escape codes."""
    _run_calls(5, color="never")
    out = capsys.readouterr().out
    assert "nan=1" in out
    assert ANSI not in out


@pytest.mark.parametrize(("no_color", "expect_ansi"), [(None, True), ("1", False)])
def test_auto_colour_follows_terminal_and_no_color(monkeypatch, no_color, expect_ansi):
    """``color="auto"`` colours a terminal stdout, unless ``NO_COLOR`` is set."""
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    tty = TtyStream()
    monkeypatch.setattr(sys, "stdout", tty)
    _run_calls(5, color="auto")
    out = tty.getvalue()
    assert "nan=1" in out
    assert (ANSI in out) is expect_ansi
    assert (f"{RED}nan=1{RESET}" in out) is expect_ansi


def test_level1_prints_only_a_completion_line_per_call(capsys):
    """At level 1 each call prints its name line and its status line, and nothing about
    inputs, outputs or statistics, and nothing before the call."""
    _run_calls(1)
    out = capsys.readouterr().out
    assert out.count(HEADER) == 1
    for word in ("inputs:", "outputs:", "stats:", "▶", "◀", "Tensor["):
        assert word not in out
    for local in ("attention", "poison", "broken"):
        assert re.search(
            re.escape(_name(local)) + r"  \d{4}-\d\d-\d\d [\d:.]+  span [0-9a-f]{16}\n", out
        )
    assert out.count("✔ OK") == 2
    assert "✘ ERROR ValueError: broken 9" in out
    body = out[out.index(_name("attention")) - 79 :]  # from the rule line before the first call
    assert len([line for line in body.splitlines() if line and not line.startswith("─")]) == 6


def test_stderr_destination_writes_to_stderr_only(capsys):
    """``OTEL_GPU_LOGDEST=stderr`` renders to stderr and leaves stdout alone."""
    _run_calls(3, dest="stderr")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert HEADER in captured.err and f"◀ {_name('attention')}" in captured.err


def test_redacted_argument_is_never_printed(capsys):
    """A string argument whose parameter name looks secret is printed as ``<redacted>``."""
    otel_gpu.configure(level=3, dest="stdout", provider="own")
    _lib()["login"]("alice", "s3cr3t-value")
    assert otel_gpu.flush() is True
    out = capsys.readouterr().out
    assert "user = 'alice'" in out
    assert "api_token = <redacted>" in out
    assert "s3cr3t-value" not in out


# --------------------------------------------------------------------------- standalone exporter


def _sdk_spans(stream: io.StringIO, **exporter_kwargs) -> ConsoleSpanExporter:
    provider = TracerProvider(resource=Resource.create({"service.name": "svc-standalone"}))
    exporter = ConsoleSpanExporter(stream, **exporter_kwargs)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tests.console")
    with tracer.start_as_current_span("parent"):
        with tracer.start_as_current_span(
            "child",
            attributes={
                "otel_gpu.input.q.shape": [2, 3],
                "otel_gpu.input.q.dtype": "torch.float16",
                "otel_gpu.input.q.device": "cuda:0",
                "otel_gpu.input.q.is_contiguous": False,
                "otel_gpu.input.scale.value": 0.5,
                "otel_gpu.input.scale.default": True,
                "otel_gpu.output.0.value": 7,
                "otel_gpu.nonfinite": True,
            },
        ) as child:
            child.add_event(
                "otel_gpu.stats",
                {
                    "otel_gpu.tensor": "input.q",
                    "numel": 6,
                    "nan_count": 2,
                    "inf_count": 0,
                    "min": -1.0,
                    "max": 1.0,
                    "mean": 0.0,
                    "std": 0.5,
                },
            )
        with pytest.raises(KeyError):
            with tracer.start_as_current_span("fails"):
                raise KeyError("k")
    provider.shutdown()
    return exporter


def test_console_exporter_standalone_renders_sdk_spans():
    """Used as an ordinary SDK span exporter, the renderer prints the header once (with the
    provider's ``service.name``) and a full block per span: name, span and parent ids, inputs
    and outputs from otel-gpu's attribute keys, stats, non-finite warning and status."""
    stream = io.StringIO()
    _sdk_spans(stream, color="never")
    out = stream.getvalue()
    assert out.count(HEADER) == 1 and out.index(HEADER) < out.index("child")
    assert "  service: svc-standalone" in out
    assert ANSI not in out

    child = out[out.index("child  ") : out.index("fails  ")]
    ids = SPAN_LINE.findall(child)
    parent_ids = re.findall(r"parent ([0-9a-f]{16})", child)
    assert len(ids) == 1 and len(parent_ids) == 1
    parent_line = out[out.index("parent  ") :].splitlines()[0]
    assert SPAN_LINE.findall(parent_line) == parent_ids  # the child names its parent's span id
    assert not re.search(r"parent [0-9a-f]{16}", parent_line)  # the root names no parent
    assert "    q = Tensor[2, 3] float16 cuda:0 non-contiguous" in child
    assert "    scale = 0.5 (default)" in child
    assert "  outputs:\n    0 = 7" in child
    assert "    input.q: min=-1 max=1 mean=0 std=0.5 nan=2 inf=0 numel=6" in child
    assert "⚠ NaN/Inf found in this call's tensors" in child
    assert "✔ OK" in child

    fails = out[out.index("fails  ") : out.index("parent  ")]
    assert "✘ ERROR KeyError: 'k'" in fails
    assert out.count("✔ OK") == 2


def test_console_exporter_colour_on_a_terminal_stream(monkeypatch):
    """The standalone exporter in ``auto`` mode colours a terminal stream, and not when
    ``NO_COLOR`` is set."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    coloured = TtyStream()
    _sdk_spans(coloured)
    assert f"{RED}nan=2{RESET}" in coloured.getvalue()

    monkeypatch.setenv("NO_COLOR", "1")
    plain = TtyStream()
    _sdk_spans(plain)
    assert ANSI not in plain.getvalue()


def test_console_exporter_shutdown_keeps_the_stream_open():
    """After ``shutdown()`` the exporter refuses further spans but does not close a stream it
    was given (it may be the application's stdout)."""
    stream = io.StringIO()
    exporter = ConsoleSpanExporter(stream, color="never")
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("t").start_as_current_span("s"):
        pass
    [span] = memory.get_finished_spans()
    assert exporter.export([span]) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert not stream.closed
    assert exporter.export([span]) is SpanExportResult.FAILURE
    assert stream.getvalue().count("✔ OK") == 1


def test_console_exporter_entry_point_is_registered():
    """``otel_gpu_console`` is registered in the ``opentelemetry_traces_exporter`` group and
    loads the ``ConsoleSpanExporter`` class."""
    found = entry_points(group="opentelemetry_traces_exporter", name="otel_gpu_console")
    assert len(found) == 1
    assert next(iter(found)).load() is ConsoleSpanExporter


def test_otel_traces_exporter_variable_resolves_the_console_exporter(monkeypatch, capsys):
    """``OTEL_TRACES_EXPORTER=otel_gpu_console`` resolves, through the SDK's own exporter loading,
    to ``ConsoleSpanExporter``, which then prints to stdout when built with no arguments."""
    from opentelemetry.sdk._configuration import _get_exporter_names, _import_exporters

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otel_gpu_console")
    names = _get_exporter_names("traces")
    assert names == ["otel_gpu_console"]
    traces, _, _ = _import_exporters(names, [], [])
    assert traces == {"otel_gpu_console": ConsoleSpanExporter}

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(traces["otel_gpu_console"]()))
    with provider.get_tracer("t").start_as_current_span("from-env"):
        pass
    provider.shutdown()
    out = capsys.readouterr().out
    assert HEADER in out and "from-env  " in out and "✔ OK" in out
