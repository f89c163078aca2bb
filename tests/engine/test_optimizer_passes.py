"""Optimizer passes of nnet-optimize-utils.cc: row ops (ReplaceRowWithMatrixOps,
SnipRowOps, SplitRowOps), ExtendMatrices, ConvertAdditionToAssignment,
LimitDerivativeTimes, OptimizeMemoryCompression (+ the CuCompressedMatrix
runtime) and OptimizeLoopedComputation.

Each pass, alone and in Kaldi's order, must leave outputs, input derivatives and
model gradients as in the unoptimized run and pass the checker, on the Kaldi
reference networks (tests/data/networks_compile and tests/data/optimizer_passes,
the full set when ../shared/kaldi-ref exists) and on random networks.  The
passes that change results on purpose are checked against a model of what they
mean: derivative time limits against a run that zeroes the out-of-range rows of
every derivative matrix, compression against Kaldi's quantisation, looped
computations chunk by chunk against one computation over the whole sequence.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.compiler.compiler import CompilerOptions, compile_computation
from engine.compiler.computation import Command, CommandType, NnetComputation
from engine.compiler.request import ComputationRequest, io_spec
from engine.core.errors import CheckError, ExecutionError
from engine.nnet.components.base import ComponentProperty as P
from engine.nnet.graph import compute_simple_context
from engine.nnet.model_io import load_nnet
from engine.nnet.nnet import Nnet
from engine.optimizer import OptimizeOptions, check_computation, run_passes
from engine.optimizer.pipeline import PassContext
from engine.optimizer.passes._edit import insert_commands
from engine.optimizer.passes.convert_addition import convert_addition_to_assignment
from engine.optimizer.passes.extend_matrices import extend_matrices
from engine.optimizer.passes.limit_derivative_times import limit_derivative_times
from engine.optimizer.passes.memory_compression import optimize_memory_compression
from engine.optimizer.passes.optimize_looped import find_time_shift
from engine.optimizer.passes.optimize_row_ops import (replace_row_with_matrix_ops,
                                                      snip_row_ops, split_row_ops)
from engine.optimizer.passes.renumber import renumber_computation
from engine.runtime.compression import (CompressingExecutor, command_compressed_matrix,
                                        compress_matrix, compression_scale,
                                        decompress_matrix)
from engine.runtime.executor import Executor

from refdata import shared_ref
from network_harness import run_network

CT = CommandType
DATA = Path(__file__).resolve().parents[1] / "data"
LOCAL_CASES = sorted([p for p in (DATA / "networks_compile").iterdir() if p.is_dir()]
                     + [p for p in (DATA / "optimizer_passes").iterdir() if p.is_dir()])


def _full_cases() -> list[Path]:
    ref = shared_ref()
    if ref is None:
        return []
    return sorted(p for p in (ref / "networks").iterdir() if (p / "request.json").exists())


FULL_CASES = _full_cases()
NO_FULL = "../shared/kaldi-ref is not present (fresh clone)"


def load_case(case: Path):
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    arrays = np.load(case / "arrays.npz")
    inputs = {s.name: arrays[f"input.{s.name}"] for s in req.inputs}
    derivs = {s.name: arrays[f"output_deriv.{s.name}"] for s in req.outputs if s.has_deriv}
    return nnet, req, inputs, (derivs or None)


def results(run) -> dict[str, np.ndarray]:
    out = {f"out.{k}": v for k, v in run.outputs.items()}
    out.update({f"din.{k}": v for k, v in run.input_derivs.items()})
    out.update({f"grad.{k}": v for k, v in run.model_gradient.items()})
    return out


def assert_same(a: dict, b: dict, what: str, rtol: float = 1e-5) -> None:
    assert set(a) == set(b), (what, sorted(a), sorted(b))
    for k in a:
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        assert x.shape == y.shape, f"{what} {k}: {x.shape} vs {y.shape}"
        if x.size:
            err = float(np.abs(x - y).max())
            assert err <= rtol * (1.0 + float(np.abs(x).max())), f"{what} {k}: error {err:.3g}"


def apply_passes(names: list[str], options: OptimizeOptions = OptimizeOptions(),
                 changed: dict | None = None):
    """An ``optimize`` callable for run_network: our passes by name, in that order,
    each followed by the checker (and a renumbering after the row-op passes, as
    Kaldi's Optimize does)."""
    funcs = {"convert_addition_to_assignment": convert_addition_to_assignment,
             "snip_row_ops": snip_row_ops, "split_row_ops": split_row_ops,
             "replace_row_with_matrix_ops": replace_row_with_matrix_ops,
             "extend_matrices": extend_matrices, "limit_derivative_times": limit_derivative_times,
             "optimize_memory_compression": optimize_memory_compression}

    def run(computation, nnet, request):
        for name in names:
            ctx = PassContext(nnet, options, request)
            did = bool(funcs[name](computation, ctx))
            if changed is not None:
                changed[name] = changed.get(name, False) or did
            if did and name.endswith("row_ops"):
                renumber_computation(computation)
            try:
                check_computation(nnet, computation,
                                  check_rewrite=name in ("convert_addition_to_assignment",
                                                         "limit_derivative_times"))
            except CheckError as e:
                raise AssertionError(f"checker rejects the result of {name}: {e}") from e
        return computation
    return run


# Kaldi's order of our passes inside Optimize()
CHAIN = ["convert_addition_to_assignment", "snip_row_ops", "split_row_ops",
         "replace_row_with_matrix_ops", "extend_matrices"]
SINGLE = CHAIN + ["optimize_memory_compression"]
LEVEL2 = OptimizeOptions(memory_compression_level=2)


def check_passes_exact(case: Path, names_list) -> dict:
    nnet, req, inputs, derivs = load_case(case)
    base = results(run_network(nnet, req, inputs, derivs))
    changed: dict = {}
    for names in names_list:
        opt = run_network(nnet, req, inputs, derivs,
                          optimize=apply_passes(names, LEVEL2, changed))
        assert_same(base, results(opt), f"{case.name} after {names}")
    return changed


# -- each pass on the reference networks --------------------------------------------------------


@pytest.mark.parametrize("case", LOCAL_CASES, ids=lambda p: p.name)
def test_each_pass_and_chain_keep_results_on_reference_networks(case):
    changed = check_passes_exact(case, [[n] for n in SINGLE] + [CHAIN])
    # every reference computation is built from "+=" into zeroed matrices
    assert changed["convert_addition_to_assignment"]


def test_local_cases_exercise_every_pass():
    seen: dict = {}
    for case in LOCAL_CASES:
        nnet, req, _, _ = load_case(case)
        comp = compile_computation(nnet, [req], CompilerOptions())
        apply_passes(CHAIN + ["optimize_memory_compression"], LEVEL2, seen)(comp, nnet, req)
    assert all(seen[n] for n in SINGLE), seen


@pytest.mark.skipif(not FULL_CASES, reason=NO_FULL)
def test_each_pass_on_full_reference_set():
    for case in FULL_CASES:
        check_passes_exact(case, [CHAIN + ["optimize_memory_compression"]])


@pytest.mark.parametrize("kind", ["simple_context", "rnn", "lstm", "statistics", "attention",
                                  "cnn_new", "multi_io", "tdnnf"])
def test_passes_keep_results_on_random_networks(kind):
    from engine.nnet.random_config import (generate_config_sequence, random_inputs,
                                           random_output_derivs, random_request)
    rng = np.random.default_rng(7000 + len(kind))
    nnet = generate_config_sequence(rng, kind=kind).build(rng)
    req = random_request(nnet, rng, need_deriv=True)
    req.need_model_derivative = True
    inputs = random_inputs(nnet, req, rng)
    derivs = random_output_derivs(nnet, req, rng)
    base = results(run_network(nnet, req, inputs, derivs))
    for names in (CHAIN, ["optimize_memory_compression"]):
        opt = run_network(nnet, req, inputs, derivs, optimize=apply_passes(names, LEVEL2))
        assert_same(base, results(opt), f"random {kind} after {names}")


# -- row ops, extension, conversion on hand-made computations ---------------------------------------


def _copy_net() -> Nnet:
    return Nnet.from_config("input-node name=input dim=3\noutput-node name=output input=input\n")


def _io_computation(nin: int, nout: int):
    """m1 (input, nin x 3), m2 (output, nout x 3); commands are added by the caller
    between the input and the output."""
    c = NnetComputation()
    s_in = c.new_matrix(nin, 3)
    s_out = c.new_matrix(nout, 3)
    c.add(CT.ACCEPT_INPUT, s_in, 0)
    c.add(CT.ALLOC_MATRIX, s_out)
    c.add(CT.SET_CONST, s_out, alpha=0.0)
    return c, s_in, s_out


def _finish(c: NnetComputation, s_out: int) -> None:
    c.add(CT.PROVIDE_OUTPUT, s_out, 1)
    c.add(CT.NO_OPERATION_MARKER)


def _run_io(c: NnetComputation, nnet, x: np.ndarray) -> np.ndarray:
    ex = Executor(c, nnet)
    ex.accept_input("input", x)
    ex.run()
    return np.array(ex.get_output("output"))


def test_replace_row_ops_with_matrix_ops():
    nnet = _copy_net()
    c, s_in, s_out = _io_computation(6, 5)
    c.indexes = [[-1, 2, 3, 4, -1], [0, 2, 1, -1, -1]]
    c.add(CT.ADD_ROWS, s_out, s_in, 0, alpha=0.5)
    c.add(CT.ADD_ROWS, s_out, s_in, 1)      # not one consecutive run: stays
    _finish(c, s_out)
    x = np.arange(18, dtype=np.float32).reshape(6, 3)
    before = _run_io(c, nnet, x)
    assert replace_row_with_matrix_ops(c)
    cmd = c.commands[3]
    assert cmd.command_type == CT.MATRIX_ADD and cmd.alpha == 0.5
    assert c.submatrices[cmd.arg1][1:3] == (1, 3) and c.submatrices[cmd.arg2][1:3] == (2, 3)
    assert c.commands[4].command_type == CT.ADD_ROWS
    check_computation(nnet, c)
    np.testing.assert_array_equal(_run_io(c, nnet, x), before)


def test_snip_row_ops_cuts_add_type_commands_only():
    nnet = _copy_net()
    c, s_in, s_out = _io_computation(4, 5)
    c.indexes = [[-1, 3, -1, 0, -1], [-1, 1, 2, 3, -1]]
    c.indexes_ranges = [[(-1, -1), (1, 3), (-1, -1), (2, 4), (-1, -1)]]
    c.add(CT.ADD_ROWS, s_out, s_in, 0)
    c.add(CT.COPY_ROWS, s_out, s_in, 1)     # -1 means "write zero": untouched
    c.add(CT.ADD_ROW_RANGES, s_out, s_in, 0)
    _finish(c, s_out)
    x = np.arange(12, dtype=np.float32).reshape(4, 3) + 1
    before = _run_io(c, nnet, x)
    assert snip_row_ops(c)
    add, copy, ranges = c.commands[3:6]
    assert c.indexes[add.arg3] == [3, -1, 0]
    assert c.submatrices[add.arg1][1:3] == (1, 3)
    assert copy.arg1 == s_out and c.indexes[copy.arg3] == [-1, 1, 2, 3, -1]
    assert c.indexes_ranges[ranges.arg3] == [(1, 3), (-1, -1), (2, 4)]
    check_computation(nnet, c)
    np.testing.assert_array_equal(_run_io(c, nnet, x), before)
    assert not snip_row_ops(c)   # idempotent


def test_split_row_ops_turns_multi_commands_into_single_source_ones():
    nnet = _copy_net()
    c, s_in, s_out = _io_computation(6, 5)
    s_tmp = c.new_matrix(4, 3)
    c.commands.insert(1, Command.make(CT.ALLOC_MATRIX, s_tmp))
    c.add(CT.MATRIX_COPY, s_tmp, c.new_submatrix(s_in, 0, 4, 0, 3))
    # two runs: consecutive rows of m1, then scattered rows of m3
    c.indexes_multi = [[(s_in, 2), (s_in, 3), (s_tmp, 3), (s_tmp, 1), (s_tmp, 2)],
                       [(s_tmp, 0), (s_tmp, 2), (s_tmp, 1), (s_tmp, 3), (s_tmp, 0)],
                       [(s_tmp, 3), (s_tmp, 1), (s_tmp, 2), (s_tmp, 0), (s_in, 5)]]
    c.add(CT.ADD_ROWS_MULTI, s_out, 0, alpha=2.0)
    c.add(CT.ADD_ROWS_MULTI, s_out, 1)
    c.add(CT.ADD_TO_ROWS_MULTI, c.new_submatrix(s_out, 0, 5, 0, 3), 2, alpha=-1.0)
    c.add(CT.DEALLOC_MATRIX, s_tmp)
    _finish(c, s_out)
    x = np.arange(18, dtype=np.float32).reshape(6, 3) * 0.25
    before = _run_io(c, nnet, x)
    assert split_row_ops(c)
    types = [cmd.command_type for cmd in c.commands]
    # the first command became a matrix add (m1 rows 2..3) and a kAddRows from m3
    k = types.index(CT.MATRIX_ADD)
    assert types[k + 1] == CT.ADD_ROWS and c.commands[k].alpha == 2.0
    assert c.indexes[c.commands[k + 1].arg3] == [2, 0, 1]
    # the second stays (the range of rows used is fine but it revisits row 0: kAddRows)
    assert types.count(CT.ADD_ROWS_MULTI) == 0
    # kAddToRowsMulti with scattered rows became a kAddRows with the inverted map
    inv = [cmd for cmd in c.commands if cmd.command_type == CT.ADD_ROWS and cmd.alpha == -1.0]
    assert len(inv) == 1 and c.indexes[inv[0].arg3] == [3, 1, 2, 0]
    check_computation(nnet, c)
    np.testing.assert_allclose(_run_io(c, nnet, x), before, rtol=1e-6)


def test_split_row_ops_leaves_copy_to_rows_multi_with_gaps():
    c, s_in, s_out = _io_computation(6, 5)
    c.indexes_multi = [[(s_out, 0), (s_out, 2)]]
    c.add(CT.COPY_TO_ROWS_MULTI, c.new_submatrix(s_in, 0, 2, 0, 3), 0)
    _finish(c, s_out)
    assert not split_row_ops(c)


def test_extend_matrices_grows_destination_to_whole_source():
    nnet = _copy_net()
    c, s_in, s_out = _io_computation(10, 9)
    s_mid = c.new_matrix(9, 3)
    c.add(CT.ALLOC_MATRIX, s_mid)
    c.add(CT.SET_CONST, s_mid, alpha=0.0)
    c.add(CT.MATRIX_COPY, s_mid, c.new_submatrix(s_in, 0, 9, 0, 3))
    c.add(CT.MATRIX_ADD, s_out, s_mid)
    c.add(CT.DEALLOC_MATRIX, s_mid)
    _finish(c, s_out)
    from engine.compiler.computation import MatrixDebugInfo
    from engine.core.index import Cindex, Index
    c.matrix_debug_info = [MatrixDebugInfo()] + [
        MatrixDebugInfo(False, [Cindex(0, Index(0, t, 0)) for t in range(m.num_rows)])
        for m in c.matrices[1:]]
    x = np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32)
    before = _run_io(c, nnet, x)
    assert extend_matrices(c)
    m_mid = 3
    assert c.matrices[m_mid].num_rows == 10
    copy = next(cmd for cmd in c.commands if cmd.command_type == CT.MATRIX_COPY)
    assert c.is_whole_matrix(copy.arg1) and c.is_whole_matrix(copy.arg2)
    assert c.matrix_debug_info[m_mid].cindexes[9].index.t == -(2 ** 31)   # kNoTime
    check_computation(nnet, c)
    np.testing.assert_array_equal(_run_io(c, nnet, x), before)


