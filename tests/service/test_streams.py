"""/streams over HTTP and WebSocket: outputs equal the engine's looped stream (and, with
../shared/kaldi-ref, Kaldi's looped decodable), offsets, errors, limits, expiry; with Redis,
a stream survives the loss of the process serving it and two processes cannot both
advance one stream."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.websockets import WebSocketDisconnect

from engine.inference.looped import LoopedConfig
from engine.inference.stream import LoopedModel
from engine.nnet.model_io import load_model
from tests.engine.inference_nets import GATED, RECURRENT, TDNN_IVECTOR, make_nnet
from tests.service.conftest import decode, make_client, needs_redis, service_backend

SHARED_REF = Path(__file__).resolve().parents[3] / "shared" / "kaldi-ref" / "models"


def _register_config(client, config: str, seed: int = 0) -> str:
    r = client.post("/models", json={"config": config, "seed": seed})
    assert r.status_code in (200, 201), r.text
    return r.json()["model_id"]


def _enc(x: np.ndarray) -> dict:
    x = np.ascontiguousarray(x, dtype="<f4")
    return {"shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode()}


def _engine_stream(config: str, seed: int, x, fpc: int, ivector=None, elc: int = 0):
    """The engine's looped output for the whole of x (one push, then finish)."""
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    nnet = Nnet.from_config(config, rng=np.random.default_rng(seed))
    s = LoopedModel(nnet, LoopedConfig(fpc, elc, 1), backend=service_backend()).stream(ivector)
    return np.concatenate([s.push(x), s.finish()])


def _push_all(client, sid, x, cuts, offsets=True, start=0, emitted=0):
    """Push x in pieces of ``cuts`` frames (x begins at frame ``start`` of the stream,
    which has returned ``emitted`` output rows so far); (outputs, frames pushed)."""
    outs, pos = [], 0
    for n in cuts:
        if pos >= len(x):
            break
        body = {"features": _enc(x[pos:pos + n]), "encoding": "base64"}
        if offsets:
            body["offset"] = start + pos
        r = client.post(f"/streams/{sid}/frames", json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["first_frame"] == emitted + sum(len(o) for o in outs)
        outs.append(decode(j["output"]).reshape(-1, j["output"]["shape"][1]))
        pos += n
    return outs, pos


def _finish(client, sid):
    r = client.post(f"/streams/{sid}/finish", json={"encoding": "base64"})
    assert r.status_code == 200, r.text
    assert r.json()["finished"] is True
    return decode(r.json()["output"])


RNG = np.random.default_rng(5)
X_REC = RNG.standard_normal((97, 8)).astype(np.float32)
X_IV = RNG.standard_normal((61, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        yield c


def test_http_stream_equals_engine_stream_on_a_recurrent_network(client):
    mid = _register_config(client, RECURRENT, 3)
    r = client.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 7}})
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["chunk_size"] >= 7 and info["input_dim"] == 8 and not info["finished"]
    sid = info["stream_id"]
    outs, _ = _push_all(client, sid, X_REC, [1, 13, 2, 30, 5, 46])
    got = client.get(f"/streams/{sid}").json()
    assert got["frames_received"] == 97 and got["frames_output"] == sum(map(len, outs))
    outs.append(_finish(client, sid))
    ours = np.concatenate(outs)
    ref = _engine_stream(RECURRENT, 3, X_REC, 7)
    np.testing.assert_array_equal(ours, ref)       # the same engine: bit for bit
    assert client.get(f"/streams/{sid}").status_code == 404   # gone after finish


def test_ivector_acoustic_scale_and_use_of_options(client):
    mid = _register_config(client, TDNN_IVECTOR, 1)
    iv = np.linspace(-1, 1, make_nnet(TDNN_IVECTOR).input_dim("ivector")).astype(np.float32)
    r = client.post("/streams", json={"model_id": mid, "ivector": iv.tolist(),
                                      "options": {"frames_per_chunk": 6,
                                                  "extra_left_context_initial": 2,
                                                  "acoustic_scale": 0.5}})
    assert r.status_code == 201, r.text
    sid = r.json()["stream_id"]
    outs, _ = _push_all(client, sid, X_IV, [20, 41])
    outs.append(_finish(client, sid))
    ref = _engine_stream(TDNN_IVECTOR, 1, X_IV, 6, iv, elc=2)
    np.testing.assert_allclose(np.concatenate(outs), 0.5 * ref, rtol=1e-6, atol=1e-6)
    # the i-vector is required by this network
    r = client.post("/streams", json={"model_id": mid})
    assert r.status_code == 422 and "i-vector" in r.json()["error"]["message"]
    # a scale JSON cannot carry (NaN, infinity) comes in msgpack: refused, field named
    import msgpack  # noqa: PLC0415
    for bad in (float("nan"), float("inf")):
        r = client.post("/streams", content=msgpack.packb(
            {"model_id": mid, "ivector": iv.tolist(), "options": {"acoustic_scale": bad}}),
            headers={"content-type": "application/msgpack"})
        assert 400 <= r.status_code < 500 and "acoustic_scale" in r.text, r.text


