"""Hostile arguments and exceptions cost the caller nothing, at every level, ring on or off.

Each payload is user code that otel-gpu could be tempted to run on the caller's thread: a
``__repr__`` raising ``SystemExit`` or sleeping 5 s, a million-item list, a list whose
``__len__``/``__iter__`` raise or sleep, a dict key whose ``__hash__``/``__eq__`` raise, and
exceptions whose ``__traceback__``, ``__str__``, ``__repr__`` or ``__class__`` misbehave. The
promises: the caller gets its own result, or its own exception object (``is``); a call with a
5 s hook returns well before 5 s; a million-item list is recorded cut, in a small manifest that
says so. Strict mode stays on: a guarded internal error would fail these tests.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from typing import Any

import pytest
import torch

import otel_gpu
from otel_gpu.calls import describe as _describe
from otel_gpu.recorder import manifest as _manifest
from otel_gpu.recorder import values

SLEEP_S = 5.0
BOUND_S = 1.0  # behavioural bound: "returns well before the 5 s hook would end"

# (level, OTEL_GPU_RING): the ring serves levels >= 3; level 10 also runs the flight recorder
CONFIGS = [(1, 0), (3, 4), (5, 4), (10, 0), (10, 4)]
CONFIG_IDS = [f"level{lv}-ring{r}" for lv, r in CONFIGS]


class ReprExits:
    def __repr__(self) -> str:
        raise SystemExit(3)


class ReprSleeps:
    def __repr__(self) -> str:
        time.sleep(SLEEP_S)
        return "ReprSleeps()"


class LenIterExit(list):
    def __len__(self) -> int:
        raise SystemExit("hostile __len__")

    def __iter__(self) -> Any:
        raise SystemExit("hostile __iter__")

    def __repr__(self) -> str:
        raise SystemExit("hostile __repr__")


class LenIterSleep(list):
    def __len__(self) -> int:
        time.sleep(SLEEP_S)
        return 0

    def __iter__(self) -> Any:
        time.sleep(SLEEP_S)
        return iter(())

    def __repr__(self) -> str:
        time.sleep(SLEEP_S)
        return "LenIterSleep()"


class KeyHostile:
    """Hashable while the dict is built, hostile afterwards."""

    armed = False

    def __hash__(self) -> int:
        if self.armed:
            raise SystemExit("hostile __hash__")
        return 1

    def __eq__(self, other: object) -> bool:
        raise SystemExit("hostile __eq__")


def _hostile_dict() -> dict:
    key = KeyHostile()
    d = {key: torch.ones(2)}
    key.armed = True
    return d


PAYLOADS = {
    "repr raises SystemExit": ReprExits,
    "repr sleeps 5 s": ReprSleeps,
    "1,000,000-item list": lambda: list(range(1_000_000)),
    "list whose __len__/__iter__/__repr__ raise SystemExit": lambda: LenIterExit([1, 2]),
    "list whose __len__/__iter__/__repr__ sleep 5 s": lambda: LenIterSleep([1, 2]),
    "dict key whose __hash__/__eq__ raise SystemExit": _hostile_dict,
}


@pytest.fixture
def fresh_describer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A describer of the test's own: one left busy by another test's 5 s repr is not reused."""
    monkeypatch.setattr(_describe, "_describer", None)


def _start(otel_gpu_spans: Any, tmp_path: Any, level: int, ring: int) -> Any:
    extra = {"ring": ring} if ring else {}
    return otel_gpu_spans(level=level, strict=True, dump_dir=str(tmp_path / "dumps"), **extra)


