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

import importlib
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
