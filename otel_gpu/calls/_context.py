"""The OTel context operations of a call (read the current span, make the call's span current,
restore), without the API's layers of Python calls.

``trace.get_current_span``, ``set_span_in_context``, ``context.attach`` and ``detach`` cost about
ten Python calls a span; inside a model, where every module is a span, that is a tenth of
level 1's cost. With the SDK's default runtime context (a ``ContextVar`` holding an immutable
``Context``), the same three operations are one ``ContextVar`` read, one dict copy and one
``set``/``reset``. Any other runtime context (``OTEL_PYTHON_CONTEXT``) gets the API's functions.
"""

from __future__ import annotations

from contextvars import ContextVar, Token

from opentelemetry import context as _api
from opentelemetry import trace
from opentelemetry.context.context import Context
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.trace import INVALID_SPAN, Span

from otel_gpu.core.record import Call, CallSpan, StepLinks

__all__ = ["FAST", "STEP", "attach_span", "current_span", "detach"]

STEP: ContextVar[StepLinks | None] = ContextVar("otel_gpu.batch", default=None)
"""The batch step in force (calls/batch.py). Read only by a call whose parent is not a call
span (a root call, or one under a span of the user's inside a step): a call under a call
inherits its parent's ``batch`` slot, one attribute read."""

try:
    from opentelemetry.trace.propagation import _SPAN_KEY as _KEY

    _SPAN_KEY: str | None = _KEY
except ImportError:  # pragma: no cover - a future API without the key: the API's functions
    _SPAN_KEY = None


def _context_var() -> ContextVar[Context] | None:
    runtime = getattr(_api, "_RUNTIME_CONTEXT", None)
    if type(runtime) is not ContextVarsRuntimeContext or _SPAN_KEY is None:
        return None
    var = getattr(runtime, "_current_context", None)
    return var if isinstance(var, ContextVar) else None


_VAR = _context_var()
FAST = _VAR is not None
"""True when the SDK's ContextVar runtime context is in use and read directly."""


def _api_attach(span: Span) -> Token[Context]:
    return _api.attach(trace.set_span_in_context(span))


if _VAR is not None:
    _get, _set, _reset = _VAR.get, _VAR.set, _VAR.reset
    _key: str = _SPAN_KEY or ""
    _setitem = dict.__setitem__  # Context forbids item assignment; the copy is ours alone

    def current_span() -> Span:
        """``trace.get_current_span()``."""
        span = _get().get(_key)
        # a decorated call's span (a model's parent module) or a batch step's: no ABC check
        if type(span) is Call or type(span) is CallSpan:
            return span
        return span if isinstance(span, Span) else INVALID_SPAN

    def attach_span(span: Span) -> Token[Context]:
        """``context.attach(trace.set_span_in_context(span))``."""
        new = Context(_get())
        _setitem(new, _key, span)
        return _set(new)

    def detach(token: Token[Context]) -> None:
        """``context.detach(token)``: a token of another context is logged by the API, never raised."""
        try:
            _reset(token)
        except Exception:
            _api.detach(token)  # fails the same way, and logs it as the API does

else:
    current_span = trace.get_current_span
    attach_span = _api_attach
    detach = _api.detach
