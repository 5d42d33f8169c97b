"""Tensors on their way to disk and back: host copies, reused host buffers, tensor files.

The recorder and the ring copy a call's tensors to the host (:class:`HostBuffers`, pinned and
asynchronous for CUDA tensors) and write them as one tensor file per call side
(:func:`save_tensors`); replay loads them without unpickling objects (:func:`load_tensors`)
and puts back the recorded layout (:func:`restore_layout`). The manifest that names these
files is :mod:`otel_gpu.recorder.manifest`.
"""

from __future__ import annotations

import math
import os
import pickle
import threading
from typing import Any

import torch

from otel_gpu import _files
from otel_gpu.recorder.manifest import (
    TENSOR_FILES,
    DumpFileError,
    _open_inside,
    _plain_name,
)
from otel_gpu.recorder.values import broadcast_dims

__all__ = [
    "TENSOR_ENTRY_SLACK",
    "TENSOR_FILE_SLACK",
    "HostBuffers",
    "HostCopies",
    "host_copy",
    "load_tensors",
    "restore_layout",
    "save_tensors",
]


def host_copy(t: torch.Tensor, always_copy: bool) -> torch.Tensor:
    """A CPU tensor with ``t``'s values that owns no more storage than it needs.

    Dense layouts (contiguous, transposed, channels-last) keep their strides; other views
    are stored compactly and their stride/offset are restored at replay from the manifest.
    ``always_copy`` is for tensors written later, which the program may modify meanwhile.
    """
    t = t.detach()
    for d in broadcast_dims(t):
        t = t.narrow(d, 0, 1)
    if t.device.type != "cpu":
        return t.to("cpu")  # preserve_format: dense layouts keep their strides
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if always_copy or not whole:
        return t.clone(memory_format=torch.preserve_format)
    return t  # torch.save would write exactly this tensor's bytes: no copy needed


class HostCopies:
    """Host copies of one call's tensors, written later by the recorder's writer thread.

    ``tensors`` may still be filling from a device (asynchronous copies into pinned
    buffers): :meth:`wait` before reading them. ``buffers`` go back to the pool once written.
    """

    __slots__ = ("buffers", "events", "nbytes", "tensors")

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.buffers: list[tuple[torch.Tensor, bool]] = []  # (buffer, pinned)
        self.events: list[Any] = []
        self.nbytes = 0

    def wait(self) -> None:
        """Block until every asynchronous device-to-host copy has landed."""
        from otel_gpu.devices import cuda

        events, self.events = self.events, []
        for event in events:
            cuda.wait_copy(event)


_POOL_BYTES = 256 << 20  # host buffers kept for reuse between calls, all sizes together


