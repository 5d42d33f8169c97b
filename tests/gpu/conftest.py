"""The GPU suite: real CUDA, real graphs, real NVML. Every test here is skipped without CUDA.

Run it with ``make test-gpu`` on a machine with an NVIDIA GPU; docs/gpu.md says what it verifies.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the GPU suite; docs/gpu.md)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
