"""How ``otel-gpu diff`` compares one tensor of two runs: by dumped values, statistics or metadata.

Each comparison says what it compared (``method``) and gives a ``status``: ``same`` (equal
exactly: the same bytes, or the same statistics to the last bit), ``close`` (not equal, but
within the tolerance: ``tolerance`` or ``rtol``/``atol`` say which), ``differ`` or ``not
compared`` (with ``why``). A verdict built from these claims only what was compared: ``same``
is never said of a tensor that differs by a rounding step.

* ``tensors`` (level 10, both calls dumped): the same bytes are ``same``; otherwise element by
  element, ``|a - b| <= atol + rtol * |b|`` with NaN equal to NaN and infinities equal only to
  themselves (``close``); reports the largest absolute and relative error, the mismatched
  fraction and the cosine similarity.
* ``fingerprint`` (level 5, when both statistics events carry :data:`FINGERPRINT`): equal or not;
  where they differ, ``statistics`` says how the statistics compare all the same (``close``:
  bytes changed by rounding, as eager against ``torch.compile``). ``fingerprints=False``
  compares such tensors by their statistics, and never calls them ``same`` (their bytes are
  known to differ).
* ``statistics`` (level 5): numel and NaN/Inf counts exactly; every statistic equal exactly is
  ``same``; otherwise min, max, mean and std within ``atol + rtol * M``, where ``M`` is the
  tensor's largest magnitude in either run (an element-wise error of ``rtol`` moves the mean or
  std by at most about that much), is ``close``. Low-precision statistics where both runs have
  them: ``amax`` within the same bound, and the fractions (``zero_fraction``, ``saturation``,
  ``underflow``, ``overflow``) within :data:`FRACTION_TOLERANCE`.
* ``metadata`` (level 3): shape and dtype, and the value of a non-tensor argument; equal
  metadata of a tensor is ``not compared`` (its values are unknown).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "FINGERPRINT",
    "FRACTION_TOLERANCE",
    "TOLERANCES",
    "compare_metadata",
    "compare_stats",
    "compare_tensors",
    "tolerance",
]

FINGERPRINT = "fingerprint"
"""The ``otel_gpu.stats`` event attribute holding a hash of the tensor's bytes (level 5 with
``OTEL_GPU_FINGERPRINT`` on; a statistics event without it is compared by its statistics)."""

TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "complex128": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "complex64": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "complex32": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float8_e4m3fn": (1.25e-1, 1e-3),
    "float8_e4m3fnuz": (1.25e-1, 1e-3),
    "float8_e5m2": (2.5e-1, 1e-3),
    "float8_e5m2fnuz": (2.5e-1, 1e-3),
}
"""Default ``(rtol, atol)`` per dtype: ``torch.testing.assert_close``'s for the wide types, a
step of the format's mantissa for float8; every other dtype (integers, bool) exactly."""
_EXACT = (0.0, 0.0)
_STATS = ("min", "max", "mean", "std", "amax")
_FRACTIONS = ("zero_fraction", "saturation", "underflow", "overflow")
FRACTION_TOLERANCE = 1e-3
"""How far two runs' low-precision fractions may be apart (0.1 percentage points): values
within tolerance of each other can still fall on either side of a threshold."""


def tolerance(
    dtype: Any, rtol: float | None = None, atol: float | None = None
) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype`` (``torch.float32`` or ``float32``), flags overriding."""
    default = TOLERANCES.get(str(dtype).removeprefix("torch."), _EXACT)
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def _result(tensor: str, status: str, method: str, **detail: Any) -> dict[str, Any]:
    return {"tensor": tensor, "status": status, "method": method, **detail}


def compare_metadata(tensor: str, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Shape and dtype of a tensor, or the value of another argument, in runs A and B."""
    if "dtype" in a and "dtype" in b:
        for key in ("dtype", "shape"):
            if a.get(key) != b.get(key):
                return _result(tensor, "differ", "metadata", a=a.get(key), b=b.get(key), field=key)
        return _result(tensor, "not compared", "metadata", why="no statistics or dump of it")
    if "value" in a and "value" in b:
        status = "same" if a["value"] == b["value"] else "differ"
        return _result(tensor, status, "metadata", a=a["value"], b=b["value"], field="value")
    return _result(tensor, "not compared", "metadata", why="not a tensor or a recorded value")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def compare_stats(
    tensor: str,
    a: dict[str, Any],
    b: dict[str, Any],
    dtype: Any,
    rtol: float | None = None,
    atol: float | None = None,
    fingerprints: bool = True,
) -> dict[str, Any]:
    """Two ``otel_gpu.stats`` events of one tensor (their attributes, the tensor name left out)."""
    both = FINGERPRINT in a and FINGERPRINT in b
    if fingerprints and both:
        if a[FINGERPRINT] == b[FINGERPRINT]:
            return _result(tensor, "same", "fingerprint")
        by_stats = _by_statistics(tensor, a, b, dtype, rtol, atol)
        return _result(tensor, "differ", "fingerprint", statistics=by_stats["status"])
    result = _by_statistics(tensor, a, b, dtype, rtol, atol)
    if result["status"] == "same" and both and a[FINGERPRINT] != b[FINGERPRINT]:
        # equal statistics, different bytes: within tolerance (zero), never "same"
        result.update(status="close", field="fingerprint", error=0.0)
    return result


