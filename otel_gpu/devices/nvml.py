"""The NVML seam: read-only, never-raising views of the machine's NVIDIA GPUs.

Everything that touches ``pynvml`` lives here so the rest of ``otel_gpu`` (and
its tests) deal only in plain frozen dataclasses. NVML is used rather than
``torch.cuda`` because NVML never creates a CUDA context, so querying it is
safe before ``fork()`` and costs no GPU memory.

- ``query_gpus()``: the static facts (UUID, name, memory size, MIG mode...) for the
  resource; it initialises NVML and shuts it down again.
- ``sample_gpus()``: the changing readings (utilization, memory used, power, temperature,
  clocks, MIG devices, this process's memory) for the GPU gauges; NVML is initialised once
  per process and kept open, since it is read at every metrics collection.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

__all__ = [
    "GpuInfo",
    "GpuReading",
    "GpuSample",
    "NvmlReport",
    "query_gpus",
    "sample_gpus",
    "unavailable",
]

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


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class GpuReading:
    """One reading of a GPU, or of a MIG device of a MIG-enabled GPU.

    A field NVML does not give (NotSupported, or not listed) is None. A MIG device has
    ``parent_uuid`` set and carries only memory and this process's memory: NVML gives no
    utilization, power, temperature or clocks per MIG instance (they are the parent GPU's).
    """

    index: int  # NVML index of the physical GPU (a MIG device: its parent's)
    uuid: str  # "GPU-..." or, for a MIG device, "MIG-..."
    name: str
    vendor: str = "NVIDIA"
    parent_uuid: str | None = None  # MIG devices only: the GPU they partition
    gpu_instance_id: int | None = None  # MIG devices only: NVML's GPU instance id
    utilization: float | None = None  # fractions in [0, 1], over NVML's last sample period
    encoder_utilization: float | None = None
    decoder_utilization: float | None = None
    memory_controller_utilization: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_draw_watts: float | None = None
    power_limit_watts: float | None = None
    temperature_celsius: float | None = None
    clock_graphics_mhz: float | None = None
    clock_sm_mhz: float | None = None
    clock_memory_mhz: float | None = None
    process_memory_bytes: int | None = None  # this process's, when NVML lists it here


@dataclass(frozen=True)
class GpuSample:
    """One pass over every GPU. ``error`` says why readings or fields are missing."""

    readings: tuple[GpuReading, ...] = ()
    error: str | None = None


class _Session:
    """NVML opened once in this process (``nvml`` None: unusable, ``error`` says why)."""

    def __init__(self, pid: int, nvml: Any, error: str | None) -> None:
        self.pid = pid
        self.nvml = nvml
        self.error = error


_session: _Session | None = None
_session_lock = threading.Lock()
_logged_reasons: set[str] = set()
_MAX_LOGGED_REASONS = 64  # a bound on the de-duplication set, not on correctness


def _log_reason(reason: str) -> None:
    # A collection runs every few seconds: say each distinct reason once, not every time.
    with _session_lock:
        if reason in _logged_reasons or len(_logged_reasons) >= _MAX_LOGGED_REASONS:
            return
        _logged_reasons.add(reason)
    _log.warning("otel-gpu GPU gauges: %s", reason)


def _open_session(log: bool = True) -> _Session:
    nvml: Any = None
    try:
        nvml = _load_pynvml()
        nvml.nvmlInit()
    except Exception as exc:
        reason = _describe(nvml, exc)
        _log.debug("NVML init for sampling failed: %r", exc)
        if log:
            _log_reason(reason)
        return _Session(os.getpid(), None, reason)
    return _Session(os.getpid(), nvml, None)


def unavailable() -> str | None:
    """Why NVML cannot be used in this process (no ``pynvml``, no driver), or None. Opens the
    session as :func:`sample_gpus` would, without logging the reason: on a machine without
    NVIDIA GPUs that is news only to whoever asked for the GPU gauges."""
    return _current_session(log=False).error


def _current_session(log: bool = True) -> _Session:
    global _session
    with _session_lock:
        # A forked child holds its parent's NVML state, which is not its own: open again.
        if _session is None or _session.pid != os.getpid():
            _session = None
        session = _session
    if session is None:
        session = _open_session(log)
        with _session_lock:
            if _session is None:
                _session = session
            elif session.nvml is not None:
                # Another thread opened it first; NVML counts inits, so give ours back.
                _shutdown_quietly(session.nvml)
            session = _session
    return session


def _shutdown_quietly(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception as exc:
        _log.debug("nvmlShutdown failed: %r", exc)


def _reset_sampling() -> None:
    """Close this process's NVML session and forget logged reasons (tests, fork)."""
    global _session
    with _session_lock:
        session, _session = _session, None
        _logged_reasons.clear()
    if session is not None and session.nvml is not None and session.pid == os.getpid():
        _shutdown_quietly(session.nvml)


def _fraction(percent: float) -> float:
    # NVML gives whole percents; the conventions want a fraction in [0, 1].
    return min(max(float(percent) / 100.0, 0.0), 1.0)


def _process_memory(nvml: Any, handle: object, pid: int) -> int | None:
    """Bytes NVML lists for ``pid`` on this device, or None when it does not list it."""
    used = [
        int(p.usedGpuMemory)
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        if p.pid == pid and p.usedGpuMemory is not None
    ]
    return sum(used) if used else None


def _memory(nvml: Any, handle: object, probe: _Probe, what: str) -> tuple[int | None, int | None]:
    info = probe.call(f"{what} memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    if info is None:
        return None, None
    return int(info.used), int(info.total)


def _read_mig_device(
    nvml: Any, handle: object, what: str, index: int, parent_uuid: str, pid: int, probe: _Probe
) -> GpuReading | None:
    uuid = probe.call(f"{what} UUID", lambda: _text(nvml.nvmlDeviceGetUUID(handle)))
    if not uuid:
        return None
    used, total = _memory(nvml, handle, probe, what)
    return GpuReading(
        index=index,
        uuid=uuid,
        name=probe.call(f"{what} name", lambda: _text(nvml.nvmlDeviceGetName(handle))) or "",
        parent_uuid=parent_uuid,
        gpu_instance_id=probe.call(
            f"{what} GPU instance id", lambda: int(nvml.nvmlDeviceGetGpuInstanceId(handle))
        ),
        memory_used_bytes=used,
        memory_total_bytes=total,
        process_memory_bytes=probe.call(
            f"{what} processes", lambda: _process_memory(nvml, handle, pid)
        ),
    )


def _sample_mig_devices(
    nvml: Any, parent: object, index: int, parent_uuid: str, pid: int, probe: _Probe
) -> list[GpuReading]:
    readings: list[GpuReading] = []
    slots = probe.call(
        f"GPU {index} MIG devices", lambda: int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent))
    )
    for slot in range(slots or 0):
        try:
            handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
        except Exception as exc:
            if not _is(nvml, exc, "NVMLError_NotFound"):  # NotFound: an empty slot
                probe.problems.append(f"GPU {index} MIG device {slot}: {_describe(nvml, exc)}")
            continue
        what = f"GPU {index} MIG device {slot}"
        reading = _read_mig_device(nvml, handle, what, index, parent_uuid, pid, probe)
        if reading is not None:
            readings.append(reading)
    return readings


