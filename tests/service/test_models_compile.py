"""/models and /compile against the CLI: info figures equal `nnetc info`, stats equal
`nnetc compile --stats`, and the computation cache keyed by structure, request,
options and IR version."""

from __future__ import annotations

import copy
import json

import pytest
from click.testing import CliRunner

from engine.nnet.model_io import load_model, model_to_bytes
from engine.compiler.serialize import computation_to_data
from engine.optimizer.options import OptimizeOptions
from schemas.compile import OptimizerOptions
from service.cli import main
from tests.service.conftest import CASES, TINY_CONFIG, register, request_for

CASE = CASES / "case024"


def _cli_json(*args) -> dict:
    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_register_text_binary_config_and_info_matches_cli(client, tmp_path):
    text = register(client, CASE / "model.txt")
    assert text["created"] is True
    again = register(client, CASE / "model.txt")
    assert again["created"] is False and again["model_id"] == text["model_id"]
    binary_path = tmp_path / "model.raw"
    binary_path.write_bytes(model_to_bytes(load_model(CASE / "model.txt"), binary=True))
    binary = register(client, binary_path, binary=True)
    # different bytes, same network: different id, same structure
    assert binary["model_id"] != text["model_id"]
    assert binary["structure_hash"] == text["structure_hash"]
    figures = _cli_json("info", str(CASE / "model.txt"), "--json")
    info = text["info"]
    assert info["left_context"] == figures.get("left-context")
    assert info["right_context"] == figures.get("right-context")
    assert info["modulus"] == figures["modulus"]
    assert info["num_parameters"] == figures["num-parameters"]
    assert info["input_dims"] == figures["input-dim"]
    assert info["output_dims"] == figures["output-dim"]
    assert info["component_types"] == figures["component-types"]
    assert info["streaming"] == figures["streaming"]
    assert binary["info"] == info
    cfg = register(client, config=TINY_CONFIG)
    assert cfg["info"]["input_dims"] == {"input": 4}
    assert cfg["info"]["left_context"] == 1 and cfg["info"]["right_context"] == 1
    listed = {m["model_id"] for m in client.get("/models").json()["models"]}
    assert {text["model_id"], binary["model_id"], cfg["model_id"]} <= listed
    assert client.get(f"/models/{cfg['model_id']}").json()["info"] == cfg["info"]
    assert client.delete(f"/models/{binary['model_id']}").status_code == 204
    assert client.get(f"/models/{binary['model_id']}").status_code == 404


@pytest.mark.parametrize("no_optimize", [False, True])
def test_compile_stats_match_cli_and_cache_hits(client, no_optimize):
    model = register(client, CASE / "model.txt")
    req = json.loads((CASE / "request.json").read_text())
    body = {"model_id": model["model_id"], "request": req, "no_optimize": no_optimize,
            "listing": True}
    first = client.post("/compile", json=body)
    assert first.status_code == 200, first.text
    first = first.json()
    args = ["compile", str(CASE / "model.txt"), "--request", str(CASE / "request.json"),
            "--stats"] + (["--no-optimize"] if no_optimize else [])
    cli = _cli_json(*args)
    for k in ("commands", "matrices", "peak_bytes", "optimized"):
        assert first["stats"][k] == cli[k], k
    assert first["cached"] is False
    assert first["listing"].startswith("c0") or "c0:" in first["listing"]
    second = client.post("/compile", json=body).json()
    assert second["cached"] is True
    assert second["computation_id"] == first["computation_id"]
    assert second["stats"] == first["stats"]
    metrics = client.get("/metrics").text
    assert 'nnetc_cache_events_total{event="hit"}' in metrics