def test_offsets_protect_against_double_pushes(client):
    mid = _register_config(client, RECURRENT, 3)
    sid = client.post("/streams", json={"model_id": mid,
                                        "options": {"frames_per_chunk": 7}}).json()["stream_id"]
    body = {"features": _enc(X_REC[:10]), "offset": 0, "encoding": "base64"}
    first = client.post(f"/streams/{sid}/frames", json=body)
    assert first.status_code == 200
    again = client.post(f"/streams/{sid}/frames", json=body)       # a retried push
    assert again.status_code == 409
    err = again.json()["error"]
    assert err["field"] == "offset" and "received 10 frames" in err["message"]
    outs = [decode(first.json()["output"]).reshape(-1, 6)]
    r = client.post(f"/streams/{sid}/frames", json={"features": _enc(X_REC[10:]), "offset": 10,
                                                    "encoding": "base64"})
    assert r.status_code == 200
    outs += [decode(r.json()["output"]).reshape(-1, 6), _finish(client, sid)]
    # the refused retry changed nothing: the whole output equals the engine's
    np.testing.assert_array_equal(np.concatenate(outs), _engine_stream(RECURRENT, 3, X_REC, 7))


@pytest.mark.parametrize("body, status, field", [
    ({"features": [[0.0] * 5] * 3}, 422, None),                # wrong dimension
    ({"features": _enc(np.full((2, 8), np.nan))}, 422, "features"),   # NaN
    ({"features": [[0.0] * 8], "offset": -1}, 422, "offset"),  # negative offset
    ({"features": [[0.0] * 8], "colour": 1}, 422, "colour"),   # unknown field
])
def test_bad_pushes_get_4xx_naming_the_field(client, body, status, field):
    mid = _register_config(client, RECURRENT, 3)
    sid = client.post("/streams", json={"model_id": mid}).json()["stream_id"]
    r = client.post(f"/streams/{sid}/frames", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if field is not None:
        assert field in (err["field"] or "") or field in err["message"]
    else:
        assert "8" in err["message"]          # names the expected dimension
    # the stream is still usable
    assert client.post(f"/streams/{sid}/frames",
                       json={"features": _enc(X_REC[:3])}).status_code == 200


def test_an_empty_json_push_is_zero_frames(client):
    """``[]`` as JSON rows has no width: it is zero frames (as an encoded (0, dim)
    matrix is), not a matrix of the wrong dimension."""
    mid = _register_config(client, RECURRENT, 3)
    sid = client.post("/streams", json={"model_id": mid,
                                        "options": {"frames_per_chunk": 7}}).json()["stream_id"]
    outs = []
    for piece in (X_REC[:10], [], X_REC[10:]):
        r = client.post(f"/streams/{sid}/frames",
                        json={"features": piece if isinstance(piece, list) else _enc(piece),
                              "encoding": "base64"})
        assert r.status_code == 200, r.text
        outs.append(decode(r.json()["output"]).reshape(-1, 6))
    assert r.json()["frames_received"] == len(X_REC)
    outs.append(_finish(client, sid).reshape(-1, 6))
    np.testing.assert_array_equal(np.concatenate(outs), _engine_stream(RECURRENT, 3, X_REC, 7))


def test_unknown_closed_and_limits(client):
    assert client.post("/streams/s-nope/frames",
                       json={"features": [[0.0] * 8]}).status_code == 404
    assert client.post("/streams", json={"model_id": "0" * 64}).status_code == 404
    mid = _register_config(client, RECURRENT, 3)
    r = client.post("/streams", json={"model_id": mid,
                                      "options": {"frames_per_chunk": 10 ** 7}})
    assert r.status_code == 413 and r.json()["error"]["field"] == "options.frames_per_chunk"
    r = client.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 0}})
    assert r.status_code == 422
    sid = client.post("/streams", json={"model_id": mid}).json()["stream_id"]
    assert client.delete(f"/streams/{sid}").status_code == 204
    assert client.delete(f"/streams/{sid}").status_code == 404
    assert client.post(f"/streams/{sid}/finish").status_code == 404


def test_max_streams_and_idle_expiry():
    with make_client(max_streams=2, stream_idle_s=1) as c:
        mid = _register_config(c, RECURRENT, 3)
        a = c.post("/streams", json={"model_id": mid}).json()["stream_id"]
        c.post("/streams", json={"model_id": mid})
        r = c.post("/streams", json={"model_id": mid})
        assert r.status_code == 503 and r.json()["error"]["type"] == "TooManyStreams"
        time.sleep(1.2)
        assert c.post("/streams", json={"model_id": mid}).status_code == 201   # swept
        assert c.get(f"/streams/{a}").status_code == 404
        # both streams opened before the pause were swept
        assert 'nnetc_stream_events_total{event="expired"} 2.0' in c.get("/metrics").text


def test_websocket_stream(client):
    mid = _register_config(client, RECURRENT, 3)
    sid = client.post("/streams", json={"model_id": mid,
                                        "options": {"frames_per_chunk": 7}}).json()["stream_id"]
    outs = []
    with client.websocket_connect(f"/streams/{sid}/ws") as ws:
        pos = 0
        for n in (4, 40, 53):
            ws.send_json({"features": _enc(X_REC[pos:pos + n]), "offset": pos,
                          "encoding": "base64"})
            j = ws.receive_json()
            assert "error" not in j, j
            outs.append(decode(j["output"]).reshape(-1, 6))
            pos += n
        ws.send_json({"features": [[0.0] * 3]})             # an error: the socket stays open
        err = ws.receive_json()
        assert err["status"] == 422 and "error" in err
        ws.send_json({"features": [[0.0] * 8], "offset": 5})
        assert ws.receive_json()["status"] == 409
        ws.send_json({"finish": True, "encoding": "base64"})
        j = ws.receive_json()
        assert j["finished"] is True
        outs.append(decode(j["output"]).reshape(-1, 6))
        with pytest.raises(WebSocketDisconnect):
            ws.receive_json()
    np.testing.assert_array_equal(np.concatenate(outs), _engine_stream(RECURRENT, 3, X_REC, 7))


