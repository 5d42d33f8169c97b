"""Crafted crash journals: a header and slots written by hand, as a dead process, an attacker or
a bug could leave them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from otel_gpu.journal import layout, writer


def pack_header(
    buf: bytearray,
    pid: int,
    meta: bytes,
    *,
    plans_size: int,
    stride: int,
    slots: int,
    level: int,
    header_size: int = writer.HEADER_SIZE,
    magic: bytes = writer.MAGIC,
) -> None:
    """Write at the start of ``buf`` the header of a journal still open in the process ``pid``
    (which has exited: no live process has its start ticks), with ``meta`` after it."""
    layout.HEADER.pack_into(
        buf,
        0,
        magic,
        writer.VERSION,
        header_size,
        plans_size,
        stride,
        slots,
        level,
        pid,
        1,  # start ticks that no live process has
        bytes(16),
        10**18,
        10**18 + 5,
        writer.OPEN,
        len(meta),
    )
    buf[layout.META_AT : layout.META_AT + len(meta)] = meta


def crafted_journal(
    path: Path,
    pid: int,
    *,
    count: int = 1,
    stride: int = writer.SMALL_SLOT,
    header_size: int = writer.HEADER_SIZE,
    meta: bytes | None = None,
    committed: int = 1,
    size: int | None = None,
) -> Path:
    """A journal with a header that says what the caller wants: ``count`` slots of ``stride``
    bytes, the first ``committed`` of them calls in flight, ``meta`` after the header, and the
    file extended (sparse) to ``size`` bytes."""
    meta = meta if meta is not None else json.dumps({"host": socket.gethostname()}).encode()
    plans_size = writer.PLANS_SIZE
    head = bytearray(header_size)
    pack_header(
        head,
        pid,
        meta,
        plans_size=plans_size,
        stride=stride,
        slots=count,
        level=1,
        header_size=header_size,
    )
    plan = json.dumps(["lib.f", {"code.function.name": "f"}]).encode()
    plans = bytearray(plans_size)
    layout.U32.pack_into(plans, 0, len(plan))
    plans[4 : 4 + len(plan)] = plan
    slot = bytearray(stride)
    layout.COMMIT.pack_into(slot, 0, layout.COMMITTED)
    with open(path, "wb") as f:
        f.write(head)
        f.write(plans)
        for i in range(committed):
            layout.BODY.pack_into(slot, 8, 1, i + 1, i + 1, 0, 10**18 + i, 1, 0, 0, 0)
            f.write(slot)
        if size is not None:
            f.truncate(size)
        else:
            f.truncate(header_size + plans_size + stride * count)
    return path


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
