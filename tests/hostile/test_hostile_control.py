"""Hostile control requests: whatever bytes or files land where ``otel-gpu control`` talks to a
process, the process refuses them with a line naming the field (or ignores a file that is not
a plain file of its user's), applies nothing partial, never blocks, and follows no link.

Each payload is crafted here; the promises are those of docs/control.md, Security."""

from __future__ import annotations

import json
import os
import threading

import pytest

import otel_gpu
from otel_gpu.control import channel, state


@pytest.fixture
def armed_process(otel_gpu_spans, tmp_path):
    """This process with OTEL_GPU_CONTROL=on, one armed function, and a change in force (so a
    partial application would show); the configured state is put back afterwards."""
    otel_gpu_spans(level=0, control="on", journal_dir=str(tmp_path / "journal"))

    @otel_gpu.api
    def victim(x):
        return x

    from otel_gpu.control import document

    state.apply(document.parse({"level": 3, "include": ["*victim"], "for": None}), "setup")
    yield victim
    state.reset("test teardown")


REFUSED = [
    (b"\xff\xfe not json at all", "not JSON"),
    (b"[1, 2, 3]", "not a JSON object"),
    (b'"level=10"', "not a JSON object"),
    (b"[" * 200_000 + b"]" * 200_000, "not JSON"),  # nesting deeper than the parser allows
    (b'{"command": "rm -rf /"}', "unknown request field 'command'"),
    (b'{"from": "evil", "show": true}', "from must be"),
    (b'{"from": 1}', "show=true or a document"),
    (b'{"list": "yes"}', "list must be true or false"),
    (b'{"list": 1}', "list must be true or false"),
    (b'{"document": {"level": 5}, "dry_run": "true"}', "dry_run must be true or false"),
    (b'{"document": {"level": 5, "include": ["*nomatch*"]}}', "selects none of the"),
    (b'{"document": [1]}', "JSON object"),
    (b'{"document": {"level": 5, "path": "/etc/passwd"}}', "unknown field 'path'"),
    (b'{"document": {"level": 5, "exec": "import os"}}', "unknown field 'exec'"),
    (b'{"document": {"level": "5"}}', "level must be one of"),
    (b'{"document": {"level": true}}', "level must be one of"),
    (b'{"document": {"level": 5.0000001}}', "level must be one of"),
    (b'{"document": {"level": 1, "sample": NaN}}', "sample must be a ratio"),
    (b'{"document": {"level": 1, "sample": -0.5}}', "sample must be a ratio"),
    (b'{"document": {"level": 1, "for": Infinity}}', "for must be"),
    (b'{"document": {"level": 1, "for": 1e999}}', "for must be"),
    (b'{"document": {"level": 1, "for": "-5s"}}', "for must be"),
    (b'{"document": {"level": 1, "for": "nan"}}', "for must be"),
    (b'{"document": {"level": 1, "for": "1e400m"}}', "for must be"),
    (b'{"document": {"level": 1, "for": "3h"}}', "for must be"),
    (b'{"document": {"level": 1, "for": 0}}', "for must be"),
    (b'{"document": {"level": 1, "for": true}}', "for must be"),
    (b'{"document": {"ring_size": 1000000000000000000000000000000}}', "ring_size must be"),
    (b'{"document": {"ring_size": -1}}', "ring_size must be"),
    (b'{"document": {"include": ["a\\nb"]}}', "include must be"),
    (b'{"document": {"include": [""]}}', "include must be"),
    (b'{"document": {"include": {"a": 1}}}', "include must be"),
    (b'{"document": {"exclude": [1]}}', "exclude must be"),
    (json.dumps({"document": {"include": ["x"] * 10_000}}).encode(), "include must be"),
    (json.dumps({"document": {"include": ["x" * 5_000]}}).encode(), "include must be"),
    (b'{"document": {"reset": "yes"}}', "reset must be"),
    (b'{"document": {"reset": true, "level": 10}}', "reset goes alone"),
    (b'{"document": {}}', "changes something"),
    # a level equal to one but not a whole number (the old parser compared 5.0 == 5)
    (b'{"document": {"level": 5.0}}', "level must be one of"),
    (b'{"document": {"level": 1e1}}', "level must be one of"),
    (b'{"document": {"triggers": [{"on": "nonfinite", "level": 10.0}]}}', "level must be one of"),
    # a field named twice: json.loads keeps the last, so {"level":10,"level":0} applied level 0
    (b'{"document": {"level": 10, "level": 0}}', "'level' is named twice"),
    (b'{"show": true, "show": true}', "'show' is named twice"),
    (b'{"document": {"level": 1}, "document": {"level": 10}}', "'document' is named twice"),
]


@pytest.mark.parametrize(("raw", "says"), REFUSED, ids=[s for _, s in REFUSED])
def test_a_malformed_request_is_refused_naming_the_field_and_nothing_is_applied(
    armed_process, raw, says
):
    """The reply is a refusal whose one line names what was wrong; the state in force and the
    armed function's level are exactly as before."""
    before = state.effective()
    reply = channel.answer(raw)
    assert reply["applied"] is False
    assert says in reply["refused"]
    assert "\n" not in reply["refused"] and len(reply["refused"]) < 400
    assert state.effective() == before
    assert armed_process.__otel_gpu_armed__.level == 3


