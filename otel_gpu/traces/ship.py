"""``otel-gpu ship FILE.jsonl [...]``: send the spans of OTLP JSON Lines files to an OTLP endpoint.

For air-gapped GPU nodes: spans are written to a file there (``OTEL_GPU_LOGDEST=spans-%i.jsonl``,
one OTLP/JSON ``TracesData`` per line, as the official ``opentelemetry-exporter-otlp-json-file``
exporter writes it), the file is carried out, and ``otel-gpu ship`` sends it from a machine that
reaches a collector or backend. Trace ids, span ids, parents, timestamps, attributes, events,
links, status and flags are kept, so shipped spans are the spans that were recorded.

How it sends: one pass reads every file (:func:`otel_gpu.traces.reader.read_lines` and
``load_json``, the reader ``otel-gpu show`` uses) and turns each line into protobuf bytes with
:mod:`otel_gpu.traces.decode`, which checks the line as it goes. The bytes wait in an unnamed
temporary file (memory stays bounded) until every file has been checked; then requests of
``--batch-size`` spans are cut from them and sent by otel-gpu's own OTLP transport
(:class:`otel_gpu.exporters.otlp_transport.OtlpSpanExporter`, what ``OTEL_GPU_LOGDEST=otlp``
uses), so the endpoint, protocol, headers, TLS, compression, timeout and retries come from the
standard ``OTEL_EXPORTER_OTLP_*`` variables exactly as for live export. What a line holds is
sent as the file has it, except keys OTLP does not define and resource ``entityRefs``.
An exporter given to :func:`ship` as an SDK ``SpanExporter`` gets ``ReadableSpan`` objects
instead (:func:`otel_gpu.traces.sdk_spans.to_spans`, with that model's limits).

Exit codes: 0 every span was sent (with ``--check``: every line is valid); 1 some or all spans
were not sent (export failures, or invalid lines or unreadable files skipped with
``--skip-invalid``); 2 nothing was sent because the input is invalid (a file is missing,
unreadable or has invalid lines) or the OTLP configuration is, as for command-line usage errors.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from otel_gpu._text import printable
from otel_gpu.traces.decode import Group, ShipError, decode, request_bytes
from otel_gpu.traces.reader import TraceFileError, load_json, read_lines
from otel_gpu.traces.sdk_spans import to_spans

__all__ = [
    "BATCH_SIZE",
    "ShipError",
    "ShipResult",
    "check_environment",
    "describe_target",
    "parse_line",
    "read_traces",
    "ship",
    "to_spans",
]

BATCH_SIZE = 512  # spans per request, as the SDK's BatchSpanProcessor; keeps requests < 4 MiB
_PROGRESS_EVERY = 2.0  # seconds between progress lines inside one large file
_SHOWN_PROBLEMS = 20  # invalid lines listed one by one; the rest are counted

Problem = Callable[[str, bool], None]
"""Told ``(message, whole_file)`` about each invalid line or unreadable file."""


def _n(count: int, noun: str) -> str:
    """``1 span``, ``2 spans``: counts read as sentences, not as ``span(s)``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# --------------------------------------------------------------------------- reading


def _traces_data(groups: list[Group]) -> Any:
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    return TracesData.FromString(request_bytes(groups))


def parse_line(text: str, where: str) -> Any:
    """One OTLP/JSON line -> ``TracesData``. Raises :class:`ShipError` naming ``where``."""
    try:
        payload = load_json(text.encode("utf-8", "surrogatepass"), where)
    except TraceFileError as exc:
        raise ShipError(str(exc)) from None
    return _traces_data(decode(payload, where))