def test_websocket_and_http_need_the_token():
    with make_client(auth_token="t0k") as c:
        assert c.post("/streams", json={"model_id": "x"}).status_code == 401
        with pytest.raises(WebSocketDisconnect) as e:
            with c.websocket_connect("/streams/s-x/ws") as ws:
                ws.receive_json()
        assert e.value.code == 1008
        with c.websocket_connect("/streams/s-x/ws",
                                 headers={"Authorization": "Bearer t0k"}) as ws:
            ws.send_json({"features": [[0.0] * 8]})
            assert ws.receive_json()["status"] == 404


@pytest.mark.skipif(not (SHARED_REF / "tdnn_lstm" / "looped.npz").exists(),
                    reason="../shared/kaldi-ref not present (full set)")
def test_kaldi_looped_reference_through_the_service(client):
    import json  # noqa: PLC0415
    d = SHARED_REF / "tdnn_lstm"
    r = client.post("/models", json={"binary_b64": base64.b64encode(
        (d / "model.raw").read_bytes()).decode()})
    mid = r.json()["model_id"]
    z = np.load(d / "looped.npz")
    s = json.loads((d / "looped.json").read_text())["settings"][1]
    key = next(k for k in z.files if k.startswith(f"output.{s['key']}."))
    utt = key.split(".")[-1]
    x = z[f"features.{utt}"]
    assert f"ivector.{utt}" not in z.files      # (this model has no i-vector input)
    sid = client.post("/streams", json={
        "model_id": mid,
        "options": {"frames_per_chunk": s["frames_per_chunk"],
                    "extra_left_context_initial": s["extra_left_context_initial"]}}
    ).json()["stream_id"]
    outs, _ = _push_all(client, sid, x, [17, 3, 55, 1, 200, 1000])
    outs.append(_finish(client, sid))
    ours, ref = np.concatenate(outs), z[key]
    assert ours.shape == ref.shape
    assert np.max(np.abs(ours - ref)) <= 1e-4 + 2e-3 * np.max(np.abs(ref))


# -- with Redis: checkpoints ------------------------------------------------------------------




@needs_redis
@pytest.mark.parametrize("config", [RECURRENT, GATED], ids=["recurrent", "gated-fused"])
def test_stream_survives_the_loss_of_its_server(server, config):
    """Also for a network whose decoding form differs from the stored one (GATED: its
    gate affines fused): the second server prepares the same network, so the checkpoint
    fits it."""
    server.client().flushall()
    cuts = [5, 9, 20, 11, 30, 22]
    with make_client(redis_url=server.url) as a:
        mid = _register_config(a, config, 3)
        sid = a.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 7}}
                     ).json()["stream_id"]
        outs, pos = _push_all(a, sid, X_REC, cuts[:3])
    # a is gone (its process state with it); b has the model and the same Redis
    with make_client(redis_url=server.url) as b:
        _register_config(b, config, 3)
        info = b.get(f"/streams/{sid}").json()
        assert info["frames_received"] == pos == 34
        more, _ = _push_all(b, sid, X_REC[pos:], cuts[3:], start=pos,
                            emitted=info["frames_output"])
        outs += more
        outs.append(_finish(b, sid))
        assert 'nnetc_stream_events_total{event="restored"} 1.0' in b.get("/metrics").text
    np.testing.assert_array_equal(np.concatenate(outs), _engine_stream(config, 3, X_REC, 7))
    # finished: the checkpoint is replaced by an expiring "ended" marker
    rec = msgpack.unpackb(server.client().get(f"nnetc:stream:{sid}"), raw=False)
    assert rec == {"v": 1, "ended": True}
    assert server.client().ttl(f"nnetc:stream:{sid}") > 0


@needs_redis
def test_two_servers_take_turns_on_one_stream(server):
    server.client().flushall()
    with make_client(redis_url=server.url) as a, make_client(redis_url=server.url) as b:
        mid = _register_config(a, RECURRENT, 3)
        _register_config(b, RECURRENT, 3)
        sid = a.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 7}}
                     ).json()["stream_id"]
        outs, pos = [], 0
        for i, n in enumerate([10, 10, 25, 30, 22]):
            c = (a, b)[i % 2]          # each server holds a live copy; the other moved it on
            o, _ = _push_all(c, sid, X_REC[pos:pos + n], [n], start=pos,
                             emitted=sum(map(len, outs)))
            outs += o
            pos += n
        outs.append(_finish(a, sid))
        np.testing.assert_array_equal(np.concatenate(outs),
                                      _engine_stream(RECURRENT, 3, X_REC, 7))


@needs_redis
def test_restore_needs_the_model_and_a_readable_checkpoint(server):
    server.client().flushall()
    with make_client(redis_url=server.url) as a:
        mid = _register_config(a, RECURRENT, 3)
        sid = a.post("/streams", json={"model_id": mid}).json()["stream_id"]
        a.post(f"/streams/{sid}/frames", json={"features": _enc(X_REC[:9])})
        other = a.post("/streams", json={"model_id": mid}).json()["stream_id"]
    with make_client(redis_url=server.url) as b:
        # the model is shared through Redis: b loads it by id to take the stream over
        assert b.post(f"/streams/{sid}/frames",
                      json={"features": _enc(X_REC[9:10]), "offset": 9}).status_code == 200
    with make_client(redis_url=server.url) as c:
        assert c.delete(f"/models/{mid}").status_code == 204        # gone everywhere
        r = c.post(f"/streams/{sid}/frames", json={"features": _enc(X_REC[10:12])})
        assert r.status_code == 409 and r.json()["error"]["type"] == "ModelNotRegistered"
        assert mid in r.json()["error"]["message"]
        _register_config(c, RECURRENT, 3)
        assert c.post(f"/streams/{sid}/frames",
                      json={"features": _enc(X_REC[10:12]), "offset": 10}).status_code == 200
        server.client().set(f"nnetc:stream:{other}", b"\x81\xa1v\x07")
        r = c.get(f"/streams/{other}")
        assert r.status_code == 500 and r.json()["error"]["type"] == "CorruptCheckpoint"
        assert c.get(f"/streams/{other}").status_code == 404     # deleted, not served again


