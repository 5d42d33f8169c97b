"""The NVTX seam: a range around each decorated call that carries the call's span id.

With ``OTEL_GPU_NVTX=true`` every decorated call opens an NVTX range named like its span, so an
Nsight Systems timeline can be joined to the trace (docs/nvtx.md). The NVTX API comes from the
``nvtx`` package when it is importable (the span id goes into the range's 64-bit payload) or
else from ``torch.cuda.nvtx`` (no payload there: the span id goes into the message). Which one
is used is decided once, in :func:`_load_backend`, the one function tests replace with a fake.

Range kinds: a call opens a thread range (push/pop), which Nsight Systems nests per thread as
the spans nest. A pop closes the thread's latest push, so where a call may end after a later
call began on its thread, or on another thread, it opens a process range (start/end, closed by
its handle) instead: on a thread running an asyncio event loop (coroutines interleave there)
and for the ``torch.distributed`` target (an async collective ends on the thread that completes
its work).

Skipped, with nothing opened and nothing closed: calls while ``torch.compile`` traces (an NVTX
call there breaks the graph or is baked into it) and calls during CUDA-graph capture (the range
would time the capture, not the replays). Behaviour on a real GPU under Nsight Systems is
unverified unless docs/gpu.md says otherwise.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from otel_gpu import _guard
from otel_gpu.devices import cuda

if TYPE_CHECKING:
    from otel_gpu.core.record import Call

__all__ = [
    "Backend",
    "NvtxRanges",
    "NvtxUnavailable",
    "make_observer",
    "message",
    "payload",
    "span_id_hex",
]

DOMAIN = "otel_gpu"
"""The NVTX domain of the ranges (``nvtx`` package); ``torch.cuda.nvtx`` has only the default one."""

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


class NvtxUnavailable(RuntimeError):
    """No NVTX API works in this process; the message says why."""


class Backend(Protocol):
    """An NVTX API: thread ranges (``push``/``pop``) and process ranges (``start``/``end``)."""

    payload: bool
    """True when ``push``/``start`` put ``value`` into the range's payload; False when they
    ignore it (the span id must then be in the message)."""

    def push(self, message: str, value: int) -> None: ...

    def pop(self) -> None: ...

    def start(self, message: str, value: int) -> int:
        """Open a process range; returns the handle :meth:`end` takes."""
        ...

    def end(self, range_id: int) -> None: ...


def payload(span_id: int) -> int:
    """The span id's 64 bits as the signed 64-bit integer an NVTX ``INT64`` payload holds
    (the ``nvtx`` package stores a Python int as ``INT64``, so ids >= 2**63 come out negative)."""
    return span_id - _U64 if span_id > _I64_MAX else span_id


def span_id_hex(value: int) -> str:
    """The span id (16 lowercase hex digits, as OTLP and Tempo show it) of a payload value."""
    return format(value % _U64, "016x")


def message(name: str, span_id: int, in_payload: bool) -> str:
    """The range's message: the span name, followed by `` span_id=<16 hex>`` when the backend
    has no payload. Stable: users grep Nsight exports for it."""
    return name if in_payload else f"{name} span_id={span_id:016x}"


class _NvtxPackage:
    """The ``nvtx`` package: ranges in the ``otel_gpu`` domain, the span id as an INT64 payload.

    The message is only the span name: the package registers every message string in a cache
    that never shrinks, so a per-call message would grow memory with every call.
    """

    payload = True

    def __init__(self, module: Any) -> None:
        domain = module.get_domain(DOMAIN)  # a no-op domain when no tool is attached
        # a release without payloads raises here (TypeError), not on every call
        domain.get_event_attributes(message=DOMAIN, payload=0)
        self._push = domain.push_range
        self._pop = domain.pop_range
        self._start = domain.start_range
        self._end = domain.end_range

    def push(self, message: str, value: int) -> None:
        self._push(message=message, payload=value)

    def pop(self) -> None:
        self._pop()

    def start(self, message: str, value: int) -> int:
        return int(self._start(message=message, payload=value))

    def end(self, range_id: int) -> None:
        self._end(range_id)


class _TorchNvtx:
    """``torch.cuda.nvtx``: ASCII messages only, no payload, the default domain."""

    payload = False

    def __init__(self, module: Any) -> None:
        self._push = module.range_push
        self._pop = module.range_pop
        self._start = module.range_start
        self._end = module.range_end

    def push(self, message: str, value: int) -> None:
        self._push(message)

    def pop(self) -> None:
        self._pop()

    def start(self, message: str, value: int) -> int:
        return int(self._start(message))

    def end(self, range_id: int) -> None:
        self._end(range_id)


def _load_backend() -> Backend:
    """The NVTX API of this process: the ``nvtx`` package, else ``torch.cuda.nvtx``.

    Kept as a separate function so tests can substitute a fake. Raises :class:`NvtxUnavailable`
    naming why neither works.
    """
    reasons = []
    try:
        import nvtx

        return _NvtxPackage(nvtx)
    except Exception as exc:  # ImportError, or a package too old for get_domain/payloads
        reasons.append(f"the nvtx package: {type(exc).__name__}: {exc}")
    try:
        import torch
        import torch.cuda.nvtx as torch_nvtx

        # A CPU build has no NVTX bindings: torch.cuda.nvtx then raises on the first push.
        if not hasattr(torch._C, "_nvtx") or not hasattr(torch._C._nvtx, "rangeStartA"):
            raise NvtxUnavailable(f"torch {torch.__version__} is built without NVTX")
        return _TorchNvtx(torch_nvtx)
    except Exception as exc:
        reasons.append(f"torch.cuda.nvtx: {exc}")
    raise NvtxUnavailable("; ".join(reasons))


_PUSHED = -1  # a range id is never negative: process range handles are uint64
# instrumentation targets whose calls may end on another thread (instrumentation/torch_distributed)
_ENDS_ELSEWHERE = frozenset({"torch.distributed"})


class NvtxRanges:
    """The observer: ``start`` opens the call's range, ``end`` closes it, also when the call
    raised. What ``start`` opened is kept per call, so ``end`` closes exactly that: nothing
    for a skipped call, even when compile or capture began or ended in between."""

    min_level = 1

    def __init__(self, backend: Backend, check_capture: bool) -> None:
        from otel_gpu.devices import compiling

        self._backend = backend
        self._push = backend.push  # bound once: the common path's two calls
        self._pop = backend.pop
        self._in_payload = bool(backend.payload)
        self._is_compiling = compiling.is_compiling
        self._check_capture = check_capture  # CUDA exists: capture may be in progress
        self._running_loop = asyncio.events._get_running_loop
        self._open: dict[Call, int] = {}  # call -> _PUSHED or a process range's handle

    def start(self, call: Call) -> None:
        if self._is_compiling() or (self._check_capture and cuda.is_capturing()):
            return
        span = call.span
        span_id = span.get_span_context().span_id
        # message() and payload() inlined: two Python calls fewer per call
        text = span.name if self._in_payload else f"{span.name} span_id={span_id:016x}"
        value = span_id - _U64 if span_id > _I64_MAX else span_id
        if self._running_loop() is None and call.plan.instrumented not in _ENDS_ELSEWHERE:
            self._push(text, value)
            self._open[call] = _PUSHED
        else:  # this call may end out of order on this thread, or elsewhere: a pop would not do
            self._open[call] = self._backend.start(text, value)

    def end(self, call: Call) -> None:
        opened = self._open.pop(call, None)
        if opened is None:
            return
        if opened == _PUSHED:
            self._pop()
        else:
            self._backend.end(opened)

    def flush(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        """Nothing to release: calls still running close their ranges when they end."""


def make_observer() -> NvtxRanges | None:
    """The observer, or None (with one warning saying why) when no NVTX API works here."""
    try:
        backend = _load_backend()
    except NvtxUnavailable as exc:
        _guard.warn_once(
            "nvtx",
            "otel-gpu: OTEL_GPU_NVTX=true, but no NVTX API works in this process (%s); "
            "calls run without NVTX ranges",
            exc,
        )
        return None
    return NvtxRanges(backend, check_capture=cuda.cuda_available())
