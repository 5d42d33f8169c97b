"""Where replay imports code from: never the current directory, never a dump folder.

A dump is data someone may have sent. Python puts the current directory first on the import
path for ``python -m`` and ``python -c``; run from inside a dump folder, a ``json.py`` or a
``psutil.py`` it ships would be imported instead of the real module (or where the real one is
not installed). So replay's import path is the process's own, minus:

- ``""`` and the current directory that Python put first (for ``-m``/``-c``), and
- every entry that is a replayed folder or lies inside one (however it got there, an explicit
  ``PYTHONPATH`` included).

Modules of the user's own project are found through ``PYTHONPATH`` or ``--path DIR``
(appended, so they never shadow installed modules). An isolated call runs in a child started
with ``-I`` (no current directory, no ``PYTHON*`` variables, no user site), whose import path
is set to this process's cleaned one before anything else is imported.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

__all__ = ["add_paths", "child_command", "clean", "entries", "inside"]

_BOOT = (
    "import sys,json;sys.path[:]=json.loads(sys.argv[1]);del sys.argv[1];"
    "from otel_gpu.cli import main;sys.exit(main(sys.argv[1:]))"
)
"""The isolated child's first code: its import path, then the command line (nothing else runs
before: ``-I`` leaves only the standard library's start-up imports)."""


def inside(path: str, folders: Sequence[str]) -> bool:
    """Whether ``path`` is one of ``folders`` or lies below one (symbolic links resolved)."""
    real = os.path.realpath(path)
    for folder in folders:
        top = os.path.realpath(folder)
        if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
            return True
    return False


def entries(dumps: Sequence[str], path: Sequence[str] | None = None) -> list[str]:
    """``path`` (default ``sys.path``) as absolute entries, without ``""`` and without any
    entry inside ``dumps``."""
    out: list[str] = []
    for entry in sys.path if path is None else path:
        if not isinstance(entry, str) or not entry or inside(entry, dumps):
            continue
        full = os.path.abspath(entry)
        if full not in out:
            out.append(full)
    return out


def clean(dumps: Sequence[str]) -> None:
    """Make this process's import path one replay may use: the entry Python added for the
    current directory (``""``, or the directory itself first for ``-m``/``-c``) and every entry
    inside ``dumps`` are removed."""
    if sys.path and not getattr(sys.flags, "safe_path", False):
        first = sys.path[0]
        if first == "" or (os.path.isdir(first) and os.path.samefile(first, os.getcwd())):
            del sys.path[0]
    sys.path[:] = [p for p in sys.path if isinstance(p, str) and p and not inside(p, dumps)]


def add_paths(folders: Sequence[str], dumps: Sequence[str]) -> str | None:
    """Append the user's ``--path`` folders (absolute) to the import path; a message naming
    the first one that is not a folder or lies inside a dump, else None."""
    for folder in folders:
        if not os.path.isdir(folder):
            return f"--path {folder}: not a directory (--path names a folder of your modules)"
        if inside(folder, dumps):
            return (
                f"--path {folder}: it is inside the dump being replayed; replay never imports "
                "code from a dump (name the folder of your own modules)"
            )
    for folder in folders:
        full = os.path.abspath(folder)
        if full not in sys.path:
            sys.path.append(full)
    return None


def child_command(argv: Sequence[str], dumps: Sequence[str]) -> list[str]:
    """``python -I`` running ``otel-gpu ARGV`` with this process's import path, cleaned."""
    return [sys.executable, "-I", "-c", _BOOT, json.dumps(entries(dumps)), *argv]
