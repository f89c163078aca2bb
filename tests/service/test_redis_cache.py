"""The Redis-backed computation cache (service/redis_cache.py) against a real
redis-server started for these tests on a free port: sharing between two
services, entries as plain data, corrupt entries dropped, expiry, and outages
(the server stopped and started again) served from the in-process LRU."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

from engine.compiler.request import ComputationRequest
from engine.compiler.serialize import IR_VERSION, computation_to_data
from engine.compiler.shortcut import compile_request
from engine.nnet.nnet import Nnet
from service.redis_cache import KEY_PREFIX, RedisComputationCache
from tests.service.conftest import (TINY_CONFIG, encode, make_client, needs_redis, register,
                                    request_for)

pytestmark = needs_redis



@pytest.fixture()
def redis_url(server):
    server.client().flushall()
    return server.url


def _metric(client, event: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'nnetc_cache_events_total{{event="{event}"}}'):
            return float(line.split()[-1])
    return 0.0


def _tiny():
    return Nnet.from_config(TINY_CONFIG, rng=np.random.default_rng(1))


def _request(t0=0, t1=3, n=1):
    import json  # noqa: PLC0415
    return ComputationRequest.from_json(json.dumps(request_for(t0, t1, n)).encode())


def test_two_services_share_compiled_computations(redis_url, server):
    with make_client(redis_url=redis_url) as a, make_client(redis_url=redis_url) as b:
        mid = register(a, config=TINY_CONFIG)["model_id"]
        assert register(b, config=TINY_CONFIG)["model_id"] == mid
        body = {"model_id": mid, "request": request_for(0, 4, n=2)}
        first = a.post("/compile", json=body).json()
        assert first["cached"] is False
        assert server.client().exists(KEY_PREFIX + first["computation_id"]) == 1
        second = b.post("/compile", json=body).json()
        # compiled once: service b found it in Redis
        assert second["cached"] is True
        assert second["computation_id"] == first["computation_id"]
        assert second["stats"] == first["stats"]
        assert _metric(b, "redis_hit") == 1.0 and _metric(b, "miss") == 0.0
        # from then on b answers from its own LRU
        assert b.post("/compile", json=body).json()["cached"] is True
        assert _metric(b, "hit") == 1.0
        # and computes with it: the same outputs as service a
        x = np.random.default_rng(0).standard_normal((12, 4)).astype(np.float32)
        cbody = {**body, "inputs": {"input": encode(x)}}
        ya = a.post("/compute", json=cbody).json()["outputs"]["output"]
        yb = b.post("/compute", json=cbody).json()["outputs"]["output"]
        assert ya == yb
        assert a.get("/readyz").json()["cache"] == "redis"


def test_entries_are_plain_data_with_expiry(redis_url, server):
    nnet = _tiny()
    cache = RedisComputationCache(redis_url, capacity=4, ttl_s=60)
    comp = compile_request(nnet, _request())
    cache.put("k1", comp, {"model_id": "m", "compile_ms": 1.5})
    raw = server.client().get(KEY_PREFIX + "k1")
    entry = msgpack.unpackb(raw, raw=False)     # plain msgpack: no pickle anywhere
    assert entry["ir_version"] == IR_VERSION
    assert entry["data"] == computation_to_data(comp)
    assert entry["meta"] == {"model_id": "m", "compile_ms": 1.5}
    assert 0 < server.client().ttl(KEY_PREFIX + "k1") <= 60
    # a process that never saw it reads it back, with its metadata
    other = RedisComputationCache(redis_url, capacity=4)
    got = other.get("k1")
    assert computation_to_data(got) == computation_to_data(comp)
    assert other.meta("k1") == {"model_id": "m", "compile_ms": 1.5}
    assert len(other) == 1


@pytest.mark.parametrize("payload", [
    b"\x00garbage",                                                     # not msgpack
    msgpack.packb([1, 2, 3]),                                           # not an entry
    msgpack.packb({"ir_version": IR_VERSION + 1, "data": {}, "meta": {}}),   # other IR
    "bad-reference",                                                    # fails validation
    "truncated",                                                        # cut short
])
def test_corrupt_entries_are_dropped_and_recompiled(redis_url, server, payload):
    nnet = _tiny()
    comp = compile_request(nnet, _request())
    good = msgpack.packb({"ir_version": IR_VERSION, "data": computation_to_data(comp),
                          "meta": {}}, use_bin_type=True)
    if payload == "bad-reference":
        data = computation_to_data(comp)
        data["commands"][0][2] = 10 ** 6      # a submatrix that does not exist
        payload = msgpack.packb({"ir_version": IR_VERSION, "data": data, "meta": {}})
    elif payload == "truncated":
        payload = good[: len(good) // 2]
    events = []
    cache = RedisComputationCache(redis_url, capacity=4, on_event=events.append)
    server.client().set(KEY_PREFIX + "k", payload)
    assert cache.get("k") is None
    assert events == ["corrupt", "miss"]
    assert server.client().exists(KEY_PREFIX + "k") == 0     # deleted, not served again
    cache.put("k", comp, {})
    fresh = RedisComputationCache(redis_url, capacity=4)
    assert computation_to_data(fresh.get("k")) == computation_to_data(comp)


def test_service_recompiles_over_a_corrupt_redis_entry(redis_url, server):
    with make_client(redis_url=redis_url) as a:
        mid = register(a, config=TINY_CONFIG)["model_id"]
        body = {"model_id": mid, "request": request_for(0, 3)}
        key = a.post("/compile", json=body).json()["computation_id"]
    server.client().set(KEY_PREFIX + key, b"\x93not an entry")
    with make_client(redis_url=redis_url) as b:
        register(b, config=TINY_CONFIG)
        r = b.post("/compile", json=body).json()
        assert r["cached"] is False and r["computation_id"] == key
        assert _metric(b, "corrupt") == 1.0
    # the recompiled entry replaced the corrupt one
    assert RedisComputationCache(redis_url).get(key) is not None


def test_outage_is_served_from_memory_and_redis_is_used_again_after(server):
    server.client().flushall()
    nnet = _tiny()
    comp = compile_request(nnet, _request())
    events = []
    cache = RedisComputationCache(server.url, capacity=8, on_event=events.append,
                                  timeout_s=0.5, retry_after_s=0.3)
    cache.put("before", comp, {})
    server.stop()
    try:
        assert cache.get("before") is not None           # the LRU still has it
        assert events[-1] == "hit"
        assert cache.get("unknown") is None               # Redis down: a miss, no exception
        cache.put("during", comp, {})                     # stored in the LRU only
        assert cache.get("during") is not None
        assert cache.ping() is False
        # one failed call to Redis; the others within retry_after_s did not try it (no
        # timeout per call after the first)
        assert events.count("redis_error") == 1, events
        n_errors = events.count("redis_error")
        assert cache.get("unknown2") is None and events.count("redis_error") == n_errors
    finally:
        server.start()
    time.sleep(0.35)                                      # the retry window passes
    assert cache.ping() is True
    cache.put("after", comp, {})
    assert server.client().exists(KEY_PREFIX + "after") == 1
    assert server.client().exists(KEY_PREFIX + "during") == 0


def test_service_keeps_serving_when_redis_is_down(server):
    server.client().flushall()
    with make_client(redis_url=server.url, redis_timeout_s=0.5) as c:
        mid = register(c, config=TINY_CONFIG)["model_id"]
        server.stop()
        try:
            body = {"model_id": mid, "request": request_for(0, 3),
                    "inputs": {"input": encode(np.zeros((5, 4)))}}
            r = c.post("/compute", json=body)
            assert r.status_code == 200, r.text
            assert c.post("/compute", json=body).status_code == 200
            assert _metric(c, "hit") == 1.0                      # the second from memory
            ready = c.get("/readyz")
            assert ready.status_code == 200
            assert ready.json()["cache"] == "memory (redis unavailable)"
            assert _metric(c, "redis_error") >= 1.0
        finally:
            server.start()


def test_settings_without_redis_url_use_the_in_process_cache():
    from service.cache import LRUComputationCache  # noqa: PLC0415
    with make_client() as c:
        assert isinstance(c.app.state.services.cache, LRUComputationCache)
        assert c.get("/readyz").json()["cache"] == "memory"
    with pytest.raises(ValueError):
        RedisComputationCache(None)


def test_a_changed_number_that_still_validates_is_caught_by_the_digest(redis_url, server):
    """A scale in a command changed in Redis still references valid matrices (the
    checker passes it) but would compute other numbers: the entry's sha256 no longer
    matches, so it is dropped and compiled again instead of served."""
    comp = compile_request(_tiny(), _request())
    RedisComputationCache(redis_url, capacity=4).put("k", comp, {"model_id": "m"})
    entry = msgpack.unpackb(server.client().get(KEY_PREFIX + "k"), raw=False)
    for command in entry["data"]["commands"]:
        command[1] = 2.0 * command[1]                 # every command's alpha
    server.client().set(KEY_PREFIX + "k", msgpack.packb(entry, use_bin_type=True))
    events = []
    cache = RedisComputationCache(redis_url, capacity=4, on_event=events.append)
    assert cache.get("k") is None
    assert events == ["corrupt", "miss"]
    assert server.client().exists(KEY_PREFIX + "k") == 0


def test_a_cache_entry_of_the_wrong_redis_type_is_a_miss_not_an_outage(redis_url, server):
    """A cache key holding another Redis type is dropped and recompiled over; Redis is
    not taken for down (the entry is written to it again and read back)."""
    nnet = _tiny()
    comp = compile_request(nnet, _request())
    events = []
    cache = RedisComputationCache(redis_url, capacity=4, on_event=events.append)
    server.client().hset(KEY_PREFIX + "k", "x", b"1")
    assert cache.get("k") is None
    assert "redis_error" not in events and cache.available(), events
    assert events == ["corrupt", "miss"]
    assert server.client().exists(KEY_PREFIX + "k") == 0
    cache.put("k", comp, {})
    assert server.client().type(KEY_PREFIX + "k") == b"string"
    fresh = RedisComputationCache(redis_url, capacity=4)
    assert computation_to_data(fresh.get("k")) == computation_to_data(comp)
