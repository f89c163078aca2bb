"""The job queue and the in-process worker.

Requests that compute (compile, compute, infer) become ``Job``s: a kind and a
payload.  ``JobQueue`` is the interface (submit -> a Future, depth, start,
stop); ``InProcessQueue`` runs one worker thread that takes jobs in order and
resolves each job's future with the handler's result or exception.  A Redis
Streams queue implements the same interface with payloads serialised.

One worker thread means executions never overlap, so the shared, read-only
models are never touched by two computations at once; a job that raises only
fails its own future (the worker loop catches everything), so one client's bad
input cannot disturb another's results.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from service.errors import ServiceError

log = logging.getLogger("nnetc.worker")


@dataclass
class Job:
    kind: str
    payload: dict
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)


class JobQueue(Protocol):
    def submit(self, kind: str, payload: dict) -> Future: ...
    def depth(self) -> int: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def alive(self) -> bool: ...


_STOP = object()


class InProcessQueue:
    def __init__(self, handlers: dict[str, Callable[[dict], Any]], maxsize: int = 1024,
                 metrics=None):
        self.handlers = handlers
        self.metrics = metrics
        self._q: queue.Queue = queue.Queue(maxsize=maxsize)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nnetc-worker",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(_STOP)
            self._thread.join(timeout=30)
            self._thread = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def depth(self) -> int:
        return self._q.qsize()

    def submit(self, kind: str, payload: dict) -> Future:
        if kind not in self.handlers:
            raise ValueError(f"no handler for job kind {kind!r}")
        job = Job(kind, payload)
        try:
            self._q.put_nowait(job)
        except queue.Full:
            raise ServiceError(503, "Overloaded", "the job queue is full; retry later") from None
        self._gauge()
        return job.future

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._q.qsize())

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            self._gauge()
            if job is _STOP:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            t0 = time.perf_counter()
            try:
                result = self.handlers[job.kind](job.payload)
            except Exception as e:  # noqa: BLE001 - the job's error, not the worker's
                job.future.set_exception(e)
            else:
                job.future.set_result(result)
            finally:
                if self.metrics is not None:
                    self.metrics.job_seconds.labels(kind=job.kind).observe(
                        time.perf_counter() - t0)
