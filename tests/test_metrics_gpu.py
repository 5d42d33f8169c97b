"""The GPU gauges (metrics/gpu.py) over a faked NVML, read back through a real SDK MeterProvider.

The fake machine: an H100 in MIG mode with two MIG devices (NVML gives no utilization for a
MIG-enabled GPU: NotSupported) and an RTX 4090 whose power limit is NotSupported. NVML lists this
process on the RTX and on the second MIG device.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fake_nvml import (
    FakeLibraryNotFound,
    FakeNotFound,
    FakeNotSupported,
    FakeNvmlDevices,
    FakeNVMLError,
    installed,
    raising,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, Sum

from otel_gpu.config import Settings
from otel_gpu.devices import nvml
from otel_gpu.metrics import gpu, names

GIB = 2**30
MIB = 2**20
OTHER_PID = os.getpid() + 1


def _proc(pid: int, used: int | None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, usedGpuMemory=used)


def _machine() -> list[dict[str, Any]]:
    mig_devices = [
        {
            "uuid": b"MIG-1111",
            "name": b"NVIDIA H100 80GB HBM3 MIG 1g.10gb",
            "used": 1 * GIB,
            "total": 10 * GIB,
            "gi": 7,
            "procs": [_proc(OTHER_PID, 512 * MIB)],
        },
        {
            "uuid": "MIG-2222",
            "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
            "used": 6 * GIB,
            "total": 40 * GIB,
            "gi": 2,
            "procs": [_proc(os.getpid(), 3 * GIB), _proc(OTHER_PID, 2 * GIB)],
        },
    ]
    return [
        {  # MIG enabled: whole-GPU utilization is NotSupported, processes live on MIG devices
            "uuid": b"GPU-aaaa",
            "name": b"NVIDIA H100 80GB HBM3",
            "mig": 1,
            "util": None,
            "enc": None,
            "dec": None,
            "used": 7 * GIB,
            "total": 80 * GIB,
            "power_mw": 312_500,
            "limit_mw": 700_000,
            "temp": 54,
            "clocks": {0: 1755, 1: 1755, 2: 2619},
            # slot 1 is empty: NVML answers NotFound there
            "mig_slots": [mig_devices[0], None, mig_devices[1]],
            "procs": [],
        },
        {
            "uuid": "GPU-bbbb",
            "name": "NVIDIA GeForce RTX 4090",
            "mig": None,
            "util": (87, 40),
            "enc": 12,
            "dec": 0,
            "used": 20 * GIB,
            "total": 24 * GIB,
            "power_mw": 401_250,
            "limit_mw": None,  # NotSupported
            "temp": 71,
            "clocks": {0: 2520, 1: 2520, 2: 10501},
            "mig_slots": [],
            "procs": [_proc(os.getpid(), 5 * GIB), _proc(OTHER_PID, 9 * GIB)],
        },
    ]


class FakeNvml(FakeNvmlDevices):
    """A pynvml look-alike over :func:`_machine`; counts every call it answers."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_GRAPHICS = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self, gpus: list[dict[str, Any]]) -> None:
        self.calls: Counter[str] = Counter()
        super().__init__(gpus)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml"):
            object.__getattribute__(self, "calls")[name] += 1
        return object.__getattribute__(self, name)

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetMemoryInfo(self, h: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(used=h["used"], total=h["total"], free=h["total"] - h["used"])

    def nvmlDeviceGetMigMode(self, h: dict[str, Any]) -> list[int]:
        if h["mig"] is None:
            raise FakeNotSupported("Not Supported")
        return [h["mig"], h["mig"]]

    def _need(self, value: Any) -> Any:
        if value is None:
            raise FakeNotSupported("Not Supported")
        return value

    def nvmlDeviceGetUtilizationRates(self, h: dict[str, Any]) -> SimpleNamespace:
        gpu_pct, mem_pct = self._need(h["util"])
        return SimpleNamespace(gpu=gpu_pct, memory=mem_pct)

    def nvmlDeviceGetEncoderUtilization(self, h: dict[str, Any]) -> list[int]:
        return [self._need(h["enc"]), 167_000]

    def nvmlDeviceGetDecoderUtilization(self, h: dict[str, Any]) -> list[int]:
        return [self._need(h["dec"]), 167_000]

    def nvmlDeviceGetPowerUsage(self, h: dict[str, Any]) -> int:
        return self._need(h["power_mw"])

    def nvmlDeviceGetEnforcedPowerLimit(self, h: dict[str, Any]) -> int:
        return self._need(h["limit_mw"])

    def nvmlDeviceGetTemperature(self, h: dict[str, Any], sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._need(h["temp"])

    def nvmlDeviceGetClockInfo(self, h: dict[str, Any], which: int) -> int:
        return h["clocks"][which]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: dict[str, Any]) -> int:
        return len(h["mig_slots"])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: dict[str, Any], slot: int) -> dict[str, Any]:
        device = h["mig_slots"][slot]
        if device is None:
            raise FakeNotFound("Not Found")
        return device

    def nvmlDeviceGetGpuInstanceId(self, h: dict[str, Any]) -> int:
        return h["gi"]

    def nvmlDeviceGetComputeRunningProcesses(self, h: dict[str, Any]) -> list[SimpleNamespace]:
        return h["procs"]


