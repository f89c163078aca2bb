"""engine.optimizer.gather_first: an output's row reordering moved before the row-wise
components that write it (inference computations).  Covered: the move on a batched
chunk request (same outputs, same commands, fewer peak bytes, a valid computation),
the chain through a log-softmax, what is left alone (padding rows, other readers, a
non-row-wise component), random networks of every generator with and without
derivatives against the computation as compiled, and the inference front-end's
compiles."""

from __future__ import annotations

import numpy as np
import pytest

from engine.compiler.computation import CommandType as CT
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.shortcut import compile_request
from engine.core.index import Index
from engine.inference.common import compile_for_inference
from engine.nnet.random_config import (GENERATOR_NAMES, generate_config_sequence,
                                       random_inputs, random_output_derivs, random_request)
from engine.optimizer.checker import check_computation
from engine.optimizer.gather_first import gather_before_row_wise
from engine.runtime.executor import run_computation
# networks from config text in test mode, chunk requests (input t in [-4, frames + 4),
# n-major) and the float32-rounding comparison: those of the fusion tests
from test_fuse import _nnet, _request, assert_dicts_close

# a chain model's end: spliced hidden layer, then a wide output affine (and an xent
# branch through a log-softmax)
CHAIN = """
input-node name=input dim=7
component name=h type=AffineComponent input-dim=21 output-dim=6
component name=relu type=RectifiedLinearComponent dim=6
component name=out type=NaturalGradientAffineComponent input-dim=6 output-dim=40
component name=xent type=AffineComponent input-dim=6 output-dim=30
component name=lsm type=LogSoftmaxComponent dim=30
component-node name=h component=h input=Append(Offset(input, -1), input, Offset(input, 1))
component-node name=relu component=relu input=h
component-node name=out component=out input=relu
component-node name=xent component=xent input=relu
component-node name=lsm component=lsm input=xent
output-node name=output input=out
output-node name=output-xent input=lsm
"""


def _run(nnet, comp, request, seed: int = 1):
    rng = np.random.default_rng(seed)
    inputs = random_inputs(nnet, request, rng)
    derivs = random_output_derivs(nnet, request, rng) or None
    outs, in_derivs, _ = run_computation(comp, nnet, inputs, derivs)
    return outs, in_derivs


def _moved(nnet, request):
    """(computation as compiled, the same with the gathers moved, number of moves)."""
    plain = compile_request(nnet, request, None)
    moved = compile_request(nnet, request, None)
    return plain, moved, gather_before_row_wise(moved, nnet)


def _assert_same(a: dict, b: dict, exact: bool = False) -> None:
    if not exact:
        assert_dicts_close(a, b)
        return
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_batched_outputs_reorder_the_narrow_input():
    """Three sequences of 5 frames: the output affine (6 -> 40 columns) and the xent
    branch's affine and log-softmax write n-major outputs from t-major rows; the
    reorderings move before them, onto 6-column inputs.  Same outputs (bit for bit
    here), same number of commands, fewer peak bytes, a computation the checker
    accepts, and the propagates now write the output matrices."""
    nnet = _nnet(CHAIN)
    request = _request(nnet, 5, 3, outputs=("output", "output-xent"))
    plain, moved, moves = _moved(nnet, request)
    assert moves >= 2
    check_computation(nnet, moved)
    assert moved.stats()["commands"] == plain.stats()["commands"]
    assert moved.stats()["peak_bytes"] < plain.stats()["peak_bytes"]
    got, want = _run(nnet, moved, request)[0], _run(nnet, plain, request)[0]
    _assert_same(got, want, exact=True)
    # the output matrices are written by propagates now, no longer by row copies
    subs = moved.submatrices
    outs = {subs[c.arg1].matrix_index for c in moved.commands
            if c.command_type == CT.PROVIDE_OUTPUT}
    writers = {subs[c.arg4].matrix_index for c in moved.commands
               if c.command_type == CT.PROPAGATE}
    assert outs <= writers
    # a gather reads the relu's rows for both outputs (the chain moved through the
    # log-softmax and its affine)
    assert sum(c.command_type == CT.COPY_ROWS for c in moved.commands) == \
        sum(c.command_type == CT.COPY_ROWS for c in plain.commands)


