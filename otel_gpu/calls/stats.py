"""Tensor statistics for level 5: min/max/mean/std over finite values, plus NaN/Inf counts.

Cost model (see docs/architecture.md):

* A clean floating tensor costs three reductions (``aminmax``, ``sum``, a ``dot`` for the
  sum of squares; ``vector_norm`` for half types and non-contiguous tensors)
  launched on its device, with no host sync. ``var_mean`` is avoided: on CPU it is
  ~20x slower than a sum.
* Every tensor of a call is read back together, in one device-to-host read
  (:func:`otel_gpu.devices.cuda.read_scalars`): the one host synchronisation of the call.
* NaN/Inf counting and finite-only statistics run only for tensors whose
  min/max/sum came back non-finite, and a precise float64 pass only where the
  sum-of-squares variance would lose precision. Those "refine" passes cost one more
  read, paid only by calls that need it.

Every dtype gets a defined answer: a statistic that does not apply is left out and
the result's ``note`` says why.

A tensor's vector may carry more columns after the moments, read in the same single read:
the low-precision statistics of float8/float4 tensors, or of a wide tensor's simulated cast
(:mod:`otel_gpu.calls.lowp`), and its fingerprint (:mod:`otel_gpu.calls.fingerprint`); the
specs in ``Pending.extras`` (:mod:`otel_gpu.core.stats`) say how to read them back.

A broadcast view (a stride-0 dimension, ``expand``) is reduced over the elements it stores,
once each: min and max are the same, and every stored element stands for the same number of
logical ones, so the sums and the NaN/Inf/finite counts are scaled by that number. The result
is the one of the materialised tensor, counts included, at the cost of the stored elements.

Tensor subclasses whose hooks are not torch's own code are read as :mod:`otel_gpu.calls._subclass`
says: over a plain view of their data, or skipped with a note.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from otel_gpu import _guard, config
from otel_gpu.attributes import STATS_FINGERPRINT, STATS_NONFINITE_SEEN
from otel_gpu.calls import _subclass, fingerprint, lowp
from otel_gpu.core.stats import (
    CAPTURED_ROW,
    Extra,
    FingerprintSpec,
    IntExtremesSpec,
    TensorStats,
    captured_stats,
    event_attributes,
    fill,
    fill_extras,
    fingerprint_hex,
    join_note,
)
from otel_gpu.devices import cuda

__all__ = [
    "CAPTURED_NOTE",
    "CAPTURED_ROW",
    "CAPTURE_NOTE",
    "Pending",
    "TensorStats",
    "capture",
    "captured_stats",
    "complete",
    "compute",
    "event_attributes",
    "finish",
    "read_later",
    "refine_on",
    "skipped",
]

CAPTURE_NOTE = "statistics skipped: CUDA graph capture in progress"
CAPTURED_NOTE = (
    "statistics not known at CUDA graph capture: recorded on the device at each replay, read "
    "into the replay spans (otel_gpu.cuda_graph.replay)"
)
"""Values per tensor in a captured call's static buffer: NaN count, Inf count, finite count,
finite min, finite max, finite mean, sum of squared deviations from that mean."""

_NATIVE_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# float32 sums of squares cancel when mean**2 dwarfs the variance; past this ratio refine in float64.
_CANCELLATION_RATIO = 1e4


class Pending:
    """Statistics launched on the device but not yet read back.

    ``vec`` holds ``moments`` columns (4 launched eagerly, :data:`CAPTURED_ROW` at capture, 0
    for a dtype torch has no arithmetic for), then the columns of each of ``extras``."""

    __slots__ = (
        "captured",
        "extras",
        "integer",
        "key",
        "moments",
        "note",
        "numel",
        "per_element",
        "scale",
        "source",
        "values",
        "vec",
        "version",
    )

    def __init__(
        self,
        key: str,
        numel: int,
        vec: torch.Tensor | None,
        source: torch.Tensor | None,
        note: str | None,
        integer: bool = False,
        scale: int = 1,
    ) -> None:
        self.key = key
        self.numel = numel
        self.vec = vec
        self.source = source
        self.note = note
        self.integer = integer
        self.scale = scale  # logical elements per stored one: a broadcast view's repeat
        self.captured = False  # vec is a static buffer a CUDA graph writes at each replay
        self.moments = 4
        self.extras: tuple[Extra, ...] = ()
        self.per_element = 1  # values per element: 2 for float4_e2m1fn_x2
        self.values: dict[str, Any] | None = None  # known without the device (an empty tensor)
        self.version = -1  # source's version counter when its read was deferred (read_later)


def skipped(key: str, numel: int, note: str) -> Pending:
    return Pending(key, numel, None, None, note)


NESTED_NOTE = "statistics not supported for nested tensors"
FP4_NOTE = "float4_e2m1fn_x2: statistics over its two e2m1 values per element"

# dtypes with no arithmetic in torch (sub-byte integer shells, bit patterns): bytes only
_RAW = frozenset(
    d
    for d in (getattr(torch, n, None) for n in ("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"))
    if d is not None
) | frozenset(
    d
    for d in (getattr(torch, f"{s}int{b}", None) for s in ("u", "") for b in range(1, 8))
    if d is not None
)
_FP4 = getattr(torch, "float4_e2m1fn_x2", None)


class _Options:
    """What the settings ask of level 5 beyond the moments, derived once per settings object."""

    __slots__ = ("fingerprint", "settings", "simulate")

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self.fingerprint = settings.fingerprint
        self.simulate = settings.lowp_simulate


_options: _Options | None = None


def _current() -> _Options:
    """The options of the settings in force: one identity check per tensor, not a parse."""
    global _options
    settings = config.current()
    opts = _options
    if opts is None or opts.settings is not settings:
        opts = _options = _Options(settings)
    return opts


def _prepare(t: torch.Tensor) -> tuple[torch.Tensor | None, str | None, bool]:
    """The tensor to reduce, a note, and whether NaN/Inf counts apply (False for ints and bools)."""
    if t.layout is not torch.strided:
        return None, f"statistics not supported for layout {t.layout}", False
    if t.device.type == "meta":
        return None, "meta tensor: no data", False
    if t.is_quantized:
        return t.dequantize(), "quantized tensor: statistics of the dequantized values", True
    dtype = t.dtype
    if dtype in _NATIVE_FLOATS:
        return t, None, True
    if dtype is _FP4:
        return lowp.unpack_e2m1(t), FP4_NOTE, True
    if dtype in _RAW:
        return None, f"{dtype} has no arithmetic in torch: no statistics of its values", False
    if dtype.is_complex:
        return t.abs(), "complex tensor: min/max/mean/std are of |x|", True
    if dtype.is_floating_point:  # fp8 and other exotic floats: reductions are not implemented
        return t.float(), None, True
    if dtype is torch.bool:
        return t.to(torch.float32), "bool tensor: statistics over 0/1; no NaN/Inf", False
    return t.to(torch.float64), "integer tensor: no NaN/Inf", False


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def compute(key: str, t: torch.Tensor) -> Pending:
    """Launch the reductions for ``t`` without reading them back."""
    return _launch(key, t, _moments_vector, 4, True)


def _launch(
    key: str,
    t: torch.Tensor,
    vector: Callable[[torch.Tensor, int], tuple[torch.Tensor, Any]],
    moments: int,
    cache: bool,
) -> Pending:
    """What :func:`compute` and :func:`capture` share: subclasses, empty and unsupported
    tensors, broadcast views, then ``vector(x, scale)`` (the device vector of ``moments``
    columns and the source a refine pass may read again), then the extras the settings ask
    for (the fingerprint), appended to the same vector: still one read per call."""
    tp = type(t)
    if tp is not torch.Tensor and tp is not torch.nn.Parameter:
        kind = _subclass.kind(tp)
        if kind != _subclass.TORCH:
            with _subclass.no_torch_function():  # the subclass's own hooks never run
                if kind == _subclass.DISPATCH or t.is_nested:
                    return Pending(key, t.numel(), None, None, _dispatch_note(tp))
                t = t.as_subclass(torch.Tensor)  # a plain view of its data: no copy
    if t.is_nested:  # before numel's checks: a nested tensor has no strides to narrow
        return Pending(key, t.numel(), None, None, NESTED_NOTE)
    numel = t.numel()
    dense = t.layout is torch.strided and t.device.type != "meta"
    opts = _current()
    if numel == 0:
        empty = Pending(key, 0, None, None, "empty tensor")
        if dense and opts.fingerprint:  # no words: known without the device
            empty.values = {STATS_FINGERPRINT: fingerprint_hex(0, 0, 0)}
        return empty
    logical = t
    scale = 1
    if dense:
        t, scale = _stored(t)
    x, note, counts_apply = _prepare(t)
    parts: list[torch.Tensor] = []
    extras: list[Extra] = []
    source = None
    if x is not None:
        vec, source = vector(x, scale)
        parts.append(vec)
        if t.dtype is torch.int64:  # the moments' min/max went through float64: exact ones
            parts.append(_int_extremes(t))
            extras.append(_INT_EXTREMES)
        if not t.is_quantized:  # low-precision formats, or a wide float's simulated cast
            spec = lowp.spec_for(t.dtype, opts.simulate, x.numel())
            if spec is not None:
                parts.append(lowp.vector(x, spec))
                extras.append(spec)
    if dense and opts.fingerprint:
        note = _add_fingerprint(logical, scale, cache, parts, extras, note)
    if not parts:
        return Pending(key, numel, None, None, note)
    pending = Pending(
        key,
        numel,
        parts[0] if len(parts) == 1 else torch.cat(parts),
        source,
        note,
        integer=not counts_apply,
        scale=scale,
    )
    pending.moments = moments if x is not None else 0
    pending.extras = tuple(extras)
    if t.dtype is _FP4:
        pending.per_element = 2
    return pending


_INT_EXTREMES = IntExtremesSpec()


def _int_extremes(t: torch.Tensor) -> torch.Tensor:
    """An int64 tensor's exact min and max as four float64 columns, each a high half (an
    arithmetic shift: floor of x / 2**32) and a low half (x mod 2**32); capturable, no read."""
    mn, mx = torch.aminmax(t)
    both = torch.stack([mn, mx])
    hi, lo = both >> 32, both & 0xFFFFFFFF
    return torch.stack([hi[0], lo[0], hi[1], lo[1]]).to(torch.float64)


def _add_fingerprint(
    logical: torch.Tensor,
    scale: int,
    cache: bool,
    parts: list[torch.Tensor],
    extras: list[Extra],
    note: str | None,
) -> str | None:
    """Launch ``logical``'s fingerprint into ``parts``; the note, saying why if it is left out."""
    if scale != 1 and logical.numel() > fingerprint.MAX_BROADCAST:
        return join_note(
            note,
            f"fingerprint left out: a broadcast view of over {fingerprint.MAX_BROADCAST} "
            "elements (hashing would read each one)",
        )
    try:
        vec, words = fingerprint.launch(logical, cache)
    except Exception as exc:  # a dtype or device the hash cannot read: the rest stays
        _guard.internal_error("fingerprint", exc)
        return join_note(note, f"fingerprint left out: {type(exc).__name__}")
    parts.append(vec)
    extras.append(FingerprintSpec(words))
    return note


