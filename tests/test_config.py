"""Configuration: one table, precedence configure() > environment > default, clear errors."""

from __future__ import annotations

import json
import os

import pytest

import otel_gpu
from otel_gpu import config


def test_defaults():
    """With no environment the defaults are level 0, stdout, auto provider."""
    s = config.load(env={})
    assert (s.level, s.dest, s.provider) == (0, ("stdout",), "auto")


@pytest.mark.parametrize("raw", ["4", "abc", "-1", "2", "1.5", "11"])
def test_invalid_level_names_variable_and_allowed_values(raw):
    """OTEL_GPU_LOGLEVEL outside 0/1/3/5/10 fails with the variable, the value and the allowed list."""
    with pytest.raises(config.ConfigError) as info:
        config.load(env={"OTEL_GPU_LOGLEVEL": raw})
    msg = str(info.value)
    assert "OTEL_GPU_LOGLEVEL" in msg and repr(raw) in msg and "0, 1, 3, 5, 10" in msg


@pytest.mark.parametrize("level", ["0", "1", "3", "5", "10", " 3 "])
def test_valid_levels(level):
    """Every documented level parses (surrounding spaces allowed)."""
    assert config.load(env={"OTEL_GPU_LOGLEVEL": level}).level == int(level)


def test_configure_wins_over_environment(monkeypatch):
    """configure() arguments beat the environment; unset ones still come from it."""
    monkeypatch.setenv("OTEL_GPU_LOGLEVEL", "1")
    monkeypatch.setenv("OTEL_GPU_MAX_ITEMS", "3")
    s = otel_gpu.configure(level=5)
    assert s.level == 5 and s.max_items == 3
    assert otel_gpu.settings().level == 5


def test_environment_is_read_when_first_needed(monkeypatch):
    """Settings come from the environment at first use, so libraries imported later see them."""
    monkeypatch.setenv("OTEL_GPU_LOGLEVEL", "3")
    monkeypatch.setenv("OTEL_GPU_LOGDEST", "stderr")
    assert otel_gpu.settings().level == 3
    assert otel_gpu.settings().dest == ("stderr",)


def test_invalid_configure_changes_nothing():
    """A rejected configure() leaves the previous settings in force."""
    otel_gpu.configure(level=3, dest="stderr")
    with pytest.raises(config.ConfigError, match="OTEL_GPU_LOGLEVEL"):
        otel_gpu.configure(level=4)
    assert otel_gpu.settings().level == 3


def test_unknown_setting_is_rejected():
    """A misspelt keyword to configure() is an error that lists the known settings."""
    with pytest.raises(config.ConfigError, match=r"known:.*max_items"):
        otel_gpu.configure(max_itmes=3)


@pytest.mark.parametrize(
    ("env", "value", "fragment"),
    [
        ("OTEL_GPU_MAX_ITEMS", "0", "greater than 0"),
        ("OTEL_GPU_QUEUE_SIZE", "lots", "not an integer"),
        ("OTEL_GPU_FLUSH_TIMEOUT", "-1", ">= 0"),
        ("OTEL_GPU_FLUSH_TIMEOUT", "nan", ">= 0"),
        ("OTEL_GPU_PROVIDER", "mine", "auto, global, own"),
        ("OTEL_GPU_COLOR", "sometimes", "auto, always, never"),
        ("OTEL_GPU_STRICT", "maybe", "boolean"),
        ("OTEL_GPU_DUMP_FORMAT", "pickle", "torch, safetensors"),
        ("OTEL_GPU_DUMP_MAX_COUNT", "-5", "greater than 0"),
        ("OTEL_GPU_DUMP_MAX_SIZE_GB", "x", "not a number"),
        ("OTEL_GPU_JOURNAL", "perhaps", "boolean"),
    ],
)
def test_every_setting_is_validated(env, value, fragment):
    """Each setting rejects bad values with its name, the value and why."""
    with pytest.raises(config.ConfigError) as info:
        config.load(env={env: value})
    assert env in str(info.value) and fragment in str(info.value)


