"""Jobs on a Redis Stream, run by worker processes (``nnetc worker``): the service's
job queue when ``NNETC_QUEUE=redis`` (SPEC section 2, "Workers").

API side (``RedisJobQueue``, the ``JobQueue`` interface): ``submit`` adds the job
(service/jobs.py wire form, with this process's reply stream and a deadline) to the
stream ``nnetc:jobs`` and returns a Future; one listener thread reads the process's
reply stream ``nnetc:replies:<process id>`` and resolves the futures.

Worker side (``RedisWorker``): a consumer of the group ``workers`` reads up to
``max_batch`` jobs at a time; compute jobs with equal batch keys run as one computation
along n (Operations.compute_batch), infer jobs of one model and options together
(Operations.infer_batch), the others one by one, in order; each reply goes to
its job's reply stream, then the job is acknowledged and deleted.  A job read by a worker
that dies before acknowledging it stays pending in the group; live workers claim jobs
pending for longer than ``claim_idle_s`` (XAUTOCLAIM) and run them: the job is
redelivered -- up to ``max_deliveries`` times: a job every worker running it died with
(a poison job) is then answered with an error (500 JobKilledWorkers) instead of taking
the next worker down too.  Jobs past their deadline (the API has answered 504 already)
are dropped unstarted -- checked when read and again before each job or batch runs --
and long infer work and stream pushes stop between chunks once it passes (a push is then
undone: service/deadlines.py), answered with Cancelled (which the API, if still waiting,
answers with its 504).
Each worker refreshes a heartbeat key (``nnetc:worker:<name>``, expiring) so that the
API's ``/readyz`` can tell whether any worker is running.

Redelivery runs a job again from the start: compile, compute and infer have no side
effects; a stream push that is redelivered after its checkpoint was saved is refused by
the stream's offset check when the client sent an offset (service/streams.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from concurrent.futures import Future, InvalidStateError

import redis

from service import deadlines
from service.errors import ServiceError
from service.jobs import decode_job, decode_result, encode_error, encode_job, encode_result
from service.worker import job_batchers, job_handlers

log = logging.getLogger("nnetc.queue")

JOBS = "nnetc:jobs"
GROUP = "workers"
REPLIES = "nnetc:replies:"
HEARTBEAT = "nnetc:worker:"


def ensure_group(client: redis.Redis, stream: str = JOBS) -> None:
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


class RedisJobQueue:
    """The API process's side: jobs out, replies in."""

    def __init__(self, client: redis.Redis, job_timeout_s: float, maxsize: int = 1024,
                 stream: str = JOBS, metrics=None):
        self.client = client
        self.stream = stream
        self.job_timeout_s = job_timeout_s
        self.maxsize = maxsize
        self.metrics = metrics
        self.process_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.reply_stream = REPLIES + self.process_id
        self._pending: dict[str, tuple[str, Future]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- JobQueue ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._listen, name="nnetc-replies",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None
        try:
            self.client.delete(self.reply_stream)
        except redis.RedisError:
            pass

    def alive(self) -> bool:
        """The listener runs and at least one worker has a live heartbeat."""
        if self._thread is None or not self._thread.is_alive():
            return False
        return self.workers() > 0

    def workers(self) -> int:
        try:
            return sum(1 for _ in self.client.scan_iter(match=HEARTBEAT + "*", count=100))
        except redis.RedisError:
            return 0

    def depth(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, kind: str, payload: dict) -> Future:
        with self._lock:
            if len(self._pending) >= self.maxsize:
                raise ServiceError(503, "Overloaded", "too many jobs waiting for workers; "
                                                      "retry later")
        job_id = secrets.token_hex(12)
        # left pending (not "running"): a caller that gives up (run_job's timeout) cancels
        # it, and the done callback forgets the job
        future: Future = Future()
        fields = {"id": job_id, "kind": kind, "reply": self.reply_stream,
                  "deadline": f"{time.time() + self.job_timeout_s:.3f}",
                  "job": encode_job(kind, payload)}
        with self._lock:
            self._pending[job_id] = (kind, future)
        try:
            self.client.xadd(self.stream, fields)
        except redis.RedisError as e:
            with self._lock:
                self._pending.pop(job_id, None)
            raise ServiceError(503, "QueueUnavailable", f"the job queue (Redis) cannot be "
                                                        f"reached ({type(e).__name__}: {e}); "
                                                        f"retry") from None
        self._gauge()
        future.add_done_callback(lambda f, j=job_id: self._forget(j))
        return future

    def _forget(self, job_id: str) -> None:
        with self._lock:
            self._pending.pop(job_id, None)
        self._gauge()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.depth())

    def _listen(self) -> None:
        last = "0-0"          # the stream is this process's own: read it all
        while not self._stop.is_set():
            try:
                got = self.client.xread({self.reply_stream: last}, count=100, block=500)
            except redis.RedisError as e:
                log.warning("reading replies failed", extra={"error": f"{e}"})
                self._stop.wait(0.5)
                continue
            for _, entries in got or ():
                for entry_id, fields in entries:
                    last = entry_id
                    self._resolve(fields)
                try:
                    self.client.xtrim(self.reply_stream, minid=last)
                except redis.RedisError:
                    pass

    def _resolve(self, fields: dict) -> None:
        job_id = fields.get(b"id", b"").decode("ascii", "replace")
        with self._lock:
            item = self._pending.get(job_id)
        if item is None:
            return                      # answered already (timed out, or a redelivery)
        kind, future = item
        if future.done():
            return
        try:
            result = decode_result(kind, fields.get(b"result", b""))
        except BaseException as e:  # noqa: BLE001 - the job's error travels to its caller
            result, error = None, e
        else:
            error = None
        try:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        except InvalidStateError:
            pass                        # cancelled meanwhile by a caller that gave up


