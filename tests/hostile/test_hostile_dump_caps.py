"""Every dump path obeys ``OTEL_GPU_DUMP_MAX_COUNT`` and ``OTEL_GPU_DUMP_MAX_SIZE_GB``.

Attack: a trigger rule that fires on every call with ``dump: true`` (a control document or
OpAMP can arm one), and a program whose every call raises, with the ring on: each would write a
ring dump per call. Promises: the ring's dumps, trigger dumps and level-10 dumps count against
one limit; at most ``OTEL_GPU_DUMP_MAX_COUNT`` calls are written below the dump folder, a byte
limit that nothing fits writes no folder at all, and reaching a limit is one warning line, not
one per call.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import otel_gpu
from otel_gpu.anomalies import triggers
from otel_gpu.control import state
from otel_gpu.recorder import limits
from otel_gpu.recorder.manifest import MANIFEST

EVERY_CALL = [{"on": "slow", "threshold": "1us", "dump": True}]  # every call takes longer


@pytest.fixture
def armed(otel_gpu_spans, tmp_path):
    """``start(level, **settings)``: otel-gpu with the every-call dump rule and a ring of 4."""

    def start(level: int, **settings):
        settings.setdefault("journal_dir", str(tmp_path / "journal"))
        settings.setdefault("dump_dir", str(tmp_path / "dumps"))
        settings.setdefault("ring", 4)
        return otel_gpu_spans(level=level, **settings)

    limits.set_limits()
    yield start
    state.reset("test teardown")
    triggers.set_triggers(None)
    limits.set_limits()


def _written(root) -> tuple[list[str], int]:
    """The ring-dump folders below ``root`` and the call directories written, all paths."""
    if not root.exists():
        return [], 0
    rings = sorted(n for n in os.listdir(root) if n.startswith("ring-"))
    calls = 0
    for _, _, files in os.walk(root):
        calls += MANIFEST in files
    return rings, calls


def _reached(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "reached" in r.getMessage()]


def test_a_rule_firing_on_every_call_writes_at_most_max_count(armed, tmp_path, caplog):
    """The issue's payload: dump on every call, MAX_COUNT=5, 200 calls: at most 5 calls in at
    most 5 ring folders, and one warning naming OTEL_GPU_DUMP_MAX_COUNT=5."""
    armed(3, triggers=EVERY_CALL, dump_max_count=5)

    @otel_gpu.api
    def step(x):
        return x * 2

    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        for _ in range(200):
            step(torch.ones(4, 8))
        otel_gpu.flush()
    rings, calls = _written(tmp_path / "dumps")
    assert 1 <= len(rings) <= 5 and calls <= 5, (rings, calls)
    said = _reached(caplog)
    assert len(said) == 1 and "OTEL_GPU_DUMP_MAX_COUNT=5" in said[0]


def test_a_size_limit_nothing_fits_writes_no_ring_folder(armed, tmp_path, caplog):
    """MAX_SIZE_GB=0.000001 (about 1 KiB) and 4x8 float32 inputs of 4 calls kept: a dump fits
    only while its calls fit; no folder is ever created empty, one warning."""
    armed(3, triggers=EVERY_CALL, dump_max_size_gb=0.000001)

    @otel_gpu.api
    def step(x):
        return x * 2

    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        for _ in range(100):
            step(torch.ones(64, 64))  # 16 KiB: never fits
        otel_gpu.flush()
    rings, calls = _written(tmp_path / "dumps")
    assert rings == [] and calls == 0
    said = _reached(caplog)
    assert len(said) == 1 and "OTEL_GPU_DUMP_MAX_SIZE_GB" in said[0]


def test_a_call_that_raises_every_time_is_dumped_within_the_limit(armed, tmp_path):
    """The ring dumps every raising call by itself (no rule): still at most MAX_COUNT calls."""
    armed(3, dump_max_count=3)

    @otel_gpu.api
    def fail(x):
        raise ValueError("boom")

    for _ in range(50):
        with pytest.raises(ValueError):
            fail(torch.ones(2))
    otel_gpu.flush()
    rings, calls = _written(tmp_path / "dumps")
    assert 1 <= len(rings) <= 3 and calls <= 3, (rings, calls)


def test_level_10_and_the_ring_share_one_limit(armed, tmp_path):
    """Level 10 with the every-call rule and a ring: level-10 calls and ring dumps together
    write at most MAX_COUNT calls below the dump folder."""
    armed(10, triggers=EVERY_CALL, dump_max_count=6)

    @otel_gpu.api
    def step(x):
        return x + 1

    for _ in range(40):
        step(torch.ones(3))
    otel_gpu.flush()
    _, calls = _written(tmp_path / "dumps")
    assert 1 <= calls <= 6, calls


def test_a_limit_raised_at_runtime_lets_ring_dumps_resume(armed, tmp_path):
    """set_limits (as a control document's dump_max_calls does) applies to the ring too."""
    armed(3, triggers=EVERY_CALL, dump_max_count=1)

    @otel_gpu.api
    def step(x):
        return x * 2

    for _ in range(10):
        step(torch.ones(2))
    assert _written(tmp_path / "dumps")[1] == 1
    limits.set_limits(max_calls=3)
    for _ in range(10):
        step(torch.ones(2))
    otel_gpu.flush()
    assert _written(tmp_path / "dumps")[1] == 3
