"""Jobs on a Redis Stream run by worker processes (NNETC_QUEUE=redis): the API's answers
equal the in-process service's, errors keep their status and message, compute jobs are
batched by the worker, a job left by a dead worker is redelivered, a real `nnetc worker`
process serves and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import redis

from service.redis_queue import GROUP, JOBS, ensure_group
from tests.service.conftest import (TINY_CONFIG, ThreadWorker, decode, encode, make_client,
                                    needs_redis, register, request_for)

pytestmark = needs_redis



def _wait_queued(client, n: int, timeout: float = 10.0) -> None:
    """Until ``n`` jobs wait on the stream (the API has submitted them)."""
    deadline = time.time() + timeout
    while client.xlen(JOBS) < n and time.time() < deadline:
        time.sleep(0.02)


def _compile_left_by_dead_workers(server, names: list[str]):
    """A compile job taken in turn by workers ``names`` that all died with it; then a
    live worker (claiming after 0.5 s idle) starts: (the API's response, the worker)."""
    client = redis.Redis.from_url(server.url)
    with _api(server.url) as api:
        mid = register(api, config=TINY_CONFIG)["model_id"]
        ensure_group(client)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(api.post, "/compile",
                              json={"model_id": mid, "request": request_for(0, 3)})
            _wait_queued(client, 1)
            taken = client.xreadgroup(GROUP, names[0], {JOBS: ">"}, count=1)
            assert taken and len(taken[0][1]) == 1
            entry_id = taken[0][1][0][0]
            for name in names[1:]:
                client.xclaim(JOBS, GROUP, name, min_idle_time=0, message_ids=[entry_id])
            time.sleep(0.6)                       # idle long enough to be claimed
            with ThreadWorker(server.url, claim_idle_s=0.5) as w:
                return fut.result(20), w


def _api(url, **kw):
    return make_client(redis_url=url, queue="redis", job_timeout_s=20, **kw)


def test_answers_equal_the_in_process_service(server):
    server.client().flushall()
    x = np.random.default_rng(1).standard_normal((7, 4)).astype(np.float32)
    dy = np.random.default_rng(2).standard_normal((5, 3)).astype(np.float32)
    feats = np.random.default_rng(3).standard_normal((40, 4)).astype(np.float32)
    req = request_for(0, 5, deriv=True)
    with make_client() as local:
        mid = register(local, config=TINY_CONFIG)["model_id"]
        body = {"model_id": mid, "request": {**req, "store_component_stats": True},
                "inputs": {"input": encode(x)}, "output_derivs": {"output": encode(dy)}}
        want_compute = local.post("/compute", json=body).json()
        want_compile = local.post("/compile", json={"model_id": mid, "request": req,
                                                    "listing": True}).json()
        want_infer = local.post("/infer", json={"model_id": mid, "features": encode(feats),
                                                "encoding": "base64"}).json()
    with ThreadWorker(server.url), _api(server.url) as api:
        assert register(api, config=TINY_CONFIG)["model_id"] == mid
        got = api.post("/compile", json={"model_id": mid, "request": req, "listing": True})
        assert got.status_code == 200, got.text
        g = got.json()
        assert g["computation_id"] == want_compile["computation_id"]
        assert g["stats"]["commands"] == want_compile["stats"]["commands"]
        assert g["listing"] == want_compile["listing"]
        c = api.post("/compute", json=body)
        assert c.status_code == 200, c.text
        c = c.json()
        for part in ("outputs", "input_derivs"):
            for k, m in want_compute[part].items():
                np.testing.assert_array_equal(decode(c[part][k]), decode(m))
        for comp, params in want_compute["model_gradient"].items():
            for p, m in params.items():
                np.testing.assert_array_equal(decode(c["model_gradient"][comp][p]), decode(m))
        # the statistics the computation stored travel back from the worker unchanged
        assert want_compute["component_stats"]["relu1"]["count"] == 5.0
        assert c["component_stats"] == want_compute["component_stats"]
        i = api.post("/infer", json={"model_id": mid, "features": encode(feats),
                                     "encoding": "base64"}).json()
        np.testing.assert_array_equal(decode(i["output"]), decode(want_infer["output"]))
        # streams through the worker
        sid = api.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 5}}
                       ).json()["stream_id"]
        o1 = api.post(f"/streams/{sid}/frames", json={"features": encode(feats[:23]),
                                                      "offset": 0, "encoding": "base64"})
        assert o1.status_code == 200, o1.text
        o2 = api.post(f"/streams/{sid}/finish", json={"encoding": "base64"}).json()
        streamed = np.concatenate([decode(o1.json()["output"]), decode(o2["output"])])
        assert streamed.shape == (23, 3)
        ready = api.get("/readyz").json()
        assert ready["workers"] >= 1


