"""Dynamic batching in the worker: compatible single-sequence compute jobs run as one
computation along n, each client getting its own rows; incompatible jobs keep their
order; a failing job fails alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from service.worker import Batcher, InProcessQueue
from tests.service.conftest import TINY_CONFIG, decode, encode, make_client, register, request_for


def _metric(client, prefix: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


def test_concurrent_computes_are_batched_and_equal_single_runs():
    xs = [np.random.default_rng(k).standard_normal((7, 4)).astype(np.float32) for k in range(6)]
    with make_client(max_batch=1) as solo:
        mid = register(solo, config=TINY_CONFIG)["model_id"]
        # input and output derivatives, no model derivative: mergeable
        body = {"model_id": mid, "request": {**request_for(0, 5, deriv=True),
                                             "need_model_derivative": False}}
        expected = []
        for x in xs:
            r = solo.post("/compute", json={**body, "inputs": {"input": encode(x)},
                                            "output_derivs": {"output": encode(x[:5, :3])}})
            assert r.status_code == 200, r.text
            expected.append(r.json())
    with make_client(max_batch=4, batch_delay_ms=300) as c:
        assert register(c, config=TINY_CONFIG)["model_id"] == mid

        def one(x):
            return c.post("/compute", json={**body, "inputs": {"input": encode(x)},
                                            "output_derivs": {"output": encode(x[:5, :3])}})
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(one, xs))
        for r, e in zip(got, expected):
            assert r.status_code == 200, r.text
            j = r.json()
            assert j["computation_id"] == e["computation_id"]     # its own request's id
            for part in ("outputs", "input_derivs"):
                for name, m in e[part].items():
                    np.testing.assert_allclose(decode(j[part][name]), decode(m),
                                               rtol=1e-5, atol=1e-6)
        # 6 jobs with at most 4 per batch: fewer executions than jobs, one of them batched
        count = _metric(c, "nnetc_batch_size_count")
        assert count < 6
        assert _metric(c, 'nnetc_batch_size_bucket{le="1.0"}') < count


def test_jobs_that_cannot_merge_run_alone():
    with make_client(max_batch=8, batch_delay_ms=100) as c:
        mid = register(c, config=TINY_CONFIG)["model_id"]
        grad = {"model_id": mid, "request": {**request_for(0, 3, deriv=True),
                                             "need_model_derivative": True},
                "inputs": {"input": encode(np.ones((5, 4)))},
                "output_derivs": {"output": encode(np.ones((3, 3)))}}
        two = {"model_id": mid, "request": request_for(0, 3, n=2),
               "inputs": {"input": encode(np.ones((10, 4)))}}
        with ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda b: c.post("/compute", json=b), [grad, two, grad, two]))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        assert all("model_gradient" in r.json() for r in (rs[0], rs[2]))
        assert _metric(c, "nnetc_batch_size_count") == 4.0


def _queue(handler_log, batch_log, max_batch=4, delay=0.2, fail_on=None):
    def handle(p):
        handler_log.append(p["v"])
        if p["v"] == fail_on:
            raise ValueError(f"bad job {p['v']}")
        return p["v"] * 10

    def run(ps):
        batch_log.append([p["v"] for p in ps])
        if any(p["v"] == fail_on for p in ps):
            return [ValueError("bad") if p["v"] == fail_on else p["v"] * 10 for p in ps]
        return [p["v"] * 10 for p in ps]
    q = InProcessQueue({"a": handle, "b": handle}, batchers={"a": Batcher(
        lambda p: p.get("key"), run)}, max_batch=max_batch, batch_delay_s=delay)
    return q


def test_queue_groups_by_key_and_keeps_the_order_of_the_rest():
    handled, batches = [], []
    q = _queue(handled, batches)
    gate = threading.Event()
    q.handlers["block"] = lambda p: gate.wait(5)
    q.start()
    try:
        first = q.submit("block", {})          # holds the worker while the others queue up
        futs = [q.submit("a", {"v": 1, "key": "k"}), q.submit("b", {"v": 2}),
                q.submit("a", {"v": 3, "key": "j"}), q.submit("a", {"v": 4, "key": "k"}),
                q.submit("a", {"v": 5, "key": None}), q.submit("a", {"v": 6, "key": "k"}),
                q.submit("a", {"v": 7, "key": "j"})]
        gate.set()
        first.result(5)
        assert [f.result(5) for f in futs] == [10, 20, 30, 40, 50, 60, 70]
    finally:
        q.stop()
    assert batches == [[1, 4, 6], [3, 7]]
    assert handled == [2, 5]                   # run alone, in their order
    assert q.depth() == 0


def test_a_failing_job_fails_alone_and_the_worker_goes_on():
    handled, batches = [], []
    q = _queue(handled, batches, fail_on=2)
    q.start()
    try:
        gate = threading.Event()
        q.handlers["block"] = lambda p: gate.wait(5)
        q.submit("block", {})
        futs = [q.submit("a", {"v": v, "key": "k"}) for v in (1, 2, 3)]
        gate.set()
        assert futs[0].result(5) == 10 and futs[2].result(5) == 30
        with pytest.raises(ValueError):
            futs[1].result(5)
        assert q.submit("a", {"v": 9, "key": None}).result(5) == 90
    finally:
        q.stop()


def test_no_delay_when_alone():
    """With batch_delay_s 0 a lone batchable job runs at once: looking for company,
    the worker only takes what is already queued, it never waits on the queue with a
    timeout (the waits are recorded rather than timed)."""
    handled, batches = [], []
    q = _queue(handled, batches, delay=0.0)
    waits = _recording_waits(q)
    q.start()
    try:
        assert q.submit("a", {"v": 1, "key": "k"}).result(5) == 10
    finally:
        q.stop()
    assert handled == [1] and batches == []
    assert waits == []


def _recording_waits(q) -> list:
    """The timeouts of the worker's waits on the queue (recorded, not timed)."""
    waits = []
    get = q._q.get

    def recorded_get(block=True, timeout=None):
        if block and timeout is not None:
            waits.append(timeout)
        return get(block, timeout)
    q._q.get = recorded_get
    return waits


