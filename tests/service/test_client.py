"""service/client.py against the real app: registration (file as raw body, config), compile,
compute with derivatives and gradients, infer, a stream, and errors as ServiceCallError."""

from __future__ import annotations

import numpy as np
import pytest

from engine.inference import InferenceOptions, Inferencer
from engine.inference.looped import LoopedConfig
from engine.inference.stream import LoopedModel
from engine.nnet.model_io import load_model
from service.client import NnetcClient, ServiceCallError
from tests.engine.inference_nets import RECURRENT
from tests.service.conftest import (BLSTM, TINY_CONFIG, make_client, request_for,
                                   service_backend)


@pytest.fixture(scope="module")
def nc():
    with make_client() as http:
        yield NnetcClient(http)


def test_models_compile_compute(nc):
    mid = nc.register(config=TINY_CONFIG, seed=2, name="tiny")["model_id"]
    assert [m["model_id"] for m in nc.models()] == [mid]
    assert nc.model(mid)["name"] == "tiny"
    stats = nc.compile(mid, request_for(0, 4, deriv=True), listing=True)
    assert stats["stats"]["commands"] > 0 and "c0:" in stats["listing"]
    x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    dy = np.ones((4, 3), np.float32)
    r = nc.compute(mid, request_for(0, 4, deriv=True), {"input": x}, {"output": dy})
    assert r["outputs"]["output"].shape == (4, 3)
    assert r["input_derivs"]["input"].shape == (6, 4)
    assert set(r["model_gradient"]) == {"affine1", "affine2"}
    assert r["model_gradient"]["affine2"]["linear_params"].shape == (3, 5)
    assert r["component_stats"] is None
    s = nc.compute(mid, {**request_for(0, 4, deriv=True), "store_component_stats": True},
                   {"input": x}, {"output": dy})["component_stats"]
    assert set(s) == {"relu1"} and s["relu1"]["count"] == 4.0
    assert s["relu1"]["value_sum"].shape == (5,) and s["relu1"]["value_sum"].dtype == np.float64
    nc.delete_model(mid)
    with pytest.raises(ServiceCallError) as e:
        nc.model(mid)
    assert e.value.status == 404 and e.value.field == "model_id"


def test_infer_a_kaldi_model_file(nc):
    mid = nc.register(BLSTM / "model.raw")["model_id"]
    feats = np.load(BLSTM / "infer_utt1_part.npz")["features"]
    y = nc.infer(mid, feats, frames_per_chunk=50)
    want = Inferencer(load_model(str(BLSTM / "model.raw")).nnet,
                      InferenceOptions(frames_per_chunk=50)).infer(feats)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ServiceCallError) as e:
        nc.infer(mid, feats[:, :3])
    assert e.value.status == 422


def test_stream(nc):
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    mid = nc.register(config=RECURRENT, seed=3)["model_id"]
    x = np.random.default_rng(4).standard_normal((50, 8)).astype(np.float32)
    with nc.stream(mid, frames_per_chunk=7) as s:
        rows = [s.push(x[:13]), s.push(x[13:13]), s.push(x[13:])]
        rows.append(s.finish())
    ref = LoopedModel(Nnet.from_config(RECURRENT, rng=np.random.default_rng(3)),
                      LoopedConfig(7, 0, 1), backend=service_backend()).stream()
    want = np.concatenate([ref.push(x), ref.finish()])
    np.testing.assert_array_equal(np.concatenate(rows), want)
    with nc.stream(mid) as s:        # closed on exit without finishing
        s.push(x[:5])
        sid = s.stream_id
    with pytest.raises(ServiceCallError) as e:
        nc._get(f"/streams/{sid}")
    assert e.value.status == 404


def test_stream_with_online_ivectors(nc):
    from pathlib import Path  # noqa: PLC0415
    d = Path(__file__).resolve().parents[1] / "data" / "inference" / "online_ivectors"
    z = np.load(d / "case.npz")
    key = "fpc20_elci0_fsf1_p10"
    x, rows, ref = z["features"], z[f"online.{key}"], z[f"output.{key}"]
    mid = nc.register(d / "model.raw")["model_id"]
    with nc.stream(mid, online_ivector_period=10, frames_per_chunk=20) as s:
        got = [s.push(x[:40], online_ivectors=rows[:4]),
               s.push(x[40:], online_ivectors=rows[4:5])]
        got.append(s.push(x[:0], online_ivectors=rows[5:]))
        got.append(s.finish())
    ours = np.concatenate(got)
    assert np.max(np.abs(ours - ref)) <= 1e-4 + 2e-3 * np.max(np.abs(ref))


def test_long_index_lists_travel_encoded_and_compute_the_same(nc):
    """An engine request with more than 64 Indexes per input or output goes with its
    Indexes as int32 bytes: the same computation (id) and outputs as its JSON form."""
    from engine.compiler.request import ComputationRequest  # noqa: PLC0415
    from service.client import _request_json  # noqa: PLC0415
    mid = nc.register(config=TINY_CONFIG, seed=2)["model_id"]
    req = ComputationRequest.from_json(request_for(0, 200))
    wire = _request_json(req)
    assert wire["inputs"][0]["indexes"]["shape"] == [202, 3]
    x = np.random.default_rng(1).standard_normal((202, 4)).astype(np.float32)
    encoded = nc.compute(mid, req, {"input": x})
    plain = nc.compute(mid, req.to_json(), {"input": x})
    assert encoded["computation_id"] == plain["computation_id"]
    np.testing.assert_array_equal(encoded["outputs"]["output"], plain["outputs"]["output"])
