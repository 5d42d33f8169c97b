"""The OpenTelemetry resource describing this process, its host and its GPUs.

Used by otel_gpu's own TracerProvider (:func:`build_resource`) and, through the
``opentelemetry_resource_detector`` entry point ``otel_gpu``, by any OTel app
that sets ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=otel_gpu``.

Attribute keys (a public contract; absent when unknown):

Host and OS
    ``host.name``, ``host.arch`` (amd64, arm64, ...), ``os.type``,
    ``os.description``, ``os.version``
Process
    ``process.pid``, ``process.executable.path``, ``process.runtime.name``,
    ``process.runtime.version``, ``process.runtime.description``,
    ``service.name`` (default only: the script name; env vars override it)
Software
    ``otel_gpu.version``, ``otel_gpu.torch.version``, ``otel_gpu.cuda.version``
    ("none" on CPU builds), ``otel_gpu.cudnn.version``,
    ``otel_gpu.torch.cuda_available``
GPUs (from NVML)
    ``otel_gpu.gpu.count``, ``otel_gpu.gpu.driver_version``,
    ``otel_gpu.gpu.cuda_driver_version``, ``otel_gpu.gpu.error`` (why GPUs or
    fields are missing), and per NVML index ``i``: ``otel_gpu.gpu.<i>.index``,
    ``otel_gpu.gpu.<i>.hw.id`` (UUID), ``otel_gpu.gpu.<i>.hw.model``,
    ``otel_gpu.gpu.<i>.hw.vendor``, ``otel_gpu.gpu.<i>.memory.total`` (bytes),
    ``otel_gpu.gpu.<i>.compute_capability``, ``otel_gpu.gpu.<i>.mig_mode``,
    ``otel_gpu.gpu.<i>.pci_bus_id``
Placement
    ``otel_gpu.gpu.current_device`` (only if CUDA was already initialised),
    ``otel_gpu.cuda_visible_devices``, and the keys of :data:`DISTRIBUTED_ENV`
    and :data:`K8S_ENV`.

Precedence in :func:`build_resource`: detected values < ``OTEL_RESOURCE_ATTRIBUTES``
< ``OTEL_SERVICE_NAME``.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from importlib import metadata

from opentelemetry.sdk.resources import OTELResourceDetector, Resource, ResourceDetector
from opentelemetry.util.types import AttributeValue

from otel_gpu.devices import nvml

__all__ = [
    "CUDA_VISIBLE_DEVICES_ENV",
    "DISTRIBUTED_ENV",
    "K8S_ENV",
    "GpuResourceDetector",
    "build_resource",
    "describe_resource_lines",
    "detect_attributes",
]

_log = logging.getLogger("otel_gpu")

Attributes = dict[str, AttributeValue]

DISTRIBUTED_ENV: Mapping[str, str] = {
    "RANK": "otel_gpu.rank",
    "LOCAL_RANK": "otel_gpu.local_rank",
    "WORLD_SIZE": "otel_gpu.world_size",
    "LOCAL_WORLD_SIZE": "otel_gpu.local_world_size",
}
"""torchrun's environment variables (integers) and the attribute each becomes."""

K8S_ENV: Mapping[str, str] = {
    "K8S_POD_NAME": "k8s.pod.name",
    "K8S_POD_UID": "k8s.pod.uid",
    "K8S_NAMESPACE_NAME": "k8s.namespace.name",
    "K8S_NODE_NAME": "k8s.node.name",
    "K8S_CONTAINER_NAME": "k8s.container.name",
}
"""Kubernetes downward-API environment variables to set in the pod spec, and their attributes."""

CUDA_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
"""Copied verbatim to ``otel_gpu.cuda_visible_devices`` when set (even empty: that hides all GPUs)."""

# platform.machine() spellings -> semantic-convention host.arch values.
_ARCH = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "armv7l": "arm32",
    "armv6l": "arm32",
    "arm": "arm32",
    "i386": "x86",
    "i686": "x86",
    "x86": "x86",
    "ppc64": "ppc64",
    "ppc64le": "ppc64",
    "ppc": "ppc32",
    "s390x": "s390x",
    "ia64": "ia64",
}
_OS_TYPE = {"sunos": "solaris", "os/390": "z_os"}


def _env() -> Mapping[str, str]:
    from otel_gpu.config import resource_variables

    return resource_variables()


def _script_name() -> str:
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 in ("", "-c", "-"):
        return "python"
    base = os.path.basename(argv0)
    if base == "__main__.py":
        # `python -m pkg` puts pkg/__main__.py in argv[0]; the package is the useful name.
        base = os.path.basename(os.path.dirname(os.path.abspath(argv0))) or base
    return base.removesuffix(".py") or "python"


