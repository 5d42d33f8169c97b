"""Configuration: the one table of settings, and the only module that reads the environment.

Every setting has one row in :data:`SETTINGS`: its environment variable, type,
default, allowed values and a docstring. Precedence is fixed: an argument to
:func:`otel_gpu.configure`, then the environment, then the default.

Nothing else in the package reads the environment: it receives a :class:`Settings` object,
or calls one of the functions of this module that return the few variables belonging to other
projects, parsed (``NO_COLOR``, ``RANK``, the resource's variables, the standard ``OTEL_*``
variables, a child process's environment). A test proves it by recording, in a subprocess,
which module reads each variable.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from otel_gpu import trigger_rules

__all__ = [
    "LEVELS",
    "SAMPLERS",
    "SAMPLER_ENTRY_POINTS",
    "SDK_IMPORT_VARIABLES",
    "SETTINGS",
    "STANDARD",
    "Bounded",
    "ConfigError",
    "Setting",
    "Settings",
    "StandardSetting",
    "check_otlp_environment",
    "check_sdk_import_variables",
    "check_standard",
    "child_environment",
    "current",
    "environ",
    "exemplar_filter",
    "expand_path",
    "in_environment",
    "load",
    "metrics_destination",
    "metrics_exporter_none",
    "no_color",
    "otel_standard_variables",
    "otlp_protocol",
    "rank",
    "reset_overrides",
    "resource_variables",
    "run_program_pid",
    "runtime_dir",
    "set_overrides",
]

LEVELS = (0, 1, 3, 5, 10)
"""The allowed values of ``OTEL_GPU_LOGLEVEL``."""


class ConfigError(ValueError):
    """A setting has a value that is not allowed. The message names the setting and what is allowed."""


def environ() -> Mapping[str, str]:
    """The process environment, for this module's own use.

    Other modules call the functions below, which return parsed values; the test of
    environment reads fails any other module that reads a variable, through this or directly.
    """
    return os.environ


# --------------------------------------------------------------------------- other projects' variables

RUN_PID = "OTEL_GPU_RUN_PID"
"""Set by ``otel-gpu run`` to its program's pid: only that program warns about targets never imported."""

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
"""CUDA's device mask, recorded as a resource attribute."""

RESOURCE_VARIABLES = (
    CUDA_VISIBLE_DEVICES,
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "K8S_POD_NAME",
    "K8S_POD_UID",
    "K8S_NAMESPACE_NAME",
    "K8S_NODE_NAME",
    "K8S_CONTAINER_NAME",
)
"""Other projects' variables the resource detector records (torchrun's, Kubernetes' downward API)."""


def no_color() -> bool:
    """True when ``NO_COLOR`` is set to a non-empty value (https://no-color.org)."""
    return bool(os.environ.get("NO_COLOR"))


def runtime_dir() -> str:
    """``XDG_RUNTIME_DIR``, or ``""`` when unset."""
    return os.environ.get("XDG_RUNTIME_DIR", "")


def rank() -> int | None:
    """The distributed rank, ``RANK``, when it is a non-negative integer; else None."""
    raw = os.environ.get("RANK")
    return int(raw) if raw and raw.isascii() and raw.isdigit() else None


def resource_variables() -> dict[str, str]:
    """The :data:`RESOURCE_VARIABLES` that are set, by name."""
    env = os.environ
    return {name: env[name] for name in RESOURCE_VARIABLES if name in env}


def otel_standard_variables() -> dict[str, str]:
    """Every standard OpenTelemetry variable that is set (``OTEL_*`` but not otel-gpu's ``OTEL_GPU_*``).

    The OTLP exporters and transport read the protocol, endpoint, headers and timeouts from it;
    :func:`check_standard` bounds the ones otel-gpu relies on.
    """
    return {
        k: v
        for k, v in os.environ.items()
        if k.startswith("OTEL_") and not k.startswith("OTEL_GPU_")
    }


def run_program_pid() -> str | None:
    """The pid ``otel-gpu run`` gave its program (:data:`RUN_PID`), or None outside ``otel-gpu run``."""
    return os.environ.get(RUN_PID)


def in_environment(field: str) -> bool:
    """Whether the variable of setting ``field`` (``"level"``: ``OTEL_GPU_LOGLEVEL``) is set."""
    return _BY_FIELD[field].env in os.environ


def child_environment() -> dict[str, str]:
    """A copy of the whole environment, for a child process to start with."""
    return dict(os.environ)


@contextlib.contextmanager
def another_library_setting(name: str, value: str) -> Iterator[None]:
    """Set another library's environment variable while it is imported, then restore it.

    The one place otel-gpu writes the environment: FlashInfer reads ``FLASHINFER_LOGLEVEL`` once,
    at import, and its own logger must not run beside ours (see ``otel_gpu.instrumentation.flashinfer``).
    """
    old = os.environ.get(name)
    if old is None or old.strip() in ("", value):
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ[name] = old


# --------------------------------------------------------------------------- parsers


_ASCII_INT = re.compile(r"[+-]?[0-9]+")
_ASCII_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_NON_FINITE = re.compile(r"[+-]?(nan|inf|infinity)", re.IGNORECASE)


def _ascii_int(text: str) -> int:
    """``int()`` of plain ASCII digits only: Python's ``int`` also takes ``1_0`` (10) and other
    scripts' digits (``٣``, 3), which no shell user means as a number."""
    if not _ASCII_INT.fullmatch(text):
        raise ValueError(f"not an integer{_ascii_hint(int, text)}")
    return int(text)


def _ascii_hint(python_parse: Callable[[str], object], text: str) -> str:
    """Why a text Python itself would parse is refused, for the error message."""
    try:
        python_parse(text)
    except ValueError:
        return ""
    return " (plain ASCII digits only: no '_' separators, no other scripts' digits)"


def _int_choice(choices: tuple[int, ...]) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = _ascii_int(raw.strip())
        if value not in choices:
            raise ValueError("not one of the allowed values")
        return value

    return parse


class Bounded:
    """Parser of a number with a documented range: NaN, inf, non-integers where an integer is
    needed and values outside ``[low, high]`` are rejected, never clamped.

    The bounds are what works, not what parses: a timeout must fit a thread wait and a socket
    timeout, a count must keep memory bounded. ``__name__`` keeps the name of the parser it
    replaces (``_positive_int``, ``_non_negative_int``, ``_non_negative_float``).
    """

    def __init__(self, low: float, high: float, *, integer: bool, unit: str = "") -> None:
        self.low = low
        self.high = high
        self.integer = integer
        self.unit = unit
        kind = "int" if integer else "float"
        self.__name__ = f"_positive_{kind}" if low > 0 else f"_non_negative_{kind}"

    @property
    def text(self) -> str:
        """The range as the docs and errors state it, e.g. ``integer > 0 and <= 1024``."""
        low = _number_text(self.low)
        if self.integer and self.low == 1:
            low_text = "integer > 0"  # reads better than ">= 1"; the same set
        else:
            low_text = f"{'integer' if self.integer else 'number'} >= {low}"
        unit = f" ({self.unit})" if self.unit else ""
        return f"{low_text} and <= {_number_text(self.high)}{unit}"

    def __call__(self, raw: str) -> int | float:
        text = str(raw).strip()
        if self.integer:
            value: int | float = _ascii_int(text)
        else:
            if _NON_FINITE.fullmatch(text):
                raise ValueError("not a finite number")
            if not _ASCII_FLOAT.fullmatch(text):
                raise ValueError(f"not a number{_ascii_hint(float, text)}")
            value = float(text)
            if value in (float("inf"), float("-inf")):  # 1e999
                raise ValueError("not a finite number")
        if not self.low <= value <= self.high:
            if self.integer and self.low == 1 and value < 1:
                raise ValueError("must be greater than 0")
            raise ValueError("out of range")
        return value