def _sample_gpu(nvml: Any, index: int, pid: int, probe: _Probe) -> list[GpuReading]:
    what = f"GPU {index}"
    handle = probe.call(f"{what} handle", lambda: nvml.nvmlDeviceGetHandleByIndex(index))
    if handle is None:
        return []
    uuid = probe.call(f"{what} UUID", lambda: _text(nvml.nvmlDeviceGetUUID(handle)))
    if not uuid:
        return []  # a reading nobody can name (hw.id) joins nothing: skip the device
    mig = _mig_mode(nvml, handle, probe, index) == "enabled"
    rates = probe.call(f"{what} utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    encoder = probe.call(f"{what} encoder", lambda: nvml.nvmlDeviceGetEncoderUtilization(handle))
    decoder = probe.call(f"{what} decoder", lambda: nvml.nvmlDeviceGetDecoderUtilization(handle))
    power = probe.call(f"{what} power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    limit = probe.call(f"{what} power limit", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
    temperature = probe.call(
        f"{what} temperature", lambda: nvml.nvmlDeviceGetTemperature(handle, sensor)
    )

    def clock(kind: str, default: int) -> float | None:
        which = getattr(nvml, kind, default)
        value = probe.call(f"{what} clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, which))
        return None if value is None else float(value)

    used, total = _memory(nvml, handle, probe, what)
    reading = GpuReading(
        index=index,
        uuid=uuid,
        name=probe.call(f"{what} name", lambda: _text(nvml.nvmlDeviceGetName(handle))) or "",
        utilization=None if rates is None else _fraction(rates.gpu),
        encoder_utilization=None if encoder is None else _fraction(encoder[0]),
        decoder_utilization=None if decoder is None else _fraction(decoder[0]),
        memory_controller_utilization=None if rates is None else _fraction(rates.memory),
        memory_used_bytes=used,
        memory_total_bytes=total,
        power_draw_watts=None if power is None else float(power) / 1000.0,  # NVML: milliwatts
        power_limit_watts=None if limit is None else float(limit) / 1000.0,
        temperature_celsius=None if temperature is None else float(temperature),
        clock_graphics_mhz=clock("NVML_CLOCK_GRAPHICS", 0),
        clock_sm_mhz=clock("NVML_CLOCK_SM", 1),
        clock_memory_mhz=clock("NVML_CLOCK_MEM", 2),
        # Under MIG the parent lists processes only with extra privileges; the MIG devices
        # list their own, so this process's memory is read there instead.
        process_memory_bytes=None
        if mig
        else probe.call(f"{what} processes", lambda: _process_memory(nvml, handle, pid)),
    )
    if not mig:
        return [reading]
    return [reading, *_sample_mig_devices(nvml, handle, index, uuid, pid, probe)]


def sample_gpus() -> GpuSample:
    """Read every GPU (NVML index order), each followed by its MIG devices. Never raises.

    NVML is initialised at the first call in a process and kept open. A field the device
    does not support is absent (None); any other failure leaves what it stopped out, names
    it in ``error`` and logs each distinct reason once.
    """
    session = _current_session()
    nvml = session.nvml
    if nvml is None:
        return GpuSample(error=session.error)
    probe = _Probe(nvml)
    readings: list[GpuReading] = []
    try:
        pid = os.getpid()
        for index in range(int(nvml.nvmlDeviceGetCount())):
            readings.extend(_sample_gpu(nvml, index, pid, probe))
    except Exception as exc:
        # Telemetry trivia must never take the application down: no readings this time.
        reason = _describe(nvml, exc)
        _log.debug("NVML sample stopped: %r", exc)
        _log_reason(reason)
        return GpuSample(error=reason)
    for problem in probe.problems:
        _log_reason(problem)
    return GpuSample(readings=tuple(readings), error="; ".join(probe.problems) or None)