def _host_os() -> Attributes:
    machine = platform.machine().lower()
    system = platform.system().lower()
    return {
        "host.name": socket.gethostname(),
        "host.arch": _ARCH.get(machine, machine),
        "os.type": _OS_TYPE.get(system, system),
        "os.description": platform.platform(),
        "os.version": platform.release(),
    }


def _process() -> Attributes:
    return {
        "process.pid": os.getpid(),
        "process.executable.path": sys.executable,
        "process.runtime.name": sys.implementation.name,
        "process.runtime.version": platform.python_version(),
        "process.runtime.description": sys.version,
        "service.name": _script_name(),
    }


def _package_version() -> Attributes:
    try:
        version = metadata.version("otel-gpu")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"otel_gpu.version": version}


def _torch() -> Attributes:
    import torch

    attrs: Attributes = {
        "otel_gpu.torch.version": str(torch.__version__),
        "otel_gpu.cuda.version": torch.version.cuda or "none",
    }
    # Each sub-probe is guarded on its own: a broken cuDNN must not hide the CUDA facts.
    try:
        cudnn = torch.backends.cudnn.version()
        if cudnn is not None:
            attrs["otel_gpu.cudnn.version"] = int(cudnn)
    except Exception as exc:
        _log.debug("otel_gpu resource: cuDNN version unavailable: %r", exc)
    try:
        # Asks the driver for a device count; unlike current_device() it creates no context.
        attrs["otel_gpu.torch.cuda_available"] = bool(torch.cuda.is_available())
    except Exception as exc:
        _log.debug("otel_gpu resource: torch.cuda.is_available() failed: %r", exc)
    return attrs


_report_lock = threading.Lock()
_report: nvml.NvmlReport | None = None


def _gpu_report() -> nvml.NvmlReport:
    # GPU inventory is machine-level, so it survives fork: re-querying NVML in
    # every DataLoader worker would cost an nvmlInit each time for nothing new.
    global _report
    with _report_lock:
        if _report is None:
            _report = nvml.query_gpus()
        return _report


def _gpus() -> Attributes:
    report = _gpu_report()
    attrs: Attributes = {"otel_gpu.gpu.count": len(report.gpus)}
    optional: dict[str, AttributeValue | None] = {
        "otel_gpu.gpu.driver_version": report.driver_version,
        "otel_gpu.gpu.cuda_driver_version": report.cuda_driver_version,
        "otel_gpu.gpu.error": report.error,
    }
    for gpu in report.gpus:
        prefix = f"otel_gpu.gpu.{gpu.index}."
        optional.update(
            {
                prefix + "index": gpu.index,
                prefix + "hw.id": gpu.uuid or None,
                prefix + "hw.model": gpu.name or None,
                prefix + "hw.vendor": gpu.vendor or None,
                prefix + "memory.total": gpu.memory_total_bytes,
                prefix + "compute_capability": gpu.compute_capability,
                prefix + "mig_mode": gpu.mig_mode,
                prefix + "pci_bus_id": gpu.pci_bus_id,
            }
        )
    attrs.update({key: value for key, value in optional.items() if value is not None})
    return attrs


def _current_cuda_device() -> int | None:
    # Never initialise CUDA here: doing so before fork() breaks every forked child.
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def _placement() -> Attributes:
    attrs: Attributes = {}
    device = _current_cuda_device()
    if device is not None:
        attrs["otel_gpu.gpu.current_device"] = device
    env = _env()
    if CUDA_VISIBLE_DEVICES_ENV in env:
        attrs["otel_gpu.cuda_visible_devices"] = env[CUDA_VISIBLE_DEVICES_ENV]
    for name, key in DISTRIBUTED_ENV.items():
        raw = env.get(name)
        if raw is None:
            continue
        try:
            attrs[key] = int(raw.strip())
        except ValueError:
            _log.debug("otel_gpu resource: ignoring non-integer %s=%r", name, raw)
    for name, key in K8S_ENV.items():
        if env.get(name):
            attrs[key] = env[name]
    return attrs


_PROBES: tuple[tuple[str, Callable[[], Attributes]], ...] = (
    ("host/os", _host_os),
    ("process", _process),
    ("package version", _package_version),
    ("torch", _torch),
    ("NVML", _gpus),
    ("placement", _placement),
)


def detect_attributes() -> dict[str, AttributeValue]:
    """Everything otel_gpu knows about this process. Never raises: a failing probe drops its keys."""
    attrs: Attributes = {}
    for name, probe in _PROBES:
        try:
            attrs.update(probe())
        except Exception as exc:
            _log.debug("otel_gpu resource: %s probe failed: %r", name, exc)
    return attrs


