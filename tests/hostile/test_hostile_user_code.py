"""User code and hostile values on the call path: metadata (level 3), statistics (level 5),
descriptions (level 10 and the ring).

Payloads: a broadcast view of 400 million elements stored in one; a list nested 100,000 deep
under a raised recursion limit; a ``__repr__``, a ``__dict__`` property and a tensor subclass's
``__torch_function__`` that call ``os._exit`` or sleep; a wrapper subclass's
``__torch_dispatch__``; a strided nested tensor; a disk that refuses every write. The promises:
otel-gpu never runs a hook the user did not ask it to run, so none of them can end the process
or stall the call; what it measures stays exact; a full disk is one line of warning.
Payloads that can kill the process run in a child, whose exit code and output are checked.
"""

from __future__ import annotations

import math
import os
import subprocess
import textwrap
import time
import warnings
from typing import Any

import pytest
import torch
from commands import python_command

import otel_gpu
from otel_gpu.attributes import (
    EVENT_STATS,
    STATS_MAX,
    STATS_MEAN,
    STATS_MIN,
    STATS_NOTE,
    STATS_NUMEL,
    STATS_TENSOR,
)
from otel_gpu.calls import describe as _describe

CHILD_TIMEOUT_S = 300  # a hang guard only


def _child(script: str, tmp_path: Any, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter; otel-gpu's own output goes to devnull."""
    full_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("OTEL_GPU_", "OTEL_TRACES_"))
    }
    full_env.update(env)
    prelude = f"""
import os, sys, time
import torch
import otel_gpu
DUMPS = {str(tmp_path / "dumps")!r}
"""
    return python_command(
        ["-c", textwrap.dedent(prelude) + textwrap.dedent(script)],
        env=full_env,
        cwd=str(tmp_path),
        timeout=CHILD_TIMEOUT_S,
    )


def _stats_of(span: Any) -> dict[str, dict[str, Any]]:
    return {
        e.attributes[STATS_TENSOR]: dict(e.attributes) for e in span.events if e.name == EVENT_STATS
    }


# --------------------------------------------------------------------------- broadcast views


def test_statistics_of_a_huge_broadcast_view_read_only_its_stored_elements(tmp_path: Any) -> None:
    """Attack: ``torch.ones(1).expand(20000, 20000)`` at level 5, 400 million logical elements
    in one stored one. Reducing it materialised 1.76 GB per call; the statistics now read the
    stored element (peak RSS grows by far less than the 1.6 GB a float32 copy would take) and
    still describe all 400 million elements."""
    proc = _child(
        """
        import resource
        otel_gpu.configure(level=5, dest="stdout", color="never")

        @otel_gpu.api
        def take(x):
            return None

        view = torch.ones(1).expand(20000, 20000)
        take(torch.ones(4))  # warm: the first call imports and allocates what every call uses
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        take(view)
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        otel_gpu.flush(10)
        print("GREW_KB", grew)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    grew_kb = int(proc.stdout.split("GREW_KB")[1].split()[0])
    assert grew_kb < 400 * 1024, f"peak RSS grew by {grew_kb / 1024:.0f} MB"
    assert "input.x: min=1 max=1 mean=1 std=0 nan=0 inf=0 numel=400000000" in proc.stdout


BROADCASTS = {
    "column": lambda: torch.tensor([1.0, 2.0, 5.0]).reshape(3, 1).expand(3, 4),
    "NaN and Inf, repeated": lambda: torch.tensor([1.0, math.nan, math.inf, 4.0]).expand(5, 4),
    "all NaN": lambda: torch.tensor([math.nan]).expand(3, 3),
    "precision pass": lambda: torch.tensor([1e6, 1e6 + 1]).expand(7, 2),
    "integer": lambda: torch.tensor([3, 9]).expand(4, 2),
    "bool": lambda: torch.tensor([True, False]).expand(3, 2),
    "one stored element": lambda: torch.ones(1).expand(3, 5),
    "middle dimension": lambda: torch.arange(6.0).reshape(2, 1, 3).expand(2, 4, 3),
    "float16": lambda: torch.tensor([0.5, -2.0], dtype=torch.float16).expand(6, 2),
}


@pytest.mark.parametrize("make", list(BROADCASTS.values()), ids=list(BROADCASTS))
def test_statistics_of_a_broadcast_view_equal_those_of_the_materialised_tensor(
    otel_gpu_spans: Any, make: Any
) -> None:
    """A broadcast view's event — min/max/mean/std, NaN/Inf counts of its logical elements,
    numel and note — equals the event of the same values materialised (``.contiguous()``)."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def take(x: torch.Tensor) -> None:
        return None

    view = make()
    assert 0 in view.stride()
    take(view)
    take(view.contiguous())
    got, want = (_stats_of(s)["input.x"] for s in spans.get())
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, float):
            # float32 accumulation (float16 inputs): the sums differ in the last bits
            assert math.isclose(got[key], value, rel_tol=1e-6, abs_tol=1e-12), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("make", list(BROADCASTS.values()), ids=list(BROADCASTS))
