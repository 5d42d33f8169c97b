"""Rebuilding one recorded call for replay: the function, its receiver, its arguments, its torch state.

Everything a manifest names is treated as untrusted: it decodes to data, never to behaviour.
Types and the function are resolved through :mod:`otel_gpu.replay.trust` (the allow list and
the denylist); the only callables replay invokes are the constructors of such classes and the
recorded function, which must carry otel-gpu's decorator.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from otel_gpu.recorder import manifest as _manifest
from otel_gpu.recorder import tensor_files
from otel_gpu.replay.compare import Mismatch, compare
from otel_gpu.replay.kernel_choices import restore_implementation_choices
from otel_gpu.replay.trust import (
    Allow,
    Refused,
    Skip,
    resolve_function,
    resolve_type,
)

__all__ = [
    "PreparedCall",
    "device_mapper",
    "prepare_call",
]


def device_mapper(mapping: dict[str, str]) -> Callable[[str], str]:
    """``{"cuda": "cpu"}`` maps every cuda device; ``{"cuda:1": "cuda:0"}`` one; ``{"*": "cpu"}`` all."""

    def map_device(device: str) -> str:
        return (
            mapping.get(device) or mapping.get(device.split(":")[0]) or mapping.get("*") or device
        )

    return map_device


_MAX_DECODE_DEPTH = 2 * _manifest.MAX_DEPTH
_KEY_TYPES = (str, int, float, bool, type(None), enum.Enum, torch.dtype, torch.device, type, tuple)
"""What a rebuilt dict or mapping may use as a key: hashable values replay built itself."""


class _Decoder:
    """Tagged JSON back to values; tensors get their recorded layout on the mapped device."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        allow: Allow,
        map_device: Callable[[str], str],
    ) -> None:
        self.tensors = tensors
        self.meta = meta
        self.allow = allow
        self.map_device = map_device
        self.cache: dict[str, torch.Tensor] = {}
        self.directory = ""  # the call's directory (module states live beside it)

    def decode(self, enc: dict[str, Any], path: str, depth: int = 0) -> Any:
        """The value ``enc`` encodes; only the classes :func:`resolve_type` admits are built."""
        if depth > _MAX_DECODE_DEPTH:  # the recorder nests 16 levels: deeper is crafted
            raise Refused(
                f"refused: argument {path} is nested more than {_MAX_DECODE_DEPTH} levels deep "
                f"(the recorder writes at most {_manifest.MAX_DEPTH})"
            )
        if not isinstance(enc, dict):
            raise Refused(f"refused: argument {path} is not a tagged value ({type(enc).__name__})")
        tag = enc.get("t")
        inner = depth + 1
        if tag == "none":
            return None
        if tag in ("bool", "int", "str"):
            value = enc.get("v")
            if type(value) is not {"bool": bool, "int": int, "str": str}[tag]:
                raise Refused(f"refused: argument {path} is tagged {tag} but holds another type")
            return value
        if tag == "float":
            return float(enc["v"])
        if tag == "tensor":
            return self._tensor(enc["key"], path)
        if tag == "dtype":
            dtype = _manifest.DTYPES.get(str(enc.get("v")))
            if dtype is None:
                raise ValueError(f"{path}: unknown dtype {enc['v']!r}")
            return dtype
        if tag == "device":
            return torch.device(self.map_device(str(enc["v"])))
        if tag == "size":
            return torch.Size(int(v) for v in enc["v"])
        if tag in ("list", "tuple"):
            items = [self.decode(v, f"{path}[{i}]", inner) for i, v in enumerate(enc["items"])]
            return items if tag == "list" else tuple(items)
        if tag == "dict":
            return self._items(enc, path, inner)
        if tag == "enum":
            cls = resolve_type(enc.get("type"), self.allow)
            if not issubclass(cls, enum.Enum):
                raise Refused(f"refused: {enc['type']} is not an Enum")
            member = cls.__members__.get(str(enc.get("name")))
            if member is None:
                raise Skip(f"argument {path}: {enc['type']} has no member {enc.get('name')!r}")
            return member
        if tag == "namedtuple":
            cls = resolve_type(enc.get("type"), self.allow)
            if not (issubclass(cls, tuple) and hasattr(cls, "_fields")):
                raise Refused(f"refused: {enc['type']} is not a namedtuple")
            return cls(*(self.decode(v, f"{path}[{i}]", inner) for i, v in enumerate(enc["items"])))
        if tag == "type":
            return resolve_type(enc.get("v"), self.allow)
        if tag == "mapping":
            return self._mapping(enc, path, inner)
        if tag == "from_dict":
            cls = resolve_type(enc.get("type"), self.allow)
            build = getattr(cls, "from_dict", None)
            if not callable(build) or not callable(getattr(cls, "to_dict", None)):
                raise Refused(f"refused: {enc['type']} has no from_dict()")
            if not isinstance(enc.get("v"), dict):
                raise Refused(f"refused: argument {path}: from_dict() takes a dict")
            config = build(enc["v"])
            return restore_implementation_choices(config, enc.get("implementation"), path)
        if tag in ("pytree", "object"):
            what = "a pytree container" if tag == "pytree" else "an object holding tensors"
            raise Skip(
                f"argument {path} is {what} of type {enc.get('type')}: "
                "replay cannot rebuild such an argument"
            )
        if tag == "redacted":
            raise Skip(f"argument {path} was redacted when recorded (OTEL_GPU_REDACT)")
        if tag == "unsupported":
            raise Skip(
                f"argument {path} (a {enc.get('type')}) was not recorded: "
                f"{enc.get('why') or 'type not supported by the flight recorder'}"
            )
        raise ValueError(f"{path}: unknown value tag {tag!r}")

    def _items(self, enc: dict[str, Any], path: str, depth: int) -> dict[Any, Any]:
        """The ``[[key, value], ...]`` pairs of a dict or mapping; keys must be plain atoms."""
        items: dict[Any, Any] = {}
        for i, pair in enumerate(enc["items"]):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise Refused(f"refused: {path}[{i}] is not a [key, value] pair")
            key = self.decode(pair[0], f"{path}.key", depth)
            if not isinstance(key, _KEY_TYPES):
                raise Refused(f"refused: {path}[{i}] has a key of type {type(key).__name__}")
            items[key] = self.decode(pair[1], f"{path}[{i}]", depth)
        return items

    def _mapping(self, enc: dict[str, Any], path: str, depth: int = 0) -> Any:
        """A dict subclass (e.g. transformers' ModelOutput) rebuilt from its items by its type."""
        cls = resolve_type(enc.get("type"), self.allow)
        if not issubclass(cls, Mapping):
            raise Refused(f"refused: {enc['type']} is not a Mapping")
        items = self._items(enc, path, depth)
        make: Any = cls
        try:
            if all(type(k) is str for k in items):
                return make(**items)
            return make(items)
        except Exception as exc:
            raise Skip(
                f"argument {path} is a {enc['type']} that replay could not rebuild from its "
                f"items ({type(exc).__name__}: {exc})"
            ) from None

    def _tensor(self, key: str, path: str) -> torch.Tensor:
        if key in self.cache:
            return self.cache[key]  # the same tensor passed twice stays one object
        meta = self.meta[key]
        device = self.map_device(meta["device"])
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise Skip(
                f"argument {path} would be placed on {device} (recorded on {meta['device']}), "
                "but this machine has no CUDA device; map it with --device, e.g. --device cuda=cpu"
            )
        t = tensor_files.restore_layout(self.tensors[key], meta, device)
        if meta.get("requires_grad") and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        self.cache[key] = t
        return t


