"""``otel_gpu.instrument_module()``: a span for every submodule call of a ``torch.nn.Module`` tree.

Each submodule's ``forward`` is wrapped on the instance, so spans are named by the module's path
in the tree (``model.layers.3.self_attn``; the root by its class name) and nest as the calls
do. The class is the attribute ``otel_gpu.module.class``, the path ``otel_gpu.module.path``.
Parameters are never recorded as arguments. With ``OTEL_GPU_MODULE_PARAM_STATS`` at level 5,
the first call of each module adds statistics of its own parameters (event
``otel_gpu.param_stats``), so a weight that turned NaN is visible.

Why instance wrappers rather than forward hooks: measured on a tiny GPT2 (docs/instrument.md),
a pre/post hook pair forces ``nn.Module.__call__`` off its no-hook fast path and cannot see the
exception a forward raised, while a wrapper costs one extra Python call and sees everything.
The wrapper is a method bound to its module, so ``copy.deepcopy(model)`` rebinds it to the copy.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import types
from collections.abc import Sequence
from typing import Any

import torch

from otel_gpu import _guard, config
from otel_gpu.attributes import EVENT_PARAM_STATS, MODULE_CLASS, MODULE_PATH, NONFINITE
from otel_gpu.calls._context import current_span
from otel_gpu.calls.compiled import is_compiling as _is_compiling
from otel_gpu.core.record import Call

__all__ = ["instrument_module", "uninstrument_module"]

_ORIGINAL = "__otel_gpu_original__"
_UNIMPLEMENTED = torch.nn.Module.forward
_NO_FORWARD = object()  # the module had no instance-level forward: restore by deleting ours


def instrument_module(
    model: Any,
    *,
    depth: int | None = None,
    include: Sequence[str] | str | None = None,
    name: str | None = None,
) -> int:
    """Wrap ``forward`` of ``model`` and its submodules; returns how many were wrapped.

    ``depth``: how many dotted path components below the root (0 = the root only;
    ``layers.3`` is 2 deep). ``include``: fnmatch patterns on the
    path (``layers.*.self_attn``) or the class name (``*Attention``). ``name``: the root's span
    name (default: its class name). Idempotent; nothing is wrapped at level 0
    unless the process is controllable (``OTEL_GPU_CONTROL=on``).
    """
    settings = config.current()
    if settings.level == 0 and not settings.controllable:
        return 0  # armed (OTEL_GPU_CONTROL=on): level-0 trampolines that control can raise
    if settings.level >= 10:
        _guard.warn_once(
            "instrument_module_replay",
            "otel-gpu: level 10 under instrument_module() records every call's tensors, but "
            "`otel-gpu replay` will skip these calls: it cannot rebuild a module instance whose "
            "parameters are not recorded. For dumps that replay, instrument the model's classes "
            "instead: otel-gpu run --instrument PACKAGE.MODULE with OTEL_GPU_DUMP_MODULES=true "
            "(docs/flight-recorder.md).",
        )
    patterns = (include,) if isinstance(include, str) else tuple(include or ())
    root = name or type(model).__name__
    count = 0
    for path, module in model.named_modules():
        level = path.count(".") + 1 if path else 0
        if depth is not None and level > depth:
            continue
        if patterns and not any(
            fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(type(module).__name__, p)
            for p in patterns
        ):
            continue
        current = module.__dict__.get("forward")
        if current is not None and hasattr(getattr(current, "__func__", None), _ORIGINAL):
            continue  # idempotent
        if current is None and type(module).forward is _UNIMPLEMENTED:
            continue  # a container (ModuleList, ModuleDict): never called, no span to make
        _wrap_module(module, path or root, path, settings)
        count += 1
    return count


def uninstrument_module(model: Any) -> int:
    """Undo :func:`instrument_module` on ``model`` and its submodules; returns how many."""
    count = 0
    for _, module in model.named_modules():
        current = module.__dict__.get("forward")
        original = getattr(getattr(current, "__func__", None), _ORIGINAL, None)
        if original is None:
            continue
        if original is _NO_FORWARD:
            del module.forward
        else:
            module.forward = original
        count += 1
    return count


def _wrap_module(module: Any, span_name: str, path: str, settings: config.Settings) -> None:
    from otel_gpu.instrumentation.targets import decorate

    cls = type(module)
    original = module.__dict__.get("forward")
    if original is None:
        # the class's function itself, bound to the module below: no extra frame a span
        forward = cls.forward
    else:  # someone set an instance-level forward already (e.g. an offloading hook): keep it

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return original(*args, **kwargs)

        functools.update_wrapper(forward, original)
        try:
            sig = inspect.signature(original)
            self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
            forward.__signature__ = sig.replace(  # type: ignore[attr-defined]
                parameters=[self_param, *sig.parameters.values()]
            )
        except (TypeError, ValueError):
            pass
    if settings.module_param_stats and (settings.level >= 5 or settings.controllable):
        # with live control the level may be raised to 5 later: the wrapper is there, and asks
        # at each call whether this call is recorded at level 5 or above
        forward = _with_param_stats(forward, span_name)
    attributes = {
        MODULE_CLASS: f"{cls.__module__}.{cls.__qualname__}",
        MODULE_PATH: path,
    }
    wrapped = decorate(forward, span_name, attributes)
    wrapped.__otel_gpu_plan__.replay_note = (
        "the forward of a torch.nn.Module instance (instrument_module): replay cannot rebuild "
        "the module, whose parameters are not recorded"
    )
    setattr(wrapped, _ORIGINAL, _NO_FORWARD if original is None else original)
    # bound to the module: deepcopy(model) rebinds the copy's wrapper to the copy
    module.forward = types.MethodType(wrapped, module)


def _with_param_stats(forward: Any, span_name: str) -> Any:
    """Add the module's own parameters' statistics to the span of its first call recorded at
    level 5 or above (the level it was instrumented at, or one live control raised it to)."""
    done: set[int] = set()

    @functools.wraps(forward)
    def with_stats(self: Any, *args: Any, **kwargs: Any) -> Any:
        # under torch.compile the span is not in the OTel context: no parameter statistics
        if id(self) not in done and not _is_compiling() and _recorded_at_5(span_name):
            done.add(id(self))
            try:
                _param_events(self)
            except Exception as exc:
                _guard.internal_error("statistics", exc)
        return forward(self, *args, **kwargs)

    return with_stats


def _recorded_at_5(span_name: str) -> bool:
    """Whether the current span is this module call's own record, at level 5 or above (not the
    parent's, current when live control left this module at level 0)."""
    current = current_span()
    if not isinstance(current, Call):
        return False  # not recorded (level 0, or a head sampler's unsampled span)
    return current.name == span_name and current.plan.level >= 5


def _param_events(module: Any) -> None:
    from opentelemetry import trace

    from otel_gpu.calls import stats

    params = [(f"param.{n}", p.detach()) for n, p in module.named_parameters(recurse=False)]
    if not params:
        return
    span = trace.get_current_span()
    for result in stats.finish([stats.compute(key, t) for key, t in params]):
        attrs = stats.event_attributes(result)
        span.add_event(EVENT_PARAM_STATS, attrs)
        if result.nonfinite:
            span.set_attribute(NONFINITE, True)
