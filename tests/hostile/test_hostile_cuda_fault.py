"""A crash journal's CUDA fault verdict, crafted: the fields ``otel-gpu recover`` puts on the
recovered spans (``otel_gpu.cuda.fault.suspect`` / ``.candidates``) come from a file, so each is
checked: wrong types are ignored, and sizes are cut to what the writer produces (a 16-hex id,
at most 64 candidates, short names), whatever the file claims."""

from __future__ import annotations

import json
import socket

import pytest
from crafted_journals import crafted_journal, dead_pid

from otel_gpu.attributes import CUDA_FAULT, CUDA_FAULT_CANDIDATES, CUDA_FAULT_SUSPECT
from otel_gpu.journal import reader, recover

_PAYLOADS = {
    "huge": {  # as large as a journal header holds (16 KiB)
        "suspect": "f" * 2000,
        "candidates": ["a" * 20] * 200 + [7, None, {"x": 1}],
        "names": ["n" * 1000] * 3,
        "error": "e" * 1000,
    },
    "wrong_types": {"suspect": 12, "candidates": "abc", "names": {"a": 1}, "error": ["x"]},
    "not_a_dict": ["suspect", "0123456789abcdef"],
}


def _journal(tmp_path, fault) -> str:
    meta = json.dumps({"host": socket.gethostname(), "cuda_fault": fault}).encode()
    path = tmp_path / f"otel-gpu-{dead_pid()}-x.journal"
    assert len(meta) < 15 * 1024
    crafted_journal(path, int(path.name.split("-")[2]), meta=meta)
    return str(path)


@pytest.mark.parametrize("name", sorted(_PAYLOADS))
def test_a_crafted_fault_verdict_is_bounded_or_ignored(tmp_path, name):
    """Read and turned into spans without error; every value put on a span is a bounded string
    (or list of them), never the file's object."""
    path = _journal(tmp_path, _PAYLOADS[name])
    journal = reader.read(path)
    spans = recover.spans_of(journal)
    assert spans
    for span in spans:
        suspect = span.attributes.get(CUDA_FAULT_SUSPECT)
        assert suspect is None or (isinstance(suspect, str) and len(suspect) <= 16)
        candidates = span.attributes.get(CUDA_FAULT_CANDIDATES) or ()
        assert len(candidates) <= 64 and all(
            isinstance(c, str) and len(c) <= 16 for c in candidates
        )
        assert span.attributes.get(CUDA_FAULT) in (None, "kernel", "surfaced", "candidate")
    if journal.fault is not None:
        assert len(journal.fault["error"]) <= 512
        assert (
            all(len(n) <= 256 for n in journal.fault["names"]) and len(journal.fault["names"]) <= 64
        )
