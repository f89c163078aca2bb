"""Mutated request bodies: whatever a client sends, the answer is a 2xx or a 4xx with
the error body (never a 5xx), and the service goes on computing the same numbers.

Each case starts from a valid body of one route (/compile, /compute with and without
derivatives, /infer with and without i-vectors, /models, /streams, a stream push) and
changes one to three places in it: a value replaced by one of a list of awkward ones
(wrong types, huge and negative integers, numbers beyond float32, empty and nested
containers, long strings, encoded matrices with impossible shapes), a key deleted, an
unknown key added, a number shifted, a list cut short or repeated.  The seed is fixed,
so a failure reproduces (NNETC_FUZZ_SEED and NNETC_FUZZ_CASES run others and more).
The same runs in process (bodies as JSON and as msgpack) and through the Redis job queue
and a worker, and for pushes
over a stream's WebSocket (the stream must count exactly the frames it answered for);
tests/service/test_bad_input*.py check the messages of the cases found this way."""

from __future__ import annotations

import copy
import json
import os
import random

import msgpack
import numpy as np
import pytest

from tests.engine.inference_nets import RECURRENT, TDNN_IVECTOR
from tests.service.conftest import (TINY_CONFIG, ThreadWorker, decode, encode, make_client,
                                    needs_redis, register, request_for)

AWKWARD = [None, True, False, -1, 0, 1, 7, 2 ** 31, -2 ** 31 - 1, 2 ** 53, 2 ** 63,
           -2 ** 63 - 5, 2 ** 70, 1e308, -1e308, 0.5, 1e-320, "", "x", "input", "output",
           "ivector", "\x00", "é" * 3, "a" * 5000, [], {}, [[]], [[0, 0, 0]], [[0, 0]],
           [1, 2, 3], [[1e10, 0, 0]], {"a": 1}, {"shape": [1, 1], "data": ""},
           {"shape": [2 ** 40, 2 ** 40], "data": "AAAA"}, {"shape": [-1, 4], "data": "AAAA"},
           [[float("inf")]], [[1.0] * 4] * 3, [0, 1, 2]]
CASES = int(os.environ.get("NNETC_FUZZ_CASES", "400"))
SEED = int(os.environ.get("NNETC_FUZZ_SEED", "20261130"))


def _places(x, rng: random.Random, at=()):
    yield at
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _places(v, rng, at + (k,))
    elif isinstance(x, list) and x:
        for i in rng.sample(range(len(x)), min(3, len(x))):
            yield from _places(x[i], rng, at + (i,))


def _value(body, at):
    for k in at:
        body = body[k]
    return body