def test_cache_key_follows_options_not_parameters(client):
    cfg = register(client, config=TINY_CONFIG)
    body = {"model_id": cfg["model_id"], "request": request_for(0, 5, n=2)}
    base = client.post("/compile", json=body).json()["computation_id"]
    # the API exposes every engine option that changes the result, except Kaldi's hidden
    # optimize_looped_computation (set by the looped compiler only)
    assert set(OptimizerOptions.model_fields) == \
        set(OptimizeOptions.result_fields()) - {"optimize_looped_computation"}
    defaults = OptimizeOptions()
    changed = {"min_deriv_time": 0, "max_deriv_time": 3, "max_deriv_time_relative": 2,
               "memory_compression_level": 2}
    keys = {base}
    for name in OptimizerOptions.model_fields:   # every option the API exposes
        value = getattr(defaults, name)
        value = (not value) if isinstance(value, bool) else changed[name]
        r = client.post("/compile", json={**body, "optimizer": {name: value}})
        assert r.status_code == 200, (name, r.text)
        assert r.json()["computation_id"] not in keys, name
        keys.add(r.json()["computation_id"])
    assert len(keys) == 1 + len(OptimizerOptions.model_fields)
    assert client.post("/compile", json={**body, "use_shortcut": False}).json()[
        "computation_id"] != base
    other_req = client.post("/compile", json={**body, "request": request_for(0, 6, n=2)})
    assert other_req.json()["computation_id"] != base
    # same structure, other parameter values (another seed): same key, a cache hit
    reseeded = client.post("/models", json={"config": TINY_CONFIG, "seed": 2}).json()
    assert reseeded["model_id"] != cfg["model_id"]
    assert reseeded["structure_hash"] == cfg["structure_hash"]
    hit = client.post("/compile", json={**body, "model_id": reseeded["model_id"]}).json()
    assert hit["computation_id"] == base and hit["cached"] is True
    # a different structure (wider layer): another key
    wider = TINY_CONFIG.replace("output-dim=5", "output-dim=6").replace("dim=5", "dim=6") \
        .replace("input-dim=5", "input-dim=6")
    w = client.post("/models", json={"config": wider}).json()
    assert w["structure_hash"] != cfg["structure_hash"]
    assert client.post("/compile", json={**body, "model_id": w["model_id"]}).json()[
        "computation_id"] != base


def test_cache_stores_plain_data_and_drops_corrupt_entries(client):
    cfg = register(client, config=TINY_CONFIG)
    body = {"model_id": cfg["model_id"], "request": request_for(0, 3)}
    key = client.post("/compile", json=body).json()["computation_id"]
    cache = client.app.state.services.cache
    raw = cache.raw(key)
    json.dumps(raw)   # plain data: JSON-serialisable, no pickled objects
    # data coming in from outside the process (as from Redis) is checked when first read:
    # a corrupt copy stored in place of the entry is dropped and the request recompiled
    bad = copy.deepcopy(raw)
    bad["commands"][0][2] = 10 ** 6   # corrupt: a submatrix index out of range
    cache.put_data(key, bad, cache.meta(key))
    again = client.post("/compile", json=body).json()
    assert again["cached"] is False   # the corrupt entry was rejected and recompiled
    assert client.post("/compile", json=body).json()["cached"] is True
    assert 'nnetc_cache_events_total{event="corrupt"} 1.0' in client.get("/metrics").text


def test_cache_hits_return_one_validated_computation(client):
    """A hit returns the same computation object each time (rebuilt from the plain data
    once, when stored), so nothing is rebuilt per request and the executor's program,
    cached per computation, is reused."""
    cfg = register(client, config=TINY_CONFIG)
    body = {"model_id": cfg["model_id"], "request": request_for(0, 4)}
    key = client.post("/compile", json=body).json()["computation_id"]
    cache = client.app.state.services.cache
    first = cache.get(key)
    assert first is cache.get(key)
    assert computation_to_data(first) == cache.raw(key)


def test_upload_a_model_file_as_the_raw_body(client):
    """POST /models/upload: the file's bytes as the body (no base64), a binary or text
    Kaldi model or a config told apart by their first bytes; the same id as the JSON
    registration of the same bytes; errors name the body."""
    from tests.service.conftest import BLSTM  # noqa: PLC0415
    octet = {"content-type": "application/octet-stream"}
    data = (BLSTM / "model.raw").read_bytes()
    r = client.post("/models/upload?name=blstm", content=data, headers=octet)
    assert r.status_code in (200, 201) and r.json()["name"] == "blstm"
    import base64  # noqa: PLC0415
    same = client.post("/models", json={"binary_b64": base64.b64encode(data).decode()})
    assert same.json()["model_id"] == r.json()["model_id"] and same.status_code == 200
    text = load_model(data).nnet
    r = client.post("/models/upload", content=model_to_bytes(load_model(data), binary=False),
                    headers=octet)
    assert r.status_code in (200, 201)
    assert r.json()["info"]["num_parameters"] == text.num_parameters()
    r = client.post("/models/upload?seed=5", content=TINY_CONFIG.encode(), headers=octet)
    assert r.status_code in (200, 201)
    assert r.json()["model_id"] == client.post("/models", json={"config": TINY_CONFIG,
                                                                "seed": 5}).json()["model_id"]
    r = client.post("/models/upload", content=b"\0Bgarbage", headers=octet)
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"
    assert "upload at byte" in r.json()["error"]["message"]
    r = client.post("/models/upload", content=b"", headers=octet)
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"
    r = client.post("/models/upload", content=b"component name=x type=Nope dim=3\n",
                    headers=octet)
    assert r.status_code == 400 and "config:1" in r.json()["error"]["message"]
    r = client.post("/models/upload", content=b"\xff\xfe\x00garbage", headers=octet)
    assert r.status_code == 422 and "UTF-8" in r.json()["error"]["message"]
