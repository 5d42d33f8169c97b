"""Fault injection: hostile argument values, property-based (hypothesis), strict mode OFF.

Arguments are drawn from tensor subclasses; meta, sparse (COO and CSR), quantized,
nested, complex, fp8 and bool tensors; 0-d, empty, non-contiguous and
requires-grad tensors with NaN/Inf; huge, deep and self-referencing containers;
and objects whose ``__repr__`` raises, returns a non-string, is huge or is slow,
whose ``__getattr__``/``__eq__``/``__hash__`` raise (containers whose ``__len__`` or
``__iter__`` raise have a test of their own: those hooks never run). For every example at levels
3 and 5 (crash journal on) the promises are: nothing escapes into the caller,
the result is the very object the function returned, and the call's span keeps
every attribute value within 2048 bytes and the attribute count within the
provider's limit.

Reproduce the figures: ``pytest tests/test_faults_hostile.py -s -q``.
"""

from __future__ import annotations

import collections
import enum
import json
import threading
import time
from collections import Counter
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import otel_gpu
from otel_gpu import _guard

EXAMPLES = 150
MAX_VALUE_BYTES = 2048
CALLER = threading.get_ident()

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # quantized/nested: deprecations


# --------------------------------------------------------------------------- hostile objects

repr_threads: list[int] = []
in_call = threading.Event()  # set while the caller is inside the decorated call


class Hostile:
    """Base of the hostile objects: records the threads that ran a __repr__ during a call.

    (``spans.get()`` flushes, and a flush materialises spans on the flushing thread: reprs run
    there are not on the call path.)
    """

    def _seen(self) -> None:
        if in_call.is_set():
            repr_threads.append(threading.get_ident())


class ReprRaises(Hostile):
    def __init__(self, exc: type[Exception]) -> None:
        self.exc = exc

    def __repr__(self) -> str:
        self._seen()
        raise self.exc("hostile __repr__")


class ReprNotStr(Hostile):
    def __repr__(self) -> Any:
        self._seen()
        return 42


class ReprHuge(Hostile):
    def __repr__(self) -> str:
        self._seen()
        return "é" * 200_000


class ReprSlow(Hostile):
    def __repr__(self) -> str:
        self._seen()
        time.sleep(0.02)
        return "slow"


class LenRaises(list):
    def __len__(self) -> int:
        raise RuntimeError("hostile __len__")


class GetattrRaises(Hostile):
    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"hostile __getattr__({name})")


class MappingRaises(collections.abc.Mapping):
    def __getitem__(self, key: Any) -> Any:
        raise RuntimeError("hostile __getitem__")

    def __iter__(self) -> Any:
        raise RuntimeError("hostile __iter__")

    def __len__(self) -> int:
        return 3


class EqHashRaises(Hostile):
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("hostile __eq__")

    def __hash__(self) -> int:
        raise RuntimeError("hostile __hash__")

    def __repr__(self) -> str:
        self._seen()
        return "EqHashRaises()"


class Pair(NamedTuple):
    left: Any
    right: Any


class Color(enum.Enum):
    RED = 1


class Sub(torch.Tensor):
    pass


