"""Hostile settings and destinations: absurd numbers, and files that fail at write time.

* Every numeric setting (otel-gpu's table and the standard OpenTelemetry variables otel-gpu
  reads) rejects NaN, inf, negatives, non-integers, absurd magnitudes and text with one line
  naming the variable, the value and the documented range. The cases are built from the tables
  themselves, so a setting added later is covered without editing this file.
* A destination that fails at write time (a full disk, a /proc file) costs the program nothing,
  prints one line, and the exit report counts every span lost.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
from commands import python_command
from opentelemetry.sdk.trace.export import SpanExportResult
from otel_gpu.exporters.destinations import CountingExporter, FileStream, build_provider
from otel_gpu.exporters.otlp_json import JsonLinesSpanExporter

import otel_gpu
from otel_gpu import _guard, config
from otel_gpu.config import STANDARD, Bounded, ConfigError
from otel_gpu.export import pipeline

HOSTILE = ["nan", "NaN", "inf", "-inf", "-1", "1e21", "1e30", "abc", "", "0x10"]


def _bounded_settings() -> list[config.Setting]:
    return [s for s in config.SETTINGS if isinstance(s.parse, Bounded)]


def _bounded_standard() -> list[config.StandardSetting]:
    return [s for s in STANDARD if isinstance(s.parse, Bounded)]  # not the sampler's name


def _cases() -> list[tuple[str, str, str]]:
    """(table, variable, hostile value) for every numeric setting of both tables."""
    cases = []
    rows: list[tuple[str, str, Bounded]] = [
        ("otel-gpu", s.env, s.parse) for s in _bounded_settings()
    ]
    rows += [(s.applies, s.env, s.parse) for s in _bounded_standard()]
    for table, env, bounds in rows:
        values = [v for v in HOSTILE if v]  # empty means unset: the default applies
        values.append(_just_above(bounds))
        if bounds.low > 0:
            values.append("0")
        if bounds.integer:
            values.append("1.5")
        cases += [(table, env, v) for v in values]
    return cases


def _just_above(bounds: Bounded) -> str:
    return str(int(bounds.high) + 1) if bounds.integer else repr(bounds.high * 1.5)


def _load_with(monkeypatch: pytest.MonkeyPatch, table: str, env: str, value: str) -> None:
    """Resolve settings the way otel-gpu does for a variable of ``table`` set to ``value``."""
    if table == "otel-gpu":
        config.load(env={env: value})
    elif table == "otlp":  # checked when OTEL_GPU_LOGDEST includes otlp
        monkeypatch.setenv(env, value)
        config.load(env={"OTEL_GPU_LOGDEST": "otlp"})
    else:  # read by the SDK for otel-gpu's own provider: checked when it is built
        environment = {env: value, "OTEL_TRACES_SAMPLER": "traceidratio"}
        config.check_standard(table, environment)


@pytest.mark.parametrize(("table", "env", "value"), _cases())
def test_hostile_number_gets_one_line_naming_variable_value_and_range(
    monkeypatch, table, env, value
):
    """Attack: NaN, inf, -1, 1e21, 1e30, 'abc', 0x10, a non-integer or one past the maximum in a
    numeric setting. Outcome: a ConfigError of one line naming the variable, the value and the
    documented range; nothing accepts it (1e30 as an OTLP timeout used to lose every span)."""
    with pytest.raises(ConfigError) as info:
        _load_with(monkeypatch, table, env, value)
    message = str(info.value)
    bounds = next(
        s.parse
        for s in [*config.SETTINGS, *STANDARD]
        if s.env == env and isinstance(s.parse, Bounded)
    )
    assert "\n" not in message
    assert f"{env}={value!r}" in message and bounds.text in message and "Allowed:" in message


@pytest.mark.parametrize(("table", "env"), sorted({(t, e) for t, e, _ in _cases()}))
def test_the_documented_bounds_themselves_are_accepted(monkeypatch, table, env):
    """The range is what works, not a guess: both ends of every documented range load."""
    bounds = next(s.parse for s in [*config.SETTINGS, *STANDARD] if s.env == env)
    for edge in (bounds.low, bounds.high):
        text = str(int(edge)) if bounds.integer else repr(float(edge))
        _load_with(monkeypatch, table, env, text)


def test_every_numeric_setting_has_a_documented_range():
    """A numeric row added to the table without bounds fails here: its default is a number, so
    its parser must be a Bounded range (choices such as the level are listed instead), and its
    allowed text, shown in the docs, states that range."""
    for s in config.SETTINGS:
        numeric = isinstance(s.default, (int, float)) and not isinstance(s.default, bool)
        if numeric and getattr(s.parse, "__name__", "") != "parse":  # _int_choice closures
            assert isinstance(s.parse, Bounded), s.env
        if isinstance(s.parse, Bounded):
            assert s.parse.text in s.allowed, s.env
    for standard in _bounded_standard():
        assert standard.parse.text in standard.allowed, standard.env


def test_configuration_docs_show_every_range():
    """docs/configuration.md shows the range of every numeric setting of both tables (as the
    table generator escapes it), so the docs say what configuration enforces."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    rows = [(s.env, s.allowed) for s in _bounded_settings()] + [
        (s.env, s.allowed) for s in STANDARD
    ]
    for env, allowed in rows:
        escaped = allowed.replace("<", "&lt;").replace(">", "&gt;")
        line = next((ln for ln in docs.splitlines() if ln.startswith(f"| `{env}`")), "")
        assert escaped in line, env


