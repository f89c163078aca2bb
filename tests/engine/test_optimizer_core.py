"""Optimizer foundation: options, analysis, checker, pipeline and the cleanup /
variable-merging passes (Kaldi's nnet-analyze, nnet-optimize, nnet-optimize-utils).

Differential backbone: every optimized computation must give the same outputs,
input derivatives and model gradients as the unoptimized one, on the Kaldi
reference networks (local subset in tests/data/networks_compile, the full set
when ../shared/kaldi-ref exists) and on random networks
(engine.nnet.random_config).  When they differ, the test re-runs with each
option switched off in turn and names the option (hence the pass) whose removal
makes the difference go away.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from engine.compiler.compiler import compile_computation
from engine.compiler.computation import Access, Command, CommandType, NnetComputation
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.errors import CheckError, ConfigError
from engine.nnet.model_io import load_nnet
from engine.optimizer import OptimizeOptions, check_computation, optimize, run_passes
from engine.optimizer.analysis import (Analyzer, ComputationAnalysis, ComputationVariables,
                                       reference_peak_bytes)
from engine.optimizer.options import INT32_MAX, INT32_MIN
from engine.optimizer.pipeline import (PASSES, PassContext, PassSpec, format_pass_table,
                                       load_pass)
from engine.optimizer.passes.allocate_from_other import remove_unnecessary_allocation
from engine.optimizer.passes.consolidate_io import consolidate_io_operations
from engine.optimizer.passes.consolidate_model_update import consolidate_model_update
from engine.optimizer.passes.initialize_undefined import (_decided_by_rectangles,
                                                          _decided_by_sweep,
                                                          remove_unnecessary_zeroing)
from engine.optimizer.passes.move_sizing_commands import move_sizing_commands
from engine.optimizer.passes.remove_no_ops import remove_no_ops
from engine.optimizer.passes.renumber import renumber_computation
from engine.optimizer.passes.variable_merging import (VariableMergingOptimizer,
                                                      variable_merging_optimization)

from refdata import shared_ref
from network_harness import run_network

CT = CommandType
LOCAL = Path(__file__).resolve().parents[1] / "data" / "networks_compile"
LOCAL_CASES = sorted(p for p in LOCAL.iterdir() if p.is_dir())


def _full_cases() -> list[Path]:
    ref = shared_ref()
    if ref is None:
        return []
    return sorted(p for p in (ref / "networks").iterdir() if (p / "request.json").exists())


FULL_CASES = _full_cases()

# the options that switch one of our passes (or a part of one) off
PASS_FLAGS = ("consolidate_model_update", "propagate_in_place", "backprop_in_place",
              "remove_assignments", "allow_left_merge", "allow_right_merge",
              "initialize_undefined", "move_sizing_commands", "allocate_from_other",
              "optimize_row_ops", "split_row_ops", "snip_row_ops", "extend_matrices",
              "convert_addition")
CHECKED = OptimizeOptions(check_after_each_pass=True)


def load_case(case: Path):
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    return nnet, req


def case_data(nnet, req, case: Path | None = None, seed: int = 0):
    """Inputs (the reference arrays when present) and random output derivatives."""
    rng = np.random.default_rng(seed)
    arrays = np.load(case / "arrays.npz") if case is not None else {}
    inputs = {}
    for s in req.inputs:
        key = f"input.{s.name}"
        inputs[s.name] = (arrays[key] if key in arrays else rng.standard_normal(
            (len(s.indexes), nnet.input_dim(s.name))).astype(np.float32))
    derivs = {s.name: rng.standard_normal((len(s.indexes), nnet.output_dim(s.name))
                                          ).astype(np.float32)
              for s in req.outputs if s.has_deriv}
    return inputs, (derivs or None)


def max_difference(a, b) -> tuple[float, str]:
    """Largest relative difference over outputs, input derivatives, model gradients."""
    worst, where = 0.0, ""
    for kind, da, db in (("output", a.outputs, b.outputs),
                         ("input-deriv", a.input_derivs, b.input_derivs),
                         ("gradient", a.model_gradient, b.model_gradient)):
        assert set(da) == set(db), (kind, sorted(da), sorted(db))
        for k in da:
            x, y = np.asarray(da[k], np.float64), np.asarray(db[k], np.float64)
            assert x.shape == y.shape, f"{kind} {k}: shape {x.shape} vs {y.shape}"
            if x.size == 0:
                continue
            err = float(np.abs(x - y).max()) / (1e-4 + float(np.abs(x).max()))
            if err > worst:
                worst, where = err, f"{kind} {k}"
    return worst, where


TOL = 1e-4


def assert_optimization_exact(nnet, req, inputs, derivs, name: str,
                              options: OptimizeOptions = CHECKED):
    """Optimized == unoptimized; on a mismatch name the option whose removal fixes it."""
    base = run_network(nnet, req, inputs, derivs)
    opt = run_network(nnet, req, inputs, derivs, optimize=options)
    err, where = max_difference(base, opt)
    if err <= TOL:
        return base, opt
    guilty = []
    for flag in PASS_FLAGS:
        if not getattr(options, flag):
            continue
        alt = run_network(nnet, req, inputs, derivs, optimize=options.replace(**{flag: False}))
        if max_difference(base, alt)[0] <= TOL:
            guilty.append(flag)
    pytest.fail(f"{name}: optimized result differs from the unoptimized one ({where}, relative "
                f"error {err:.3g}); switching off {guilty or 'no single option'} removes the "
                f"difference")


# -- options ---------------------------------------------------------------------------------------


def test_options_have_kaldi_names_and_defaults():
    o = OptimizeOptions()
    for name in ("optimize", "consolidate_model_update", "propagate_in_place",
                 "backprop_in_place", "optimize_row_ops", "split_row_ops", "extend_matrices",
                 "convert_addition", "remove_assignments", "allow_left_merge",
                 "allow_right_merge", "initialize_undefined", "move_sizing_commands",
                 "allocate_from_other", "snip_row_ops"):
        assert getattr(o, name) is True, name
    assert o.min_deriv_time == INT32_MIN and o.max_deriv_time == INT32_MAX
    assert o.max_deriv_time_relative == INT32_MAX
    assert o.memory_compression_level == 1
    assert o.optimize_looped_computation is False and o.check_after_each_pass is False
    with pytest.raises(Exception):
        o.optimize = False  # frozen


def test_cache_key_changes_with_every_result_option():
    base = OptimizeOptions()
    keys = {base.cache_key()}
    for name in OptimizeOptions.result_fields():
        v = getattr(base, name)
        new = base.replace(**{name: (not v) if isinstance(v, bool) else
                              (0 if name == "memory_compression_level" else 7)})
        keys.add(new.cache_key())
        assert f"{name}=" in new.cache_key()
    assert len(keys) == len(OptimizeOptions.result_fields()) + 1
    # the debugging switch does not change the computation, so not the key
    assert base.replace(check_after_each_pass=True).cache_key() == base.cache_key()


def test_options_validation_and_dict_round_trip():
    o = OptimizeOptions(min_deriv_time=-3, allow_left_merge=False)
    assert OptimizeOptions.from_dict(o.to_dict()) == o
    with pytest.raises(ConfigError, match="unknown optimizer option"):
        OptimizeOptions.from_dict({"optimise": True})
    with pytest.raises(ConfigError, match="expected a boolean"):
        OptimizeOptions(optimize=1)
    with pytest.raises(ConfigError, match="memory_compression_level"):
        OptimizeOptions(memory_compression_level=5)
    assert OptimizeOptions(max_deriv_time_relative=2).effective_max_deriv_time(10) == 12
    assert OptimizeOptions(max_deriv_time=4).effective_max_deriv_time(None) == 4


# -- analysis --------------------------------------------------------------------------------------


def _toy_computation() -> NnetComputation:
    c = NnetComputation()
    m1 = c.new_matrix(4, 6)
    left = c.new_submatrix(m1, 0, 4, 0, 3)
    top = c.new_submatrix(m1, 0, 2, 0, 6)
    m2 = c.new_matrix(4, 3)
    c.add(CT.ALLOC_MATRIX, m1)
    c.add(CT.ALLOC_MATRIX, m2)
    c.add(CT.SET_CONST, m1, alpha=0.0)             # c2
    c.add(CT.SET_CONST, m2, alpha=1.0)             # c3
    c.add(CT.MATRIX_COPY, left, m2)                # c4
    c.add(CT.SET_CONST, top, alpha=2.0)            # c5
    c.add(CT.DEALLOC_MATRIX, m1)
    c.add(CT.DEALLOC_MATRIX, m2)
    return c


def test_variables_split_matrices_at_submatrix_boundaries():
    c = _toy_computation()
    v = ComputationVariables(c)
    # m1 split at rows {0,2,4} and columns {0,3,6}: 4 variables; m2 one
    assert v.num_variables == 5
    assert v.variables_for_submatrix[2] == [0, 2]          # left half: both row blocks
    assert v.variables_for_submatrix[3] == [0, 1]          # top rows: both column blocks
    assert v.describe_variable(1) == "m1(0:1,3:5)"
    assert v.describe_variable(4) == "m2"
    assert v.submatrix_is_whole_matrix[1] and not v.submatrix_is_whole_matrix[2]


def test_accesses_and_analysis_queries():
    c = _toy_computation()
    a = Analyzer(None, c)
    attr = a.command_attributes[4]                          # left = m2
    assert attr.variables_written == [0, 2] and attr.variables_read == [4]
    assert attr.matrices_read == [1, 2] and attr.matrices_written == [1]  # partial write reads m1
    assert a.variable_accesses[0][0] == (2, 2) and a.variable_accesses[0][1][0] == 4
    ma = a.matrix_accesses[1]
    assert ma.allocate_command == 0 and ma.deallocate_command == 6
    an = ComputationAnalysis(c, a)
    assert an.first_access(2) == 2 and an.first_nontrivial_access(2) == 4
    assert an.last_access(4) == 4 and an.last_write_access(4) == 3
    assert an.data_invalidated_command(3, 4) == 7           # only its deallocation
    assert an.data_invalidated_command(2, 2) == 4
    assert an.first_nontrivial_matrix_access(1) == 4 and an.last_matrix_access(2) == 4


# -- checker ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", LOCAL_CASES, ids=lambda p: p.name)
def test_checker_accepts_compiled_reference_computations(case):
    nnet, req = load_case(case)
    comp = compile_computation(nnet, [req])
    check_computation(nnet, comp, check_rewrite=True)


@pytest.mark.skipif(not FULL_CASES, reason="../shared/kaldi-ref is not present (fresh clone)")
def test_checker_accepts_all_reference_computations():
    for case in FULL_CASES:
        nnet, req = load_case(case)
        check_computation(nnet, compile_computation(nnet, [req]), check_rewrite=True)


def _compiled(name="case013"):
    nnet, req = load_case(LOCAL / name)
    return nnet, req, compile_computation(nnet, [req])


def _find(comp, ct, start=0):
    return next(i for i, c in enumerate(comp.commands) if c.command_type == ct and i >= start)


def test_checker_rejects_read_before_write_naming_the_command():
    nnet, _, comp = _compiled()
    # drop the zeroing of a matrix that is then added to
    i = next(i for i, c in enumerate(comp.commands)
             if c.command_type == CT.SET_CONST and any(
                 d.command_type in (CT.MATRIX_ADD, CT.ADD_ROWS) and
                 comp.submatrices[d.arg1].matrix_index == comp.submatrices[c.arg1].matrix_index
                 for d in comp.commands))
    comp.commands[i].command_type = CT.NO_OPERATION
    with pytest.raises(CheckError, match=r"at c\d+: .*is read before it is written"):
        check_computation(nnet, comp)


def test_checker_rejects_use_after_deallocation():
    nnet, _, comp = _compiled()
    i = _find(comp, CT.DEALLOC_MATRIX)
    cmd = comp.commands.pop(i)
    comp.commands.insert(1, cmd)
    with pytest.raises(CheckError, match=r"accessed after it is destroyed \(by c1\) \(at c\d+: m\d+\.AddRows"):
        check_computation(nnet, comp)


def test_checker_rejects_dimension_mismatch_and_bad_propagate():
    nnet, _, comp = _compiled()
    prop = _find(comp, CT.PROPAGATE)
    bad = comp.copy()
    bad.commands[prop].arg4 = bad.commands[prop].arg3   # output into the input matrix
    with pytest.raises(CheckError) as e:
        check_computation(nnet, bad)
    assert f"at c{prop}: " in str(e.value) and ".Propagate(" in str(e.value)
    # a matrix copy between submatrices of different shapes
    bad = comp.copy()
    s_small = bad.new_submatrix(1, 0, 1, 0, -1)
    bad.commands.insert(prop + 1, Command.make(CT.MATRIX_COPY, 1, s_small))
    with pytest.raises(CheckError, match=r"c\d+: m1 = m1\(0:0.*dimension mismatch"):
        check_computation(nnet, bad)


def test_checker_rejects_unconsumed_memo_and_bad_goto():
    nnet, _, comp = _compiled()
    prop = _find(comp, CT.PROPAGATE)
    bad = comp.copy()
    bad.commands[prop].arg5 = 7
    with pytest.raises(CheckError, match="memo 7 is produced but never consumed"):
        check_computation(nnet, bad)
    bad = comp.copy()
    bad.commands.insert(0, Command.make(CT.GOTO_LABEL, 0))
    with pytest.raises(CheckError, match=r"c0: goto c0: goto"):
        check_computation(nnet, bad)


def test_checker_rejects_double_allocation():
    nnet, _, comp = _compiled()
    i = _find(comp, CT.ALLOC_MATRIX)
    comp.commands.insert(i + 1, Command.make(CT.ALLOC_MATRIX, comp.commands[i].arg1))
    with pytest.raises(CheckError, match=rf"c{i + 1}: m\d+ = undefined.*initialized twice"):
        check_computation(nnet, comp)


# -- pipeline -----------------------------------------------------------------------------------


def test_pass_table_lists_every_pass_and_notes_missing_ones():
    nnet, req, comp = _compiled()
    missing = PassSpec("no_such_pass", "no_such_module", lambda o, c: True)
    out, table = run_passes(comp, nnet, CHECKED, req, passes=PASSES + (missing,))
    assert [r.name for r in table] == [p.name for p in PASSES] + ["no_such_pass"]
    assert table[-1].status == "missing" and "does not exist yet" in table[-1].note
    by = {r.name: r for r in table}
    assert by["limit_derivative_times"].status == "off"
    assert by["variable_merging_optimization"].status == "ran"
    assert "no_such_pass" in format_pass_table(table)
    # the input is left alone
    assert comp.stats() == compile_computation(nnet, [req]).stats()
    assert out.stats()["commands"] < comp.stats()["commands"]
    assert optimize(comp, nnet, CHECKED, request=req).to_text(nnet) == out.to_text(nnet)


def test_check_mode_names_the_bad_pass_and_its_predecessors():
    nnet, req, comp = _compiled()

    def break_it(computation, ctx):
        computation.commands = [c for c in computation.commands
                                if c.command_type != CT.ALLOC_MATRIX]
        return True

    spec = PassSpec("break_it", "-", lambda o, c: True, function=break_it)
    passes = PASSES[:2] + (spec,) + PASSES[2:]
    with pytest.raises(CheckError, match=r"pass 'break_it'.*before it: "
                                         r"consolidate_model_update\)"):
        run_passes(comp, nnet, CHECKED, req, passes=passes)
    # without check mode the broken computation goes through unchecked
    run_passes(comp, nnet, OptimizeOptions(), req, passes=passes)


def test_optimize_false_only_consolidates_io():
    nnet, req, comp = _compiled("case024")
    out, table = run_passes(comp, nnet, OptimizeOptions(optimize=False,
                                                        memory_compression_level=0), req)
    assert [r.name for r in table if r.status == "ran"] == ["consolidate_io_operations"]
    assert out.stats() == comp.stats()


def test_consolidate_io_operations_reorders_only_what_is_out_of_place():
    """Within each marker-separated segment, inputs go first and outputs last, the
    rest keeping its order (a plain stable partition gives the same commands); a
    computation already in that form is left as it is, with the same segments."""
    from engine.compiler.compiler import consolidate_io_operations as consolidate

    def partition(types):
        out, seg, segments = [], [], []
        for t in types + ["|"]:
            if t != "|":
                seg.append(t)
                continue
            first = len(out)
            out += [x for x in seg if x[0] == "A"] + [x for x in seg if x[0] not in "AP"] \
                + [x for x in seg if x[0] == "P"]
            segments.append((first, len(out)))
            out.append("|")
            seg = []
        return out[:-1], segments
    kind = {"A": CT.ACCEPT_INPUT, "P": CT.PROVIDE_OUTPUT, "|": CT.NO_OPERATION_MARKER,
            "x": CT.NO_OPERATION}
    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(1, 14))
        types = ["|" if k == 4 else f"{'AxxP'[int(k)]}{i}"
                 for i, k in enumerate(rng.integers(0, 5, n))]
        if trial % 3 == 0:               # already in place
            types, _ = partition(types)
        comp = NnetComputation()
        comp.commands = [Command.make(kind[t[0]]) for t in types]
        for c, t in zip(comp.commands, types):
            c.alpha = float(t[1:]) if t != "|" else 1.0
        expect, segments = partition(types)
        before = list(comp.commands)
        consolidate(comp)
        got = ["|" if c.command_type == CT.NO_OPERATION_MARKER else
               "AxxP"[[CT.ACCEPT_INPUT, CT.NO_OPERATION, CT.NO_OPERATION,
                       CT.PROVIDE_OUTPUT].index(c.command_type)] + str(int(c.alpha))
               for c in comp.commands]
        assert got == expect and comp.segments == segments, types
        if expect == types:
            assert comp.commands == before


# -- each pass, on small pieces --------------------------------------------------------------------


def test_remove_no_ops_and_renumber():
    nnet, req, comp = _compiled()
    n = len(comp.commands)
    comp.commands.insert(3, Command.make(CT.NO_OPERATION))
    assert remove_no_ops(comp) and len(comp.commands) == n
    assert not remove_no_ops(comp)
    # an unused matrix, a duplicate submatrix and an unused index list disappear
    extra = comp.new_matrix(3, 3)
    dup = comp.new_submatrix(1, 0, -1, 0, -1)
    comp.indexes.append([0, 0])
    rows = _find(comp, CT.ADD_ROWS) if any(c.command_type == CT.ADD_ROWS
                                           for c in comp.commands) else None
    alloc = _find(comp, CT.ALLOC_MATRIX)
    comp.commands[alloc].arg1 = comp.commands[alloc].arg1   # untouched
    first_use = next(c for c in comp.commands if c.arg1 == 1 and c.command_type == CT.ACCEPT_INPUT)
    first_use.arg1 = dup
    before = (len(comp.matrices), len(comp.submatrices), len(comp.indexes))
    assert renumber_computation(comp)
    assert len(comp.matrices) == before[0] - 1 and len(comp.submatrices) <= before[1] - 2
    assert len(comp.indexes) == before[2] - 1
    assert first_use.arg1 == 1 and extra not in [c.arg1 for c in comp.commands]
    check_computation(nnet, comp)
    assert rows is None or comp.commands[rows].arg3 < len(comp.indexes)


def test_move_sizing_commands_and_allocate_from_other_lower_the_peak():
    nnet, req, comp = _compiled("case024")
    ctx = PassContext(nnet, OptimizeOptions(), req)
    peak0 = comp.stats()["peak_bytes"]
    assert move_sizing_commands(comp, ctx)
    check_computation(nnet, comp)
    peak1 = comp.stats()["peak_bytes"]
    assert peak1 < peak0
    # allocations now come just before first use, deallocations just after last use
    a = Analyzer(nnet, comp)
    for m in range(1, len(comp.matrices)):
        ma = a.matrix_accesses[m]
        if comp.commands[ma.allocate_command].command_type == CT.ALLOC_MATRIX and ma.accesses:
            between = range(ma.allocate_command + 1, ma.accesses[0][0])
            assert all(comp.commands[k].command_type in (CT.ALLOC_MATRIX, CT.SET_CONST)
                       for k in between)
    ctx.invalidate()
    n_alloc = sum(c.command_type == CT.ALLOC_MATRIX for c in comp.commands)
    assert remove_unnecessary_allocation(comp, ctx)
    assert any(c.command_type == CT.SWAP_MATRIX for c in comp.commands)
    check_computation(nnet, comp)
    # what it saves is allocator calls; the peak in Kaldi's convention (stats()) can
    # rise, since a supplied input whose memory is reused is no longer subtracted
    # when it would have been freed
    assert sum(c.command_type == CT.ALLOC_MATRIX for c in comp.commands) < n_alloc


def test_remove_unnecessary_zeroing_keeps_needed_zeroing():
    nnet, req, comp = _compiled("case005")
    ctx = PassContext(nnet, OptimizeOptions(), req)
    zeros = sum(c.command_type == CT.SET_CONST for c in comp.commands)
    assert remove_unnecessary_zeroing(comp, ctx)
    left = sum(c.command_type == CT.SET_CONST for c in comp.commands)
    # the matrices filled by AddRows / += keep their zeroing, the others lose it
    assert 0 < left < zeros
    check_computation(nnet, comp)


def test_variable_merging_merges_in_place_and_assignments():
    nnet, req, comp = _compiled("case024")
    ctx = PassContext(nnet, OptimizeOptions(), req)
    n_mat = len(comp.matrices)
    assert variable_merging_optimization(comp, ctx)
    check_computation(nnet, comp)
    assert len(comp.matrices) < n_mat
    # switched off entirely, nothing merges
    nnet, req, comp = _compiled("case024")
    off = OptimizeOptions(allow_left_merge=False, allow_right_merge=False)
    assert not variable_merging_optimization(comp, PassContext(nnet, off, req))


@functools.lru_cache(maxsize=1)
def _pipeline_cases():
    """(nnet, request, unoptimized computation) for the local reference cases and
    a few random networks, both as requested and with every derivative."""
    from engine.nnet.random_config import (GENERATOR_NAMES, GenerationOptions,
                                           generate_config_sequence, random_request)
    out = []
    for case in LOCAL_CASES:
        nnet, req = load_case(case)
        out.append((nnet, req))
    for k, kind in enumerate(GENERATOR_NAMES):
        rng = np.random.default_rng(500 + k)
        nnet = generate_config_sequence(rng, kind=kind).build(rng)
        out.append((nnet, random_request(nnet, rng)))
    # as in test_random_networks; seed 10109 merges a submatrix in the second round
    # whose first-round stand-in is no longer used at the end
    for seed in range(10100, 10112):
        rng = np.random.default_rng(seed)
        nnet = generate_config_sequence(rng, GenerationOptions(dim_scale=0.3)).build(rng)
        out.append((nnet, random_request(nnet, rng)))
    full = [(nnet, ComputationRequest(
        [IoSpecification(s.name, s.indexes, True) for s in req.inputs],
        [IoSpecification(s.name, s.indexes, True) for s in req.outputs],
        need_model_derivative=True)) for nnet, req in out]
    return tuple((nnet, req, compile_computation(nnet, [req])) for nnet, req in out + full)


def _analysis_view(a: Analyzer):
    return ([sorted(x) for x in a.command_accesses],
            [(ma.allocate_command, ma.deallocate_command, ma.is_input, ma.is_output,
              ma.accesses) for ma in a.matrix_accesses],
            [sorted(e) for e in a.entries], a.submatrix_matrix, a.submatrix_whole,
            a.submatrix_rect)


def test_analysis_kept_up_to_date_by_passes_equals_a_fresh_one():
    """A pass that hands the next pass an analysis it updated instead of a new
    one (variable merging: reanalyze, renumbered, remove_commands) must hand on
    what a new analysis of its result says."""
    kept = 0
    for nnet, req, comp in _pipeline_cases():
        c = comp.copy()
        # (with remove_unnecessary_zeroing next, variable merging hands that pass its
        # decisions instead: test_zeroing_decided_by_variable_merging)
        ctx = PassContext(nnet, OptimizeOptions(initialize_undefined=False), req)
        for spec in PASSES:
            if not spec.gate(ctx.options, ctx):
                continue
            ctx._updated = False
            changed = load_pass(spec)[0](c, ctx)
            if changed and ctx._updated:
                assert _analysis_view(ctx.analyzer(c)) == _analysis_view(Analyzer(nnet, c))
                kept += 1
            elif changed:
                ctx.invalidate()
    assert kept > 10


def test_zeroing_decided_by_variable_merging():
    """Variable merging decides remove_unnecessary_zeroing's zeroings on its analysis
    before deleting its no-ops and renumbering; the pass then gives what it gives
    deciding on a new analysis of the computation it gets."""
    handed = 0
    for nnet, req, comp in _pipeline_cases():
        texts = []
        for hand_on in (True, False):
            c = comp.copy()
            ctx = PassContext(nnet, OptimizeOptions(), req)
            for spec in PASSES:
                if not spec.gate(ctx.options, ctx):
                    continue
                if spec.name == "remove_unnecessary_zeroing":
                    if ctx.zeroings is not None:
                        handed += hand_on
                    if not hand_on:
                        ctx.zeroings = None
                        ctx.invalidate()
                ctx._updated = False
                if load_pass(spec)[0](c, ctx) and not ctx._updated:
                    ctx.invalidate()
            texts.append(c.to_text(nnet))
        assert texts[0] == texts[1]
    assert handed > 10


def test_matrix_accesses_are_made_right_from_the_entries():
    """MatrixAccesses.accesses, made from the matrix's entries when first read, is
    Kaldi's list: each command that touches the matrix once, in order, with all
    it does there (a write to part of the matrix counting as read-write)."""
    for nnet, _, comp in _pipeline_cases():
        a = Analyzer(nnet, comp)
        expected: list[list] = [[] for _ in comp.matrices]
        for ci, lst in enumerate(a.command_accesses):
            bits: dict[int, int] = {}
            for s, acc in lst:
                m = comp.submatrices[s].matrix_index
                if acc == 2 and not comp.is_whole_matrix(s):
                    acc = 3
                bits[m] = bits.get(m, 0) | acc
            for m, b in bits.items():
                expected[m].append((ci, Access(b)))
        assert [ma.accesses for ma in a.matrix_accesses] == expected


def test_computation_copy_copies_every_command_field():
    """NnetComputation.copy (which optimize() starts from) copies each command
    slot by slot without the constructor: every dataclass field, new objects."""
    import dataclasses
    names = [f.name for f in dataclasses.fields(Command)]
    for _, _, comp in _pipeline_cases()[:3]:
        c = comp.copy()
        assert len(c.commands) == len(comp.commands)
        for a, b in zip(c.commands, comp.commands):
            assert a is not b and type(a) is Command
            assert [getattr(a, n) for n in names] == [getattr(b, n) for n in names]
        c.commands[0].arg1 += 1
        assert c.commands[0] != comp.commands[0]


def test_optimize_leaves_the_input_debug_info_alone():
    """NnetComputation.copy shares the debug-info entries; the passes that change
    them (extend_matrices, limit_derivative_times) replace them instead, so the
    computation given to optimize() keeps its own."""
    changed = {"extend_matrices": 0, "limit_derivative_times": 0}
    for nnet, req, comp in _pipeline_cases():
        before = [(d.is_deriv, list(d.cindexes)) for d in comp.matrix_debug_info]
        for options in (OptimizeOptions(), OptimizeOptions(min_deriv_time=0, max_deriv_time=2)):
            for r in run_passes(comp, nnet, options, req)[1]:
                if r.name in changed:
                    changed[r.name] += r.changed
        assert [(d.is_deriv, list(d.cindexes)) for d in comp.matrix_debug_info] == before
    assert all(changed.values()), changed


def test_optimize_in_place_equals_the_copy():
    """optimize(..., in_place=True) edits and returns the computation it is given,
    which ends up as the copy optimize() returns would (same serialized form,
    same alphas), under the default options and with deriv-time limits."""
    from engine.compiler.serialize import computation_to_data

    def data(c):
        return computation_to_data(c), [cmd.alpha for cmd in c.commands]

    for nnet, req, comp in _pipeline_cases():
        for options in (OptimizeOptions(), OptimizeOptions(min_deriv_time=0, max_deriv_time=2)):
            expected = data(optimize(comp, nnet, options, request=req))
            mine = comp.copy()
            assert optimize(mine, nnet, options, request=req, in_place=True) is mine
            assert data(mine) == expected


def test_per_matrix_variable_accesses_agree_with_the_variables():
    """Analyzer.variable_accesses_of (the grid of a matrix's own accesses) gives the
    same access lists as Kaldi's variables of that matrix."""
    names = [p.name for p in PASSES]
    checked = 0
    for nnet, req, comp in _pipeline_cases():
        for stop in ("variable_merging_optimization", "remove_unnecessary_zeroing"):
            c = run_passes(comp, nnet, OptimizeOptions(), req,
                           passes=PASSES[:names.index(stop)])[0]
            a = Analyzer(nnet, c)
            for m in range(1, len(c.matrices)):
                ours = {tuple(x) for x in a.variable_accesses_of(m)}
                ref = {tuple(a.variable_accesses[v]) for v in a.variables.variables_for_matrix(m)
                       if a.variable_accesses[v]}
                assert ours == ref
                checked += 1
    assert checked > 100


def _zeroing_needed_by_variables(a: Analyzer, m: int) -> bool:
    """Kaldi's test for one matrix: a variable whose second access is not a plain
    write, or an output variable that only the zeroing touches."""
    is_output = a.matrix_accesses[m].is_output
    return any((len(acc) > 1 and acc[1][1] != 2) or (len(acc) == 1 and is_output)
               for acc in a.variable_access_bits_of(m))


def test_zeroing_sweep_agrees_with_the_variables():
    """remove_unnecessary_zeroing decides most matrices by a walk over the
    commands after the zeroing (on intervals, or on the rectangles accessed);
    where a walk answers, it is what the variables say."""
    decided = on_grid = 0
    names = [p.name for p in PASSES]
    for nnet, req, comp in _pipeline_cases():
        c = run_passes(comp, nnet, OptimizeOptions(), req,
                       passes=PASSES[:names.index("remove_unnecessary_zeroing")])[0]
        a = Analyzer(nnet, c)
        for m in range(1, len(c.matrices)):
            ma = a.matrix_accesses[m]
            if not ma.accesses:
                continue
            first = c.commands[ma.accesses[0][0]]
            if not (first.command_type == CommandType.SET_CONST and first.alpha == 0.0):
                continue
            mi = c.matrices[m]
            ents = a.entries[m]
            quick = _decided_by_sweep(ents, mi.num_rows, mi.num_cols, ma.is_output)
            if quick is not None:
                assert quick == _zeroing_needed_by_variables(a, m)
                decided += 1
            if len(ents) > 1:
                grid = _decided_by_rectangles(ents, mi.num_rows, mi.num_cols, ma.is_output)
                if grid is not None:
                    assert grid == _zeroing_needed_by_variables(a, m)
                    on_grid += 1
    assert decided > 100 and on_grid > 100
    # made-up accesses of a 4 x 6 matrix zeroed by c0 (bits: 1 read, 2 write)
    whole = (0, 4, 0, 6)
    cases = [
        ([(0, 2, whole)], False, False),
        ([(0, 2, whole)], True, True),
        ([(0, 2, whole), (1, 2, whole), (2, 1, (0, 4, 0, 3))], False, False),
        # one command writing everything and reading part: reads the zeros
        ([(0, 2, whole), (1, 2, whole), (1, 1, (0, 4, 0, 3))], False, True),
        ([(0, 2, whole), (1, 2, (0, 4, 0, 3)), (2, 2, (0, 4, 3, 6)), (3, 1, whole)],
         False, False),
        ([(0, 2, whole), (1, 2, (0, 4, 0, 3)), (2, 1, whole)], False, True),
        ([(0, 2, whole), (1, 2, (0, 4, 0, 3)), (2, 1, (0, 4, 1, 2))], False, False),
        ([(0, 2, whole), (1, 2, (0, 4, 0, 3))], True, True),
        ([(0, 2, whole), (1, 2, (0, 2, 0, 6)), (2, 2, (2, 4, 0, 6)), (3, 3, whole)],
         True, False),
        # column blocks from the left, the last one's command also reading: the zeros
        # are read (and not when the read comes with a later command)
        ([(0, 2, whole), (1, 2, (0, 4, 0, 3)), (2, 2, (0, 4, 3, 6)), (2, 1, (0, 4, 4, 5))],
         False, True),
        ([(0, 2, whole), (1, 2, (0, 4, 0, 3)), (2, 2, (0, 4, 3, 6)), (2, 1, (0, 4, 0, 1))],
         False, False),
        ([(0, 2, whole), (1, 2, (0, 4, 0, 3)), (2, 2, (0, 4, 3, 6)), (3, 1, (0, 4, 4, 5))],
         False, False),
        ([(0, 2, whole), (1, 2, (0, 4, 0, 2)), (1, 2, (0, 4, 2, 6)), (2, 1, whole)],
         True, False),
        ([(0, 2, whole), (1, 2, (0, 4, 3, 6)), (2, 2, (0, 4, 0, 3)), (3, 1, whole)],
         False, False),
        ([(0, 2, whole), (1, 2, (0, 4, 0, 2)), (2, 2, (0, 4, 3, 6)), (3, 1, whole)],
         False, True),
        ([(0, 2, whole), (1, 2, (0, 2, 0, 3))], False, None),   # neither rows nor columns
        ([(0, 2, (0, 2, 0, 6)), (1, 2, whole)], False, None),   # the zeroing is partial
    ]
    for ents, is_output, expected in cases:
        got = _decided_by_sweep(ents, 4, 6, is_output)
        if expected is None:
            assert got is None or got == _needed_on_grid(ents, is_output)
        else:
            assert got == expected, ents
    # accesses in two dimensions: only the walk over the rectangles answers
    cases = [
        ([(0, 2, whole), (1, 2, (0, 2, 0, 3)), (2, 2, (2, 4, 0, 3)), (3, 2, (0, 4, 3, 6)),
          (4, 1, whole)], False, False),
        ([(0, 2, whole), (1, 2, (0, 2, 0, 3)), (2, 1, (1, 3, 0, 3))], False, True),
        ([(0, 2, whole), (1, 2, (0, 2, 0, 3)), (2, 1, (0, 2, 1, 2))], False, False),
        ([(0, 2, whole), (1, 2, (0, 2, 0, 3)), (2, 1, (0, 2, 1, 2))], True, True),
        # one command writing a block and reading part of it: reads the zeros
        ([(0, 2, whole), (1, 2, (0, 3, 0, 3)), (1, 1, (2, 3, 1, 2))], False, True),
        ([(0, 2, (0, 2, 0, 6)), (1, 2, whole)], False, None),
    ]
    for ents, is_output, expected in cases:
        assert _decided_by_sweep(ents, 4, 6, is_output) is None
        assert _decided_by_rectangles(ents, 4, 6, is_output) == expected, ents
        if expected is not None:
            assert _needed_on_grid(ents, is_output) == expected, ents


def _needed_on_grid(ents, is_output) -> bool:
    """The variables' test on the made-up accesses, cell by cell."""
    rows = sorted({r for _, _, rc in ents for r in rc[:2]})
    cols = sorted({c for _, _, rc in ents for c in rc[2:]})
    for r in rows[:-1]:
        for k in cols[:-1]:
            acc: list = []
            for c, a, (r0, r1, c0, c1) in ents:
                if r0 <= r < r1 and c0 <= k < c1:
                    if acc and acc[-1][0] == c:
                        acc[-1] = (c, acc[-1][1] | a)
                    else:
                        acc.append((c, a))
            if (len(acc) > 1 and acc[1][1] != 2) or (len(acc) == 1 and is_output):
                return True
    return False


def _merge_by_rounds(c: NnetComputation, nnet, options: OptimizeOptions) -> bool:
    """Kaldi's VariableMergingOptimization as written: a new analysis every round,
    and renumbering after every round that merged something."""
    merged = False
    while True:
        a = Analyzer(nnet, c)
        opt = VariableMergingOptimizer(options, c, a, a.props)
        if not opt.merge_variables(range(len(c.commands))):
            return merged
        merged = True
        renumber_computation(c)
        remove_no_ops(c)


def _same_computation(a: NnetComputation, b: NnetComputation) -> bool:
    def view(c):
        return ([(int(x.command_type), x.alpha, x.args) for x in c.commands], c.matrices,
                c.submatrices, c.indexes, c.indexes_multi, c.indexes_ranges)
    return view(a) == view(b)


@pytest.mark.parametrize("options", [OptimizeOptions(), OptimizeOptions(allow_left_merge=False),
                                     OptimizeOptions(allow_right_merge=False),
                                     OptimizeOptions(remove_assignments=False)],
                         ids=["default", "no-left", "no-right", "no-assignments"])
def test_incremental_variable_merging_equals_round_by_round(options):
    """The pass re-analyses only merged matrices, retries only candidates touching
    them and renumbers once; the result must be Kaldi's round-by-round one."""
    names = [p.name for p in PASSES]
    merged = 0
    for nnet, req, comp in _pipeline_cases():
        c = run_passes(comp, nnet, options, req,
                       passes=PASSES[:names.index("variable_merging_optimization")])[0]
        ref = c.copy()
        did = variable_merging_optimization(c, PassContext(nnet, options, req))
        assert did == _merge_by_rounds(ref, nnet, options)
        assert _same_computation(c, ref)
        merged += did
    assert merged > 5


def _case_with_repeated_backprop():
    for case in LOCAL_CASES + FULL_CASES:
        nnet, req = load_case(case)
        if not req.need_model_derivative:
            continue
        comp = compile_computation(nnet, [req])
        seen = [c.arg1 for c in comp.commands if c.command_type == CT.BACKPROP
                and nnet.components[c.arg1].is_updatable]
        if len(seen) != len(set(seen)):
            return case, nnet, req, comp
    return None


def test_consolidate_model_update():
    found = _case_with_repeated_backprop()
    if found is None:
        pytest.skip("no local reference case backpropagates one component twice")
    case, nnet, req, comp = found
    ctx = PassContext(nnet, OptimizeOptions(), req)
    assert consolidate_model_update(comp, ctx)
    check_computation(nnet, comp, check_rewrite=True)
    finals = [c for c in comp.commands if c.command_type == CT.BACKPROP and c.arg6 == 0]
    assert finals
    # its new allocations go first; I/O goes back to the segment edges at the end of Optimize
    consolidate_io_operations(comp)
    inputs, derivs = case_data(nnet, req, case)
    base = run_network(nnet, req, inputs, derivs)
    cons = run_network(nnet, req, inputs, derivs, computation=comp)
    assert max_difference(base, cons)[0] <= TOL


# -- the whole pipeline: reference networks --------------------------------------------------------


def _reference_stats(case: Path) -> dict:
    return json.loads((case / "stats.json").read_text())["optimized"]


@pytest.mark.parametrize("case", LOCAL_CASES, ids=lambda p: p.name)
def test_optimized_reference_networks_match_unoptimized(case):
    nnet, req = load_case(case)
    inputs, derivs = case_data(nnet, req, case)
    _, opt = assert_optimization_exact(nnet, req, inputs, derivs, case.name)
    ref = _reference_stats(case)
    ours = opt.computation.stats()
    # close to Kaldi's optimizer (the differences come from passes that are not ours)
    assert abs(ours["commands"] - ref["commands"]) <= max(3, ref["commands"] // 20), (ours, ref)
    assert reference_peak_bytes(opt.computation) <= 1.25 * ref["peak_bytes"], (ours, ref)


@pytest.mark.parametrize("flag", PASS_FLAGS)
def test_each_pass_switched_off_still_exact(flag):
    options = CHECKED.replace(**{flag: False})
    for case in LOCAL_CASES:
        nnet, req = load_case(case)
        inputs, derivs = case_data(nnet, req, case)
        assert_optimization_exact(nnet, req, inputs, derivs, f"{case.name} with {flag}=False",
                                  options)


@pytest.mark.skipif(not FULL_CASES, reason="../shared/kaldi-ref is not present (fresh clone)")
def test_optimized_full_reference_set_matches_unoptimized():
    exact = 0
    for case in FULL_CASES:
        nnet, req = load_case(case)
        inputs, derivs = case_data(nnet, req, case)
        _, opt = assert_optimization_exact(nnet, req, inputs, derivs, case.name)
        ref = _reference_stats(case)
        s = opt.computation.stats()
        exact += (s["commands"] == ref["commands"]
                  and reference_peak_bytes(opt.computation) == ref["peak_bytes"])
    # most computations come out exactly as Kaldi's optimizer makes them
    assert exact >= 0.75 * len(FULL_CASES)


# -- random networks -------------------------------------------------------------------------------


def _random_kinds():
    try:
        from engine.nnet.random_config import GENERATOR_NAMES
    except ImportError:
        return []
    return list(GENERATOR_NAMES)


@pytest.mark.parametrize("kind", _random_kinds())
def test_optimized_random_networks_match_unoptimized(kind):
    from engine.nnet.random_config import (generate_config_sequence, random_inputs,
                                           random_output_derivs, random_request)
    seed = 1000 + len(kind)
    rng = np.random.default_rng(seed)
    net = generate_config_sequence(rng, kind=kind)
    nnet = net.build(rng)
    req = random_request(nnet, rng, need_deriv=True)
    req.need_model_derivative = True   # exercises consolidate_model_update
    inputs = random_inputs(nnet, req, rng)
    derivs = random_output_derivs(nnet, req, rng)
    assert_optimization_exact(nnet, req, inputs, derivs, f"random {kind} seed {seed}")


@pytest.mark.parametrize("seed", range(6))
def test_combined_access_walks_equal_the_single_queries(seed):
    """ComputationAnalysis.first_use_at and last_access_and_write (variable merging's
    one-walk forms) answer what first_nontrivial_access/data_invalidated_command and
    last_access/last_write_access answer, for every submatrix and command."""
    from engine.nnet.random_config import (GenerationOptions, generate_config_sequence,
                                           random_request)
    rng = np.random.default_rng(700 + seed)
    nnet = generate_config_sequence(rng, GenerationOptions(dim_scale=0.3)).build(rng)
    req = random_request(nnet, rng)
    raw = compile_computation(nnet, [req])
    for c in (raw, optimize(raw, nnet, OptimizeOptions(), request=req)):
        an = ComputationAnalysis(c, Analyzer(nnet, c))
        for s in range(1, len(c.submatrices)):
            assert an.last_access_and_write(s) == (an.last_access(s),
                                                   an.last_write_access(s)), s
            first = an.first_nontrivial_access(s)
            for ci in range(len(c.commands)):
                want = an.data_invalidated_command(ci, s) if ci == first else -1
                assert an.first_use_at(s, ci) == want, (s, ci)
