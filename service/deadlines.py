"""Job deadlines: cooperative cancellation of work nobody waits for any more.

A job gets a deadline when it is submitted: job_timeout_s later, when the API stops
waiting and answers 504.  It is wall-clock time (``time.time()``), the same in every
process, so it travels with a job on the Redis queue (service/redis_queue.py).  The
queues hand it to the handlers in the payload (key ``deadline``); a worker does not
start a job past it, and long work stops between chunks once it has passed (the
engine's ``should_stop`` hook, engine.inference.simple.Inferencer.infer_batch), and a
compile between its phases and passes (``compiles_stopped``: around the compile of a
compile or compute job and of a stream open), raising engine.core.errors.Cancelled, which the API
answers with the 504 of a timeout.  A stream
push or finish stops between chunks as well, and is then undone: the engine's Stream.push
and finish are all or nothing, and one that passes the deadline before it is done (even
after its last chunk) puts the stream back as it was, so the client can send it again.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from engine.core.cancel import stopping_when
from engine.core.errors import Cancelled

log = logging.getLogger("nnetc.worker")

DEADLINE = "deadline"       # the payload key


def deadline_of(p: dict) -> float | None:
    return p.get(DEADLINE)


def passed(deadline: float | None) -> bool:
    return deadline is not None and time.time() >= deadline


def not_started(kind: str, deadline: float) -> Cancelled:
    """The error of a job of ``kind`` not started because ``deadline`` has passed."""
    return Cancelled(f"{kind} job not started: {time.time() - deadline:.3f} s past its "
                     f"deadline", done=0)


def check(p: dict, kind: str) -> None:
    """Cancelled when the deadline of job ``p`` (of ``kind``) has passed: not started."""
    deadline = deadline_of(p)
    if passed(deadline):
        raise not_started(kind, deadline)


def latest(deadlines: list[float | None]) -> float | None:
    """The deadline of work done for jobs with these deadlines together: the last of them
    (it is wanted until every one has passed); None when one job has none (or none is
    given)."""
    if not deadlines or any(d is None for d in deadlines):
        return None
    return max(deadlines)


def stop_hook(deadlines: list[float | None]) -> Callable[[], bool] | None:
    """The engine's ``should_stop`` for work done for jobs with these deadlines: stop when
    every one of them has passed (``latest``; None: never stop)."""
    last = latest(deadlines)
    if last is None:
        return None
    return lambda: time.time() >= last


def job_stop_hook(p: dict) -> Callable[[], bool] | None:
    """The engine's ``should_stop`` for work done for job ``p`` alone: stop once its
    deadline has passed."""
    return stop_hook([deadline_of(p)])


def compiles_stopped(p: dict):
    """A ``with`` block in which the engine's compiles for job ``p`` stop between their
    phases and passes once its deadline has passed (engine.core.cancel)."""
    return stopping_when(job_stop_hook(p))


def record(metrics, kind: str, when: str, error: BaseException | None = None) -> None:
    """Count and log a job cancelled past its deadline: ``when`` is "queued" (not started)
    or "running" (stopped between chunks)."""
    if metrics is not None:
        metrics.jobs_cancelled.labels(kind=kind, when=when).inc()
    extra = {"kind": kind, "when": when}
    done, total = getattr(error, "done", None), getattr(error, "total", None)
    if total is not None:
        extra.update(chunks_done=done, chunks_total=total)
    log.warning("job cancelled: past its deadline", extra=extra)


def record_if_cancelled(metrics, kind: str, result) -> None:
    """``record`` a job's outcome ``result`` (its value or error) when it is Cancelled:
    stopped while running, past its deadline."""
    if isinstance(result, Cancelled):
        record(metrics, kind, "running", result)
