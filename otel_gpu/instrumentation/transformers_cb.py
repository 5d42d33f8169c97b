"""Target ``transformers.continuous_batching``: transformers' continuous batching, per request.

``OTEL_GPU_INSTRUMENT=transformers.continuous_batching`` (or ``otel_gpu.instrument(...)``) patches
the classes of ``transformers.generation.continuous_batching.continuous_api``:

- **a request** gets a span, ``transformers.continuous_batching.request``, from its submission
  (``ContinuousBatchingManager.add_request``) to the delivery of its last token
  (``OutputRouter.deliver``/``deliver_batch``, failures included) or its cancellation
  (``Scheduler.clear_cancelled_requests``). It continues the caller's ``traceparent``, given as
  ``add_request(..., traceparent=...)``, ``add_requests(..., traceparents=[...])`` or
  ``generate_batch(..., traceparents=[...])`` (one per input, in order), keywords this target
  takes out before transformers sees them; without one, the span current at submission is its
  parent. A malformed ``traceparent`` is refused with one warning: the request runs, and its
  span starts a new trace. The span carries ``otel_gpu.request.id``, and the attributes given
  as ``request_attributes={...}`` (``add_requests``/``generate_batch``: one per input), which
  live control's ``request_attributes`` matches.
- **a scheduler step** (``ContinuousBatchProcessor._generation_step``) is an
  ``otel_gpu.batch`` context over the requests the scheduler put in it (the
  ``FutureRequestState`` list the step's inputs were built from), so its calls link to their
  request spans, or are children of the request span at one request. A forked sequence
  (``"{id}__child#{i}"``, ``num_return_sequences``) counts as its parent request; warm-up
  requests, which no one submitted, are not linked.
- **the forward** (``ModelRunner.compute_batch``) is a call span of its own, so every step has
  one; ``otel_gpu.instrument_module(model)`` adds the model's modules under it.

The generation loop runs on a background thread, so nothing travels through the caller's
context: the request spans wait in a table keyed by request id. With CUDA graphs, steps that
replay a graph run no module in Python: only ``compute_batch``'s span remains. With tensor
parallelism only rank 0 accepts requests, so only it makes request spans.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

from otel_gpu import _guard
from otel_gpu.attributes import REQUEST_ID
from otel_gpu.calls.batch import batch, request_context
from otel_gpu.core import sink
from otel_gpu.core.plan import Plan
from otel_gpu.core.record import Call, CallSpan

__all__ = ["REQUEST_SPAN_NAME", "SPEC", "install", "open_requests", "uninstall"]

SPEC = "transformers.continuous_batching"
"""The target's name in ``instrument()`` and ``OTEL_GPU_INSTRUMENT``."""
REQUEST_SPAN_NAME = "transformers.continuous_batching.request"
_MODULE = "transformers.generation.continuous_batching.continuous_api"
_CHILD = "__child#"
_PLAN = Plan(REQUEST_SPAN_NAME, 1)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class _Request:
    """A submitted request: its span's record (None when not recorded), what steps link to, and
    the attributes its submitter gave (live control by request attribute matches them)."""

    __slots__ = ("attributes", "call", "link", "pipe")

    def __init__(
        self,
        call: Call | None,
        link: SpanContext | None,
        pipe: Any,
        attributes: dict[str, Any] | None = None,
    ) -> None:
        self.call = call
        self.link = link
        self.pipe = pipe
        self.attributes = attributes


_requests: dict[str, _Request] = {}
_lock = threading.Lock()
_given = threading.local()  # .traceparents, .attributes: {id(input list): ...} during add_requests
_patched: list[tuple[Any, str, Any]] = []


def open_requests() -> list[str]:
    """The ids of the requests whose span is still open (submitted, not yet delivered)."""
    with _lock:
        return list(_requests)


# --------------------------------------------------------------------------- request spans


def _open(
    rid: str,
    traceparent: Any,
    caller: SpanContext | None,
    start_ns: int,
    attributes: dict[str, Any] | None = None,
) -> None:
    pipe = sink.get()
    if pipe is None:
        return
    if traceparent is not None:
        parent = request_context(traceparent)  # malformed: one warning, a new trace
    else:
        parent = caller if caller is not None and caller.is_valid else None
    if parent is not None and not parent.trace_flags.sampled:
        entry = _Request(None, parent, pipe, attributes)  # the caller's trace is not sampled
    else:
        trace_id = parent.trace_id if parent is not None else random.getrandbits(128) or 1
        sampler = pipe.root_sampler
        if parent is None and sampler is not None and not sampler(trace_id, REQUEST_SPAN_NAME):
            entry = _Request(None, None, pipe, attributes)
        else:
            ctx = SpanContext(trace_id, random.getrandbits(64) or 1, False, _SAMPLED)
            call = Call(_PLAN, CallSpan(ctx, REQUEST_SPAN_NAME), parent, start_ns)
            if attributes:
                call.span.set_attributes(attributes)
            call.span.set_attribute(REQUEST_ID, rid)
            entry = _Request(call, ctx, pipe, attributes)
    with _lock:
        _requests[rid] = entry


