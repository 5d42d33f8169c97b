"""Level-5 statistics read off the caller's thread (``OTEL_GPU_STATS_READ=async``, the default).

At level 5 a call's statistics are reductions launched on the device; reading them back is a
host synchronisation, which costs the caller the time for its stream to drain (on a busy GPU,
every queued kernel). Where every vector is on a CUDA device and the non-finite policy is
``mark`` (nothing on the caller's thread depends on the values), the caller only queues a
non-blocking copy into page-locked memory and an event (:func:`otel_gpu.devices.cuda.read_later`)
and hands the call here instead of to the pipeline. A reader thread (``otel-gpu-stats``) waits
for each event (``cudaEventSynchronize``, without the GIL), completes the statistics exactly as
the caller would have (:func:`otel_gpu.calls.stats.complete`), runs the NaN/Inf or precise pass
on the call's stream where one is needed (:func:`otel_gpu.calls.stats.refine_on`), then queues
the call to the pipeline. The pipeline's flush and exit wait for it first, so nothing is lost.

Memory: a call waiting here holds its statistic vectors and, for that pass, its tensors; at
most ``_QUEUE`` calls wait, and a call that finds the queue full is read on the caller's thread,
as with ``OTEL_GPU_STATS_READ=sync``. Policies that decide on the caller's thread (``error``,
``dump``, ``raise``), non-finite triggers, and level 10 read on the caller's thread.
"""

from __future__ import annotations

import weakref
from typing import Any

from otel_gpu.core.protocols import SpanSink
from otel_gpu.core.record import Call
from otel_gpu.core.threads import JobThread
from otel_gpu.devices import cuda

from . import stats

__all__ = ["flush", "require_on_caller", "submit", "wanted_on_caller"]

_QUEUE = 64  # calls whose statistics may wait at once (bounds the tensors held for them)

wanted_on_caller = False
"""True while something reads a call's statistics on the caller's thread (a non-finite trigger,
:func:`require_on_caller`): calls then read them there, as with ``OTEL_GPU_STATS_READ=sync``."""


def require_on_caller(wanted: bool) -> None:
    """Say whether an observer needs each call's statistics when its ``end`` runs on the
    caller's thread (the triggers, while a non-finite rule is in force)."""
    global wanted_on_caller
    wanted_on_caller = wanted


class _Job:
    __slots__ = ("call", "live", "pending", "pipe", "read")

    def __init__(
        self, call: Call, pipe: SpanSink, pending: list, live: list, read: cuda.Read
    ) -> None:
        self.call, self.pipe, self.pending, self.live, self.read = call, pipe, pending, live, read


def _read(job: _Job) -> None:
    try:
        _complete(job)
    except Exception as exc:  # strict mode: kept for the pipeline's flush to raise
        job.pipe.report_internal("statistics", exc)
        job.call.stats = None
        job.pipe.submit(job.call)


def _complete(job: _Job) -> None:
    read = job.read
    cuda.wait_copy(read.event)  # cudaEventSynchronize: this thread waits, without the GIL
    rows = cuda.read_rows(read)
    job.call.stats = stats.complete(job.pending, job.live, rows, stats.refine_on(read.stream))
    job.pipe.submit(job.call)


_hooked: weakref.WeakSet[Any] = weakref.WeakSet()  # pipelines whose flush waits for the reader


def _hook(job: _Job) -> None:  # under the queue's lock, once queued
    if job.pipe not in _hooked:  # by identity of a live pipeline: a new one is never taken for it
        _hooked.add(job.pipe)
        job.pipe.add_before_flush(_reader.flush)


_reader: JobThread[_Job] = JobThread("otel-gpu-stats", _QUEUE, _read, on_put=_hook)


def submit(call: Call, pipe: SpanSink, pending: list, read: cuda.Read) -> None:
    """Hand ``call``, whose statistics ``read`` is bringing back, to the reader thread, which
    queues it to ``pipe`` once they are complete. With the reader's queue full, they are read
    and completed here, on the caller's thread, and the call is queued at once."""
    live = [p for p in pending if p.vec is not None]
    if _reader.put(_Job(call, pipe, pending, live, read)):
        return
    cuda.wait_copy(read.event)  # the queue is full: back-pressure, as a synchronous read
    call.stats = stats.complete(pending, live, cuda.read_rows(read), stats.refine_on(read.stream))
    pipe.submit(call)


def flush(timeout: float = 10.0) -> bool:
    """Wait until every call handed to the reader has been queued to its pipeline."""
    return _reader.flush(timeout)