def test_no_wait_for_company_that_is_not_on_its_way():
    """With Arrivals (the HTTP layer's count of compute/infer requests in flight) a lone
    job -- its own request the only one in flight -- runs without waiting batch_delay_s
    (30 s here) for more jobs; with a second request in flight the worker waits, and the
    second job, submitted meanwhile, joins the batch."""
    from service.worker import Arrivals
    handled, batches = [], []
    q = _queue(handled, batches, delay=30.0)
    q.arrivals = arrivals = Arrivals()
    waits = _recording_waits(q)
    q.start()
    try:
        arrivals.enter("a")
        assert q.submit("a", {"v": 1, "key": "k"}).result(5) == 10
        assert waits == [] and handled == [1]
        arrivals.enter("a")              # a second request arrives (two in flight)
        second = []
        get = q._q.get

        def get_then_submit(block=True, timeout=None):
            if block and timeout is not None and not second:
                second.append(q.submit("a", {"v": 3, "key": "k"}))
            return get(block, timeout)
        q._q.get = get_then_submit
        first = q.submit("a", {"v": 2, "key": "k"})
        assert first.result(5) == 20 and second[0].result(5) == 30
        assert batches == [[2, 3]]
    finally:
        q.stop()


def test_arrivals_count_requests_in_flight_and_return_to_zero():
    """The middleware counts POST /compute and /infer from arrival to answer, whatever the
    answer: after good ones, refused ones (413, 422, 404) and other routes, nothing is left
    counted."""
    with make_client() as c:
        arrivals = c.app.state.services.queue.arrivals
        mid = register(c, config=TINY_CONFIG)["model_id"]
        x = np.ones((5, 4), np.float32).tolist()
        assert c.post("/compute", json={"model_id": mid, "request": request_for(0, 3),
                                        "inputs": {"input": x}}).status_code == 200
        assert c.post("/compute", json={"model_id": mid, "request": request_for(0, 3),
                                        "inputs": {"input": x[:2]}}).status_code == 422
        assert c.post("/compute", json={"model_id": "0" * 64, "request": request_for(0, 3),
                                        "inputs": {"input": x}}).status_code == 404
        assert c.post("/infer", json={"model_id": mid, "features": x}).status_code == 200
        assert c.post("/compute", content=b"x" * (65 << 20),
                      headers={"content-type": "application/json"}).status_code == 413
        assert c.get("/healthz").status_code == 200
        assert arrivals("compute") == 0 and arrivals("infer") == 0


def _compute_jobs(c, xs):
    """(operations, compute payloads of TINY_CONFIG's 3-frame request, one per input)."""
    from engine.optimizer.options import OptimizeOptions  # noqa: PLC0415
    from schemas.compile import ComputationRequestModel  # noqa: PLC0415
    from service.convert import request_to_engine  # noqa: PLC0415
    services = c.app.state.services
    entry = services.registry.get(register(c, config=TINY_CONFIG)["model_id"])
    req = request_to_engine(ComputationRequestModel(**request_for(0, 3)))
    return services.operations, [
        {"entry": entry, "request": req, "options": OptimizeOptions(), "optimize": True,
         "use_shortcut": True, "inputs": {"input": x}, "output_derivs": {}} for x in xs]


def test_compute_batch_falls_back_to_one_by_one():
    with make_client() as c:
        ones = np.ones((5, 4), np.float32)
        ops, (good, bad) = _compute_jobs(c, [ones, ones[:4]])     # the second a row short
        assert ops.compute_batch_key(good) == ops.compute_batch_key(bad)
        out = ops.compute_batch([good, bad, good])
        assert isinstance(out[1], Exception)
        a, b = out[0][1].outputs["output"], out[2][1].outputs["output"]
        np.testing.assert_array_equal(a, b)
        assert a.shape == (3, 3)


