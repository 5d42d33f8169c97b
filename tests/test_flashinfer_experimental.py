"""Target ``flashinfer`` never changes FlashInfer's behaviour: every experimental API of the
installed package (``@flashinfer_experimental_api``, which wraps ``@flashinfer_api`` once more)
raises on CPU exactly the error it raises without otel-gpu, whether otel-gpu was installed
before or after ``import flashinfer``.

Each mode runs in its own process: FlashInfer reads its settings once, at import.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from commands import python_command

pytest.importorskip("flashinfer")

pytestmark = pytest.mark.flashinfer

_SCRIPT = textwrap.dedent(
    """
    import importlib, inspect, json, re, sys, warnings
    warnings.simplefilter("ignore")
    mode = sys.argv[1]
    import otel_gpu
    if mode == "before":
        otel_gpu.instrument("flashinfer")
    import flashinfer
    import torch
    if mode == "after":
        otel_gpu.instrument("flashinfer")
    from otel_gpu.instrumentation import flashinfer as target

    def arguments(fn):
        # a small CPU tensor for every required parameter: the call reaches FlashInfer's checks
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return (), {}
        args, kwargs = [], {}
        for p in params:
            if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            value = torch.zeros(2, 2)
            if p.kind is p.KEYWORD_ONLY:
                kwargs[p.name] = value
            else:
                args.append(value)
        return tuple(args), kwargs

    def outcome(api):
        try:
            owner = cls = importlib.import_module(api.module)
            for part in api.qualname.split("."):
                cls, owner = owner, getattr(owner, part)
        except BaseException as exc:
            return ["unreachable", type(exc).__name__]
        args, kwargs = arguments(owner)
        if "." in api.qualname and args:
            # a method, called through its class on an instance whose __init__ did not run
            args = (cls.__new__(cls), *args[1:])
        try:
            owner(*args, **kwargs)
        except RecursionError as exc:
            return ["RecursionError", str(exc)[:200]]
        except BaseException as exc:
            message = re.sub(r"0x[0-9a-f]+", "0x?", str(exc))[:300]
            return [f"{type(exc).__module__}.{type(exc).__qualname__}", message]
        return ["returned", ""]

    apis = [a for a in target.decorated_apis() if a.experimental]
    otel_gpu.flush()
    print(json.dumps({f"{a.module}:{a.qualname}": outcome(a) for a in apis}))
    """
)


def _run(mode: str, tmp_path: Path) -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLASHINFER_"))}
    env["OTEL_GPU_LOGLEVEL"] = "3"
    env["OTEL_GPU_LOGDEST"] = str(tmp_path / f"{mode}.jsonl")
    done = python_command(["-c", _SCRIPT, mode], env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[str]]]:
    tmp_path = tmp_path_factory.mktemp("experimental")
    found = {mode: _run(mode, tmp_path) for mode in ("plain", "before", "after")}
    found["dir"] = {"path": [str(tmp_path)]}
    return found


def tmp_dir(outcomes: dict[str, dict[str, list[str]]]) -> Path:
    return Path(outcomes["dir"]["path"][0])


def test_the_experimental_apis_are_found(outcomes: dict[str, dict[str, list[str]]]) -> None:
    """The scan finds the experimental APIs the issue names, and most of them are called."""
    plain = outcomes["plain"]
    names = {key.rsplit(":", 1)[-1] for key in plain}
    assert {"sm110_gqa_decode", "prepare_sm110_gqa_decode"} <= names
    assert any("cudnn_frost_grouped_gemm1_swiglu" in n for n in names)
    called = [v for v in plain.values() if v[0] != "unreachable"]
    assert len(called) >= 80
    assert not any(v[0] == "RecursionError" for v in plain.values())


@pytest.mark.parametrize("mode", ["before", "after"])
def test_every_experimental_api_raises_flashinfers_own_error(
    outcomes: dict[str, dict[str, list[str]]], mode: str
) -> None:
    """Instrumented before or after import, each API ends as it does without otel-gpu: the same
    exception type and message (never a RecursionError from a wrapper calling itself)."""
    plain, got = outcomes["plain"], outcomes[mode]
    assert set(got) == set(plain)
    # the APIs were routed: their calls are spans (error spans, as they raised)
    spans = (tmp_dir(outcomes) / f"{mode}.jsonl").read_text()
    assert '"flashinfer.sm110_gqa_decode"' in spans
    differ = {key: (plain[key], got[key]) for key in plain if got[key] != plain[key]}
    assert differ == {}