def test_a_stream_whose_model_is_deleted_answers_409(client):
    """Held in this process: the next push (or finish) after the model's deletion is a
    409 naming it; registering the same model again lets the stream go on."""
    mid = _register_config(client, RECURRENT, 5)
    sid = client.post("/streams", json={"model_id": mid}).json()["stream_id"]
    assert client.post(f"/streams/{sid}/frames",
                       json={"features": _enc(X_REC[:9])}).status_code == 200
    assert client.delete(f"/models/{mid}").status_code == 204
    for path, body in ((f"/streams/{sid}/frames", {"features": _enc(X_REC[9:12])}),
                       (f"/streams/{sid}/finish", {})):
        r = client.post(path, json=body)
        assert r.status_code == 409 and r.json()["error"]["type"] == "ModelNotRegistered"
        assert mid in r.json()["error"]["message"] and r.json()["error"]["field"] == "model_id"
    assert _register_config(client, RECURRENT, 5) == mid
    assert client.post(f"/streams/{sid}/frames",
                       json={"features": _enc(X_REC[9:12]), "offset": 9}).status_code == 200


@needs_redis
def test_a_model_deleted_by_one_process_is_gone_in_the_others(server):
    """Two service processes on one Redis: after A deletes a model that B has loaded
    (and runs a stream on), B lists it no more, answers 404 for it and 409 for the
    stream, as A does."""
    server.client().flushall()
    with make_client(redis_url=server.url) as a, make_client(redis_url=server.url) as b:
        mid = _register_config(a, RECURRENT, 3)
        assert b.get(f"/models/{mid}").status_code == 200            # b loads it
        sid = b.post("/streams", json={"model_id": mid}).json()["stream_id"]
        assert b.post(f"/streams/{sid}/frames",
                      json={"features": _enc(X_REC[:9])}).status_code == 200
        assert a.delete(f"/models/{mid}").status_code == 204
        assert b.get(f"/models/{mid}").status_code == 404
        assert mid not in [m["model_id"] for m in b.get("/models").json()["models"]]
        for c in (b, a):
            r = c.post(f"/streams/{sid}/frames", json={"features": _enc(X_REC[9:12])})
            assert r.status_code == 409 and r.json()["error"]["type"] == "ModelNotRegistered"
        r = b.post("/compute", json={"model_id": mid, "request": {
            "inputs": [{"name": "input", "indexes": [[0, 0, 0]]}],
            "outputs": [{"name": "output", "indexes": [[0, 0, 0]]}]}, "inputs": {}})
        assert r.status_code == 404 and r.json()["error"]["field"] == "model_id"
        # registered again (on either): back everywhere, and the stream goes on
        assert _register_config(a, RECURRENT, 3) == mid
        assert b.post(f"/streams/{sid}/frames",
                      json={"features": _enc(X_REC[9:12]), "offset": 9}).status_code == 200


@needs_redis
def test_redis_outage_keeps_held_streams_going(server):
    server.client().flushall()
    with make_client(redis_url=server.url, redis_timeout_s=0.5) as a:
        mid = _register_config(a, RECURRENT, 3)
        sid = a.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 7}}
                     ).json()["stream_id"]
        outs, pos = _push_all(a, sid, X_REC, [30])
        server.stop()
        try:
            more, _ = _push_all(a, sid, X_REC[pos:], [40, 27], start=pos,
                                emitted=sum(map(len, outs)))     # held here: goes on
            outs += more
            assert 'nnetc_stream_events_total{event="checkpoint_error"}' in a.get("/metrics").text
            r = a.get("/streams/s-elsewhere")
            assert r.status_code == 503 and r.json()["error"]["type"] == "StoreUnavailable"
        finally:
            server.start()
        outs.append(_finish(a, sid))
    np.testing.assert_array_equal(np.concatenate(outs), _engine_stream(RECURRENT, 3, X_REC, 7))


@needs_redis
def test_store_refuses_a_stale_save(server):
    import redis as redis_py  # noqa: PLC0415

    from service.streams import RECORD_VERSION, RedisStreamStore, StreamConflict  # noqa: PLC0415
    server.client().flushall()
    store = RedisStreamStore(redis_py.Redis.from_url(server.url), ttl_s=30)
    rec = {"v": RECORD_VERSION, "version": 1, "model_id": "m", "options": {},
           "state": b"x", "frames_output": 0}
    store.save("s1", rec, None)
    store.save("s1", {**rec, "version": 2}, 1)
    with pytest.raises(StreamConflict):
        store.save("s1", {**rec, "version": 2}, 1)         # someone already saved version 2
    assert store.version("s1") == 2
    assert 0 < server.client().ttl("nnetc:stream:s1") <= 30