def test_extend_matrices_needs_eighty_percent_and_no_io():
    c, s_in, s_out = _io_computation(10, 7)
    c.add(CT.MATRIX_COPY, s_out, c.new_submatrix(s_in, 0, 7, 0, 3))   # output: never grown
    _finish(c, s_out)
    assert not extend_matrices(c)
    c2, s_in, s_out = _io_computation(10, 7)
    s_mid = c2.new_matrix(7, 3)
    c2.add(CT.ALLOC_MATRIX, s_mid)
    c2.add(CT.MATRIX_COPY, s_mid, c2.new_submatrix(s_in, 0, 7, 0, 3))   # 70% < 80%
    _finish(c2, s_out)
    assert not extend_matrices(c2)


def test_convert_addition_only_for_first_write():
    nnet = _copy_net()
    c, s_in, s_out = _io_computation(4, 4)
    c.add(CT.MATRIX_ADD, s_out, s_in, alpha=3.0)      # first write after zeroing: copy
    c.add(CT.MATRIX_ADD, s_out, s_in)                 # adds to it: stays
    s_t = c.new_matrix(4, 3)
    c.indexes_multi = [[(s_t, 3), (s_t, 1), (s_t, 0), (s_t, 2)]]
    c.add(CT.ALLOC_MATRIX, s_t)
    c.add(CT.SET_CONST, s_t, alpha=0.0)
    c.add(CT.ADD_TO_ROWS_MULTI, s_in, 0, alpha=2.0)  # alpha != 1: no CopyToRowsMulti
    c.add(CT.MATRIX_ADD, s_out, s_t)
    c.add(CT.DEALLOC_MATRIX, s_t)
    _finish(c, s_out)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    before = _run_io(c, nnet, x)
    assert convert_addition_to_assignment(c, PassContext(nnet, OptimizeOptions()))
    assert [cmd.command_type for cmd in c.commands[3:5]] == [CT.MATRIX_COPY, CT.MATRIX_ADD]
    assert c.commands[7].command_type == CT.ADD_TO_ROWS_MULTI
    check_computation(nnet, c, check_rewrite=True)
    np.testing.assert_array_equal(_run_io(c, nnet, x), before)


