"""Snapshots: ``otel-gpu snapshot PID`` makes a live otel-gpu process export its state now.

The mechanism is a control file, polled by the export thread (which wakes every ~100 ms, an
``lstat`` each time): the command creates ``otel-gpu-<pid>.snapshot`` in the crash journal's
directory (private to the user, 0700), the process sees it on its next drain, removes it,
exports one span named ``otel_gpu.snapshot`` and flushes it at once, then writes
``otel-gpu-<pid>.snapshot-done`` (the span's ids, as JSON) for the command to read.

The span holds one ``otel_gpu.thread_stack`` event per Python thread (the stuck-call report's
events, :func:`otel_gpu.anomalies.watchdog.add_thread_stacks`), one ``otel_gpu.call_in_flight``
event per call in flight with its inputs as the crash journal has them, and, when the ring is
on, the directory of a ring dump (the ring's completed calls).

Only the same user can ask: the directory is the user's own (``OTEL_GPU_JOURNAL_DIR`` must be
owned by the user and writable by nobody else), and a request file owned by another uid, or not
a regular file, is ignored. Nothing blocks on a file planted in the directory: the reply is
written under a fresh random name (exclusive, no symlink followed) and renamed into place, and
the command opens a reply non-blocking and reads it only if it is a small regular file of its
own user's. ``--all`` lists only this user's processes. No signal is used, so none is taken from
the application.

What it cannot see: it runs on the export thread, so it needs the GIL for a moment. A thread
stuck in C code while it holds the GIL (a C extension that never releases it) stops the export
thread too: the request is answered when the GIL is released, or never; the command then says
that the process did not answer. Stacks are Python stacks only: a thread inside a C or CUDA call
shows the Python line that called it.
"""

from __future__ import annotations

import glob
import json
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from otel_gpu import _files, _guard
from otel_gpu.attributes import (
    CALL_NAME,
    CALL_SECONDS,
    CALL_SPAN_ID,
    EVENT_CALL_IN_FLIGHT,
    INPUT_PREFIX,
    RING_DUMP_DIR,
    SNAPSHOT,
    SNAPSHOT_CALLS,
    SNAPSHOT_REQUESTED_BY,
    SNAPSHOT_SPAN_NAME,
    THREAD_ID,
)
from otel_gpu.config import Settings
from otel_gpu.core.plan import Plan
from otel_gpu.core.record import CallSpan, standalone

if TYPE_CHECKING:
    from otel_gpu.core.protocols import Host

__all__ = [
    "REQUEST_SUFFIX",
    "Reply",
    "Responder",
    "collect_replies",
    "live_pids",
    "live_processes",
    "read_reply",
    "reply_path",
    "request",
    "request_path",
]

REQUEST_SUFFIX = ".snapshot"
REPLY_SUFFIX = ".snapshot-done"
_PREFIX = "otel-gpu-"


def request_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{pid}{REQUEST_SUFFIX}")


def reply_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{pid}{REPLY_SUFFIX}")


class Responder:
    """On the export thread, after each drain: answer a snapshot request, if there is one."""

    def __init__(self, settings: Settings, pipeline: Host) -> None:
        from otel_gpu.journal.directory import journal_dir

        self.pid = os.getpid()
        self.level = settings.level
        self.limit = settings.repr_limit
        self.pipeline = pipeline
        self.directory = journal_dir(settings)
        self.request = request_path(self.directory, self.pid)
        self.answered = 0
        pipeline.add_after_drain(self.check)

    def check(self) -> None:
        if os.getpid() != self.pid:
            return  # a fork child: its own pipeline has its own responder
        try:
            info = os.lstat(self.request)
        except OSError:
            return  # the usual case: one failed lstat per drain
        requested_by = _requester(self.request, info)
        try:
            os.unlink(self.request)
        except OSError:
            return
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return  # only the same user may ask, with a plain file
        self.answer(requested_by)

    def answer(self, requested_by: int | None) -> None:
        """Build and export the snapshot span now, then write the reply file."""
        from otel_gpu.anomalies.watchdog import add_thread_stacks

        now = time.time_ns()
        record = standalone(Plan(SNAPSHOT_SPAN_NAME, self.level), now)  # a snapshot span
        ctx = record.span.get_span_context()
        threads = add_thread_stacks(record.span, None, now)
        calls = self._calls_in_flight(record.span, now)
        attrs: dict[str, Any] = {SNAPSHOT: True}
        if calls is not None:  # None: no crash journal, so the calls in flight are not known
            attrs[SNAPSHOT_CALLS] = calls
        if requested_by is not None:
            attrs[SNAPSHOT_REQUESTED_BY] = requested_by
        ring = self.pipeline.ring
        if ring is not None:
            directory = ring.dump("snapshot", None)
            if directory is not None:
                attrs[RING_DUMP_DIR] = directory
        record.span.set_attributes(attrs)
        self.pipeline.export_now(record)
        self.answered += 1
        reply = {
            "pid": self.pid,
            "trace_id": format(ctx.trace_id, "032x"),
            "span_id": format(ctx.span_id, "016x"),
            "threads": threads,
            "calls_in_flight": calls,
            "ring_dump": attrs.get(RING_DUMP_DIR),
        }
        _write_reply(reply_path(self.directory, self.pid), reply)

    def _calls_in_flight(self, span: CallSpan, now: int) -> int | None:
        """One event per call this process's journal has in flight, inputs as journaled; None
        when the process keeps no journal."""
        from otel_gpu.journal import reader, recover, writer

        journals = [j for j in writer.open_journals() if j.pid == self.pid]
        if not journals:
            return None
        count = 0
        for journal in journals:
            try:
                spans = recover.spans_of(reader.read(journal.path), self.limit)
            except (OSError, ValueError) as exc:
                _guard.internal_error("snapshot", exc)
                continue
            for s in spans:
                attrs: dict[str, Any] = {
                    CALL_NAME: s.name,
                    CALL_SPAN_ID: format(s.context.span_id, "016x"),
                    CALL_SECONDS: round((now - (s.start_time or now)) / 1e9, 3),
                }
                for key, value in (s.attributes or {}).items():
                    if key.startswith(INPUT_PREFIX) or key == THREAD_ID:
                        attrs[key] = value
                span.add_event(EVENT_CALL_IN_FLIGHT, attrs, now)
                count += 1
        return count