def _arguments(
    fn: Callable[..., Any],
    params: list[dict[str, Any]],
    decoder: _Decoder,
    receiver: bool,
    positional_count: int | None = None,
) -> tuple[list, dict]:
    """Positional and keyword arguments as the caller passed them; defaults are left to the function.

    ``positional_count`` (recorded since the manifest has it): how many arguments the call passed
    positionally; the rest go by keyword, as they did, so a wrapper that looks for a keyword
    (``use_cache=``) finds it where the original call put it.
    """
    recorded = {p["name"]: p for p in params}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional = True
    P = inspect.Parameter
    sig = list(inspect.signature(fn).parameters.values())
    index = 0
    for param in sig[1:] if receiver else sig:
        rec = recorded.get(param.name)
        is_positional = param.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
        if rec is None or rec.get("default"):
            if is_positional:
                positional = False
            continue
        value = decoder.decode(rec["value"], param.name)
        if is_positional:
            by_position = positional and (
                positional_count is None
                or index < positional_count
                or param.kind is P.POSITIONAL_ONLY
            )
            index += 1
            if by_position:
                args.append(value)
            else:
                positional = False
                kwargs[param.name] = value
        elif param.kind is P.VAR_POSITIONAL:
            args.extend(value)
        elif param.kind is P.KEYWORD_ONLY:
            kwargs[param.name] = value
        else:
            kwargs.update(value)
    return args, kwargs


