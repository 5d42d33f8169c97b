"""Hostile trigger lists: nested deeper than anything a trigger needs, in OTEL_GPU_TRIGGERS,
``otel-gpu control --triggers`` or a control document. Each is refused in one line naming the
depth limit (ConfigError, exit 2, a refusal), never a RecursionError traceback."""

from __future__ import annotations

import json
import os

import pytest
from commands import otel_gpu_command, without_otel

from otel_gpu import config, trigger_rules
from otel_gpu.control import channel

DEEP = "[" * 5_000 + "]" * 5_000  # past the JSON parser's recursion limit (1000)
JUST_TOO_DEEP = '[{"on": "nonfinite", "level": 10, "functions": ' + "[" * 15 + "]" * 15 + "}]"


@pytest.mark.parametrize("text", [DEEP, JUST_TOO_DEEP], ids=["5000", "17"])
def test_a_deep_otel_gpu_triggers_is_a_config_error_naming_the_limit(text):
    """OTEL_GPU_TRIGGERS nested past 16 levels: a ConfigError naming the variable and the
    limit, one line."""
    with pytest.raises(config.ConfigError) as caught:
        config.load({"triggers": text})
    message = str(caught.value)
    assert "OTEL_GPU_TRIGGERS" in message
    assert f"nested deeper than {trigger_rules.MAX_DEPTH} levels" in message
    assert len(message) < 1000


def test_sixteen_levels_and_brackets_inside_strings_are_fine():
    """The limit counts real nesting only: a bracket inside a string does not count, and a
    list nested 16 deep is parsed (then judged by the trigger rules as usual)."""
    rules = trigger_rules.parse_text(
        '[{"on": "exception", "types": ["[[[[[[[[[[[[[[[[[[["], "dump": true}]'
    )
    assert rules[0].types == ("[[[[[[[[[[[[[[[[[[[",)
    sixteen = "[" * 16 + "]" * 16
    with pytest.raises(ValueError, match="trigger 0: an object"):
        trigger_rules.parse_text(sixteen)


def test_a_deep_triggers_flag_exits_2_without_a_traceback(tmp_path):
    """otel-gpu control PID --triggers <deep JSON>: exit 2, the flag and the limit named."""
    env = without_otel(OTEL_GPU_JOURNAL_DIR=str(tmp_path / "j"))
    result = otel_gpu_command(["control", str(os.getpid()), "--triggers", DEEP], env)
    assert result.returncode == 2
    assert "--triggers" in result.stderr and "nested deeper than 16 levels" in result.stderr
    assert "Traceback" not in result.stderr and "RecursionError" not in result.stderr


def test_a_deep_trigger_list_in_a_control_document_is_refused():
    """A control request whose triggers nest past the parser's limit: refused, not a crash."""
    reply = channel.answer(('{"document": {"triggers": ' + DEEP + "}}").encode())
    assert reply["applied"] is False and "\n" not in reply["refused"]
    reply = channel.answer(
        json.dumps({"document": {"triggers": json.loads(JUST_TOO_DEEP)}}).encode()
    )
    assert reply["applied"] is False and reply["refused"].startswith("triggers:")
