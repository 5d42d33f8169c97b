"""``otel-gpu replay``: re-run recorded calls from flight-recorder dumps and give each a verdict.

Verdicts: ``pass`` (every output compared and matched), ``mismatch`` (which output, max
abs/rel difference), ``error`` (the exception), ``crashed-originally`` (the recorded call
never completed; says whether it completes now), ``unverified`` (the call ran, but some or
all of its outputs were never recorded, so they could not be compared) and ``skipped``
(with the reason). Exit code 0 only when nothing failed and at least one call was verified;
``unverified`` calls, and a run that verified nothing (every call skipped or unverified), fail
it unless ``--allow-unverified`` is given. A missing, corrupt or out-of-place dump file makes
its call ``error``, naming the file, and the run goes on.

Dumps are untrusted input: tensors are loaded with ``torch.load(weights_only=True)`` or
safetensors, manifests are plain JSON, and a module named by a dump is imported only
when the user allows it (``--allow-module``, ``--trust-dump`` or an interactive
confirmation). Only functions decorated with ``@otel_gpu.api`` are ever called.
See ``docs/flight-recorder.md``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from otel_gpu import _guard, attributes
from otel_gpu._text import printable
from otel_gpu.config import child_environment
from otel_gpu.recorder import manifest as _manifest
from otel_gpu.replay import import_path
from otel_gpu.replay.call import prepare_call
from otel_gpu.replay.trust import Allow, Refused, Skip

__all__ = [
    "VERDICTS",
    "Allow",
    "Options",
    "Result",
    "exit_code",
    "failed",
    "find_calls",
    "register",
    "replay",
    "replay_one",
    "summarize",
    "verified_nothing",
]

VERDICTS = ("pass", "mismatch", "error", "crashed-originally", "unverified", "skipped")
FAILED = ("mismatch", "error", "crashed-originally", "unverified")
"""Verdicts that fail the run (``unverified`` only without ``allow_unverified``)."""
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


@dataclass
class Options:
    """What to replay and how. Mirrors the command-line flags."""

    allow: Allow = field(default_factory=Allow)
    device_map: dict[str, str] = field(default_factory=dict)
    rtol: float | None = None
    atol: float | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    fail_fast: bool = False
    allow_unverified: bool = False
    isolate: bool = False
    timeout: float = 300.0
    in_process: bool = False  # never spawn (the child of an isolated run)

    dumps: tuple[str, ...] = ()
    """The folders being replayed (set by :func:`replay`): never on an import path."""

    def child_argv(self, directory: str) -> list[str]:
        """The isolated child's command: ``python -I``, this process's import path without the
        current directory or the dump (:mod:`otel_gpu.replay.import_path`)."""
        argv = ["replay", "--dir", directory, "--json", "--_child"]
        argv += [f"--allow-module={p}" for p in self.allow.prefixes]
        argv += [f"--instrument={t}" for t in self.allow.instrument]
        if self.allow.any_instrument:
            argv.append("--trust-dump")
        argv += [f"--device={k}={v}" for k, v in self.device_map.items()]
        if self.rtol is not None:
            argv.append(f"--rtol={self.rtol!r}")
        if self.atol is not None:
            argv.append(f"--atol={self.atol!r}")
        return import_path.child_command(argv, (*self.dumps, directory))


@dataclass
class Result:
    """The verdict on one recorded call."""

    dir: str
    span_name: str
    verdict: str
    detail: str = ""
    status: str = ""
    trace_id: str | None = None
    span_id: str | None = None
    duration_ms: float = 0.0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    exception: dict[str, str] | None = None
    completes_now: bool | None = None
    now: str | None = None
    """For crashed-originally: what the call does on replay: returns, raises, crashes or hangs."""
    notes: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    """For unverified: the outputs that were not compared, each with why."""


# --------------------------------------------------------------------------- finding dumps


def find_calls(path: str) -> list[str]:
    """Call directories at ``path``: the path itself if it is one, else those below it (2 levels), in call order.

    ``path`` itself may be a link (the user named it); a directory below it that is a symbolic
    link is listed but never entered (:func:`replay_one` judges it an ``error``): a crafted dump
    must not make replay read a call recorded somewhere else.
    """
    path = os.path.realpath(path)
    if os.path.isfile(os.path.join(path, _manifest.MANIFEST)):
        return [path]
    found: list[str] = []
    roots = [path]
    for d in _listdir(path):
        folder = os.path.join(path, d)
        if not os.path.islink(folder):
            roots.append(folder)
        elif not _LINKED_CALL.match(d):
            _guard.logger.warning(
                "otel-gpu replay: not entering %s: a symbolic link (replay reads only calls inside "
                "the dump; name the folder itself to replay its calls)",
                printable(folder),
            )
    for root in roots:
        for name in _listdir(root):
            full = os.path.join(root, name)
            if os.path.islink(full):
                if _LINKED_CALL.match(name):
                    found.append(full)  # reported, not followed
            elif os.path.isfile(os.path.join(full, _manifest.MANIFEST)) or _looks_like_call(
                name, full
            ):
                found.append(full)
    return sorted(found, key=lambda d: (os.path.basename(d), d))


# a call directory's name (recorder/manifest.py call_dir_name): <seq>-<UTC time>-<span id>-<name>
_LINKED_CALL = re.compile(r"^\d+-[0-9T.]+-[0-9a-f]{16}-.")


def _listdir(path: str) -> list[str]:
    try:
        return sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    except OSError:
        return []


def _looks_like_call(name: str, full: str) -> bool:
    """A call directory whose manifest was never written (the process died while saving inputs)."""
    parts = name.split("-", 3)
    return (
        len(parts) == 4
        and parts[0].isascii()
        and parts[0].isdigit()
        and len(parts[2]) == 16
        and any(f.startswith("inputs.") for f in os.listdir(full))
    )


# --------------------------------------------------------------------------- one call


def replay_one(directory: str, opts: Options, tracer: Any = None) -> Result:
    """Replay the call recorded in ``directory`` (in this process, or in a child for crashed calls)."""
    if os.path.islink(directory):
        return Result(
            directory,
            _name_from_dir(directory),
            "error",
            "refusing the call directory: it is a symlink (replay reads only calls inside the dump)",
        )
    try:
        manifest = _manifest.read_manifest(directory)
    except FileNotFoundError:
        return Result(
            directory,
            _name_from_dir(directory),
            "skipped",
            "incomplete dump: the process ended while saving inputs",
        )
    except (OSError, ValueError) as exc:
        return Result(directory, _name_from_dir(directory), "error", f"unreadable manifest: {exc}")
    fn = manifest.get("function") or {}
    result = Result(
        directory,
        str(fn.get("span_name", "?")),
        "skipped",
        status=str(manifest.get("status")),
        trace_id=manifest.get("trace_id"),
        span_id=manifest.get("span_id"),
    )
    started = time.perf_counter()
    with _replay_span(tracer, result) as span:
        try:
            _judge(directory, manifest, opts, result)
        except _manifest.DumpFileError as exc:
            result.verdict, result.detail = "error", str(exc)
        except Exception as exc:  # a manifest of an unexpected shape: this call only, no traceback
            result.verdict = "error"
            result.detail = f"replay could not judge this call: {_exc_text(exc).splitlines()[0]}"
        result.duration_ms = round((time.perf_counter() - started) * 1000, 3)
        if span is not None:
            _annotate(span, result)
    return result


def _name_from_dir(directory: str) -> str:
    """The span name as the directory name spells it, for a call whose manifest cannot be read."""
    parts = os.path.basename(directory).split("-", 3)
    return parts[3] if len(parts) == 4 and parts[3] else "?"


def _judge(directory: str, manifest: dict[str, Any], opts: Options, result: Result) -> None:
    status = result.status
    crashed = status == "inputs_saved"
    if crashed and os.path.exists(os.path.join(directory, _manifest.RETURNED)):
        # the marker is made before outputs are queued: the process ended, or writing them failed
        result.detail = (
            "the call returned, but its outputs were never written "
            "(the process ended or the recorder stopped writing first): nothing to compare"
        )
        return
    if (crashed or opts.isolate) and not opts.in_process:
        _run_isolated(directory, opts, result)
        return
    try:
        call = prepare_call(directory, manifest, opts.allow, opts.device_map)
    except Exception as exc:
        if isinstance(exc, (Skip, Refused)):
            result.verdict, result.detail = (
                ("skipped" if isinstance(exc, Skip) else "error"),
                str(exc),
            )
        elif isinstance(exc, _manifest.DumpFileError):  # names the file and what is wrong
            result.verdict, result.detail = "error", str(exc)
        else:
            result.verdict = "error"
            result.detail = f"cannot prepare the call: {type(exc).__name__}: {exc}"
        if crashed:  # a crash is never hidden behind "skipped"
            result.verdict = "crashed-originally"
            result.detail = (
                f"the recorded call never completed; it cannot be re-run: {result.detail}"
            )
        return
    result.notes.extend(call.notes)
    raised, value = call.run()
    if crashed:
        result.verdict = "crashed-originally"
        result.completes_now = raised is None
        result.now = "returns" if raised is None else "raises"
        if raised is not None:
            result.exception = {"type": _exc_type(raised), "message": str(raised)}
        result.detail = "the recorded call never completed; " + (
            "now it returns" if raised is None else f"now it raises {_exc_text(raised)}"
        )
        return
    if status == "raised":
        want = (manifest.get("exception") or {}).get("type", "?")
        if raised is None:
            result.verdict, result.detail = (
                "mismatch",
                f"returned, but the recorded call raised {want}",
            )
        elif _exc_type(raised) == want:
            result.verdict, result.detail = "pass", f"raised {want} as recorded"
        else:
            result.verdict, result.detail = (
                "mismatch",
                f"raised {_exc_type(raised)}: {raised}; the recorded call raised {want}",
            )
        return
    if raised is not None:
        result.verdict = "error"
        result.exception = {"type": _exc_type(raised), "message": str(raised)}
        result.detail = f"raised {_exc_text(raised)}; the recorded call returned"
        return
    if manifest.get("outputs_skipped"):
        result.verdict = "unverified"
        result.unchecked = [f"all outputs: not recorded ({manifest['outputs_skipped']})"]
        result.detail = (
            f"ran without error, but its outputs were not recorded "
            f"({manifest['outputs_skipped']}): nothing was compared"
        )
        return
    mismatches, unchecked = call.compare(value, (opts.rtol, opts.atol))
    result.mismatches = [asdict(m) for m in mismatches]
    result.unchecked = unchecked
    if mismatches:
        result.verdict = "mismatch"
        result.detail = mismatches[0].describe() + (
            f" (+{len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        )
    elif unchecked:
        result.verdict = "unverified"
        result.detail = (
            f"ran without error; {len(unchecked)} part(s) of the outputs were not recorded and "
            f"not compared: {'; '.join(unchecked[:3])}"
            + (f" (+{len(unchecked) - 3} more)" if len(unchecked) > 3 else "")
            + "; everything recorded matched"
        )
    else:
        result.verdict = "pass"
        if call.nonfinite_expected:
            result.detail = (
                f"reproduced: the outputs match the recording, including its "
                f"{call.nonfinite_expected} NaN/Inf value(s)"
            )


def _run_isolated(directory: str, opts: Options, result: Result) -> None:
    """Run one call in a child process, so a crash that repeats does not end the replay."""
    try:
        proc = subprocess.run(
            opts.child_argv(directory),
            capture_output=True,
            text=True,
            timeout=opts.timeout,
            env=child_environment(),
        )
    except subprocess.TimeoutExpired:
        proc = None
    child = None
    if proc is not None and proc.returncode in (0, 1):
        try:
            child = json.loads(proc.stdout)["results"][0]
        except (ValueError, KeyError, IndexError):
            child = None
    if child is not None:
        for key in (
            "verdict",
            "detail",
            "mismatches",
            "exception",
            "completes_now",
            "now",
            "notes",
            "unchecked",
        ):
            setattr(result, key, child.get(key, getattr(result, key)))
        return
    crashed = result.status == "inputs_saved"
    result.completes_now = False
    if proc is None:
        result.now = "hangs"
        how = f"does not complete within --timeout {opts.timeout:g} s (its process was killed)"
    elif proc.returncode < 0:
        result.now = "crashes"
        how = f"crashes{' again' if crashed else ''} (killed by {_signal_name(-proc.returncode)})"
    elif proc.returncode in (0, 1):  # the child ran, but its report could not be read
        result.now = None
        result.completes_now = None
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [""]
        result.verdict = "crashed-originally" if crashed else "error"
        result.detail = (
            ("the recorded call never completed; " if crashed else "")
            + f"replay could not judge it: its child process exited {proc.returncode} "
            + f"without a readable report {tail[0]}"
        ).strip()
        return
    else:
        result.now = "crashes"
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [""]
        how = (
            f"crashes{' again' if crashed else ''} (exit code {proc.returncode}) {tail[0]}".strip()
        )
    result.verdict = "crashed-originally" if crashed else "error"
    result.detail = ("the recorded call never completed; now it " if crashed else "the call ") + how


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _exc_type(exc: BaseException) -> str:
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def _exc_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- spans


@contextmanager
def _replay_span(tracer: Any, result: Result) -> Iterator[Any]:
    """A span per replayed call, linked to the original call's span, when spans are wanted."""
    if tracer is None:
        yield None
        return
    from opentelemetry.trace import Link, SpanContext, TraceFlags

    links = []
    if result.trace_id and result.span_id:
        try:
            original = SpanContext(
                int(result.trace_id, 16), int(result.span_id, 16), True, TraceFlags(1)
            )
            links.append(Link(original, {attributes.LINK_KIND: "replay_of"}))
        except ValueError:
            pass
    with tracer.start_as_current_span(f"replay {result.span_name}", links=links) as span:
        yield span