@pytest.fixture(autouse=True)
def _fresh_nvml_session() -> Iterator[None]:
    nvml._reset_sampling()
    yield
    nvml._reset_sampling()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return installed(monkeypatch, FakeNvml(_machine()))


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def meter(reader: InMemoryMetricReader) -> Any:
    return MeterProvider(metric_readers=[reader]).get_meter(names.METER)


ON = Settings(metrics=True, metrics_interval=10.0)

Points = dict[str, list[tuple[float, dict[str, Any]]]]


def _collect(reader: InMemoryMetricReader) -> tuple[Points, dict[str, Any]]:
    """One collection: each metric's (value, attributes) points, and each metric's data object."""
    points: Points = {}
    data: dict[str, Any] = {}
    metrics_data = reader.get_metrics_data()
    for rm in metrics_data.resource_metrics if metrics_data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                data[m.name] = m
                points[m.name] = [(p.value, dict(p.attributes)) for p in m.data.data_points]
    return points, data


def _gpu(uuid: str, name: str) -> dict[str, Any]:
    return {"hw.id": uuid, "hw.name": name, "hw.vendor": "NVIDIA", "hw.type": "gpu"}


H100 = _gpu("GPU-aaaa", "NVIDIA H100 80GB HBM3")
RTX = _gpu("GPU-bbbb", "NVIDIA GeForce RTX 4090")
MIG_A = {
    **_gpu("MIG-1111", "NVIDIA H100 80GB HBM3 MIG 1g.10gb"),
    "hw.parent": "GPU-aaaa",
    "otel_gpu.gpu.mig.gpu_instance_id": 7,
}
MIG_B = {
    **_gpu("MIG-2222", "NVIDIA H100 80GB HBM3 MIG 3g.40gb"),
    "hw.parent": "GPU-aaaa",
    "otel_gpu.gpu.mig.gpu_instance_id": 2,
}


def _sorted(points: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, dict[str, Any]]]:
    return sorted(points, key=lambda p: sorted(p[1].items()))


