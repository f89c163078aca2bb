"""Statistics the components store while a computation runs, against Kaldi's
(tests/data/networks_kaldi_stored_stats), and batch-norm in training mode.

Each case was written by tests/kaldi_oracle/gen.cc for the seed in its folder name,
with a request that stores component statistics (Kaldi draws store_component_stats for
about half of its random requests): Kaldi's NnetComputer was given the network itself
to store them in, and ``model_after.txt`` is that network after the run.  All five were
made with OPTIONS 4, which leaves batch-norm in training mode (``seed0024`` has none): the
component normalises by the minibatch's own mean and variance (forward and backward) and
adds them to its statistics.  They cover what 3,000 such networks showed: batch-norm in
training mode forward only, with input derivatives, with model derivatives, with
block-dim below dim; and nonlinearities whose backprop stores output-derivative
statistics when the request asks for input derivatives but no model derivative (before
the fix, our executor gave that backprop nothing to store them in, as here; with a
network to store statistics in, it handed the updatable components' backprop that
network too, which then changed their parameters).

Checked here: outputs, input derivatives and model gradients, unoptimized and
optimized (test_compile_reference.check_case), and every numeric field of every
component after the run (test_compile_reference.check_stored_stats: parameters
unchanged, statistics as Kaldi's to float32 rounding)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.compiler.compiler import compile_computation
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.index import Index
from engine.nnet.nnet import Nnet
from engine.runtime.executor import Executor

from test_compile_reference import check_case, check_stored_stats

CASES = sorted((Path(__file__).resolve().parents[1] / "data"
                / "networks_kaldi_stored_stats").iterdir())


def _id(p: Path) -> str:
    return p.name


def test_the_cases_cover_training_mode_batch_norm_and_backprop_statistics():
    bn = [c for c in CASES if "BatchNormComponent" in (c / "configs.txt").read_text()]
    assert len(bn) >= 3
    assert any("<TestMode> F" in (c / "model.txt").read_text() for c in bn)
    assert all((c / "model_after.txt").exists() for c in CASES)


@pytest.mark.parametrize("optimize", [False, True], ids=["unoptimized", "optimized"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_numbers_match_kaldi(case, optimize):
    check_case(case, optimize=optimize)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_stored_statistics_match_kaldi(case):
    problems, compared = check_stored_stats(case)
    assert not problems, problems
    assert compared > 0


CONFIG = """
input-node name=input dim=3
component name=affine type=AffineComponent input-dim=3 output-dim=4
component-node name=affine component=affine input=input
component name=relu type=RectifiedLinearComponent dim=4
component-node name=relu component=relu input=affine
output-node name=output input=relu
"""


def test_input_derivatives_without_model_derivative_store_backprop_statistics():
    """Kaldi's NnetComputer hands a non-updatable component's backprop the network that
    stores statistics (here the one computed with), and an updatable one nothing when no
    model derivative is asked for: the ReLU gets its output-derivative statistics, the
    affine component's parameters stay as they were."""
    nnet = Nnet.from_config(CONFIG, rng=np.random.default_rng(3))
    rows = [Index(0, t, 0) for t in range(5)]
    req = ComputationRequest([IoSpecification("input", rows, has_deriv=True)],
                             [IoSpecification("output", rows, has_deriv=True)],
                             need_model_derivative=False, store_component_stats=True)
    comp = compile_computation(nnet, [req])
    affine, relu = nnet.components
    params = [p.copy() for p in affine.param_arrays()]
    rng = np.random.default_rng(0)
    ex = Executor(comp, nnet, nnet_to_store_stats=nnet)
    ex.accept_input("input", rng.standard_normal((5, 3)).astype(np.float32))
    ex.run()
    y = np.asarray(ex.get_output("output"))
    assert relu.count == 5
    np.testing.assert_allclose(relu.value_sum, y.sum(axis=0), rtol=1e-6)
    d = rng.standard_normal((5, 4)).astype(np.float32)
    ex.accept_output_deriv("output", d)
    ex.run()
    assert relu.oderiv_count == 5
    np.testing.assert_allclose(relu.oderiv_sumsq, (d.astype(np.float64) ** 2).sum(axis=0),
                               rtol=1e-6)
    for before, after in zip(params, affine.param_arrays()):
        np.testing.assert_array_equal(before, after)


