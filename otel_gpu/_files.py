"""Creating otel-gpu's folders and files safely: private modes, no symlink followed, atomic names.

The flight recorder, the ring, the module-state writer and the crash journal write below folders
that may sit in a shared place (``/tmp``, a project folder). Someone who can write there could
plant a symlink at a name otel-gpu is about to create, hoping otel-gpu writes through it (into a
file of the victim's), or makes the result world-readable. So the folders and the dump files
otel-gpu creates go through this module (the journal opens its mmapped file itself, with the
same exclusive, no-follow, 0600 create):

* Folders otel-gpu creates are 0700 whatever the umask, parents included (``os.makedirs`` gives
  the parents ``0777 & ~umask``). Creating a folder never follows a symlink: ``mkdir`` fails on
  any existing name, a link included. An existing folder that is otel-gpu's by name (``modules/``)
  must be a real folder owned by this user, and is tightened to 0700; a folder the user named
  (the dump dir) is never chmod'ed: when other users can reach it, one warning says so.
* Files are written to a temporary name in their target folder, created with
  ``O_CREAT|O_EXCL|O_NOFOLLOW`` and mode 0600 (never looser, whatever the umask), with 64 random
  bits in the name, and renamed into place. A symlink at the final name is **replaced** (the link
  itself, as ``rename`` does); its target is never opened or written. A writer that takes a path
  (safetensors) writes inside a new 0700 folder nobody else can enter, then the file is checked
  and renamed the same way.

Trace files (JSON Lines and text destinations) are not created here: they follow the umask, as
log files do.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from typing import BinaryIO

from otel_gpu import _guard

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "fsync_dir",
    "make_dir",
    "make_dirs",
    "own_dir",
    "touch",
    "warn_if_shared",
    "write_atomic",
    "write_atomic_bytes",
    "write_atomic_path",
]

DIR_MODE = 0o700
"""Mode of every folder otel-gpu creates."""
FILE_MODE = 0o600
"""Mode of every file otel-gpu creates (the umask can only remove bits from it)."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC


# --------------------------------------------------------------------------- folders


def make_dir(path: str) -> None:
    """Create the folder ``path``, mode 0700 whatever the umask.

    Exclusive: an existing name (a symlink included) raises :class:`FileExistsError`, so a name
    somebody planted is never used.
    """
    os.mkdir(path, DIR_MODE)
    # A umask only removes bits; one that removes the owner's own would leave us unable to write.
    if stat.S_IMODE(os.lstat(path).st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)


