"""Fault injection: bad configuration, secrets in arguments, and internal errors.

* Every ``OTEL_GPU_*`` variable with a parser rejects bad values with a ConfigError that
  names the variable, the value and what is allowed, at configuration time.
* Secret-looking string arguments are redacted at level >= 3 (configurable).
* An internal error is logged once per kind and the call proceeds; strict mode
  (the tests' mode) turns it into a failure instead.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import subprocess
import textwrap
from importlib.metadata import EntryPoint, EntryPoints
from pathlib import Path

import pytest
import torch
from commands import python_command, without_otel
from jsonl_spans import read_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanProcessor

import otel_gpu
from otel_gpu import _guard, config
from otel_gpu.calls import metadata

REPO = Path(__file__).resolve().parent.parent

# Bad values per parser; every setting whose parser can reject something is covered.
BAD_BY_PARSER = {
    "_bool": ["maybe", "2", "yes please"],
    "_metrics": ["maybe", "automatic", "2"],
    "_positive_int": ["0", "-3", "x", "1.5"],
    "_non_negative_float": ["-1", "nan", "soon"],
    "_positive_float": ["0", "0.05", "-1", "nan", "soon"],
    "_non_negative_int": ["-1", "x", "2.5"],
    "_dest": [","],
    "_opamp_endpoint": ["ws://opamp:4320/v1/opamp", "http:///v1/opamp", "http://h:99999/"],
    "parse_text": ["{not json", '[{"on": "nan", "level": 5}]', '[{"on": "nonfinite"}]'],
}
CHOICE_BAD = ["bogus", "7"]


def _bad_cases() -> list[tuple[str, str]]:
    cases = []
    for s in config.SETTINGS:
        name = getattr(s.parse, "__name__", "")
        if name in BAD_BY_PARSER:
            cases += [(s.env, v) for v in BAD_BY_PARSER[name]]
        elif name == "parse":  # the closures of _int_choice / _str_choice
            cases += [(s.env, v) for v in CHOICE_BAD]
    return cases


@pytest.mark.parametrize(("env", "value"), _bad_cases())
def test_every_variable_rejects_bad_values_with_a_clear_error(env, value):
    """config.load() raises ConfigError naming the variable, the bad value and the allowed values."""
    with pytest.raises(config.ConfigError) as info:
        config.load(env={env: value})
    message = str(info.value)
    assert env in message and repr(value) in message and "Allowed:" in message


def test_the_bad_value_table_covers_every_validating_setting():
    """Each setting whose parser can reject a value is exercised above (no setting forgotten)."""
    covered = {env for env, _ in _bad_cases()}
    free_text = {
        "OTEL_GPU_DUMP_DIR",
        "OTEL_GPU_JOURNAL_DIR",
        "OTEL_GPU_WORKLOADS_DIR",
        "OTEL_SERVICE_NAME",
        "OTEL_GPU_REDACT",
    }
    patterns = {s.env for s in config.SETTINGS if s.parse.__name__ == "_patterns"}
    # credentials: an error never shows the value (tests/test_opamp.py checks its refusals)
    free_text.add("OTEL_GPU_OPAMP_HEADERS")
    assert covered | free_text | patterns == {s.env for s in config.SETTINGS}


def test_a_bad_environment_fails_at_decoration_not_inside_calls(monkeypatch):
    """A bad OTEL_GPU_LOGLEVEL surfaces when the library is decorated (import time), as a
    ConfigError naming the variable, never later from inside a call."""
    monkeypatch.setenv("OTEL_GPU_LOGLEVEL", "2")
    config.reset_overrides()
    with pytest.raises(config.ConfigError, match="OTEL_GPU_LOGLEVEL='2'"):

        @otel_gpu.api
        def f():
            return 1


@pytest.mark.parametrize("value", ["inf", "1e300"])
def test_flush_timeout_must_be_finite(value):
    """OTEL_GPU_FLUSH_TIMEOUT=inf (or absurdly large) is rejected at configuration."""
    with pytest.raises(config.ConfigError, match="OTEL_GPU_FLUSH_TIMEOUT"):
        config.load(env={"OTEL_GPU_FLUSH_TIMEOUT": value})


def test_journal_dir_that_is_a_file_fails_at_configuration(tmp_path):
    """OTEL_GPU_JOURNAL_DIR naming an existing file is a ConfigError at configuration."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(config.ConfigError, match="OTEL_GPU_JOURNAL_DIR"):
        config.load(env={"OTEL_GPU_JOURNAL_DIR": str(blocker)})


