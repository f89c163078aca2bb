"""/compute on Kaldi's reference networks (outputs, input derivatives and model
gradients to Kaldi's tolerance) and /infer against nnet3-compute's output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.nnet.model_io import load_nnet
from refdata import stats_tolerance
from tests.service.conftest import BLSTM, CASES, DATA, decode, encode, register

CASE_DIRS = sorted(p for p in CASES.iterdir() if p.is_dir())


def _close(what, ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    if ref.size:
        err = float(np.max(np.abs(ours - ref)))
        tol = 1e-4 + 2e-3 * float(np.max(np.abs(ref)))
        assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("encoding", ["json", "base64"])
@pytest.mark.parametrize("case", CASE_DIRS, ids=lambda p: p.name)
def test_compute_reference(client, case, encoding):
    model = register(client, case / "model.txt")
    req = json.loads((case / "request.json").read_text())
    arrays = np.load(case / "arrays.npz")

    def wire(a):   # the two wire forms of a matrix
        return encode(a) if encoding == "base64" else a.astype(np.float64).tolist()

    body = {"model_id": model["model_id"], "request": req, "encoding": encoding,
            "inputs": {s["name"]: wire(arrays[f"input.{s['name']}"]) for s in req["inputs"]},
            "output_derivs": {s["name"]: wire(arrays[f"output_deriv.{s['name']}"])
                              for s in req["outputs"] if s["has_deriv"]}}
    r = client.post("/compute", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    for s in req["outputs"]:
        _close(f"output {s['name']}", decode(out["outputs"][s["name"]]),
               arrays[f"output.{s['name']}"])
    for s in req["inputs"]:
        if s["has_deriv"]:
            _close(f"input_deriv {s['name']}", decode(out["input_derivs"][s["name"]]),
                   arrays[f"input_deriv.{s['name']}"])
    grad_file = DATA / "service" / case.name / "model_grad.txt"
    if req["need_model_derivative"]:
        grads = out["model_gradient"]
        nnet = load_nnet(case / "model.txt")
        updatable = [n for n, c in zip(nnet.component_names, nnet.components)
                     if c.is_updatable]
        assert sorted(grads) == sorted(updatable)
        if grad_file.exists():
            model_nnet, ref = load_nnet(case / "model.txt"), load_nnet(grad_file)
            checked = 0
            for name, theirs, orig in zip(ref.component_names, ref.components,
                                          model_nnet.components):
                if not orig.is_updatable:
                    continue
                for p, b, o in zip(orig.PARAMS, theirs.param_arrays(), orig.param_arrays()):
                    want = np.asarray(b, np.float64) - np.asarray(o, np.float64)
                    _close(f"gradient {name}.{p}",
                           decode(grads[name][p]).reshape(want.shape), want)
                    checked += 1
            assert checked > 0
    else:
        assert "model_gradient" not in out


def test_compute_is_deterministic_and_model_unchanged(client):
    """Running a request with store_component_stats uses a private copy of the model."""
    case = CASES / "case024"
    model = register(client, case / "model.txt")
    req = json.loads((case / "request.json").read_text())
    arrays = np.load(case / "arrays.npz")
    body = {"model_id": model["model_id"], "request": {**req, "store_component_stats": True},
            "inputs": {"input": encode(arrays["input.input"])},
            "output_derivs": {"output": encode(arrays["output_deriv.output"])}}
    entry = client.app.state.services.registry.get(model["model_id"])
    before = [np.array(a, copy=True) for c in entry.model.nnet.components
              for a in (getattr(c, p, None) for p in c.PARAMS + c.ARRAYS)
              if isinstance(a, np.ndarray)]
    stats_before = [{k: np.copy(v) for k, v in c.stats().items()}
                    for c in entry.model.nnet.components]
    first = client.post("/compute", json=body).json()
    second = client.post("/compute", json=body).json()
    assert first["outputs"] == second["outputs"]
    # each computation's statistics from zero, the registered model's left as they were
    assert first["component_stats"] and first["component_stats"] == second["component_stats"]
    for c, was in zip(entry.model.nnet.components, stats_before):
        for k, v in c.stats().items():
            np.testing.assert_array_equal(v, was[k])
    after = [a for c in entry.model.nnet.components
             for a in (getattr(c, p, None) for p in c.PARAMS + c.ARRAYS)
             if isinstance(a, np.ndarray)]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    # a registered model's arrays are read-only (the executors keep derived copies:
    # device-resident weights on a GPU, transposed weights for small products)
    assert after and not any(a.flags.writeable for a in after)


def test_infer_blstm_matches_nnet3_compute(client):
    model = register(client, BLSTM / "model.raw", binary=True)
    ref = np.load(BLSTM / "infer_utt1_part.npz")
    r = client.post("/infer", json={"model_id": model["model_id"],
                                    "features": encode(ref["features"]),
                                    "options": {"frames_per_chunk": 50}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["num_frames"] == ref["features"].shape[0]
    got = decode(out["output"])
    _close("infer output", got[:100], ref["output"])


TDNN_CONFIG = """
input-node name=input dim=10
component name=a1 type=NaturalGradientAffineComponent input-dim=30 output-dim=64
component-node name=a1 component=a1 input=Append(Offset(input, -1), input, Offset(input, 1))
component name=r1 type=RectifiedLinearComponent dim=64
component-node name=r1 component=r1 input=a1
component name=a2 type=NaturalGradientAffineComponent input-dim=192 output-dim=20
component-node name=a2 component=a2 input=Append(Offset(r1, -2), r1, Offset(r1, 2))
component name=sm type=LogSoftmaxComponent dim=20
component-node name=sm component=sm input=a2
output-node name=output input=sm
"""


def test_infer_threads_setting_gives_the_same_output(client):
    """NNETC_INFER_THREADS: the chunks of a long utterance of a network without
    recurrence computed two batches at a time, each on one BLAS thread
    (engine.runtime.parallel), equal to the one-thread service's output; a client
    cannot set it."""
    from tests.service.conftest import make_client  # noqa: PLC0415
    feats = np.random.default_rng(3).standard_normal((1500, 10)).astype(np.float32)
    body = {"features": encode(feats), "options": {"frames_per_chunk": 50}}
    outs = []
    with make_client(infer_threads=2) as threaded:
        for c in (client, threaded):
            model = register(c, config=TDNN_CONFIG)
            r = c.post("/infer", json={"model_id": model["model_id"], **body})
            assert r.status_code == 200, r.text
            outs.append(decode(r.json()["output"]))
        bad = threaded.post("/infer", json={"model_id": model["model_id"], **body,
                                            "options": {"threads": 2}})
    assert outs[0].shape == (1500, 20)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert bad.status_code == 422, bad.text      # not a client option


def test_concurrent_threaded_infers_leave_the_blas_setting_as_it_was():
    """Several /infer requests of a service with NNETC_INFER_THREADS=2 at once: each
    output equals the one-at-a-time output, and afterwards the process's BLAS thread
    count is what it was (NumPy's OpenBLAS has one process-wide count, which the
    concurrent sections hold at one while any runs: engine.runtime.parallel)."""
    import threading  # noqa: PLC0415

    from threadpoolctl import ThreadpoolController  # noqa: PLC0415

    from tests.service.conftest import make_client  # noqa: PLC0415
    libs = ThreadpoolController().select(user_api="blas").lib_controllers
    before = [lib.get_num_threads() for lib in libs]
    rng = np.random.default_rng(5)
    feats = [rng.standard_normal((900 + 150 * k, 10)).astype(np.float32) for k in range(4)]
    with make_client(infer_threads=2) as threaded:
        model = register(threaded, config=TDNN_CONFIG)
        body = lambda x: {"model_id": model["model_id"], "features": encode(x),  # noqa: E731
                          "options": {"frames_per_chunk": 50}}
        alone = []
        for x in feats:
            r = threaded.post("/infer", json=body(x))
            assert r.status_code == 200, r.text
            alone.append(decode(r.json()["output"]))
        together: dict = {}

        def go(k):
            r = threaded.post("/infer", json=body(feats[k]))
            together[k] = (r.status_code, decode(r.json()["output"]))
        threads = [threading.Thread(target=go, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for k in range(4):
        assert together[k][0] == 200
        # jobs waiting together may be batched otherwise: equal to float32 rounding
        np.testing.assert_allclose(together[k][1], alone[k], rtol=1e-5, atol=1e-5)
    assert [lib.get_num_threads() for lib in libs] == before


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_non_finite_outputs_come_in_the_base64_form(client):
    """A network's output can overflow on finite input: JSON has no infinity (the
    encoder would write null), so such a matrix comes in the base64 form, which keeps
    the values; the finite matrices keep the encoding asked for."""
    from tests.service.conftest import decode  # noqa: PLC0415
    cfg = ("input-node name=input dim=2\n"
           "component name=big type=AffineComponent input-dim=2 output-dim=3 "
           "param-stddev=1e30 bias-stddev=0\n"
           "component-node name=big component=big input=input\n"
           "output-node name=output input=big\n")
    model = register(client, config=cfg)
    idx = [[0, 0, 0], [0, 1, 0]]
    feats = [[1e10, -1e10], [1.0, 2.0]]
    body = {"model_id": model["model_id"],
            "request": {"inputs": [{"name": "input", "indexes": idx}],
                        "outputs": [{"name": "output", "indexes": idx}]},
            "inputs": {"input": feats}, "encoding": "json"}
    entry = client.app.state.services.registry.get(model["model_id"])
    w = entry.model.nnet.components[0].linear_params
    with np.errstate(over="ignore", invalid="ignore"):
        expected = np.asarray(feats, np.float32) @ w.T
    assert not np.isfinite(expected[0]).all() and np.isfinite(expected[1]).all()
    for path, payload, key in (("/compute", body, ("outputs", "output")),
                               ("/infer", {"model_id": model["model_id"], "features": feats,
                                           "encoding": "json"}, ("output",))):
        r = client.post(path, json=payload)
        assert r.status_code == 200, r.text
        out = r.json()
        for k in key:
            out = out[k]
        assert isinstance(out, dict) and out["dtype"] == "float32", out
        got = decode(out)
        # the same entries are not finite; which of inf or nan the sum of two overflowing
        # products gives is the BLAS's (OpenBLAS's fused multiply-adds keep inf, cuBLAS
        # on an H100 gave nan for a +inf and a -inf product)
        assert np.array_equal(np.isfinite(got), np.isfinite(expected))
        assert np.allclose(got[1], expected[1], rtol=1e-5)
    # finite outputs keep the JSON rows asked for
    body["inputs"] = {"input": [[1e-20, 0.0], [0.0, 1e-20]]}
    out = client.post("/compute", json=body).json()["outputs"]["output"]
    assert isinstance(out, list) and len(out) == 2


@pytest.mark.parametrize("name", ["bn_seed0872", "bn_seed1067", "bn_seed2457"])
def test_component_stats_are_kaldis(client, name):
    """store_component_stats: the statistics in the response are those Kaldi's
    NnetComputer stored in the network (tests/data/networks_kaldi_stored_stats: its
    model_after.txt; the models start with none, so the difference is what the
    computation stored) -- a ReLU's sums and output-derivative squares, batch-norm's in
    training mode.  (Feed-forward cases: a component called more than once stores on
    Kaldi's random draws after the first call.)"""
    case = DATA / "networks_kaldi_stored_stats" / name
    model = register(client, case / "model.txt")
    req = json.loads((case / "request.json").read_text())
    arrays = np.load(case / "arrays.npz")
    body = {"model_id": model["model_id"], "request": req,
            "inputs": {s["name"]: encode(arrays[f"input.{s['name']}"]) for s in req["inputs"]},
            "output_derivs": {s["name"]: encode(arrays[f"output_deriv.{s['name']}"])
                              for s in req["outputs"] if s["has_deriv"]}}
    r = client.post("/compute", json=body)
    assert r.status_code == 200, r.text
    got = r.json()["component_stats"]
    before = load_nnet(case / "model.txt")
    after = load_nnet(case / "model_after.txt")
    compared = 0
    for cname, fields in got.items():
        i = after.component_names.index(cname)
        for k, v in fields.items():
            assert not np.any(before.components[i].stats()[k])     # none before the run
            want = after.components[i].stats()[k]
            ours = np.asarray(v, dtype=np.float64)
            tol = stats_tolerance(k, float(np.max(np.abs(want), initial=0)),
                                  type(after.components[i]).__name__)
            assert np.max(np.abs(ours - want), initial=0) <= tol, (cname, k)
            compared += 1
    assert compared > 0


def test_compute_a_batch_of_utterances_of_different_lengths(client):
    """An x-vector-style network (statistics pooling over 10000 frames ahead) and one
    /compute request holding 20 utterances of different lengths, each asking for its
    embedding at t=0: each answer row is what the utterance gives alone (the engine
    compiles and runs it by itself).  The graph no longer grows by the pooling window
    per utterance: this request's first compile took 0.90 s before and 0.085 s since the
    interval build takes such batches (on the reference x-vector, 52 nodes, a batch of
    16 was refused; tests/engine/test_variable_length_batches.py)."""
    from engine.compiler.request import ComputationRequest  # noqa: PLC0415
    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    from engine.runtime.executor import run_computation  # noqa: PLC0415
    from tests.engine.inference_nets import XVECTOR  # noqa: PLC0415
    model = register(client, config=XVECTOR)
    rng = np.random.default_rng(11)
    lens = rng.integers(1, 90, size=20).tolist()
    feats = [rng.standard_normal((m + 8, 6)).astype(np.float32) for m in lens]
    req = {"inputs": [{"name": "input", "indexes": [[n, t, 0] for n, m in enumerate(lens)
                                                     for t in range(-4, m + 4)]}],
           "outputs": [{"name": "output", "indexes": [[n, 0, 0] for n in range(len(lens))]}]}
    r = client.post("/compute", json={"model_id": model["model_id"], "request": req,
                                      "inputs": {"input": encode(np.concatenate(feats))},
                                      "encoding": "base64"})
    assert r.status_code == 200, r.text
    got = decode(r.json()["outputs"]["output"])
    nnet = client.app.state.services.registry.get(model["model_id"]).model.nnet
    for n, m in enumerate(lens):
        alone = ComputationRequest.from_json({
            "inputs": [{"name": "input", "indexes": [[0, t, 0] for t in range(-4, m + 4)]}],
            "outputs": [{"name": "output", "indexes": [[0, 0, 0]]}]})
        want = run_computation(compile_request(nnet, alone), nnet, {"input": feats[n]})[0]
        _close(f"utterance {n}", got[n], want["output"][0])