def test_one_sequence_has_nothing_to_move():
    """One sequence: t-major and n-major are one order, no reordering to move."""
    nnet = _nnet(CHAIN)
    plain, moved, moves = _moved(nnet, _request(nnet, 5, 1))
    assert moves == 0
    assert moved.stats() == plain.stats()


def test_left_alone_where_the_rows_are_not_a_function_of_their_row():
    """A reordering after a component that is not row-wise (here a non-simple one,
    StatisticsPooling-free: a TDNN over time offsets) or whose source another command
    reads stays where it is: the outputs do not change either way."""
    text = """
input-node name=input dim=4
component name=a type=AffineComponent input-dim=4 output-dim=5
component name=t type=TdnnComponent input-dim=5 output-dim=3 time-offsets=-1,0
component-node name=a component=a input=input
component-node name=t component=t input=a
output-node name=output input=t
output-node name=output-a input=a
"""
    nnet = _nnet(text)
    request = ComputationRequest(
        [IoSpecification("input", [Index(n, t, 0) for n in range(3) for t in range(-2, 6)])],
        [IoSpecification(o, [Index(n, t, 0) for n in range(3) for t in range(4)])
         for o in ("output", "output-a")])
    plain, moved, moves = _moved(nnet, request)
    check_computation(nnet, moved)
    # the TDNN is not in ROW_WISE; the affine's rows are also read by the TDNN
    assert moves == 0
    _assert_same(_run(nnet, moved, request)[0], _run(nnet, plain, request)[0], exact=True)


@pytest.mark.parametrize("deriv", [False, True])
def test_derivatives_unchanged(deriv):
    """The same request forward-only and with derivatives: whatever moves (forward only,
    the gathers do; with derivatives the compiler's backward pass names the matrices
    involved, so the conditions leave them alone), outputs and input derivatives are
    those of the computation as compiled."""
    nnet = _nnet(CHAIN)
    request = _request(nnet, 4, 2, deriv=deriv, outputs=("output", "output-xent"))
    plain, moved, moves = _moved(nnet, request)
    assert moves >= (0 if deriv else 1)
    check_computation(nnet, moved)
    o1, d1 = _run(nnet, plain, request)
    o2, d2 = _run(nnet, moved, request)
    _assert_same(o2, o1)
    _assert_same(d2, d1)


@pytest.mark.parametrize("seed", range(48))
def test_random_networks_same_results(seed):
    """Kaldi-style random networks of every generator and random requests (1-4
    sequences, derivatives half the time): the rewritten computation passes the
    checker, has the same commands count and no more peak bytes, and gives the same
    outputs and input derivatives as the computation as compiled."""
    rng = np.random.default_rng(9100 + seed)
    kind = GENERATOR_NAMES[seed % len(GENERATOR_NAMES)]
    nnet = generate_config_sequence(rng, kind=kind).build(np.random.default_rng(seed))
    nnet.set_test_mode(True)
    request = random_request(nnet, rng)
    plain, moved, moves = _moved(nnet, request)
    check_computation(nnet, moved)
    assert moved.stats()["commands"] == plain.stats()["commands"]
    assert moved.stats()["peak_bytes"] <= plain.stats()["peak_bytes"]
    o1, d1 = _run(nnet, plain, request, seed)
    o2, d2 = _run(nnet, moved, request, seed)
    _assert_same(o2, o1)
    _assert_same(d2, d1)


def test_inference_compiles_move_the_gathers():
    """compile_for_inference (the Inferencer's CachingCompiler) makes the move, through
    the shortcut for a batch of 8; compile_request alone does not (its computations are
    Kaldi's, command for command)."""
    nnet = _nnet(CHAIN)
    request = _request(nnet, 6, 8)
    kaldi = compile_request(nnet, request, None)
    ours = compile_for_inference(nnet, request)
    assert ours.stats()["peak_bytes"] < kaldi.stats()["peak_bytes"]
    _assert_same(_run(nnet, ours, request)[0], _run(nnet, kaldi, request)[0])
    unoptimized = compile_for_inference(nnet, request, optimize=False)
    assert unoptimized.stats() == compile_request(nnet, request, None,
                                                  optimize=False).stats()
