"""``otel-gpu show TRACE.jsonl [...]``: trace files as a terminal tree, and where NaN/Inf began.

Each trace is drawn as a tree of calls (parents from ``parentSpanId``, children in start order)
with duration, ERROR status, compact inputs and outputs, NaN/Inf found by level-5 statistics
and the flight recorder's dump directory. ``--nonfinite`` names the first call that turned
finite inputs into NaN/Inf outputs, rather than the many callers that merely carried them.

Exit codes: 0 something was shown (``--nonfinite``: a producer was found); 1 nothing matched
(``--nonfinite``: no producer found), or lines were skipped (a torn last line, or invalid lines
with ``--skip-invalid``) and what is shown may be incomplete; 2 usage errors (a missing file, an
invalid line). Every text read from a file is printed through :func:`otel_gpu._text.printable`,
so a span name or attribute cannot send terminal control sequences. See ``docs/show.md``.
"""

from __future__ import annotations

import fnmatch
import gc
import os
import stat as _stat
import sys
from collections.abc import Iterable, Sequence
from typing import IO, Any

from otel_gpu import attributes as attr
from otel_gpu._text import printable
from otel_gpu.traces import device
from otel_gpu.traces.output import clip
from otel_gpu.traces.reader import Span, TraceFileError, fill, read_all
from otel_gpu.traces.request import BATCH_SPAN_NAME, first_problem, served
from otel_gpu.traces.trees import Trace, build_traces, tree_path

__all__ = ["DEFAULT_LIMIT", "file_kind", "show"]

EXIT_FOUND, EXIT_NONE, EXIT_USAGE = 0, 1, 2
DEFAULT_LIMIT = 200
_SHOWN_ITEMS = 6  # inputs or outputs per line before "+N"
_SHOWN = 10  # other producers and unknown spans listed
_SHOWN_PROBLEMS = 20  # invalid lines listed one by one; the rest are counted
_FIELDS = {"shape", "dtype", "value", "enum_value", "type", "length", "repr", "id", "default"}
_DTYPE_PREFIXES = (("bfloat", "bf"), ("float", "f"), ("complex", "c"), ("uint", "u"), ("int", "i"))
_DRAWN_DEPTH = 64  # levels of indentation drawn; deeper spans say their depth instead
_PATH_ENDS = (3, 6)  # names shown at the start and the end of a long path to a span

Segment = tuple[str, str]  # text and a rich style ("" for none)


def _n(count: int, noun: str) -> str:
    """``1 span``, ``2 spans``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class _Writer:
    """Lines of styled segments: through rich with colour, else plain text without escapes.

    Every segment passes through :func:`printable`: segments carry span names and attribute
    values from the file, and those must not reach the terminal as control sequences.
    """

    def __init__(self, out: IO[str], color: bool) -> None:
        self._out = out
        self._console: Any = None
        if color:
            from rich.console import Console

            self._console = Console(
                file=out, force_terminal=True, highlight=False, soft_wrap=True, emoji=False
            )

    def line(self, *segments: Segment) -> None:
        safe = [(printable(text), style) for text, style in segments]
        if self._console is not None:
            from rich.text import Text

            self._console.print(Text.assemble(*safe))
        else:
            self._out.write("".join(text for text, _ in safe) + "\n")

    def text(self, text: str, style: str = "") -> None:
        self.line((text, style))


def show(
    paths: Sequence[str],
    *,
    nonfinite: bool = False,
    names: Sequence[str] = (),
    trace_id: str | None = None,
    limit: int = DEFAULT_LIMIT,
    color: bool = False,
    skip_invalid: bool = False,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    request: str | None = None,
) -> int:
    """Render ``paths`` as trees (or the ``nonfinite`` report) to ``out``; returns the exit code.

    Problems in the input go to ``err``, one line each naming ``FILE:LINE``. A torn last line
    (a writer killed mid-line) is skipped and the rest shown, with exit code 1; other invalid
    lines and unreadable files make it a usage error (2) unless ``skip_invalid``.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    problems: list[TraceFileError] = []
    # the tree reads the attributes of the spans it draws when it draws them; the NaN/Inf
    # report and --limit 0 read every span's
    eager = nonfinite or not limit or request is not None
    spans = read_all(paths, trace_id and trace_id.lower(), problems.append, attributes=eager)
    _report_problems(err, paths, spans, problems)
    fatal = [p for p in problems if not p.torn]
    if fatal and not skip_invalid:
        _say(err, f"nothing shown: {_problems(problems)} (--skip-invalid shows the rest)")
        return EXIT_USAGE
    if problems:
        _say(err, f"{_problems(problems)} skipped: what follows may be incomplete")
    if request is not None:
        code = _request(spans, paths, request, limit, _Writer(out, color), err)
        return EXIT_NONE if problems else code
    code = _render(spans, paths, nonfinite, names, trace_id, limit, _Writer(out, color), err)
    return EXIT_NONE if problems else code