def test_batches_are_padded_to_a_power_of_two():
    with make_client() as c:
        xs = [np.random.default_rng(k).standard_normal((5, 4)).astype(np.float32)
              for k in range(3)]
        ops, jobs = _compute_jobs(c, xs)
        entry, req = jobs[0]["entry"], jobs[0]["request"]
        from engine.optimizer.options import OptimizeOptions  # noqa: PLC0415
        before = len(c.app.state.services.cache)
        out = ops.compute_batch(jobs)
        singles = [ops.compute_job(j) for j in jobs]
        for (_, got), (_, want) in zip(out, singles):
            np.testing.assert_allclose(got.outputs["output"], want.outputs["output"],
                                       rtol=1e-6, atol=1e-6)
        # one merged computation of 4 sequences was compiled (3 jobs + 1 zero sequence)
        from service.cache import cache_key  # noqa: PLC0415
        merged = req.replicated(4)
        cache = c.app.state.services.cache
        assert cache.raw(cache_key(entry.structure_hash, merged, OptimizeOptions(), True,
                                   True)) is not None
        assert len(cache) == before + 2          # the merged one and the single one
        # ... and the batch size reported is the 3 jobs
        assert "nnetc_batch_size_sum 6.0" in c.get("/metrics").text     # 3 + 3 singles


def test_concurrent_infers_run_together_and_equal_single_runs():
    feats = [np.random.default_rng(k).standard_normal((30 + 7 * k, 4)).astype(np.float32)
             for k in range(5)]
    with make_client(max_batch=1) as solo:
        mid = register(solo, config=TINY_CONFIG)["model_id"]
        want = [decode(solo.post("/infer", json={
            "model_id": mid, "features": encode(f), "options": {"frames_per_chunk": 10}}
        ).json()["output"]) for f in feats]
    bad = np.ones((6, 3), np.float32)             # wrong dimension: fails alone
    with make_client(max_batch=8, batch_delay_ms=300) as c:
        register(c, config=TINY_CONFIG)

        def one(f):
            return c.post("/infer", json={"model_id": mid, "features": encode(f),
                                          "options": {"frames_per_chunk": 10}})
        with ThreadPoolExecutor(6) as pool:
            rs = list(pool.map(one, feats + [bad]))
        for r, w in zip(rs, want):
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(decode(r.json()["output"]), w, rtol=1e-5, atol=1e-6)
        assert rs[-1].status_code == 422 and "dimension" in rs[-1].json()["error"]["message"]
        text = c.get("/metrics").text
        assert 'nnetc_jobs_per_batch_count{kind="infer"}' in text
        assert _metric(c, 'nnetc_jobs_per_batch_bucket{kind="infer",le="1.0"}') == 0.0


BATCHNORM_TRAINING = """input-node name=input dim=4
component name=affine type=AffineComponent input-dim=4 output-dim=3
component-node name=affine component=affine input=input
component name=bn type=BatchNormComponent dim=3
component-node name=bn component=bn input=affine
output-node name=output input=bn
"""


def test_batch_norm_in_training_mode_keeps_each_job_alone():
    """Batch-norm in training mode (a config's default) normalises by the mean and
    variance of all the rows it computes: merged along n, one client's outputs would
    depend on the other clients' inputs (and on the zero sequences of the padding).
    Such a network's jobs never merge, and concurrent computes give what each gives
    alone."""
    # (request_for's rows: t in [-1, 5] in, [0, 5) out)
    xs = [np.random.default_rng(k).standard_normal((7, 4)).astype(np.float32) * (k + 1)
          for k in range(4)]
    body_for = {}
    with make_client(max_batch=1) as solo:
        mid = register(solo, config=BATCHNORM_TRAINING)["model_id"]
        body_for["req"] = {"model_id": mid, "request": request_for(0, 5)}
        want = []
        for x in xs:
            r = solo.post("/compute", json={**body_for["req"], "inputs": {"input": encode(x)}})
            assert r.status_code == 200, r.text
            want.append(decode(r.json()["outputs"]["output"]))
    with make_client(max_batch=4, batch_delay_ms=300) as c:
        entry = c.app.state.services.registry.get(
            register(c, config=BATCHNORM_TRAINING)["model_id"])
        assert entry.row_coupled
        assert entry.model.nnet.row_coupled_components() == ["bn"]

        def one(x):
            return c.post("/compute", json={**body_for["req"], "inputs": {"input": encode(x)}})
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, xs))
        for r, w in zip(got, want):
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(decode(r.json()["outputs"]["output"]), w,
                                       rtol=1e-5, atol=1e-6)
        # every job ran alone
        assert _metric(c, "nnetc_batch_size_count") == _metric(
            c, 'nnetc_batch_size_bucket{le="1.0"}')


def test_batch_norm_in_test_mode_merges():
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    nnet = Nnet.from_config(BATCHNORM_TRAINING, rng=np.random.default_rng(0))
    assert nnet.row_coupled_components() == ["bn"]
    nnet.set_test_mode(True)
    assert nnet.row_coupled_components() == []
    with make_client() as c:
        config = BATCHNORM_TRAINING.replace("BatchNormComponent dim=3",
                                            "BatchNormComponent dim=3 test-mode=true")
        entry = c.app.state.services.registry.get(register(c, config=config)["model_id"])
        assert not entry.row_coupled
