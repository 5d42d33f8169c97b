"""The NVML seam: a read-only, never-raising snapshot of the machine's NVIDIA GPUs.

Everything that touches ``pynvml`` lives here so the rest of ``otel_gpu`` (and
its tests) deal only in plain frozen dataclasses. NVML is used rather than
``torch.cuda`` because NVML never creates a CUDA context, so querying it is
safe before ``fork()`` and costs no GPU memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

__all__ = ["GpuInfo", "NvmlReport", "query_gpus"]

_log = logging.getLogger("otel_gpu")

_T = TypeVar("_T")


@dataclass(frozen=True)
class GpuInfo:
    """Static facts about one GPU, as NVML numbers it (not CUDA_VISIBLE_DEVICES order)."""

    index: int
    uuid: str
    name: str
    vendor: str = "NVIDIA"
    memory_total_bytes: int | None = None
    compute_capability: str | None = None
    mig_mode: str = "unsupported"
    pci_bus_id: str | None = None


@dataclass(frozen=True)
class NvmlReport:
    """What NVML could tell us; ``error`` explains why GPUs or fields are missing."""

    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    error: str | None = None


def _load_pynvml() -> ModuleType:
    # Kept as a separate function so tests can substitute a fake module.
    import pynvml

    return pynvml


def _text(value: object) -> str:
    # Older pynvml releases return bytes, newer ones str.
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _error_class(nvml: Any, name: str) -> type[BaseException] | None:
    cls = getattr(nvml, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


def _is(nvml: Any, exc: BaseException, name: str) -> bool:
    cls = _error_class(nvml, name)
    return cls is not None and isinstance(exc, cls)


def _describe(nvml: Any, exc: BaseException) -> str:
    """A short human-readable reason, phrased for someone wondering where their GPUs went."""
    if isinstance(exc, ImportError):
        return f"pynvml not importable ({exc})"
    if _is(nvml, exc, "NVMLError_LibraryNotFound"):
        return "NVML library not found (no NVIDIA driver)"
    if _is(nvml, exc, "NVMLError_DriverNotLoaded"):
        return "NVIDIA driver not loaded"
    if _is(nvml, exc, "NVMLError_NoPermission"):
        return "no permission to query NVML"
    if _is(nvml, exc, "NVMLError_NotSupported"):
        return "not supported by this GPU/driver"
    try:
        detail = str(exc)
    except Exception:
        # pynvml's __str__ itself calls into the library, which may be what is broken.
        detail = ""
    kind = "NVML error" if _is(nvml, exc, "NVMLError") else type(exc).__name__
    return f"{kind}: {detail}" if detail else kind


def _cuda_version_text(raw: int) -> str:
    # NVML encodes CUDA versions as 1000*major + 10*minor, e.g. 12040 -> "12.4".
    return f"{raw // 1000}.{(raw % 1000) // 10}"


class _Probe:
    """Runs NVML calls one at a time, turning failures into None plus a recorded reason."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.problems: list[str] = []

    def call(self, what: str, fn: Callable[[], _T]) -> _T | None:
        try:
            return fn()
        except Exception as exc:
            # NotSupported is the normal answer on some boards (e.g. memory info
            # on unified-memory parts), so it is not worth reporting.
            if not _is(self.nvml, exc, "NVMLError_NotSupported"):
                self.problems.append(f"{what}: {_describe(self.nvml, exc)}")
            _log.debug("NVML %s failed: %r", what, exc)
            return None


def _mig_mode(nvml: Any, handle: object, probe: _Probe, index: int) -> str:
    try:
        current = nvml.nvmlDeviceGetMigMode(handle)[0]
    except Exception as exc:
        if not _is(nvml, exc, "NVMLError_NotSupported"):
            probe.problems.append(f"GPU {index} MIG mode: {_describe(nvml, exc)}")
        return "unsupported"
    enabled = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
    return "enabled" if current == enabled else "disabled"


def _read_gpu(nvml: Any, index: int, probe: _Probe) -> GpuInfo | None:
    handle = probe.call(f"GPU {index} handle", lambda: nvml.nvmlDeviceGetHandleByIndex(index))
    if handle is None:
        return None
    uuid = probe.call(f"GPU {index} UUID", lambda: _text(nvml.nvmlDeviceGetUUID(handle)))
    name = probe.call(f"GPU {index} name", lambda: _text(nvml.nvmlDeviceGetName(handle)))
    memory = probe.call(
        f"GPU {index} memory", lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    )
    cc = probe.call(
        f"GPU {index} compute capability",
        lambda: "{}.{}".format(*nvml.nvmlDeviceGetCudaComputeCapability(handle)),
    )
    bus_id = probe.call(
        f"GPU {index} PCI info", lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    )
    return GpuInfo(
        index=index,
        uuid=uuid or "",
        name=name or "",
        vendor="NVIDIA",
        memory_total_bytes=memory,
        compute_capability=cc,
        mig_mode=_mig_mode(nvml, handle, probe, index),
        pci_bus_id=bus_id or None,
    )


def _cuda_driver_version(nvml: Any) -> str:
    getter = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", None)
    if getter is None:
        getter = nvml.nvmlSystemGetCudaDriverVersion
    return _cuda_version_text(int(getter()))


def query_gpus() -> NvmlReport:
    """Snapshot every GPU NVML can see. Never raises; ``error`` says what went wrong."""
    nvml: Any = None
    gpus: list[GpuInfo] = []
    driver: str | None = None
    cuda_driver: str | None = None
    probe: _Probe | None = None
    fatal: str | None = None
    initialised = False
    try:
        nvml = _load_pynvml()
        nvml.nvmlInit()
        initialised = True
        probe = _Probe(nvml)
        driver = probe.call("driver version", lambda: _text(nvml.nvmlSystemGetDriverVersion()))
        cuda_driver = probe.call("CUDA driver version", lambda: _cuda_driver_version(nvml))
        count = probe.call("device count", lambda: int(nvml.nvmlDeviceGetCount())) or 0
        for index in range(count):
            info = _read_gpu(nvml, index, probe)
            if info is not None:
                gpus.append(info)
    except Exception as exc:
        # Telemetry trivia must never take the application down.
        fatal = _describe(nvml, exc)
        _log.debug("NVML query stopped: %r", exc)
    finally:
        if initialised:
            try:
                nvml.nvmlShutdown()
            except Exception as exc:
                _log.debug("nvmlShutdown failed: %r", exc)

    problems = ([fatal] if fatal else []) + (probe.problems if probe else [])
    if not gpus and not problems:
        # A working driver with zero devices is still worth explaining to the reader.
        problems.append("NVML reports no GPUs")
    return NvmlReport(
        gpus=tuple(gpus),
        driver_version=driver,
        cuda_driver_version=cuda_driver,
        error="; ".join(problems) or None,
    )