def _close(rid: str, error: str | None) -> None:
    with _lock:
        entry = _requests.pop(rid, None)
    if entry is None or entry.call is None:
        return
    call = entry.call
    call.end_ns = time.time_ns()
    if error:
        call.span.set_status(Status(StatusCode.ERROR, str(error)[:256]))
    entry.pipe.submit(call)


def _step_requests(
    processor: Any,
) -> tuple[dict[str, SpanContext], dict[str, dict[str, Any]]] | None:
    """The step's request ids and what each links to, from the states its inputs were built of;
    and the attributes of those that were given some."""
    ios = processor.inputs_and_outputs
    pairs = getattr(ios, "io_pairs", None)
    host = pairs[ios.current_pair].host_io if pairs is not None else ios
    out: dict[str, SpanContext] = {}
    attributes: dict[str, dict[str, Any]] = {}
    with _lock:
        for future in host.requests_in_batch:
            rid = future.state.request_id
            entry = _requests.get(rid.split(_CHILD, 1)[0])
            if entry is not None and entry.link is not None:
                out[rid] = entry.link
                if entry.attributes:
                    attributes[rid] = entry.attributes
    return (out, attributes) if out else None


# --------------------------------------------------------------------------- the wrappers


def _wrap_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """The request's span opens when ``add_request`` builds its ``RequestState`` (see
    :func:`_state_factory`), before the state is queued: the loop, on its own thread, may
    schedule it at once, and its first step must find the span."""

    def add_request(self: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        traceparent = kwargs.pop("traceparent", None)
        attributes = _checked_attributes(kwargs.pop("request_attributes", None))
        if traceparent is None:
            given = getattr(_given, "traceparents", None)
            traceparent = given.get(id(input_ids)) if given else None
        if attributes is None:
            given = getattr(_given, "attributes", None)
            attributes = given.get(id(input_ids)) if given else None
        caller: SpanContext | None = None
        try:
            caller = trace.get_current_span().get_span_context()
        except Exception as exc:
            _guard.internal_error(SPEC, exc)
        _given.submitting = [traceparent, caller, time.time_ns(), None, attributes]
        try:
            return original(self, input_ids, *args, **kwargs)
        except BaseException as exc:
            opened = _given.submitting[3]
            if opened is not None:  # built but never queued (a full queue): nothing will run
                _close(opened, f"not submitted: {type(exc).__name__}")
            raise
        finally:
            _given.submitting = None

    return add_request


def _state_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    """``RequestState`` as ``add_request`` calls it: the state, and the request's span opened."""

    def request_state(*args: Any, **kwargs: Any) -> Any:
        state = original(*args, **kwargs)
        submitting = getattr(_given, "submitting", None)
        if submitting is not None and submitting[3] is None:
            try:
                rid = str(state.request_id)
                _open(rid, submitting[0], submitting[1], submitting[2], submitting[4])
                submitting[3] = rid
            except Exception as exc:
                _guard.internal_error(SPEC, exc)
        return state

    return request_state


def _checked_attributes(attributes: Any) -> dict[str, Any] | None:
    """``request_attributes=``: a mapping of string keys (the request's attributes, e.g.
    ``{"tenant": "acme"}``), or None; anything else is the caller's :class:`TypeError`."""
    if attributes is None:
        return None
    if not isinstance(attributes, Mapping) or not all(isinstance(k, str) for k in attributes):
        raise TypeError(
            "request_attributes= takes a mapping of attribute name (str) to value, e.g. "
            f'{{"tenant": "acme"}}, not {type(attributes).__name__}'
        )
    return dict(attributes) or None


def _per_input(kwargs: dict[str, Any], name: str, inputs: Any, what: str) -> list[Any] | None:
    given = kwargs.pop(name, None)
    if given is None:
        return None
    given = list(given)
    if len(given) != len(inputs):
        raise ValueError(
            f"{name}= has {len(given)} entries for {len(inputs)} inputs: give one {what} "
            "(or None) per input, in order"
        )
    return given


def _with_per_input_keywords(original: Callable[..., Any]) -> Callable[..., Any]:
    """``add_requests``/``generate_batch``: ``traceparents=[...]`` and ``request_attributes=
    [...]``, one per input, taken out and handed to ``add_request`` by the identity of each
    input list (which both pass on as is)."""

    def wrapper(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        traceparents = _per_input(kwargs, "traceparents", inputs, "W3C traceparent")
        attributes = _per_input(kwargs, "request_attributes", inputs, "mapping of attributes")
        if traceparents is None and attributes is None:
            return original(self, inputs, *args, **kwargs)
        outer = (getattr(_given, "traceparents", None), getattr(_given, "attributes", None))
        _given.traceparents = {
            id(ids): tp for ids, tp in zip(inputs, traceparents or ()) if tp is not None
        }
        _given.attributes = {
            id(ids): checked
            for ids, a in zip(inputs, attributes or ())
            if (checked := _checked_attributes(a)) is not None
        }
        try:
            return original(self, inputs, *args, **kwargs)
        finally:
            _given.traceparents, _given.attributes = outer

    return wrapper


def _wrap_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def _generation_step(self: Any, model: Any) -> Any:
        step = None
        try:
            step = _step_requests(self)
        except Exception as exc:
            _guard.internal_error(SPEC, exc)
        if step is None:
            return original(self, model)
        with batch(requests=step[0], attributes=step[1] or None):
            return original(self, model)

    return _generation_step


def _finished(output: Any) -> None:
    try:
        if output.is_finished():
            _close(str(output.request_id), output.error)
    except Exception as exc:
        _guard.internal_error(SPEC, exc)


def _wrap_deliver(original: Callable[..., Any]) -> Callable[..., Any]:
    def deliver(self: Any, output: Any) -> Any:
        _finished(output)  # its last token: before the caller is handed the output
        return original(self, output)

    return deliver


def _wrap_deliver_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    def deliver_batch(self: Any, outputs: Any) -> Any:
        for output in outputs:
            _finished(output)
        return original(self, outputs)

    return deliver_batch


def _wrap_cancelled(original: Callable[..., Any]) -> Callable[..., Any]:
    def clear_cancelled_requests(self: Any) -> Any:
        states = original(self)
        for state in states:
            _close(str(state.request_id), None)  # cancelled: nothing is delivered
        return states

    return clear_cancelled_requests


# --------------------------------------------------------------------------- install


def install(wrap_call: Callable[[Any, str], Any]) -> list[str]:
    """Patch the continuous batching classes; ``wrap_call(fn, span_name)`` makes ``compute_batch``
    a call span (targets.py's decoration). Returns what was patched ([] without transformers'
    continuous batching)."""
    import importlib

    try:
        api = importlib.import_module(_MODULE)
        from transformers.generation.continuous_batching import model_runner, scheduler
    except ImportError:
        return []
    plan = [
        (api.ContinuousBatchingManager, "add_request", _wrap_add_request),
        (api, "RequestState", _state_factory),
        (api.ContinuousBatchingManager, "add_requests", _with_per_input_keywords),
        (api.ContinuousMixin, "generate_batch", _with_per_input_keywords),
        (api.ContinuousBatchProcessor, "_generation_step", _wrap_step),
        (api.OutputRouter, "deliver", _wrap_deliver),
        (api.OutputRouter, "deliver_batch", _wrap_deliver_batch),
        (scheduler.Scheduler, "clear_cancelled_requests", _wrap_cancelled),
        (
            model_runner.ModelRunner,
            "compute_batch",
            lambda fn: wrap_call(fn, "transformers.continuous_batching.compute_batch"),
        ),
    ]
    done = []
    for owner, name, make in plan:
        if any(o is owner and n == name for o, n, _ in _patched):
            continue
        original = owner.__dict__[name]
        wrapped = make(original)
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            try:
                setattr(wrapped, attr, getattr(original, attr))
            except (AttributeError, TypeError):
                pass
        setattr(owner, name, wrapped)
        _patched.append((owner, name, original))
        where = owner.__name__ if owner is api else f"{owner.__module__}.{owner.__qualname__}"
        done.append(f"{where}.{name}")
    return done


def uninstall() -> None:
    """Restore every patched method; requests still open are forgotten (not exported)."""
    while _patched:
        owner, name, original = _patched.pop()
        setattr(owner, name, original)
    with _lock:
        _requests.clear()
