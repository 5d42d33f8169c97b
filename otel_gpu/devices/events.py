"""CUDA timing events: the seam device time goes through, and the fake that tests drive.

Every CUDA touch of device time (:mod:`otel_gpu.devices.device_time`) is one of the methods of
:class:`EventBackend`: which stream is current, record an event on it, ask whether an event has
completed, the time between two completed events, and a reference event for mapping device
times to the host clock. :class:`CudaEvents` does it with ``torch.cuda``; :class:`FakeEvents`
does it with plain objects whose completion and device time a test sets, so the whole of
device time (resolution order, timeouts, the fault suspect) runs on a CPU-only machine.

Nothing here waits on the caller's thread: ``record`` and ``query`` never block
(``cudaEventRecord``, ``cudaEventQuery``); only :meth:`EventBackend.reference`, called by the
resolver off the caller's thread, polls one event of its own until a deadline.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Protocol

__all__ = [
    "CudaEvents",
    "EventBackend",
    "FakeEvent",
    "FakeEvents",
    "backend",
    "is_cuda_error",
    "use",
]


class EventBackend(Protocol):
    """What device time asks of CUDA. ``record``/``stream`` run on the caller's thread."""

    def ready(self) -> bool:
        """CUDA is initialised in this process (and not a child forked after it was)."""
        ...

    def stream(self) -> tuple[Any, int | str, int] | None:
        """``(stream, its id, device index)`` of the current stream; None while it captures a
        CUDA graph (a timing event cannot be recorded into a capture)."""
        ...

    def new_event(self) -> Any:
        """A timing event (called when the pool grows, never per call)."""
        ...

    def record(self, event: Any, stream: Any) -> None:
        """Enqueue ``event`` on ``stream``; returns at once."""
        ...

    def query(self, event: Any) -> bool:
        """Whether ``event`` has completed; never blocks. Raises on a CUDA error."""
        ...

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end``, both completed, on one device."""
        ...

    def reference(self, device: int, timeout: float) -> tuple[int, Any] | None:
        """``(host time ns, event)``: an event that ran on ``device`` at that host time, within
        the returned uncertainty; None if it did not complete within ``timeout`` s."""
        ...


_FAULT_WORDS = (
    "device-side assert",
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "hardware stack error",
    "invalid program counter",
    "CUDA_ERROR_ILLEGAL",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_ASSERT",
)


def is_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` reports a sticky CUDA fault of a kernel (illegal address, device-side
    assert, launch failure, misaligned address, illegal instruction): a ``RuntimeError``
    (``torch.AcceleratorError`` is one) whose message says so. Other CUDA errors (an invalid
    argument, out of memory) leave the context usable and blame no kernel."""
    try:
        if not isinstance(exc, RuntimeError):
            return False
        text = str(exc)
    except BaseException:  # a hostile __str__ is not a CUDA error
        return False
    return any(word in text for word in _FAULT_WORDS)


