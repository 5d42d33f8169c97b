"""``otel-gpu replay``: record → replay verdicts, exit codes, flags, safety and span links."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from crafted_dumps import crafted_manifest, write_call
from dump_files import finish as _finish
from lib_sources import RECEIVERS
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_gpu import cli
from otel_gpu.replay import Allow, Options, compare, replay

LIB = (
    """
import collections
import enum
import torch
import otel_gpu

class Mode(enum.Enum):
    SUM = "sum"
    MAX = "max"

Pair = collections.namedtuple("Pair", "a b")

@otel_gpu.api
def positional(x, y, /, scale):
    return x * scale + y

@otel_gpu.api
def keywords(x, *, scale=2.0, bias=None):
    return x * scale + (0 if bias is None else bias)

@otel_gpu.api
def nested(items, opts):
    total = sum(t.sum() for t in items[0]) + items[1].a
    if opts["mode"] is Mode.MAX:
        total = total * 2
    return {"total": total.to(opts["dtype"]), "n": len(items[0]), "pair": items[1]}

@otel_gpu.api
def layout(x):
    return x * 2, x.stride(), x.is_contiguous(), x.storage_offset()

@otel_gpu.api
def varargs(first, *rest, **named):
    return first + sum(rest) + sum(named.values())

@otel_gpu.api
def alias(a, b):
    return a is b

@otel_gpu.api
def inplace(x, out):
    out.copy_(x * 2)

@otel_gpu.api
def fails(x):
    raise ValueError("bad input")

@otel_gpu.api
def half(x):
    return (x * 3).half()

@otel_gpu.api
async def async_scale(x, factor=2.0):
    return x * factor
"""
    + RECEIVERS
)


@pytest.fixture
def lib(module_factory):
    """Returns ``load(source)``: writes a fresh module below tmp_path and imports it (decorated at the current level)."""
    return lambda source=LIB: module_factory(source, "replaylib")


def _record(otel_gpu_spans, tmp_path, fmt="torch"):
    root = tmp_path / "d"
    spans = otel_gpu_spans(level=10, dump_dir=str(root), dump_format=fmt)
    return root, spans


def _opts(module, **kw) -> Options:
    return Options(allow=Allow([module.__name__]), **kw)


def _verdicts(results) -> list[str]:
    return [r.verdict for r in results]


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_record_then_replay_passes_for_every_argument_kind(otel_gpu_spans, lib, tmp_path, fmt):
    """Positional-only, keyword-only, defaults, nested containers, enums, dtypes, namedtuples, varargs, non-contiguous and aliased inputs replay to pass."""
    root, _ = _record(otel_gpu_spans, tmp_path, fmt)
    m = lib()
    base = torch.arange(24.0).view(4, 6)
    m.positional(torch.ones(3), torch.arange(3.0), 0.5)
    m.keywords(torch.ones(2), bias=torch.ones(2))
    m.nested(
        [[torch.ones(2), torch.ones(3)], m.Pair(torch.tensor(1.0), "b")],
        {"mode": m.Mode.MAX, "dtype": torch.float64},
    )
    m.layout(base.t())
    m.layout(base[1:, ::2])
    m.layout(torch.ones(4, 1).expand(4, 5))
    m.varargs(torch.ones(1), torch.ones(1), 2, k=torch.ones(1))
    t = torch.ones(2)
    m.alias(t, t)
    _finish()
    results = replay(str(root), _opts(m))
    assert _verdicts(results) == ["pass"] * 8, [r.detail for r in results]


def test_async_functions_are_recorded_and_replayed(otel_gpu_spans, lib, tmp_path, monkeypatch):
    """An async API is recorded with its awaited result, and replay awaits it before comparing."""
    import asyncio

    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    asyncio.run(m.async_scale(torch.ones(2), factor=3.0))
    _finish()
    assert _verdicts(replay(str(root), _opts(m))) == ["pass"]

    async def changed(x, factor=2.0):
        return x * factor + 1

    monkeypatch.setattr(m.async_scale, "__wrapped__", changed)
    assert _verdicts(replay(str(root), _opts(m))) == ["mismatch"]


def test_replay_restores_recorded_strides_and_offsets(otel_gpu_spans, lib, tmp_path, monkeypatch):
    """The replayed function receives inputs with the recorded stride, contiguity and storage offset."""
    root, _ = _record(otel_gpu_spans, tmp_path, "safetensors")
    m = lib()
    base = torch.arange(24.0).view(4, 6)
    m.layout(base[1:, ::2])
    _finish()
    seen = []
    raw = m.layout.__wrapped__
    monkeypatch.setattr(
        m.layout, "__wrapped__", lambda x: seen.append((x.stride(), x.storage_offset())) or raw(x)
    )
    assert _verdicts(replay(str(root), _opts(m))) == ["pass"]
    assert seen == [((6, 2), 6)]


def test_a_deliberate_change_is_a_mismatch_with_output_and_differences(
    otel_gpu_spans, lib, tmp_path, monkeypatch
):
    """After changing the function, replay reports mismatch naming the output and its max abs/rel difference."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.keywords(torch.ones(4), scale=3.0)
    _finish()
    monkeypatch.setattr(
        m.keywords, "__wrapped__", lambda x, *, scale=2.0, bias=None: x * scale + 0.5
    )
    (result,) = replay(str(root), _opts(m))
    assert result.verdict == "mismatch"
    (mismatch,) = result.mismatches
    assert mismatch["output"] == "output"
    assert mismatch["max_abs"] == pytest.approx(0.5)
    assert mismatch["max_rel"] == pytest.approx(0.5 / 3)
    assert "output: 4 of 4 elements differ" in result.detail


