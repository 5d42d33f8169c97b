"""The asking side of the control channel (``otel-gpu control``): the files' names, which
processes listen, and sending a request and collecting the replies.

It imports neither torch nor the process side (:mod:`otel_gpu.control.channel`, which applies
documents): the command starts in a fraction of a second, even beside a loaded process.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from otel_gpu import _files
from otel_gpu.anomalies import snapshot
from otel_gpu.journal.directory import private_dir

__all__ = [
    "MARKER_SUFFIX",
    "REPLY_LIMIT",
    "REPLY_SUFFIX",
    "REQUEST_LIMIT",
    "REQUEST_SUFFIX",
    "ask",
    "is_listening",
    "listening",
    "marker_path",
    "read_reply",
    "reply_path",
    "request_path",
]

REQUEST_SUFFIX = ".control"
REPLY_SUFFIX = ".control-done"
MARKER_SUFFIX = ".controllable"
REQUEST_LIMIT = 64 * 1024
"""The largest request read, in bytes (a document is a few hundred)."""
_PREFIX = "otel-gpu-"


def request_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{pid}{REQUEST_SUFFIX}")


def reply_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{pid}{REPLY_SUFFIX}")


def marker_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{pid}{MARKER_SUFFIX}")


def listening(directory: str) -> list[int]:
    """Pids of this user's live processes on this host that listen for control in
    ``directory`` (their marker is there; this command excluded)."""
    import glob

    pattern = os.path.join(glob.escape(directory), f"{_PREFIX}*{MARKER_SUFFIX}")
    return snapshot.live_pids(pattern, lambda name: name[len(_PREFIX) : -len(MARKER_SUFFIX)])


def is_listening(directory: str, pid: int) -> bool:
    """Whether ``pid`` left its marker in ``directory`` (a regular file of this user's)."""
    try:
        info = os.lstat(marker_path(directory, pid))
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()


def ask(
    directory: str,
    pids: list[int],
    request: dict[str, Any],
    timeout: float,
    *,
    chosen: bool = True,
) -> list[tuple[int, dict[str, Any] | None]]:
    """Send ``request`` to every pid and wait up to ``timeout`` seconds for the replies (None:
    no reply in time; the request is then withdrawn, so a late process does not apply it).

    ``chosen``: the directory was set (``OTEL_GPU_JOURNAL_DIR``), not the default one, whose
    parent is shared: checked as the journal checks it."""
    private_dir(directory, shared_parent=not chosen)
    data = json.dumps(request).encode()
    for pid in pids:
        try:
            os.unlink(reply_path(directory, pid))
        except FileNotFoundError:
            pass
        # written whole under a fresh name, then renamed: the process never reads half of it
        _files.write_atomic_bytes(directory, os.path.basename(request_path(directory, pid)), data)
    answers = snapshot.collect_replies(
        pids,
        lambda pid: reply_path(directory, pid),
        lambda pid: request_path(directory, pid),
        timeout,
        REPLY_LIMIT,
    )
    return [(pid, answers.get(pid)) for pid in pids]


REPLY_LIMIT = 4 * 1024 * 1024
"""The largest reply read, in bytes: a ``--list`` of a large model's modules runs to a few
hundred KiB."""


def read_reply(path: str) -> dict[str, Any] | None:
    return snapshot.read_reply(path, REPLY_LIMIT)