def test_insert_commands_keeps_order_and_fixes_goto():
    c = NnetComputation()
    c.commands = [Command.make(CT.NO_OPERATION_PERMANENT), Command.make(CT.NO_OPERATION_LABEL),
                  Command.make(CT.NO_OPERATION), Command.make(CT.GOTO_LABEL, 1)]
    insert_commands([(1, Command.make(CT.NO_OPERATION_MARKER)),
                     (0, Command.make(CT.NO_OPERATION, 5)),
                     (1, Command.make(CT.NO_OPERATION, 6)),
                     (3, Command.make(CT.NO_OPERATION, 7))], c)
    types = [(cmd.command_type, cmd.arg1) for cmd in c.commands]
    assert types[:4] == [(CT.NO_OPERATION, 5), (CT.NO_OPERATION_PERMANENT, -1),
                         (CT.NO_OPERATION_MARKER, -1), (CT.NO_OPERATION, 6)]
    assert c.commands[4].command_type == CT.NO_OPERATION_LABEL
    assert c.commands[-1].command_type == CT.GOTO_LABEL and c.commands[-1].arg1 == 4
    assert types[-2] == (CT.NO_OPERATION, 7)
    with pytest.raises(CheckError):
        insert_commands([(99, Command.make(CT.NO_OPERATION))], c)


