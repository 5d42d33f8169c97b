"""``otel-gpu show``, ``ship`` and ``recover``, and the console exporter, on hostile input.

Trace files and journals travel (attached to a bug report, carried off a GPU node), and span
names, attribute values and exception messages come from user code. Each test names the attack:
terminal escapes, a torn or truncated file, nesting bombs, over-long lines, garbage. The
promise is the same for all: no raw control character reaches the output, every problem is
one line naming the file (and line), there is no traceback, and the rest is still read.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from commands import otel_gpu_command, without_otel
from crafted_journals import dead_pid, pack_header
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, Status, StatusCode
from otel_gpu.exporters.console import ConsoleSpanExporter
from recording_exporter import RecordingExporter

from otel_gpu import config
from otel_gpu.cli import main
from otel_gpu.journal import layout, recover, writer
from otel_gpu.traces import reader, ship
from otel_gpu.traces.show import show

# --------------------------------------------------------------------------- payloads

ESCAPES = {
    "OSC 0 window title": "\x1b]0;owned\x07",
    "clear screen": "\x1b[2J\x1b[H",
    "OSC 8 hyperlink": "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\",
    "one-byte C1 CSI": "\x9b2J",
    "bidi right-to-left override": "\u202eevil",
}
EVIL = "".join(ESCAPES.values())
# What the reader sees instead: the escapes spelled out.
VISIBLE = ("\\x1b]0;owned\\x07", "\\x1b[2J", "\\x1b]8;;https://evil.example/", "\\x9b2J", "\\u202e")
_RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_OUR_SGR = re.compile("\x1b\\[[0-9;]*m")  # the colours otel-gpu itself writes on a terminal

TRACE = "0af7651916cd43dd8448eb211c80319c"


def raw_controls(text: str, *, colour: bool = False) -> list[str]:
    """Control characters (except newline) left in ``text``; our own colour codes removed."""
    if colour:
        text = _OUR_SGR.sub("", text)
    return _RAW.findall(text.replace("\t", "\\t"))


def _kv(key: str, value: Any) -> dict[str, Any]:
    kind = "stringValue" if isinstance(value, str) else "intValue"
    return {"key": key, "value": {kind: value if isinstance(value, str) else str(value)}}


def otlp_line(name: str = "f", text: str = "x", span_id: int = 1, **extra: Any) -> str:
    """One otel-gpu style line whose span carries ``text`` in every printed place."""
    span = {
        "traceId": TRACE,
        "spanId": f"{span_id:016x}",
        "name": name,
        "startTimeUnixNano": "1000",
        "endTimeUnixNano": "2000",
        "attributes": [
            _kv(f"otel_gpu.input.{text}.dtype", text),
            _kv(f"otel_gpu.input.{text}.shape", text),
            _kv("otel_gpu.input.s.value", text),
            _kv("otel_gpu.input.o.type", text),
            _kv("otel_gpu.output.0.dtype", "torch.float32"),
            _kv("otel_gpu.dump.dir", text),
        ],
        "events": [
            {
                "name": "otel_gpu.stats",
                "timeUnixNano": "1500",
                "attributes": [
                    _kv("otel_gpu.tensor", f"output.{text}"),
                    _kv("nan_count", 3),
                    _kv("numel", 4),
                ],
            },
            {"name": text, "timeUnixNano": "1500", "attributes": []},
        ],
        "status": {"code": 2, "message": f"ValueError: {text}"},
        **extra,
    }
    payload = {
        "resourceSpans": [
            {
                "resource": {"attributes": [_kv("service.name", text)]},
                "scopeSpans": [{"scope": {"name": "otel_gpu"}, "spans": [span]}],
            }
        ]
    }
    return json.dumps(payload)


def _show(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["show", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# --------------------------------------------------------------------------- escapes


@pytest.mark.parametrize("nonfinite", [False, True], ids=["tree", "nonfinite"])
@pytest.mark.parametrize("colour", [False, True], ids=["pipe", "terminal"])
def test_show_escapes_control_sequences_from_every_field(
    tmp_path: Path, nonfinite: bool, colour: bool
) -> None:
    """Attack: OSC title, screen clear, OSC 8 hyperlink, C1 CSI and a bidi override in the span
    name, attribute keys and values, event names, the exception message and the resource's
    service name. ``show`` prints none of them raw, to a pipe or a terminal, and spells each
    out so the reader sees it."""
    path = tmp_path / "evil.jsonl"
    path.write_text(otlp_line(name=f"f{EVIL}", text=EVIL) + "\n")
    out, err = io.StringIO(), io.StringIO()
    rc = show([str(path)], nonfinite=nonfinite, color=colour, limit=0, out=out, err=err)
    assert rc == 0, err.getvalue()
    text = out.getvalue()
    assert raw_controls(text, colour=colour) == []
    assert raw_controls(err.getvalue()) == []
    for visible in VISIBLE:
        assert visible in text, (visible, text)


def _command(*args: str, text: bool = True, **env: str) -> subprocess.CompletedProcess[Any]:
    """``otel-gpu ARGS`` as a real command, without the caller's OTEL_* variables, plus ``env``."""
    return otel_gpu_command(list(args), without_otel(**env), text=text)


