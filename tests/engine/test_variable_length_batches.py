"""Batches of sequences of different lengths in one request (the x-vector use: each
utterance's embedding from statistics pooling over all its frames), compiled and
run: each sequence's output is what the sequence gives alone.  Such a request used to
grow the unpruned graph by the pooling window (10000 frames) per sequence, and from
16 sequences on it was refused; the graph build by intervals (per sequence shape,
engine/compiler/graph_intervals.py) makes only the pruned graph."""

from __future__ import annotations

import numpy as np
import pytest

from engine.compiler.graph import ComputationGraph, ComputationGraphBuilder
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.shortcut import compile_request
from engine.core.index import Index
from engine.nnet.model_io import load_model
from engine.nnet.nnet import Nnet
from engine.runtime.executor import run_computation

from inference_nets import XVECTOR
from refdata import shared_ref


def _request(lens: list[int], left: int, right: int) -> ComputationRequest:
    return ComputationRequest(
        [IoSpecification("input", [Index(n, t, 0) for n, m in enumerate(lens)
                                   for t in range(-left, m + right)])],
        [IoSpecification("output", [Index(n, 0, 0) for n in range(len(lens))])])


def _check_batch(nnet, lens: list[int], left: int, right: int, dim: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    req = _request(lens, left, right)
    builder = ComputationGraphBuilder(nnet, ComputationGraph())
    builder.compute(req)
    assert builder.array_method == "intervals"
    feats = [rng.standard_normal((m + left + right, dim)).astype(np.float32) for m in lens]
    batch = compile_request(nnet, req)
    out, _, _ = run_computation(batch, nnet, {"input": np.concatenate(feats)})
    for n, m in enumerate(lens):
        alone = compile_request(nnet, _request([m], left, right))
        want, _, _ = run_computation(alone, nnet, {"input": feats[n]})
        np.testing.assert_allclose(out["output"][n], want["output"][0], rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_of_24_sequences_of_different_lengths(seed):
    rng = np.random.default_rng(seed)
    nnet = Nnet.from_config(XVECTOR, rng=rng)
    lens = rng.integers(1, 120, size=24).tolist()
    _check_batch(nnet, lens, 4, 4, 6, seed)


@pytest.mark.conformance
def test_the_reference_xvector_on_a_batch_of_32_utterances():
    ref = shared_ref()
    if ref is None or not (ref / "models" / "xvector" / "model.raw").is_file():
        pytest.skip("../shared/kaldi-ref models not present")
    nnet = load_model(str(ref / "models" / "xvector" / "model.raw")).nnet
    lens = np.random.default_rng(7).integers(10, 300, size=32).tolist()
    # (the first layer reads t - 2 .. t + 2, the third t - 3 .. t + 3: 7 frames each side
    # cover the context)
    _check_batch(nnet, lens, 7, 7, nnet.input_dim("input"), 7)
