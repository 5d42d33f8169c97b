"""On a real GPU: the GPU gauges read real NVML values within their physical range.

Skipped without CUDA (``conftest.py``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu.config import Settings
from otel_gpu.devices import nvml
from otel_gpu.metrics import gpu, names


@pytest.fixture(autouse=True)
def _fresh_nvml_session():
    nvml._reset_sampling()
    yield
    nvml._reset_sampling()


def _points(reader: InMemoryMetricReader) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    points: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                points[m.name] += [(p.value, dict(p.attributes)) for p in m.data.data_points]
    return points


def test_real_gauges_are_within_physical_range():
    """Every GPU NVML sees has a memory limit > 0 and a usage <= it; every fraction is in
    [0, 1]; temperature, power and clocks are positive; this process's memory, where NVML
    lists it (a PID namespace may hide it), is at most its device's usage."""
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # a context and memory
    torch.cuda.synchronize()
    reader = InMemoryMetricReader()
    gauges = gpu.register(
        MeterProvider(metric_readers=[reader]).get_meter(names.METER), Settings(metrics=True)
    )
    assert gauges is not None
    points = _points(reader)
    assert gauges.samples == 1, gauges.last_error

    usage = {a["hw.id"]: v for v, a in points["hw.gpu.memory.usage"]}
    limit = {a["hw.id"]: v for v, a in points["hw.gpu.memory.limit"]}
    gpus = {g.uuid for g in nvml.query_gpus().gpus}
    assert gpus and gpus <= set(limit)
    for device, size in limit.items():
        assert size > 0
        assert 0 <= usage[device] <= size
    for name in ("hw.gpu.utilization", "hw.gpu.memory.utilization"):
        for value, attributes in points[name]:
            assert 0.0 <= value <= 1.0, (name, attributes)
    for name in ("hw.gpu.temperature", "hw.gpu.power.draw", "hw.gpu.clock.memory"):
        for value, attributes in points[name]:
            assert value > 0, (name, attributes)
    for value, attributes in points["process.gpu.memory.usage"]:
        assert 0 < value <= usage[attributes["hw.id"]]
    for _, attributes in points["hw.gpu.memory.limit"]:
        assert attributes["hw.vendor"] == "NVIDIA" and attributes["hw.type"] == "gpu"
        assert attributes["hw.id"].startswith(("GPU-", "MIG-"))
    del block