def test_a_blstm_is_refused_unless_truncation_is_asked_for(client):
    # a BLSTM (Kaldi binary model): each output depends on all later frames
    path = Path(__file__).resolve().parents[1] / "data" / "inference" / "blstm" / "model.raw"
    mid = client.post("/models", json={"binary_b64": base64.b64encode(
        path.read_bytes()).decode()}).json()["model_id"]
    r = client.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 20}})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["type"] == "InferenceError" and "backward" in err["message"]
    assert "truncate_future_recurrence" in err["message"]
    assert err["field"] == "options"
    # asked for: Kaldi's looped decodable, the backward recurrence cut at chunk ends
    d = path.parent
    x = np.load(d / "infer_utt1_part.npz")["features"]
    ref = np.load(d / "looped_truncated.npz")["output.fpc20_elci0"]
    r = client.post("/streams", json={"model_id": mid, "options": {
        "frames_per_chunk": 20, "truncate_future_recurrence": True}})
    assert r.status_code == 201, r.text
    assert "blstm1-backward" in r.json()["truncated_recurrence"]
    sid = r.json()["stream_id"]
    outs, _ = _push_all(client, sid, x, [7, 30, 1, 64])
    outs.append(_finish(client, sid))
    ours = np.concatenate([o.reshape(-1, 300) for o in outs])
    assert ours.shape == ref.shape
    assert np.max(np.abs(ours - ref)) <= 1e-4 + 2e-3 * np.max(np.abs(ref))


@needs_redis
def test_a_stream_closed_elsewhere_is_not_carried_on(server):
    server.client().flushall()
    with make_client(redis_url=server.url) as a, make_client(redis_url=server.url) as b:
        mid = _register_config(a, RECURRENT, 3)
        sid = a.post("/streams", json={"model_id": mid}).json()["stream_id"]
        assert a.post(f"/streams/{sid}/frames",
                      json={"features": _enc(X_REC[:5])}).status_code == 200
        assert b.delete(f"/streams/{sid}").status_code == 204      # closed by b
        r = a.post(f"/streams/{sid}/frames", json={"features": _enc(X_REC[5:9])})
        assert r.status_code == 404                                 # a does not resurrect it
        assert a.get(f"/streams/{sid}").status_code == 404
        assert b.delete(f"/streams/{sid}").status_code == 404


@needs_redis
def test_an_expired_checkpoint_is_written_again_by_its_holder(server):
    server.client().flushall()
    with make_client(redis_url=server.url) as a:
        mid = _register_config(a, RECURRENT, 3)
        sid = a.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 7}}
                     ).json()["stream_id"]
        outs, pos = _push_all(a, sid, X_REC, [20])
        server.client().delete(f"nnetc:stream:{sid}")                # as if it had expired
        more, _ = _push_all(a, sid, X_REC[pos:], [77], start=pos,
                            emitted=sum(map(len, outs)))
        assert server.client().exists(f"nnetc:stream:{sid}") == 1
    with make_client(redis_url=server.url) as b:                     # and it can move on
        outs += more
        outs.append(_finish(b, sid))
    np.testing.assert_array_equal(np.concatenate(outs), _engine_stream(RECURRENT, 3, X_REC, 7))


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fpc=st.integers(1, 12), cuts=st.lists(st.integers(0, 40), min_size=1, max_size=8),
       frames=st.integers(1, 60))
def test_any_pieces_give_the_engine_stream_output(client, fpc, cuts, frames):
    """Property: however the frames are cut into pushes (empty pushes included), the
    stream's rows are the engine's looped output for the whole input."""
    mid = _register_config(client, RECURRENT, 3)
    x = X_REC[:frames]
    sid = client.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": fpc}}
                      ).json()["stream_id"]
    outs, pos = [], 0
    for n in cuts + [frames]:
        piece = x[pos:pos + n]
        r = client.post(f"/streams/{sid}/frames", json={"features": _enc(piece), "offset": pos,
                                                         "encoding": "base64"})
        assert r.status_code == 200, r.text
        assert r.json()["first_frame"] == sum(map(len, outs))
        outs.append(decode(r.json()["output"]).reshape(-1, 6))
        pos += len(piece)
    outs.append(_finish(client, sid).reshape(-1, 6))
    np.testing.assert_array_equal(np.concatenate(outs), _engine_stream(RECURRENT, 3, x, fpc))


def test_websocket_errors_are_the_http_errors(client):
    mid = _register_config(client, RECURRENT, 3)
    sid = client.post("/streams", json={"model_id": mid}).json()["stream_id"]
    for bad in ({"features": [[0.0] * 8], "colour": 1},        # unknown field
                {"features": [[0.0] * 3]},                      # wrong dimension
                {"features": [[0.0] * 8], "offset": 7}):        # wrong offset
        http = client.post(f"/streams/{sid}/frames", json=bad)
        with client.websocket_connect(f"/streams/{sid}/ws") as ws:
            ws.send_json(bad)
            got = ws.receive_json()
        assert got == {**http.json(), "status": http.status_code}


# -- online i-vectors --------------------------------------------------------------------------

ONLINE = Path(__file__).resolve().parents[1] / "data" / "inference" / "online_ivectors"


def _register_online(client) -> str:
    """The model of the online i-vector case, registered; its id."""
    r = client.post("/models", json={"binary_b64": base64.b64encode(
        (ONLINE / "model.raw").read_bytes()).decode()})
    assert r.status_code in (200, 201), r.text
    return r.json()["model_id"]


def _open_online(client, mid: str, period: int = 10, **options) -> str:
    r = client.post("/streams", json={"model_id": mid, "online_ivector_period": period,
                                      "options": {"frames_per_chunk": 20, **options}})
    assert r.status_code == 201, r.text
    return r.json()["stream_id"]


def _online_case(i: int):
    import json  # noqa: PLC0415
    s = json.loads((ONLINE / "case.json").read_text())["settings"][i]
    z = np.load(ONLINE / "case.npz")
    return (s, z["features"], z[f"online.{s['key']}"], z[f"output.{s['key']}"])


