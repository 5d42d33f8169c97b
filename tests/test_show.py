"""Behaviour of ``otel-gpu show``: trace files as a terminal tree, and the first NaN/Inf producer.

Most fixtures are recorded by running decorated functions through otel-gpu into an OTLP JSON
Lines file; collector-style input (base64 ids, ``instrumentationLibrarySpans``, gzip) is
written by hand, as other producers write it.
"""

from __future__ import annotations

import base64
import enum
import gzip
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from commands import python_command

import otel_gpu
from otel_gpu.cli import main
from otel_gpu.traces.show import show

ANSI = "\x1b["


# --------------------------------------------------------------------------- helpers


def _record_nan_nest(path: Path, level: int = 5, dtype: torch.dtype = torch.float32) -> None:
    """model › layer › (shift, log_of): shift makes a negative value, log_of turns it into NaN,
    and layer and model then carry the NaN. A second trace holds a call that raised."""
    otel_gpu.configure(level=level, dest=str(path), provider="own")

    @otel_gpu.api(name="log_of")
    def log_of(x):
        return torch.log(x)

    @otel_gpu.api(name="shift")
    def shift(x, by=1.0):
        return x - by

    @otel_gpu.api(name="layer")
    def layer(x):
        return log_of(shift(x)) * 2.0

    @otel_gpu.api(name="model")
    def model(x):
        return layer(x) + 1.0, "tag"

    @otel_gpu.api(name="boom")
    def boom(n):
        raise ValueError(f"boom {n}")

    model(torch.tensor([0.5, 2.0, 3.0], dtype=dtype))
    with pytest.raises(ValueError, match="boom 3"):
        boom(3)
    assert otel_gpu.flush() is True


