"""The kernel-path choices a config carries outside ``to_dict()``, recorded beside it (replay
restores them: :mod:`otel_gpu.replay.kernel_choices`).

transformers' ``PretrainedConfig.to_dict()`` leaves out ``_attn_implementation`` and
``_experts_implementation`` (stored as ``_<kind>_implementation_internal``), so a config rebuilt
with ``from_dict()`` runs whatever its model's default is (eager attention in a bare submodule)
where the recording ran sdpa. Replay would then judge another program: false mismatches, and
passes that checked a different kernel. The recorder keeps every such choice, of the config and
of its sub-configs; replay sets each back through transformers' own setter, or refuses, saying
why, when this process cannot run the recorded kernel.

The choices are data: a dump may only name the ``_<kind>_implementation`` properties of the
config class, and only kernels that run here without downloading anything.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["implementation_choices", "is_config"]

_INTERNAL = re.compile(r"^_([a-z0-9]+)_implementation_internal$")
_MAX_DEPTH = 4  # sub-configs of sub-configs (a vision tower's text config…), well past real models


def implementation_choices(config: Any) -> dict[str, Any]:
    """``{"_attn_implementation": "sdpa", "text_config._attn_implementation": "eager"}``.

    Every ``_<kind>_implementation`` of ``config`` and of its sub-configs, keyed by its dotted
    attribute path. A value that is not a string or None (which transformers never stores) is
    kept as ``{"unsupported": <type name>}``, so replay refuses it rather than dropping it.
    """
    out: dict[str, Any] = {}
    _collect(config, "", out, 0)
    return out


def _collect(config: Any, prefix: str, out: dict[str, Any], depth: int) -> None:
    try:
        attrs = dict(vars(config))
    except TypeError:
        return
    for name, value in attrs.items():
        match = _INTERNAL.match(name)
        if match:
            key = f"{prefix}_{match.group(1)}_implementation"
            plain = value is None or type(value) is str
            out[key] = value if plain else {"unsupported": type(value).__name__}
        elif depth < _MAX_DEPTH and is_config(value):
            _collect(value, f"{prefix}{name}.", out, depth + 1)


def is_config(value: Any) -> bool:
    """Whether ``value`` is a config object: its class has ``to_dict`` and ``from_dict``."""
    cls = type(value)
    return callable(getattr(cls, "to_dict", None)) and callable(getattr(cls, "from_dict", None))
