"""LstmNonlinearity, Gru/OutputGru nonlinearities, Convolution and Maxpooling
components: random configs (as Kaldi's GenerateRandomSimpleComponent) through the
shared checks, exact maths against plain loop transcriptions of Kaldi's scalar
code, Kaldi's reference gradients, config and dimension errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from component_harness import (
    assert_close,
    check_derivatives,
    check_io_roundtrip,
    check_properties,
    component_from_config,
    load_component_text,
    reference_cases,
    run_backward,
    run_forward,
)
from engine.core.errors import ComponentError, ConfigError, DimensionError
from engine.nnet.components import read_component
from engine.nnet.components.base import ComponentProperty as P
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

TYPES = ["LstmNonlinearityComponent", "GruNonlinearityComponent",
         "OutputGruNonlinearityComponent", "ConvolutionComponent", "MaxpoolingComponent"]


# ----------------------------------------------------------------------------------
# random configs (Kaldi's GenerateRandomSimpleComponent, sizes kept small)


def _random_configs(seed: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    ri = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    out = [("LstmNonlinearityComponent", f"cell-dim={ri(1, 30)} self-repair-scale=0.0"),
           ("LstmNonlinearityComponent",
            f"cell-dim={ri(1, 10)} self-repair-scale=0.0 use-dropout=true param-stddev=0.5")]
    c = ri(10, 20)
    r = ri(5, c - 1) if rng.integers(2) == 0 else c
    out.append(("GruNonlinearityComponent", f"cell-dim={c} recurrent-dim={r}"))
    out.append(("GruNonlinearityComponent", f"cell-dim={c}"))
    out.append(("OutputGruNonlinearityComponent",
                f"cell-dim={ri(10, 20)} learning-rate={rng.uniform(0.001, 0.1):.3f}"))
    ix, iy, iz = ri(6, 14), ri(6, 14), ri(2, 5)
    fx, fy = ri(1, ix), ri(1, iy)
    sx, sy = ri(1, fx), ri(1, fy)
    ix -= (ix - fx) % sx
    iy -= (iy - fy) % sy
    order = "yzx" if rng.integers(2) == 0 else "zyx"
    out.append(("ConvolutionComponent",
                f"input-x-dim={ix} input-y-dim={iy} input-z-dim={iz} filt-x-dim={fx} "
                f"filt-y-dim={fy} filt-x-step={sx} filt-y-step={sy} num-filters={ri(1, 6)} "
                f"input-vectorization-order={order} learning-rate=0.01"))
    dims = [ri(5, 9) for _ in range(3)]
    sizes = [ri(1, d) for d in dims]
    steps = [ri(1, s) for s in sizes]
    dims = [d - (d - s) % st for d, s, st in zip(dims, sizes, steps)]
    out.append(("MaxpoolingComponent",
                " ".join(f"input-{a}-dim={d}" for a, d in zip("xyz", dims)) + " "
                + " ".join(f"pool-{a}-size={s}" for a, s in zip("xyz", sizes)) + " "
                + " ".join(f"pool-{a}-step={s}" for a, s in zip("xyz", steps))))
    return out


CONFIGS = [cfg for seed in range(3) for cfg in _random_configs(seed)]


def _with_dropout_masks(comp, x, rng):
    if getattr(comp, "use_dropout", False):
        x[:, -3:] = rng.uniform(0.5, 1.5, size=(x.shape[0], 3))
    return x


@pytest.mark.parametrize("type_name,config", CONFIGS,
                         ids=[f"{t}-{i}" for i, (t, _) in enumerate(CONFIGS)])
def test_random_config(type_name, config):
    comp = component_from_config(type_name, config, seed=len(config))
    assert comp.type_name == type_name
    check_properties(comp)
    check_io_roundtrip(comp)
    if getattr(comp, "use_dropout", False):
        _check_lstm_dropout_derivatives(comp)
    else:
        check_derivatives(comp)
    assert comp.info().startswith(type_name)


def _check_lstm_dropout_derivatives(comp):
    """Finite differences for the 5C data columns only: Kaldi gives the dropout masks
    no derivative (zero), so the harness's all-columns check does not apply."""
    rng = np.random.default_rng(3)
    c64 = comp.copy()
    c64.params = c64.params.astype(np.float64)
    x = _with_dropout_masks(comp, rng.standard_normal((6, comp.input_dim())), rng)
    y, memo = run_forward(c64, x)
    dy = rng.standard_normal(y.shape)
    dx = run_backward(c64, x, y, dy, memo)
    assert np.all(dx[:, -3:] == 0)
    for _ in range(3):
        d = rng.standard_normal(x.shape) * 1e-6
        d[:, -3:] = 0
        yp, _ = run_forward(c64, x + d)
        ym, _ = run_forward(c64, x - d)
        actual = float(np.sum((yp - ym) * dy)) / 2
        predicted = float(np.sum(dx * d))
        assert abs(predicted - actual) <= 1e-3 * max(abs(actual), abs(predicted)) + 1e-12


