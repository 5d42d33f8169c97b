"""Running work off the caller's thread: a step that may block (a network flush, user code)
without holding the caller, and a queue of jobs with a thread of its own."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from otel_gpu import _guard

__all__ = ["JobThread", "bounded_call"]

J = TypeVar("J")


def bounded_call(fn: Callable[[], Any], timeout: float) -> Any:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` s: exit must never hang on a
    network. Returns what ``fn`` returned, or None when it failed or did not finish in time."""
    result: list[Any] = []

    def target() -> None:
        try:
            result.append(fn())
        except Exception as exc:
            _guard.logger.debug("otel-gpu flush failed: %s", exc)

    worker = threading.Thread(target=target, name="otel-gpu-flush", daemon=True)
    worker.start()
    worker.join(timeout)
    return result[0] if result else None


class JobThread(Generic[J]):
    """A daemon thread named ``name`` that runs ``handle(job)`` for each job :meth:`put`, in
    order, from a queue of at most ``size``; ``done(job)`` runs after each, whatever happened.

    The thread starts at the first put, and again in a forked child (which inherits no thread).
    ``on_put(job)`` runs under :attr:`lock` when a job was queued, so what it counts is never
    behind what ``done`` takes back (the same lock is the caller's to use). ``handle`` reports
    its own failures; one that escapes it is an internal error of ``name``."""

    def __init__(
        self,
        name: str,
        size: int,
        handle: Callable[[J], None],
        done: Callable[[J], None] | None = None,
        on_put: Callable[[J], None] | None = None,
    ) -> None:
        self.name = name
        self.size = size
        self.lock = threading.Lock()
        self._handle, self._done, self._on_put = handle, done, on_put
        self._queue: queue.Queue[J] = queue.Queue(size)
        self._thread: threading.Thread | None = None
        self._pid = 0

    def put(self, job: J) -> bool:
        """Queue ``job``; False when the queue is full (nothing queued)."""
        with self.lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._queue = queue.Queue(self.size)  # a forked child starts with no thread
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._loop, args=(self._queue,), name=self.name, daemon=True
                )
                self._thread.start()
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                return False
            if self._on_put is not None:
                self._on_put(job)
        return True

    def flush(self, timeout: float) -> bool:
        """Wait until every job queued so far has been handled; False after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def _loop(self, jobs: queue.Queue[J]) -> None:
        while True:
            job = jobs.get()
            try:
                self._handle(job)
            except Exception as exc:
                _guard.internal_error(self.name, exc)
            finally:
                try:
                    if self._done is not None:
                        self._done(job)
                finally:
                    jobs.task_done()
