"""The job queue and the in-process worker.

Requests that compute (compile, compute, infer) become ``Job``s: a kind and a
payload.  ``JobQueue`` is the interface (submit -> a Future, depth, start,
stop); ``InProcessQueue`` runs one worker thread that takes jobs in order and
resolves each job's future with the handler's result or exception.  The Redis
Streams queue (service/redis_queue.py) implements the same interface with payloads
serialised (service/jobs.py) and workers in other processes.

Dynamic batching: a kind with a ``Batcher`` (the service gives one to "compute") has
the compatible jobs waiting behind a job run with it as one call (see
InProcessQueue).

One worker thread means executions never overlap, so the shared, read-only
models are never touched by two computations at once; a job that raises only
fails its own future (the worker loop catches everything), so one client's bad
input cannot disturb another's results.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from service import deadlines
from service.errors import ServiceError

log = logging.getLogger("nnetc.worker")


@dataclass
class Job:
    kind: str
    payload: dict
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    deadline: float | None = None      # time.time() when the API stops waiting for it

    def started_payload(self) -> dict:
        """The payload as the handler gets it: with the job's deadline
        (service/deadlines.py)."""
        return {**self.payload, deadlines.DEADLINE: self.deadline}


class JobQueue(Protocol):
    def submit(self, kind: str, payload: dict) -> Future: ...
    def depth(self) -> int: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def alive(self) -> bool: ...


_STOP = object()


@dataclass
class Batcher:
    """Dynamic batching of one job kind: ``key(payload)`` is None for a job that runs
    alone, else equal for jobs that ``run(payloads)`` can do together; ``run`` returns
    one result or exception per payload, in order."""

    key: Callable[[dict], Any]
    run: Callable[[list], list]


def job_handlers(operations, streams) -> dict[str, Callable[[dict], Any]]:
    """Job kind -> handler: what the in-process worker and worker processes run."""
    return {"compile": operations.compile_job, "compute": operations.compute_job,
            "infer": operations.infer_job, "stream_open": streams.open,
            "stream_push": streams.push, "stream_finish": streams.finish,
            "stream_close": streams.close, "stream_info": streams.info}


def job_batchers(operations) -> dict[str, Batcher]:
    """The kinds whose compatible jobs run together (dynamic batching)."""
    return {"compute": Batcher(operations.compute_batch_key, operations.compute_batch),
            "infer": Batcher(operations.infer_batch_key, operations.infer_batch)}


class Arrivals:
    """Requests of the batched kinds between their arrival and their answer, counted by
    the HTTP layer (service.middleware.WireMiddleware, in the event loop): the worker
    waits for more jobs to join a batch only while more such requests are in flight than
    the batch holds -- a lone request is not held back ``batch_delay_s`` for company that
    is not on its way."""

    PATHS = {"/compute": "compute", "/infer": "infer"}

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()

    def kind_of(self, method: str, path: str) -> str | None:
        return self.PATHS.get(path) if method == "POST" else None

    def enter(self, kind: str) -> None:
        self.counts[kind] += 1

    def leave(self, kind: str) -> None:
        self.counts[kind] -= 1

    def __call__(self, kind: str) -> int:
        return self.counts[kind]


class InProcessQueue:
    """One worker thread.  With ``batchers``, a job of a batched kind is run together
    with the compatible jobs waiting behind it (up to ``max_batch``, waiting at most
    ``batch_delay_s`` for more to arrive -- with ``arrivals``, only while requests of its
    kind are in flight beyond the batch's own); incompatible jobs taken out meanwhile run
    next, in their order.  With ``job_timeout_s`` every job has a deadline that long
    after its submission (service/deadlines.py): a job past it is not started, and its
    handler is told it to stop long work there."""

    def __init__(self, handlers: dict[str, Callable[[dict], Any]], maxsize: int = 1024,
                 metrics=None, batchers: dict[str, Batcher] | None = None,
                 max_batch: int = 1, batch_delay_s: float = 0.0,
                 job_timeout_s: float | None = None, arrivals: Arrivals | None = None):
        self.handlers = handlers
        self.arrivals = arrivals
        self.job_timeout_s = job_timeout_s
        self.metrics = metrics
        self.batchers = batchers or {}
        self.max_batch = max_batch
        self.batch_delay_s = batch_delay_s
        self._q: queue.Queue = queue.Queue(maxsize=maxsize)
        self._deferred: collections.deque = collections.deque()
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
        return self._q.qsize() + len(self._deferred)

    def submit(self, kind: str, payload: dict) -> Future:
        if kind not in self.handlers:
            raise ValueError(f"no handler for job kind {kind!r}")
        job = Job(kind, payload)
        if self.job_timeout_s is not None:
            job.deadline = time.time() + self.job_timeout_s
        try:
            self._q.put_nowait(job)
        except queue.Full:
            raise ServiceError(503, "Overloaded", "the job queue is full; retry later") from None
        self._gauge()
        return job.future

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._q.qsize())

    def _next(self, timeout: float | None = None):
        if self._deferred:
            return self._deferred.popleft()
        return self._q.get(timeout=timeout) if timeout is not None else self._q.get()

    def _collect(self, job: Job, batcher: Batcher, key) -> list[Job]:
        """``job`` and the compatible jobs behind it (see the class docstring)."""
        group = [job]
        skipped: list = []
        deadline = time.perf_counter() + self.batch_delay_s
        # first the jobs already taken out earlier, then the queue
        pending = list(self._deferred)
        self._deferred.clear()
        for other in pending:
            if (len(group) < self.max_batch and other is not _STOP
                    and other.kind == job.kind and self._key(batcher, other) == key):
                group.append(other)
            else:
                skipped.append(other)
        while len(group) < self.max_batch and not (skipped and skipped[-1] is _STOP):
            wait = deadline - time.perf_counter()
            if wait > 0 and self.arrivals is not None and self._q.empty() \
                    and self.arrivals(job.kind) <= len(group):
                break       # nothing queued, and no other such request on its way
            try:
                other = self._q.get_nowait() if wait <= 0 else self._q.get(timeout=wait)
            except queue.Empty:
                break
            if (other is not _STOP and other.kind == job.kind
                    and self._key(batcher, other) == key):
                group.append(other)
            else:
                skipped.append(other)
        self._deferred.extend(skipped)
        return group

    @staticmethod
    def _key(batcher: Batcher, job: Job):
        try:
            return batcher.key(job.payload)
        except Exception:  # noqa: BLE001 - such a job runs alone and reports its own error
            return None

    def _loop(self) -> None:
        while True:
            job = self._next()
            self._gauge()
            if job is _STOP:
                return
            if not self._start(job):
                continue
            batcher = self.batchers.get(job.kind)
            key = self._key(batcher, job) if batcher is not None and self.max_batch > 1 else None
            if key is not None:
                group = self._collect(job, batcher, key)
                group = [job] + [j for j in group[1:] if self._start(j)]
                self._gauge()
                if len(group) > 1:
                    self._run_group(batcher, group)
                    continue
            self._run_one(job)

    def _start(self, job: Job) -> bool:
        """Whether to run ``job`` now: not when its caller gave up (cancelled it) or its
        deadline has passed (it is answered with Cancelled, the 504 of a timeout)."""
        if not job.future.set_running_or_notify_cancel():
            deadlines.record(self.metrics, job.kind, "queued")
            return False
        if deadlines.passed(job.deadline):
            job.future.set_exception(deadlines.not_started(job.kind, job.deadline))
            deadlines.record(self.metrics, job.kind, "queued")
            return False
        return True

    def _run_one(self, job: Job) -> None:
        t0 = time.perf_counter()
        try:
            result = self.handlers[job.kind](job.started_payload())
        except Exception as e:  # noqa: BLE001 - the job's error, not the worker's
            deadlines.record_if_cancelled(self.metrics, job.kind, e)
            job.future.set_exception(e)
        else:
            job.future.set_result(result)
        finally:
            if self.metrics is not None:
                self.metrics.job_seconds.labels(kind=job.kind).observe(
                    time.perf_counter() - t0)

    def _run_group(self, batcher: Batcher, group: list[Job]) -> None:
        t0 = time.perf_counter()
        try:
            results = batcher.run([j.started_payload() for j in group])
            if len(results) != len(group):
                raise RuntimeError(f"batch handler gave {len(results)} results for "
                                   f"{len(group)} jobs")
        except Exception as e:  # noqa: BLE001 - every job of the group learns of it
            results = [e] * len(group)
        seconds = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.jobs_per_batch.labels(kind=group[0].kind).observe(len(group))
        for j, r in zip(group, results):
            if isinstance(r, BaseException):
                deadlines.record_if_cancelled(self.metrics, j.kind, r)
                j.future.set_exception(r)
            else:
                j.future.set_result(r)
            if self.metrics is not None:
                self.metrics.job_seconds.labels(kind=j.kind).observe(seconds)