class Weird(torch.Tensor):
    """A subclass whose every torch function fails except the metadata getters."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__get__", "size", "stride", "dim", "is_contiguous"):
            return super().__torch_function__(func, types, args, kwargs or {})
        raise RuntimeError(f"hostile tensor subclass: {func}")


# --------------------------------------------------------------------------- strategies

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
KINDS = [
    "plain",
    "meta",
    "noncontig",
    "grad",
    "subclass",
    "weird",
    "sparse",
    "csr",
    "quantized",
    "nested",
    "expanded",
    "zero_d",
]
FILL = [0.0, 1.0, -3.5, 1e30, float("nan"), float("inf"), float("-inf")]


def make_tensor(dtype: torch.dtype, shape: list[int], kind: str, fill: float) -> torch.Tensor:
    base = (
        torch.full(shape, fill).to(dtype)
        if dtype.is_floating_point or dtype.is_complex
        else (torch.zeros(shape, dtype=dtype))
    )
    if kind == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if kind == "noncontig" and base.dim() >= 2:
        return base.transpose(0, 1)
    if kind == "grad" and (dtype.is_floating_point and dtype.itemsize >= 2):
        return torch.full(shape, fill, dtype=torch.float32).requires_grad_()
    if kind == "subclass":
        return base.as_subclass(Sub)
    if kind == "weird":
        return torch.ones(shape).as_subclass(Weird)
    if kind == "sparse" and base.dim() >= 1 and dtype in (torch.float32, torch.float64):
        return base.to_sparse()
    if kind == "csr" and base.dim() == 2 and dtype in (torch.float32, torch.float64):
        return base.to_sparse_csr()
    if kind == "quantized":
        return torch.quantize_per_tensor(torch.full(shape, 1.0), 0.1, 0, torch.quint8)
    if kind == "nested":
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    if kind == "expanded" and base.dim() >= 1:
        return torch.ones(1, dtype=dtype).expand(*shape)
    if kind == "zero_d":
        return torch.tensor(fill).to(dtype) if dtype.is_floating_point else torch.tensor(1)
    return base


tensors = st.builds(
    make_tensor,
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 4), max_size=4),
    st.sampled_from(KINDS),
    st.sampled_from(FILL),
)


def _self_list() -> list:
    x: list = [1]
    x.append(x)
    return x


def _self_dict() -> dict:
    x: dict = {"a": 1}
    x["self"] = x
    return x


def _deep(n: int) -> list:
    x: list = []
    for _ in range(n):
        x = [x]
    return x


hostile_objects = st.one_of(
    st.sampled_from([ValueError, RuntimeError, TypeError, RecursionError]).map(ReprRaises),
    st.builds(ReprNotStr),
    st.builds(ReprHuge),
    st.builds(ReprSlow),
    st.builds(GetattrRaises),
    st.builds(EqHashRaises),
    st.builds(lambda: list(range(200_000))),
    st.builds(lambda: dict.fromkeys(range(50_000), 0)),
    st.builds(lambda: set(range(10_000))),
    st.builds(_self_list),
    st.builds(_self_dict),
    st.integers(1, 300).map(_deep),
    st.builds(lambda: "x" * 1_000_000),
    st.builds(lambda: b"\xff" * 100_000),
    st.builds(object),
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3000),
    st.binary(max_size=100),
    st.sampled_from([Color.RED, torch.float16, torch.device("meta"), torch.device("cpu")]),
)

leaves = st.one_of(tensors, hostile_objects, scalars)
values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=12),
        st.tuples(children, children),
        st.builds(Pair, children, children),
        st.dictionaries(st.text(max_size=20), children, max_size=12),
    ),
    max_leaves=12,
)
keywords = st.dictionaries(
    st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True), values, max_size=4
)


# --------------------------------------------------------------------------- checks


def _value_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (list, tuple)):
        return max((_value_bytes(v) for v in value), default=0)
    return len(json.dumps(value))


def check_span(span: Any, limit: int) -> None:
    attrs = dict(span.attributes)
    assert len(attrs) <= limit, f"{len(attrs)} attributes > limit {limit}"
    for key, value in attrs.items():
        assert _value_bytes(value) <= MAX_VALUE_BYTES, f"{key}: {len(str(value))} chars"
    for event in span.events:
        for key, value in (event.attributes or {}).items():
            assert _value_bytes(value) <= MAX_VALUE_BYTES, f"event {event.name} {key}"


@pytest.mark.parametrize("level", [3, 5])
def test_hostile_arguments_never_escape_and_spans_stay_within_limits(otel_gpu_spans, level):
    """Property (EXAMPLES per level, strict mode off, journal on): the call returns the function's
    own result object, nothing is raised into the caller, user __repr__ never runs on the
    caller's thread, and every span keeps values <= 2048 bytes and count <= the limit (128).

    Figure: examples run, 0 escapes, spans produced, internal errors by kind (each logged once).
    """
    spans = otel_gpu_spans(level=level, strict=False)
    _guard.set_strict(False)

    @otel_gpu.api
    def op(a, b=None, *rest, secret_token=None, **kw):
        return a

    tally: Counter[str] = Counter()
    repr_threads.clear()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(a=values, b=values, rest=st.lists(values, max_size=3), kw=keywords)
    def check(a, b, rest, kw):
        spans.clear()
        kw.pop("a", None), kw.pop("b", None), kw.pop("secret_token", None)
        in_call.set()
        try:
            result = op(a, b, *rest, secret_token="s3cr3t", **kw)
        except BaseException as exc:  # an escape is the failure we look for
            tally["escapes"] += 1
            raise AssertionError(f"escaped into the caller: {exc!r}") from exc
        finally:
            in_call.clear()
        assert result is a
        got = spans.get()
        tally["examples"] += 1
        tally["spans"] += len(got)
        for span in got:
            check_span(span, 128)

    check()
    assert CALLER not in repr_threads, "a user __repr__ ran on the caller's thread"
    errors = _guard.internal_error_counts()
    print(
        f"\n[figure] level {level}: {tally['examples']} hypothesis examples, "
        f"{tally['escapes']} escapes, {tally['spans']} spans within limits; "
        f"internal errors (logged once per kind): {dict(errors) or 'none'}"
    )
    assert tally["escapes"] == 0 and tally["examples"] >= EXAMPLES


def test_containers_whose_len_or_iter_raise_cost_nothing(otel_gpu_spans, caplog):
    """A list whose __len__ raises and a Mapping whose __iter__ raises (strict mode off): their
    hooks never run on the caller's thread, so the call returns its result, its span is exported
    with the list read through list's own methods and the Mapping by type, and no internal
    error happens."""
    spans = otel_gpu_spans(level=3, strict=False)
    _guard.set_strict(False)

    @otel_gpu.api
    def op(x, y=None):
        return x

    hostile = [LenRaises([1, 2]), MappingRaises()]
    with caplog.at_level("WARNING", logger="otel_gpu"):
        for i in range(50):
            value = hostile[i % 2]
            assert op(value, y=i) is value
    assert len(spans.get()) == 50
    got = spans.get()
    assert len(got) == 50
    assert got[0].attributes["otel_gpu.input.x.length"] == 2  # list.__len__, not the hostile one
    assert got[1].attributes["otel_gpu.input.x.type"] == "MappingRaises"
    assert "metadata" not in _guard.internal_error_counts()


def test_a_slow_repr_never_delays_the_caller(otel_gpu_spans):
    """An argument whose __repr__ takes 2 s: the call returns at once and its span arrives, recorded
    by type and id (the repr of a mutable object is never taken, on any thread)."""
    spans = otel_gpu_spans(level=3, strict=False)

    class Slow:
        def __repr__(self):
            time.sleep(2.0)
            return "Slow()"

    @otel_gpu.api
    def op(x):
        return 1

    t0 = time.perf_counter()
    op(Slow())
    for i in range(100):
        op(i)
    caller_s = time.perf_counter() - t0
    assert caller_s < 0.5
    got = spans.get()
    assert len(got) == 101
    (slow,) = [s for s in got if s.attributes.get("otel_gpu.input.x.type", "").endswith("Slow")]
    assert "otel_gpu.input.x.repr" not in slow.attributes
    assert slow.attributes["otel_gpu.input.x.id"].startswith("0x")
    print(f"\n[figure] 101 calls, one with a 2 s __repr__: caller spent {caller_s * 1e3:.1f} ms")


def test_an_int_of_any_size_still_yields_its_span(otel_gpu_spans):
    """``op(10**5000)`` returns normally and its span is exported with a bounded value."""
    spans = otel_gpu_spans(level=3, strict=True)

    @otel_gpu.api
    def op(n):
        return 0

    assert op(10**5000) == 0
    (span,) = spans.get()
    assert len(span.attributes["otel_gpu.input.n.value"]) <= MAX_VALUE_BYTES


def test_dict_keys_are_never_formatted_on_the_callers_thread(otel_gpu_spans):
    """A dict argument whose key's __repr__ raises: no user __repr__ on the caller's thread and the
    call's input metadata is still recorded (strict mode makes an internal error fail here)."""
    spans = otel_gpu_spans(level=3, strict=True)
    repr_threads.clear()

    @otel_gpu.api
    def op(mapping):
        return 0

    in_call.set()
    try:
        assert op({ReprRaises(ValueError): 1, "ok": 2}) == 0
    finally:
        in_call.clear()
    assert CALLER not in repr_threads
    (span,) = spans.get()
    assert span.attributes["otel_gpu.input.mapping.ok.value"] == 2


def test_attribute_keys_stay_bounded(otel_gpu_spans):
    """A dict argument with a 100 kB key does not produce a 100 kB attribute name."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def op(mapping):
        return mapping

    op({"k" * 100_000: 1})
    (span,) = spans.get()
    assert max(len(k) for k in span.attributes) <= MAX_VALUE_BYTES


def test_a_repr_raising_a_base_exception_does_not_stop_the_export_thread(otel_gpu_spans):
    """After an argument whose __repr__ raises SystemExit, later calls' spans are still exported
    by the export thread (without an explicit flush)."""
    spans = otel_gpu_spans(level=3, strict=False)
    _guard.set_strict(False)

    class Exits:
        def __repr__(self):
            raise SystemExit("hostile")

    @otel_gpu.api
    def op(x):
        return 1

    op(Exits())
    time.sleep(0.3)
    for i in range(5):
        op(i)
    time.sleep(0.5)  # the export thread wakes every 100 ms
    assert len(spans.exporter.get_finished_spans()) >= 5
