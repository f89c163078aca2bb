"""Nonlinearities, fixed column maps, normalisation and CompositeComponent: random
configurations through the shared checks (declared properties, finite differences,
text/binary I/O), Kaldi-specific behaviour (stats, self-repair, block-dim, test mode),
config errors and shape errors.  Random components and gradient controls are in
test_components_nonlinear_random.py."""

from __future__ import annotations

import numpy as np
import pytest

from component_harness import (
    check_derivatives,
    check_io_roundtrip,
    check_properties,
    component_from_config,
    run_backward,
    run_forward,
)
from engine.core.errors import ConfigError, DimensionError
from engine.nnet.components import read_component
from engine.nnet.components.base import ComponentProperty as P
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

# (type, config) pairs in the spirit of Kaldi's GenerateRandomSimpleComponent
CONFIGS = [
    ("SigmoidComponent", "dim=7"),
    ("SigmoidComponent", "dim=12 self-repair-scale=1e-05"),
    ("TanhComponent", "dim=5"),
    ("TanhComponent", "dim=16 self-repair-lower-threshold=0.1 self-repair-scale=1e-5"),
    ("RectifiedLinearComponent", "dim=9"),
    ("RectifiedLinearComponent", "dim=12 block-dim=4 self-repair-scale=1e-05"),
    ("SoftmaxComponent", "dim=6"),
    ("SoftmaxComponent", "dim=21"),
    ("LogSoftmaxComponent", "dim=4"),
    ("LogSoftmaxComponent", "dim=33"),
    ("PnormComponent", "input-dim=12 output-dim=4"),
    ("PnormComponent", "input-dim=10 output-dim=10"),
    ("SumGroupComponent", "sizes=3,1,4,2"),
    ("SumGroupComponent", "input-dim=12 output-dim=3"),
    ("SumBlockComponent", "input-dim=12 output-dim=4 scale=0.5"),
    ("SumBlockComponent", "input-dim=9 output-dim=9"),
    ("PermuteComponent", "column-map=2,0,3,1,4"),
    ("PermuteComponent", "column-map=0,1,2"),
    ("ElementwiseProductComponent", "input-dim=6 output-dim=3"),
    ("ElementwiseProductComponent", "input-dim=12 output-dim=4"),
    ("NoOpComponent", "dim=8"),
    ("NormalizeComponent", "dim=10"),
    ("NormalizeComponent", "dim=12 block-dim=4 target-rms=2.0"),
    ("NormalizeComponent", "input-dim=9 block-dim=3 add-log-stddev=true"),
    ("NormalizeComponent", "dim=5 add-log-stddev=true target-rms=0.5"),
    ("BatchNormComponent", "dim=6"),
    ("BatchNormComponent", "dim=12 block-dim=4 target-rms=2.0 epsilon=0.01"),
    ("CompositeComponent", "num-components=3 max-rows-process=3 "
     "component1='type=AffineComponent input-dim=5 output-dim=7' "
     "component2='type=TanhComponent dim=7' "
     "component3='type=AffineComponent input-dim=7 output-dim=4'"),
    ("CompositeComponent", "num-components=2 "
     "component1='type=RectifiedLinearComponent dim=6' "
     "component2='type=NormalizeComponent dim=6 block-dim=3'"),
]


def _ids(cfg):
    return f"{cfg[0]}:{cfg[1][:40]}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_random_configs(cfg):
    type_name, text = cfg
    comp = component_from_config(type_name, text, seed=3)
    check_properties(comp)
    check_derivatives(comp, num_rows=7)
    check_io_roundtrip(comp)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_wrong_input_shape_is_dimension_error(cfg):
    type_name, text = cfg
    comp = component_from_config(type_name, text)
    x = np.zeros((3, comp.input_dim() + 1), dtype=np.float32)
    out = np.zeros((3, comp.output_dim()), dtype=np.float32)
    with pytest.raises(DimensionError) as e:
        comp.propagate(None, x, out)
    assert type_name in str(e.value)