def test_unwritable_destination_fails_at_configuration(tmp_path):
    """A LOGDEST that cannot be written fails when configured, not on the hundredth call."""
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load(env={"OTEL_GPU_LOGDEST": str(tmp_path / "missing" / "t.jsonl")})
    with pytest.raises(config.ConfigError, match="is a directory"):
        config.load(env={"OTEL_GPU_LOGDEST": str(tmp_path)})
    if os.geteuid() != 0:  # root can write anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(config.ConfigError, match="not writable"):
            config.load(env={"OTEL_GPU_LOGDEST": str(ro / "x.log")})


def test_destination_list_and_placeholders(tmp_path, monkeypatch):
    """LOGDEST is comma-separated; %i expands to the pid and %r to RANK."""
    s = config.load(env={"OTEL_GPU_LOGDEST": f"stdout, {tmp_path}/t_%i_%r.jsonl , otlp"})
    assert s.dest == ("stdout", f"{tmp_path}/t_%i_%r.jsonl", "otlp")
    assert config.expand_path("a_%i_%r", {"RANK": "3"}) == f"a_{os.getpid()}_3"
    assert config.expand_path("a_%r", {}) == "a_0"


def test_repr_limit_is_capped_at_2048():
    """No setting can produce attribute values longer than Tempo's 2048-byte cut."""
    assert config.load(env={"OTEL_GPU_REPR_LIMIT": "99999"}).repr_limit == 2048


def test_settings_table_documents_every_field():
    """Every Settings field has exactly one row (env var, default, allowed, doc) in the table;
    the only others say whether a setting was set explicitly (``dest_explicit``)."""
    every = set(config.Settings.__dataclass_fields__)
    explicit = {f for f in every if f.endswith("_explicit")}
    fields = every - explicit
    assert {f.removesuffix("_explicit") for f in explicit} <= fields
    assert {s.field for s in config.SETTINGS} == fields
    for row in config.settings_table():
        assert row["env"].startswith("OTEL_") and row["doc"] and row["allowed"]


def test_docs_list_every_setting():
    """docs/configuration.md names every environment variable of the settings table (docs stay true)."""
    import pathlib

    docs = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    missing = [s.env for s in config.SETTINGS if f"`{s.env}`" not in docs]
    assert missing == []


# --------------------------------------------------------------------------- otel-gpu info


def _info(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `otel-gpu info ARGS`, run in this process."""
    from otel_gpu.cli import main

    code = main(["info", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_info_lists_the_standard_variables_that_are_set(monkeypatch, capsys):
    """`otel-gpu info` shows each standard OTEL_* variable set, in the settings' style, OTLP
    headers hidden (they carry credentials); --json has them under "standard"."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer s3cret")
    code, out, err = _info(capsys)
    assert code == 0 and err == ""
    standard = out.partition("\nstandard:\n")[2].partition("\nresource:\n")[0].splitlines()
    assert standard == [
        "  OTEL_EXPORTER_OTLP_HEADERS   = <redacted>",
        "  OTEL_TRACES_SAMPLER          = parentbased_traceidratio",
        "  OTEL_TRACES_SAMPLER_ARG      = 0.5",
    ]
    code, out, _ = _info(capsys, "--json")
    assert code == 0
    assert json.loads(out)["standard"] == {
        "OTEL_EXPORTER_OTLP_HEADERS": "<redacted>",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.5",
    }
    assert "s3cret" not in out


@pytest.mark.parametrize(
    ("name", "value"),
    [("OTEL_TRACES_SAMPLER", "bogus"), ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "abc")],
)
def test_info_flags_a_bad_standard_variable_as_a_bad_setting(monkeypatch, capsys, name, value):
    """At a level above 0 a bad standard variable makes `otel-gpu info` print its ConfigError as
    one line, saying a program would record nothing, and exit 2, as a bad OTEL_GPU_* variable
    does, with nothing on stdout."""
    monkeypatch.setenv(name, value)
    monkeypatch.setenv("OTEL_GPU_LOGLEVEL", "1")
    code, out, err = _info(capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"otel-gpu info: {name}={value!r} (environment) is invalid: ")
    assert err.count("\n") == 1 and "Allowed: " in err
    assert err.rstrip().endswith(
        "A program records nothing with it (otel-gpu stays off, with one warning)."
    )
    monkeypatch.setenv("OTEL_GPU_MAX_ITEMS", "0")  # the same exit status as otel-gpu's own
    code, _, err = _info(capsys)
    assert code == 2 and err.startswith("otel-gpu info: OTEL_GPU_MAX_ITEMS='0'")