# -- derivative time limits ----------------------------------------------------------------------------


class MaskedExecutor(Executor):
    """The meaning of min/max_deriv_time for networks of simple components: every
    derivative row whose t is outside the range is zero whenever anything reads it."""

    def __init__(self, computation, nnet, lo: int, hi: int):
        super().__init__(computation, nnet)
        self.masks = {}
        for m, d in enumerate(computation.matrix_debug_info):
            if m and d.is_deriv:
                t = np.array([ci[1][1] for ci in d.cindexes])
                out = (t < lo) | (t > hi)
                if out.any():
                    self.masks[m] = out

    def _zero(self) -> None:
        for m, mask in self.masks.items():
            if self._matrices[m] is not None:
                self._matrices[m][mask] = 0

    def _execute(self, c) -> None:
        self._zero()
        super()._execute(c)
        self._zero()

    def get_output(self, name):
        self._zero()
        return super().get_output(name)

    get_input_deriv = get_output


def run_with(ex: Executor, req, inputs, derivs) -> dict:
    for s in req.inputs:
        ex.accept_input(s.name, inputs[s.name])
    ex.run()
    out = {f"out.{s.name}": np.array(ex.get_output(s.name)) for s in req.outputs}
    for s in req.outputs:
        if s.has_deriv:
            ex.accept_output_deriv(s.name, derivs[s.name])
    ex.run()
    out.update({f"din.{s.name}": np.array(ex.get_input_deriv(s.name))
                for s in req.inputs if s.has_deriv})
    grad = ex.get_model_gradient()
    if grad is not None:
        for name, comp in zip(grad.component_names, grad.components):
            if comp.is_updatable:
                out.update({f"grad.{name}.{p}": np.array(a)
                            for p, a in zip(comp.PARAMS, comp.param_arrays())})
    return out