class HostBuffers:
    """Reused host buffers for the copies the recorder writes later (page-locked for CUDA tensors).

    A fresh CPU allocation of a few MB page-faults on every call, and pinned memory is
    expensive to allocate; a reused buffer costs the copy only. Buffers are kept by exact
    size, so a tensor file never holds more bytes than the tensor (``torch.save`` writes
    a tensor's whole storage).
    """

    def __init__(self, max_bytes: int = _POOL_BYTES) -> None:
        self.max_bytes = max_bytes
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def copy(self, tensors: dict[str, torch.Tensor]) -> HostCopies:
        """Copies of ``tensors`` that the program cannot change any more (device copies may be in flight)."""
        from otel_gpu.devices import cuda

        out = HostCopies()
        for key, t in tensors.items():
            t = t.detach()
            for d in broadcast_dims(t):
                t = t.narrow(d, 0, 1)
            nbytes = t.numel() * t.element_size()
            out.nbytes += nbytes
            plain = nbytes > 0 and not (t.is_quantized or t.is_conj() or t.is_neg())
            pinned = plain and cuda.is_cuda_tensor(t)
            if pinned:
                buf = self._take(nbytes, True)
                dst = buf.view(t.dtype).view(t.shape)  # contiguous: replay restores the strides
                out.events.append(cuda.copy_to_host(dst, t))
            elif plain and t.device.type == "cpu" and t.is_contiguous():
                buf = self._take(nbytes, False)
                dst = buf.view(t.dtype).view(t.shape)
                dst.copy_(t)
            else:  # other layouts and devices: a fresh copy, as host_copy makes it
                out.tensors[key] = host_copy(t, always_copy=True)
                continue
            out.buffers.append((buf, pinned))
            out.tensors[key] = dst
        return out

    def release(self, copies: HostCopies) -> None:
        """Give ``copies``' buffers back once they are written (or dropped)."""
        buffers, copies.buffers = copies.buffers, []
        copies.tensors = {}
        with self._lock:
            for buf, pinned in buffers:
                n = buf.numel()
                if self._kept + n <= self.max_bytes:
                    self._free.setdefault((n, pinned), []).append(buf)
                    self._kept += n

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._kept = 0

    def _take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            free = self._free.get((nbytes, pinned))
            if free:
                self._kept -= nbytes
                return free.pop()
        if pinned:
            from otel_gpu.devices import cuda

            return cuda.pinned_empty(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def save_tensors(
    path_base: str, tensors: dict[str, torch.Tensor], fmt: str, fsync: bool = True
) -> str:
    """Write ``tensors`` to ``<path_base>.pt`` or ``.safetensors`` (fsync'd if asked); returns the file name.

    The file is created safely (:mod:`otel_gpu._files`: 0600, a random temporary name, renamed
    into place; a symlink at the name is replaced, never written through). Its folder is not
    fsync'd here: the manifest written next fsyncs it, which makes this rename durable too.
    Falls back to the torch format when safetensors cannot represent a tensor
    (complex128, shared storage).
    """
    directory, base = os.path.split(path_base)
    if fmt == "safetensors":
        name = base + ".safetensors"
        try:
            from safetensors.torch import save_file

            contiguous = {k: v.contiguous() for k, v in tensors.items()}
            # save_file streams to a path: about 2x faster than building bytes in memory
            return _files.write_atomic_path(
                directory, name, lambda tmp: save_file(contiguous, tmp), fsync, sync_dir=False
            )
        except Exception as exc:  # ImportError, complex128, shared storage
            from otel_gpu import _guard

            _guard.warn_once(
                "dump.safetensors",
                "otel-gpu flight recorder: safetensors cannot store some calls' tensors (%s: %s); "
                "those calls are written in the torch format (inputs.pt/outputs.pt)",
                type(exc).__name__,
                exc,
            )
    return _write_file(path_base + ".pt", lambda f: torch.save(tensors, f), fsync)


def _write_file(path: str, write: Any, fsync: bool) -> str:
    """``write(f)`` into the new file ``path`` (atomically, 0600; folder not fsync'd); its name."""
    directory, name = os.path.split(path)
    return _files.write_atomic(directory, name, write, fsync, sync_dir=False)


TENSOR_FILE_SLACK = 1 << 20
"""Bytes a tensor file may hold beyond the tensor data its manifest states: the file format's
own (zip or safetensors headers, the pickle of the dict), plus :data:`TENSOR_ENTRY_SLACK` for
each tensor the manifest states."""
TENSOR_ENTRY_SLACK = 1 << 10
"""The format's bytes allowed per stated tensor (a ``.pt`` file spends about 300: its zip
entry, alignment and pickle)."""


def load_tensors(
    directory: str,
    filename: str | None,
    field: str = "tensor file",
    stated: int | None = None,
    count: int = 0,
) -> dict[str, torch.Tensor]:
    """Load a tensor file without unpickling objects: ``torch.load(weights_only=True)`` or safetensors.

    ``field`` names where the dump named the file (``files.outputs``), for the message. Every
    failure is a :class:`DumpFileError` naming the file: missing, outside the call's directory
    (a path, a symlink), truncated or corrupt, holding objects other than tensors.

    Memory is bounded before anything is read: with ``stated`` (the bytes of tensor data the
    manifest states for its ``count`` tensors, :func:`~otel_gpu.recorder.manifest.stated_nbytes`),
    a file whose size on disk, or whose header's sizes, pass ``stated`` plus the format's slack
    (:data:`TENSOR_FILE_SLACK`, :data:`TENSOR_ENTRY_SLACK` per tensor) is refused unread. A loaded tensor with more elements than its storage holds (an expanded or
    overlapping view, which the recorder never writes) is refused before anything touches its
    values.
    """
    if not filename:
        return {}
    ext = os.path.splitext(filename)[1] if isinstance(filename, str) else ""
    if ext not in TENSOR_FILES or not _plain_name(filename):
        raise DumpFileError(
            f"{field}: refusing tensor file name {filename!r} (must be a plain .pt/.safetensors "
            "name inside the call's directory)"
        )
    slack = TENSOR_FILE_SLACK + TENSOR_ENTRY_SLACK * max(count, 0)
    limit = None if stated is None else stated + slack
    try:
        fd, size = _open_inside(directory, filename)
    except DumpFileError as exc:
        raise DumpFileError(f"{field}: {exc}") from exc.__cause__
    with os.fdopen(fd, "rb") as f:
        _check_size(field, filename, size, limit, slack, "on disk")
        if ext == ".safetensors":
            loaded = _load_safetensors(f, field, filename, size, limit, slack)
        else:
            loaded = _load_torch(f, field, filename, limit, slack)
    for key, t in loaded.items():
        if t.numel() > 1 and _needed_bytes(t) > t.untyped_storage().nbytes():
            raise DumpFileError(
                f"{field}: refusing {filename}: tensor {key!r} of shape {list(t.shape)} is a "
                f"view of {t.untyped_storage().nbytes()} bytes of storage (an expanded or "
                "overlapping view; the recorder stores each tensor's own elements)"
            )
    return loaded


def _needed_bytes(t: torch.Tensor) -> int:
    """Bytes of storage a non-overlapping tensor of ``t``'s shape needs from its offset on."""
    return int((t.storage_offset() + t.numel()) * t.element_size())


def _check_size(
    field: str, filename: str, size: int, limit: int | None, slack: int, where: str
) -> None:
    if limit is not None and size > limit:
        raise DumpFileError(
            f"{field}: refusing {filename}: {size} bytes {where}, more than the "
            f"{limit - slack} bytes of tensors the manifest states (+ {slack} for the file "
            "format; see docs/reliability.md)"
        )


def _load_safetensors(
    f: Any, field: str, filename: str, size: int, limit: int | None, slack: int
) -> dict[str, torch.Tensor]:
    """A safetensors file, its header's sizes checked before its data is read."""
    import json
    import struct

    try:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"a header of {n} bytes in a file of {size}")
        header = json.loads(f.read(n))
        ends = [
            int(v["data_offsets"][1])
            for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict)
        ]
    except Exception as exc:
        raise DumpFileError(
            f"{field}: {filename} is not a readable safetensors file (truncated or "
            f"corrupt: {_first_line(exc)})"
        ) from None
    _check_size(field, filename, 8 + n + max(ends, default=0), limit, slack, "by its header")
    from safetensors.torch import load as load_safetensors

    f.seek(0)
    data = f.read()
    try:
        return load_safetensors(data)
    except Exception as exc:
        raise DumpFileError(
            f"{field}: {filename} is not a readable safetensors file (truncated or "
            f"corrupt: {_first_line(exc)})"
        ) from None