def test_bad_otlp_timeout_fails_at_configuration(monkeypatch):
    """With OTEL_GPU_LOGDEST=otlp, OTEL_EXPORTER_OTLP_TIMEOUT=abc is a ConfigError naming it."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "abc")
    with pytest.raises(config.ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT"):
        config.load(env={"OTEL_GPU_LOGDEST": "otlp"})


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize(
    "name", ["api_token", "private_key", "password", "client_secret", "Authorization", "AUTH_HDR"]
)
def test_secret_named_string_arguments_are_redacted(otel_gpu_spans, name):
    """A string argument whose parameter name contains token/key/password/secret/auth (any case)
    is recorded as <redacted>, at levels 3 and 5 alike."""
    for level in (3, 5):
        spans = otel_gpu_spans(level=level)
        ns: dict = {}
        exec(f"def f(user, {name}):\n    return user", ns)
        f = otel_gpu.api(ns["f"])
        assert f("ann", "hunter2") == "ann"
        (span,) = spans.get()
        assert span.attributes[f"otel_gpu.input.{name}.value"] == "<redacted>"
        assert "hunter2" not in repr(dict(span.attributes))
        spans.clear()


def test_non_string_values_under_secret_names_keep_their_metadata(otel_gpu_spans):
    """Attention's ``key`` tensor is not a secret: only strings are redacted."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def attention(query, key, value):
        return query

    attention(torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 4))
    (span,) = spans.get()
    assert span.attributes["otel_gpu.input.key.shape"] == (2, 4)


def test_redaction_list_is_configurable_and_can_be_disabled(otel_gpu_spans):
    """OTEL_GPU_REDACT replaces the default words; an empty value disables redaction."""
    spans = otel_gpu_spans(level=3, redact="pin")

    @otel_gpu.api
    def f(card_pin, token):
        return 0

    f("1234", "abc")
    (span,) = spans.get()
    assert span.attributes["otel_gpu.input.card_pin.value"] == "<redacted>"
    assert span.attributes["otel_gpu.input.token.value"] == "abc"
    assert config.load(env={"OTEL_GPU_REDACT": ""}).redact == ()


def test_secrets_passed_through_kwargs_are_redacted(otel_gpu_spans):
    """``f(x, token="...")`` into ``def f(x, **kwargs)`` redacts ``kwargs.token`` too."""
    spans = otel_gpu_spans(level=3)

    @otel_gpu.api
    def f(x, **kwargs):
        return x

    f(1, token="s3cr3t", api_key="k3y")
    (span,) = spans.get()
    assert "s3cr3t" not in repr(dict(span.attributes))
    assert span.attributes["otel_gpu.input.kwargs.token.value"] == "<redacted>"


# --------------------------------------------------------------------------- internal errors


def test_internal_errors_are_logged_once_per_kind_and_calls_proceed(
    otel_gpu_spans, monkeypatch, caplog
):
    """Metadata capture failing on every call (strict off): 100 calls return their results, 100
    spans are exported (without inputs), one warning is logged, 100 errors are counted."""
    spans = otel_gpu_spans(level=3, strict=False)
    _guard.set_strict(False)

    def broken(*args, **kwargs):
        raise RuntimeError("metadata is broken")

    monkeypatch.setattr(metadata, "capture", broken)

    @otel_gpu.api
    def f(x):
        return x * 2

    with caplog.at_level("WARNING", logger="otel_gpu"):
        assert [f(i) for i in range(100)] == [i * 2 for i in range(100)]
    assert len(spans.get()) == 100
    warnings = [r for r in caplog.records if "internal error in metadata" in r.getMessage()]
    assert len(warnings) == 1
    assert _guard.internal_error_counts()["metadata"] >= 100  # inputs (and outputs) of each call