def _is_block(flags: list[bool]) -> bool:
    """True if the True entries are one contiguous run (or there are none)."""
    idx = np.nonzero(flags)[0]
    return idx.size == 0 or idx[-1] - idx[0] + 1 == idx.size


def _limits(req) -> tuple[int, int]:
    ts = sorted({ix[1] for o in req.outputs for ix in o.indexes})
    lo, hi = ts[0] + 1, ts[-1] - 1
    return (lo, hi) if lo <= hi else (ts[0], ts[0])


def check_deriv_limits(nnet, req, inputs, derivs, name: str, pipeline: bool = True) -> None:
    lo, hi = _limits(req)
    opts = OptimizeOptions(min_deriv_time=lo, max_deriv_time=hi)
    comp = compile_computation(nnet, [req], CompilerOptions())
    plain = run_with(Executor(comp, nnet), req, inputs, derivs)
    limited_comp = comp.copy()
    assert limit_derivative_times(limited_comp, PassContext(nnet, opts, req))
    check_computation(nnet, limited_comp, check_rewrite=True)
    limited = run_with(Executor(limited_comp, nnet), req, inputs, derivs)
    assert limited_comp.stats()["peak_bytes"] <= comp.stats()["peak_bytes"]
    # outputs never change.  Kaldi keeps, per derivative matrix, the block of rows from
    # the first to the last row with t in [lo, hi]: rows outside it are zero (rows
    # inside it with t out of range are zero too when the rows are in time order)
    for s in req.outputs:
        np.testing.assert_array_equal(limited[f"out.{s.name}"], plain[f"out.{s.name}"])
    for s in req.inputs:
        if s.has_deriv:
            t = np.array([ix[1] for ix in s.indexes])
            inside = np.nonzero((t >= lo) & (t <= hi))[0]
            block = np.zeros(len(t), bool)
            if inside.size:
                block[inside[0]:inside[-1] + 1] = True
            d = limited[f"din.{s.name}"]
            assert not d[~block].any(), f"{name}: nonzero derivative outside [{lo}, {hi}]"
    contiguous = all(
        not d.is_deriv or _is_block([lo <= ci[1][1] <= hi for ci in d.cindexes])
        for d in comp.matrix_debug_info[1:])
    if contiguous and all(c.properties() & P.SIMPLE_COMPONENT for c in nnet.components):
        manual = run_with(MaskedExecutor(comp, nnet, lo, hi), req, inputs, derivs)
        assert_same(manual, limited, f"{name} limited vs masked")
    if not pipeline:
        return
    # the rest of the optimizer keeps the limited results
    full, _ = run_passes(comp, nnet, opts.replace(check_after_each_pass=True), req)
    assert_same(limited, run_with(Executor(full, nnet), req, inputs, derivs),
                f"{name} fully optimized with limits")


def _deriv_cases() -> list[Path]:
    out = []
    for case in LOCAL_CASES:
        req = ComputationRequest.from_json((case / "request.json").read_bytes())
        if any(s.has_deriv for s in req.outputs):
            out.append(case)
    return out


@pytest.mark.parametrize("case", _deriv_cases(), ids=lambda p: p.name)
def test_deriv_time_limits_on_reference_networks(case):
    nnet, req, inputs, derivs = load_case(case)
    check_deriv_limits(nnet, req, inputs, derivs, case.name)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "simple_context", "statistics"])
def test_deriv_time_limits_on_random_networks(kind):
    from engine.nnet.random_config import (generate_config_sequence, random_inputs,
                                           random_output_derivs, random_request)
    rng = np.random.default_rng(300 + len(kind))
    nnet = generate_config_sequence(rng, kind=kind).build(rng)
    req = random_request(nnet, rng, need_deriv=True)
    req.need_model_derivative = True
    req.inputs[0].has_deriv = True
    check_deriv_limits(nnet, req, random_inputs(nnet, req, rng),
                       random_output_derivs(nnet, req, rng), f"random {kind}")