# ----------------------------------------------------------------------------------
# exact maths: plain-loop transcriptions of Kaldi's scalar code


def _sig(a):
    return 1.0 / (1.0 + np.exp(-a))


def _lstm_reference(x, params, deriv_sum, count, cfg, dy):
    """Kaldi's CpuComputeLstmNonlinearity / CpuBackpropLstmNonlinearity, element by
    element; returns (output, input_deriv, params_deriv, value_sums, deriv_sums,
    self_repair_counts)."""
    nr, cd = x.shape[0], params.shape[1]
    drop = x.shape[1] == 5 * cd + 3
    y = np.zeros((nr, 2 * cd))
    dx = np.zeros_like(x)
    pd = np.zeros_like(params)
    vs, ds, srs = np.zeros((5, cd)), np.zeros((5, cd)), np.zeros((5, cd))
    cnt = 1.0 + count
    for c in range(cd):
        w_ic, w_fc, w_oc = params[:, c]
        sr = [cfg[5 + k] if deriv_sum[k, c] / cnt < cfg[k] else 0.0 for k in range(5)]
        for r in range(nr):
            i_p, f_p, c_p, o_p, c_prev = (x[r, c + k * cd] for k in range(5))
            i_s, f_s, o_s = x[r, 5 * cd:5 * cd + 3] if drop else (1.0, 1.0, 1.0)
            i_t = _sig(i_p + w_ic * c_prev)
            f_t = _sig(f_p + w_fc * c_prev)
            tcp = np.tanh(c_p)
            c_t = f_t * f_s * c_prev + i_t * i_s * tcp
            o_t = _sig(o_p + w_oc * c_t)
            tct = np.tanh(c_t)
            y[r, c], y[r, c + cd] = c_t, o_t * o_s * tct
            for k, (v, d) in enumerate(((i_t, i_t * (1 - i_t)), (f_t, f_t * (1 - f_t)),
                                        (tcp, 1 - tcp * tcp), (o_t, o_t * (1 - o_t)),
                                        (tct, 1 - tct * tct))):
                vs[k, c] += v
                ds[k, c] += d
            dm = dy[r, c + cd]
            do_in = o_t * (1 - o_t) * o_s * tct * dm - (2 * o_t - 1) * sr[3]
            dc = (1 - tct * tct) * o_t * o_s * dm + dy[r, c] + do_in * w_oc - tct * sr[4]
            df_in = dc * f_s * c_prev * f_t * (1 - f_t) - (2 * f_t - 1) * sr[1]
            di_in = dc * i_s * tcp * i_t * (1 - i_t) - (2 * i_t - 1) * sr[0]
            pd[:, c] += (c_prev * di_in, c_prev * df_in, c_t * do_in)
            dx[r, c] = di_in
            dx[r, c + cd] = df_in
            dx[r, c + 2 * cd] = (1 - tcp * tcp) * i_t * i_s * dc - tcp * sr[2]
            dx[r, c + 3 * cd] = do_in
            dx[r, c + 4 * cd] = w_ic * di_in + w_fc * df_in + f_t * f_s * dc
        for k in range(5):
            srs[k, c] = nr if deriv_sum[k, c] / cnt < cfg[k] else 0
    return y, dx, pd, vs, ds, srs


