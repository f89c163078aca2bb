"""More bad input that must get a 4xx naming what is at fault, and leave the service
serving: request inputs at component nodes, bodies that are not JSON objects, matrices
in neither wire form, i-vector and option errors of /infer and /streams blamed on the
right field, integers a queued job cannot carry, WebSocket messages out of shape."""

from __future__ import annotations

import json
import warnings

import msgpack
import numpy as np
import pytest
from starlette.websockets import WebSocketDisconnect

from tests.engine.inference_nets import RECURRENT, TDNN_IVECTOR
from tests.service.conftest import (TINY_CONFIG, ThreadWorker, decode, encode, make_client,
                                    needs_redis, register, request_for)


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        yield c


def _err(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "field"}
    return body["error"]


def _good_compute(client, mid):
    x = np.arange(20, dtype=np.float32).reshape(5, 4) / 20
    r = client.post("/compute", json={"model_id": mid, "request": request_for(0, 3),
                                      "inputs": {"input": encode(x)}})
    assert r.status_code == 200, r.text
    return decode(r.json()["outputs"]["output"])


def test_a_component_node_as_a_request_input_is_a_422_naming_it(client):
    """The compiler cannot take a component's output from the request (Kaldi's graph
    builder asserts): it was a 500 (KeyError in the worker)."""
    mid = register(client, config=TINY_CONFIG)["model_id"]
    want = _good_compute(client, mid)
    req = {**request_for(0, 3), "inputs": [{"name": "relu1",
                                             "indexes": [[0, t, 0] for t in range(3)]}]}
    for route, extra in (("/compile", {}),
                         ("/compute", {"inputs": {"relu1": np.zeros((3, 5)).tolist()}})):
        e = _err(client.post(route, json={"model_id": mid, "request": req, **extra}), 422)
        assert e["field"] == "request.inputs.0.name", e
        assert "'relu1' is a component node" in e["message"]
    np.testing.assert_array_equal(_good_compute(client, mid), want)


def test_bodies_that_are_not_json_objects_say_why(client):
    json_type = {"content-type": "application/json"}
    e = _err(client.post("/compile", content=b'{"model_id": "', headers=json_type), 422)
    assert e["message"].startswith("body: not valid JSON at character 13") and e["field"] is None
    e = _err(client.post("/compile", content=b'{"model_id": "\xff"}', headers=json_type), 400)
    assert "not readable as JSON" in e["message"] and "UnicodeDecodeError" in e["message"]
    e = _err(client.post("/compile", content=b"[" * 100000 + b"]" * 100000,
                         headers=json_type), 400)
    assert "RecursionError" in e["message"]
    e = _err(client.post("/compile", content=b"{}"), 422)          # no content type
    assert "Content-Type: application/json" in e["message"]
    e = _err(client.post("/compile", content=b"[1]", headers=json_type), 422)
    assert e["message"] == "body: expected a JSON object, got an array"
    e = _err(client.post("/compile", content=b"", headers=json_type), 422)
    assert e["message"] == "body: empty: send a JSON object"


def test_matrix_errors_name_the_part_of_the_matrix_at_fault(client):
    """A matrix is JSON rows or the encoded form: an error inside the encoded form names
    the encoded form's field (it said 'inputs.input.list[list[float]]: Input should be a
    valid list (and 1 more)'), one inside the rows names the cell."""
    mid = register(client, config=TINY_CONFIG)["model_id"]
    body = {"model_id": mid, "request": request_for(0, 3)}
    x = np.zeros((5, 4), np.float32)
    for matrix, field, words in (
            ({**encode(x), "dtype": "float64"}, "inputs.input.dtype", "'float32'"),
            ({"shape": [5, 4], "data": 5}, "inputs.input.data", "valid string"),
            ({"shape": [20], "data": encode(x)["data"]}, "inputs.input.shape.1", "required"),
            ([["a"] * 4] * 5, "inputs.input.0.0", "valid number"),
            ("abc", "inputs.input", "expected a matrix")):
        e = _err(client.post("/compute", json={**body, "inputs": {"input": matrix}}), 422)
        assert e["field"] == field and words in e["message"], e
        assert "list[list[float]]" not in e["message"] and "EncodedMatrix" not in e["message"]