def test_deriv_time_limits_zero_the_recurrence_beyond_the_limit():
    """A recurrent chain by hand: with min_deriv_time = 4 the derivative w.r.t. the
    inputs at t < 4 vanishes, and at t >= 4 it is what backprop gives when the
    recurrence is cut there."""
    nnet = Nnet.from_config(RNN_CONFIG, rng=np.random.default_rng(3))
    ins = [(0, t, 0) for t in range(-1, 8)]
    outs = [(0, t, 0) for t in range(0, 8)]
    req = ComputationRequest([io_spec("input", ins, True)], [io_spec("output", outs, True)])
    rng = np.random.default_rng(4)
    inputs = {"input": rng.standard_normal((9, 4)).astype(np.float32)}
    derivs = {"output": rng.standard_normal((8, 6)).astype(np.float32)}
    comp = compile_computation(nnet, [req], CompilerOptions())
    c2 = comp.copy()
    limit_derivative_times(c2, PassContext(nnet, OptimizeOptions(min_deriv_time=4), req))
    d = run_with(Executor(c2, nnet), req, inputs, derivs)["din.input"]
    assert not d[:5].any() and d[5:].any()       # rows are t = -1 .. 7
    # manual: the same network with the derivative entering only at t >= 4, and the
    # recurrent input from t = 3 treated as a constant
    aff = nnet.components[nnet.get_component_index("affine")]
    w, b = np.asarray(aff.linear_params, np.float64), np.asarray(aff.bias_params, np.float64)
    x = inputs["input"].astype(np.float64)
    h = {}
    for t in range(0, 8):
        prev = h.get(t - 1, np.zeros(6))
        h[t] = np.tanh(w @ np.concatenate([x[t], x[t + 1], prev]) + b)
    dx = np.zeros_like(x)
    dh_next = np.zeros(6)
    for t in range(7, 3, -1):
        dz = (derivs["output"][t].astype(np.float64) + dh_next) * (1 - h[t] ** 2)
        g = w.T @ dz
        dx[t] += g[:4]
        dx[t + 1] += g[4:8]
        dh_next = g[8:]
    dx[:5] = 0          # t < 4 (row 4 is t = 3: cut as well)
    np.testing.assert_allclose(d, dx, rtol=1e-4, atol=1e-5)


def test_max_deriv_time_relative_uses_the_last_output_time():
    nnet, req, inputs, derivs = load_case(DATA / "networks_compile" / "case024")
    t_max = max(ix[1] for o in req.outputs for ix in o.indexes)
    comp = compile_computation(nnet, [req], CompilerOptions())
    a, b = comp.copy(), comp.copy()
    limit_derivative_times(a, PassContext(nnet, OptimizeOptions(max_deriv_time_relative=-2), req))
    limit_derivative_times(b, PassContext(nnet, OptimizeOptions(max_deriv_time=t_max - 2), req))
    assert a.to_text(nnet) == b.to_text(nnet)
    assert not limit_derivative_times(comp.copy(), PassContext(nnet, OptimizeOptions(), req))


@pytest.mark.skipif(not FULL_CASES, reason=NO_FULL)
def test_deriv_time_limits_on_full_reference_set():
    for case in FULL_CASES:
        nnet, req, inputs, derivs = load_case(case)
        if derivs is not None:
            check_deriv_limits(nnet, req, inputs, derivs, case.name, pipeline=False)


# -- memory compression ------------------------------------------------------------------------------


def test_compression_round_trip_within_quantisation_error():
    rng = np.random.default_rng(5)
    x = rng.uniform(-12, 12, size=(40, 7)).astype(np.float32)
    cm = compress_matrix(np, x, 3, 10.0)                 # int16 in [-10, 10]
    assert cm.data.dtype == np.int16 and cm.nbytes == x.size * 2
    scale = float(compression_scale(3, 10.0))
    assert scale == pytest.approx(10.0 / 32767)
    y = decompress_matrix(np, cm)
    inside = np.abs(x) <= 10
    assert np.abs(y - x)[inside].max() <= 0.5 * scale * (1 + 1e-5)
    np.testing.assert_array_equal(y[x > 10], np.float32(32767 * np.float32(scale)))
    np.testing.assert_array_equal(y[x < -10], np.float32(-32768 * np.float32(scale)))
    assert not decompress_matrix(np, compress_matrix(np, np.zeros((2, 2), np.float32), 3,
                                                     10.0)).any()   # zero stays zero
    u = compress_matrix(np, x, 4, 5.0)                   # uint16 in [0, 5]
    yu = decompress_matrix(np, u)
    assert (yu[x < 0] == 0).all()
    ok = (x >= 0) & (x <= 5)
    assert np.abs(yu - x)[ok].max() <= 0.5 * float(compression_scale(4, 5.0)) * (1 + 1e-5)
    out = np.empty_like(x)
    assert decompress_matrix(np, u, out=out) is out
    with pytest.raises(ExecutionError):
        decompress_matrix(np, u, out=np.empty((3, 3), np.float32))


def test_compression_sign_mode_wraparound_and_errors():
    x = np.array([[-1.0, 0.0, 1e-30, 3.0, 1.5, -1.5]], np.float32)
    s = compress_matrix(np, x, 2, 0.0)                   # ReLU: the sign only
    np.testing.assert_array_equal(decompress_matrix(np, s), [[0, 0, 1, 1, 1, 0]])
    w = compress_matrix(np, x, 1, 1.0, truncate=False)  # int8 without bounds check wraps
    assert w.data[0, 4] == np.int8(np.int64(190).astype(np.int8)) and w.data[0, 4] < 0
    t = compress_matrix(np, x, 1, 1.0)
    assert t.data[0, 4] == 127 and t.data[0, 5] == -128
    # NnetComputer drops the command's truncate flag: values are always clamped
    cmd = Command.make(CT.COMPRESS_MATRIX, 1, 1, 0, alpha=1.0)
    assert command_compressed_matrix(np, x, cmd).data[0, 4] == 127
    with pytest.raises(ExecutionError):
        compress_matrix(np, x, 3, 0.0)                   # 16-bit types need a range
    with pytest.raises(ExecutionError):
        compress_matrix(np, x, 1, 0.0)                   # sign mode exists for uint8 only
    with pytest.raises(ExecutionError):
        compress_matrix(np, x, 7, 1.0)