def test_a_failing_span_processor_costs_spans_not_calls(monkeypatch, caplog):
    """A span processor that raises on every span (strict off): calls return normally, the
    export error is logged once, and exit-time flushing does not raise."""
    _guard.set_strict(False)

    class Broken(SpanProcessor):
        def on_end(self, span):
            raise RuntimeError("processor down")

    provider = TracerProvider()
    provider.add_span_processor(Broken())
    otel_gpu.configure(level=1, tracer_provider=provider, strict=False)

    @otel_gpu.api
    def f(x):
        return x + 1

    with caplog.at_level("WARNING", logger="otel_gpu"):
        assert [f(i) for i in range(50)] == list(range(1, 51))
        otel_gpu.flush(2)
    assert sum("internal error in export" in r.getMessage() for r in caplog.records) == 1


def test_strict_mode_turns_an_internal_error_into_a_failure(otel_gpu_spans, monkeypatch):
    """In strict mode (how tests run) the same internal error raises, so a test cannot miss it."""
    otel_gpu_spans(level=3, strict=True)

    def broken(*args, **kwargs):
        raise RuntimeError("metadata is broken")

    monkeypatch.setattr(metadata, "capture", broken)

    @otel_gpu.api
    def f(x):
        return x

    with pytest.raises(RuntimeError, match="metadata is broken"):
        f(1)
    assert math.isfinite(config.current().flush_timeout)


# --------------------------------------------------------------------------- standard variables

_DECORATE = textwrap.dedent(
    """
    import otel_gpu

    f = otel_gpu.api(lambda x: x)
    print("decorated", flush=True)
    print("result", f(3), flush=True)
    """
)


def _run(program: str, tmp_path: Path, **environment: str) -> subprocess.CompletedProcess[str]:
    """``program`` in a fresh interpreter (which has not imported the SDK yet), with only these
    OTEL_* variables set."""
    # the checkout under test, whatever the working directory
    env = without_otel(**environment, PYTHONPATH=str(REPO))
    return python_command(["-c", program], env=env, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize(
    ("name", "value", "level"),
    [
        ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "abc", "1"),
        ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "1e21", "0"),  # level 0 imports the SDK as well
    ],
)
def test_the_span_limit_the_sdk_reads_at_import_fails_as_one_line(tmp_path, name, value, level):
    """OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT is read by opentelemetry.sdk.trace when it is imported,
    which then stops with its own chained ValueError. Imported on the way to @otel_gpu.api, the
    same failure is otel-gpu's one-line ConfigError naming the variable, the value and the range
    (exit 1, nothing after the decoration runs), never the SDK's ValueError."""
    assert name in config.SDK_IMPORT_VARIABLES
    proc = _run(_DECORATE, tmp_path, OTEL_GPU_LOGLEVEL=level, **{name: value})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("otel_gpu.config.ConfigError: ")
    assert f"{name}={value!r} (environment) is invalid" in last
    assert "Allowed: integer >= 0 and <= 1000000, or unset." in last
    assert "ValueError" not in proc.stderr and "non-negative integer" not in proc.stderr
    assert "decorated" not in proc.stdout


@pytest.mark.parametrize("level", ["0", "1"])
def test_other_standard_variables_leave_otel_gpu_off_never_the_program(tmp_path, level):
    """A span limit the SDK reads only in its TracerProvider (OTEL_SPAN_EVENT_COUNT_LIMIT=-1)
    and an unknown sampler (which the SDK would replace by always-on with a warning): the
    program runs and returns its results. At level 0 nothing is said; at level 1 otel-gpu's own
    provider is not built and one line names each variable, the value and what is allowed."""
    for name, value in (("OTEL_SPAN_EVENT_COUNT_LIMIT", "-1"), ("OTEL_TRACES_SAMPLER", "bogus")):
        proc = _run(_DECORATE, tmp_path, OTEL_GPU_LOGLEVEL=level, **{name: value})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == ["decorated", "result 3"]
        if level == "0":
            assert proc.stderr == ""
            continue
        [line] = proc.stderr.strip().splitlines()
        assert "otel-gpu records nothing in this process" in line
        assert f"{name}={value!r} (environment) is invalid" in line and "Allowed: " in line
        if name == "OTEL_TRACES_SAMPLER":
            allowed = line.partition("Allowed: ")[2]
            assert all(sampler in allowed for sampler in config.SAMPLERS)
            assert config.SAMPLER_ENTRY_POINTS in allowed