IVECTOR_MODEL = {"config": TDNN_IVECTOR, "seed": 0}


def test_infer_errors_name_the_field_at_fault(client):
    """i-vector and option errors found by the worker were all blamed on 'features'."""
    mid = register(client, config=TINY_CONFIG)["model_id"]
    ivm = client.post("/models", json=IVECTOR_MODEL).json()["model_id"]
    feats, f8 = np.zeros((10, 4)).tolist(), np.zeros((10, 8)).tolist()
    for model, extra, field, words in (
            (mid, {"ivector": [1.0, 2.0]}, "ivector", "no 'ivector' input"),
            (mid, {"online_ivectors": [[1.0]], "online_ivector_period": 10}, "online_ivectors",
             "no 'ivector' input"),
            (mid, {"options": {"use_priors": True}}, "options.use_priors", "no priors"),
            (mid, {"options": {"output": "nope"}}, "options.output", "'nope'"),
            (ivm, {}, "ivector", "no i-vectors were given"),
            (ivm, {"online_ivectors": [[1.0] * 3], "online_ivector_period": 10},
             "online_ivectors", "4 columns"),
            (ivm, {"online_ivectors": [[1.0] * 4]}, "online_ivector_period", "period > 0"),
            (ivm, {"online_ivectors": [[1.0] * 4], "online_ivector_period": -1},
             "online_ivector_period", "got -1"),
            (ivm, {"online_ivectors": [[1.0] * 4], "online_ivector_period": 2 ** 64},
             "online_ivector_period", "2147483647")):
        e = _err(client.post("/infer", json={"model_id": model,
                                             "features": f8 if model == ivm else feats,
                                             **extra}), 422)
        assert e["field"] == field and words in e["message"], e
    ok = client.post("/infer", json={"model_id": ivm, "features": f8,
                                     "online_ivectors": [[1.0] * 4], "online_ivector_period": 10})
    assert ok.status_code == 200 and ok.json()["num_frames"] == 10


def test_infer_frame_subsampling_factor_is_bounded_with_the_chunk(client):
    """frames_per_chunk is rounded up to a multiple of frame_subsampling_factor: a
    factor past max_request_indexes is a 413 naming it, as for /streams (2**64 was a
    500 with jobs on the Redis queue)."""
    mid = register(client, config=TINY_CONFIG)["model_id"]
    feats = np.zeros((10, 4)).tolist()
    e = _err(client.post("/infer", json={"model_id": mid, "features": feats,
                                         "options": {"frame_subsampling_factor": 2 ** 64}}), 413)
    assert e["field"] == "options.frame_subsampling_factor"
    assert f"frame_subsampling_factor {2 ** 64}" in e["message"]
    ok = client.post("/infer", json={"model_id": mid, "features": feats,
                                     "options": {"frame_subsampling_factor": 3}})
    assert ok.status_code == 200 and ok.json()["num_frames"] == 4


def test_stream_errors_name_the_field_at_fault(client):
    mid = client.post("/models", json={"config": RECURRENT, "seed": 0}).json()["model_id"]
    ivm = client.post("/models", json=IVECTOR_MODEL).json()["model_id"]
    for body, status, field, words in (
            ({"model_id": mid, "ivector": [1.0]}, 422, "ivector", "no 'ivector' input"),
            ({"model_id": ivm}, 422, "ivector", "none was given"),
            ({"model_id": mid, "options": {"use_priors": True}}, 422, "options.use_priors",
             "no priors"),
            ({"model_id": ivm, "online_ivector_period": 2 ** 64}, 422, "online_ivector_period",
             "2147483647")):
        e = _err(client.post("/streams", json=body), status)
        assert e["field"] == field and words in e["message"], e
    sid = client.post("/streams", json={"model_id": mid}).json()["stream_id"]
    e = _err(client.post(f"/streams/{sid}/frames", json={"features": [[0.0] * 8],
                                                          "ivector": [1.0]}), 422)
    assert e["field"] == "ivector"
    e = _err(client.post(f"/streams/{sid}/frames", json={"features": [[0.0] * 8],
                                                          "offset": 2 ** 64}), 422)
    assert e["field"] == "offset" and str(2 ** 64) in e["message"]
    r = client.post(f"/streams/{sid}/frames", json={"features": [[0.0] * 8], "offset": 0})
    assert r.status_code == 200 and r.json()["frames_received"] == 1
    # an online stream cannot end without a row: the finish names the rows
    osid = client.post("/streams", json={"model_id": ivm, "online_ivector_period": 10}
                       ).json()["stream_id"]
    assert client.post(f"/streams/{osid}/frames",
                       json={"features": np.zeros((5, 8)).tolist()}).status_code == 200
    e = _err(client.post(f"/streams/{osid}/finish"), 422)
    assert e["field"] == "online_ivectors" and "no i-vector row" in e["message"]