def test_captured_statistics_of_a_broadcast_view_equal_the_materialised_ones(make: Any) -> None:
    """The CUDA-graph capture kernels (run here on CPU: the same ops) narrow a broadcast view and
    scale its counts on the device: the row read after a replay gives the materialised event."""
    from otel_gpu.calls import stats

    def captured(t: torch.Tensor) -> Any:
        pending = stats.capture("x", t)
        row = pending.vec.tolist()
        return stats.captured_stats("x", pending.numel, pending.note, pending.integer, row)

    view = make()
    got, want = captured(view), captured(view.contiguous())
    assert (got.numel, got.note, set(got.values)) == (want.numel, want.note, set(want.values))
    for key, value in want.values.items():
        assert math.isclose(got.values[key], value, rel_tol=1e-9, abs_tol=1e-12), key


# --------------------------------------------------------------------------- deep lists


@pytest.mark.parametrize(("level", "ring"), [(10, 0), (5, 4)], ids=["level10", "level5-ring"])
def test_a_list_nested_100000_deep_is_described_without_overflowing_the_stack(
    tmp_path: Any, level: int, ring: int
) -> None:
    """Attack: a list nested 100,000 deep with the recursion limit raised to a million. The
    builtin repr of it, on the describer thread, overflowed the C stack (SIGSEGV, exit -11).
    The description is now cut at a few levels, and the process exits 0."""
    proc = _child(
        f"""
        import glob, json
        from otel_gpu.calls import describe as _describe
        sys.setrecursionlimit(1_000_000)
        otel_gpu.configure(level={level}, ring={ring}, dest=os.devnull, dump_dir=DUMPS)

        @otel_gpu.api
        def take(x):
            return None

        deep = []
        for _ in range(100_000):
            deep = [deep]
        take(deep)
        otel_gpu.flush(10)
        assert _describe.drain(10)
        for path in glob.glob(os.path.join(DUMPS, "**", "manifest.json"), recursive=True):
            text = open(path).read()
            assert "[[[[" in text and "not described yet" not in text, text[:2000]
        print("SURVIVED")
        """,
        tmp_path,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "SURVIVED" in proc.stdout


def test_a_described_value_is_cut_in_depth_and_items() -> None:
    """The description of an argument runs no code of the value: nested containers stop at a
    few levels, long ones at a few items, and a user ``__repr__`` is never called."""
    ran: list[str] = []

    class Loud:
        def __repr__(self) -> str:
            ran.append("repr")
            return "Loud()"

    deep: list[Any] = []
    for _ in range(50):
        deep = [deep]
    text = _describe.safe_repr([deep, list(range(100)), Loud()], limit=1000)
    assert text.startswith("[[[[[...]]]], [0, 1, 2")
    assert ", ...]" in text and "Loud object at 0x" in text
    assert ran == []


# --------------------------------------------------------------------------- os._exit in hooks

EXIT_HOOKS = {
    "__repr__": """
        class Payload:
            def __repr__(self):
                os._exit(7)
        value = Payload()
    """,
    "__dict__ property": """
        class Payload:
            @property
            def __dict__(self):
                os._exit(8)
        value = Payload()
    """,
    "__torch_function__": """
        class Payload(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                os._exit(9)
        value = torch.ones(3).as_subclass(Payload)
    """,
}
EXIT_CASES = [
    pytest.param("__repr__", 10, 0, id="repr-level10"),
    pytest.param("__repr__", 5, 4, id="repr-level5-ring"),
    pytest.param("__dict__ property", 3, 0, id="dict-level3"),
    pytest.param("__dict__ property", 5, 0, id="dict-level5"),
    pytest.param("__dict__ property", 10, 0, id="dict-level10"),
    pytest.param("__dict__ property", 5, 4, id="dict-level5-ring"),
    pytest.param("__torch_function__", 3, 0, id="torch-function-level3"),
    pytest.param("__torch_function__", 5, 0, id="torch-function-level5"),
    pytest.param("__torch_function__", 10, 0, id="torch-function-level10"),
]


@pytest.mark.parametrize(("hook", "level", "ring"), EXIT_CASES)
def test_a_hook_calling_os_exit_is_never_run(
    tmp_path: Any, hook: str, level: int, ring: int
) -> None:
    """Attack: an argument whose ``__repr__``, ``__dict__`` property or ``__torch_function__``
    calls ``os._exit`` (which no ``except`` catches). Describing, walking or measuring the
    argument used to run it, ending the process with the payload's exit code; otel-gpu no
    longer runs such hooks, and the program ends normally."""
    proc = _child(
        EXIT_HOOKS[hook]
        + f"""
        otel_gpu.configure(level={level}, ring={ring}, dest=os.devnull, dump_dir=DUMPS)

        @otel_gpu.api
        def take(x):
            return 42

        assert take(value) == 42
        otel_gpu.flush(10)
        from otel_gpu.calls import describe as _describe
        assert _describe.drain(10)
        print("SURVIVED")
        """,
        tmp_path,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "SURVIVED" in proc.stdout


RESULTS = {
    "dict subclass whose items()/__len__ call os._exit": """
        class Payload(dict):
            def items(self):
                os._exit(5)
            def __len__(self):
                os._exit(6)
        value = Payload(t=torch.ones(2))
    """,
    "namedtuple subclass whose __iter__ calls os._exit": """
        import collections
        class Payload(collections.namedtuple("Pair", "a b")):
            def __iter__(self):
                os._exit(7)
        value = Payload(torch.ones(2), 3)
    """,
}


@pytest.mark.parametrize("payload", list(RESULTS.values()), ids=list(RESULTS))
@pytest.mark.parametrize("level", [3, 5])
def test_a_result_whose_methods_call_os_exit_is_read_without_them(
    tmp_path: Any, payload: str, level: int
) -> None:
    """Attack: a function returns a dict subclass whose ``items()`` and ``__len__``, or a
    namedtuple subclass whose ``__iter__``, call ``os._exit``. The output metadata read the
    result through them; it now reads through the builtin types' own methods, and the tensor
    inside is still recorded."""
    proc = _child(
        payload
        + f"""
        otel_gpu.configure(level={level}, dest="stdout", color="never")

        @otel_gpu.api
        def give():
            return value

        assert give() is value
        otel_gpu.flush(10)
        print("SURVIVED")
        """,
        tmp_path,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "SURVIVED" in proc.stdout
    assert "Tensor[2] float32" in proc.stdout


# --------------------------------------------------------------------------- sleeping hooks

RAN: list[str] = []


class SleepyDict:
    """An object whose ``__dict__`` property sleeps 5 s (``vars()`` would run it)."""

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        RAN.append("__dict__")
        time.sleep(5.0)
        return {"t": torch.ones(2)}


class SleepyFunction(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` sleeps 5 s on every torch function."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        RAN.append("__torch_function__")
        time.sleep(5.0)
        return super().__torch_function__(func, types, args, kwargs or {})


class Dispatching(torch.Tensor):
    """A wrapper subclass: every operation on it is its ``__torch_dispatch__``."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Dispatching:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        RAN.append("__torch_dispatch__")
        time.sleep(5.0)
        raise RuntimeError("hostile __torch_dispatch__")


@pytest.fixture
def ran() -> list[str]:
    RAN.clear()
    yield RAN
    RAN.clear()


@pytest.mark.parametrize("level", [3, 5])
def test_a_sleeping_dict_property_is_never_run(
    otel_gpu_spans: Any, ran: list[str], level: int
) -> None:
    """Attack: an argument whose ``__dict__`` property sleeps 5 s. ``vars()`` ran it on every
    call (+5 s each); the instance dict is now read through the interpreter's own descriptor
    only, so the property never runs and the argument is recorded as an object."""
    spans = otel_gpu_spans(level=level)

    @otel_gpu.api
    def take(x: Any) -> int:
        return 1

    assert take(SleepyDict()) == 1
    (span,) = spans.get()
    assert ran == []
    assert span.attributes["otel_gpu.input.x.type"].endswith("SleepyDict")


@pytest.mark.parametrize("level", [3, 5])
def test_a_sleeping_torch_function_is_never_run(
    otel_gpu_spans: Any, ran: list[str], level: int
) -> None:
    """Attack: a tensor subclass whose ``__torch_function__`` sleeps 5 s. Metadata (6 property
    reads) and statistics (a dozen reductions) ran it each time; they are now read with torch
    functions disabled for subclasses, so it never runs, and the values are the data's own."""
    spans = otel_gpu_spans(level=level)

    @otel_gpu.api
    def take(x: Any) -> int:
        return 1

    value = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).as_subclass(SleepyFunction)
    assert take(value) == 1
    (span,) = spans.get()
    assert ran == []
    attrs = span.attributes
    assert tuple(attrs["otel_gpu.input.x.shape"]) == (2, 2)
    assert attrs["otel_gpu.input.x.dtype"] == "torch.float32"
    if level == 5:
        stats = _stats_of(span)["input.x"]
        assert (stats[STATS_MIN], stats[STATS_MAX], stats[STATS_MEAN]) == (1.0, 4.0, 2.5)


def test_a_dispatching_subclass_keeps_its_metadata_and_skips_statistics(
    otel_gpu_spans: Any, ran: list[str]
) -> None:
    """Attack: a wrapper subclass whose ``__torch_dispatch__`` sleeps 5 s and raises. Every
    reduction would run it: its statistics are skipped with a note saying why, its metadata is
    recorded, and the hook never runs."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def take(x: Any) -> int:
        return 1

    assert take(Dispatching(torch.ones(2, 3))) == 1
    (span,) = spans.get()
    assert ran == []
    assert tuple(span.attributes["otel_gpu.input.x.shape"]) == (2, 3)
    stats = _stats_of(span)["input.x"]
    assert stats[STATS_NUMEL] == 6 and STATS_MIN not in stats
    assert stats[STATS_NOTE].startswith(
        "statistics skipped: tensor subclass Dispatching has its own __torch_dispatch__"
    )


# --------------------------------------------------------------------------- nested, full disk


def test_statistics_of_a_strided_nested_tensor_are_skipped_with_a_note(
    otel_gpu_spans: Any,
) -> None:
    """Attack: a strided nested tensor at level 5 (its layout says strided, yet it has no
    strides). The reductions raised a 40-line internal error; the event now says why there are
    no statistics (strict mode: an internal error would fail this test)."""
    spans = otel_gpu_spans(level=5)

    @otel_gpu.api
    def take(x: Any) -> Any:
        return x

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the prototype layout's warning
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert take(nested) is nested
    (span,) = spans.get()
    for key in ("input.x", "output.0"):
        stats = _stats_of(span)[key]
        assert stats[STATS_NUMEL] == 5
        assert stats[STATS_NOTE] == "statistics not supported for nested tensors"


def test_a_full_disk_at_level_10_is_one_line(tmp_path: Any) -> None:
    """Attack: a disk that refuses every write past 4 KiB (``RLIMIT_FSIZE``: the writes fail
    with EFBIG, as a full disk fails them with ENOSPC). ``torch.save`` turned the OSError into a
    RuntimeError, reported as an internal error with two tracebacks; it is now the recorder's
    one-line warning, and the program goes on."""
    proc = _child(
        """
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        otel_gpu.configure(level=10, dest=os.devnull, dump_dir=DUMPS)
        import mod_full_disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        for _ in range(3):
            assert mod_full_disk.twice(torch.ones(100_000))[0] == 2
        otel_gpu.flush(10)
        print("SURVIVED")
        """,
        tmp_path,
        OTEL_GPU_JOURNAL="false",
        PYTHONPATH=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SURVIVED" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "flight recorder stopped" in lines[0], proc.stderr


@pytest.fixture(autouse=True)
def _full_disk_module(tmp_path: Any) -> None:
    """A decorated function in a module of its own, for the child processes above."""
    (tmp_path / "mod_full_disk.py").write_text(
        "import otel_gpu\n\n@otel_gpu.api\ndef twice(x):\n    return x * 2\n"
    )
