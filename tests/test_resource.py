"""Tests for the NVML seam and the OpenTelemetry resource built from it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fake_nvml import (
    FakeLibraryNotFound,
    FakeNotSupported,
    FakeNvmlDevices,
    FakeNVMLError,
    installed,
    raising,
)
from opentelemetry.sdk.resources import Resource, get_aggregated_resources

from otel_gpu import resource
from otel_gpu.devices import nvml
from otel_gpu.resource import (
    DISTRIBUTED_ENV,
    K8S_ENV,
    GpuResourceDetector,
    build_resource,
    describe_resource_lines,
    detect_attributes,
)

GIB = 2**30

_ENV_TO_CLEAR = (
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SERVICE_NAME",
    "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS",
    "CUDA_VISIBLE_DEVICES",
    *DISTRIBUTED_ENV,
    *K8S_ENV,
)


class FakeNvml(FakeNvmlDevices):
    """A pynvml look-alike over a list of GPU dicts; counts its shutdowns."""

    def __init__(self, gpus: list[dict[str, Any]]) -> None:
        super().__init__(gpus)
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"550.54.15"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 12040

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(total=handle["memory"], used=0, free=handle["memory"])

    def nvmlDeviceGetCudaComputeCapability(self, handle: dict[str, Any]) -> tuple[int, int]:
        return handle["cc"]

    def nvmlDeviceGetMigMode(self, handle: dict[str, Any]) -> list[int]:
        if handle["mig"] is None:
            raise FakeNotSupported("Not Supported")
        return [handle["mig"], handle["mig"]]

    def nvmlDeviceGetPciInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(busId=handle["bus"])


def _two_gpus() -> list[dict[str, Any]]:
    # Bytes on one GPU and str on the other: pynvml has returned both over its history.
    return [
        {
            "uuid": b"GPU-aaaa",
            "name": b"NVIDIA H100 80GB HBM3",
            "memory": 80 * GIB,
            "cc": (9, 0),
            "mig": 0,
            "bus": b"00000000:17:00.0",
        },
        {
            "uuid": "GPU-bbbb",
            "name": "NVIDIA GeForce RTX 4090",
            "memory": 24 * GIB,
            "cc": (8, 9),
            "mig": None,
            "bus": "00000000:65:00.0",
        },
    ]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in _ENV_TO_CLEAR:
        monkeypatch.delenv(name, raising=False)
    resource._reset_cache()
    yield
    resource._reset_cache()


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return installed(monkeypatch, FakeNvml(_two_gpus()))


# --------------------------------------------------------------------------- NVML


def test_two_gpus_give_every_per_gpu_key(fake_nvml: FakeNvml) -> None:
    """Each GPU NVML reports becomes the full set of otel_gpu.gpu.<i>.* keys, bytes decoded."""
    attrs = detect_attributes()
    gpu_attrs = {k: v for k, v in attrs.items() if k.startswith("otel_gpu.gpu.")}
    assert gpu_attrs == {
        "otel_gpu.gpu.count": 2,
        "otel_gpu.gpu.driver_version": "550.54.15",
        "otel_gpu.gpu.cuda_driver_version": "12.4",
        "otel_gpu.gpu.0.index": 0,
        "otel_gpu.gpu.0.hw.id": "GPU-aaaa",
        "otel_gpu.gpu.0.hw.model": "NVIDIA H100 80GB HBM3",
        "otel_gpu.gpu.0.hw.vendor": "NVIDIA",
        "otel_gpu.gpu.0.memory.total": 80 * GIB,
        "otel_gpu.gpu.0.compute_capability": "9.0",
        "otel_gpu.gpu.0.mig_mode": "disabled",
        "otel_gpu.gpu.0.pci_bus_id": "00000000:17:00.0",
        "otel_gpu.gpu.1.index": 1,
        "otel_gpu.gpu.1.hw.id": "GPU-bbbb",
        "otel_gpu.gpu.1.hw.model": "NVIDIA GeForce RTX 4090",
        "otel_gpu.gpu.1.hw.vendor": "NVIDIA",
        "otel_gpu.gpu.1.memory.total": 24 * GIB,
        "otel_gpu.gpu.1.compute_capability": "8.9",
        "otel_gpu.gpu.1.mig_mode": "unsupported",
        "otel_gpu.gpu.1.pci_bus_id": "00000000:65:00.0",
    }
    assert fake_nvml.shutdowns == 1


def test_mig_enabled_is_reported(fake_nvml: FakeNvml) -> None:
    """A current MIG mode equal to NVML_DEVICE_MIG_ENABLE reads as "enabled"."""
    fake_nvml.gpus[0]["mig"] = 1
    assert nvml.query_gpus().gpus[0].mig_mode == "enabled"


def _detected_while_raising(
    monkeypatch: pytest.MonkeyPatch, target: object, name: str, exc: BaseException
) -> dict[str, Any]:
    """The attributes detected while ``target.name`` raises ``exc``."""
    monkeypatch.setattr(target, name, raising(exc))
    return detect_attributes()


def _without_gpus(
    monkeypatch: pytest.MonkeyPatch, target: object, name: str, exc: BaseException
) -> dict[str, Any]:
    """As :func:`_detected_while_raising`; the attributes count no GPU."""
    attrs = _detected_while_raising(monkeypatch, target, name, exc)
    assert attrs["otel_gpu.gpu.count"] == 0
    return attrs


def test_library_not_found_gives_zero_gpus_and_reason(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No NVIDIA driver: count 0, the reason is recorded, nothing raises, no shutdown without init."""
    attrs = _without_gpus(monkeypatch, fake_nvml, "nvmlInit", FakeLibraryNotFound("not found"))
    assert attrs["otel_gpu.gpu.error"] == "NVML library not found (no NVIDIA driver)"
    assert not any(key.startswith("otel_gpu.gpu.0.") for key in attrs)
    assert fake_nvml.shutdowns == 0


