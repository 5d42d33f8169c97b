"""Per-span cost of otel-gpu's OTLP encoders against the official ones (pytest-benchmark).

CI runs these with ``--benchmark-disable``: each body runs once, as a smoke test, and
nothing is timed or asserted about time. To compare, run
``python -m pytest tests/test_encoder_bench.py --benchmark-only --benchmark-group-by=group``
or, for interleaved medians printed as µs per span side by side, run this file as a script.

The spans are shaped like otel-gpu's: level 1 carries the three ``code.*`` attributes
(hinted ``fixed``), level 3 adds per-tensor metadata for three inputs and an output (~22
attributes), level 5 adds an ``otel_gpu.stats`` event per input tensor.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as official_json
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as official_proto,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags
from otel_gpu.exporters.otlp_json import JsonEncoder
from otel_gpu.exporters.otlp_proto import ProtoEncoder
from otel_gpu.exporters.spandata import SpanData

BATCH = 64
LEVELS = (1, 3, 5)
_RESOURCE = Resource({"service.name": "bench", "host.name": "node-1", "process.pid": 4242})
_SCOPE = InstrumentationScope("otel_gpu", "0.1.0")
_UNSET = Status(StatusCode.UNSET)


def _attributes(level: int, rng: random.Random) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "code.function.name": "flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper.run",
        "code.file.path": "/opt/lib/python3.11/site-packages/flashinfer/decode.py",
        "code.line.number": 1187,
    }
    if level >= 3:
        batch = rng.choice((16, 32))
        for name in ("q", "k", "v"):
            p = f"otel_gpu.input.{name}"
            attrs[p + ".shape"] = [batch, 128, 128]
            attrs[p + ".dtype"] = "torch.float16"
            attrs[p + ".device"] = "cuda:0"
            attrs[p + ".stride"] = [16384, 128, 1]
            attrs[p + ".requires_grad"] = False
            attrs[p + ".is_contiguous"] = True
        attrs["otel_gpu.input.sm_scale.value"] = 0.08838834764831845
        attrs["otel_gpu.input.causal.value"] = True
        attrs["otel_gpu.output.shape"] = [batch, 128, 128]
        attrs["otel_gpu.output.dtype"] = "torch.float16"
    return attrs


def _events(level: int, rng: random.Random, ts: int) -> list[Event]:
    if level < 5:
        return []
    return [
        Event(
            "otel_gpu.stats",
            {
                "otel_gpu.tensor": name,
                "numel": 524288,
                "min": rng.uniform(-4, 0),
                "max": rng.uniform(0, 4),
                "mean": rng.gauss(0, 0.01),
                "std": rng.uniform(0.9, 1.1),
                "nan_count": 0,
                "inf_count": 0,
            },
            ts,
        )
        for name in ("q", "k", "v")
    ]


def make_spans(level: int, n: int = BATCH, seed: int = 0) -> list[SpanData]:
    """``n`` level-``level`` spans of one decorated function, as otel-gpu's pipeline makes them."""
    rng = random.Random(seed)
    start = 1_700_000_000_000_000_000
    return [
        SpanData(
            "flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper.run",
            SpanContext(rng.getrandbits(128), rng.getrandbits(64), False, TraceFlags(1)),
            None,
            start + 1000 * i,
            start + 1000 * i + 850,
            _attributes(level, rng),
            _events(level, rng, start + 1000 * i + 800),
            (),
            _UNSET,
            _RESOURCE,
            _SCOPE,
            fixed=("decode.run", 3),
        )
        for i in range(n)
    ]


def _official_json(spans: Sequence[Any]) -> str:
    # what the official FileSpanExporter does per export() call
    return json.dumps(official_json(spans).to_dict(), separators=(",", ":"))


def _official_proto(spans: Sequence[Any]) -> bytes:
    return official_proto(spans).SerializeToString()


def encoders() -> dict[str, Callable[[Sequence[Any]], Any]]:
    """Name -> batch encoder; ours keep their caches warm across calls, as an exporter does."""
    return {
        "json-official": _official_json,
        "json-ours": JsonEncoder().encode,
        "proto-official": _official_proto,
        "proto-ours": ProtoEncoder().encode,
    }


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(encoders()))
def test_encode_batch(benchmark: Any, name: str, level: int) -> None:
    """Encoding a batch of level-N spans succeeds for every encoder (time: see the report)."""
    spans = make_spans(level)
    encode = encoders()[name]
    benchmark.group = f"level {level}, {name.split('-')[0]}"
    benchmark.extra_info["spans_per_round"] = len(spans)
    assert benchmark(encode, spans)


def compare(rounds: int = 25) -> dict[int, dict[str, float]]:
    """Median µs per span of each encoder per level, the encoders interleaved within each round."""
    out: dict[int, dict[str, float]] = {}
    for level in LEVELS:
        spans = make_spans(level)
        fns = encoders()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for fn in fns.values():
            fn(spans)  # warm the caches, as a running exporter has them
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn(spans)
                times[name].append((time.perf_counter() - t0) / len(spans) * 1e6)
        out[level] = {name: statistics.median(values) for name, values in times.items()}
    return out


if __name__ == "__main__":
    print(f"median µs per span, batches of {BATCH}, interleaved")
    print(
        f"{'level':>5} {'json official':>14} {'json ours':>10} {'ratio':>6} "
        f"{'proto official':>15} {'proto ours':>11} {'ratio':>6}"
    )
    for level, r in compare().items():
        print(
            f"{level:>5} {r['json-official']:>14.2f} {r['json-ours']:>10.2f} "
            f"{r['json-official'] / r['json-ours']:>5.1f}x {r['proto-official']:>15.2f} "
            f"{r['proto-ours']:>11.2f} {r['proto-official'] / r['proto-ours']:>5.1f}x"
        )
