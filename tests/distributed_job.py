"""A real ``torch.distributed`` job on CPU (gloo), one subprocess per rank, for the fleet tests.

Each rank runs :data:`PROGRAM` with otel-gpu's ``torch.distributed`` target instrumented before
``torch.distributed`` is imported, writes its spans to ``spans-<rank>.jsonl`` and its crash
journal to ``journal/``, and does ``CALLS`` ``all_reduce`` calls on 4 floats (``dist.all_reduce``,
the package alias). Options, by environment:

* ``JOB_SLEEPER=R``: rank R writes ``sleeping-R`` and sleeps (in Python, so the GIL is free)
  before its ``JOB_SLEEP_BEFORE``-th ``all_reduce``;
* ``JOB_P2P=1`` (two ranks): before the ``all_reduce`` calls, ranks 0 and 1 exchange a tensor
  every way a program can: ``send`` against ``irecv().wait()``, ``isend().wait()`` against
  ``recv``, ``send`` against ``recv``, and ``batch_isend_irecv`` on both sides;
* ``JOB_DIVERGE=R``: rank R's ``JOB_DIVERGE_AT``-th ``all_reduce`` has 8 floats, not 4; the
  group's timeout (``JOB_TIMEOUT`` seconds) then ends the job with an error on every rank.

Nothing here waits on a clock to decide a result: the tests wait for files and processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

CALLS = 12

PROGRAM = r"""
import datetime, os, sys, time

import otel_gpu
otel_gpu.instrument("torch.distributed")  # before the import: the post-import hook applies it

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
out = os.environ["JOB_DIR"]
sleeper = int(os.environ.get("JOB_SLEEPER", "-1"))
sleep_before = int(os.environ.get("JOB_SLEEP_BEFORE", "8"))
diverge = int(os.environ.get("JOB_DIVERGE", "-1"))
diverge_at = int(os.environ.get("JOB_DIVERGE_AT", "3"))
timeout = float(os.environ.get("JOB_TIMEOUT", "600"))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
try:
    if os.environ.get("JOB_P2P"):
        peer = 1 - rank
        t = torch.ones(4)
        if rank == 0:
            dist.send(t, peer)
            dist.isend(t, peer).wait()
            dist.send(t, peer)
        else:
            dist.irecv(t, peer).wait()
            dist.recv(t, peer)
            dist.recv(t, peer)
        mine = dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, peer)
        for work in dist.batch_isend_irecv([mine]):
            work.wait()
    for i in range(1, int(os.environ["JOB_CALLS"]) + 1):
        n = 8 if (rank == diverge and i == diverge_at) else 4
        t = torch.ones(n)
        if rank == sleeper and i == sleep_before:
            open(os.path.join(out, f"sleeping-{rank}"), "w").close()
            time.sleep(3600)
        dist.all_reduce(t)
    dist.barrier()
    open(os.path.join(out, f"done-{rank}"), "w").close()
finally:
    otel_gpu.flush()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    directory: Path, world: int = 4, calls: int = CALLS, **options: str
) -> list[subprocess.Popen[bytes]]:
    """Start every rank of the job; ``options`` are ``JOB_*`` variables (``JOB_SLEEPER="2"``)."""
    program = directory / "job.py"
    program.write_text(PROGRAM)
    (directory / "journal").mkdir(exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("OTEL_") and k not in ("RANK", "WORLD_SIZE")
        }
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            JOB_DIR=str(directory),
            JOB_CALLS=str(calls),
            OTEL_GPU_LOGLEVEL="3",
            OTEL_GPU_LOGDEST=str(directory / "spans-%r.jsonl"),
            OTEL_GPU_JOURNAL_DIR=str(directory / "journal"),
            OTEL_GPU_STUCK_AFTER="2",
            OTEL_GPU_STRICT="true",
            OMP_NUM_THREADS="1",
            **options,
        )
        log = open(directory / f"log-{rank}.txt", "wb")
        procs.append(
            subprocess.Popen([sys.executable, str(program)], env=env, stdout=log, stderr=log)
        )
    return procs


def wait_for(condition, what: str, limit: float = 240.0) -> None:  # type: ignore[no-untyped-def]
    """Wait, generously, for ``condition()``: a slow shared machine must not fail the test."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {limit:.0f} s")
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=60)
