"""The flight recorder's on-disk format, shared by the recorder (:mod:`otel_gpu.dump`) and replay.

One directory per call holds ``manifest.json`` and one tensor file each for inputs
and outputs. Values are encoded as tagged JSON (``{"t": "int", "v": 3}``) so replay
rebuilds them without unpickling anything; tensors are referenced by their key in
the tensor file. The schema is documented in ``docs/flight-recorder.md``.
"""

from __future__ import annotations

import enum
import json
import math
import os
import pickle
import re
import threading
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "MANIFEST",
    "RETURNED",
    "SCHEMA_VERSION",
    "Encoder",
    "HostBuffers",
    "HostCopies",
    "call_dir_name",
    "encode_json",
    "host_copy",
    "load_tensors",
    "public_fields",
    "pytree_children",
    "read_manifest",
    "restore_layout",
    "save_tensors",
    "stored_nbytes",
    "type_ref",
    "write_bytes",
    "write_json",
]

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
RETURNED = "returned"
"""Empty marker file: the call returned (written on the caller's thread before outputs are queued)."""

TENSOR_FILES = {".pt": "torch", ".safetensors": "safetensors"}
MAX_DEPTH = 16
_NAME_BAD = re.compile(r"[^A-Za-z0-9._-]+")
_REPR_LIMIT = 200


def call_dir_name(seq: int, time_ns: int, span_id: int, name: str) -> str:
    """``000042-20250101T120000.123456-<16 hex span id>-<api name>``: sorts in call order."""
    import time

    secs, ns = divmod(time_ns, 1_000_000_000)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(secs)) + f".{ns // 1000:06d}"
    safe = _NAME_BAD.sub("_", name)[-80:].strip("._") or "call"
    return f"{seq:06d}-{stamp}-{span_id:016x}-{safe}"


def type_ref(tp: type) -> str:
    """``module:qualname`` — the colon makes the module/qualname split unambiguous."""
    return f"{tp.__module__}:{tp.__qualname__}"


_MAX_FIELDS = 64


def pytree_children(value: Any) -> list[tuple[str, Any]] | None:
    """``(key, child)`` pairs of a type registered with ``torch.utils._pytree``, else None."""
    from torch.utils import _pytree as pytree

    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is None:
        return None
    try:
        if node.flatten_with_keys_fn is not None:
            pairs, _ = node.flatten_with_keys_fn(value)
            return [(_key_name(k, i), child) for i, (k, child) in enumerate(pairs)]
        children, _ = node.flatten_fn(value)
        return [(str(i), child) for i, child in enumerate(children)]
    except Exception:
        return None


def _from_dict(value: Any, tp: type) -> dict[str, Any] | None:
    """``value.to_dict()`` when ``tp.from_dict`` exists and the dict is plain JSON, else None."""
    to_dict = getattr(value, "to_dict", None)
    if not callable(to_dict) or not callable(getattr(tp, "from_dict", None)):
        return None
    try:
        data = to_dict()
        json.dumps(data, allow_nan=False)
    except Exception:
        return None
    return data if isinstance(data, dict) else None


def _key_name(key: Any, index: int) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(index)


_NOT_WALKED = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    torch.nn.Module,
)


def public_fields(value: Any) -> list[tuple[str, Any]] | None:
    """Public instance attributes of a plain object (``vars()``), None for what is not walked."""
    if isinstance(value, _NOT_WALKED) or callable(value):
        return None
    try:
        attrs = vars(value)
    except TypeError:
        return None
    return [(k, v) for k, v in _first(attrs.items(), _MAX_FIELDS) if not k.startswith("_")]


def _first(items: Any, n: int) -> Iterator[Any]:
    for i, item in enumerate(items):
        if i >= n:
            return
        yield item


def _safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<repr failed: {type(exc).__name__}>"
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _broadcast_dims(t: torch.Tensor) -> list[int]:
    return [d for d, (n, s) in enumerate(zip(t.shape, t.stride())) if s == 0 and n > 1]