def test_every_type_that_keeps_statistics_names_them():
    """``STAT_FIELDS`` is what ``zero_stats`` clears, for every component type that
    keeps statistics (those overriding zero_stats): each field set to ones is zero
    afterwards, and Component.stats() gives each as a float64 array."""
    from engine.nnet.components.base import COMPONENT_TYPES, Component  # noqa: PLC0415
    checked = []
    for name, cls in sorted(COMPONENT_TYPES.items()):
        if cls.zero_stats is Component.zero_stats:
            continue
        comp = cls()
        if hasattr(comp, "test_mode"):
            comp.test_mode = False     # batch-norm keeps its statistics in test mode
        fields = comp.STAT_FIELDS
        if name == "CompositeComponent":
            continue                   # its members' fields (tested below)
        assert fields, name
        for f in fields:
            v = getattr(comp, f)
            setattr(comp, f, np.ones(3) if isinstance(v, np.ndarray) else 1.0)
        comp.zero_stats()
        stats = comp.stats()
        assert list(stats) == list(fields)
        for f, v in stats.items():
            assert v.dtype == np.float64 and not np.any(v), (name, f)
        checked.append(name)
    assert {"RectifiedLinearComponent", "BatchNormComponent", "ClipGradientComponent",
            "BackpropTruncationComponent", "RestrictedAttentionComponent"} <= set(checked)


STATS_CONFIG = """
input-node name=input dim=3
component name=affine type=AffineComponent input-dim=3 output-dim=4
component-node name=affine component=affine input=input
component name=relu type=RectifiedLinearComponent dim=4
component-node name=relu component=relu input=affine
component name=bn type=BatchNormComponent dim=4
component-node name=bn component=bn input=relu
component name=clip type=ClipGradientComponent dim=4 clipping-threshold=0.5 norm-based-clipping=true
component-node name=clip component=clip input=bn
output-node name=output input=clip
"""


def test_component_stats_are_what_the_run_stored():
    """Executor.component_stats on a stats network made by Nnet.stats_copy: the ReLU's
    value and derivative sums and its output-derivative squares, batch-norm's (training
    mode) frame mean and uncentred variance sums, the clipping counts of the backprop --
    from zero, the network computed with untouched."""
    nnet = Nnet.from_config(STATS_CONFIG, rng=np.random.default_rng(5))
    relu0 = nnet.components[1]
    relu0.count, relu0.value_sum = 7.0, np.full(4, 3.0)       # a trained model's stats
    before = {n: {k: np.copy(v) for k, v in c.stats().items()}
              for n, c in zip(nnet.component_names, nnet.components) if c.STAT_FIELDS}
    rows = [Index(0, t, 0) for t in range(6)]
    req = ComputationRequest([IoSpecification("input", rows, has_deriv=True)],
                             [IoSpecification("output", rows, has_deriv=True)],
                             store_component_stats=True)
    comp = compile_computation(nnet, [req])
    stats_nnet = nnet.stats_copy()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 3)).astype(np.float32)
    ex = Executor(comp, nnet, nnet_to_store_stats=stats_nnet)
    ex.accept_input("input", x)
    ex.run()
    d = rng.standard_normal((6, 4)).astype(np.float32)
    ex.accept_output_deriv("output", d)
    ex.run()
    stats = ex.component_stats()
    assert set(stats) == {"relu", "bn", "clip"}
    a = x.astype(np.float64) @ nnet.components[0].linear_params.T.astype(np.float64) \
        + nnet.components[0].bias_params
    r = np.maximum(a, 0)
    np.testing.assert_allclose(stats["relu"]["value_sum"], r.sum(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(stats["relu"]["deriv_sum"], (r > 0).sum(axis=0))
    assert stats["relu"]["count"] == 6 and stats["relu"]["oderiv_count"] == 6
    assert stats["bn"]["count"] == 6
    np.testing.assert_allclose(stats["bn"]["stats_sum"], r.sum(axis=0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stats["bn"]["stats_sumsq"], (r * r).sum(axis=0), rtol=1e-4,
                               atol=1e-5)
    assert stats["clip"]["count"] == 6
    assert 0 <= stats["clip"]["num_clipped"] <= 6
    # the oderiv squares are those of the derivative reaching the ReLU's output
    assert stats["relu"]["oderiv_sumsq"].shape == (4,) and np.all(stats["relu"]["oderiv_sumsq"] >= 0)
    after = {n: c.stats() for n, c in zip(nnet.component_names, nnet.components) if c.STAT_FIELDS}
    for n, fields in before.items():
        for k, v in fields.items():
            np.testing.assert_array_equal(after[n][k], v)
    # without a stats network there is nothing to report
    assert Executor(comp, nnet).component_stats() == {}