def _ids(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The raw spans of an otel-gpu JSONL file by name."""
    found: dict[str, list[dict[str, Any]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    found.setdefault(span["name"], []).append(span)
    return found


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["show", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _hex_span(name: str, span_id: str, parent: str = "", **extra: Any) -> dict[str, Any]:
    span = {
        "traceId": "5b8efff798038103d269b633813fc60c",
        "spanId": span_id,
        "parentSpanId": parent,
        "name": name,
        "kind": 1,
        "startTimeUnixNano": str(1_000_000 + int(span_id[-4:], 16)),
        "endTimeUnixNano": "3000000",
        "status": {},
    }
    span.update(extra)
    return span


def _write_lines(path: Path, *spans: dict[str, Any]) -> Path:
    payload = {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": list(spans)}]}]}
    path.write_text(json.dumps(payload) + "\n", encoding="utf-8")
    return path


def _stat(tensor: str, nan: int | None = 0, inf: int | None = 0, note: str = "") -> dict[str, Any]:
    attrs: list[dict[str, Any]] = [{"key": "otel_gpu.tensor", "value": {"stringValue": tensor}}]
    for key, value in (("nan_count", nan), ("inf_count", inf)):
        if value is not None:
            attrs.append({"key": key, "value": {"intValue": str(value)}})
    if note:
        attrs.append({"key": "otel_gpu.stats.note", "value": {"stringValue": note}})
    return {"name": "otel_gpu.stats", "timeUnixNano": "3000000", "attributes": attrs}


# --------------------------------------------------------------------------- the tree


def test_tree_shows_nesting_durations_status_inputs_outputs_and_nan(tmp_path, capsys):
    """Each trace is a tree in start order; a line carries name, duration, ERROR with its
    description, compact tensor shapes/dtypes and scalars, and the tensors holding NaN/Inf."""
    path = tmp_path / "t.jsonl"
    _record_nan_nest(path)
    rc, out, err = _run(capsys, str(path))
    assert rc == 0, err
    assert ANSI not in out  # captured stdout is not a terminal: plain text
    lines = out.splitlines()
    assert lines[0].startswith("trace ") and "4 spans" in lines[0]
    names = [line.split("─ ", 1)[1].split("  ")[0] for line in lines if "─ " in line]
    assert names == ["model", "layer", "shift", "log_of", "boom"]
    model = next(line for line in lines if "─ model" in line)
    assert "x=f32[3] → (f32[3], 'tag')" in model
    assert "NaN/Inf: output.0 (1 NaN)" in model
    assert any(line.startswith("   └─ layer") for line in lines)
    assert any(line.startswith("      ├─ shift") and "by=1.0" in line for line in lines)
    log_of = next(line for line in lines if "─ log_of" in line)
    assert log_of.startswith("      └─ log_of") and "NaN/Inf: output.0 (1 NaN)" in log_of
    shift = next(line for line in lines if "─ shift" in line)
    assert "NaN/Inf" not in shift
    boom = next(line for line in lines if "─ boom" in line)
    assert "ERROR ValueError: boom 3" in boom and "n=3" in boom
    for line in (model, shift, boom):
        assert any(unit in line for unit in (" ns", " µs", " ms", " s"))


def test_compact_values_containers_enums_strings_and_named_outputs(tmp_path, capsys):
    """Arguments read as ``name=value``: containers as type(length), enum members and None
    unquoted, strings quoted; a returned dict shows its keys, a returned tuple its values."""
    path = tmp_path / "t.jsonl"
    otel_gpu.configure(level=3, dest=str(path), provider="own")

    class Mode(enum.Enum):
        SUM = 1

    @otel_gpu.api(name="mix")
    def mix(xs, mode=Mode.SUM, tag="hello", extra=None):
        return {"out": xs[0], "n": len(xs)}

    mix([torch.ones(2, dtype=torch.int64), torch.zeros(3)])
    assert otel_gpu.flush() is True
    rc, out, _ = _run(capsys, str(path))
    assert rc == 0
    assert "xs=list(2) mode=Mode.SUM tag='hello' extra=None → out=i64[2] n=2" in out


def test_dump_dir_is_shown_on_the_tree_and_in_the_report(tmp_path, capsys):
    """At level 10 each line names its dump directory, and --nonfinite gives the producer's."""
    path = tmp_path / "t.jsonl"
    otel_gpu.configure(level=10, dest=str(path), provider="own", dump_dir=str(tmp_path / "d"))

    @otel_gpu.api(name="bad_sqrt")
    def bad_sqrt(x):
        return torch.sqrt(x - 10.0)

    bad_sqrt(torch.ones(4))
    assert otel_gpu.flush() is True
    (span,) = _ids(path)["bad_sqrt"]
    dump = next(
        a["value"]["stringValue"] for a in span["attributes"] if a["key"] == "otel_gpu.dump.dir"
    )
    rc, out, _ = _run(capsys, str(path))
    assert rc == 0 and f"dump {dump}" in out
    rc, out, _ = _run(capsys, str(path), "--nonfinite")
    assert rc == 0 and f"dump dir: {dump}" in out and "output.0 (4 NaN)" in out


def test_name_filter_keeps_matches_and_their_ancestors(tmp_path, capsys):
    """--name GLOB keeps the matching spans plus their ancestors, drops the rest and other
    traces; no match at all is exit 1 with a message."""
    path = tmp_path / "t.jsonl"
    _record_nan_nest(path)
    rc, out, _ = _run(capsys, str(path), "--name", "log_*")
    assert rc == 0
    names = [line.split("─ ", 1)[1].split("  ")[0] for line in out.splitlines() if "─ " in line]
    assert names == ["model", "layer", "log_of"]
    assert out.count("trace ") == 1
    rc, out, err = _run(capsys, str(path), "--name", "nothing*")
    assert rc == 1 and out == "" and "no span name matches nothing*" in err


def test_trace_id_filter_is_case_insensitive_and_validated(tmp_path, capsys):
    """--trace-id keeps one trace whatever the case of its hex; an id that is not 32 hex
    digits is a usage error naming what is allowed."""
    path = tmp_path / "t.jsonl"
    _record_nan_nest(path)
    (boom,) = _ids(path)["boom"]
    rc, out, _ = _run(capsys, str(path), "--trace-id", boom["traceId"].upper())
    assert rc == 0
    assert f"trace {boom['traceId']}" in out and "boom" in out and "model" not in out
    rc, _, err = _run(capsys, str(path), "--trace-id", "f" * 32)
    assert rc == 1 and f"no trace {'f' * 32}" in err
    with pytest.raises(SystemExit) as exc:
        main(["show", str(path), "--trace-id", "xyz"])
    assert exc.value.code == 2 and "32 hex digits" in capsys.readouterr().err


def test_limit_caps_the_tree_and_says_how_many_were_left_out(tmp_path, capsys):
    """--limit N renders N spans and says how many more there are; --limit 0 renders all."""
    path = tmp_path / "t.jsonl"
    otel_gpu.configure(level=1, dest=str(path), provider="own")

    @otel_gpu.api(name="tick")
    def tick(i):
        return i

    for i in range(10):
        tick(i)
    assert otel_gpu.flush() is True
    rc, out, _ = _run(capsys, str(path), "--limit", "3")
    assert rc == 0 and out.count("─ tick") == 3
    assert "7 more spans not shown (--limit 3; --limit 0 shows all)" in out
    rc, out, _ = _run(capsys, str(path), "--limit", "0")
    assert out.count("─ tick") == 10 and "not shown" not in out


def test_orphans_cycles_and_traces_split_over_files(tmp_path, capsys):
    """A span whose parent is not in the files is a root marked as such; a parent link that
    would close a cycle is cut and marked; a trace split over two files is one tree."""
    a = _write_lines(tmp_path / "a.jsonl", _hex_span("root", "00000000000000a1"))
    b = _write_lines(
        tmp_path / "b.jsonl",
        _hex_span("child", "00000000000000b2", parent="00000000000000a1"),
        _hex_span("orphan", "00000000000000c3", parent="00000000000000ff"),
        _hex_span("loop1", "00000000000000d4", parent="00000000000000d5"),
        _hex_span("loop2", "00000000000000d5", parent="00000000000000d4"),
    )
    rc, out, _ = _run(capsys, str(a), str(b))
    assert rc == 0
    lines = out.splitlines()
    root = next(i for i, line in enumerate(lines) if line.startswith("├─ root"))
    assert lines[root + 1].startswith("│  └─ child")
    assert any(
        "orphan" in line and "[root: parent 00000000000000ff not in the input]" in line
        for line in lines
    )
    assert sum("would close a cycle" in line for line in lines) == 1
    assert sum(1 for line in lines if "loop" in line) == 2


# --------------------------------------------------------------------------- --nonfinite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_names_the_inner_call_not_the_callers_that_carry_nan(tmp_path, capsys, dtype):
    """The first producer is the innermost call whose finite inputs became NaN outputs
    (log_of), not layer/model that only carry it: path, span id and trace id are given."""
    path = tmp_path / "t.jsonl"
    _record_nan_nest(path, dtype=dtype)
    (log_of,) = _ids(path)["log_of"]
    rc, out, _ = _run(capsys, str(path), "--nonfinite")
    assert rc == 0
    assert "First producer of NaN/Inf: log_of" in out
    assert "path:     model › layer › log_of" in out
    assert f"span id:  {log_of['spanId']}" in out
    assert f"trace id: {log_of['traceId']}" in out
    assert "no NaN/Inf in input.x" in out
    assert "Other producers" not in out
    assert "5 spans in 2 traces checked, 4 with statistics." in out  # boom: no tensors


def test_nonfinite_path_indexes_same_named_siblings_and_lists_other_producers(tmp_path, capsys):
    """Siblings sharing a name get an index in the path (step[1]); later producers, in this
    trace or others, are listed briefly."""
    path = tmp_path / "t.jsonl"
    otel_gpu.configure(level=5, dest=str(path), provider="own")

    @otel_gpu.api(name="step")
    def step(x):
        return torch.log(x)

    @otel_gpu.api(name="run")
    def run(x):
        return step(x) + step(x - 5.0)

    @otel_gpu.api(name="divide")
    def divide(x):
        return x / 0.0

    run(torch.tensor([2.0, 3.0]))
    divide(torch.ones(3))
    assert otel_gpu.flush() is True
    rc, out, _ = _run(capsys, str(path), "--nonfinite")
    assert rc == 0
    assert "First producer of NaN/Inf: step" in out and "path:     run › step[1]" in out
    other = out.split("Other producers (1):", 1)[1]
    assert "divide" in other and "output.0 (3 Inf)" in other
    rc, out, _ = _run(capsys, str(path), "--nonfinite", "--name", "div*")
    assert rc == 0 and "First producer of NaN/Inf: divide" in out
    rc, out, _ = _run(capsys, str(path), "--nonfinite", "--name", "run")
    assert rc == 1 and "No producer of NaN/Inf found named run: 4 spans in 2 traces checked" in out


def test_nonfinite_without_statistics_says_level_5_is_needed(tmp_path, capsys):
    """At level 3 there are no statistics: exit 1, saying how many spans were checked, that
    none had statistics and that level 5 records them."""
    path = tmp_path / "t.jsonl"
    _record_nan_nest(path, level=3)
    rc, out, _ = _run(capsys, str(path), "--nonfinite")
    assert rc == 1
    assert "No producer of NaN/Inf found: 5 spans in 2 traces checked, 0 with statistics." in out
    assert "level 5" in out and "OTEL_GPU_LOGLEVEL=5" in out


def test_nonfinite_that_arrived_in_the_inputs_has_no_producer(tmp_path, capsys):
    """NaN already in the inputs of the first traced call is not blamed on it: exit 1, and the
    call where it was first seen is named."""
    path = tmp_path / "t.jsonl"
    otel_gpu.configure(level=5, dest=str(path), provider="own")

    @otel_gpu.api(name="consume")
    def consume(x):
        return x * 2

    consume(torch.tensor([1.0, math.nan]))
    assert otel_gpu.flush() is True
    rc, out, _ = _run(capsys, str(path), "--nonfinite")
    assert rc == 1
    assert "No producer of NaN/Inf found" in out
    assert "already in the inputs of consume: input.x (1 NaN)" in out


def test_nonfinite_flag_without_statistics_is_reported_as_unknown(tmp_path, capsys):
    """A span flagged otel_gpu.nonfinite whose statistics do not name a tensor cannot be
    judged: it is not reported as a producer, and the report says nothing can be said."""
    flag = [{"key": "otel_gpu.nonfinite", "value": {"boolValue": True}}]
    path = _write_lines(
        tmp_path / "t.jsonl", _hex_span("mystery", "00000000000000a1", attributes=flag)
    )
    rc, out, _ = _run(capsys, str(path), "--nonfinite")
    assert rc == 1
    assert "1 span flagged otel_gpu.nonfinite without statistics naming the tensor" in out
    assert "mystery (span 00000000000000a1)" in out


def test_nonfinite_producer_with_unobserved_children_is_reported_with_a_caveat(tmp_path, capsys):
    """A producer whose children have no statistics is reported, with the caveat that one of
    them may be where the values began; inputs whose statistics were skipped are named."""
    stats = [
        _stat("input.a"),
        _stat(
            "input.b",
            None,
            None,
            note="statistics skipped: CUDA graph capture in progress",
        ),
        _stat("output.0", 2, 0),
    ]
    path = _write_lines(
        tmp_path / "t.jsonl",
        _hex_span("parent", "00000000000000a1", events=stats),
        _hex_span("blind", "00000000000000b2", parent="00000000000000a1"),
    )
    rc, out, _ = _run(capsys, str(path), "--nonfinite")
    assert rc == 0 and "First producer of NaN/Inf: parent" in out
    assert "not checked (no NaN/Inf counts): input.b (statistics skipped" in out
    assert "1 call below it without statistics: the NaN/Inf may have begun in one of them." in out
    assert "2 spans in 1 trace checked, 1 with statistics." in out


# --------------------------------------------------------------------------- other producers' files


def _collector_line() -> str:
    """One line as a collector or protobuf-JSON producer may write it: base64 ids, the older
    instrumentationLibrarySpans, ints as numbers, NaN/Infinity as strings, enum status names."""

    def b64(hexid: str) -> str:
        return base64.b64encode(bytes.fromhex(hexid)).decode("ascii")

    trace = b64("0af7651916cd43dd8448eb211c80319c")
    kernel_attrs = [
        {
            "key": "otel_gpu.input.q.shape",
            "value": {"arrayValue": {"values": [{"intValue": 2}, {"intValue": "4"}]}},
        },
        {"key": "otel_gpu.input.q.dtype", "value": {"stringValue": "torch.bfloat16"}},
        {"key": "otel_gpu.input.scale.value", "value": {"doubleValue": "NaN"}},
        {"key": "otel_gpu.output.0.shape", "value": {"arrayValue": {"values": [{"intValue": 2}]}}},
        {"key": "otel_gpu.output.0.dtype", "value": {"stringValue": "torch.float32"}},
    ]
    events = [
        _stat("input.q"),
        {
            "name": "otel_gpu.stats",
            "timeUnixNano": 2500,
            "attributes": [
                {"key": "otel_gpu.tensor", "value": {"stringValue": "output.0"}},
                {"key": "inf_count", "value": {"intValue": 2}},
                {"key": "nan_count", "value": {"intValue": 0}},
                {"key": "min", "value": {"doubleValue": "-Infinity"}},
            ],
        },
    ]
    spans = [
        {
            "traceId": trace,
            "spanId": b64("b7ad6b7169203331"),
            "parentSpanId": "",
            "name": "request",
            "kind": "SPAN_KIND_SERVER",
            "startTimeUnixNano": 1000,
            "endTimeUnixNano": 5_001_000,
        },
        {
            "traceId": trace,
            "spanId": b64("00f067aa0ba902b7"),
            "parentSpanId": b64("b7ad6b7169203331"),
            "name": "kernel",
            "startTimeUnixNano": "2000",
            "endTimeUnixNano": "3000",
            "attributes": kernel_attrs,
            "events": events,
            "status": {"code": "STATUS_CODE_ERROR", "message": "kernel failed"},
        },
    ]
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": "collector-app"}}]}
    payload = {
        "resourceSpans": [
            {
                "resource": resource,
                "instrumentationLibrarySpans": [
                    {"instrumentationLibrary": {"name": "lib"}, "spans": spans}
                ],
            }
        ]
    }
    return json.dumps(payload)


def test_collector_style_gzip_file_with_base64_ids(tmp_path, capsys):
    """A gzip file of collector-style lines is read: base64 ids become the usual hex, the
    child hangs under its parent, string NaN/Infinity and numeric ints parse, ERROR shows."""
    path = tmp_path / "collector.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as stream:
        stream.write(_collector_line() + "\n")
        stream.write(json.dumps({"resourceMetrics": []}) + "\n")  # another signal: skipped
    rc, out, err = _run(capsys, str(path))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "trace 0af7651916cd43dd8448eb211c80319c  2 spans  service collector-app"
    assert lines[1] == "└─ request  5 ms"
    assert lines[2].startswith(
        "   └─ kernel  1 µs  ERROR kernel failed  q=bf16[2,4] scale=nan → f32[2]"
    )
    assert lines[2].endswith("NaN/Inf: output.0 (2 Inf)")
    rc, out, _ = _run(
        capsys, str(path), "--nonfinite", "--trace-id", "0AF7651916CD43DD8448EB211C80319C"
    )
    assert rc == 0
    assert "path:     request › kernel" in out and "span id:  00f067aa0ba902b7" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"resourceSpans": []}\n{not json\n', "bad.jsonl:2: not JSON"),
        ('{"resourceLogs": 1}\n\n[1, 2]\n', "bad.jsonl:3: expected a JSON object"),
        ('{"foo": 1}\n', "bad.jsonl:1: not OTLP trace data (no resourceSpans)"),
        (
            json.dumps(
                {
                    "resourceSpans": [
                        {
                            "scopeSpans": [
                                {
                                    "spans": [
                                        {"traceId": "zz", "spanId": "00000000000000a1", "name": "f"}
                                    ]
                                }
                            ]
                        }
                    ]
                }
            ),
            "bad.jsonl:1: span 'f': traceId 'zz' is neither 32 hex digits nor base64 of 16 bytes",
        ),
    ],
)
def test_invalid_lines_are_usage_errors_naming_file_and_line(tmp_path, capsys, content, message):
    """An unreadable line stops the command with exit 2 and a message naming file, line and
    what is wrong; nothing is rendered."""
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    rc, out, err = _run(capsys, str(path))
    assert rc == 2 and out == ""
    assert f"otel-gpu show: {path.parent}/{message}" in err


