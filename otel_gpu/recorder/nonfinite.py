"""Which call produced a NaN or Inf: the one verdict the ring's ``OTEL_GPU_ON_NONFINITE=dump``
and the ``nonfinite`` triggers share, so both blame the same call.

A call *produced* non-finite values when its outputs hold some, its inputs are finite, and no
call inside it produced them (a child that did ends first and marks its parent as explained);
and the first non-finite call the process records is blamed whatever its inputs (they came
from code otel-gpu does not see). Calls that merely pass a NaN on, and callers whose NaN came
from a call inside them, are not: one NaN would otherwise blame every call that follows it.

The verdict changes state (the parent marked, the first call seen), so each call is judged once:
:meth:`Origins.produced` remembers the last verdicts by span id, and a second reader (the
triggers after the ring) gets the same answer.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from otel_gpu.core.record import Call

__all__ = ["Origins"]

_EXPLAINED_MAX = 65536  # parents waiting for their own end: cleared past it (a leak bound)
_VERDICTS_MAX = 1024  # verdicts kept for a second reader of the same call


class Origins:
    """The blame for non-finite values, for one pipeline's calls."""

    def __init__(self) -> None:
        self.seen = False
        """Whether a non-finite call was recorded yet."""
        self._explained: set[int] = set()  # span ids whose NaN output a call inside produced
        self._verdicts: collections.OrderedDict[int, bool] = collections.OrderedDict()
        self._lock = threading.Lock()

    def produced(self, call: Call) -> bool:
        """Whether ``call`` (ended, with level-5 statistics) produced non-finite values."""
        results = call.stats
        if not results:
            return False
        span_id = call.span.get_span_context().span_id
        with self._lock:
            known = self._verdicts.get(span_id)
            if known is not None:
                return known
            verdict = self._judge(call, span_id)
            self._verdicts[span_id] = verdict
            if len(self._verdicts) > _VERDICTS_MAX:
                self._verdicts.popitem(last=False)
            return verdict

    def _judge(self, call: Call, span_id: int) -> bool:
        results = call.stats or ()
        bad_in = any(r.nonfinite for r in results if r.key.startswith("input."))
        bad_out = any(r.nonfinite for r in results if r.key.startswith("output."))
        if not (bad_in or bad_out):
            return False
        explained = span_id in self._explained
        self._explained.discard(span_id)
        if bad_out and call.parent is not None:  # the caller's NaN output is explained by this
            if len(self._explained) > _EXPLAINED_MAX:
                self._explained.clear()
            self._explained.add(call.parent.span_id)
        first = not self.seen
        self.seen = True
        return first or (bad_out and not bad_in and not explained)