@dataclass(eq=False, repr=False)  # a plain record; its repr stays the object's (no tensors)
class PreparedCall:
    """A recorded call ready to run: ``run()`` then ``compare()``."""

    directory: str
    manifest: dict[str, Any]
    fn: Callable[..., Any]
    args: list
    kwargs: dict
    decoder: _Decoder
    notes: list[str]
    nonfinite_expected: int = field(default=0, init=False)
    """NaN/Inf values in the recorded outputs (set by compare)."""

    def run(self) -> tuple[BaseException | None, Any]:
        """Call the function under the recorded grad/inference mode; returns (exception, value)."""
        with _torch_state(self.manifest.get("torch_state") or {}):
            try:
                value = self.fn(*self.args, **self.kwargs)
                if inspect.iscoroutine(value):  # an async API: run it to completion here
                    import asyncio

                    value = asyncio.run(value)
                if any(t.is_cuda for t in self.decoder.cache.values()):
                    torch.cuda.synchronize()  # asynchronous kernel errors belong to this call
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                return exc, None
        return None, value

    def compare(
        self, value: Any, tol: tuple[float | None, float | None]
    ) -> tuple[list[Mismatch], list[str]]:
        """Differences between ``value`` (and inputs changed in place) and the recording.

        Returns the mismatches and the parts that were not compared (not recorded), each with why.
        """
        files = self.manifest.get("files") or {}
        meta = self.manifest.get("tensors") or {}
        expected = tensor_files.load_tensors(
            self.directory,
            files.get("outputs"),
            "files.outputs",
            _manifest.stated_nbytes(meta),
            len(meta),
        )
        self.nonfinite_expected = sum(
            int((~torch.isfinite(t)).sum())
            for t in expected.values()
            if t.is_floating_point() or t.is_complex()
        )
        out: list[Mismatch] = []
        unchecked: list[str] = []
        mapper = self.decoder.map_device
        compare(
            self.manifest.get("result") or {"t": "none"},
            value,
            expected,
            "output",
            tol,
            mapper,
            out,
            unchecked,
        )
        for key, enc in (self.manifest.get("mutated") or {}).items():
            actual = self.decoder.cache.get(key)
            name = "in-place " + key.removeprefix("input.")
            compare(enc, actual, expected, name, tol, mapper, out, unchecked)
        return out, unchecked


