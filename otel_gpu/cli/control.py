"""``otel-gpu control PID`` / ``--all``: turn a live process's recording up or down for a while.

Exit codes: 0 every process applied the change (or answered ``--show``); 1 a process refused
it, did not answer, or is not an otel-gpu process listening for control (``--all``: none
found); 2 usage errors (a bad flag or value, checked here before anything is sent).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from otel_gpu import cli
from otel_gpu.cli import add_command, live
from otel_gpu.cli.flags import add_json, checked, digits
from otel_gpu.config import LEVELS

__all__ = ["EXIT_APPLIED", "EXIT_REFUSED", "EXIT_USAGE", "register"]

EXIT_APPLIED = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2


def _json_list(text: str) -> Any:
    from otel_gpu import trigger_rules

    try:
        value = trigger_rules.load_json(text)  # nested too deep: this error, not a RecursionError
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc}: write a JSON list of trigger objects, such as "
            '\'[{"on": "nonfinite", "level": 10}]\''
        ) from None
    return value


def _document(args: argparse.Namespace) -> dict[str, Any] | None:
    """The control document the flags describe; None for --show and --list."""
    if args.show or args.list:
        return None
    if args.reset:
        return {"reset": True}
    doc: dict[str, Any] = {}
    if args.level is not None:
        doc["level"] = args.level
    if args.include:
        doc["include"] = args.include
    if args.exclude:
        doc["exclude"] = args.exclude
    if args.requests:
        doc["requests"] = args.requests
    if args.request_attributes:
        attributes: dict[str, list[str]] = {}
        for key, glob in args.request_attributes:
            attributes.setdefault(key, []).append(glob)
        doc["request_attributes"] = attributes
    if args.sample is not None:
        doc["sample"] = args.sample
    if args.ring_size is not None:
        doc["ring_size"] = args.ring_size
    if args.triggers is not None:
        doc["triggers"] = args.triggers
    if args.dump_max_calls is not None:
        doc["dump_max_calls"] = args.dump_max_calls
    if args.dump_max_bytes is not None:
        doc["dump_max_bytes"] = args.dump_max_bytes
    if args.until_changed:
        doc["for"] = None
    elif args.window is not None:
        doc["for"] = args.window
    return doc


def _main(args: argparse.Namespace) -> int:
    from otel_gpu import config
    from otel_gpu._text import printable
    from otel_gpu.control import ask, document
    from otel_gpu.journal.directory import journal_dir

    def say(line: str) -> None:
        cli.say(f"otel-gpu control: {line}")

    changes = [
        args.level is not None,
        bool(args.include or args.exclude or args.requests or args.request_attributes),
        args.sample is not None,
        args.ring_size is not None,
        args.triggers is not None,
        args.dump_max_calls is not None,
        args.dump_max_bytes is not None,
    ]
    if (args.show or args.reset) and (any(changes) or args.window or args.until_changed):
        say(
            "--show and --reset take no other change (--level, --include, --exclude, --requests, "
            "--request-attribute, --sample, --ring-size, --dump-max-calls, --dump-max-bytes, --triggers, --for)"
        )
        return EXIT_USAGE
    if args.list and (any(changes) or args.window or args.until_changed):
        say("--list takes no change: it prints every controllable name")
        return EXIT_USAGE
    if sum((args.show, args.reset, args.list)) > 1:
        say("one of --show, --reset and --list")
        return EXIT_USAGE
    if args.dry_run and (args.show or args.reset or args.list or not any(changes)):
        say("--dry-run previews a change: give --level, --include, --exclude or --sample with it")
        return EXIT_USAGE
    if args.window is not None and args.until_changed:
        say("--for or --until-changed, not both")
        return EXIT_USAGE
    doc = _document(args)
    if doc is not None:
        try:
            document.parse(doc)  # the same check the process makes: a usage error here
        except document.ControlError as exc:
            say(str(exc).replace("for must", "--for must", 1))
            return EXIT_USAGE
    settings = config.current()
    directory = journal_dir(settings)
    nobody = (
        f"no live otel-gpu process of this user listens for control in {directory} "
        "(it needs OTEL_GPU_CONTROL=on and one decorated or instrumented function)"
    )
    request: dict[str, Any] = {"from": os.getpid()}
    if args.list:
        request["list"] = True
    elif doc is None:
        request["show"] = True
    else:
        request["document"] = doc
        if args.dry_run:
            request["dry_run"] = True
    try:
        pids = live.targets(args, directory, ask.listening, nobody, EXIT_REFUSED)
        if not args.all and not ask.is_listening(directory, args.pid):
            raise live.Refused(
                f"pid {args.pid} is not an otel-gpu process listening for control in {directory}: "
                "it needs OTEL_GPU_CONTROL=on and one decorated or instrumented function, and the same "
                "OTEL_GPU_JOURNAL_DIR",
                EXIT_REFUSED,
            )
        replies = live.ask(
            directory,
            lambda: ask.ask(
                directory, pids, request, args.timeout, chosen=bool(settings.journal_dir)
            ),
            EXIT_REFUSED,
        )
    except live.Refused as refused:
        say(str(refused))
        return refused.code
    code = EXIT_APPLIED
    for pid, reply in replies:
        if reply is None:
            code = EXIT_REFUSED
            say(
                f"pid {pid} did not answer within {args.timeout:g} s (the process is stopped, "
                "or exited)"
            )
            continue
        if reply.get("dry_run") is True:
            _print_preview(pid, reply.get("preview"), args.json)
            continue
        if not reply.get("applied"):
            code = EXIT_REFUSED
            say(f"pid {pid} refused: {reply.get('refused')}")
            continue
        if args.list:
            _print_list(pid, reply.get("functions"), args.json)
            continue
        effective = reply.get("effective")
        if args.json:
            print(json.dumps({"pid": pid, "effective": effective}, sort_keys=True))
        else:
            verb = "in force" if doc is None else "applied"
            print(printable(f"pid {pid}: {verb}: {_summary(effective)}"))
            for line in _stack(effective):
                print(printable(f"  {line}"))
    return code


def _print_list(pid: int, functions: Any, as_json: bool) -> None:
    from otel_gpu._text import printable

    rows = [f for f in functions if isinstance(f, dict)] if isinstance(functions, list) else []
    if as_json:
        print(json.dumps({"pid": pid, "functions": rows}, sort_keys=True))
        return
    print(printable(f"pid {pid}: {len(rows)} controllable function(s) (name, level now)"))
    for row in rows:
        name, qualified = str(row.get("name")), str(row.get("qualified"))
        also = "" if qualified == name else f"  ({qualified})"
        print(printable(f"  {name}  level {row.get('level')}{also}"))


def _print_preview(pid: int, preview: Any, as_json: bool) -> None:
    from otel_gpu._text import printable

    if not isinstance(preview, dict):
        preview = {}
    if as_json:
        print(json.dumps({"pid": pid, "preview": preview}, sort_keys=True))
        return
    rows = [r for r in preview.get("selected") or () if isinstance(r, dict)]
    print(
        printable(
            f"pid {pid}: dry run, nothing applied: would select {len(rows)} of "
            f"{preview.get('functions')} function(s), {preview.get('changed')} of them to "
            "another level"
        )
    )
    for row in rows:
        print(printable(f"  {row.get('name')}  level {row.get('level')} -> {row.get('would_be')}"))


def _summary(effective: Any) -> str:
    if not isinstance(effective, dict):
        return "(no configuration in the reply)"
    if not effective.get("changed"):
        return (
            f"configured state (level {effective.get('configured_level')}), "
            f"{effective.get('functions')} controllable function(s)"
        )
    level = effective.get("level")
    parts = [f"level {level if level is not None else 'as configured'}"]
    if effective.get("include"):
        parts.append("include " + ",".join(map(str, effective["include"])))
    if effective.get("exclude"):
        parts.append("exclude " + ",".join(map(str, effective["exclude"])))
    scope = [str(g) for g in effective.get("requests") or ()]
    attributes = effective.get("request_attributes") or {}
    if isinstance(attributes, dict):
        scope += [f"{k}={g}" for k, globs in attributes.items() for g in globs]
    if scope:
        parts.append("only in steps serving " + ",".join(scope))
    if effective.get("sample") is not None:
        parts.append(f"sample {effective['sample']:g}")
    if effective.get("ring_size") is not None:
        parts.append(f"ring {effective['ring_size']}")
    until = effective.get("until")
    if isinstance(until, (int, float)):
        left = max(0.0, until - time.time())
        parts.append(
            f"for {left:.0f} s more (until {time.strftime('%H:%M:%S', time.localtime(until))})"
        )
    else:
        parts.append("until changed")
    parts.append(
        f"{effective.get('functions_changed')} of {effective.get('functions')} function(s) changed"
    )
    return ", ".join(parts)


def _stack(effective: Any) -> list[str]:
    """The baseline and each window in force, oldest first, with the time each has left."""
    if not isinstance(effective, dict):
        return []
    lines = []
    baseline = effective.get("baseline")
    if isinstance(baseline, dict):
        lines.append(f"baseline: {_layer(baseline)}, until changed")
    overlays = effective.get("overlays")
    overlays = [o for o in overlays if isinstance(o, dict)] if isinstance(overlays, list) else []
    for n, overlay in enumerate(overlays, 1):
        until = overlay.get("until")
        left = ""
        if isinstance(until, (int, float)):
            clock = time.strftime("%H:%M:%S", time.localtime(until))
            left = f", {max(0.0, until - time.time()):.0f} s left (until {clock})"
        lines.append(f"window {n} of {len(overlays)}: {_layer(overlay)}{left}")
    return lines


def _layer(layer: dict[str, Any]) -> str:
    """One layer of the stack: what it sets, and who set it."""
    parts = []
    if layer.get("level") is not None:
        parts.append(f"level {layer['level']}")
    for name in ("include", "exclude"):
        if layer.get(name):
            parts.append(f"{name} " + ",".join(map(str, layer[name])))
    if layer.get("sample") is not None:
        parts.append(f"sample {layer['sample']}")
    for name, label in (
        ("ring_size", "ring"),
        ("dump_max_calls", "dump_max_calls"),
        ("dump_max_bytes", "dump_max_bytes"),
    ):
        if layer.get(name) is not None:
            parts.append(f"{label} {layer[name]}")
    if layer.get("triggers") is not None:
        parts.append(f"{len(layer['triggers'])} trigger(s)")
    text = ", ".join(parts) or "no change"
    return f"{text} (from {layer.get('source')})"


_level = checked(
    digits,
    lambda level: level in LEVELS,
    f"must be one of {', '.join(map(str, LEVELS))}, not {{raw!r}}",
)


def _attribute_glob(text: str) -> tuple[str, str]:
    """``KEY=GLOB`` (``--request-attribute``): the attribute's key and the glob on its value."""
    key, sep, glob = text.partition("=")
    if not sep or not key or not glob:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY=GLOB: a request attribute's key and a glob on its value, "
            "e.g. tenant=acme or tenant=beta-*"
        )
    return key, glob


