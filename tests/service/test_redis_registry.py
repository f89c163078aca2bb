"""Models shared through Redis (service/redis_registry.py): registered on one service,
known to another; ids checked on load; outages; deletion everywhere."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.service.conftest import (BLSTM, TINY_CONFIG, encode, make_client, needs_redis,
                                    register, request_for)

pytestmark = needs_redis



@pytest.fixture()
def url(server):
    server.client().flushall()
    return server.url


def test_a_model_registered_on_one_service_is_known_to_another(url):
    with make_client(redis_url=url) as a, make_client(redis_url=url) as b:
        r = a.post("/models", json={"config": TINY_CONFIG, "seed": 4, "name": "tiny"})
        assert r.status_code == 201
        mid = r.json()["model_id"]
        # b lists it (from the record) and serves it (loading the bytes)
        listed = b.get("/models").json()["models"]
        assert [m["model_id"] for m in listed] == [mid] and listed[0]["name"] == "tiny"
        assert listed[0]["info"] == r.json()["info"]
        got = b.get(f"/models/{mid}").json()
        assert got["structure_hash"] == r.json()["structure_hash"]
        body = {"model_id": mid, "request": request_for(0, 3),
                "inputs": {"input": encode(np.ones((5, 4)))}}
        ya, yb = (c.post("/compute", json=body).json()["outputs"]["output"] for c in (a, b))
        assert ya == yb
        # registering the same bytes elsewhere is a no-op: 200, not 201
        assert b.post("/models", json={"config": TINY_CONFIG, "seed": 4}).status_code == 200


def test_a_config_without_a_seed_is_one_network_everywhere(url):
    """A config registered without a seed: every service that loads it by id builds the
    same parameters (they are drawn with a fixed seed), so its answers agree and its
    streams move between services."""
    with make_client(redis_url=url) as a, make_client(redis_url=url) as b:
        mid = a.post("/models", json={"config": TINY_CONFIG}).json()["model_id"]
        body = {"model_id": mid, "request": request_for(0, 3),
                "inputs": {"input": encode(np.arange(20.0).reshape(5, 4))}}
        ya, yb = (c.post("/compute", json=body).json()["outputs"]["output"] for c in (a, b))
        assert ya == yb
        sid = a.post("/streams", json={"model_id": mid}).json()["stream_id"]
        feats = encode(np.ones((3, 4)))
        assert a.post(f"/streams/{sid}/frames", json={"features": feats, "offset": 0}
                      ).status_code == 200
        r = b.post(f"/streams/{sid}/frames", json={"features": feats, "offset": 3})
        assert r.status_code == 200, r.text


def test_binary_models_round_trip_through_redis(url):
    data = (BLSTM / "model.raw").read_bytes()
    with make_client(redis_url=url) as a:
        mid = a.post("/models", json={"binary_b64": base64.b64encode(data).decode()}
                     ).json()["model_id"]
    with make_client(redis_url=url) as b:
        info = b.get(f"/models/{mid}").json()["info"]
        assert info["num_parameters"] > 0


def test_a_record_that_does_not_match_its_id_is_refused(url, server):
    with make_client(redis_url=url) as a:
        mid = register(a, config=TINY_CONFIG)["model_id"]
    server.client().hset(f"nnetc:model:{mid}", "data", TINY_CONFIG.replace("dim=5", "dim=6"))
    with make_client(redis_url=url) as b:
        r = b.get(f"/models/{mid}")
        assert r.status_code == 500 and r.json()["error"]["type"] == "CorruptModelRecord"
        assert b.get(f"/models/{mid}").status_code == 404          # deleted
        assert b.get("/models").json()["models"] == []


def test_delete_removes_the_model_everywhere(url):
    with make_client(redis_url=url) as a, make_client(redis_url=url) as b:
        mid = register(a, config=TINY_CONFIG)["model_id"]
        assert b.get(f"/models/{mid}").status_code == 200
        assert b.delete(f"/models/{mid}").status_code == 204
        assert b.get(f"/models/{mid}").status_code == 404
        # a had loaded it: deleted by b, it is gone from a too
        assert a.get("/models").json()["models"] == []
        assert a.get(f"/models/{mid}").status_code == 404
        assert b.delete(f"/models/{mid}").status_code == 404
        assert b.delete("/models/" + "0" * 64).status_code == 404


def test_outage_registered_here_still_works_others_get_503(server):
    server.client().flushall()
    with make_client(redis_url=server.url, redis_timeout_s=0.5) as a:
        mine = register(a, config=TINY_CONFIG)["model_id"]
        server.stop()
        try:
            r = a.post("/models", json={"config": TINY_CONFIG, "seed": 9})
            assert r.status_code == 201                 # loaded here; stored later
            assert a.get(f"/models/{mine}").status_code == 200
            r = a.get("/models/" + "1" * 64)
            assert r.status_code == 503 and r.json()["error"]["type"] == "StoreUnavailable"
            assert {m["model_id"] for m in a.get("/models").json()["models"]} >= {mine}
        finally:
            server.start()


@pytest.mark.parametrize("broken", [{"info": b"5"}, {"info": b"{\"modulus\": 1}"},
                                    {"info": b"not json"}, {"name": None}])
def test_a_broken_model_record_is_left_out_of_the_listing(url, server, broken):
    """A model record whose figures are not readable (or whose name field is gone) does
    not fail GET /models for everyone: the other models are listed, that one left out."""
    server.client().flushall()
    with make_client(redis_url=url) as a:
        bad = register(a, config=TINY_CONFIG)["model_id"]
        good = register(a, config=TINY_CONFIG.replace("output-dim=3", "output-dim=2")
                        )["model_id"]
    key = f"nnetc:model:{bad}"
    for field, value in broken.items():
        if value is None:
            server.client().hdel(key, field)
        else:
            server.client().hset(key, field, value)
    with make_client(redis_url=url) as b:                # holds neither model
        r = b.get("/models")
        assert r.status_code == 200, r.text
        ids = [m["model_id"] for m in r.json()["models"]]
        assert good in ids
        assert (bad in ids) == (broken == {"name": None})


def test_a_model_record_of_the_wrong_redis_type_is_corrupt_not_an_outage(url, server):
    """A model key holding another Redis type (a string, not a hash) is a broken record:
    500 CorruptModelRecord and the key deleted, not a 503 as if Redis were down; the
    listing leaves it out and lists the others."""
    with make_client(redis_url=url) as a:
        bad = register(a, config=TINY_CONFIG)["model_id"]
        good = register(a, config=TINY_CONFIG.replace("output-dim=3", "output-dim=2")
                        )["model_id"]
    key = f"nnetc:model:{bad}"
    server.client().delete(key)
    server.client().set(key, b"not a hash")
    with make_client(redis_url=url) as b:
        r = b.get("/models")
        assert r.status_code == 200, r.text
        assert [m["model_id"] for m in r.json()["models"]] == [good]
        r = b.get(f"/models/{bad}")
        assert r.status_code == 500 and r.json()["error"]["type"] == "CorruptModelRecord", r.text
        assert "type" in r.json()["error"]["message"]
        assert server.client().exists(key) == 0
        assert b.get(f"/models/{bad}").status_code == 404
        assert b.get(f"/models/{good}").status_code == 200
        # registering over a key of the wrong type replaces it
        server.client().set(key, b"not a hash")
        assert register(b, config=TINY_CONFIG)["model_id"] == bad
    with make_client(redis_url=url) as c:
        assert c.get(f"/models/{bad}").status_code == 200


def test_a_model_index_of_the_wrong_redis_type_is_made_again(url, server):
    """The index of model ids (a set) holding another Redis type is made again from the
    model keys: every service lists every model, and registering works."""
    with make_client(redis_url=url) as a:
        one = register(a, config=TINY_CONFIG)["model_id"]
    server.client().delete("nnetc:models")
    server.client().set("nnetc:models", b"not a set")
    with make_client(redis_url=url) as b:
        r = b.get("/models")
        assert r.status_code == 200 and [m["model_id"] for m in r.json()["models"]] == [one]
        server.client().set("nnetc:models", b"not a set")
        two = register(b, config=TINY_CONFIG.replace("output-dim=3", "output-dim=2")
                       )["model_id"]
    assert server.client().type("nnetc:models") == b"set"
    with make_client(redis_url=url) as c:
        assert {m["model_id"] for m in c.get("/models").json()["models"]} == {one, two}
        assert c.get(f"/models/{two}").status_code == 200