def _render(
    spans: list[Span],
    paths: Sequence[str],
    nonfinite: bool,
    names: Sequence[str],
    trace_id: str | None,
    limit: int,
    writer: _Writer,
    err: IO[str],
) -> int:
    traces = _linked(spans)
    what = f"trace {trace_id.lower()}" if trace_id else "spans"
    if not traces:
        _say(err, f"no {what} in {', '.join(paths)}")
        return EXIT_NONE
    if nonfinite:
        return _report(writer, traces, names)
    matched = {s for s in _all(traces) if _matches(s, names)} if names else None
    if matched is not None and not matched:
        _say(err, f"no span name matches {' or '.join(names)}")
        return EXIT_NONE
    _tree(writer, traces, matched, limit)
    return EXIT_FOUND


def _request(
    spans: list[Span], paths: Sequence[str], request: str, limit: int, w: _Writer, err: IO[str]
) -> int:
    """``--request``: the steps and calls that served a request (traces/request.py), as trees
    (their ancestors dimmed), then the first error or NaN/Inf among them."""
    traces = _linked(spans)
    found = served(traces, request)
    if not found:
        _say(err, f"no step or call served request {request.lower()} in {', '.join(paths)}")
        return EXIT_NONE
    steps = sum(1 for s in found if s.name == BATCH_SPAN_NAME)
    calls = len(found) - steps
    ids = sorted({rid for s in found for t, sp, rid in s.links if rid and request in (t, sp)})
    w.line(
        (f"request {request.lower()}", "bold"),
        (f"  request id {', '.join(ids)}" if ids else "", ""),
        (f"  {_n(steps, 'step span')}, {_n(calls, 'call')}", ""),
    )
    _tree(w, traces, set(found), limit)
    bad = first_problem(found)
    if bad is None:
        w.text(
            "no error or NaN/Inf among them (NaN/Inf is seen only where level-5 statistics or "
            "otel_gpu.nonfinite were recorded)",
            "dim",
        )
    else:
        w.line(
            ("first problem: ", "bold red"),
            *_describe(bad, False),
            (f"  span {bad.span_id}  {bad.where}", "dim"),
        )
    return EXIT_FOUND


def _linked(spans: list[Span]) -> list[Trace]:
    """:func:`build_traces` with the cyclic garbage collector paused, as the reading was: the
    links it makes would otherwise trigger full collections over every span read."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return build_traces(spans)
    finally:
        if enabled:
            gc.enable()


def _report_problems(
    err: IO[str], paths: Sequence[str], spans: list[Span], problems: list[TraceFileError]
) -> None:
    """The problems, one line each; a file that held no OTLP line at all is first named in one
    line saying what it looks like, and only its first few lines' problems follow."""
    read_from = {s.where.rpartition(":")[0] for s in spans}
    foreign: dict[str, int] = {}  # path -> its problems shown so far
    for path in dict.fromkeys(paths):
        if path in read_from:
            continue
        kind = file_kind(path)
        if kind is not None:
            _say(err, f"{path} {kind}, not the OTLP JSON Lines that show reads {_EXPECTED}")
            foreign[path] = 0
    shown = 0
    for problem in problems:
        owner = next((p for p in foreign if str(problem).startswith(f"{p}:")), None)
        if owner is not None:
            foreign[owner] += 1
            if foreign[owner] > _SHOWN_FOREIGN:
                continue
        elif shown >= _SHOWN_PROBLEMS:
            continue
        else:
            shown += 1
        _say(err, str(problem))
    hidden = sum(max(n - _SHOWN_FOREIGN, 0) for n in foreign.values())
    hidden += max(len(problems) - sum(foreign.values()) - _SHOWN_PROBLEMS, 0)
    if hidden:
        _say(err, f"... and {_n(hidden, 'more problem')}")


