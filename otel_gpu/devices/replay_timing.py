"""Device time of CUDA-graph replays: two timing events around each replay, read by the reader
thread of :mod:`otel_gpu.devices.cuda_graphs` after the replay's copy completed.

Events go through :mod:`otel_gpu.devices.events` (the fake in tests) and are reused: each graph
keeps the pairs not being read, at most one per replay queued for its reader. Only when device
time is on in the process's pipeline (``OTEL_GPU_DEVICE_TIME``, see devices/device_time.py).
Per captured call inside a graph nothing is timed: events recorded during a capture would need
``cudaEventRecordWithFlags(..., cudaEventRecordExternal)``, which torch does not expose.
"""

from __future__ import annotations

from typing import Any

__all__ = ["end", "give_back", "seconds", "start"]

_MAX_TIMERS = 8  # pairs per graph: above the reader's buffers in flight, never per replay


def start(timers: list[list[Any]]) -> list[Any] | None:
    """Record a start event before a replay on the current stream; None when device time is off
    (or every pair of the graph is being read)."""
    from otel_gpu.core import sink

    device = getattr(sink.current(), "device_time", None)
    if device is None or not (device.live or device._go_live()):
        return None
    backend = device.backend
    try:
        timer = timers.pop()
    except IndexError:
        if len(timers) >= _MAX_TIMERS:
            return None
        timer = [backend, backend.new_event(), backend.new_event(), None]
    where = backend.stream()
    if where is None:
        timers.append(timer)
        return None
    timer[3] = where[0]
    backend.record(timer[1], where[0])
    return timer


def end(timer: list[Any] | None) -> None:
    """Record the end event right after the replay was enqueued."""
    if timer is not None:
        timer[0].record(timer[2], timer[3])


def give_back(timers: list[list[Any]], timer: list[Any] | None) -> None:
    if timer is not None:
        timer[3] = None
        timers.append(timer)


def seconds(timers: list[list[Any]], timer: list[Any] | None) -> float | None:
    """The replay's device time (reader thread, after its copy completed), and the pair back;
    None when it was not timed or its events did not complete."""
    if timer is None:
        return None
    backend = timer[0]
    try:
        if not (backend.query(timer[1]) and backend.query(timer[2])):
            return None
        return float(backend.elapsed_ms(timer[1], timer[2])) / 1e3
    except Exception:  # a CUDA error: the replay's spans go out without device time
        return None
    finally:
        give_back(timers, timer)
