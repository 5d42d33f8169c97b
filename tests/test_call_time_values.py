"""A span describes the call as it was: values are taken at call time, and every destination agrees.

Non-tensor arguments are recorded on the caller's thread: scalars, strings, enums and dtypes as
values; an object's repr only when its type is immutable (so the repr cannot change before the
span is exported); any other object as its type and id.
"""

from __future__ import annotations

import dataclasses
import decimal
import enum
import fractions

import numpy as np
import torch
from jsonl_spans import read_spans

import otel_gpu


class Mode(enum.Enum):
    OPTION_A = 0
    OPTION_B = 1


class Layout(enum.Enum):
    NHD = "nhd"


class Counter:
    """A mutable argument, as a caller might change it after the call returns."""

    def __init__(self) -> None:
        self.n = 0

    def __repr__(self) -> str:
        return f"Counter(n={self.n})"


@dataclasses.dataclass(frozen=True)
class Tile:
    rows: int
    cols: int
    mode: Mode = Mode.OPTION_A


@dataclasses.dataclass(frozen=True)
class Holder:
    items: list


def test_a_mutable_argument_changed_after_the_call_is_never_shown_with_its_later_value(
    tmp_path, capsys
):
    """The issue's case: a counter with n=0 at the call, n=42 after it. No destination may show
    n=42; the JSON Lines file and the console both show the type and the same id."""
    path = tmp_path / "t.jsonl"
    otel_gpu.configure(level=3, dest=f"stdout,{path}", provider="own", color="never")

    @otel_gpu.api
    def op(x, counter):
        return x

    counter = Counter()
    op(torch.ones(2), counter)
    counter.n = 42  # after the call, before the export thread has run
    otel_gpu.flush()
    out = capsys.readouterr().out
    (attrs,) = [span["attrs"] for span in read_spans(path)]
    assert attrs["otel_gpu.input.counter.type"] == "Counter"
    assert attrs["otel_gpu.input.counter.id"] == f"0x{id(counter):x}"
    assert "otel_gpu.input.counter.repr" not in attrs
    assert "n=42" not in out and "n=42" not in path.read_text()
    assert f"Counter object (id 0x{id(counter):x})" in out


def test_immutable_objects_are_recorded_with_their_call_time_repr(otel_gpu_spans):
    """complex, bytes, Decimal, Fraction, range, frozenset, numpy scalars and frozen dataclasses of
    atoms cannot change after the call: their repr is taken at call time."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def op(a, b, c, d, e, f, g, h):
        return None

    op(
        1 + 2j,
        b"ab",
        decimal.Decimal("1.5"),
        fractions.Fraction(1, 3),
        range(3),
        frozenset({1}),
        np.float32(0.5),
        Tile(2, 3),
    )
    a = spans.get()[0].attributes
    expected = {
        "a": "(1+2j)",
        "b": "b'ab'",
        "c": "Decimal('1.5')",
        "d": "Fraction(1, 3)",
        "e": "range(0, 3)",
        "f": "frozenset({1})",
        "g": repr(np.float32(0.5)),
        "h": "Tile(rows=2, cols=3, mode=<Mode.OPTION_A: 0>)",
    }
    for name, text in expected.items():
        assert a[f"otel_gpu.input.{name}.repr"] == text, name
        assert f"otel_gpu.input.{name}.id" not in a


def test_a_frozen_dataclass_holding_a_mutable_value_is_recorded_by_type_and_id(otel_gpu_spans):
    """Frozen only means its fields cannot be rebound: a list inside can still change, so no repr."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def op(h):
        return None

    holder = Holder([1])
    op(holder)
    holder.items.append(2)
    a = spans.get()[0].attributes
    assert a["otel_gpu.input.h.type"] == "Holder" and "otel_gpu.input.h.repr" not in a
    assert a["otel_gpu.input.h.id"] == f"0x{id(holder):x}"


