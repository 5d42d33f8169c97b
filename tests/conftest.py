"""Shared fixtures: every test starts from a clean otel-gpu state, with internal errors raised."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests import helpers such as otlp_receiver

_OUR_ENV = (
    "OTEL_GPU_",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_EXPORTER_OTLP",
    "OTEL_TRACES_",
    "OTEL_BSP_",
    "OTEL_METRICS_",
)


def pytest_configure(config: pytest.Config) -> None:
    """Crash journals of the test run (and of its subprocesses) go to a private directory."""
    import tempfile

    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="otel-gpu-tests-")


@pytest.fixture(autouse=True)
def _clean_otel_gpu(monkeypatch: pytest.MonkeyPatch):
    """Isolate each test: no inherited OTEL_* settings, fresh config and pipeline, strict mode on."""
    from otel_gpu import _guard, config
    from otel_gpu.export import pipeline

    for name in list(os.environ):
        if name.startswith(_OUR_ENV):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_GPU_STRICT", "true")
    pipeline.reset(timeout=2.0)
    pipeline.set_tracer_provider(None)
    config.reset_overrides()
    _guard._reset()
    _guard.set_strict(True)
    yield
    from otel_gpu.instrumentation import targets

    targets._reset_for_tests()
    for name in ("otel_gpu.calls.armed", "otel_gpu.anomalies.triggers"):
        module = sys.modules.get(name)
        if module is not None:  # armed functions and triggers are process-wide
            module._reset_for_tests()
    graphs = sys.modules.get("otel_gpu.devices.cuda_graphs")
    if graphs is not None:  # a faked capture patched CUDAGraph: put it back
        graphs.uninstall()
    pipeline.reset(timeout=2.0)
    events = sys.modules.get("otel_gpu.devices.events")
    if events is not None:  # a backend chosen while cuda_available() was faked: choose again
        events.use(None)
    pipeline.set_tracer_provider(None)
    config.reset_overrides()
    _guard._reset()
    _guard.set_strict(False)


@pytest.fixture
def module_factory(tmp_path, monkeypatch):
    """Returns ``load(source, prefix)``: writes a fresh module below tmp_path and imports it.

    Functions in it are decorated at the level in force when it is imported.
    """
    names = []

    def load(source: str, prefix: str = "testlib"):
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        names.append(name)
        return importlib.import_module(name)

    yield load
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def fake_events():
    """A fake CUDA event backend for the next pipeline; the real choice is put back afterwards."""
    from otel_gpu.devices import events

    backend = events.FakeEvents()
    events.use(backend)
    yield backend
    events.use(None)


@pytest.fixture
def fresh_module_states():
    """The recorder's table of stored module states is empty before and after the test."""
    from otel_gpu.recorder import module_state

    module_state._reset_for_tests()
    yield
    module_state._reset_for_tests()
