"""``otel-gpu recover``: the calls that were in flight when a process died, as ERROR spans.

It reads the crash journals (:mod:`otel_gpu.journal.writer`) of dead processes and
exports each in-flight call as a span with status ERROR ``process died during
call``, with the call's original trace id, span id, parent, start time, name and
input metadata, under the dead process's resource. The span ends at the last
sign of life of the process (the export thread's heartbeat, every 100 ms), or
at its start if there was none.

A journal is claimed by an atomic rename to ``<name>.recovering.<pid>-<random>``, so
several recoverers at once export nothing twice, and deleted only once its spans reached a
destination that keeps them: a file that took them, or an OTLP collector that acknowledged
them (the exporter's own count of confirmed spans). Spans that went only to the terminal
(``stdout``/``stderr``, the default destination), or that no keeping destination confirmed,
leave the journal in place for another run: the journal is never the copy that is lost.
Journals of live processes are left alone; a pid reused by a new process is told apart by the
process start time and the boot id.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_gpu._text import brief, printable
from otel_gpu.attributes import (
    INPUT_PREFIX,
    RECOVERED,
    RECOVERED_INPUTS_ERROR,
    RECOVERED_INPUTS_TRUNCATED,
    THREAD_ID,
)
from otel_gpu.calls import metadata
from otel_gpu.config import Settings, expand_path
from otel_gpu.journal import writer as _writer
from otel_gpu.journal.layout import boot_id, process_start_ticks
from otel_gpu.journal.reader import JournalFile, read
from otel_gpu.journal.writer import _unlink

__all__ = [
    "STATUS_MESSAGE",
    "TERMINAL",
    "Outcome",
    "judge",
    "pid_state",
    "recover",
    "spans_of",
]

STATUS_MESSAGE = "process died during call"
_CLAIM = ".recovering."
_KEYWORDS = ("stdout", "stderr", "otlp")
TERMINAL = ("stdout", "stderr")  # destinations that keep nothing once the terminal scrolls


@dataclass
class Outcome:
    """What happened to one journal file."""

    path: str
    state: str
    """recovered (every destination confirmed the spans), unconfirmed (handed to the exporters,
    not confirmed by all of them: the journal is removed if a keeping destination confirmed
    them, else kept, see ``kept``), shown (only the terminal got them: journal kept), failed
    (not exported, journal kept), empty (died with no call in flight), dead (dry run), alive,
    other-host, clean (closed normally), taken (another recoverer has it, or it is gone),
    invalid (not a journal we read), unreadable (``path`` is a directory that could not be
    listed)."""
    pid: int = 0
    spans: int = 0
    detail: str = ""
    """Why, for unconfirmed, failed, taken, invalid, unreadable, and clean when the file could
    not be removed; the host for other-host."""
    to: str = ""
    """Where the spans were handed: the destinations, or this process's span processor."""
    kept: bool = False
    """For unconfirmed and shown: the journal is still there, for another run."""
    fault: str = ""
    """The call whose kernel faulted, in words, when the process saw a CUDA fault
    (devices/cuda_fault.py wrote the verdict into the journal): the suspect, or the candidates."""


# --------------------------------------------------------------------------- liveness


def pid_state(pid: int) -> str:
    """alive or dead, for a pid on this host (zombies count as dead)."""
    info = process_start_ticks(pid)
    if info is not None:
        return "dead" if info[1] in ("Z", "X", "x") else "alive"
    if os.path.exists("/proc/self/stat"):
        return "dead"
    try:  # no /proc (macOS): existence only, pid reuse is not detected
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except PermissionError:
        return "alive"
    return "alive"


def judge(journal: JournalFile) -> str:
    """dead, alive or other-host: may this journal be recovered?"""
    if journal.host is not None and journal.host != socket.gethostname():
        return "other-host"  # its pid means nothing here; run recover on that host
    ours = boot_id()
    if any(journal.boot_id) and any(ours) and journal.boot_id != ours:
        return "dead"  # written before the last reboot
    info = process_start_ticks(journal.pid)
    if info is None:
        return pid_state(journal.pid)
    ticks, state = info
    if state in ("Z", "X", "x"):
        return "dead"
    if journal.start_ticks and ticks != journal.start_ticks:
        return "dead"  # the pid now belongs to another process
    return "alive"


