"""Flight-recorder dumps (level 10) as ``diff`` reads them: calls from manifests, tensors compared.

A dump folder holds one directory per call (``manifest.json`` and its tensor files). Manifests
are read by :func:`otel_gpu.recorder.manifest.read_manifest` and tensors by
:func:`otel_gpu.recorder.tensor_files.load_tensors`: plain JSON, and tensor files loaded without
unpickling objects, bounded by the sizes the manifest states, never through a symlink or
outside the call's directory. Nothing named by a dump is imported or run.
"""

from __future__ import annotations

import os
from typing import Any

from otel_gpu.traces.call_records import CallRecord, link
from otel_gpu.traces.diff_values import compare_tensors

__all__ = ["MAX_CALLS", "compare_dumps", "load_dump_calls"]

MAX_CALLS = 200_000
"""Call directories read from one dump folder; a folder with more is refused."""


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int:
    return value if type(value) is int and 0 <= value < 2**64 else 0


def load_dump_calls(root: str) -> list[CallRecord]:
    """The calls recorded under ``root``, linked by their parent span ids; ``DiffError`` when
    ``root`` holds no readable manifest."""
    from otel_gpu.recorder.manifest import read_manifest
    from otel_gpu.traces.diff import DiffError

    calls = []
    problems = []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        raise DiffError(f"{root}: cannot read the folder ({exc.strerror or exc})") from None
    if len(entries) > MAX_CALLS:
        raise DiffError(f"{root}: {len(entries)} entries, over the {MAX_CALLS} diff reads")
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            manifest = read_manifest(entry.path)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            problems.append(f"{entry.path}: {exc}")
            continue
        calls.append(_call(entry.path, manifest))
    if problems:
        raise DiffError(
            f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        )
    if not calls:
        raise DiffError(f"{root}: no flight-recorder call directory (manifest.json) in it")
    link(calls)
    return calls


def _call(path: str, manifest: dict[str, Any]) -> CallRecord:
    function = _dict(manifest.get("function"))
    times = _dict(manifest.get("time"))
    resource = _dict(manifest.get("resource"))
    process = _dict(manifest.get("process"))
    start = _int(times.get("start_unix_nano"))
    call = CallRecord(
        name=_str(function.get("span_name")) or os.path.basename(path),
        trace_id=_str(manifest.get("trace_id")),
        span_id=_str(manifest.get("span_id")) or path,
        parent_id=_str(manifest.get("parent_span_id")) or None,
        start=start,
        end=_int(times.get("end_unix_nano")) or start,
        where=path,
        service=_str(resource.get("service.name")),
        version=_str(resource.get("otel_gpu.version")),
        rank=process.get("rank") if type(process.get("rank")) is int else None,
        dump_dir=path,
    )
    for key, meta in (manifest.get("tensors") or {}).items():
        side, _, rest = key.partition(".")
        fields = {k: meta.get(k) for k in ("shape", "dtype") if isinstance(meta, dict)}
        if side == "input" and rest:
            call.inputs[rest] = fields
        elif side == "output":
            call.outputs[rest or "0"] = fields
    return call


def _load(directory: str) -> tuple[dict[str, Any], str | None]:
    """The call's tensors by key, laid out as recorded; and why not all could be read."""
    from otel_gpu.recorder.manifest import read_manifest, stated_nbytes
    from otel_gpu.recorder.tensor_files import load_tensors, restore_layout

    manifest = read_manifest(directory)
    meta = manifest.get("tensors") or {}
    stated, count = stated_nbytes(meta), len(meta)
    tensors: dict[str, Any] = {}
    why = None
    for field in ("inputs", "outputs"):
        name = (manifest.get("files") or {}).get(field)
        if not name:
            if field == "outputs":
                why = "no outputs recorded (the call did not return, or they were skipped)"
            continue
        tensors.update(load_tensors(directory, name, f"files.{field}", stated, count))
    laid = {}
    for key, t in tensors.items():
        entry = meta.get(key)
        laid[key] = restore_layout(t, entry, "cpu") if isinstance(entry, dict) else t
    return laid, why


def compare_dumps(
    dir_a: str, dir_b: str, rtol: float | None = None, atol: float | None = None
) -> list[dict[str, Any]] | None:
    """Each tensor the two calls' dumps both hold, compared; None when either cannot be read
    (the caller falls back to statistics)."""
    try:
        a, why_a = _load(dir_a)
        b, why_b = _load(dir_b)
    except (OSError, ValueError):
        return None
    out = []
    for key in sorted(a.keys() | b.keys()):
        tensor = key if "." in key or key != "output" else "output.0"
        if key in a and key in b:
            out.append(compare_tensors(tensor, a[key], b[key], rtol, atol))
        else:
            why = f"dumped in {'A' if key in a else 'B'} only"
            if why_a or why_b:
                why += f" ({why_a or why_b})"
            out.append(
                {"tensor": tensor, "status": "not compared", "method": "tensors", "why": why}
            )
    return out
