"""A crash-journal folder (``OTEL_GPU_JOURNAL_DIR``) that other users can write in or own.

Whoever can write in the folder can plant files at the names otel-gpu opens: a FIFO where the
snapshot reply or its temporary file goes, a journal named after a live process. The promises:
nothing otel-gpu opens there blocks (non-blocking, no symlink followed, a regular file of this
user's or nothing), a chosen folder owned by another user or writable by others is refused (the
journal is then off, with one warning, and the program runs on), and ``snapshot --all`` asks only
this user's processes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from commands import otel_gpu_command, python_command, without_otel

import otel_gpu
from otel_gpu.anomalies import snapshot

needs_root = pytest.mark.skipif(
    not hasattr(os, "getuid") or os.getuid() != 0, reason="plays another user with chown/setuid"
)
OTHER_UID = 4321


def _sleeper(**kwargs: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], **kwargs)  # type: ignore[call-overload]


def test_a_fifo_planted_at_the_reply_path_does_not_hang_snapshot(tmp_path: Path) -> None:
    """Attack: while ``otel-gpu snapshot PID --timeout 3`` waits, a FIFO is planted (again and
    again) at ``otel-gpu-<pid>.snapshot-done``. Opening it used to block the command forever,
    past its timeout; now the reply is opened non-blocking and a non-regular file is no reply:
    the command ends after its timeout with exit 1. (The child's timeout is the hang guard.)"""
    journal = tmp_path / "journal"
    journal.mkdir(mode=0o700)
    target = _sleeper()
    reply = snapshot.reply_path(str(journal), target.pid)
    stop = threading.Event()

    def plant() -> None:
        while not stop.is_set():
            try:
                os.mkfifo(reply)
            except FileExistsError:
                pass
            time.sleep(0.001)

    planter = threading.Thread(target=plant, daemon=True)
    planter.start()
    try:
        done = python_command(
            ["-m", "otel_gpu", "snapshot", str(target.pid), "--timeout", "3"],
            env=without_otel(OTEL_GPU_JOURNAL_DIR=str(journal)),
            timeout=60,
        )
    finally:
        stop.set()
        planter.join()
        target.kill()
        target.wait()
    assert done.returncode == 1, done.stderr
    assert f"pid {target.pid} did not answer within 3 s" in done.stderr


def test_a_fifo_at_the_reply_files_old_temporary_name_does_not_block_the_export_thread(
    otel_gpu_spans, tmp_path: Path
) -> None:
    """Attack: a FIFO at ``<reply>.<pid>.tmp``, the temporary name the responder used to open
    for writing (which blocks until a reader comes, stalling the export thread). The reply is
    now written under a fresh random name: the answer completes and the reply is read back."""
    journal = tmp_path / "journal"
    otel_gpu_spans(level=1, journal_dir=str(journal))
    otel_gpu.api(lambda: None)()
    from otel_gpu.export import pipeline

    pipe = pipeline.get()
    assert pipe is not None
    responder = snapshot.Responder(pipe.settings, pipe)
    reply = snapshot.reply_path(responder.directory, os.getpid())
    fifo = f"{reply}.{os.getpid()}.tmp"
    os.mkfifo(fifo)
    answered = threading.Thread(target=responder.answer, args=(None,), daemon=True)
    answered.start()
    answered.join(60)
    if answered.is_alive():  # the old code: unblock it before failing
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        answered.join(5)
        pytest.fail("the responder blocked opening a FIFO planted in the journal folder")
    assert snapshot._read_reply(reply) is not None


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_journal_folder_others_may_write_in_turns_the_journal_off_with_one_warning(
    otel_gpu_spans, tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int
) -> None:
    """A chosen OTEL_GPU_JOURNAL_DIR writable by group or others (sticky or not) used to be
    used as it was; now the journal is off with one warning naming the folder and the rule,
    and the decorated calls still run and are traced."""
    from otel_gpu import _guard

    _guard.set_strict(False)  # the warning is the behaviour under test
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    spans = otel_gpu_spans(level=1, journal_dir=str(shared))
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):

        @otel_gpu.api
        def work(x: int) -> int:
            return x + 1

        assert [work(1), work(2)] == [2, 3]
        otel_gpu.flush()
    assert len(spans.get()) == 2
    assert [p for p in shared.iterdir() if p.name.endswith(".journal")] == []
    warnings = [
        r.getMessage() for r in caplog.records if "crash journal disabled" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert "lets other users write in it" in warnings[0] and str(shared) in warnings[0]


@needs_root
def test_a_journal_folder_of_another_user_is_refused_by_snapshot(tmp_path: Path) -> None:
    """A chosen folder owned by another uid: ``otel-gpu snapshot`` refuses to write its request
    there (exit 2, one line naming the folder and the owner) instead of trusting it."""
    shared = tmp_path / "theirs"
    shared.mkdir(mode=0o700)
    os.chown(shared, OTHER_UID, -1)
    target = _sleeper()
    try:
        done = otel_gpu_command(
            ["snapshot", str(target.pid), "--timeout", "1"],
            without_otel(OTEL_GPU_JOURNAL_DIR=str(shared)),
        )
    finally:
        target.kill()
        target.wait()
    assert done.returncode == 2, done.stderr
    assert f"belongs to uid {OTHER_UID}, not to this user" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert list(shared.iterdir()) == []


@needs_root
def test_snapshot_all_lists_only_this_users_processes(tmp_path: Path) -> None:
    """Attack: in a shared folder, a journal file of another user's (named after a live pid),
    and a journal of ours named after another user's live process. ``--all`` used to list (and
    ask) both; now neither."""
    journal = tmp_path / "journal"
    journal.mkdir(mode=0o700)
    ours = _sleeper()
    theirs = subprocess.Popen(["sleep", "600"], user=OTHER_UID)  # the venv's python is ours
    try:
        planted = journal / f"otel-gpu-{ours.pid}-00000001.journal"
        planted.write_bytes(b"x")
        os.chown(planted, OTHER_UID, -1)
        (journal / f"otel-gpu-{theirs.pid}-00000002.journal").write_bytes(b"x")
        assert snapshot.live_processes(str(journal)) == []
        (journal / f"otel-gpu-{ours.pid}-00000003.journal").write_bytes(b"x")
        assert snapshot.live_processes(str(journal)) == [ours.pid]
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", ["fifo", "other user's file", "directory"])
def test_a_reply_that_is_not_a_small_regular_file_of_ours_is_no_reply(
    tmp_path: Path, kind: str
) -> None:
    """The reply reader takes only a regular file of this user's: a FIFO (opened non-blocking),
    a file of another uid, or a directory is not a reply, and none blocks."""
    path = tmp_path / "otel-gpu-1.snapshot-done"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        if os.getuid() != 0:
            pytest.skip("needs root to chown")
        path.write_text('{"pid": 1}')
        os.chown(path, OTHER_UID, -1)
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(snapshot._read_reply(str(path))))
    worker.daemon = True
    worker.start()
    worker.join(30)
    if worker.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading the reply blocked")
    assert result == [None]
