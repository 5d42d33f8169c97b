"""No folder is created until something is written into it: a process raised to level 5 by
live control (whose pipeline builds every level's observers, the flight recorder's included)
leaves no empty dump folder; the first call dumped at level 10 creates it."""

from __future__ import annotations

import torch

import otel_gpu
from otel_gpu.control import document, state


def test_a_level_5_change_creates_no_dump_folder_and_level_10_creates_it(otel_gpu_spans, tmp_path):
    """Armed level 0 raised to 5: calls recorded with statistics, and OTEL_GPU_DUMP_DIR does
    not exist; raised to 10: the first dumped call creates it, with that call in it."""
    root = tmp_path / "dumps"
    spans = otel_gpu_spans(
        level=0, control="on", dump_dir=str(root), journal_dir=str(tmp_path / "journal")
    )

    @otel_gpu.api
    def scale(x):
        return x * 2

    try:
        state.apply(document.parse({"level": 5, "for": None}), "test")
        scale(torch.ones(2))
        otel_gpu.flush()
        assert [s for s in spans.get() if s.name.endswith("scale")]
        assert not root.exists()
        state.apply(document.parse({"level": 10, "for": None}), "test")
        scale(torch.ones(2))
        otel_gpu.flush()
        assert root.is_dir() and len(list(root.iterdir())) == 1
    finally:
        state.reset("test teardown")
