"""Replay of calls recorded through otel_gpu.instrument(): the target is applied again only when
the user names it, so a dump can never make replay call a function nobody chose."""

from __future__ import annotations

import json
import os
import shutil

import torch
from crafted_dumps import crafted_manifest, write_call

import otel_gpu
from otel_gpu import cli
from otel_gpu.export import pipeline
from otel_gpu.replay import Allow, Options, replay

LIB = """
def scale(x, factor=2.0):
    return x * factor
"""


def _record(otel_gpu_spans, module_factory, tmp_path):
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root))
    m = module_factory(LIB, "instlib")
    otel_gpu.instrument(f"{m.__name__}.scale")
    m.scale(torch.ones(2), 3.0)
    pipeline.reset(timeout=2.0)
    otel_gpu.uninstrument()
    return m, root


def test_an_instrumented_call_replays_when_its_target_is_named(
    otel_gpu_spans, module_factory, tmp_path
):
    """Named with Allow(instrument=...) (the CLI's --instrument / OTEL_GPU_INSTRUMENT) or trusted:
    replay instruments the module again and the call passes."""
    m, root = _record(otel_gpu_spans, module_factory, tmp_path)
    spec = f"{m.__name__}.scale"
    (named,) = replay(str(root), Options(allow=Allow([m.__name__], [spec])))
    assert named.verdict == "pass", named.detail
    otel_gpu.uninstrument()
    (trusted,) = replay(str(root), Options(allow=Allow([m.__name__], any_instrument=True)))
    assert trusted.verdict == "pass"


def test_an_instrumented_call_is_skipped_until_its_target_is_named(
    otel_gpu_spans, module_factory, tmp_path
):
    """Module allowed but target not named: skipped, and the reason names the flag to pass."""
    m, root = _record(otel_gpu_spans, module_factory, tmp_path)
    (result,) = replay(str(root), Options(allow=Allow([m.__name__])))
    assert result.verdict == "skipped"
    assert f"--instrument {m.__name__}.scale" in result.detail


def test_a_crafted_dump_cannot_make_replay_call_os_system(tmp_path, capsys):
    """A manifest naming os.system as an instrumented function: --allow-module os is a usage
    error (exit 2, os is denylisted), and --trust-dump refuses the call (error, exit 1); never
    instrumented, never called (the command it carries never runs)."""
    marker = tmp_path / "pwned"
    function = {"span_name": "os.system", "module": "os", "qualname": "system"}
    command = {"t": "str", "v": f"touch {marker}"}
    manifest = crafted_manifest(
        {**function, "instrumented": "os.system"},
        [("command", command)],
        result={"t": "int", "v": 0},
    )
    write_call(tmp_path / "d", manifest)
    code = cli.main(["replay", "--dir", str(tmp_path / "d"), "--allow-module", "os", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "--allow-module os: 'os' is on replay's denylist" in err
    code = cli.main(["replay", "--dir", str(tmp_path / "d"), "--trust-dump", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert not marker.exists()
    assert report["results"][0]["verdict"] == "error"
    assert report["results"][0]["detail"].startswith("refused: function os.system is in 'os'")
    assert code == 1
    assert "__otel_gpu_plan__" not in getattr(os.system, "__dict__", {})  # never patched


def test_positional_counts_the_arguments_as_passed(otel_gpu_spans, module_factory, tmp_path):
    """`positional` is the number of arguments passed positionally, a plain function's first
    argument included (only a method's self is not counted)."""
    root = tmp_path / "d"
    otel_gpu_spans(level=10, dump_dir=str(root))
    m = module_factory(
        """
import otel_gpu

@otel_gpu.api
def f(a, b=1):
    return a

class C:
    @otel_gpu.api
    def g(self, a, b=1):
        return a
""",
        "poslib",
    )
    m.f(1, 2)
    m.f(1, b=2)
    m.C().g(1, 2)
    pipeline.reset(timeout=2.0)
    counts = [
        json.loads((d / "manifest.json").read_text())["positional"]
        for d in sorted(p for p in root.iterdir() if p.is_dir())
    ]
    assert counts == [2, 1, 2]
    shutil.rmtree(root)
