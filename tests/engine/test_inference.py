"""Whole-utterance inference (engine.inference.simple, `nnetc infer`) against Kaldi's
nnet3-compute references and against a plain one-request computation."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from refdata import DATA, shared_ref
from engine.compiler.compiler import compile_computation
from engine.compiler.request import ComputationRequest, io_spec
from engine.core.errors import InferenceError
from engine.inference import InferenceOptions, Inferencer, infer
from engine.nnet.model_io import Model, load_model, save_model
from engine.runtime.executor import run_computation
from inference_nets import (RECURRENT, TDNN_IVECTOR, TDNN_PLAIN, assert_close, feats, make_nnet,
                            model_dirs, model_file, nnet3_compute_flags,
                            nnet3_compute_options, read_json)

SHARED = shared_ref()
LOCAL = DATA / "inference"


def whole_request_output(nnet, x, left, right, ivector=None, output="output", outputs=None):
    """One computation over the whole utterance, edges padded by repeating frames:
    what chunked inference must equal for a network without recurrence.  ``outputs``
    (default: every frame) are the output times asked for."""
    T = x.shape[0]
    rows = np.clip(np.arange(-left, T + right), 0, T - 1)
    ins = [io_spec("input", [(0, t, 0) for t in range(-left, T + right)])]
    inputs = {"input": x[rows]}
    if ivector is not None:
        ins.append(io_spec("ivector", [(0, 0, 0)]))
        inputs["ivector"] = ivector[None, :]
    times = range(T) if outputs is None else outputs
    req = ComputationRequest(ins, [io_spec(output, [(0, t, 0) for t in times])])
    nnet = nnet.copy()
    nnet.set_test_mode(True)
    outs, _, _ = run_computation(compile_computation(nnet, [req]), nnet, inputs)
    return np.asarray(outs[output])


# -- Kaldi references ----------------------------------------------------------------------


def test_local_blstm_reference():
    """blstm (bidirectional LSTM) from kaldi-ref: two full 50-frame chunks."""
    model = load_model(LOCAL / "blstm" / "model.raw")
    z = np.load(LOCAL / "blstm" / "infer_utt1_part.npz")
    out = infer(model, z["features"], InferenceOptions(frames_per_chunk=50))
    assert out.shape == (102, 300)
    assert_close(out[:100], z["output"], "blstm utt1[:100]")


def test_nnet3_compute_flags():
    assert nnet3_compute_flags(["--acoustic-scale=0.1", "--apply-exp", "--use-priors=false",
                                 "--online-ivector-period=10"]) == {
        "acoustic_scale": 0.1, "apply_exp": True, "use_priors": False,
        "online_ivector_period": 10}
    with pytest.raises(AssertionError, match="not understood"):
        nnet3_compute_flags(["--minimize=true"])


@pytest.mark.skipif(SHARED is None, reason="../shared/kaldi-ref not present (full set)")
@pytest.mark.parametrize("model_dir", model_dirs(SHARED, "infer.json"), ids=lambda p: p.name)
def test_kaldi_infer_reference(model_dir):
    js = read_json(model_dir / "infer.json")
    o = nnet3_compute_options(js)
    fields = {f.name for f in dataclasses.fields(InferenceOptions)}
    opts = InferenceOptions(**{k: v for k, v in o.items() if k in fields})
    model = load_model(model_file(model_dir))
    z = np.load(model_dir / "infer.npz")
    utts = sorted(k.split(".", 1)[1] for k in z.files if k.startswith("features."))
    inf = Inferencer(model.nnet, opts, priors=model.priors)
    # per-utterance i-vectors (a vector per utterance), or online ones (a matrix, one row
    # per online_ivector_period frames, as nnet3-compute's --online-ivectors)
    period = int(o.get("online_ivector_period", o.get("ivector_period", 0)) or 0)

    def utterance(u):
        iv = z.get(f"online_ivectors.{u}", z.get(f"ivector.{u}"))
        if iv is not None and (o.get("ivectors") == "online" or iv.ndim == 2):
            assert period > 0, f"online i-vectors without a period in {o}"
            return inf.make_utterance(z[f"features.{u}"], None, iv, period)
        return inf.make_utterance(z[f"features.{u}"], iv)
    batch = inf.infer_batch([utterance(u) for u in utts])
    for u, out in zip(utts, batch):
        assert_close(out, z[f"output.{u}"], f"{model_dir.name} {u}")


@pytest.mark.skipif(SHARED is None, reason="../shared/kaldi-ref not present (full set)")
@pytest.mark.parametrize("model_dir", model_dirs(SHARED, "request.json"), ids=lambda p: p.name)
def test_kaldi_request_reference(model_dir, tmp_path):
    """An explicit request (the x-vector's: output at t=0 per sequence) goes through
    `nnetc compute`: every input of request_arrays.npz in, every output Kaldi gave
    compared."""
    from service.cli import main
    z = np.load(model_dir / "request_arrays.npz")
    np.savez(tmp_path / "in.npz", **{k: z[k] for k in z.files if k.startswith("input.")})
    r = CliRunner().invoke(main, ["compute", str(model_file(model_dir)), "--request",
                                  str(model_dir / "request.json"), "--inputs",
                                  str(tmp_path / "in.npz"), "--out", str(tmp_path / "out.npz")])
    assert r.exit_code == 0, r.output
    ours = np.load(tmp_path / "out.npz")
    expected = [k for k in z.files if k.startswith("output.")]
    assert expected, "request_arrays.npz holds no output"
    for k in expected:
        assert k in ours.files, f"{k} missing from nnetc compute's output ({ours.files})"
        assert_close(ours[k], z[k], f"{model_dir.name} {k}")


_ONLINE = DATA / "inference" / "online_ivectors"
_OFFLINE = json.loads((_ONLINE / "offline.json").read_text())["settings"]


@pytest.mark.parametrize("s", _OFFLINE, ids=lambda s: s["key"])
def test_online_ivectors_offline_match_kaldi(s):
    """Whole-utterance inference with an online i-vector matrix (nnet3-compute's
    --online-ivectors: each chunk reads the row of its middle frame) against Kaldi's
    DecodableNnetSimple on a small recurrent network; rows too few and too many
    included (tests/kaldi_oracle/make_online_ivector_case.py --offline)."""
    z = np.load(_ONLINE / "offline.npz")
    feats = np.load(_ONLINE / "case.npz")["features"]
    fields = {f.name for f in dataclasses.fields(InferenceOptions)}
    opts = InferenceOptions(**{k: v for k, v in s.items() if k in fields})
    out = Inferencer(load_model(_ONLINE / "model.raw").nnet, opts).infer(
        feats, online_ivectors=z[f"online.{s['key']}"],
        online_ivector_period=s["online_ivector_period"])
    assert_close(out, z[f"output.{s['key']}"], s["key"])


# -- semantics on small networks ----------------------------------------------------------------


@pytest.mark.parametrize("fpc", [1, 7, 20, 50, 200])
def test_chunking_equals_whole_utterance(fpc):
    nnet = make_nnet(TDNN_IVECTOR)
    x, iv = feats(53), feats(1, 4, seed=5)[0]
    ref = whole_request_output(nnet, x, 5, 4, iv)
    out = Inferencer(nnet, InferenceOptions(frames_per_chunk=fpc)).infer(x, iv)
    assert_close(out, ref, f"fpc={fpc}")


def test_other_output_and_extra_context():
    nnet = make_nnet(TDNN_IVECTOR)
    x, iv = feats(31), feats(1, 4, seed=5)[0]
    ref = whole_request_output(nnet, x, 2, 1, iv, output="output-xent")
    opts = InferenceOptions(frames_per_chunk=8, output="output-xent", extra_left_context=3,
                            extra_right_context=2, extra_left_context_initial=0,
                            extra_right_context_final=5)
    assert_close(Inferencer(nnet, opts).infer(x, iv), ref, "output-xent")


@pytest.mark.parametrize("fsf", [2, 3])
def test_frame_subsampling(fsf):
    nnet = make_nnet(TDNN_PLAIN)
    x = feats(40)
    full = Inferencer(nnet, InferenceOptions(frames_per_chunk=9)).infer(x)
    sub = Inferencer(nnet, InferenceOptions(frames_per_chunk=9,
                                            frame_subsampling_factor=fsf)).infer(x)
    assert sub.shape == ((40 + fsf - 1) // fsf, 6)
    assert_close(sub, full[::fsf], f"fsf={fsf}")


def test_recurrent_chunks_are_independent():
    """Without extra context each chunk starts the recurrence afresh (nnet3-compute):
    a 10-frame chunking differs from one chunk, and equals running each chunk alone."""
    nnet = make_nnet(RECURRENT)
    x = feats(30)
    chunked = Inferencer(nnet, InferenceOptions(frames_per_chunk=10)).infer(x)
    whole = Inferencer(nnet, InferenceOptions(frames_per_chunk=30)).infer(x)
    assert not np.allclose(chunked[10:], whole[10:], atol=1e-4)
    assert_close(chunked[:10], whole[:10], "first chunk")
    # the second chunk reads frames 8..22 (context 2/3) and nothing else
    second = whole_request_output(nnet, x[8:23], 0, 0, outputs=range(2, 12))
    assert_close(chunked[10:20], second, "second chunk")


def test_batch_equals_single_and_keeps_order():
    nnet = make_nnet(TDNN_IVECTOR)
    inf = Inferencer(nnet, InferenceOptions(frames_per_chunk=10, max_batch=3))
    utts = [(feats(n, seed=n), feats(1, 4, seed=100 + n)[0]) for n in (25, 7, 30, 10, 1)]
    batch = inf.infer_batch([inf.make_utterance(x, v) for x, v in utts])
    for (x, v), out in zip(utts, batch):
        np.testing.assert_allclose(out, inf.infer(x, v), rtol=1e-5, atol=1e-5)


def test_online_ivectors_and_priors_and_exp():
    nnet = make_nnet(TDNN_IVECTOR)
    x, iv = feats(45), feats(1, 4, seed=5)[0]
    per_utt = Inferencer(nnet, InferenceOptions(frames_per_chunk=10)).infer(x, iv)
    online = Inferencer(nnet, InferenceOptions(frames_per_chunk=10)).infer(
        x, online_ivectors=np.tile(iv, (5, 1)), online_ivector_period=10)
    assert_close(online, per_utt, "constant online i-vectors")
    # online rows are picked for the middle frame of each chunk: rows 0..4 here
    ramp = np.stack([iv * (1 + k) for k in range(5)])
    varied = Inferencer(nnet, InferenceOptions(frames_per_chunk=10)).infer(
        x, online_ivectors=ramp, online_ivector_period=10)
    for k in range(5):
        single = Inferencer(nnet, InferenceOptions(frames_per_chunk=10)).infer(x, ramp[k])
        assert_close(varied[10 * k:10 * k + 10], single[10 * k:10 * k + 10], f"chunk {k}")
    priors = np.random.default_rng(3).uniform(0.01, 1.0, 12).astype(np.float32)
    with_priors = Inferencer(nnet, InferenceOptions(frames_per_chunk=10, use_priors=True,
                                                    apply_exp=True),
                             priors=priors).infer(x, iv)
    np.testing.assert_allclose(with_priors, np.exp(per_utt - np.log(priors)), rtol=1e-5)


# -- errors ---------------------------------------------------------------------------------------


def test_bad_inputs_raise_typed_errors():
    nnet = make_nnet(TDNN_IVECTOR)
    inf = Inferencer(nnet, InferenceOptions())
    x, iv = feats(20), feats(1, 4)[0]
    with pytest.raises(InferenceError, match="dimension 8"):
        inf.infer(feats(20, dim=9), iv)
    with pytest.raises(InferenceError, match="no i-vectors"):
        inf.infer(x)
    with pytest.raises(InferenceError, match="expects dimension 4"):
        inf.infer(x, np.zeros(5, np.float32))
    with pytest.raises(InferenceError, match="period"):
        inf.infer(x, online_ivectors=np.zeros((2, 4), np.float32))
    with pytest.raises(InferenceError, match="not both"):
        inf.infer(x, iv, online_ivectors=np.zeros((2, 4), np.float32), online_ivector_period=10)
    with pytest.raises(InferenceError, match="only 1 rows"):
        inf.infer(feats(300), online_ivectors=np.zeros((1, 4), np.float32),
                  online_ivector_period=10)
    with pytest.raises(InferenceError, match="zero-length"):
        inf.infer(np.zeros((0, 8), np.float32), iv)
    with pytest.raises(InferenceError, match="NaN"):
        inf.infer(np.full((5, 8), np.nan, np.float32), iv)
    with pytest.raises(InferenceError, match="no 'ivector' input"):
        Inferencer(make_nnet(TDNN_PLAIN)).infer(x, iv)
    with pytest.raises(InferenceError, match="frames_per_chunk"):
        Inferencer(nnet, InferenceOptions(frames_per_chunk=0))
    with pytest.raises(InferenceError, match="no output node named 'nope'"):
        Inferencer(nnet, InferenceOptions(output="nope"))
    with pytest.raises(InferenceError, match="no priors"):
        Inferencer(nnet, InferenceOptions(use_priors=True))


# -- CLI ------------------------------------------------------------------------------------------


def test_cli_infer(tmp_path):
    from service.cli import main
    nnet = make_nnet(TDNN_IVECTOR)
    # A .raw (no priors), so --use-priors must fail.
    save_model(Model(nnet), tmp_path / "m.raw", binary=True)
    x, iv = feats(33), feats(1, 4, seed=5)[0]
    np.save(tmp_path / "f.npy", x)
    np.save(tmp_path / "iv.npy", iv)
    r = CliRunner().invoke(main, ["infer", str(tmp_path / "m.raw"), "--features",
                                  str(tmp_path / "f.npy"), "--ivector", str(tmp_path / "iv.npy"),
                                  "--frames-per-chunk", "8", "--frame-subsampling-factor", "2",
                                  "--apply-exp", "--out", str(tmp_path / "o.npy")])
    assert r.exit_code == 0, r.output
    ref = Inferencer(nnet, InferenceOptions(frames_per_chunk=8, frame_subsampling_factor=2,
                                            apply_exp=True)).infer(x, iv)
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), ref)
    r = CliRunner().invoke(main, ["infer", str(tmp_path / "m.raw"), "--features",
                                  str(tmp_path / "f.npy"), "--use-priors",
                                  "--ivector", str(tmp_path / "iv.npy"),
                                  "--out", str(tmp_path / "o.npy")])
    assert r.exit_code == 2 and "no priors" in r.output
    r = CliRunner().invoke(main, ["infer", str(tmp_path / "m.raw"), "--features",
                                  str(tmp_path / "f.npy"), "--out", str(tmp_path / "o.npy")])
    assert r.exit_code == 2 and "no i-vectors" in r.output
    # --threads: chunks computed two at a time (engine.runtime.parallel)
    r = CliRunner().invoke(main, ["infer", str(tmp_path / "m.raw"), "--features",
                                  str(tmp_path / "f.npy"), "--ivector", str(tmp_path / "iv.npy"),
                                  "--frames-per-chunk", "8", "--frame-subsampling-factor", "2",
                                  "--apply-exp", "--threads", "2", "--out",
                                  str(tmp_path / "o2.npy")])
    assert r.exit_code == 0, r.output
    np.testing.assert_allclose(np.load(tmp_path / "o2.npy"), ref, rtol=1e-5, atol=1e-6)
    r = CliRunner().invoke(main, ["infer", str(tmp_path / "m.raw"), "--features",
                                  str(tmp_path / "f.npy"), "--threads", "0", "--out",
                                  str(tmp_path / "o2.npy")])
    assert r.exit_code == 2 and "--threads" in r.output
    # --acoustic-scale (nnet3-compute's): the output scaled before --apply-exp
    r = CliRunner().invoke(main, ["infer", str(tmp_path / "m.raw"), "--features",
                                  str(tmp_path / "f.npy"), "--ivector", str(tmp_path / "iv.npy"),
                                  "--frames-per-chunk", "8", "--acoustic-scale", "0.5",
                                  "--out", str(tmp_path / "o3.npy")])
    assert r.exit_code == 0, r.output
    plain = Inferencer(nnet, InferenceOptions(frames_per_chunk=8)).infer(x, iv)
    np.testing.assert_array_equal(np.load(tmp_path / "o3.npy"), plain * np.float32(0.5))
