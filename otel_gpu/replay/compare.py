"""Replay's comparison of a re-run call with its recording: tolerances, max abs/rel differences.

Default tolerances per dtype are those of ``torch.testing.assert_close``; float8 types,
which it does not cover, get one unit in the last place at 1.0 as ``rtol``. Unlike
``assert_close``, NaN matches NaN: a NaN that was recorded and comes back is reproduced.

The default ``atol`` follows the recorded tensor's scale (its largest finite magnitude): in full
at scale 1 and above, as in ``assert_close``, proportionally less below it, so that outputs near
1e-3 are not all within an absolute 1e-5 of anything; never below the dtype's smallest normal
number (all-zero outputs). An ``atol`` given by the caller is absolute, as before.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from otel_gpu.recorder.manifest import type_ref
from otel_gpu.recorder.values import public_fields, pytree_children

__all__ = [
    "DEFAULT_TOLERANCES",
    "Mismatch",
    "compare",
    "compare_tensors",
    "scaled_atol",
    "tolerance",
]

DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex32: (1e-3, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}
"""(rtol, atol) per dtype; every other dtype (integers, bool) must match exactly."""
for _name, _rtol in (
    ("float8_e4m3fn", 0.125),
    ("float8_e4m3fnuz", 0.125),
    ("float8_e5m2", 0.25),
    ("float8_e5m2fnuz", 0.25),
):
    if hasattr(torch, _name):
        DEFAULT_TOLERANCES[getattr(torch, _name)] = (_rtol, 1e-5)


def tolerance(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype``: the flag when given, else the dtype's default."""
    default = DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def scaled_atol(atol: float, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """A dtype's default ``atol`` at the scale of ``expected``: ``atol * min(1, max |finite|)``,
    at least the smallest normal number of ``dtype`` (of its real part for a complex dtype)."""
    finite = expected.abs()[expected.isfinite()]
    scale = float(finite.max()) if finite.numel() else 0.0
    real = dtype.to_real() if dtype.is_complex else dtype
    floor = float(torch.finfo(real).tiny) if real.is_floating_point else 0.0
    return max(atol * min(1.0, scale), floor)


@dataclass
class Mismatch:
    """One output that differs from its recording.

    The ``nan_*``/``inf_*``/``finite_*`` counts say how many elements differ by being non-finite
    on one side only: such a difference has no size, so ``max_abs``/``max_rel`` cover the
    finite elements only and are None when no finite element differs.
    """

    output: str
    reason: str
    max_abs: float | None = None
    max_rel: float | None = None
    nan_where_finite: int = 0
    """Elements that are NaN now where the recording had a finite value."""
    inf_where_finite: int = 0
    """Elements that are infinite now where the recording had a finite value."""
    finite_where_nonfinite: int = 0
    """Elements that are finite now where the recording had NaN or an infinity."""
    nonfinite_changed: int = 0
    """Elements that are NaN or infinite on both sides, but not the same (NaN for Inf, -Inf for Inf)."""

    def describe(self) -> str:
        text = f"{self.output}: {self.reason}"
        if self.max_abs is not None:
            among = " among finite values" if self.nonfinite_count() else ""
            text += f"; max abs diff{among} {self.max_abs:.3g}, max rel diff {self.max_rel:.3g}"
        return text

    def nonfinite_count(self) -> int:
        """Elements that differ because one side is NaN or infinite and the other is not."""
        return (
            self.nan_where_finite
            + self.inf_where_finite
            + self.finite_where_nonfinite
            + self.nonfinite_changed
        )


def compare_tensors(
    path: str, expected: torch.Tensor, actual: Any, rtol: float | None, atol: float | None
) -> Mismatch | None:
    """None when ``actual`` matches ``expected`` within tolerance, else what differs and by how much."""
    if not isinstance(actual, torch.Tensor):
        return Mismatch(path, f"expected a tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(expected.shape):
        return Mismatch(path, f"shape {list(actual.shape)} != recorded {list(expected.shape)}")
    if actual.dtype != expected.dtype:
        return Mismatch(path, f"dtype {actual.dtype} != recorded {expected.dtype}")
    if expected.numel() == 0:
        return None
    a = actual.detach().to("cpu")
    e = expected.detach().to("cpu")
    rt, at = tolerance(e.dtype, rtol, atol)
    wide = torch.complex128 if e.is_complex() else torch.float64
    a64, e64 = a.to(wide), e.to(wide)
    if atol is None and at > 0:
        at = scaled_atol(at, e64, e.dtype)
    diff = (a64 - e64).abs()
    close = diff <= at + rt * e64.abs()
    if e.is_floating_point() or e.is_complex():
        close |= (a64.isnan() & e64.isnan()) | (a64 == e64)  # NaN reproduced; equal infinities
    if bool(close.all()):
        return None
    bad = ~close
    counts = _nonfinite_counts(a64, e64, bad)
    finite_bad = bad & a64.isfinite() & e64.isfinite()
    max_abs = max_rel = None
    if bool(finite_bad.any()):  # a size only where both sides are numbers
        both = a64.isfinite() & e64.isfinite()
        max_abs = float(diff[both].max())
        rel = (diff / e64.abs())[both]
        rel = rel[rel.isfinite()]
        max_rel = float(rel.max()) if rel.numel() else math.inf
    reason = f"{int(bad.sum())} of {e.numel()} elements differ (rtol={rt:g}, atol={at:g})"
    said = [f"{n} {what}" for what, n in zip(_NONFINITE_WORDS, counts) if n]
    if said:
        reason += ": " + ", ".join(said)
    return Mismatch(path, reason, max_abs, max_rel, *counts)


_NONFINITE_WORDS = (
    "NaN where the recording had finite values",
    "Inf where the recording had finite values",
    "finite values where the recording had NaN/Inf",
    "NaN/Inf other than the recorded NaN/Inf",
)


def _nonfinite_counts(
    a: torch.Tensor, e: torch.Tensor, bad: torch.Tensor
) -> tuple[int, int, int, int]:
    """Among the differing elements: NaN now (recorded finite), Inf now (recorded finite),
    finite now (recorded NaN/Inf), and non-finite on both sides but not the same."""
    a_nan, a_inf = a.isnan(), a.isinf()
    a_fin, e_fin = a.isfinite(), e.isfinite()
    return (
        int((bad & a_nan & e_fin).sum()),
        int((bad & a_inf & e_fin).sum()),
        int((bad & a_fin & ~e_fin).sum()),
        int((bad & ~a_fin & ~e_fin).sum()),
    )


def compare(
    enc: dict[str, Any],
    actual: Any,
    expected: dict[str, torch.Tensor],
    path: str,
    tol: tuple[float | None, float | None],
    map_device: Callable[[str], str],
    out: list[Mismatch],
    unchecked: list[str],
) -> None:
    """Walk the recorded (encoded) value and ``actual`` together, leaf by leaf.

    Differences go to ``out``; parts that were not recorded, and so were not compared, go to
    ``unchecked`` with the reason (a pass must never be claimed for them).
    """
    tag = enc.get("t")
    recurse = functools.partial(
        compare,
        expected=expected,
        tol=tol,
        map_device=map_device,
        out=out,
        unchecked=unchecked,
    )
    if tag == "tensor":
        tensor = expected.get(enc.get("key", ""))
        if tensor is None:
            unchecked.append(f"{path}: the tensor is missing from the outputs file")
            return
        found = compare_tensors(path, tensor, actual, *tol)
        if found is not None:
            out.append(found)
    elif tag in ("list", "tuple", "namedtuple", "size"):
        items: list[Any] = (
            enc.get("items") or [] if tag != "size" else [{"t": "int", "v": v} for v in enc["v"]]
        )
        want = list if tag == "list" else tuple
        if not isinstance(actual, want):
            out.append(Mismatch(path, f"expected a {tag}, got {type(actual).__name__}"))
        elif len(actual) != len(items):
            out.append(Mismatch(path, f"length {len(actual)} != recorded {len(items)}"))
        else:
            for i, (item, value) in enumerate(zip(items, actual)):
                recurse(item, value, path=f"{path}[{i}]")
    elif tag in ("dict", "mapping"):
        if not isinstance(actual, Mapping) or (
            tag == "mapping" and type_ref(type(actual)) != enc.get("type")
        ):
            wanted = "a dict" if tag == "dict" else f"a {enc.get('type')}"
            out.append(Mismatch(path, f"expected {wanted}, got {type_ref(type(actual))}"))
            return
        keys = {_plain(k): v for k, v in enc.get("items", [])}
        got = {_plain_key(k): v for k, v in actual.items()}
        if set(keys) != set(got):
            now, recorded = sorted(map(repr, got)), sorted(map(repr, keys))
            out.append(Mismatch(path, f"keys {now} != recorded {recorded}"))
            return
        for key, item in keys.items():
            recurse(item, got[key], path=f"{path}[{key!r}]")
    elif tag in ("pytree", "object"):
        if type_ref(type(actual)) != enc.get("type"):
            out.append(
                Mismatch(path, f"expected a {enc.get('type')}, got {type_ref(type(actual))}")
            )
            return
        if tag == "pytree":
            children = dict(pytree_children(actual) or [])
        else:
            children = dict(public_fields(actual) or [])
        pairs = enc.get("items" if tag == "pytree" else "fields") or []
        recorded_keys = [k for k, _ in pairs]
        if tag == "pytree" and sorted(children) != sorted(recorded_keys):
            out.append(
                Mismatch(path, f"keys {sorted(children)} != recorded {sorted(recorded_keys)}")
            )
            return
        for key, item in pairs:
            if key not in children:
                out.append(Mismatch(f"{path}.{key}", "attribute missing on replay"))
                continue
            recurse(item, children[key], path=f"{path}.{key}")
    elif tag == "from_dict":
        to_dict = getattr(actual, "to_dict", None)
        if type_ref(type(actual)) != enc.get("type") or not callable(to_dict):
            out.append(
                Mismatch(path, f"expected a {enc.get('type')}, got {type_ref(type(actual))}")
            )
        elif to_dict() != enc.get("v"):
            out.append(Mismatch(path, f"{enc.get('type')}.to_dict() differs from the recording"))
    elif tag == "unsupported":
        unchecked.append(f"{path}: a {enc.get('type')} ({enc.get('why', 'not recorded')})")
    elif tag == "redacted":
        unchecked.append(f"{path}: redacted when recorded (OTEL_GPU_REDACT)")
    elif not _same_scalar(enc, actual, tol, map_device):
        out.append(Mismatch(path, f"{_short(actual)} != recorded {_short(_plain(enc))}"))


def _same_scalar(
    enc: dict[str, Any],
    actual: Any,
    tol: tuple[float | None, float | None],
    map_device: Callable[[str], str],
) -> bool:
    tag = enc.get("t")
    if tag == "float":
        if type(actual) is not float:
            return False
        want = float(enc["v"])
        if math.isnan(want) or math.isnan(actual):
            return math.isnan(want) and math.isnan(actual)
        rt, at = tolerance(torch.float64, *tol)
        return abs(actual - want) <= at + rt * abs(want)
    if tag == "enum":
        return (
            isinstance(actual, enum.Enum)
            and type_ref(type(actual)) == enc["type"]
            and actual.name == enc["name"]
        )
    if tag == "dtype":
        return isinstance(actual, torch.dtype) and str(actual).removeprefix("torch.") == enc["v"]
    if tag == "device":
        return isinstance(actual, torch.device) and str(actual) == map_device(enc["v"])
    if tag == "none":
        return actual is None
    if tag == "type":
        return isinstance(actual, type) and type_ref(actual) == enc.get("v")
    return type(actual).__name__ == tag and actual == enc.get("v")


def _plain(enc: dict[str, Any]) -> Any:
    """A scalar recorded value as a plain Python value (dict keys, messages)."""
    tag = enc.get("t")
    if tag == "none":
        return None
    if tag == "float":
        return float(enc["v"])
    if tag == "enum":
        return f"{enc['type']}.{enc['name']}"
    return enc.get("v", f"<{tag}>")


def _plain_key(key: Any) -> Any:
    """A returned dict key in the form :func:`_plain` gives recorded keys."""
    if isinstance(key, enum.Enum):
        return f"{type_ref(type(key))}.{key.name}"
    return key


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