def test_a_long_bytes_argument_is_described_without_formatting_it(otel_gpu_spans):
    """A 1 MB bytes argument costs no 1 MB repr on the caller's thread: type and length."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def op(blob):
        return None

    op(b"x" * 1_000_000)
    a = spans.get()[0].attributes
    assert a["otel_gpu.input.blob.repr"] == "<bytes of length 1000000>"


def test_enums_keep_their_name_and_their_value(otel_gpu_spans):
    """An enum member is recorded as ``Class.MEMBER`` in ``value`` and its value in ``enum_value``
    (ints stay ints, strings strings), as FlashInfer's logger shows both."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def op(mode, layout=Layout.NHD):
        return mode

    op(Mode.OPTION_B)
    a = spans.get()[0].attributes
    assert a["otel_gpu.input.mode.value"] == "Mode.OPTION_B"
    assert a["otel_gpu.input.mode.enum_value"] == 1
    assert a["otel_gpu.input.layout.value"] == "Layout.NHD"
    assert a["otel_gpu.input.layout.enum_value"] == "nhd"
    assert a["otel_gpu.output.0.value"] == "Mode.OPTION_B"
    assert a["otel_gpu.output.0.enum_value"] == 1


def test_the_console_shows_an_enums_name_and_value(capsys):
    """The console line of an enum argument carries both, e.g. ``Mode.OPTION_B (value 1)``."""
    otel_gpu.configure(level=3, dest="stdout", provider="own", color="never")

    @otel_gpu.api
    def op(mode):
        return None

    op(Mode.OPTION_B)
    otel_gpu.flush()
    assert "mode = Mode.OPTION_B (value 1)" in capsys.readouterr().out


def test_an_enum_whose_value_is_not_a_scalar_has_no_enum_value(otel_gpu_spans):
    """An enum whose value is a tuple or object: the name only; nothing is invented for its value."""
    spans = otel_gpu_spans(level=3)

    class Shape(enum.Enum):
        SQUARE = (2, 2)

    @otel_gpu.api
    def op(s):
        return None

    op(Shape.SQUARE)
    a = spans.get()[0].attributes
    assert a["otel_gpu.input.s.value"] == "Shape.SQUARE" and "otel_gpu.input.s.enum_value" not in a


def test_each_type_is_treated_by_what_it_is_however_many_types_a_program_makes():
    """How a value is recorded is decided once per type: subclasses of list, tuple, dict, a
    namedtuple, an enum, a user mapping and a plain object each keep their treatment, and a
    program making classes in a loop does not grow that memo without bound."""
    import collections
    import collections.abc

    from otel_gpu.calls import metadata

    class Items(list):
        pass

    class Pair(tuple):
        pass

    class Table(dict):
        pass

    Point = collections.namedtuple("Point", "x y")

    class Store(collections.abc.Mapping):
        def __getitem__(self, k):
            raise KeyError(k)

        def __iter__(self):
            return iter(())

        def __len__(self):
            return 0

    values = {
        "items": Items([torch.ones(1)]),
        "pair": Pair((1, 2)),
        "table": Table(a=1),
        "point": Point(1, 2),
        "mode": Mode.OPTION_A,
        "store": Store(),
        "counter": Counter(),
    }
    for _ in range(2):  # the second pass reads the memo
        out: list = []
        for key, value in values.items():
            metadata.capture(out, key, value, 8, None)
        kinds = {k: kind for k, kind, _ in out}
        assert kinds["items"] == kinds["pair"] == kinds["table"] == metadata.CONTAINER
        assert kinds["items.0"] == metadata.TENSOR
        assert kinds["point.x"] == kinds["table.a"] == kinds["pair.1"] == metadata.VALUE
        assert kinds["mode"] == metadata.VALUE
        assert kinds["store"] == kinds["counter"] == metadata.OBJECT
    for i in range(3000):
        metadata.capture([], "x", type(f"Made{i}", (), {})(), 8, None)
    assert len(metadata._BRANCHES) <= 1024
