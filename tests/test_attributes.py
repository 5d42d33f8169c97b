"""otel_gpu.attributes and docs/attributes.md name the same keys, in both directions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import otel_gpu
from otel_gpu import attributes

DOC = Path(__file__).resolve().parent.parent / "docs" / "attributes.md"

# A backticked key: `otel_gpu.dump.dir`, a pattern `otel_gpu.input.<param>.<field>` or
# `otel_gpu.stuck <name>`, or a group `code.*`.
_KEY = re.compile(
    r"`((?:otel_gpu|code|exception|thread)(?:\.[a-z_]+)*(?:\.\*|\.<[a-z]+>[a-z_.<>]*| <[a-z]+>)?)`"
)
# The page names the older semantic-convention keys only to say they are not emitted.
_NOT_EMITTED = re.compile(r"not the older ((?:`[a-z_.]+`[\s/]*)+)")


def _constants() -> dict[str, str]:
    return {
        name: value
        for name, value in vars(attributes).items()
        if name.isupper() and isinstance(value, str)
    }


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _is_api(token: str) -> bool:
    """`otel_gpu.instrument_module` on the page names a function of the API, not a key."""
    head, _, name = token.partition(".")
    return head == "otel_gpu" and callable(getattr(otel_gpu, name, None))


def _documented(text: str) -> tuple[set[str], set[str], set[str]]:
    """(exact keys, pattern prefixes, group prefixes) the page documents."""
    not_emitted = {k for m in _NOT_EMITTED.finditer(text) for k in re.findall(r"`([^`]+)`", m[1])}
    keys: set[str] = set()
    patterns: set[str] = set()
    groups: set[str] = set()
    for token in _KEY.findall(text):
        if token.endswith(".*"):
            groups.add(token[:-1])
        elif "<" in token:
            patterns.add(token[: token.index("<")])
        elif token not in not_emitted and not _is_api(token):
            keys.add(token)
    events = _section(text, "Events")
    # Event names are the section's headings; their attributes the first column of its tables.
    keys.update(re.findall(r"^### `([^`]+)`", events, re.M))
    for cell in re.findall(r"^\| ([^|]+) \|", events, re.M):
        keys.update(re.findall(r"`([^`]+)`", cell))
    return keys, patterns, groups


def test_the_doc_parser_finds_the_page_keys_and_skips_the_older_ones() -> None:
    """The parser sees exact keys, patterns, groups and event names, not `code.namespace`."""
    keys, patterns, groups = _documented(DOC.read_text())
    assert {"otel_gpu.dump.dir", "numel", "exception", "otel_gpu.stats"} <= keys
    assert {"otel_gpu.input.", "otel_gpu.output.", "otel_gpu.stuck "} <= patterns
    assert "code." in groups
    assert not {"code.namespace", "code.function"} & keys


def test_every_constant_is_documented() -> None:
    """A key emitted in code but missing from docs/attributes.md fails here."""
    keys, patterns, _ = _documented(DOC.read_text())
    missing = {
        name: value
        for name, value in _constants().items()
        if value not in keys and value not in patterns and not _is_group(value, keys)
    }
    assert not missing, f"not in docs/attributes.md: {missing}"


def _is_group(value: str, keys: set[str]) -> bool:
    """A prefix constant such as DUMP_PREFIX stands for the documented keys it starts."""
    return value.endswith(".") and any(key.startswith(value) for key in keys)


def test_every_documented_key_is_a_constant() -> None:
    """A key documented in docs/attributes.md but not in otel_gpu.attributes fails here."""
    keys, patterns, groups = _documented(DOC.read_text())
    values = set(_constants().values())
    assert not keys - values, f"documented but not in otel_gpu.attributes: {keys - values}"
    assert not patterns - values, f"patterns without a prefix constant: {patterns - values}"
    for group in groups:
        assert any(v.startswith(group) for v in values), f"no key in the group {group}*"


@pytest.mark.parametrize(
    ("page", "complaint"),
    [
        ("| `otel_gpu.made.up` | int | x |\n", "documented but not"),
        ("", "not in docs/attributes.md"),
    ],
)
def test_the_check_fails_on_a_mismatch(
    page: str, complaint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both directions catch a mismatch: an invented key, and a page missing the keys."""
    doc = tmp_path / "attributes.md"
    doc.write_text(page + "\n## Events\n")
    monkeypatch.setitem(globals(), "DOC", doc)
    test = test_every_documented_key_is_a_constant if page else test_every_constant_is_documented
    with pytest.raises(AssertionError, match=complaint):
        test()
