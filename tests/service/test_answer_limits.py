"""Answers too large to build, and computations too large to run, are refused with a 413
naming the field before anything is computed (a few hundred bytes of request must not be
able to make the server allocate gigabytes): compute, infer and streams, with
max_response_bytes and max_computation_bytes."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_client, register
from engine.core.errors import ResourceLimitError
from engine.inference import InferenceOptions
from engine.inference.simple import Inferencer
from engine.inference.stream import LoopedConfig, LoopedModel
from engine.nnet.nnet import Nnet


def _wide(dim: int) -> str:
    """A network whose output is 4 + dim wide: a constant appended to its input."""
    return ("input-node name=input dim=4\n"
            "component name=a type=AffineComponent input-dim=12 output-dim=4\n"
            "component-node name=a component=a input=Append(Offset(input, -1), input, "
            "Offset(input, 1))\n"
            f"output-node name=output input=Append(a, Const(1.0, {dim}))\n")


def _error(r, status: int, field: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    return err["message"]


def test_compute_answer_beyond_the_limit_is_413_before_computing():
    with make_client(max_response_bytes=1 << 16) as c:
        mid = register(c, config=_wide(4000))["model_id"]
        frames = 6
        body = {"model_id": mid, "request": {
            "inputs": [{"name": "input", "indexes": [[0, t, 0] for t in range(-1, frames + 1)]}],
            "outputs": [{"name": "output", "indexes": [[0, t, 0] for t in range(frames)]}]},
            "inputs": {"input": [[0.5] * 4] * (frames + 2)}}
        msg = _error(c.post("/compute", json=body), 413, "request")
        assert "max_response_bytes" in msg and str(frames * 4004) in msg
        # nothing was compiled for it
        assert 'nnetc_cache_events_total{event="miss"}' not in c.get("/metrics").text
        body["request"]["outputs"][0]["indexes"] = [[0, 0, 0]]
        assert c.post("/compute", json=body).status_code == 200     # 4004 values: fits
    # a model gradient counts too: 60 outputs fit in 1 kB, 780 parameters more do not
    with make_client(max_response_bytes=1 << 10) as c:
        net = ("input-node name=input dim=12\n"
               "component name=a type=AffineComponent input-dim=12 output-dim=60\n"
               "component-node name=a component=a input=input\n"
               "output-node name=output input=a\n")
        mid = register(c, config=net)["model_id"]
        body = {"model_id": mid, "request": {
            "inputs": [{"name": "input", "indexes": [[0, 0, 0]]}],
            "outputs": [{"name": "output", "indexes": [[0, 0, 0]], "has_deriv": True}],
            "need_model_derivative": True},
            "inputs": {"input": [[0.5] * 12]}, "output_derivs": {"output": [[1.0] * 60]}}
        msg = _error(c.post("/compute", json=body), 413, "request")
        assert "model gradient" in msg and "840 float32 values" in msg
        body["request"]["need_model_derivative"] = False
        assert c.post("/compute", json=body).status_code == 200


def test_infer_answer_beyond_the_limit_is_413():
    with make_client(max_response_bytes=1 << 16) as c:
        mid = register(c, config=_wide(4000))["model_id"]
        r = c.post("/infer", json={"model_id": mid, "features": [[0.1] * 4] * 20})
        msg = _error(r, 413, "features")
        assert "20 frames x 4004" in msg
        r = c.post("/infer", json={"model_id": mid, "features": [[0.1] * 4] * 2})
        assert r.status_code == 200 and r.json()["num_frames"] == 2


def test_infer_output_beyond_the_computation_limit_is_a_resource_error():
    """The engine counts the utterance's output matrix against max_peak_bytes (it was
    allocated first, and a huge one was a MemoryError)."""
    nnet = Nnet.from_config(_wide(100))
    inf = Inferencer(nnet, InferenceOptions(frames_per_chunk=10), max_peak_bytes=4000)
    with pytest.raises(ResourceLimitError, match="output 'output' .*20 frames x 104"):
        inf.infer(np.zeros((20, 4), np.float32))
    assert Inferencer(nnet, InferenceOptions(frames_per_chunk=10),
                      max_peak_bytes=1 << 20).infer(np.zeros((20, 4), np.float32)).shape \
        == (20, 104)


def test_streams_are_bounded_by_both_limits():
    # the looped computation itself: refused when the stream is opened
    with pytest.raises(ResourceLimitError, match="peak"):
        LoopedModel(Nnet.from_config(_wide(100000)), LoopedConfig(20), max_peak_bytes=1 << 20)
    with make_client(max_computation_bytes=1 << 20) as c:
        mid = register(c, config=_wide(100000))["model_id"]
        r = c.post("/streams", json={"model_id": mid, "options": {"frames_per_chunk": 20}})
        assert r.status_code == 413, r.text
        assert "peak" in r.json()["error"]["message"]
    # what one push could give back
    with make_client(max_response_bytes=1 << 16) as c:
        mid = register(c, config=_wide(1000))["model_id"]
        sid = c.post("/streams", json={"model_id": mid,
                                       "options": {"frames_per_chunk": 5}}).json()["stream_id"]
        msg = _error(c.post(f"/streams/{sid}/frames", json={"features": [[0.1] * 4] * 40}),
                     413, "features")
        assert "40 output frames of dim 1004" in msg
        for _ in range(4):
            r = c.post(f"/streams/{sid}/frames", json={"features": [[0.1] * 4] * 10})
            assert r.status_code == 200, r.text
        r = c.post(f"/streams/{sid}/finish", json={})
        assert r.status_code == 200 and r.json()["frames_output"] == 40
