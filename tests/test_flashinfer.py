"""Target ``flashinfer``: FlashInfer's ``@flashinfer_api`` APIs become otel-gpu spans.

Runs against the real FlashInfer. Without a GPU its kernels raise a clean error before any
launch (a clean raise is a span with ERROR status); a few planning helpers run on CPU.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import types
from collections.abc import Iterator
from typing import Any

import pytest
from commands import python_command

pytest.importorskip("flashinfer")

import flashinfer
import torch
from opentelemetry.trace import StatusCode

import otel_gpu
from otel_gpu.calls import decorator
from otel_gpu.instrumentation import flashinfer as _flashinfer

pytestmark = [
    pytest.mark.flashinfer,
    pytest.mark.filterwarnings("ignore:.*is an experimental FlashInfer API"),
]


def _decorate(fn: Any, name: str) -> Any:
    return otel_gpu.api(name=name)(fn)


def _attrs(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


def _qo_indptr_api() -> Any:
    """An experimental planning helper that runs on CPU (a lazily imported module)."""
    from flashinfer.attention.prims_ts import decode

    return decode.make_q_token_kv_block_sparse_qo_indptr


@pytest.fixture
def routed(otel_gpu_spans: Any) -> Iterator[Any]:
    """otel-gpu at level 3 and the target installed after FlashInfer was imported."""
    spans = otel_gpu_spans(level=3)
    _flashinfer.install(_decorate)
    try:
        yield spans
    finally:
        _flashinfer.uninstall()


def _flashinfer_namespace() -> dict[tuple[str, ...], Any]:
    """Every callable FlashInfer's modules and classes hold, and what their closures hold."""
    out: dict[tuple[str, ...], Any] = {}

    def add(key: tuple[str, ...], value: Any) -> None:
        out[key] = value
        fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        for i, cell in enumerate(getattr(fn, "__closure__", None) or ()):
            try:
                if callable(cell.cell_contents):
                    out[(*key, f"cell{i}")] = cell.cell_contents
            except ValueError:
                pass

    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or not name.startswith("flashinfer"):
            continue
        for key, value in list(vars(module).items()):
            if isinstance(value, type) and str(getattr(value, "__module__", "")).startswith(
                "flashinfer"
            ):
                for ckey, cvalue in list(vars(value).items()):
                    if callable(cvalue) or isinstance(cvalue, (staticmethod, classmethod)):
                        add((name, key, ckey), cvalue)
            elif callable(value):
                add((name, key), value)
    return out


def _is_ours(obj: Any) -> bool:
    fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    code = getattr(fn, "__code__", None)
    # the wrappers are built in the calls layer (otel_gpu.api, at the top, hands fn to it)
    return code is not None and code.co_filename == decorator.make_plan.__code__.co_filename


def test_source_scan_finds_the_decorated_apis() -> None:
    """The list comes from FlashInfer's source: functions, wrapper methods, experimental APIs."""
    apis = _flashinfer.decorated_apis()
    names = {(a.module, a.qualname) for a in apis}
    assert len(apis) > 400
    assert ("flashinfer.norm", "rmsnorm") in names
    assert ("flashinfer.decode", "BatchDecodeWithPagedKVCacheWrapper.plan") in names
    assert ("flashinfer.decode", "BatchDecodeWithPagedKVCacheWrapper.run") in names
    assert any(a.experimental for a in apis)
    assert _flashinfer.decorated_apis() is apis  # parsed once


def test_an_api_that_raises_is_one_error_span_with_its_arguments(routed: Any) -> None:
    """rmsnorm without a GPU: one span named after the API, ERROR, inputs bound by name."""
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(RuntimeError):
        flashinfer.rmsnorm(x, w)
    (span,) = routed.get()
    assert span.name == "flashinfer.rmsnorm"
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]
    attrs = _attrs(span)
    assert attrs["otel_gpu.input.input.shape"] == (2, 8)
    assert attrs["otel_gpu.input.weight.shape"] == (8,)
    assert attrs["code.function.name"] == "flashinfer.norm.rmsnorm"


