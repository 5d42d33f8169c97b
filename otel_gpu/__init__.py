"""otel-gpu: every call of a decorated GPU library function becomes an OpenTelemetry span.

    import otel_gpu

    @otel_gpu.api
    def attention(q, k, v, scale=None): ...

``OTEL_GPU_LOGLEVEL`` (0, 1, 3, 5, 10) sets how much each span carries and
``OTEL_GPU_LOGDEST`` where it goes. See docs/ for the full contract.

The public names are imported on first use (PEP 562), so that ``import otel_gpu`` and the
commands that need none of them (``otel-gpu show``, ``ship``, ``recover``, ``info``) do not
import torch.
"""

from __future__ import annotations

import atexit
import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on use
    from otel_gpu.config import ConfigError, Settings
    from otel_gpu.instrumentation.targets import (
        instrument,
        instrument_from_settings,
        uninstrument,
    )
    from otel_gpu.instrumentation.torch_modules import instrument_module, uninstrument_module
    from otel_gpu.runtime import NonFiniteError, api, batch, configure, flush

__all__ = [
    "ConfigError",
    "NonFiniteError",
    "Settings",
    "api",
    "batch",
    "configure",
    "flush",
    "instrument",
    "instrument_from_settings",
    "instrument_module",
    "settings",
    "uninstrument",
    "uninstrument_module",
]

# public name -> the module that defines it. No name here is also a submodule's name (the
# function ``instrument`` lives in the package ``instrumentation``): importing a submodule
# binds it as an attribute of this package, which would hide a lazy name of the same spelling.
_LAZY = {
    "NonFiniteError": "otel_gpu.runtime",
    "api": "otel_gpu.runtime",
    "batch": "otel_gpu.runtime",
    "configure": "otel_gpu.runtime",
    "flush": "otel_gpu.runtime",
    "ConfigError": "otel_gpu.config",
    "Settings": "otel_gpu.config",
    "instrument": "otel_gpu.instrumentation.targets",
    "instrument_from_settings": "otel_gpu.instrumentation.targets",
    "uninstrument": "otel_gpu.instrumentation.targets",
    "instrument_module": "otel_gpu.instrumentation.torch_modules",
    "uninstrument_module": "otel_gpu.instrumentation.torch_modules",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # AttributeError, not ImportError: `from otel_gpu import replay` relies on it to go on
        # and import the submodule
        raise AttributeError(f"module 'otel_gpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later uses are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def settings() -> Settings:
    """The settings in force (loaded from the environment on first use)."""
    from otel_gpu import config

    return config.current()


def _instrument_left_unapplied() -> None:
    """At exit: one warning where ``OTEL_GPU_INSTRUMENT`` names a module this program imported
    and nothing applied the variable (no ``import otel_gpu.auto``, no ``otel-gpu run``, no
    ``opentelemetry-instrument``, nothing decorated or configured): its calls made no span."""
    if "otel_gpu.cli" in sys.modules:  # otel-gpu's own commands are not the program
        return
    targets = sys.modules.get("otel_gpu.instrumentation.targets")
    if targets is not None and targets.applied_how() is not None:
        return
    try:
        from otel_gpu import _guard, config

        if not config.in_environment("instrument"):
            return  # the usual case: one dictionary lookup
        wanted = config.current()
    except Exception:  # a bad setting is reported where it is used, not at exit
        return
    if not wanted.instrument or (wanted.level == 0 and not wanted.controllable):
        return
    names = [spec for spec in wanted.instrument if _imported(spec)]
    if names:
        _guard.logger.warning(
            "otel-gpu: OTEL_GPU_INSTRUMENT names %s, imported in this process, but nothing "
            "applied it, so its calls made no span: `import otel_gpu.auto` first, or start the "
            "program with `otel-gpu run` or `opentelemetry-instrument` (docs/instrument.md)",
            ", ".join(repr(n) for n in names),
        )


def _imported(spec: str) -> bool:
    import fnmatch

    if set(spec) & set("*?["):
        return any(fnmatch.fnmatchcase(name, spec) for name in list(sys.modules))
    parts = spec.replace(":", ".").split(".")
    return any(".".join(parts[:i]) in sys.modules for i in range(len(parts), 0, -1))


atexit.register(_instrument_left_unapplied)