class CudaEvents:
    """:class:`EventBackend` over ``torch.cuda`` (unverified where docs/gpu.md says so).

    What a call costs the caller's thread (``stream`` once, ``record`` twice), each a C getter
    of torch's, never a Python stream object: ``torch._C._cuda_isCurrentStreamCapturing()``
    (the capture query: an event recorded into someone's graph capture would change their
    graph, so it is asked per call, ~0.1 µs), ``torch._C._cuda_getDevice()``,
    ``torch._C._cuda_getCurrentRawStream(device)`` (the stream's handle, ~0.2 µs against
    ~4.4 µs for ``torch.cuda.current_stream()``, pytorch PRs #78066/#78165), and
    ``torch._C._CudaEventBase.record(event, stream)`` (``cudaEventRecord`` without
    ``torch.cuda.Event.record``'s Python frame). ``torch.cuda.current_stream()`` runs only the
    first time a handle is seen: its stream object is kept, keyed by handle. A stream destroyed
    and another created at the same handle (only a user's ``ExternalStream`` can do that) keeps
    the first one's ``stream_id`` until the cache is cleared (``_MAX_STREAMS``); the events are
    still recorded on the right CUDA stream, since a stream object records by its handle.
    ``torch_module`` replaces ``torch`` (tests: a counting stand-in)."""

    def __init__(self, torch_module: Any = None) -> None:
        if torch_module is None:
            import torch as torch_module
        cuda = self._cuda = torch_module.cuda
        native = torch_module._C
        self._streams: dict[int, Any] = {}  # device -> a stream of our own for reference events
        self._known: dict[int, tuple[Any, int | str, int]] = {}  # raw handle -> stream, id, device
        self._refs: dict[int, list[Any]] = {}  # device -> reference events, reused
        # C getters where this torch has them, else the public (slower) ones
        self._capturing = getattr(
            native, "_cuda_isCurrentStreamCapturing", cuda.is_current_stream_capturing
        )
        self._device = getattr(native, "_cuda_getDevice", cuda.current_device)
        self._raw = getattr(native, "_cuda_getCurrentRawStream", None)
        base = getattr(native, "_CudaEventBase", None)
        self._record = getattr(base, "record", None) if base is not None else None

    def ready(self) -> bool:
        try:
            return bool(self._cuda.is_initialized())  # False in a child forked after init
        except Exception:
            return False

    def stream(self) -> tuple[Any, int | str, int] | None:
        # Hot path (every call): three C getters and a dict lookup, no Python stream object.
        if self._capturing():
            return None
        raw = self._raw
        if raw is None:  # a torch without the raw getter: the public, slower path
            s = self._cuda.current_stream()
            return s, s.stream_id, s.device_index
        device = self._device()
        handle = raw(device)
        known = self._known.get(handle)
        if known is None:
            if len(self._known) >= _MAX_STREAMS:
                self._known.clear()
            s = self._cuda.current_stream(device)
            known = self._known[handle] = (s, s.stream_id, s.device_index)
        return known

    def new_event(self) -> Any:
        return self._cuda.Event(enable_timing=True)

    def record(self, event: Any, stream: Any) -> None:
        record = self._record
        if record is None:
            event.record(stream)
        else:
            record(event, stream)  # cudaEventRecord, without Event.record's Python frame

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def reference(self, device: int, timeout: float) -> tuple[int, Any] | None:
        cuda = self._cuda
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = cuda.Stream(device=device, priority=-1)
        # two events per device, used in turn: the caller keeps the latest reference and the
        # one before it (devices/device_time.py), so the third record may reuse the first
        refs = self._refs.setdefault(device, [])
        if len(refs) < 3:
            refs.append(cuda.Event(enable_timing=True))
        event = refs.pop(0)
        refs.append(event)
        before = time.time_ns()
        self.record(event, stream)  # an idle stream of our own: it runs at once
        deadline = time.monotonic() + timeout
        while not event.query():  # polled, not synchronised: a hung device ends the wait
            if time.monotonic() > deadline:
                return None
            # a short sleep, not sleep(0): each wake takes the GIL from a caller launching
            # kernels, and the event needs only microseconds on a stream of its own
            time.sleep(_POLL)
        after = time.time_ns()
        return (before + after) // 2, event


_MAX_STREAMS = 256  # stream handles remembered (a program uses a few)
_POLL = 20e-6  # seconds between polls of a reference event


class FakeEvent:
    """A timing event whose completion and device time (``time_ms``) the test sets."""

    __slots__ = ("done", "recorded", "seq", "stream", "time_ms")

    def __init__(self) -> None:
        self.done = False
        self.time_ms: float | None = None
        self.recorded = 0  # how many times it was recorded (a reused event counts each)
        self.stream: Any = None
        self.seq = 0  # the order of its latest record, over all fake events


