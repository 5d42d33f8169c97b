"""Observers: what runs on the caller's thread around each call, and the one registry of them.

An observer sees every call of the functions it serves: ``start(call)`` before the call runs,
``end(call)`` after it returned or raised (``call.bound`` and ``call.result`` are set only
then), ``flush(timeout)`` when the pipeline flushes and ``close()`` at exit or reconfiguration.

:data:`REGISTRY` lists every observer in the order they run, with the lowest level each serves
and its factory. It is the only place that decides which observers run at which level: the
pipeline builds them once (:func:`build`) and keeps one tuple per level, so a level-1 function
never runs the level-3 or level-10 observers and no call checks a level.

This module wires the plugins to the pipeline: the observers, the metrics
(:func:`build_metrics`) and recovery at start (:func:`start_recovery`) are built here, each
given the complete pipeline as its :class:`~otel_gpu.core.protocols.Host`. It names each
plugin by its import string, imported only when the settings ask for it, as sentry-python's
integrations table does: no module of the pipeline's layer imports a plugin, and a plugin
imports nothing of the pipeline (docs/architecture.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from otel_gpu import _guard
from otel_gpu.config import (
    LEVELS,
    ConfigError,
    Settings,
    metrics_destination,
    metrics_exporter_none,
)
from otel_gpu.core.protocols import ExportState, Host, Observer
from otel_gpu.exporters.destinations import PRECALL_LEVEL

if TYPE_CHECKING:
    from otel_gpu.core.protocols import MetricsSink

__all__ = [
    "REGISTRY",
    "Built",
    "Entry",
    "Observer",
    "build",
    "build_metrics",
    "by_level",
    "serves",
    "start_recovery",
]


def _load(target: str) -> Any:
    """``"package.module:name"`` imported and looked up: a plugin, when it is wanted."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class Wired(Host, ExportState, Protocol):
    """What the wiring uses of the pipeline: the plugins' host, the metrics' counts, and
    otel-gpu's own console destinations (which print a call's inputs before it runs)."""

    @property
    def consoles(self) -> tuple[Any, ...]: ...


Factory = Callable[[Settings, Wired], "Observer | None"]
"""Builds an observer when the settings ask for it (None otherwise). Called once per pipeline."""


class Entry(NamedTuple):
    name: str
    """Also the kind its internal errors are reported under."""
    min_level: int
    factory: Factory


def _when(wanted: Callable[[Settings], object], target: str) -> Factory:
    """The factory of a plugin's observer: ``target`` (an import string) imported and called
    with the settings and the pipeline when ``wanted(settings)`` holds, None otherwise."""

    def factory(settings: Settings, pipeline: Wired) -> Observer | None:
        if not wanted(settings):
            return None
        return _load(target)(settings, pipeline)

    return factory


def _console(settings: Settings, pipeline: Wired) -> Observer | None:
    if not pipeline.consoles:  # otel-gpu's own provider with a console or text destination
        return None
    return _load("otel_gpu.exporters.destinations:ConsolePrecall")(pipeline.consoles, settings)


def _snapshot(settings: Settings, pipeline: Wired) -> Observer | None:
    # not a per-call observer: it only adds an export-thread hook (otel-gpu snapshot)
    _load("otel_gpu.anomalies.snapshot:Responder")(settings, pipeline)
    return None


def _nvtx(settings: Settings, pipeline: Wired) -> Observer | None:
    if not settings.nvtx:
        return None
    return _load("otel_gpu.devices.nvtx:make_observer")()


_RING = "otel_gpu.recorder.ring:Ring"
_WATCHDOG = "otel_gpu.anomalies.watchdog:Watchdog"

_journal = _when(attrgetter("journal"), "otel_gpu.journal.writer:make_observer")
_watchdog = _when(attrgetter("stuck_after"), _WATCHDOG)
# a ring of size 0 still dumps the call itself when OTEL_GPU_ON_NONFINITE=dump
_ring = _when(lambda s: s.ring or s.on_nonfinite == "dump", _RING)
_workloads_dir = _when(attrgetter("workloads_dir"), "otel_gpu.workloads.folder:make_observer")
_recorder = _when(lambda s: True, "otel_gpu.recorder.recorder:make_observer")
_triggers = _when(attrgetter("controllable"), "otel_gpu.anomalies.triggers:make_observer")
_device_time = _when(lambda s: s.device_time != "off", "otel_gpu.devices.device_time:make_observer")