_OPAMP_INTERVAL = Bounded(1, 86_400, integer=False, unit="seconds, a day")
_HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _opamp_endpoint(raw: str) -> str:
    """An OpAMP server's URL: HTTP only (the client polls; it has no WebSocket transport)."""
    from urllib.parse import urlsplit

    text = str(raw)
    if _CONTROL.search(text) or text != text.strip() or " " in text:
        raise ValueError("it contains spaces or control characters")
    try:
        parts = urlsplit(text)
        _ = parts.port
    except ValueError as exc:
        raise ValueError(f"not a URL ({exc})") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"scheme {parts.scheme or '(none)'!r} is not http or https")
    if not parts.hostname:
        raise ValueError("it names no host")
    return text


def _opamp_headers(raw: str) -> tuple[tuple[str, str], ...]:
    """``name=value,...`` as the OTLP exporters read their headers (URL-encoded), strictly: a
    pair that is not one is refused, not skipped with a warning, and a CR or LF, even encoded,
    would forge a header line. Errors name the pair's position, never its text (credentials)."""
    from urllib.parse import unquote

    pairs: list[tuple[str, str]] = []
    for position, item in enumerate(str(raw).split(","), start=1):
        if not item.strip():
            continue
        name, equals, value = item.partition("=")
        name, value = unquote(name).strip().lower(), unquote(value).strip()
        if not equals or not _HTTP_TOKEN.fullmatch(name):
            raise ValueError(f"pair {position} is not name=value with a header name")
        if _CONTROL.search(value):
            raise ValueError(f"the value of pair {position} has a control character")
        pairs.append((name, value))
    return tuple(pairs)


_SECRET_FIELDS = frozenset({"opamp_headers"})
"""Settings whose values carry credentials: an error names the variable, never the value."""


def _number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


_MAX_COUNT = 1_000_000  # items, calls, dumps: beyond this a count is a typo, memory unbounded
_MAX_SECONDS = 600.0  # a wait at exit or on a network: ten minutes; inf breaks thread joins
_MAX_MIB = 1_048_576.0  # 1 TiB of host memory or disk

# Kept for rows other engineers add: a plain count or duration gets the house bounds.
_positive_int = Bounded(1, _MAX_COUNT, integer=True)
_non_negative_int = Bounded(0, _MAX_COUNT, integer=True)
_non_negative_float = Bounded(0, _MAX_SECONDS, integer=False, unit="seconds")