class FakeEvents:
    """:class:`EventBackend` for tests: nothing touches CUDA.

    ``recorded`` lists events in the order they were recorded (with reuse). The test completes
    an event by setting ``done`` and ``time_ms``, or with :meth:`complete`; :meth:`fail` makes
    every later query raise as a sticky CUDA error does. ``skew_ms`` is the device clock minus the
    host clock, in ms, as the reference event reports it. ``records`` counts calls of
    :meth:`record` from any thread; ``capturing`` makes :meth:`stream` say a capture runs.
    """

    def __init__(self, *, initialised: bool = True, skew_ms: float = 1000.0) -> None:
        self.initialised = initialised
        self.skew_ms = skew_ms
        self.current: int | str = 7  # the current stream's id
        self.device = 0
        self.capturing = False
        self.created = 0
        self.records = 0
        self.recorded: list[FakeEvent] = []
        self.error: str | None = None
        self.queries = 0
        self._seq = itertools.count(1)

    def ready(self) -> bool:
        return self.initialised

    def stream(self) -> tuple[Any, int | str, int] | None:
        if self.capturing:
            return None
        return self.current, self.current, self.device

    def new_event(self) -> FakeEvent:
        self.created += 1
        return FakeEvent()

    def record(self, event: FakeEvent, stream: Any) -> None:
        self.records += 1
        event.done = False
        event.time_ms = None
        event.recorded += 1
        event.stream = stream
        event.seq = next(self._seq)
        self.recorded.append(event)

    def query(self, event: FakeEvent) -> bool:
        self.queries += 1
        if self.error is not None:
            raise RuntimeError(f"CUDA error: {self.error}")
        return event.done

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        if self.error is not None:
            raise RuntimeError(f"CUDA error: {self.error}")
        if start.time_ms is None or end.time_ms is None or not (start.done and end.done):
            raise RuntimeError("elapsed time of an event that has not completed")
        if end.time_ms < start.time_ms:  # not relied on: device time measures forwards
            raise RuntimeError("elapsed time backwards: the end event ran before the start")
        return end.time_ms - start.time_ms

    def reference(self, device: int, timeout: float) -> tuple[int, Any] | None:
        if self.error is not None:
            raise RuntimeError(f"CUDA error: {self.error}")
        host = time.time_ns()
        event = FakeEvent()
        event.done = True
        event.time_ms = host / 1e6 + self.skew_ms
        return host, event

    # ---------------------------------------------------------------- what tests call

    def complete(self, event: FakeEvent, host_ns: int, offset_ms: float = 0.0) -> None:
        """Complete ``event`` as if the device reached it at host time ``host_ns`` + ``offset_ms``."""
        event.time_ms = host_ns / 1e6 + offset_ms + self.skew_ms
        event.done = True

    def fail(self, message: str = "an illegal memory access was encountered") -> None:
        """A sticky CUDA error: every later query and elapsed time raises."""
        self.error = message


_backend: EventBackend | None = None
_chosen = False


def use(chosen: EventBackend | None) -> None:
    """Make ``chosen`` the backend device time uses from the next pipeline on (tests: a
    :class:`FakeEvents`); None goes back to choosing :class:`CudaEvents` where CUDA exists."""
    global _backend, _chosen
    _backend, _chosen = chosen, chosen is not None


def backend() -> EventBackend | None:
    """The backend in force: the one given to :func:`use`, else :class:`CudaEvents` when CUDA is
    available (without creating a context), else None (a CPU-only machine)."""
    global _backend
    if _chosen or _backend is not None:
        return _backend
    from otel_gpu.devices import cuda

    if cuda.cuda_available():
        _backend = CudaEvents()
    return _backend


def why_not() -> str | None:
    """Why calls carry no device time in this process at all, or None when they may."""
    if _chosen:
        return None
    from otel_gpu.devices import cuda

    if not cuda.cuda_available():
        return "no CUDA device is available to this process (torch.cuda.is_available() is false)"
    return None
