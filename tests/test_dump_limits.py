"""The flight recorder's limits at runtime, and what replay says of the calls they left out.

Promises: ``set_limits`` changes the running recorder's limits (a raised limit resumes dumping,
``None`` gives back the configured one), each limit reached after a change is one more warning;
a bad value is refused naming the argument, nothing changed; ``otel-gpu replay`` says how many
calls of which process were not dumped because a limit was reached.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from dump_files import call_dirs, finish

from otel_gpu import cli
from otel_gpu.recorder import limits

LIB = """
import otel_gpu

@otel_gpu.api
def combine(x, y):
    return x + y
"""


@pytest.fixture(autouse=True)
def _configured_limits():
    """Every test starts and ends with the configured limits."""
    limits.set_limits()
    yield
    limits.set_limits()


def _skipped(spans) -> list:
    return [s.attributes.get("otel_gpu.dump.skipped") for s in spans.get()]


def test_set_limits_changes_the_running_recorder(otel_gpu_spans, module_factory, tmp_path, caplog):
    """Limit 2: the third call is skipped; raised to 4 at runtime, two more are dumped, then
    the next is skipped with a second warning naming the runtime limit; None gives back 2."""
    root = tmp_path / "d"
    spans = otel_gpu_spans(level=10, dump_dir=str(root), dump_max_count=2)
    m = module_factory(LIB, "limitlib")
    one = torch.ones(2)
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        for _ in range(3):
            m.combine(one, one)
        limits.set_limits(max_calls=4)
        for _ in range(3):
            m.combine(one, one)
        limits.set_limits(max_calls=None)
        m.combine(one, one)
    assert _skipped(spans) == [None, None, "max_count", None, None, "max_count", "max_count"]
    finish()
    assert len(call_dirs(root)) == 4
    said = [r.getMessage() for r in caplog.records if "reached" in r.getMessage()]
    assert len(said) == 3
    assert "OTEL_GPU_DUMP_MAX_COUNT=2" in said[0] and "4 calls (set at runtime)" in said[1]
    assert "OTEL_GPU_DUMP_MAX_COUNT=2" in said[2]


def test_a_byte_limit_set_at_runtime_skips_calls_that_do_not_fit(
    otel_gpu_spans, module_factory, tmp_path
):
    """max_bytes=0 at runtime: a call with tensors is not dumped (max_size); None resumes."""
    root = tmp_path / "d"
    spans = otel_gpu_spans(level=10, dump_dir=str(root))
    m = module_factory(LIB, "limitlib")
    limits.set_limits(max_bytes=0)
    m.combine(torch.ones(2), torch.ones(2))
    limits.set_limits(max_bytes=None)
    m.combine(torch.ones(2), torch.ones(2))
    assert _skipped(spans) == ["max_size", None]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_calls": 0}, "max_calls"),
        ({"max_calls": 2.5}, "max_calls"),
        ({"max_calls": True}, "max_calls"),
        ({"max_bytes": -1}, "max_bytes"),
        ({"max_bytes": "1GB"}, "max_bytes"),
    ],
)
def test_set_limits_refuses_a_bad_value_and_changes_nothing(kwargs, named, otel_gpu_spans):
    """A limit that is not a whole number in range: ValueError naming it and what is allowed;
    the limits in force stay as they were."""
    from otel_gpu.config import current

    limits.set_limits(max_calls=7)
    with pytest.raises(ValueError, match=rf"^{named} must be a whole number >= \d+ and <= \d+"):
        limits.set_limits(**kwargs)
    assert limits.in_force(current()).max_calls == 7


def test_replay_says_which_calls_have_no_dump(otel_gpu_spans, module_factory, tmp_path, capsys):
    """Limit 2, five calls: replay passes the two dumped calls and says, on stderr and in
    --json, that three calls of this process were not dumped (the limit named)."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root), dump_max_count=2)
    m = module_factory(LIB, "limitlib")
    for _ in range(5):
        m.combine(torch.ones(2), torch.ones(2))
    finish()
    argv = ["replay", "--dir", str(root), "--allow-module", m.__name__, "--no-progress"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert (
        f"3 call(s) of process {os.getpid()} were not dumped (OTEL_GPU_DUMP_MAX_COUNT=2 reached): "
        "they have no dump to replay"
    ) in err
    assert cli.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["pass"] == 2
    assert report["not_dumped"] == [
        {
            "pid": os.getpid(),
            "reason": "max_count",
            "limit": "OTEL_GPU_DUMP_MAX_COUNT=2",
            "skipped": 3,
        }
    ]
