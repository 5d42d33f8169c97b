"""The crash journal's file layout: what :mod:`otel_gpu.journal.writer` stores and
:mod:`otel_gpu.journal.reader` checks, written once here for both.

Layout of ``<dir>/otel-gpu-<pid>-<random>.journal`` (little-endian but for the native commit
words; a journal is read on the host that wrote it)::

    header   16 KiB   magic, version, pid, process start time, boot id, heartbeat,
                      then JSON metadata: host name and the resource of the process
    plans    64 KiB   one JSON entry per decorated function seen: name, code.* attributes
    slots    N x S    one record per call in flight (S = 64 bytes at level 1,
                      4 KiB at level >= 3, where the input metadata follows)

The header names its process by pid, start time and boot (:func:`process_start_ticks`,
:func:`boot_id`). Each slot begins with a commit word (:data:`COMMIT`), stored last when a call starts and
cleared first when it ends: a slot holds a record only while that word is :data:`COMMITTED`.
The input metadata of a large slot is :mod:`otel_gpu.journal.inputs`'s encoding.
"""

from __future__ import annotations

import struct

__all__ = [
    "BODY",
    "CLOSED",
    "COMMIT",
    "COMMITTED",
    "F_INPUTS",
    "F_INPUTS_FAILED",
    "F_PARENT",
    "F_PARENT_REMOTE",
    "F_TRUNCATED",
    "HEADER",
    "HEADER_SIZE",
    "HEARTBEAT_AT",
    "I64",
    "INPUTS_AT",
    "LARGE_SLOT",
    "MAGIC",
    "MAX_SIZE",
    "META_AT",
    "NO_PLAN",
    "OPEN",
    "PLANS_SIZE",
    "PREFIX",
    "RECORD",
    "SLOTS_LARGE",
    "SLOTS_SMALL",
    "SLOT_LIMITS",
    "SMALL_SLOT",
    "STATE_AT",
    "SUFFIX",
    "U32",
    "VERSION",
    "boot_id",
    "process_start_ticks",
]

MAGIC = b"OTGPUJNL"
VERSION = 1
PREFIX = "otel-gpu-"
SUFFIX = ".journal"

HEADER_SIZE = 16 * 1024
PLANS_SIZE = 64 * 1024
SMALL_SLOT = 64  # level 1: ids, clock, thread, plan index
LARGE_SLOT = 4096  # level >= 3: plus up to 4032 bytes of encoded input metadata
SLOTS_SMALL = 1024
SLOTS_LARGE = 256

OPEN, CLOSED = 1, 2
"""The header's state word: the writer is running, or it closed the journal on a clean exit."""

# magic, version, header_size, plans_size, slot_size, slot_count, level, pid, start_ticks,
# boot_id, created_ns, heartbeat_ns, state, meta_len
HEADER = struct.Struct("<8sIIIIIIqQ16sqqII")
HEARTBEAT_AT = 72
STATE_AT = 80
META_AT = 128
U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
# trace_hi, trace_lo, span_id, parent_span_id, start_ns, thread_id, plan, flags, inputs_len
BODY = struct.Struct("<QQQQQQIHH")
# Native and aligned: one 8-byte store, so the process dying cannot tear it.
COMMIT = struct.Struct("@Q")
COMMITTED = 0x4C4E524A55504731  # any fixed non-zero value; 0 means free
INPUTS_AT = 64
RECORD = COMMIT.size + BODY.size
"""Bytes a call's start stores before its inputs."""

F_PARENT, F_PARENT_REMOTE, F_INPUTS, F_TRUNCATED, F_INPUTS_FAILED = 1, 2, 4, 8, 16
NO_PLAN = 0xFFFFFFFF
"""A record's plan index when the plans area was full: its name reads as unknown."""

# What the writer can produce, and so all a reader ever needs to look at: a crafted header
# (a billion slots, a 16 GB sparse file, megabytes of "metadata") is refused before it is
# mapped, so reading a journal costs a small multiple of these sizes whatever the file says.
SLOT_LIMITS = {SMALL_SLOT: SLOTS_SMALL, LARGE_SLOT: SLOTS_LARGE}
MAX_SIZE = HEADER_SIZE + PLANS_SIZE + max(s * n for s, n in SLOT_LIMITS.items())
"""The largest journal the writer makes (1.1 MiB); a larger file is refused unread."""


# --------------------------------------------------------------------------- process identity
# What the header's start_ticks and boot_id fields hold: they tell a dead process from a live
# one that reuses its pid, and a journal written before the last reboot.

_boot_id: bytes | None = None


def boot_id() -> bytes:
    """This boot's id (16 bytes; zeros where unknown): tells a reboot from a live pid."""
    global _boot_id
    if _boot_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                _boot_id = bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
        except (OSError, ValueError):
            _boot_id = bytes(16)
    return _boot_id


def process_start_ticks(pid: int) -> tuple[int, str] | None:
    """(start time in clock ticks since boot, state letter) of ``pid`` from ``/proc``; None if absent.

    The start time tells a dead process from a new one that reuses its pid.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return int(fields[19]), fields[0].decode("ascii", "replace")
    except (ValueError, IndexError):
        return None
