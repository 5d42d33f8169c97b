"""otel-gpu: every call of a decorated GPU library function becomes an OpenTelemetry span.

    import otel_gpu

    @otel_gpu.api
    def attention(q, k, v, scale=None): ...

``OTEL_GPU_LOGLEVEL`` (0, 1, 3, 5, 10) sets how much each span carries and
``OTEL_GPU_LOGDEST`` where it goes. See docs/ for the full contract.
"""

from otel_gpu.calls.decorator import NonFiniteError, api, configure, flush
from otel_gpu.config import ConfigError, Settings
from otel_gpu.instrumentation.targets import instrument, instrument_from_settings, uninstrument
from otel_gpu.instrumentation.torch_modules import instrument_module, uninstrument_module

__all__ = [
    "ConfigError",
    "NonFiniteError",
    "Settings",
    "api",
    "configure",
    "flush",
    "instrument",
    "instrument_from_settings",
    "instrument_module",
    "settings",
    "uninstrument",
    "uninstrument_module",
]


def settings() -> Settings:
    """The settings in force (loaded from the environment on first use)."""
    from otel_gpu import config

    return config.current()