@pytest.mark.parametrize("dropout", [False, True])
def test_lstm_matches_kaldi_scalar_code_with_self_repair(dropout):
    rng = np.random.default_rng(7)
    comp = component_from_config(
        "LstmNonlinearityComponent",
        f"cell-dim=4 self-repair-scale=0.05 use-dropout={'true' if dropout else 'false'}")
    # existing stats that switch self-repair on for some units and off for others
    comp.count = 10.0
    comp.deriv_sum = rng.uniform(0.0, 0.4, size=(5, 4)) * comp.count
    comp.value_sum = rng.uniform(size=(5, 4)) * comp.count
    comp.params = comp.params.astype(np.float64)
    x = _with_dropout_masks(comp, rng.standard_normal((6, comp.input_dim())) * 2, rng)
    dy = rng.standard_normal((6, 8))
    y_ref, dx_ref, pd_ref, vs, ds, srs = _lstm_reference(
        x, comp.params, comp.deriv_sum, comp.count, comp.self_repair_config, dy)
    y, memo = run_forward(comp, x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    grad = comp.copy()
    grad.learning_rate = 0.5
    before = grad.copy()
    dx = run_backward(comp, x, y, dy, memo, grad)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad.params - before.params, 0.5 * pd_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad.value_sum - before.value_sum, vs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad.deriv_sum - before.deriv_sum, ds, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad.self_repair_total - before.self_repair_total,
                               srs.sum(axis=1))
    assert grad.count == before.count + 6
    assert 0 < srs.sum() < 5 * 4 * 6, "test should have self-repair both on and off"


def test_gru_maths_by_hand():
    rng = np.random.default_rng(11)
    comp = component_from_config("GruNonlinearityComponent",
                                 "cell-dim=5 recurrent-dim=3 self-repair-scale=0")
    w = comp.w_h.astype(np.float64)
    x = rng.standard_normal((4, comp.input_dim()))
    z, r, hp, c1, s1 = x[:, :5], x[:, 5:8], x[:, 8:13], x[:, 13:18], x[:, 18:21]
    h = np.tanh(hp + (r * s1) @ w.T)
    y, _ = run_forward(comp, x)
    np.testing.assert_allclose(y, np.hstack([h, (1 - z) * h + z * c1]), rtol=1e-6)
    # unprojected: c_{t-1} and s_{t-1} are the same columns
    comp2 = component_from_config("GruNonlinearityComponent", "cell-dim=4")
    assert comp2.input_dim() == 16 and comp2.recurrent_dim == 4
    x2 = rng.standard_normal((3, 16))
    h2 = np.tanh(x2[:, 8:12] + (x2[:, 4:8] * x2[:, 12:16]) @ comp2.w_h.astype(np.float64).T)
    y2, _ = run_forward(comp2, x2)
    np.testing.assert_allclose(y2[:, 4:], (1 - x2[:, :4]) * h2 + x2[:, :4] * x2[:, 12:16],
                               rtol=1e-6)


def test_output_gru_maths_by_hand():
    rng = np.random.default_rng(12)
    comp = component_from_config("OutputGruNonlinearityComponent", "cell-dim=6")
    x = rng.standard_normal((4, 18))
    z, hp, c1 = x[:, :6], x[:, 6:12], x[:, 12:]
    h = np.tanh(hp + comp.w_h.astype(np.float64) * c1)
    y, _ = run_forward(comp, x)
    np.testing.assert_allclose(y, np.hstack([h, (1 - z) * h + z * c1]), rtol=1e-6)


def test_gru_stats_and_self_repair():
    """Saturated units (average tanh' below threshold) get their derivative pushed
    back towards zero by self-repair-scale * h_t; stats accumulate in to_update."""
    comp = component_from_config("OutputGruNonlinearityComponent",
                                 "cell-dim=3 self-repair-scale=0.1 param-stddev=0")
    x = np.zeros((4, 9))
    x[:, 3] = 10.0      # unit 0 saturated: tanh' ~ 0
    x[:, 4] = 0.1       # unit 1 not saturated
    y, memo = run_forward(comp, x)
    dy = np.zeros_like(y)
    g = comp.copy()
    g.set_as_gradient()
    dx = run_backward(comp, x, y, dy, memo, g)
    # only unit 0 is saturated (unit 2 has h = 0, tanh' = 1); Kaldi counts units here
    assert g.count == 4 and g.self_repair_total == 1.0
    h0 = np.tanh(10.0)
    np.testing.assert_allclose(dx[:, 3], -0.1 * h0, rtol=1e-6)
    np.testing.assert_allclose(dx[:, 4], 0.0, atol=1e-12)
    np.testing.assert_allclose(g.value_sum, [4 * h0, 4 * np.tanh(0.1), 0.0], rtol=1e-6)
    dx_plain = run_backward(comp, x, y, dy, memo, None)
    assert np.all(dx_plain == 0), "no stats and no self-repair without to_update"


