"""The executor: row kernels against naive loops, I/O protocol, memos, goto,
buffer pool, error messages naming the command."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine.compiler.compiler import compile_computation
from engine.compiler.computation import CommandType as CT, NnetComputation, PrecomputedIndexesInfo
from engine.compiler.request import ComputationRequest
from engine.core.errors import ExecutionError
from engine.nnet.components.base import Component, ComponentProperty as P
from engine.runtime import kernels as K
from engine.runtime.backend import BufferPool, get_backend
from engine.runtime.executor import Executor, run_computation

LOCAL = Path(__file__).resolve().parents[1] / "data" / "networks_compile"
RNG = np.random.default_rng(0)


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# -- kernels vs naive loops --------------------------------------------------------------------


def test_copy_and_add_rows():
    src = _rand(5, 3)
    idx = [4, -1, 0, 0, 2, -1]
    dest = _rand(6, 3)
    want = dest.copy()
    for i, j in enumerate(idx):
        want[i] = 0.5 * src[j] if j >= 0 else 0
    K.copy_rows(np, dest, src, K.make_row_plan(np, idx), 0.5)
    np.testing.assert_allclose(dest, want, rtol=1e-6)
    dest2 = _rand(6, 3)
    want2 = dest2.copy()
    for i, j in enumerate(idx):
        if j >= 0:
            want2[i] += 2.0 * src[j]
    K.add_rows(np, dest2, src, K.make_row_plan(np, idx), 2.0)
    np.testing.assert_allclose(dest2, want2, rtol=1e-6)
    with pytest.raises(ValueError):
        K.add_rows(np, dest2, src[:2], K.make_row_plan(np, idx), 1.0)



@pytest.mark.parametrize("idx,period", [
    ([0, 1, 2] * 4, 3),            # a per-sequence row of a t-major batch of 3
    ([0] * 5, 1),                  # one row for every row (batch 1)
    ([0, 1, 0, 1, 0], 0),          # not a whole number of periods
    ([0, 1, 2], 0),                # the identity (handled as such)
    ([1, 0, 1, 0], 0),             # does not start at 0
    ([0, 1, 0, 2], 0),
    ([0, 1, -1, 0, 1, -1], 0),     # -1 entries
])
def test_repeated_source_rows_are_a_broadcast_with_the_same_bits(idx, period):
    """RowPlan.period: indexes 0..k-1 over and over (an i-vector per sequence in a
    t-major batch) run as a broadcast over the destination's rows; the results are
    those of the gather form, bit for bit, on a strided destination (a column block)
    and for alpha 1 and not 1; a source of fewer than k rows is refused."""
    plan = K.make_row_plan(np, idx)
    assert plan.period == period
    gather = K.make_row_plan(np, idx)
    gather.period = 0
    src = _rand(4, 5)
    for alpha in (1.0, 0.37):
        for fn in (K.copy_rows, K.add_rows):
            base = _rand(len(idx), 9)
            a, b = base.copy(), base.copy()
            fn(np, a[:, 2:7], src, plan, alpha)
            fn(np, b[:, 2:7], src, gather, alpha)
            assert np.array_equal(a, b), (fn.__name__, alpha)
            # the columns outside the block are untouched
            assert np.array_equal(a[:, :2], base[:, :2]) and np.array_equal(a[:, 7:], base[:, 7:])
    if period > 1:
        with pytest.raises(ValueError, match="out of range"):
            K.add_rows(np, _rand(len(idx), 5), src[:period - 1], plan)

def test_multi_row_kernels():
    a, b = _rand(4, 3), _rand(3, 3)
    subs = {1: a, 2: b}
    pairs = [(1, 3), (-1, -1), (2, 0), (1, 3), (2, 2)]
    plan = K.make_multi_plan(np, pairs)
    dest = _rand(5, 3)
    want = dest.copy()
    for i, (s, r) in enumerate(pairs):
        if s >= 0:
            want[i] += 1.5 * subs[s][r]
    K.rows_multi(np, dest, plan, subs.__getitem__, 1.5, add=True)
    np.testing.assert_allclose(dest, want, rtol=1e-6)
    want_c = np.stack([subs[s][r] if s >= 0 else np.zeros(3, np.float32) for s, r in pairs])
    K.rows_multi(np, dest, plan, subs.__getitem__, 1.0, add=False)
    np.testing.assert_allclose(dest, want_c, rtol=1e-6)
    # AddToRowsMulti with a repeated destination (1, 3) must accumulate both rows
    src = _rand(5, 3)
    wa, wb = a.copy(), b.copy()
    wsubs = {1: wa, 2: wb}
    for i, (s, r) in enumerate(pairs):
        if s >= 0:
            wsubs[s][r] += src[i]
    K.to_rows_multi(np, src, plan, subs.__getitem__, 1.0, add=True)
    np.testing.assert_allclose(a, wa, rtol=1e-6)
    np.testing.assert_allclose(b, wb, rtol=1e-6)


def test_add_row_ranges():
    src = _rand(8, 4)
    ranges = [(0, 3), (-1, -1), (3, 4), (4, 8), (2, 2)]
    dest = _rand(5, 4)
    want = dest.astype(np.float64)
    for i, (s, e) in enumerate(ranges):
        if s >= 0:
            want[i] += -2.0 * src[s:e].astype(np.float64).sum(axis=0)
    K.add_row_ranges(np, dest, src, K.make_range_plan(np, ranges), -2.0)
    np.testing.assert_allclose(dest, want, rtol=1e-5, atol=1e-6)
    # all ranges of length <= 1 take the AddRows path
    dest2 = np.zeros((3, 4), np.float32)
    K.add_row_ranges(np, dest2, src, K.make_range_plan(np, [(5, 6), (-1, -1), (0, 1)]), 1.0)
    np.testing.assert_array_equal(dest2, np.stack([src[5], np.zeros(4, np.float32), src[0]]))


# -- hand-built computations with a fake network --------------------------------------------------


class _Doubler(Component):
    """out = 2 * in; returns a memo that backprop checks (USES_MEMO)."""

    type_name = "TestDoubler"

    def __init__(self):
        super().__init__()
        self.seen_memos = []

    def properties(self):
        return P.SIMPLE_COMPONENT | P.USES_MEMO | P.BACKPROP_NEEDS_INPUT

    def input_dim(self):
        return 3

    def output_dim(self):
        return 3

    def propagate(self, indexes, in_value, out):
        out[...] = 2 * in_value
        return ("memo", in_value.shape[0])

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo, to_update,
                 in_deriv):
        self.seen_memos.append(memo)
        in_deriv[...] = 2 * out_deriv


def _fake_nnet(components):
    names = ["input", "comp_input", "comp", "output"]
    return SimpleNamespace(
        nodes=[SimpleNamespace(name=n) for n in names], components=components,
        component_names=[f"c{i}" for i in range(len(components))],
        get_node_index=lambda n: names.index(n) if n in names else -1,
        get_node_name=lambda i: names[i])


def _doubler_computation():
    c = NnetComputation()
    x = c.new_matrix(4, 3)
    y = c.new_matrix(4, 3)
    dy = c.new_matrix(4, 3)
    dx = c.new_matrix(4, 3)
    c.component_precomputed_indexes = [PrecomputedIndexesInfo()]
    c.add(CT.ACCEPT_INPUT, x, 0)
    c.add(CT.ALLOC_MATRIX, y)
    c.add(CT.ALLOC_MATRIX, dx)
    c.add(CT.PROPAGATE, 0, 0, x, y, 7, 0)
    c.add(CT.PROVIDE_OUTPUT, y, 3)
    c.add(CT.NO_OPERATION_MARKER)
    c.add(CT.ACCEPT_INPUT, dy, 3)
    c.add(CT.BACKPROP, 0, 0, x, 0, dy, dx, 7)
    c.add(CT.DEALLOC_MATRIX, dy)
    c.add(CT.PROVIDE_OUTPUT, dx, 0)
    return c


def test_forward_backward_protocol_and_memo():
    comp = _Doubler()
    nnet = _fake_nnet([comp])
    c = _doubler_computation()
    x, dy = _rand(4, 3), _rand(4, 3)
    outs, derivs, ex = run_computation(c, nnet, {"input": x}, {"output": dy})
    np.testing.assert_allclose(outs["output"], 2 * x)
    np.testing.assert_allclose(derivs["input"], 2 * dy)
    assert comp.seen_memos == [("memo", 4)]
    assert ex.get_model_gradient() is None


def test_io_errors_name_the_node():
    nnet = _fake_nnet([_Doubler()])
    c = _doubler_computation()
    ex = Executor(c, nnet)
    with pytest.raises(ExecutionError, match="no input was given for node 'input'"):
        ex.run()
    ex = Executor(c, nnet)
    with pytest.raises(ExecutionError, match=r"expected a matrix of shape \(4, 3\)"):
        ex.accept_input("input", np.zeros((3, 3), np.float32))
    with pytest.raises(ExecutionError, match="no node named"):
        ex.accept_input("nope", np.zeros((4, 3), np.float32))
    ex.accept_input("input", np.zeros((4, 3), np.float32))
    with pytest.raises(ExecutionError, match="not expected at this point"):
        ex.get_input_deriv("input")


def test_a_failure_after_a_goto_names_the_command_and_stops_there():
    """A computation with a goto runs its dynamic program (one stretch per run, on the
    BLAS thread count parallel.ThreadChoice picks): a command that fails on the second
    pass, after the jump back, is the one named, and the program counter stays on it."""
    c = NnetComputation()
    a = c.new_matrix(3, 2)
    b = c.new_matrix(2, 2)
    c.indexes.append([0, 2])
    c.add(CT.ALLOC_MATRIX, a)            # c0
    c.add(CT.NO_OPERATION_LABEL)         # c1
    c.add(CT.ALLOC_MATRIX, b)            # c2
    c.add(CT.ADD_ROWS, b, a, 0)          # c3: a is gone on the second pass
    c.add(CT.DEALLOC_MATRIX, b)          # c4
    c.add(CT.DEALLOC_MATRIX, a)          # c5
    c.add(CT.GOTO_LABEL, 1)              # c6
    ex = Executor(c, _fake_nnet([]))
    with pytest.raises(ExecutionError, match=r"while executing c3: m2\.AddRows.*before it "
                                             r"is allocated"):
        ex.run()
    assert ex.position[0] == 3


def test_failures_name_the_command():
    c = NnetComputation()
    a = c.new_matrix(3, 2)
    b = c.new_matrix(2, 2)
    c.indexes.append([0, 5])
    c.add(CT.ALLOC_MATRIX, a)
    c.add(CT.ALLOC_MATRIX, b)
    c.add(CT.ADD_ROWS, b, a, 0)
    ex = Executor(c, _fake_nnet([]))
    with pytest.raises(ExecutionError, match=r"while executing c2: m2\.AddRows\(1, m1\[0, 5\]\)"):
        ex.run()
    c2 = NnetComputation()
    a = c2.new_matrix(3, 2)
    c2.add(CT.SET_CONST, a, alpha=1.0)
    with pytest.raises(ExecutionError, match=r"c0: m1\.set\(1\).*before it is allocated"):
        Executor(c2, _fake_nnet([])).run()


def test_goto_label_loops_over_io():
    # the shape Kaldi's FormInfiniteLoop gives a looped computation: segment 2
    # starts with its input and a label; segment 3 takes its input, swaps it into
    # segment 2's matrix and jumps back to the label.
    c = NnetComputation()
    x1, acc, x2, x3 = (c.new_matrix(2, 2) for _ in range(4))
    c.add(CT.ACCEPT_INPUT, x1, 0)
    c.add(CT.ALLOC_MATRIX, acc)
    c.add(CT.SET_CONST, acc, alpha=0.0)
    c.add(CT.MATRIX_ADD, acc, x1)
    c.add(CT.PROVIDE_OUTPUT, acc, 3)
    c.add(CT.NO_OPERATION_MARKER)
    c.add(CT.ACCEPT_INPUT, x2, 0)
    c.add(CT.NO_OPERATION_LABEL)
    c.add(CT.MATRIX_ADD, acc, x2, alpha=2.0)
    c.add(CT.PROVIDE_OUTPUT, acc, 3)
    c.add(CT.NO_OPERATION_MARKER)
    c.add(CT.ACCEPT_INPUT, x3, 0)
    c.add(CT.SWAP_MATRIX, x2, x3)
    c.add(CT.GOTO_LABEL, 7)
    ex = Executor(c, _fake_nnet([]))
    total = np.zeros((2, 2), np.float32)
    for k in range(5):
        chunk = _rand(2, 2)
        total += chunk if k == 0 else 2 * chunk
        ex.accept_input("input", chunk)
        ex.run()
        np.testing.assert_allclose(ex.get_output("output"), total, rtol=1e-6)


def test_swap_copy_and_scaled_commands():
    c = NnetComputation()
    a = c.new_matrix(2, 3)
    b = c.new_matrix(2, 3)
    part = c.new_submatrix(b, 0, 2, 1, 2)
    c.add(CT.ACCEPT_INPUT, a, 0)
    c.add(CT.SWAP_MATRIX, b, a)
    c.add(CT.MATRIX_COPY, part, part, alpha=3.0)
    c.add(CT.PROVIDE_OUTPUT, b, 3)
    ex = Executor(c, _fake_nnet([]))
    x = _rand(2, 3)
    ex.accept_input("input", x)
    ex.run()
    want = x.copy()
    want[:, 1:] *= 3
    np.testing.assert_allclose(ex.get_output("output"), want, rtol=1e-6)


def test_inputs_are_copied_and_pool_is_reused_between_runs():
    from engine.nnet.model_io import load_nnet
    case = LOCAL / "case013"
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    comp = compile_computation(nnet, [req])
    arrays = np.load(case / "arrays.npz")
    pool = BufferPool()
    x = arrays["input.input"].copy()
    x_before = x.copy()
    first, _, _ = run_computation(comp, nnet, {"input": x}, pool=pool)
    misses = pool.misses
    second, _, _ = run_computation(comp, nnet, {"input": x}, pool=pool)
    np.testing.assert_array_equal(x, x_before)  # the caller's array is never written
    np.testing.assert_array_equal(first["output"], second["output"])
    # the second run reuses every buffer except the first run's output, which
    # belongs to the caller
    assert pool.hits == misses - 1 and pool.misses == misses + 1


def test_backend_names():
    assert get_backend("numpy") is np
    with pytest.raises(ExecutionError, match="unknown backend"):
        get_backend("torch")


def test_cupy_backend_matches_numpy():
    cupy = pytest.importorskip("cupy")
    try:
        xp = get_backend("cupy")
    except ExecutionError as e:
        pytest.skip(str(e))
    from engine.nnet.model_io import load_nnet
    for name in ("case059", "case024"):
        case = LOCAL / name
        nnet = load_nnet(case / "model.txt")
        req = ComputationRequest.from_json((case / "request.json").read_bytes())
        comp = compile_computation(nnet, [req])
        arrays = np.load(case / "arrays.npz")
        inputs = {s.name: arrays[f"input.{s.name}"] for s in req.inputs}
        derivs = {s.name: arrays[f"output_deriv.{s.name}"] for s in req.outputs if s.has_deriv}
        o_np, d_np, _ = run_computation(comp, nnet, inputs, derivs)
        o_cp, d_cp, _ = run_computation(comp, nnet, inputs, derivs, backend=xp)
        for k in o_np:
            np.testing.assert_allclose(cupy.asnumpy(o_cp[k]), o_np[k], rtol=1e-3, atol=1e-4)
        for k in d_np:
            np.testing.assert_allclose(cupy.asnumpy(d_cp[k]), d_np[k], rtol=1e-3, atol=1e-4)


def test_multi_segment_computation_runs_segment_by_segment():
    from engine.compiler.request import IoSpecification
    from engine.core.index import Index
    from engine.nnet.model_io import load_nnet
    nnet = load_nnet(LOCAL / "case039" / "model.txt")  # Append(Offset(input, 3)) -> affine

    def req(t0, t1):
        return ComputationRequest(
            [IoSpecification("input", [Index(0, t, 0) for t in range(t0 + 3, t1 + 3)])],
            [IoSpecification("output", [Index(0, t, 0) for t in range(t0, t1)])])
    both = compile_computation(nnet, [req(0, 4), req(4, 8)])
    markers = [i for i, c in enumerate(both.commands) if c.command_type == CT.NO_OPERATION_MARKER]
    assert len(markers) == 2 and len(both.segments) == 3
    ex = Executor(both, nnet)
    for t0 in (0, 4):
        x = _rand(4, 24)
        ex.accept_input("input", x)
        ex.run()
        want, _, _ = run_computation(compile_computation(nnet, [req(t0, t0 + 4)]), nnet,
                                     {"input": x})
        np.testing.assert_allclose(ex.get_output("output"), want["output"], rtol=1e-5)


def test_device_copies_of_frozen_components_are_shared():
    """backend.device_component: a component whose arrays are all frozen is copied
    to a device once and shared; writeable arrays are copied for each caller; new
    arrays assigned to a frozen component make a new copy.  (A stand-in array module
    that copies with np.array plays the device.)"""
    import types  # noqa: PLC0415

    from engine.runtime.backend import device_component, is_shared_device_copy
    fake = types.ModuleType("fakegpu")
    fake.asarray = lambda a, dtype=None: np.array(a, dtype=dtype)
    case = LOCAL / "case059"
    from engine.nnet.model_io import load_nnet
    nnet = load_nnet(case / "model.txt")
    comp = next(c for c in nnet.components if c.PARAMS)
    a, b = device_component(comp, fake), device_component(comp, fake)
    assert a is not b and not is_shared_device_copy(comp, a, fake)    # writeable: private
    assert device_component(comp, np) is comp
    nnet.freeze_parameters()
    a, b = device_component(comp, fake), device_component(comp, fake)
    assert a is b and is_shared_device_copy(comp, a, fake)
    for p in comp.PARAMS:
        np.testing.assert_array_equal(getattr(a, p), getattr(comp, p))
    p0 = comp.PARAMS[0]
    new = getattr(comp, p0) + 1
    new.flags.writeable = False
    setattr(comp, p0, new)                        # new (frozen) weights: a new copy
    c = device_component(comp, fake)
    assert c is not a and is_shared_device_copy(comp, c, fake)
    np.testing.assert_array_equal(getattr(c, p0), new)


def test_out_of_memory_is_named_as_such():
    """A computation whose matrices cannot be allocated (2.4 TB here) raises an
    ExecutionError saying so and giving the peak, not a misleading 'used before it is
    allocated'."""
    from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: PLC0415
    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    nnet = Nnet.from_config(
        "input-node name=input dim=4\n"
        "component name=a type=AffineComponent input-dim=4 output-dim=20000000\n"
        "component-node name=a component=a input=input\noutput-node name=output input=a\n")
    rows = 30000
    req = ComputationRequest([IoSpecification("input", [Index(0, t, 0) for t in range(rows)])],
                             [IoSpecification("output", [Index(0, t, 0) for t in range(rows)])])
    comp = compile_request(nnet, req)
    peak = comp.stats()["peak_bytes"]
    assert peak >= rows * 20000000 * 4
    ex = Executor(comp, nnet)
    ex.accept_input("input", np.zeros((rows, 4), np.float32))
    with pytest.raises(ExecutionError, match=f"out of memory .*need {peak} bytes at their peak"):
        ex.run()


