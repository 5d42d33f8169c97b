"""Building spans from call records: attributes, events, status and the provider's limits.

The export thread (or a caller helping it, see :mod:`otel_gpu.export.pipeline`) turns each
queued :class:`~otel_gpu.core.record.Call` into a finished span: an SDK ``ReadableSpan``
for an application's provider, or a ``SpanData`` for otel-gpu's own native encoders.
:class:`SpanBuilder` holds that part of the pipeline; the queue, the thread, flush and exit
stay in ``pipeline.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain, islice
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_gpu.attributes import (
    ATTRIBUTES_OMITTED,
    CUDA_FAULT,
    EVENT_EXCEPTION,
    EVENT_STATS,
    EVENTS_OMITTED,
    EXCEPTION_MESSAGE,
    INPUT_PREFIX,
    NONFINITE,
    OUTPUT_PREFIX,
)
from otel_gpu.config import Settings
from otel_gpu.core import raw
from otel_gpu.core.record import Call, ExceptionText, exception_attributes
from otel_gpu.core.scope import SCOPE
from otel_gpu.core.stats import event_attributes
from otel_gpu.devices import cuda_fault
from otel_gpu.exporters.spandata import SpanData

__all__ = ["SCOPE", "SpanBuilder", "describe_exceptions_with"]

# keys (and prefixes) whose values the export thread writes per call
_PER_CALL_KEYS = (
    INPUT_PREFIX,
    OUTPUT_PREFIX,
    NONFINITE,
    EVENTS_OMITTED,
    ATTRIBUTES_OMITTED,
)

_UNSET = Status(StatusCode.UNSET)
_payload = raw.payload_of
_kind = raw.kind_of
_OBJECT = raw.OBJECT
_exception_text: ExceptionText | None = None


def describe_exceptions_with(text: ExceptionText) -> None:
    """Format the exceptions of the spans built from now on with ``text`` (the calls' describer,
    which bounds the time an exception's ``__str__`` may take on the export thread)."""
    global _exception_text
    _exception_text = text


def _without_ids(raw: Any) -> Any:
    """``raw`` with each object's id left out (an ``.id`` attribute is written per call; an
    object with a repr has none)."""
    return tuple((k, kind, p[:2]) if kind == _OBJECT else (k, kind, p) for k, kind, p in raw)


_LAYOUTS_MAX = 1024  # layouts whose attributes are kept (a model has a few per module)


class SpanBuilder:
    """Turns call records into spans within the provider's limits. The pipeline holds one, built
    from its target provider (resource, span limits)."""

    def __init__(self, settings: Settings, provider: Any) -> None:
        self.settings = settings
        self.resource: Resource = _HashedResource(provider.resource)
        limits = getattr(provider, "_span_limits", None) or SpanLimits()
        self.max_attributes: int | None = limits.max_span_attributes
        self.max_events: int | None = limits.max_events
        # never above Tempo's 2048 default cut, also for attributes users set on the call's span
        self.max_value_len: int | None = min(limits.max_span_attribute_length or 2048, 2048)
        self._heads: dict[Any, int] = {}  # plan -> leading attributes shared by its spans
        # (plan, inputs, outputs, their payload types) -> (attributes, encoder key, dropped
        # count, where each object's id goes)
        self._layouts: dict[
            Any, tuple[dict[str, Any], object, int, tuple[tuple[str, int, int, int], ...]]
        ] = {}
        # (plan, id(inputs), id(outputs)) -> (inputs, outputs, layout): records shared between
        # calls (calls/metadata.py's ``shared``) find their layout without hashing them; the
        # records are kept, so their ids are not reused meanwhile
        self._same: dict[tuple[Any, int, int], tuple[Any, Any, Any]] = {}
        self.notes: list[Event] = []
        """Events to put on the next span built (the pipeline's drops since the last one)."""

    def materialise(self, call: Call) -> ReadableSpan:
        """Build the SDK span of one call record."""
        span = call  # the record is its span
        attrs, events, status = self._contents(call)
        step = span.batch
        if step is not None:  # a batch step's: its counts after the call's own attributes
            attrs.update(step.attributes)
        return ReadableSpan(
            name=span.name,
            context=span.get_span_context(),
            parent=call.parent,
            resource=self.resource,
            attributes=self._bounded(attrs),
            events=events,
            links=_links_of(span),
            kind=SpanKind.INTERNAL,
            status=status,
            start_time=call.start_ns,
            end_time=call.end_ns,
            instrumentation_scope=SCOPE,
        )

    def materialise_native(self, call: Call) -> SpanData:
        """The same span as :meth:`materialise`, as ``SpanData`` for otel-gpu's own encoders.

        ``BoundedAttributes`` validates every value through ABC ``isinstance`` checks
        (15–40 µs a span); here one exact-type pass proves the values need no cleaning,
        and only spans that do (long strings, unusual types, bad keys) take the SDK's path.
        """
        plan = call.plan
        span = call  # the record is its span
        n = self._heads.get(plan)
        if n is None:
            n = self._head_of(plan)
        attrs: Mapping[str, Any] | None = None
        fixed: tuple[Any, int] | None
        events: list[Event] = []
        status = span.status or _UNSET
        dropped = 0
        if (
            n
            and n == len(plan.attributes)
            and not (call.inputs or call.outputs or call.stats or span.attributes or span.events)
            and call.exc is None
            and not self.notes
        ):
            # Nothing of the call's own (level 1): its attributes are its plan's, checked once
            # per plan (``_head_of``), shared rather than copied and checked again per span.
            attrs, fixed = plan.attributes, (plan, n)
        else:
            own = span.attributes
            if (
                not (call.stats or span.events or self.notes)
                and call.exc is None
                and (not own or _device_readings(own))
            ):
                # Level 3 and 4: the attributes are a function of the plan and the captured
                # layout, which a serving loop or a model repeats: built, checked and encoded
                # once per layout.
                layout = self._layout(call)
                if layout is not None:
                    shared, hint, dropped = layout
                    limit = self.max_attributes
                    if own and (limit is None or len(shared) + len(own) <= limit):
                        if own.keys().isdisjoint(shared):  # after the shared ones: the hint holds
                            shared, own = {**shared, **own}, None
                    if not own:
                        attrs, fixed = shared, hint
        if attrs is None:
            attrs, events, status = self._contents(call)
            # The plan's attributes lead every span of the plan unchanged unless something was
            # put before them (the events-omitted count) or a user attribute overwrote one.
            head = (
                n > 0
                and next(iter(attrs)) == next(iter(plan.attributes))
                and not (span.attributes and not span.attributes.keys().isdisjoint(plan.attributes))
            )
            # the plan's own attributes, when they lead unchanged, were checked once per plan
            attrs, dropped, cleaned = self._within_limits(attrs, n if head else 0)
            fixed = (plan, n) if head and not cleaned else None
        if span.batch is not None:
            attrs = self._with_step(attrs, span.batch.attributes)
        # one construction for the three paths: no call of its own on the export thread
        return SpanData(
            span.name,
            span.get_span_context(),
            call.parent,
            call.start_ns,
            call.end_ns,
            attrs,
            events,
            _links_of(span),
            status,
            self.resource,
            SCOPE,
            fixed=fixed,
            dropped_attributes=dropped,
        )

    def _with_step(self, attrs: Mapping[str, Any], counts: dict[str, Any]) -> dict[str, Any]:
        """A batch step's counts (two ints, clean) after ``attrs``, within the count limit; the
        leading attributes, and so the ``fixed`` hint, stay as they were."""
        merged = {**attrs, **counts}
        limit = self.max_attributes
        if limit is not None and len(merged) > limit:
            merged = self._summarised(merged, limit)
        return merged

    def _within_limits(self, attrs: dict[str, Any], skip: int) -> tuple[dict[str, Any], int, bool]:
        """``attrs`` within the provider's attribute limits: summarised past the count limit
        (never dropped silently), cleaned by the SDK's ``BoundedAttributes`` when a value after the
        first ``skip`` (known clean) needs it. Returns the attributes, the count the SDK dropped,
        and whether it cleaned them."""
        limit = self.max_attributes
        if limit is not None and len(attrs) > limit:
            attrs = self._summarised(attrs, limit)
        if limit == 0 or _needs_cleaning(attrs, self.max_value_len, skip):
            bounded = BoundedAttributes(
                limit, attrs, immutable=True, max_value_len=self.max_value_len
            )
            return bounded._dict, bounded.dropped, True
        return attrs, 0, False

    def _layout(self, call: Call) -> tuple[dict[str, Any], tuple[object, int], int] | None:
        """The attributes of a call with no statistics, exception or span attributes of its own,
        shared by every such call of its plan with the same captured inputs and outputs.

        Keyed by the raw records and their payloads' types (``1 == 1.0 == True`` as tuples, but
        not as attributes); an object is keyed by its type and repr, and its ``.id`` attribute
        written per call (a model passes a new cache object to each block). A layout holding a
        float zero is never cached: ``-0.0 == 0.0``. Returns None when the records are
        unhashable. The token is the encoders' ``fixed`` key: the attributes before the first
        ``.id`` are the same in each span of the layout.
        """
        inputs, outputs = call.inputs or (), call.outputs or ()
        same_key = (call.plan, id(inputs), id(outputs))
        same = self._same.get(same_key)
        if same is not None and same[0] is inputs and same[1] is outputs:
            attrs, token, dropped, ids = same[2]  # no object: no ids to write
            return attrs, (token, len(attrs)), dropped
        kinds = tuple(map(type, map(_payload, inputs))), tuple(map(type, map(_payload, outputs)))
        objects = _OBJECT in map(_kind, inputs) or _OBJECT in map(_kind, outputs)
        if objects:
            key: Any = (call.plan, _without_ids(inputs), _without_ids(outputs), kinds)
        else:
            key = (call.plan, inputs, outputs, kinds)
        try:
            hit = self._layouts.get(key)
        except TypeError:  # an unhashable payload
            return None
        if hit is None:
            hit = self._new_layout(call, key, kinds, objects)
            if hit is None:
                return None
        if not objects:
            if len(self._same) >= _LAYOUTS_MAX:
                self._same.clear()
            self._same[same_key] = (inputs, outputs, hit)
        attrs, token, dropped, ids = hit
        if not ids:
            return attrs, (token, len(attrs)), dropped
        attrs = dict(attrs)
        for attr, which, index, _ in ids:
            attrs[attr] = f"0x{(inputs if which == 0 else outputs)[index][2][2]:x}"
        return attrs, (token, ids[0][3]), dropped

    def _new_layout(self, call: Call, key: Any, kinds: Any, objects: bool) -> Any:
        """Build, check and keep the attributes of a layout not seen yet (None: not cacheable)."""
        inputs, outputs = call.inputs or (), call.outputs or ()
        if (float in kinds[0] or float in kinds[1]) and any(
            type(p) is float and p == 0.0 for p in map(_payload, chain(inputs, outputs))
        ):
            return None
        attrs, dropped, cleaned = self._within_limits(self._contents(call)[0], 0)
        ids: list[tuple[str, int, int, int]] = []
        if objects:
            if cleaned:
                return None  # the SDK may have cut an id: it is written per call, uncut
            order = {k: i for i, k in enumerate(attrs)}
            for side, (prefix, raw) in enumerate(
                ((INPUT_PREFIX, inputs), (OUTPUT_PREFIX, outputs))
            ):
                for index, (k, kind, payload) in enumerate(raw):
                    if kind == _OBJECT and payload[1] is None:
                        attr = (prefix + k if k else prefix.rstrip(".")) + ".id"
                        if attr not in order:
                            return None
                        ids.append((attr, side, index, order[attr]))
            ids.sort(key=lambda entry: entry[3])
        layout = (attrs, object(), dropped, tuple(ids))
        if len(self._layouts) >= _LAYOUTS_MAX:
            self._layouts.clear()
            self._same.clear()
        self._layouts[key] = layout
        return layout

    def _head_of(self, plan: Any) -> int:
        """How many leading attributes every span of ``plan`` shares (the ``fixed`` hint), or 0.

        0 when a count limit could cut them, the SDK would clean them, or a key is one the
        pipeline writes per call (a decorator's ``attributes=`` may name any key).
        """
        n = len(plan.attributes)
        limit = self.max_attributes
        if (
            (limit is not None and limit <= n)
            or any(type(k) is not str or k.startswith(_PER_CALL_KEYS) for k in plan.attributes)
            or _needs_cleaning(plan.attributes, self.max_value_len)
        ):
            n = 0
        if len(self._heads) >= 4096:  # decorating in a loop must not grow this without bound
            self._heads.clear()
        self._heads[plan] = n
        return n

    def _contents(self, call: Call) -> tuple[dict[str, Any], list[Event], Status]:
        """A call's attributes (before limits), events (event limit applied) and status."""
        plan = call.plan
        span = call  # the record is its span
        limit = self.settings.repr_limit
        # Order matters when the attribute count limit cuts: what a query keys on comes first.
        attrs: dict[str, Any] = dict(plan.attributes)
        events: list[Event] = []
        if self.notes:  # drops since the last exported span (see Pipeline._note_drops)
            events, self.notes = self.notes, []
        if call.stats:
            nonfinite = False
            for result in call.stats:
                events.append(Event(EVENT_STATS, event_attributes(result), call.end_ns))
                nonfinite = nonfinite or result.nonfinite
            if nonfinite:
                attrs[NONFINITE] = True
        if span.attributes:
            attrs.update(span.attributes)
        if call.inputs:
            raw.to_attributes(INPUT_PREFIX, call.inputs, limit, attrs)
        if call.outputs:
            raw.to_attributes(OUTPUT_PREFIX, call.outputs, limit, attrs)
        if span.events:
            events.extend(Event(name, a, ts) for name, a, ts in span.events)
        status = span.status or _UNSET
        if call.exc is not None:
            exc = call.exc
            exc_attrs = exception_attributes(exc, call.tb, _exception_text)
            events.append(Event(EVENT_EXCEPTION, exc_attrs, call.end_ns))
            text = f"{type(exc).__name__}: {exc_attrs[EXCEPTION_MESSAGE]}"
            if span.attributes and span.attributes.get(CUDA_FAULT) == "surfaced":
                text = cuda_fault.surfaced_status(span.attributes, text)  # caused earlier
            status = Status(StatusCode.ERROR, text[:limit])
        if self.max_events is not None and len(events) > self.max_events:
            # keep the exception event (last) and count what the event limit cuts
            tail = events[-1:] if call.exc is not None else []
            body = events[: len(events) - len(tail)]
            keep = self.max_events - len(tail)
            attrs = {EVENTS_OMITTED: len(body) - keep, **attrs}
            events = body[:keep] + tail
        return attrs, events, status

    def _bounded(self, attrs: dict[str, Any]) -> BoundedAttributes:
        """Stay within the provider's attribute count limit: summarise, never drop silently."""
        limit = self.max_attributes
        if limit is not None and len(attrs) > limit:
            attrs = self._summarised(attrs, limit)
        return BoundedAttributes(limit, attrs, immutable=True, max_value_len=self.max_value_len)

    @staticmethod
    def _summarised(attrs: dict[str, Any], limit: int) -> dict[str, Any]:
        """The first ``limit - 1`` attributes and one naming the keys the count limit cut."""
        items = list(attrs.items())
        kept = dict(items[: limit - 1])
        omitted = [k for k, _ in items[limit - 1 :]]
        summary = (
            f"{len(omitted)} attributes omitted (attribute count limit {limit}): "
            + ", ".join(omitted)
        )
        kept[ATTRIBUTES_OMITTED] = raw.truncate(summary, raw.MAX_VALUE_BYTES)
        return kept


def _links_of(span: Any) -> Any:
    """A span's links: a batch step's shared tuple as it is (the native encoders encode it once
    per step), followed by any the user added to the span."""
    step = span.batch
    if step is None:
        return span.links or ()
    return step.links + tuple(span.links) if span.links else step.links


def _device_readings(own: dict[str, Any]) -> bool:
    """Whether a call's own attributes are all device readings (``otel_gpu.device.*`` ints,
    floats and flags, as memory per call and device time write them): values that need no
    cleaning, so they can follow a layout's shared attributes as they are."""
    for key, value in own.items():
        kind = type(value)
        if (
            type(key) is not str
            or not key.startswith(_DEVICE_PREFIX)
            or not (kind is int or kind is float or kind is bool)
        ):
            return False
    return True


_DEVICE_PREFIX = "otel_gpu.device."  # readings of the call's device: memory, device time


def _needs_cleaning(attrs: dict[str, Any], max_len: int | None, skip: int = 0) -> bool:
    """Whether ``BoundedAttributes`` might change ``attrs`` after the first ``skip`` (known clean):
    a key that is not a non-empty str, a string longer than ``max_len``, or a value other than a
    str/bool/int/float or a list or tuple of one of them. Exact types: a subclass takes the SDK's
    path, which knows what to do."""
    if skip >= len(attrs):
        return False
    for k, v in islice(attrs.items(), skip, None) if skip else attrs.items():
        if type(k) is not str or not k:
            return True
        t = type(v)
        if t is str:
            if max_len is not None and len(v) > max_len:
                return True
        elif t is int or t is float or t is bool:
            continue
        elif t is list or t is tuple:
            if not v:
                continue
            t0 = type(v[0])  # one element type: older SDKs drop mixed sequences
            if t0 is str:
                for x in v:
                    if type(x) is not str or (max_len is not None and len(x) > max_len):
                        return True
            elif t0 is int or t0 is float or t0 is bool:
                for x in v:
                    if type(x) is not t0:
                        return True
            else:
                return True
        else:
            return True
    return False


class _HashedResource(Resource):
    """The provider's resource, hashed once.

    Exporters group spans by resource, and the SDK's ``Resource.__hash__`` serialises every
    attribute to JSON on each call: ~30 µs a span with the GPU resource attributes.
    """

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash
