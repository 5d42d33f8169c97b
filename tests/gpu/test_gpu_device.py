"""On a real GPU: host syncs per call, the recorder's pinned copies, NVML on a real device.

Skipped without CUDA (``conftest.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import otel_gpu
from otel_gpu import resource
from otel_gpu.devices import cuda
from otel_gpu.export import pipeline
from otel_gpu.recorder.recorder import Recorder


def _lib():
    @otel_gpu.api
    def combine(x, y):
        return x * y + 1

    return combine


def _syncs(fn):
    """The synchronizing CUDA operations ``fn`` performs, as torch's sync debug mode warns them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("level", [1, 3])
def test_levels_1_and_3_make_no_host_sync(otel_gpu_spans, level):
    """A decorated call on CUDA tensors at level 1 or 3 never synchronises (error mode)."""
    otel_gpu_spans(level=level)
    combine = _lib()
    x, y = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    combine(x, y)  # first call: lazy set-up outside the measured call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            combine(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_level_5_makes_exactly_one_host_read_per_clean_call(otel_gpu_spans):
    """Level 5 with OTEL_GPU_STATS_READ=sync: one device-to-host read per clean call for all its
    tensors, two with NaN, and no other synchronisation (the refine pass masks, it never
    indexes by a boolean mask)."""
    otel_gpu_spans(level=5, stats_read="sync")
    combine = _lib()
    x, y = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    combine(x, y)
    reads = cuda.host_reads
    assert _syncs(lambda: combine(x, y)) == 1
    assert cuda.host_reads - reads == 1
    x[0] = float("nan")
    reads = cuda.host_reads
    assert _syncs(lambda: combine(x, y)) == 2  # the refine pass: one more read
    assert cuda.host_reads - reads == 2


def test_level_5_by_default_never_synchronises_the_caller(otel_gpu_spans):
    """Level 5 with the defaults (OTEL_GPU_STATS_READ=async, the mark policy): a call, clean or
    with NaN, makes no synchronising CUDA call on the caller's thread (sync debug mode error),
    and its statistics, read off that thread, equal value for value those of a synchronous
    read of the same tensors."""
    x, y = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    x2 = x.clone()
    x2[0] = float("nan")
    got = {}
    for mode in ("sync", "async"):
        spans = otel_gpu_spans(level=5, stats_read=mode)
        combine = _lib()
        combine(x, y)  # first call: lazy set-up outside the measured calls
        torch.cuda.synchronize()
        otel_gpu.flush()
        spans.clear()
        if mode == "async":
            # the stream is kept busy (~0.2 s) so that the reader thread's own reads (the NaN
            # pass) come after the error window, which covers the caller's thread alone
            torch.cuda._sleep(400_000_000)
            torch.cuda.set_sync_debug_mode("error")
        try:
            combine(x, y)
            combine(x2, y)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got[mode] = [
            [dict(e.attributes) for e in s.events if e.name == "otel_gpu.stats"]
            for s in spans.get()
        ]
    assert got["async"] == got["sync"]
    assert any(e.get("nan_count") == 1 for span in got["async"] for e in span)


def test_recorder_host_buffers_are_pinned(otel_gpu_spans, tmp_path):
    """The flight recorder copies CUDA outputs into page-locked, reused host buffers."""
    otel_gpu_spans(level=10, dump_dir=str(tmp_path / "d"), dump_durability="async")
    combine = _lib()
    x, y = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    for _ in range(3):
        combine(x, y)
    pipe = pipeline.current()
    assert pipe is not None
    (recorder,) = [o for o in pipe.observers if isinstance(o, Recorder)]
    assert recorder.flush(30.0)
    kept = [(key, b) for key, bufs in recorder._buffers._free.items() for b in bufs]
    pinned = [b for (_, is_pinned), b in kept if is_pinned]
    assert pinned and all(b.is_pinned() for b in pinned)


def test_nvml_describes_the_real_device():
    """The resource names every GPU with a real name and UUID, and agrees with torch."""
    resource._reset_cache()
    attrs = resource.detect_attributes()
    assert "otel_gpu.gpu.error" not in attrs, attrs.get("otel_gpu.gpu.error")
    count = attrs["otel_gpu.gpu.count"]
    assert count >= torch.cuda.device_count() >= 1
    names = [attrs[f"otel_gpu.gpu.{i}.hw.model"] for i in range(count)]
    uuids = [attrs[f"otel_gpu.gpu.{i}.hw.id"] for i in range(count)]
    assert all(uuid.startswith(("GPU-", "MIG-")) for uuid in uuids)
    assert torch.cuda.get_device_name(0) in names
    props = torch.cuda.get_device_properties(0)
    if hasattr(props, "uuid"):
        assert any(str(props.uuid) in uuid for uuid in uuids)
    assert attrs["otel_gpu.gpu.driver_version"]
