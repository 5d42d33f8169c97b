"""``otel-gpu info``: the settings in force, the standard OpenTelemetry variables set, and the
resource spans will carry."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["register"]

_HIDDEN = "<redacted>"  # OTLP headers carry credentials (an Authorization header, an API key)


def _shown(field: str, value: Any) -> Any:
    """A setting's value as shown: OTEL_GPU_OPAMP_HEADERS' carry credentials, like OTLP's."""
    return _HIDDEN if field == "opamp_headers" and value else value


def _standard(settings: Any) -> tuple[dict[str, str], list[str]]:
    """The standard variables set (not otel-gpu's own rows, such as OTEL_SERVICE_NAME), headers
    hidden, and a note for each one otel-gpu would refuse but does not use with these settings.

    The OTLP ones otel-gpu uses were checked already: an invalid one stops the command before
    this runs, with the ConfigError a program gets. The provider's (sampler, span limits) are
    checked here: a program would run with otel-gpu off, so the command fails with that error.
    """
    from otel_gpu import config

    own = {row.env for row in config.SETTINGS}
    variables = config.otel_standard_variables()
    shown = {
        name: _HIDDEN if name.endswith("_HEADERS") else value
        for name, value in sorted(variables.items())
        if name not in own
    }
    notes = []
    try:
        config.check_standard("provider", variables)
    except config.ConfigError as exc:
        if settings.level > 0:
            raise config.ConfigError(
                f"{exc} A program records nothing with it (otel-gpu stays off, with one warning)."
            ) from None
        notes.append(f"unused at level 0; with a level above 0: {exc}")
    if not any(item.lower() == "otlp" for item in settings.dest):
        for row in config.STANDARD:
            if row.applies == "otlp" and row.env in shown:
                try:
                    config.check_standard("otlp", {row.env: variables[row.env]})
                except config.ConfigError as exc:
                    notes.append(f"unused while OTEL_GPU_LOGDEST has no otlp; with it: {exc}")
    return shown, notes


_HOW = (
    "a program applies them at start-up under `otel-gpu run` or `opentelemetry-instrument`; "
    "started otherwise, at its first @otel_gpu.api decoration, configure() or instrument() "
    "(names it bound earlier with `from ... import` keep the originals)"
)


def _instrument(settings: Any) -> dict[str, Any]:
    """``OTEL_GPU_INSTRUMENT``: refused targets, and whether and how the targets are applied
    in this process and in a program (never a value that silently does nothing)."""
    from otel_gpu.instrumentation import refused, targets

    if not settings.instrument:
        return {}
    how = targets.applied_how()
    if settings.level == 0:
        applied = "no: OTEL_GPU_LOGLEVEL is 0, so nothing is instrumented"
    elif how is None:
        applied = "no (this command instruments nothing); " + _HOW
    else:
        applied = f"yes, by {how}"
    return {
        "targets": list(settings.instrument),
        "refused": {s: why for s in settings.instrument if (why := refused.refusal(s))},
        "applied_in_this_process": applied,
    }


def _opamp(settings: Any) -> str | None:
    """One line saying why a program with these settings would not be an OpAMP agent whose
    remote configuration changes levels, or None (no endpoint, or nothing in the way)."""
    import importlib.util

    if not settings.opamp_endpoint:
        return None
    if importlib.util.find_spec("opentelemetry._opamp") is None:
        return (
            "opentelemetry-opamp-client is not installed (pip install 'otel-gpu[opamp]'): "
            "a program is no OpAMP agent"
        )
    if settings.control != "on":
        return "without OTEL_GPU_CONTROL=on a remote configuration changes no function's level"
    return None


def _device_time(settings: Any) -> str | None:
    """One line saying why calls carry no device time in a program with these settings, or
    None when they may (with ``auto``, once the program initialises CUDA)."""
    from otel_gpu.devices import events

    if settings.device_time == "off":
        return "off: no call carries device time"
    if settings.level == 0:
        return "no device time: OTEL_GPU_LOGLEVEL is 0"
    why = events.why_not()
    return f"no call carries device time: {why}" if why else None


def _main(args: argparse.Namespace) -> int:
    from otel_gpu import config
    from otel_gpu._text import printable
    from otel_gpu.cli import version_line
    from otel_gpu.resource import build_resource

    settings = config.current()
    standard, notes = _standard(settings)
    resource = build_resource()
    if args.json:
        print(
            json.dumps(
                {
                    "version": version_line(),
                    "settings": {k: _shown(k, v) for k, v in vars(settings).items()},
                    "standard": standard,
                    "resource": dict(resource.attributes),
                    "instrument": _instrument(settings),
                    "device_time": _device_time(settings),
                    "opamp": _opamp(settings),
                },
                indent=2,
                default=str,
            )
        )
        return 0
    print(version_line())
    print("settings:")
    for row in config.SETTINGS:
        value = _shown(row.field, getattr(settings, row.field))
        if isinstance(value, tuple):
            value = ",".join(value)
        print(f"  {row.env:28} = {value}")
    device = _device_time(settings)
    if device:  # why calls carry no device time (devices/device_time.py)
        print(f"  note: OTEL_GPU_DEVICE_TIME: {device}")
    opamp = _opamp(settings)
    if opamp:  # why a program would not be an agent, or not one that changes levels
        print(f"  note: OTEL_GPU_OPAMP_ENDPOINT: {opamp}")
    instrument = _instrument(settings)
    if instrument:
        print(
            f"  note: OTEL_GPU_INSTRUMENT applied in this process: {instrument['applied_in_this_process']}"
        )
        for why in instrument["refused"].values():
            print(f"  note: OTEL_GPU_INSTRUMENT {printable(why)}")
    print("standard:")
    for name, value in standard.items():  # another tool's value: escaped, it cannot forge lines
        print(f"  {printable(name):28} = {printable(value)}")
    if not standard:
        print("  (none set)")
    for note in notes:
        print(f"  note: {note}")
    print("resource:")
    for key, value in sorted(resource.attributes.items()):
        print(f"  {key} = {value}")
    return 0


def register(sub: Any) -> None:
    from otel_gpu.cli import add_command
    from otel_gpu.cli.flags import add_json

    p = add_command(sub, "info", "Show the settings in force and the resource spans will carry.")
    add_json(p)
    p.set_defaults(func=_main)
