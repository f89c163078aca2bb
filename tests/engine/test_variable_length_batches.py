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

from refdata import shared_ref

# an x-vector in miniature: frame layers with context, statistics extraction and
# pooling over up to 10000 frames ahead (mean and standard deviation), segment layers
XVECTOR = """input-node name=input dim=6
component name=tdnn1 type=AffineComponent input-dim=30 output-dim=16
component-node name=tdnn1 component=tdnn1 input=Append(Offset(input, -2), Offset(input, -1), input, Offset(input, 1), Offset(input, 2))
component name=relu1 type=RectifiedLinearComponent dim=16
component-node name=relu1 component=relu1 input=tdnn1
component name=tdnn2 type=AffineComponent input-dim=48 output-dim=12
component-node name=tdnn2 component=tdnn2 input=Append(Offset(relu1, -2), relu1, Offset(relu1, 2))
component name=relu2 type=RectifiedLinearComponent dim=12
component-node name=relu2 component=relu2 input=tdnn2
component name=stats-extraction type=StatisticsExtractionComponent input-dim=12 input-period=1 output-period=1 include-variance=true
component-node name=stats-extraction component=stats-extraction input=relu2
component name=stats-pooling type=StatisticsPoolingComponent input-dim=25 input-period=1 left-context=0 right-context=10000 num-log-count-features=0 output-stddevs=true
component-node name=stats-pooling component=stats-pooling input=stats-extraction
component name=segment type=AffineComponent input-dim=24 output-dim=8
component-node name=segment component=segment input=Round(stats-pooling, 1)
output-node name=output input=segment
"""


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