@pytest.mark.parametrize("type_name,text,option", [
    ("SigmoidComponent", "", "dim"),
    ("TanhComponent", "dim=0", "dim"),
    ("RectifiedLinearComponent", "dim=10 block-dim=3", "block-dim"),
    ("SoftmaxComponent", "dim=x", "dim"),
    ("PnormComponent", "input-dim=10 output-dim=3", "input-dim"),
    ("PnormComponent", "input-dim=10", "output-dim"),
    ("SumGroupComponent", "input-dim=10", "output-dim"),
    ("SumGroupComponent", "sizes=2,0,1", "sizes"),
    ("SumBlockComponent", "input-dim=10 output-dim=4", "input-dim"),
    ("PermuteComponent", "column-map=0,0,1", "column-map"),
    ("PermuteComponent", "", "column-map"),
    ("ElementwiseProductComponent", "input-dim=4 output-dim=4", "input-dim"),
    ("NoOpComponent", "backprop-scale=0.5", "dim"),
    ("NormalizeComponent", "dim=6 target-rms=0", "target-rms"),
    ("NormalizeComponent", "target-rms=1", "dim"),
    ("BatchNormComponent", "dim=6 block-dim=4", "block-dim"),
    ("BatchNormComponent", "dim=6 epsilon=0", "epsilon"),
    ("CompositeComponent", "component1='type=TanhComponent dim=3'", "num-components"),
    ("CompositeComponent", "num-components=2 component1='type=TanhComponent dim=3'",
     "component2"),
    ("CompositeComponent", "num-components=1 component1='type=DropoutComponent dim=3 "
     "dropout-proportion=0.5'", "component1"),
    ("CompositeComponent", "num-components=1 component1='type=TanhComponent'", "dim"),
    ("SigmoidComponent", "dim=4 bogus=1", "bogus"),
])
def test_config_errors_name_option(type_name, text, option):
    with pytest.raises(ConfigError) as e:
        component_from_config(type_name, text)
    assert option in str(e.value)


# -- Kaldi-specific behaviour ---------------------------------------------------------


def _roundtrip_text(comp) -> bytes:
    w = KaldiWriter(binary=False)
    comp.write(w)
    return w.getvalue()


def test_nonlinear_stats_store_write_read():
    comp = component_from_config("TanhComponent", "dim=4 self-repair-scale=0.01")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y, memo = run_forward(comp, x)
    comp.store_stats(x, y, memo)  # the first minibatch is always stored
    assert comp.count == 8
    np.testing.assert_allclose(comp.value_sum, y.sum(axis=0), rtol=1e-5)
    np.testing.assert_allclose(comp.deriv_sum, (1 - y * y).sum(axis=0), rtol=1e-5)
    grad = comp.copy()
    dy = rng.standard_normal(y.shape).astype(np.float32)
    run_backward(comp, x, y, dy, memo, grad)
    assert grad.oderiv_count == 8 and grad.num_dims_processed == 4
    text = _roundtrip_text(grad)
    assert b"<Count> 8 " in text and b"<SelfRepairScale> 0.01 " in text
    back = read_component(KaldiReader(text, binary=False))
    np.testing.assert_allclose(back.value_sum, grad.value_sum, rtol=1e-6)
    np.testing.assert_allclose(back.oderiv_sumsq, grad.oderiv_sumsq, rtol=1e-5)
    assert _roundtrip_text(back) == text
    wb = KaldiWriter(binary=True)
    grad.write(wb)
    back_b = read_component(KaldiReader(wb.getvalue(), binary=True))
    assert back_b.count == 8.0 and _roundtrip_text(back_b) == text


def test_relu_self_repair_pushes_dead_dims_up():
    comp = component_from_config("RectifiedLinearComponent",
                                 "dim=6 block-dim=3 self-repair-scale=0.05")
    # fake statistics: block column 0 never active, column 2 always active
    comp.count = 10.0
    comp.value_sum = np.zeros(6)
    comp.deriv_sum = np.array([0.0, 5.0, 10.0, 0.0, 5.0, 10.0])
    x = np.ones((2, 6), dtype=np.float32)
    y, _ = run_forward(comp, x)
    dy = np.zeros_like(y)
    repaired = 0
    for seed in range(8):  # the repair happens on about half of the minibatches
        upd = comp.copy()
        upd.rng = np.random.default_rng(seed)
        dx = run_backward(comp, x, y, dy, None, upd)
        if np.any(dx != 0):
            repaired += 1
            # -scale/0.5 * (-1) for dead, 0 for middle, -scale/0.5 for saturated
            np.testing.assert_allclose(dx[0], [0.1, 0, -0.1, 0.1, 0, -0.1], atol=1e-7)
            assert upd.num_dims_self_repaired == 2 and upd.num_dims_processed == 3
    assert 0 < repaired < 8


