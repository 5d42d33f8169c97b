"""``otel-gpu recover`` on crash journals crafted to exhaust memory, time or patience.

A journal's header says how big its parts are; a crafted one says "a million slots", "a 16 GB
file" or "180 MB of metadata", or is no file at all but a FIFO that never answers. The promise:
the reader looks only at what the writer can produce (:data:`otel_gpu.journal.reader.MAX_SIZE`),
refuses the rest in one line naming the file and the limit, and never blocks on a planted file.
The payloads are built by :mod:`crafted_journals`.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from commands import otel_gpu_command, python_command, without_otel
from crafted_journals import crafted_journal, dead_pid

from otel_gpu.journal import reader, recover, writer

# --------------------------------------------------------------------------- measuring

_MEASURE = """
import resource, sys, time
from otel_gpu import config
from otel_gpu.journal import recover
start = time.monotonic()
outcomes = recover.recover(config.current(), sys.argv[1], timeout=5)
took = time.monotonic() - start
for o in outcomes:
    print(o.state, o.detail)
print("maxrss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "seconds", round(took, 2))
"""


def recover_in_child(path: Path, tmp_path: Path, timeout: float = 300) -> tuple[list[str], int]:
    """Recover ``path`` in a fresh process (destination: a file under ``tmp_path``): the
    outcome lines and the child's peak RSS in KiB."""
    env = without_otel(OTEL_GPU_LOGDEST=str(tmp_path / "out.jsonl"))
    done = python_command(["-c", _MEASURE, str(path)], env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    return lines[:-1], int(lines[-1].split()[1])


def _baseline_rss(tmp_path: Path) -> int:
    """Peak RSS of the same child recovering one ordinary one-call journal."""
    folder = tmp_path / "baseline"
    folder.mkdir()
    pid = dead_pid()
    crafted_journal(folder / f"otel-gpu-{pid}-00000000.journal", pid)
    return recover_in_child(folder, tmp_path)[1]


# --------------------------------------------------------------------------- sizes


def test_a_sparse_journal_larger_than_any_the_writer_makes_is_refused_unread(tmp_path):
    """Attack: a 4 GiB sparse file whose header claims 64 M slots (consistent with its size).
    It used to be walked slot by slot (16 GB: 91 s, 7.8 GB); now it is refused before it is
    mapped, in one line naming the size and the limit, and left alone."""
    pid = dead_pid()
    path = crafted_journal(
        tmp_path / f"otel-gpu-{pid}-00000001.journal",
        pid,
        count=(4 << 30) // 64,
        size=writer.HEADER_SIZE + writer.PLANS_SIZE + 4 * (1 << 30),
    )
    (outcome,) = recover.recover(None, str(tmp_path), timeout=5)
    assert outcome.state == "invalid"
    assert outcome.detail == (
        "4.0 GiB, larger than any journal otel-gpu writes (1.1 MiB at most)"
    ), outcome.detail
    assert path.exists()


def test_a_million_committed_slots_cost_no_more_than_an_ordinary_journal(tmp_path):
    """Attack: 1 M slots, each a call in flight (the writer never makes more than 1024). It
    used to become 1 M spans (4.1 GB, a 569 MB output line); now it is refused, and the child
    that reads it peaks within 150 MB of one recovering an ordinary journal."""
    pid = dead_pid()
    count = 1 << 20
    crafted_journal(
        tmp_path / f"otel-gpu-{pid}-00000002.journal", pid, count=count, committed=count
    )
    lines, rss = recover_in_child(tmp_path, tmp_path)
    assert lines == [
        "invalid 64.1 MiB, larger than any journal otel-gpu writes (1.1 MiB at most)"
    ], lines
    assert not (tmp_path / "out.jsonl").exists()
    assert rss < _baseline_rss(tmp_path) + 150 * 1024


def test_a_slot_count_beyond_the_writers_is_refused_even_in_a_small_file(tmp_path):
    """Attack: a header claiming 5000 slots of 64 bytes in a file of exactly that size (under
    the size limit): the count is checked against the writer's 1024, and the message names it."""
    pid = dead_pid()
    crafted_journal(tmp_path / f"otel-gpu-{pid}-00000003.journal", pid, count=5000, committed=5000)
    (outcome,) = recover.recover(None, str(tmp_path), timeout=5)
    assert outcome.state == "invalid"
    assert outcome.detail == (
        "its header claims 5000 slots of 64 bytes; otel-gpu writes at most 1024 of 64 or 256 of 4096"
    )


def test_megabytes_of_metadata_behind_a_stretched_header_are_refused(tmp_path):
    """Attack: a header claiming a 420 KB header holding 420 KB of JSON resource (180 MB used to
    take 4.9 GB): the header size is the writer's 16 KiB or the journal is refused, unparsed."""
    pid = dead_pid()
    resource_ = {f"k{i}": "v" * 40 for i in range(8_000)}
    meta = json.dumps({"host": socket.gethostname(), "resource": resource_}).encode()
    crafted_journal(
        tmp_path / f"otel-gpu-{pid}-00000004.journal",
        pid,
        header_size=len(meta) + 4096,
        meta=meta,
    )
    (outcome,) = recover.recover(None, str(tmp_path), timeout=5)
    assert outcome.state == "invalid"
    assert outcome.detail.startswith("its header claims a ") and "otel-gpu writes 16384" in (
        outcome.detail
    ), outcome.detail


def test_the_command_names_the_file_and_the_limit_in_one_line(tmp_path):
    """The refusal as a user reads it: one line, the journal's path, the limit; exit 0 (nothing
    was lost: the file was never a journal), no traceback."""
    jdir = tmp_path / "journal"
    jdir.mkdir(mode=0o700)
    pid = dead_pid()
    path = crafted_journal(
        jdir / f"otel-gpu-{pid}-00000005.journal", pid, count=1 << 16, size=2 << 20
    )
    done = otel_gpu_command(
        ["recover"],
        without_otel(OTEL_GPU_JOURNAL_DIR=str(jdir), OTEL_GPU_LOGDEST=str(tmp_path / "o.jsonl")),
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith(str(path))]
    assert "2.0 MiB, larger than any journal otel-gpu writes (1.1 MiB at most)" in line


def test_an_ordinary_journal_within_the_limits_is_still_recovered(tmp_path):
    """The limits are the writer's own: a journal of the largest layout (256 slots of 4 KiB),
    every slot in flight, is recovered in full."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    pid = dead_pid()
    path = crafted_journal(
        tmp_path / f"otel-gpu-{pid}-00000006.journal",
        pid,
        count=writer.SLOTS_LARGE,
        stride=writer.LARGE_SLOT,
        committed=writer.SLOTS_LARGE,
    )
    assert os.path.getsize(path) == reader.MAX_SIZE
    memory = InMemorySpanExporter()
    (outcome,) = recover.recover(
        None, str(tmp_path), processor=SimpleSpanProcessor(memory), timeout=5
    )
    assert (outcome.state, outcome.spans) == ("recovered", writer.SLOTS_LARGE)


# --------------------------------------------------------------------------- planted files


def test_a_fifo_named_like_a_journal_does_not_hang_recover(tmp_path):
    """Attack: a FIFO at ``otel-gpu-<pid>-<hex>.journal``. Opening it for reading used to block
    forever (no writer ever comes); now it is opened non-blocking, named "not a regular file"
    and left alone, and the real journal beside it is still read. The hang guard is the
    child's timeout."""
    pid = dead_pid()
    fifo = tmp_path / f"otel-gpu-{pid}-0000000a.journal"
    os.mkfifo(fifo)
    crafted_journal(tmp_path / f"otel-gpu-{pid}-0000000b.journal", pid)
    lines, _ = recover_in_child(tmp_path, tmp_path, timeout=60)
    assert lines[0] == "invalid not a regular file", lines
    assert lines[1].startswith("recovered"), lines
    assert fifo.exists()
