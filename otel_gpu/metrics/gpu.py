"""The GPU gauges: NVML readings under the OTel hardware conventions' names (docs/metrics.md).

``register(meter, settings)`` creates one asynchronous instrument per metric of the GPU section
of :mod:`otel_gpu.metrics.names`. Their callbacks share one NVML sample per collection: the SDK
calls every callback once per collection, so a callback that finds its instrument already
served from the current sample knows a new collection has begun and takes a new one. A sample
older than half the collection interval is never reused either, so an instrument a view
leaves out cannot pin a stale one. Sampling happens on the reader's thread, never the caller's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_gpu import _guard
from otel_gpu.config import Settings
from otel_gpu.devices import nvml
from otel_gpu.devices.nvml import GpuReading, GpuSample
from otel_gpu.metrics import names
from otel_gpu.metrics.names import Metric

__all__ = ["GpuGauges", "register"]

_Attributes = dict[str, Any]
# What one metric reads from one GPU reading: (value, extra attributes) pairs.
_Read = Callable[[GpuReading], Iterable[tuple[float, _Attributes]]]


def _field(name: str) -> _Read:
    def read(r: GpuReading) -> Iterator[tuple[float, _Attributes]]:
        value = getattr(r, name)
        if value is not None:
            yield value, {}

    return read


def _utilization(r: GpuReading) -> Iterator[tuple[float, _Attributes]]:
    for task, value in (
        ("general", r.utilization),
        ("encoder", r.encoder_utilization),
        ("decoder", r.decoder_utilization),
    ):
        if value is not None:
            yield value, {names.HW_GPU_TASK: task}


def _memory_fraction(r: GpuReading) -> Iterator[tuple[float, _Attributes]]:
    if r.memory_used_bytes is not None and r.memory_total_bytes:
        yield r.memory_used_bytes / r.memory_total_bytes, {}


# (metric, asynchronous up-down counter rather than gauge, reader). The conventions make the
# memory sizes UpDownCounters; the rest are gauges.
_METRICS: tuple[tuple[Metric, bool, _Read], ...] = (
    (names.GPU_UTILIZATION, False, _utilization),
    (names.GPU_MEMORY_USAGE, True, _field("memory_used_bytes")),
    (names.GPU_MEMORY_LIMIT, True, _field("memory_total_bytes")),
    (names.GPU_MEMORY_UTILIZATION, False, _memory_fraction),
    (names.GPU_MEMORY_CONTROLLER_UTILIZATION, False, _field("memory_controller_utilization")),
    (names.GPU_POWER_DRAW, False, _field("power_draw_watts")),
    (names.GPU_POWER_LIMIT, False, _field("power_limit_watts")),
    (names.GPU_TEMPERATURE, False, _field("temperature_celsius")),
    (names.GPU_CLOCK_GRAPHICS, False, _field("clock_graphics_mhz")),
    (names.GPU_CLOCK_SM, False, _field("clock_sm_mhz")),
    (names.GPU_CLOCK_MEMORY, False, _field("clock_memory_mhz")),
    (names.PROCESS_GPU_MEMORY_USAGE, True, _field("process_memory_bytes")),
)


def _identity(r: GpuReading) -> _Attributes:
    """The attributes every point of this device carries: ``hw.id`` joins DCGM's ``UUID``."""
    attributes: _Attributes = {
        names.HW_ID: r.uuid,
        names.HW_NAME: r.name,
        names.HW_VENDOR: r.vendor,
        names.HW_TYPE: "gpu",
    }
    if r.parent_uuid is not None:
        attributes[names.HW_PARENT] = r.parent_uuid
        if r.gpu_instance_id is not None:
            attributes[names.GPU_MIG_INSTANCE] = r.gpu_instance_id
    return attributes


class GpuGauges:
    """The GPU instruments of one meter and the NVML sample their callbacks share."""

    def __init__(
        self,
        max_age: float,
        sampler: Callable[[], GpuSample] = nvml.sample_gpus,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_age = max_age
        self._sampler = sampler
        self._clock = clock
        self._lock = threading.Lock()
        self._identities: list[_Attributes] = []
        self._readings: tuple[GpuReading, ...] = ()
        self._taken_at: float | None = None
        self._served: set[str] = set()
        self.samples = 0  # NVML samples taken for collections
        self.last_error: str | None = None  # why the last sample lacks readings or fields
        self.instruments: tuple[object, ...] = ()

    def _current(self, metric: str) -> tuple[tuple[GpuReading, ...], list[_Attributes]]:
        with self._lock:
            now = self._clock()
            if (
                self._taken_at is None
                or metric in self._served
                or now - self._taken_at > self._max_age
            ):
                sample = self._sampler()
                self.samples += 1
                self.last_error = sample.error
                self._readings = sample.readings
                self._identities = [_identity(r) for r in sample.readings]
                self._taken_at = now
                self._served.clear()
            self._served.add(metric)
            return self._readings, self._identities

    def _callback(self, metric: str, read: _Read) -> Callable[[CallbackOptions], list[Observation]]:
        def observe(_options: CallbackOptions) -> list[Observation]:
            try:
                readings, identities = self._current(metric)
                return [
                    Observation(value, {**identity, **extra} if extra else identity)
                    for reading, identity in zip(readings, identities)
                    for value, extra in read(reading)
                ]
            except Exception as exc:
                _guard.internal_error("GPU gauges", exc)
                return []

        return observe

    def _register(self, meter: Meter) -> None:
        instruments = []
        for metric, up_down, read in _METRICS:
            create = (
                meter.create_observable_up_down_counter
                if up_down
                else meter.create_observable_gauge
            )
            instruments.append(
                create(
                    metric.name,
                    callbacks=[self._callback(metric.name, read)],
                    unit=metric.unit,
                    description=metric.description,
                )
            )
        self.instruments = tuple(instruments)


def register(meter: Meter, settings: Settings) -> GpuGauges | None:
    """Create the GPU instruments on ``meter``; None (and nothing created) without GPUs.

    Nothing is created when metrics are off, when NVML cannot be used (no ``pynvml``, no
    driver: the reason is logged once) or when it sees no GPU. Never raises.
    """
    if not settings.metrics:
        return None
    try:
        if settings.metrics == "auto" and nvml.unavailable() is not None:
            return None  # no NVIDIA GPU here, and nobody asked for its gauges: no warning
        probe = nvml.sample_gpus()  # opens this process's NVML session, kept for collections
        if not probe.readings:
            return None
        # Shorter than the interval, so each periodic collection reads NVML afresh.
        gauges = GpuGauges(max_age=settings.metrics_interval / 2)
        gauges._register(meter)
        return gauges
    except Exception as exc:
        _guard.internal_error("GPU gauges", exc)
        return None