@pytest.mark.parametrize(("level", "ring"), CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("payload", list(PAYLOADS), ids=list(PAYLOADS))
def test_a_hostile_argument_costs_the_caller_nothing(
    otel_gpu_spans: Any, tmp_path: Any, level: int, ring: int, payload: str, fresh_describer: None
) -> None:
    """Attack: an argument whose hooks raise SystemExit, sleep 5 s, or hold a million items.
    The call returns the function's own result object, within 1 s, and its span is exported."""
    spans = _start(otel_gpu_spans, tmp_path, level, ring)

    @otel_gpu.api
    def op(x: Any, t: torch.Tensor) -> Any:
        return result

    result = object()
    value = PAYLOADS[payload]()
    t0 = time.perf_counter()
    for _ in range(3):
        assert op(value, torch.ones(3)) is result
    elapsed = time.perf_counter() - t0
    assert elapsed < BOUND_S, f"3 calls took {elapsed:.2f} s"
    assert len(spans.get()) == 3


def _manifests(root: Any) -> list[tuple[int, dict[str, Any]]]:
    out = []
    for path in sorted(
        glob.glob(os.path.join(str(root), "**", _manifest.MANIFEST), recursive=True)
    ):
        with open(path, encoding="utf-8") as f:
            out.append((os.path.getsize(path), json.load(f)))
    return out


@pytest.mark.parametrize("ring", [0, 4], ids=["recorder", "recorder+ring"])
def test_a_million_item_list_is_recorded_cut_in_a_small_manifest(
    otel_gpu_spans: Any, tmp_path: Any, ring: int
) -> None:
    """Attack: a 1,000,000-item list argument at level 10 (it once wrote a 50 MB manifest over
    30 s). The manifest stays under 256 KiB and records the cut: the length and the first
    1000 items, as ``unsupported`` so replay skips the call and says why."""
    _start(otel_gpu_spans, tmp_path, 10, ring)

    @otel_gpu.api
    def op(x: Any) -> int:
        return 0

    big = list(range(1_000_000))
    assert op(big) == 0
    otel_gpu.flush()
    ((size, manifest),) = _manifests(tmp_path / "dumps")
    assert size < 256 * 1024
    (param,) = manifest["params"]
    value = param["value"]
    assert value["t"] == "unsupported" and value["truncated"] == 1_000_000
    assert value["container"] == "list" and len(value["items"]) == _manifest.MAX_ITEMS
    assert value["items"][999] == {"t": "int", "v": 999}
    assert "cut at 1000 of 1000000 items when recorded" in value["why"]


def test_the_ring_records_a_million_item_list_cut(otel_gpu_spans: Any, tmp_path: Any) -> None:
    """Attack: a 1,000,000-item list passed to a call that raises, ring on at level 3: the ring
    dump's manifest is small and records the cut, and the caller gets its own exception."""
    _start(otel_gpu_spans, tmp_path, 3, 4)
    boom = ValueError("boom")

    @otel_gpu.api
    def op(x: Any) -> int:
        raise boom

    with pytest.raises(ValueError) as info:
        op(list(range(1_000_000)))
    assert info.value is boom
    ((size, manifest),) = _manifests(tmp_path / "dumps")
    assert size < 256 * 1024
    assert manifest["params"][0]["value"]["truncated"] == 1_000_000


def test_the_byte_budget_cuts_a_huge_string(otel_gpu_spans: Any, tmp_path: Any) -> None:
    """Attack: a 5 MB string argument at level 10: left out past the 1 MiB budget, and said so."""
    _start(otel_gpu_spans, tmp_path, 10, 0)

    @otel_gpu.api
    def op(s: str) -> int:
        return 1

    assert op("x" * 5_000_000) == 1
    otel_gpu.flush()
    ((size, manifest),) = _manifests(tmp_path / "dumps")
    assert size < 64 * 1024
    value = manifest["params"][0]["value"]
    assert value["t"] == "unsupported" and value["truncated"] is True
    assert "a str of 5000000 characters" in value["why"]


# --------------------------------------------------------------------------- exceptions


class TracebackRaises(Exception):
    @property  # type: ignore[override]
    def __traceback__(self) -> Any:
        raise RuntimeError("hostile __traceback__")

    @__traceback__.setter
    def __traceback__(self, value: Any) -> None:
        pass


class StrExits(Exception):
    def __str__(self) -> str:
        raise SystemExit("hostile __str__")

    def __repr__(self) -> str:
        raise SystemExit("hostile __repr__")


class StrSleeps(Exception):
    def __str__(self) -> str:
        time.sleep(SLEEP_S)
        return "slow"

    def __repr__(self) -> str:
        time.sleep(SLEEP_S)
        return "slow"


class ClassLies(Exception):
    @property  # type: ignore[override]
    def __class__(self) -> type:
        raise SystemExit("hostile __class__")


EXCEPTIONS = {
    "__traceback__ property raises": lambda: TracebackRaises("x"),
    "__str__/__repr__ raise SystemExit": lambda: StrExits("x"),
    "__str__/__repr__ sleep 5 s": lambda: StrSleeps("x"),
    "__class__ property raises SystemExit": lambda: ClassLies("x"),
    "KeyboardInterrupt raised by the function itself": KeyboardInterrupt,
}


@pytest.mark.parametrize(("level", "ring"), CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("kind", list(EXCEPTIONS), ids=list(EXCEPTIONS))
def test_the_caller_gets_its_own_exception_object(
    otel_gpu_spans: Any, tmp_path: Any, level: int, ring: int, kind: str, fresh_describer: None
) -> None:
    """Attack: an exception whose __traceback__, __str__, __repr__ or __class__ misbehave (and a
    KeyboardInterrupt from the function): the caller gets the very same object, within 1 s."""
    _start(otel_gpu_spans, tmp_path, level, ring)
    exc = EXCEPTIONS[kind]()

    @otel_gpu.api
    def op(t: torch.Tensor) -> None:
        raise exc

    t0 = time.perf_counter()
    try:
        op(torch.ones(2))
    except BaseException as got:  # KeyboardInterrupt included: it must pass through untouched
        assert got is exc
    else:
        pytest.fail("the exception did not reach the caller")
    assert time.perf_counter() - t0 < BOUND_S


def test_a_raised_exceptions_message_is_recorded_off_the_callers_thread(
    otel_gpu_spans: Any, tmp_path: Any, fresh_describer: None
) -> None:
    """An ordinary exception at level 10: the manifest holds its message and traceback (formatted
    by the describer within its 50 ms wait), so nothing is lost for well-behaved exceptions."""
    _start(otel_gpu_spans, tmp_path, 10, 0)

    @otel_gpu.api
    def op(t: torch.Tensor) -> None:
        raise ValueError("plain message")

    with pytest.raises(ValueError):
        op(torch.ones(2))
    otel_gpu.flush()
    ((_, manifest),) = _manifests(tmp_path / "dumps")
    exception = manifest["exception"]
    assert exception["type"] == "builtins.ValueError"
    assert exception["message"] == "plain message"
    assert "ValueError: plain message" in exception["traceback"]


def test_a_slow_exception_message_does_not_hold_the_export_thread(
    otel_gpu_spans: Any, tmp_path: Any, fresh_describer: None
) -> None:
    """Attack: six calls raise an exception whose __str__ sleeps 5 s. The export thread formats
    exception text through the describer, within its 0.5 s budget: the six spans are exported in
    well under one sleep (it used to take 6 x 5 s), and their message says it was not formatted
    in time instead of holding text nobody checked."""
    spans = _start(otel_gpu_spans, tmp_path, 1, 0)

    @otel_gpu.api
    def op(exc: BaseException) -> None:
        raise exc

    for _ in range(6):
        with pytest.raises(StrSleeps):
            op(StrSleeps("x"))
    t0 = time.perf_counter()
    exported = spans.get()
    elapsed = time.perf_counter() - t0
    assert len(exported) == 6
    assert elapsed < SLEEP_S, f"exporting took {elapsed:.1f} s"
    messages = [
        e.attributes["exception.message"]
        for s in exported
        for e in s.events
        if e.name == "exception"
    ]
    assert len(messages) == 6
    assert all(m.startswith("<not") and "slow" not in m for m in messages), messages


# --------------------------------------------------------------------------- the describer


def test_the_describer_fills_in_a_description_after_the_call(fresh_describer: None) -> None:
    """An unsupported argument is recorded by type and id on the caller's thread; its
    description arrives later, formatted without running its ``__repr__`` (user code that
    could end the process): one raising SystemExit is never called."""

    class Nice:
        def __repr__(self) -> str:
            return "Nice(" + "n" * 500 + ")"

    enc = values.Encoder("input.", {}, {})
    nice = enc.encode(Nice(), "x")
    exits = enc.encode(ReprExits(), "y")
    listed = enc.encode(LenIterExit([1, 2]), "z")
    assert nice["type"].endswith("Nice") and nice["id"].startswith("0x")
    assert _describe.drain(5.0)
    assert "Nice object at 0x" in nice["repr"] and "nnn" not in nice["repr"]
    assert "ReprExits object at 0x" in exits["repr"]
    assert listed["repr"] == "LenIterExit([1, 2])"


class SlowError(Exception):
    def __str__(self) -> str:
        time.sleep(_describe.BUDGET_S + 0.3)
        return "slow"


class ExitError(Exception):
    def __str__(self) -> str:
        raise SystemExit("hostile __str__")


def test_a_description_over_budget_is_recorded_as_timed_out(fresh_describer: None) -> None:
    """Attack: an exception whose ``__str__`` is slower than the 0.5 s budget. Its record says
    it timed out, records queued behind it are not described, and its type is never described
    again in the process."""
    slow = _describe.exception_record(SlowError(), None, wait=0.0)
    behind = _describe.exception_record(ExitError(), None, wait=0.0)
    assert _describe.drain(5.0)
    assert slow["traceback"].startswith("<not described: took")
    assert behind["traceback"] == "<not described: queued behind a description that timed out>"
    again = _describe.exception_record(SlowError(), None, wait=0.0)
    assert again["traceback"].startswith("<not described: describing a")


# --------------------------------------------------------------------------- jagged tensors


@pytest.mark.parametrize("level", [3, 5])
def test_jagged_nested_tensors_give_no_sdk_warning(
    otel_gpu_spans: Any, caplog: pytest.LogCaptureFixture, level: int
) -> None:
    """A jagged nested tensor (symbolic size ``j1``) once put a SymInt into the shape array: two
    "Invalid type" SDK warnings per call. Its shape and stride are now string arrays."""
    spans = otel_gpu_spans(level=level)

    @otel_gpu.api
    def op(x: torch.Tensor) -> torch.Tensor:
        return x

    nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
    with caplog.at_level(logging.WARNING, logger="opentelemetry"):
        op(nt)
        (span,) = spans.get()
    sdk = [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert sdk == []
    batch, ragged, inner = span.attributes["otel_gpu.input.x.shape"]
    assert (batch, inner) == ("2", "3") and ragged.startswith("j")
    assert all(type(s) is str for s in span.attributes["otel_gpu.output.0.stride"])
