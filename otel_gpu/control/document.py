"""The control document: what one request may change, validated whole before anything applies.

A document is a JSON-able mapping (from ``otel-gpu control``, or a remote configuration)::

    {"level": 5, "include": ["flashinfer.*attention*"], "exclude": [], "sample": 0.1,
     "for": "120s", "ring_size": 64}

    {"reset": true}

Every field is optional; a field left out keeps what the process has. Unknown fields are
refused, so a typo never passes for a change. :func:`parse` returns a :class:`Change` or raises
:class:`ControlError` whose one-line message names the field and what is allowed: a document
is applied whole or not at all. Nothing in a document names a path or runs code: globs are
matched with :func:`fnmatch.fnmatchcase`, and every value is a number, a boolean or a short
string.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otel_gpu import trigger_rules
from otel_gpu.config import LEVELS

__all__ = [
    "DEFAULT_WINDOW",
    "FIELDS",
    "MAX_PATTERNS",
    "MAX_WINDOW",
    "Change",
    "ControlError",
    "RequestMatcher",
    "parse",
    "parse_window",
    "request_fields",
]

DEFAULT_WINDOW = 60.0
"""Seconds a change lasts when the document names no ``for``."""
MAX_WINDOW = 7 * 24 * 3600.0
"""The longest window, in seconds (a week); ``"for": null`` lasts until changed instead."""
MAX_PATTERNS = 64
"""Globs per list (``include``, ``exclude``)."""
MAX_PATTERN_LENGTH = 256
MAX_RING_SIZE = 1_000_000
MAX_DUMP_CALLS = 1_000_000
"""The most ``dump_max_calls`` may say, as ``OTEL_GPU_DUMP_MAX_COUNT`` allows."""
MAX_DUMP_BYTES = 1_048_576 << 30
"""The most ``dump_max_bytes`` may say, as ``OTEL_GPU_DUMP_MAX_SIZE_GB`` allows."""
FIELDS = (
    "level",
    "include",
    "exclude",
    "sample",
    "for",
    "ring_size",
    "dump_max_calls",
    "dump_max_bytes",
    "triggers",
    "requests",
    "request_attributes",
    "reset",
)
"""The fields a document may hold."""

RequestMatcher = str | tuple[str, str]
"""What a document's ``requests`` or ``request_attributes`` asks of a request: a glob on its id
and trace id (a string), or an attribute's key and a glob on its value (a pair)."""


class ControlError(ValueError):
    """A control document that cannot be applied; the message names the field and what is allowed."""


@dataclass(frozen=True)
class Change:
    """A validated control document. ``None`` fields are not changed by it."""

    level: int | None = None
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    sample: float | None = None
    window: float | None = DEFAULT_WINDOW
    """Seconds until the process goes back to its configured state; None: until changed."""
    ring_size: int | None = None
    reset: bool = False
    triggers: tuple[trigger_rules.Trigger, ...] | None = None
    """The triggers in force while the change lasts (``[]``: none); None: unchanged."""
    dump_max_calls: int | None = None
    """The flight recorder's limit on dumped calls while the change lasts; None: unchanged."""
    dump_max_bytes: int | None = None
    """Its limit on bytes of tensors written; None: unchanged."""
    requests: tuple[RequestMatcher, ...] | None = None
    """Globs on request ids (or trace ids), and (key, glob) pairs on request attributes: the
    level, include, exclude and sample apply only during the serving steps (``otel_gpu.batch``)
    that serve a request any of them matches; None: to every call, as without it."""

    def fields(self) -> dict[str, Any]:
        """The fields this change sets, JSON-able (for the control span and the reply)."""
        out: dict[str, Any] = {}
        for name in (
            "level",
            "include",
            "exclude",
            "sample",
            "ring_size",
            "dump_max_calls",
            "dump_max_bytes",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value) if isinstance(value, tuple) else value
        if self.requests is not None:
            out.update(request_fields(self.requests))
        if self.triggers is not None:
            out["triggers"] = [t.as_dict() for t in self.triggers]
        if self.reset:
            out["reset"] = True
        return out