class GpuResourceDetector(ResourceDetector):
    """The ``otel_gpu`` resource detector for ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS``."""

    def detect(self) -> Resource:
        return Resource(detect_attributes())

    def is_process_dependent(self) -> bool:
        # process.pid changes across fork, so the SDK should re-run us in the child.
        return True


_cache_lock = threading.Lock()
_cache: Resource | None = None


def _compose() -> Resource:
    detected = detect_attributes()
    try:
        # Adds the SDK's telemetry.sdk.* defaults and any detectors the user configured.
        resource = Resource.create(detected)
    except Exception as exc:
        _log.debug("otel_gpu resource: Resource.create failed: %r", exc)
        resource = Resource(detected)
    try:
        # Resource.create lets its argument beat OTEL_RESOURCE_ATTRIBUTES; the
        # user's explicit settings must win over our guesses, so merge them last.
        return resource.merge(OTELResourceDetector().detect())
    except Exception as exc:
        _log.debug("otel_gpu resource: reading OTEL_RESOURCE_ATTRIBUTES failed: %r", exc)
        return resource


def build_resource() -> Resource:
    """The resource for otel_gpu's TracerProvider, computed once per process. Never raises."""
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = _compose()
        return _cache


def _forget_process() -> None:
    global _cache, _cache_lock, _report_lock
    # Fresh locks too: another thread may have held the old ones at fork time.
    _cache_lock = threading.Lock()
    _report_lock = threading.Lock()
    _cache = None


def _reset_cache() -> None:
    """Forget everything detected, GPU inventory included (for tests)."""
    global _report
    _forget_process()
    _report = None


_SEP = " \u00b7 "


def _gpu_line(attrs: Mapping[str, object], index: int) -> str:
    prefix = f"otel_gpu.gpu.{index}."
    parts = [f"GPU {index}: {attrs.get(prefix + 'hw.model') or 'unknown model'}"]
    if attrs.get(prefix + "compute_capability"):
        parts.append(f"cc {attrs[prefix + 'compute_capability']}")
    memory = attrs.get(prefix + "memory.total")
    if isinstance(memory, int):
        parts.append(f"{memory / 2**30:.1f} GiB")
    if attrs.get(prefix + "mig_mode") in ("enabled", "disabled"):
        parts.append(f"MIG {attrs[prefix + 'mig_mode']}")
    if attrs.get("otel_gpu.gpu.current_device") == index:
        parts.append("current")
    return _SEP.join(parts)


def describe_resource_lines(resource: Resource) -> list[str]:
    """A few human-readable lines summarising ``resource``, for console headers."""
    attrs: Mapping[str, object] = resource.attributes
    head: list[str] = []
    if attrs.get("otel_gpu.torch.version"):
        head.append(f"torch {attrs['otel_gpu.torch.version']}")
        head.append(f"CUDA {attrs.get('otel_gpu.cuda.version', 'none')}")
    if attrs.get("otel_gpu.gpu.driver_version"):
        head.append(f"driver {attrs['otel_gpu.gpu.driver_version']}")
    if "otel_gpu.cuda_visible_devices" in attrs:
        head.append(f"{CUDA_VISIBLE_DEVICES_ENV}={attrs['otel_gpu.cuda_visible_devices']}")
    count = attrs.get("otel_gpu.gpu.count")
    if isinstance(count, int):
        gpus = f"{count} GPU" + ("" if count == 1 else "s")
        error = attrs.get("otel_gpu.gpu.error")
        head.append(f"{gpus}: {error}" if error else gpus)
    lines = [_SEP.join(head)] if head else []

    prefix, suffix = "otel_gpu.gpu.", ".index"
    indices = sorted(
        value
        for key, value in attrs.items()
        if key.startswith(prefix) and key.endswith(suffix) and isinstance(value, int)
    )
    lines.extend(_gpu_line(attrs, index) for index in indices)

    if "otel_gpu.rank" in attrs or "otel_gpu.local_rank" in attrs:
        rank = f"rank {attrs.get('otel_gpu.rank', '?')}"
        if "otel_gpu.world_size" in attrs:
            rank += f"/{attrs['otel_gpu.world_size']}"
        if "otel_gpu.local_rank" in attrs:
            rank += f" local {attrs['otel_gpu.local_rank']}"
        lines.append(rank)
    if attrs.get("k8s.pod.name"):
        pod = str(attrs["k8s.pod.name"])
        if attrs.get("k8s.namespace.name"):
            pod = f"{attrs['k8s.namespace.name']}/{pod}"
        node = f" on {attrs['k8s.node.name']}" if attrs.get("k8s.node.name") else ""
        lines.append(f"k8s pod {pod}{node}")
    return lines


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_process)
