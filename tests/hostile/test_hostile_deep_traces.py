"""``workloads``, ``show`` and ``ranks`` on traces built to hurt a reader: a parent chain
thousands of spans deep, attribute values megabytes long, numbers that are not finite.

The promises (docs/show.md, docs/workloads.md, docs/ranks.md): the spans are linked in time
linear in their number whatever the depth, and without recursion; the tree's indentation and
a path to a span stay one readable line; a value read from a file is clipped in human output
(:data:`otel_gpu.traces.output.SHOWN_CHARACTERS`) and whole in ``--json``; ``--json`` is
valid JSON, a NaN or an infinity written as the string ``"NaN"``, ``"Infinity"``,
``"-Infinity"``. Times are measured in the report of the change, never asserted here.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import crafted_calls
import pytest
from crafted_calls import call, stats, tensor, write

from otel_gpu.traces import ranks as ranks_module
from otel_gpu.traces.output import SHOWN_CHARACTERS
from otel_gpu.traces.reader import Span
from otel_gpu.traces.show import show
from otel_gpu.traces.trees import build_traces, cycle_closers
from otel_gpu.traces.workloads import workloads

DEPTH = 3000
MEGABYTE = "v" * 1_000_000


def _strict(text: str) -> Any:
    """JSON as a strict parser reads it: a bare NaN or Infinity is an error."""

    def refuse(name: str) -> Any:
        raise ValueError(f"bare {name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _chain(tmp: Path, depth: int = DEPTH) -> str:
    """One trace, each span the child of the one before."""
    spans: list[dict[str, Any]] = []
    for i in range(depth):
        parent = spans[-1] if spans else None
        spans.append(call(f"lib.level{i % 5}", inputs={"x": tensor([i % 3 + 1, 4])}, parent=parent))
    return write(tmp / "chain.jsonl", spans)


def _show(paths: list[str], **kw: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = show(paths, out=out, err=err, **kw)
    return code, out.getvalue(), err.getvalue()


def _workloads(paths: list[str], **kw: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = workloads(paths, out=out, err=err, **kw)
    return code, out.getvalue(), err.getvalue()


def _ranks(paths: list[str], **kw: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = ranks_module.ranks(paths, out=out, err=err, **kw)
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------- depth


def _closes_cycle_one_by_one(parents: Mapping[int, int | None]) -> set[int]:
    """The rule as it was written before: each link, in order, refused if the child is an
    ancestor of its parent through the links made so far (quadratic in the depth)."""
    made: dict[int, int] = {}
    refused = set()
    for child, parent in parents.items():
        if parent is None:
            continue
        node: int | None = parent
        while node is not None and node != child:
            node = made.get(node)
        if node == child:
            refused.add(child)
        else:
            made[child] = parent
    return refused


def test_cycle_closers_refuses_the_same_links_as_the_one_by_one_rule():
    """On 3,000 random parent maps (self-loops, loops of any length, chains hanging into
    loops, orders shuffled), the linear walk refuses exactly the links the one-by-one rule
    refuses: in each loop, its node last in the file's order."""
    rng = random.Random(39)
    for _ in range(3000):
        nodes = list(range(rng.randint(1, 14)))
        rng.shuffle(nodes)
        parents = {n: rng.choice([*nodes, None, None]) for n in nodes}
        assert cycle_closers(parents) == _closes_cycle_one_by_one(parents), parents


def test_build_traces_cuts_the_same_links_as_the_one_by_one_rule():
    """Spans whose parent ids loop (and some whose parent is missing), in shuffled file order:
    the spans drawn as roots with "would close a cycle" are those the one-by-one rule refuses,
    every other span with its parent present hangs under it, and every span is in a tree."""
    rng = random.Random(5)
    for _ in range(500):
        ids = [f"{i:016x}" for i in range(1, rng.randint(2, 12))]
        rng.shuffle(ids)
        parent_of = {i: rng.choice([*ids, None, "00000000000000ff"]) for i in ids}
        spans = [
            Span("1" * 32, i, parent_of[i], f"f{i}", n + 1, n + 2, False, "", {}, [], "t:1")
            for n, i in enumerate(ids)
        ]
        (trace,) = build_traces(spans)
        present = {i: (p if p in parent_of else None) for i, p in parent_of.items()}
        refused = _closes_cycle_one_by_one(present)
        assert {s.span_id for s in spans if s.cycle} == refused
        for span in spans:
            linked = present[span.span_id] is not None and span.span_id not in refused
            assert (span.parent is not None) == linked
            assert span.parent is None or span.parent.span_id == present[span.span_id]
        assert trace.count == len(ids) == len(_descendants(trace.roots))