def test_sigmoid_no_self_repair_without_stats():
    comp = component_from_config("SigmoidComponent", "dim=3 self-repair-scale=0.05")
    x = np.array([[5.0, -5.0, 0.0]], dtype=np.float32)
    y, _ = run_forward(comp, x)
    dy = np.ones_like(y)
    upd = comp.copy()
    dx = run_backward(comp, x, y, dy, None, upd)
    np.testing.assert_allclose(dx, y * (1 - y), rtol=1e-6)
    assert upd.num_dims_processed == 3 and upd.num_dims_self_repaired == 0


def test_softmax_floor_and_logsoftmax():
    sm = component_from_config("SoftmaxComponent", "dim=3")
    y, _ = run_forward(sm, np.array([[0.0, -100.0, 100.0]], dtype=np.float32))
    assert y[0, 1] == np.float32(1e-20) and abs(y.sum() - 1) < 1e-6
    ls = component_from_config("LogSoftmaxComponent", "dim=3")
    x = np.array([[1.0, 2.0, 3.0]])
    y, _ = run_forward(ls, x)
    np.testing.assert_allclose(np.exp(y).sum(), 1.0, rtol=1e-12)


def test_normalize_values_and_floor():
    comp = component_from_config("NormalizeComponent",
                                 "dim=4 block-dim=2 target-rms=2 add-log-stddev=true")
    assert comp.output_dim() == 6
    x = np.array([[3.0, 4.0, 0.0, 0.0]], dtype=np.float32)
    y, _ = run_forward(comp, x)
    # block 1: rms 3.5355 -> scaled to rms 2; log column = log(rms); block 2 floored
    np.testing.assert_allclose(y[0, :2], [3.0, 4.0] / np.sqrt(12.5) * 2, rtol=1e-5)
    np.testing.assert_allclose(y[0, 2], np.log(np.sqrt(12.5)), rtol=1e-5)
    np.testing.assert_allclose(y[0, 3:5], 0.0)
    dx = run_backward(comp, x, y, np.ones_like(y), None)
    assert np.all(np.isfinite(dx))


def test_batchnorm_train_stats_then_test_mode():
    comp = component_from_config("BatchNormComponent", "dim=6 block-dim=3")
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((50, 6)) * 3 + 1).astype(np.float32)
    y, memo = run_forward(comp, x)
    xb = x.reshape(100, 3)
    np.testing.assert_allclose(y.reshape(100, 3).mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(y.reshape(100, 3).std(axis=0),
                               xb.std(axis=0) / np.sqrt(xb.var(axis=0) + 1e-3), rtol=1e-4)
    comp.store_stats(x, y, memo)
    assert comp.count == 100
    comp.set_test_mode(True)
    assert not comp.properties() & (P.USES_MEMO | P.STORES_STATS)
    y2, memo2 = run_forward(comp, x)
    assert memo2 is None
    np.testing.assert_allclose(y2, y, rtol=1e-3, atol=1e-4)
    check_derivatives(comp, num_rows=6)
    check_properties(comp)


def test_batchnorm_training_statistics_keep_their_digits_over_many_frames():
    """Training-mode batch-norm on 4000 frames whose mean is 50 times their deviation:
    the variance is uvar - mean^2, which cancels most digits, so the column sums must not
    lose any (NumPy sums a row-major column one row after another in float32: the
    outputs came out 5e-3 off here).  Against a float64 computation, forward and
    backward."""
    comp = component_from_config("BatchNormComponent", "dim=3")
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((4000, 3)) + 50.0).astype(np.float32)
    y, memo = run_forward(comp, x)
    x64 = x.astype(np.float64)
    mean, var = x64.mean(axis=0), x64.var(axis=0)
    want = (x64 - mean) / np.sqrt(var + 1e-3)
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-3)
    od = rng.standard_normal(y.shape).astype(np.float32)
    dx = run_backward(comp, x, y, od, memo)
    od64, y64 = od.astype(np.float64), want
    scale = 1.0 / np.sqrt(var + 1e-3)
    want_dx = scale * (od64 - od64.mean(axis=0) - y64 * (y64 * od64).mean(axis=0))
    np.testing.assert_allclose(dx, want_dx, rtol=0, atol=2e-3 * np.abs(want_dx).max())


