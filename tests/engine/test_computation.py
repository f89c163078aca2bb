"""The IR: command table completeness, Kaldi-identical printing, stats."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.compiler.computation import (COMMAND_SPECS, K_STRIDE_EQUAL_NUM_COLS, Access, ArgKind,
                                         Command, CommandType as CT, MatrixDebugInfo,
                                         NnetComputation, PrecomputedIndexesInfo,
                                         format_cindexes, format_indexes, format_int_vector,
                                         submatrix_accesses)
from engine.core.index import K_NO_TIME, Cindex, Index
from engine.runtime.executor import EXECUTOR_HANDLERS

DATA = Path(__file__).resolve().parents[1] / "data" / "networks_compile"


def _fake_nnet(node_names, component_names):
    return SimpleNamespace(nodes=[SimpleNamespace(name=n) for n in node_names],
                           component_names=list(component_names))


def test_every_command_type_has_spec_printer_and_handler():
    c = NnetComputation()
    s = c.new_matrix(2, 3)
    c.indexes.append([0, 1])
    c.indexes_multi.append([(s, 0), (-1, -1)])
    c.indexes_ranges.append([(0, 1), (-1, -1)])
    c.component_precomputed_indexes = [PrecomputedIndexesInfo()]
    nnet = _fake_nnet(["input"], ["comp"])
    for ct in CT:
        spec = COMMAND_SPECS[ct]
        assert callable(spec.printer), ct
        assert ct in EXECUTOR_HANDLERS, f"no executor handler for {ct.name}"
        args = []
        for slot in spec.slots:
            args.append({ArgKind.SUBMATRIX: s, ArgKind.INDEXES: 0, ArgKind.INDEXES_MULTI: 0,
                         ArgKind.INDEXES_RANGES: 0, ArgKind.COMPRESSION: 1}.get(slot.kind, 0))
        c.commands = [Command.make(ct, *args)]
        text = c.command_string(0, nnet)
        assert text.startswith("c0: ") and text.endswith("\n") and len(text) > 5, ct
    assert {ct.kaldi_name for ct in CT} >= {"kAllocMatrix", "kAddToRowsMulti", "kGotoLabel",
                                            "kNoOperationPermanent", "kBackpropNoModelUpdate"}
    assert [int(ct) for ct in CT] == list(range(25))  # Kaldi's enum values


def _case000_optimized() -> tuple[NnetComputation, SimpleNamespace]:
    """Kaldi's optimized computation for kaldi-ref case000, rebuilt by hand."""
    nnet = _fake_nnet(["input", "affine_input", "affine", "attention_input", "attention",
                       "output"], ["affine", "attention"])
    c = NnetComputation()
    c.matrix_debug_info = [MatrixDebugInfo()]
    shapes = [(14, 149), (14, 149), (12, 149), (12, 220), (16, 220), (16, 220), (10, 56),
              (10, 56)]
    for r, k in shapes:
        c.new_matrix(r, k)
    m1_part = c.new_submatrix(1, 0, 12, 0, 149)
    m5_part = c.new_submatrix(5, 4, 12, 0, 220)
    m2_part = c.new_submatrix(2, 0, 12, 0, 149)

    def idx(node, ts, n=0):
        return [Cindex(node, Index(n, t, 0)) for t in ts]
    blanks = [Cindex(3, Index(0, K_NO_TIME, 0))] * 4
    dbg = [(False, idx(0, range(-2, 12))), (True, idx(0, range(-2, 12))),
           (True, idx(1, range(-2, 10))), (True, idx(2, range(-2, 10))),
           (False, blanks + idx(3, range(-2, 10))), (True, blanks + idx(3, range(-2, 10))),
           (False, idx(4, range(0, 10))), (True, idx(5, range(0, 10)))]
    for m, (is_deriv, cindexes) in enumerate(dbg, start=1):
        c.matrix_debug_info[m] = MatrixDebugInfo(is_deriv, cindexes)
    c.component_precomputed_indexes = [PrecomputedIndexesInfo(), PrecomputedIndexesInfo("x")]
    c.indexes_ranges.append([(i, i + 1) for i in range(4, 16)])
    c.need_model_derivative = True
    add = c.add
    add(CT.ACCEPT_INPUT, 1, 0)
    add(CT.NO_OPERATION_PERMANENT)
    add(CT.ALLOC_MATRIX, 5)
    add(CT.SET_CONST, 5, alpha=0.0)
    add(CT.PROPAGATE, 0, 0, m1_part, m5_part, 0, 0)
    add(CT.ALLOC_MATRIX, 7)
    add(CT.SET_CONST, 7, alpha=0.0)
    add(CT.PROPAGATE, 1, 1, 5, 7, 0, 0)
    add(CT.PROVIDE_OUTPUT, 7, 5)
    add(CT.NO_OPERATION_MARKER)
    add(CT.ACCEPT_INPUT, 8, 5)
    add(CT.ALLOC_MATRIX, 6)
    add(CT.SET_CONST, 6, alpha=0.0)
    add(CT.BACKPROP, 1, 1, 5, 0, 8, 6, 0)
    add(CT.DEALLOC_MATRIX, 5)
    add(CT.DEALLOC_MATRIX, 8)
    add(CT.ALLOC_MATRIX, 4)
    add(CT.SET_CONST, 4, alpha=0.0)
    add(CT.ADD_ROW_RANGES, 4, 6, 0)
    add(CT.DEALLOC_MATRIX, 6)
    add(CT.ALLOC_MATRIX, 3)
    add(CT.SET_CONST, 3, alpha=0.0)
    add(CT.BACKPROP, 0, 0, m1_part, 0, 4, 3, 0)
    add(CT.DEALLOC_MATRIX, 4)
    add(CT.SWAP_MATRIX, 2, 1)
    add(CT.SET_CONST, 2, alpha=0.0)
    add(CT.MATRIX_COPY, m2_part, 3)
    add(CT.DEALLOC_MATRIX, 3)
    add(CT.NO_OPERATION_PERMANENT)
    add(CT.PROVIDE_OUTPUT, 2, 0)
    return c, nnet