def test_max_peak_bytes_refuses_before_allocating():
    """Executor(max_peak_bytes=...): a computation whose peak is above the limit raises
    ResourceLimitError at construction; at or below it runs; the peak is computed once
    per computation and again after the computation changes."""
    from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: PLC0415
    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    from engine.core.errors import ResourceLimitError  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    from engine.runtime.executor import peak_bytes_of  # noqa: PLC0415
    nnet = Nnet.from_config(
        "input-node name=input dim=4\n"
        "component name=a type=AffineComponent input-dim=4 output-dim=6\n"
        "component-node name=a component=a input=input\noutput-node name=output input=a\n")
    req = ComputationRequest([IoSpecification("input", [Index(0, t, 0) for t in range(10)])],
                             [IoSpecification("output", [Index(0, t, 0) for t in range(10)])])
    comp = compile_request(nnet, req)
    peak = comp.peak_bytes()
    assert peak_bytes_of(comp) == peak > 0
    with pytest.raises(ResourceLimitError, match=f"needs {peak} bytes .* limit of {peak - 1}"):
        Executor(comp, nnet, max_peak_bytes=peak - 1)
    ex = Executor(comp, nnet, max_peak_bytes=peak)
    ex.accept_input("input", np.ones((10, 4), np.float32))
    ex.run()
    assert ex.get_output("output").shape == (10, 6)
    # an allocated matrix made larger in place: the cached peak follows
    m = comp.matrices[-1]
    comp.matrices[-1] = m._replace(num_rows=m.num_rows * 100)
    assert peak_bytes_of(comp) == comp.peak_bytes() > peak
