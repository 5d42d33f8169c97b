"""``printable``: the one escape every command applies to text it did not write."""

from __future__ import annotations

import pytest

from otel_gpu._text import printable

# (attack, payload, the escaped form the reader sees)
_PAYLOADS = [
    ("OSC 0 window title", "\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),
    ("clear screen", "\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),
    (
        "OSC 8 hyperlink",
        "\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\",
        "\\x1b]8;;https://evil.example\\x1b\\click\\x1b]8;;\\x1b\\",
    ),
    ("one-byte C1 CSI", "\x9b2J", "\\x9b2J"),
    ("DEL", "a\x7fb", "a\\x7fb"),
    ("NUL and bell", "a\x00b\x07", "a\\x00b\\x07"),
    ("carriage return overwriting the line", "ok\rFAIL", "ok\\rFAIL"),
    ("bidi right-to-left override", "abc\u202edcba", "abc\\u202edcba"),
    ("bidi isolate", "\u2066x\u2069", "\\u2066x\\u2069"),
    ("lone surrogate that print() cannot encode", "a\ud800b", "a\\ud800b"),
]


@pytest.mark.parametrize(("attack", "payload", "escaped"), _PAYLOADS, ids=[p[0] for p in _PAYLOADS])
def test_control_characters_become_visible_escapes(attack: str, payload: str, escaped: str) -> None:
    """Attack: terminal control sequences in a printed value; each becomes its visible escape."""
    out = printable(payload)
    assert out == escaped
    assert out.isprintable()
    out.encode("utf-8")  # no lone surrogate left to break print()


def test_newline_and_tab_are_escaped_inline_and_newline_kept_in_blocks() -> None:
    """A value printed inline cannot start a fake line; a block (a traceback) keeps its lines."""
    assert printable("a\nb\tc") == "a\\nb\\tc"
    assert printable("a\nb\tc\x1b", keep_newlines=True) == "a\nb\\tc\\x1b"


def test_ordinary_text_is_unchanged() -> None:
    """Non-ASCII letters, emoji, quotes and backslashes are not escaped: only controls are."""
    text = "naïve Größe 東京 ✓ 🚀 'q' \"d\" back\\slash α=0.5"
    assert printable(text) is text or printable(text) == text
