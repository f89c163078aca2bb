"""Restricted attention and time-height convolution compute on a regular time grid
(Kaldi's GetIndexesForComputation): the greatest common step of the times involved, from
the first to the last.  A time stride or times far apart with times one apart between them
make that grid billions of rows for a few frames (Kaldi would try to allocate it; a 400-byte
config with time-stride=2147483647 took a server to 48 GiB and a 500).  The grid may hold
at most four times the Indexes it is made for plus GRID_SLACK; beyond, compiling raises
ResourceLimitError naming the component, before anything is allocated."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from engine.compiler.compiler import compile_computation
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.errors import ResourceLimitError
from engine.core.index import Index
from engine.nnet.components._nonsimple_utils import GRID_SLACK
from engine.nnet.nnet import Nnet


def _attention(stride: int) -> Nnet:
    return Nnet.from_config(f"""input-node name=input dim=8
component name=affine type=AffineComponent input-dim=8 output-dim=16
component-node name=affine component=affine input=input
component name=att type=RestrictedAttentionComponent num-heads=1 key-dim=4 value-dim=4 \
time-stride={stride} num-left-inputs=3 num-right-inputs=0 num-left-inputs-required=0 \
num-right-inputs-required=0 output-context=true
component-node name=att component=att input=affine
output-node name=output input=att
""", rng=np.random.default_rng(0))


def _conv() -> Nnet:
    return Nnet.from_config("""input-node name=input dim=8
component name=conv type=TimeHeightConvolutionComponent num-filters-in=2 num-filters-out=2 \
height-in=4 height-out=4 height-offsets=-1,0,1 time-offsets=-1,0,1 required-time-offsets=0 \
use-natural-gradient=false
component-node name=conv component=conv input=input
output-node name=output input=conv
""", rng=np.random.default_rng(0))


def _request(in_t, out_t) -> ComputationRequest:
    return ComputationRequest([IoSpecification("input", [Index(0, t, 0) for t in in_t])],
                              [IoSpecification("output", [Index(0, t, 0) for t in out_t])])


def _refused(nnet: Nnet, req: ComputationRequest) -> str:
    tracemalloc.start()
    try:
        with pytest.raises(ResourceLimitError) as e:
            compile_computation(nnet, [req])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak          # refused before the grid is made
    return str(e.value)


@pytest.mark.parametrize("stride", [2147483647, 20_000_000, 100_000])
def test_an_attention_time_stride_far_beyond_the_frames_is_refused_by_name(stride):
    msg = _refused(_attention(stride), _request(range(4), range(2)))
    assert "'att' (RestrictedAttentionComponent)" in msg
    assert f"times from {-3 * stride} to 1" in msg and "greatest common step of 1" in msg


def test_ordinary_strides_and_large_regular_grids_still_compile():
    assert compile_computation(_attention(3), [_request(range(-9, 10), range(10))])
    # a grid about as large as what it holds is allowed at any size
    n = 2 * GRID_SLACK
    assert compile_computation(_attention(1), [_request(range(-3, n), range(n))])


def test_convolution_outputs_far_apart_are_refused_by_name():
    # outputs at t = 0 and t = 10^8 (inputs around each): a grid of 10^8 times of step 1
    far = 10 ** 8
    req = _request([-1, 0, 1, far - 1, far, far + 1], [0, far])
    msg = _refused(_conv(), req)
    assert "'conv' (TimeHeightConvolutionComponent)" in msg
    # the same outputs close together compile
    assert compile_computation(_conv(), [_request(range(-1, 12), [0, 10])])