def parse(doc: Mapping[str, Any]) -> Change:
    """Validate ``doc`` whole: a :class:`Change`, or :class:`ControlError` naming the first bad
    field and what is allowed."""
    if not isinstance(doc, Mapping):
        raise ControlError(f"a control document is a JSON object, not {_kind(doc)}")
    unknown = sorted(str(k) for k in doc if k not in FIELDS)
    if unknown:
        raise ControlError(
            f"unknown field {_show(unknown[0])}: a control document has only {', '.join(FIELDS)}"
        )
    reset = doc.get("reset", False)
    if not isinstance(reset, bool):
        raise ControlError(f"reset must be true or false, not {_show(reset)}")
    if reset:
        others = sorted(k for k in doc if k != "reset")
        if others:
            raise ControlError(
                f"reset goes alone: a document with reset=true has no other field "
                f"(found {', '.join(others)})"
            )
        return Change(window=None, reset=True)
    if not any(k in doc for k in FIELDS if k not in ("for", "reset")):
        raise ControlError(
            "a control document changes something: level, include, exclude, sample, "
            "ring_size, dump_max_calls, dump_max_bytes, triggers, requests, request_attributes, "
            "or reset=true"
        )
    level = doc.get("level")
    # a whole number: 5.0, 1e1 and true are refused (they compare equal to a level)
    if level is not None and (type(level) is not int or level not in LEVELS):
        raise ControlError(
            f"level must be one of {', '.join(map(str, LEVELS))}, not {_show(level)}"
        )
    include = _globs(doc, "include")
    exclude = _globs(doc, "exclude")
    sample = doc.get("sample")
    if sample is not None:
        if (
            isinstance(sample, bool)
            or not isinstance(sample, (int, float))
            or not 0 <= sample <= 1
            or math.isnan(sample)
        ):
            raise ControlError(f"sample must be a ratio from 0 to 1, not {_show(sample)}")
        sample = float(sample)
    ring = doc.get("ring_size")
    if ring is not None and (
        isinstance(ring, bool) or not isinstance(ring, int) or not 0 <= ring <= MAX_RING_SIZE
    ):
        raise ControlError(
            f"ring_size must be a whole number of calls from 0 to {MAX_RING_SIZE}, not {_show(ring)}"
        )
    limits = [_limit(doc, "dump_max_calls", 1, MAX_DUMP_CALLS, "calls")]
    limits.append(_limit(doc, "dump_max_bytes", 0, MAX_DUMP_BYTES, "bytes"))
    triggers = None
    if "triggers" in doc:
        try:
            triggers = trigger_rules.parse(doc["triggers"])
        except ValueError as exc:
            raise ControlError(f"triggers: {exc}") from None
    window = parse_window(doc["for"], "for") if "for" in doc else DEFAULT_WINDOW
    requests = _request_matchers(doc)
    if requests is not None and level is None:
        named = " and ".join(k for k in ("requests", "request_attributes") if k in doc)
        raise ControlError(
            f"{named} needs a level: the level the functions run at during the steps that "
            'serve a matching request (e.g. {"requests": ["tenant-a:*"], "level": 5} or '
            '{"request_attributes": {"tenant": "acme"}, "level": 5})'
        )
    calls, size = limits
    return Change(
        level, include, exclude, sample, window, ring, False, triggers, calls, size, requests
    )


def _request_matchers(doc: Mapping[str, Any]) -> tuple[RequestMatcher, ...] | None:
    """``requests`` and ``request_attributes`` as one tuple of matchers (any one matching a
    request selects its step); None when the document has neither."""
    globs = _patterns(
        doc.get("requests"),
        f"requests must be a list of 1 to {MAX_PATTERNS} glob patterns (strings of 1 to "
        f"{MAX_PATTERN_LENGTH} printable characters) matched on a request's id and its trace id",
        least=1,
    )
    raw = doc.get("request_attributes")
    if raw is None:
        return globs
    allowed = (
        "request_attributes must be an object of request attribute keys (strings of 1 to "
        f"{MAX_PATTERN_LENGTH} printable characters) to a glob pattern or a list of them, "
        f'matched on the attribute\'s value (e.g. {{"tenant": ["acme", "beta-*"]}}); at most '
        f"{MAX_PATTERNS} patterns in all"
    )
    if not isinstance(raw, Mapping) or not raw:
        raise ControlError(f"{allowed}, not {_show(raw)}")
    pairs: list[RequestMatcher] = []
    for key, value in raw.items():
        if (
            not isinstance(key, str)
            or not 0 < len(key) <= MAX_PATTERN_LENGTH
            or not key.isprintable()
        ):
            raise ControlError(f"{allowed}, not the key {_show(key)}")
        globs_of_key = _patterns(value, allowed, least=1) if value is not None else None
        if globs_of_key is None:
            raise ControlError(f"{allowed}, not {_show(value)} for {_show(key)}")
        pairs.extend((key, glob) for glob in globs_of_key)
    matchers = (*(globs or ()), *pairs)
    if len(matchers) > MAX_PATTERNS:
        raise ControlError(
            f"requests and request_attributes hold {len(matchers)} patterns: at most "
            f"{MAX_PATTERNS} in all"
        )
    return matchers


