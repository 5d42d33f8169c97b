"""``otel-gpu workloads --emit DIR``: definition and workload files a benchmark rebuilds inputs from.

Layout (docs/workloads.md has the fields)::

    DIR/definitions/<function>-<signature>.json   one per signature
    DIR/workloads/<function>.jsonl                one line per signature of the function
    DIR/flashinfer/<definition name>.json         FlashInfer's own definition (fi_trace)

Every name comes from a trace, which may be hostile: file names are made of ``[A-Za-z0-9._-]``
only (:func:`safe_name`), never start with a dot, and every file is created inside ``DIR``'s
own sub-folders (a symlink at a file's name is replaced, never written through). Nothing read
from a trace is imported or run; FlashInfer's ``fi_trace`` is the installed package's, called
with meta tensors of the recorded shapes (no kernel, no device memory).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from otel_gpu import _files
from otel_gpu.workloads.signature import FORMAT, definition, encode, safe_name

if TYPE_CHECKING:
    from otel_gpu.traces.workloads import Workload

__all__ = ["FORMAT", "EmitError", "emit_files", "rebuild_inputs", "safe_name"]

_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


class EmitError(ValueError):
    """``--emit DIR`` cannot be written; the message says why."""


def _dtype_name(raw: Any) -> str:
    return str(raw).removeprefix("torch.")


def _dump_refs(dump_dir: str | None) -> tuple[dict[str, dict[str, Any]], str | None]:
    """``param -> {"type": "safetensors"|"torch", "path", "tensor_key"}`` for the tensors a
    level-10 dump holds for its inputs, and why none could be read (None when read)."""
    if not dump_dir:
        return {}, None
    try:
        from otel_gpu.recorder.manifest import read_manifest

        manifest = read_manifest(dump_dir)
    except (OSError, ValueError) as exc:
        return {}, f"{dump_dir}: {exc}"
    filename = (manifest.get("files") or {}).get("inputs")
    if not isinstance(filename, str) or os.path.basename(filename) != filename:
        return {}, f"{dump_dir}: no input tensor file"
    kind = "safetensors" if filename.endswith(".safetensors") else "torch"
    refs = {}
    for param in manifest.get("params") or []:
        value = param.get("value") or {}
        if value.get("t") == "tensor" and isinstance(value.get("key"), str):
            path = os.path.join(dump_dir, filename)
            refs[param["name"]] = {"type": kind, "path": path, "tensor_key": value["key"]}
    return refs, None


def emit_files(directory: str, workloads: Sequence[Workload]) -> int:
    """Write the files of ``workloads`` under ``directory``; returns how many were written."""
    try:
        _files.make_dirs(directory)
        folders = {n: _files.own_dir(directory, n) for n in ("definitions", "workloads")}
    except OSError as exc:
        raise EmitError(f"cannot write to {directory}: {exc.strerror or exc}") from None
    written = 0
    lines: dict[str, list[dict[str, Any]]] = {}
    everything = sum(len(w.calls) for w in workloads)
    fi_names: dict[str, str] = {}
    for w in workloads:
        first = w.calls[0]
        name = f"{safe_name(w.function)}-{w.id}"
        fi_def = _flashinfer_definition(directory, w)
        if fi_def is not None:
            fi_names[w.id] = fi_def["name"]
            written += 1
        summary = w.as_json(everything)
        defined = {
            **definition(w.function, w.id, w.signature, first.inputs, first.outputs),
            "flashinfer_definition": fi_names.get(w.id),
            **{k: summary[k] for k in ("calls", "share", "time", "total_s", "p50_s", "p99_s")},
        }
        _write(folders["definitions"], f"{name}.json", encode(defined))
        written += 1
        inputs = dict(defined["inputs"])
        dump = summary["dump_dir"]
        refs, why = _dump_refs(dump)
        for param, ref in refs.items():
            if param in inputs and inputs[param].get("type") == "random":
                inputs[param] = {**inputs[param], **ref}
        line = {
            "definition": fi_names.get(w.id, name),
            "solution": None,
            "workload": {
                "uuid": w.id,
                "axes": _axes(fi_def, first),
                "inputs": _fi_inputs(fi_def, first, inputs) if fi_def else inputs,
            },
            "evaluation": None,
            "otel_gpu": {
                "format": FORMAT,
                "function": w.function,
                "definition_file": f"definitions/{name}.json",
                "calls": summary["calls"],
                "dump_dir": dump,
                **({"inputs": inputs} if fi_def else {}),
                **({"dump_unreadable": why} if why else {}),
            },
        }
        lines.setdefault(w.function, []).append(line)
    for function, entries in lines.items():
        text = "".join(json.dumps(e, default=str) + "\n" for e in entries)
        _write(folders["workloads"], f"{safe_name(function)}.jsonl", text.encode("utf-8"))
        written += 1
    return written


def _write(folder: str, name: str, data: bytes) -> None:
    try:
        _files.write_atomic_bytes(folder, name, data)
    except OSError as exc:
        raise EmitError(f"cannot write {name} in {folder}: {exc.strerror or exc}") from None


# --------------------------------------------------------------------------- FlashInfer


def _flashinfer_target(function: str) -> Any:
    """The installed FlashInfer API named ``flashinfer.<name>`` that has ``fi_trace``, or None.

    Only plain identifiers are looked up, attribute by attribute, from the package itself."""
    parts = function.split(".")
    if parts[0] != "flashinfer" or len(parts) < 2 or not all(_IDENT.fullmatch(p) for p in parts):
        return None
    try:
        import flashinfer
    except Exception:
        return None
    node: Any = flashinfer
    for part in parts[1:]:
        node = getattr(node, part, None)
        if node is None:
            return None
    tracer = getattr(node, "fi_trace", None)
    return tracer if callable(tracer) else None


def _meta_kwargs(call_inputs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    import torch

    from otel_gpu.recorder.manifest import DTYPES

    kwargs: dict[str, Any] = {}
    for path, fields in call_inputs.items():
        if "." in path:
            continue  # inside a container: fi_trace takes top-level arguments
        if "dtype" in fields and isinstance(fields.get("shape"), list):
            dtype = DTYPES.get(_dtype_name(fields["dtype"]))
            shape = fields["shape"]
            if dtype is None or not all(type(n) is int and 0 <= n < 2**40 for n in shape):
                return None
            kwargs[path] = torch.empty(shape, dtype=dtype, device="meta")
        elif "value" in fields and fields.get("default") is not True:
            value = fields.get("enum_value", fields["value"])
            kwargs[path] = None if value == "None" else value
    return kwargs


def _flashinfer_definition(directory: str, w: Workload) -> dict[str, Any] | None:
    """FlashInfer's own definition of ``w``'s signature, written to ``DIR/flashinfer/``."""
    tracer = _flashinfer_target(w.function)
    if tracer is None:
        return None
    kwargs = _meta_kwargs(w.calls[0].inputs)
    if kwargs is None:
        return None
    try:
        scratch = tempfile.mkdtemp(prefix=".fi_trace-", dir=directory)
    except OSError as exc:
        raise EmitError(f"cannot write to {directory}: {exc.strerror or exc}") from None
    try:  # fi_trace writes its file when given a folder: a scratch one, never another place
        fi_def = tracer(save_dir=scratch, **kwargs)
    except Exception:
        return None  # a signature FlashInfer's template does not describe: ours only
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not isinstance(fi_def, dict) or not isinstance(fi_def.get("name"), str):
        return None
    try:
        folder = _files.own_dir(directory, "flashinfer")
    except OSError as exc:
        raise EmitError(f"cannot write to {directory}: {exc.strerror or exc}") from None
    _write(folder, f"{safe_name(fi_def['name'])}.json", encode(fi_def))
    return fi_def


def _fi_params(fi_def: dict[str, Any], call: Any) -> dict[str, str]:
    """The recorded parameter behind each input of FlashInfer's definition: the one of the same
    name, else the one at the same position among the tensor parameters (FlashInfer's
    ``hidden_states`` is ``rmsnorm``'s ``input``)."""
    tensors = [p for p, f in call.inputs.items() if "." not in p and "shape" in f and "dtype" in f]
    out = {}
    wanted = [k for k, v in (fi_def.get("inputs") or {}).items() if isinstance(v, dict)]
    for i, key in enumerate(wanted):
        if key in call.inputs:
            out[key] = key
        elif fi_def["inputs"][key].get("shape") is not None and i < len(tensors):
            out[key] = tensors[i]
    return out


def _axes(fi_def: dict[str, Any] | None, call: Any) -> dict[str, int]:
    """The values of the definition's axes in this signature, read from the recorded shapes."""
    if not fi_def:
        return {}
    axes: dict[str, int] = {}
    for key, param in _fi_params(fi_def, call).items():
        dims = (fi_def["inputs"][key] or {}).get("shape")
        shape = call.inputs.get(param, {}).get("shape")
        if isinstance(dims, list) and isinstance(shape, list) and len(dims) == len(shape):
            for dim, size in zip(dims, shape):
                if isinstance(dim, str) and type(size) is int:
                    axes.setdefault(dim, size)
    return axes


def _fi_inputs(fi_def: dict[str, Any], call: Any, ours: dict[str, Any]) -> dict[str, Any]:
    """``workload.inputs`` keyed by FlashInfer's input names, each entry with only the fields
    flashinfer-bench's input types have (``random``; ``safetensors`` with ``path`` and
    ``tensor_key``; ``scalar`` with ``value``)."""
    out: dict[str, Any] = {}
    for key, param in _fi_params(fi_def, call).items():
        entry = ours.get(param)
        if not entry:
            continue
        kind = entry.get("type")
        if kind == "scalar":
            out[key] = {"type": "scalar", "value": entry.get("value")}
        elif kind == "safetensors":
            out[key] = {k: entry[k] for k in ("type", "path", "tensor_key")}
        elif kind in ("random", "torch"):
            out[key] = {"type": "random"}
    return out


# --------------------------------------------------------------------------- the reading side


def rebuild_inputs(inputs: dict[str, dict[str, Any]], device: str = "cpu") -> dict[str, Any]:
    """The arguments a workload line's ``workload.inputs`` describes: tensors of the recorded
    shape, dtype and strides (random values, or the dumped ones for a ``safetensors``/``torch``
    reference, read by the flight recorder's safe loader), scalars as recorded.

    ``ValueError`` for an entry it cannot rebuild (an unknown dtype, an ``unsupported`` one)."""
    import torch

    from otel_gpu.recorder.manifest import DTYPES
    from otel_gpu.recorder.tensor_files import load_tensors

    out: dict[str, Any] = {}
    for name, entry in inputs.items():
        kind = entry.get("type")
        if kind == "scalar":
            out[name] = entry.get("value")
            continue
        dtype = DTYPES.get(_dtype_name(entry.get("dtype")))
        if kind not in ("random", "safetensors", "torch") or dtype is None:
            raise ValueError(f"input {name!r}: cannot rebuild an entry of type {kind!r}")
        shape = [int(n) for n in entry["shape"]]
        stride = entry.get("stride")
        if kind != "random":
            folder, filename = os.path.split(str(entry["path"]))
            loaded = load_tensors(folder, filename, f"input {name}")[str(entry["tensor_key"])]
            out[name] = loaded.to(device)
            continue
        if stride is not None:
            t = torch.empty_strided(shape, [int(s) for s in stride], dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        if dtype.is_floating_point or dtype.is_complex:
            t.normal_()
        elif dtype != torch.bool:
            t.random_(0, 8)
        out[name] = t
    return out