def test_in_place_outputs_are_compared(otel_gpu_spans, lib, tmp_path, monkeypatch):
    """A call that writes into an argument is checked on what it writes, not only on what it returns."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.inplace(torch.ones(2), torch.zeros(2))
    _finish()
    assert _verdicts(replay(str(root), _opts(m))) == ["pass"]

    def changed(x, out):
        out.copy_(x * 3)

    monkeypatch.setattr(m.inplace, "__wrapped__", changed)
    (result,) = replay(str(root), _opts(m))
    assert result.verdict == "mismatch" and result.mismatches[0]["output"] == "in-place out"


def test_recorded_exception_replays_as_pass_and_its_absence_as_mismatch(
    otel_gpu_spans, lib, tmp_path, monkeypatch
):
    """A call recorded as raising passes when it raises the same type again, and is a mismatch when it no longer does."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    with pytest.raises(ValueError):
        m.fails(torch.ones(1))
    _finish()
    (result,) = replay(str(root), _opts(m))
    assert (result.verdict, result.detail) == ("pass", "raised builtins.ValueError as recorded")
    monkeypatch.setattr(m.fails, "__wrapped__", lambda x: x)
    (result,) = replay(str(root), _opts(m))
    assert (
        result.verdict == "mismatch" and "recorded call raised builtins.ValueError" in result.detail
    )


def test_a_call_that_now_raises_is_an_error_with_the_exception(
    otel_gpu_spans, lib, tmp_path, monkeypatch
):
    """A recorded successful call that raises on replay gets verdict error with the exception type and message."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.positional(torch.ones(1), torch.ones(1), 1.0)
    _finish()

    def broken(x, y, scale):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(m.positional, "__wrapped__", broken)
    (result,) = replay(str(root), _opts(m))
    assert result.verdict == "error"
    assert result.exception == {"type": "builtins.RuntimeError", "message": "kernel exploded"}


def test_default_tolerances_follow_the_dtype(otel_gpu_spans, lib, tmp_path, monkeypatch):
    """float16 outputs within assert_close's float16 tolerance pass by default and fail with --rtol/--atol 0."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.half(torch.full((8,), 100.0))
    _finish()
    # one fp16 step (0.25) above 300: a relative difference of 8.3e-4, inside fp16's rtol of 1e-3
    monkeypatch.setattr(m.half, "__wrapped__", lambda x: (x * 3 + 0.2).half())
    assert float((torch.full((8,), 300.2)).half()[0]) == 300.25
    assert _verdicts(replay(str(root), _opts(m))) == ["pass"]
    assert _verdicts(replay(str(root), _opts(m, rtol=0.0, atol=0.0))) == ["mismatch"]
    assert compare.tolerance(torch.float32, None, None) == (1.3e-6, 1e-5)
    assert compare.tolerance(torch.bfloat16, None, 0.1) == (1.6e-2, 0.1)
    assert compare.tolerance(torch.int64, None, None) == (0.0, 0.0)


