"""The control channel: ``otel-gpu control PID`` asks a live process through files, as
``otel-gpu snapshot`` does (docs/control.md, Security).

In a process with ``OTEL_GPU_CONTROL=on``, the first armed function starts one daemon
thread, ``otel-gpu-control``, which every 100 ms ``lstat``s ``otel-gpu-<pid>.control`` in the
crash journal's directory (``OTEL_GPU_JOURNAL_DIR``, private to the user, 0700). It does not
wait for the export thread: a process at armed level 0 has none. On start it leaves a marker,
``otel-gpu-<pid>.controllable``, by which ``otel-gpu control --all`` finds the processes that
listen, and removes it at exit.

A request is a small JSON object written whole (under a temporary name, then renamed)::

    {"from": 4242, "show": true}
    {"from": 4242, "list": true}
    {"from": 4242, "document": {"level": 5, "include": ["mylib.*"], "for": "2m"}}
    {"from": 4242, "document": {"level": 5, "include": ["*layers.1.mlp"]}, "dry_run": true}

The process removes it, answers in ``otel-gpu-<pid>.control-done`` (written under a fresh name,
then renamed)::

    {"pid": 17, "applied": true, "effective": {...}}
    {"pid": 17, "applied": true, "functions": [{"name": ..., "qualified": ..., "level": 0}, ...]}
    {"pid": 17, "applied": false, "dry_run": true, "preview": {"selected": [...], ...}}
    {"pid": 17, "applied": false, "refused": "level must be one of 0, 1, 3, 5, 10, not 7"}

A document whose globs select no controllable function is refused, naming the closest names
(:mod:`otel_gpu.control.names`). The asking side (the files' names, ``ask``) is
:mod:`otel_gpu.control.ask`, which the command imports without this module or torch.

The rules are the snapshot's: only a regular file of this user's, at most 64 KiB, opened
without following a link or blocking on a FIFO, is read; anything else is removed unread. The
document goes through :func:`otel_gpu.control.document.parse`: it sets levels, globs, a ratio
and sizes, and nothing in it names a path or runs code. A request that is not such an object is
refused with the reason.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import stat
import threading
from typing import Any

from otel_gpu import _files, _guard
from otel_gpu.config import Settings
from otel_gpu.control import document, names, state
from otel_gpu.control.ask import (
    MARKER_SUFFIX,
    REPLY_SUFFIX,
    REQUEST_LIMIT,
    REQUEST_SUFFIX,
    ask,
    is_listening,
    listening,
    marker_path,
    read_reply,
    reply_path,
    request_path,
)

__all__ = [
    "MARKER_SUFFIX",
    "REPLY_SUFFIX",
    "REQUEST_LIMIT",
    "REQUEST_SUFFIX",
    "Listener",
    "answer",
    "ask",
    "is_listening",
    "listening",
    "marker_path",
    "reply_path",
    "request_path",
    "running",
    "start",
]

_POLL = 0.1  # seconds between lstat()s: one failed system call per poll when nothing is asked


class Listener:
    """The thread that answers control requests for this process."""

    def __init__(self, directory: str) -> None:
        self.pid = os.getpid()
        self.directory = directory
        self.request = request_path(directory, self.pid)
        self.answered = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="otel-gpu-control", daemon=True)

    def start(self) -> None:
        _mark(self.directory, self.pid)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(_POLL):
            if os.getpid() != self.pid:
                return
            try:
                self.check()
            except Exception as exc:  # never let the thread die on one bad request
                _guard.internal_error("control", exc)

    def check(self) -> bool:
        """Answer the request waiting, if there is one; True when one was answered."""
        try:
            info = os.lstat(self.request)
        except OSError:
            return False  # the usual case
        if stat.S_ISDIR(info.st_mode):
            _clear_directory(self.request)  # it would block every later request: moved away
            return False
        raw = _read_request(self.request, info)
        try:
            os.unlink(self.request)
        except OSError:
            return False
        if raw is None:
            return False  # not a small regular file of this user's: removed unread
        reply = answer(raw)
        reply["pid"] = self.pid
        reply_at = reply_path(self.directory, self.pid)
        if os.path.isdir(reply_at) and not os.path.islink(reply_at):
            _clear_directory(reply_at)  # a file cannot be renamed over it
        _files.write_atomic_bytes(
            self.directory,
            os.path.basename(reply_path(self.directory, self.pid)),
            json.dumps(reply).encode(),
        )
        self.answered += 1
        return True


def answer(raw: bytes) -> dict[str, Any]:
    """The reply to one request's bytes: applied (with the configuration in force) or refused
    (with the reason). Nothing is applied unless the whole document is valid."""
    try:
        request = json.loads(raw, object_pairs_hook=_unique)
    except _Duplicate as exc:
        return _refused(f"{exc} is named twice in the request: every field once")
    except (ValueError, RecursionError):
        return _refused("the request is not JSON")
    if not isinstance(request, dict):
        return _refused("the request is not a JSON object")
    unknown = sorted(str(k) for k in request if k not in _FIELDS)
    if unknown:
        return _refused(
            f"unknown request field {document._show(unknown[0])}: a request has "
            + ", ".join(_FIELDS)
        )
    sender = request.get("from")
    if sender is not None and (isinstance(sender, bool) or not isinstance(sender, int)):
        return _refused(f"from must be the asking process's pid, not {document._show(sender)}")
    for flag in ("show", "list", "dry_run"):
        if flag in request and not isinstance(request[flag], bool):
            return _refused(f"{flag} must be true or false, not {document._show(request[flag])}")
    source = "otel-gpu control" + (f" (pid {sender})" if sender is not None else "")
    if request.get("show") is True and "document" not in request:
        return {"applied": True, "effective": state.effective()}
    if request.get("list") is True and "document" not in request:
        return {"applied": True, "functions": names.listing()}
    if "document" not in request:
        return _refused("a request holds list=true, show=true or a document")
    try:
        change = document.parse(request["document"])
        refusal = names.unmatched(change)
        if refusal is not None:
            return _refused(refusal)
        if request.get("dry_run") is True:
            return {"applied": False, "dry_run": True, "preview": names.preview(change)}
        effective = state.apply(change, source)
    except document.ControlError as exc:
        return _refused(str(exc))
    return {"applied": True, "effective": effective}


_FIELDS = ("from", "show", "list", "document", "dry_run")


class _Duplicate(Exception):
    """A JSON object names a field twice (as OpAMP, a request is refused for it)."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(document._show(key))
        out[key] = value
    return out