def test_online_ivector_streams_through_the_worker(server):
    """A stream with online i-vector rows through a Redis worker (its jobs carry the
    period and the rows) gives the in-process service's output."""
    import base64  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    d = Path(__file__).resolve().parents[1] / "data" / "inference" / "online_ivectors"
    z = np.load(d / "case.npz")
    x, rows = z["features"], z["online.fpc20_elci0_fsf1_p10"]
    model = {"binary_b64": base64.b64encode((d / "model.raw").read_bytes()).decode()}

    def run(api):
        mid = api.post("/models", json=model).json()["model_id"]
        sid = api.post("/streams", json={"model_id": mid, "online_ivector_period": 10}
                       ).json()["stream_id"]
        outs = []
        for a, b in ((0, 35), (35, 90)):
            r = api.post(f"/streams/{sid}/frames", json={
                "features": encode(x[a:b]), "online_ivectors": encode(rows[a // 10:b // 10]),
                "encoding": "base64"})
            assert r.status_code == 200, r.text
            outs.append(decode(r.json()["output"]))
        assert api.get(f"/streams/{sid}").json()["ivector_rows_received"] == 9
        r = api.post(f"/streams/{sid}/finish", json={"encoding": "base64"})
        outs.append(decode(r.json()["output"]))
        return np.concatenate([o.reshape(-1, 10) for o in outs])

    server.client().flushall()
    with make_client() as local:
        want = run(local)
    with ThreadWorker(server.url), _api(server.url) as api:
        np.testing.assert_array_equal(run(api), want)


def test_errors_keep_their_status_and_message(server):
    server.client().flushall()
    with ThreadWorker(server.url), _api(server.url) as api, make_client() as local:
        mid = register(api, config=TINY_CONFIG)["model_id"]
        register(local, config=TINY_CONFIG)
        # output t=0..2 needs input t=-1..3; give only 0..3: not computable
        bad = {"model_id": mid, "request": {
            "inputs": [{"name": "input", "indexes": [[0, t, 0] for t in range(0, 4)]}],
            "outputs": [{"name": "output", "indexes": [[0, t, 0] for t in range(0, 3)]}]}}
        r_api, r_local = api.post("/compile", json=bad), local.post("/compile", json=bad)
        assert r_api.status_code == r_local.status_code == 422
        assert r_api.json() == r_local.json()
        r = api.post("/streams/s-missing/frames", json={"features": [[0.0] * 4]})
        assert r.status_code == 404 and r.json()["error"]["field"] == "stream_id"


def test_no_worker_means_not_ready_and_timeouts(server):
    server.client().flushall()
    with make_client(redis_url=server.url, queue="redis", job_timeout_s=0.5) as api:
        r = api.get("/readyz")
        assert r.status_code == 503 and "nnetc worker" in r.json()["error"]["message"]
        mid = register(api, config=TINY_CONFIG)["model_id"]
        r = api.post("/compile", json={"model_id": mid, "request": request_for(0, 3)})
        assert r.status_code == 504
    # a worker started afterwards drops the job whose deadline has passed
    with ThreadWorker(server.url) as w:
        deadline = time.time() + 5
        while server.client().xlen(JOBS) and time.time() < deadline:
            time.sleep(0.05)
        assert server.client().xlen(JOBS) == 0 and w.worker.jobs_done == 0


def test_worker_batches_concurrent_computes(server):
    server.client().flushall()
    xs = [np.random.default_rng(k).standard_normal((5, 4)).astype(np.float32) for k in range(8)]
    with _api(server.url) as api:
        mid = register(api, config=TINY_CONFIG)["model_id"]
        body = {"model_id": mid, "request": request_for(0, 3)}
        with ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(api.post, "/compute",
                                json={**body, "inputs": {"input": encode(x)}}) for x in xs]
            _wait_queued(server.client(), 8)     # all eight queued before the worker starts
            with ThreadWorker(server.url, max_batch=8) as w:
                rs = [f.result(20) for f in futs]
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        text = w.services.metrics.render().decode()
        assert "nnetc_batch_size_count 1.0" in text and "nnetc_batch_size_sum 8.0" in text
    with make_client() as local:
        register(local, config=TINY_CONFIG)
        for x, r in zip(xs, rs):
            want = local.post("/compute", json={**body, "inputs": {"input": encode(x)}}).json()
            np.testing.assert_allclose(decode(r.json()["outputs"]["output"]),
                                       decode(want["outputs"]["output"]), rtol=1e-5, atol=1e-6)


def test_a_job_left_by_a_dead_worker_is_redelivered(server):
    server.client().flushall()
    # a worker takes the job and dies without answering
    r, w = _compile_left_by_dead_workers(server, ["dead-worker"])
    assert r.status_code == 200, r.text
    assert w.worker.jobs_done == 1
    assert server.client().xpending(JOBS, GROUP)["pending"] == 0


def test_nnetc_worker_process(server):
    server.client().flushall()
    env = dict(os.environ, NNETC_REDIS_URL=server.url, NNETC_LOG_LEVEL="WARNING")
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--name", "w1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                os.path.abspath(__file__)))))
    try:
        client = redis.Redis.from_url(server.url)
        deadline = time.time() + 60
        while not client.exists("nnetc:worker:w1") and time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        with _api(server.url) as api:
            assert api.get("/readyz").status_code == 200
            mid = register(api, config=TINY_CONFIG)["model_id"]
            good = {"model_id": mid, "request": request_for(0, 3),
                    "inputs": {"input": encode(np.ones((5, 4)))}}
            # jobs that fail in the worker process get their 4xx; it goes on serving
            short = {**request_for(0, 3), "inputs": [{"name": "input", "has_deriv": False,
                                                      "indexes": [[0, 0, 0]]}]}
            r = api.post("/compute", json={**good, "request": short,
                                           "inputs": {"input": encode(np.ones((1, 4)))}})
            assert r.status_code == 422 and r.json()["error"]["type"] == "NotComputableError"
            r = api.post("/infer", json={"model_id": mid, "features": encode(np.ones((9, 6)))})
            assert r.status_code == 422 and "dimension" in r.json()["error"]["message"]
            r = api.post("/compile", json={"model_id": mid, "request": request_for(0, 3),
                                           "optimizer": {"min_deriv_time": 5,
                                                         "max_deriv_time": 1}})
            assert r.status_code == 400, r.text
            r = api.post("/compute", json=good)
            assert r.status_code == 200, r.text
            assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not client.exists("nnetc:worker:w1")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_job_given_up_by_its_caller_is_forgotten(server):
    server.client().flushall()
    with make_client(redis_url=server.url, queue="redis", job_timeout_s=0.3) as api:
        mid = register(api, config=TINY_CONFIG)["model_id"]
        assert api.post("/compile", json={"model_id": mid,
                                          "request": request_for(0, 3)}).status_code == 504
        assert api.app.state.services.queue.depth() == 0      # nothing left waiting


