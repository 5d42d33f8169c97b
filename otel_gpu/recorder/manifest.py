"""The flight recorder's on-disk format, shared by the recorder (:mod:`otel_gpu.recorder.recorder`) and replay.

One directory per call holds ``manifest.json`` and one tensor file each for inputs
and outputs. Values are encoded as tagged JSON (``{"t": "int", "v": 3}``) so replay
rebuilds them without unpickling anything; tensors are referenced by their key in
the tensor file. The schema is documented in ``docs/flight-recorder.md``; values are encoded by
:mod:`otel_gpu.recorder.values`, and this module reads a manifest back, checked.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from otel_gpu import _files

__all__ = [
    "DTYPES",
    "MANIFEST",
    "MAX_BYTES",
    "MAX_ITEMS",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_VALUES",
    "RETURNED",
    "SCHEMA_VERSION",
    "call_dir_name",
    "encode_json",
    "read_manifest",
    "stated_nbytes",
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
MAX_ITEMS = 1000
"""Items of one container (list, tuple, dict, pytree, namedtuple) a manifest records."""
MAX_BYTES = 1 << 20
"""About how many bytes of values one manifest's arguments (and, apart, its outputs) may hold."""


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


def write_json(directory: str, name: str, obj: Any, fsync: bool = True) -> None:
    """Replace ``directory/name`` atomically: readers see the old or the new file, never half of one."""
    write_bytes(directory, name, encode_json(obj), fsync)


def encode_json(obj: Any) -> bytes:
    """The bytes :func:`write_json` writes for ``obj``: one top-level key a line.

    Each value is encoded by the C encoder; ``indent`` would switch the whole document to the
    pure-Python one, several times slower on a call's manifest (written twice a call).
    """
    if not isinstance(obj, dict) or not obj or not all(type(k) is str for k in obj):
        return _JSON.encode(obj).encode("utf-8")
    encode = _JSON.encode
    return (
        "{\n" + ",\n".join(f" {encode(k)}: {encode(v)}" for k, v in obj.items()) + "\n}"
    ).encode("utf-8")


# built once: json.dumps(allow_nan=False) builds an encoder on every call
_JSON = json.JSONEncoder(allow_nan=False)


def write_bytes(directory: str, name: str, data: bytes, fsync: bool = True) -> None:
    """Replace ``directory/name`` with ``data`` atomically (a 0600 file at a random temporary
    name, then rename; a symlink at ``name`` is replaced, never written through).

    With ``fsync``, the file and then the directory are fsync'd: one directory fsync makes
    both the rename and any file created before it in this directory durable.
    """
    _files.write_atomic_bytes(directory, name, data, fsync)


class DumpFileError(ValueError):
    """A file of the dump is missing, unreadable, corrupt or not allowed; the message names it.

    Replay gives the call it belongs to the verdict ``error`` with this message, and goes on.
    """


MAX_MANIFEST_BYTES = 64 << 20
"""A manifest larger than this is refused unread. The recorder writes far less: about
:data:`MAX_BYTES` of values for the arguments and as much for the outputs, and a few hundred
bytes of metadata per tensor."""
MAX_MANIFEST_VALUES = 2_000_000
"""A manifest whose text could hold more JSON values than this (counted from its ``{``, ``[``,
``,`` and ``:`` before it is parsed) is refused: parsing it would build that many Python objects,
tens of bytes each, from a few bytes of text each (``[{},{},...]``)."""

DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
"""Every torch dtype by the name the recorder writes (``float32``): the only dtypes a dump may
name. A name is looked up here, never with ``getattr(torch, name)``, which can import torch's
lazily loaded submodules (``torch._dynamo``, ``torch._inductor``)."""


