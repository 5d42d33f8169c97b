"""``otel-gpu ship FILE.jsonl [...]``: send the spans of OTLP JSON Lines files to an OTLP endpoint.

For air-gapped GPU nodes: spans are written to a file there (``OTEL_GPU_LOGDEST=spans-%i.jsonl``,
one OTLP/JSON ``TracesData`` per line, as the official ``opentelemetry-exporter-otlp-json-file``
exporter writes it), the file is carried out, and ``otel-gpu ship`` sends it from a machine that
reaches a collector or backend. Trace ids, span ids, parents, timestamps, attributes, events,
links and status are kept, so shipped spans are the spans that were recorded.

How it sends: every line is parsed with ``google.protobuf.json_format`` into a ``TracesData``
(after turning OTLP/JSON's hex ids into the base64 ``json_format`` expects), rebuilt as SDK
``ReadableSpan`` objects, and handed to the official ``OTLPSpanExporter`` that
``OTEL_GPU_LOGDEST=otlp`` uses (:func:`otel_gpu.exporters.destinations.otlp_exporter`). So the
endpoint, protocol, headers, TLS, compression, timeout and retries come from the standard
``OTEL_EXPORTER_OTLP_*`` variables exactly as for live export, through public API only.
What the SDK span model cannot carry is not sent: the W3C trace-flag bits of ``Span.flags``,
link ``trace_state``, resource and scope ``dropped_attributes_count`` and resource
``entity_refs``; a status message is kept for ERROR status only. Files written by otel-gpu
round-trip exactly (tested).

Exit codes: 0 every span was sent (with ``--check``: every line is valid); 1 some or all spans
were not sent (export failures, or invalid lines or unreadable files skipped with
``--skip-invalid``); 2 nothing was sent because the input is invalid (a file is missing,
unreadable or has invalid lines) or the OTLP configuration is, as for command-line usage errors.
"""

from __future__ import annotations

import argparse
import base64
import functools
import io
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from otel_gpu._text import brief, printable
from otel_gpu.traces.reader import TraceFileError, load_json, read_lines

__all__ = [
    "ShipError",
    "ShipResult",
    "parse_line",
    "read_traces",
    "register",
    "ship",
    "to_spans",
]

_BATCH_SIZE = 512  # spans per request, as the SDK's BatchSpanProcessor; keeps requests < 4 MiB
_PROGRESS_EVERY = 2.0  # seconds between progress lines inside one large file
_SHOWN_PROBLEMS = 20  # invalid lines listed one by one; the rest are counted