def _descendants(roots: list[Span]) -> list[Span]:
    found, stack = [], list(roots)
    while stack:
        span = stack.pop()
        found.append(span)
        stack.extend(span.children)
    return found


class _Counting(dict):
    lookups = 0

    def get(self, key: Any, default: Any = None) -> Any:
        type(self).lookups += 1
        return super().get(key, default)


def test_cycle_closers_walks_each_node_once_on_a_deep_chain():
    """A chain of 100,000 nodes, each the parent of the next, and a loop closing it: about one
    parent lookup per node (the one-by-one rule walks the whole chain above each node: 5
    billion steps), and the one link refused is the loop's last in order."""
    n = 100_000
    # node 0's parent is the last node: one loop through all of them, n - 1 last in order
    parents = _Counting({0: n - 1, **{i: i - 1 for i in range(1, n)}})
    assert cycle_closers(parents) == {n - 1}
    assert _Counting.lookups <= 2 * n


def test_show_draws_a_deep_chain_with_bounded_indentation(tmp_path):
    """``show --limit 0`` on a 3,000-deep chain: every span drawn (exit 0, no error), but no
    line is longer than 64 levels of indentation and a span's text; past that, a span says
    its depth. (Before, the last line was indented 9,000 characters, and a chain of 200,000
    would have printed 60 GB of indentation.)"""
    code, out, err = _show([_chain(tmp_path)], limit=0)
    assert code == 0, err
    lines = out.splitlines()
    assert sum(1 for line in lines if "lib.level" in line) == DEPTH
    assert max(len(line) for line in lines) < 64 * 3 + 200
    assert any(f"depth {DEPTH - 1} " in line for line in lines)


def test_show_nonfinite_names_a_deep_producer_on_one_short_line(tmp_path):
    """The producer of NaN at the bottom of a 3,000-deep chain is found, and its path is
    shown by its ends and how many levels lie between, not as 3,000 names on one line."""
    bottom = {"stats": {"output.0": {**stats(0.0, 1.0, 0.5, 0.1), "nan_count": 2}}}
    spans: list[dict[str, Any]] = []
    for i in range(DEPTH):
        extra = bottom if i == DEPTH - 1 else {}
        spans.append(call(f"lib.level{i % 5}", parent=spans[-1] if spans else None, **extra))
    path = write(tmp_path / "nan.jsonl", spans)
    code, out, err = _show([path], nonfinite=True)
    assert code == 0, err
    (line,) = [x for x in out.splitlines() if x.strip().startswith("path:")]
    assert f"… {DEPTH - 9} more …" in line
    assert len(line) < 400


@pytest.mark.parametrize("as_json", [False, True])
def test_workloads_and_ranks_read_a_deep_chain(tmp_path, as_json):
    """``workloads`` and ``ranks`` (and their ``--json``) on the 3,000-deep chain: every call
    counted, exit 0, no recursion error."""
    path = _chain(tmp_path)
    code, out, err = _workloads([path], as_json=as_json)
    assert code == 0, err
    if as_json:
        assert _strict(out)["calls"] == DEPTH
    code, out, err = _ranks([path], as_json=as_json)
    assert code == 0, err
    if as_json:
        assert _strict(out)["status"] == "agree"


# ---------------------------------------------------------------------- long values


def test_workloads_clips_a_megabyte_value_and_keeps_it_whole_in_json(tmp_path):
    """A call whose argument value is 1,000,000 characters: the human line shows the first
    256 and how many more there are; ``--json`` carries the value whole. (Before, the whole
    value was printed: a 40 MB attribute made a 40 MB line.)"""
    spans = [call("lib.f", inputs={"x": tensor([2]), "mode": {"value": MEGABYTE}})]
    path = write(tmp_path / "long.jsonl", spans)
    code, out, err = _workloads([path])
    assert code == 0, err
    assert max(len(line) for line in out.splitlines()) < 2 * SHOWN_CHARACTERS + 200
    assert f"… (+{len(MEGABYTE) - SHOWN_CHARACTERS} characters)" in out
    code, out, err = _workloads([path], as_json=True)
    assert code == 0, err
    (workload,) = _strict(out)["workloads"]
    assert workload["inputs"]["mode"]["value"] == MEGABYTE


