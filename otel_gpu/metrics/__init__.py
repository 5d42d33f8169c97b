"""Metrics beside the traces (``OTEL_GPU_METRICS``): docs/metrics.md.

- ``names.py``: every metric name, unit and metric attribute key otel-gpu emits (the public
  contract; a test checks it against docs/metrics.md both ways).
- ``provider.py``: the ``MeterProvider`` the metrics go to (the application's, or otel-gpu's own
  with one reader per ``OTEL_GPU_LOGDEST`` destination), built once per pipeline.
- ``aggregation.py``: the call metrics of otel-gpu's own provider, aggregated on the export
  thread (never on the caller's) into the SDK's point objects, with exemplars that name each
  call's span; ``exporter.py`` adds them to each export of the official exporters.
- ``calls.py``: the same call metrics through SDK instruments, where the application's provider
  (or an exporter asking for what the aggregation does not reproduce) decides.
- ``gpu.py``: the GPU gauges, read through the NVML seam (``devices/nvml.py``) at collection.
- ``own.py``: otel-gpu's own counters (spans processed and dropped, queue depth, bytes the
  journal and the flight recorder wrote).
- ``summary.py``: the console's table at exit.
"""