def read_traces(path: str) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, TracesData)`` for each non-blank line of ``path`` (``.gz`` too).

    Raises :class:`ShipError` for an unreadable file or at the first invalid line.
    """

    def strict(message: str, whole_file: bool) -> None:
        raise ShipError(message)

    for number, groups in _decoded(path, strict):
        yield number, _traces_data(groups)


def _decoded(path: str, problem: Problem) -> Iterator[tuple[int, list[Group]]]:
    """The decoded lines of ``path``; an invalid line is reported to ``problem(message, False)``
    and skipped, an unreadable file is reported (``True``) and ends the iteration.

    Lines are read by the trace-file reader ``otel-gpu show`` uses: gzip by content, lines
    decoded one by one, and the same bounds on a line's length and nesting.
    """

    def report(exc: TraceFileError) -> None:
        problem(str(exc), exc.whole_file)

    for line in read_lines(path, report):
        try:
            yield line.number, decode(load_json(line.raw, line.where, line.torn), line.where)
        except (TraceFileError, ShipError) as exc:
            problem(str(exc), False)


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


@dataclass
class _Scan:
    """What the one reading pass found: spans and spooled bytes per file, and every problem."""

    counts: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    """Per file, where its lines lie in the spool (start, end offsets)."""
    problems: list[str] = field(default_factory=list)
    unreadable: int = 0


def _scan(paths: Sequence[str], spool: IO[bytes] | None) -> _Scan:
    """Read and check every file before sending anything; the decoded lines go to ``spool``."""
    scan = _Scan()

    def problem(message: str, whole_file: bool) -> None:
        scan.problems.append(message)
        scan.unreadable += whole_file

    for path in paths:
        count = 0
        start = spool.tell() if spool is not None else 0
        for _, groups in _decoded(path, problem):
            count += sum(len(group.spans) for group in groups)
            if spool is not None:
                pickle.dump(groups, spool, pickle.HIGHEST_PROTOCOL)
        scan.counts.append(count)
        scan.spans.append((start, spool.tell() if spool is not None else 0))
    return scan


def _metrics_file(path: str) -> bool:
    """Whether ``path`` is otel-gpu's metrics file beside a span file (``NAME.metrics.jsonl``,
    ``OTEL_GPU_METRICS``), which a glob such as ``spool/*.jsonl`` also matches: by its name, and
    by its first line holding metrics (a file so named that holds spans is shipped)."""
    if not os.path.basename(path).endswith(".metrics.jsonl"):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
    except OSError:
        return False  # reported as unreadable by the scan, as any other file
    return head.startswith(b"{") and b'"resourceMetrics"' in head


def _spooled(spool: IO[bytes], start: int, end: int) -> Iterator[list[Group]]:
    spool.seek(start)
    while spool.tell() < end:
        yield pickle.load(spool)


def ship(
    paths: Sequence[str],
    exporter_factory: Callable[[], Any] | None = None,
    *,
    batch_size: int = BATCH_SIZE,
    skip_invalid: bool = False,
    max_failures: int = 3,
    check_only: bool = False,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    target: str = "",
) -> ShipResult:
    """Send the spans of ``paths`` through the exporter ``exporter_factory()`` builds (default:
    the OTLP transport the standard variables configure).

    All files are validated first; with invalid lines nothing is sent unless ``skip_invalid``.
    After ``max_failures`` consecutive failed requests (0: never) the rest is counted as failed.
    Progress goes to ``out``, problems in the input to ``err`` (both: stderr), and the summary
    to ``out``, or to ``err`` when not everything was sent. Raises ``ConfigError`` when the
    standard OTLP variables cannot build the default exporter.
    """
    out = sys.stderr if out is None else out  # progress and summary
    err = out if err is None else err  # problems in the input
    # the decoded lines wait on disk, not in memory, until every file is checked
    spool = contextlib.nullcontext() if check_only else tempfile.TemporaryFile()
    with spool as opened:
        return _ship(
            paths,
            opened,
            exporter_factory,
            batch_size,
            skip_invalid,
            max_failures,
            out,
            err,
            target,
        )


def _ship(
    paths: Sequence[str],
    spool: IO[bytes] | None,
    exporter_factory: Callable[[], Any] | None,
    batch_size: int,
    skip_invalid: bool,
    max_failures: int,
    out: IO[str],
    err: IO[str],
    target: str,
) -> ShipResult:
    metrics = [path for path in paths if _metrics_file(path)]
    if metrics:
        paths = [path for path in paths if path not in metrics]
        _say(
            f"otel-gpu ship: {_n(len(metrics), 'metrics file')} left out "
            f"({', '.join(metrics[:3])}{', ...' if len(metrics) > 3 else ''}): otel-gpu writes "
            "its metrics beside the spans as NAME.metrics.jsonl, and ship sends spans",
            file=out,
        )
    result = ShipResult(files=len(paths))
    scan = _scan(paths, spool)
    result.invalid, result.unreadable = scan.problems, scan.unreadable
    result.spans = sum(scan.counts)
    for message in result.invalid[:_SHOWN_PROBLEMS]:
        _say(f"otel-gpu ship: {message}", file=err)
    if len(result.invalid) > _SHOWN_PROBLEMS:
        more = len(result.invalid) - _SHOWN_PROBLEMS
        _say(f"otel-gpu ship: ... and {_n(more, 'more problem')}", file=err)
    files = _n(len(paths), "file")
    if spool is None:  # --check
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
    send = _sender(exporter)
    _say(f"otel-gpu ship: {_n(result.spans, 'span')} in {files} -> {target or 'OTLP'}", file=out)
    consecutive = 0
    try:
        for path, total, (start, end) in zip(paths, scan.counts, scan.spans):
            if result.aborted:
                result.failed += total
                result.not_attempted += total
                _say(f"  {path}: not sent ({_n(total, 'span')})", file=out)
                continue
            sent_before, failed_before = result.sent, result.failed
            before = sent_before + failed_before
            last = time.monotonic()
            batch: list[Group] = []
            size = 0
            for groups in _spooled(spool, start, end):
                for group in groups:
                    spans = group.spans
                    while spans and not result.aborted:
                        take, spans = spans[: batch_size - size], spans[batch_size - size :]
                        batch.append(Group(group.resource, group.scope, take))
                        size += len(take)
                        if size == batch_size:
                            consecutive = _send(
                                send, batch, size, result, consecutive, max_failures
                            )
                            batch, size = [], 0
                if result.aborted:
                    break
                if time.monotonic() - last > _PROGRESS_EVERY:
                    done = result.sent + result.failed - before
                    _say(f"  {path}: {done}/{total} spans ...", file=out)
                    last = time.monotonic()
            if batch and not result.aborted:
                consecutive = _send(send, batch, size, result, consecutive, max_failures)
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


Send = Callable[[list[Group], int], Any]


def _sender(exporter: Any) -> Send:
    """How a request reaches ``exporter``: the OTLP transport takes the bytes as they are; an
    SDK ``SpanExporter`` takes spans, rebuilt from them."""
    from otel_gpu.exporters.otlp_transport import OtlpSpanExporter

    if isinstance(exporter, OtlpSpanExporter):
        return lambda groups, count: exporter.export_encoded(request_bytes(groups), count)
    return lambda groups, count: exporter.export(to_spans(_traces_data(groups)))


def _send(
    send: Send, groups: list[Group], count: int, result: ShipResult, consecutive: int, limit: int
) -> int:
    from opentelemetry.sdk.trace.export import SpanExportResult

    result.requests += 1
    try:
        ok = send(groups, count) == SpanExportResult.SUCCESS
    except Exception as exc:  # an exporter should not raise; count it as a failed request
        _say(f"otel-gpu ship: export raised {type(exc).__name__}: {exc}", file=sys.stderr)
        ok = False
    if ok:
        result.sent += count
        return 0
    result.failed += count
    consecutive += 1
    if limit and consecutive >= limit:
        result.aborted = True
    return consecutive


# --------------------------------------------------------------------------- configuration


_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_PROTOCOLS = ("grpc", "http/protobuf")
_COMPRESSIONS = {"grpc": ("gzip", "none"), "http/protobuf": ("gzip", "deflate", "none")}
_COMPRESSION_VARS = ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION")


def _protocol(env: Mapping[str, str]) -> tuple[str, str]:
    """(variable, protocol) as the exporters choose it: the first variable set, else grpc."""
    for name in _PROTOCOL_VARS:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return "", "grpc"


def check_environment(env: Mapping[str, str]) -> None:
    """ConfigError naming the standard OTLP variable ``ship`` cannot send with."""
    from otel_gpu.config import ConfigError, check_standard

    name, protocol = _protocol(env)
    if protocol not in _PROTOCOLS:
        raise ConfigError(
            f"{name}={protocol!r} is not supported by otel-gpu ship. "
            f"Allowed: {', '.join(_PROTOCOLS)}."
        )
    check_standard("otlp", env)  # the timeouts
    for var in _COMPRESSION_VARS:
        value = env.get(var, "").strip()
        if value:
            allowed = _COMPRESSIONS[protocol]
            if value.lower() not in allowed:
                raise ConfigError(
                    "the OTEL_EXPORTER_OTLP_* variables do not make an exporter: "
                    f"{var}={value!r} is not a compression for {protocol}. "
                    f"Allowed: {', '.join(allowed)}."
                )
            break


def _otlp_exporter() -> Any:
    """otel-gpu's OTLP transport; ConfigError when the standard variables cannot build one."""
    from otel_gpu.config import ConfigError, otel_standard_variables
    from otel_gpu.exporters.otlp_transport import OtlpSpanExporter

    env = otel_standard_variables()
    check_environment(env)
    try:
        return OtlpSpanExporter(_protocol(env)[1])
    except Exception as exc:  # e.g. an unreadable certificate file
        raise ConfigError(
            f"the OTEL_EXPORTER_OTLP_* variables do not make an exporter: "
            f"{type(exc).__name__}: {exc}"
        ) from None


def describe_target(env: Mapping[str, str]) -> str:
    """``PROTOCOL ENDPOINT`` as the standard OTLP variables resolve them (for messages)."""
    from otel_gpu.exporters.otlp_transport import endpoint_url

    protocol = _protocol(env)[1]
    if protocol not in _PROTOCOLS:
        return protocol  # check_environment names it
    return f"{protocol} {endpoint_url(env, protocol)}"
