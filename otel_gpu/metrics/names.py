"""Every metric otel-gpu emits: name, unit and the attribute keys of its points.

A stable public contract, like the span attribute keys of :mod:`otel_gpu.attributes`: dashboards,
alerts and collector configs are written against these names. docs/metrics.md documents each,
and ``tests/test_metrics_names.py`` checks both directions. A Prometheus backend shows them
translated by the collector's usual rules: dots become underscores, the unit is appended
(``_seconds``, ``_bytes``, ``_ratio``) and counters end in ``_total``.
"""

from __future__ import annotations

from typing import NamedTuple

from otel_gpu.attributes import CODE_FUNCTION_NAME
from otel_gpu.attributes import COMPONENT_TYPE as COMPONENT_TYPE  # otel_gpu_queue
from otel_gpu.attributes import ERROR_TYPE as ERROR_TYPE  # see below

__all__ = ["Metric"]

METER = "otel_gpu"  # the instrumentation scope of every metric


class Metric(NamedTuple):
    name: str
    unit: str
    description: str


# --- Call metrics (metrics/calls.py), every decorated call at level >= 1 ---
CALL_DURATION = Metric(
    "otel_gpu.call.duration",
    "s",
    "Duration of decorated calls, as the span's (host wall-clock, call start to return).",
)
CALL_DEVICE_DURATION = Metric(
    "otel_gpu.call.device.duration",
    "s",
    "GPU time of decorated calls (otel_gpu.device.duration on the span): from the call's first "
    "to its last work on the device stream, for the calls whose device time was measured.",
)
CALLS = Metric("otel_gpu.calls", "{call}", "Decorated calls that ended (returned or raised).")
CALL_ERRORS = Metric("otel_gpu.call.errors", "{call}", "Decorated calls that raised.")
CALL_NONFINITE = Metric(
    "otel_gpu.call.nonfinite",
    "{call}",
    "Decorated calls with a NaN or Inf in an input or output tensor (level >= 5).",
)

# Explicit histogram boundaries, in seconds: 1-2.5-5 steps from 1 µs to 10 s, for kernel calls
# from microseconds (a launch) to seconds (a whole forward). The SDK's default boundaries are
# milliseconds-sized (0, 5, 10, 25 ... 10000) and would put every kernel call in one bucket.
DURATION_BUCKETS: tuple[float, ...] = (
    0.000001, 0.0000025, 0.000005,
    0.00001, 0.000025, 0.00005,
    0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

# --- Attribute keys of call-metric points ---
FUNCTION = CODE_FUNCTION_NAME  # <module>.<qualname>, as on the span
# ERROR_TYPE ("error.type"): the exception's <module>.<qualname> (failed calls only)

# --- GPU gauges (metrics/gpu.py), read through NVML at each collection ---
# The OTel hardware conventions' names (hw.gpu.*, status Development) where they define one; power,
# temperature and clocks under the names OpenLIT's GPU collector documents (extensions). The
# conventions make hw.gpu.memory.usage and .limit UpDownCounters: they are asynchronous
# up-down counters here, the other GPU metrics asynchronous gauges.
GPU_UTILIZATION = Metric(
    "hw.gpu.utilization",
    "1",
    "Fraction of time the GPU spent on a task (hw.gpu.task) over NVML's last sample period.",
)
GPU_MEMORY_USAGE = Metric("hw.gpu.memory.usage", "By", "GPU memory used.")
GPU_MEMORY_LIMIT = Metric("hw.gpu.memory.limit", "By", "Size of the GPU memory.")
GPU_MEMORY_UTILIZATION = Metric(
    "hw.gpu.memory.utilization", "1", "Fraction of GPU memory used (usage / limit)."
)
GPU_MEMORY_CONTROLLER_UTILIZATION = Metric(
    "hw.gpu.memory.controller.utilization",
    "1",
    "Fraction of time the GPU memory was read or written (NVML's memory utilization).",
)  # extension (OpenLIT)
GPU_POWER_DRAW = Metric("hw.gpu.power.draw", "W", "GPU power draw.")  # extension (OpenLIT)
GPU_POWER_LIMIT = Metric(
    "hw.gpu.power.limit", "W", "GPU power limit the driver enforces."
)  # extension (OpenLIT)
GPU_TEMPERATURE = Metric("hw.gpu.temperature", "Cel", "GPU die temperature.")  # ext. (OpenLIT)
GPU_CLOCK_GRAPHICS = Metric(
    "hw.gpu.clock.graphics", "MHz", "GPU graphics clock frequency."
)  # extension (OpenLIT)
GPU_CLOCK_SM = Metric(
    "hw.gpu.clock.sm", "MHz", "GPU SM clock frequency."
)  # extension (otel-gpu, beside OpenLIT's clocks)
GPU_CLOCK_MEMORY = Metric(
    "hw.gpu.clock.memory", "MHz", "GPU memory clock frequency."
)  # extension (OpenLIT)
PROCESS_GPU_MEMORY_USAGE = Metric(
    "process.gpu.memory.usage",
    "By",
    "GPU memory used by this process, as NVML lists its compute processes.",
)  # extension: process.memory.usage's pattern on the GPU; OpenLIT's collector uses the name

# --- Attribute keys of GPU points ---
HW_ID = "hw.id"  # the GPU's UUID ("GPU-..."), a MIG device's UUID ("MIG-...")
HW_NAME = "hw.name"  # NVML's product name
HW_VENDOR = "hw.vendor"  # "NVIDIA"
HW_TYPE = "hw.type"  # always "gpu", as the conventions require for hw.* metrics of a GPU
HW_PARENT = "hw.parent"  # MIG devices only: the UUID of the GPU they partition
HW_GPU_TASK = "hw.gpu.task"  # hw.gpu.utilization only: "general", "encoder", "decoder"
GPU_MIG_INSTANCE = "otel_gpu.gpu.mig.gpu_instance_id"  # MIG devices only: DCGM's GPU_I_ID

# --- otel-gpu's own metrics (metrics/own.py), under the SDK's self-observability names ---
SPANS_PROCESSED = Metric(
    "otel.sdk.processor.span.processed",
    "{span}",
    "Calls otel-gpu's queue handed to the span processors as spans (no error.type), or dropped "
    "(error.type queue_full or export_stalled).",
)
QUEUE_SIZE = Metric(
    "otel.sdk.processor.span.queue.size", "{span}", "Calls waiting in otel-gpu's queue."
)
QUEUE_CAPACITY = Metric(
    "otel.sdk.processor.span.queue.capacity",
    "{span}",
    "The most calls otel-gpu's queue holds (OTEL_GPU_QUEUE_SIZE).",
)
JOURNAL_WRITTEN = Metric(
    "otel_gpu.journal.written",
    "By",
    "Bytes of call records the crash journal wrote into its memory-mapped file.",
)
RECORDER_WRITTEN = Metric(
    "otel_gpu.recorder.written",
    "By",
    "Bytes of flight-recorder dumps written: tensor files and manifests (also the ring's and "
    "CUDA-graph snapshots' dumps).",
)

# --- Attribute keys of otel-gpu's own metrics ---
COMPONENT_NAME = "otel.component.name"  # otel_gpu_queue/0
COMPONENT_TYPE_QUEUE = "otel_gpu_queue"  # the value of COMPONENT_TYPE, as on the drop events