def stored_nbytes(t: torch.Tensor) -> int:
    """Bytes the recorder writes for ``t``: its elements, broadcast (stride 0) dimensions once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= 1 if stride == 0 else size
    return n * t.element_size()


class Encoder:
    """Encodes values into tagged JSON, collecting tensors (not copied) under unique keys.

    The same tensor object passed twice is stored once and referenced twice, so replay
    passes one object twice, as the original call did. Containers the flight recorder
    cannot rebuild but can compare are walked leaf by leaf: mappings of any type
    (transformers' ``ModelOutput``), types registered with ``torch.utils._pytree``, and
    objects that hold tensors in public attributes (a KV cache). What cannot be recorded
    is encoded as ``unsupported`` and listed in :attr:`unsupported` with its path.
    """

    def __init__(
        self,
        prefix: str,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        secret: Any = None,
    ) -> None:
        self.prefix = prefix
        self.tensors = tensors
        self.meta = meta
        self.secret = secret  # name -> bool: strings under such a key are never written
        self.seen: dict[int, str] = {}
        self.unsupported: list[str] = []
        """``"<path> (<module:Type>): <why>"`` for every part that was not recorded."""
        self._tensor_refs = 0

    def encode(self, value: Any, path: str, depth: int = 0) -> dict[str, Any]:
        tp = type(value)
        if value is None:
            return {"t": "none"}
        if tp is bool:
            return {"t": "bool", "v": value}
        if tp is int:
            return {"t": "int", "v": value}
        if tp is float:
            return {"t": "float", "v": value if math.isfinite(value) else repr(value)}
        if tp is str:
            if self.secret is not None and self.secret(path.rsplit(".", 1)[-1]):
                return {"t": "redacted"}
            return {"t": "str", "v": value}
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, enum.Enum):
            out: dict[str, Any] = {"t": "enum", "type": type_ref(tp), "name": value.name}
            if type(value.value) in (int, str, bool):
                out["value"] = value.value
            return out
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"t": "device", "v": str(value)}
        if isinstance(value, type):
            return {"t": "type", "v": type_ref(value)}
        if depth >= MAX_DEPTH:
            return self._unsupported(value, path, "nested too deeply")
        if tp is torch.Size:
            return {"t": "size", "v": list(value)}
        if tp in (list, tuple):
            items = [self.encode(v, f"{path}.{i}", depth + 1) for i, v in enumerate(value)]
            return {"t": tp.__name__, "items": items}
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            items = [self.encode(v, f"{path}.{f}", depth + 1) for f, v in zip(value._fields, value)]
            return {"t": "namedtuple", "type": type_ref(tp), "items": items}
        if isinstance(value, Mapping):
            pairs = [
                [
                    {"t": "str", "v": k} if type(k) is str else self.encode(k, path, depth + 1),
                    self.encode(v, f"{path}.{k}", depth + 1),
                ]
                for k, v in value.items()
            ]
            if tp is dict:
                return {"t": "dict", "items": pairs}
            return {"t": "mapping", "type": type_ref(tp), "items": pairs}
        children = pytree_children(value)
        if children is not None:
            named = [[k, self.encode(v, f"{path}.{k}", depth + 1)] for k, v in children]
            return {"t": "pytree", "type": type_ref(tp), "items": named}
        rebuilt = _from_dict(value, tp)
        if rebuilt is not None:  # a transformers config: rebuilt by Type.from_dict(v)
            return {"t": "from_dict", "type": type_ref(tp), "v": rebuilt}
        fields = public_fields(value)
        if fields is not None:
            refs, noted = self._tensor_refs, len(self.unsupported)
            named = [[k, self.encode(v, f"{path}.{k}", depth + 1)] for k, v in fields]
            if self._tensor_refs > refs:  # it holds tensors: worth comparing leaf by leaf
                return {"t": "object", "type": type_ref(tp), "fields": named}
            del self.unsupported[noted:]
        return self._unsupported(value, path, "type not supported by the flight recorder")

    def _unsupported(self, value: Any, path: str, why: str) -> dict[str, Any]:
        ref = type_ref(type(value))
        self.unsupported.append(f"{self.prefix}{path} ({ref}): {why}")
        return {"t": "unsupported", "type": ref, "repr": _safe_repr(value), "why": why}

    def _tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        known = self.seen.get(id(t))
        if known is not None:
            self._tensor_refs += 1
            return {"t": "tensor", "key": known}
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            return self._unsupported(t, path, "only plain strided tensors are recorded")
        if t.is_meta or t.device.type == "meta":
            return self._unsupported(t, path, "meta tensors have no data")
        key = self.prefix + path
        while key in self.tensors:
            key += "_"
        self.seen[id(t)] = key
        self.tensors[key] = t
        self._tensor_refs += 1
        self.meta[key] = {
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "stride": list(t.stride()),
            "storage_offset": t.storage_offset(),
            "device": str(t.device),
            "requires_grad": t.requires_grad,
            "nbytes": stored_nbytes(t),
        }
        return {"t": "tensor", "key": key}


# --------------------------------------------------------------------------- tensors on disk


def host_copy(t: torch.Tensor, always_copy: bool) -> torch.Tensor:
    """A CPU tensor with ``t``'s values that owns no more storage than it needs.

    Dense layouts (contiguous, transposed, channels-last) keep their strides; other views
    are stored compactly and their stride/offset are restored at replay from the manifest.
    ``always_copy`` is for tensors written later, which the program may modify meanwhile.
    """
    t = t.detach()
    for d in _broadcast_dims(t):
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
        from otel_gpu import _gpu

        events, self.events = self.events, []
        for event in events:
            _gpu.wait_copy(event)


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
        from otel_gpu import _gpu

        out = HostCopies()
        for key, t in tensors.items():
            t = t.detach()
            for d in _broadcast_dims(t):
                t = t.narrow(d, 0, 1)
            nbytes = t.numel() * t.element_size()
            out.nbytes += nbytes
            plain = nbytes > 0 and not (t.is_quantized or t.is_conj() or t.is_neg())
            pinned = plain and _gpu.is_cuda_tensor(t)
            if pinned:
                buf = self._take(nbytes, True)
                dst = buf.view(t.dtype).view(t.shape)  # contiguous: replay restores the strides
                out.events.append(_gpu.copy_to_host(dst, t))
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
            from otel_gpu import _gpu

            return _gpu.pinned_empty(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def save_tensors(
    path_base: str, tensors: dict[str, torch.Tensor], fmt: str, fsync: bool = True
) -> str:
    """Write ``tensors`` to ``<path_base>.pt`` or ``.safetensors`` (fsync'd if asked); returns the file name.

    Falls back to the torch format when safetensors cannot represent a tensor
    (complex128, shared storage).
    """
    if fmt == "safetensors":
        path = path_base + ".safetensors"
        try:
            from safetensors.torch import save_file

            # save_file streams to the file: about 2x faster than building bytes in memory
            save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        except Exception as exc:  # ImportError, complex128, shared storage
            from otel_gpu import _guard

            _guard.warn_once(
                "dump.safetensors",
                "otel-gpu flight recorder: safetensors cannot store some calls' tensors (%s: %s); "
                "those calls are written in the torch format (inputs.pt/outputs.pt)",
                type(exc).__name__,
                exc,
            )
            if os.path.exists(path):
                os.remove(path)
        else:
            os.chmod(path, 0o600)
            if fsync:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            return os.path.basename(path)
    return _write_file(path_base + ".pt", lambda f: torch.save(tensors, f), fsync)


def _write_file(path: str, write: Any, fsync: bool) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        write(f)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return os.path.basename(path)


def write_json(directory: str, name: str, obj: Any, fsync: bool = True) -> None:
    """Replace ``directory/name`` atomically: readers see the old or the new file, never half of one."""
    write_bytes(directory, name, encode_json(obj), fsync)


def encode_json(obj: Any) -> bytes:
    """The bytes :func:`write_json` writes for ``obj``."""
    return json.dumps(obj, indent=1, allow_nan=False).encode("utf-8")


def write_bytes(directory: str, name: str, data: bytes, fsync: bool = True) -> None:
    """Replace ``directory/name`` with ``data`` atomically (temporary file, then rename).

    With ``fsync``, the file and then the directory are fsync'd: one directory fsync makes
    both the rename and any file created before it in this directory durable.
    """
    tmp = os.path.join(directory, f".{name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, os.path.join(directory, name))
    if fsync:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of one call directory (plain JSON; nothing is executed)."""
    with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"not an otel-gpu dump manifest of schema version {SCHEMA_VERSION}")
    return manifest


def load_tensors(directory: str, filename: str | None) -> dict[str, torch.Tensor]:
    """Load a tensor file without unpickling objects: ``torch.load(weights_only=True)`` or safetensors."""
    if not filename:
        return {}
    ext = os.path.splitext(filename)[1]
    if os.path.basename(filename) != filename or ext not in TENSOR_FILES:
        raise ValueError(
            f"refusing tensor file name {filename!r} (must be a plain .pt/.safetensors name)"
        )
    path = os.path.join(directory, filename)
    if ext == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message suggests weights_only=False: exactly what must never happen here
        lines = [
            ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "Unsupported" in ln
        ]
        why = f" ({lines[0]})" if lines else ""
        raise ValueError(f"refusing {filename}: it holds objects other than tensors{why}") from None
    if not isinstance(loaded, dict) or not all(
        isinstance(v, torch.Tensor) for v in loaded.values()
    ):
        raise ValueError(f"{filename} does not hold a dict of tensors")
    return loaded


def restore_layout(
    t: torch.Tensor, meta: dict[str, Any], device: torch.device | str
) -> torch.Tensor:
    """Place a stored tensor on ``device`` with the recorded shape, strides and storage offset."""
    shape = tuple(meta["shape"])
    stride = tuple(meta["stride"])
    offset = int(meta.get("storage_offset", 0))
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
