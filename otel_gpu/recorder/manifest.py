"""The flight recorder's on-disk format, shared by the recorder (:mod:`otel_gpu.recorder.recorder`) and replay.

One directory per call holds ``manifest.json`` and one tensor file each for inputs
and outputs. Values are encoded as tagged JSON (``{"t": "int", "v": 3}``) so replay
rebuilds them without unpickling anything; tensors are referenced by their key in
the tensor file. The schema is documented in ``docs/flight-recorder.md``.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import os
import re
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from otel_gpu import _files
from otel_gpu.calls import describe
from otel_gpu.calls.metadata import instance_dict
from otel_gpu.recorder.kernel_choices import implementation_choices

__all__ = [
    "DTYPES",
    "MANIFEST",
    "MAX_BYTES",
    "MAX_ITEMS",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_VALUES",
    "RETURNED",
    "SCHEMA_VERSION",
    "Encoder",
    "call_dir_name",
    "encode_json",
    "public_fields",
    "pytree_children",
    "read_manifest",
    "stated_nbytes",
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


_MAX_FIELDS = 64


def pytree_children(value: Any) -> list[tuple[str, Any]] | None:
    """``(key, child)`` pairs of a type registered with ``torch.utils._pytree``, else None.

    The flatten function is registered code: anything it raises, ``SystemExit`` included,
    means None.
    """
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
    except BaseException:  # registered user code
        return None


def _from_dict(value: Any, tp: type) -> dict[str, Any] | None:
    """The fields of a ``from_dict`` encoding, when ``tp.from_dict`` exists and ``value.to_dict()``
    is plain JSON, else None: ``v`` (the dict) and ``implementation`` (the kernel choices the
    config carries outside it, such as ``_attn_implementation``; replay restores them, see
    :mod:`otel_gpu.recorder.kernel_choices`)."""
    to_dict = getattr(value, "to_dict", None)
    if not callable(to_dict) or not callable(getattr(tp, "from_dict", None)):
        return None
    try:
        data = to_dict()
        choices = implementation_choices(value)
        json.dumps([data, choices], allow_nan=False)
    except Exception:
        return None
    return {"v": data, "implementation": choices} if isinstance(data, dict) else None


def _key_name(key: Any, index: int) -> str:
    """A pytree key entry (``MappingKey``, ``GetAttrKey``, ``SequenceKey``) as a path part.

    Only atoms are formatted: anything else is user code, and the child's index stands in.
    """
    for attr in ("key", "name", "idx"):
        part = getattr(key, attr, None)
        if part is not None:
            return _part(part, index)
    return str(index)


def _part(key: Any, index: int) -> str:
    """A dict key as a path part: atoms as text (bounded), anything else by its index."""
    tp = type(key)
    if tp is str:
        return key[:64]
    if tp is int and -(10**18) < key < 10**18:
        return str(key)
    if tp in (bool, float, type(None)):
        return repr(key)
    return str(index)


_NOT_WALKED = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    torch.nn.Module,
)


def public_fields(value: Any) -> list[tuple[str, Any]] | None:
    """Public instance attributes of a plain object, None for what is not walked.

    Read through the interpreter's own ``__dict__`` descriptor (``instance_dict``), never
    ``vars()``, which runs a ``__dict__`` property: user code that may sleep or end the process.
    At most :data:`_MAX_FIELDS` attributes are looked at.
    """
    if issubclass(type(value), _NOT_WALKED) or callable(value):
        return None
    attrs = instance_dict(value)
    if attrs is None:
        return None
    return [
        (k, v)
        for k, v in _first(dict.items(attrs), _MAX_FIELDS)
        if type(k) is str and not k.startswith("_")
    ]


def _first(items: Any, n: int) -> Iterator[Any]:
    """The first ``n`` of ``items``: never more is iterated (a generator may be endless)."""
    return itertools.islice(items, n)


def _type_ref(tp: type) -> str:
    """:func:`type_ref` read through ``type``'s own descriptors: a metaclass property cannot run."""
    module = type.__dict__["__module__"].__get__(tp)
    qualname = type.__dict__["__qualname__"].__get__(tp)
    return f"{module}:{qualname}"


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
    cannot rebuild but can compare are walked leaf by leaf: dicts of any dict type
    (transformers' ``ModelOutput``), types registered with ``torch.utils._pytree``, and
    objects that hold tensors in public attributes (a KV cache). What cannot be recorded
    is encoded as ``unsupported`` and listed in :attr:`unsupported` with its path.

    It runs on the caller's thread, so it never runs a user object's ``__repr__``,
    ``__len__``, ``__iter__``, ``__eq__`` or ``__hash__``: builtin containers are read
    through the builtin methods (at most :data:`MAX_ITEMS` items each, and about
    :data:`MAX_BYTES` of values in all), and an unsupported object is recorded by type and
    ``id``, its repr filled in later by :mod:`otel_gpu.calls.describe`. A cut container is
    encoded as ``unsupported`` with ``truncated`` (its length) and the items kept, so
    replay skips the call and says why.
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
        self.budget = MAX_BYTES  # bytes of values left; below 0 the rest is cut

    def encode(self, value: Any, path: str, depth: int = 0) -> dict[str, Any]:
        """Encode ``value``; never raises, whatever user code ``value`` carries."""
        try:
            return self._encode(value, path, depth)
        except BaseException as exc:  # a user hook (a property, a flatten)
            return self._unsupported(value, path, f"encoding failed: {type(exc).__name__}")

    def _encode(self, value: Any, path: str, depth: int) -> dict[str, Any]:
        tp = type(value)
        self.budget -= 16  # a tag, a number: the small part of every encoded value
        if value is None:
            return {"t": "none"}
        if tp is bool:
            return {"t": "bool", "v": value}
        if tp is int:
            if value.bit_length() > 8192:  # JSON and str() refuse ints past 4300 digits
                return self._unsupported(value, path, f"an int of {value.bit_length()} bits")
            return {"t": "int", "v": value}
        if tp is float:
            return {"t": "float", "v": value if math.isfinite(value) else repr(value)}
        if tp is str:
            if self.secret is not None and self.secret(path.rsplit(".", 1)[-1]):
                return {"t": "redacted"}
            if len(value) > self.budget:
                return self._cut(value, path, f"a str of {len(value)} characters")
            self.budget -= len(value)
            return {"t": "str", "v": value}
        if self.budget < 0:
            return self._cut(value, path, f"a {tp.__name__}")
        if issubclass(tp, torch.Tensor):  # never isinstance: a __class__ property can lie
            return self._tensor(value, path)
        if issubclass(tp, enum.Enum):
            out: dict[str, Any] = {"t": "enum", "type": _type_ref(tp), "name": value._name_}
            inner = value._value_
            if type(inner) in (int, str, bool):
                out["value"] = inner
            return out
        if tp is torch.dtype:
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if tp is torch.device:
            return {"t": "device", "v": str(value)}
        if issubclass(tp, type):
            return {"t": "type", "v": _type_ref(value)}
        if depth >= MAX_DEPTH:
            return self._unsupported(value, path, "nested too deeply")
        if tp is torch.Size:
            return {"t": "size", "v": [int(n) for n in value]}
        if tp is list or tp is tuple:
            node = {"t": tp.__name__, "items": self._items(value, path, depth)}
            return self._maybe_cut(node, value, tp.__len__(value), path)
        if issubclass(tp, tuple) and type(getattr(tp, "_fields", None)) is tuple:
            names = [f if type(f) is str else str(i) for i, f in enumerate(tp._fields)]  # type: ignore[attr-defined]
            items = [
                self.encode(v, f"{path}.{f}", depth + 1)
                for f, v in _first(zip(names, tuple.__iter__(value)), MAX_ITEMS)
                if self.budget >= 0
            ]
            node = {"t": "namedtuple", "type": _type_ref(tp), "items": items}
            return self._maybe_cut(node, value, tuple.__len__(value), path)
        if issubclass(tp, dict):  # dict's own methods: a subclass's overrides never run
            pairs = [
                [
                    self._key(k, path, depth),
                    self.encode(v, f"{path}.{_part(k, i)}", depth + 1),
                ]
                for i, (k, v) in _first(enumerate(dict.items(value)), MAX_ITEMS)
                if self.budget >= 0
            ]
            node = (
                {"t": "dict", "items": pairs}
                if tp is dict
                else {"t": "mapping", "type": _type_ref(tp), "items": pairs}
            )
            return self._maybe_cut(node, value, dict.__len__(value), path)
        if issubclass(tp, (list, tuple, Mapping, set, frozenset)):
            # a user-defined container: reading it means running its __len__/__iter__
            return self._unsupported(value, path, "type not supported by the flight recorder")
        children = pytree_children(value)
        if children is not None:
            named = [
                [k, self.encode(v, f"{path}.{k}", depth + 1)]
                for k, v in _first(children, MAX_ITEMS)
                if self.budget >= 0
            ]
            node = {"t": "pytree", "type": _type_ref(tp), "items": named}
            return self._maybe_cut(node, value, len(children), path)
        if callable(getattr(tp, "to_dict", None)):  # looked up on the type: no __getattr__ runs
            rebuilt = _from_dict(value, tp)
            if rebuilt is not None:  # a transformers config: rebuilt by Type.from_dict(v)
                return {"t": "from_dict", "type": _type_ref(tp), **rebuilt}
        fields = public_fields(value)
        if fields is not None:
            refs, noted, budget = self._tensor_refs, len(self.unsupported), self.budget
            named = [[k, self.encode(v, f"{path}.{k}", depth + 1)] for k, v in fields]
            if self._tensor_refs > refs:  # it holds tensors: worth comparing leaf by leaf
                return {"t": "object", "type": _type_ref(tp), "fields": named}
            del self.unsupported[noted:]
            self.budget = budget
        return self._unsupported(value, path, "type not supported by the flight recorder")

    def _items(self, value: list[Any] | tuple[Any, ...], path: str, depth: int) -> list[Any]:
        """The first :data:`MAX_ITEMS` items within the budget; ints and floats inline, since
        lists of numbers (sequence lengths, offsets) are the common long argument."""
        items: list[Any] = []
        append = items.append
        for i, v in _first(enumerate(value), MAX_ITEMS):
            if self.budget < 0:
                break
            tp = type(v)
            if tp is int and -(2**63) <= v < 2**63:
                self.budget -= 16
                append({"t": "int", "v": v})
            elif tp is float and math.isfinite(v):
                self.budget -= 16
                append({"t": "float", "v": v})
            else:
                append(self.encode(v, f"{path}.{i}", depth + 1))
        return items

    def _key(self, key: Any, path: str, depth: int) -> dict[str, Any]:
        if type(key) is str:  # a key is a name, never redacted itself
            self.budget -= len(key)
            return {"t": "str", "v": key}
        return self.encode(key, path, depth + 1)

    def _maybe_cut(
        self, node: dict[str, Any], value: Any, length: int, path: str
    ) -> dict[str, Any]:
        """``node`` as is, or, when items were left out, marked ``unsupported`` with the cut."""
        kept = len(node["items"])
        if kept >= length:
            return node
        why = (
            f"cut at {kept} of {length} items when recorded (the flight recorder keeps at most "
            f"{MAX_ITEMS} items of a container and about {MAX_BYTES >> 20} MiB of values a call)"
        )
        ref = _type_ref(type(value))
        self.unsupported.append(f"{self.prefix}{path} ({ref}): {why}")
        cut = {"t": "unsupported", "type": ref, "why": why, "truncated": length}
        cut["container"] = node["t"]
        cut["items"] = node["items"]
        return cut

    def _cut(self, value: Any, path: str, what: str) -> dict[str, Any]:
        why = (
            f"{what}, left out when recorded: the call's values passed the flight recorder's "
            f"budget of about {MAX_BYTES >> 20} MiB"
        )
        ref = _type_ref(type(value))
        self.unsupported.append(f"{self.prefix}{path} ({ref}): {why}")
        return {"t": "unsupported", "type": ref, "why": why, "truncated": True}

    def _unsupported(self, value: Any, path: str, why: str) -> dict[str, Any]:
        """Type and id now; the repr later, off the caller's thread (:mod:`otel_gpu.calls.describe`)."""
        tp = type(value)
        ref = _type_ref(tp)
        self.unsupported.append(f"{self.prefix}{path} ({ref}): {why}")
        node = {"t": "unsupported", "type": ref, "id": f"0x{id(value):x}", "repr": "", "why": why}
        if tp is torch.Tensor or tp is torch.nn.Parameter:
            node["repr"] = _tensor_text(value)  # builtin accessors only: no user code
        elif issubclass(tp, torch.Tensor):
            del node["repr"]  # a subclass's repr may read every value: not taken
        else:
            describe.later(node, "repr", value)
        return node

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


def _tensor_text(t: torch.Tensor) -> str:
    """A short description of a tensor the recorder does not store (sparse, nested, meta)."""
    try:
        shape = ", ".join(str(n) for n in t.shape)
        return f"tensor(shape=({shape}), dtype={t.dtype}, layout={t.layout}, device={t.device})"
    except Exception as exc:
        return f"tensor (metadata unavailable: {type(exc).__name__})"


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
