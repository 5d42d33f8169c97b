"""Where the crash journal and the live files (snapshot and control requests) go: the
directory rule and its checks. No torch: ``otel-gpu control`` and ``otel-gpu snapshot`` use it
to find a process without importing what the journal's writer needs."""

from __future__ import annotations

import os
import stat
import tempfile

from otel_gpu import _files
from otel_gpu.config import Settings, runtime_dir

__all__ = ["default_dir", "journal_dir", "private_dir"]


def default_dir() -> str:
    """``$XDG_RUNTIME_DIR/otel-gpu`` when that variable names a directory, else ``<tmp>/otel-gpu-<uid>``.

    ``<tmp>`` is :func:`tempfile.gettempdir` (``$TMPDIR``, else ``/tmp``). The same rule in
    ``otel-gpu recover`` finds the journals when it runs with the dead program's environment.
    """
    runtime = runtime_dir()
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return os.path.join(runtime, "otel-gpu")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"otel-gpu-{uid}")


def journal_dir(settings: Settings) -> str:
    """Where this process's journal goes: ``OTEL_GPU_JOURNAL_DIR``, else :func:`default_dir`."""
    if settings.journal_dir:
        return os.path.abspath(os.path.expanduser(settings.journal_dir))
    return default_dir()


def private_dir(path: str, shared_parent: bool) -> None:
    """Create ``path`` 0700, and its missing parents 0700 too (whatever the umask); refuse a
    default directory another user created or a symlink, and a chosen one
    (``OTEL_GPU_JOURNAL_DIR``) that another user owns or may write in.

    In a shared ``/tmp`` anybody could create ``otel-gpu-<uid>`` first, so a default
    directory must be a real directory owned by us; its mode is tightened to 0700. A chosen
    directory is the user's to name (it may be a symlink) and is never chmod'ed, but whoever can
    write in it can plant files where the journal and the snapshot files go: it must be owned by
    this user, with no write permission for group or others.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        _files.make_dirs(path)  # os.makedirs would give the parents 0777 & ~umask
    info = os.lstat(path) if shared_parent else os.stat(path)  # a chosen dir may be a symlink
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{path!r} is not a directory")
    if shared_parent and hasattr(os, "getuid"):
        if info.st_uid != os.getuid():
            raise PermissionError(f"{path!r} belongs to uid {info.st_uid}, not to this user")
        if info.st_mode & 0o077:
            os.chmod(path, 0o700)
    elif hasattr(os, "getuid"):
        if info.st_uid != os.getuid():
            raise PermissionError(
                f"{path!r} belongs to uid {info.st_uid}, not to this user: "
                "OTEL_GPU_JOURNAL_DIR must be a directory of your own"
            )
        if info.st_mode & 0o022:
            raise PermissionError(
                f"{path!r} (mode {stat.S_IMODE(info.st_mode):04o}) lets other users write in it: "
                "OTEL_GPU_JOURNAL_DIR must not be group- or world-writable (chmod 700 it)"
            )