_ratio = checked(float, lambda share: 0 <= share <= 1, "must be a ratio from 0 to 1, not {raw!r}")
_count = checked(digits, lambda _: True, "must be a whole number of calls >= 0, not {raw!r}")


def _window(raw: str) -> str | float:
    from otel_gpu.control import document

    try:
        document.parse_window(raw, "--for")
    except document.ControlError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--for must be ")) from None
    return raw


def register(sub: Any) -> None:
    p = add_command(
        sub,
        "control",
        "Change what a running otel-gpu process of this user records, without a "
        "restart: its level, globally or for the functions whose module.qualname or span name "
        "matches --include and not --exclude, head sampling for the spans it turns on, the "
        "ring's size; for --for (default 60 s), then the process goes back to its configured "
        "state. The process needs OTEL_GPU_CONTROL=on (docs/control.md). Every change is a span "
        "'otel_gpu.control' in the process's trace. The request is a file in the crash "
        "journal's directory (OTEL_GPU_JOURNAL_DIR), as for otel-gpu snapshot. "
        "Exit codes: 0 applied (or shown) everywhere; 1 refused (the reason is printed), not "
        "answered, or not an otel-gpu process listening for control; 2 usage errors.",
    )
    live.add_targets(
        p, "every live otel-gpu process of this user on this host that listens for control"
    )
    p.add_argument("--level", type=_level, help="the level to record at: 0, 1, 3, 5 or 10")
    p.add_argument(
        "--include",
        action="append",
        metavar="GLOB",
        help="only functions whose module.qualname or span name matches (repeatable)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        metavar="GLOB",
        help="not the functions whose module.qualname or span name matches (repeatable)",
    )
    p.add_argument(
        "--requests",
        action="append",
        metavar="GLOB",
        help="only during the serving steps (otel_gpu.batch) that serve a request whose id or "
        "trace id matches (repeatable; needs --level); see docs/serving.md",
    )
    p.add_argument(
        "--request-attribute",
        dest="request_attributes",
        action="append",
        type=_attribute_glob,
        metavar="KEY=GLOB",
        help="only during the serving steps that serve a request whose attribute KEY matches "
        "GLOB, e.g. tenant=acme (repeatable, any one matching; with --requests too; needs "
        "--level); see docs/serving.md",
    )
    p.add_argument(
        "--sample", type=_ratio, metavar="RATIO", help="record this share of the calls (0 to 1)"
    )
    p.add_argument(
        "--ring-size", type=_count, metavar="N", help="the anomaly ring's size, in calls"
    )
    p.add_argument(
        "--dump-max-calls",
        type=_count,
        metavar="N",
        help="the flight recorder's limit on dumped calls while the change lasts",
    )
    p.add_argument(
        "--dump-max-bytes",
        type=_count,
        metavar="N",
        help="the flight recorder's limit on bytes of tensors written while the change lasts",
    )
    p.add_argument(
        "--triggers",
        type=_json_list,
        metavar="JSON",
        help="the triggers in force while the change lasts, a JSON list such as "
        '\'[{"on": "nonfinite", "level": 10, "calls": 20}]\' ([] for none; docs/control.md)',
    )
    p.add_argument(
        "--for",
        dest="window",
        type=_window,
        metavar="DURATION",
        help="how long the change lasts: 120s, 2m, or a bare number of seconds (default 60 s)",
    )
    p.add_argument(
        "--until-changed", action="store_true", help="the change lasts until changed or reset"
    )
    p.add_argument("--reset", action="store_true", help="back to the configured state now")
    p.add_argument("--show", action="store_true", help="print the configuration in force")
    p.add_argument(
        "--list",
        action="store_true",
        help="print every controllable name: span names (a module's path in an "
        "instrument_module() tree) and module.qualname, with each one's level now",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what the change would select and to which level, applying nothing",
    )
    add_json(p, "print each answer as one JSON line")
    live.add_timeout(p)
    p.set_defaults(func=_main)
