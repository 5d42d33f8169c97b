"""Anomalies: the in-memory ring dumped when a call raises or produces NaN/Inf, stuck calls
reported at once, and the first producer of NaN found from the trace."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest
import torch

from otel_gpu import cli
from otel_gpu.export import pipeline
from otel_gpu.replay import Allow, Options, replay

LIB = """
import time
import torch
import otel_gpu

@otel_gpu.api
def scale(x, factor):
    return x * factor

@otel_gpu.api
def log(x):
    return torch.log(x)

@otel_gpu.api
def fail(x):
    raise ValueError("bad input")

@otel_gpu.api
def step(x):
    return log(scale(x, -1.0))
"""


def _manifests(root: Path) -> list[tuple[Path, dict]]:
    found = []
    for manifest in sorted(root.rglob("manifest.json")):
        found.append((manifest.parent, json.loads(manifest.read_text())))
    return found


def _ring_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("ring-"))


def test_a_call_that_raises_leaves_its_inputs_and_the_ring_on_disk(
    otel_gpu_spans, module_factory, tmp_path
):
    """Level 5, OTEL_GPU_RING=3: the raising call and the 2 calls before it are written, in call
    order; the raising call replays as 'raised as recorded'; its span names the ring dump."""
    root = tmp_path / "d"
    spans = otel_gpu_spans(level=5, ring=3, dump_dir=str(root))
    m = module_factory(LIB, "anomlib")
    for i in range(5):
        m.scale(torch.full((2,), float(i)), 2.0)
    with pytest.raises(ValueError):
        m.fail(torch.ones(2))
    (ring,) = _ring_dirs(root)
    assert "-raised-" in ring.name
    found = _manifests(ring)
    assert [mf["function"]["span_name"].rsplit(".", 1)[1] for _, mf in found] == [
        "scale",
        "scale",
        "fail",
    ]
    assert [mf["status"] for _, mf in found] == ["completed", "completed", "raised"]
    assert found[-1][1]["exception"]["type"] == "builtins.ValueError"
    kept = torch.load(found[0][0] / "inputs.pt", weights_only=True)
    assert torch.equal(kept["input.x"], torch.full((2,), 3.0))  # the 4th call: the ring kept 3
    failed = next(s for s in spans.get() if s.name.endswith("fail"))
    assert failed.attributes["otel_gpu.ring.dump.dir"] == str(ring)
    pipeline.reset(timeout=2.0)
    verdicts = {
        r.span_name.rsplit(".", 1)[1]: r.verdict
        for r in replay(str(ring), Options(allow=Allow([m.__name__])))
    }
    assert verdicts == {"scale": "unverified", "fail": "pass"}


def test_nonfinite_dump_writes_the_producer_with_its_outputs_and_replay_reproduces_the_nan(
    otel_gpu_spans, module_factory, tmp_path
):
    """OTEL_GPU_ON_NONFINITE=dump: the call that produced NaN (finite inputs) is written with its
    outputs and the ring before it; replay re-runs it and gets the NaN again (pass); the calls
    after it that only pass the NaN on are not dumped."""
    root = tmp_path / "d"
    otel_gpu_spans(level=5, ring=2, on_nonfinite="dump", dump_dir=str(root))
    m = module_factory(LIB, "anomlib")
    m.scale(torch.ones(2), 2.0)
    out = m.step(torch.ones(2))  # scale gives -1 (finite), log(-1) is NaN: log is the producer
    m.scale(out, 2.0)  # passes the NaN on: no new dump
    (ring,) = _ring_dirs(root)
    assert "-nonfinite-" in ring.name
    found = _manifests(ring)
    names = [mf["function"]["span_name"].rsplit(".", 1)[1] for _, mf in found]
    assert names[-1] == "log"
    producer_dir, producer = found[-1]
    outputs = torch.load(producer_dir / producer["files"]["outputs"], weights_only=True)
    assert torch.isnan(outputs["output"]).all()
    pipeline.reset(timeout=2.0)
    results = replay(str(producer_dir), Options(allow=Allow([m.__name__])))
    assert [r.verdict for r in results] == ["pass"]


def test_nonfinite_dump_without_a_ring_writes_the_producer_alone(
    otel_gpu_spans, module_factory, tmp_path
):
    """OTEL_GPU_ON_NONFINITE=dump with OTEL_GPU_RING=0: the producing call is still dumped."""
    root = tmp_path / "d"
    spans = otel_gpu_spans(level=5, on_nonfinite="dump", dump_dir=str(root))
    m = module_factory(LIB, "anomlib")
    m.scale(torch.ones(2), 2.0)
    m.log(torch.tensor([-1.0]))
    (ring,) = _ring_dirs(root)
    assert [mf["function"]["span_name"].rsplit(".", 1)[1] for _, mf in _manifests(ring)] == ["log"]
    log_span = next(s for s in spans.get() if s.name.endswith("log"))
    assert log_span.attributes["otel_gpu.ring.dump.dir"] == str(ring)


def test_ring_dumps_of_module_methods_replay_with_the_recorded_state(
    otel_gpu_spans, module_factory, tmp_path, fresh_module_states
):
    """With OTEL_GPU_DUMP_MODULES, a module method in a ring dump finds its state (kept once
    below the dump directory) and replays."""
    import otel_gpu

    root = tmp_path / "d"
    otel_gpu_spans(level=5, ring=2, dump_modules=True, dump_dir=str(root))
    m = module_factory(
        """