_EXPECTED = "(as OTEL_GPU_LOGDEST=FILE.jsonl writes them)"
_SHOWN_FOREIGN = 3  # per-line problems listed for a file that holds no OTLP line
_SNIFF = 4096
_PYTHON_STARTS = ("import ", "from ", "def ", "class ", "async def ", "@", "#!")


def file_kind(path: str) -> str | None:
    """What ``path`` is when it is not OTLP JSON Lines ("is empty", "is binary data", "looks
    like Python source", "is a text log (as OTEL_GPU_LOGDEST=FILE.log writes it)", "is text,
    not JSON"); None when it may be (it starts with a JSON object, or is gzip), is not a
    regular file or cannot be read (the reader reports that)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the sniff
    except OSError:
        return None
    try:
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.read(fd, _SNIFF)
    except OSError:
        return None
    finally:
        os.close(fd)
    if head.startswith(b"\x1f\x8b"):
        return None
    if not head.strip():
        return "is empty"
    if b"\0" in head:
        return "is binary data"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not merely a character cut at the sniff's end
            return "is binary data (not UTF-8 text)"
        text = head[: exc.start].decode("utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    first = lines[0].lstrip() if lines else ""
    if first.startswith(("{", "[")):
        return None
    if first.startswith("═") or "otel-gpu · " in text:
        return "is a text log (as OTEL_GPU_LOGDEST=FILE.log writes it)"
    code = [ln for ln in lines if ln.startswith(_PYTHON_STARTS)]
    if code and (path.endswith(".py") or first.startswith(_PYTHON_STARTS)):
        return "looks like Python source"
    return "is text, not JSON"


def _say(err: IO[str], message: str) -> None:
    """One line on ``err``; file names and values in it are escaped as the tree's are."""
    print(printable(f"otel-gpu show: {message}"), file=err)


def _problems(problems: list[TraceFileError]) -> str:
    """``1 invalid line and 1 unreadable file``, by kind."""
    files = sum(1 for p in problems if p.whole_file)
    parts = [_n(len(problems) - files, "invalid line")] if len(problems) > files else []
    if files:
        parts.append(_n(files, "unreadable file"))
    return " and ".join(parts)


# --------------------------------------------------------------------------- the tree


def _matches(span: Span, names: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(span.name, pattern) for pattern in names)


def _with_ancestors(matched: set[Span]) -> set[Span]:
    keep: set[Span] = set()
    for span in matched:
        node: Span | None = span
        while node is not None and node not in keep:
            keep.add(node)
            node = node.parent
    return keep


def _walk(roots: Iterable[Span]) -> list[Span]:
    """``roots`` and all their descendants, parents before children."""
    order: list[Span] = []
    stack = list(roots)[::-1]
    while stack:
        span = stack.pop()
        order.append(span)
        stack.extend(reversed(span.children))
    return order


def _all(traces: list[Trace]) -> list[Span]:
    return _walk(root for trace in traces for root in trace.roots)


def _tree(w: _Writer, traces: list[Trace], matched: set[Span] | None, limit: int) -> None:
    """Draw the trees; with ``matched`` (--name) only those spans and their ancestors."""
    keep = _with_ancestors(matched) if matched is not None else None
    total = len(keep) if keep is not None else sum(t.count for t in traces)
    rows: list[tuple[Span | None, str, bool]] = []  # (span, prefix, last); None: a trace header
    headers: list[list[Segment]] = []
    shown = 0
    for trace in traces:
        roots = [r for r in trace.roots if keep is None or r in keep]
        if not roots:
            continue
        if limit and shown >= limit:
            break
        services = sorted({s.service for s in roots if s.service})
        header = f"trace {trace.trace_id}  {trace.count} span{'s' * (trace.count != 1)}"
        headers.append(
            [(header, "bold"), ("  service " + ", ".join(services) if services else "", "dim")]
        )
        rows.append((None, "", False))
        stack = [(r, "", i == len(roots) - 1, 0) for i, r in enumerate(roots)][::-1]
        while stack and not (limit and shown >= limit):
            span, prefix, last, depth = stack.pop()
            # past _DRAWN_DEPTH levels the prefix stops growing (a chain of a million spans
            # would otherwise print a million-character indentation): the depth is written
            indent = prefix if depth < _DRAWN_DEPTH else f"{prefix}⋯ depth {depth} "
            rows.append((span, indent, last))
            shown += 1
            kids = [c for c in span.children if keep is None or c in keep]
            inner = prefix + ("   " if last else "│  ") if depth < _DRAWN_DEPTH - 1 else prefix
            stack.extend(
                (c, inner, i == len(kids) - 1, depth + 1)
                for i, c in reversed(list(enumerate(kids)))
            )
    fill(span for span, _, _ in rows if span is not None)  # attributes of the drawn spans only
    next_header = iter(headers)
    clocks = device.Clocks()
    for drawn, prefix, last in rows:
        if drawn is None:
            w.line(*next(next_header))
            continue
        context = matched is not None and drawn not in matched
        w.line((prefix + ("└─ " if last else "├─ "), "dim"), *_describe(drawn, context))
        clocks.add(device.seconds(drawn.attrs) is not None)
    if clocks.device:  # a tree without device time says so in docs/show.md, not on each run
        w.line(
            (
                f"durations: {clocks.label()} (device: otel_gpu.device.duration; "
                "host: the span's start to end)",
                "dim",
            )
        )
    if shown < total:
        w.line(
            (f"… {_n(total - shown, 'more span')} not shown (--limit {limit}; ", ""),
            ("--limit 0 shows all)", ""),
        )