def test_missing_file_and_bad_limit_are_usage_errors(tmp_path, capsys):
    """A missing file is exit 2 naming it; a negative --limit is rejected by the parser."""
    rc, out, err = _run(capsys, str(tmp_path / "nope.jsonl"))
    assert rc == 2 and out == "" and f"{tmp_path / 'nope.jsonl'}: no such file" in err
    with pytest.raises(SystemExit) as exc:
        main(["show", str(tmp_path / "nope.jsonl"), "--limit", "-1"])
    assert exc.value.code == 2 and "--limit" in capsys.readouterr().err


# --------------------------------------------------------------------------- colour


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_on_a_terminal_only_and_never_with_no_color(tmp_path, capsys, monkeypatch):
    """On a terminal the tree is coloured (ERROR in red); --no-color and NO_COLOR give plain
    text, as does a pipe (see the subprocess test)."""
    path = tmp_path / "t.jsonl"
    _record_nan_nest(path)
    monkeypatch.delenv("NO_COLOR", raising=False)
    for argv, env, coloured in (([], None, True), (["--no-color"], None, False), ([], "1", False)):
        if env:
            monkeypatch.setenv("NO_COLOR", env)
        tty = _Tty()
        monkeypatch.setattr(sys, "stdout", tty)
        assert main(["show", str(path), *argv]) == 0
        text = tty.getvalue()
        assert (ANSI in text) is coloured, (argv, env)
        assert "ERROR" in text
    monkeypatch.delenv("NO_COLOR")
    buffer = io.StringIO()
    show([str(path)], color=True, out=buffer)
    assert "\x1b[1;31m  ERROR" in buffer.getvalue()