def _load_torch(
    f: Any, field: str, filename: str, limit: int | None, slack: int
) -> dict[str, torch.Tensor]:
    """A torch file (a zip archive), its entries' sizes checked before any is read."""
    import zipfile

    try:
        with zipfile.ZipFile(f) as archive:
            content = sum(info.file_size for info in archive.infolist())
    except Exception as exc:
        raise DumpFileError(
            f"{field}: {filename} is not a readable torch file (truncated or corrupt: "
            f"{_first_line(exc)})"
        ) from None
    _check_size(field, filename, content, limit, slack, "by its archive's entries")
    f.seek(0)
    try:
        loaded = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message suggests weights_only=False: exactly what must never happen here
        lines = [ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln]
        if not lines:  # bytes the unpickler cannot parse: damage, not a payload
            why = [ln.strip() for ln in str(exc).splitlines() if "Unsupported" in ln]
            raise DumpFileError(
                f"{field}: {filename} is not a readable torch file (truncated or corrupt: "
                f"{why[0] if why else type(exc).__name__})"
            ) from None
        raise DumpFileError(
            f"{field}: refusing {filename}: it holds objects other than tensors ({lines[0]})"
        ) from None
    except Exception as exc:
        raise DumpFileError(
            f"{field}: {filename} is not a readable torch file (truncated or corrupt: "
            f"{_first_line(exc)})"
        ) from None
    if not isinstance(loaded, dict) or not all(
        isinstance(v, torch.Tensor) for v in loaded.values()
    ):
        raise DumpFileError(f"{field}: {filename} does not hold a dict of tensors")
    return loaded


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, short, without torch's advice to unpickle."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    line = lines[0]
    if "weights_only" in line:
        line = type(exc).__name__
    return line if len(line) <= 160 else line[:157] + "..."


def restore_layout(
    t: torch.Tensor, meta: dict[str, Any], device: torch.device | str
) -> torch.Tensor:
    """Place a stored tensor on ``device`` with the recorded shape, strides and storage offset.

    ``ValueError`` when the recorded layout is not one of non-negative integers that fits the
    stored tensor (a hand-edited manifest), rather than a view of memory it does not describe.
    """
    shape, stride = meta.get("shape"), meta.get("stride")
    offset = meta.get("storage_offset", 0)
    if not (
        isinstance(shape, list)
        and isinstance(stride, list)
        and len(shape) == len(stride)
        and all(type(v) is int and v >= 0 for v in [*shape, *stride, offset])
    ):
        raise ValueError(
            f"the recorded layout (shape {shape!r}, stride {stride!r}, storage_offset "
            f"{offset!r}) is not one of non-negative integers"
        )
    shape, stride = tuple(shape), tuple(stride)
    stored = 0 if 0 in shape else math.prod(1 if s == 0 else n for n, s in zip(shape, stride))
    if stored != t.numel():
        raise ValueError(
            f"the recorded shape {list(shape)} does not fit the stored tensor "
            f"of shape {list(t.shape)}"
        )
    if tuple(t.shape) == shape and t.stride() == stride and offset == 0:
        return t.to(device)
    if 0 in shape:
        return torch.empty_strided(shape, stride, dtype=t.dtype, device=device)
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    full = torch.empty(extent, dtype=t.dtype, device=device).as_strided(shape, stride, offset)
    target = full
    for d, (n, s) in enumerate(zip(shape, stride)):
        if s == 0 and n > 1:
            target = target.narrow(d, 0, 1)
    try:
        target.copy_(t)
    except RuntimeError:  # overlapping strides cannot be written through: values matter most
        return t.to(device).expand(shape).contiguous()
    return full
