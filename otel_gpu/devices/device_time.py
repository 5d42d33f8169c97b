"""Device time: two timing events around each call, resolved off the caller's thread.

On the caller's thread (an observer, :data:`otel_gpu.export.observers.REGISTRY`): ``start``
takes a pair of events from a pool and records the first on the current stream right before
the call runs; ``end`` (or :func:`stop`, called before level-5 statistics kernels are
launched) records the second right after it returns or raises. Nothing waits: recording is an
enqueue, and a call that finds the pool empty goes without device time, counted.

On the export thread (:meth:`DeviceTime.hold`, :meth:`DeviceTime.release`): a call whose
events have completed gets ``otel_gpu.device.duration``, ``otel_gpu.device.queue_delay`` and
``otel_gpu.device.stream`` and, where ``OTEL_GPU_DEVICE_SPANS`` asks, a child span
``<name> [device]`` whose times are the events' device times mapped to the host clock through
a reference event (re-taken every second). A call whose events have not completed waits beside
the export queue, never in it, up to ``OTEL_GPU_DEVICE_TIME_WAIT`` seconds, then goes out with
``otel_gpu.device.unresolved``; its events go back to the pool once they complete. Memory is
bounded by the pool whatever the GPU does: at most ``POOL`` calls wait.

Every query also notes what it saw (start reached, end reached) for the fault suspect
(:mod:`otel_gpu.devices.cuda_fault`). CUDA is touched only through
:mod:`otel_gpu.devices.events`.
"""

from __future__ import annotations

import collections
import itertools
import os
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from otel_gpu import _guard
from otel_gpu.attributes import (
    DEVICE_DURATION,
    DEVICE_QUEUE_DELAY,
    DEVICE_STREAM,
    DEVICE_UNMEASURED,
    DEVICE_UNRESOLVED,
)
from otel_gpu.core.plan import Plan
from otel_gpu.devices import cuda_fault, events

if TYPE_CHECKING:
    from otel_gpu.config import Settings
    from otel_gpu.core.record import Call

Pipeline = Any
"""The export pipeline (its queue, drain and ``device_time``), handed over by the observer
registry; typed loosely so that devices never import export."""

__all__ = ["POOL", "DeviceTime", "Pair", "make_observer", "on_resolved", "stop"]

POOL = 1024
"""Event pairs per process: the most calls whose device time can be pending at once."""
_GROW = 64  # pairs created at a time (never per call)
_RECALIBRATE = 1.0  # seconds between reference events: clock drift stays far below 50 µs
_REFERENCE_TIMEOUT = 0.05  # seconds the export thread polls a reference event
_MARGIN_NS = 1_000_000  # a reference this much older than a call's host start preceded it
_RESOLVED = ()  # call.device once resolved without a device span


class Pair:
    """Two events and what the resolver has seen of them."""

    __slots__ = (
        "call",
        "deadline",
        "device",
        "end",
        "end_seen",
        "ended",
        "name",
        "owner",
        "seen_ns",
        "span_id",
        "start",
        "start_seen",
        "stream",
        "stream_id",
    )

    def __init__(self, owner: DeviceTime, start: Any, end: Any) -> None:
        self.owner = owner
        self.deadline = 0.0  # monotonic time its call stops waiting
        self.start = start
        self.end = end
        self.call: Call | None = None  # None once the call's span went out
        self.stream: Any = None
        self.stream_id: int | str = 0
        self.device = 0
        self.ended = 0  # when the end event was recorded (the order of end records), 0: not yet
        self.start_seen = False  # a query found the start event complete
        self.end_seen = False
        self.seen_ns = 0  # host time the end was found complete
        self.span_id = 0
        self.name = ""


