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

# A program that calls alpha(x) = x * 2 and beta(x) = x + 1 every 10 ms until sys.argv[1] +
# ".stop" exists, writing how many rounds it made to sys.argv[1] (read it with progress()):
# the running process that live control and OpAMP tests turn up and down.
ALPHA_BETA_LOOP = """
import os, sys, time
import torch
import otel_gpu

@otel_gpu.api
def alpha(x):
    return x * 2

@otel_gpu.api
def beta(x):
    return x + 1

t = torch.ones(3)
done, deadline = 0, time.time() + 600
while time.time() < deadline and not os.path.exists(sys.argv[1] + ".stop"):
    alpha(t); beta(t)
    done += 1
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(done))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(0.01)
otel_gpu.flush()
"""


def progress(path) -> int:  # type: ignore[no-untyped-def]
    """The rounds ALPHA_BETA_LOOP has made so far (0 before its first)."""
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0
