"""Every seam of otel-gpu, as a ``typing.Protocol``: open this file to see each contract.

- :class:`Observer`: what runs on the caller's thread around each call (the crash journal, the
  watchdog, the ring, the flight recorder, NVTX ranges, the console's pre-call printing).
- :class:`Host`: what an observer (or an export-thread hook) may use of the running pipeline.
  Plugins receive a host, never the pipeline itself.
- :class:`SpanSink`: what a finished call is handed to, and what the caller's thread reads of
  it (the observers of a level, the head sampler).
- :class:`RingDump`: what the watchdog and the snapshot ask of the in-memory ring.
- :class:`ExportState`: what the metrics read of the pipeline (its counts, its provider).
- :class:`MetricsSink`: what the pipeline feeds the metrics (each chunk's calls) and closes.

Part of the core: it imports nothing of otel-gpu but ``config`` and the core's records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from otel_gpu.config import Settings
    from otel_gpu.core.plan import Plan
    from otel_gpu.core.record import Call

__all__ = ["ExportState", "Host", "MetricsSink", "Observer", "RingDump", "SpanSink"]


class Observer(Protocol):
    """What the pipeline calls. ``start``/``end`` run on the caller's thread, so they stay cheap.

    While ``start``/``end`` run, ``call.bound`` holds the bound arguments and ``call.result``
    the return value; both are cleared before the record is queued. ``call.stats`` is read at
    ``end``: at ``start`` it holds the statistics still being computed.
    """

    min_level: int
    """The lowest level served, set from the registry when the observer is built."""

    def start(self, call: Call) -> None: ...

    def end(self, call: Call) -> None: ...

    def flush(self, timeout: float) -> bool:
        """Finish queued work within ``timeout`` seconds; True when it did."""
        ...

    def close(self) -> None: ...


class RingDump(Protocol):
    """The in-memory ring of the last calls, as the watchdog and the snapshot use it."""

    def dump_for(self, call: Call, reason: str) -> str | None:
        """Write the ring and ``call`` (in flight); the dump's directory, or None."""
        ...

    def dump(self, reason: str, trigger: Any, result: Any = None) -> str | None:
        """Write the ring's calls (and ``trigger``, None for none); the directory, or None."""
        ...

    def dump_call(self, call: Call, reason: str) -> str | None:
        """Write the ring with ``call`` (ended) as the trigger, as ``OTEL_GPU_ON_NONFINITE=dump``
        does (the triggers' dumps); the directory, or None."""
        ...


class Host(Protocol):
    """What an observer may use of the running pipeline.

    ``resource`` and ``processor`` are the target provider's; the pipeline is complete (provider,
    resource, processor) before any observer is built.
    """

    @property
    def settings(self) -> Settings: ...

    @property
    def resource(self) -> Any:
        """The provider's ``Resource`` (its ``attributes`` describe the process)."""
        ...

    @property
    def processor(self) -> Any:
        """The provider's span processor: where recovered spans go."""
        ...

    @property
    def ring(self) -> RingDump | None:
        """The in-memory ring, when ``OTEL_GPU_RING`` (or ``OTEL_GPU_ON_NONFINITE=dump``) asks
        for one."""
        ...

    @property
    def owns_provider(self) -> bool:
        """Whether spans go to otel-gpu's own provider, not the application's."""
        ...

    def add_after_drain(self, hook: Callable[[], Any]) -> None:
        """Run ``hook`` on the export thread after each drain (every ~100 ms)."""
        ...

    def export_now(self, call: Call, timeout: float | None = None) -> None:
        """Build and export one record now, flushed (a report that must not wait in a batch)."""
        ...

    def report_internal(self, kind: str, exc: BaseException) -> None:
        """An internal error on the export thread: logged once per kind (kept for the next
        flush to raise in strict mode), never the program's."""
        ...


class SpanSink(Protocol):
    """What the caller's thread hands a finished call to (the pipeline's queue)."""

    @property
    def observers_at(self) -> Mapping[int, tuple[Observer, ...]]:
        """The observers of each level, decided once: a call iterates its level's tuple."""
        ...

    @property
    def root_sampler(self) -> Callable[[int, str], bool] | None:
        """The decision for calls with no parent; None means always sample."""
        ...

    @property
    def metrics(self) -> Any:
        """The call metrics (``OTEL_GPU_METRICS``), or None."""
        ...

    @property
    def device_time(self) -> Any:
        """The device-time recorder (:mod:`otel_gpu.devices.device_time`), or None where calls
        are not timed on the device."""
        ...

    def submit(self, call: Call) -> None:
        """Queue a finished call (never blocks beyond the queue's back-pressure)."""
        ...

    def add_before_flush(self, hook: Callable[[float], Any]) -> None:
        """Have every flush and the exit first call ``hook(timeout)``, which waits for calls
        still on their way to :meth:`submit` (read off the caller's thread)."""
        ...

    def note_unsampled(self, plan: Plan, duration_ns: int, failed: Any) -> None:
        """A call the head sampler dropped, for the call metrics."""
        ...

    def report_internal(self, kind: str, exc: BaseException) -> None:
        """An internal error off the caller's thread (see :meth:`Host.report_internal`)."""
        ...


class ExportState(Protocol):
    """What otel-gpu's metrics read of the pipeline: its own counters and its provider."""

    @property
    def exported(self) -> int:
        """Spans handed to the processors."""
        ...

    @property
    def dropped(self) -> int:
        """Calls never exported: the queue was full, or export stalled."""
        ...

    @property
    def stalled(self) -> int:
        """Of the dropped calls, those dropped because export made no progress."""
        ...

    @property
    def maxsize(self) -> int:
        """The queue's bound (``OTEL_GPU_QUEUE_SIZE``)."""
        ...

    @property
    def queue(self) -> Sized:
        """The calls waiting for export."""
        ...

    @property
    def observers(self) -> tuple[Observer, ...]: ...

    @property
    def counters(self) -> Sequence[Any]:
        """otel-gpu's own destinations' exporters, each counting the spans it confirmed."""
        ...

    @property
    def provider(self) -> Any:
        """The target ``TracerProvider`` (its ``resource`` is the metrics' resource too)."""
        ...

    @property
    def owns_provider(self) -> bool: ...


class MetricsSink(Protocol):
    """The metrics beside the spans (``OTEL_GPU_METRICS``), as the pipeline drives them."""

    @property
    def calls(self) -> Any:
        """The call metrics: ``record(calls)`` per chunk, ``record_unsampled(deque)``."""
        ...

    def flush(self, timeout: float) -> bool: ...

    def shutdown(self, timeout: float) -> None: ...