def test_show_as_a_command_to_a_pipe_writes_no_control_byte(tmp_path: Path) -> None:
    """Attack: escapes in a trace file, shown by the real command with stdout piped (as into
    ``less -R`` or a log): the bytes on stdout and stderr hold no control character."""
    path = tmp_path / "evil.jsonl"
    path.write_text(otlp_line(name=EVIL, text=EVIL) + "\n" + "{torn" + EVIL)
    done = _command("show", str(path), text=False)
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 1, stderr  # the torn last line was skipped
    assert raw_controls(stdout) == [] and raw_controls(stderr) == []
    assert "\\x1b]0;owned\\x07" in stdout and "Traceback" not in stderr


def test_a_file_name_with_escapes_is_escaped_in_messages(tmp_path: Path) -> None:
    """Attack: a trace file whose *name* holds an OSC title sequence (a directory listing
    passed as arguments): ``show``'s and ``ship``'s messages name it escaped."""
    path = tmp_path / f"t{ESCAPES['OSC 0 window title']}.jsonl"
    path.write_text("{not json\n")
    err = io.StringIO()
    assert show([str(path)], out=io.StringIO(), err=err) == 2
    out = io.StringIO()
    result = ship.ship([str(path)], exporter_factory=RecordingExporter, out=out)
    assert result.exit_code == 2
    for text in (err.getvalue(), out.getvalue()):
        assert raw_controls(text) == [] and "t\\x1b]0;owned\\x07.jsonl:1: not JSON" in text


