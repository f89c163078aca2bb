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