def test_websocket_finish_must_be_true_and_deep_json_is_a_bad_message(client):
    """{"finish": "no"} finished the stream (any truthy value did); JSON nested past the
    parser's depth escaped the handler (RecursionError) instead of the BadMessage
    answer."""
    mid = client.post("/models", json={"config": RECURRENT, "seed": 0}).json()["model_id"]
    sid = client.post("/streams", json={"model_id": mid}).json()["stream_id"]
    with client.websocket_connect(f"/streams/{sid}/ws") as ws:
        for value in ("no", False, 1):
            ws.send_json({"finish": value})
            err = ws.receive_json()
            assert err["status"] == 422 and err["error"]["field"] == "finish", err
            assert "must be true" in err["error"]["message"]
        ws.send_json({"features": [[0.0] * 8], "offset": 0})
        assert ws.receive_json()["frames_received"] == 1         # still open
        ws.send_text("[" * 100000 + "]" * 100000)
        err = ws.receive_json()
        assert err["status"] == 400 and err["error"]["type"] == "BadMessage"
        with pytest.raises(WebSocketDisconnect) as e:
            ws.receive_json()
        assert e.value.code == 1003
    info = client.get(f"/streams/{sid}").json()
    assert info["frames_received"] == 1 and info["finished"] is False


def test_websocket_lone_surrogate_escape_is_a_bad_message(client):
    """A message whose JSON holds a lone UTF-16 surrogate escape (its error could not be
    encoded to answer it) gets the BadMessage answer, and the stream is untouched."""
    mid = client.post("/models", json={"config": RECURRENT, "seed": 0}).json()["model_id"]
    sid = client.post("/streams", json={"model_id": mid}).json()["stream_id"]
    with client.websocket_connect(f"/streams/{sid}/ws") as ws:
        ws.send_text('{"finish": true, "encoding": "\\ud800"}')
        err = ws.receive_json()
        assert err["status"] == 400 and err["error"]["type"] == "BadMessage"
        assert "lone UTF-16 surrogate" in err["error"]["message"]
    info = client.get(f"/streams/{sid}").json()
    assert info["frames_received"] == 0 and info["finished"] is False


def test_upload_name_is_bounded_like_the_json_name(client):
    e = _err(client.post("/models/upload", content=TINY_CONFIG.encode(),
                         params={"name": "n" * 201}), 422)
    assert e["field"] == "query.name" and "200" in e["message"]


def test_the_msgpack_content_type_is_case_insensitive(client):
    r = client.post("/models", content=msgpack.packb({"config": TINY_CONFIG, "seed": 1}),
                    headers={"content-type": "Application/MsgPack",
                             "accept": "Application/MsgPack"})
    assert r.status_code in (200, 201), r.content[:200]
    assert r.headers["content-type"] == "application/msgpack"


