"""Networks written by Kaldi's xconfig tools (tests/kaldi_oracle/xconfigs: projected and
fast LSTMs, the GRU family, restricted attention, convolutions with residual blocks and
channel averaging, TDNN-F with its less common options, an IDCT + LDA front end with
statistics pooling, the basic layer and component types), checked against Kaldi's own output on them (tests/data/inference/xconfig, made by
tests/kaldi_oracle/make_xconfig_cases.py): offline inference as nnet3-compute runs it,
and streams as Kaldi's looped decodable runs them, with the frames pushed in pieces; and
against Kaldi's compilation of the chunk requests of kaldi_stats.json on them (command
counts and peak bytes, unoptimized, optimized and shortcut-compiled; a printout)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from refdata import DATA
from engine.compiler.shortcut import compile_request
from engine.inference.common import simple_context
from engine.inference.looped import LoopedConfig, find_future_recurrence
from engine.inference.simple import InferenceOptions, Inferencer
from engine.inference.stream import LoopedModel
from engine.nnet.model_io import load_model
from engine.optimizer.collapse import set_batchnorm_test_mode, set_dropout_test_mode
from inference_nets import assert_close

ROOT = DATA / "inference" / "xconfig"
CASES = sorted(p.parent for p in ROOT.glob("*/case.json"))
PARAMS = [pytest.param(d, s, id=f"{d.name}-{s['key']}")
          for d in CASES for s in json.loads((d / "case.json").read_text())["settings"]]
_NNETS: dict = {}


def nnet_of(folder):
    if folder not in _NNETS:
        _NNETS[folder] = load_model(str(folder / "model.raw")).nnet
    return _NNETS[folder]


def test_every_architecture_is_there():
    assert {d.name for d in CASES} == {"attention", "basic_layers", "cnn_res", "fast_lstm",
                                       "lda_stats", "lstmp", "opgru", "pgru", "tdnnf_options"}
    assert len(PARAMS) == 4 * len(CASES)


@pytest.mark.parametrize("folder,setting", PARAMS)
def test_output_equals_kaldi(folder, setting):
    nnet = nnet_of(folder)
    z = np.load(folder / "case.npz")
    feats = z["features"]
    iv = z["ivector"] if "ivector" in z.files else None
    ref = z[f"output.{setting['key']}"]
    # the reference varies over frames well beyond the tolerance: a wrong network
    # cannot pass for a right one
    assert float(ref.std(axis=0).mean()) > 5 * (1e-4 + 2e-3 * float(np.abs(ref).max()))
    o = {k: setting[k] for k in ("frames_per_chunk", "extra_left_context",
                                 "extra_right_context", "extra_left_context_initial",
                                 "extra_right_context_final", "frame_subsampling_factor")}
    if not setting["looped"]:
        got = Inferencer(nnet, InferenceOptions(**o)).infer(feats, iv)
        assert_close(got, ref, setting["key"])
        return
    lm = LoopedModel(nnet, LoopedConfig(o["frames_per_chunk"],
                                        max(0, o["extra_left_context_initial"]),
                                        o["frame_subsampling_factor"],
                                        truncate_future_recurrence=find_future_recurrence(
                                            nnet) is not None))
    outs = []
    for pieces in ([feats.shape[0]], [1, 6, 13, 29, 21], [25] * 3):
        s = lm.stream(iv)
        got, pos = [], 0
        for n in pieces:
            got.append(s.push(feats[pos:pos + n]))
            pos += n
        got.append(s.finish())
        outs.append(np.concatenate(got, axis=0))
    for got in outs:
        assert_close(got, ref, setting["key"])
        # how the frames were cut changes nothing, to the bit
        assert np.array_equal(got, outs[0])


# -- Kaldi's compilation of the chunk requests of kaldi_stats.json on them ------------------

CHUNK_PARAMS = [pytest.param(d, key, id=f"{d.name}-{key}") for d in CASES
                for key in json.loads((d / "kaldi_chunks.json").read_text())]


@pytest.mark.parametrize("folder,key", CHUNK_PARAMS)
def test_compilation_equals_kaldis(folder, key):
    """Command counts and peak bytes of the unoptimized, optimized and shortcut-compiled
    computations as Kaldi's (genchunk: Compiler, Optimize, CachingOptimizingCompiler on
    the network in test mode); for chunk 21 x 1 the optimized printout, character for
    character."""
    fig = json.loads((folder / "kaldi_chunks.json").read_text())[key]
    nnet = load_model(str(folder / "model.raw")).nnet
    set_batchnorm_test_mode(nnet)
    set_dropout_test_mode(nnet)
    # kaldi_stats.json's request (bench.common.chunk_request, as test_kaldi_stats), on the
    # context Kaldi used
    assert simple_context(nnet) == (fig["left_context"], fig["right_context"])
    from bench import common  # noqa: PLC0415
    req = common.chunk_request(nnet, fig["chunk"], fig["batch"])
    for form, comp in (("unoptimized", compile_request(nnet, req, optimize=False)),
                       ("optimized", compile_request(nnet, req, use_shortcut=False)),
                       ("shortcut", compile_request(nnet, req, use_shortcut=True))):
        st = comp.stats()
        assert (st["commands"], st["peak_bytes"]) == (fig[form]["commands"],
                                                      fig[form]["peak_bytes"]), form
        if form == "optimized" and key == "c21_b1":
            with gzip.open(folder / "computation_c21_b1.txt.gz", "rt") as f:
                assert comp.to_text(nnet) == f.read()
