"""``OTEL_GPU_WORKLOADS_DIR``: one definition per (function, input signature), written at call time.

FlashInfer's trace dump writes a definition before a kernel runs; this observer does the same for
every function decorated at level 3 or more, in the format of ``otel-gpu workloads --emit``
(:mod:`otel_gpu.workloads.signature`), and keeps a count per signature::

    DIR/definitions/<function>-<signature>.json   one per signature, whichever process came first
    DIR/counts/<host>-<pid>-<token>.json          {"counts": {"<function>-<signature>": n}}, one
                                                  per process, read back by :func:`read_counts`

- **Before the call, crash-safe.** A new signature's definition is written on the caller's
  thread before the call runs: to a temporary file, fsync'd, then linked to its name only if
  that name is absent (``link`` fails on an existing name), the folder fsync'd. A reader sees no
  file or the whole file; a process killed mid-write leaves a hidden temporary file, never a torn
  definition.
- **Deduplicated across processes.** The first process to link a name wrote it; the others find
  it there and write nothing. Within a process, a signature already seen costs a set lookup: the
  call's raw metadata (a tuple of atoms) is the key, and the signature is computed once per
  distinct metadata (a bounded number of them; past the bound, once per call).
- **Counts without lost updates.** Each process counts in memory and rewrites its own counts file
  (temporary file and rename) from the export thread after each drain (~100 ms) when it changed,
  and at exit; nobody else writes that file, so no update is lost between processes, and
  :func:`read_counts` adds the files up. A process that dies loses the calls since its last
  rewrite (at most about 100 ms of them).
- **Never breaks the call.** A folder that cannot be written (read-only, full disk, a symlinked
  sub-folder): one warning, and the observer turns itself off.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from otel_gpu import _files, _guard
from otel_gpu.attributes import INPUT_PREFIX
from otel_gpu.config import Settings, expand_path
from otel_gpu.core import raw
from otel_gpu.workloads import signature as _sig

if TYPE_CHECKING:
    from otel_gpu.core.plan import Plan
    from otel_gpu.core.protocols import Host
    from otel_gpu.core.record import Call

__all__ = ["COUNTS", "DEFINITIONS", "WorkloadsDir", "make_observer", "read_counts"]

DEFINITIONS = "definitions"
COUNTS = "counts"
_KNOWN_MAX = 4096  # distinct raw metadata remembered; an argument whose repr changes every call
# (an object's address) would otherwise grow the set without bound
_MAX_COUNTS_FILE = 16 << 20  # a counts file larger than this is not ours: skipped when read
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def make_observer(settings: Settings, host: Host) -> WorkloadsDir | None:
    """The observer registry's factory (level 3): None, with one warning, when the folder
    cannot be created."""
    folder = os.path.abspath(os.path.expanduser(expand_path(settings.workloads_dir)))
    try:
        if not _files.make_dirs(folder):
            _files.warn_if_shared(folder, "workloads dir (OTEL_GPU_WORKLOADS_DIR)")
        definitions = _files.own_dir(folder, DEFINITIONS)
        counts = _files.own_dir(folder, COUNTS)
    except OSError as exc:
        _stopped(folder, exc)
        return None
    observer = WorkloadsDir(settings, folder, definitions, counts)
    host.add_after_drain(observer.save_counts)  # the export thread, every ~100 ms
    return observer


def _stopped(folder: str, exc: OSError) -> None:
    _guard.warn_once(
        "workloads_dir",
        "otel-gpu: OTEL_GPU_WORKLOADS_DIR stopped: cannot write below %s (%s). Your program "
        "continues; no more definitions or counts are written by this process.",
        folder,
        exc.strerror or exc,
    )


class WorkloadsDir:
    """The observer: a definition per new signature before the call, a count per call."""

    min_level: int  # set by the observer registry (otel_gpu.export.observers)

    def __init__(self, settings: Settings, folder: str, definitions: str, counts: str) -> None:
        self.folder = folder
        self.definitions = definitions
        self.counts_dir = counts
        self.limit = settings.repr_limit  # values are cut as the span attributes cut them
        self.off = False
        self.pid = os.getpid()
        host = _sig.safe_name(socket.gethostname() or "host")
        self.counts_name = f"{host}-{self.pid}-{secrets.token_hex(4)}.json"
        self._lock = threading.Lock()
        self._saving = threading.Lock()
        self._known: dict[Hashable, str] = {}  # (plan, raw inputs) -> definition name
        self._written: set[str] = set()  # definitions this process wrote or found
        self._counts: dict[str, int] = {}
        self._saved = 0  # calls counted when the counts file was last written
        self._total = 0

    # ------------------------------------------------------------------ caller's thread

    def start(self, call: Call) -> None:
        """Count the call under its signature; write the signature's definition if it is new."""
        inputs = call.inputs
        if self.off or inputs is None:
            return
        try:  # the common case: metadata seen before, one dict lookup
            name = self._known.get((call.plan, inputs))
        except TypeError:  # a payload that cannot be hashed
            name = None
        if name is None:
            name = self._lookup(call.plan, inputs)
            if name is None:
                return
        with self._lock:  # threads calling at once: no increment lost
            self._counts[name] = self._counts.get(name, 0) + 1
            self._total += 1

    def end(self, call: Call) -> None:
        """Nothing: the definition and the count are taken before the call."""

    def _lookup(self, plan: Plan, inputs: Any) -> str | None:
        """Metadata not seen as it is: by its key without objects' addresses, else its
        signature computed (and its definition written if new)."""
        key = _stable_key(plan, inputs)
        name = self._known.get(key) if key is not None else None
        if name is not None:
            return name
        name = self._first(plan.name, inputs)
        if name is not None and key is not None and len(self._known) < _KNOWN_MAX:
            self._known[key] = name
        return name

    def _first(self, function: str, inputs: Any) -> str | None:
        """The name of the signature of ``inputs``, its definition written if new."""
        attrs: dict[str, Any] = {}
        raw.to_attributes(INPUT_PREFIX, inputs, self.limit, attrs)
        fields = _sig.fields_by_path(attrs.items(), INPUT_PREFIX)
        sig = _sig.signature(function, fields)
        sig_id = _sig.signature_id(function, sig)
        name = _sig.definition_name(function, sig_id)
        if name not in self._written:
            body = _sig.definition(function, sig_id, sig, fields, {})
            try:
                _create(self.definitions, f"{name}.json", _sig.encode(body))
            except OSError as exc:
                self._stop(exc)
                return None
            self._written.add(name)
        return name

    def _stop(self, exc: OSError) -> None:
        self.off = True
        _stopped(self.folder, exc)

    # ------------------------------------------------------------------ export thread, exit

    def save_counts(self) -> None:
        """Rewrite this process's counts file when calls were counted since the last time."""
        if self._total == self._saved or os.getpid() != self.pid:
            return  # nothing new; or a forked child, which has its own observer and file
        with self._saving:  # the export thread and close(): the newer counts written last
            with self._lock:
                counts, total = dict(self._counts), self._total
            body = {"format": _sig.FORMAT, "pid": self.pid, "counts": counts}
            try:
                _files.write_atomic_bytes(
                    self.counts_dir, self.counts_name, json.dumps(body).encode("utf-8")
                )
            except OSError as exc:
                self._stop(exc)
                return
            self._saved = total

    def flush(self, timeout: float) -> bool:
        """Write the counts now."""
        self.save_counts()
        return True

    def close(self) -> None:
        """Write the counts a last time."""
        self.save_counts()


