"""Numbers and switches in requests are taken only as JSON types them: a string for
a number, a boolean for a number, a real for an integer, or anything but true/false
for a switch is a 422 naming the field (pydantic's lax mode converted "5" to 5,
"yes" to True and 2.0 to 2 without a word).  JSON integers stay valid reals."""

from __future__ import annotations

import numpy as np
import pytest

from tests.service.conftest import TINY_CONFIG, make_client, register, request_for


@pytest.fixture(scope="module", params=["in-event-loop", "parsed-apart"])
def client(request):
    """Bodies parsed as FastAPI parses them, and every JSON body parsed by the helper
    process (service/body_parse.py), its matrices packed there: the same answers."""
    settings = {"parse_offload_bytes": 0} if request.param == "parsed-apart" else {}
    with make_client(**settings) as c:
        yield c


@pytest.fixture(scope="module")
def mid(client):
    return register(client, config=TINY_CONFIG)["model_id"]


def _field_error(r, field):
    assert r.status_code == 422, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["field"] == field, err
    return err["message"]


def _compute(mid, **changes):
    req = request_for(0, 3)
    x = np.zeros((5, 4)).tolist()
    body = {"model_id": mid, "request": req, "inputs": {"input": x}}
    for path, value in changes.items():
        target = body
        keys = path.split(".")
        for k in keys[:-1]:
            target = target[int(k) if isinstance(target, list) else k]
        target[int(keys[-1]) if isinstance(target, list) else keys[-1]] = value
    return body


@pytest.mark.parametrize("path, value", [
    ("request.inputs.0.indexes.0.1", "-1"),            # a string for an index
    ("request.inputs.0.indexes.0.1", -1.0),            # a real for an index
    ("request.inputs.0.indexes.0.0", False),           # a boolean for an index
    ("request.inputs.0.has_deriv", "yes"),
    ("request.need_model_derivative", 0),
    ("inputs.input.0.0", "0.5"),                       # a string in a matrix cell
    ("inputs.input.0.0", True),
    ("use_shortcut", "false"),
])
def test_compute_refuses_converted_types(client, mid, path, value):
    msg = _field_error(client.post("/compute", json=_compute(mid, **{path: value})), path)
    assert "should be a valid" in msg, msg


def test_json_integers_are_valid_reals_and_good_requests_still_run(client, mid):
    body = _compute(mid)
    body["inputs"]["input"] = [[0, 1, 0, 1]] * 5
    r = client.post("/compute", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("options, field", [
    ({"frames_per_chunk": "50"}, "options.frames_per_chunk"),
    ({"frames_per_chunk": 50.0}, "options.frames_per_chunk"),
    ({"acoustic_scale": "0.1"}, "options.acoustic_scale"),
    ({"apply_exp": 1}, "options.apply_exp"),
])
def test_infer_options_refuse_converted_types(client, mid, options, field):
    body = {"model_id": mid, "features": np.zeros((10, 4)).tolist(), "options": options}
    _field_error(client.post("/infer", json=body), field)
    body["options"] = {}
    assert client.post("/infer", json=body).status_code == 200


def test_compile_optimizer_options_and_model_seed(client, mid):
    body = {"model_id": mid, "request": request_for(0, 3)}
    _field_error(client.post("/compile", json={**body, "optimizer": {"min_deriv_time": "0"}}),
                 "optimizer.min_deriv_time")
    _field_error(client.post("/compile", json={**body, "optimizer": {"optimize": "true"}}),
                 "optimizer.optimize")
    _field_error(client.post("/models", json={"config": TINY_CONFIG, "seed": "1"}), "seed")
    assert client.post("/compile", json={**body, "optimizer": {"min_deriv_time": 0}}
                       ).status_code == 200


def test_stream_options_and_push_offset(client, mid):
    _field_error(client.post("/streams", json={"model_id": mid,
                                               "options": {"frames_per_chunk": "20"}}),
                 "options.frames_per_chunk")
    sid = client.post("/streams", json={"model_id": mid}).json()["stream_id"]
    _field_error(client.post(f"/streams/{sid}/frames",
                             json={"features": [[0.0] * 4], "offset": "0"}), "offset")
    r = client.post(f"/streams/{sid}/frames", json={"features": [[0.0] * 4], "offset": 0})
    assert r.status_code == 200, r.text


def test_json_rows_answers_carry_the_float32_values_exactly(client, mid):
    """A JSON-rows answer (written by orjson from float64 arrays: service.convert.wire_json)
    holds each float32 value of the output exactly: parsed as float64 and cast back, the
    same bits as the base64 answer; it validates against the response model; None fields
    are left out of /compute's answer, at every level."""
    import base64

    from schemas.compute import ComputeResponse, InferResponse
    rng = np.random.default_rng(3)
    req = request_for(0, 6)
    x = (rng.standard_normal((len(req["inputs"][0]["indexes"]), 4)) * 1e3).astype(np.float32)
    x[0, 0] = np.float32(1e-30)     # a tiny one: written with an exponent
    answers = {}
    for enc in ("json", "base64"):
        r = client.post("/compute", json={"model_id": mid, "request": req,
                                          "inputs": {"input": x.tolist()}, "encoding": enc})
        assert r.status_code == 200, r.text
        answers[enc] = ComputeResponse.model_validate_json(r.content)
        assert "model_gradient" not in r.json() and "component_stats" not in r.json()
    rows = np.array(answers["json"].outputs["output"], dtype=np.float64)
    enc = answers["base64"].outputs["output"]
    exact = np.frombuffer(base64.b64decode(enc.data), "<f4").reshape(enc.shape)
    assert np.array_equal(rows, exact.astype(np.float64))        # float32 values, exactly
    r = client.post("/infer", json={"model_id": mid, "features": x.tolist(),
                                    "encoding": "json"})
    assert r.status_code == 200, r.text
    InferResponse.model_validate_json(r.content)


def test_wire_json_writes_arrays_and_models():
    """wire_json: float64 arrays as JSON rows, nested wire models as objects, and with
    exclude_none no None field at any level."""
    import orjson

    from schemas.common import EncodedMatrix
    from schemas.compute import ComputeResponse
    from service.convert import matrix_to_wire, wire_json
    a = np.array([[0.1, -2.5e-8], [3.0, 1e20]], dtype=np.float32)
    m = ComputeResponse.model_construct(
        computation_id="k", outputs={"o": matrix_to_wire(a, "json", 0)},
        input_derivs={"i": matrix_to_wire(a, "base64", 0)}, model_gradient=None,
        component_stats=None)
    assert isinstance(m.input_derivs["i"], EncodedMatrix)
    doc = orjson.loads(wire_json(m, exclude_none=True))
    assert set(doc) == {"computation_id", "outputs", "input_derivs"}
    assert np.array_equal(np.array(doc["outputs"]["o"], dtype=np.float32), a)
    assert doc["input_derivs"]["i"]["shape"] == [2, 2]
    assert set(orjson.loads(wire_json(m))) == set(ComputeResponse.model_fields)