def _describe(span: Span, context: bool) -> list[Segment]:
    """One span's line; each value read from the file clipped (:func:`clip`)."""
    segments: list[Segment] = [(clip(span.name), "dim" if context else "bold")]
    segments.append(("  " + _duration(span), "dim"))
    if span.error:
        segments.append(("  ERROR", "bold red"))
        if span.message:
            segments.append((" " + clip(" ".join(span.message.split())), "red"))
    io = _io(span)
    if io:
        segments.append(("  " + io, ""))
    memory = device.memory(span.attrs)
    if memory:
        segments.append(("  " + memory, "red" if span.error else "dim"))
    bad = _bad(span, "input") + _bad(span, "output")
    if bad:
        segments.append(("  NaN/Inf: " + ", ".join(bad), "bold red"))
    elif span.attrs.get(attr.NONFINITE):
        segments.append(
            ("  NaN/Inf (otel_gpu.nonfinite; no statistics name the tensor)", "bold red")
        )
    if attr.DUMP_DIR in span.attrs:
        segments.append((f"  dump {clip(span.attrs[attr.DUMP_DIR])}", "cyan"))
    if attr.RING_DUMP_DIR in span.attrs:
        segments.append((f"  ring dump {clip(span.attrs[attr.RING_DUMP_DIR])}", "cyan"))
    if span.attrs.get(attr.STUCK):
        seconds = clip(span.attrs.get(attr.STUCK_SECONDS, "?"))
        segments.append((f"  STUCK: running for {seconds} s (host time) when reported", "bold red"))
    if span.cycle:
        segments.append((f"  [root: parent {span.parent_id} would close a cycle]", "yellow"))
    elif span.parent is None and span.parent_id:
        segments.append((f"  [root: parent {span.parent_id} not in the input]", "yellow"))
    return segments


def _duration(span: Span) -> str:
    """The device time where the span has it, with the host's beside it; else the host's."""
    host = _host_duration(span)
    measured = device.seconds(span.attrs)
    if measured is not None:
        return f"device {device.human(measured * 1e9)} (host {host})"
    if device.unresolved(span.attrs):
        return f"{host} (host; device time unresolved)"
    return host


def _host_duration(span: Span) -> str:
    ns = span.end - span.start
    if not span.start or not span.end or ns < 0:
        return "?"
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns} ns"


def _io(span: Span) -> str:
    """``q=bf16[2,4,8] scale=0.5 → f32[2,4,8]``: top-level inputs, then outputs."""
    inputs = _entries(span.attrs, attr.INPUT_PREFIX)
    outputs = _entries(span.attrs, attr.OUTPUT_PREFIX)
    text = _join(inputs, keys=True)
    if outputs:
        numbered = all(key.isdigit() for key in outputs)
        shown = _join(outputs, keys=not numbered, sep=", " if numbered else " ")
        if numbered and len(outputs) > 1:
            shown = f"({shown})"  # a returned tuple
        text += (" → " if text else "→ ") + shown
    return text