def _conv_reference(comp, x):
    X, Y, Z = comp.input_x_dim, comp.input_y_dim, comp.input_z_dim
    t = np.zeros((x.shape[0], X, Y, Z))
    for i in range(X):
        for j in range(Y):
            for k in range(Z):
                col = i * Y * Z + (j * Z + k if comp.input_vectorization == 1 else k * Y + j)
                t[:, i, j, k] = x[:, col]
    nx = 1 + (X - comp.filt_x_dim) // comp.filt_x_step
    ny = 1 + (Y - comp.filt_y_dim) // comp.filt_y_step
    w = comp.filter_params.astype(np.float64)
    out = []
    for a in range(nx):
        for b in range(ny):
            xs, ys = a * comp.filt_x_step, b * comp.filt_y_step
            patch = t[:, xs:xs + comp.filt_x_dim, ys:ys + comp.filt_y_dim, :].reshape(len(x), -1)
            out.append(patch @ w.T + comp.bias_params)
    return np.hstack(out)


@pytest.mark.parametrize("order", ["zyx", "yzx"])
def test_convolution_matches_loops(order):
    comp = component_from_config(
        "ConvolutionComponent", "input-x-dim=7 input-y-dim=6 input-z-dim=3 filt-x-dim=3 "
        f"filt-y-dim=2 filt-x-step=2 filt-y-step=2 num-filters=4 input-vectorization-order={order}")
    assert comp.output_dim() == 3 * 3 * 4
    x = np.random.default_rng(5).standard_normal((5, comp.input_dim()))
    y, _ = run_forward(comp, x)
    np.testing.assert_allclose(y, _conv_reference(comp, x), rtol=1e-5, atol=1e-6)


def test_convolution_column_maps_follow_the_geometry():
    """The patch column maps are cached per geometry (the values of the geometry fields):
    a component whose step changes after it has run computes with the new step."""
    comp = component_from_config(
        "ConvolutionComponent", "input-x-dim=7 input-y-dim=6 input-z-dim=3 filt-x-dim=3 "
        "filt-y-dim=2 filt-x-step=2 filt-y-step=2 num-filters=4")
    x = np.random.default_rng(6).standard_normal((4, comp.input_dim()))
    run_forward(comp, x)
    comp.filt_x_step = comp.filt_y_step = 1
    assert comp.output_dim() == 5 * 5 * 4
    y, _ = run_forward(comp, x)
    np.testing.assert_allclose(y, _conv_reference(comp, x), rtol=1e-5, atol=1e-6)


def test_convolution_matrix_option(tmp_path):
    rng = np.random.default_rng(1)
    mat = rng.standard_normal((3, 2 * 2 * 2 + 1)).astype(np.float32)
    for binary in (False, True):
        w = KaldiWriter(binary, header=True)
        w.write_matrix(mat)
        f = tmp_path / f"m{int(binary)}.mat"
        f.write_bytes(w.getvalue())
        comp = component_from_config(
            "ConvolutionComponent", "input-x-dim=4 input-y-dim=3 input-z-dim=2 filt-x-dim=2 "
            f"filt-y-dim=2 filt-x-step=1 filt-y-step=1 matrix={f}")
        np.testing.assert_array_equal(comp.filter_params, mat[:, :-1])
        np.testing.assert_array_equal(comp.bias_params, mat[:, -1])
    with pytest.raises(ConfigError, match="matrix"):
        component_from_config(
            "ConvolutionComponent", "input-x-dim=4 input-y-dim=3 input-z-dim=3 filt-x-dim=2 "
            f"filt-y-dim=2 filt-x-step=1 filt-y-step=1 matrix={f}")


def test_maxpooling_ties_and_overlap():
    comp = component_from_config(
        "MaxpoolingComponent", "input-x-dim=3 input-y-dim=1 input-z-dim=1 pool-x-size=2 "
        "pool-y-size=1 pool-z-size=1 pool-x-step=1 pool-y-step=1 pool-z-step=1")
    x = np.array([[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]], np.float32)
    y, memo = run_forward(comp, x)
    np.testing.assert_array_equal(y, [[1, 1], [2, 2]])
    dy = np.array([[10.0, 100.0], [10.0, 100.0]], np.float32)
    dx = run_backward(comp, x, y, dy, memo)
    # row 0: both members of pool 0 tie and both get 10; x1 is also the max of pool 1
    np.testing.assert_array_equal(dx, [[10, 110, 0], [0, 110, 0]])