@pytest.mark.parametrize(
    "environment",
    [
        {"OTEL_GPU_MAX_ITEMS": "1e21"},
        {"OTEL_GPU_FLUSH_TIMEOUT": "nan"},
        {"OTEL_GPU_QUEUE_SIZE": "-1"},
        {"OTEL_GPU_LOGDEST": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": "1e30"},
        {"OTEL_GPU_LOGDEST": "otlp", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "inf"},
        {"OTEL_GPU_LOGDEST": "otlp", "OTEL_BSP_SCHEDULE_DELAY": "abc"},
    ],
)
def test_cli_exits_2_with_one_line_on_a_hostile_number(tmp_path, environment):
    """Attack: a hostile number in the environment of `otel-gpu info`. Outcome: exit 2 and one
    line on stderr naming the variable, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | environment
    proc = python_command(["-m", "otel_gpu", "info"], env=env, cwd=tmp_path, timeout=120)
    (name,) = [k for k in environment if k != "OTEL_GPU_LOGDEST"]
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert name in proc.stderr and repr(environment[name]) in proc.stderr


def test_sdk_variable_out_of_range_turns_otel_gpu_off_with_one_line(tmp_path, monkeypatch, caplog):
    """Attack: OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT=1e21, which the SDK's TracerProvider raises on.
    Outcome: otel-gpu's own provider is not built, one warning names the variable, and the
    program's calls run and return their results."""
    _guard.set_strict(False)
    monkeypatch.setenv("OTEL_GPU_STRICT", "false")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "1e21")
    otel_gpu.configure(level=1, dest=str(tmp_path / "t.jsonl"), provider="own", strict=False)

    @otel_gpu.api
    def double(x):
        return 2 * x

    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        assert [double(i) for i in range(5)] == [0, 2, 4, 6, 8]
    lines = [r.getMessage() for r in caplog.records if r.name == "otel_gpu"]
    assert len(lines) == 1 and "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT='1e21'" in lines[0]
    assert all(r.exc_info is None for r in caplog.records)


def test_batch_size_above_a_small_queue_is_lowered_not_fatal():
    """Attack: OTEL_GPU_QUEUE_SIZE=100 with OTLP, whose default batch size (512) the SDK refuses
    above the queue size. Outcome: the provider is built, the batch lowered to the queue."""
    settings = config.load(env={"OTEL_GPU_LOGDEST": "otlp", "OTEL_GPU_QUEUE_SIZE": "100"})
    own = build_provider(settings)
    try:
        (processor,) = own.provider._active_span_processor._span_processors
        assert processor._batch_processor._max_export_batch_size == 100
    finally:
        own.provider.shutdown()


# --------------------------------------------------------------------------- failing destinations

_PROGRAM = textwrap.dedent(
    """
    import otel_gpu

    @otel_gpu.api
    def double(x):
        return 2 * x

    print(sum(double(i) for i in range(3000)))
    """
)
_CALLS = 3000


def _run_against(tmp_path: Path, dest: str, **extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(_PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_GPU_LOGLEVEL": "1", "OTEL_GPU_LOGDEST": dest, "OTEL_GPU_STRICT": "false"}
    env |= extra
    return python_command([str(script)], env=env, cwd=tmp_path, timeout=300)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize(
    ("suffix", "encoder"),
    [(".jsonl", "native"), (".jsonl", "official"), (".log", "native")],
    ids=["jsonl-native", "jsonl-official", "text"],
)
def test_full_disk_destination_gives_one_line_and_counts_every_lost_span(tmp_path, suffix, encoder):
    """Attack: the destination is a full disk (a file name linked to /dev/full), for 3,000
    level-1 calls. Outcome: the program's output is unchanged, stderr holds exactly one line
    about the failure (no traceback per batch, as before: 207 of them), and the exit report
    counts all 3,000 spans as lost."""
    dest = tmp_path / f"spans{suffix}"
    dest.symlink_to("/dev/full")
    proc = _run_against(tmp_path, str(dest), OTEL_GPU_ENCODER=encoder)
    assert proc.returncode == 0 and proc.stdout == f"{sum(2 * i for i in range(_CALLS))}\n"
    lines = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr
    failures = [ln for ln in lines if "cannot write to" in ln]
    assert len(failures) == 1 and "ENOSPC" in failures[0] and str(dest) in failures[0]
    (report,) = [ln for ln in lines if ln.startswith("otel-gpu dropped")]
    assert re.match(rf"otel-gpu dropped {_CALLS} span\(s\)", report)
    assert f"{_CALLS} refused or not written" in report
    assert len(lines) == 2  # the failure and the exit report, nothing else


def test_proc_file_destination_gives_one_line_and_counts_every_lost_span(tmp_path):
    """Attack: the destination is a /proc file that opens for writing but refuses what is
    written (EINVAL). Outcome: the same one line and the exact count at exit."""
    target = Path("/proc/self/timerslack_ns")
    if not target.exists():
        pytest.skip("needs /proc/self/timerslack_ns (Linux)")
    dest = tmp_path / "spans.jsonl"
    dest.symlink_to(target)
    proc = _run_against(tmp_path, str(dest))
    if "cannot write to" not in proc.stderr and "otel-gpu dropped" not in proc.stderr:
        pytest.skip("this kernel accepted the write")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if "cannot write to" in ln]) == 1
    assert f"otel-gpu dropped {_CALLS} span(s)" in proc.stderr