@needs_redis
def test_integers_a_queued_job_cannot_carry_are_4xx(server):
    """With jobs on the Redis queue (msgpack: 64-bit integers) these were 500s: Indexes
    in /compile (checked only by the worker), an online i-vector period, a push offset.
    Each is now refused by the API, naming the field, and the worker goes on serving."""
    server.client().flushall()
    with ThreadWorker(server.url, max_batch=8) as w, \
            make_client(redis_url=server.url, queue="redis", job_timeout_s=30) as c:
        mid = register(c, config=TINY_CONFIG)["model_id"]
        ivm = c.post("/models", json=IVECTOR_MODEL).json()["model_id"]
        req = {**request_for(0, 3), "outputs": [{"name": "output",
                                                  "indexes": [[0, 2 ** 64, 0]]}]}
        e = _err(c.post("/compile", json={"model_id": mid, "request": req}), 422)
        assert e["field"] == "request" and "32-bit" in e["message"]
        e = _err(c.post("/infer", json={"model_id": ivm, "features": np.zeros((5, 8)).tolist(),
                                        "online_ivectors": [[1.0] * 4],
                                        "online_ivector_period": 2 ** 64}), 422)
        assert e["field"] == "online_ivector_period"
        e = _err(c.post("/streams", json={"model_id": ivm, "online_ivector_period": 2 ** 64}),
                 422)
        assert e["field"] == "online_ivector_period"
        sid = c.post("/streams", json={"model_id": ivm, "ivector": [1.0] * 4}).json()["stream_id"]
        e = _err(c.post(f"/streams/{sid}/frames", json={"features": [[0.0] * 8],
                                                         "offset": 2 ** 64}), 422)
        assert e["field"] == "offset"
        _good_compute(c, mid)
        assert w.thread.is_alive()


def test_non_finite_values_are_named_by_position_and_make_no_warning(client):
    """A value that is NaN, infinite, or too large for float32 (it becomes infinite when
    converted) is a 422 naming the field and the first such value's row and column
    (engine.core.finite), in every route that takes numbers; the conversion of a JSON
    number beyond float32 made NumPy warn ("overflow encountered in cast") on the way."""
    mid = register(client, config=TINY_CONFIG)["model_id"]
    ivm = client.post("/models", json=IVECTOR_MODEL).json()["model_id"]
    x = np.zeros((5, 4))
    json_type = {"content-type": "application/json"}

    def post(route, body):
        # (json.dumps: NaN and Infinity as JavaScript writes them, which the API reads)
        return client.post(route, content=json.dumps(body), headers=json_type)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = x.tolist()
        rows[3][1] = 1e39
        e = _err(post("/compute", {"model_id": mid, "request": request_for(0, 3),
                                   "inputs": {"input": rows}}), 422)
        assert e["field"] == "inputs.input"
        assert "the first at row 3, column 1: +inf" in e["message"]
        assert "float32 holds magnitudes up to 3.403e+38" in e["message"]
        bad = x.astype(np.float32)
        bad[4, 0] = np.nan
        e = _err(post("/compute", {"model_id": mid, "request": request_for(0, 3),
                                   "inputs": {"input": encode(bad)}}), 422)
        assert e["message"].endswith("the first at row 4, column 0: NaN)"), e
        feats = np.zeros((5, 8)).tolist()
        e = _err(post("/infer", {"model_id": ivm, "features": feats,
                                 "ivector": [0.0, 0.0, -1e300, float("nan")]}), 422)
        assert e["field"] == "ivector" and "the first at element 2: -inf" in e["message"]
        e = _err(post("/infer", {"model_id": ivm, "features": feats,
                                 "online_ivectors": [[0.0] * 4, [0.0, float("inf"), 0, 0]],
                                 "online_ivector_period": 2}), 422)
        assert e["field"] == "online_ivectors" and "row 1, column 1: +inf" in e["message"]
        sid = post("/streams", {"model_id": ivm, "ivector": [1.0] * 4}).json()["stream_id"]
        e = _err(post(f"/streams/{sid}/frames", {"features": feats,
                                                  "ivector": [0.0, 0.0, 0.0, 1e39]}), 422)
        assert e["field"] == "ivector" and "element 3: +inf" in e["message"]
        feats[2][5] = float("-inf")
        e = _err(post(f"/streams/{sid}/frames", {"features": feats}), 422)
        assert e["field"] == "features" and "row 2, column 5: -inf" in e["message"]
        _good_compute(client, mid)
