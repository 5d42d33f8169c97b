"""OTEL_GPU_ON_NONFINITE: what a call with NaN/Inf does at level >= 5 (mark, error, raise)."""

from __future__ import annotations

import pytest
import torch

import otel_gpu
from otel_gpu import config


def _op():
    @otel_gpu.api
    def log(x):
        return torch.log(x)

    return log


def test_mark_is_the_default_and_changes_nothing_but_the_span(otel_gpu_spans):
    """mark: the nonfinite attribute and events; status unset; the result returned as usual."""
    spans = otel_gpu_spans(level=5)
    assert config.current().on_nonfinite == "mark"
    out = _op()(torch.tensor([-1.0, 1.0]))
    assert torch.isnan(out[0])
    (span,) = spans.get()
    assert span.attributes["otel_gpu.nonfinite"] is True
    assert span.status.status_code.name == "UNSET"


def test_error_sets_status_error_naming_the_tensors_and_counts(otel_gpu_spans):
    """error: span status ERROR with a description naming each non-finite tensor and its counts."""
    spans = otel_gpu_spans(level=5, on_nonfinite="error")
    _op()(torch.tensor([-1.0, 0.0, 1.0]))
    (span,) = spans.get()
    assert span.status.status_code.name == "ERROR"
    assert span.status.description == "non-finite values in output.0 (1 NaN, 1 Inf)"


def test_raise_raises_after_the_call_with_the_span_exported(otel_gpu_spans):
    """raise: NonFiniteError after the call, naming the tensors; the span is exported first and
    carries the same span id; the result is kept on the exception."""
    spans = otel_gpu_spans(level=5, on_nonfinite="raise")
    with pytest.raises(otel_gpu.NonFiniteError) as info:
        _op()(torch.tensor([-1.0, 2.0]))
    err = info.value
    assert err.tensors == {"output.0": (1, 0)}
    assert torch.isnan(err.result[0])
    (span,) = spans.get()
    assert err.span_id == format(span.context.span_id, "016x")
    assert span.status.status_code.name == "ERROR"


def test_raise_never_replaces_the_users_own_exception(otel_gpu_spans):
    """A call that raises itself, with NaN in its inputs: the caller gets its own exception."""
    otel_gpu_spans(level=5, on_nonfinite="raise")
    error = RuntimeError("mine")

    @otel_gpu.api
    def bad(x):
        raise error

    with pytest.raises(RuntimeError) as info:
        bad(torch.tensor([float("nan")]))
    assert info.value is error


def test_clean_calls_are_untouched_by_any_policy(otel_gpu_spans):
    """Finite tensors: no attribute, no status, no exception, whatever the policy."""
    spans = otel_gpu_spans(level=5, on_nonfinite="raise")
    _op()(torch.tensor([1.0, 2.0]))
    (span,) = spans.get()
    assert "otel_gpu.nonfinite" not in span.attributes
    assert span.status.status_code.name == "UNSET"


def test_an_invalid_policy_names_the_variable_and_the_allowed_values(monkeypatch):
    """OTEL_GPU_ON_NONFINITE=warn fails at configuration with a clear message."""
    monkeypatch.setenv("OTEL_GPU_ON_NONFINITE", "warn")
    with pytest.raises(
        config.ConfigError, match=r"OTEL_GPU_ON_NONFINITE='warn'.*mark, error, dump, raise"
    ):
        config.load()