def test_maxpooling_3d_layout():
    comp = component_from_config(
        "MaxpoolingComponent", "input-x-dim=4 input-y-dim=3 input-z-dim=4 pool-x-size=2 "
        "pool-y-size=3 pool-z-size=2 pool-x-step=2 pool-y-step=1 pool-z-step=2")
    x = np.random.default_rng(2).standard_normal((3, 48))
    t = x.reshape(3, 4, 3, 4)
    ref = t.reshape(3, 2, 2, 1, 3, 2, 2).max(axis=(2, 4, 6)).reshape(3, -1)
    y, _ = run_forward(comp, x)
    np.testing.assert_array_equal(y, ref)


# ----------------------------------------------------------------------------------
# Kaldi's reference cases: gradients


def _ref_cases():
    return [c for t in TYPES for c in reference_cases(t, full=True)]


@pytest.mark.parametrize("case", _ref_cases(), ids=lambda p: p.name)
def test_reference_gradient_and_stats(case):
    """Kaldi's gradient.txt holds the original parameters plus the gradient (Kaldi's
    SetAsGradient() sets the learning rate to 1 but does not zero the parameters),
    so compare (gradient.txt - component.txt) with our plain gradient."""
    comp = load_component_text(case / "component.txt")
    arrays = np.load(case / "arrays.npz")
    x = arrays["input"]
    y, memo = run_forward(comp, x)
    assert_close("output", y, arrays["output"])
    grad = None
    if (case / "gradient.txt").exists():
        grad = comp.copy()
        grad.set_as_gradient()
    dx = run_backward(comp, x, y, arrays["output_deriv"], memo, grad)
    assert_close("input_deriv", dx, arrays["input_deriv"])
    if grad is None:
        return
    ref = load_component_text(case / "gradient.txt")
    for p in comp.PARAMS:
        assert_close(p, getattr(grad, p), getattr(ref, p) - getattr(comp, p))
    if hasattr(ref, "count") and ref.count > 0:   # Kaldi's GRUs skip stats at random
        assert grad.count == ref.count
        assert_close("value stats", grad.value_sum, ref.value_sum)
        assert_close("deriv stats", grad.deriv_sum, ref.deriv_sum)


@pytest.mark.parametrize("case", _ref_cases(), ids=lambda p: p.name)
def test_reference_text_io_byte_identical(case):
    for name in ("component.txt", "gradient.txt"):
        if (case / name).exists():
            comp = load_component_text(case / name)
            check_io_roundtrip(comp, (case / name).read_bytes())


# ----------------------------------------------------------------------------------
# I/O details


def test_lstm_stats_and_dropout_io():
    comp = component_from_config("LstmNonlinearityComponent", "cell-dim=3 use-dropout=true")
    assert comp.input_dim() == 18 and comp.output_dim() == 6
    comp.count = 123456789.0   # needs a double on disk
    comp.value_sum[...] = comp.count * 0.5
    comp.self_repair_total[...] = comp.count * 3 * 0.25
    text = comp.to_text()
    assert "<UseDropout> T <Count>" in text and "<SelfRepairProb>  [ 0.25 0.25" in text
    check_io_roundtrip(comp)
    wb = KaldiWriter(binary=True)
    comp.write(wb)
    back = read_component(KaldiReader(wb.getvalue(), binary=True))
    assert back.count == comp.count and back.use_dropout


def test_read_tolerates_repeated_type_token():
    for t, cfg in (("GruNonlinearityComponent", "cell-dim=3"),
                   ("MaxpoolingComponent", "input-x-dim=2 input-y-dim=2 input-z-dim=2 "
                    "pool-x-size=1 pool-y-size=1 pool-z-size=1 pool-x-step=1 pool-y-step=1 "
                    "pool-z-step=1")):
        text = component_from_config(t, cfg).to_text()
        doubled = f"<{t}> " + text
        back = read_component(KaldiReader(doubled.encode(), binary=False))
        assert back.to_text() == text


def test_scale_add_and_zero_touch_stats_as_kaldi():
    comp = component_from_config("GruNonlinearityComponent", "cell-dim=4")
    comp.count, comp.value_sum[...] = 2.0, 1.0
    other = comp.copy()
    comp.add(0.5, other)
    assert comp.count == 3.0 and np.all(comp.value_sum == 1.5)
    comp.scale(0.0)
    assert comp.count == 0.0 and not comp.w_h.any() and not comp.value_sum.any()