def test_methods_replay_through_the_state_hook_or_are_skipped_as_stateful(
    otel_gpu_spans, lib, tmp_path
):
    """A method whose class has __otel_gpu_state__ is rebuilt and passes; one without is skipped (stateful method); classmethods pass."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.Scaler(torch.tensor(3.0)).run(torch.ones(2))
    m.Opaque().run(torch.ones(2))
    m.Factory.make(3)
    _finish()
    results = replay(str(root), _opts(m))
    assert _verdicts(results) == ["pass", "skipped", "pass"]
    assert results[1].detail.startswith("stateful method")


def test_replay_spans_link_to_the_original_calls(otel_gpu_spans, lib, tmp_path):
    """Each replayed call's span carries a link to the recorded span (trace and span id) and the verdict."""
    root, spans = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.positional(torch.ones(1), torch.ones(1), 2.0)
    m.keywords(torch.ones(1))
    originals = [s.get_span_context() for s in spans.get()]
    _finish()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    replay(str(root), _opts(m), tracer_provider=provider)
    got = {s.name: s for s in exporter.get_finished_spans()}
    root_span = got.pop("otel-gpu replay")
    assert sorted(got) == [f"replay {m.__name__}.keywords", f"replay {m.__name__}.positional"]
    linked = []
    for span in got.values():
        assert span.parent.span_id == root_span.context.span_id
        assert span.attributes["otel_gpu.replay.verdict"] == "pass"
        (link,) = span.links
        linked.append((link.context.trace_id, link.context.span_id))
    assert sorted(linked) == sorted((c.trace_id, c.span_id) for c in originals)


def test_crafted_pickle_in_a_dump_is_not_executed(otel_gpu_spans, lib, tmp_path):
    """An inputs.pt holding a pickle that would run a command is refused by weights_only loading; the command never runs."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.keywords(torch.ones(1))
    _finish()
    (directory,) = [os.path.join(root, d) for d in os.listdir(root)]
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"input.x": Evil()}, os.path.join(directory, "inputs.pt"))
    torch.load(os.path.join(directory, "inputs.pt"), weights_only=False)  # the payload is live...
    assert marker.exists()
    marker.unlink()
    (result,) = replay(str(root), _opts(m))
    assert not marker.exists()  # ...but replay never runs it
    assert result.verdict == "error" and "holds objects other than tensors" in result.detail
    assert "posix.system" in result.detail


def test_crafted_manifest_cannot_call_arbitrary_functions_or_read_outside(
    otel_gpu_spans, lib, tmp_path
):
    """A manifest naming os.system is refused (os is denylisted: no Allow can name it), and file names cannot escape the call dir."""
    function = {"span_name": "os.system", "module": "os", "qualname": "system"}
    command = {"t": "str", "v": "touch x"}
    manifest = crafted_manifest(function, [("command", command)], result={"t": "int", "v": 0})
    call = write_call(tmp_path, manifest)
    (result,) = replay(str(tmp_path), Options(allow=Allow(["mylib"])))
    assert result.verdict == "error" and "refused: function os.system is in 'os'" in result.detail
    with pytest.raises(ValueError, match="'os' is on replay's denylist"):
        Allow(["os"])
    otel_gpu_spans(level=1)
    m = lib()
    manifest["function"] = {"span_name": "x", "module": m.__name__, "qualname": "keywords"}
    manifest["files"]["inputs"] = "../../../etc/passwd.pt"
    (call / "manifest.json").write_text(json.dumps(manifest))
    (result,) = replay(str(tmp_path), _opts(m))
    assert result.verdict == "error" and "refusing tensor file name" in result.detail


def test_device_mapping_replays_cuda_recordings_on_cpu(otel_gpu_spans, lib, tmp_path):
    """A call recorded on cuda is skipped on a machine without it, and passes with --device cuda=cpu."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.keywords(torch.ones(3), scale=2.0, bias=torch.ones(3))
    _finish()
    (directory,) = [os.path.join(root, d) for d in os.listdir(root)]
    path = os.path.join(directory, "manifest.json")
    manifest = json.load(open(path))
    for meta in manifest["tensors"].values():
        meta["device"] = "cuda:0"
    json.dump(manifest, open(path, "w"))
    if not torch.cuda.is_available():
        (result,) = replay(str(root), _opts(m))
        assert result.verdict == "skipped" and "--device cuda=cpu" in result.detail
    (result,) = replay(str(root), _opts(m, device_map={"cuda": "cpu"}))
    assert result.verdict == "pass"


