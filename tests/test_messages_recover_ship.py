"""What ``otel-gpu recover`` and ``otel-gpu ship`` tell the user: every line claims only what
was checked (exported means confirmed, removed means removed, counts and plurals are exact,
names are the ones used).

Dead processes come from the crash lab of tests/test_faults_crash.py, as in test_recover.py.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from commands import python_command
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import StatusCode
from recording_exporter import RecordingExporter
from test_faults_crash import child_env, error_spans, jsonl_spans, recover_cli, run_lab
from test_recover import closed_journal
from test_ship import ship_cli

from otel_gpu import config
from otel_gpu.cli import main
from otel_gpu.journal import reader, recover, writer
from otel_gpu.traces import ship

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict[str, Any], Path]]:
    """Journals of dead processes, made once: 10 killed inside a nested call, 1 died idle."""
    tmp = tmp_path_factory.mktemp("pool")
    cases = run_lab(child_env(tmp, RANK="5"), "kill:10,idle:1", 0, seed=11)
    files = {int(p.name.split("-")[2]): p for p in (tmp / "journal").iterdir()}
    return [(c, files[c["pid"]]) for c in cases]


@pytest.fixture
def dead(pool: list[tuple[dict[str, Any], Path]], tmp_path: Path) -> Callable[..., Any]:
    """``dead(mode="kill", **env)``: one dead journal moved into this test's journal directory;
    returns (env, case, journal path)."""

    def take(mode: str = "kill", **extra: str) -> tuple[dict[str, str], dict[str, Any], Path]:
        env = child_env(tmp_path, **extra)
        jdir = Path(env["OTEL_GPU_JOURNAL_DIR"])
        jdir.mkdir(mode=0o700, exist_ok=True)
        for item in list(pool):
            case, path = item
            if case["mode"] == mode:
                pool.remove(item)
                return env, case, path.rename(jdir / path.name)
        raise AssertionError("pool exhausted: raise the counts in the pool fixture")

    return take


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _summary(stderr: str, command: str = "recover") -> str:
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith(f"otel-gpu {command}: ")][-1:]
    return line


# --------------------------------------------------------------------------- recover: per journal


def test_recovered_line_names_the_pid_the_calls_and_the_file_actually_written(dead, tmp_path):
    """ "exported as ERROR spans to F": F is the dead process's own file (``%i``/``%r``
    expanded), the one that now holds the spans; the summary counts 2 calls of 1 process."""
    env, case, _ = dead(OTEL_GPU_LOGDEST=str(tmp_path / "out-%r-%i.jsonl"))
    own = tmp_path / f"out-5-{case['pid']}.jsonl"
    result = recover_cli(env)
    assert result.returncode == 0, result.stderr
    assert (
        f"pid {case['pid']} died with 2 call(s) in flight: exported as ERROR spans to {own}"
        in result.stderr
    )
    assert len(error_spans(jsonl_spans(own))) == 2
    assert (
        _summary(result.stderr) == "otel-gpu recover: 2 call(s) recovered from 1 dead process(es)"
    )


def test_an_unreachable_collector_is_not_reported_as_exported(dead, tmp_path):
    """OTLP to a closed port: the line says the spans were handed over but not confirmed, the
    summary counts 0 recovered and 2 unconfirmed, and the exit code is 1. (It used to say
    "exported as ERROR spans", "2 call(s) recovered" and exit 0.) No destination that keeps
    spans confirmed them, so the journal is kept for another run (it used to be removed: the
    only copy of the crash was gone)."""
    env, case, path = dead(
        OTEL_GPU_LOGDEST="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
    )
    result = recover_cli(env)
    assert result.returncode == 1, result.stderr
    assert "exported as" not in result.stderr
    assert (
        f"pid {case['pid']} died with 2 call(s) in flight: handed as ERROR spans to otlp, but "
        "otlp did not confirm them" in result.stderr
    )
    assert "journal kept for another run" in result.stderr
    assert _summary(result.stderr) == (
        "otel-gpu recover: 0 call(s) recovered from 1 dead process(es); "
        "2 call(s) of 1 process(es) not confirmed by the exporters"
    )
    assert path.exists()  # kept, as the line says


def test_recover_to_the_terminal_alone_keeps_the_journal_and_says_how_to_export(dead, tmp_path):
    """No OTEL_GPU_LOGDEST (the default, stdout): the spans are shown on the terminal, and the
    journal is kept (it used to be deleted, so the only record of the crash was gone once the
    terminal scrolled). The summary says in one line how to export it; doing so exports the
    calls and removes the journal."""
    env, case, path = dead()
    del env["OTEL_GPU_LOGDEST"]
    result = recover_cli(env)
    assert result.returncode == 0, result.stderr
    assert case["kernel"] in result.stdout  # shown
    assert (
        f"pid {case['pid']} died with 2 call(s) in flight: shown as ERROR spans on stdout only; "
        "journal kept" in result.stderr
    )
    assert _summary(result.stderr) == (
        "otel-gpu recover: 0 call(s) recovered from 1 dead process(es); 2 call(s) of 1 "
        "process(es) only shown on the terminal, journal(s) kept: to export and remove them, "
        "run OTEL_GPU_LOGDEST=crash.jsonl otel-gpu recover (or OTEL_GPU_LOGDEST=otlp)"
    )
    assert path.exists()
    out = tmp_path / "crash.jsonl"
    again = recover_cli(dict(env, OTEL_GPU_LOGDEST=str(out)))
    assert again.returncode == 0 and "2 call(s) recovered from 1 dead process(es)" in again.stderr
    assert len(error_spans(jsonl_spans(out))) == 2 and not path.exists()


def test_a_file_that_took_the_spans_removes_the_journal_even_if_the_collector_did_not(
    dead, tmp_path
):
    """Destinations otlp (unreachable) and a file: the file keeps the spans, so the journal is
    removed, and the line says the collector did not confirm them."""
    out = tmp_path / "both.jsonl"
    env, _, path = dead(
        OTEL_GPU_LOGDEST=f"otlp,{out}",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
    )
    result = recover_cli(env)
    assert result.returncode == 1, result.stderr
    assert "otlp did not confirm them" in result.stderr
    assert "journal removed: a destination that keeps them confirmed them" in result.stderr
    assert len(error_spans(jsonl_spans(out))) == 2 and not path.exists()


def test_a_destination_that_cannot_be_opened_keeps_the_journal(dead, tmp_path):
    """The dead process's file cannot be opened (a directory has its name): "not exported",
    "journal kept", and it is kept; exit 1. (It used to end in a traceback after deleting
    the journal, so the calls were lost unexported.)"""
    env, case, path = dead(OTEL_GPU_LOGDEST=str(tmp_path / "out-%i.txt"))
    blocker = tmp_path / f"out-{case['pid']}.txt"
    blocker.mkdir()
    result = recover_cli(env)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert (
        f"pid {case['pid']} died with 2 call(s) in flight: not exported (cannot open the "
        f"destinations: Is a directory: {blocker}); journal kept for another run" in result.stderr
    )
    assert _summary(result.stderr).endswith(
        "; 2 call(s) of 1 process(es) not exported, journal(s) kept"
    )
    assert path.exists()
    blocker.rmdir()  # once the destination works, the kept journal is recovered
    again = recover_cli(env)
    assert again.returncode == 0 and "2 call(s) recovered from 1 dead process(es)" in again.stderr


def _recover_beside_a_closed_journal(dead, mode: str, *args: str):
    """A dead process's journal (``mode``) and a closed one beside it, recovered with ``args``:
    (result, pid of the dead process, its journal, the closed journal)."""
    env, case, path = dead(mode=mode)
    closed = closed_journal(Path(env["OTEL_GPU_JOURNAL_DIR"]))
    result = recover_cli(env, *args)
    assert result.returncode == 0, result.stderr
    return result, case["pid"], path, closed


def test_dry_run_says_nothing_was_exported_or_removed(dead, tmp_path):
    """--dry-run: "not exported, journal kept" per journal, a dry-run summary with the calls
    found (it used to read "0 call(s) recovered"), and a closed journal is "kept", not
    "removed" (it is not removed in a dry run)."""
    result, pid, path, closed = _recover_beside_a_closed_journal(dead, "kill", "--dry-run")
    assert (
        f"{path}: pid {pid} died with 2 call(s) in flight (dry run: not exported, "
        "journal kept)" in result.stderr
    )
    assert f"{closed}: pid {os.getpid()} exited normally: nothing to export, journal kept" in (
        result.stderr
    )
    assert _summary(result.stderr) == (
        "otel-gpu recover: dry run: 2 call(s) in flight in 1 dead process(es); "
        "nothing exported or removed"
    )
    assert path.exists() and closed.exists()


def test_empty_and_closed_journals_say_they_were_removed_and_they_are(dead, tmp_path):
    """A process that died idle and one that exited normally: "nothing to export, journal
    removed", and both files are gone; the summary counts the idle one as a dead process."""
    result, pid, path, closed = _recover_beside_a_closed_journal(dead, "idle")
    assert (
        f"{path}: pid {pid} died with no call in flight: nothing to export, "
        "journal removed" in result.stderr
    )
    assert f"{closed}: pid {os.getpid()} exited normally: nothing to export, journal removed" in (
        result.stderr
    )
    assert (
        _summary(result.stderr) == "otel-gpu recover: 0 call(s) recovered from 1 dead process(es)"
    )
    assert not path.exists() and not closed.exists()


