"""BLSTM model gradients against Kaldi's, self-repair off (tests/data/kaldi_blstm_gradient).

The model is tests/data/inference/blstm/model.raw (the kaldi-ref blstm) with every
self-repair scale set to 0 (tests/kaldi_oracle/self_repair_off.py): Kaldi's sigmoid and
tanh self-repair runs in backprop on a random half of the calls (RandUniform), nnetc's on
its own draws, so with it on the two sides' derivatives differ by chance (at 150 frames the
gradients were outside the tolerance); with the scale 0 neither side adds anything and the
comparison is deterministic.  The case is Kaldi's chunk request at the reference commit
(f40076610), made with tests/kaldi_oracle/genchunk: 21 frames x 1 sequence (input t in
[-2, 23), output t in [0, 21)), input and output derivatives and the model derivative,
default compiler and optimizer options.  arrays.npz: the inputs, Kaldi's output, the random
output derivative, Kaldi's input derivative and ``grad.COMPONENT.PARAM``, Kaldi's model
derivative.  When it was made, Kaldi's and nnetc's gradients were both within 7e-6 (relative
to each array's largest value) of a float64 PyTorch BLSTM on the same numbers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from engine.compiler.compiler import CompilerOptions, compile_computation
from engine.compiler.request import ComputationRequest
from engine.compiler.shortcut import compile_request
from engine.nnet.model_io import load_nnet
from engine.optimizer import OptimizeOptions, optimize
from engine.runtime.backend import to_host
from engine.runtime.executor import Executor

from test_compile_reference import _close

DATA = Path(__file__).resolve().parents[1] / "data"
CASE = DATA / "kaldi_blstm_gradient"


def _model():
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kaldi_oracle"))
    from self_repair_off import self_repair_off
    nnet = load_nnet(DATA / "inference" / "blstm" / "model.raw")
    assert len(self_repair_off(nnet)) == 10      # the five sigmoids and tanhs of each direction
    return nnet


@pytest.fixture(scope="module")
def case():
    nnet = _model()
    req = ComputationRequest.from_json((CASE / "request.json").read_bytes())
    return nnet, req, np.load(CASE / "arrays.npz")


@pytest.mark.parametrize("opt", [False, True], ids=["unoptimized", "optimized"])
def test_blstm_gradients_match_kaldi(case, opt):
    nnet, req, arrays = case
    comp = compile_computation(nnet, [req], CompilerOptions())
    if opt:
        comp = optimize(comp, nnet, OptimizeOptions(), request=req)
    ex = Executor(comp, nnet)
    ex.accept_input("input", arrays["input.input"])
    ex.run()
    _close("output", to_host(ex.get_output("output")), arrays["output.output"])
    ex.accept_output_deriv("output", arrays["output_deriv.output"])
    ex.run()
    _close("input_deriv", to_host(ex.get_input_deriv("input")), arrays["input_deriv.input"])
    grad = ex.get_model_gradient()
    checked = 0
    for name, c in zip(grad.component_names, grad.components):
        if not c.is_updatable:
            continue
        for p, a in zip(c.PARAMS, c.param_arrays()):
            ref = arrays[f"grad.{name}.{p}"]
            _close(f"gradient {name}.{p}", a, ref)
            # far tighter than the tolerance: both sides float32 on the same model
            err = float(np.max(np.abs(np.asarray(a, np.float64) - ref)))
            assert err <= 1e-4 * float(np.max(np.abs(ref))), (name, p, err)
            checked += 1
    assert checked == 28


def test_blstm_gradients_are_not_trivial(case):
    """Every gradient array varies (a zero or constant reference would pass anything)."""
    _, _, arrays = case
    grads = [k for k in arrays.files if k.startswith("grad.")]
    assert len(grads) == 28
    for k in grads:
        assert np.ptp(arrays[k]) > 1e-2, k


def test_blstm_computation_is_kaldis(case):
    nnet, req, _ = case
    comp = compile_request(nnet, req)
    ref = json.loads((CASE / "stats.json").read_text())["optimized"]
    st = comp.stats()
    assert (st["commands"], st["peak_bytes"]) == (ref["commands"], ref["peak_bytes"])
    assert comp.to_text(nnet) == gzip.decompress(
        (CASE / "computation.txt.gz").read_bytes()).decode()
    short = compile_request(nnet, req, use_shortcut=True).stats()
    ref = json.loads((CASE / "shortcut.json").read_text())
    assert (short["commands"], short["peak_bytes"]) == (ref["commands"], ref["peak_bytes"])
