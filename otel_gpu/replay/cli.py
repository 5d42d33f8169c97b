"""The ``otel-gpu replay`` command: flags, the module allow-list, progress, and the report."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from otel_gpu._text import printable
from otel_gpu.recorder import limits as _limits
from otel_gpu.recorder import manifest as _manifest
from otel_gpu.replay import (
    EXIT_USAGE,
    VERDICTS,
    Options,
    Result,
    exit_code,
    find_calls,
    import_path,
    replay,
    summarize,
    verified_nothing,
)
from otel_gpu.replay.trust import VALUE_TYPES, Allow, denied

__all__ = ["add_parser", "main"]

_DESCRIPTION = """\
Re-run calls recorded by the flight recorder (OTEL_GPU_LOGLEVEL=10) and compare them with
their recording. Verdicts: pass, mismatch, error, crashed-originally, unverified (the call
ran but some outputs were never recorded, so they were not compared), skipped.
Exit code: 0 when nothing failed and at least one call was verified; 1 when a call had a
mismatch, an error, had crashed originally or is unverified, or when nothing was verified
(every call skipped or unverified), the last two unless --allow-unverified; 2 for a usage
error (no dumps, bad flags, imports not allowed). A missing or corrupt dump file makes its
call an error, naming the file; the other calls are still replayed.