import torch
from torch import nn

class Norm(nn.Module):
    def __init__(self, width, eps=0.0):
        super().__init__()
        self.width, self.eps = width, eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
""",
        "normlib",
    )
    otel_gpu.instrument(m.Norm)
    norm = m.Norm(4)
    with pytest.raises(RuntimeError):
        norm(torch.ones(3))  # 3 features into a width-4 norm: raises
    (ring,) = _ring_dirs(root)
    pipeline.reset(timeout=2.0)
    otel_gpu.uninstrument()
    (result,) = replay(str(ring), Options(allow=Allow([m.__name__], any_instrument=True)))
    assert result.verdict == "pass" and "raised builtins.RuntimeError as recorded" in result.detail


def test_the_ring_is_bounded_and_holds_no_reference_to_the_callers_tensors(
    otel_gpu_spans, module_factory, tmp_path
):
    """At most N calls and OTEL_GPU_RING_MAX_MB bytes; the caller's tensors are copied, so a
    tensor the program drops is freed (on CUDA: no GPU memory kept alive)."""
    otel_gpu_spans(level=3, ring=4, ring_max_mb=1, dump_dir=str(tmp_path / "d"))
    m = module_factory(LIB, "anomlib")
    x = torch.ones(1000)
    ref = weakref.ref(x)
    m.scale(x, 1.0)
    del x
    gc.collect()
    assert ref() is None
    for _ in range(10):
        m.scale(torch.ones(10), 1.0)
    ring = pipeline.current().ring
    assert len(ring.entries) == 4
    m.scale(torch.ones(300_000), 1.0)  # 1.2 MB: over the bound, kept without its tensors
    big = ring.entries[-1]
    assert big.nbytes == 0 and "exceed OTEL_GPU_RING_MAX_MB" in big.manifest["why_not_replayable"]
    assert ring.bytes <= 2**20


STUCK = """
import sys, time, torch
sys.path.insert(0, {here!r})
import otel_gpu

@otel_gpu.api
def collective(tensor, group_size=8):
    time.sleep(60)  # a hung all-reduce

@otel_gpu.api
def warmup(x):
    return x + 1

warmup(torch.ones(3))
print("calling", flush=True)
collective(torch.ones(4, 2))
"""


def test_a_stuck_call_is_reported_within_the_interval_even_if_the_process_is_then_killed(
    tmp_path,
):
    """OTEL_GPU_STUCK_AFTER=0.5: a span with every thread's stack and the call's inputs reaches the
    file within about a second — before exit, which never comes: the process is SIGKILLed."""
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(STUCK).format(here=str(tmp_path)))
    spans_file = tmp_path / "spans.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_GPU_LOGLEVEL="3",
        OTEL_GPU_LOGDEST=str(spans_file),
        OTEL_GPU_STUCK_AFTER="0.5",
        OTEL_GPU_RING="4",
        OTEL_GPU_DUMP_DIR=str(tmp_path / "dumps"),
        OTEL_GPU_PROVIDER="own",
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "calling"
        called = time.monotonic()
        stuck = None
        while time.monotonic() - called < 20 and stuck is None:
            time.sleep(0.05)
            for line in spans_file.read_text().splitlines() if spans_file.exists() else ():
                for rs in json.loads(line)["resourceSpans"]:
                    for ss in rs["scopeSpans"]:
                        stuck = next(
                            (s for s in ss["spans"] if s["name"].startswith("otel_gpu.stuck")),
                            stuck,
                        )
        waited = time.monotonic() - called
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert stuck is not None, "no stuck report before the kill"
    print(
        f"\n[figure] stuck report in the file {waited:.2f} s after the call started (STUCK_AFTER=0.5)"
    )
    assert waited < 5.0
    attrs = {a["key"]: next(iter(a["value"].values())) for a in stuck["attributes"]}
    assert attrs["otel_gpu.stuck"] is True and attrs["otel_gpu.stuck.call"] == "__main__.collective"
    assert attrs["otel_gpu.input.tensor.shape"]["values"] == [{"intValue": "4"}, {"intValue": "2"}]
    assert stuck["parentSpanId"] == attrs["otel_gpu.stuck.span_id"]
    stacks = [e for e in stuck["events"] if e["name"] == "otel_gpu.thread_stack"]
    assert len(stacks) >= 2  # the caller and the export thread at least
    mine = [{a["key"]: next(iter(a["value"].values())) for a in e["attributes"]} for e in stacks]
    caller = next(e for e in mine if e["otel_gpu.stuck.thread"] is True)
    assert (
        "time.sleep(60)" in caller["code.stacktrace"] and "collective" in caller["code.stacktrace"]
    )
    (ring,) = _ring_dirs(tmp_path / "dumps")
    statuses = {mf["function"]["span_name"]: mf["status"] for _, mf in _manifests(ring)}
    assert statuses == {"__main__.warmup": "completed", "__main__.collective": "inputs_saved"}
    assert attrs["otel_gpu.ring.dump.dir"] == str(ring)


SIGTERM = """
import sys, time, torch
import otel_gpu