def test_online_ivector_rows_through_the_service_equal_kaldi(client):
    """A stream opened with online_ivector_period takes i-vector rows with its frames
    (HTTP and WebSocket pushes); the output is Kaldi's looped decodable's with that
    online i-vector matrix (tests/data/inference/online_ivectors)."""
    mid = _register_online(client)
    for i, via_ws in ((0, False), (1, True)):
        s, x, rows, ref = _online_case(i)
        period = s["online_ivector_period"]
        sid = _open_online(client, mid, period, frames_per_chunk=s["frames_per_chunk"],
                           extra_left_context_initial=s["extra_left_context_initial"])
        assert client.get(f"/streams/{sid}").json()["online_ivector_period"] == period
        pushes, pos, sent = [], 0, 0
        for n in (17, 3, 25, 9, 100):
            want = min(len(rows), (pos + n) // period)
            body = {"features": _enc(x[pos:pos + n]), "encoding": "base64"}
            if want > sent:
                body["online_ivectors"] = _enc(rows[sent:want])
                sent = want
            pushes.append(body)
            pos += n
        pushes.append({"features": _enc(x[:0]), "online_ivectors": _enc(rows[sent:]),
                       "encoding": "base64"})
        outs = []
        if via_ws:
            with client.websocket_connect(f"/streams/{sid}/ws") as ws:
                for body in pushes:
                    ws.send_json(body)
                    j = ws.receive_json()
                    outs.append(decode(j["output"]).reshape(-1, ref.shape[1]))
                ws.send_json({"finish": True, "encoding": "base64"})
                outs.append(decode(ws.receive_json()["output"]).reshape(-1, ref.shape[1]))
        else:
            for body in pushes:
                r = client.post(f"/streams/{sid}/frames", json=body)
                assert r.status_code == 200, r.text
                outs.append(decode(r.json()["output"]).reshape(-1, ref.shape[1]))
            info = client.get(f"/streams/{sid}").json()
            assert info["ivector_rows_received"] == len(rows)
            outs.append(_finish(client, sid).reshape(-1, ref.shape[1]))
        ours = np.concatenate(outs)
        assert ours.shape == ref.shape
        assert np.max(np.abs(ours - ref)) <= 1e-4 + 2e-3 * np.max(np.abs(ref))


def test_online_ivector_mistakes_get_4xx_naming_the_field(client):
    mid = _register_online(client)
    plain = _register_config(client, RECURRENT, 3)
    iv = {"model_id": mid, "ivector": [0.0] * 8, "online_ivector_period": 3}
    for body, field in ((iv, "online_ivector_period"),
                        ({"model_id": plain, "online_ivector_period": 3},
                         "online_ivector_period"),
                        ({"model_id": mid, "online_ivector_period": 0},
                         "online_ivector_period")):
        r = client.post("/streams", json=body)
        assert r.status_code == 422, r.text
        assert field in (r.json()["error"].get("field") or str(r.json())), r.text
    sid = _open_online(client, mid, 3)
    x = np.zeros((4, 13), np.float32)
    for extra, field in (({"online_ivectors": _enc(np.zeros((2, 5), np.float32))},
                          "online_ivectors"),
                         ({"online_ivectors": _enc(np.full((1, 8), np.nan, np.float32))},
                          "online_ivectors"),
                         ({"ivector": [0.0] * 8}, "ivector")):
        r = client.post(f"/streams/{sid}/frames", json={"features": _enc(x), **extra})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == field, r.text
    per_utt = client.post("/streams", json={"model_id": mid, "ivector": [0.0] * 8}
                          ).json()["stream_id"]
    r = client.post(f"/streams/{per_utt}/frames", json={
        "features": _enc(x), "online_ivectors": _enc(np.zeros((1, 8), np.float32))})
    assert r.status_code == 422 and r.json()["error"]["field"] == "online_ivectors", r.text
    # finished without a single row: the stream cannot produce its output
    r = client.post(f"/streams/{sid}/frames", json={"features": _enc(x)})
    assert r.status_code == 200
    r = client.post(f"/streams/{sid}/finish", json={})
    assert r.status_code == 422, r.text         # a StreamError, as any misuse of a stream
    assert "no i-vector row" in r.text
    # the stream is still open: a row, and it finishes
    r = client.post(f"/streams/{sid}/frames", json={
        "features": _enc(x[:0]), "online_ivectors": _enc(np.ones((1, 8), np.float32))})
    assert r.status_code == 200, r.text
    r = client.post(f"/streams/{sid}/finish", json={})
    assert r.status_code == 200 and r.json()["frames_output"] == 4, r.text


def test_online_ivector_rows_held_are_bounded():
    """Rows pushed far ahead of the frames that read them are refused (413) once a
    stream would hold more than max_stream_ivector_rows; rows the chunks have read
    no longer count.  Frames waiting for their rows are bounded by
    max_request_indexes the same way."""
    with make_client(max_stream_ivector_rows=6) as c:
        sid = _open_online(c, _register_online(c))
        x = np.zeros((45, 13), np.float32)
        rows = np.ones((7, 8), np.float32)
        r = c.post(f"/streams/{sid}/frames", json={"features": _enc(x[:0]),
                                                    "online_ivectors": _enc(rows)})
        assert r.status_code == 413 and r.json()["error"]["field"] == "online_ivectors", r.text
        assert c.get(f"/streams/{sid}").json()["ivector_rows_received"] == 0   # unchanged
        r = c.post(f"/streams/{sid}/frames", json={"features": _enc(x),
                                                    "online_ivectors": _enc(rows[:6])})
        assert r.status_code == 200 and r.json()["frames_output"] == 40, r.text
        # two chunks read rows 2 and 4; the next will read row 6 (or the last): rows 0-4
        # are dropped, so three more rows make 4 held
        r = c.post(f"/streams/{sid}/frames", json={"features": _enc(x[:0]),
                                                    "online_ivectors": _enc(rows[:3])})
        assert r.status_code == 200, r.text
    # frames waiting for their rows are bounded too (by max_request_indexes)
    with make_client(max_request_indexes=50) as c:
        sid = _open_online(c, _register_online(c))
        x = np.zeros((30, 13), np.float32)
        assert c.post(f"/streams/{sid}/frames", json={"features": _enc(x)}).status_code == 200
        r = c.post(f"/streams/{sid}/frames", json={"features": _enc(x)})
        assert r.status_code == 413 and r.json()["error"]["field"] == "features", r.text
        r = c.post(f"/streams/{sid}/frames", json={"features": _enc(x),
                                                    "online_ivectors": _enc(np.ones((6, 8)))})
        assert r.status_code == 413             # (checked before the rows are taken)
        r = c.post(f"/streams/{sid}/frames", json={"features": _enc(x[:0]),
                                                    "online_ivectors": _enc(np.ones((3, 8)))})
        assert r.status_code == 200 and r.json()["frames_output"] == 20, r.text


_ONLINE_PUSH = st.tuples(
    st.integers(0, 30),                                   # frames
    st.sampled_from([13, 13, 13, 12]),                    # feature dim (12: wrong)
    st.integers(-1, 4),                                   # rows (-1: none sent)
    st.sampled_from([8, 8, 8, 7]),                        # row dim (7: wrong)
    st.booleans())                                        # a NaN in the rows


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pushes=st.lists(_ONLINE_PUSH, max_size=8))
def test_online_pushes_of_any_shape_get_200_or_422_and_the_good_ones_count(client, pushes):
    """Property: pushes of any shape to an online stream are answered 200 or 422 (never
    5xx), a refused push changes nothing, and after the accepted ones and a finish the
    output is the engine's stream given exactly the accepted frames and rows."""
    mid = _register_online(client)
    sid = _open_online(client, mid, 10)
    rng = np.random.default_rng(len(pushes))
    frames, rows_sent, outs = [], [], []
    for n, fdim, nrows, rdim, nan in pushes:
        x = rng.standard_normal((n, fdim)).astype(np.float32)
        body = {"features": _enc(x)}
        rows = None
        if nrows >= 0:
            rows = rng.standard_normal((nrows, rdim)).astype(np.float32)
            if nan and nrows:
                rows[0, 0] = np.nan
            body["online_ivectors"] = _enc(rows)
        r = client.post(f"/streams/{sid}/frames", json=body)
        good = fdim == 13 and (rows is None or (rdim == 8 and not (nan and nrows)))
        assert r.status_code == (200 if good else 422), (body.keys(), r.text)
        if good:
            frames.append(x)
            if rows is not None:
                rows_sent.append(rows)
            outs.append(decode(r.json()["output"]).reshape(-1, 10))
    x_all = np.concatenate(frames) if frames else np.zeros((0, 13), np.float32)
    rows_all = np.concatenate(rows_sent) if rows_sent else np.zeros((0, 8), np.float32)
    r = client.post(f"/streams/{sid}/finish", json={"encoding": "base64"})
    if len(x_all) and not len(rows_all):
        assert r.status_code == 422 and "no i-vector row" in r.text
        client.delete(f"/streams/{sid}")
        return
    assert r.status_code == 200, r.text
    assert r.json()["frames_output"] == len(x_all)
    outs.append(decode(r.json()["output"]).reshape(-1, 10))
    if len(x_all):
        s = LoopedModel(load_model(str(ONLINE / "model.raw")).nnet, LoopedConfig(20, 0, 1),
                        backend=service_backend()).stream(online_ivector_period=10)
        want = np.concatenate([s.push(x_all, online_ivectors=rows_all), s.finish()])
        np.testing.assert_array_equal(np.concatenate(outs), want)