def _dispatch_note(tp: type) -> str:
    name = type.__dict__["__qualname__"].__get__(tp)
    return (
        f"statistics skipped: tensor subclass {name} has its own __torch_dispatch__, "
        "code otel-gpu does not run"
    )


def _stored(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` with its broadcast (stride 0) dimensions narrowed to one element, and how many
    logical elements each stored one stands for."""
    stride = t.stride()
    if 0 not in stride:
        return t, 1
    scale = 1
    for d, (n, s) in enumerate(zip(t.shape, stride)):
        if s == 0 and n > 1:
            t = t.narrow(d, 0, 1)
            scale *= n
    return t, scale


def _moments_vector(x: torch.Tensor, scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[min, max, sum, sum of squares] in float64, and ``x`` for the refine pass.

    The sums are of ``x``'s own elements: :func:`finish` scales them by ``scale``."""
    acc = _acc_dtype(x)
    mn, mx = torch.aminmax(x)
    total = x.sum(dtype=acc)
    if x.dtype is acc and x.is_contiguous():
        # BLAS dot: one pass, ~30% cheaper than vector_norm on CPU, and no sqrt to square again.
        flat = x.reshape(-1)
        sumsq = torch.dot(flat, flat)
        vec = torch.stack([mn, mx, total, sumsq])  # one dtype: one stack, one conversion
    else:
        sumsq = torch.linalg.vector_norm(x, dtype=acc).square()
        vec = torch.stack([mn.to(acc), mx.to(acc), total, sumsq])
    return vec.to(torch.float64), x


def capture(key: str, t: torch.Tensor) -> Pending:
    """During CUDA graph capture: record ``t``'s statistics into a static device vector.

    Only graph-capturable ops: elementwise kernels and full reductions, whose results stay on
    the device (no boolean indexing, no ``.item()``, no host read). Every temporary is allocated
    during capture, so from the graph's private pool, and the vector itself is kept alive with
    the graph's record (:mod:`otel_gpu.devices.cuda_graphs`), so each replay rewrites it in
    place. NaN/Inf counts and finite-only, float64 two-pass moments are computed on every
    replay, since no refine pass can run later: about a dozen kernels per tensor.
    """
    pending = _launch(
        key, t, lambda x, scale: (_captured_vector(x, scale), None), CAPTURED_ROW, False
    )
    pending.captured = pending.vec is not None
    return pending


def _captured_vector(x: torch.Tensor, scale: int = 1) -> torch.Tensor:
    """[nan, inf, finite count, finite min, finite max, finite mean, sum of squared deviations].

    ``scale``: logical elements per element of ``x`` (a broadcast view's repeat); the counts
    and the sum of squared deviations are scaled by it, the mean and extremes are unchanged."""
    xd = x.to(torch.float64)
    finite = torch.isfinite(xd)
    nan = torch.isnan(xd).sum()
    count = finite.sum()
    inf = (~finite).sum() - nan
    lo = torch.where(finite, xd, math.inf).amin()
    hi = torch.where(finite, xd, -math.inf).amax()
    mean = torch.where(finite, xd, 0.0).sum() / count  # NaN when nothing is finite
    m2 = torch.where(finite, xd - mean, 0.0).square().sum()
    parts = [nan.to(torch.float64), inf.to(torch.float64), count.to(torch.float64)]
    if scale != 1:  # scalar multiplications: capturable, no host-to-device copy
        parts = [part * scale for part in parts]
        m2 = m2 * scale
    return torch.stack([*parts, lo, hi, mean, m2])


def _moments(n: int, total: float, sumsq: float) -> tuple[float, float | None, bool]:
    """Mean and sample std from the sum and the sum of squares; True if precision is doubtful."""
    mean = total / n
    if n < 2:
        return mean, None, False
    var = max((sumsq - total * mean) / (n - 1), 0.0)
    doubtful = mean * mean > _CANCELLATION_RATIO * var if var > 0 else mean != 0.0
    return mean, math.sqrt(var), doubtful


def finish(pending: list[Pending], call: Any = None) -> list[TensorStats]:
    """Read every pending vector back (one host read) and complete the statistics.

    Vectors recorded during CUDA graph capture (:func:`capture`) are not read: they go to the
    graph's record of ``call`` and are read after each replay; their events say so.
    """
    _set_aside_captured(pending, call)
    live = [p for p in pending if p.vec is not None]
    rows = cuda.read_scalars([p.vec for p in live]) if live else []  # type: ignore[misc]
    return complete(pending, live, rows, _refine)


def _set_aside_captured(pending: list[Pending], call: Any) -> None:
    captured = [p for p in pending if p.captured]
    if captured:
        from otel_gpu.devices import cuda_graphs

        cuda_graphs.record(call).add_stats(pending)
        for p in captured:
            p.note = join_note(p.note, CAPTURED_NOTE)
            p.vec = None


def read_later(pending: list[Pending], call: Any = None) -> cuda.Read | None:
    """Start reading every pending vector back without waiting (:func:`cuda.read_later`);
    None when there is nothing on a CUDA device to read, or something not on one (then
    :func:`finish` reads them now). :func:`complete` finishes them once the read has landed."""
    if any(p.captured or (p.vec is not None and not cuda.readable_later(p.vec)) for p in pending):
        return None
    _set_aside_captured(pending, call)
    live = [p for p in pending if p.vec is not None]
    if not live:
        return None
    for p in live:  # an in-place change after this moment bumps it (views share the counter)
        if p.source is not None:
            p.version = p.source._version
    return cuda.read_later([p.vec for p in live])  # type: ignore[misc]


MODIFIED_NOTE = (
    "statistics from the first pass only: the tensor was modified in place before its NaN/Inf "
    "or precise pass could run off the caller's thread (OTEL_GPU_STATS_READ=sync runs it on "
    "the caller's thread)"
)


def refine_on(stream: Any) -> Refine:
    """The refine pass of a deferred read, run off the caller's thread on the call's ``stream``
    (after the caller's work on it), for each tensor not modified in place since the call.

    A modified one keeps its first pass: its min/max/mean/std when they were finite (a
    precision doubt left unresolved), NaN/Inf counts unknown otherwise; its note says so."""

    def refine(items: list[tuple[TensorStats, Pending]]) -> None:
        same: list[tuple[TensorStats, Pending]] = []
        for stats, p in items:
            source = p.source
            if source is not None and source._version == p.version:
                same.append((stats, p))
            else:
                stats.note = join_note(stats.note, MODIFIED_NOTE)
                if not stats.values or any(
                    isinstance(v, float) and not math.isfinite(v) for v in stats.values.values()
                ):
                    stats.values.clear()
                    stats.values[STATS_NONFINITE_SEEN] = True
        if same:
            with cuda.on_stream(stream):
                _refine(same)

    return refine


Refine = Callable[[list[tuple[TensorStats, "Pending"]]], None]


def complete(
    pending: list[Pending], live: list[Pending], rows: list[list[float]], refine: Refine
) -> list[TensorStats]:
    """The statistics of ``pending`` from the rows read back for ``live`` (the pending vectors
    that were read), ``refine`` run on the tensors that need a precise or NaN/Inf pass."""
    results: list[TensorStats] = []
    row_of = {id(p): row for p, row in zip(live, rows)}
    refine_items: list[tuple[TensorStats, Pending]] = []
    tails: list[tuple[TensorStats, tuple[Extra, ...], list[float]]] = []
    for p in pending:
        stats = TensorStats(p.key, p.numel, note=p.note)
        results.append(stats)
        if p.values:
            stats.values.update(p.values)
        row = row_of.get(id(p))
        if row is None:
            continue
        if p.extras:  # filled last: a refine pass replaces the moments' values
            tails.append((stats, p.extras, row[p.moments :]))
        if not p.moments:
            continue
        mn, mx, total, sumsq = row[:4]
        if p.scale != 1:  # a broadcast view: each stored element stands for p.scale ones
            total, sumsq = total * p.scale, sumsq * p.scale
        if not (
            math.isfinite(mn)
            and math.isfinite(mx)
            and math.isfinite(total)
            and math.isfinite(sumsq)
        ):
            refine_items.append((stats, p))
            continue
        if mn == mx:  # constant tensor: exact answer, nothing to refine
            mean, std, doubtful = mn, (0.0 if p.numel * p.per_element > 1 else None), False
        else:
            mean, std, doubtful = _moments(p.numel * p.per_element, total, sumsq)
        fill(stats, p.integer, mn, mx, mean, std)
        if doubtful:
            refine_items.append((stats, p))
    if refine_items:
        refine(refine_items)
    for stats, extras, tail in tails:
        fill_extras(stats, extras, tail)
    for p in pending:  # drop references to user tensors as soon as possible
        p.source = None
        p.vec = None
    return results


def _refine(items: list[tuple[TensorStats, Pending]]) -> None:
    """Precise float64 statistics over finite values, plus NaN/Inf counts, in one more read.

    The same masked kernels as at CUDA graph capture (:func:`_captured_vector`): no boolean
    indexing, whose data-dependent size would cost one more device sync per tensor.
    """
    vecs = []
    for _stats, p in items:
        assert p.source is not None
        vecs.append(_captured_vector(p.source, p.scale))
    rows = cuda.read_scalars(vecs)
    for (stats, p), row in zip(items, rows):
        precise = captured_stats(p.key, p.numel, p.note, p.integer, row)
        stats.values, stats.note = precise.values, precise.note
