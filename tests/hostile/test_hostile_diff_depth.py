"""``otel-gpu diff`` on a parent chain 100,000 calls deep.

Attack: a trace whose every span is the parent of the next (a recursion, or a crafted file),
and parent ids that loop. Promises: linking the calls walks each call's parent chain a bounded
number of times in all (linear work, not one walk of the whole chain per call, which took 24 s
at 20,000 deep and minutes at 40,000); the first call of each loop's last member loses its
link, as before; diff ends without a RecursionError, and a call it names deep in the chain
shows a bounded path.
"""

from __future__ import annotations

from otel_gpu.traces import call_records
from otel_gpu.traces.call_records import CallRecord, link
from otel_gpu.traces.diff import compare_runs

DEEP = 100_000


class _Counted(CallRecord):
    """A call record counting every read and write of its ``parent``."""

    __slots__ = ("_up",)
    touched = 0

    @property  # type: ignore[override]
    def parent(self) -> CallRecord | None:
        _Counted.touched += 1
        return self._up

    @parent.setter
    def parent(self, value: CallRecord | None) -> None:
        _Counted.touched += 1
        self._up = value


def _chain(n: int, cls: type[CallRecord] = CallRecord, name: str = "lib.f") -> list[CallRecord]:
    calls = []
    for i in range(n):
        call = cls(
            name=name,
            trace_id="t",
            span_id=f"{i:016x}",
            parent_id=f"{i - 1:016x}" if i else None,
            start=i,
            end=2 * n - i,
            where="crafted",
            stats={"output.0": {"numel": 1, "min": 0.0, "max": 1.0, "mean": 0.5, "std": 0.0}},
        )
        if cls is _Counted:
            call._up = None  # type: ignore[attr-defined]
        calls.append(call)
    return calls


def test_linking_a_deep_chain_touches_each_parent_a_bounded_number_of_times():
    """5,000 calls each the parent of the next: link() reads or writes ``parent`` at most
    twice per call (a walk up the chain for each call would be 12.5 million reads)."""
    calls = _chain(5000, _Counted)
    _Counted.touched = 0
    link(calls)
    assert _Counted.touched <= 2 * len(calls), _Counted.touched
    assert calls[-1].parent is calls[-2] and calls[0].parent is None
    assert [c.children for c in calls[:-1]] == [[c] for c in calls[1:]]


def test_a_loop_of_parent_ids_is_broken_at_its_last_member():
    """a -> b -> c -> a (each naming the next as parent) and d its own parent: c, the last of
    the loop in file order, loses its link; d loses its own; a and b keep theirs."""
    a, b, c, d = _chain(4)
    a.parent_id, b.parent_id, c.parent_id, d.parent_id = b.span_id, c.span_id, a.span_id, d.span_id
    link([a, b, c, d])
    assert (a.parent, b.parent, c.parent, d.parent) == (b, c, None, None)
    assert call_records.link is link


def test_diff_of_a_100k_deep_chain_ends_and_names_a_deep_call_with_a_bounded_path():
    """A 100,000-deep chain against the same chain one call deeper: diff pairs 100,000 calls,
    names the extra call as in B only, with a path of at most 65 parts; no RecursionError."""
    a, b = _chain(DEEP), _chain(DEEP + 1)
    link(a)
    link(b)
    report = compare_runs(a, b)
    assert report["calls"]["paired"] == DEEP and report["calls"]["b_only"] == 1
    (only,) = report["b_only"]
    parts = only["path"].split(" > ")
    assert len(parts) <= 65 and parts[0] == "…"