def _compression_commands(comp: NnetComputation):
    return [(i, c) for i, c in enumerate(comp.commands)
            if c.command_type in (CT.COMPRESS_MATRIX, CT.DECOMPRESS_MATRIX)]


RELU_CONFIG = """input-node name=input dim=5
component name=a1 type=AffineComponent input-dim=15 output-dim=8
component name=r1 type=RectifiedLinearComponent dim=8
component name=a2 type=AffineComponent input-dim=16 output-dim=6
component name=r2 type=RectifiedLinearComponent dim=6
component-node name=a1 component=a1 input=Append(Offset(input, -1), input, Offset(input, 1))
component-node name=r1 component=r1 input=a1
component-node name=a2 component=a2 input=Append(Offset(r1, -2), r1)
component-node name=r2 component=r2 input=a2
output-node name=output input=Append(r2, Offset(r2, 1))
"""


def _relu_case(need_model_derivative: bool):
    nnet = Nnet.from_config(RELU_CONFIG, rng=np.random.default_rng(11))
    # the output reads r2 by copies, so only r2's own backprop reads it afterwards
    # (level 1 keeps its sign); r1 is also read by a2's backprop (level 2: int16)
    ins = [(n, t, 0) for t in range(-3, 10) for n in range(2)]
    outs = [(n, t, 0) for t in range(0, 8) for n in range(2)]
    req = ComputationRequest([io_spec("input", ins, True)], [io_spec("output", outs, True)],
                             need_model_derivative=need_model_derivative)
    rng = np.random.default_rng(12)
    return (nnet, req, {"input": rng.standard_normal((26, 5)).astype(np.float32)},
            {"output": rng.standard_normal((16, 12)).astype(np.float32)})


@pytest.mark.parametrize("level,model_deriv", [(1, False), (2, True), (3, False)])
def test_memory_compression_levels(level, model_deriv):
    from engine.optimizer.analysis import Analyzer, max_memory_use
    nnet, req, inputs, derivs = _relu_case(model_deriv)
    base = results(run_network(nnet, req, inputs, derivs))
    comp = compile_computation(nnet, [req], CompilerOptions())
    opt, _ = run_passes(comp, nnet, OptimizeOptions(memory_compression_level=level,
                                                    check_after_each_pass=True), req)
    pairs = _compression_commands(opt)
    assert pairs, f"level {level}: nothing compressed"
    marker = next(i for i, c in enumerate(opt.commands)
                  if c.command_type == CT.NO_OPERATION_MARKER)
    analyzer = Analyzer(nnet, opt)
    kinds = set()
    for i, c in pairs:
        m = opt.submatrices[c.arg1].matrix_index
        touched = [ci for ci, _ in analyzer.matrix_accesses[m].accesses]
        if c.command_type == CT.COMPRESS_MATRIX:
            assert i < marker and i - 1 in touched      # right after the last forward use
            kinds.add((c.arg2, c.alpha))
        else:
            assert i > marker and i + 1 in touched      # right before the first backward use
    if level == 1:
        assert kinds == {(2, 0.0)}                      # uint8 sign of ReLU outputs
    else:
        assert (3, 10.0) in kinds                       # int16 in [-10, 10]
    plain = results(run_network(nnet, req, inputs, derivs, computation=opt))
    assert_same(base, plain, f"level {level}, compression as a no-op (Kaldi's CPU build)")
    compressed = run_with(CompressingExecutor(opt, nnet), req, inputs, derivs)
    if level == 1:
        assert_same(base, compressed, "level 1 keeps results exactly", rtol=1e-6)
    else:
        assert_same(base, compressed, f"level {level} within int16 quantisation", rtol=2e-3)
        if model_deriv:   # the affine gradients use the quantised inputs
            worst = max(float(np.abs(base[k] - compressed[k]).max()) for k in base)
            assert worst > 0, "int16 compression should change the gradients a little"
    no_compression = run_passes(comp, nnet, OptimizeOptions(memory_compression_level=0), req)[0]
    assert max_memory_use(opt) <= max_memory_use(no_compression)


def test_memory_compression_does_nothing_without_backward_or_when_off():
    nnet, req, inputs, _ = _relu_case(False)
    fwd = ComputationRequest([io_spec(s.name, s.indexes, False) for s in req.inputs],
                             [io_spec(s.name, s.indexes, False) for s in req.outputs])
    comp = compile_computation(nnet, [fwd], CompilerOptions())
    assert not optimize_memory_compression(comp, PassContext(nnet, LEVEL2, fwd))
    comp = compile_computation(nnet, [req], CompilerOptions())
    assert not optimize_memory_compression(
        comp, PassContext(nnet, OptimizeOptions(memory_compression_level=0), req))


def test_compressing_executor_rejects_unpaired_commands():
    nnet = _copy_net()
    c, s_in, s_out = _io_computation(2, 2)
    c.add(CT.MATRIX_COPY, s_out, s_in)
    c.add(CT.DECOMPRESS_MATRIX, s_out)
    _finish(c, s_out)
    ex = CompressingExecutor(c, nnet)
    ex.accept_input("input", np.ones((2, 3), np.float32))
    with pytest.raises(ExecutionError, match="was not compressed"):
        ex.run()


# -- looped computations -------------------------------------------------------------------------------

