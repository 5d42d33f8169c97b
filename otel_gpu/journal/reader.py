"""Reading a crash journal back: the file's header, its process, and the calls in flight.

The layout is :mod:`otel_gpu.journal.layout`, the writer's and this reader's; this is its only decoder, used by
``otel-gpu recover`` (:mod:`otel_gpu.journal.recover`) and the tests. Everything read is
checked before it is used: a journal may be truncated, torn or planted.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from otel_gpu._text import too_deep
from otel_gpu.journal import layout
from otel_gpu.journal.inputs import decode as decode_inputs
from otel_gpu.journal.layout import MAX_SIZE

__all__ = ["MAX_SIZE", "JournalFile", "Record", "decode_inputs", "read"]


@dataclass
class Record:
    """One call that was in flight when the journal was last written."""

    trace_id: int
    span_id: int
    parent_span_id: int | None
    parent_remote: bool
    start_ns: int
    thread_id: int
    name: str
    code: dict[str, Any]
    inputs: list[tuple[Any, ...]] | None
    inputs_truncated: bool = False
    inputs_error: str | None = None


@dataclass
class JournalFile:
    """A journal as read from disk: whose it is and which calls were in flight."""

    path: str
    pid: int
    start_ticks: int
    boot_id: bytes
    created_ns: int
    heartbeat_ns: int
    level: int
    closed: bool
    host: str | None
    resource: dict[str, Any]
    records: list[Record] = field(default_factory=list)
    fault: dict[str, Any] | None = None
    """A CUDA fault's verdict (devices/cuda_fault.py): suspect span id, or candidates."""


def read(path: str) -> JournalFile:
    """Parse a journal file. Raises ``ValueError`` when it is not one, ``OSError`` when unreadable."""
    # Non-blocking: a FIFO planted under a journal's name must not hang the reader in open().
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise ValueError("a symbolic link, not followed") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise ValueError(f"owned by uid {info.st_uid}, not by this user")
        if info.st_size < layout.HEADER_SIZE:
            raise ValueError("too short to be a journal")
        if info.st_size > MAX_SIZE:
            raise ValueError(
                f"{_size(info.st_size)}, larger than any journal otel-gpu writes "
                f"({_size(MAX_SIZE)} at most)"
            )
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            return _parse(path, mm, info.st_size)
    finally:
        os.close(fd)


def _parse(path: str, mm: Any, size: int) -> JournalFile:
    (
        magic,
        version,
        header_size,
        plans_size,
        stride,
        count,
        level,
        pid,
        ticks,
        boot,
        created,
        heartbeat,
        state,
        meta_len,
    ) = layout.HEADER.unpack_from(mm, 0)
    if magic != layout.MAGIC:
        raise ValueError("not an otel-gpu journal")
    if version != layout.VERSION:
        raise ValueError(f"journal format {version}, this otel-gpu reads {layout.VERSION}")
    base = header_size + plans_size
    if (
        stride < layout.SMALL_SLOT
        or header_size < layout.META_AT
        or base + stride * count > size
        or meta_len > header_size - layout.META_AT
    ):
        raise ValueError("inconsistent journal header")
    # The writer's layout, not merely a consistent one: each part within what it writes.
    limit = layout.SLOT_LIMITS.get(stride)
    if limit is None or count > limit:
        raise ValueError(
            f"its header claims {count} slots of {stride} bytes; otel-gpu writes at most "
            f"{layout.SLOTS_SMALL} of {layout.SMALL_SLOT} or {layout.SLOTS_LARGE} of {layout.LARGE_SLOT}"
        )
    if header_size != layout.HEADER_SIZE or plans_size > layout.PLANS_SIZE:
        raise ValueError(
            f"its header claims a {header_size}-byte header and {plans_size} bytes of plans; "
            f"otel-gpu writes {layout.HEADER_SIZE} and at most {layout.PLANS_SIZE}"
        )
    meta = _json(bytes(mm[layout.META_AT : layout.META_AT + meta_len])) if meta_len else {}
    if not isinstance(meta, dict):
        meta = {}
    plans: list[tuple[str, dict[str, Any]]] = []
    at = header_size
    while at + 4 <= base:
        (length,) = layout.U32.unpack_from(mm, at)
        if not length or at + 4 + length > base:
            break
        try:
            name, code = _json(bytes(mm[at + 4 : at + 4 + length]))
            plans.append((str(name), dict(code)))
        except (ValueError, TypeError):
            plans.append(("unknown", {}))
        at += 4 + ((length + 7) & ~7)
    host = meta.get("host")
    resource = meta.get("resource")
    journal = JournalFile(
        path=path,
        pid=pid,
        start_ticks=ticks,
        boot_id=bytes(boot),
        created_ns=created,
        heartbeat_ns=heartbeat,
        level=level,
        closed=state == layout.CLOSED,
        host=host if isinstance(host, str) else None,
        resource=resource if isinstance(resource, dict) else {},
        fault=_fault(meta.get("cuda_fault")),
    )
    for slot in range(count):
        offset = base + slot * stride
        (commit,) = layout.COMMIT.unpack_from(mm, offset)
        if commit != layout.COMMITTED:
            continue
        hi, lo, span_id, parent_id, start, thread, plan, flags, size = layout.BODY.unpack_from(
            mm, offset + 8
        )
        trace_id = hi << 64 | lo
        if not trace_id or not span_id:
            continue
        name, code = plans[plan] if plan < len(plans) else ("unknown", {})
        inputs = None
        error = None
        if flags & layout.F_INPUTS and size and layout.INPUTS_AT + size <= stride:
            try:
                inputs = decode_inputs(
                    bytes(mm[offset + layout.INPUTS_AT : offset + layout.INPUTS_AT + size])
                )
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        elif flags & layout.F_INPUTS_FAILED:
            error = "input metadata could not be encoded"
        journal.records.append(
            Record(
                trace_id=trace_id,
                span_id=span_id,
                parent_span_id=parent_id if flags & layout.F_PARENT else None,
                parent_remote=bool(flags & layout.F_PARENT_REMOTE),
                start_ns=start,
                thread_id=thread,
                name=name,
                code=code,
                inputs=inputs,
                inputs_truncated=bool(flags & layout.F_TRUNCATED),
                inputs_error=error,
            )
        )
    journal.records.sort(key=lambda r: r.start_ns)
    return journal


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _json(raw: bytes) -> Any:
    """A JSON field of the journal; None when it is not JSON or nests deeper than the
    trace-file bound (a nesting bomb would end ``json.loads`` in ``RecursionError``)."""
    if too_deep(raw):
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _fault(raw: Any) -> dict[str, Any] | None:
    """A recorded CUDA fault verdict, its fields checked (a journal is untrusted input)."""
    if not isinstance(raw, dict):
        return None
    suspect = raw.get("suspect")
    candidates = raw.get("candidates")
    names = raw.get("names")
    hexes = (
        [c for c in candidates if isinstance(c, str)][:64] if isinstance(candidates, list) else []
    )
    return {
        "suspect": suspect[:16] if isinstance(suspect, str) else None,
        "candidates": [c[:16] for c in hexes],
        "names": [str(n)[:256] for n in names][:64] if isinstance(names, list) else [],
        "error": str(raw.get("error", ""))[:512],
    }