def test_print_matches_kaldi_byte_for_byte():
    c, nnet = _case000_optimized()
    expected = (DATA / "case000_computation.txt").read_text()
    assert c.to_text(nnet) == expected


def test_stats_match_kaldi_reference_counting():
    c, _ = _case000_optimized()
    st = c.stats()
    # Kaldi's stats.json for case000 (optimized): 28 commands, 30400 peak bytes;
    # the two no-op-permanent commands are not counted, the marker is.
    assert st == {"commands": 28, "matrices": 8, "peak_bytes": 30400}


def test_peak_bytes_follow_swap_and_ignore_supplied_inputs():
    c = NnetComputation()
    a = c.new_matrix(10, 10)
    b = c.new_matrix(5, 2)
    c.add(CT.ACCEPT_INPUT, a, 0)          # supplied: not counted
    c.add(CT.ALLOC_MATRIX, b)              # 40 bytes
    c.add(CT.SWAP_MATRIX, a, b)            # a now holds b's (counted) memory
    c.add(CT.DEALLOC_MATRIX, a)            # frees 40
    c.add(CT.ALLOC_MATRIX, b)              # 40 again
    c.add(CT.NO_OPERATION)
    st = c.stats()
    assert st["peak_bytes"] == 40 and st["commands"] == 5 and st["matrices"] == 2


def test_int_vector_and_index_formats_are_kaldis():
    # examples taken from kaldi-ref computation.txt printouts
    assert format_int_vector([1, 7, 2, 8, 3, 9, 4, 10]) == "[1, 7, 2, 8, 3, 9, 4, 10]"
    assert format_int_vector([-1, 0, 2, 4, 6, -1, -1, 1, 3, 5, 7, -1]) == \
        "[-1, 0, 2, 4, 6, -1, -1, 1, 3, 5, 7, -1]"
    assert format_int_vector([-1, -1, -1, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]) == \
        "[-1x4, 0:11]"
    assert format_int_vector([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, -1, -1]) == "[0:11, -1, -1]"
    assert format_int_vector([5, 5]) == "[5, 5]"
    assert format_int_vector([]) == "[ ]"
    assert format_indexes([Index(1, 3, 0), Index(2, 3, 0)]) == "[(1,3), (2,3)]"
    assert format_indexes([Index(0, t, 0) for t in range(-2, 12)]) == "[(0,-2:11)]"
    assert format_indexes([Index(0, 1, 2), Index(0, 2, 2)]) == "[(0,1:2,2)]"
    long = format_indexes([Index(n, t, 0) for t in range(3, 11) for n in range(1, 5)])
    assert long.startswith("[(1,3), (2,3), (3,3), (4,3), (1,4)") and " ... " in long
    assert len(long) == 205 and long.endswith("(1,10), (2,10), (3,10), (4,10)]")
    assert format_cindexes([Cindex(0, Index(0, 0, 0)), Cindex(1, Index(0, 0, 0))],
                           ["a", "b"]) == "a[(0,0)]b[(0,0)]"


