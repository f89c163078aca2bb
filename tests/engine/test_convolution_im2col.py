"""TimeHeightConvolution's all-steps-at-once form (engine/nnet/components/_convolution.py:
the gathered inputs of every step side by side, one product per chunk of rows) against
the naive definition and against Kaldi's step-by-step form, on random models: regular
and irregular height offsets (sliding windows over zero-padded heights, plain column
blocks, general column gathers), height subsampling, time offsets with gaps, several
sequences, output t strides, and chunks of rows small enough to split the work."""

from __future__ import annotations

import numpy as np
import pytest

from component_harness import component_from_config
from engine.core.errors import ConfigError
from engine.core.index import Index
from engine.nnet.components import _convolution as conv
from test_components_nonsimple import Setup, check_derivatives_ns, naive_conv, rows_by_index


def _random_case(rng):
    fi, fo = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    h_in = int(rng.integers(3, 9))
    kind = rng.integers(0, 4)
    if kind == 0:                       # padded window: heights -1,0,1
        hoffs = [-1, 0, 1]
    elif kind == 1:                     # unpadded window 0..2
        hoffs = [0, 1, 2]
    elif kind == 2:                     # one height offset (a column block per step)
        hoffs = [int(rng.integers(-1, 2))]
    else:                               # irregular: a general gather
        hoffs = sorted(set(int(v) for v in rng.integers(-2, 3, size=3)))
        if len(hoffs) > 1 and hoffs == list(range(hoffs[0], hoffs[0] + len(hoffs))):
            hoffs = [hoffs[0], hoffs[0] + 2]
    sub = int(rng.integers(1, 3))
    # output heights for which some height read lies inside the input
    h_out = 0
    while any(0 <= h_out * sub + o < h_in for o in hoffs):
        h_out += 1
    h_out = int(rng.integers(1, h_out + 1)) if h_out else 0
    toffs = [[0], [-1, 0, 1], [-2, 0, 2], [-3, 0]][int(rng.integers(0, 4))]
    cfg = (f"num-filters-in={fi} num-filters-out={fo} height-in={h_in} height-out={h_out} "
           f"height-offsets={','.join(map(str, hoffs))} time-offsets={','.join(map(str, toffs))} "
           f"height-subsample-out={sub} use-natural-gradient=false bias-stddev=1")
    if rng.integers(0, 3) == 0:
        cfg += " max-memory-mb=1e-4"
    return cfg, toffs


def _run(seed: int, kinds: set, small_chunks: bool, monkeypatch) -> bool:
    rng = np.random.default_rng(seed)
    cfg, toffs = _random_case(rng)
    try:
        comp = component_from_config("TimeHeightConvolutionComponent", cfg, seed=seed)
    except ConfigError:
        return False    # a model Kaldi refuses too (e.g. an input height nothing reads)
    n_seq = int(rng.integers(1, 4))
    t_step = [1, 1, 2][int(rng.integers(0, 3))]
    span = max(toffs) - min(toffs)
    tin = range(min(toffs) - 1, 12 + max(toffs) + 1)
    tout = range(0, 10 - span if span < 6 else 4, t_step)
    avail = [Index(n, t, 0) for n in range(n_seq) for t in tin]
    outs = [Index(n, t, 0) for n in range(n_seq) for t in tout]
    s = Setup(comp, outs, avail)
    plan = conv._step_plan(s.pi, comp.linear_params.shape[1])
    assert plan is not None, cfg      # every model Kaldi builds partitions its columns
    kinds.update(step[3] for step in plan[2])
    if small_chunks:
        monkeypatch.setattr(conv, "_IM2COL_ELEMENTS", 7 * s.pi.height_out)
    x = rng.standard_normal((len(s.ins), comp.input_dim()))
    x[~s.in_mask] = 0
    # against the definition (float64), and the derivatives by finite differences
    y, _ = check_derivatives_ns(s, x, seed=seed)
    for key, row in naive_conv(comp, s, x).items():
        np.testing.assert_allclose(rows_by_index(s, y)[key], row, rtol=1e-9, atol=1e-12,
                                   err_msg=cfg)
    # against Kaldi's step-by-step form, float32 as the executor runs it
    x32 = x.astype(np.float32)
    params = comp.linear_params.astype(np.float32)
    out_new = rng.standard_normal((len(s.outs), comp.output_dim())).astype(np.float32)
    out_old = out_new.copy()
    conv.convolve_forward(s.pi, x32, params, out_new)
    conv._convolve_forward_steps(s.pi, x32.reshape(s.pi.num_t_in * s.pi.num_images, -1),
                                 params, out_old)
    np.testing.assert_allclose(out_new, out_old, rtol=1e-5, atol=1e-5, err_msg=cfg)
    dy = rng.standard_normal(out_new.shape).astype(np.float32)
    g_new = np.zeros_like(params)
    conv.convolve_backward_params(s.pi, x32, dy, 0.5, g_new)
    g_old = np.zeros_like(params)
    monkeypatch.setattr(conv, "_step_plan", lambda ci, k: None)   # the step-by-step form
    conv.convolve_backward_params(s.pi, x32, dy, 0.5, g_old)
    monkeypatch.undo()
    np.testing.assert_allclose(g_new, g_old, rtol=1e-4, atol=1e-4, err_msg=cfg)
    # the input derivative: col2im against the step-by-step form, both adding to a
    # random start, and into a column slice of a wider matrix (not contiguous)
    if small_chunks:
        monkeypatch.setattr(conv, "_IM2COL_ELEMENTS", 7 * s.pi.height_out)
    start = rng.standard_normal(x32.shape).astype(np.float32)
    dx_old = start.copy()
    conv._backward_data_steps(s.pi, params, dy, dx_old, np)
    dx_new = start.copy()
    conv.convolve_backward_data(s.pi, params, dy, dx_new)
    np.testing.assert_allclose(dx_new, dx_old, rtol=1e-4, atol=1e-4, err_msg=cfg)
    cols = x32.shape[1]
    wide = np.zeros((x32.shape[0], cols + 3), np.float32)
    wide[:, 1:1 + cols] = start
    conv.convolve_backward_data(s.pi, params, dy, wide[:, 1:1 + cols])
    np.testing.assert_allclose(wide[:, 1:1 + cols], dx_old, rtol=1e-4, atol=1e-4, err_msg=cfg)
    assert not wide[:, 0].any() and not wide[:, 1 + cols:].any()
    monkeypatch.undo()
    return True


@pytest.mark.parametrize("small_chunks", [False, True])
def test_im2col_convolution_random(small_chunks, monkeypatch):
    kinds: set = set()
    ran = sum(_run(seed, kinds, small_chunks, monkeypatch) for seed in range(60))
    assert ran >= 40, ran
    # the three ways a step's columns are taken all occurred
    assert kinds == {"block", "window", "gather"}, kinds


def test_window_detection():
    # output height h reads heights 2h-1, 2h, 2h+1 (-1 outside [0, 5))
    assert conv._window([-1, 0, 1, 1, 2, 3, 3, 4, -1], 3, 5) == (-1, 2)
    # a -1 inside the input is not a window
    assert conv._window([0, -1, 2, 1, 2, 3], 2, 5) is None
    # irregular starts
    assert conv._window([0, 1, 3, 4, 4, 5], 3, 6) is None