# --------------------------------------------------------------------------- spans


def _input_attributes(entries: list[tuple[Any, ...]], limit: int, attrs: dict[str, Any]) -> None:
    raw: list[tuple[str, int, Any]] = []
    for entry in entries:
        key, kind = entry[0], entry[1]
        if kind == metadata.TENSOR:
            raw.append((key, kind, entry[2] if len(entry) == 3 else tuple(entry[2:8])))
        elif kind == metadata.VALUE:
            raw.append((key, kind, entry[2]))
        elif kind == metadata.CONTAINER:
            raw.append((key, kind, (entry[2], entry[3])))
        elif kind == metadata.OBJECT:  # the repr was never taken on the caller's thread
            attrs[f"{INPUT_PREFIX}{key}.type"] = metadata.truncate(str(entry[2]), limit)
        elif kind == metadata.DEFAULT:
            raw.append((key, kind, True))
        elif kind == metadata.REDACTED:
            raw.append((key, kind, None))
    metadata.to_attributes(INPUT_PREFIX, raw, limit, attrs)


def _resource(attrs: dict[str, Any]) -> Any:
    from opentelemetry.sdk.resources import Resource

    clean = {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}
    return Resource(clean)


def _fault_attributes(fault: dict[str, Any], span_id: str, attrs: dict[str, Any]) -> None:
    from otel_gpu.attributes import CUDA_FAULT, CUDA_FAULT_CANDIDATES, CUDA_FAULT_SUSPECT

    if fault.get("suspect"):
        if fault["suspect"] == span_id:
            attrs[CUDA_FAULT] = "kernel"
        else:
            attrs[CUDA_FAULT] = "surfaced"
            attrs[CUDA_FAULT_SUSPECT] = fault["suspect"]
    elif fault.get("candidates"):
        attrs[CUDA_FAULT] = "candidate" if span_id in fault["candidates"] else "surfaced"
        attrs[CUDA_FAULT_CANDIDATES] = list(fault["candidates"])


def spans_of(journal: JournalFile, limit: int = 256) -> list[Any]:
    """The in-flight records of ``journal`` as SDK ``ReadableSpan``s with status ERROR."""
    from opentelemetry.attributes import BoundedAttributes
    from opentelemetry.sdk.trace import ReadableSpan, SpanLimits
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    from otel_gpu.core.scope import SCOPE

    resource = _resource(journal.resource)
    limits = SpanLimits()
    sampled = TraceFlags(TraceFlags.SAMPLED)
    spans = []
    for record in journal.records:
        attrs: dict[str, Any] = dict(record.code)
        if record.inputs:
            try:
                _input_attributes(record.inputs, limit, attrs)
            except Exception as exc:
                attrs[RECOVERED_INPUTS_ERROR] = f"{type(exc).__name__}: {exc}"[:limit]
        if record.inputs_error:
            attrs[RECOVERED_INPUTS_ERROR] = record.inputs_error[:limit]
        if record.inputs_truncated:
            attrs[RECOVERED_INPUTS_TRUNCATED] = True
        attrs[THREAD_ID] = record.thread_id
        attrs[RECOVERED] = True
        if journal.fault:  # the process saw a CUDA fault: which call caused it
            _fault_attributes(journal.fault, format(record.span_id, "016x"), attrs)
        parent = None
        if record.parent_span_id:
            parent = SpanContext(
                record.trace_id, record.parent_span_id, record.parent_remote, sampled
            )
        spans.append(
            ReadableSpan(
                name=record.name,
                context=SpanContext(record.trace_id, record.span_id, False, sampled),
                parent=parent,
                resource=resource,
                attributes=BoundedAttributes(
                    limits.max_span_attributes,
                    attrs,
                    immutable=True,
                    max_value_len=limits.max_span_attribute_length,
                ),
                events=(),
                links=(),
                kind=SpanKind.INTERNAL,
                status=Status(StatusCode.ERROR, STATUS_MESSAGE),
                start_time=record.start_ns,
                end_time=max(record.start_ns, journal.heartbeat_ns),
                instrumentation_scope=SCOPE,
            )
        )
    return spans