def test_every_gauge_value_and_attributes(fake: FakeNvml, meter: Any, reader: Any) -> None:
    """Each metric has the NVML value of each device, converted to the conventions' units, with
    hw.id/hw.name/hw.vendor/hw.type, MIG devices with hw.parent and their GPU instance id; a
    NotSupported field (the 4090's power limit, the MIG GPU's utilization) has no point."""
    assert gpu.register(meter, ON) is not None
    points, _ = _collect(reader)
    expected: Points = {
        "hw.gpu.utilization": [
            (0.87, {**RTX, "hw.gpu.task": "general"}),
            (0.12, {**RTX, "hw.gpu.task": "encoder"}),
            (0.0, {**RTX, "hw.gpu.task": "decoder"}),
        ],
        "hw.gpu.memory.usage": [
            (7 * GIB, H100),
            (1 * GIB, MIG_A),
            (6 * GIB, MIG_B),
            (20 * GIB, RTX),
        ],
        "hw.gpu.memory.limit": [
            (80 * GIB, H100),
            (10 * GIB, MIG_A),
            (40 * GIB, MIG_B),
            (24 * GIB, RTX),
        ],
        "hw.gpu.memory.utilization": [
            (7 / 80, H100),
            (1 / 10, MIG_A),
            (6 / 40, MIG_B),
            (20 / 24, RTX),
        ],
        "hw.gpu.memory.controller.utilization": [(0.40, RTX)],
        "hw.gpu.power.draw": [(312.5, H100), (401.25, RTX)],
        "hw.gpu.power.limit": [(700.0, H100)],
        "hw.gpu.temperature": [(54.0, H100), (71.0, RTX)],
        "hw.gpu.clock.graphics": [(1755.0, H100), (2520.0, RTX)],
        "hw.gpu.clock.sm": [(1755.0, H100), (2520.0, RTX)],
        "hw.gpu.clock.memory": [(2619.0, H100), (10501.0, RTX)],
        # only this process's entries; MIG_A lists only another process, so it has no point
        "process.gpu.memory.usage": [(3 * GIB, MIG_B), (5 * GIB, RTX)],
    }
    assert sorted(points) == sorted(expected)
    for name, want in expected.items():
        got = _sorted(points[name])
        assert [a for _, a in got] == [a for _, a in _sorted(want)], name
        assert [v for v, _ in got] == pytest.approx([v for v, _ in _sorted(want)]), name


def test_units_descriptions_and_instrument_kinds(fake: FakeNvml, meter: Any, reader: Any) -> None:
    """Each metric carries the unit and description of names.py; memory sizes are non-monotonic
    sums (the conventions' UpDownCounters), the others gauges."""
    gpu.register(meter, ON)
    _, data = _collect(reader)
    declared = {m.name: m for m in (metric for metric, _, _ in gpu._METRICS)}
    assert set(data) == set(declared)
    for name, m in data.items():
        assert (m.unit, m.description) == (declared[name].unit, declared[name].description)
        is_sum = isinstance(m.data, Sum)
        assert is_sum == (name in {"hw.gpu.memory.usage", "hw.gpu.memory.limit",
                                   "process.gpu.memory.usage"})  # fmt: skip
        if is_sum:
            assert not m.data.is_monotonic


def test_one_nvml_sample_per_collection(fake: FakeNvml, meter: Any, reader: Any) -> None:
    """Twelve instruments read one NVML pass per collection (one device count, one memory query
    per device), and NVML is initialised once for the process, not per sample."""
    gpu.register(meter, ON)
    fake.calls.clear()
    for _ in range(3):
        _collect(reader)
    assert fake.calls["nvmlDeviceGetCount"] == 3
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 3 * 4  # 2 GPUs + 2 MIG devices
    assert fake.calls["nvmlInit"] == 0  # opened once, at register
    assert fake.calls["nvmlShutdown"] == 0


def test_register_opens_nvml_once(fake: FakeNvml, meter: Any, reader: Any) -> None:
    """register and the collections after it share one NVML initialisation."""
    gpu.register(meter, ON)
    _collect(reader)
    assert fake.calls["nvmlInit"] == 1


def test_metrics_off_creates_nothing_and_loads_no_nvml(
    monkeypatch: pytest.MonkeyPatch, meter: Any, reader: Any
) -> None:
    """With OTEL_GPU_METRICS off, register creates no instrument and never touches NVML."""
    monkeypatch.setattr(nvml, "_load_pynvml", raising(AssertionError("NVML loaded")))
    assert gpu.register(meter, Settings(metrics=False)) is None
    assert _collect(reader) == ({}, {})


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(lambda mp, fake: mp.setattr(nvml, "_load_pynvml", raising(ImportError("x"))),
                     id="pynvml-missing"),
        pytest.param(lambda mp, fake: mp.setattr(fake, "nvmlInit",
                                                 raising(FakeLibraryNotFound("gone"))),
                     id="no-driver"),
        pytest.param(lambda mp, fake: mp.setattr(fake, "gpus", []), id="no-gpus"),
    ],
)  # fmt: skip
def test_no_usable_nvml_creates_nothing(
    fake: FakeNvml,
    monkeypatch: pytest.MonkeyPatch,
    meter: Any,
    reader: Any,
    broken: Callable[[pytest.MonkeyPatch, FakeNvml], None],
) -> None:
    """Without pynvml, without a driver or without a GPU, register returns None, raises
    nothing and creates no instrument."""
    broken(monkeypatch, fake)
    assert gpu.register(meter, ON) is None
    assert _collect(reader) == ({}, {})