def request_fields(matchers: tuple[RequestMatcher, ...]) -> dict[str, Any]:
    """Matchers as a document writes them (JSON-able): ``requests`` (the id and trace id globs)
    and ``request_attributes`` (each key's globs), each only when it has any."""
    out: dict[str, Any] = {}
    globs = [m for m in matchers if isinstance(m, str)]
    if globs:
        out["requests"] = globs
    attributes: dict[str, list[str]] = {}
    for m in matchers:
        if not isinstance(m, str):
            attributes.setdefault(m[0], []).append(m[1])
    if attributes:
        out["request_attributes"] = attributes
    return out


def _limit(doc: Mapping[str, Any], name: str, low: int, high: int, unit: str) -> int | None:
    value = doc.get(name)
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high
    ):
        raise ControlError(
            f"{name} must be a whole number of {unit} from {low} to {high}, not {_show(value)}"
        )
    return value


def parse_window(raw: Any, name: str = "for") -> float | None:
    """``120``, ``"120s"``, ``"2m"`` -> seconds (in (0, a week]); ``None`` -> until changed."""
    if raw is None:
        return None
    allowed = (
        f"{name} must be seconds (a number, '120s') or minutes ('2m'), more than 0 and "
        f"at most {MAX_WINDOW / 86400:g} days, or null (until changed)"
    )
    if isinstance(raw, bool):
        raise ControlError(f"{allowed}, not {_show(raw)}")
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str) and 0 < len(raw) <= 32 and raw.isascii():
        text = raw.strip().lower()
        scale = 1.0
        if text.endswith("s"):
            text = text[:-1]
        elif text.endswith("m"):
            text, scale = text[:-1], 60.0
        try:
            value = float(text) * scale if text and text[0] in "0123456789." else -1.0
        except ValueError:
            value = -1.0
    else:
        raise ControlError(f"{allowed}, not {_show(raw)}")
    if not (0 < value <= MAX_WINDOW) or math.isnan(value):
        raise ControlError(f"{allowed}, not {_show(raw)}")
    return value


def _globs(doc: Mapping[str, Any], name: str) -> tuple[str, ...] | None:
    return _patterns(
        doc.get(name),
        f"{name} must be a list of at most {MAX_PATTERNS} glob patterns (strings of 1 to "
        f"{MAX_PATTERN_LENGTH} printable characters) matched on 'module.qualname' and the span "
        "name",
    )


def _patterns(raw: Any, allowed: str, least: int = 0) -> tuple[str, ...] | None:
    """``raw`` (a string, or a list of strings) as glob patterns, each printable and of 1 to
    ``MAX_PATTERN_LENGTH`` characters, ``least`` to ``MAX_PATTERNS`` of them; None when absent."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not least <= len(raw) <= MAX_PATTERNS:
        raise ControlError(f"{allowed}, not {_show(raw)}")
    for item in raw:
        if (
            not isinstance(item, str)
            or not 0 < len(item) <= MAX_PATTERN_LENGTH
            or not item.isprintable()
        ):
            raise ControlError(f"{allowed}, not {_show(item)}")
    return tuple(raw)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _show(value: Any) -> str:
    """A short, printable rendering of a refused value (a request is untrusted text)."""
    try:
        text = repr(value)
    except Exception:
        text = f"a {type(value).__name__}"
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= 60 else text[:57] + "..."
