"""The manifest of one recorded call: its function, encoded arguments and receiver, process.

The flight recorder (:mod:`otel_gpu.recorder.recorder`), the in-memory ring
(:mod:`otel_gpu.recorder.ring`) and the CUDA-graph replay snapshots all describe a call with
this manifest; the format is in ``docs/flight-recorder.md``.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import TYPE_CHECKING, Any

import torch

from otel_gpu import _files, _guard
from otel_gpu.config import rank
from otel_gpu.recorder import manifest as _manifest
from otel_gpu.recorder import target as _target
from otel_gpu.recorder import tensor_files, values

if TYPE_CHECKING:
    from otel_gpu.core.plan import Plan
    from otel_gpu.core.protocols import Host
    from otel_gpu.core.record import Call
    from otel_gpu.recorder.ring import _Entry

__all__ = ["encode_inputs", "new_manifest", "write_ring_call"]


def encode_inputs(
    call: Call, targets: dict[Plan, _target.Target], secret: Any, with_receiver: bool = True
) -> tuple[
    _target.Target,
    dict[str, torch.Tensor],
    dict[str, Any],
    list[dict[str, Any]],
    list[str],
    dict[str, Any] | None,
]:
    """A call's function, tensors (not copied), tensor metadata, encoded parameters, the keys of
    the argument tensors (the receiver's state is not compared after the call) and receiver.

    ``targets`` caches where each decorated function can be found again.
    """
    plan = call.plan
    target = targets.get(plan)
    if target is None:
        target = _target.Target(plan)
        if target.module == "__main__":  # said at record time, when moving it is still cheap
            _guard.warn_once(
                "dump.main",
                "otel-gpu flight recorder: %s is defined in __main__ (the script you ran); "
                "`otel-gpu replay` imports functions from modules by name and will not be able "
                "to import it, so its calls are recorded but cannot be replayed. Put it in a "
                "module your script imports (docs/flight-recorder.md, 'A layout that replays'). "
                "This is reported once.",
                plan.name,
            )
        if target.found:  # a module still being imported may define the function later
            targets[plan] = target
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    enc = values.Encoder("input.", tensors, meta, secret)
    params = [
        {"name": name, "default": is_default, "value": enc.encode(value, name)}
        for name, value, is_default in call.bound or ()
    ]
    arg_keys = list(tensors)
    # the receiver's hook may read device memory: not during CUDA graph capture (with_receiver)
    receiver = _receiver(call, enc) if target.receiver and with_receiver else None
    return target, tensors, meta, params, arg_keys, receiver


def _receiver(call: Call, enc: values.Encoder) -> dict[str, Any]:
    """The receiver's encoding; its ``__otel_gpu_state__`` hook is user code, ``SystemExit`` too."""
    try:
        return _target.receiver(call, enc)
    except BaseException as exc:  # the hook, or a __getattr__/__class__ property on the receiver
        why = f"receiver hook failed: {type(exc).__name__}"
        return {"t": "unsupported", "type": "?", "why": why}


def new_manifest(
    call: Call,
    target: _target.Target,
    params: list[dict[str, Any]],
    receiver: dict[str, Any] | None,
    meta: dict[str, Any],
    why_not: str | None,
    seq: int,
    pipeline: Host | None,
) -> dict[str, Any]:
    """A call's manifest as the recorder writes it before the call runs (status ``inputs_saved``).

    The flight recorder and the in-memory ring (:mod:`otel_gpu.recorder.ring`) both write this format.
    """
    plan = call.plan
    ctx = call.span.get_span_context()
    return {
        "schema_version": _manifest.SCHEMA_VERSION,
        "status": "inputs_saved",
        "function": {
            "span_name": plan.name,
            "module": target.module,
            "qualname": target.qualname,
            "file": target.file,
            "receiver": receiver is not None,
            "instrumented": plan.instrumented,  # the instrument() target
        },
        "replayable": why_not is None,
        "why_not_replayable": why_not,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{call.parent.span_id:016x}" if call.parent else None,
        "sequence": seq,
        "process": _process(),
        "time": {"start_unix_nano": call.start_ns, "end_unix_nano": None},
        "torch_state": {
            "grad_enabled": torch.is_grad_enabled(),
            "inference_mode": torch.is_inference_mode_enabled(),
            "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        },
        "files": {"inputs": None, "outputs": None},
        "tensors": meta,
        "params": params,
        # how many were passed positionally: replay calls the same way (wrappers such as
        # transformers' check the keyword arguments they are given)
        "positional": _positional(call, target),
        "receiver": receiver,
        "result": None,
        "mutated": {},
        "outputs_skipped": None,
        "outputs_unsupported": [],
        "exception": None,
        "resource": _resource_summary(pipeline),
    }


def write_ring_call(
    directory: str, entry: _Entry, result: Any, with_outputs: bool, fmt: str, secret: Any
) -> str:
    """Write one call the ring kept into ``directory`` (its inputs; its outputs when given)."""
    manifest = entry.manifest
    seq = manifest["sequence"]
    span_id = int(manifest["span_id"], 16)
    call_dir = os.path.join(
        directory,
        _manifest.call_dir_name(seq, entry.start_ns, span_id, manifest["function"]["span_name"]),
    )
    _files.make_dir(call_dir)
    entry.copies.wait()
    manifest["files"]["inputs"] = tensor_files.save_tensors(
        os.path.join(call_dir, "inputs"), entry.copies.tensors, fmt, False
    )
    manifest["status"] = entry.status
    manifest["time"]["end_unix_nano"] = entry.end_ns
    manifest["exception"] = entry.exception
    if entry.status == "completed":
        if with_outputs:
            tensors: dict[str, torch.Tensor] = {}
            meta: dict[str, Any] = {}
            enc = values.Encoder("", tensors, meta, secret)
            manifest["result"] = enc.encode(result, "output")
            manifest["tensors"].update(meta)
            if enc.unsupported:
                manifest["outputs_unsupported"] = enc.unsupported[:64]
            host = {k: tensor_files.host_copy(t, always_copy=True) for k, t in tensors.items()}
            if host:
                manifest["files"]["outputs"] = tensor_files.save_tensors(
                    os.path.join(call_dir, "outputs"), host, fmt, False
                )
        else:
            manifest["outputs_skipped"] = "ring"  # the ring keeps inputs only
    _manifest.write_json(call_dir, _manifest.MANIFEST, manifest, fsync=False)
    return call_dir


_proc: dict[str, Any] | None = None
_resource: tuple[Any, dict[str, Any]] | None = None


def _process() -> dict[str, Any]:
    global _proc
    if _proc is None or _proc["pid"] != os.getpid():
        _proc = {
            "pid": os.getpid(),
            "rank": rank(),
            "host": socket.gethostname(),
        }
    return dict(_proc)


def _resource_summary(pipeline: Host | None) -> dict[str, Any]:
    """Versions and the process's resource attributes, computed once per resource."""
    global _resource
    resource = pipeline.resource if pipeline is not None else None
    if _resource is not None and _resource[0] is resource:
        return _resource[1]
    summary: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch.cuda": torch.version.cuda,
    }
    for key, value in dict(resource.attributes if resource is not None else {}).items():
        summary[key] = list(value) if isinstance(value, tuple) else value
    _resource = (resource, summary)
    return summary


def _positional(call: Call, target: _target.Target) -> int | None:
    """Arguments passed positionally, not counting a receiver passed as the first one."""
    args = call.args
    if args is None:
        return None
    plan = call.plan
    passed = plan.receiver_passed and plan.receiver is None
    return max(len(args) - (1 if passed and target.receiver and args else 0), 0)
