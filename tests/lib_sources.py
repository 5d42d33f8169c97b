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

# Receivers: an instance with a state hook (Scaler), one without (Opaque), and a class (the
# classmethod Factory.make).
RECEIVERS = """
class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def __otel_gpu_state__(self):
        return {"factor": self.factor}

    @otel_gpu.api
    def run(self, x):
        return x * self.factor

class Opaque:
    @otel_gpu.api
    def run(self, x):
        return x

class Factory:
    @otel_gpu.api
    @classmethod
    def make(cls, n):
        return torch.arange(n)
"""
