"""A call's input signature, its id, and the definition file written for it.

One signature for both producers: ``otel-gpu workloads`` reads a call's arguments back from its
span attributes, ``OTEL_GPU_WORKLOADS_DIR`` from the raw metadata the caller's thread captured
(:func:`fields_by_path` turns those into the same attributes first), and both write the same
definition (:func:`definition`) under the same name. Nothing here imports torch.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "FORMAT",
    "UNUSED_FIELDS",
    "Rules",
    "definition",
    "definition_name",
    "encode",
    "fields_by_path",
    "input_entry",
    "safe_name",
    "signature",
    "signature_id",
]

FORMAT = "otel-gpu.workload/1"
"""The ``format`` field of every file written: what a reader checks before reading on."""

UNUSED_FIELDS = frozenset({"device", "requires_grad"})
"""Fields of an argument that no signature or definition uses (dropped as they are read)."""

_TENSOR_FIELDS = ("dtype", "shape")
_SKIPPED_FIELDS = frozenset({"id", "device", "requires_grad", "default", "is_contiguous"})
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 120

Rules = Mapping[str, frozenset[str]]
"""Function glob -> the names of the non-tensor arguments that count in its signature (the
top-level parameter name: ``eps`` covers ``eps`` and ``kwargs.eps``)."""


def fields_by_path(attributes: Iterable[tuple[str, Any]], prefix: str) -> dict[str, dict[str, Any]]:
    """``(key, value)`` span attributes under ``prefix`` (``otel_gpu.input.``) grouped by
    argument path: ``{"q": {"shape": [..], "dtype": ..}, "kv.0": {...}}``, without the
    :data:`UNUSED_FIELDS`, as a trace reader groups them."""
    out: dict[str, dict[str, Any]] = {}
    cut = len(prefix)
    for key, value in attributes:
        if key.startswith(prefix):
            path, dot, name = key[cut:].rpartition(".")
            if dot and path and name not in UNUSED_FIELDS:
                out.setdefault(path, {})[name] = value
    return out


def _param(path: str) -> str:
    head, _, rest = path.partition(".")
    return rest.partition(".")[0] if head in ("kwargs", "args") and rest else head


def signature(
    function: str, inputs: Mapping[str, Mapping[str, Any]], rules: Rules | None = None
) -> dict[str, dict[str, Any]]:
    """The input signature of a call of ``function``: per argument path, the fields that
    identify it (a tensor's dtype and shape, and strides when not contiguous; another
    argument's recorded fields but its ``id``, all of them or those ``rules`` name)."""
    allowed: frozenset[str] | None = None
    for glob, names in (rules or {}).items():
        if fnmatch.fnmatchcase(function, glob):
            allowed = names
            break
    out: dict[str, dict[str, Any]] = {}
    for path, fields in sorted(inputs.items()):
        if "dtype" in fields and "shape" in fields:  # a tensor
            entry = {k: fields[k] for k in _TENSOR_FIELDS}
            if fields.get("is_contiguous") is False and "stride" in fields:
                entry["stride"] = fields["stride"]
            out[path] = entry
        elif allowed is None or _param(path) in allowed:
            kept = {k: fields[k] for k in sorted(fields) if k not in _SKIPPED_FIELDS}
            if kept:
                out[path] = kept
    return out


def signature_id(function: str, sig: Mapping[str, Any]) -> str:
    """16 hex digits of the SHA-256 of the canonical JSON of ``function`` and ``sig``."""
    text = json.dumps({"f": function, "s": sig}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def safe_name(text: str) -> str:
    """A file name made from ``text``: runs of other characters become ``_``, no leading dot
    or dash, at most 120 characters, never empty; a name that had to change gets a short hash
    of the original, so two names cannot collide into one file."""
    cleaned = _UNSAFE.sub("_", text).lstrip("._-")[:_MAX_NAME] or "function"
    if cleaned != text:
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        cleaned = f"{cleaned[: _MAX_NAME - 9]}-{digest}"
    return cleaned


def definition_name(function: str, sig_id: str) -> str:
    """``<function>-<signature>``: the definition's name, and its file's without ``.json``."""
    return f"{safe_name(function)}-{sig_id}"


def _dtype_name(raw: Any) -> str:
    return str(raw).removeprefix("torch.")


def input_entry(fields: Mapping[str, Any]) -> dict[str, Any]:
    """An argument's entry in a definition: ``random`` (a tensor: shape, dtype, strides when
    not contiguous), ``scalar`` (a value; an enum's ``enum_value``) or ``unsupported``."""
    if "dtype" in fields and "shape" in fields:
        entry = {"type": "random", "shape": fields["shape"], "dtype": _dtype_name(fields["dtype"])}
        if fields.get("stride") is not None and fields.get("is_contiguous") is False:
            entry["stride"] = fields["stride"]
        return entry
    if "value" in fields:
        return {"type": "scalar", "value": fields.get("enum_value", fields["value"])}
    return {"type": "unsupported", **{k: v for k, v in fields.items() if k != "id"}}


def definition(
    function: str,
    sig_id: str,
    sig: Mapping[str, Any],
    inputs: Mapping[str, Mapping[str, Any]],
    outputs: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The fields of a definition both producers write: ``format``, ``name``, ``function``,
    ``signature``, ``inputs`` (those of the signature, from a call's ``inputs``) and
    ``outputs`` (a call's, where known)."""
    return {
        "format": FORMAT,
        "name": definition_name(function, sig_id),
        "function": function,
        "signature": sig_id,
        "inputs": {p: input_entry(f) for p, f in inputs.items() if p in sig},
        "outputs": {k: input_entry(f) for k, f in outputs.items() if "dtype" in f or "value" in f},
    }


def encode(obj: Any) -> bytes:
    """A definition as its file holds it."""
    return (json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n").encode(
        "utf-8", "surrogatepass"
    )
