"""What the service keeps between requests is bounded in bytes, not only in entries: the
computation cache (cache_bytes: 256 entries of a large request were tens of GB) and the
matrices inference and streams keep for reuse (one pool of max_pooled_bytes for every
cached inferencer and looped model; each had a 1 GiB pool of its own)."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

from conftest import TINY_CONFIG, encode, make_client, register
from engine.compiler.compiler import compile_computation
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.index import Index
from engine.nnet.nnet import Nnet
from service.cache import LRUComputationCache, estimated_bytes, plain_and_validated


def _computation(frames: int):
    nnet = Nnet.from_config(TINY_CONFIG, rng=np.random.default_rng(0))
    req = ComputationRequest(
        [IoSpecification("input", [Index(0, t, 0) for t in range(-1, frames + 1)])],
        [IoSpecification("output", [Index(0, t, 0) for t in range(frames)])])
    return compile_computation(nnet, [req])


def test_the_size_estimate_covers_what_an_entry_holds():
    """The estimate is at least what the plain data and the rebuilt computation take
    (tracemalloc), and not far above it."""
    for frames in (10, 400, 3000):
        comp = _computation(frames)
        gc.collect()
        tracemalloc.start()
        data, validated = plain_and_validated(comp)
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        est = estimated_bytes(data)
        assert held <= est <= 4 * held, (frames, held, est)


def test_the_cache_drops_its_oldest_entries_beyond_its_byte_budget():
    small, big = _computation(10), _computation(3000)
    size_small = estimated_bytes(plain_and_validated(small)[0])
    size_big = estimated_bytes(plain_and_validated(big)[0])
    cache = LRUComputationCache(capacity=100, max_bytes=size_big + 2 * size_small)
    cache.put("s1", small, {})
    cache.put("s2", small, {})
    assert len(cache) == 2 and cache.estimated_bytes == 2 * size_small
    cache.put("b1", big, {})
    assert len(cache) == 3 and cache.estimated_bytes == size_big + 2 * size_small
    cache.put("s3", small, {})                       # over budget: s1 goes
    assert cache.get("s1") is None and cache.get("s2") is not None
    assert cache.estimated_bytes == size_big + 2 * size_small
    cache.put("b2", big, {})                 # b1 goes (the least recently used)
    assert [k for k in ("s2", "b1", "s3", "b2") if cache.raw(k) is not None] == [
        "s2", "s3", "b2"]
    cache.put("b3", big, {})                 # s3, s2 (the get made it recent) and b2 go
    assert [k for k in ("s2", "s3", "b2", "b3") if cache.raw(k) is not None] == ["b3"]
    assert cache.estimated_bytes == size_big
    # an entry larger than the whole budget is still kept, alone (it was just made)
    tiny = LRUComputationCache(capacity=100, max_bytes=size_small)
    tiny.put("s", small, {})
    tiny.put("b", big, {})
    assert len(tiny) == 1 and tiny.get("b") is not None
    # storing a key again replaces its size
    tiny.put("b", big, {})
    assert tiny.estimated_bytes == size_big


def test_inference_and_streams_keep_their_matrices_in_one_bounded_pool():
    limit = 1 << 20
    with make_client(max_pooled_bytes=limit, cache_bytes=8 << 20) as c:
        services = c.app.state.services
        assert services.cache.max_bytes == 8 << 20
        pool = services.operations.pool
        assert pool is services.streams.pool and pool.max_bytes == limit
        mid = register(c, config=TINY_CONFIG)["model_id"]
        feats = encode(np.ones((300, 4), np.float32))
        for fpc in (20, 50, 150):
            r = c.post("/infer", json={"model_id": mid, "features": feats,
                                       "options": {"frames_per_chunk": fpc}})
            assert r.status_code == 200, r.text
        for fpc in (20, 40):
            sid = c.post("/streams", json={"model_id": mid, "options": {
                "frames_per_chunk": fpc}}).json()["stream_id"]
            r = c.post(f"/streams/{sid}/frames", json={"features": feats, "offset": 0})
            assert r.status_code == 200, r.text
        entry = services.registry.get(mid)
        inferencers = list(entry.extras["inferencers"].values())
        assert len(inferencers) == 3 and all(i.pool is pool for i in inferencers)
        looped = list(services.streams._looped.values())
        assert len(looped) == 2 and all(m.pool is pool for m in looped)
        assert 0 < pool.pooled_bytes <= limit


def _linear_config(i: int, out_dim: int) -> str:
    return (f"input-node name=input dim=1024\ncomponent name=a{i} type=LinearComponent "
            f"input-dim=1024 output-dim={out_dim}\ncomponent-node name=a component=a{i} "
            f"input=input\noutput-node name=output input=a\n")


def test_registered_models_are_bounded_in_bytes():
    """Fuzzing: three 181-byte configs kept 0.5 GB each (only their count was bounded).
    max_model_bytes bounds the arrays of the models held: a registration beyond gets 413
    naming the setting, the model's bytes and what is held, before its parameters are
    drawn; a deletion frees its share."""
    one = 4 * 1024 * 1000                      # a model's bytes (4 MB)
    with make_client(max_model_bytes=(2 * one + one // 2)) as c:
        ids = [register(c, config=_linear_config(i, 1000))["model_id"] for i in range(2)]
        gc.collect()
        tracemalloc.start()
        r = c.post("/models", json={"config": _linear_config(2, 1000)})
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert r.status_code == 413, r.text
        e = r.json()["error"]
        assert e["type"] == "RequestTooLarge" and e["field"] == "config"
        assert f"{one} bytes" in e["message"] and f"hold {2 * one}" in e["message"]
        assert f"max_model_bytes ({2 * one + one // 2})" in e["message"]
        assert peak < one // 2, peak               # nothing of it was drawn
        # a model larger than the whole budget, refused before drawing its 400 MB
        gc.collect()
        tracemalloc.start()
        r = c.post("/models", json={"config": _linear_config(3, 100000)})
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert r.status_code == 413 and "409600000 bytes, more than" in r.text
        assert peak < one // 2, peak
        assert c.delete(f"/models/{ids[0]}").status_code in (200, 204)
        register(c, config=_linear_config(2, 1000))      # room again


def test_registrations_under_way_count_against_the_byte_budget(monkeypatch):
    """Registrations at the same time reserve their bytes while their parameters are
    drawn, so they cannot all pass the check together (four at once peaked at 6.2 GB)."""
    import service.registry as registry_mod  # noqa: PLC0415
    from service.errors import ServiceError  # noqa: PLC0415
    reg = registry_mod.InProcessRegistry(max_bytes=6 << 20)
    real_load = registry_mod._load
    seen = []

    def load(data, field, seed, check=None):
        def check_then_another(nnet):
            check(nnet)
            if not seen:       # another registration while this one is being drawn
                try:
                    reg.register(_linear_config(1, 1000).encode(), "config")
                except ServiceError as e:
                    seen.append(e)
                raise ServiceError(499, "Stop", "stop here")
        return real_load(data, field, seed, check_then_another)
    monkeypatch.setattr(registry_mod, "_load", load)
    try:
        reg.register(_linear_config(0, 1000).encode(), "config")
    except ServiceError as e:
        assert e.status == 499
    assert len(seen) == 1 and seen[0].status == 413, seen
    assert "(and 1 being registered) hold 4096000" in seen[0].message
    assert reg.held_bytes() == 0                   # the refused and stopped ones hold nothing
    monkeypatch.setattr(registry_mod, "_load", real_load)
    reg.register(_linear_config(0, 1000).encode(), "config")
    assert reg.held_bytes() == 4 * 1024 * 1000


def test_a_cache_entry_holds_few_objects_the_garbage_collector_tracks():
    """The plain data and the rebuilt computation of a cache entry hold the rows of
    Indexes as flat integer lists and arrays (IR version 2): the objects the cyclic
    garbage collector walks at each full collection do not grow with the request (one
    list and one (node, Index) tuple per row made a 40000-frame TDNN entry 1.4 million
    objects, and each full collection took about 0.18 s while the event loop waited)."""
    def tracked_after(frames: int) -> int:
        # the tracked objects made and still alive, counted by identity: a difference
        # of totals also counted what the call let go (a memo emptied by an earlier
        # test's state: the 20-frame call alone then "made" 72 objects fewer)
        comp = _computation(frames)
        gc.collect()
        held = gc.get_objects()           # kept alive: no identity is reused meanwhile
        before = set(map(id, held))
        entry = plain_and_validated(comp)
        gc.collect()
        count = sum(1 for o in gc.get_objects() if id(o) not in before)
        del entry, held
        return count
    small, large = tracked_after(20), tracked_after(4000)
    assert large <= small + 50, (small, large)