def make_dirs(path: str) -> bool:
    """Create ``path`` and its missing parents, each 0700 whatever the umask; True if ``path`` was
    created here, False when it existed (then see :func:`warn_if_shared`).

    Existing parts of the path are the user's, and followed as given (a dump dir may be a symlink
    to a larger disk). Another process creating the same folders at the same time (ranks sharing
    a dump dir) is no error.
    """
    path = os.path.abspath(path)
    missing: list[str] = []
    probe = path
    while not os.path.isdir(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    created = False
    for folder in reversed(missing):
        try:
            make_dir(folder)
            created = folder == path
        except FileExistsError:
            if not os.path.isdir(folder):  # a file, or a dangling link: not a folder to use
                raise NotADirectoryError(f"{folder!r} exists and is not a directory") from None
    return created


def own_dir(parent: str, name: str) -> str:
    """The folder ``parent/name`` that otel-gpu owns by name (``modules/``): created 0700, or an
    existing one checked: a real folder (not a symlink), owned by this user, tightened to 0700.
    Raises :class:`OSError` saying what is wrong otherwise."""
    path = os.path.join(parent, name)
    try:
        make_dir(path)
        return path
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{path!r} is not a directory (a symlink or a file is refused)")
    if info.st_uid != _uid():
        raise PermissionError(f"{path!r} belongs to uid {info.st_uid}, not to this user")
    if stat.S_IMODE(info.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)  # lstat said it is our own real folder
    return path


def warn_if_shared(path: str, what: str) -> None:
    """One warning (per folder and process) when the existing folder ``path``, which the user
    named, belongs to another user or lets other users in; it is left as it is."""
    try:
        info = os.stat(path)
    except OSError:
        return  # the write that follows reports it
    mode = stat.S_IMODE(info.st_mode)
    other_owner = info.st_uid != _uid()
    if not (mode & 0o077 or other_owner):
        return
    if other_owner:
        who = f"belongs to uid {info.st_uid}, who can change anything in it"
    elif mode & 0o022 and not mode & stat.S_ISVTX:
        who = "lets other users list, remove or replace what otel-gpu writes there"
    else:
        who = "lets other users list what otel-gpu writes there"
    _guard.warn_once(
        f"files.shared:{path}",
        "otel-gpu: the %s %s (mode %s) %s. Files are created 0600 in 0700 folders and never "
        "through a symlink; otel-gpu leaves the folder's mode alone: chmod 700 it or choose a "
        "private folder. Reported once.",
        what,
        path,
        oct(mode)[2:].zfill(4),
        who,
    )


# --------------------------------------------------------------------------- files


_written = [0]  # bytes of every file written atomically (the flight recorder's dumps)
_written_lock = threading.Lock()


def bytes_written() -> int:
    """Bytes this process wrote through :func:`write_atomic` and its variants: the flight
    recorder's tensor files and manifests (also the ring's and CUDA-graph snapshots' dumps)."""
    return _written[0]


def _count(nbytes: int) -> None:
    with _written_lock:
        _written[0] += nbytes


def write_atomic(
    directory: str,
    name: str,
    write: Callable[[BinaryIO], object],
    fsync: bool = False,
    sync_dir: bool | None = None,
) -> str:
    """Write ``directory/name`` through ``write(f)`` (a binary file, as ``torch.save`` takes): a
    new 0600 file at a random temporary name, renamed into place, so readers see the old file or
    the whole new one. Returns ``name``.

    ``fsync`` fsyncs the file before the rename; ``sync_dir`` (default: ``fsync``) fsyncs the
    folder after it, which makes the rename, and any file renamed there before, durable: callers
    that write several files into one folder fsync it once, with the last.
    """
    tmp = _temp_name(directory, name)
    fd = os.open(tmp, _CREATE, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            nbytes = f.tell()
    except BaseException:
        _discard(tmp)
        raise
    _install(tmp, directory, name, fsync if sync_dir is None else sync_dir)
    _count(nbytes)
    return name


def write_atomic_bytes(
    directory: str, name: str, data: bytes, fsync: bool = False, sync_dir: bool | None = None
) -> str:
    """:func:`write_atomic` for bytes already built (a manifest): written straight to the file
    descriptor, without a file object (a call writes its manifest twice)."""
    tmp = _temp_name(directory, name)
    fd = os.open(tmp, _CREATE, FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        _discard(tmp)
        raise
    _install(tmp, directory, name, fsync if sync_dir is None else sync_dir)
    _count(len(data))
    return name


def _install(tmp: str, directory: str, name: str, sync_dir: bool) -> None:
    """Rename the finished ``tmp`` to ``directory/name`` (a link there is replaced, not followed)."""
    try:
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        _discard(tmp)
        raise
    if sync_dir:
        fsync_dir(directory)


def write_atomic_path(
    directory: str,
    name: str,
    write: Callable[[str], object],
    fsync: bool = False,
    sync_dir: bool | None = None,
) -> str:
    """As :func:`write_atomic`, for writers that take a path (``safetensors.torch.save_file``
    streams to a path and has no file-object API).

    Such a writer opens the path itself, following a link there, so it writes into a folder
    nobody else can enter: a new 0700 folder (an exclusive ``mkdir`` at a random name) inside
    ``directory``. What it left there is opened without following a link and must be a regular
    file of this user's; it is set to 0600 and renamed into place, and the folder removed.
    Returns ``name``.
    """
    private = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=directory)  # 0700
    tmp = os.path.join(private, name)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != _uid():
                raise PermissionError(f"{tmp!r} is not a regular file of this user's")
            if stat.S_IMODE(info.st_mode) != FILE_MODE:
                os.fchmod(fd, FILE_MODE)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        _install(tmp, directory, name, False)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)  # never follows a link inside
        raise
    _count(info.st_size)
    os.rmdir(private)
    if fsync if sync_dir is None else sync_dir:
        fsync_dir(directory)
    return name


def touch(path: str) -> None:
    """Create the empty marker file ``path`` (0600). An existing name, a symlink included, is
    left as it is: the marker is there, and nothing is opened through a link."""
    try:
        os.close(os.open(path, _CREATE, FILE_MODE))
    except FileExistsError:
        pass


def fsync_dir(directory: str) -> None:
    """Make the renames and creations in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_own_file(path: str, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file of this user's of at most ``limit`` bytes,
    checked on what was opened (never following a link, never blocking on a FIFO planted
    there); None for anything else or an error. The file channels of ``otel-gpu snapshot`` and
    ``otel-gpu control`` read requests and replies with it."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != _uid() or info.st_size > limit:
            return None
        return os.read(fd, limit + 1)[:limit]
    except OSError:
        return None
    finally:
        os.close(fd)


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0  # Windows: st_uid is 0 too


def _temp_name(directory: str, name: str) -> str:
    return os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")


def _discard(path: str) -> None:
    try:
        os.unlink(path)  # unlinks a link itself, never its target
    except OSError:
        pass
