"""Workloads: the input signatures a program calls its functions with.

:mod:`~otel_gpu.workloads.signature` holds what makes a signature and its definition file, the
same for ``otel-gpu workloads --emit`` (which reads traces, :mod:`otel_gpu.traces.workloads`)
and for ``OTEL_GPU_WORKLOADS_DIR`` (:mod:`~otel_gpu.workloads.folder`, which writes them at
call time). See docs/workloads.md.
"""
