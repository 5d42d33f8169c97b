"""Metrics beside the traces (``OTEL_GPU_METRICS=true``): docs/metrics.md.

- ``names.py``: every metric name, unit and metric attribute key otel-gpu emits (the public
  contract; a test checks it against docs/metrics.md both ways).
- ``provider.py``: the ``MeterProvider`` the metrics go to (the application's, or otel-gpu's own
  with one reader per ``OTEL_GPU_LOGDEST`` destination), built once per pipeline.
- ``calls.py``: the call metrics, recorded from call records on the export thread (never on
  the caller's), with exemplars that name each call's span.
- ``gpu.py``: the GPU gauges, read through the NVML seam (``devices/nvml.py``) at collection.
- ``own.py``: otel-gpu's own counters (spans processed and dropped, queue depth, bytes the
  journal and the flight recorder wrote).
- ``summary.py``: the console's table at exit.
"""