def _annotate(span: Any, result: Result) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute(attributes.REPLAY_VERDICT, result.verdict)
    span.set_attribute(attributes.REPLAY_DUMP_DIR, result.dir)
    if result.detail:
        span.set_attribute(attributes.REPLAY_DETAIL, result.detail[:2048])
    if result.mismatches:
        first = result.mismatches[0]
        span.set_attribute(attributes.REPLAY_OUTPUT, first["output"])
        for key, name in (
            ("max_abs", attributes.REPLAY_MAX_ABS_DIFF),
            ("max_rel", attributes.REPLAY_MAX_REL_DIFF),
        ):
            if first.get(key) is not None:
                span.set_attribute(name, first[key])
    if result.unchecked:
        span.set_attribute(attributes.REPLAY_UNCHECKED, [u[:256] for u in result.unchecked[:16]])
    if result.verdict in FAILED and result.verdict != "unverified":  # a gap, not a failed call
        span.set_status(Status(StatusCode.ERROR, f"{result.verdict}: {result.detail}"[:256]))


# --------------------------------------------------------------------------- many calls


def replay(
    path: str,
    opts: Options | None = None,
    tracer_provider: Any = None,
    on_result: Callable[[int, int, Result | None], None] | None = None,
) -> list[Result]:
    """Replay every selected call below ``path`` in recorded order.

    With ``tracer_provider``, one ``otel-gpu replay`` span holds a span per call, each linked
    to the recorded call's span. ``on_result(done, total, result)`` is called before the
    first call (``result=None``) and after each.
    """
    opts = opts or Options()
    opts = replace(opts, dumps=(*opts.dumps, os.path.realpath(path)))
    dirs = [d for d in find_calls(path) if _selected(d, opts)]
    results: list[Result] = []
    tracer = (
        tracer_provider.get_tracer(attributes.SCOPE_REPLAY) if tracer_provider is not None else None
    )
    root = tracer.start_as_current_span("otel-gpu replay") if tracer is not None else nullcontext()
    with root:
        if on_result is not None:
            on_result(0, len(dirs), None)
        for directory in dirs:
            result = replay_one(directory, opts, tracer)
            results.append(result)
            if on_result is not None:
                on_result(len(results), len(dirs), result)
            if opts.fail_fast and failed(result, opts.allow_unverified):
                break
    return results