# ----------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("type_name,config,option", [
    ("LstmNonlinearityComponent", "param-stddev=1", "cell-dim"),
    ("LstmNonlinearityComponent", "cell-dim=4 self-repair-scale=0.5", "self-repair-scale"),
    ("LstmNonlinearityComponent", "cell-dim=4 use-dropout=maybe", "use-dropout"),
    ("GruNonlinearityComponent", "recurrent-dim=4", "cell-dim"),
    ("GruNonlinearityComponent", "cell-dim=4 recurrent-dim=5", "recurrent-dim"),
    ("OutputGruNonlinearityComponent", "cell-dim=0", "cell-dim"),
    ("ConvolutionComponent", "input-x-dim=4 input-y-dim=4 input-z-dim=1 filt-x-dim=2 "
     "filt-y-dim=2 filt-x-step=1 filt-y-step=1", "num-filters"),
    ("ConvolutionComponent", "input-x-dim=4 input-y-dim=4 input-z-dim=1 filt-x-dim=2 "
     "filt-y-dim=2 filt-x-step=1 filt-y-step=1 num-filters=2 input-vectorization-order=xyz",
     "input-vectorization-order"),
    ("ConvolutionComponent", "input-x-dim=5 input-y-dim=4 input-z-dim=1 filt-x-dim=2 "
     "filt-y-dim=2 filt-x-step=2 filt-y-step=1 num-filters=2", "filt-x-step"),
    ("MaxpoolingComponent", "input-x-dim=4 input-y-dim=4 input-z-dim=4 pool-x-size=2 "
     "pool-y-size=2 pool-z-size=2 pool-x-step=2 pool-y-step=2", "pool-z-step"),
    ("MaxpoolingComponent", "input-x-dim=4 input-y-dim=4 input-z-dim=4 pool-x-size=2 "
     "pool-y-size=2 pool-z-size=2 pool-x-step=2 pool-y-step=2 pool-z-step=3", "pool-z-step"),
    ("GruNonlinearityComponent", "cell-dim=4 bogus=1", "bogus"),
])
def test_config_errors(type_name, config, option):
    with pytest.raises(ConfigError) as e:
        component_from_config(type_name, config)
    assert option in str(e.value)
    assert type_name in str(e.value) or "component" in str(e.value) or option in str(e.value)


def test_config_errors_name_component():
    with pytest.raises(ConfigError, match=r"'test' \(GruNonlinearityComponent\).*recurrent-dim"):
        component_from_config("GruNonlinearityComponent", "cell-dim=4 recurrent-dim=9")


@pytest.mark.parametrize("type_name,config", [cfg for cfg in _random_configs(0)])
def test_dimension_errors(type_name, config):
    comp = component_from_config(type_name, config)
    x = np.zeros((3, comp.input_dim() + 1), np.float32)
    with pytest.raises(DimensionError, match="test"):
        run_forward(comp, x)
    x = np.zeros((3, comp.input_dim()), np.float32)
    y, memo = run_forward(comp, x)
    with pytest.raises(DimensionError):
        comp.backprop("", None, x, y, np.zeros((3, comp.output_dim() + 2), np.float32), memo,
                      None, np.zeros_like(x))


def test_bad_file_is_typed_error():
    text = component_from_config("GruNonlinearityComponent", "cell-dim=3").to_text()
    bad = text.replace("<CellDim> 3", "<CellDim> 4")
    with pytest.raises((ComponentError, ValueError), match="GruNonlinearityComponent"):
        read_component(KaldiReader(bad.encode(), binary=False))


def test_properties_flags():
    def flags(t, cfg):
        return component_from_config(t, cfg).properties()
    assert flags("LstmNonlinearityComponent", "cell-dim=2") == (
        P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT)
    assert flags("GruNonlinearityComponent", "cell-dim=2") == (
        P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
        | P.BACKPROP_NEEDS_OUTPUT | P.BACKPROP_ADDS)
    assert flags("ConvolutionComponent", "input-x-dim=2 input-y-dim=2 input-z-dim=1 "
                 "filt-x-dim=1 filt-y-dim=1 filt-x-step=1 filt-y-step=1 num-filters=1") == (
        P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
        | P.BACKPROP_ADDS | P.PROPAGATE_ADDS)
    assert flags("MaxpoolingComponent", "input-x-dim=2 input-y-dim=2 input-z-dim=2 "
                 "pool-x-size=1 pool-y-size=1 pool-z-size=1 pool-x-step=1 pool-y-step=1 "
                 "pool-z-step=1") == (
        P.SIMPLE_COMPONENT | P.BACKPROP_NEEDS_INPUT | P.BACKPROP_NEEDS_OUTPUT | P.BACKPROP_ADDS)


def test_reference_data_present():
    for t in TYPES:
        assert reference_cases(t), f"no tests/data reference case for {t}"
        assert isinstance(reference_cases(t)[0], Path)