def _entries(attrs: dict[str, Any], prefix: str) -> dict[str, str]:
    groups: dict[str, dict[str, Any]] = {}
    for key, value in attrs.items():
        if key.startswith(prefix):
            name, _, fld = key[len(prefix) :].rpartition(".")
            if name and "." not in name and fld in _FIELDS:
                groups.setdefault(name, {})[fld] = value
    return {name: _compact(entry) for name, entry in groups.items()}


def _join(entries: dict[str, str], keys: bool, sep: str = " ") -> str:
    items = [f"{k}={v}" if keys else v for k, v in entries.items()]
    more = len(items) - _SHOWN_ITEMS
    return sep.join(items[:_SHOWN_ITEMS]) + (f"{sep}+{more} more" if more > 0 else "")


def _compact(entry: dict[str, Any]) -> str:
    if "dtype" in entry:
        dtype = clip(str(entry["dtype"]).removeprefix("torch."))
        for long, short in _DTYPE_PREFIXES:
            if dtype.startswith(long):
                dtype = short + dtype[len(long) :]
                break
        shape = entry.get("shape") or ()
        dims = ",".join(str(d) for d in shape) if isinstance(shape, list) else str(shape)
        return f"{dtype}[{clip(dims)}]"
    if "value" in entry:
        value = entry["value"]
        plain = ("None", "<redacted>")  # and enum members, recorded as "Class.MEMBER"
        if isinstance(value, str) and value not in plain and "enum_value" not in entry:
            return repr(value if len(value) <= 40 else value[:39] + "…")
        return clip(value)
    if "length" in entry:
        return f"{clip(entry.get('type', 'container'))}({clip(entry['length'])})"
    return clip(entry.get("type", "?"))


# --------------------------------------------------------------------------- NaN/Inf


def _counts(stat: dict[str, Any]) -> tuple[int, int] | None:
    """(NaN, Inf) counts of one statistics event; None when the event cannot say."""
    if attr.STATS_NAN_COUNT in stat or attr.STATS_INF_COUNT in stat:
        nan, inf = stat.get(attr.STATS_NAN_COUNT) or 0, stat.get(attr.STATS_INF_COUNT) or 0
        return (nan, inf) if isinstance(nan, int) and isinstance(inf, int) else None
    note = str(stat.get(attr.STATS_NOTE, ""))
    if stat.get(attr.STATS_NUMEL) == 0 or note.startswith(("integer", "bool")):
        return 0, 0  # no NaN/Inf possible
    return None


def _bad(span: Span, side: str) -> list[str]:
    """``output.0 (3 NaN, 1 Inf)`` for each tensor of ``side`` holding NaN/Inf."""
    found = []
    for stat in span.stats:
        tensor = str(stat.get(attr.STATS_TENSOR, "?"))
        counts = _counts(stat)
        if tensor.startswith(side + ".") and counts and any(counts):
            what = [f"{n} {label}" for n, label in zip(counts, ("NaN", "Inf")) if n]
            found.append(f"{tensor} ({', '.join(what)})")
    return found


def _unchecked(span: Span) -> list[str]:
    """Input tensors whose statistics say nothing about NaN/Inf, with the reason."""
    return [
        f"{stat.get(attr.STATS_TENSOR, '?')} ({stat.get(attr.STATS_NOTE, 'no counts')})"
        for stat in span.stats
        if str(stat.get(attr.STATS_TENSOR, "")).startswith("input.") and _counts(stat) is None
    ]


