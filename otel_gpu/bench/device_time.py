"""The device-time row of ``otel-gpu bench``: the caller-visible cost of device time at level 1.

One process, one decorated function, level 1 with otel-gpu's defaults (journal on), spans to a
JSON Lines file. Device time runs on fake events (:class:`otel_gpu.devices.events.FakeEvents`,
completed as they are recorded), so on a CPU-only machine the row measures what device time
adds in Python on the caller's thread: taking a pair from the pool, the current stream, two
records, the bookkeeping. A CUDA event record itself (a few µs of driver time on a GPU) is not
in it. Rounds alternate ``OTEL_GPU_DEVICE_TIME=off`` and ``on``, with ``OTEL_GPU_DEVICE_SPANS``
at its default; each round times ``calls`` calls in chunks of 500 with export deferred, flushing
between chunks outside the timed region (so the pool has its pairs back, as it does when the
export thread keeps up). Medians per call; the budget is 1 µs added.

Run alone: ``python -m otel_gpu.bench.device_time [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

__all__ = ["BUDGET_US", "measure", "render", "row"]

BUDGET_US = 1.0
_CHUNK = 500


class _Instant:
    """Fake events that complete when recorded, 10 µs of device time after their start."""

    def __new__(cls) -> Any:
        from otel_gpu.devices import events

        class Instant(events.FakeEvents):
            def record(self, event: Any, stream: Any) -> None:
                event.done = True
                event.time_ms = time.time_ns() / 1e6 + self.skew_ms

        return Instant()


def measure(rounds: int = 9, calls: int = 20_000) -> dict[str, Any]:
    """``{"off": [µs per call per round], "on": [...]}`` in this process."""
    import otel_gpu
    from otel_gpu.devices import events

    fake = _Instant()
    events.use(fake)
    out: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "spans.jsonl")
        try:
            for _ in range(rounds):
                for mode in ("off", "on"):
                    otel_gpu.configure(level=1, dest=path, device_time=mode, queue_size=1 << 20)

                    @otel_gpu.api
                    def launch(x: int, y: int, scale: float = 1.0) -> int:
                        return x

                    launch(1, 2)
                    otel_gpu.flush()
                    spent = 0.0
                    for _ in range(calls // _CHUNK):
                        start = time.perf_counter()
                        for i in range(_CHUNK):
                            launch(i, 2, scale=0.5)
                        spent += time.perf_counter() - start
                        otel_gpu.flush()
                    out[mode].append(spent / (calls // _CHUNK * _CHUNK) * 1e6)
        finally:
            events.use(None)
            otel_gpu.configure(dest="stdout", device_time="auto")
    return out


def isolated(rounds: int = 9, calls: int = 1000) -> list[float]:
    """µs per call of the observer's ``start`` and ``end`` alone (a pair taken from the pool,
    the stream asked, two records), with no export thread beside it: per round, the median of
    20 batches of ``calls`` calls, the pairs given back between batches, outside the timing."""
    from otel_gpu.config import Settings
    from otel_gpu.core.record import Call, CallSpan
    from otel_gpu.devices import device_time

    class _Pipe:
        observers = ()

    observer = device_time.DeviceTime(Settings(level=1), _Pipe(), _Instant())  # type: ignore[arg-type]
    plan = type("Plan", (), {"name": "launch", "level": 1})()
    calls_ = [Call(plan, CallSpan(None, "launch", 1, i + 1), None, 0) for i in range(calls)]
    out = []
    for _ in range(rounds):
        batches = []
        for _ in range(20):
            start = time.perf_counter()
            for call in calls_:
                observer.start(call)
                observer.end(call)
            batches.append((time.perf_counter() - start) / calls * 1e6)
            for call in calls_:  # what the resolver does, off the caller's thread
                observer._free(call.device)
                call.device = None
        out.append(statistics.median(batches))
    return out


def render(result: dict[str, Any]) -> str:
    off, on = result["off_us"], result["on_us"]
    added = result["isolated_us"]
    verdict = "within" if added <= BUDGET_US else "OVER"
    return (
        "device time (level 1, fake events on CPU, caller-visible per call)\n"
        f"  observer start+end alone  {added:7.2f} µs  ({verdict} the {BUDGET_US:.1f} µs budget)\n"
        f"  level-1 loop, off         {off:7.2f} µs\n"
        f"  level-1 loop, on          {on:7.2f} µs  (export thread beside it: noisy)"
    )


def row(quick: bool = False) -> dict[str, Any]:
    """The bench row (3 short rounds with ``--quick``: checks the harness only)."""
    raw = measure(3, 2_000) if quick else measure()
    alone = isolated(3) if quick else isolated()
    result: dict[str, Any] = {
        "name": "device_time",
        "isolated_us": statistics.median(alone),
        "off_us": statistics.median(raw["off"]),
        "on_us": statistics.median(raw["on"]),
        "rounds": raw,
        "budget_us": BUDGET_US,
        "ok": True,
    }
    result["added_us"] = result["on_us"] - result["off_us"]
    result["text"] = render(result)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m otel_gpu.bench.device_time")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    raw = measure(args.rounds, args.calls)
    result = {
        "isolated_us": statistics.median(isolated(args.rounds)),
        "off_us": statistics.median(raw["off"]),
        "on_us": statistics.median(raw["on"]),
        "rounds": raw,
    }
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
