"""Lining up the calls of two runs of one program, for ``otel-gpu diff``.

Each run's calls are put in call-tree order (roots by start time, each call followed by its
children, depth first). Two runs of the same program give the same sequence of function names,
so the calls pair off in order: same function, same position in the tree. Where the trees
differ (one extra call, an extra wrapper level, a compiled region that records less), the
common prefix and suffix of the two sequences pair off first, and the middle, if there is one,
is matched by :class:`difflib.SequenceMatcher` on the names (a longest-common-subsequence
alignment); calls it leaves unpaired are in one run only. A middle too long for that quadratic
matcher pairs the k-th call of each function in one run with the k-th in the other.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["MAX_FUZZY", "Alignment", "align", "tree_order"]

T = TypeVar("T")

MAX_FUZZY = 4000
"""Calls of each run's unmatched middle that :class:`difflib.SequenceMatcher` aligns; past it,
calls pair off as the k-th call of each function."""


class Alignment(Generic[T]):
    """``pairs`` of calls that line up, in run A's order; calls only in ``a_only`` / ``b_only``."""

    def __init__(self) -> None:
        self.pairs: list[tuple[T, T]] = []
        self.a_only: list[T] = []
        self.b_only: list[T] = []
        self.fuzzy = False
        """Whether the sequences differed, so some pairs came from the fuzzy matcher."""


def tree_order(roots: Sequence[T], children: Callable[[T], Sequence[T]]) -> list[T]:
    """Every call under ``roots``, each followed by its children (depth first, no recursion)."""
    out: list[T] = []
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(children(node)))
    return out


def align(a: Sequence[T], b: Sequence[T], name: Callable[[T], str]) -> Alignment[T]:
    """Pair the calls of ``a`` and ``b`` (each in :func:`tree_order`) by function name."""
    out: Alignment[T] = Alignment()
    na = [name(x) for x in a]
    nb = [name(x) for x in b]
    head = 0
    limit = min(len(na), len(nb))
    while head < limit and na[head] == nb[head]:
        head += 1
    tail = 0
    while tail < limit - head and na[len(na) - 1 - tail] == nb[len(nb) - 1 - tail]:
        tail += 1
    out.pairs.extend(zip(a[:head], b[:head]))
    mid_a, mid_b = list(a[head : len(a) - tail]), list(b[head : len(b) - tail])
    if mid_a or mid_b:
        out.fuzzy = True
        names_a, names_b = na[head : len(na) - tail], nb[head : len(nb) - tail]
        if len(mid_a) <= MAX_FUZZY and len(mid_b) <= MAX_FUZZY:
            _matched(mid_a, mid_b, names_a, names_b, out)
        else:
            _kth(mid_a, mid_b, names_a, names_b, out)
    out.pairs.extend(zip(a[len(a) - tail :], b[len(b) - tail :]))
    return out


def _matched(a: list[T], b: list[T], na: list[str], nb: list[str], out: Alignment[T]) -> None:
    matcher = difflib.SequenceMatcher(None, na, nb, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out.pairs.extend(zip(a[i1:i2], b[j1:j2]))
        else:
            out.a_only.extend(a[i1:i2])
            out.b_only.extend(b[j1:j2])


def _kth(a: list[T], b: list[T], na: list[str], nb: list[str], out: Alignment[T]) -> None:
    by_name: dict[str, list[T]] = {}
    for call, n in zip(b, nb):
        by_name.setdefault(n, []).append(call)
    taken: dict[str, int] = {}
    for call, n in zip(a, na):
        k = taken.get(n, 0)
        others = by_name.get(n, [])
        if k < len(others):
            out.pairs.append((call, others[k]))
            taken[n] = k + 1
        else:
            out.a_only.append(call)
    for n, others in by_name.items():
        out.b_only.extend(others[taken.get(n, 0) :])
