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