def test_cli_json_report_filters_fail_fast_and_exit_codes(
    otel_gpu_spans, lib, tmp_path, monkeypatch, capsys
):
    """--json gives one result per call and a summary; --include/--exclude select; --fail-fast stops; exit 1 only on failure."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.positional(torch.ones(1), torch.ones(1), 1.0)
    m.keywords(torch.ones(1))
    m.half(torch.ones(1))
    _finish()
    base = ["replay", "--dir", str(root), "--allow-module", m.__name__, "--json"]

    def run(*extra):
        code = cli.main([*base, *extra])
        return code, json.loads(capsys.readouterr().out)

    code, report = run()
    assert code == 0 and report["exit_code"] == 0
    assert report["summary"] == {
        "total": 3,
        "pass": 3,
        "mismatch": 0,
        "error": 0,
        "crashed-originally": 0,
        "unverified": 0,
        "skipped": 0,
    }
    code, report = run("--include", "*.keywords,*.half", "--exclude", "*.half")
    assert [r["span_name"].rsplit(".", 1)[1] for r in report["results"]] == ["keywords"]
    monkeypatch.setattr(m.positional, "__wrapped__", lambda x, y, scale: x - y)
    monkeypatch.setattr(m.keywords, "__wrapped__", lambda x, **kw: x * 0)
    code, report = run()
    assert code == 1 and report["summary"]["mismatch"] == 2
    code, report = run("--fail-fast")
    assert code == 1 and [r["verdict"] for r in report["results"]] == ["mismatch"]


def test_cli_refuses_to_import_without_an_allow_list(otel_gpu_spans, lib, tmp_path, capsys):
    """Non-interactive replay without --allow-module or --trust-dump imports nothing and exits 2, naming the modules."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.keywords(torch.ones(1))
    _finish()
    assert cli.main(["replay", "--dir", str(root)]) == 2
    assert m.__name__ in capsys.readouterr().err
    assert cli.main(["replay", "--dir", str(root), "--trust-dump"]) == 0
    assert cli.main(["replay", "--dir", str(tmp_path / "empty")]) == 2


@pytest.mark.parametrize(("answer", "code"), [("y", 0), ("", 2)])
def test_interactive_replay_asks_before_importing_recorded_modules(
    otel_gpu_spans, lib, tmp_path, monkeypatch, capsys, answer, code
):
    """On a terminal without --allow-module, replay lists the recorded modules and imports them only after a yes."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.keywords(torch.ones(1))
    _finish()
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or answer)
    assert cli.main(["replay", "--dir", str(root), "--no-progress"]) == code
    assert len(asked) == 1 and m.__name__ in capsys.readouterr().err


def test_a_single_call_directory_can_be_replayed(otel_gpu_spans, lib, tmp_path):
    """--dir may name one call's directory instead of the dump root."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.keywords(torch.ones(1))
    m.keywords(torch.ones(2))
    _finish()
    second = sorted(os.listdir(root))[1]
    results = replay(str(root / second), _opts(m))
    assert [os.path.basename(r.dir) for r in results] == [second]
    assert _verdicts(results) == ["pass"]


def test_a_crashed_call_that_cannot_be_rerun_stays_crashed_originally(
    otel_gpu_spans, lib, tmp_path
):
    """A call that never completed but cannot be replayed (stateful method) is crashed-originally, not skipped."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.Opaque().run(torch.ones(1))
    _finish()
    (directory,) = [os.path.join(root, d) for d in os.listdir(root)]
    manifest = json.load(open(os.path.join(directory, "manifest.json")))
    manifest.update(status="inputs_saved", result=None)
    json.dump(manifest, open(os.path.join(directory, "manifest.json"), "w"))
    os.remove(os.path.join(directory, "returned"))
    (result,) = replay(str(root), _opts(m, in_process=True))
    assert result.verdict == "crashed-originally"
    assert "cannot be re-run: stateful method" in result.detail


def test_returned_calls_without_outputs_and_incomplete_dumps_are_skipped(
    otel_gpu_spans, lib, tmp_path
):
    """A call that returned but whose outputs never reached the disk is skipped, not crashed-originally; so is a dump without manifest."""
    root, _ = _record(otel_gpu_spans, tmp_path)
    m = lib()
    m.keywords(torch.ones(1))
    m.keywords(torch.ones(2))
    _finish()
    first, second = sorted(os.path.join(root, d) for d in os.listdir(root))
    manifest = json.load(open(os.path.join(first, "manifest.json")))
    manifest.update(status="inputs_saved", result=None)
    json.dump(manifest, open(os.path.join(first, "manifest.json"), "w"))
    os.remove(os.path.join(second, "manifest.json"))
    results = replay(str(root), _opts(m))
    assert _verdicts(results) == ["skipped", "skipped"]
    assert "returned" in results[0].detail and "incomplete dump" in results[1].detail