def test_pynvml_not_importable_gives_zero_gpus_and_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """If pynvml itself cannot be imported, count is 0 and the error names pynvml."""
    attrs = _without_gpus(
        monkeypatch, nvml, "_load_pynvml", ImportError("No module named 'pynvml'")
    )
    assert "pynvml" in str(attrs["otel_gpu.gpu.error"])


def test_unexpected_exception_in_init_never_escapes(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a non-NVML exception from nvmlInit becomes a recorded reason, not a crash."""
    monkeypatch.setattr(fake_nvml, "nvmlInit", raising(RuntimeError("boom")))
    report = nvml.query_gpus()
    assert report.gpus == ()
    assert report.error == "RuntimeError: boom"


def test_device_count_failure_keeps_driver_and_records_reason(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvmlDeviceGetCount failing mid-query: zero GPUs, driver still known, reason kept, shutdown run."""
    attrs = _without_gpus(
        monkeypatch, fake_nvml, "nvmlDeviceGetCount", FakeNVMLError("Unknown Error")
    )
    assert attrs["otel_gpu.gpu.driver_version"] == "550.54.15"
    assert "device count" in str(attrs["otel_gpu.gpu.error"])
    assert "Unknown Error" in str(attrs["otel_gpu.gpu.error"])
    assert fake_nvml.shutdowns == 1


def test_one_failing_field_drops_only_that_field(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A field that fails on one GPU is omitted for that GPU; the rest of the inventory survives."""
    real = fake_nvml.nvmlDeviceGetMemoryInfo

    def memory(handle: dict[str, Any]) -> SimpleNamespace:
        if handle is fake_nvml.gpus[1]:
            raise FakeNVMLError("GPU is lost")
        return real(handle)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetMemoryInfo", memory)
    attrs = detect_attributes()
    assert attrs["otel_gpu.gpu.count"] == 2
    assert attrs["otel_gpu.gpu.0.memory.total"] == 80 * GIB
    assert "otel_gpu.gpu.1.memory.total" not in attrs
    assert attrs["otel_gpu.gpu.1.hw.id"] == "GPU-bbbb"
    assert "GPU 1 memory" in str(attrs["otel_gpu.gpu.error"])


def test_not_supported_field_is_silently_absent(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NotSupported (normal on some boards) drops the field without polluting the error."""
    attrs = _detected_while_raising(
        monkeypatch, fake_nvml, "nvmlDeviceGetPciInfo", FakeNotSupported("n/a")
    )
    assert "otel_gpu.gpu.0.pci_bus_id" not in attrs
    assert "otel_gpu.gpu.error" not in attrs


def test_unreachable_device_is_skipped(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If one GPU's handle cannot be obtained, the other GPU is still reported under its own index."""
    real = fake_nvml.nvmlDeviceGetHandleByIndex

    def handle(index: int) -> dict[str, Any]:
        if index == 0:
            raise FakeNVMLError("GPU requires reset")
        return real(index)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetHandleByIndex", handle)
    attrs = detect_attributes()
    assert attrs["otel_gpu.gpu.count"] == 1
    assert attrs["otel_gpu.gpu.1.hw.model"] == "NVIDIA GeForce RTX 4090"
    assert not any(key.startswith("otel_gpu.gpu.0.") for key in attrs)
    assert "GPU 0 handle" in str(attrs["otel_gpu.gpu.error"])


def test_real_pynvml_without_gpus_reports_reason() -> None:
    """The real pynvml on a machine without NVIDIA GPUs yields count 0 and a reason, no exception."""
    if nvml.query_gpus().gpus:
        pytest.skip("this machine has NVIDIA GPUs; the GPU-less path cannot be observed here")
    attrs = detect_attributes()
    assert attrs["otel_gpu.gpu.count"] == 0
    assert attrs["otel_gpu.gpu.error"]


# --------------------------------------------------------------------------- host, process, torch


def test_host_process_and_software_keys(fake_nvml: FakeNvml) -> None:
    """The documented host, OS, process and software keys are present with sane values."""
    attrs = detect_attributes()
    assert attrs["process.pid"] == os.getpid()
    assert attrs["process.executable.path"] == sys.executable
    assert attrs["process.runtime.name"] == sys.implementation.name
    assert attrs["process.runtime.version"] == platform.python_version()
    assert attrs["process.runtime.description"] == sys.version
    assert attrs["os.type"] == platform.system().lower()
    assert attrs["os.version"] == platform.release()
    for key in ("host.name", "host.arch", "os.description", "otel_gpu.version"):
        assert isinstance(attrs[key], str) and attrs[key], key
    if platform.machine() == "x86_64":
        assert attrs["host.arch"] == "amd64"


def test_torch_keys() -> None:
    """torch version, CUDA build version ("none" on CPU builds) and availability are recorded."""
    torch = pytest.importorskip("torch")
    attrs = detect_attributes()
    assert attrs["otel_gpu.torch.version"] == str(torch.__version__)
    assert attrs["otel_gpu.cuda.version"] == (torch.version.cuda or "none")
    assert attrs["otel_gpu.torch.cuda_available"] is torch.cuda.is_available()


def test_failing_probe_drops_only_its_keys(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe that raises (here platform) loses its own keys; everything else is still detected."""
    attrs = _detected_while_raising(monkeypatch, platform, "machine", OSError("uname failed"))
    assert "host.arch" not in attrs
    assert attrs["otel_gpu.gpu.count"] == 2
    assert attrs["process.pid"] == os.getpid()


# --------------------------------------------------------------------------- placement


def test_current_device_only_when_cuda_initialised(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """otel_gpu.gpu.current_device appears only when the seam reports an initialised CUDA."""
    monkeypatch.setattr(resource, "_current_cuda_device", lambda: None)
    assert "otel_gpu.gpu.current_device" not in detect_attributes()
    monkeypatch.setattr(resource, "_current_cuda_device", lambda: 1)
    assert detect_attributes()["otel_gpu.gpu.current_device"] == 1


def test_detection_never_initialises_cuda() -> None:
    """Detecting the resource leaves CUDA uninitialised, so fork-based apps keep working."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_initialized():
        pytest.skip("CUDA was already initialised by an earlier test")
    detect_attributes()
    assert resource._current_cuda_device() is None
    assert not torch.cuda.is_initialized()


def test_cuda_visible_devices(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES is copied verbatim when set, even empty, and absent otherwise."""
    assert "otel_gpu.cuda_visible_devices" not in detect_attributes()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert detect_attributes()["otel_gpu.cuda_visible_devices"] == "1,0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect_attributes()["otel_gpu.cuda_visible_devices"] == ""


def test_torchrun_variables_become_int_attributes(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE map to integer otel_gpu.* keys."""
    for name, value in {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
    }.items():
        monkeypatch.setenv(name, value)
    attrs = detect_attributes()
    assert attrs["otel_gpu.rank"] == 3
    assert attrs["otel_gpu.local_rank"] == 1
    assert attrs["otel_gpu.world_size"] == 8
    assert attrs["otel_gpu.local_world_size"] == 4


def test_invalid_rank_is_ignored(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-integer RANK is dropped without failing; valid siblings are still recorded."""
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    attrs = detect_attributes()
    assert "otel_gpu.rank" not in attrs
    assert attrs["otel_gpu.world_size"] == 2


@pytest.mark.parametrize(("env_name", "key"), sorted(K8S_ENV.items()))
def test_kubernetes_downward_api_variables(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, env_name: str, key: str
) -> None:
    """Each documented K8S_* variable maps to its k8s.* semantic-convention key."""
    assert key not in detect_attributes()
    monkeypatch.setenv(env_name, "value-" + env_name.lower())
    assert detect_attributes()[key] == "value-" + env_name.lower()


# --------------------------------------------------------------------------- build_resource


def test_otel_resource_attributes_override_detected_values(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_RESOURCE_ATTRIBUTES beats detection, including for service.name."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "host.name=from-env,service.name=attrs-svc")
    attrs = build_resource().attributes
    assert attrs["host.name"] == "from-env"
    assert attrs["service.name"] == "attrs-svc"
    assert attrs["otel_gpu.gpu.count"] == 2


def test_otel_service_name_wins(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_SERVICE_NAME beats both OTEL_RESOURCE_ATTRIBUTES' service.name and the script name."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=attrs-svc")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "named-svc")
    assert build_resource().attributes["service.name"] == "named-svc"


@pytest.mark.parametrize(
    ("argv0", "expected"),
    [
        ("/jobs/train_model.py", "train_model"),
        ("-c", "python"),
        ("", "python"),
        ("/src/mypkg/__main__.py", "mypkg"),
        ("/usr/bin/torchrun", "torchrun"),
    ],
)
def test_service_name_defaults_to_script_name(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, argv0: str, expected: str
) -> None:
    """Without env settings service.name is the script's name, never unknown_service."""
    monkeypatch.setattr(sys, "argv", [argv0])
    assert build_resource().attributes["service.name"] == expected


def test_build_resource_is_cached_until_reset(fake_nvml: FakeNvml) -> None:
    """build_resource computes once per process; _reset_cache forces a fresh detection."""
    first = build_resource()
    assert build_resource() is first
    resource._reset_cache()
    assert build_resource() is not first


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_gets_its_own_pid(fake_nvml: FakeNvml) -> None:
    """After fork the child rebuilds the resource, so process.pid names the child, not the parent."""
    parent_pid = build_resource().attributes["process.pid"]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report and leave without running pytest's teardown
        try:
            os.write(write_fd, str(build_resource().attributes["process.pid"]).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    child_reported = int(os.read(read_fd, 64).decode())
    os.close(read_fd)
    os.waitpid(pid, 0)
    assert parent_pid == os.getpid()
    assert child_reported == pid


# --------------------------------------------------------------------------- SDK integration


def test_detector_class_works_with_sdk_aggregation(fake_nvml: FakeNvml) -> None:
    """GpuResourceDetector plugs into the SDK's aggregation and reports process dependence."""
    detector = GpuResourceDetector()
    merged = get_aggregated_resources([detector], Resource.get_empty())
    assert merged.attributes["otel_gpu.gpu.count"] == 2
    assert detector.is_process_dependent() is True


def test_entry_point_detector_through_resource_create(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=otel_gpu makes Resource.create() include our keys."""
    if not importlib.metadata.entry_points(
        group="opentelemetry_resource_detector", name="otel_gpu"
    ):
        pytest.skip("otel_gpu entry point not installed (pip install -e . registers it)")
    monkeypatch.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", "otel_gpu")
    attrs = Resource.create().attributes
    assert attrs["otel_gpu.gpu.count"] == 2
    assert attrs["otel_gpu.gpu.0.hw.model"] == "NVIDIA H100 80GB HBM3"


# --------------------------------------------------------------------------- summary


def test_describe_lines_with_gpus(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    """The console summary names each GPU with cc, memory and MIG, plus rank and pod lines."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("K8S_POD_NAME", "trainer-0")
    monkeypatch.setenv("K8S_NAMESPACE_NAME", "ml")
    monkeypatch.setenv("K8S_NODE_NAME", "gpu-node-7")
    lines = describe_resource_lines(build_resource())
    assert "driver 550.54.15" in lines[0]
    assert lines[0].endswith("2 GPUs")
    assert "GPU 0: NVIDIA H100 80GB HBM3 \u00b7 cc 9.0 \u00b7 80.0 GiB \u00b7 MIG disabled" in lines
    assert "GPU 1: NVIDIA GeForce RTX 4090 \u00b7 cc 8.9 \u00b7 24.0 GiB" in lines
    assert "rank 0/8 local 0" in lines
    assert "k8s pod ml/trainer-0 on gpu-node-7" in lines


def test_describe_lines_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no GPUs the header states the count 0 and why."""
    monkeypatch.setattr(nvml, "_load_pynvml", raising(ImportError("no pynvml")))
    lines = describe_resource_lines(build_resource())
    assert len(lines) == 1
    assert "0 GPUs: pynvml not importable" in lines[0]