def _directory(raw: str) -> str:
    """A directory that exists, or can be created below the nearest existing ancestor."""
    path = os.path.abspath(os.path.expanduser(str(raw).strip()))
    if not str(raw).strip():
        raise ValueError("empty")
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(f"{probe!r} exists and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"directory {probe!r} is not writable")
    return str(raw).strip()


def _str_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = str(raw).strip().lower()
        if value not in choices:
            raise ValueError("not one of the allowed values")
        return value

    return parse


def _bool(raw: str) -> bool:
    value = str(raw).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("not a boolean")


def _metrics(raw: str) -> bool | str:
    if str(raw).strip().lower() == "auto":
        return "auto"
    try:
        return _bool(raw)
    except ValueError:
        raise ValueError("not auto, true or false") from None


def _dest(raw: str) -> tuple[str, ...]:
    items = tuple(part.strip() for part in str(raw).split(",") if part.strip())
    if not items:
        raise ValueError("empty")
    return items


def _string(raw: str) -> str:
    return str(raw)


def _patterns(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in str(raw).split(",") if part.strip())


def _names(raw: str) -> tuple[str, ...]:
    return tuple(part.strip().lower() for part in str(raw).split(",") if part.strip())


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Setting:
    """One row of the configuration table. Its default is not a column: it is written once, as
    the default of the :class:`Settings` field of the same name, and read from there."""

    field: str
    env: str
    allowed: str
    parse: Callable[[str], Any]
    doc: str

    @property
    def default(self) -> Any:
        """The default: the :class:`Settings` field's, the only place it is written."""
        return _DEFAULTS[self.field]


_METRICS_INTERVAL = Bounded(0.1, 86_400, integer=False, unit="seconds, a day")

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "level",
        "OTEL_GPU_LOGLEVEL",
        "0, 1, 3, 5, 10",
        _int_choice(LEVELS),
        "0: off (the decorator returns the function itself); 1: one span per call; "
        "3: plus input/output metadata attributes; 5: plus tensor statistics events; "
        "10: plus the flight recorder (every input and output tensor written to OTEL_GPU_DUMP_DIR).",
    ),
    Setting(
        "dest",
        "OTEL_GPU_LOGDEST",
        "comma-separated: stdout, stderr, otlp, a path ending in .jsonl (OTLP JSON Lines), "
        "any other path (text; a bare name close to a keyword, such as stdot, is refused as a "
        "typo: write ./stdot); %i = pid, %r = rank",
        _dest,
        "Where spans go when otel-gpu owns the TracerProvider.",
    ),
    Setting(
        "provider",
        "OTEL_GPU_PROVIDER",
        "auto, global, own",
        _str_choice(("auto", "global", "own")),
        "auto: use the application's global SDK TracerProvider if it has set one, else "
        "otel-gpu's own provider with OTEL_GPU_LOGDEST; global: always the global one; "
        "own: always otel-gpu's own provider, even inside an instrumented application.",
    ),
    Setting(
        "max_items",
        "OTEL_GPU_MAX_ITEMS",
        "integer > 0 and <= 1024",
        Bounded(1, 1024, integer=True),
        "How many elements of a list/tuple/dict argument are expanded into attributes; "
        "the rest are counted in `<key>.length`.",
    ),
    Setting(
        "repr_limit",
        "OTEL_GPU_REPR_LIMIT",
        "integer > 0 and <= 1000000 (values above 2048 are capped at 2048)",
        Bounded(1, 1_000_000, integer=True),
        "Maximum length in bytes of a repr() or string attribute value. Never above 2048.",
    ),
    Setting(
        "queue_size",
        "OTEL_GPU_QUEUE_SIZE",
        "integer > 0 and <= 16777216",
        Bounded(1, 16_777_216, integer=True),
        "Calls waiting to be turned into spans. When full, OTEL_GPU_QUEUE_FULL decides.",
    ),
    Setting(
        "queue_full",
        "OTEL_GPU_QUEUE_FULL",
        "block, drop",
        _str_choice(("block", "drop")),
        "What a call does when the queue is full (export fell behind). block: the caller exports "
        "a chunk of spans itself (after the export thread's current chunk), so no span is "
        "lost; only an export that makes no progress for 1 s drops (counted). drop: the call's "
        "span is dropped and counted, never waited on. Drops are reported at exit and as "
        "otel.sdk.processor.span.processed events on the next exported span.",
    ),
    Setting(
        "flush_timeout",
        "OTEL_GPU_FLUSH_TIMEOUT",
        "number >= 0 and <= 600 (seconds)",
        Bounded(0, _MAX_SECONDS, integer=False, unit="seconds"),
        "Unset: interpreter exit builds every span still queued, however long that takes while "
        "export makes progress (it gives up only when nothing is built for this many seconds), "
        "then gives the destinations this long to confirm. Set: exit spends at most this long "
        "in all, and says how many spans it left unbuilt.",
    ),
    Setting(
        "export_gc_pause",
        "OTEL_GPU_EXPORT_GC_PAUSE",
        "true, false",
        _bool,
        "Pause Python's garbage collector while the export thread builds and encodes a chunk of "
        "64 spans (a few ms), so their short-lived objects never trigger full collections of a "
        "large torch heap. Turn off if the application toggles gc.disable()/gc.enable() itself.",
    ),
    Setting(
        "encoder",
        "OTEL_GPU_ENCODER",
        "native, official",
        _str_choice(("native", "official")),
        "How otel-gpu's own destinations (OTEL_GPU_LOGDEST) encode spans. native: otel-gpu's "
        "OTLP JSON and protobuf encoders, fed plain span records (a few µs a span); official: "
        "the OpenTelemetry exporters fed SDK ReadableSpans (~10× the cost). An application's "
        "provider always gets ReadableSpans.",
    ),
    Setting(
        "color",
        "OTEL_GPU_COLOR",
        "auto, always, never",
        _str_choice(("auto", "always", "never")),
        "Colour in the console renderer. auto: when the stream is a tty and NO_COLOR is unset.",
    ),
    Setting(
        "strict",
        "OTEL_GPU_STRICT",
        "true, false",
        _bool,
        "Turn otel-gpu's internal errors into exceptions instead of logging them once. "
        "For tests of otel-gpu and of libraries that use it; never in production.",
    ),
    Setting(
        "redact",
        "OTEL_GPU_REDACT",
        "comma-separated substrings; empty disables",
        _names,
        "String arguments whose parameter name contains one of these are recorded as "
        "'<redacted>' at level 3 and above.",
    ),
    Setting(
        "instrument",
        "OTEL_GPU_INSTRUMENT",
        "comma-separated targets: module, pkg.mod.Class, pkg.mod.function, glob on module names "
        "(pkg.*), flashinfer; refused: the standard library, otel_gpu, opentelemetry, torch "
        "internals and what torch needs to start (docs/instrument.md)",
        _patterns,
        "Code to instrument without editing it, applied by `otel-gpu run` and the "
        "`opentelemetry-instrument` entry point at start-up, by `import otel_gpu.auto`, and "
        "otherwise at the first decorated function, configure() or instrument() of the "
        "process (a program that does none of these is warned at exit): modules not yet "
        "imported are instrumented when first imported; a name a program bound itself "
        "(from x import f) before that moment keeps the original.",
    ),
    Setting(
        "batch_max_links",
        "OTEL_GPU_BATCH_MAX_LINKS",
        "integer >= 0 and <= 1000000; 0 links no request",
        _non_negative_int,
        "Inside otel_gpu.batch(requests=...), the most links to requests each span of the step "
        "carries (the first requests given, duplicates once); otel_gpu.batch.requests and "
        "otel_gpu.batch.links say how many there were and how many were kept. The SDK's own "
        "default cap on links (OTEL_SPAN_LINK_COUNT_LIMIT) is also 128.",
    ),
    Setting(
        "on_nonfinite",
        "OTEL_GPU_ON_NONFINITE",
        "mark, error, dump, raise",
        _str_choice(("mark", "error", "dump", "raise")),
        "At level >= 5, what a call with NaN/Inf in its tensors does: mark (the otel_gpu.nonfinite "
        "attribute and the statistics events), error (also span status ERROR naming the tensors), "
        "dump (also a flight-recorder dump of the call and of the OTEL_GPU_RING calls before it), "
        "raise (also otel_gpu.NonFiniteError raised after the call: for debugging runs).",
    ),
    Setting(
        "stuck_after",
        "OTEL_GPU_STUCK_AFTER",
        "number >= 0 and <= 604800 (seconds, a week); 0 turns it off",
        Bounded(0, 604_800, integer=False, unit="seconds, a week"),
        "Report a call still running after this many seconds, once, at once (not at exit): a span "
        "otel_gpu.stuck <name> with every thread's Python stack and the call's inputs, and a ring "
        "dump when OTEL_GPU_RING is on. Checked by the export thread every 100 ms.",
    ),
    Setting(
        "ring",
        "OTEL_GPU_RING",
        "integer >= 0 and <= 1000000; 0 turns it off",
        Bounded(0, _MAX_COUNT, integer=True),
        "At level >= 3, keep the inputs of the last N calls in host memory, and write them with "
        "the triggering call as flight-recorder dumps when a call raises, when "
        "OTEL_GPU_ON_NONFINITE=dump sees NaN/Inf, when a call is stuck, or on SIGTERM.",
    ),
    Setting(
        "ring_max_mb",
        "OTEL_GPU_RING_MAX_MB",
        "number >= 0 and <= 1048576 (MiB)",
        Bounded(0, _MAX_MIB, integer=False, unit="MiB"),
        "Host memory the ring may hold; the oldest calls are dropped first. A call larger than "
        "this is kept without its tensors (its dump says so).",
    ),
    Setting(
        "dump_modules",
        "OTEL_GPU_DUMP_MODULES",
        "true, false",
        _bool,
        "At level 10, save the state_dict of each torch.nn.Module whose method is recorded (at "
        "its first call and again when it changed, below OTEL_GPU_DUMP_DIR/modules, named by a "
        "content hash), so replay can construct the module again and re-run the call with the "
        "weights of its moment.",
    ),
    Setting(
        "dump_modules_max_mb",
        "OTEL_GPU_DUMP_MODULES_MAX_MB",
        "number >= 0 and <= 1048576 (MiB)",
        Bounded(0, _MAX_MIB, integer=False, unit="MiB"),
        "Total size of module states OTEL_GPU_DUMP_MODULES may write; beyond it calls are recorded "
        "without their module (replay skips them, saying so).",
    ),
    Setting(
        "module_param_stats",
        "OTEL_GPU_MODULE_PARAM_STATS",
        "true, false",
        _bool,
        "At level >= 5, instrument_module() adds statistics of each module's own parameters "
        "to its first call's span (event otel_gpu.param_stats), so a weight that turned NaN shows; "
        "with OTEL_GPU_CONTROL=on, to its first call recorded at 5 after control raised it.",
    ),
    Setting(
        "fingerprint",
        "OTEL_GPU_FINGERPRINT",
        "true, false",
        _bool,
        "At level >= 5, each statistics event also carries fingerprint: a 64-bit hash of the "
        "tensor's bytes (16 hex digits), computed on its device with the other statistics, no "
        "extra host read. Equal bytes, equal fingerprint: otel-gpu diff compares runs by it. "
        "Off by default: on CPU it costs several times the other statistics (otel-gpu bench).",
    ),
    Setting(
        "lowp_simulate",
        "OTEL_GPU_LOWP_SIMULATE",
        "off, e4m3, e5m2, e2m1",
        _str_choice(("off", "e4m3", "e5m2", "e2m1")),
        "At level >= 5, each float16/bfloat16/float32/float64 tensor's statistics also say what "
        "a plain cast to this format (float8_e4m3fn, float8_e5m2, float4_e2m1fn) would do: the "
        "fractions of values flushed to zero (underflow) and beyond its largest magnitude "
        "(overflow), with amax, dynamic_range and zero_fraction. float8 and float4 tensors get "
        "their own low-precision statistics whatever this says.",
    ),
    # ---- flight recorder (level 10)
    Setting(
        "graph_stats_every",
        "OTEL_GPU_GRAPH_STATS_EVERY",
        "integer > 0 and <= 1000000",
        Bounded(1, _MAX_COUNT, integer=True),
        "At level >= 5, read the statistics recorded inside a captured CUDA graph after replay 1 "
        "and then one replay in N: each read replay gives one span per captured call "
        "(otel_gpu.cuda_graph.replay), linked to its capture span. 1 reads every replay.",
    ),
    Setting(
        "graph_dump_every",
        "OTEL_GPU_GRAPH_DUMP_EVERY",
        "integer > 0 and <= 1000000",
        Bounded(1, _MAX_COUNT, integer=True),
        "At level 10, write a flight-recorder snapshot of each call captured in a CUDA graph "
        "after replay 1 and then one replay in N (within OTEL_GPU_DUMP_MAX_COUNT and "
        "OTEL_GPU_DUMP_MAX_SIZE_GB). 1 snapshots every replay.",
    ),
    Setting(
        "dump_dir",
        "OTEL_GPU_DUMP_DIR",
        "a directory path; %i = pid, %r = rank",
        _string,
        "Where level 10 writes one directory per call (inputs, outputs, manifest).",
    ),
    Setting(
        "dump_max_size_gb",
        "OTEL_GPU_DUMP_MAX_SIZE_GB",
        "number >= 0 and <= 1048576 (GB)",
        Bounded(0, 1_048_576, integer=False, unit="GB"),
        "Total size of tensors the recorder may write, inputs and outputs counted before "
        "copying; ring, trigger and CUDA-graph snapshot dumps count too.",
    ),
    Setting(
        "dump_max_count",
        "OTEL_GPU_DUMP_MAX_COUNT",
        "integer > 0 and <= 1000000",
        Bounded(1, _MAX_COUNT, integer=True),
        "How many calls the recorder may dump: level-10 calls, CUDA-graph snapshots and the "
        "calls of ring and trigger dumps together.",
    ),
    Setting(
        "dump_include",
        "OTEL_GPU_DUMP_INCLUDE",
        "comma-separated fnmatch patterns on the span name",
        _patterns,
        "Only calls whose span name matches one of these are dumped (default: all).",
    ),
    Setting(
        "dump_exclude",
        "OTEL_GPU_DUMP_EXCLUDE",
        "comma-separated fnmatch patterns on the span name",
        _patterns,
        "Calls whose span name matches one of these are not dumped.",
    ),
    Setting(
        "dump_format",
        "OTEL_GPU_DUMP_FORMAT",
        "torch, safetensors",
        _str_choice(("torch", "safetensors")),
        "torch keeps dense layouts in the file; safetensors stores contiguous copies; replay restores "
        "the recorded strides for both.",
    ),
    Setting(
        "dump_durability",
        "OTEL_GPU_DUMP_DURABILITY",
        "fsync, process, async",
        _str_choice(("fsync", "process", "async")),
        "process: inputs and manifest are written before the call runs, no fsync (they survive the "
        "process dying, not a power loss); fsync: the same, fsync'd (they survive a power loss too; "
        "bound by the disk's durable write speed); async: copied before the call, written by a "
        "background thread (a process that dies inside the call may lose them).",
    ),
    # ---- workloads at call time
    Setting(
        "workloads_dir",
        "OTEL_GPU_WORKLOADS_DIR",
        "a directory path (created if missing); %i = pid, %r = rank; empty: off",
        _string,
        "At level >= 3, before a call runs, write one definition JSON per (function, input "
        "signature) below this folder, in the format of otel-gpu workloads --emit, once across "
        "the processes sharing it, with a count per signature (docs/workloads.md).",
    ),
    # ---- crash journal
    Setting(
        "journal",
        "OTEL_GPU_JOURNAL",
        "true, false",
        _bool,
        "Keep a crash journal of in-flight calls (a memory-mapped file per process) at level >= 1.",
    ),
    Setting(
        "journal_dir",
        "OTEL_GPU_JOURNAL_DIR",
        "a directory path (created if missing)",
        _directory,
        "Where crash journals live. Default: $XDG_RUNTIME_DIR/otel-gpu, else <tmp>/otel-gpu-<uid>.",
    ),
    Setting(
        "recover_on_start",
        "OTEL_GPU_RECOVER_ON_START",
        "true, false",
        _bool,
        "At the first decorated call, export the in-flight calls of dead processes' journals.",
    ),
    # ---- metrics and the device timeline
    Setting(
        "metrics",
        "OTEL_GPU_METRICS",
        "auto, true, false",
        _metrics,
        "At level >= 1, also emit OpenTelemetry metrics where the spans go: call durations (with "
        "exemplars naming the call's span), calls, errors and non-finite results per function, "
        "GPU gauges read through NVML, and otel-gpu's own counters (docs/metrics.md). auto: "
        "where otel-gpu's own provider sends spans to otlp or a .jsonl file (aggregated by "
        "otel-gpu, about 1 µs a call), not to a console or the application's provider; true: "
        "also a table at exit on a console destination, and the application's MeterProvider "
        "through SDK instruments (10-13 µs a call); false: never.",
    ),
    Setting(
        "metrics_interval",
        "OTEL_GPU_METRICS_INTERVAL",
        _METRICS_INTERVAL.text,
        _METRICS_INTERVAL,
        "How often metrics are collected and exported; the GPU gauges read NVML at each "
        "collection. A last collection is exported at exit.",
    ),
    Setting(
        "nvtx",
        "OTEL_GPU_NVTX",
        "true, false",
        _bool,
        "At level >= 1, push an NVTX range named like the span around each decorated call, with "
        "the span id in its payload (the nvtx package) or its message (torch.cuda.nvtx), so an "
        "Nsight Systems timeline joins the trace. Skipped while torch.compile traces and during "
        "CUDA-graph capture (docs/nvtx.md).",
    ),
    Setting(
        "device_time",
        "OTEL_GPU_DEVICE_TIME",
        "auto, on, off",
        _str_choice(("auto", "on", "off")),
        "At level >= 1, time each call on the GPU with two CUDA events from a reused pool, "
        "recorded around it on the current stream and read off the caller's thread: "
        "otel_gpu.device.duration and otel_gpu.device.queue_delay on its span (docs/levels.md, "
        "Device time). auto: once the program has initialised CUDA; on: whenever CUDA is "
        "available (the first call may initialise it); off: never. Nothing on a machine "
        "without CUDA.",
    ),
    Setting(
        "device_spans",
        "OTEL_GPU_DEVICE_SPANS",
        "auto, on, off",
        _str_choice(("auto", "on", "off")),
        "Where a call has device time, also a child span '<name> [device]' whose start and end "
        "are the device's, on the host clock, so trace viewers draw the GPU work under the "
        "call. auto: for functions decorated at level >= 3; on: at every level; off: never.",
    ),
    Setting(
        "device_time_wait",
        "OTEL_GPU_DEVICE_TIME_WAIT",
        _non_negative_float.text,
        _non_negative_float,
        "How long a call's span waits, off the caller's thread, for its device events to "
        "complete; then it is exported with otel_gpu.device.unresolved = true and no duration.",
    ),
    Setting(
        "device_memory",
        "OTEL_GPU_DEVICE_MEMORY",
        "true, false",
        _bool,
        "At level >= 3 where CUDA is available, read the CUDA caching allocator before and after "
        "each call: otel_gpu.device.memory.allocated_delta and .peak on its span, the "
        "allocator's summary on an out-of-memory error (docs/levels.md, Memory per call). "
        "false saves the two reads (tens of microseconds a call on a GPU host).",
    ),
    Setting(
        "stats_read",
        "OTEL_GPU_STATS_READ",
        "async, sync",
        _str_choice(("async", "sync")),
        "At level 5, how a call's statistics come back from a CUDA device. async: a non-blocking "
        "copy and an event on the caller's thread, read and completed by a thread of otel-gpu "
        "(no host synchronisation of the caller) where the non-finite policy is mark and no "
        "non-finite trigger is in force; sync: one blocking read on the caller's thread per "
        "call, as the other policies always do (docs/levels.md, Level 5).",
    ),
    Setting(
        "device_memory_calls",
        "OTEL_GPU_DEVICE_MEMORY_CALLS",
        "outermost, all",
        _str_choice(("outermost", "all")),
        "Which calls read memory per call (OTEL_GPU_DEVICE_MEMORY). outermost: only a call not "
        "nested in another decorated call of the same thread or task (the model's forward, not "
        "each of its modules), so an instrumented module tree pays two allocator reads a "
        "forward; a nested call still gets the allocator's summary when it raises out of "
        "memory. all: every call, for the delta of each module (two reads per call, ~11 us "
        "each on a GPU host).",
    ),
    Setting(
        "control",
        "OTEL_GPU_CONTROL",
        "on, off",
        _str_choice(("on", "off")),
        "on: every decorated or instrumented function (instrument(), OTEL_GPU_INSTRUMENT, "
        "instrument_module(), flashinfer), level 0 included, is a trampoline whose path live "
        "control (otel-gpu control) can swap for another level's, per function by glob, for a "
        "time window; level 0 costs one extra call (docs/control.md). off: level 0 is the "
        "function itself, nothing is instrumented, and the level is fixed at decoration.",
    ),
    Setting(
        "triggers",
        "OTEL_GPU_TRIGGERS",
        "a JSON list of trigger objects (docs/control.md, Triggers), or none",
        trigger_rules.parse_text,
        "Rules that raise detail when something happens: on a non-finite result, an exception "
        "of a given type or a call slower than a threshold, the next calls of that function (or "
        "all functions) take a higher level, bounded by a count and a time, and/or the ring is "
        "dumped. Arms the decorated functions as OTEL_GPU_CONTROL=on does. Example: "
        '[{"on": "nonfinite", "level": 10, "calls": 20}].',
    ),
    Setting(
        "trigger_max_fires",
        "OTEL_GPU_TRIGGER_MAX_FIRES",
        "integer > 0 and <= 1000000",
        Bounded(1, 1_000_000, integer=True),
        "The most times one trigger fires in any 60 s (or in its own `per`), where the rule "
        "gives no max_fires: a firing past it is skipped, with one warning line, so a rule that "
        "matches every call costs at most this many dumps and control spans a window.",
    ),
    Setting(
        "opamp_endpoint",
        "OTEL_GPU_OPAMP_ENDPOINT",
        "an http:// or https:// URL with a host, such as https://opamp.example:4320/v1/opamp "
        "(no spaces or control characters); unset: no OpAMP",
        _opamp_endpoint,
        "The OpAMP server this process reports to and takes its remote configuration "
        "`otel-gpu` from (docs/control.md, OpAMP). Needs the `opamp` extra "
        "(opentelemetry-opamp-client). Polled over HTTP on a thread of its own.",
    ),
    Setting(
        "opamp_headers",
        "OTEL_GPU_OPAMP_HEADERS",
        "name=value pairs separated by commas, URL-encoded as in OTEL_EXPORTER_OTLP_HEADERS "
        "(names are HTTP tokens; no control characters, encoded or not)",
        _opamp_headers,
        "Headers of every OpAMP request, such as an Authorization header (credentials: never "
        "shown, in errors or by `otel-gpu info` either).",
    ),
    Setting(
        "opamp_interval",
        "OTEL_GPU_OPAMP_INTERVAL",
        _OPAMP_INTERVAL.text,
        _OPAMP_INTERVAL,
        "Seconds between two polls of the OpAMP server (heartbeats): a remote configuration "
        "is taken at the next poll, so this is how late it may come. Each request may take half "
        "of it (at most 5 s), so that polls never queue up behind a server that hangs.",
    ),
    Setting(
        "service_name",
        "OTEL_SERVICE_NAME",
        "any string",
        _string,
        "Standard OpenTelemetry variable: service.name of the resource (default: the script name).",
    ),
)