# --------------------------------------------------------------------------- export


def _bounded(fn: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
    """Run ``fn`` on a daemon thread for at most ``timeout`` s: (finished, result)."""
    result: list[Any] = []

    def target() -> None:
        try:
            result.append(fn())
        except Exception as exc:
            result.append(exc)

    worker = threading.Thread(target=target, name="otel-gpu-recover-flush", daemon=True)
    worker.start()
    worker.join(max(timeout, 0.0))
    return (bool(result), result[0] if result else None)


def _dead_process_settings(settings: Settings, journal: JournalFile) -> Settings:
    """The destinations as the dead process saw them: ``%i`` is its pid, ``%r`` its rank."""
    from otel_gpu.config import with_changes

    rank = str(journal.resource.get("otel_gpu.rank", "0"))
    if not (rank.isascii() and rank.isdigit()) and any("%r" in d for d in settings.dest):
        # read from the journal: it must not steer a file name (``../``) outside its folder
        raise ValueError(
            f"its rank {brief(rank)} is not a whole number, and the destination names %r"
        )
    dest = tuple(
        d if d.lower() in _KEYWORDS else d.replace("%i", str(journal.pid)).replace("%r", rank)
        for d in settings.dest
    )
    return with_changes(settings, dest=dest)


def _end_torn_line(settings: Settings) -> None:
    # A process killed while writing a JSON line leaves it unterminated; our line must not join it.
    for dest in settings.dest:
        if dest.lower() in _KEYWORDS or not dest.endswith(".jsonl"):
            continue
        try:
            with open(expand_path(dest), "rb+") as f:
                if f.seek(0, os.SEEK_END) == 0:
                    continue
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
        except OSError:
            pass


def _raise_unopened(own: Any) -> None:
    """Raise the error of the first file destination of ``own`` that could not be opened."""
    for exporter in own.exporters:
        error = getattr(exporter.stream, "open_error", None)
        if error is not None:
            raise error


def _why(exc: BaseException, path: str = "") -> str:
    """An error as a user reads it: the OS reason and the file, unless the file is ``path``
    (the line names it already), else the exception's own text."""
    if isinstance(exc, OSError) and exc.strerror:
        other = exc.filename is not None and str(exc.filename) != path
        return f"{exc.strerror}: {exc.filename}" if other else exc.strerror
    return str(exc) or type(exc).__name__


def _flush(fn: Callable[[], Any], timeout: float) -> str:
    """Run a flush for at most ``timeout`` s: "" when it finished and said so, else why not."""
    done, result = _bounded(fn, timeout)
    if not done:
        return f"no answer within {timeout:g} s"
    if isinstance(result, Exception):
        return f"{type(result).__name__}: {result}"
    return "the flush reported a failure" if result is False else ""


def _to_processor(spans: list[Any], processor: Any, timeout: float) -> str:
    """In-process: where this process's own spans go. "" when the flush confirmed them."""
    for span in spans:
        processor.on_end(span)
    why = _flush(lambda: processor.force_flush(int(timeout * 1000)), timeout)
    return f"the span processor did not confirm them: {why}" if why else ""


def _to_destinations(spans: list[Any], own: Any, timeout: float) -> tuple[str, bool]:
    """("", True) when every destination's exporter confirmed every span, else which did not,
    and why; and whether a destination that keeps spans (a file, a collector) confirmed them all.

    The exporters' own counts decide: a flush that returns in time says nothing about delivery
    (the SDK's batch processor reports a refused export as a finished flush); an OTLP exporter
    counts a batch once the collector acknowledged it.
    """
    provider = own.provider

    def flush() -> Any:
        for hook in own.after_drain:
            hook()
        return provider.force_flush(int(timeout * 1000))

    try:
        for span in spans:
            provider._active_span_processor.on_end(span)
        why = _flush(flush, timeout)
    finally:
        _bounded(provider.shutdown, min(timeout, 2.0))
    short = [c.name for c in own.exporters if c.confirmed < len(spans)]
    kept = any(c.confirmed >= len(spans) for c in own.exporters if c.name.lower() not in TERMINAL)
    if not short:
        return "", kept
    return f"{', '.join(short)} did not confirm them" + (f": {why}" if why else ""), kept


# --------------------------------------------------------------------------- recovery


def _candidates(path: str) -> list[str]:
    """The journals at ``path`` (none when it does not exist); OSError when it cannot be listed."""
    if os.path.isfile(path):
        return [path]
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(
        os.path.join(path, name)
        for name in names
        if name.startswith(_writer.PREFIX)
        and (name.endswith(_writer.SUFFIX) or _writer.SUFFIX + _CLAIM in name)
    )


def fault_text(fault: dict[str, Any] | None) -> str:
    """A journal's CUDA fault verdict in words ("" without one): the call whose kernel faulted,
    or the calls that could not be told apart."""
    if not fault:
        return ""
    names = [printable(n) for n in fault.get("names") or []]
    if fault.get("suspect"):
        name = f" ({names[0]})" if names else ""
        return f"a CUDA kernel fault, caused by span {fault['suspect']}{name}"
    candidates = fault.get("candidates") or []
    if candidates:
        shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        return (
            f"a CUDA kernel fault, caused by one of {len(candidates)} calls that could not be "
            f"told apart{f' ({shown})' if shown else ''}"
        )
    return ""


def _recover_one(
    path: str,
    settings: Settings,
    processor: Any,
    timeout: float,
    dry_run: bool,
    processor_keeps: bool = True,
) -> Outcome:
    seen: list[Any] = []
    outcome = _recover_journal(path, settings, processor, timeout, dry_run, processor_keeps, seen)
    if seen and outcome.spans:
        outcome.fault = fault_text(seen[0])
    return outcome


def _recover_journal(
    path: str,
    settings: Settings,
    processor: Any,
    timeout: float,
    dry_run: bool,
    processor_keeps: bool,
    seen: list[Any],
) -> Outcome:
    """One journal file; ``seen`` gets the journal's CUDA fault verdict once it is read."""
    base, claim, claimer = path.partition(_CLAIM)
    if claim:  # a recoverer claimed it; recover it only if that recoverer died
        owner = claimer.partition("-")[0]
        if not (owner.isascii() and owner.isdigit()):  # "²" is a digit int() refuses
            return Outcome(path, "invalid", detail="unexpected file name for a claimed journal")
        if int(owner) == os.getpid() or pid_state(int(owner)) == "alive":
            return Outcome(path, "taken", detail=f"claimed by pid {owner}, which is running")
    try:
        journal = read(path)
    except FileNotFoundError:
        return Outcome(path, "taken", detail="gone before it could be read")
    except (OSError, ValueError) as exc:
        return Outcome(path, "invalid", detail=_why(exc, path))
    seen.append(journal.fault)
    if journal.closed:  # closed normally, but the file could not be deleted then
        if not dry_run:
            try:
                _unlink(path)
            except OSError as exc:
                return Outcome(
                    path, "clean", journal.pid, detail=f"cannot remove it: {_why(exc, path)}"
                )
        return Outcome(path, "clean", journal.pid)
    verdict = judge(journal)
    if verdict != "dead":
        host = (journal.host or "") if verdict == "other-host" else ""
        return Outcome(path, verdict, journal.pid, detail=host)
    if dry_run:
        return Outcome(path, "dead", journal.pid, len(journal.records))
    own = None
    to = "this process's span processor"
    terminal_only = False
    if journal.records and processor is None:
        try:
            target = _dead_process_settings(settings, journal)
        except ValueError as exc:
            return Outcome(path, "invalid", journal.pid, detail=str(exc))
        # Opened before the claim: a destination that cannot be opened keeps the journal.
        to = ", ".join(target.dest)
        terminal_only = all(d.lower() in TERMINAL for d in target.dest)
        try:
            from otel_gpu.exporters.destinations import build_provider

            _end_torn_line(target)
            own = build_provider(target)
            # A live process's file destination retries its open at each write; recover must
            # know now, or it would claim and delete a journal whose spans go nowhere.
            _raise_unopened(own)
        except Exception as exc:
            if own is not None:
                _bounded(own.provider.shutdown, min(timeout, 2.0))
            detail = f"cannot open the destinations: {_why(exc)}"
            return Outcome(path, "failed", journal.pid, len(journal.records), detail, to)
    if journal.records and processor is not None and not processor_keeps:
        detail = _to_processor(spans_of(journal, settings.repr_limit), processor, timeout)
        return Outcome(path, "shown", journal.pid, len(journal.records), detail, to, kept=True)
    if terminal_only and own is not None:
        # Nothing keeps them once the terminal scrolls: show them, and keep the journal (not
        # claimed: showing twice loses nothing).
        detail, _ = _to_destinations(spans_of(journal, settings.repr_limit), own, timeout)
        return Outcome(path, "shown", journal.pid, len(journal.records), detail, to, kept=True)
    # Unique per recoverer, threads included; the pid lets others tell a dead recoverer's claim.
    claimed = f"{base}{_CLAIM}{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.rename(path, claimed)  # atomic: exactly one recoverer wins
        journal = read(claimed)
    except (OSError, ValueError) as exc:
        if own is not None:
            _bounded(own.provider.shutdown, min(timeout, 2.0))
        if isinstance(exc, FileNotFoundError):
            return Outcome(path, "taken", journal.pid, detail="another recoverer claimed it first")
        if os.path.exists(claimed):
            return Outcome(claimed, "invalid", journal.pid, detail=_why(exc, claimed))
        detail = f"cannot claim it: {_why(exc, path)}"
        return Outcome(path, "failed", journal.pid, len(journal.records), detail, to)
    spans = spans_of(journal, settings.repr_limit)
    detail = ""
    kept_elsewhere = True
    try:
        if own is not None:
            detail, kept_elsewhere = _to_destinations(spans, own, timeout)
        elif spans:
            detail = _to_processor(spans, processor, timeout)
            kept_elsewhere = not detail
    finally:
        if kept_elsewhere:
            _unlink(claimed)
        else:  # no destination that keeps them confirmed them: the journal is the only copy
            _unclaim(claimed, path)
    if not spans:
        return Outcome(path, "empty", journal.pid)
    state = "unconfirmed" if detail else "recovered"
    return Outcome(path, state, journal.pid, len(spans), detail, to, kept=not kept_elsewhere)


def _unclaim(claimed: str, path: str) -> None:
    """Give a claimed journal its name back, for another run (it stays claimed if that fails:
    a claim whose recoverer is gone is recovered all the same)."""
    try:
        os.rename(claimed, path)
    except OSError:
        pass


def recover(
    settings: Settings | None = None,
    path: str | None = None,
    *,
    processor: Any = None,
    processor_keeps: bool = True,
    timeout: float | None = None,
    dry_run: bool = False,
) -> list[Outcome]:
    """Recover the journals in ``path`` (a directory or one file; default: the journal directory).

    One :class:`Outcome` per journal found; a directory that cannot be listed is one outcome
    with state ``unreadable``.

    With ``processor`` (an SDK span processor), spans go there; otherwise to otel-gpu's own
    provider for ``settings.dest``, with ``%i``/``%r`` naming the dead process's files.
    ``processor_keeps=False`` says the processor only shows spans (otel-gpu's own provider with
    terminal destinations alone): they are shown and the journal is kept, as without one.
    """
    from otel_gpu import config

    settings = config.current() if settings is None else settings
    timeout = settings.flush_timeout if timeout is None else timeout
    where = path if path is not None else _writer.journal_dir(settings)
    try:
        paths = _candidates(where)
    except OSError as exc:  # not "no journals": there may well be some
        return [Outcome(where, "unreadable", detail=_why(exc, where))]
    return [_recover_one(p, settings, processor, timeout, dry_run, processor_keeps) for p in paths]


# --------------------------------------------------------------------------- command line