def test_the_users_exception_passes_through_as_the_same_object(
    routed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever FlashInfer raises reaches the caller untouched."""
    boom = ValueError("from the kernel launcher")

    def launcher(*args: Any) -> None:
        raise boom

    monkeypatch.setattr(flashinfer.norm, "_rmsnorm_impl", launcher)
    with pytest.raises(ValueError) as caught:
        flashinfer.rmsnorm(torch.randn(2, 8), torch.ones(8))
    assert caught.value is boom
    (span,) = routed.get()
    assert span.events[0].attributes["exception.type"] == "ValueError"


def test_a_wrapper_method_span_is_named_class_dot_method(routed: Any) -> None:
    """BatchDecodeWithPagedKVCacheWrapper.__init__ (needs pinned memory, so it raises on CPU)."""
    with pytest.raises(RuntimeError):
        flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64, dtype=torch.uint8))
    (span,) = routed.get()
    assert span.name == "flashinfer.BatchDecodeWithPagedKVCacheWrapper.__init__"
    assert span.status.status_code is StatusCode.ERROR
    assert _attrs(span)["otel_gpu.input.float_workspace_buffer.shape"] == (64,)


def test_an_api_that_runs_on_cpu_records_its_result(routed: Any) -> None:
    """An experimental planning helper runs on CPU: one OK span with inputs and output."""
    qo_indptr = _qo_indptr_api()
    starts = torch.tensor([0, 4, 8], dtype=torch.int32)
    out = qo_indptr(starts, 8, group_size=2)
    assert out.tolist() == [0, 2, 4, 6, 8]
    (span,) = routed.get()
    assert span.name == "flashinfer.make_q_token_kv_block_sparse_qo_indptr"
    assert span.status.status_code is StatusCode.UNSET
    attrs = _attrs(span)
    assert attrs["otel_gpu.input.query_start_loc_cpu.shape"] == (3,)
    assert attrs["otel_gpu.input.group_size.value"] == 2
    assert attrs["otel_gpu.output.0.shape"] == (5,)


def test_reexports_are_routed_too(routed: Any) -> None:
    """flashinfer.rmsnorm and flashinfer.norm.rmsnorm stay one object, and it is ours."""
    assert flashinfer.rmsnorm is flashinfer.norm.rmsnorm
    assert _is_ours(flashinfer.rmsnorm)
    assert _is_ours(flashinfer.BatchDecodeWithPagedKVCacheWrapper.__dict__["plan"])


def test_every_loaded_api_is_routed(routed: Any) -> None:
    """Only APIs under functools caches (whose closure is out of reach) stay FlashInfer's."""
    state = _flashinfer._state
    assert state is not None
    assert state.patched + len(state.made) > 250
    assert all(set(api.outer) & {"cache", "lru_cache"} for api in state.unreached)


def test_install_twice_wraps_once(routed: Any) -> None:
    """A second install is a no-op: one span per call, no wrapper around a wrapper."""
    first = flashinfer.rmsnorm
    _flashinfer.install(_decorate)
    assert flashinfer.rmsnorm is first
    assert not _is_ours(first.__wrapped__)
    with pytest.raises(RuntimeError):
        flashinfer.rmsnorm(torch.randn(2, 8), torch.ones(8))
    assert [s.name for s in routed.get()] == ["flashinfer.rmsnorm"]


def test_uninstall_restores_the_original_objects(otel_gpu_spans: Any) -> None:
    """After uninstall every module attribute, class attribute and closure holds what it did."""
    _qo_indptr_api()  # imported before, so it is patched in place too
    spans = otel_gpu_spans(level=3)
    before = _flashinfer_namespace()
    _flashinfer.install(_decorate)
    assert _is_ours(flashinfer.rmsnorm)
    _flashinfer.uninstall()
    _flashinfer.uninstall()  # twice is fine
    after = _flashinfer_namespace()
    changed = [k for k, v in before.items() if k in after and after[k] is not v]
    assert changed == []
    assert not any(_is_ours(v) for v in after.values())
    with pytest.raises(RuntimeError):
        flashinfer.rmsnorm(torch.randn(2, 8), torch.ones(8))
    assert spans.get() == []


def test_level_0_leaves_flashinfer_untouched(otel_gpu_spans: Any) -> None:
    """At otel-gpu level 0 the decorator returns the function, so nothing is replaced."""
    otel_gpu_spans(level=0)
    before = flashinfer.rmsnorm
    _flashinfer.install(_decorate)
    try:
        assert flashinfer.rmsnorm is before
    finally:
        _flashinfer.uninstall()


def test_the_flashinfer_target_arms_at_level_0_under_control(
    otel_gpu_spans: Any, tmp_path: Any
) -> None:
    """With OTEL_GPU_CONTROL=on at level 0, the target routes FlashInfer's APIs to armed
    trampolines: no span until otel-gpu control raises one by its span name, then that API's
    calls are spans; uninstrument() puts FlashInfer's own objects back."""
    from otel_gpu.control import document, state

    qo_indptr = _qo_indptr_api()
    spans = otel_gpu_spans(level=0, control="on", journal_dir=str(tmp_path / "journal"))
    before = flashinfer.rmsnorm
    assert otel_gpu.instrument("flashinfer")
    try:
        assert (
            hasattr(flashinfer.rmsnorm, "__otel_gpu_armed__") and flashinfer.rmsnorm is not before
        )
        qo_indptr = _qo_indptr_api()
        starts = torch.tensor([0, 4, 8], dtype=torch.int32)
        assert qo_indptr(starts, 8, group_size=2).tolist() == [0, 2, 4, 6, 8]
        otel_gpu.flush()
        assert [s.name for s in spans.get()] == []
        name = "flashinfer.make_q_token_kv_block_sparse_qo_indptr"
        state.apply(document.parse({"level": 3, "include": [name], "for": None}), "test")
        assert qo_indptr(starts, 8, group_size=2).tolist() == [0, 2, 4, 6, 8]
        otel_gpu.flush()
        assert [s.name for s in spans.get() if s.name != "otel_gpu.control"] == [name]
    finally:
        state.reset("test teardown")
        otel_gpu.uninstrument()
    assert flashinfer.rmsnorm is before


_CHILD = textwrap.dedent(
    """
    import json, sys, warnings
    import otel_gpu
    from otel_gpu.instrumentation import flashinfer as _flashinfer
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    warnings.simplefilter("ignore")
    order = sys.argv[1]
    assert "flashinfer" not in sys.modules
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel_gpu.configure(level=3, tracer_provider=provider, strict=True)
    if order == "before":
        _flashinfer.install(lambda fn, name: otel_gpu.api(name=name)(fn))
    import torch
    import flashinfer
    if order == "after":
        _flashinfer.install(lambda fn, name: otel_gpu.api(name=name)(fn))
    from flashinfer.attention.prims_ts import decode

    for call in (
        lambda: flashinfer.rmsnorm(torch.randn(2, 8), torch.ones(8)),
        lambda: flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64, dtype=torch.uint8)),
        lambda: decode.make_q_token_kv_block_sparse_qo_indptr(
            torch.tensor([0, 4, 8], dtype=torch.int32), 8, group_size=2
        ),
    ):
        try:
            call()
        except RuntimeError:
            pass
    otel_gpu.flush()
    spans = [(s.name, s.status.status_code.name) for s in exporter.get_finished_spans()]
    sys.stdout.write("SPANS " + json.dumps(spans) + "\\n")
    """
)

_EXPECTED = [
    ["flashinfer.rmsnorm", "ERROR"],
    ["flashinfer.BatchDecodeWithPagedKVCacheWrapper.__init__", "ERROR"],
    ["flashinfer.make_q_token_kv_block_sparse_qo_indptr", "UNSET"],
]


def _run_child(order: str) -> tuple[list[list[str]], str]:
    env = {**os.environ, "FLASHINFER_LOGLEVEL": "3", "FLASHINFER_LOGDEST": "stdout"}
    done = python_command(["-c", _CHILD, order], env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    marker = [line for line in done.stdout.splitlines() if line.startswith("SPANS ")]
    assert len(marker) == 1, done.stdout[-3000:]
    return json.loads(marker[0][len("SPANS ") :]), done.stdout + done.stderr


@pytest.mark.slow
def test_flashinfer_logging_is_on_in_the_control_run() -> None:
    """Control: FLASHINFER_LOGLEVEL=3 without the target logs every call (so the tests below
    would see FlashInfer's logging if it ran)."""
    spans, output = _run_child("never")
    assert spans == []
    assert "FlashInfer API Call: rmsnorm" in output


@pytest.mark.slow
def test_installed_before_import_flashinfer_logs_nothing() -> None:
    """Installed before ``import flashinfer`` with FLASHINFER_LOGLEVEL=3: our spans, and not a
    line from FlashInfer's logger (no banner, no version line, no per-call lines)."""
    spans, output = _run_child("before")
    assert spans == _EXPECTED
    assert "FlashInfer" not in output.replace("SPANS", "")


@pytest.mark.slow
def test_installed_after_import_flashinfer_stops_its_call_logging() -> None:
    """Installed after ``import flashinfer`` at FLASHINFER_LOGLEVEL=3: FlashInfer's logging
    wrappers are cut out, so calls log nothing (its import banner had already been printed)."""
    spans, output = _run_child("after")
    assert spans == _EXPECTED
    assert "FlashInfer API Call" not in output
    assert "Positional input arguments" not in output