def _selected(directory: str, opts: Options) -> bool:
    if not opts.include and not opts.exclude:
        return True
    try:
        name = _manifest.read_manifest(directory)["function"]["span_name"]
    except Exception:
        return not opts.include
    return (
        not opts.include or any(fnmatch.fnmatchcase(name, p) for p in opts.include)
    ) and not any(fnmatch.fnmatchcase(name, p) for p in opts.exclude)


def summarize(results: Sequence[Result]) -> dict[str, int]:
    counts = {v: 0 for v in VERDICTS}
    for r in results:
        counts[r.verdict] += 1
    return {"total": len(results), **counts}


def failed(result: Result, allow_unverified: bool = False) -> bool:
    """Whether this verdict fails the run."""
    if result.verdict == "unverified":
        return not allow_unverified
    return result.verdict in FAILED


def verified_nothing(results: Sequence[Result]) -> bool:
    """Whether no call was judged against its recording: every one skipped or unverified.

    Such a run checked nothing, so it must not read as a success (a dump of a script's
    ``__main__`` function replays as "0 pass, 1 skipped").
    """
    return not any(r.verdict not in ("skipped", "unverified") for r in results)


def exit_code(results: Sequence[Result], allow_unverified: bool = False) -> int:
    """0 only when something was verified and nothing failed: no mismatch, error,
    crashed-originally, or unverified call. ``allow_unverified`` accepts unverified calls and a
    run that verified nothing (every call skipped or unverified)."""
    if any(failed(r, allow_unverified) for r in results):
        return EXIT_FAILED
    return EXIT_FAILED if verified_nothing(results) and not allow_unverified else EXIT_OK


def register(sub: Any) -> None:
    """Add ``otel-gpu replay`` to the command line (arguments and report in :mod:`otel_gpu.replay.cli`)."""
    from otel_gpu.replay.cli import add_parser

    add_parser(sub)