Dumps are untrusted input: replay imports only the modules you allow, and calls only
functions decorated with @otel_gpu.api in them."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="re-run calls recorded at level 10 and report pass/mismatch/error per call",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "dir_pos",
        nargs="?",
        default=None,
        metavar="DIR",
        help="the dump root (OTEL_GPU_DUMP_DIR) or one call's directory",
    )
    p.add_argument("--dir", default=None, help="the same as DIR")
    _repeatable(
        p,
        "--path",
        "DIR",
        "a folder of your own modules to import allowed modules from (repeatable; appended "
        "to the import path, as PYTHONPATH's entries are); replay never imports from the "
        "current directory or the dump",
    )
    _repeatable(
        p,
        "--allow-module",
        "PREFIX",
        "import modules named PREFIX or PREFIX.*, and rebuild their classes (repeatable, or "
        "comma-separated); denylisted modules (os, subprocess, builtins, importlib, pickle...) "
        "are refused",
    )
    _repeatable(
        p,
        "--instrument",
        "TARGET",
        "an otel_gpu.instrument() target replay may apply again, for calls recorded through "
        "it (repeatable or comma-separated; OTEL_GPU_INSTRUMENT's targets are allowed too)",
    )
    p.add_argument(
        "--trust-dump",
        action="store_true",
        help="allow every module the dump names for functions, receivers and argument types, and "
        "its instrumentation targets, without asking (only for dumps you made; never a "
        "denylisted module)",
    )
    _repeatable(
        p,
        "--device",
        "FROM=TO",
        "map recorded devices: cuda=cpu, cuda:1=cuda:0, or TO alone for all (repeatable)",
    )
    p.add_argument(
        "--rtol", type=float, default=None, help="relative tolerance (default: per dtype)"
    )
    p.add_argument(
        "--atol",
        type=float,
        default=None,
        help="absolute tolerance (default: per dtype, scaled down for outputs below 1)",
    )
    _repeatable(p, "--include", "PATTERN", "only span names matching (fnmatch)")
    _repeatable(p, "--exclude", "PATTERN", "skip span names matching (fnmatch)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failed call")
    p.add_argument(
        "--allow-unverified",
        action="store_true",
        help="do not fail the run for calls whose outputs could not be compared (unverified), "
        "nor for a run that verified nothing (every call skipped or unverified)",
    )
    p.add_argument("--isolate", action="store_true", help="run every call in its own process")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds an isolated call may take (default 300)",
    )
    p.add_argument("--json", action="store_true", help="print a machine-readable report on stdout")
    p.add_argument(
        "--dest", default=None, help="send replay spans here (default: OTEL_GPU_LOGDEST if set)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    # replay runs at level 1 without a journal whatever the environment says (see _provider)
    p.set_defaults(func=main, settings_from_flags=_forced_settings)


def _repeatable(parser: argparse.ArgumentParser, flag: str, metavar: str, help: str) -> None:
    """A flag given any number of times, collected in a list (read back with :func:`_split`
    where its items may also be comma-separated)."""
    parser.add_argument(flag, action="append", default=[], metavar=metavar, help=help)


def _split(values: list[str]) -> tuple[str, ...]:
    return tuple(v.strip() for item in values for v in item.split(",") if v.strip())


def _device_map(values: list[str]) -> dict[str, str]:
    """``FROM=TO`` pairs (or ``TO`` alone); ValueError naming the malformed item."""
    import torch

    mapping: dict[str, str] = {}
    for item in _split(values):
        src, sep, dst = item.partition("=")
        src, dst = (src.strip(), dst.strip()) if sep else ("*", src.strip())
        for device in (src, dst) if src != "*" else (dst,):
            try:
                torch.device(device)
            except (RuntimeError, ValueError) as exc:
                raise ValueError(
                    f"{item!r}: {exc} (expected FROM=TO such as cuda=cpu or cuda:1=cuda:0, "
                    "or TO alone)"
                ) from None
        mapping[src] = dst
    return mapping


def _manifests(dirs: list[str]) -> Iterator[dict[str, Any]]:
    for d in dirs:
        try:
            yield _manifest.read_manifest(d)
        except Exception:
            continue  # replay gives that call its verdict


_TYPED = ("enum", "namedtuple", "mapping", "from_dict")


def _type_modules(enc: Any, out: set[str]) -> None:
    """Modules of the types replay would resolve in one encoded value (bounded, no recursion)."""
    stack, seen = [(enc, 0)], 0
    while stack and seen < 100_000:
        value, depth = stack.pop()
        seen += 1
        if isinstance(value, list) and depth <= 64:
            stack.extend((v, depth + 1) for v in value)
            continue
        if not isinstance(value, dict):
            continue
        tag = value.get("t")
        ref = value.get("v") if tag == "type" else value.get("type") if tag in _TYPED else None
        if isinstance(ref, str) and ":" in ref and ref not in VALUE_TYPES:
            out.add(ref.partition(":")[0])
        if tag in ("list", "tuple", "dict", "mapping", "namedtuple") and depth <= 64:
            stack.append((value.get("items"), depth + 1))


def _recorded_modules(dirs: list[str]) -> list[str]:
    """Modules the dumps name for functions, receivers' classes and argument types.

    Denylisted ones are left out: no flag allows them, and their calls are refused one by one.
    """
    modules: set[str] = set()
    for manifest in _manifests(dirs):
        fn = manifest.get("function")
        module = fn.get("module") if isinstance(fn, dict) else None
        if isinstance(module, str) and module:
            modules.add(module)
        rec = manifest.get("receiver")
        if isinstance(rec, dict) and rec.get("t") in ("class", "module", "state"):
            _type_modules({"t": "type", "v": rec.get("type")}, modules)
            _type_modules(rec.get("state"), modules)
            _type_modules(list((rec.get("init") or {}).values()), modules)
        params = manifest.get("params")
        for p in params if isinstance(params, list) else []:
            _type_modules(p.get("value") if isinstance(p, dict) else None, modules)
    return sorted(m for m in modules if m and denied(m) is None)


def _recorded_targets(dirs: list[str]) -> list[str]:
    targets = set()
    for manifest in _manifests(dirs):
        fn = manifest.get("function")
        spec = fn.get("instrumented") if isinstance(fn, dict) else None
        if spec:
            targets.add(str(spec))
    return sorted(targets)


def _allow(args: argparse.Namespace, dirs: list[str]) -> Allow | None:
    """The modules replay may import; None when the user has not allowed any, or asked for a
    denylisted one (a usage error: no flag lifts the denylist)."""
    from otel_gpu import config

    prefixes = list(_split(args.allow_module))
    for prefix in prefixes:
        entry = denied(prefix)
        if entry is not None:
            print(
                f"otel-gpu replay: --allow-module {prefix}: {entry!r} is on replay's denylist "
                "(the standard library's process, shell, file, import and network machinery, "
                "and torch's loaders): no flag allows it; see 'Threat model' in "
                "docs/flight-recorder.md",
                file=sys.stderr,
            )
            return None
    instrument = list(_split(args.instrument))
    try:
        instrument += list(config.current().instrument)
    except config.ConfigError:
        pass  # reported when replay configures itself
    modules = _recorded_modules(dirs)
    if args.trust_dump:
        prefixes += modules
    if prefixes or args._child or not modules:  # no module named: nothing to allow
        return Allow(prefixes, instrument, any_instrument=args.trust_dump)
    if modules and sys.stdin.isatty() and sys.stderr.isatty():
        print("The dump asks replay to import and run code from these modules:", file=sys.stderr)
        for m in modules:
            print(f"  {printable(m)}", file=sys.stderr)
        targets = _recorded_targets(dirs)
        if targets:
            print("and to instrument these targets again:", file=sys.stderr)
            for t in targets:
                print(f"  {printable(t)}", file=sys.stderr)
        try:
            answer = input("Import them? Only say yes for dumps you trust. [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() in ("y", "yes"):
            return Allow(modules, instrument + targets)
    print(
        "otel-gpu replay: not importing any module. A dump names the modules replay imports and "
        "runs; allow them with --allow-module PREFIX (or --trust-dump for dumps you made). "
        f"Recorded modules: {printable(', '.join(modules))}",
        file=sys.stderr,
    )
    return None


def _forced_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings replay forces or takes from its flags, which beat the environment."""
    overrides: dict[str, Any] = {"level": 1, "journal": False}
    if args.dest:
        overrides["dest"] = args.dest
    return overrides


def _provider(args: argparse.Namespace) -> tuple[Any, bool]:
    """Configure this process for replay (level 1, no journal) and build the replay spans' provider."""
    from opentelemetry.sdk.trace import TracerProvider

    import otel_gpu
    from otel_gpu import config

    settings = config.load(_forced_settings(args))
    want = not args._child and settings.dest_explicit
    if want:
        from otel_gpu.exporters.destinations import build_provider

        provider = build_provider(settings)[0]
    else:
        provider = TracerProvider()  # no processors: nested decorated calls cost little
    # level 1: decorated functions keep the wrapper replay looks for; nothing is dumped again
    otel_gpu.configure(level=1, journal=False, tracer_provider=provider, dest=args.dest)
    return provider, want


class _Progress:
    """A progress bar on stderr (rich when installed), and the per-call lines on stdout."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.lines = not args.json
        self.bar: Any = None
        self.plain = False
        if args.no_progress or args._child or not sys.stderr.isatty():
            return
        try:
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("replay", total=None)
            self.bar.start()
        except ImportError:
            self.plain = True

    def __call__(self, done: int, total: int, result: Result | None) -> None:
        if result is not None and self.lines:
            line = _line(result)
            if self.bar is not None:
                self.bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                if self.plain:
                    sys.stderr.write("\r\033[K")
                print(line, flush=True)
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)
        elif self.plain:
            sys.stderr.write(f"\rreplay {done}/{total}")
            sys.stderr.flush()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.plain:
            sys.stderr.write("\r\033[K")


def _line(r: Result) -> str:
    """A verdict line; the names and details come from the dump, so escapes are made visible."""
    text = f"{r.verdict.upper():<18} {r.span_name}  [{os.path.basename(r.dir)}]"
    return printable(f"{text}  {r.detail}" if r.detail else text)


def _finite(obj: Any) -> Any:
    """Strict JSON: infinite differences become the strings "inf"/"nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


@contextlib.contextmanager
def _report_only_on_stdout(child: bool) -> Iterator[None]:
    """In an isolated child, what the replayed code prints (Python or native) goes to stderr.

    The parent reads the child's stdout as the JSON report: a library that prints must not
    turn its call into an unreadable report.
    """
    if not child:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _where(args: argparse.Namespace) -> str | None:
    """Settle ``args.dir`` from DIR or ``--dir``; a one-line problem, else None."""
    if args.dir_pos is not None and args.dir is not None and args.dir_pos != args.dir:
        return f"give the dump folder once: DIR {args.dir_pos} and --dir {args.dir} differ"
    args.dir = args.dir if args.dir is not None else args.dir_pos
    if args.dir is None:
        return (
            "name the dump folder to replay: otel-gpu replay DIR (the folder OTEL_GPU_DUMP_DIR "
            "names, or one call's folder below it)"
        )
    if os.path.isdir(args.dir):
        return None
    if os.path.exists(args.dir):
        kind = "a file" if os.path.isfile(args.dir) else "not a folder"
        hint = " (a trace file: read it with otel-gpu show)" if args.dir.endswith(".jsonl") else ""
        return (
            f"{args.dir} is {kind}{hint}; replay expects a dump folder: the folder "
            "OTEL_GPU_DUMP_DIR names, or one call's folder below it"
        )
    return f"{args.dir}: no such directory (replay expects the dump folder OTEL_GPU_DUMP_DIR names)"


def main(args: argparse.Namespace) -> int:
    """Run ``otel-gpu replay``; returns the exit code."""
    problem = _where(args)
    if problem:
        print(f"otel-gpu replay: {problem}", file=sys.stderr)
        return EXIT_USAGE
    dumps = (os.path.realpath(args.dir),)
    import_path.clean(dumps)  # before anything below can import a module lazily
    problem = import_path.add_paths(args.path, dumps)
    if problem:
        print(f"otel-gpu replay: {problem}", file=sys.stderr)
        return EXIT_USAGE
    dirs = find_calls(args.dir)
    not_dumped = _limits.read_notes(os.path.realpath(args.dir))
    for note in not_dumped:  # calls the recorder skipped for a limit: nothing here to replay
        print(
            printable(
                f"otel-gpu replay: {note['skipped']} call(s) of process {note['pid']} were not "
                f"dumped ({note['limit']} reached): they have no dump to replay"
            ),
            file=sys.stderr,
        )
    if not dirs:
        print(
            f"otel-gpu replay: no call directories (with a {_manifest.MANIFEST} or an inputs file) "
            f"at {args.dir} or the two levels below it",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        device_map = _device_map(args.device)
    except ValueError as exc:
        print(f"otel-gpu replay: bad --device {exc}", file=sys.stderr)
        return EXIT_USAGE
    allow = _allow(args, dirs)
    if allow is None:
        return EXIT_USAGE
    opts = Options(
        allow=allow,
        device_map=device_map,
        rtol=args.rtol,
        atol=args.atol,
        include=_split(args.include),
        exclude=_split(args.exclude),
        fail_fast=args.fail_fast,
        allow_unverified=args.allow_unverified,
        isolate=args.isolate and not args._child,
        timeout=args.timeout,
        in_process=args._child,
    )
    from otel_gpu.config import ConfigError

    try:
        provider, _ = _provider(args)
    except ConfigError as exc:
        print(f"otel-gpu replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    progress = _Progress(args)
    with _report_only_on_stdout(args._child):
        try:
            results = replay(args.dir, opts, provider, progress)
        finally:
            progress.stop()
            import otel_gpu

            otel_gpu.flush()
            provider.shutdown()
    code = exit_code(results, args.allow_unverified)
    summary = summarize(results)
    if args.json:
        report = {
            "schema_version": 1,
            "dir": os.path.abspath(args.dir),
            "results": [asdict(r) for r in results],
            "summary": summary,
            "verified_nothing": verified_nothing(results),
            "not_dumped": not_dumped,
            "exit_code": code,
        }
        json.dump(_finite(report), sys.stdout, indent=1, default=str)
        print()
    else:
        counts = ", ".join(f"{summary[v]} {v}" for v in VERDICTS)
        print(f"{summary['total']} call(s): {counts}")
        if verified_nothing(results):
            print(
                "nothing was verified: every call was skipped or unverified"
                + (
                    " (accepted: --allow-unverified)"
                    if args.allow_unverified
                    else "; exit 1 (pass --allow-unverified to accept that)"
                ),
                file=sys.stderr,
            )
    return code
