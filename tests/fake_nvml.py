"""A pynvml look-alike over a list of GPU dicts, shared by the resource and GPU-metrics tests: the
error classes, and the calls that walk the device list; each test file adds what it reads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from otel_gpu.devices import nvml


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError."""


class FakeNotSupported(FakeNVMLError):
    """Stands in for pynvml.NVMLError_NotSupported."""


class FakeNotFound(FakeNVMLError):
    """Stands in for pynvml.NVMLError_NotFound (an empty MIG slot)."""


class FakeLibraryNotFound(FakeNVMLError):
    """Stands in for pynvml.NVMLError_LibraryNotFound."""


class FakeNvmlDevices:
    """pynvml's error classes and device enumeration over ``gpus`` (dicts with "uuid" and
    "name"); any method can be swapped to fail (see :func:`raising`)."""

    NVMLError = FakeNVMLError
    NVMLError_NotSupported = FakeNotSupported
    NVMLError_NotFound = FakeNotFound
    NVMLError_LibraryNotFound = FakeLibraryNotFound
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, gpus: list[dict[str, Any]]) -> None:
        self.gpus = gpus

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> bytes | str:
        return handle["uuid"]

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> bytes | str:
        return handle["name"]


def raising(exc: BaseException) -> Callable[..., Any]:
    """A stand-in for any NVML call that raises ``exc``."""

    def fail(*_args: object) -> Any:
        raise exc

    return fail


Fake = TypeVar("Fake", bound=FakeNvmlDevices)


def installed(monkeypatch: pytest.MonkeyPatch, fake: Fake) -> Fake:
    """``fake``, loaded by the NVML seam instead of pynvml for the rest of the test."""
    monkeypatch.setattr(nvml, "_load_pynvml", lambda: fake)
    return fake
