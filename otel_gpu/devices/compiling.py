"""Whether the calling thread is being traced by ``torch.compile`` or ``torch.export``.

The seam to the compiler, decided once at import: the decorator's wrappers take the compiled
body (:mod:`otel_gpu.calls.compiled`) where it says so, and the NVTX observer opens no range.
``torch.compiler.is_compiling()`` reads a process-wide flag, true on every thread while any
thread compiles; ``torch.compiler.is_dynamo_compiling()`` is a constant ``True`` in traced code
and ``False`` at run time on every thread, so the thread that traces is told apart.
"""

from __future__ import annotations

import torch

__all__ = ["SUPPORTED", "is_compiling", "is_exporting"]

# The ops need torch.library.register_fake (torch >= 2.4); without it the wrapper never takes
# the compiled path, and a compiled graph breaks around decorated calls as it did before.
SUPPORTED = hasattr(torch.library, "register_fake") and hasattr(torch.compiler, "is_compiling")


def _never() -> bool:
    return False


# torch.export traces through Dynamo too, but an exported program outlives this process: it
# must not carry otel-gpu's operators nor plan ids that mean nothing elsewhere.
is_exporting = getattr(torch.compiler, "is_exporting", _never)
_compiler = torch.compiler
_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", None)
_FAKE = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)


def _fake_mode_here() -> bool:
    """Whether a FakeTensorMode is active on this thread (dispatch modes are thread-local)."""
    return _FAKE is None or torch._C._get_dispatch_mode(_FAKE) is not None


def _tracing_here() -> bool:
    """True only on the thread that traces: in code Dynamo traces (``is_dynamo_compiling`` is a
    constant True there, False at run time on every thread), or under torch.export's non-strict
    tracing, whose process-wide flag is confirmed by a fake mode active on this thread. ~0.1 µs
    a call: one call that returns False and one attribute read."""
    if _dynamo_compiling():  # type: ignore[misc]
        return True
    return _compiler._is_exporting_flag and _fake_mode_here()


if not SUPPORTED:
    is_compiling = _never
elif _dynamo_compiling is None or not hasattr(_compiler, "_is_exporting_flag"):
    is_compiling = torch.compiler.is_compiling  # older torch: the process-wide flag
else:
    is_compiling = _tracing_here