class DeviceTime:
    """The device-time observer, its event pool and its resolver."""

    min_level = 1

    def __init__(self, settings: Settings, pipeline: Pipeline, backend: events.EventBackend):
        self.backend = backend
        self._record = backend.record
        self._stream = backend.stream
        self.pipeline = pipeline
        self.wait = settings.device_time_wait
        self.force = settings.device_time == "on"  # measure without waiting for CUDA's init
        self.spans_from = {"auto": 3, "on": 1, "off": 99}[settings.device_spans]
        self.pid = os.getpid()
        self.free: list[Pair] = []
        self._pop, self._push = self.free.pop, self.free.append
        self.created = 0
        # pairs in use, in record order (a dict keeps insertion order; set and del are atomic)
        self.active: dict[Pair, None] = {}
        self.held: collections.deque[Call] = collections.deque()
        self.unmeasured = 0  # calls that found the pool empty
        self._noted = 0
        self.live = False
        self.broken = False  # a CUDA error: every query fails from now on
        self.faults: dict[int, cuda_fault.Verdict] = {}
        self._lock = threading.Lock()  # held, active's flags, calibration, faults
        self._grow_lock = threading.Lock()
        # device -> its last two references (host ns, event, when taken), the newest last
        self._calibration: dict[int, list[tuple[int, Any, float]]] = {}
        self._child_plans: dict[Any, Plan] = {}
        self._tick = itertools.count(1).__next__  # the order of end records (the fence)

    # ------------------------------------------------------------------ caller's thread

    def _go_live(self) -> bool:
        if self.broken or self.pid != os.getpid():  # a forked child never reuses these events
            return False
        if not (self.force or self.backend.ready()):
            return False
        self.live = True
        return True

    def _grow(self) -> Pair | None:
        with self._grow_lock:
            if self.free:
                return self.free.pop()
            if self.created >= POOL:
                self.unmeasured += 1
                return None
            new = self.backend.new_event
            batch = [Pair(self, new(), new()) for _ in range(min(_GROW, POOL - self.created))]
            self.created += len(batch)
            pair = batch.pop()
            self.free.extend(batch)
            return pair

    def start(self, call: Call) -> None:
        # Hot path (every call at level >= 1): bound methods, flags reset off the caller's
        # thread when the pair is freed; ~0.6 µs with fake events (otel-gpu bench device_time).
        if not self.live and not self._go_live():
            return
        try:
            pair: Pair | None = self._pop()  # list.pop/append are atomic under the GIL
        except IndexError:
            pair = self._grow()
        if pair is None:
            return
        try:
            where = self._stream()
            if where is None:  # capturing a CUDA graph: replays are timed instead
                self._push(pair)
                return
            pair.stream, pair.stream_id, pair.device = where
            self._record(pair.start, pair.stream)
        except Exception as exc:
            self._push(pair)
            self._record_failed(exc)
            return
        pair.call = call
        self.active[pair] = None
        call.device = pair

    def end(self, call: Call) -> None:
        pair = call.device
        if pair is not None and not pair.ended:
            pair.ended = self._tick()
            try:
                self._record(pair.end, pair.stream)
            except Exception as exc:
                self._record_failed(exc)
        if call.exc is not None and events.is_cuda_error(call.exc):
            self.raised(call)

    def record_end(self, pair: Pair) -> None:
        pair.ended = self._tick()
        try:
            self.backend.record(pair.end, pair.stream)
        except Exception as exc:
            self._record_failed(exc)

    def _record_failed(self, exc: Exception) -> None:
        """Recording failed (a sticky CUDA error, or a backend bug): measure no more calls."""
        self.live = False
        self.broken = True
        if not events.is_cuda_error(exc):
            _guard.internal_error("device_time", exc)

    def raised(self, call: Call) -> None:
        """``call`` raised a CUDA error (caller's thread, error path only): name the suspect on
        its span and in the crash journal. Pure bookkeeping over what the resolver saw."""
        pair = call.device
        device = pair.device if type(pair) is Pair else self._any_device()
        with self._lock:
            verdict = self._verdict(device, _text(call.exc))
        cuda_fault.mark_raising(call, verdict)

    def _any_device(self) -> int:
        for pair in self.active:
            return pair.device
        return 0

    # ------------------------------------------------------------------ export thread

    def hold(self, call: Call) -> bool:
        """True: ``call``'s events have not completed; it waits here, out of the export queue."""
        pair = call.device
        if type(pair) is not Pair:
            return False
        with self._lock:
            self._look(pair)
            if self._settle(pair, 0.0):
                return False
            pair.deadline = time.monotonic() + self.wait
            self.held.append(call)
            return True

    def release(self, queue: collections.deque[Call]) -> None:
        """Put back at the head of ``queue`` the waiting calls now resolved or past their wait;
        note what every pending pair's events show (the fault suspect's evidence)."""
        if not self.active:
            return
        ready: list[Call] = []
        with self._lock:
            self._observe()
            if self.held:
                now = time.monotonic()
                keep: collections.deque[Call] = collections.deque()
                for call in self.held:
                    pair = call.device
                    (ready if self._settle(pair, pair.deadline, now) else keep).append(call)
                self.held = keep
        if ready:
            queue.extendleft(reversed(ready))

    def _observe(self) -> None:
        """Learn which pending pairs completed, with as few queries as the streams allow.

        First one query per stream, of its fence: the end event recorded last on it. A stream
        runs its work in order, so when the fence has completed every event recorded on that
        stream before it has too (one ``cudaEventQuery`` for a whole batch: queries and the
        caller's launches contend in the driver). Otherwise every pending pair is queried once,
        in record order; a stream's later events cannot have completed when an earlier one has
        not, so its queries stop there."""
        fences: dict[tuple[int, int | str], Pair] = {}
        for pair in self.active:
            if pair.ended and not pair.end_seen:
                key = (pair.device, pair.stream_id)
                fence = fences.get(key)
                if fence is None or pair.ended > fence.ended:
                    fences[key] = pair
        passed: dict[tuple[int, int | str], int] = {}
        for key, fence in fences.items():
            if self._look(fence):
                passed[key] = fence.ended
        now = time.time_ns()
        stalled: set[Any] = set()
        for pair in list(self.active):
            key = (pair.device, pair.stream_id)
            if not pair.end_seen:
                reached = passed.get(key)
                if reached is not None and pair.ended and pair.ended <= reached:
                    # recorded on this stream before its completed fence: completed too
                    pair.start_seen = pair.end_seen = True
                    pair.seen_ns = now
                elif key in stalled or key in passed:
                    continue  # recorded after the fence, or behind an incomplete event
                elif not self._look(pair):
                    stalled.add(key)
                    continue
            if pair.call is None:  # its span went out unresolved: the pair is free again
                self._free(pair)

    def _look(self, pair: Pair) -> bool:
        """Query what is not known yet; True when the end (recorded) has completed."""
        if self.broken:
            return False
        query = self.backend.query
        try:
            # the end first: when it has completed, so has the start recorded before it
            if pair.ended and not pair.end_seen and query(pair.end):
                pair.start_seen = pair.end_seen = True
                pair.seen_ns = time.time_ns()
            elif not pair.start_seen:
                pair.start_seen = query(pair.start)
        except Exception as exc:
            self._query_failed(exc, pair.device)
            return False
        return pair.end_seen

    def _query_failed(self, exc: Exception, device: int) -> None:
        """A query or elapsed time raised: a kernel fault stops every query from now on (it is
        sticky) and names the suspect; anything else costs only this call its device time."""
        if events.is_cuda_error(exc):
            self._verdict(device, _text(exc))
        else:
            _guard.internal_error("device_time", exc)

    def _verdict(self, device: int, error: str) -> cuda_fault.Verdict:
        """The fault verdict for ``device`` (found once: after a sticky error nothing changes)."""
        verdict = self.faults.get(device)
        if verdict is None:
            self.broken = True
            self.live = False
            verdict = cuda_fault.find(list(self.active), device, error)
            self.faults[device] = verdict
            cuda_fault.mark_suspects(verdict)
            # in the journal at once: the process may die before any call raises the error
            cuda_fault.journal(self.pipeline, verdict)
        return verdict

    def _settle(self, pair: Pair, deadline: float, now: float | None = None) -> bool:
        """Finish ``pair``'s call when its events completed (device time on its span) or its wait
        is over or the device broke (unresolved). False: keep waiting."""
        call = pair.call
        if call is None:
            return True
        if pair.end_seen and not self.broken:
            try:
                self._resolve(call, pair)
            except Exception as exc:
                self._unresolved(call)
                self._free(pair)
                self._query_failed(exc, pair.device)
            return True
        if self.broken or (now is not None and now >= deadline):
            self._unresolved(call)
            pair.call = None
            pair.span_id, pair.name = call.span.span_id, call.plan.name
            return True
        return False

    def _unresolved(self, call: Call) -> None:
        call.span.set_attribute(DEVICE_UNRESOLVED, True)
        call.device = _RESOLVED

    def _resolve(self, call: Call, pair: Pair) -> None:
        backend = self.backend
        duration = backend.elapsed_ms(pair.start, pair.end) / 1e3
        span = call.span
        span.set_attribute(DEVICE_DURATION, duration)
        span.set_attribute(DEVICE_STREAM, pair.stream_id)
        for hook in _resolved_hooks:  # the triggers' device clock (anomalies/triggers.py)
            try:
                hook(call, duration)
            except Exception as exc:
                _guard.internal_error("device_time", exc)
        if self.unmeasured != self._noted:
            span.set_attribute(DEVICE_UNMEASURED, self.unmeasured - self._noted)
            self._noted = self.unmeasured
        started = self._host_ns(pair, call.start_ns)
        call.device = _RESOLVED
        if started is not None:
            span.set_attribute(DEVICE_QUEUE_DELAY, max(started - call.start_ns, 0) / 1e9)
            if call.plan.level >= self.spans_from:
                call.device = (started, started + round(duration * 1e9), pair.stream_id)
        self._free(pair)

    def _free(self, pair: Pair) -> None:
        self.active.pop(pair, None)
        pair.call = None
        pair.ended = 0
        pair.start_seen = pair.end_seen = False
        self.free.append(pair)

    def _host_ns(self, pair: Pair, call_start_ns: int) -> int | None:
        """Host time (ns) at which the device reached ``pair.start``, from a reference event:
        ``elapsed`` is measured forwards, from whichever of the two the device reached first.

        A reference serves a call only when it surely ran before the call's start or after its
        end. The last two are kept: a call that was running while the newest was taken uses
        the one before, so a reference is taken about once a second, not once per call that
        straddles the last one."""
        cals = self._calibration.get(pair.device)
        # the start event was recorded just before call_start_ns: a reference 1 ms older surely
        # ran before it; one taken after the end was seen complete surely ran after it
        before = call_start_ns - _MARGIN_NS
        cal = None
        if cals:
            for candidate in reversed(cals):
                if candidate[0] < before or candidate[0] > pair.seen_ns:
                    cal = candidate
                    break
        if cal is None or time.monotonic() - cals[-1][2] > _RECALIBRATE:  # type: ignore[index]
            found = self.backend.reference(pair.device, _REFERENCE_TIMEOUT)
            if found is not None:
                cal = (found[0], found[1], time.monotonic())  # taken now: after the end was seen
                self._calibration[pair.device] = [*(cals or [])[-1:], cal]
            elif cal is None:
                return None
        host, ref = cal[0], cal[1]
        if host < before:  # the reference ran before the call's start was recorded
            return host + round(self.backend.elapsed_ms(ref, pair.start) * 1e6)
        return host - round(self.backend.elapsed_ms(pair.start, ref) * 1e6)

    def children(self, call: Call, build: Callable[[Call], Any], append: Callable) -> None:
        """After ``call``'s span is built: its ``<name> [device]`` child, when it has one."""
        times = call.device
        if type(times) is not tuple or not times:
            return
        from otel_gpu.core.record import Call as CallRecord
        from otel_gpu.core.record import CallSpan

        call.device = _RESOLVED
        plan = self._child_plans.get(call.plan)
        if plan is None:
            if len(self._child_plans) >= 4096:
                self._child_plans.clear()
            plan = self._child_plans[call.plan] = Plan(call.plan.name + " [device]", 1)
        parent = call.span.get_span_context()
        span = CallSpan(
            None, plan.name, parent.trace_id, random.getrandbits(64) or 1, parent.trace_state
        )
        span.set_attribute(DEVICE_STREAM, times[2])
        child = CallRecord(plan, span, parent, times[0])
        child.end_ns = times[1]
        append(build(child))

    # ------------------------------------------------------------------ flush and exit

    def flush(self, timeout: float) -> bool:
        """Wait (polling, within ``timeout`` and the wait bound) for the waiting calls' events,
        then export them, resolved or not."""
        deadline = time.monotonic() + timeout
        while self.held and time.monotonic() < deadline:
            self.pipeline.drain(deadline)  # each drain releases what completed (release())
            if self.held:
                time.sleep(0.002)
        return not self.held

    def close(self) -> None:
        """Exit: what still waits goes out now (unresolved where its events never completed)."""
        with self._lock:
            self._observe()
            calls, self.held = list(self.held), collections.deque()
            for call in calls:
                self._settle(call.device, 0.0, 1.0)
        if calls:
            self.pipeline.queue.extendleft(reversed(calls))
            self.pipeline.drain(time.monotonic() + 1.0)


def _text(exc: BaseException | None) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:512]
    except BaseException:
        return type(exc).__name__


_resolved_hooks: list[Callable[[Call, float], None]] = []


def on_resolved(hook: Callable[[Call, float], None]) -> None:
    """Call ``hook(call, seconds)`` on the export thread each time a call's device duration is
    resolved (once per hook, however often it is added)."""
    if hook not in _resolved_hooks:
        _resolved_hooks.append(hook)


def stop(call: Call) -> None:
    """Record ``call``'s end event now, if it has one not recorded yet: before the statistics
    kernels a level-5 call launches after its body (the decorator calls this)."""
    pair = call.device
    if type(pair) is Pair and not pair.ended:
        pair.owner.record_end(pair)


def make_observer(settings: Settings, pipeline: Pipeline) -> DeviceTime | None:
    """The observer for ``settings`` (None when device time is off or there is no CUDA)."""
    if settings.device_time == "off":
        return None
    backend = events.backend()
    if backend is None:
        return None
    observer = DeviceTime(settings, pipeline, backend)
    pipeline.device_time = observer
    return observer