def test_ship_messages_escape_span_names_and_values(tmp_path: Path) -> None:
    """Attack: an invalid span whose name holds terminal escapes: the problem line quotes the
    name escaped; valid spans with escapes are shipped byte for byte (not altered)."""
    path = tmp_path / "evil.jsonl"
    bad = json.loads(otlp_line(name=EVIL, text=EVIL, span_id=2))
    bad["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = EVIL
    path.write_text(otlp_line(name=EVIL, text=EVIL) + "\n" + json.dumps(bad) + "\n")
    out = io.StringIO()
    sink = RecordingExporter()
    result = ship.ship([str(path)], exporter_factory=lambda: sink, skip_invalid=True, out=out)
    assert (result.sent, result.exit_code) == (1, 1)
    assert raw_controls(out.getvalue()) == []
    assert "\\x1b]0;owned\\x07" in out.getvalue()
    assert sink.spans[0].name == EVIL  # data is shipped as recorded; only printing escapes


def _evil_span() -> ReadableSpan:
    context = SpanContext(int(TRACE, 16), 1, False)
    return ReadableSpan(
        name=EVIL,
        context=context,
        resource=Resource({"service.name": EVIL}),
        attributes={
            f"otel_gpu.input.{EVIL}.dtype": EVIL,
            f"otel_gpu.input.{EVIL}.shape": (2, 3),
            "otel_gpu.input.s.value": EVIL,
            "otel_gpu.input.o.type": EVIL,
            "otel_gpu.input.o.repr": EVIL,
            "otel_gpu.output.0.type": EVIL,
            "otel_gpu.output.0.length": 3,
        },
        events=[
            Event(
                "otel_gpu.stats",
                {"otel_gpu.tensor": f"input.{EVIL}", "nan_count": 1, "otel_gpu.stats.note": EVIL},
                1500,
            )
        ],
        status=Status(StatusCode.ERROR, f"ValueError: {EVIL}\nsecond line"),
        start_time=1000,
        end_time=2000,
    )


@pytest.mark.parametrize("colour", ["never", "always"])
def test_console_exporter_escapes_user_text(colour: str) -> None:
    """Attack: user code names a span, an argument, a value and an exception message with
    terminal escapes. The console exporter prints them escaped, with or without colour, and
    the exception message stays on its line."""
    stream = io.StringIO()
    exporter = ConsoleSpanExporter(stream, color=colour)
    exporter.export([_evil_span()])
    exporter.write_call_start(EVIL, 1, 1000, {f"otel_gpu.input.{EVIL}.value": EVIL})
    text = stream.getvalue()
    assert raw_controls(text, colour=colour == "always") == []
    for visible in VISIBLE:
        assert visible in text
    assert "\\nsecond line" in text


# --------------------------------------------------------------------------- torn and cut files


def test_a_torn_last_line_is_reported_and_the_rest_shown(tmp_path: Path, capsys) -> None:
    """Attack (or accident): a writer killed mid-line leaves a last line with no newline.
    ``show`` draws the spans before it, names FILE:LINE on stderr, and exits 1."""
    path = tmp_path / "killed.jsonl"
    whole = otlp_line(name="first") + "\n"
    path.write_text(whole + otlp_line(name="second", span_id=2)[:70])
    rc, out, err = _show(str(path), capsys=capsys)
    assert rc == 1
    assert "─ first" in out and "second" not in out
    assert f"{path}:2: not JSON (" in err and "cut short" in err
    assert "Traceback" not in err


def test_invalid_middle_line_is_a_usage_error_unless_skip_invalid(tmp_path: Path, capsys) -> None:
    """An invalid line that is not the torn end stops ``show`` (exit 2, nothing drawn, the
    message suggests --skip-invalid); with ``--skip-invalid`` the rest is drawn, the line is
    named, and the exit code is 1, as for ``ship``."""
    path = tmp_path / "mixed.jsonl"
    path.write_text(otlp_line(name="first") + "\n{oops\n" + otlp_line(name="third", span_id=3))
    rc, out, err = _show(str(path), capsys=capsys)
    assert (rc, out) == (2, "")
    assert f"{path}:2: not JSON" in err and "(--skip-invalid shows the rest)" in err
    rc, out, err = _show(str(path), "--skip-invalid", capsys=capsys)
    assert rc == 1
    assert "─ first" in out and "─ third" in out
    assert f"{path}:2: not JSON" in err and "1 invalid line skipped" in err


def test_a_truncated_gzip_shows_what_was_read(tmp_path: Path, capsys) -> None:
    """Attack: a gzip stream cut short (a compressing writer killed). ``show`` draws the whole
    lines before the cut, names the file and the last line read, and exits 1."""
    lines = "".join(otlp_line(name=f"call{i}", span_id=i + 1) + "\n" for i in range(300))
    packed = gzip.compress(lines.encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(packed[: len(packed) // 2])
    rc, out, err = _show(str(path), "--limit", "0", capsys=capsys)
    assert rc == 1
    match = re.search(rf"{re.escape(str(path))}: cannot read after line (\d+): ", err)
    assert match is not None, err
    assert 0 < int(match[1]) < 300 and out.count("─ call") == int(match[1])


@pytest.mark.parametrize(
    "garbage",
    [
        bytes(range(256)) * 4,
        b"\x1f\x8b" + b"\x00" * 64,  # gzip magic, then nothing valid
        b"\xff\xfe\x00{\x00\n",
    ],
    ids=["all bytes", "fake gzip", "utf-16"],
)
def test_binary_garbage_is_one_line_per_problem(tmp_path: Path, capsys, garbage: bytes) -> None:
    """Attack: binary garbage (or a fake gzip header) given as a trace file. ``show`` and
    ``ship`` each name the file and what is wrong, without traceback or raw bytes."""
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(garbage)
    rc, out, err = _show(str(path), capsys=capsys)
    assert rc == 2 and out == ""
    assert err.startswith(f"otel-gpu show: {path}") and "Traceback" not in err
    assert raw_controls(err) == []
    result = ship.ship([str(path)], exporter_factory=RecordingExporter, out=io.StringIO())
    assert result.exit_code == 2 and result.invalid
    assert all(p.startswith(str(path)) for p in result.invalid)


def test_an_empty_file_is_no_spans_not_an_error(tmp_path: Path, capsys) -> None:
    """An empty file (a process that exported nothing): ``show`` says there are no spans
    (exit 1); ``ship`` sends 0 spans (exit 0). Neither raises."""
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    rc, out, err = _show(str(path), capsys=capsys)
    assert (rc, out) == (1, "") and f"no spans in {path}" in err
    result = ship.ship([str(path)], exporter_factory=RecordingExporter, out=io.StringIO())
    assert (result.spans, result.exit_code) == (0, 0)


# --------------------------------------------------------------------------- bounds


def _bombs() -> dict[str, str]:
    deep = 100_000
    return {
        "100k nested arrays": "[" * deep + "]" * deep,
        "100k nested objects": '{"a":' * deep + "1" + "}" * deep,
        "100k nested arrays, never closed": "[" * deep,
        "65 levels inside a valid span attribute": otlp_line().replace(
            '{"stringValue": "x"}',
            '{"arrayValue": {"values": [' * 22 + '{"stringValue": "x"}' + "]}}" * 22,
            1,
        ),
    }


@pytest.mark.parametrize("name", list(_bombs()))
def test_nesting_bombs_are_refused_with_the_bound(tmp_path: Path, name: str) -> None:
    """Attack: a line nested far deeper than OTLP needs (a nesting bomb; ``json.loads`` and
    every recursive walk would end in RecursionError). ``show`` and ``ship`` run as commands
    print one line naming FILE:LINE and the bound (64 levels), no traceback; the valid line
    before it is still shown or shipped with --skip-invalid."""
    path = tmp_path / "bomb.jsonl"
    path.write_text(otlp_line(name="good") + "\n" + _bombs()[name] + "\n")
    done = _command("show", "--skip-invalid", str(path))
    assert done.returncode == 1, done.stderr
    assert "─ good" in done.stdout
    bound = f"{path}:2: arrays and objects nested deeper than 64 levels"
    assert bound in done.stderr and "Traceback" not in done.stderr
    assert "RecursionError" not in done.stderr
    done = _command("ship", "--check", str(path))
    assert done.returncode == 2
    assert bound in done.stderr and "Traceback" not in done.stderr


def test_depth_at_the_bound_is_read() -> None:
    """64 levels are read and 65 are not: the bound is what the docs say, and real OTLP (13
    levels to an attribute value) is far below it."""
    assert reader.MAX_DEPTH == 64
    assert not reader.too_deep(("[" * 64 + "]" * 64).encode())
    assert reader.too_deep(("[" * 65 + "]" * 65).encode())
    # brackets inside strings, and escaped quotes, do not count
    text = json.dumps([["[[[[" * 100, '\\"]]]']])
    assert not reader.too_deep(text.encode())
    assert not reader.too_deep(otlp_line(text=EVIL).encode())


def test_an_over_long_line_is_skipped_without_holding_it(tmp_path: Path) -> None:
    """Attack: one line longer than the 64 MiB bound (a file with no newlines). It is reported
    as FILE:LINE with the bound and skipped; the line after it is read."""
    path = tmp_path / "long.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"x": "' + b"a" * (reader.MAX_LINE_BYTES + 10) + b'"}\n')
        f.write(otlp_line(name="after").encode() + b"\n")
    problems: list[str] = []
    spans = list(reader.read_spans(str(path), problem=lambda e: problems.append(str(e))))
    assert [s.name for s in spans] == ["after"]
    assert problems == [f"{path}:1: line longer than 64 MiB (the most a line may hold): skipped"]


# --------------------------------------------------------------------------- type confusion


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [at]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*at, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _paths(value, (*at, i))
    return found


def _replaced(node: Any, at: tuple[Any, ...], value: Any) -> Any:
    if not at:
        return value
    copy = json.loads(json.dumps(node))
    target = copy
    for step in at[:-1]:
        target = target[step]
    target[at[-1]] = value
    return copy


_ODD = [None, 7, -1, 1e308, "x", True, [], {}, [1, [2]], {"values": 5}, "9" * 5000]


def test_every_field_replaced_by_every_odd_value_is_a_line_error_or_read(tmp_path) -> None:
    """Attack: type confusion. Every node of a valid line is replaced, in turn, by null, a
    number, a huge number, a string, a list, an object or a 5000-digit string. ``show``'s
    reader and ``ship``'s parser either read the line or raise their one-line error naming
    FILE:LINE; nothing else escapes, and ``show`` draws whatever it read."""
    base = json.loads(otlp_line(text=EVIL))
    lines = [json.dumps(_replaced(base, at, odd)) for at in _paths(base) for odd in _ODD] + [
        '{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "' + TRACE + '", "spanId"'
    ]
    path = tmp_path / "confused.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems: list[reader.TraceFileError] = []
    spans = reader.read_all([str(path)], problem=problems.append)
    assert spans and problems
    assert all(re.match(rf"{re.escape(str(path))}:\d+: ", str(p)) for p in problems)
    out = io.StringIO()
    assert show([str(path)], skip_invalid=True, limit=0, out=out, err=io.StringIO()) == 1
    assert raw_controls(out.getvalue()) == []
    for number, line in enumerate(lines, 1):
        try:
            ship.parse_line(line, f"f:{number}")
        except ship.ShipError as exc:
            assert str(exc).startswith(f"f:{number}: ")


# --------------------------------------------------------------------------- recover


def _journal_bytes(
    pid: int,
    meta: bytes,
    plans: list[bytes],
    inputs: bytes | None = None,
    *,
    magic: bytes = writer.MAGIC,
    count: int = 1,
) -> bytes:
    """A journal as a dead process leaves it: header, plans, one committed slot."""
    header_size, plans_size, stride = writer.HEADER_SIZE, 4096, writer.LARGE_SLOT
    data = bytearray(header_size + plans_size + stride)
    pack_header(
        data, pid, meta, plans_size=plans_size, stride=stride, slots=count, level=3, magic=magic
    )
    at = header_size
    for plan in plans:
        layout.U32.pack_into(data, at, len(plan))
        data[at + 4 : at + 4 + len(plan)] = plan
        at += 4 + ((len(plan) + 7) & ~7)
    slot = header_size + plans_size
    flags = writer.F_INPUTS if inputs else 0
    layout.BODY.pack_into(data, slot + 8, 1, 2, 3, 0, 10**18, 1, 0, flags, len(inputs or b""))
    if inputs:
        data[slot + layout.INPUTS_AT : slot + layout.INPUTS_AT + len(inputs)] = inputs
    layout.COMMIT.pack_into(data, slot, layout.COMMITTED)
    return bytes(data)


def _meta(**extra: Any) -> bytes:
    return json.dumps({"host": socket.gethostname(), "resource": {}, **extra}).encode()


_PLAN = json.dumps(["lib.f", {"code.function": "f"}]).encode()


class _Global:
    def __reduce__(self) -> Any:
        return (os.system, ("echo owned",))


def _hostile_journals(pid: int) -> dict[str, bytes]:
    good_inputs = pickle.dumps([("x", 1, 5)], 5)
    # [("x", 1, [[[...1...]]])], 1500 lists deep, written opcode by opcode (pickle.dumps
    # itself recurses): PROTO 5, EMPTY_LIST, MARK, "x", 1, 1500 EMPTY_LIST, 1, 1500 APPEND,
    # TUPLE, APPEND, STOP.
    deep = 1500
    bomb = b"\x80\x05](\x8c\x01xK\x01" + b"]" * deep + b"K\x01" + b"a" * deep + b"ta."
    return {
        "good": _journal_bytes(pid, _meta(), [_PLAN], good_inputs),
        "truncated": _journal_bytes(pid, _meta(), [_PLAN])[:100],
        "wrong magic": _journal_bytes(pid, _meta(), [_PLAN], magic=b"NOTOURS!"),
        "huge count": _journal_bytes(pid, _meta(), [_PLAN], count=2**31),
        "nesting bomb in the metadata": _journal_bytes(pid, b"[" * 8000 + b"]" * 8000, [_PLAN]),
        "metadata not an object": _journal_bytes(pid, b"[1, 2]", [_PLAN]),
        "nesting bomb in a plan": _journal_bytes(pid, _meta(), [b"[" * 2000 + b"]" * 2000]),
        "nesting bomb in the pickled inputs": _journal_bytes(pid, _meta(), [_PLAN], bomb),
        "a global in the pickled inputs": _journal_bytes(
            pid, _meta(), [_PLAN], pickle.dumps([("x", 1, _Global())], 5)
        ),
        "escapes in the host name": _journal_bytes(pid, _meta(host=f"h{EVIL}"), [_PLAN]),
    }


def test_recover_reads_each_hostile_journal_or_names_it_in_one_line(tmp_path: Path) -> None:
    """Attack: journals crafted by hand (truncated, wrong magic, a huge slot count, nesting
    bombs in the JSON metadata, in a plan and in the pickled inputs, a pickled global, escapes
    in the host name). Each gets one outcome and no exception: the broken ones are named
    ``invalid`` and left alone, the others are recovered with what could be read, and the
    good journal's call is recovered."""
    pid = dead_pid()
    for i, data in enumerate(_hostile_journals(pid).values()):
        (tmp_path / f"otel-gpu-{pid}-{i:08x}.journal").write_bytes(data)
    names = dict(enumerate(_hostile_journals(pid)))
    memory = InMemorySpanExporter()
    outcomes = recover.recover(
        config.current(), str(tmp_path), processor=SimpleSpanProcessor(memory), timeout=5
    )
    states = {names[int(Path(o.path).name.split("-")[3][:8], 16)]: o for o in outcomes}
    assert {k: o.state for k, o in states.items() if o.state != "recovered"} == {
        "truncated": "invalid",
        "wrong magic": "invalid",
        "huge count": "invalid",
        "escapes in the host name": "other-host",
    }
    assert states["truncated"].detail == "too short to be a journal"
    assert states["huge count"].detail == "inconsistent journal header"
    spans = {
        s.attributes.get("otel_gpu.recovered.inputs_error"): s for s in memory.get_finished_spans()
    }
    assert "journal entries hold no objects (posix.system)" in "".join(map(str, spans))
    assert "malformed journal input records" in "".join(map(str, spans))
    good = [s for s in memory.get_finished_spans() if s.attributes.get("otel_gpu.input.x.value")]
    assert len(good) == 1 and good[0].name == "lib.f"


def test_recover_command_prints_hostile_journals_escaped_without_traceback(tmp_path: Path) -> None:
    """Attack: the same journals, and one whose file name holds an OSC title, through the
    real command: one line per journal, no raw control character, no traceback."""
    pid = dead_pid()
    jdir = tmp_path / "journal"
    jdir.mkdir(mode=0o700)
    for i, data in enumerate(_hostile_journals(pid).values()):
        (jdir / f"otel-gpu-{pid}-{i:08x}.journal").write_bytes(data)
    (jdir / f"otel-gpu-{pid}-x{ESCAPES['OSC 0 window title']}.journal").write_bytes(b"short")
    done = _command(
        "recover",
        text=False,
        OTEL_GPU_LOGDEST=str(tmp_path / "out.jsonl"),
        OTEL_GPU_JOURNAL_DIR=str(jdir),
    )
    stderr = done.stderr.decode()
    assert "Traceback" not in stderr
    assert raw_controls(stderr) == []
    per_journal = [ln for ln in stderr.splitlines() if ln.startswith(str(jdir))]
    assert len(per_journal) == len(_hostile_journals(pid)) + 1
    assert "x\\x1b]0;owned\\x07.journal: not a journal" in stderr
    assert "ran on host h\\x1b]0;owned\\x07" in stderr


def test_a_journal_rank_cannot_steer_the_output_file(tmp_path: Path) -> None:
    """Attack: a journal whose resource says ``otel_gpu.rank = "../../escaped"`` with a
    destination naming ``%r``: the journal is refused as invalid, and nothing is written
    outside the destination's folder."""
    pid = dead_pid()
    jdir = tmp_path / "journal"
    jdir.mkdir()
    meta = _meta(resource={"otel_gpu.rank": "../../escaped"})
    path = jdir / f"otel-gpu-{pid}-00000000.journal"
    path.write_bytes(_journal_bytes(pid, meta, [_PLAN]))
    settings = config.with_changes(config.current(), dest=(str(tmp_path / "out" / "s-%r.jsonl"),))
    (outcome,) = recover.recover(settings, str(jdir), timeout=5)
    assert outcome.state == "invalid"
    assert "rank '../../escaped' is not a whole number" in outcome.detail
    assert path.exists() and not (tmp_path.parent / "escaped.jsonl").exists()
    assert not (tmp_path / "out").exists()
