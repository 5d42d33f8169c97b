"""The core every other part of otel-gpu depends on, and which depends on none of them.

It imports nothing of otel-gpu but ``config``, ``attributes`` and ``_guard``:

- ``plan.py``: :class:`~otel_gpu.core.plan.Plan`, what a decorated function's calls must do, and
  the callable shapes (how a callable's calls bind, where its receiver is);
- ``record.py``: :class:`~otel_gpu.core.record.Call`, the record of one call, and
  :class:`~otel_gpu.core.record.CallSpan`, the light span current during it;
- ``raw.py``: the raw metadata kinds and their conversion to span attributes;
- ``stats.py``: the statistics record of a tensor and its span event;
- ``protocols.py``: every seam as a ``typing.Protocol`` (observer, host, span sink);
- ``sink.py``: where code finishing calls outside a wrapper finds the span sink;
- ``scope.py``: the instrumentation scope; ``threads.py``: a bounded call on a helper thread.
"""