_BY_FIELD = {s.field: s for s in SETTINGS}


@dataclass(frozen=True)
class StandardSetting:
    """A standard OpenTelemetry variable that otel-gpu's own destinations read (through its
    exporters or the SDK objects it builds). Not a field of :class:`Settings`: it belongs to the
    OpenTelemetry specification, and otel-gpu only bounds it where it uses it.

    ``applies``: ``otlp`` is checked at configuration when ``OTEL_GPU_LOGDEST`` includes ``otlp``;
    ``provider`` when otel-gpu builds its own TracerProvider (a bad value leaves otel-gpu off
    for the process with one warning), except :data:`SDK_IMPORT_VARIABLES`, which the SDK reads
    when ``opentelemetry.sdk.trace`` is imported and which ``otel_gpu.export.pipeline`` checks
    just before that import. ``only_if`` names another variable and the values of it under which
    this one is checked (the sampler's argument).
    """

    env: str
    applies: str
    allowed: str
    parse: Callable[[str], Any]
    doc: str
    only_if: tuple[str, tuple[str, ...]] | None = None
    secret: bool = False
    """The value carries credentials (OTLP headers): an error names the variable, never the value."""


_OTLP_TIMEOUT = Bounded(0.001, _MAX_SECONDS, integer=False, unit="seconds")
_SPAN_LIMIT = Bounded(0, _MAX_COUNT, integer=True)
_SPAN_LIMIT_ALLOWED = f"{_SPAN_LIMIT.text}, or unset"
_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
"""The SDK's built-in values of ``OTEL_TRACES_SAMPLER`` (``sampling._KNOWN_SAMPLERS``)."""
SAMPLER_ENTRY_POINTS = "opentelemetry_traces_sampler"
"""The entry-point group under which packages register more samplers."""
SDK_IMPORT_VARIABLES = ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",)
"""Standard variables ``opentelemetry.sdk.trace`` reads when it is imported: a bad one stops
that import with the SDK's own ``ValueError``, at any level, for any program importing it."""


def _sampler_entry_points() -> tuple[str, ...]:
    """The names of the installed :data:`SAMPLER_ENTRY_POINTS`, sorted (the SDK registers its
    built-ins there too)."""
    from importlib.metadata import entry_points

    return tuple(sorted({ep.name for ep in entry_points(group=SAMPLER_ENTRY_POINTS)}))


def _sampler(raw: str) -> str:
    """``OTEL_TRACES_SAMPLER``: a built-in name (any case, as the SDK's TracerProvider reads it) or
    the exact name of an installed entry point (as the SDK's auto-configuration loads it)."""
    if raw.lower() in SAMPLERS:
        return raw.lower()
    if raw != raw.strip():
        raise ValueError(f"{raw!r} has spaces around the name, which the SDK does not strip")
    installed = _sampler_entry_points()
    if raw in installed:
        return raw
    others = [n for n in installed if n not in SAMPLERS]
    listed = ", ".join(others) if others else "none besides the built-ins"
    raise ValueError(
        f"not a known sampler (installed {SAMPLER_ENTRY_POINTS} entry points: {listed})"
    )


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _endpoint(raw: str) -> str:
    """An OTLP endpoint the official exporters can parse: ``http://[::1`` passed every check and
    then failed inside the exporter at the first call."""
    from urllib.parse import urlsplit

    if _CONTROL.search(raw) or raw != raw.strip() or " " in raw:
        raise ValueError("it contains spaces or control characters")
    try:
        _ = urlsplit(raw).port  # the exporters read the port; a bad one raises only then
    except ValueError as exc:
        raise ValueError(f"not a URL ({exc})") from None
    return raw