def test_long_commands_are_elided_like_kaldi():
    c = NnetComputation()
    big = c.new_matrix(200, 3)
    dest = c.new_matrix(200, 3)
    c.indexes_multi.append([(big, i) for i in range(200)])
    c.add(CT.COPY_ROWS_MULTI, dest, 0)
    line = c.command_string(0)
    assert line.startswith("c0: m2.CopyRowsMulti(1, [m1(0,:),m1(1,:),")
    assert " ... " in line and line.endswith("m1(198,:),m1(199,:)])\n")
    assert len(line) == 205


def test_submatrix_accesses_come_from_the_table():
    c = NnetComputation()
    a = c.new_matrix(2, 2)
    b = c.new_matrix(2, 2)
    cmd = Command.make(CT.MATRIX_ADD, a, b)
    assert submatrix_accesses(c, cmd) == [(a, Access.READWRITE), (b, Access.READ)]
    c.indexes_multi.append([(a, 0), (b, 1), (-1, -1)])
    cmd = Command.make(CT.ADD_TO_ROWS_MULTI, b, 0)
    assert submatrix_accesses(c, cmd) == [(b, Access.READ), (a, Access.READWRITE),
                                          (b, Access.READWRITE)]


def test_submatrix_helpers():
    c = NnetComputation()
    s = c.new_matrix(4, 6, K_STRIDE_EQUAL_NUM_COLS)
    p = c.new_submatrix(s, 1, -1, 2, 3)
    q = c.new_submatrix(p, 1, 1, 1, -1)
    assert c.submatrices[q] == (1, 2, 1, 3, 2)
    assert c.is_whole_matrix(s) and not c.is_whole_matrix(p)
    assert c.whole_submatrices() == [0, s]
    assert c.submatrix_strings()[q] == "m1(2:2, 3:4)"
    with pytest.raises(ValueError):
        c.new_submatrix(s, 3, 2, 0, 1)
    d = c.copy()
    d.commands.append(Command.make(CT.NO_OPERATION))
    assert not c.commands


def test_plain_data_round_trip_and_validation():
    import json

    from engine.compiler.compiler import compile_computation
    from engine.compiler.request import ComputationRequest
    from engine.compiler.serialize import computation_from_data, computation_to_data
    from engine.core.errors import CheckError
    from engine.nnet.model_io import load_nnet
    from engine.runtime.executor import run_computation

    case = DATA / "case005"   # statistics pooling: precomputed indexes
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    comp = compile_computation(nnet, [req])
    assert any(p.data is not None for p in comp.component_precomputed_indexes)
    data = json.loads(json.dumps(computation_to_data(comp)))
    back = computation_from_data(data)
    assert back.to_text(nnet) == comp.to_text(nnet)
    import numpy as np
    arrays = np.load(case / "arrays.npz")
    a, _, _ = run_computation(comp, nnet, {"input": arrays["input.input"]})
    b, _, _ = run_computation(back, nnet, {"input": arrays["input.input"]})
    np.testing.assert_array_equal(a["output"], b["output"])
    bad = json.loads(json.dumps(data))
    bad["commands"][-1][2] = 10 ** 6
    with pytest.raises(CheckError, match="out of range"):
        computation_from_data(bad)
    bad = json.loads(json.dumps(data))
    bad["precomputed_indexes"][0]["class"] = "os:system"
    with pytest.raises(CheckError, match="not allowed"):
        computation_from_data(bad)
    with pytest.raises(CheckError):
        computation_from_data({"ir_version": 1})


def test_debug_cindexes_read_as_pairs():
    """DebugCindexes: node, n, t, x rows read as (node, Index) pairs, made only when
    read; its length and slices need no pairs."""
    import numpy as np

    from engine.compiler.computation import DebugCindexes, MatrixDebugInfo
    rows = np.array([[3, 0, 5, 0], [3, 1, 5, 0], [4, 0, K_NO_TIME, 2]], dtype=np.int64)
    d = DebugCindexes(rows)
    assert len(d) == 3 and d
    part = d[1:]
    assert type(part) is DebugCindexes and part.rows.tolist() == rows[1:].tolist()
    assert d._pairs is None
    pairs = [(3, Index(0, 5, 0)), (3, Index(1, 5, 0)), (4, Index(0, K_NO_TIME, 2))]
    assert d == pairs and list(d) == pairs and d[2] == pairs[2] and part == pairs[1:]
    assert d == DebugCindexes(rows.copy()) and d != DebugCindexes(rows[:2])
    with pytest.raises(AttributeError):
        d.append((0, Index(0, 0, 0)))
    assert MatrixDebugInfo(False, d) == MatrixDebugInfo(False, pairs)
