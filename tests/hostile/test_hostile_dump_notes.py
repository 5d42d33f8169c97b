"""Crafted "not dumped" notes in a dump folder: replay reads only what a note may hold.

Promise: a note that is not JSON, of another format, too large, nested deep, a symlink, or with
fields of the wrong type is left out; a note's text reaches the terminal only printable and
bounded; nothing read from a note names a path that is opened or runs code.
"""

from __future__ import annotations

import json
import os

from otel_gpu._text import printable
from otel_gpu.recorder.limits import NOTE_PREFIX, read_notes

FORMAT = "otel-gpu.not-dumped/1"


def _note(folder, name: str, body) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    (folder / f"{NOTE_PREFIX}{name}.json").write_bytes(data)


def test_crafted_notes_are_left_out_or_read_bounded(tmp_path):
    """Only the well-formed note is read; its limit text is cut to 200 characters and printed
    through printable(), which shows escape sequences instead of running them."""
    good = {"format": FORMAT, "pid": 7, "reason": "max_count", "limit": "\x1b[2J" + "x" * 500}
    _note(tmp_path, "good", {**good, "skipped": 3})
    _note(tmp_path, "torn", b'{"format": "otel-gpu.not-dumped/1", "pid": ')
    _note(tmp_path, "other", {**good, "format": "something/1", "skipped": 1})
    _note(tmp_path, "negative", {**good, "skipped": -5})
    _note(tmp_path, "bool", {**good, "pid": True, "skipped": 1})
    _note(tmp_path, "reason", {**good, "reason": "../../etc/passwd", "skipped": 1})
    _note(tmp_path, "list", [good])
    _note(tmp_path, "deep", b"[" * 100_000 + b"]" * 100_000)
    _note(tmp_path, "huge", {**good, "skipped": 1, "pad": "y" * (1 << 20)})
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({**good, "skipped": 99}))
    os.symlink(secret, tmp_path / f"{NOTE_PREFIX}link.json")
    notes = read_notes(str(tmp_path))
    assert [(n["pid"], n["skipped"]) for n in notes] == [(7, 3)]
    assert len(notes[0]["limit"]) == 200
    assert "\x1b" not in printable(notes[0]["limit"])


def test_a_folder_that_cannot_be_listed_has_no_notes(tmp_path):
    """A missing folder or a file in its place: no notes, no error."""
    assert read_notes(str(tmp_path / "missing")) == []
    (tmp_path / "file").write_text("x")
    assert read_notes(str(tmp_path / "file")) == []