def _span_batch(n: int) -> list:
    """``n`` real SDK spans."""
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    spans = []
    for i in range(n):
        with tracer.start_as_current_span(f"s{i}") as span:
            pass
        spans.append(span)
    return spans


def test_a_destination_keeps_trying_and_recovers_when_the_path_comes_back(tmp_path, caplog):
    """Attack: the destination's folder disappears before the first write (as a disk that
    fills and frees). Outcome: each failed batch is counted, the failure is reported once, and
    writing resumes when the folder is back: nothing is lost after that."""
    folder = tmp_path / "gone"
    stream = FileStream(str(folder / "t.jsonl"))
    counted = CountingExporter(JsonLinesSpanExporter(stream=stream), "t.jsonl", stream)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        assert counted.export(_span_batch(3)) is SpanExportResult.FAILURE
        assert counted.export(_span_batch(4)) is SpanExportResult.FAILURE
        folder.mkdir()
        assert counted.export(_span_batch(5)) is SpanExportResult.SUCCESS
    counted.shutdown()
    assert (counted.failed, counted.confirmed) == (7, 5)
    assert len([r for r in caplog.records if "cannot write to" in r.getMessage()]) == 1
    assert (folder / "t.jsonl").read_text().count("\n") == 1
    assert stream.closed


def test_exit_report_counts_spans_a_failing_destination_refused(tmp_path, caplog):
    """Attack: a destination that fails every write, in process. Outcome: the pipeline's exit
    report names the exact number of spans it refused."""
    _guard.set_strict(False)
    dest = tmp_path / "spans.jsonl"
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux)")
    dest.symlink_to("/dev/full")
    otel_gpu.configure(level=1, dest=str(dest), provider="own", strict=False)

    @otel_gpu.api
    def inc(x):
        return x + 1

    assert [inc(i) for i in range(70)] == list(range(1, 71))
    with caplog.at_level(logging.WARNING, logger="otel_gpu"):
        pipeline.reset(timeout=5.0)
    (report,) = [r.getMessage() for r in caplog.records if "otel-gpu dropped" in r.getMessage()]
    assert (
        report.startswith("otel-gpu dropped 70 span(s)") and "70 refused or not written" in report
    )


def test_configuration_docs_tables_are_what_the_page_script_prints(capsys):
    """The settings tables in docs/configuration.md are exactly what the page's own regeneration
    script prints today: a range changed in the code without regenerating the page fails here."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    section = docs[docs.index("## Regenerating the settings table") :]
    script = section[section.index("```python\n") + len("```python\n") :]
    script = script[: script.index("```")]
    exec(compile(script, "configuration.md", "exec"), {"__name__": "docs"})
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln]
    assert len(printed) > len(config.SETTINGS) + len(STANDARD)
    missing = [ln for ln in printed if ln not in docs.splitlines()]
    assert missing == []


@pytest.mark.parametrize(
    "endpoint",
    ["http://[::1", "http://collector:99999", "http://collector:43x7", "http://a b:4318"],
)
def test_a_malformed_otlp_endpoint_fails_at_configuration_in_one_line(endpoint, monkeypatch):
    """OTEL_EXPORTER_OTLP_ENDPOINT=http://[::1 passed configuration and `otel-gpu info`, then
    failed inside the exporter at the first call with an internal-error traceback: it is now a
    ConfigError at configuration, naming the variable."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    with pytest.raises(ConfigError) as info:
        config.load(env={"OTEL_GPU_LOGDEST": "otlp"})
    assert str(info.value).startswith("OTEL_EXPORTER_OTLP_ENDPOINT=")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "name", ["OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"]
)
def test_a_control_character_in_otlp_headers_is_refused_without_echoing_them(name, monkeypatch):
    """A CR/LF in the headers forged a log line through the SDK's warning about them: it is refused
    at configuration, and the error never prints the value (headers carry credentials)."""
    monkeypatch.setenv(name, "authorization=Bearer s3cret\r\nWARNING forged line")
    with pytest.raises(ConfigError) as info:
        config.load(env={"OTEL_GPU_LOGDEST": "otlp"})
    message = str(info.value)
    assert message.startswith(f"{name}=<redacted>") and "control character" in message
    assert "s3cret" not in message and "forged" not in message