def test_the_first_chunk_is_bounded_before_compiling(compiles):
    """frame_subsampling_factor (frames_per_chunk is rounded up to a multiple of it) and
    extra_left_context_initial make the first chunk's computation as large as
    frames_per_chunk does: past max_request_indexes the open is a 413 naming the
    option, answered at once (a factor of 10**9 used to be counted up to, one by one)."""
    with make_client(max_request_indexes=1000) as c:
        mid = _register_config(c, RECURRENT, 3)
        for opts, field in (({"frame_subsampling_factor": 10 ** 9}, "frame_subsampling_factor"),
                            ({"frame_subsampling_factor": 2 ** 70}, "frame_subsampling_factor"),
                            ({"extra_left_context_initial": 10 ** 9},
                             "extra_left_context_initial"),
                            ({"frames_per_chunk": 600, "extra_left_context_initial": 600},
                             "extra_left_context_initial")):
            r = c.post("/streams", json={"model_id": mid, "options": opts})
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["field"] == f"options.{field}" and "(1000)" in err["message"]
            assert f"{field} {opts[field]}" in err["message"]
            assert compiles == [], opts      # refused before anything was compiled
        r = c.post("/streams", json={"model_id": mid, "options": {
            "frames_per_chunk": 7, "frame_subsampling_factor": 3,
            "extra_left_context_initial": 10}})
        assert r.status_code == 201, r.text
        assert compiles                      # (a stream that opens does compile)
        assert r.json()["chunk_size"] >= 7 and r.json()["chunk_size"] % 3 == 0