def _refused(reason: str) -> dict[str, Any]:
    return {"applied": False, "refused": reason}


def _clear_directory(path: str) -> None:
    """A directory planted at a request's or reply's name: removed when empty, else renamed to
    a fresh hidden name beside it (its contents are never read or followed), so control of this
    process is not blocked; one warning says where it went."""
    try:
        os.rmdir(path)
        return
    except OSError:
        pass
    aside = os.path.join(
        os.path.dirname(path), f".{os.path.basename(path)}.planted-{secrets.token_hex(4)}"
    )
    try:
        os.rename(path, aside)
    except OSError as exc:
        _guard.warn_once(
            "control.planted_dir",
            "otel-gpu: a directory sits at %s, where control requests go, and cannot be moved "
            "(%s): remove it to control this process",
            path,
            exc,
        )
        return
    _guard.warn_once(
        "control.planted_dir",
        "otel-gpu: a directory sat at %s, where control requests go; moved to %s",
        path,
        aside,
    )


def _read_request(path: str, info: os.stat_result) -> bytes | None:
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size > REQUEST_LIMIT:
        return None
    return _files.read_own_file(path, REQUEST_LIMIT)  # checked again on what was opened


def _mark(directory: str, pid: int) -> None:
    """Leave the marker ``--all`` finds (best effort: without it, the pid must be named)."""
    try:
        _files.write_atomic_bytes(
            directory, os.path.basename(marker_path(directory, pid)), str(pid).encode()
        )
    except OSError:
        return
    atexit.register(_unmark, directory, pid)


def _unmark(directory: str, pid: int) -> None:
    if os.getpid() != pid:
        return
    try:
        os.unlink(marker_path(directory, pid))
    except OSError:
        pass


_lock = threading.Lock()
_listener: Listener | None = None


def running() -> Listener | None:
    """This process's listener, if one runs."""
    listener = _listener
    return listener if listener is not None and listener.pid == os.getpid() else None


def start(settings: Settings) -> Listener | None:
    """Start this process's listener once (``OTEL_GPU_CONTROL=on``); None when the directory
    cannot be used (a warning says why: control then cannot reach this process)."""
    global _listener
    from otel_gpu.journal.directory import journal_dir, private_dir

    with _lock:
        if running() is not None:
            return _listener
        directory = journal_dir(settings)
        try:
            private_dir(directory, shared_parent=not settings.journal_dir)
        except OSError as exc:
            _guard.logger.warning(
                "otel-gpu: OTEL_GPU_CONTROL=on, but live control cannot listen in %s: %s",
                directory,
                exc,
            )
            return None
        listener = Listener(directory)
        listener.start()
        _listener = listener
        return listener


def _after_fork_in_child() -> None:
    # The parent's thread stays with the parent: a child that inherited a listener gets its own.
    global _lock, _listener
    _lock = threading.Lock()
    parent, _listener = _listener, None
    if parent is not None:
        try:
            child = Listener(parent.directory)
            child.start()
            _listener = child
        except Exception as exc:
            _guard.internal_error("control", exc)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _read_reply(path: str) -> dict[str, Any] | None:
    return read_reply(path)
