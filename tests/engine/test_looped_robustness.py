"""Looped compilation on awkward networks (engine.inference.looped): networks that
cannot be looped fail fast with a reason, a looped computation in which one chunk
reads what only a later chunk creates is refused at compile time (not at run
time), and random recurrent networks stream exactly like one whole-utterance
computation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from refdata import shared_ref
from engine.core.errors import InferenceError
from engine.inference import InferenceOptions, Inferencer
from engine.inference.looped import LoopedConfig, check_loopable, find_future_recurrence
from engine.inference.stream import LoopedModel
from engine.nnet.model_io import load_model
from engine.nnet.random_config import GenerationOptions, generate_config_sequence
from inference_nets import RECURRENT, assert_close, feats, make_nnet

DATA = Path(__file__).resolve().parents[1] / "data" / "inference"


def _random_net(kind: str, seed: int):
    rng = np.random.default_rng(seed)
    return generate_config_sequence(rng, GenerationOptions(dim_scale=0.3), kind=kind).build(rng)


def _stream_all(model: LoopedModel, x, ivector, rng) -> np.ndarray:
    s, outs, pos = model.stream(ivector), [], 0
    while pos < len(x):
        n = int(rng.integers(0, 12))
        outs.append(s.push(x[pos:pos + n]))
        pos += n
    outs.append(s.finish())
    return np.concatenate(outs)


# -- networks that cannot be looped -----------------------------------------------------------


def _blstm_path() -> Path:
    shared = shared_ref()
    p = shared / "models" / "blstm" / "model.raw" if shared is not None else None
    return p if p is not None and p.is_file() else DATA / "blstm" / "model.raw"


def test_blstm_fails_fast_naming_the_backward_recurrence(compiles):
    model = load_model(_blstm_path())
    nnet = getattr(model, "nnet", model)
    with pytest.raises(InferenceError) as err:
        LoopedModel(nnet, LoopedConfig(frames_per_chunk=20))
    msg = str(err.value)
    assert "blstm1-backward" in msg and "t+1" in msg and "whole-utterance inference" in msg
    assert "blstm1-forward" not in msg            # the forward LSTM is fine
    # detected before any compilation (which took seconds and then looped anyway)
    assert compiles == []
    # whole-utterance inference still works on it
    x = np.load(DATA / "blstm" / "infer_utt1_part.npz")
    out = Inferencer(nnet, InferenceOptions(frames_per_chunk=50)).infer(x["features"])
    assert_close(out[:100], x["output"], "blstm whole-utterance")


FUTURE = RECURRENT.replace("IfDefined(Offset(t1, -2))", "IfDefined(Offset(t1, 2))")
ORPHAN_FUTURE = RECURRENT + """
component name=rb type=AffineComponent input-dim=32 output-dim=16
component-node name=rb component=rb input=Append(a1, IfDefined(Offset(tb, 1)))
component name=tb type=TanhComponent dim=16
component-node name=tb component=tb input=rb
output-node name=output-backward input=tb
"""


def test_future_recurrence_detection():
    assert find_future_recurrence(make_nnet(RECURRENT)) is None
    why = find_future_recurrence(make_nnet(FUTURE))
    assert why is not None and "r1 reads t1 at t+2" in why and "2 frame(s) later" in why
    assert "Inferencer" not in why             # the reason alone; the refusal advises
    with pytest.raises(InferenceError, match="not possible.*use whole-utterance inference"
                       ".*set truncate_future_recurrence"):
        check_loopable(make_nnet(FUTURE))
    # a backward recurrence that only another output uses does not matter: the looped
    # requests ask for 'output' alone
    nnet = make_nnet(ORPHAN_FUTURE)
    assert find_future_recurrence(nnet) is None
    assert find_future_recurrence(nnet, "output-backward") is not None
    model = LoopedModel(nnet, LoopedConfig(frames_per_chunk=5))
    x = feats(23)
    out = _stream_all(model, x, None, np.random.default_rng(0))
    ref = Inferencer(make_nnet(RECURRENT), InferenceOptions(frames_per_chunk=100)).infer(x)
    assert_close(out, ref, "forward output next to a backward orphan")


# -- a chunk reading what a later chunk creates ------------------------------------------------


@pytest.mark.parametrize("seed", [0, 4, 5])
def test_failover_on_future_input(seed):
    """multi_io networks reading ``Failover(Offset(x, k), x)`` (right context 0).
    Kaldi's compiler resolves the Failover at a chunk's last frames against the whole
    multi-chunk graph, so chunk 0 would read chunk 1's input before it exists ('matrix
    m8 is used before it is allocated').  Our compiler resolves optional inputs only
    against the chunk's own and earlier segments, so the stream equals chunk-by-chunk
    inference (each chunk sees its inputs only, as the looped requests define)."""
    nnet = _random_net("multi_io", seed)
    rng = np.random.default_rng(100 + seed)
    chunk, elci = int(rng.integers(3, 9)), int(rng.choice([0, 3]))
    model = LoopedModel(nnet, LoopedConfig(frames_per_chunk=chunk,
                                           extra_left_context_initial=elci))
    T = int(rng.integers(1, 40))
    x = rng.standard_normal((T, model.input_dim)).astype(np.float32)
    iv = rng.standard_normal(model.ivector_dim).astype(np.float32)
    out = _stream_all(model, x, iv, rng)
    ref = Inferencer(nnet, InferenceOptions(frames_per_chunk=model.chunk_size,
                                            extra_left_context=200,
                                            extra_left_context_initial=200)).infer(x, iv)
    assert_close(out, ref, f"multi_io seed {seed}")


# -- random recurrent networks: stream == one whole-utterance computation ------------------


RECURRENT_KINDS = ["rnn", "rnn_clockwork", "lstm", "lstm_truncation", "fast_lstm", "gru",
                   "tdnnf", "simple", "cnn_new"]


@pytest.mark.parametrize("kind", RECURRENT_KINDS)
def test_random_network_stream_equals_whole_utterance(kind):
    for seed in range(3):
        nnet = _random_net(kind, seed)
        rng = np.random.default_rng(100 + seed)
        chunk, elci = int(rng.integers(3, 9)), int(rng.choice([0, 3]))
        model = LoopedModel(nnet, LoopedConfig(frames_per_chunk=chunk,
                                               extra_left_context_initial=elci))
        T = int(rng.integers(1, 40))
        x = rng.standard_normal((T, model.input_dim)).astype(np.float32)
        iv = (rng.standard_normal(model.ivector_dim).astype(np.float32)
              if model.has_ivectors else None)
        out = _stream_all(model, x, iv, rng)
        ref = Inferencer(nnet, InferenceOptions(frames_per_chunk=T + 10,
                                                extra_left_context_initial=elci)).infer(x, iv)
        assert_close(out, ref, f"{kind} seed {seed} chunk {model.chunk_size} T {T}")


def test_blstm_truncated_as_kaldis_looped_decodable():
    """With truncate_future_recurrence the BLSTM streams as Kaldi's looped decodable
    runs it: the backward recurrence cut at each chunk's end.  Checked against
    Kaldi (tests/kaldi_oracle/check_infer.py --looped, blstm: 0 failing); here: the
    stream is the same however the frames are cut, depends on the chunk size,
    differs from whole-utterance output, and names the truncation."""
    nnet = getattr(load_model(_blstm_path()), "nnet", None)
    x = np.load(DATA / "blstm" / "infer_utt1_part.npz")["features"][:90]
    outs = {}
    for chunk in (20, 30):
        model = LoopedModel(nnet, LoopedConfig(frames_per_chunk=chunk,
                                               truncate_future_recurrence=True))
        assert "blstm1-backward" in model.truncation
        runs = [_stream_all(model, x, None, np.random.default_rng(seed)) for seed in (1, 2)]
        assert np.array_equal(runs[0], runs[1])
        outs[chunk] = runs[0]
    whole = Inferencer(nnet, InferenceOptions(frames_per_chunk=200)).infer(x)
    assert outs[20].shape == outs[30].shape == whole.shape
    assert np.abs(outs[20] - outs[30]).max() > 1e-3
    assert np.abs(outs[20] - whole).max() > 1e-3
    # the refusal names the option
    with pytest.raises(InferenceError, match="truncate_future_recurrence"):
        LoopedModel(nnet, LoopedConfig(frames_per_chunk=20))


@pytest.mark.parametrize("chunk,elci", [(20, 0), (33, 10)])
def test_blstm_truncated_equals_kaldi(chunk, elci):
    """Kaldi's looped decodable on the BLSTM (tests/data/inference/blstm)."""
    nnet = getattr(load_model(DATA / "blstm" / "model.raw"), "nnet", None)
    x = np.load(DATA / "blstm" / "infer_utt1_part.npz")["features"]
    ref = np.load(DATA / "blstm" / "looped_truncated.npz")[f"output.fpc{chunk}_elci{elci}"]
    model = LoopedModel(nnet, LoopedConfig(frames_per_chunk=chunk,
                                           extra_left_context_initial=elci,
                                           truncate_future_recurrence=True))
    assert_close(_stream_all(model, x, None, np.random.default_rng(chunk)), ref,
                 f"blstm looped {chunk}/{elci}")
