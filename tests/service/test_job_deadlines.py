"""Jobs past their deadline (job_timeout_s after submission, when the API answers 504)
stop: a long /infer between chunks (the engine's should_stop hook), a compile between
its phases (engine.core.cancel), a job not started yet
is not started -- in process and on the Redis queue -- and the worker goes on to the next
job; metrics (nnetc_jobs_cancelled_total) and logs say so.  Chunks are counted, never
timed: a patched chunk computation waits until the deadline has passed."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from engine.core.errors import Cancelled
from engine.inference.simple import Inferencer
from service.metrics import Metrics
from service.redis_queue import JOBS
from service.worker import InProcessQueue
from tests.engine.inference_nets import TDNN_PLAIN
from tests.service.conftest import ThreadWorker, encode, make_client, needs_redis

X = np.random.default_rng(11).standard_normal((2000, 8)).astype(np.float32)
TIMEOUT = 1.5


class _Chunks:
    """Counts the chunk computations of inference (Inferencer._run_batch) and, at the
    ``slow_at``-th, waits until ``wait_s`` after the patch was made (past the deadline
    of a job submitted then)."""

    def __init__(self, monkeypatch, slow_at: int, wait_s: float):
        self.runs = 0
        self.chunks = 0
        self.start = time.time()
        real = Inferencer._run_batch

        def run(inf, chunks, utts, computation):
            self.runs += 1
            self.chunks += len(chunks)
            if self.runs == slow_at:
                time.sleep(max(0.0, self.start + wait_s - time.time()))
            return real(inf, chunks, utts, computation)
        monkeypatch.setattr(Inferencer, "_run_batch", run)


class _Logs(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        logging.getLogger("nnetc.worker").addHandler(self)

    def emit(self, record):
        self.records.append(record)

    def close(self):
        logging.getLogger("nnetc.worker").removeHandler(self)
        super().close()


def _model(client) -> str:
    r = client.post("/models", json={"config": TDNN_PLAIN, "seed": 1})
    assert r.status_code in (200, 201), r.text
    return r.json()["model_id"]


def _infer(client, mid: str, x=X, fpc: int = 10):
    return client.post("/infer", json={"model_id": mid, "features": encode(x),
                                       "options": {"frames_per_chunk": fpc},
                                       "encoding": "base64"})


def _until(cond, timeout: float = 10.0) -> None:
    end = time.time() + timeout
    while not cond() and time.time() < end:
        time.sleep(0.02)
    assert cond()


def _cancelled(metrics_text: str, kind: str, when: str) -> float:
    key = f'nnetc_jobs_cancelled_total{{kind="{kind}",when="{when}"}} '
    for line in metrics_text.splitlines():
        if line.startswith(key):
            return float(line[len(key):])
    return 0.0


def test_a_long_infer_stops_between_chunks_at_its_deadline_and_the_worker_goes_on(
        monkeypatch):
    logs = _Logs()
    try:
        with make_client(job_timeout_s=TIMEOUT) as c:
            mid = _model(c)
            assert _infer(c, mid, X[:30]).status_code == 200       # compiled, warm
            # (the job is submitted just after this: its deadline is before start + 2.5 s
            # unless submitting takes a whole second)
            chunks = _Chunks(monkeypatch, slow_at=3, wait_s=TIMEOUT + 1.0)
            r = _infer(c, mid)
            assert r.status_code == 504, r.text
            assert r.json()["error"]["type"] == "Timeout"
            assert "did not finish within 1.5 s" in r.json()["error"]["message"]
            _until(lambda: _cancelled(c.get("/metrics").text, "infer", "running") == 1)
            # 200 chunks of 10 frames (one shape, 16 to a computation: 13 computations)
            # planned; it stopped before the fourth computation (the third waits past
            # the deadline; on a slow machine the deadline may pass even earlier)
            assert 1 <= chunks.runs <= 3 and chunks.chunks == chunks.runs * 16
            runs = chunks.runs
            # the worker serves the next request
            monkeypatch.undo()
            r = _infer(c, mid, X[:300])
            assert r.status_code == 200, r.text
            assert r.json()["num_frames"] == 300
        (rec,) = [r for r in logs.records if r.getMessage().startswith("job cancelled")]
        assert (rec.kind, rec.when) == ("infer", "running")
        assert (rec.chunks_done, rec.chunks_total) == (runs, 13)
    finally:
        logs.close()


def test_a_compile_stops_at_its_deadline_and_nothing_is_cached(monkeypatch):
    """A compile (of /compile, or inside /compute) is stopped between the compiler's
    phases once its deadline has passed (engine.core.cancel): the patched graph build
    waits past it, and the compile stops at the checkpoint after the graph instead of
    going on to the steps, commands and optimizer passes.  Nothing reaches the cache (the
    next compile of the request is not a hit), the worker is free for it, and
    nnetc_jobs_cancelled_total{kind="compile",when="running"} counts the stop."""
    import engine.compiler.graph as graph_module  # noqa: PLC0415
    import engine.optimizer.pipeline as pipeline  # noqa: PLC0415
    logs = _Logs()
    try:
        with make_client(job_timeout_s=TIMEOUT) as c:
            mid = _model(c)
            req = {"inputs": [{"name": "input", "indexes": [[0, t, 0] for t in range(-9, 30)]}],
                   "outputs": [{"name": "output", "indexes": [[0, t, 0] for t in range(21)]}]}
            start = time.time()
            real_build, real_passes = graph_module.build_computation_graph, pipeline._run_passes
            passes = []

            def slow_build(*a, **k):
                time.sleep(max(0.0, start + TIMEOUT + 1.0 - time.time()))
                return real_build(*a, **k)

            def counted_passes(*a, **k):
                passes.append(1)
                return real_passes(*a, **k)
            monkeypatch.setattr(graph_module, "build_computation_graph", slow_build)
            monkeypatch.setattr(pipeline, "_run_passes", counted_passes)
            r = c.post("/compile", json={"model_id": mid, "request": req})
            assert r.status_code == 504, r.text
            _until(lambda: _cancelled(c.get("/metrics").text, "compile", "running") == 1)
            assert passes == []                 # stopped before the optimizer
            monkeypatch.undo()
            r = c.post("/compile", json={"model_id": mid, "request": req})
            assert r.status_code == 200, r.text
            assert r.json()["cached"] is False  # the stopped compile left nothing
            assert c.post("/compile", json={"model_id": mid, "request": req}).json()["cached"]
        (rec,) = [r for r in logs.records if r.getMessage().startswith("job cancelled")]
        assert (rec.kind, rec.when) == ("compile", "running")
    finally:
        logs.close()


def test_an_in_process_job_past_its_deadline_is_not_started():
    metrics = Metrics()
    release = threading.Event()
    ran = []

    def handle(p):
        ran.append(p["n"])
        assert p["deadline"] is not None and p["deadline"] > time.time() - 5
        release.wait(10)
        return p["n"]
    q = InProcessQueue({"a": handle}, metrics=metrics, job_timeout_s=0.3)
    q.start()
    try:
        first = q.submit("a", {"n": 1})
        _until(lambda: ran == [1])
        second = q.submit("a", {"n": 2})
        time.sleep(0.4)                  # its deadline passes while the first job runs
        release.set()
        assert first.result(5) == 1
        with pytest.raises(Cancelled):
            second.result(5)
        third = q.submit("a", {"n": 3})
        assert third.result(5) == 3 and ran == [1, 3]
    finally:
        release.set()
        q.stop()
    assert _cancelled(metrics.render().decode(), "a", "queued") == 1


@needs_redis
def test_queue_workers_stop_and_skip_jobs_past_their_deadline(server, monkeypatch):
    """Two infer jobs of different options read together by one worker: the first stops
    between chunks at its deadline, the second -- whose deadline passed meanwhile -- is
    not started; both clients get 504 and the worker answers the next job."""
    server.client().flushall()
    with make_client(redis_url=server.url, queue="redis", job_timeout_s=TIMEOUT) as api:
        mid = _model(api)
        chunks = _Chunks(monkeypatch, slow_at=1, wait_s=TIMEOUT + 0.3)
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(_infer, api, mid, X, fpc) for fpc in (10, 20)]
            _until(lambda: server.client().xlen(JOBS) == 2)
            # both are submitted: their deadlines are before now + TIMEOUT, and the first
            # run waits until now + TIMEOUT + 0.3
            chunks.start = time.time()
            with ThreadWorker(server.url, max_batch=8) as w:
                rs = [f.result(20) for f in futs]
                assert [r.status_code for r in rs] == [504, 504], [r.text for r in rs]
                text = lambda: w.services.metrics.render().decode()  # noqa: E731
                _until(lambda: _cancelled(text(), "infer", "running") == 1
                       and _cancelled(text(), "infer", "queued") == 1)
                assert chunks.runs == 1            # one computation, then the stop
                monkeypatch.undo()
                r = _infer(api, mid, X[:100])
                assert r.status_code == 200, r.text


def test_a_stream_opened_past_its_deadline_is_not_kept():
    """The API answered 504: nobody would learn the stream's id, so it does not stay
    (counted against max_stream_bytes) until it idles out; the compile of its looped
    computation stops at its first checkpoint and is not kept either."""
    from schemas.streams import StreamOptions  # noqa: PLC0415
    with make_client() as c:
        services = c.app.state.services
        p = {"entry": services.registry.get(_model(c)), "options": StreamOptions().model_dump(),
             "ivector": None, "online_ivector_period": None, "deadline": time.time() - 1}
        with pytest.raises(Cancelled, match="compilation stopped by its caller"):
            services.streams.open(p)         # its looped compile stopped at once
        assert len(services.streams) == 0 and services.streams.held_bytes == 0
        assert len(services.streams._looped) == 0       # and nothing of it is kept
        p["deadline"] = time.time() + 60
        services.streams.open(p)
        assert len(services.streams) == 1 and services.streams.held_bytes > 0


def _undone_push(c, monkeypatch, metrics_text) -> None:
    """A push whose chunks run past the job's deadline stops between chunks and is
    undone (engine Stream.push): the API's 504 says so, the stream's frames_received is
    as before, and sending the same frames again (with their offset) gives the output of
    a stream never interrupted, bit for bit."""
    from engine.inference.stream import Stream  # noqa: PLC0415
    from tests.engine.inference_nets import RECURRENT  # noqa: PLC0415
    from tests.service.conftest import decode  # noqa: PLC0415
    x = np.random.default_rng(4).standard_normal((120, 8)).astype(np.float32)

    def push(sid, lo, hi):
        return c.post(f"/streams/{sid}/frames", json={"features": encode(x[lo:hi]),
                                                      "offset": lo, "encoding": "base64"})

    def rows(r):
        j = r.json()
        return decode(j["output"]).reshape(-1, j["output"]["shape"][1])

    r = c.post("/models", json={"config": RECURRENT, "seed": 2})
    mid = r.json()["model_id"]
    outs = {}
    for interrupted in (False, True):
        r = c.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 6}})
        assert r.status_code == 201, r.text
        sid = r.json()["stream_id"]
        got = [rows(push(sid, 0, 10))]
        if interrupted:
            start, runs = time.time(), []
            real = Stream._run_chunk

            def slow(self, f, iv, runs=runs, start=start, real=real):
                runs.append(1)
                if len(runs) == 2:       # waits until past the deadline
                    time.sleep(max(0.0, start + TIMEOUT + 0.5 - time.time()))
                return real(self, f, iv)
            monkeypatch.setattr(Stream, "_run_chunk", slow)
            r = push(sid, 10, 100)
            assert r.status_code == 504, r.text
            msg = r.json()["error"]["message"]
            assert "is undone, the stream left as before it" in msg
            # the worker stops before the third chunk (on a slow machine the deadline may
            # pass even earlier) and undoes the push
            _until(lambda: _cancelled(metrics_text(), "stream_push", "running") == 1)
            assert 1 <= len(runs) <= 2
            monkeypatch.undo()
            info = c.get(f"/streams/{sid}").json()
            assert info["frames_received"] == 10 and info["frames_output"] == len(got[0])
        r = push(sid, 10, 100)
        assert r.status_code == 200, r.text
        got.append(rows(r))
        got.append(rows(push(sid, 100, 120)))
        r = c.post(f"/streams/{sid}/finish", json={"encoding": "base64"})
        assert r.status_code == 200, r.text
        got.append(rows(r))
        outs[interrupted] = np.concatenate(got, axis=0)
    assert outs[True].tobytes() == outs[False].tobytes()


def test_a_stream_push_past_its_deadline_is_undone_and_can_be_sent_again(monkeypatch):
    with make_client(job_timeout_s=TIMEOUT) as c:
        _undone_push(c, monkeypatch, lambda: c.get("/metrics").text)


@needs_redis
def test_a_queue_worker_undoes_a_stream_push_past_its_deadline(server, monkeypatch):
    """The same through the Redis queue and a worker of its own, the stream checkpointed in
    Redis: the undone push saves no checkpoint, so whichever process takes the stream next
    continues from the state before it."""
    server.client().flushall()
    with make_client(redis_url=server.url, queue="redis", job_timeout_s=TIMEOUT) as api:
        with ThreadWorker(server.url) as w:
            _undone_push(api, monkeypatch, lambda: w.services.metrics.render().decode())
