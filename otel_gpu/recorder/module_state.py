"""Rebuilding a ``torch.nn.Module`` receiver for replay: its ``state_dict`` and constructor arguments.

With ``OTEL_GPU_DUMP_MODULES=true`` the flight recorder saves the module's ``state_dict`` below
``<dump dir>/modules/<sha256 of the contents>.pt`` (shared by every call and every identical
module) at its first recorded call, and again at a later call whenever the state changed since
the last record (training, a weight poisoned in place), so each call's manifest names the state
of that moment; it also saves the arguments to construct the module again: each parameter of the
class's ``__init__`` is taken from the module's attribute of the same name (``config``,
``layer_idx``, ``in_features``…); a tensor attribute for a ``bool`` parameter means ``True``
(``nn.Linear(bias=True)`` keeps its bias tensor); parameters with defaults may be absent.
The state file also holds what ``state_dict`` leaves out: non-persistent buffers
(``register_buffer(..., persistent=False)``, e.g. a scale the constructor was given) and plain
tensor attributes, each of the module or of its submodules; the manifest lists their names
(``buffers``, ``attributes``).

Whether the state changed is decided without reading a byte (:class:`_Slots`): each tensor of
the module and its submodules (parameters, buffers, tensor attributes) is checked to be the
same object at the same place, with the same version counter (``t._version``, which every
in-place operation bumps, ``no_grad`` or not) and the same storage pointer (``data_ptr``, which
``param.data = other`` moves); the submodules too are checked to be the same objects, and the
dicts holding them (and each submodule's ``__dict__``) to have the same sizes. All of it is held
by weak reference. A few microseconds a call for a small model, about a quarter of one
``state_dict()`` call (docs/flight-recorder.md). Not seen: a write through ``param.data`` (a tensor with its own
version counter), or through a tensor sharing the storage made with ``.data``; and a module
with its own ``get_extra_state`` is recorded again at every call (that state has no counter).

Replay checks the file against the SHA-256 its name carries (a mismatch is an error naming the
file), constructs the class with the arguments, loads the state strictly and puts the recorded
buffers and attributes back in place of the constructor's. What cannot be rebuilt that way (a
recorded buffer the rebuilt module lacks, one it has that was not recorded) is said, and the
call is skipped with that reason: it is never replayed with the constructor's defaults.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import re
import stat
import threading
import weakref
from typing import Any

import torch

from otel_gpu import _files
from otel_gpu.recorder import manifest, tensor_files, values

__all__ = ["STATE_DIR", "CannotRebuild", "load_state", "record", "restore", "state_path"]

STATE_DIR = "modules"
_STATE_NAME = re.compile(r"^[0-9a-f]{64}\.pt$")
_lock = threading.Lock()
_recorded: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_written_bytes = 0


class CannotRebuild(Exception):
    """The module cannot be reconstructed from its attributes; the message says why."""


_HOLDERS = ("_parameters", "_buffers", "_modules")


class _Slots:
    """Where each tensor and submodule of a module was at its last record, to tell cheaply
    whether its state changed since: for each submodule, its parameter, buffer and submodule
    dicts and its tensor attributes, each entry the same object (by identity) and each dict the
    same size (one added or removed); each tensor the same version counter and storage pointer.

    Everything is held by weak reference: a weight replaced since (``load_state_dict(...,
    assign=True)``, a new submodule) is not kept alive, on its device, by this record."""

    __slots__ = ("always", "subs", "tensors")

    def __init__(self, module: torch.nn.Module) -> None:
        # per submodule: a weak reference, the sizes of its three dicts and of its __dict__, and
        # its entries (dict name or None for a tensor attribute, key, weak reference)
        subs: list[tuple[Any, tuple[int, ...], tuple[tuple[str | None, str, Any], ...]]] = []
        tensors: list[tuple[weakref.ref[torch.Tensor], int, int]] = []
        self.always = False  # a get_extra_state of its own: no counter tells its changes
        for sub in module.modules():
            if type(sub).get_extra_state is not torch.nn.Module.get_extra_state:
                self.always = True
            attrs = vars(sub)
            entries: list[tuple[str | None, str, Any]] = []
            for name in _HOLDERS:
                entries.extend((name, k, _weak(v)) for k, v in attrs[name].items())
            own = {k: v for k, v in attrs.items() if isinstance(v, torch.Tensor)}
            entries.extend((None, k, _weak(v)) for k, v in own.items())
            subs.append((weakref.ref(sub), _sizes(attrs), tuple(entries)))
            for t in (*sub._parameters.values(), *sub._buffers.values(), *own.values()):
                if t is not None:
                    tensors.append((weakref.ref(t), t._version, _pointer(t)))
        self.subs = subs
        self.tensors = tensors

    def changed(self) -> bool:
        """Whether anything moved since these slots were taken (dict look-ups and two
        attribute reads per tensor; no tensor data is read)."""
        if self.always:
            return True
        for ref, sizes, entries in self.subs:
            sub = ref()
            if sub is None:
                return True
            attrs = sub.__dict__
            if _sizes(attrs) != sizes:
                return True
            for name, key, value in entries:
                holder = attrs if name is None else attrs[name]
                if holder.get(key) is not value():
                    return True
        for tref, version, pointer in self.tensors:
            t = tref()
            if t is None or t._version != version or (pointer and t.data_ptr() != pointer):
                return True
        return False


def _sizes(attrs: dict[str, Any]) -> tuple[int, int, int, int]:
    """A parameter, buffer, submodule or attribute added or removed changes one of these."""
    return (
        len(attrs["_parameters"]),
        len(attrs["_buffers"]),
        len(attrs["_modules"]),
        len(attrs),
    )


def _none() -> None:
    return None


def _weak(value: Any) -> Any:
    """A weak reference to a tensor or module; for ``None`` (an empty slot), a function that
    returns ``None`` (called alike: no branch in the check)."""
    return _none if value is None else weakref.ref(value)


def _pointer(t: torch.Tensor) -> int:
    """The tensor's storage pointer; 0 (not checked) for a tensor without storage (meta, some
    subclasses), or with none yet: its version counter decides."""
    try:
        return int(t.data_ptr())
    except Exception:
        return 0


def record(
    module: torch.nn.Module, root: str, enc: values.Encoder, max_bytes: int
) -> dict[str, Any]:
    """The manifest's receiver for ``module``: its type, constructor arguments and state file.

    The state is written at the module's first recorded call, and again whenever it changed
    since the last record (:class:`_Slots`); calls in between refer to the last one written.
    Raises :class:`CannotRebuild` when the constructor arguments cannot be found, the state is
    over the size limit or cannot be written (``modules/`` is a symlink, the disk is full); an
    unchanged module that could not be recorded is refused again without trying again.
    """
    with _lock:
        known = _recorded.get(module)
    if known is not None and known["slots"].changed():
        known = None  # the state of this moment differs from the one recorded: record it
    elif known is not None and "error" in known:
        raise CannotRebuild(known["error"])
    if known is None:
        slots = _Slots(module)  # taken before the copy: a change during it is seen next call
        try:
            known = _record_state(module, root, max_bytes)
        except CannotRebuild as exc:
            with _lock:
                _recorded[module] = {"slots": slots, "error": str(exc)}
            raise
        known["slots"] = slots
        with _lock:
            _recorded[module] = known
    return {
        "t": "module",
        "type": manifest.type_ref(type(module)),
        "init": {k: enc.encode(v, f"self.{k}") for k, v in known["init"].items()},
        "state": known["state"],
        "device": known["device"],
        "training": module.training,
        "buffers": known["buffers"],
        "attributes": known["attributes"],
    }


def _record_state(module: torch.nn.Module, root: str, max_bytes: int) -> dict[str, Any]:
    """Copy ``module``'s state to the host and write it (content-addressed); what the
    manifest's receiver needs of it."""
    global _written_bytes
    init = _init_arguments(module)
    extras = _extras(module)
    try:
        state = {k: _host(v) for k, v in module.state_dict().items()}
        state.update((k, _host(getattr(owner, leaf))) for k, (owner, leaf, _) in extras.items())
    except Exception as exc:  # extra state that is not a tensor, a tensor with no data
        raise CannotRebuild(
            f"its state could not be recorded ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with _lock:
        if _written_bytes + nbytes > max_bytes:
            raise CannotRebuild(
                f"its state ({nbytes / 2**20:.1f} MiB) would exceed "
                f"OTEL_GPU_DUMP_MODULES_MAX_MB={max_bytes / 2**20:g}"
            )
        _written_bytes += nbytes
    name = _content_hash(state) + ".pt"
    try:
        _write_state(root, name, state)
    except OSError as exc:  # this call goes without its module; the dump goes on
        raise CannotRebuild(f"its state could not be written: {exc}") from None
    device = next((str(t.device) for t in module.state_dict().values()), "cpu")
    return {
        "init": init,
        "state": name,
        "device": device,
        "buffers": sorted(k for k, v in extras.items() if v[2] == "buffer"),
        "attributes": sorted(k for k, v in extras.items() if v[2] == "attribute"),
    }


def _host(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a {type(value).__name__} in the state is not a tensor")
    return value.detach().to("cpu").contiguous()


def _extras(module: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, str]]:
    """What ``state_dict`` leaves out: ``{dotted name: (owner, name, "buffer" | "attribute")}``
    for every non-persistent buffer and plain tensor attribute of ``module`` and its submodules."""
    found: dict[str, tuple[torch.nn.Module, str, str]] = {}
    for prefix, sub in module.named_modules():
        dot = prefix + "." if prefix else ""
        for leaf in sorted(getattr(sub, "_non_persistent_buffers_set", ())):
            if sub._buffers.get(leaf) is not None:
                found[dot + leaf] = (sub, leaf, "buffer")
        for leaf, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                found[dot + leaf] = (sub, leaf, "attribute")
    return found


def restore(module: torch.nn.Module, rec: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into the rebuilt ``module``: its ``state_dict`` strictly, then the recorded
    non-persistent buffers and tensor attributes in place of those the constructor made.

    Raises :class:`CannotRebuild` when the rebuilt module's buffers and tensor attributes are not
    the recorded ones (one missing, one more, a dump recorded without them), and
    :class:`~otel_gpu.recorder.manifest.DumpFileError` when the manifest names ones the file lacks.
    Only names the rebuilt module already holds as tensors are set.
    """
    now = _extras(module)
    listed = {"buffer": rec.get("buffers"), "attribute": rec.get("attributes")}
    if any(v is None for v in listed.values()):
        if now:
            raise CannotRebuild(
                f"it has state outside its state_dict ({', '.join(sorted(now)[:3])}) that was "
                "not recorded (a dump of an older otel-gpu): replay would use the "
                "constructor's values"
            )
        listed = {"buffer": [], "attribute": []}
    recorded: dict[str, str] = {}
    for kind, names in listed.items():
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise manifest.DumpFileError(f"receiver.{kind}s: not a list of names")
        for n in names:
            if n not in state:
                raise manifest.DumpFileError(
                    f"receiver.{kind}s: {n!r} is not in the module's state file"
                )
            recorded[n] = kind
    for n, kind in recorded.items():
        if n not in now or now[n][2] != kind:
            raise CannotRebuild(
                f"the recorded module had a {kind} {n!r} that the rebuilt one lacks"
            )
    for n, (_, _, kind) in now.items():
        if n not in recorded:
            raise CannotRebuild(f"the rebuilt module has a {kind} {n!r} that was not recorded")
    module.load_state_dict({k: v for k, v in state.items() if k not in recorded}, strict=True)
    for n, (owner, leaf, kind) in now.items():
        if kind == "buffer":
            owner._buffers[leaf] = state[n]
        else:
            object.__setattr__(owner, leaf, state[n])


def _write_state(root: str, name: str, state: dict[str, torch.Tensor]) -> None:
    """Write ``<root>/modules/<name>`` unless a regular file of that name is there already
    (identical modules share one file).

    ``modules/`` is otel-gpu's: created 0700 (the root and its parents too), or an existing one
    must be a real folder of this user's. The file is written as every dump file is
    (:mod:`otel_gpu._files`: 0600, a random temporary name, renamed into place), so a symlink
    planted at the temporary or the final name is never written through: a link at the final
    name is replaced by the state.
    """
    if not _files.make_dirs(root):
        _files.warn_if_shared(root, "dump dir (OTEL_GPU_DUMP_DIR)")
    created = not os.path.lexists(os.path.join(root, STATE_DIR))
    directory = _files.own_dir(root, STATE_DIR)
    try:
        if stat.S_ISREG(os.lstat(os.path.join(directory, name)).st_mode):
            return
    except FileNotFoundError:
        pass
    try:
        _files.write_atomic(directory, name, lambda f: torch.save(state, f))
    except BaseException:
        if created:  # made for this state alone: not left behind empty (a full disk)
            with contextlib.suppress(OSError):
                os.rmdir(directory)  # refused where another state was written meanwhile
        raise


def _init_arguments(module: torch.nn.Module) -> dict[str, Any]:
    cls = type(module)
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        raise CannotRebuild(f"the constructor of {cls.__qualname__} has no signature") from None
    found: dict[str, Any] = {}
    P = inspect.Parameter
    for p in params:
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            continue
        has = p.name in module.__dict__ or hasattr(module, p.name)
        value = getattr(module, p.name, None) if has else None
        if has and isinstance(value, (torch.Tensor, torch.nn.Module)):
            if isinstance(p.default, bool):
                value = True  # nn.Linear(bias=True) keeps the tensor, not the flag
            else:
                has = False
        elif has and value is None and isinstance(p.default, bool):
            value = False
        if has:
            found[p.name] = value
        elif p.default is P.empty:
            raise CannotRebuild(
                f"constructor parameter {p.name!r} of {cls.__qualname__} is not an attribute "
                "of the module, so replay cannot construct it again"
            )
    return found


def _content_hash(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(state):
        t = state[key]
        digest.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def state_path(call_dir: str, name: str) -> str:
    """Where a manifest's module state lives: ``modules/`` beside the call's directory, or one
    level up for a call in a ring dump (``<dump dir>/ring-…/<call>``). Refuses names that are not
    a content hash, so a dump cannot point outside its own tree."""
    if not isinstance(name, str) or not _STATE_NAME.fullmatch(name):
        raise manifest.DumpFileError(
            f"receiver.state: refusing module state name {name!r} (must be <sha256>.pt)"
        )
    parent = os.path.dirname(os.path.abspath(call_dir))
    path = os.path.join(parent, STATE_DIR, name)
    if not os.path.lexists(path) and os.path.basename(parent).startswith("ring-"):
        path = os.path.join(os.path.dirname(parent), STATE_DIR, name)
    return path


def load_state(call_dir: str, name: str) -> dict[str, torch.Tensor]:
    """The recorded state (tensors only: ``weights_only`` loading, nothing unpickled).

    Raises :class:`otel_gpu.recorder.manifest.DumpFileError` naming the file when it is missing, corrupt,
    not inside the dump's own ``modules/`` folder (that folder or the file a symlink), when its
    archive's entries hold more bytes than the file itself (compressed entries that would inflate
    in memory; the recorder writes none), or when its contents do not match the SHA-256 its name
    carries (changed after it was recorded).
    """
    path = state_path(call_dir, name)
    folder = os.path.dirname(path)
    if os.path.islink(folder):
        raise manifest.DumpFileError(
            f"receiver.state: refusing {STATE_DIR}/{name}: the {STATE_DIR}/ folder is a symlink "
            "(replay reads only files inside the dump)"
        )
    try:  # the archive's entries may not hold more than the file's own bytes (no inflating)
        on_disk: int | None = os.lstat(path).st_size
    except OSError:
        on_disk = None  # missing: load_tensors says so, naming the file
    state = tensor_files.load_tensors(folder, name, f"receiver.state ({STATE_DIR}/)", on_disk)
    if _content_hash(state) + ".pt" != name:
        raise manifest.DumpFileError(
            f"receiver.state: {STATE_DIR}/{name} does not match the SHA-256 its name carries "
            "(its contents changed after it was recorded)"
        )
    return state


def _reset_for_tests() -> None:
    global _written_bytes
    with _lock:
        _recorded.clear()
        _written_bytes = 0