def test_a_document_with_one_bad_field_among_good_ones_applies_none_of_them(armed_process):
    """level, include and for are valid, sample is not: the whole document is refused, the
    level and globs in force stay."""
    before = state.effective()
    doc = {"level": 10, "include": ["*"], "for": "1m", "sample": 7}
    reply = channel.answer(json.dumps({"document": doc}).encode())
    assert reply["applied"] is False and reply["refused"].startswith("sample")
    assert state.effective() == before


def _listener(tmp_path):
    directory = tmp_path / "journal"
    directory.mkdir(mode=0o700, exist_ok=True)
    return channel.Listener(str(directory))


def test_a_fifo_planted_as_the_request_neither_blocks_nor_is_answered(armed_process, tmp_path):
    """A FIFO at the request's name is removed unread: the listener never opens it, so it
    cannot block, and writes no reply."""
    listener = _listener(tmp_path)
    os.mkfifo(listener.request)
    done = threading.Event()
    threading.Thread(target=lambda: (listener.check(), done.set()), daemon=True).start()
    assert done.wait(60), "the listener blocked on a FIFO"
    assert not os.path.exists(listener.request)
    assert not os.path.exists(channel.reply_path(listener.directory, listener.pid))


def test_a_symlink_planted_as_the_request_is_not_followed(armed_process, tmp_path):
    """A link at the request's name, to a valid document elsewhere, is removed and not read:
    nothing is applied from a file the link points to, and that file is untouched."""
    listener = _listener(tmp_path)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"document": {"reset": True}}))
    os.symlink(elsewhere, listener.request)
    before = state.effective()
    assert listener.check() is False
    assert state.effective() == before
    assert elsewhere.read_text() == json.dumps({"document": {"reset": True}})
    assert not os.path.lexists(listener.request)


def test_an_oversized_request_is_removed_unread(armed_process, tmp_path):
    """A request over the size limit (a valid document padded with spaces) is not parsed."""
    listener = _listener(tmp_path)
    body = json.dumps({"document": {"reset": True}}) + " " * (channel.REQUEST_LIMIT + 1)
    with open(listener.request, "w") as f:
        f.write(body)
    before = state.effective()
    assert listener.check() is False
    assert state.effective() == before and not os.path.exists(listener.request)


def test_a_directory_at_the_request_name_does_not_block_control(armed_process, tmp_path):
    """A directory planted where the request goes is answered by nothing, and does not block
    control until someone removes it: an empty one is removed, one with files in it is moved
    aside under a hidden name (its contents untouched, not followed); the next real request
    is answered, and the command can write it (a file cannot be renamed over a directory)."""
    listener = _listener(tmp_path)
    os.mkdir(listener.request)
    assert listener.check() is False
    assert not os.path.exists(listener.request)
    os.mkdir(listener.request)
    with open(os.path.join(listener.request, "keep"), "w") as f:
        f.write("theirs")
    os.symlink("/", os.path.join(listener.request, "root"))
    assert listener.check() is False
    assert not os.path.exists(listener.request)
    (aside,) = [n for n in os.listdir(listener.directory) if ".planted-" in n]
    assert aside.startswith(".") and sorted(
        os.listdir(os.path.join(listener.directory, aside))
    ) == [
        "keep",
        "root",
    ]
    channel._files.write_atomic_bytes(
        listener.directory, os.path.basename(listener.request), b'{"show": true}'
    )
    assert listener.check() is True


def test_a_directory_at_the_reply_name_does_not_lose_the_reply(armed_process, tmp_path):
    """A directory planted at the reply's name is cleared before the reply is renamed there."""
    listener = _listener(tmp_path)
    reply = channel.reply_path(listener.directory, listener.pid)
    os.mkdir(reply)
    with open(listener.request, "w") as f:
        json.dump({"show": True}, f)
    assert listener.check() is True
    assert json.loads(open(reply).read())["applied"] is True


def test_a_link_planted_at_the_reply_name_is_replaced_not_written_through(armed_process, tmp_path):
    """The reply is written under a fresh name and renamed over whatever is at its name: a
    link planted there to a file elsewhere leaves that file as it was."""
    listener = _listener(tmp_path)
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    os.symlink(target, channel.reply_path(listener.directory, listener.pid))
    with open(listener.request, "w") as f:
        json.dump({"show": True}, f)
    assert listener.check() is True
    assert target.read_text() == "keep me"
    reply = channel.reply_path(listener.directory, listener.pid)
    assert not os.path.islink(reply) and json.load(open(reply))["applied"] is True


@pytest.mark.skipif(not hasattr(os, "chown") or os.getuid() != 0, reason="needs to chown")
def test_a_request_of_another_user_is_ignored(armed_process, tmp_path):
    """Only the same user may ask: a request file owned by another uid is removed unread."""
    listener = _listener(tmp_path)
    with open(listener.request, "w") as f:
        json.dump({"document": {"reset": True}}, f)
    os.chown(listener.request, 4321, -1)
    before = state.effective()
    assert listener.check() is False
    assert state.effective() == before


def test_a_fifo_planted_as_the_reply_does_not_block_the_command(tmp_path):
    """The asking side opens a reply non-blocking and reads only a regular file: a FIFO at the
    reply's name makes the wait end unanswered at its timeout, not hang."""
    directory = tmp_path / "journal"
    directory.mkdir(mode=0o700)
    pid = os.getpid()
    os.mkfifo(channel.reply_path(str(directory), pid))
    done = []

    def read() -> None:
        done.append(channel._read_reply(channel.reply_path(str(directory), pid)))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(60)
    assert done == [None]