def mutate(body, rng: random.Random):
    out = copy.deepcopy(body)
    places = list(_places(out, rng))
    # half the time a container (a matrix, a list of Indexes, an options object): the
    # places inside long lists would otherwise drown them
    boxes = [at for at in places if isinstance(_value(out, at), (dict, list))]
    at = rng.choice(boxes if boxes and rng.random() < 0.5 else places)
    if not at:
        return rng.choice(AWKWARD)
    parent = _value(out, at[:-1])
    k, op, value = at[-1], rng.random(), parent[at[-1]]
    if isinstance(value, list) and value and op < 0.5:
        # a list cut short (empty, one or two items, half, all but one) or repeated
        n = len(value)
        parent[k] = (value + value[:rng.randint(1, n)] if op < 0.15
                     else value[:rng.choice([0, 1, 2, n // 2, n - 1])])
    elif op < 0.15 and isinstance(parent, dict):
        del parent[k]
    elif op < 0.25 and isinstance(parent, dict):
        parent[f"zz_{rng.randint(0, 9)}"] = rng.choice(AWKWARD)
    elif op < 0.35 and isinstance(value, (int, float)) and not isinstance(value, bool):
        parent[k] = value + rng.choice([-1, 1, -1000, 1000, 2 ** 31, -2 ** 31])
    else:
        parent[k] = rng.choice(AWKWARD)
    return out


def _fuzz(client, cases: int, body_type: str = "json") -> None:
    """``body_type``: each mutated body sent as JSON or as msgpack (bodies msgpack cannot
    carry, integers past 64 bits, are skipped)."""
    rng = random.Random(SEED)
    data = np.random.default_rng(0)
    tiny = register(client, config=TINY_CONFIG)["model_id"]
    rec = register(client, config=RECURRENT)["model_id"]
    ivm = register(client, config=TDNN_IVECTOR)["model_id"]
    x = data.standard_normal((5, 4)).astype(np.float32)
    good = {"model_id": tiny, "request": request_for(0, 3), "inputs": {"input": x.tolist()}}
    sid = client.post("/streams", json={"model_id": rec, "options": {"frames_per_chunk": 5}}
                      ).json()["stream_id"]
    feats = data.standard_normal((30, 8)).astype(np.float32)
    bodies = [
        ("/compile", {"model_id": tiny, "request": request_for(0, 3), "listing": True,
                      "optimizer": {"min_deriv_time": 0, "memory_compression_level": 1}}),
        ("/compute", {"model_id": tiny, "request": request_for(0, 3, deriv=True),
                      "inputs": {"input": encode(x)},
                      "output_derivs": {"output": x[:3, :3].tolist()}}),
        ("/compute", good),
        ("/infer", {"model_id": rec, "features": feats.tolist(),
                    "options": {"frames_per_chunk": 7, "extra_left_context": 2}}),
        ("/infer", {"model_id": ivm, "features": feats[:20].tolist(), "ivector": [0.5] * 4}),
        ("/models", {"config": TINY_CONFIG, "seed": 3}),
        ("/streams", {"model_id": rec, "options": {"frames_per_chunk": 5}}),
        (f"/streams/{sid}/frames", {"features": feats[:6].tolist()}),
    ]
    for route, body in bodies:           # each starting body is valid
        r = client.post(route, json=body)
        assert r.status_code in (200, 201), (route, r.text)
    want = decode(client.post("/compute", json=good).json()["outputs"]["output"])
    seen = set()
    for case in range(cases):
        route, body = rng.choice(bodies)
        m = body
        for _ in range(rng.randint(1, 3)):
            m = mutate(m, rng) if isinstance(m, dict) else m
        text = json.dumps(m)
        if body_type == "msgpack":
            try:
                content = msgpack.packb(m)
            except (OverflowError, TypeError):
                continue
        else:
            content = text
        r = client.post(route, content=content,
                        headers={"content-type": f"application/{body_type}"})
        assert r.status_code < 500, (case, route, text[:500], r.text[:500])
        seen.add(r.status_code)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"type", "message", "field"} and err["message"], (case, r.text)
    assert {200, 422} <= seen        # the mutations made both kinds of answer
    got = decode(client.post("/compute", json=good).json()["outputs"]["output"])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("body_type", ["json", "msgpack"])
def test_mutated_bodies_get_a_4xx_and_leave_the_service_computing(body_type):
    with make_client() as c:
        _fuzz(c, CASES, body_type)


@needs_redis
def test_mutated_bodies_through_the_redis_queue(server):
    """The same through Redis: jobs on the queue (msgpack-encoded: what a queued job can
    carry is narrower than JSON), run by a worker, which must go on serving."""
    server.client().flushall()
    with ThreadWorker(server.url, max_batch=8) as w, \
            make_client(redis_url=server.url, queue="redis", job_timeout_s=30) as c:
        _fuzz(c, max(1, CASES // 2))
        assert w.thread.is_alive()


def test_mutated_websocket_pushes_leave_the_stream_consistent():
    """Pushes over a stream's WebSocket, mutated as above: each is answered with the
    stream's output or an error message of status 4xx, the socket stays open, and the
    stream counts exactly the frames of the pushes it answered with output."""
    from tests.engine.inference_nets import RECURRENT as NET  # noqa: PLC0415
    rng = random.Random(SEED + 1)
    data = np.random.default_rng(1)
    with make_client() as c:
        mid = register(c, config=NET)["model_id"]
        sid = c.post("/streams", json={"model_id": mid}).json()["stream_id"]
        received = ok = 0
        with c.websocket_connect(f"/streams/{sid}/ws") as ws:
            for case in range(max(1, CASES // 2)):
                body = {"features": data.standard_normal((rng.randint(1, 6), 8))
                        .astype(np.float32).tolist(), "offset": received}
                m = body
                for _ in range(rng.randint(0, 2)):
                    m = mutate(m, rng) if isinstance(m, dict) else m
                if isinstance(m, dict) and "finish" in m:
                    continue                  # (an unknown key named finish: not sent)
                ws.send_text(json.dumps(m))
                answer = ws.receive_json()    # (a closed socket raises here)
                if "error" in answer:
                    assert 400 <= answer["status"] < 500, (case, m, answer)
                else:
                    # (an empty push is answered too: it adds no frames)
                    assert answer["frames_received"] >= received, (case, answer)
                    received = answer["frames_received"]
                    ok += 1
        info = c.get(f"/streams/{sid}").json()
        assert info["frames_received"] == received and not info["finished"]
        assert ok > 10