class RedisWorker:
    """A worker process's loop (``nnetc worker``)."""

    def __init__(self, client: redis.Redis, operations, streams, registry, max_batch: int = 8,
                 claim_idle_s: float = 30.0, name: str | None = None, stream: str = JOBS,
                 heartbeat_s: float = 5.0, max_deliveries: int = 3):
        self.client = client
        self.operations, self.streams, self.registry = operations, streams, registry
        self.max_batch = max_batch
        self.claim_idle_s = claim_idle_s
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.stream = stream
        self.heartbeat_s = heartbeat_s
        self.max_deliveries = max_deliveries
        self.handlers = job_handlers(operations, streams)
        self.batchers = job_batchers(operations)
        self._stop = threading.Event()
        self.jobs_done = 0

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        ensure_group(self.client, self.stream)
        log.info("worker started", extra={"worker": self.name})
        next_beat = next_claim = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_beat:
                    self.client.set(HEARTBEAT + self.name, "1",
                                    ex=max(1, int(3 * self.heartbeat_s)))
                    next_beat = now + self.heartbeat_s
                entries = []
                if now >= next_claim:
                    entries = self._claim()
                    next_claim = now + max(0.5, self.claim_idle_s / 4)
                if not entries:
                    got = self.client.xreadgroup(GROUP, self.name, {self.stream: ">"},
                                                 count=self.max_batch, block=500)
                    entries = [e for _, es in got or () for e in es]
            except redis.RedisError as e:
                if isinstance(e, redis.ResponseError) and "NOGROUP" in str(e):
                    # Redis lost the group (restarted without its data): make it again,
                    # so that the jobs submitted since are read instead of left waiting
                    log.warning("the worker group is gone; creating it again",
                                extra={"worker": self.name})
                    try:
                        ensure_group(self.client, self.stream)
                        continue
                    except redis.RedisError:
                        pass
                log.warning("worker cannot reach Redis", extra={"error": f"{e}"})
                # beat as soon as Redis answers again: one that came back empty has
                # lost the heartbeat, and /readyz would say no worker runs meanwhile
                next_beat = 0.0
                self._stop.wait(1.0)
                continue
            if entries:
                try:
                    self.process(entries)
                except redis.RedisError as e:
                    # replies or acknowledgements lost: the jobs stay pending and are
                    # claimed again once Redis answers
                    log.warning("worker lost Redis while answering", extra={"error": f"{e}"})
                    self._stop.wait(1.0)
        try:
            self.client.delete(HEARTBEAT + self.name)
        except redis.RedisError:
            pass

    def _claim(self) -> list:
        """Jobs left pending by a worker that stopped answering."""
        res = self.client.xautoclaim(self.stream, GROUP, self.name,
                                     min_idle_time=int(self.claim_idle_s * 1000),
                                     start_id="0-0", count=self.max_batch)
        claimed = [e for e in res[1] if e[1]]
        if not claimed:
            return []
        # a job that has taken down several workers already (each delivery to a worker
        # that died with it) is answered with an error instead of being run again
        ids = [e[0] for e in claimed]
        pending = self.client.xpending_range(self.stream, GROUP, min=min(ids), max=max(ids),
                                             count=len(ids) + 100, consumername=self.name)
        deliveries = {p["message_id"]: p["times_delivered"] for p in pending}
        keep = []
        for entry in claimed:
            n = deliveries.get(entry[0], 1)
            if n > self.max_deliveries:
                log.error("dropping a job that every worker running it died with",
                          extra={"worker": self.name, "deliveries": n})
                self._reply((entry[0], entry[1], entry[1].get(b"kind", b"").decode(
                    "ascii", "replace"), None), ServiceError(
                    500, "JobKilledWorkers",
                    f"this job was delivered to {n} workers and none of them finished it "
                    f"(each stopped while running it); it is not run again"))
            else:
                keep.append(entry)
        if keep:
            log.warning("redelivered jobs of a worker that stopped",
                        extra={"worker": self.name, "jobs": len(keep)})
        return keep

    def _metrics(self):
        return getattr(self.operations, "metrics", None)

    def _expired(self, job) -> bool:
        """Whether ``job`` is past its deadline; if so it is dropped without running
        or answering (the API has given up on it and answered 504)."""
        try:
            deadline = float(job[1].get(b"deadline", b"0"))
        except ValueError:
            return False            # (a job that cannot be read fails on its own)
        if not deadlines.passed(deadline):
            return False
        deadlines.record(self._metrics(), job[2], "queued")
        self._done(job[0])
        return True

    def process(self, entries: list) -> None:
        jobs = []              # (entry id, fields, kind, payload or exception)
        for entry_id, fields in entries:
            kind = fields.get(b"kind", b"").decode("ascii", "replace")
            try:
                if self._expired((entry_id, fields, kind, None)):
                    continue
                k, payload = decode_job(fields[b"job"], self.registry)
                payload[deadlines.DEADLINE] = float(fields[b"deadline"])
                jobs.append((entry_id, fields, k, payload))
            except Exception as e:  # noqa: BLE001 - a job that cannot be read fails alone
                jobs.append((entry_id, fields, kind, e))
        # compute and infer jobs that run together, in groups; everything else in order
        groups: dict = {}
        order: list = []
        for job in jobs:
            _, _, kind, payload = job
            key = None
            if (kind in self.batchers and not isinstance(payload, Exception)
                    and self.max_batch > 1):
                try:
                    key = (kind, self.batchers[kind].key(payload))
                except Exception:  # noqa: BLE001
                    key = None
            if key is None or key[1] is None:
                order.append([job])
            elif key in groups:
                groups[key].append(job)
            else:
                groups[key] = [job]
                order.append(groups[key])
        for group in order:
            # the jobs before may have run past the deadlines of these
            group = [job for job in group if not self._expired(job)]
            if len(group) > 1:
                run = self.batchers[group[0][2]].run
                metrics = self._metrics()
                if metrics is not None:
                    metrics.jobs_per_batch.labels(kind=group[0][2]).observe(len(group))
                try:
                    results = run([j[3] for j in group])
                except Exception as e:  # noqa: BLE001 - every job of the group learns of it
                    results = [e] * len(group)
                for job, r in zip(group, results):
                    deadlines.record_if_cancelled(self._metrics(), job[2], r)
                    self._reply(job, r)
                continue
            if not group:
                continue
            job = group[0]
            _, _, kind, payload = job
            if isinstance(payload, Exception):
                self._reply(job, payload)
                continue
            try:
                result = self.handlers[kind](payload)
            except Exception as e:  # noqa: BLE001 - the job's error, not the worker's
                result = e
            deadlines.record_if_cancelled(self._metrics(), job[2], result)
            self._reply(job, result)

    def _reply(self, job, result) -> None:
        entry_id, fields, kind, _ = job
        try:
            if isinstance(result, BaseException):
                data = encode_error(result)
            else:
                data = encode_result(kind, result)
        except Exception as e:  # noqa: BLE001
            data = encode_error(e)
        reply = fields.get(b"reply")
        if reply:
            try:
                with self.client.pipeline() as pipe:
                    pipe.xadd(reply, {"id": fields.get(b"id", b""), "result": data},
                              maxlen=10000, approximate=True)
                    pipe.expire(reply, 600)   # an API process that went away leaves nothing
                    pipe.execute()
            except redis.ResponseError as e:
                # Redis refused the reply (its key is not a reply stream): no retry can
                # deliver it, so the job is done with; the jobs read with it are answered
                log.error("a job's reply cannot be written; the job is dropped",
                          extra={"worker": self.name, "error": f"{e}"})
        self._done(entry_id)
        self.jobs_done += 1

    def _done(self, entry_id) -> None:
        with self.client.pipeline() as pipe:
            pipe.xack(self.stream, GROUP, entry_id)
            pipe.xdel(self.stream, entry_id)
            pipe.execute()