def _report(w: _Writer, traces: list[Trace], names: Sequence[str]) -> int:
    spans = _all(traces)
    candidate = {id(s): bool(_bad(s, "output") and not _bad(s, "input")) for s in spans}
    below: dict[int, bool] = {}
    for span in reversed(spans):  # children before their parents
        below[id(span)] = any(candidate[id(c)] or below[id(c)] for c in span.children)
    producers = [s for s in spans if candidate[id(s)] and not below[id(s)]]
    producers.sort(key=lambda s: s.start)
    if names:
        producers = [s for s in producers if _matches(s, names)]
    with_stats = sum(1 for s in spans if s.stats)
    checked = (
        f"{_n(len(spans), 'span')} in {_n(len(traces), 'trace')} checked, "
        f"{with_stats} with statistics"
    )
    roots = {t.trace_id: t.roots for t in traces}

    def where(span: Span) -> str:
        parts = [clip(part) for part in tree_path(span, roots[span.trace_id])]
        head, tail = _PATH_ENDS
        if len(parts) > head + tail + 1:  # a deep chain: its ends, and how many between
            parts = [*parts[:head], f"… {len(parts) - head - tail} more …", *parts[-tail:]]
        return " › ".join(parts)

    if not producers:
        matching = f" named {' or '.join(names)}" if names else ""
        w.text(f"No producer of NaN/Inf found{matching}: {checked}.", "bold")
        if not with_stats:
            w.text(
                "None of the spans has otel_gpu.stats events: NaN/Inf counts are recorded at "
                "level 5 or higher (OTEL_GPU_LOGLEVEL=5); record again at level 5."
            )
        entered = sorted((s for s in spans if _bad(s, "input")), key=lambda s: s.start)
        if entered and not names:
            first = entered[0]
            w.text(
                f"NaN/Inf are already in the inputs of {first.name}: "
                f"{', '.join(_bad(first, 'input'))}; no call with statistics in these files "
                "turned finite inputs into NaN/Inf.",
                "red",
            )
            w.text(f"  path:     {where(first)}")
            w.text(f"  span id:  {first.span_id}  trace id: {first.trace_id}")
        _unknown_lines(w, spans)
        return EXIT_NONE
    first = producers[0]
    w.line(("First producer of NaN/Inf: ", "bold"), (first.name, "bold red"))
    w.text(f"  path:     {where(first)}")
    w.text(f"  span id:  {first.span_id}")
    w.text(f"  trace id: {first.trace_id}")
    w.text("  outputs:  " + ", ".join(_bad(first, "output")), "red")
    inputs = [str(s.get(attr.STATS_TENSOR)) for s in first.stats if _counts(s) is not None]
    inputs = [t for t in inputs if t.startswith("input.")]
    w.text(
        "  inputs:   " + (f"no NaN/Inf in {', '.join(inputs)}" if inputs else "no tensor inputs")
    )
    unchecked = _unchecked(first)
    if unchecked:
        w.text(f"  not checked (no NaN/Inf counts): {', '.join(unchecked)}", "yellow")
    if attr.EVENTS_OMITTED in first.attrs:
        omitted = first.attrs[attr.EVENTS_OMITTED]
        w.text(f"  {_n(omitted, 'event')} cut by the event limit: statistics may be incomplete")
    if attr.RING_DUMP_DIR in first.attrs:  # the ring wrote it when it produced NaN/Inf
        w.text(f"  ring dump: {first.attrs[attr.RING_DUMP_DIR]}", "cyan")
    if attr.DUMP_DIR in first.attrs:
        w.text(f"  dump dir: {first.attrs[attr.DUMP_DIR]}", "cyan")
    elif attr.DUMP_SKIPPED in first.attrs:
        w.text(f"  not dumped: {first.attrs[attr.DUMP_SKIPPED]}")
    w.text(f"  read from {first.where}", "dim")
    blind = sum(1 for s in _walk(first.children) if not s.stats)
    if blind:
        w.text(
            f"  {_n(blind, 'call')} below it without statistics: the NaN/Inf may have begun "
            "in one of them.",
            "yellow",
        )
    if len(producers) > 1:
        w.text(f"Other producers ({len(producers) - 1}):", "bold")
        for span in producers[1 : _SHOWN + 1]:
            w.text(
                f"  {where(span)}  span {span.span_id}  trace {span.trace_id}  "
                + ", ".join(_bad(span, "output"))
            )
        if len(producers) > _SHOWN + 1:
            w.text(f"  … and {len(producers) - _SHOWN - 1} more")
    _unknown_lines(w, spans)
    w.text(checked + ".", "dim")
    return EXIT_FOUND


def _unknown_lines(w: _Writer, spans: list[Span]) -> None:
    """Spans flagged NaN/Inf whose statistics do not say which tensor (e.g. cut by limits)."""
    unknown = [
        s
        for s in spans
        if s.attrs.get(attr.NONFINITE) and not (_bad(s, "output") or _bad(s, "input"))
    ]
    if unknown:
        listed = ", ".join(f"{s.name} (span {s.span_id})" for s in unknown[:_SHOWN])
        more = f" and {len(unknown) - _SHOWN} more" if len(unknown) > _SHOWN else ""
        w.text(
            f"{_n(len(unknown), 'span')} flagged otel_gpu.nonfinite without statistics naming the "
            f"tensor, so nothing can be said about them: {listed}{more}",
            "yellow",
        )
