"""otel-gpu's own metrics: what its export pipeline, journal and flight recorder did.

Read at each collection from counters the pipeline and the observers keep anyway, so they cost
nothing per call. The span-processor metrics use the names of the OpenTelemetry SDK's own
self-observability conventions (``otel.sdk.processor.span.*``), with ``otel.component.type``
``otel_gpu_queue`` (the same value as the drop events on spans), so a dashboard built for the
SDK's processors shows otel-gpu's queue beside them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Observation

from otel_gpu import _files
from otel_gpu.metrics.names import (
    COMPONENT_NAME,
    COMPONENT_TYPE,
    COMPONENT_TYPE_QUEUE,
    ERROR_TYPE,
    JOURNAL_WRITTEN,
    QUEUE_CAPACITY,
    QUEUE_SIZE,
    RECORDER_WRITTEN,
    SPANS_PROCESSED,
)

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter

    from otel_gpu.core.protocols import ExportState

__all__ = ["register"]

_COMPONENT = {COMPONENT_TYPE: COMPONENT_TYPE_QUEUE, COMPONENT_NAME: "otel_gpu_queue/0"}
_QUEUE_FULL = {**_COMPONENT, ERROR_TYPE: "queue_full"}
_STALLED = {**_COMPONENT, ERROR_TYPE: "export_stalled"}


def register(meter: Meter, pipeline: ExportState) -> None:
    """Create the observable instruments over ``pipeline`` (held weakly: a pipeline replaced by
    ``configure()`` reports nothing more)."""
    ref = weakref.ref(pipeline)

    def processed(options: CallbackOptions) -> Iterable[Observation]:
        pipe = ref()
        if pipe is None:
            return ()
        stalled = pipe.stalled
        return (
            Observation(pipe.exported, _COMPONENT),
            Observation(pipe.dropped - stalled, _QUEUE_FULL),
            Observation(stalled, _STALLED),
        )

    def size(options: CallbackOptions) -> Iterable[Observation]:
        pipe = ref()
        return () if pipe is None else (Observation(len(pipe.queue), _COMPONENT),)

    def capacity(options: CallbackOptions) -> Iterable[Observation]:
        pipe = ref()
        return () if pipe is None else (Observation(pipe.maxsize, _COMPONENT),)

    def journal_written(options: CallbackOptions) -> Iterable[Observation]:
        pipe = ref()
        if pipe is None:
            return ()
        from otel_gpu.journal.writer import Journal

        journals = [o for o in pipe.observers if isinstance(o, Journal)]
        # no journal (OTEL_GPU_JOURNAL=false, or it could not be created): no point, not a 0
        return (Observation(sum(j.bytes_written for j in journals)),) if journals else ()

    def recorder_written(options: CallbackOptions) -> Iterable[Observation]:
        return (Observation(_files.bytes_written()),)

    counter, gauge = meter.create_observable_counter, meter.create_observable_up_down_counter
    for create, metric, callback in (
        (counter, SPANS_PROCESSED, processed),
        (gauge, QUEUE_SIZE, size),
        (gauge, QUEUE_CAPACITY, capacity),
        (counter, JOURNAL_WRITTEN, journal_written),
        (counter, RECORDER_WRITTEN, recorder_written),
    ):
        create(metric.name, callbacks=[callback], unit=metric.unit, description=metric.description)