@pytest.mark.parametrize(("metrics", "warned"), [("auto", False), (True, True)])
def test_no_driver_is_a_warning_only_where_metrics_were_asked_for(
    fake: FakeNvml,
    monkeypatch: pytest.MonkeyPatch,
    meter: Any,
    reader: Any,
    caplog: pytest.LogCaptureFixture,
    metrics: Any,
    warned: bool,
) -> None:
    """Without a driver, ``OTEL_GPU_METRICS=true`` logs why there are no GPU gauges; the
    default (``auto``) creates none either, but says nothing: a machine without NVIDIA GPUs is
    the normal case for a program that never asked for them."""
    monkeypatch.setattr(fake, "nvmlInit", raising(FakeLibraryNotFound("gone")))
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        assert gpu.register(meter, Settings(metrics=metrics, metrics_interval=10.0)) is None
    assert bool([r for r in caplog.records if "GPU gauges" in r.getMessage()]) is warned
    assert _collect(reader) == ({}, {})


def test_nvml_error_in_one_collection_then_recovery(
    fake: FakeNvml,
    monkeypatch: pytest.MonkeyPatch,
    meter: Any,
    reader: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An NVML failure during a collection gives that collection no GPU point and no exception,
    its reason is logged once however often it repeats, and the next healthy collection has
    every point again."""
    gauges = gpu.register(meter, ON)
    assert gauges is not None
    healthy, _ = _collect(reader)
    monkeypatch.setattr(fake, "nvmlDeviceGetCount", raising(FakeNVMLError("Unknown Error")))
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        for _ in range(2):
            broken, _ = _collect(reader)
            assert broken == {}  # the SDK exports no metric that has no point
    assert gauges.last_error == "NVML error: Unknown Error"
    logged = [r.getMessage() for r in caplog.records if "Unknown Error" in r.getMessage()]
    assert len(logged) == 1, logged
    monkeypatch.undo()
    monkeypatch.setattr(nvml, "_load_pynvml", lambda: fake)
    recovered, _ = _collect(reader)
    assert recovered == healthy
    assert gauges.last_error is None


def test_failing_field_drops_only_that_field(
    fake: FakeNvml,
    monkeypatch: pytest.MonkeyPatch,
    meter: Any,
    reader: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A field that fails with a real error (not NotSupported) is absent and logged once; the
    other fields and devices keep their points."""
    gpu.register(meter, ON)
    monkeypatch.setattr(fake, "nvmlDeviceGetTemperature", raising(FakeNVMLError("No permission")))
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        points, _ = _collect(reader)
        _collect(reader)
    assert "hw.gpu.temperature" not in points  # no point, so the SDK leaves the metric out
    assert len(points["hw.gpu.memory.usage"]) == 4
    logged = [r.getMessage() for r in caplog.records if "temperature" in r.getMessage()]
    assert logged == [
        "otel-gpu GPU gauges: GPU 0 temperature: NVML error: No permission",
        "otel-gpu GPU gauges: GPU 1 temperature: NVML error: No permission",
    ]


def test_not_supported_fields_are_not_logged(
    fake: FakeNvml, meter: Any, reader: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """NotSupported is NVML's normal answer on some boards: absent, and no warning."""
    with caplog.at_level(logging.DEBUG, logger="otel_gpu"):
        gauges = gpu.register(meter, ON)
        _collect(reader)
    assert gauges is not None and gauges.last_error is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_process_absent_from_nvml_list_has_no_point(
    fake: FakeNvml, meter: Any, reader: Any
) -> None:
    """When NVML lists no memory for this process (another pid only, or usedGpuMemory None as
    under some drivers), there is no per-process point rather than a made-up 0."""
    fake.gpus[1]["procs"] = [_proc(os.getpid(), None), _proc(OTHER_PID, GIB)]
    gpu.register(meter, ON)
    points, _ = _collect(reader)
    assert points["process.gpu.memory.usage"] == [(3 * GIB, MIG_B)]


def test_forked_child_opens_its_own_session(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML is opened once per process: samples reuse it, a new pid (a forked child) opens it
    again."""
    nvml.sample_gpus()
    nvml.sample_gpus()
    assert fake.calls["nvmlInit"] == 1
    monkeypatch.setattr(nvml.os, "getpid", lambda: OTHER_PID + 1)
    nvml.sample_gpus()
    assert fake.calls["nvmlInit"] == 2


def test_sample_shared_within_a_collection_and_never_older_than_max_age() -> None:
    """The shared sample is renewed when an instrument asks a second time (a new collection),
    and also when it is older than max_age even if that instrument was not served from it."""
    now = [0.0]
    taken: list[int] = []

    def sampler() -> nvml.GpuSample:
        taken.append(1)
        return nvml.GpuSample(readings=(nvml.GpuReading(index=0, uuid="GPU-x", name="x"),))

    gauges = gpu.GpuGauges(max_age=5.0, sampler=sampler, clock=lambda: now[0])
    gauges._current("a")
    gauges._current("b")
    assert len(taken) == 1
    gauges._current("a")  # "a" again: the next collection
    assert len(taken) == 2
    now[0] = 6.0
    gauges._current("b")  # first ask of "b" in this sample, but the sample is too old
    assert len(taken) == 3
    assert gauges.samples == 3


def test_real_pynvml_without_gpus_creates_nothing(meter: Any, reader: Any) -> None:
    """The real pynvml on a machine without an NVIDIA driver: None, no exception."""
    if nvml.query_gpus().gpus:
        pytest.skip("this machine has GPUs (the GPU suite covers it)")
    assert gpu.register(meter, ON) is None
    assert _collect(reader) == ({}, {})


def test_gauges_reach_the_metrics_file_beside_the_spans(
    fake: FakeNvml, tmp_path: Any, module_factory: Any
) -> None:
    """End to end through the pipeline: with ``OTEL_GPU_METRICS=true`` and a ``.jsonl``
    destination, the GPU gauges of the faked machine (two GPUs, one in MIG mode) are in
    ``<name>.metrics.jsonl``, read back with the official proto parser, under the same resource
    as the spans (so a series joins the traces of its process)."""
    import json

    from google.protobuf import json_format
    from opentelemetry.proto.metrics.v1.metrics_pb2 import MetricsData

    import otel_gpu

    try:
        from jsonl_spans import read_spans
        from otlp_receiver import attrs_of, hex_ids_to_base64
    except ModuleNotFoundError:  # tests/ imported as a package
        from tests.jsonl_spans import read_spans
        from tests.otlp_receiver import attrs_of, hex_ids_to_base64

    otel_gpu.configure(level=1, dest=str(tmp_path / "s.jsonl"), metrics=True)
    lib = module_factory("import otel_gpu\n@otel_gpu.api\ndef f(x):\n    return x\n")
    lib.f(1)
    assert otel_gpu.flush(timeout=10)
    [span] = read_spans(tmp_path / "s.jsonl", plain=True)
    usage: dict[str, int] = {}
    resources = []
    for line in (tmp_path / "s.metrics.jsonl").read_text().splitlines():
        data = MetricsData()
        json_format.ParseDict(hex_ids_to_base64(json.loads(line)), data)
        for rm in data.resource_metrics:
            resources.append(attrs_of(rm.resource.attributes))
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == "hw.gpu.memory.usage":
                        for p in metric.sum.data_points:
                            usage[attrs_of(p.attributes)["hw.id"]] = p.as_int
    assert usage == {
        "GPU-aaaa": 7 * GIB,
        "MIG-1111": 1 * GIB,
        "MIG-2222": 6 * GIB,
        "GPU-bbbb": 20 * GIB,
    }
    instance = span["resource"]["service.instance.id"]
    assert resources and all(r["service.instance.id"] == instance for r in resources)