def _requester(path: str, info: os.stat_result) -> int | None:
    """The pid the request file names (the command writes its own), if it is one."""
    if not stat.S_ISREG(info.st_mode) or info.st_size > 32:
        return None
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except OSError:
        return None
    try:
        text = os.read(fd, 32).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isascii() and text.isdigit() else None


def _write_reply(path: str, reply: dict[str, Any]) -> None:
    # A fresh random name, created exclusively: a FIFO planted at a predictable temporary name
    # would block the export thread in open().
    data = json.dumps(reply).encode()
    _files.write_atomic_bytes(os.path.dirname(path), os.path.basename(path), data)


# --------------------------------------------------------------------------- the requesting side


@dataclass
class Reply:
    """What one process answered (``answer`` None: it did not answer in time)."""

    pid: int
    answer: dict[str, Any] | None


def live_processes(directory: str) -> list[int]:
    """Pids of this user's live otel-gpu processes on this host: those whose crash journal is
    in ``directory`` and whose process runs (this command excluded)."""
    pattern = os.path.join(glob.escape(directory), f"{_PREFIX}*.journal")
    return live_pids(pattern, lambda name: name[len(_PREFIX) :].split("-", 1)[0])


def live_pids(pattern: str, pid_text: Callable[[str], str]) -> list[int]:
    """The pids named by the files matching the glob ``pattern`` (``pid_text`` takes a file's
    name to its pid's digits) that are this user's files and live processes of this user, this
    command excluded: how ``snapshot --all`` and ``control --all`` find their processes."""
    from otel_gpu.journal import recover

    pids = set()
    for path in glob.glob(pattern):
        head = pid_text(os.path.basename(path))
        if not (head.isascii() and head.isdigit()) or int(head) == os.getpid():
            continue
        try:  # in a shared directory, other users' files (and their pids) are not ours
            if os.lstat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if recover.pid_state(int(head)) == "alive" and same_user(int(head)):
            pids.add(int(head))
    return sorted(pids)


def same_user(pid: int) -> bool:
    """Whether ``pid`` runs as this user (``/proc``; elsewhere, whether a null signal is allowed)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return False
    except OSError:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def request(directory: str, pids: list[int], timeout: float, *, chosen: bool = True) -> list[Reply]:
    """Ask every pid for a snapshot and wait up to ``timeout`` seconds for their replies.

    ``chosen``: the directory was set (``OTEL_GPU_JOURNAL_DIR``), not the default one, whose
    parent is shared: checked as the journal checks it."""
    from otel_gpu.journal.directory import private_dir

    private_dir(directory, shared_parent=not chosen)
    for pid in pids:
        for stale in (reply_path(directory, pid), request_path(directory, pid)):
            try:
                os.unlink(stale)
            except FileNotFoundError:
                pass
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(request_path(directory, pid), flags, 0o600)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)
    answers = collect_replies(
        pids,
        lambda pid: reply_path(directory, pid),
        lambda pid: request_path(directory, pid),
        timeout,
        _REPLY_LIMIT,
    )
    return [Reply(pid, answers.get(pid)) for pid in pids]


_REPLY_LIMIT = 64 * 1024  # a reply is a few hundred bytes of JSON


def collect_replies(
    pids: list[int],
    reply_at: Callable[[int], str],
    request_at: Callable[[int], str],
    timeout: float,
    limit: int,
) -> dict[int, dict[str, Any]]:
    """Wait up to ``timeout`` seconds for each pid's JSON reply at ``reply_at(pid)`` (a regular
    file of this user's, at most ``limit`` bytes: :func:`read_reply`); a request left unanswered
    is withdrawn (``request_at(pid)`` removed), so a late process does not act on it. The file
    channel of ``otel-gpu snapshot`` and ``otel-gpu control``."""
    answers: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(answers) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in answers:
                got = read_reply(reply_at(pid), limit)
                if got is not None:
                    answers[pid] = got
        time.sleep(0.05)
    for pid in pids:
        if pid not in answers:
            try:
                os.unlink(request_at(pid))
            except FileNotFoundError:
                pass
    return answers


def _read_reply(path: str) -> dict[str, Any] | None:
    return read_reply(path, _REPLY_LIMIT)


def read_reply(path: str, limit: int) -> dict[str, Any] | None:
    """The JSON object at ``path`` once it is there (then removed); None until then, and for
    anything but a regular file of this user's of at most ``limit`` bytes (a FIFO planted there
    must not block the wait in open())."""
    data = _files.read_own_file(path, limit)
    if data is None:
        return None
    try:
        got = json.loads(data)
    except (ValueError, RecursionError):
        return None
    try:
        os.unlink(path)
    except OSError:
        pass
    return got if isinstance(got, dict) else None