def test_a_closed_journal_that_cannot_be_removed_says_so(tmp_path, monkeypatch, capsys):
    """If removing a closed journal fails, the line says it remains and why (it used to end in
    a traceback)."""
    closed = closed_journal(tmp_path)

    def refuse(path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(recover, "_unlink", refuse)
    assert main(["recover", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert (
        f"{closed}: pid {os.getpid()} exited normally, but its journal remains (cannot remove "
        "it: Permission denied)" in err
    )


def test_running_and_other_host_journals_are_left_alone_and_say_whose(
    tmp_path, monkeypatch, capsys
):
    """A journal of this (running) process: "pid N is still running: left alone"; one written
    on another host names that host: "ran on host H ... run otel-gpu recover there"."""
    settings = config.load(env={"OTEL_GPU_LOGLEVEL": "1"})
    mine = writer.Journal(str(tmp_path), settings, None)
    other = writer.Journal(str(tmp_path), settings, None)
    with monkeypatch.context() as m:
        m.setattr(writer.socket, "gethostname", lambda: "gpu-node-7")
        other._write_meta(None)
    try:
        assert main(["recover", str(tmp_path)]) == 0
        err = capsys.readouterr().err
    finally:
        mine.close()
        other.close()
    pid = os.getpid()
    assert f"{mine.path}: pid {pid} is still running: left alone" in err
    assert (
        f"{other.path}: pid {pid} ran on host gpu-node-7: left alone, run otel-gpu recover there"
        in err
    )


def test_a_live_claim_names_the_claiming_pid(dead, tmp_path, capsys, monkeypatch):
    """A journal another recoverer claimed (its pid is running): "not recovered here: claimed
    by pid P, which is running"."""
    env, _, path = dead()
    owner = os.getppid()
    claimed = path.rename(f"{path}.recovering.{owner}-abcd")
    _use_env(monkeypatch, env)
    assert main(["recover"]) == 0
    err = capsys.readouterr().err
    assert f"{claimed}: not recovered here: claimed by pid {owner}, which is running" in err
    assert claimed.exists()


def test_files_that_are_not_journals_say_why_and_are_left_alone(tmp_path, capsys):
    """Junk and a symbolic link named like journals: "not a journal this otel-gpu can
    recover (why): left alone", with the reason of each, and both stay."""
    junk = tmp_path / "otel-gpu-1-deadbeef.journal"
    junk.write_bytes(b"\0" * (writer.HEADER_SIZE + 10))
    link = tmp_path / "otel-gpu-2-deadbeef.journal"
    link.symlink_to(junk)
    assert main(["recover", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert (
        f"{junk}: not a journal this otel-gpu can recover (not an otel-gpu journal): left alone"
        in err
    )
    assert (
        f"{link}: not a journal this otel-gpu can recover (a symbolic link, not followed): "
        "left alone" in err
    )
    assert junk.exists() and link.is_symlink()


# --------------------------------------------------------------------------- recover: directory


def test_an_unlistable_directory_is_not_reported_as_empty(tmp_path, monkeypatch, capsys):
    """A journal directory that cannot be listed: "cannot list the directory (why)" and exit 1,
    never "no journals" (it used to end in a traceback)."""
    real = os.listdir

    def listdir(path: Any = ".") -> list[str]:
        if str(path) == str(tmp_path):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    assert main(["recover", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{tmp_path}: cannot list the directory (Permission denied)\n")
    assert f"otel-gpu recover: nothing recovered: cannot list {tmp_path}" in err
    assert "no journals" not in err


def test_no_journals_says_whether_the_place_exists(tmp_path, capsys):
    """An empty directory: "no journals in D"; a path that does not exist says so too."""
    assert main(["recover", str(tmp_path)]) == 0
    assert capsys.readouterr().err == f"otel-gpu recover: no journals in {tmp_path}\n"
    missing = tmp_path / "typo"
    assert main(["recover", str(missing)]) == 0
    assert capsys.readouterr().err == (
        f"otel-gpu recover: no journals in {missing} (it does not exist)\n"
    )


def test_a_bad_timeout_is_a_usage_error_that_names_the_flag(capsys):
    """--timeout abc / -1: argparse names --timeout and the rule, not a helper function."""
    for bad in ("abc", "-1", "nan"):
        with pytest.raises(SystemExit) as usage:
            main(["recover", "--timeout", bad, "/nonexistent"])
        assert usage.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --timeout: must be a number of seconds >= 0, not '{bad}'" in err
        assert "_seconds" not in err


def test_recover_help_names_real_settings_and_exit_codes():
    """The help names settings that exist (OTEL_GPU_LOGDEST, OTEL_GPU_JOURNAL_DIR,
    OTEL_GPU_FLUSH_TIMEOUT) and explains exit codes 0, 1 and 2."""
    proc = python_command(["-m", "otel_gpu", "recover", "--help"], cwd=REPO, timeout=60)
    text = " ".join(proc.stdout.split())
    named = set(re.findall(r"OTEL_GPU_[A-Z_]+", text))
    assert named == {"OTEL_GPU_LOGDEST", "OTEL_GPU_JOURNAL_DIR", "OTEL_GPU_FLUSH_TIMEOUT"}
    assert named <= {s.env for s in config.SETTINGS}
    assert "Exit codes: 0 " in text and "; 1 " in text and "; 2 invalid configuration" in text


# --------------------------------------------------------------------------- recover: in process


class _Processor:
    """A span processor whose flush hangs, fails or raises."""

    def __init__(self, flush: Callable[[], Any]) -> None:
        self.flush = flush
        self.spans: list[Any] = []

    def on_end(self, span: Any) -> None:
        self.spans.append(span)

    def force_flush(self, timeout_millis: int = 30000) -> Any:
        return self.flush()


def _raise() -> bool:
    raise RuntimeError("collector gone")


@pytest.mark.parametrize(
    ("flush", "why"),
    [
        (lambda: time.sleep(5), "no answer within 0.2 s"),
        (lambda: False, "the flush reported a failure"),
        (_raise, "RuntimeError: collector gone"),
    ],
    ids=["hangs", "fails", "raises"],
)
def test_in_process_recovery_says_why_the_processor_did_not_confirm(dead, flush, why):
    """With a span processor, an unconfirmed flush is "unconfirmed" with the actual reason (it
    used to be "did not confirm within T s" whatever happened)."""
    env, case, _ = dead()
    processor = _Processor(flush)
    (outcome,) = recover.recover(config.load(env=env), processor=processor, timeout=0.2)
    assert (outcome.state, outcome.pid, outcome.spans) == ("unconfirmed", case["pid"], 2)
    assert outcome.detail == f"the span processor did not confirm them: {why}"
    assert len(processor.spans) == 2


def test_recovered_spans_carry_the_status_and_input_notes_they_claim():
    """ERROR "process died during call"; an input record that could not be encoded or decoded
    says which in ``otel_gpu.recovered.inputs_error``; a cut one sets ``inputs_truncated``."""

    def record(span_id: int, **kw: Any) -> reader.Record:
        base: dict[str, Any] = dict(
            trace_id=1,
            span_id=span_id,
            parent_span_id=None,
            parent_remote=False,
            start_ns=10,
            thread_id=7,
            name="f",
            code={},
            inputs=None,
        )
        return reader.Record(**{**base, **kw})

    jf = reader.JournalFile("x", 1, 0, b"", 0, 20, 3, False, None, {})
    jf.records = [
        record(1, inputs_error="input metadata could not be encoded"),
        record(2, inputs=[("x", 1, 5)], inputs_truncated=True),
    ]
    failed, cut = recover.spans_of(jf)
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "process died during call"
    assert failed.attributes["otel_gpu.recovered.inputs_error"] == (
        "input metadata could not be encoded"
    )
    assert cut.attributes["otel_gpu.recovered.inputs_truncated"] is True
    assert "otel_gpu.recovered.inputs_error" not in cut.attributes
    with pytest.raises(Exception, match=r"journal entries hold no objects \(posix\.system\)"):
        reader.decode_inputs(b"cposix\nsystem\n.")


# --------------------------------------------------------------------------- ship: counts


_SPAN = (
    '{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"n%d",'
    '"traceId":"0af7651916cd43dd8448eb211c80319c","spanId":"b7ad6b71692033%02x"}]}]}]}'
)


def _lines(n: int) -> str:
    return "".join(_SPAN % (i, i) + "\n" for i in range(n))


def test_one_span_reads_as_one_span(tmp_path):
    """Counts agree with their nouns: "1 span in 1 file", "1 span sent" (it used to print
    "1 spans in 1 file(s)")."""
    one = tmp_path / "one.jsonl"
    one.write_text(_lines(1))
    out = io.StringIO()
    result = ship.ship([str(one)], exporter_factory=RecordingExporter, out=out, target="grpc x")
    assert result.exit_code == 0
    assert out.getvalue().splitlines() == [
        "otel-gpu ship: 1 span in 1 file -> grpc x",
        f"  {one}: 1 sent, 0 failed",
        "otel-gpu ship: 1 span sent, 0 failed",
    ]


def test_stopping_after_failures_counts_what_was_never_attempted(tmp_path):
    """max_failures=1 with 3 spans per request of 1: "stopped after 1 failed request in a row:
    2 not attempted", per file "(2 not attempted)", and the next file "not sent (3 spans)"."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(_lines(3))
    second.write_text(_lines(3))
    out = io.StringIO()
    result = ship.ship(
        [str(first), str(second)],
        exporter_factory=lambda: RecordingExporter(SpanExportResult.FAILURE),
        batch_size=1,
        max_failures=1,
        out=out,
    )
    assert (result.sent, result.failed, result.not_attempted, result.exit_code) == (0, 6, 5, 1)
    lines = out.getvalue().splitlines()
    assert f"  {first}: 0 sent, 3 failed (2 not attempted)" in lines
    assert f"  {second}: not sent (3 spans)" in lines
    assert lines[-1] == (
        "otel-gpu ship: 0 spans sent, 6 failed "
        "(stopped after 1 failed request in a row: 5 not attempted)"
    )


def test_an_exporter_that_raises_is_named_with_its_error(tmp_path, capsys):
    """An exporter raising (it should not): "export raised RuntimeError: boom", counted failed."""

    class Raising(RecordingExporter):
        def export(self, spans: Any) -> SpanExportResult:
            raise RuntimeError("boom")

    path = tmp_path / "a.jsonl"
    path.write_text(_lines(2))
    result = ship.ship([str(path)], exporter_factory=Raising, out=io.StringIO(), max_failures=0)
    assert (result.sent, result.failed) == (0, 2)
    assert "otel-gpu ship: export raised RuntimeError: boom" in capsys.readouterr().err


# --------------------------------------------------------------------------- ship: bad input


def test_check_never_calls_invalid_files_valid(tmp_path):
    """--check with an invalid line (even with --skip-invalid): the summary counts the valid
    spans and the invalid line, exit 2 (it used to say "N spans ... look valid"); clean files
    read "5 valid spans in 1 file", exit 0."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_lines(2) + "{oops\n")
    for skip in (False, True):
        out = io.StringIO()
        result = ship.ship([str(bad)], check_only=True, skip_invalid=skip, out=out)
        assert result.exit_code == 2
        assert "look valid" not in out.getvalue()
        assert out.getvalue().splitlines()[-1] == (
            "otel-gpu ship: 2 valid spans in 1 file, 1 invalid line; nothing sent (--check)"
        )
    good = tmp_path / "good.jsonl"
    good.write_text(_lines(5))
    out = io.StringIO()
    assert ship.ship([str(good)], check_only=True, out=out).exit_code == 0
    assert out.getvalue() == "otel-gpu ship: 5 valid spans in 1 file\n"


def test_nothing_sent_advice_names_a_flag_that_exists(tmp_path, capsys):
    """The "nothing sent" line counts the problems and suggests --skip-invalid, a real flag."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_lines(1) + "{oops\n[1]\n")
    assert main(["ship", str(bad)]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "otel-gpu ship: nothing sent: 2 invalid lines (--skip-invalid sends the rest)"
    from otel_gpu.cli import build_parser

    assert build_parser().parse_args(["ship", "--skip-invalid", "x"]).skip_invalid


def test_a_missing_file_is_not_counted_as_an_invalid_line(tmp_path):
    """--skip-invalid with a missing file: "1 unreadable file skipped" (it used to read "1
    invalid line(s) skipped"); mixed problems are counted by kind."""
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(_lines(2))
    bad.write_text("{oops\n" + _lines(1))
    out = io.StringIO()
    result = ship.ship(
        [str(good), str(tmp_path / "gone.jsonl"), str(bad)],
        exporter_factory=RecordingExporter,
        skip_invalid=True,
        out=out,
    )
    assert (result.sent, result.unreadable, result.exit_code) == (3, 1, 1)
    assert out.getvalue().splitlines()[-1] == (
        "otel-gpu ship: 3 spans sent, 0 failed, 1 invalid line and 1 unreadable file skipped"
    )


def test_many_problems_are_cut_with_a_count_of_what_is_left(tmp_path):
    """More than 20 problems: 20 lines, then "... and 2 more problems"."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{\n" * 22)
    out = io.StringIO()
    ship.ship([str(bad)], out=out)
    lines = out.getvalue().splitlines()
    assert len([ln for ln in lines if "not JSON" in ln]) == 20
    assert "otel-gpu ship: ... and 2 more problems" in lines


def test_json_errors_read_once_and_name_the_cut_line(tmp_path):
    """A line cut short reads "Unterminated string starting at column N" (no "at at"; it used
    to read "Invalid control character at at column", the newline counted as content)."""
    cut = tmp_path / "cut.jsonl"
    torn = (_SPAN % (1, 1))[:40]
    cut.write_text(_lines(1) + torn + "\n")
    result = ship.ship([str(cut)], exporter_factory=RecordingExporter, out=io.StringIO())
    (problem,) = result.invalid
    column = torn.rindex('"') + 1  # where the unterminated string starts
    assert problem == f"{cut}:2: not JSON (Unterminated string starting at column {column})"
    assert " at at " not in problem


def test_a_bad_byte_is_reported_on_its_own_line_and_the_rest_is_read(tmp_path):
    """A non-UTF-8 byte far into a file is reported on its own line (a text stream decoded ahead
    and blamed an earlier line, then dropped the rest of the file); the lines after it are
    still read and sent with --skip-invalid."""
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(_lines(200).encode() + b"\xff\n" + _lines(3).encode())
    out = io.StringIO()
    result = ship.ship([str(path)], exporter_factory=RecordingExporter, skip_invalid=True, out=out)
    assert result.invalid == [f"{path}:201: not UTF-8 text (byte 0xff at offset 0)"]
    assert (result.sent, result.unreadable) == (203, 0)


def test_a_truncated_gzip_names_the_last_line_read(tmp_path):
    """A .gz cut short: "cannot read after line N: ..." with N the last whole line, counted as
    an unreadable file."""
    raw = gzip.compress(_lines(400).encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(raw[: len(raw) // 2])
    result = ship.ship(
        [str(path)], exporter_factory=RecordingExporter, skip_invalid=True, out=io.StringIO()
    )
    (problem,) = result.invalid
    match = re.fullmatch(rf"{re.escape(str(path))}: cannot read after line (\d+): .+", problem)
    assert match is not None, problem
    assert int(match[1]) == result.sent and 0 < result.sent < 400
    assert result.unreadable == 1


@pytest.mark.parametrize(
    ("span", "message"),
    [
        ('"trace_id":"xyz","span_id":"b7ad6b7169203331"', "trace_id 'xyz' is not 32 hex digits"),
        (
            '"traceId":"0af7651916cd43dd8448eb211c80319c","spanId":"b7ad6b7169203331",'
            '"parent_span_id":"zz"',
            "parent_span_id 'zz' is not 16 hex digits",
        ),
    ],
)
def test_id_errors_name_the_key_as_the_file_spells_it(span, message):
    """snake_case keys are named as written (it used to name the camelCase key the file lacks)."""
    line = '{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"n",' + span + "}]}]}]}"
    with pytest.raises(ship.ShipError) as exc:
        ship.parse_line(line, "f.jsonl:3")
    assert str(exc.value).endswith(message)


def test_a_misshapen_entry_is_named_by_its_position():
    """An entry that is not an object is named by where it sits, and a list that is not one
    by the key the file uses."""
    with pytest.raises(ship.ShipError) as exc:
        ship.parse_line('{"resourceSpans":[{"scopeSpans":[]}, 5]}', "f.jsonl:1")
    assert str(exc.value) == (
        "f.jsonl:1: resourceSpans[1] is not an object (expected one holding scopeSpans)"
    )
    with pytest.raises(ship.ShipError) as exc:
        ship.parse_line('{"resource_spans":[{"scope_spans":{}}]}', "f.jsonl:1")
    assert str(exc.value) == "f.jsonl:1: resourceSpans[0]: scope_spans is not a list"


# --------------------------------------------------------------------------- ship: command line


def test_an_unreachable_endpoint_is_named_and_counted_failed(tmp_path):
    """A closed port: the target line names protocol and endpoint, the summary "0 spans sent,
    2 failed", exit 1; with -q the summary still shows."""
    path = tmp_path / "a.jsonl"
    path.write_text(_lines(2))
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
    proc = ship_cli([str(path)], **env)
    assert proc.returncode == 1, proc.stderr
    assert f"otel-gpu ship: 2 spans in 1 file -> grpc {endpoint}" in proc.stderr
    assert f"  {path}: 0 sent, 2 failed" in proc.stderr
    assert _summary(proc.stderr, "ship") == "otel-gpu ship: 0 spans sent, 2 failed"
    quiet = ship_cli(["-q", str(path)], **env)
    assert quiet.returncode == 1
    assert _summary(quiet.stderr, "ship") == "otel-gpu ship: 0 spans sent, 2 failed"
    assert "->" not in quiet.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "otel-gpu ship: OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported by "
            "otel-gpu ship. Allowed: grpc, http/protobuf.",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"},
            "otel-gpu ship: OTEL_EXPORTER_OTLP_TIMEOUT='soon' (environment) is invalid: not a number. "
            "Allowed: number >= 0.001 and <= 600 (seconds).",
        ),
        (
            {"OTEL_EXPORTER_OTLP_COMPRESSION": "zip"},
            "otel-gpu ship: the OTEL_EXPORTER_OTLP_* variables do not make an exporter: ",
        ),
    ],
    ids=["protocol", "timeout", "compression"],
)
def test_bad_otlp_variables_are_named_with_exit_code_2(tmp_path, env, message):
    """A bad standard OTLP variable: exit 2 naming it, in ship's own terms (the protocol error
    used to name OTEL_GPU_LOGDEST=otlp, which ship does not use; a bad timeout or compression
    used to end in a traceback)."""
    path = tmp_path / "a.jsonl"
    path.write_text(_lines(1))
    proc = ship_cli([str(path)], **env)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and "OTEL_GPU_LOGDEST" not in proc.stderr
    assert "COMPRESSION" in proc.stderr or "compression" not in message


def test_the_target_shown_is_the_protocol_the_exporter_uses():
    """A blank traces-protocol variable is skipped, as the exporter does (it used to print an
    empty protocol and the HTTP endpoint); one trailing slash is dropped, as the HTTP exporter
    joins the path."""
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": " ", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert ship.describe_target(env) == "grpc http://localhost:4317"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": "h://c/"}
    assert ship.describe_target(env) == "http/protobuf h://c/v1/traces"


def test_bad_flag_values_name_the_flag_and_the_rule(capsys):
    """--batch-size x / --max-failures -1: the rule and the value, not a helper's name."""
    for args, rule in (
        (["--batch-size", "x"], "argument --batch-size: must be a whole number >= 1, not 'x'"),
        (["--batch-size", "0"], "argument --batch-size: must be a whole number >= 1, not '0'"),
        (["--max-failures", "-1"], "argument --max-failures: must be a whole number >= 0"),
    ):
        with pytest.raises(SystemExit) as usage:
            main(["ship", *args, "f.jsonl"])
        assert usage.value.code == 2
        err = capsys.readouterr().err
        assert rule in err and "_positive" not in err and "_non_negative" not in err


def test_ship_help_states_the_exit_codes_the_code_returns():
    """The help's exit codes: 0 all sent, 1 some or all not sent, 2 invalid input or config."""
    proc = ship_cli(["--help"])
    text = " ".join(proc.stdout.split())
    assert "Exit codes: 0 every span sent" in text
    assert "1 some or all spans not sent" in text
    assert "2 nothing sent because of invalid input or configuration" in text


# --------------------------------------------------------------------------- helpers


def _use_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Run an in-process command with the settings of ``env`` (the OTEL_GPU_* part)."""
    for key, value in env.items():
        if key.startswith("OTEL_"):
            monkeypatch.setenv(key, value)
    config.reset_overrides()
