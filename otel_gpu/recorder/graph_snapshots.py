"""Level 10 under CUDA graphs: the dump deferred at capture, a snapshot written after replays.

During capture nothing may be copied to the host, so :func:`defer_inputs` and
:func:`defer_outputs` only encode the call (its manifest, with the tensors themselves kept by
reference: they are the graph's static memory, which every replay rewrites) and attach a
snapshot to the call's CUDA-graph record (:mod:`otel_gpu.devices.cuda_graphs`). After replay 1
and one replay in ``OTEL_GPU_GRAPH_DUMP_EVERY``, :func:`snapshot` runs on the caller's thread:
it counts the snapshot against ``OTEL_GPU_DUMP_MAX_COUNT``/``_MAX_SIZE_GB``, starts the copies
of the inputs and outputs into the recorder's reused pinned buffers (non-blocking, with an
event) and queues them for the recorder's writer thread, which waits for the copies and writes
a call directory with status ``completed`` and ``cuda_graph: {replay, capture_span_id}``. A
full writer queue skips the snapshot: a replay never waits for the disk.

What a snapshot holds: the inputs and outputs as they are *after* the replay. For a call that
writes into its inputs the inputs are the written values, so the manifest marks it not
replayable.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

import torch
from opentelemetry.trace import SpanContext

from otel_gpu import _files
from otel_gpu.recorder import call_manifest, tensor_files, values
from otel_gpu.recorder import manifest as _manifest

if TYPE_CHECKING:
    from otel_gpu.core.record import Call
    from otel_gpu.recorder.recorder import Recorder

__all__ = ["Deferred", "defer_inputs", "defer_outputs", "snapshot", "write_snapshot"]

_MUTATED = "the call writes into its inputs and the snapshot holds them after the CUDA graph replay"


class Deferred:
    """A call captured into a CUDA graph at level 10: its manifest and tensors (by reference)."""

    __slots__ = ("inputs", "manifest", "name", "nbytes", "outputs", "versions")

    def __init__(
        self, name: str, manifest: dict[str, Any], inputs: dict[str, torch.Tensor], versions: Any
    ) -> None:
        self.name = name
        self.manifest = manifest
        self.inputs = inputs
        self.outputs: dict[str, torch.Tensor] = {}
        self.versions = versions
        self.nbytes = sum(m["nbytes"] for m in manifest["tensors"].values())


def defer_inputs(recorder: Recorder, call: Call) -> Deferred:
    """At capture, before the call: encode it without copying anything (no receiver state)."""
    target, tensors, meta, params, arg_keys, _ = call_manifest.encode_inputs(
        call, recorder._targets, recorder._secret, with_receiver=False
    )
    why_not = target.why_not
    if why_not is None and target.receiver:
        why_not = "recorded at CUDA graph capture, where the receiver's state is not stored"
    manifest = call_manifest.new_manifest(
        call, target, params, None, meta, why_not, 0, recorder.pipeline
    )
    versions = [
        (k, tensors[k], tensors[k]._version) for k in arg_keys if not tensors[k].is_inference()
    ]
    return Deferred(call.plan.name, manifest, tensors, versions)


def defer_outputs(recorder: Recorder, call: Call, deferred: Deferred) -> None:
    """At capture, after the call: encode its result and attach the snapshot to its graph record."""
    from otel_gpu.devices import cuda_graphs

    manifest = deferred.manifest
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    enc = values.Encoder("", tensors, meta, recorder._secret)
    manifest["result"] = enc.encode(call.result, "output")
    for key, t, version in deferred.versions:
        if t._version != version:
            manifest["mutated"][key] = enc.encode(t, "mutated." + key.removeprefix("input."))
            manifest["replayable"], manifest["why_not_replayable"] = False, _MUTATED
    manifest["tensors"].update(meta)
    if enc.unsupported:
        manifest["outputs_unsupported"] = enc.unsupported[:64]
    deferred.outputs = tensors
    deferred.versions = None
    deferred.nbytes = sum(m["nbytes"] for m in manifest["tensors"].values())

    def take(
        replay: int, ctx: SpanContext, parent: SpanContext | None, start_ns: int, end_ns: int
    ) -> str | None:
        return snapshot(recorder, deferred, replay, ctx, parent, start_ns, end_ns)

    cuda_graphs.record(call).snapshot = take


def snapshot(
    recorder: Recorder,
    deferred: Deferred,
    replay: int,
    ctx: SpanContext,
    parent: SpanContext | None,
    start_ns: int,
    end_ns: int,
) -> str | None:
    """After a replay, on the caller's thread: start the copies and queue the snapshot; returns
    its directory (for the replay span's ``otel_gpu.dump.dir``), or None when it is not taken."""
    if recorder.stopped is not None or recorder._reserve(deferred.nbytes, True) is not None:
        return None
    seq = next(_seq())
    manifest = copy.deepcopy(deferred.manifest)
    manifest.update(
        status="completed",
        sequence=seq,
        trace_id=f"{ctx.trace_id:032x}",
        span_id=f"{ctx.span_id:016x}",
        parent_span_id=f"{parent.span_id:016x}" if parent is not None else None,
        cuda_graph={"replay": replay, "capture_span_id": deferred.manifest["span_id"]},
    )
    manifest["time"] = {"start_unix_nano": start_ns, "end_unix_nano": end_ns}
    directory = os.path.join(
        recorder.root, _manifest.call_dir_name(seq, start_ns, ctx.span_id, deferred.name)
    )
    buffers = recorder._buffers
    inputs, outputs = buffers.copy(deferred.inputs), buffers.copy(deferred.outputs)
    if not recorder.enqueue_snapshot(directory, manifest, inputs, outputs):
        buffers.release(inputs)
        buffers.release(outputs)
        return None
    return directory


def write_snapshot(
    recorder: Recorder,
    directory: str,
    manifest: dict[str, Any],
    inputs: tensor_files.HostCopies,
    outputs: tensor_files.HostCopies,
) -> None:
    """On the writer thread: wait for the copies, write the tensors, then the manifest."""
    fmt, fsync = recorder.format, recorder._fsync
    try:
        _files.make_dir(directory)
        inputs.wait()
        manifest["files"]["inputs"] = tensor_files.save_tensors(
            os.path.join(directory, "inputs"), inputs.tensors, fmt, fsync
        )
        if outputs.tensors:
            outputs.wait()
            manifest["files"]["outputs"] = tensor_files.save_tensors(
                os.path.join(directory, "outputs"), outputs.tensors, fmt, fsync
            )
    finally:
        recorder._buffers.release(inputs)
        recorder._buffers.release(outputs)
    _manifest.write_json(directory, _manifest.MANIFEST, manifest, fsync)


def _seq() -> Any:
    from otel_gpu.recorder import recorder

    return recorder._SEQ