def test_piped_output_has_no_escape_codes(tmp_path):
    """Run as a command with stdout piped, the output is plain text."""
    path = tmp_path / "t.jsonl"
    _record_nan_nest(path)
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    done = python_command(["-m", "otel_gpu", "show", str(path)], env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "─ log_of" in done.stdout and ANSI not in done.stdout


def test_the_depth_check_pairs_escapes_as_json_does() -> None:
    """``too_deep`` (escapes paired by splitting at backslashes) decides as the plain reference
    does (``\\\\`` pairs removed from the left, then ``\\"``) on 20,000 random lines of brackets,
    quotes and backslashes around depths 0-140, and the 64-level bound holds exactly."""
    import random

    from otel_gpu import _text
    from otel_gpu.traces import reader

    def reference(raw: bytes) -> bool:
        shape = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
        shape = shape.translate(_text._BRACKETS, _text._NOT_BRACKETS).replace(b'""', b"")
        if b'"' in shape:
            shape = b"".join(shape.split(b'"')[::2])
        for _ in range(reader.MAX_DEPTH):
            inner = shape.replace(b"[]", b"")
            if not shape or len(inner) == len(shape):
                return False
            shape = inner
        return b"[]" in shape

    rnd = random.Random(7)
    alphabet = b'[]{}"\\nbtu, '
    deep = 0
    for _ in range(20_000):
        middle = bytes(rnd.choice(alphabet) for _ in range(rnd.randint(0, 40)))
        line = b"[" * rnd.randint(0, 70) + middle + b"]" * rnd.randint(0, 70)
        assert reader.too_deep(line) == reference(line), line
        deep += reference(line)
    assert 0 < deep < 20_000  # both answers were exercised
    assert not reader.too_deep(b'["\\\\"' + b"[" * 63 + b"]" * 63 + b"]")
    assert reader.too_deep(b'["\\\\\\""' + b"[" * 64 + b"]" * 64 + b"]")


def test_the_tree_reads_attributes_of_the_spans_it_draws_only(tmp_path: Path) -> None:
    """Read without attributes, every span is pending; ``fill`` gives the drawn ones the same
    attributes and statistics an eager read gives, and leaves the others pending."""
    from otel_gpu.traces import reader

    shape = {"arrayValue": {"values": [{"intValue": "2"}, {"intValue": "3"}]}}
    spans = [
        _hex_span(
            f"op{i}",
            f"{i + 1:016x}",
            attributes=[
                {"key": "otel_gpu.input.x.shape", "value": shape},
                {"key": "otel_gpu.input.x.dtype", "value": {"stringValue": "torch.float32"}},
            ],
            events=[_stat("output.0", nan=i)],
        )
        for i in range(6)
    ]
    path = _write_lines(tmp_path / "t.jsonl", *spans)
    eager = {s.span_id: s for s in reader.read_all([str(path)])}
    lazy = reader.read_all([str(path)], attributes=False)
    assert all(s.pending and s.attrs == {} and s.stats == [] for s in lazy)
    drawn = [s for s in lazy if s.name in ("op1", "op4")]
    reader.fill(drawn)
    for span in lazy:
        if span in drawn:
            assert not span.pending
            assert (span.attrs, span.stats) == (
                eager[span.span_id].attrs,
                eager[span.span_id].stats,
            )
            assert span.attrs["otel_gpu.input.x.shape"] == [2, 3]
        else:
            assert span.pending and span.attrs == {}
    assert sum(s.pending for s in lazy) == 4


# --------------------------------------------------------------------------- not a trace file

_PYTHON = "import torch\n\n\ndef f(x):\n    return x + 1\n" + "".join(
    f"y{i} = {i}\n" for i in range(14)
)


@pytest.mark.parametrize(
    ("name", "content", "kind"),
    [
        ("mylib.py", _PYTHON.encode(), "looks like Python source"),
        (
            "run.log",
            "═" * 40 + "\notel-gpu · system information\n  service: x\n"
            "lib.f  2026-01-01 00:00:00.000  span 8bb034832ba1b41d\n  ✔ OK  0.001 ms\n",
            "is a text log (as OTEL_GPU_LOGDEST=FILE.log writes it)",
        ),
        ("empty.jsonl", b"", "is empty"),
        ("core.bin", bytes(range(256)) * 8, "is binary data"),
        ("notes.txt", b"some notes\nmore notes\n", "is text, not JSON"),
    ],
)
def test_a_file_with_no_otlp_line_is_named_for_what_it_is_in_one_line(
    tmp_path, capsys, name, content, kind
):
    """``show mylib.py`` used to print one "not JSON" line per line of the file and never say
    that show reads OTLP JSON Lines. Now the first line names the file, what it looks like and
    what show expected; at most 3 per-line problems follow, then a count."""
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    rc, out, err = _run(capsys, str(path))
    lines = err.splitlines()
    assert lines[0] == (
        f"otel-gpu show: {path} {kind}, not the OTLP JSON Lines that show reads "
        "(as OTEL_GPU_LOGDEST=FILE.jsonl writes them)"
    )
    per_line = [ln for ln in lines if ln.startswith(f"otel-gpu show: {path}:")]
    assert len(per_line) <= 3
    assert len(lines) <= 6 and out == ""
    assert rc == (1 if kind == "is empty" else 2)


def test_a_trace_file_beside_a_foreign_one_keeps_its_own_problems_listed(tmp_path, capsys):
    """Only files with no OTLP line get the one-line description: a trace file with one bad
    line is reported as before (its line, no description)."""
    good = _write_lines(tmp_path / "t.jsonl", _hex_span("f", "00000000000000a1"))
    with good.open("a") as f:
        f.write("{not json\n")
    rc, _, err = _run(capsys, str(good))
    assert rc == 2
    assert "not the OTLP JSON Lines" not in err
    assert f"{good}:2: not JSON" in err