@pytest.mark.parametrize(
    ("name", "value"),
    [("OTEL_TRACES_SAMPLER", "bogus"), ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "abc")],
)
def test_info_notes_a_bad_standard_variable_at_level_0(monkeypatch, capsys, name, value):
    """At level 0 otel-gpu uses neither the sampler nor the span limits: a bad one is a note
    giving the error it would be at a level above 0, and the command succeeds."""
    monkeypatch.setenv(name, value)
    code, out, err = _info(capsys)
    assert code == 0 and err == ""
    assert f"  note: unused at level 0; with a level above 0: {name}={value!r}" in out


def test_info_notes_a_bad_otlp_variable_it_does_not_use(monkeypatch, capsys):
    """An OTLP timeout otel-gpu would refuse, set while OTEL_GPU_LOGDEST has no otlp, is shown
    with a note giving the error it would raise with otlp; the command still succeeds."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "abc")
    code, out, _ = _info(capsys)
    assert code == 0
    assert "  OTEL_EXPORTER_OTLP_TIMEOUT   = abc\n" in out
    assert (
        "  note: unused while OTEL_GPU_LOGDEST has no otlp; with it: "
        "OTEL_EXPORTER_OTLP_TIMEOUT='abc' (environment) is invalid: not a number." in out
    )


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("OTEL_GPU_LOGLEVEL", "1_0"),  # int() reads it as 10
        ("OTEL_GPU_LOGLEVEL", "٣"),  # Arabic-Indic three: int() reads it as 3
        ("OTEL_GPU_QUEUE_SIZE", "1_000"),
        ("OTEL_GPU_FLUSH_TIMEOUT", "1_0.5"),
        ("OTEL_GPU_FLUSH_TIMEOUT", "١"),
    ],
)
def test_numbers_are_plain_ascii_digits(name, raw):
    """A number Python's int()/float() would accept but no shell user means (digit separators,
    other scripts' digits) is refused, naming why, instead of silently becoming another value."""
    with pytest.raises(config.ConfigError) as info:
        config.load(env={name: raw})
    assert name in str(info.value) and "plain ASCII digits only" in str(info.value)


@pytest.mark.parametrize(
    ("raw", "keyword"),
    [("stdot", "stdout"), ("sdtout", "stdout"), ("stdrr", "stderr"), ("otpl", "otlp")],
)
def test_a_destination_that_looks_like_a_mistyped_keyword_is_refused(
    tmp_path, monkeypatch, raw, keyword
):
    """OTEL_GPU_LOGDEST=stdot used to write a file named stdot in the current directory: a bare
    name close to a keyword is refused with the keyword it resembles and the way to mean a file,
    and no file is created."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(config.ConfigError) as info:
        config.load(env={"OTEL_GPU_LOGDEST": raw})
    message = str(info.value)
    assert f"mistyped {keyword!r}" in message and f"./{raw}" in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("raw", ["./stdot", "stdot.log", "out", "trace", "STDOUT", "spans.jsonl"])
def test_files_and_keywords_that_are_not_typos_are_accepted(tmp_path, monkeypatch, raw):
    """A name written as a path, one with an extension, or one not close to a keyword is a file;
    keywords are case-insensitive."""
    monkeypatch.chdir(tmp_path)
    assert config.load(env={"OTEL_GPU_LOGDEST": raw}).dest == (raw,)


def test_version_flag_and_info_show_the_installed_version(capsys):
    """`otel-gpu --version` prints otel-gpu's version (with Python's and torch's) and exits 0;
    `otel-gpu info` starts with the same line."""
    from importlib import metadata

    from otel_gpu.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert out.startswith(f"otel-gpu {metadata.version('otel-gpu')} (Python ")
    assert f"torch {metadata.version('torch')}" in out
    code, info_out, _ = _info(capsys)
    assert code == 0 and info_out.splitlines()[0] == out.strip()