def stated_nbytes(meta: Any) -> int:
    """Bytes of tensor data the manifest's ``tensors`` table says the tensor files hold: per
    entry, its elements (broadcast dimensions once) times its dtype's size; 0 for an entry of
    another shape (replay refuses that entry when it uses it)."""
    total = 0
    for entry in meta.values() if isinstance(meta, dict) else ():
        if not isinstance(entry, dict):
            continue
        shape, stride, dtype = entry.get("shape"), entry.get("stride"), entry.get("dtype")
        if not (isinstance(shape, list) and isinstance(stride, list) and dtype in DTYPES):
            continue
        if len(shape) != len(stride) or not all(type(v) is int and v >= 0 for v in shape):
            continue
        n = 1
        for size, step in zip(shape, stride):
            n *= 1 if step == 0 else size
        total += n * DTYPES[dtype].itemsize
    return total


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "status": (str,),
    "function": (dict,),
    "replayable": (bool,),
    "why_not_replayable": (str, type(None)),
    "trace_id": (str, type(None)),
    "span_id": (str, type(None)),
    "files": (dict,),
    "tensors": (dict,),
    "params": (list,),
    "positional": (int, type(None)),
    "receiver": (dict, type(None)),
    "result": (dict, type(None)),
    "mutated": (dict,),
    "outputs_skipped": (str, type(None)),
    "exception": (dict, type(None)),
    "torch_state": (dict,),
}
"""The manifest fields replay reads, and the JSON types each may have (absent is allowed)."""
_JSON_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "true/false"}


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of one call directory (plain JSON; nothing is executed).

    Raises FileNotFoundError when there is none, else ``ValueError`` with a one-line reason
    for a manifest that is a symlink, not JSON, or not of the shape replay reads.
    """
    try:
        data = _read_inside(directory, MANIFEST, MAX_MANIFEST_BYTES)
    except DumpFileError as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            raise FileNotFoundError(str(exc)) from None
        raise
    values = sum(data.count(c) for c in (b"{", b"[", b",", b":"))
    if values > MAX_MANIFEST_VALUES:
        raise ValueError(
            f"{MANIFEST} could hold about {values} JSON values, over the {MAX_MANIFEST_VALUES} "
            "replay parses (the recorder writes far fewer; see docs/reliability.md)"
        )
    try:
        manifest = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{MANIFEST} is not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"{MANIFEST} is nested too deeply to be a dump manifest") from None
    except ValueError as exc:
        raise ValueError(f"{MANIFEST} is not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{MANIFEST} holds {_json_name(manifest)}, not an object")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"not an otel-gpu dump manifest of schema version {SCHEMA_VERSION}")
    _check_shape(manifest)
    return manifest


def _json_name(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    return "null" if value is None else _JSON_NAMES.get(type(value), type(value).__name__)


def _check_shape(manifest: dict[str, Any]) -> None:
    """``ValueError`` naming the first field whose JSON type is not the one replay reads."""

    def want(where: str, value: Any, types_: tuple[type, ...]) -> None:
        ok = isinstance(value, types_) and not (isinstance(value, bool) and bool not in types_)
        if not ok:
            names = " or ".join(
                _JSON_NAMES.get(t, "null" if t is type(None) else "a number") for t in types_
            )
            raise ValueError(f"manifest field {where} must be {names}, not {_json_name(value)}")

    for name, types_ in _FIELD_TYPES.items():
        if name in manifest:
            want(name, manifest[name], types_)
    for name, value in (manifest.get("function") or {}).items():
        if name in ("span_name", "module", "qualname", "instrumented"):
            want(f"function.{name}", value, (str, type(None)))
    for name, value in (manifest.get("files") or {}).items():
        want(f"files.{name}", value, (str, type(None)))
    for i, param in enumerate(manifest.get("params") or []):
        want(f"params[{i}]", param, (dict,))
        want(f"params[{i}].name", param.get("name"), (str,))
        want(f"params[{i}].value", param.get("value"), (dict,))
    for key, meta in (manifest.get("tensors") or {}).items():
        want(f"tensors.{key}", meta, (dict,))
    for key, enc in (manifest.get("mutated") or {}).items():
        want(f"mutated.{key}", enc, (dict,))


def _open_inside(directory: str, filename: Any) -> tuple[int, int]:
    """An open descriptor of the regular file ``directory/filename`` and its size; never a file
    outside the directory.

    ``filename`` must be a plain name (no separator, not ``.``/``..``); a symlink (its target
    may lie anywhere), a folder, a FIFO or a device is refused, so a dump cannot make replay read
    or block on a file outside the call's directory. The caller closes the descriptor.
    """
    if not _plain_name(filename):
        raise DumpFileError(
            f"refusing file name {filename!r}: a dump names only plain files inside its "
            "call's directory"
        )
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(os.path.join(directory, filename), flags)
    except FileNotFoundError as exc:
        raise DumpFileError(f"{filename} is missing from the dump") from exc
    except OSError as exc:
        if os.path.islink(os.path.join(directory, filename)):
            raise DumpFileError(
                f"refusing {filename}: it is a symlink (replay reads only files inside the dump)"
            ) from None
        raise DumpFileError(f"{filename} cannot be read ({exc.strerror or exc})") from None
    try:
        import stat

        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DumpFileError(f"refusing {filename}: not a regular file")
        return fd, info.st_size
    except BaseException:
        os.close(fd)
        raise


def _read_inside(directory: str, filename: Any, limit: int | None = None) -> bytearray:
    """The bytes of the regular file ``directory/filename`` (see :func:`_open_inside`).

    The size is checked against ``limit`` before anything is read, and the bytes are read into
    one buffer of that size: the peak is the file's size, once (a file that grows while it is
    read is refused).
    """
    fd, size = _open_inside(directory, filename)
    try:
        if limit is not None and size > limit:
            raise DumpFileError(
                f"refusing {filename}: {size} bytes, over the {limit} replay reads "
                "(see docs/reliability.md)"
            )
        buf = bytearray(size)
        view, done = memoryview(buf), 0
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            while done < size:
                n = f.readinto(view[done:])
                if not n:
                    raise DumpFileError(f"{filename} shrank while it was read")
                done += n
        if os.read(fd, 1):
            raise DumpFileError(f"{filename} grew while it was read")
        return buf
    except OSError as exc:
        raise DumpFileError(f"{filename} cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def _plain_name(name: Any) -> bool:
    """A file name with no folder part: no separator, not ``.`` or ``..``, no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and os.path.basename(name) == name
        and not (os.altsep and os.altsep in name)
        and "\0" not in name
    )