def test_worker_runs_infer_jobs_together(server):
    server.client().flushall()
    feats = [np.random.default_rng(k).standard_normal((25 + k, 4)).astype(np.float32)
             for k in range(4)]
    with _api(server.url) as api:
        mid = register(api, config=TINY_CONFIG)["model_id"]
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(api.post, "/infer", json={"model_id": mid, "features": encode(f)})
                    for f in feats]
            _wait_queued(server.client(), 4)
            with ThreadWorker(server.url, max_batch=8) as w:
                rs = [f.result(20) for f in futs]
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        text = w.services.metrics.render().decode()
        assert 'nnetc_jobs_per_batch_sum{kind="infer"} 4.0' in text
    with make_client() as local:
        register(local, config=TINY_CONFIG)
        for f, r in zip(feats, rs):
            want = local.post("/infer", json={"model_id": mid, "features": encode(f)}).json()
            np.testing.assert_allclose(decode(r.json()["output"]), decode(want["output"]),
                                       rtol=1e-5, atol=1e-6)


def test_a_job_that_killed_every_worker_is_answered_with_an_error(server):
    server.client().flushall()
    # three workers took it in turn and died with it
    r, w = _compile_left_by_dead_workers(server, ["dead-1", "dead-2", "dead-3"])
    assert r.status_code == 500 and r.json()["error"]["type"] == "JobKilledWorkers"
    assert "4 workers" in r.json()["error"]["message"]
    assert w.worker.jobs_done == 1          # answered, not run
    assert server.client().xpending(JOBS, GROUP)["pending"] == 0