def prepare_call(
    directory: str, manifest: dict[str, Any], allow: Allow, device_map: dict[str, str]
) -> PreparedCall:
    """Resolve, load and decode everything a recorded call needs. Raises :class:`Skip` or an error."""
    if not manifest.get("replayable", False):
        raise Skip(str(manifest.get("why_not_replayable") or "not replayable"))
    fn, owner = resolve_function(manifest.get("function") or {}, allow)
    files = manifest.get("files") or {}
    meta = manifest.get("tensors") or {}
    stated = _manifest.stated_nbytes(meta)
    tensors = tensor_files.load_tensors(
        directory, files.get("inputs"), "files.inputs", stated, len(meta)
    )
    decoder = _Decoder(tensors, manifest.get("tensors") or {}, allow, device_mapper(device_map))
    decoder.directory = directory
    notes: list[str] = []
    receiver = _receiver(manifest, owner, decoder)
    args, kwargs = _arguments(
        fn,
        manifest.get("params") or [],
        decoder,
        receiver is not None,
        manifest.get("positional"),
    )
    if receiver is not None:
        args.insert(0, receiver)
    return PreparedCall(directory, manifest, fn, args, kwargs, decoder, notes)


def _receiver(manifest: dict[str, Any], owner: type | None, decoder: _Decoder) -> Any:
    rec = manifest.get("receiver")
    if not (manifest.get("function") or {}).get("receiver"):
        return None
    if not rec or rec.get("t") == "unsupported":
        why = (rec or {}).get("why") or "the receiver was not recorded"
        raise Skip(f"stateful method: {why}")
    if rec.get("t") not in ("class", "module", "state"):
        raise Refused(f"refused: receiver kind {rec.get('t')!r} is not class, module or state")
    if owner is None:  # a plain function: no class of the dump's choosing is built for it
        raise Refused(
            "refused: the manifest gives a receiver to a function that is not a method of a "
            "class (replay builds a receiver only for a method, of the method's class)"
        )
    cls = resolve_type(rec.get("type"), decoder.allow)  # a class from an allowed module only
    if not issubclass(cls, owner):
        raise Refused(
            f"refused: receiver type {rec['type']} is not a subclass of the method's class"
        )
    if rec["t"] == "class":
        return cls
    if rec["t"] == "module":
        return _module(rec, cls, decoder)
    if "__otel_gpu_state__" not in dir(cls):  # construction is opt-in, per class
        raise Skip(f"stateful method: {rec['type']} has no __otel_gpu_state__ hook")
    state = decoder.decode(rec["state"], "self")
    rebuild = getattr(cls, "__otel_gpu_rebuild__", None)
    return rebuild(state) if rebuild is not None else cls(**state)


def _module(rec: dict[str, Any], cls: type, decoder: _Decoder) -> Any:
    """A ``torch.nn.Module`` receiver constructed again and loaded with its recorded state."""
    from otel_gpu.recorder import module_state

    if not issubclass(cls, torch.nn.Module):
        raise Refused(f"refused: receiver type {rec['type']} is not a torch.nn.Module")
    init = {k: decoder.decode(v, f"self.{k}") for k, v in (rec.get("init") or {}).items()}
    directory = decoder.directory
    # a DumpFileError here becomes the call's verdict (error)
    state = module_state.load_state(directory, rec.get("state", ""))
    try:
        module = cls(**init)
        module_state.restore(module, rec, state)
    except _manifest.DumpFileError:
        raise
    except module_state.CannotRebuild as exc:
        raise Skip(f"stateful method: {rec['type']} cannot be rebuilt as recorded: {exc}") from None
    except Exception as exc:
        raise Skip(
            f"stateful method: {rec['type']} could not be rebuilt from its recorded constructor "
            f"arguments and state ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    module.train(bool(rec.get("training", False)))
    return module.to(decoder.map_device(str(rec.get("device", "cpu"))))


@contextlib.contextmanager
def _torch_state(state: dict[str, Any]) -> Iterator[None]:
    default = torch.get_default_dtype()
    dtype = _manifest.DTYPES.get(str(state.get("default_dtype", "")))
    try:
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            torch.set_default_dtype(dtype)
        with (
            torch.inference_mode(bool(state.get("inference_mode", False))),
            torch.set_grad_enabled(bool(state.get("grad_enabled", True))),
        ):
            yield
    finally:
        torch.set_default_dtype(default)