@pytest.mark.parametrize("value", ["Bogus", " traceidratio", "traceidratio,always_on"])
def test_sampler_names_the_sdk_would_not_recognise_are_refused(value):
    """A name with spaces around it, or a list, is unknown to the SDK's TracerProvider: refused."""
    with pytest.raises(config.ConfigError, match="OTEL_TRACES_SAMPLER="):
        config.check_standard("provider", {"OTEL_TRACES_SAMPLER": value})


@pytest.mark.parametrize("value", [*config.SAMPLERS, "ParentBased_TraceIdRatio", ""])
def test_the_sdk_sampler_names_are_accepted_in_any_case(value):
    """Every built-in name loads, in any case, as the SDK reads it; empty means unset."""
    config.check_standard(
        "provider", {"OTEL_TRACES_SAMPLER": value, "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    )


def _doubled(tmp_path: Path, calls: int, **settings: object) -> Path:
    """``calls`` calls of a decorated function at level 1 on otel-gpu's own provider, their
    results checked, then flushed; returns the span file (absent when nothing was recorded)."""
    out = tmp_path / "t.jsonl"
    otel_gpu.configure(level=1, dest=str(out), provider="own", **settings)

    @otel_gpu.api
    def double(x):
        return 2 * x

    assert [double(i) for i in range(calls)] == [2 * i for i in range(calls)]
    otel_gpu.flush()
    return out


def test_a_valid_ratio_sampler_still_samples_own_provider_spans(tmp_path, monkeypatch):
    """parentbased_traceidratio with OTEL_TRACES_SAMPLER_ARG=0.5 is accepted and applied: of 400
    root calls some, not all, become spans (all or none has a chance of 2 * 2**-400)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    spans = read_spans(_doubled(tmp_path, 400))
    assert 0 < len(spans) < 400


def _register_sampler(monkeypatch: pytest.MonkeyPatch, name: str, target: str) -> None:
    """Make ``name`` an installed sampler entry point (``module:factory``), as a package would."""
    registered = EntryPoint(name, target, config.SAMPLER_ENTRY_POINTS)
    real = importlib.metadata.entry_points

    def entry_points(**select):
        if select.get("group") == config.SAMPLER_ENTRY_POINTS:
            found = [*real(group=config.SAMPLER_ENTRY_POINTS), registered]
            return EntryPoints(ep for ep in found if select.get("name", ep.name) == ep.name)
        return real(**select)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_a_registered_sampler_is_accepted_and_used_by_otel_gpus_provider(tmp_path, monkeypatch):
    """A sampler an installed package registers under the opentelemetry_traces_sampler entry
    points is accepted by name and used by otel-gpu's own provider (the SDK's TracerProvider
    alone would ignore it and sample everything): here one that drops every call."""
    _register_sampler(monkeypatch, "test_drop_all", "opentelemetry.sdk.trace.sampling:_AlwaysOff")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "test_drop_all")
    out = _doubled(tmp_path, 20)
    assert not out.exists() or read_spans(out) == []
    with pytest.raises(config.ConfigError, match=r"entry points: test_drop_all\)"):
        config.check_standard("provider", {"OTEL_TRACES_SAMPLER": "test_drop_al"})


@pytest.mark.parametrize(
    "target",
    [
        "opentelemetry.sdk.trace.sampling:TraceIdRatioBased",  # raises on its argument, None
        "builtins:str",  # returns a string, not a Sampler
    ],
)
def test_a_registered_sampler_that_fails_turns_otel_gpu_off_with_one_line(
    tmp_path, monkeypatch, caplog, target
):
    """A registered sampler whose factory raises or returns no Sampler: otel-gpu's provider is
    not built, one warning names the variable, and the program's calls return their results."""
    _register_sampler(monkeypatch, "test_broken", target)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "test_broken")
    _guard.set_strict(False)
    monkeypatch.setenv("OTEL_GPU_STRICT", "false")
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        _doubled(tmp_path, 5, strict=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "otel_gpu"]
    assert len(lines) == 1
    assert "OTEL_TRACES_SAMPLER='test_broken' (environment) is invalid: its entry point" in lines[0]