REGISTRY: tuple[Entry, ...] = (
    Entry("console", PRECALL_LEVEL, _console),  # level 1 prints only the end-of-call line
    Entry("journal", 1, _journal),
    Entry("watchdog", 1, _watchdog),
    Entry("snapshot", 1, _snapshot),  # answers otel-gpu snapshot; never on the caller's path
    Entry("ring", 3, _ring),  # the bound arguments exist from level 3
    Entry("workloads_dir", 3, _workloads_dir),  # a definition per new signature, before the call
    Entry("dump", 10, _recorder),  # the flight recorder
    # after the ring (which keeps the call a trigger may dump) and the recorder
    Entry("triggers", 1, _triggers),
    Entry("nvtx", 1, _nvtx),  # its range opens after the others' start work
    # last: its start event is recorded right before the call runs (its end event right after
    # it returns: calls/lifecycle.py records it before any statistics kernel)
    Entry("device_time", 1, _device_time),
)


def serves(name: str, level: int) -> bool:
    """Whether the observer ``name`` runs for functions decorated at ``level``."""
    return any(e.name == name and e.min_level <= level for e in REGISTRY)


class Built(NamedTuple):
    observers: tuple[Observer, ...]
    """In the registry's order."""
    ring: Any
    """The ring (``recorder/ring.py``'s ``Ring``) or None, also handed to the watchdog (which dumps it for stuck calls)."""


def build(settings: Settings, pipeline: Wired) -> Built:
    """The observers ``settings`` ask for, in the registry's order. One that fails to build is an
    internal error under its entry's name; the others are built all the same."""
    built: dict[str, Observer] = {}
    # Live control (or a trigger) may raise any function to any level: every level's observers
    # are built, and each call still meets only its own level's (observers_at).
    top = LEVELS[-1] if settings.controllable else settings.level
    for entry in REGISTRY:
        if top < entry.min_level:
            continue
        try:
            observer = entry.factory(settings, pipeline)
        except Exception as exc:
            _guard.internal_error(entry.name, exc)
            continue
        if observer is not None:
            observer.min_level = entry.min_level
            built[entry.name] = observer
    ring = None
    if "ring" in built:
        ring = built["ring"] if isinstance(built["ring"], _load(_RING)) else None
        if ring is not None and "watchdog" in built:
            watchdog = built["watchdog"]
            if isinstance(watchdog, _load(_WATCHDOG)):
                watchdog.ring = ring  # type: ignore[attr-defined]
    return Built(tuple(built.values()), ring)


def by_level(observers: tuple[Observer, ...]) -> dict[int, tuple[Observer, ...]]:
    """One tuple per level, decided once: the caller's thread only iterates its level's tuple."""
    return {lvl: tuple(o for o in observers if o.min_level <= lvl) for lvl in LEVELS}


def build_metrics(settings: Settings, pipeline: Wired) -> MetricsSink | None:
    """``OTEL_GPU_METRICS``: the metrics beside the spans, or None (a bad metrics setting is one
    warning, and the spans go on without them). ``auto`` (the default) builds them only where
    otel-gpu's own provider exports spans to OTLP or a ``.jsonl`` file: there the call metrics
    are aggregated by otel-gpu (about a microsecond a call) and something reads them; a console
    gets no table, and the application's provider no SDK instruments (10-13 µs a call), unless
    ``OTEL_GPU_METRICS=true`` asks."""
    if settings.metrics == "auto" and not (
        pipeline.owns_provider
        and any(metrics_destination(item) != "console" for item in settings.dest)
        and not metrics_exporter_none()  # the standard "no metrics", for a traces-only backend
    ):
        return None
    try:
        return _load("otel_gpu.metrics.provider:build")(settings, pipeline)  # type: ignore[no-any-return]
    except ConfigError as exc:  # e.g. the metrics' OTLP protocol: spans go on without them
        if _guard.is_strict():
            raise
        _guard.logger.warning("otel-gpu records no metrics in this process: %s", exc)
    except Exception as exc:
        pipeline.report_internal("metrics", exc)
    return None


def start_recovery(settings: Settings, pipeline: Wired) -> None:
    """``OTEL_GPU_RECOVER_ON_START``: recover dead processes' journals into the pipeline's
    processor, in the background, once the pipeline is complete."""
    try:
        _load("otel_gpu.journal.writer:start_recovery")(settings, pipeline)
    except Exception as exc:
        _guard.internal_error("journal", exc)
