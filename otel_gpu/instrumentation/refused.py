"""Targets ``otel_gpu.instrument()`` refuses: the code otel-gpu and torch run on themselves.

A span is made by otel-gpu's own code: the first call builds the pipeline (resource detection,
exporters, the export thread), every call goes through the wrapper, and the export thread turns
records into spans with the OpenTelemetry SDK and its exporters. Instrumenting any of that makes
a call wait for the pipeline it is building (a deadlock), or makes exporting a span record new
spans without end. torch imports a few packages while it initialises; instrumenting one of them
then means building otel-gpu's wrapper from a half-initialised torch (a crash). So these are
refused, each with one line naming the target, why, and what is allowed:

- the standard library (``logging``, ``os``, ``threading``, ``importlib``, …): what otel-gpu,
  OpenTelemetry and torch run on;
- ``otel_gpu`` itself and ``opentelemetry``;
- what torch imports while it initialises (``numpy``, ``typing_extensions``, ``pynvml``,
  ``torchgen``) and what otel-gpu exports with (``google.protobuf``, ``grpc``, ``requests``,
  ``urllib3``);
- torch's internals: the ``torch`` package module itself, every private module
  (``torch._C``, ``torch._dynamo``, ``torch.utils._pytree``) and the modules otel-gpu's wrapper
  calls (``torch.cuda``, ``torch.compiler``, ``torch.library``, ``torch.autograd.grad_mode``,
  ``torch.serialization``, ``torch.backends``, ``torch.overrides``);
- a glob with no package name before its first wildcard (``*``, ``*.modeling_*``): it would
  match all of the above.

A glob that starts with a package name (``torch.*``) skips the refused modules it matches.
"""

from __future__ import annotations

import sys

__all__ = ["ALLOWED", "RefusedTarget", "refusal", "refused_module"]

ALLOWED = (
    "allowed: your own packages and libraries such as transformers.models.llama, "
    "torch.nn.functional, torch.distributed, flashinfer, or a glob that starts with a package "
    "name (transformers.models.*)"
)

_STDLIB = frozenset(sys.stdlib_module_names) | {"builtins", "__future__"}

# dotted prefixes -> why (a prefix covers its submodules)
_PREFIXES: dict[str, str] = {
    "otel_gpu": "it is otel-gpu itself",
    "opentelemetry": "otel-gpu records and exports its spans with OpenTelemetry",
    "google.protobuf": "otel-gpu's OTLP exporters encode spans with it",
    "grpc": "otel-gpu's OTLP exporter sends spans with it",
    "requests": "otel-gpu's OTLP/HTTP exporter sends spans with it",
    "urllib3": "otel-gpu's OTLP/HTTP exporter sends spans with it",
    "numpy": "torch imports it while it initialises, before otel-gpu's wrapper can be built",
    "typing_extensions": "torch imports it while it initialises",
    "pynvml": "torch imports it while it initialises and otel-gpu reads the GPUs with it",
    "torchgen": "torch imports it while it initialises",
    "torch.cuda": "otel-gpu's wrapper calls it (CUDA graph capture, devices)",
    "torch.compiler": "otel-gpu's wrapper calls it on every call (torch.compile support)",
    "torch.library": "otel-gpu registers its torch.compile operators with it",
    "torch.autograd.grad_mode": "otel-gpu's statistics run under torch.no_grad()",
    "torch.serialization": "the flight recorder saves tensors with it",
    "torch.backends": "otel-gpu reads the device versions with it",
    "torch.overrides": "torch dispatches every tensor function through it",
}
_TORCH = "torch is initialised by it and otel-gpu's wrapper is built from it"
_PRIVATE = "a private module of torch, which otel-gpu's wrapper and torch's own start run on"


class RefusedTarget(ValueError):
    """A target that would instrument what otel-gpu or torch run on (see :func:`refusal`)."""


def refused_module(name: str) -> str | None:
    """Why the module (or ``module.attr`` path) ``name`` may not be instrumented; None if it may."""
    parts = name.replace(":", ".").split(".")
    if parts[0] in _STDLIB:
        return (
            "the standard library is what otel-gpu, OpenTelemetry and torch run on while they "
            "start and export spans, so its calls cannot be spans"
        )
    for i in range(len(parts), 0, -1):
        why = _PREFIXES.get(".".join(parts[:i]))
        if why is not None:
            return why
    if parts[0] == "torch":
        if len(parts) == 1:
            return _TORCH
        if any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
            return _PRIVATE
    return None


def refusal(spec: str) -> str | None:
    """The one-line refusal of target ``spec`` (naming it, why, what is allowed), or None."""
    glob = any(c in spec for c in "*?[")
    why: str | None
    if glob and any(c in spec.split(".", 1)[0] for c in "*?["):
        why = "a glob must start with a package name; this one would match every module"
    elif glob:
        # under a refused module (numpy.*, torch.cuda.*) a glob could match only refused ones;
        # torch.* is allowed and skips them (targets.py asks refused_module() per match)
        literal = ".".join(_until_wildcard(spec.split(".")))
        why = refused_module(literal) if literal != "torch" else None
    else:
        why = refused_module(spec)
    if why is None:
        return None
    return f"target {spec!r} refused: {why}; {ALLOWED}"


def _until_wildcard(parts: list[str]) -> list[str]:
    out = []
    for part in parts:
        if any(c in part for c in "*?["):
            break
        out.append(part)
    return out