def test_workers_make_their_group_again_when_redis_loses_it(server):
    """Redis restarted without its data (here: flushed) has no consumer group: the
    worker creates it again and the jobs submitted since are run, not left to time out."""
    server.client().flushall()
    with ThreadWorker(server.url, claim_idle_s=0.5) as w, _api(server.url) as api:
        mid = register(api, config=TINY_CONFIG)["model_id"]
        body = {"model_id": mid, "request": request_for(0, 3),
                "inputs": {"input": encode(np.ones((5, 4)))}}
        assert api.post("/compute", json=body).status_code == 200
        server.client().flushall()
        register(api, config=TINY_CONFIG)
        r = api.post("/compute", json=body)
        assert r.status_code == 200, r.text
        assert w.thread.is_alive()


def test_a_job_whose_reply_cannot_be_written_does_not_hold_up_the_others(server):
    """A job entry whose reply key Redis refuses (another type of key) is dropped; the
    job read with it is answered at once, not left pending with it for ever."""
    server.client().flushall()
    client = server.client()
    ensure_group(client)
    client.sadd("not-a-stream", "x")
    client.xadd(JOBS, {"id": "bad", "kind": "compile", "reply": "not-a-stream",
                       "deadline": f"{time.time() + 60:.3f}", "job": b"\xc1"})
    with _api(server.url) as api:
        mid = register(api, config=TINY_CONFIG)["model_id"]
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(api.post, "/compute", json={
                "model_id": mid, "request": request_for(0, 3),
                "inputs": {"input": encode(np.ones((5, 4)))}})
            _wait_queued(client, 2)
            with ThreadWorker(server.url, max_batch=8) as w:
                r = fut.result(15)
                assert r.status_code == 200, r.text
                assert w.thread.is_alive()
    assert client.xpending(JOBS, GROUP)["pending"] == 0