RNN_CONFIG = """input-node name=input dim=4
component name=affine type=AffineComponent input-dim=14 output-dim=6
component name=tanh type=TanhComponent dim=6
component-node name=affine component=affine input=Append(Offset(input, -1), input, IfDefined(Offset(tanh, -1)))
component-node name=tanh component=tanh input=affine
output-node name=output input=tanh
"""

# state carried over two chunks' worth of time plus right context
RNN2_CONFIG = """input-node name=input dim=3
component name=affine type=AffineComponent input-dim=14 output-dim=5
component name=relu type=RectifiedLinearComponent dim=5
component name=final type=AffineComponent input-dim=5 output-dim=2
component-node name=affine component=affine input=Append(Offset(input, -2), input, Offset(input, 1), IfDefined(Offset(relu, -2)))
component-node name=relu component=relu input=affine
component-node name=final component=final input=Sum(relu, IfDefined(Offset(relu, -3)))
output-node name=output input=final
"""


def looped_requests(nnet, chunk: int, num_segments: int, num_seq: int):
    """Kaldi's CreateLoopedComputationRequest (no i-vectors), extended to
    ``num_segments`` requests as CompileLooped does."""
    left, right = compute_simple_context(nnet)
    reqs = []
    for k in range(num_segments):
        ib = -left if k == 0 else k * chunk + right
        ie = (k + 1) * chunk + right
        ins = [(n, t, 0) for t in range(ib, ie) for n in range(num_seq)]
        outs = [(n, t, 0) for t in range(k * chunk, (k + 1) * chunk) for n in range(num_seq)]
        reqs.append(ComputationRequest([io_spec("input", ins)], [io_spec("output", outs)]))
    return reqs, left, right


def check_looped(nnet, chunk: int, num_chunks: int = 7, num_seq: int = 2,
                 options: OptimizeOptions = OptimizeOptions()) -> NnetComputation:
    reqs, left, right = looped_requests(nnet, chunk, 5, num_seq)
    comp = compile_computation(nnet, reqs, CompilerOptions())
    looped, table = run_passes(comp, nnet, options.replace(optimize_looped_computation=True,
                                                            check_after_each_pass=True), reqs)
    assert next(r for r in table if r.name == "optimize_looped_computation").changed
    assert looped.commands[-1].command_type == CT.GOTO_LABEL
    assert looped.commands[looped.commands[-1].arg1].command_type == CT.NO_OPERATION_LABEL
    assert any(c.command_type == CT.SWAP_MATRIX for c in looped.commands)
    dim = nnet.input_dim("input")
    rng = np.random.default_rng(chunk)
    T = num_chunks * chunk
    x = rng.standard_normal((left + T + right, num_seq, dim)).astype(np.float32)  # t from -left
    ex = Executor(looped, nnet)
    ys = []
    for k in range(num_chunks):
        ib = -left if k == 0 else k * chunk + right
        ex.accept_input("input", x[ib + left:(k + 1) * chunk + right + left].reshape(-1, dim))
        ex.run()
        ys.append(np.array(ex.get_output("output")))
    whole = ComputationRequest(
        [io_spec("input", [(n, t, 0) for t in range(-left, T + right) for n in range(num_seq)])],
        [io_spec("output", [(n, t, 0) for t in range(T) for n in range(num_seq)])])
    ref = run_network(nnet, whole, {"input": x.reshape(-1, dim)}, None)
    np.testing.assert_allclose(np.concatenate(ys), ref.outputs["output"], rtol=1e-5, atol=1e-6)
    return looped


def test_looped_rnn_matches_whole_sequence():
    nnet = Nnet.from_config(RNN_CONFIG, rng=np.random.default_rng(0))
    looped = check_looped(nnet, chunk=3)
    # the loop body is one segment: one output per pass round the loop
    label = looped.commands[-1].arg1
    assert sum(c.command_type == CT.PROVIDE_OUTPUT for c in looped.commands[label:]) == 1


def test_looped_state_over_several_chunks_and_without_optimization():
    nnet = Nnet.from_config(RNN2_CONFIG, rng=np.random.default_rng(1))
    check_looped(nnet, chunk=2, num_chunks=9)
    check_looped(nnet, chunk=4, num_chunks=5, num_seq=1)
    check_looped(nnet, chunk=2, num_chunks=6, options=OptimizeOptions(optimize=False))


@pytest.mark.parametrize("kind", ["lstm", "gru", "fast_lstm"])
def test_looped_random_recurrent_networks(kind):
    from engine.nnet.random_config import GenerationOptions, generate_config_sequence
    rng = np.random.default_rng(50 + len(kind))
    net = generate_config_sequence(rng, GenerationOptions(allow_ivector=False), kind=kind)
    nnet = net.build(rng)
    check_looped(nnet, chunk=nnet.modulus() * 3, num_chunks=4, num_seq=1)


def test_find_time_shift_needs_three_segments():
    nnet = Nnet.from_config(RNN_CONFIG, rng=np.random.default_rng(0))
    reqs, _, _ = looped_requests(nnet, 3, 2, 1)
    comp = compile_computation(nnet, reqs, CompilerOptions())
    with pytest.raises(CheckError, match="at least 3 segments"):
        find_time_shift(comp)
    reqs, _, _ = looped_requests(nnet, 3, 4, 1)
    assert find_time_shift(compile_computation(nnet, reqs, CompilerOptions())) == 3