def _create(folder: str, name: str, data: bytes) -> bool:
    """Write ``folder/name`` if absent, crash-safe: a fsync'd temporary file linked to ``name``
    (``link`` never replaces an existing name), then the folder fsync'd. True when this call
    created it, False when it was there already (another process, or an earlier run, wrote it)."""
    path = os.path.join(folder, name)
    if os.path.lexists(path):
        return False
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, _files.FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    _files.fsync_dir(folder)
    return True


def _stable_key(plan: Plan, inputs: Any) -> Hashable | None:
    """``(plan, inputs)`` without objects' addresses (which change every call and are never
    part of a signature); None when a payload cannot be hashed."""
    if raw.OBJECT in map(raw.kind_of, inputs):
        inputs = tuple(
            (k, kind, p[:2]) if kind == raw.OBJECT else (k, kind, p) for k, kind, p in inputs
        )
    key = (plan, inputs)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def read_counts(folder: str) -> dict[str, int]:
    """The calls counted per definition name under ``folder`` (``OTEL_GPU_WORKLOADS_DIR``), added
    up over every process's counts file. A file that is not a counts file (not JSON, another
    format, a count that is not a whole number >= 0) is skipped."""
    total: dict[str, int] = {}
    where = os.path.join(folder, COUNTS)
    try:
        names = sorted(os.listdir(where))
    except FileNotFoundError:
        return total
    for entry in names:
        if entry.startswith(".") or not entry.endswith(".json"):
            continue  # a temporary file being written
        try:
            fd = os.open(os.path.join(where, entry), os.O_RDONLY | _NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                body = json.loads(f.read(_MAX_COUNTS_FILE + 1)[:_MAX_COUNTS_FILE])
        except (OSError, ValueError):
            continue
        if not isinstance(body, dict) or body.get("format") != _sig.FORMAT:
            continue
        counts = body.get("counts")
        if not isinstance(counts, dict):
            continue
        for name, n in counts.items():
            if type(n) is int and n >= 0:
                total[name] = total.get(name, 0) + n
    return total
