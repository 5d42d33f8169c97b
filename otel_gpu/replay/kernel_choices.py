"""Replay's side of the kernel-path choices the recorder keeps beside a config
(:mod:`otel_gpu.recorder.kernel_choices`): each is set back through transformers' own setter,
or replay refuses, saying why, when this process cannot run the recorded kernel.

The choices are data: a dump may only name the ``_<kind>_implementation`` properties of the
config class, and only kernels that run here without downloading anything.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from otel_gpu.recorder.kernel_choices import implementation_choices, is_config
from otel_gpu.replay.trust import Refused, Skip

__all__ = ["restore_implementation_choices"]

_PROPERTY = re.compile(r"^_[a-z0-9]+_implementation$")

_LOCAL = {
    "attn": {None, "eager", "paged|eager", "sdpa"},
    "experts": {None, "eager", "batched_mm", "grouped_mm"},
}
"""Implementations that are plain torch code: they run wherever transformers does."""
_DOWNLOADED = {"deepgemm", "sonicmoe"}
"""Experts implementations that transformers fetches from the Hugging Face hub on first use."""


def restore_implementation_choices(config: Any, choices: Any, path: str = "config") -> Any:
    """Set ``choices`` (from :func:`implementation_choices`) back on ``config``; returns ``config``.

    Raises replay's ``Skip`` when a recorded kernel cannot run here (a package not installed, a
    kernel transformers would download) and ``Refused`` for choices no recorder writes. A config
    recorded without choices (an older dump) is refused when it has such attributes: replay
    could not tell which kernels the recording ran.
    """
    if choices is None:
        if implementation_choices(config):
            raise Skip(
                f"argument {path} is a {type(config).__qualname__} recorded without its "
                "implementation choices (an older dump): replay cannot tell which attention or "
                "experts kernels the recording ran; record it again with this otel-gpu"
            )
        return config
    if not isinstance(choices, dict):
        raise Refused(f"refused: {path}: implementation choices must be an object")
    for key in sorted(choices, key=lambda k: str(k).count(".")):  # parents first: they propagate
        value = choices[key]
        *parents, name = str(key).split(".")
        if not _PROPERTY.match(name) or not all(p.isidentifier() for p in parents):
            raise Refused(f"refused: {path}: {key!r} is not a config implementation choice")
        target = config
        for part in parents:  # instance attributes only: no property of the dump's choosing runs
            target = vars(target).get(part)
            if not is_config(target):
                raise Refused(f"refused: {path}: {key!r} names no sub-config of the config")
        if not isinstance(getattr(type(target), name, None), property):
            raise Refused(f"refused: {path}: {type(target).__qualname__} has no {name}")
        if value is not None and type(value) is not str:
            raise Refused(
                f"refused: {path}.{key} was recorded as {value!r}, not an implementation name"
            )
        why = _unavailable(name.strip("_").removesuffix("_implementation"), value)
        if why:
            raise Skip(
                f"argument {path}.{key} was recorded as {value!r}, which cannot run here ({why}); "
                "replay does not run another kernel in its place, as the call would then be "
                "judged on another program"
            )
        setattr(target, name, value)
    return config


def _unavailable(kind: str, value: str | None) -> str:
    """Why the ``kind`` implementation ``value`` cannot run in this process, or ``""``."""
    if value in _LOCAL.get(kind, {None, "eager"}):
        return ""
    if kind not in _LOCAL:
        return f"replay does not know transformers' {kind} implementations"
    if "transformers" not in sys.modules:
        return "transformers is not imported"
    if kind == "experts":
        if value in _DOWNLOADED:
            return "transformers would download this kernel from the hub; replay downloads nothing"
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return "" if value in ALL_EXPERTS_FUNCTIONS else "not registered in this process"
    return _attention_unavailable(str(value))


def _attention_unavailable(value: str) -> str:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if "/" in value:
        return "a hub kernel; replay downloads nothing"
    if value not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        return "not registered in this process's transformers AttentionInterface"
    flash = re.fullmatch(r"flash_attention_(\d+)", value)
    if flash:
        from transformers.modeling_flash_attention_utils import (
            FLASH_ATTENTION_COMPATIBILITY_MATRIX as matrix,
        )

        spec = matrix.get(int(flash.group(1)))
        if spec is None or not spec["general_availability_check"]():
            return f"FlashAttention {flash.group(1)} is not installed for this device"
    if value == "flex_attention":
        from transformers.utils import is_torch_flex_attn_available

        if not is_torch_flex_attn_available():
            return "torch flex attention is not available"
    return ""