def _headers(raw: str) -> str:
    """OTLP headers without control characters: a CR or LF in a value forges a line in the SDK's
    own warning about it (and no HTTP header may carry one)."""
    found = _CONTROL.search(raw)
    if found:
        raise ValueError(f"a control character ({found.group()!r}) at position {found.start()}")
    return raw


STANDARD: tuple[StandardSetting, ...] = (
    *(
        StandardSetting(
            name,
            "otlp",
            "a URL such as http://collector:4317 (no spaces or control characters)",
            _endpoint,
            "Where the OTLP exporter sends; checked at configuration so that a malformed URL is "
            "a one-line error, not a failure at the first call.",
        )
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ),
    *(
        StandardSetting(
            name,
            "otlp",
            "key=value pairs separated by commas, without control characters (CR, LF, tab...)",
            _headers,
            "Headers of every OTLP request (credentials: never shown, in errors either).",
            secret=True,
        )
        for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS")
    ),
    StandardSetting(
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "otlp",
        "number >= 0.001 and <= 600 (seconds)",
        _OTLP_TIMEOUT,
        "How long one OTLP export (all its retries) may take. Seconds, as the OpenTelemetry "
        "Python exporters read it (the specification's milliseconds are refused above 600).",
    ),
    StandardSetting(
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "otlp",
        "number >= 0.001 and <= 600 (seconds)",
        _OTLP_TIMEOUT,
        "The same for traces only; wins over OTEL_EXPORTER_OTLP_TIMEOUT.",
    ),
    StandardSetting(
        "OTEL_BSP_SCHEDULE_DELAY",
        "otlp",
        "integer > 0 and <= 600000 (milliseconds)",
        Bounded(1, 600_000, integer=True, unit="milliseconds"),
        "How often the OTLP batch processor sends.",
    ),
    StandardSetting(
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
        "otlp",
        "integer > 0 and <= 1048576",
        Bounded(1, 1_048_576, integer=True),
        "Spans per OTLP request; above OTEL_GPU_QUEUE_SIZE it is lowered to it.",
    ),
    StandardSetting(
        "OTEL_BSP_EXPORT_TIMEOUT",
        "otlp",
        "integer >= 0 and <= 600000 (milliseconds)",
        Bounded(0, 600_000, integer=True, unit="milliseconds"),
        "Parsed by the SDK's batch processor, which does not use it; OTEL_EXPORTER_OTLP_TIMEOUT "
        "bounds an export.",
    ),
    StandardSetting(
        "OTEL_TRACES_SAMPLER",
        "provider",
        f"{', '.join(SAMPLERS)}, or the name of an installed {SAMPLER_ENTRY_POINTS} entry point",
        _sampler,
        "The head sampler of otel-gpu's own provider (on an unknown name the SDK logs one warning "
        "and samples everything).",
    ),
    StandardSetting(
        "OTEL_TRACES_SAMPLER_ARG",
        "provider",
        "number >= 0 and <= 1",
        Bounded(0, 1, integer=False),
        "The sampling ratio when OTEL_TRACES_SAMPLER is traceidratio or parentbased_traceidratio "
        "(the SDK would silently sample everything on a bad value).",
        only_if=("OTEL_TRACES_SAMPLER", _RATIO_SAMPLERS),
    ),
    *(
        StandardSetting(
            name,
            "provider",
            _SPAN_LIMIT_ALLOWED,
            _SPAN_LIMIT,
            "Span limit of otel-gpu's own provider (see attributes.md); 'unset' means no limit.",
        )
        for name in (
            "OTEL_ATTRIBUTE_COUNT_LIMIT",
            "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
            "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
            "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
            "OTEL_SPAN_EVENT_COUNT_LIMIT",
            "OTEL_SPAN_LINK_COUNT_LIMIT",
            "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT",
            "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT",
        )
    ),
)
"""Standard variables otel-gpu bounds (see :class:`StandardSetting`); the others it does not read."""