def _by_statistics(
    tensor: str,
    a: dict[str, Any],
    b: dict[str, Any],
    dtype: Any,
    rtol: float | None,
    atol: float | None,
) -> dict[str, Any]:
    for key in ("numel", "nan_count", "inf_count"):
        if key in a and key in b and a[key] != b[key]:
            return _result(tensor, "differ", "statistics", field=key, a=a[key], b=b[key])
    present: dict[str, tuple[float, float]] = {}
    for k in _STATS:
        x, y = _number(a.get(k)), _number(b.get(k))
        if x is not None and y is not None:
            present[k] = (x, y)
    if not present:
        return _result(tensor, "not compared", "statistics", why="no statistic in both runs")
    r, t = tolerance(dtype, rtol, atol)
    # the largest finite magnitude: an infinity read from a file must not widen the bound
    extremes = [abs(x) for k in ("min", "max") for x in present.get(k, ())]
    extremes = [x for x in extremes if math.isfinite(x)] or [
        abs(x) for pair in present.values() for x in pair if math.isfinite(x)
    ]
    magnitude = max(extremes, default=0.0)
    bound = t + r * magnitude
    exact = all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in present.values())
    worst = None
    nearest: tuple[str, float] | None = None  # the largest difference within tolerance
    for key, (x, y) in present.items():
        if math.isnan(x) and math.isnan(y):
            continue
        error = (
            abs(x - y) if math.isfinite(x) and math.isfinite(y) else (0.0 if x == y else math.inf)
        )
        if not error <= bound and (worst is None or error > worst[1]):
            worst = (key, error)
        elif error > 0 and (nearest is None or error > nearest[1]):
            nearest = (key, error)
    if worst is not None:
        return _result(
            tensor, "differ", "statistics", field=worst[0], error=worst[1], tolerance=bound
        )
    for key in _FRACTIONS:
        x, y = _number(a.get(key)), _number(b.get(key))
        if x is None or y is None:
            continue
        if not abs(x - y) <= FRACTION_TOLERANCE:
            return _result(
                tensor,
                "differ",
                "statistics",
                field=key,
                error=abs(x - y),
                tolerance=FRACTION_TOLERANCE,
            )
        if x != y:
            exact = False
            if nearest is None:
                nearest = (key, abs(x - y))
    if exact and nearest is None:
        return _result(tensor, "same", "statistics")
    field, error = nearest if nearest is not None else ("", 0.0)
    return _result(tensor, "close", "statistics", field=field, error=error, tolerance=bound)


def compare_tensors(
    tensor: str, a: Any, b: Any, rtol: float | None = None, atol: float | None = None
) -> dict[str, Any]:
    """Two dumped tensors (torch), element by element; see the module's docstring."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return _result(
            tensor,
            "differ",
            "tensors",
            field="dtype" if a.dtype != b.dtype else "shape",
            a=f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}",
            b=f"{str(b.dtype).removeprefix('torch.')}{list(b.shape)}",
        )
    r, t = tolerance(a.dtype, rtol, atol)
    if a.numel() == 0:
        return _result(tensor, "same", "tensors", rtol=r, atol=t, numel=0)
    identical = _same_bytes(a, b)
    wide = torch.complex128 if a.is_complex() else torch.float64
    x, y = a.detach().to(wide).flatten(), b.detach().to(wide).flatten()
    nan = torch.isnan(x) | torch.isnan(y)
    both_nan = torch.isnan(x) & torch.isnan(y)
    same_inf = torch.isinf(x) & (x == y)
    error = torch.where(nan | same_inf, torch.zeros_like(x.real), (x - y).abs())
    mismatch = ((error > t + r * y.abs()) | (nan & ~both_nan)) & ~same_inf
    finite = torch.isfinite(error)
    max_abs = float(error[finite].max()) if bool(finite.any()) else math.inf
    scale = y.abs()
    rel = torch.where(scale > 0, error / scale.clamp_min(1e-300), (error > 0) * math.inf)
    ok = ~nan & torch.isfinite(x) & torch.isfinite(y)
    if a.is_complex():
        cos = torch.nn.functional.cosine_similarity(
            torch.view_as_real(x[ok]).flatten(), torch.view_as_real(y[ok]).flatten(), dim=0
        )
    else:
        cos = torch.tensor(_cosine(x[ok], y[ok]))
    count = int(mismatch.sum())
    return _result(
        tensor,
        "differ" if count else "same" if identical else "close",
        "tensors",
        max_abs_error=max_abs,
        max_rel_error=float(rel[ok].max()) if bool(ok.any()) else 0.0,
        mismatch_pct=100.0 * count / a.numel(),
        cosine_similarity=float(cos),
        rtol=r,
        atol=t,
    )


def _same_bytes(a: Any, b: Any) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (-0.0 is not 0.0, a NaN
    only a NaN of the same bits): "same" means bit-identical."""
    import torch

    x, y = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if x.dtype == torch.bool:
        return bool(torch.equal(x, y))
    return bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))


def _cosine(x: Any, y: Any) -> float:
    nx, ny = float(x.norm()), float(y.norm())
    if nx == 0.0 or ny == 0.0:
        return 1.0 if nx == ny else 0.0
    return float((x @ y) / (nx * ny))