def test_show_clips_megabyte_names_dtypes_messages_and_dump_paths(tmp_path):
    """A span whose name, an input's dtype, its error message and its dump directory are each
    1,000,000 characters: one line of at most a few times 256 characters."""
    span = call(
        MEGABYTE,
        inputs={"x": {"shape": [2], "dtype": MEGABYTE}},
        extra={"otel_gpu.dump.dir": MEGABYTE},
    )
    span["status"] = {"code": 2, "message": MEGABYTE}
    code, out, err = _show([write(tmp_path / "long.jsonl", [span])])
    assert code == 0, err
    assert max(len(line) for line in out.splitlines()) < 5 * SHOWN_CHARACTERS + 400
    assert "characters)" in out


class _Job:
    """Two ranks' spans: rank 1 never enters the second all_reduce rank 0 is in."""

    def __init__(self, name: str = "all_reduce", stuck_seconds: float = 5.0) -> None:
        self.ranks: list[list[dict[str, Any]]] = [[], []]
        for rank, count in ((0, 2), (1, 1)):
            for seq in range(1, count + 1):
                self.ranks[rank].append(
                    call(
                        f"torch.distributed.{name}",
                        extra={
                            "otel_gpu.collective.op": name,
                            "otel_gpu.collective.group.id": "0",
                            "otel_gpu.collective.group.name": "default_pg",
                            "otel_gpu.collective.group.ranks": [0, 1],
                            "otel_gpu.collective.group.rank": rank,
                            "otel_gpu.collective.seq": seq,
                        },
                    )
                )
        self.ranks[1].append(
            call(
                "otel_gpu.stuck mylib.load",
                extra={
                    "otel_gpu.stuck": True,
                    "otel_gpu.stuck.seconds": stuck_seconds,
                    "otel_gpu.stuck.span_id": "00000000000000ff",
                },
            )
        )

    def write(self, tmp: Path) -> list[str]:
        return [
            write(tmp / f"rank{rank}.jsonl", spans, resource={"otel_gpu.rank": rank})
            for rank, spans in enumerate(self.ranks)
        ]


def test_ranks_clips_a_megabyte_collective_name_and_keeps_it_whole_in_json(tmp_path):
    """A collective whose op is 1,000,000 characters: the human report's lines stay short,
    ``--json`` names it whole."""
    paths = _Job(name=MEGABYTE).write(tmp_path)
    code, out, err = _ranks(paths)
    assert code == 1, err
    assert max(len(line) for line in out.splitlines()) < 4 * SHOWN_CHARACTERS + 400
    code, out, err = _ranks(paths, as_json=True)
    (group,) = _strict(out)["groups"]
    assert group["stalled"]["call"] == MEGABYTE


# ---------------------------------------------------------------------- non-finite numbers


@pytest.mark.parametrize(
    ("number", "word"),
    [(float("inf"), "Infinity"), (float("-inf"), "-Infinity"), (float("nan"), "NaN")],
)
def test_workloads_json_writes_an_infinite_argument_as_a_string(tmp_path, number, word):
    """An argument recorded as a double that is not finite (``doubleValue: "Infinity"``):
    ``--json`` is valid JSON, the value the string ``"Infinity"`` (``"-Infinity"``,
    ``"NaN"``). (Before: a bare ``Infinity``, which no strict JSON parser reads.)"""
    spans = [call("lib.f", inputs={"x": tensor([2]), "eps": {"value": number}})]
    code, out, err = _workloads([write(tmp_path / "inf.jsonl", spans)], as_json=True)
    assert code == 0, err
    (workload,) = _strict(out)["workloads"]
    assert workload["inputs"]["eps"]["value"] == word


def test_ranks_json_writes_an_infinite_wait_as_a_string(tmp_path):
    """A stuck-call report saying the call had run for ``Infinity`` seconds: ``ranks --json``
    is valid JSON, the open call's seconds the string ``"Infinity"``."""
    paths = _Job(stuck_seconds=float("inf")).write(tmp_path)
    code, out, err = _ranks(paths, as_json=True)
    assert code == 1, err
    (group,) = _strict(out)["groups"]
    (behind,) = group["behind"]
    assert behind["open"][0]["seconds"] == "Infinity"
    assert crafted_calls.value(float("inf")) == {"doubleValue": "Infinity"}  # the payload