def check_sdk_import_variables() -> None:
    """ConfigError for a bad one of :data:`SDK_IMPORT_VARIABLES` (call before importing the SDK)."""
    env = environ()
    check_standard("provider", {k: env[k] for k in SDK_IMPORT_VARIABLES if k in env})


def check_standard(applies: str, env: Mapping[str, str] | None = None) -> None:
    """ConfigError naming the first standard variable of group ``applies`` outside its range."""
    env = environ() if env is None else env
    for setting in STANDARD:
        if setting.applies != applies:
            continue
        value = env.get(setting.env, "")
        raw = value.strip()
        if not raw or (setting.parse is _SPAN_LIMIT and raw.lower() == "unset"):
            continue
        if setting.only_if is not None:
            other, values = setting.only_if
            if env.get(other, "").strip().lower() not in values:
                continue
        try:
            setting.parse(value)  # unstripped: a sampler name with spaces is unknown to the SDK
        except ValueError as exc:
            shown = "<redacted>" if setting.secret else repr(raw)
            raise ConfigError(
                f"{setting.env}={shown} (environment) is invalid: {exc}. "
                f"Allowed: {setting.allowed}."
            ) from None


@dataclass(frozen=True)
class Settings:
    """The resolved configuration. Immutable: :func:`otel_gpu.configure` builds a new one.

    Each field's default here is the setting's default, written nowhere else: the table
    (:data:`SETTINGS`: variable, allowed values, parser, doc) reads it through
    :attr:`Setting.default`, and so do ``otel-gpu info`` and docs/configuration.md's tables."""

    level: int = 0
    dest: tuple[str, ...] = ("stdout",)
    provider: str = "auto"
    max_items: int = 8
    repr_limit: int = 256
    queue_size: int = 65536
    queue_full: str = "block"
    flush_timeout: float = 3.0
    export_gc_pause: bool = True
    encoder: str = "native"
    color: str = "auto"
    strict: bool = False
    redact: tuple[str, ...] = ("token", "key", "password", "secret", "auth")
    instrument: tuple[str, ...] = ()
    batch_max_links: int = 128
    on_nonfinite: str = "mark"
    stuck_after: float = 0.0
    ring: int = 0
    ring_max_mb: float = 256.0
    dump_modules: bool = False
    dump_modules_max_mb: float = 1024.0
    module_param_stats: bool = False
    fingerprint: bool = False
    lowp_simulate: str = "off"
    graph_stats_every: int = 100
    graph_dump_every: int = 100
    dump_dir: str = "otel_gpu_dumps"
    dump_max_size_gb: float = 20.0
    dump_max_count: int = 1000
    dump_include: tuple[str, ...] = ()
    dump_exclude: tuple[str, ...] = ()
    dump_format: str = "torch"
    dump_durability: str = "process"
    workloads_dir: str = ""
    journal: bool = True
    journal_dir: str | None = None
    recover_on_start: bool = False
    metrics: bool | str = "auto"  # "auto": where it is cheap and read (metrics/provider.py)
    metrics_interval: float = 10.0
    nvtx: bool = False
    device_time: str = "auto"
    device_spans: str = "auto"
    device_time_wait: float = 5.0
    device_memory: bool = True
    device_memory_calls: str = "outermost"
    stats_read: str = "async"
    control: str = "off"
    triggers: tuple[trigger_rules.Trigger, ...] = ()
    trigger_max_fires: int = 10
    opamp_endpoint: str | None = None
    opamp_headers: tuple[tuple[str, str], ...] = ()
    opamp_interval: float = 30.0
    service_name: str | None = None
    dest_explicit: bool = False
    """True when OTEL_GPU_LOGDEST or configure(dest=...) set the destination (not the default)."""
    flush_timeout_explicit: bool = False
    """True when OTEL_GPU_FLUSH_TIMEOUT or configure(flush_timeout=...) set the bound: only then
    may exit leave queued spans unbuilt (dropping data is the user's choice, never a default)."""

    @property
    def controllable(self) -> bool:
        """Whether decorated functions are armed (calls/armed.py): ``OTEL_GPU_CONTROL=on``, or
        triggers set, which raise functions' levels as control does."""
        return self.control == "on" or bool(self.triggers)

    def __post_init__(self) -> None:
        # Tempo cuts attribute values at 2048 bytes by default: never produce longer ones.
        if self.repr_limit > 2048:
            object.__setattr__(self, "repr_limit", 2048)


# Every default is written once, above; the table's rows read theirs from here.
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Settings)}


def _error(setting: Setting, raw: object, why: str, source: str) -> ConfigError:
    shown = "<redacted>" if setting.field in _SECRET_FIELDS else repr(raw)
    if len(shown) > 200:  # a value of any size is named in one line
        shown = f"{shown[:160]}... ({len(shown)} characters)"
    return ConfigError(
        f"{setting.env}={shown} ({source}) is invalid: {why}. Allowed: {setting.allowed}."
    )


def _parse(setting: Setting, raw: object, source: str) -> Any:
    if setting.field == "dest" and isinstance(raw, (list, tuple)):
        raw = ",".join(str(r) for r in raw)
    if setting.field == "redact" and isinstance(raw, (list, tuple)):
        raw = ",".join(str(r) for r in raw)
    if isinstance(raw, bool) and setting.parse in (_bool, _metrics):
        return raw
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        raw = str(raw)
    if isinstance(raw, (list, tuple)) and setting.parse is _patterns:
        raw = ",".join(str(r) for r in raw)
    if setting.field == "triggers" and isinstance(raw, (list, tuple, dict)):
        try:  # configure(triggers=[{...}]): the objects themselves, not their str()
            return trigger_rules.parse(list(raw) if isinstance(raw, tuple) else raw)
        except ValueError as exc:
            raise _error(setting, "the triggers given", str(exc), source) from None
    if isinstance(raw, Mapping) and setting.parse is _opamp_headers:  # configure(opamp_headers={})
        from urllib.parse import quote

        raw = ",".join(f"{quote(str(k))}={quote(str(v))}" for k, v in raw.items())
    try:
        value = setting.parse(raw if isinstance(raw, str) else str(raw))
    except ValueError as exc:
        raise _error(setting, raw, str(exc), source) from None
    if setting.field == "dest":
        for item in value:
            _check_dest(setting, raw, item, source)
    return value


_DEST_KEYWORDS = ("stdout", "stderr", "otlp")


def expand_path(path: str, env: Mapping[str, str] | None = None) -> str:
    """Replace ``%i`` with the pid and ``%r`` with the distributed rank (``RANK``, else 0)."""
    env = environ() if env is None else env
    return path.replace("%i", str(os.getpid())).replace("%r", env.get("RANK", "0") or "0")