def test_a_binary_websocket_message_is_a_bad_message(client):
    """Messages are JSON text: a binary one gets the BadMessage error and the socket is
    closed (1003), as for text that is not JSON (it used to escape the handler); the
    stream is untouched."""
    mid = _register_config(client, RECURRENT, 3)
    sid = client.post("/streams", json={"model_id": mid}).json()["stream_id"]
    with client.websocket_connect(f"/streams/{sid}/ws") as ws:
        ws.send_bytes(b"\x00\x01\x02")
        err = ws.receive_json()
        assert err["status"] == 400 and err["error"]["type"] == "BadMessage"
        assert "JSON text" in err["error"]["message"]
        with pytest.raises(WebSocketDisconnect) as e:
            ws.receive_json()
        assert e.value.code == 1003
    info = client.get(f"/streams/{sid}")
    assert info.status_code == 200 and info.json()["frames_received"] == 0


@needs_redis
@pytest.mark.parametrize("mutate", [
    lambda o: o.pop("frames_per_chunk"),                    # missing
    lambda o: o.update(frames_per_chunk="7"),               # wrong type
    lambda o: o.update(use_priors=None),
    lambda o: o.update(acoustic_scale=[]),
    lambda o: o.update(bogus=1),                            # not an option
])
def test_a_checkpoint_with_broken_options_is_corrupt_and_dropped(server, mutate):
    """The options stored in a checkpoint are checked as a client's are: broken ones make
    the checkpoint corrupt (500 CorruptCheckpoint, record deleted), not an internal error
    left in Redis for every later request."""
    server.client().flushall()
    with make_client(redis_url=server.url) as a:
        mid = _register_config(a, RECURRENT, 3)
        sid = a.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 7}}
                     ).json()["stream_id"]
        assert a.post(f"/streams/{sid}/frames",
                      json={"features": _enc(X_REC[:9])}).status_code == 200
    key = f"nnetc:stream:{sid}"
    rec = msgpack.unpackb(server.client().get(key), raw=False)
    mutate(rec["options"])
    server.client().set(key, msgpack.packb(rec, use_bin_type=True))
    with make_client(redis_url=server.url) as b:
        _register_config(b, RECURRENT, 3)
        r = b.post(f"/streams/{sid}/frames", json={"features": _enc(X_REC[9:12]), "offset": 9})
        assert r.status_code == 500 and r.json()["error"]["type"] == "CorruptCheckpoint", r.text
        assert server.client().exists(key) == 0


def _checkpointed_stream(server, **options) -> tuple[str, str]:
    """A RECURRENT stream with 9 frames pushed, checkpointed in Redis: (model id, id)."""
    server.client().flushall()
    with make_client(redis_url=server.url) as a:
        mid = _register_config(a, RECURRENT, 3)
        sid = a.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 7,
                                                                     **options}}
                     ).json()["stream_id"]
        assert a.post(f"/streams/{sid}/frames",
                      json={"features": _enc(X_REC[:9])}).status_code == 200
    return mid, sid


@needs_redis
def test_a_checkpoint_of_the_wrong_redis_type_is_corrupt_not_an_outage(server):
    """A stream key holding another Redis type is a broken checkpoint (500
    CorruptCheckpoint, key deleted, then 404), not a 503 as if Redis were down."""
    _, sid = _checkpointed_stream(server)
    key = f"nnetc:stream:{sid}"
    server.client().delete(key)
    server.client().hset(key, "state", b"x")
    with make_client(redis_url=server.url) as b:
        _register_config(b, RECURRENT, 3)
        r = b.post(f"/streams/{sid}/frames", json={"features": _enc(X_REC[9:12]), "offset": 9})
        assert r.status_code == 500 and r.json()["error"]["type"] == "CorruptCheckpoint", r.text
        assert server.client().exists(key) == 0
        assert b.get(f"/streams/{sid}").status_code == 404


@needs_redis
def test_a_checkpoint_asking_for_priors_the_model_lacks_is_corrupt(server):
    """use_priors set in a checkpoint of a model without priors (a client could not have
    opened it so) is a broken checkpoint, not a 422 blamed on the client's features."""
    _, sid = _checkpointed_stream(server)
    key = f"nnetc:stream:{sid}"
    rec = msgpack.unpackb(server.client().get(key), raw=False)
    rec["options"]["use_priors"] = True
    server.client().set(key, msgpack.packb(rec, use_bin_type=True))
    with make_client(redis_url=server.url) as b:
        _register_config(b, RECURRENT, 3)
        r = b.post(f"/streams/{sid}/frames", json={"features": _enc(X_REC[9:12]), "offset": 9})
        assert r.status_code == 500 and r.json()["error"]["type"] == "CorruptCheckpoint", r.text
        assert "priors" in r.json()["error"]["message"]
        assert server.client().exists(key) == 0


@needs_redis
@pytest.mark.parametrize("field, value", [("frames_per_chunk", 10**9),
                                          ("extra_left_context_initial", 10**9),
                                          ("frame_subsampling_factor", 10**8)])
def test_a_checkpoint_chunk_beyond_the_bound_is_refused_before_compiling(server, field, value,
                                                                         compiles):
    """A checkpoint whose chunk (frames_per_chunk, rounded up, plus the initial extra
    context) is beyond this server's max_request_indexes is refused with the 413 that
    opening such a stream gets, at once, instead of compiling a huge computation."""
    _, sid = _checkpointed_stream(server)
    key = f"nnetc:stream:{sid}"
    rec = msgpack.unpackb(server.client().get(key), raw=False)
    rec["options"][field] = value
    server.client().set(key, msgpack.packb(rec, use_bin_type=True))
    with make_client(redis_url=server.url) as b:
        _register_config(b, RECURRENT, 3)
        before = len(compiles)
        r = b.post(f"/streams/{sid}/frames", json={"features": _enc(X_REC[9:12]), "offset": 9})
        assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLarge", r.text
        assert r.json()["error"]["field"] == f"options.{field}"
        assert "checkpoint" in r.json()["error"]["message"]
        assert len(compiles) == before       # refused before compiling the chunk
