"""Hostile input at the front door: what a user or a script puts in the environment or on the
command line cannot forge extra lines, move the terminal's cursor, or turn the one-line error
into a traceback; a dump directory whose name holds escape sequences is printed escaped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from commands import otel_gpu_command

import otel_gpu


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLASHINFER_"))}
    env["XDG_RUNTIME_DIR"] = str(tmp)
    env.update(extra)
    return env


CASES = {
    # a setting's value with a newline and a screen-clearing escape: a forged second line
    "env-newline-escape": (["info"], {"OTEL_GPU_LOGLEVEL": "7\n\x1b[2Jotel-gpu: all good"}),
    # an unknown argument with the same payload: argparse prints unknown arguments raw
    "argument-newline-escape": (["info", "--x\n\x1b[2Jotel-gpu: all good"], {}),
    # a flag's value with an OSC sequence (retitles the terminal)
    "flag-osc": (["demo", "--level", "7\x1b]0;pwned\x07"], {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_payload_in_a_setting_or_argument_stays_on_one_escaped_line(tmp_path, case):
    """Attack: a newline or an escape sequence in OTEL_GPU_LOGLEVEL, an unknown argument or a
    flag's value, to print a fake second line or drive the terminal. Outcome: exit 2, one stderr
    line, no ESC byte in it (shown as \\x1b), no traceback."""
    args, extra = CASES[case]
    proc = otel_gpu_command(args, _env(tmp_path, **extra), cwd=tmp_path, timeout=300)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "\x1b" not in proc.stderr and "\\x1b" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_undecodable_argument_bytes_do_not_become_a_traceback(tmp_path):
    """Attack: an argument that is not valid UTF-8 (Python keeps it as lone surrogates, which
    `print` cannot encode). Outcome: the one-line error shows them escaped; exit 2."""
    proc = subprocess.run(
        [os.fsencode(sys.executable), b"-m", b"otel_gpu", b"info", b"--\xff\xfe"],
        capture_output=True,
        env=_env(tmp_path),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2
    err = proc.stderr.decode("utf-8")
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "unrecognized arguments: --\\udcff\\udcfe" in err


def test_a_dump_directory_named_with_escapes_is_printed_escaped(tmp_path):
    """Attack: OTEL_GPU_DUMP_DIR whose name holds a screen-clearing escape. Outcome: the console's
    `dump:` line names the directory with the escape shown as \\x1b, never the raw byte."""
    root = tmp_path / "dumps\x1b[2J"
    log = tmp_path / "console.txt"
    otel_gpu.configure(level=10, dest=str(log), dump_dir=str(root))

    @otel_gpu.api
    def inc(x: int) -> int:
        return x + 1

    assert inc(1) == 2
    otel_gpu.flush()
    text = log.read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("  dump: ")]
    assert "\x1b" not in line and "dumps\\x1b[2J" in line
    assert root.is_dir()
