"""Memory per call (level >= 3 where CUDA is available): the caching allocator around a call.

The decorator decides at decoration whether a function's calls read the allocator at all
(level >= 3 and ``cuda.cuda_available()``): on a machine without CUDA nothing here runs. Where
it does, :func:`begin` reads the allocator's allocated bytes and their high-water mark just
before the call runs and :func:`end` just after, both on the caller's thread, on the device
current when the call started. Reading them synchronises nothing (host counters), so the
program's timing and results are unchanged; the program's own peak statistics are never reset.

What the attributes claim (docs/attributes.md, "Memory per call"):

Which calls read: by default (``OTEL_GPU_DEVICE_MEMORY_CALLS=outermost``) only a call not
nested in another decorated call of its thread or task, so an instrumented module tree pays two
readings a forward, not two per module; ``all``: every call, as described below for nested ones.

* ``otel_gpu.device.memory.allocated_delta``: allocated bytes after the call minus before, on
  that device: what the call left allocated (its outputs, caches it filled), negative when it
  freed more than it kept. Every allocation of the process on that device in that interval
  counts, another thread's too.
* ``otel_gpu.device.memory.peak``: only on a call not nested in another decorated call, and only
  when the allocator's high-water mark of allocated bytes rose during the call: then the new
  high-water mark was reached during the call, and it is the most bytes allocated on the device
  at any moment of the call (everything allocated before it included). When the mark did not
  rise, the call stayed at or under the earlier mark and nothing more is known without
  resetting the program's peak statistics: no attribute, rather than a number that would claim
  more.
* on a call that raised an out-of-memory error, the allocator's state then
  (:func:`otel_gpu.devices.memory.summary`).
"""

from __future__ import annotations

from contextvars import ContextVar, Token

from otel_gpu.attributes import MEMORY_ALLOCATED_DELTA, MEMORY_PEAK, MEMORY_PREFIX
from otel_gpu.core.record import Call
from otel_gpu.devices import memory as devices

__all__ = ["NESTED", "Reading", "begin", "end"]

_inside: ContextVar[bool] = ContextVar("otel_gpu_memory_inside", default=False)
"""True while a decorated call of this context (thread, task) is reading memory: a call that
starts then is nested, and gets no peak (its outermost caller's covers it)."""


class Reading:
    """The allocator's counters when a call started. ``device`` None: CUDA was not initialised
    then, so nothing was allocated on any GPU yet."""

    __slots__ = ("allocated", "device", "peak", "token")

    def __init__(
        self, device: int | None, allocated: int, peak: int, token: Token[bool] | None
    ) -> None:
        self.device = device
        self.allocated = allocated
        self.peak = peak
        self.token = token  # set on the outermost call: it resets the nesting mark at its end


NESTED = Reading(None, 0, 0, None)
"""What :func:`begin` returns for a nested call when only outermost calls read memory
(``OTEL_GPU_DEVICE_MEMORY_CALLS=outermost``): nothing was read, nothing will be but an
out-of-memory summary."""


def begin(every: bool = True) -> Reading:
    """Read the allocator just before a call runs (caller's thread). ``every`` False: a call
    nested in another that reads memory reads nothing (:data:`NESTED`)."""
    outer = not _inside.get()
    if not outer and not every:
        return NESTED  # hot path: one context-variable read; the allocator's reads cost ~11 µs
    device: int | None = None
    allocated = peak = 0
    if devices.initialized():
        device = index = devices.current_device()
        allocated, peak = devices.counters(index)
    # marked last: a reading that raised leaves no mark behind
    return Reading(device, allocated, peak, _inside.set(True) if outer else None)


def end(call: Call, reading: Reading | None) -> None:
    """Read the allocator just after the call and put what it says on the call's span.

    ``reading`` None: :func:`begin` did not run or failed; only an out-of-memory summary can be
    said then."""
    attrs: dict[str, int] = {}
    device: int | None = None
    if reading is NESTED:
        exc = call.exc
        if exc is not None and isinstance(exc, devices.OUT_OF_MEMORY) and devices.initialized():
            device = devices.current_device()
            call.span.set_attributes(
                {MEMORY_PREFIX + k: v for k, v in devices.summary(device).items()}
            )
        return
    try:
        if devices.initialized():
            # reading.device None: the call initialised CUDA, it began with nothing allocated
            known = None if reading is None else reading.device
            device = devices.current_device() if known is None else known
            if reading is not None:
                allocated, peak = devices.counters(device)
                attrs[MEMORY_ALLOCATED_DELTA] = allocated - reading.allocated
                if reading.token is not None and peak > reading.peak:
                    attrs[MEMORY_PEAK] = peak
    finally:
        if reading is not None and reading.token is not None:
            try:
                _inside.reset(reading.token)
            except ValueError:  # ended in another context than it began: leave it as it is
                pass
    exc = call.exc
    if exc is not None and device is not None and isinstance(exc, devices.OUT_OF_MEMORY):
        for key, value in devices.summary(device).items():
            attrs[MEMORY_PREFIX + key] = value
    if attrs:
        call.span.set_attributes(attrs)
