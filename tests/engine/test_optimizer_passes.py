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

from conftest import shared_ref
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
        for k, v in check_passes_exact(case, [CHAIN, ["optimize_memory_compression"]]).items():
            seen[k] = seen.get(k, False) or v
    assert all(seen[n] for n in SINGLE), seen


@pytest.mark.skipif(not FULL_CASES, reason=NO_FULL)
def test_each_pass_on_full_reference_set():
    for case in FULL_CASES:
        check_passes_exact(case, [CHAIN, ["optimize_memory_compression"]])


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