def test_a_worker_beats_again_as_soon_as_redis_comes_back(server):
    """Redis restarted (without its data) loses the workers' heartbeats; a worker beats
    again as soon as Redis answers, so /readyz is ready again within seconds, not after
    the worker's heartbeat period (here 60 s)."""
    server.client().flushall()
    with ThreadWorker(server.url, heartbeat_s=60) as w, _api(server.url) as api:
        deadline = time.time() + 10
        while api.get("/readyz").status_code != 200 and time.time() < deadline:
            time.sleep(0.1)
        assert api.get("/readyz").status_code == 200
        server.stop()
        server.start()
        deadline = time.time() + 15
        while api.get("/readyz").status_code != 200 and time.time() < deadline:
            time.sleep(0.2)
        r = api.get("/readyz")
        assert r.status_code == 200, r.text
        assert r.json()["workers"] == 1
        mid = register(api, config=TINY_CONFIG)["model_id"]
        assert api.post("/compute", json={"model_id": mid, "request": request_for(0, 3),
                                          "inputs": {"input": encode(np.ones((5, 4)))}}
                        ).status_code == 200
        assert w.thread.is_alive()


def test_one_bad_job_in_a_worker_batch_fails_alone(server):
    """Several clients' compute and infer jobs taken by the worker in one read, one of
    each kind bad (a request whose output cannot be computed from its inputs, found when
    the worker compiles it; features of the wrong dimension): the bad ones get their 422
    naming the fault, every other one its own correct answer."""
    server.client().flushall()
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((5, 4)).astype(np.float32) for _ in range(5)]
    feats = [rng.standard_normal((20 + 3 * k, 4)).astype(np.float32) for k in range(4)]
    bad_x, bad_f = np.ones((3, 4), np.float32), np.ones((9, 6), np.float32)
    with _api(server.url) as api:
        mid = register(api, config=TINY_CONFIG)["model_id"]
        body = {"model_id": mid, "request": request_for(0, 3)}
        jobs = ([("/compute", {**body, "inputs": {"input": encode(x)}}) for x in xs[:3]]
                + [("/compute", {"model_id": mid, "request": {
                    **request_for(0, 3), "inputs": [{"name": "input", "has_deriv": False,
                                                     "indexes": [[0, t, 0] for t in range(3)]}]},
                    "inputs": {"input": encode(bad_x)}})]
                + [("/infer", {"model_id": mid, "features": encode(f)}) for f in feats[:2]]
                + [("/infer", {"model_id": mid, "features": encode(bad_f)})]
                + [("/compute", {**body, "inputs": {"input": encode(x)}}) for x in xs[3:]]
                + [("/infer", {"model_id": mid, "features": encode(f)}) for f in feats[2:]])
        with ThreadPoolExecutor(len(jobs)) as pool:
            futs = [pool.submit(api.post, path, json=b) for path, b in jobs]
            _wait_queued(server.client(), len(jobs))     # all queued before the worker starts
            with ThreadWorker(server.url, max_batch=16) as w:
                rs = [f.result(30) for f in futs]
                assert w.thread.is_alive()
            # each kind's five jobs, the bad one with them, were taken as one batch
            text = w.services.metrics.render().decode()
            for kind in ("compute", "infer"):
                assert f'nnetc_jobs_per_batch_count{{kind="{kind}"}} 1.0' in text
                assert f'nnetc_jobs_per_batch_sum{{kind="{kind}"}} 5.0' in text
    with make_client() as local:
        register(local, config=TINY_CONFIG)
        for (path, b), r in zip(jobs, rs):
            bad = (b.get("inputs", {}).get("input") == encode(bad_x)
                   or b.get("features") == encode(bad_f))
            if bad:
                assert r.status_code == 422, r.text
                err = r.json()["error"]
                assert ("cannot be computed" in err["message"] if path == "/compute"
                        else "dimension" in err["message"]), r.text
                continue
            assert r.status_code == 200, r.text
            want = local.post(path, json=b).json()
            got, ref = ((r.json()["outputs"]["output"], want["outputs"]["output"])
                        if path == "/compute" else (r.json()["output"], want["output"]))
            np.testing.assert_allclose(decode(got), decode(ref), rtol=1e-5, atol=1e-6)