@otel_gpu.api
def serve(batch):
    time.sleep(60)

print("serving", flush=True)
serve(torch.ones(2))
"""


def test_sigterm_dumps_the_calls_in_flight_then_the_process_ends_as_asked(tmp_path):
    """With the ring on, SIGTERM writes the in-flight call (status inputs_saved) and the process
    then ends by SIGTERM, as it would have without otel-gpu."""
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(SIGTERM))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_GPU_LOGLEVEL="3",
        OTEL_GPU_LOGDEST=str(tmp_path / "s.jsonl"),
        OTEL_GPU_RING="2",
        OTEL_GPU_DUMP_DIR=str(tmp_path / "dumps"),
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "serving"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    (ring,) = _ring_dirs(tmp_path / "dumps")
    assert "-sigterm-" in ring.name
    ((_, manifest),) = _manifests(ring)
    assert (
        manifest["status"] == "inputs_saved"
        and manifest["function"]["span_name"] == "__main__.serve"
    )


def test_show_nonfinite_names_the_module_whose_weight_is_nan(tmp_path, capsys):
    """A tiny GPT2 with every module instrumented and one weight set to NaN: `otel-gpu show
    --nonfinite` names that module's call (its inputs are finite, its output is not)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_models

    import otel_gpu

    otel_gpu.configure(level=5, dest=str(tmp_path / "t.jsonl"), provider="own")
    model = tiny_models.gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    otel_gpu.instrument_module(model)
    ids, mask = tiny_models.inputs()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    otel_gpu.flush()
    capsys.readouterr()
    assert cli.main(["show", str(tmp_path / "t.jsonl"), "--nonfinite", "--no-color"]) == 0
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if "transformer.h" in line)
    assert "transformer.h.1.mlp.c_fc" in first, out


def test_a_weight_set_to_nan_is_dumped_at_its_producer_and_replay_reproduces_it(
    otel_gpu_spans, module_factory, tmp_path, capsys, fresh_module_states
):
    """The issue's model: a layer whose weight turned NaN. With ON_NONFINITE=dump, the ring and
    module states on, that layer's call (finite input, NaN output) is dumped; replay rebuilds the
    layer from its recorded state and gets the NaN again; show --nonfinite names it."""
    import otel_gpu

    root = tmp_path / "d"
    trace = tmp_path / "t.jsonl"
    otel_gpu.configure(
        level=5,
        dest=str(trace),
        provider="own",
        ring=4,
        on_nonfinite="dump",
        dump_modules=True,
        dump_dir=str(root),
    )
    m = module_factory(
        """
import torch
from torch import nn

class Dense(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.eye(width))

    def forward(self, x):
        return x @ self.weight

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Dense(4), Dense(4)

    def forward(self, x):
        return self.second(self.first(x))
""",
        "nanlib",
    )
    otel_gpu.instrument(m.Dense)
    otel_gpu.instrument(m.Net)
    net = m.Net()
    with torch.no_grad():
        net.second.weight[0, 0] = float("nan")
        out = net(torch.ones(2, 4))
    assert torch.isnan(out).any()
    otel_gpu.flush()
    (ring,) = _ring_dirs(root)
    producer_dir, producer = _manifests(ring)[-1]
    assert (
        producer["function"]["qualname"] == "Dense.forward"
        and producer["receiver"]["t"] == "module"
    )
    pipeline.reset(timeout=2.0)
    otel_gpu.uninstrument()
    (result,) = replay(str(producer_dir), Options(allow=Allow([m.__name__], any_instrument=True)))
    assert result.verdict == "pass" and result.detail.startswith("reproduced:"), result.detail
    capsys.readouterr()
    assert cli.main(["show", str(trace), "--nonfinite", "--no-color"]) == 0
    report = capsys.readouterr().out
    assert "First producer of NaN/Inf: " in report and "Dense.forward[1]" in report, report
    assert producer["span_id"] in report
