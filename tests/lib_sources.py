"""Sources of small instrumented libraries that several test files import with ``module_factory``."""

# inner(x) = x + 1 and outer(x) = inner(x) * 2: one call nested in another.
NESTED = """
import otel_gpu

@otel_gpu.api
def inner(x):
    return x + 1

@otel_gpu.api
def outer(x):
    return inner(x) * 2
"""
