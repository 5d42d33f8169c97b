"""Text from files and user code, made safe to print to a terminal or a pipe.

Span names, attribute values, exception messages and journal fields are written
by someone else: a user's program, or whoever crafted the file being read. Printed
raw, an ``ESC`` sequence can retitle the terminal, clear the screen, plant an OSC 8
hyperlink or move the cursor over earlier output, and a bidi override can make a
line read differently from what it holds. A lone surrogate (valid in JSON text)
makes ``print`` raise. Every command that prints such text passes it through
:func:`printable` first, so the reader sees the bytes as a visible escape
(``\\x1b``, ``\\u202e``) instead of having them acted on.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "brief", "printable", "too_deep"]


_SHORT = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}


def _escape(code: int) -> str:
    if code in _SHORT:
        return _SHORT[code]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _table(*, keep_newlines: bool) -> dict[int, str]:
    codes = [
        *range(0x00, 0x20),  # C0 controls, ESC among them
        0x7F,  # DEL
        *range(0x80, 0xA0),  # C1 controls: 0x9b is a one-byte CSI to many terminals
        *range(0x202A, 0x202F),  # bidi embeddings and overrides (LRE .. RLO)
        *range(0x2066, 0x206A),  # bidi isolates (LRI .. PDI)
        *range(0xD800, 0xE000),  # lone surrogates: valid in JSON, unencodable on output
    ]
    table = {code: _escape(code) for code in codes}
    if keep_newlines:
        del table[ord("\n")]
    return table


_INLINE = _table(keep_newlines=False)
_BLOCK = _table(keep_newlines=True)


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """Return ``text`` with control characters, bidi controls and surrogates escaped.

    Escaped: C0 controls (including ``\\t``, and ``\\n`` unless ``keep_newlines``),
    DEL, C1 controls (``\\x80``-``\\x9f``), the bidi embedding, override and
    isolate controls (U+202A-U+202E, U+2066-U+2069) and lone surrogates. Each
    becomes its Python escape (``\\x1b``, ``\\u202e``, ``\\n``), so what was there stays
    visible. Everything else, non-ASCII letters included, is unchanged.
    ``keep_newlines`` is for multi-line blocks (a traceback) printed as blocks.
    """
    if text.isprintable():  # the common case: nothing to escape, no copy
        return text
    return text.translate(_BLOCK if keep_newlines else _INLINE)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def brief(value: Any) -> str:
    """``repr`` of a value read from a file, cut to about 60 characters per string or atom and
    a few items per container: a message must stay one readable line, whatever the file holds.
    ``repr`` escapes control characters itself."""
    return _REPR.repr(value)


# --------------------------------------------------------------------------- JSON nesting bound

MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a trace file or journal field may have (read
before parsing, so a nesting bomb never reaches ``json.loads``)."""

_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b'[]{}"')


def too_deep(raw: bytes) -> bool:
    """Whether arrays and objects nest deeper than :data:`MAX_JSON_DEPTH` in ``raw`` (JSON text).

    Checked on the bytes, before parsing: ``json.loads`` and every recursive walk after it
    would end in ``RecursionError`` on a nesting bomb. Costs a few C-speed passes over the line
    (about a tenth of ``json.loads``'s time on a line of 512 otel-gpu spans), no Python loop
    per byte.
    """
    # Drop escaped backslashes and quotes (pairing from the left, as JSON does), then all but
    # brackets and quotes, then the strings (with any brackets in them). What is left is
    # brackets; each pass removes the innermost pairs, so passes count the depth.
    shape = _unescaped(raw).translate(_BRACKETS, _NOT_BRACKETS)
    shape = shape.replace(b'""', b"")  # removing two neighbouring quotes keeps the pairing
    if b'"' in shape:
        shape = b"".join(shape.split(b'"')[::2])
    for _ in range(MAX_JSON_DEPTH):
        if not shape:
            return False
        inner = shape.replace(b"[]", b"")
        if len(inner) == len(shape):
            return False  # unbalanced: the JSON parser says where
        shape = inner
    return b"[]" in shape


def _unescaped(raw: bytes) -> bytes:
    """``raw`` without its escaped quotes, escapes paired from the left as JSON pairs them.

    Split at the backslashes, which are few in trace files (two ``bytes.replace`` over the
    whole line cost more than ``too_deep``'s other passes together): a backslash either
    escapes the next one (``\\\\``) or the first byte after it, which is dropped if a quote."""
    if b"\\" not in raw:
        return raw
    parts = raw.split(b"\\")
    out = [parts[0]]
    pending = False  # the last backslash escapes the next one
    for part in parts[1:]:
        if pending:  # this backslash was escaped: what follows it is plain
            pending = False
            out.append(part)
        elif not part:
            pending = True
        else:
            out.append(part[1:] if part[0] == 0x22 else part)  # 0x22: an escaped quote
    return b"".join(out)