def test_batchnorm_io_exact_with_dyadic_stats():
    comp = component_from_config("BatchNormComponent", "dim=4 target-rms=0.5")
    comp.count = 8.0
    comp.stats_sum = np.array([4.0, -2.0, 0.0, 1.0])
    comp.stats_sumsq = np.array([10.0, 3.0, 2.0, 8.0])
    comp.set_test_mode(True)
    check_io_roundtrip(comp)
    text = _roundtrip_text(comp)
    assert b"<TestMode> T <Count> 8 <StatsMean>  [ 0.5 -0.25 0 0.125 ]" in text
    back = read_component(KaldiReader(text, binary=False))
    np.testing.assert_array_equal(back.scale_vec, comp.scale_vec)
    mean = comp.stats_sum / 8
    var = comp.stats_sumsq / 8 - mean ** 2
    np.testing.assert_allclose(comp.scale_vec, 0.5 / np.sqrt(var + 1e-3), rtol=1e-6)
    np.testing.assert_allclose(comp.offset_vec, -mean * comp.scale_vec, rtol=1e-6)


def test_composite_chunks_match_unchunked_and_store_stats():
    text = ("num-components=2 max-rows-process={} "
            "component1='type=AffineComponent input-dim=4 output-dim=5' "
            "component2='type=SigmoidComponent dim=5'")
    big = component_from_config("CompositeComponent", text.format(100), seed=1)
    small = big.copy()
    small.max_rows_process = 3
    assert big.properties() & P.UPDATABLE_COMPONENT
    assert big.num_parameters() == 25
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 4)).astype(np.float32)
    y1, _ = run_forward(big, x)
    y2, _ = run_forward(small, x)
    np.testing.assert_allclose(y1, y2, rtol=1e-6)
    dy = rng.standard_normal(y1.shape).astype(np.float32)
    g1, g2 = big.copy(), small.copy()
    g1.set_as_gradient()
    g2.set_as_gradient()
    dx1 = run_backward(big, x, y1, dy, None, g1)
    dx2 = run_backward(small, x, y2, dy, None, g2)
    np.testing.assert_allclose(dx1, dx2, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1.param_arrays(), g2.param_arrays()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # the sigmoid's activation stats were stored in the gradient copy
    assert g1.components[1].count == 10
    assert b"<NumComponents> 2 <AffineComponent>" in _roundtrip_text(big)


def test_elementwise_product_backprop_bits():
    """Each block's derivative is out_deriv times the other blocks' product, made from
    running products in the order cumulative products along the blocks take them: the
    very bits of the prefix/suffix cumprod form, for 2, 3 and 4 blocks (special values
    included), into a non-contiguous derivative too."""
    for k in (2, 3, 4):
        d = 5
        comp = component_from_config("ElementwiseProductComponent",
                                     f"input-dim={k * d} output-dim={d}")
        rng = np.random.default_rng(3 + k)
        x = rng.standard_normal((7, k * d)).astype(np.float32)
        x[0, :6] = [0.0, -0.0, np.inf, np.nan, 1e-45, -3e38]
        dy = rng.standard_normal((7, d)).astype(np.float32)
        blocks = x.reshape(7, k, d)
        ones = np.ones((7, 1, d), np.float32)
        with np.errstate(all="ignore"):
            prefix = np.concatenate([ones, np.cumprod(blocks, axis=1)[:, :-1]], axis=1)
            suffix = np.concatenate([np.cumprod(blocks[:, ::-1], axis=1)[:, :-1][:, ::-1],
                                     ones], axis=1)
            want = (prefix * suffix * dy[:, None, :]).reshape(7, k * d)
            got = np.empty_like(x)
            comp.backprop(None, None, x, None, dy, None, None, got)
            wide = np.zeros((7, k * d + 3), np.float32)
            comp.backprop(None, None, x, None, dy, None, None, wide[:, 2:2 + k * d])
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), k
        assert np.array_equal(wide[:, 2:2 + k * d].view(np.int32), want.view(np.int32)), k
        assert not wide[:, :2].any() and not wide[:, 2 + k * d:].any()