def _n(count: int, noun: str) -> str:
    """``1 span``, ``2 spans``: counts read as sentences, not as ``span(s)``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class ShipError(ValueError):
    """A file cannot be read, or one of its lines is not OTLP/JSON trace data.

    The message starts with ``FILE:LINE:`` (or ``FILE:`` when the file itself is the problem).
    """


# --------------------------------------------------------------------------- parsing

_ID_KEYS = (("traceId", "trace_id", 32), ("spanId", "span_id", 16))
_PARENT_KEYS = ("parentSpanId", "parent_span_id")


def _b64_id(value: Any, key: str, width: int, where: str, optional: bool = False) -> str:
    """OTLP/JSON carries ids as hex; ``json_format`` wants bytes fields as base64."""
    if optional and value in ("", None):
        return ""
    try:
        if not isinstance(value, str) or len(value) != width:
            raise ValueError
        raw = bytes.fromhex(value)
    except ValueError:
        raise ShipError(f"{where}: {key} {brief(value)} is not {width} hex digits") from None
    if not optional and not any(raw):
        raise ShipError(f"{where}: {key} is all zeros (an invalid id)")
    return base64.b64encode(raw).decode("ascii")


def _convert_ids(node: dict[str, Any], where: str, with_parent: bool) -> None:
    for camel, snake, width in _ID_KEYS:
        key = camel if camel in node else snake
        if key not in node:
            raise ShipError(f"{where}: no {camel}")
        node[key] = _b64_id(node[key], key, width, where)  # named as the file spells it
    if with_parent:
        for key in _PARENT_KEYS:
            if key in node:
                node[key] = _b64_id(node[key], key, 16, where, optional=True)


def _items(node: Any, camel: str, snake: str, where: str) -> list[Any]:
    if not isinstance(node, dict):
        raise ShipError(f"{where} is not an object (expected one holding {camel})")
    key = camel if camel in node else snake
    value = node.get(key, [])
    if not isinstance(value, list):
        raise ShipError(f"{where}: {key} is not a list")
    return value


def parse_line(text: str, where: str) -> Any:
    """One OTLP/JSON line -> ``TracesData``. Raises :class:`ShipError` naming ``where``."""
    try:
        payload = load_json(text.encode("utf-8", "surrogatepass"), where)
    except TraceFileError as exc:
        raise ShipError(str(exc)) from None
    return _traces(payload, where)


def _traces(payload: Any, where: str) -> Any:
    """A line's JSON (within the reader's bounds) -> ``TracesData``, or :class:`ShipError`."""
    from google.protobuf import json_format
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    if not isinstance(payload, dict):
        raise ShipError(f"{where}: expected a JSON object (OTLP TracesData)")
    if "resourceSpans" not in payload and "resource_spans" not in payload:
        other = [k for k in ("resourceMetrics", "resourceLogs") if k in payload]
        what = (
            f"{other[0]} found: metrics and logs are not shipped" if other else "no resourceSpans"
        )
        raise ShipError(f"{where}: not OTLP trace data ({what})")
    for r, rs in enumerate(_items(payload, "resourceSpans", "resource_spans", where)):
        at_r = f"{where}: resourceSpans[{r}]"
        for s, ss in enumerate(_items(rs, "scopeSpans", "scope_spans", at_r)):
            at_s = f"{at_r}.scopeSpans[{s}]"
            for i, span in enumerate(_items(ss, "spans", "spans", at_s)):
                path = f"resourceSpans[{r}].scopeSpans[{s}].spans[{i}]"
                if not isinstance(span, dict):
                    raise ShipError(f"{where}: {path} is not an object")
                at = f"{where}: span {brief(span.get('name', '?'))} ({path})"
                _convert_ids(span, at, with_parent=True)
                for k, link in enumerate(_items(span, "links", "links", at)):
                    _convert_ids(link, f"{at} links[{k}]", with_parent=False)
    traces = TracesData()
    try:
        json_format.ParseDict(payload, traces, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise ShipError(f"{where}: not OTLP trace data: {_cut(str(exc))}") from None
    return traces


def _cut(text: str, limit: int = 200) -> str:
    """A parser's message quotes the offending value: keep a message one readable line."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_traces(path: str) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, TracesData)`` for each non-blank line of ``path`` (``.gz`` too).

    Raises :class:`ShipError` for an unreadable file or at the first invalid line.
    """

    def strict(message: str, whole_file: bool) -> None:
        raise ShipError(message)

    return _parsed(path, strict)


def _parsed(path: str, problem: Callable[[str, bool], None]) -> Iterator[tuple[int, Any]]:
    """The parsed lines of ``path``; an invalid line is reported to ``problem(message, False)``
    and skipped, an unreadable file is reported (``True``) and ends the iteration.

    Lines are read by the trace-file reader ``otel-gpu show`` uses: gzip by content, lines
    decoded one by one, and the same bounds on a line's length and nesting.
    """

    def report(exc: TraceFileError) -> None:
        problem(str(exc), exc.whole_file)

    for line in read_lines(path, report):
        try:
            yield line.number, _traces(load_json(line.raw, line.where, line.torn), line.where)
        except (TraceFileError, ShipError) as exc:
            problem(str(exc), False)


# --------------------------------------------------------------------------- proto -> SDK spans


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@functools.cache
def _sdk_types() -> dict[str, Any]:
    """SDK subclasses that carry a file's values verbatim (the SDK classes would re-validate)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link

    class _Resource(Resource):
        # Identity, not value, equality: the encoder groups spans by resource, and two
        # ResourceSpans of a file must stay two.
        __eq__ = object.__eq__
        __hash__ = object.__hash__

        def __init__(self, attributes: dict[str, Any], schema_url: str) -> None:
            super().__init__({}, schema_url)
            self._raw = attributes

        @property
        def attributes(self) -> Any:
            return self._raw

    class _Scope(InstrumentationScope):
        __eq__ = object.__eq__
        __hash__ = object.__hash__

        def __init__(self, name: str, version: str, schema_url: str, attributes: Any) -> None:
            super().__init__(name, version or None, schema_url)
            self._raw = attributes

        @property
        def attributes(self) -> Any:
            return self._raw

    class _Event(Event):
        def __init__(self, name: str, attributes: Any, timestamp: int, dropped: int) -> None:
            super().__init__(name, attributes, timestamp)
            self._dropped = dropped

        @property
        def dropped_attributes(self) -> int:
            return self._dropped

    class _Link(Link):
        def __init__(self, context: Any, attributes: Any, dropped: int) -> None:
            super().__init__(context, attributes)
            self._dropped = dropped

        @property
        def dropped_attributes(self) -> int:
            return self._dropped

    class _Span(ReadableSpan):
        def __init__(self, dropped: tuple[int, int, int], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._dropped = dropped

        @property
        def dropped_attributes(self) -> int:
            return self._dropped[0]

        @property
        def dropped_events(self) -> int:
            return self._dropped[1]

        @property
        def dropped_links(self) -> int:
            return self._dropped[2]

    return {"resource": _Resource, "scope": _Scope, "event": _Event, "link": _Link, "span": _Span}


_REMOTE = 0x200  # SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


def to_spans(traces: Any) -> list[Any]:
    """The ``ReadableSpan`` objects of a ``TracesData``, ids and values unchanged."""
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
    from opentelemetry.trace.span import TraceState

    types = _sdk_types()
    kinds = list(SpanKind)
    spans = []
    for rs in traces.resource_spans:
        resource = types["resource"](_attrs(rs.resource.attributes), rs.schema_url)
        for ss in rs.scope_spans:
            scope = types["scope"](
                ss.scope.name, ss.scope.version, ss.schema_url, _attrs(ss.scope.attributes)
            )
            for s in ss.spans:
                trace_id = int.from_bytes(s.trace_id, "big")
                state = TraceState.from_header([s.trace_state]) if s.trace_state else None
                context = SpanContext(
                    trace_id,
                    int.from_bytes(s.span_id, "big"),
                    False,
                    TraceFlags(s.flags & 0xFF),
                    state,
                )
                parent = None
                if s.parent_span_id:
                    remote = bool(s.flags & _REMOTE)
                    parent = SpanContext(trace_id, int.from_bytes(s.parent_span_id, "big"), remote)
                code = StatusCode(s.status.code) if s.status.code in (0, 1, 2) else StatusCode.UNSET
                status = Status(
                    code, s.status.message or None if code is StatusCode.ERROR else None
                )
                events = [
                    types["event"](
                        e.name, _attrs(e.attributes), e.time_unix_nano, e.dropped_attributes_count
                    )
                    for e in s.events
                ]
                links = [
                    types["link"](
                        SpanContext(
                            int.from_bytes(link.trace_id, "big"),
                            int.from_bytes(link.span_id, "big"),
                            bool(link.flags & _REMOTE),
                        ),
                        _attrs(link.attributes),
                        link.dropped_attributes_count,
                    )
                    for link in s.links
                ]
                spans.append(
                    types["span"](
                        (s.dropped_attributes_count, s.dropped_events_count, s.dropped_links_count),
                        name=s.name,
                        context=context,
                        parent=parent,
                        resource=resource,
                        attributes=_attrs(s.attributes),
                        events=events,
                        links=links,
                        kind=kinds[s.kind - 1] if 1 <= s.kind <= len(kinds) else SpanKind.INTERNAL,
                        status=status,
                        start_time=s.start_time_unix_nano,
                        end_time=s.end_time_unix_nano,
                        instrumentation_scope=scope,
                    )
                )
    return spans


# --------------------------------------------------------------------------- shipping


@dataclass
class ShipResult:
    """What one ``ship`` run did. ``exit_code`` follows the module's contract."""

    files: int = 0
    spans: int = 0
    sent: int = 0
    failed: int = 0
    requests: int = 0
    invalid: list[str] = field(default_factory=list)
    """Messages for invalid lines or unreadable files (``FILE:LINE: why``)."""
    unreadable: int = 0
    """How many of ``invalid`` are files that could not be read (to the end), not lines."""
    aborted: bool = False
    """True when shipping stopped after too many consecutive failed requests."""
    not_attempted: int = 0
    """Spans counted in ``failed`` that were never sent, because shipping stopped."""
    summary: str = ""
    """The last line ``ship`` printed: what was sent, failed and skipped (to ``err`` when
    the exit code is not 0, so ``--quiet`` still shows it)."""

    @property
    def exit_code(self) -> int:
        if self.invalid and self.sent == 0 and self.failed == 0:
            return 2
        return 0 if not self.failed and not self.invalid else 1


def _scan(paths: Sequence[str]) -> tuple[list[int], list[str], int]:
    """Validate every file before sending anything: spans per file, every problem found, and
    how many files could not be read (to the end)."""
    counts: list[int] = []
    problems: list[str] = []
    unreadable = 0

    def problem(message: str, whole_file: bool) -> None:
        nonlocal unreadable
        problems.append(message)
        unreadable += whole_file

    for path in paths:
        counts.append(
            sum(
                len(ss.spans)
                for _, traces in _parsed(path, problem)
                for rs in traces.resource_spans
                for ss in rs.scope_spans
            )
        )
    return counts, problems, unreadable


def ship(
    paths: Sequence[str],
    exporter_factory: Callable[[], Any] | None = None,
    *,
    batch_size: int = _BATCH_SIZE,
    skip_invalid: bool = False,
    max_failures: int = 3,
    check_only: bool = False,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    target: str = "",
) -> ShipResult:
    """Send the spans of ``paths`` through the exporter ``exporter_factory()`` builds.

    All files are validated first; with invalid lines nothing is sent unless ``skip_invalid``.
    After ``max_failures`` consecutive failed requests (0: never) the rest is counted as failed.
    Progress goes to ``out``, problems in the input to ``err`` (both: stderr), and the summary
    to ``out``, or to ``err`` when not everything was sent. Raises ``ConfigError`` when the
    standard OTLP variables cannot build the default exporter.
    """

    out = sys.stderr if out is None else out  # progress and summary
    err = out if err is None else err  # problems in the input
    result = ShipResult(files=len(paths))
    counts, result.invalid, result.unreadable = _scan(paths)
    result.spans = sum(counts)
    for message in result.invalid[:_SHOWN_PROBLEMS]:
        _say(f"otel-gpu ship: {message}", file=err)
    if len(result.invalid) > _SHOWN_PROBLEMS:
        more = len(result.invalid) - _SHOWN_PROBLEMS
        _say(f"otel-gpu ship: ... and {_n(more, 'more problem')}", file=err)
    files = _n(len(paths), "file")
    if check_only:
        result.summary = f"otel-gpu ship: {_n(result.spans, 'valid span')} in {files}"
        if result.invalid:
            result.summary += f", {_problems(result)}; nothing sent (--check)"
        _say(result.summary, file=err if result.invalid else out)
        return result
    if result.invalid and not skip_invalid:
        result.summary = (
            f"otel-gpu ship: nothing sent: {_problems(result)} (--skip-invalid sends the rest)"
        )
        _say(result.summary, file=err)
        return result
    exporter = (_otlp_exporter if exporter_factory is None else exporter_factory)()
    _say(f"otel-gpu ship: {_n(result.spans, 'span')} in {files} -> {target or 'OTLP'}", file=out)
    consecutive = 0
    try:
        for path, total in zip(paths, counts):
            if result.aborted:
                result.failed += total
                result.not_attempted += total
                _say(f"  {path}: not sent ({_n(total, 'span')})", file=out)
                continue
            sent_before, failed_before = result.sent, result.failed
            before = sent_before + failed_before
            last = time.monotonic()
            batch: list[Any] = []
            for _lineno, traces in _parsed(path, _ignore):
                batch.extend(to_spans(traces))
                while len(batch) >= batch_size and not result.aborted:
                    chunk, batch = batch[:batch_size], batch[batch_size:]
                    consecutive = _send(exporter, chunk, result, consecutive, max_failures)
                if result.aborted:
                    break
                if time.monotonic() - last > _PROGRESS_EVERY:
                    done = result.sent + result.failed - before
                    _say(f"  {path}: {done}/{total} spans ...", file=out)
                    last = time.monotonic()
            while batch and not result.aborted:
                chunk, batch = batch[:batch_size], batch[batch_size:]
                consecutive = _send(exporter, chunk, result, consecutive, max_failures)
            # after an abort, what was not attempted counts as failed
            skipped = total - (result.sent + result.failed - before)
            result.failed += skipped
            result.not_attempted += skipped
            sent, failed = result.sent - sent_before, result.failed - failed_before
            line = f"  {path}: {sent} sent, {failed} failed"
            _say(line + (f" ({skipped} not attempted)" if skipped else ""), file=out)
    finally:
        try:
            exporter.shutdown()
        except Exception:
            pass
    result.summary = f"otel-gpu ship: {_n(result.sent, 'span')} sent, {result.failed} failed"
    if result.invalid:
        result.summary += f", {_problems(result)} skipped"
    if result.aborted:
        result.summary += (
            f" (stopped after {_n(max_failures, 'failed request')} in a row: "
            f"{result.not_attempted} not attempted)"
        )
    _say(result.summary, file=err if result.exit_code else out)  # -q shows it when not 0
    return result


def _say(text: str, file: IO[str]) -> None:
    """Print one line; file names and values read from files are escaped (see ``_text``)."""
    print(printable(text), file=file)


def _problems(result: ShipResult) -> str:
    """``2 invalid lines and 1 unreadable file``: what ``result.invalid`` holds, by kind."""
    lines = len(result.invalid) - result.unreadable
    parts = [_n(lines, "invalid line")] if lines else []
    if result.unreadable:
        parts.append(_n(result.unreadable, "unreadable file"))
    return " and ".join(parts)


def _ignore(_message: str, _whole_file: bool) -> None:
    """Invalid lines were reported by the scan; the send pass skips them silently."""


def _send(exporter: Any, chunk: list[Any], result: ShipResult, consecutive: int, limit: int) -> int:
    from opentelemetry.sdk.trace.export import SpanExportResult

    result.requests += 1
    try:
        ok = exporter.export(chunk) == SpanExportResult.SUCCESS
    except Exception as exc:  # an exporter should not raise; count it as a failed request
        _say(f"otel-gpu ship: export raised {type(exc).__name__}: {exc}", file=sys.stderr)
        ok = False
    if ok:
        result.sent += len(chunk)
        return 0
    result.failed += len(chunk)
    consecutive += 1
    if limit and consecutive >= limit:
        result.aborted = True
    return consecutive


# --------------------------------------------------------------------------- CLI


_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_PROTOCOLS = ("grpc", "http/protobuf")


def _protocol(env: Mapping[str, str]) -> tuple[str, str]:
    """(variable, protocol) as the exporters choose it: the first variable set, else grpc."""
    for name in _PROTOCOL_VARS:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return "", "grpc"


def _check_environment(env: Mapping[str, str]) -> None:
    """ConfigError naming the standard OTLP variable ``ship`` cannot send with."""
    from otel_gpu.config import ConfigError
    from otel_gpu.exporters.destinations import check_otlp_environment

    name, protocol = _protocol(env)
    if protocol not in _PROTOCOLS:
        raise ConfigError(
            f"{name}={protocol!r} is not supported by otel-gpu ship. "
            f"Allowed: {', '.join(_PROTOCOLS)}."
        )
    check_otlp_environment(env)  # the timeouts


def _otlp_exporter() -> Any:
    """The official OTLP exporter; ConfigError when the standard variables cannot build one."""
    from otel_gpu.config import ConfigError, otel_standard_variables
    from otel_gpu.exporters.destinations import otlp_exporter

    _check_environment(otel_standard_variables())
    try:
        return otlp_exporter()
    except Exception as exc:  # e.g. OTEL_EXPORTER_OTLP_COMPRESSION=zip
        raise ConfigError(
            f"the OTEL_EXPORTER_OTLP_* variables do not make an exporter: "
            f"{type(exc).__name__}: {exc}"
        ) from None


def describe_target(env: Mapping[str, str]) -> str:
    """``PROTOCOL ENDPOINT`` as the standard OTLP variables resolve them (for messages)."""
    protocol = _protocol(env)[1]
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint:
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if protocol == "grpc":
            endpoint = base or "http://localhost:4317"
        else:  # as the HTTP exporter joins them: one trailing slash dropped
            endpoint = f"{(base or 'http://localhost:4318/').removesuffix('/')}/v1/traces"
    return f"{protocol} {endpoint}"


def _main(args: argparse.Namespace) -> int:
    from otel_gpu.config import ConfigError, otel_standard_variables

    env = otel_standard_variables()
    try:
        if not args.check:  # before reading the files: a bad variable fails at once
            _check_environment(env)
        result = ship(
            args.files,
            batch_size=args.batch_size,
            skip_invalid=args.skip_invalid,
            max_failures=args.max_failures,
            check_only=args.check,
            out=io.StringIO() if args.quiet else sys.stderr,
            err=sys.stderr,
            target=describe_target(env),
        )
    except ConfigError as exc:
        _say(f"otel-gpu ship: {exc}", file=sys.stderr)
        return 2
    return result.exit_code


def register(sub: Any) -> None:
    from otel_gpu.cli import whole_number

    p = sub.add_parser(
        "ship",
        help="send the spans of OTLP JSON Lines files to the OTEL_EXPORTER_OTLP_* endpoint",
        description="Send the spans of OTLP JSON Lines files (as OTEL_GPU_LOGDEST=FILE.jsonl "
        "writes them; .jsonl.gz too) to the endpoint the standard OTEL_EXPORTER_OTLP_* variables "
        "name (protocol grpc or http/protobuf), keeping trace and span ids. Every file is "
        "validated before anything is sent. Exit codes: 0 every span sent (with --check: every "
        "line valid); 1 some or all spans not sent (export failures, or invalid input skipped "
        "with --skip-invalid); 2 nothing sent because of invalid input or configuration.",
    )
    p.add_argument("files", nargs="+", metavar="FILE.jsonl", help="OTLP JSON Lines files")
    p.add_argument(
        "--batch-size",
        type=whole_number(1),
        default=_BATCH_SIZE,
        help=f"spans per export request (default {_BATCH_SIZE})",
    )
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="ship the valid lines even if some lines are invalid (e.g. a truncated last line) "
        "or some files cannot be read",
    )
    p.add_argument(
        "--max-failures",
        type=whole_number(0),
        default=3,
        help="stop after this many failed requests in a row; 0 never stops (default 3)",
    )
    p.add_argument("--check", action="store_true", help="only validate the files; send nothing")
    p.add_argument("-q", "--quiet", action="store_true", help="print only problems")
    p.set_defaults(func=_main)