def _mistyped_keyword(item: str) -> str | None:
    """The keyword a bare name (no directory part, no extension) is a near miss of: ``stdot``
    silently wrote a file named ``stdot`` in the current directory."""
    import difflib

    if os.path.basename(item) != item or os.path.splitext(item)[1]:
        return None
    close = difflib.get_close_matches(item.lower(), _DEST_KEYWORDS, n=1, cutoff=0.75)
    return close[0] if close else None


def _check_dest(setting: Setting, raw: object, item: str, source: str) -> None:
    """Fail at configuration, not on the hundredth call, for a path we cannot write."""
    if item.lower() == "otlp":
        check_otlp_environment()  # an unsupported protocol or timeout fails now, not at the first call
        return
    if item.lower() in _DEST_KEYWORDS:
        return
    typo = _mistyped_keyword(item)
    if typo:
        why = f"{item!r} looks like a mistyped {typo!r}; for a file of that name write ./{item}"
        raise _error(setting, raw, why, source)
    path = os.path.abspath(os.path.expanduser(expand_path(item)))
    parent = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise _error(setting, raw, f"{item!r} is a directory, not a file", source)
    if not os.path.isdir(parent):
        raise _error(setting, raw, f"directory {parent!r} of {item!r} does not exist", source)
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise _error(setting, raw, f"file {path!r} is not writable", source)
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise _error(setting, raw, f"directory {parent!r} is not writable", source)


def load(
    overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> Settings:
    """Resolve settings: ``overrides`` (from :func:`otel_gpu.configure`) beat ``env``, which beats defaults.

    Raises :class:`ConfigError` naming the first invalid setting and what it allows.
    """
    env = environ() if env is None else env
    overrides = dict(overrides or {})
    unknown = set(overrides) - set(_BY_FIELD)
    if unknown:
        names = ", ".join(sorted(_BY_FIELD))
        raise ConfigError(f"unknown setting(s) {', '.join(sorted(unknown))}; known: {names}")
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        if setting.field in overrides and overrides[setting.field] is not None:
            values[setting.field] = _parse(setting, overrides[setting.field], "configure()")
        elif setting.env in env and (env[setting.env].strip() or setting.field == "redact"):
            values[setting.field] = _parse(setting, env[setting.env], "environment")
    return Settings(
        **values,
        dest_explicit="dest" in values,
        flush_timeout_explicit="flush_timeout" in values,
    )


# --------------------------------------------------------------------------- process-wide state

_lock = threading.Lock()
_current: Settings | None = None
_overrides: dict[str, Any] = {}


def current() -> Settings:
    """The settings in force, loaded from the environment on first use."""
    global _current
    settings = _current
    if settings is None:
        with _lock:
            if _current is None:
                _current = load(_overrides)
            settings = _current
    return settings


def set_overrides(overrides: Mapping[str, Any]) -> Settings:
    """Merge ``overrides`` into the ones from earlier :func:`otel_gpu.configure` calls and reload."""
    global _current
    with _lock:
        merged = {**_overrides, **{k: v for k, v in overrides.items() if v is not None}}
        settings = load(merged)  # raises before anything changes
        _overrides.clear()
        _overrides.update(merged)
        _current = settings
        return settings


def reset_overrides() -> None:
    """Forget configure() overrides and the cached settings (tests)."""
    global _current
    with _lock:
        _overrides.clear()
        _current = None


def settings_table() -> list[dict[str, str]]:
    """The table for docs and ``otel-gpu config``: env var, default, allowed values, doc."""
    rows = []
    for s in SETTINGS:
        default = ",".join(s.default) if isinstance(s.default, tuple) else s.default
        rows.append({"env": s.env, "default": str(default), "allowed": s.allowed, "doc": s.doc})
    return rows


def with_changes(settings: Settings, **changes: Any) -> Settings:
    """A copy of ``settings`` with fields replaced (validated types are the caller's job)."""
    names = {f.name for f in fields(Settings)}
    bad = set(changes) - names
    if bad:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(bad))}")
    return replace(settings, **changes)


# ---------------------------------------------------------------------- the OTLP protocol

_PROTOCOLS = ("grpc", "http/protobuf")


def otlp_protocol(env: Mapping[str, str] | None = None, signal: str = "TRACES") -> str:
    """The OTLP protocol the standard variables choose for ``signal`` (``TRACES`` or ``METRICS``):
    ``OTEL_EXPORTER_OTLP_<signal>_PROTOCOL``, then ``OTEL_EXPORTER_OTLP_PROTOCOL``, then gRPC, as
    the OTel SDK reads them; ConfigError naming the variable if unsupported."""
    env = otel_standard_variables() if env is None else env
    what = "OTEL_GPU_LOGDEST=otlp" + (" with OTEL_GPU_METRICS" if signal == "METRICS" else "")
    for name in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(name, "").strip()
        if value:
            if value not in _PROTOCOLS:
                raise ConfigError(
                    f"{name}={value!r} is not supported by {what}. "
                    f"Allowed: {', '.join(_PROTOCOLS)}."
                )
            return value
    return "grpc"


def metrics_destination(item: str) -> str:
    """Where the metrics of one ``OTEL_GPU_LOGDEST`` entry go: ``otlp`` (the OTLP metric
    exporter), ``file`` (a ``.jsonl`` path: its ``.metrics.jsonl`` sibling) or ``console``
    (stdout, stderr, a text file: a table at exit, with ``OTEL_GPU_METRICS=true`` only)."""
    key = item.lower()
    if key == "otlp":
        return "otlp"
    if key not in ("stdout", "stderr") and expand_path(item).endswith(".jsonl"):
        return "file"
    return "console"


def metrics_exporter_none(env: Mapping[str, str] | None = None) -> bool:
    """``OTEL_METRICS_EXPORTER=none``: the standard way to say "no metrics" (a traces-only
    backend); ``OTEL_GPU_METRICS=auto`` honours it."""
    env = otel_standard_variables() if env is None else env
    return env.get("OTEL_METRICS_EXPORTER", "").strip().lower() == "none"


def exemplar_filter(env: Mapping[str, str] | None = None) -> str:
    """``OTEL_METRICS_EXEMPLAR_FILTER`` as the OTel SDK reads it (``trace_based`` when unset):
    otel-gpu's own aggregation of the call metrics keeps the exemplars that filter would."""
    env = otel_standard_variables() if env is None else env
    return env.get("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based")


def check_otlp_environment(env: Mapping[str, str] | None = None) -> None:
    """Validate the standard OTLP variables otel-gpu relies on; ConfigError naming the bad one.

    The protocol, and the timeouts and batch-processor settings within their ranges
    (``otel_gpu.config.STANDARD``): a timeout of 1e30 s would make every send fail.
    """
    env = otel_standard_variables() if env is None else env
    otlp_protocol(env)
    check_standard("otlp", env)
