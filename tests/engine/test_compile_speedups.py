"""Helpers the compiler uses for speed give exactly what the plain code gives:
engine.compiler.array_ops (column-wise reductions), graph_nodes.make_indexes
(shared Index objects, blank Indexes included), PrecomputedIndexesInfo.index_rows
(arrays kept by the compiler, dropped when the lists are replaced) and the
shortcut expander's reuse of expansions of rows that differ by a shift in t."""

from __future__ import annotations

import numpy as np

from engine.compiler.array_ops import (column_bounds, rows_all, rows_any, rows_count,
                                       rows_equal)
from engine.compiler.computation import PrecomputedIndexesInfo
from engine.compiler.graph_nodes import make_indexes
from engine.compiler.shortcut import _Expander, convert_num_n_values, find_n_stride
from engine.core.index import K_NO_TIME, Index, index_rows


def test_array_ops_match_numpy():
    rng = np.random.default_rng(0)
    for width in (0, 1, 2, 3, 5, 8, 9, 12):
        for rows in (1, 7, 300):
            a = rng.integers(-5, 5, (rows, width))
            b = rng.integers(-5, 5, (rows, width))
            m = a > 0
            if width:
                lo, hi = column_bounds(a)
                assert lo == a.min(axis=0).tolist() and hi == a.max(axis=0).tolist()
            assert np.array_equal(rows_all(m), m.all(axis=1))
            assert np.array_equal(rows_any(m), m.any(axis=1))
            assert np.array_equal(rows_count(m), m.sum(axis=1))
            assert np.array_equal(rows_equal(a, b), (a == b).all(axis=1))
            b[::2] = a[::2]
            assert np.array_equal(rows_equal(a, b), (a == b).all(axis=1))
            if width:
                assert np.array_equal(rows_equal(a, a[0]), (a == a[0]).all(axis=1))


def test_make_indexes_values_types_and_sharing():
    rng = np.random.default_rng(1)
    for trial in range(200):
        k = int(rng.integers(0, 400))
        a = np.stack([rng.integers(0, 3, k), rng.integers(-5, 20, k),
                      rng.integers(0, 2, k)], axis=1).astype(np.int64)
        if k and trial % 3:
            a[rng.random(k) < 0.2, 1] = K_NO_TIME
        if k and trial % 11 == 0:
            a[:, 1] = K_NO_TIME
        got = make_indexes(a)
        assert got == [tuple(r) for r in a.tolist()]
        assert all(type(i) is Index for i in got)
        if k >= 64:
            # equal Indexes are one object
            assert len({id(i) for i in got}) == len(set(got))


def test_precomputed_info_index_rows_follow_the_lists():
    ins = [Index(0, t, 0) for t in range(5)]
    outs = [Index(0, t, 0) for t in range(1, 4)]
    info = PrecomputedIndexesInfo(None, ins, outs)
    a, b = info.index_rows()                      # nothing kept: converted
    assert a.tolist() == [list(i) for i in ins] and b.tolist() == [list(i) for i in outs]
    kept_in, kept_out = index_rows(ins), index_rows(outs)
    info.remember_index_rows(kept_in, kept_out)
    a, b = info.index_rows()
    assert a is kept_in and b is kept_out
    # lists replaced (or grown in place): the kept arrays no longer count
    info.input_indexes = [Index(1, t, 0) for t in range(5)]
    a, b = info.index_rows()
    assert a is not kept_in and a[:, 0].tolist() == [1] * 5 and b is not kept_out
    info.remember_index_rows(index_rows(info.input_indexes), kept_out)
    info.output_indexes.append(Index(0, 9, 0))
    a, b = info.index_rows()
    assert b.tolist()[-1] == [0, 9, 0]


def test_shortcut_expansion_of_t_shifted_rows():
    """Rows that differ by one shift of every t share one expansion; the result is
    what find_n_stride + convert_num_n_values give for each."""
    exp = _Expander(None, None, None, 5, False)
    rng = np.random.default_rng(2)
    for trial in range(60):
        per = int(rng.integers(1, 5))
        ts = np.sort(rng.choice(np.arange(-6, 6), size=per, replace=False))
        x = rng.integers(0, 2, per)
        base = np.stack([np.zeros(per, np.int64), ts, x], axis=1)
        if trial % 2:
            rows = np.concatenate([base, base + [1, 0, 0]])          # stride = per
        else:
            rows = np.repeat(base, 2, axis=0)
            rows[1::2, 0] = 1                                        # stride 1
        for shift in (0, 3, -7):
            r = rows + [0, shift, 0]
            if trial % 5 == 0:
                r[0, 1] = K_NO_TIME if shift == 3 else r[0, 1]
            s = find_n_stride(r)
            if s == 0:
                continue
            want = convert_num_n_values(r, s, 2, 5)
            key, got = exp.expand_index_rows(r.copy())
            assert key == r.tobytes()
            assert np.array_equal(got, want), (trial, shift)
    assert exp._expanded_rel


def test_general_dropout_mask_rows_number_pairs_by_first_appearance():
    """GeneralDropoutComponent's mask rows (the table path for compact ranges, the
    sorting path for wide ones, the one-pair path for one sequence without time
    blocks) against a plain Python numbering of (n, t-block) pairs by first
    appearance."""
    from component_harness import component_from_config
    rng = np.random.default_rng(5)
    for cfg, period in (("dim=8 block-dim=2 time-period=5", 5), ("dim=6 block-dim=3", 0),
                        ("dim=4 time-period=1", 1)):
        comp = component_from_config("GeneralDropoutComponent", cfg)
        multiple = comp.dim // comp.block_dim
        for k, one_seq in ((1, False), (2, False), (9, False), (40, False), (300, False),
                           (2000, False), (1, True), (21, True), (300, True)):
            wide = k == 9
            hi = 2 ** 40 if wide else 30
            arr = np.stack([np.zeros(k, np.int64) if one_seq else rng.integers(0, 4, k),
                            rng.integers(-hi, hi, k), np.zeros(k, np.int64)],
                           axis=1).astype(np.int64)
            seen: dict = {}
            want = [seen.setdefault((n, t // period if period else 0), len(seen))
                    for n, t, _ in arr.tolist()]
            got = comp.precompute_index_arrays(None, arr, arr.copy(), True)
            assert got.num_mask_rows == len(seen) * multiple
            assert np.asarray(got.indexes).tolist() == np.repeat(want, multiple).tolist()


# Descriptors whose forward commands _batch_forward decides for all steps at once:
# SplitByScale pieces of one input, pieces summing several inputs of one step
# (idct-style deltas) or of distinct steps, plain sums, IfDefined, and inputs
# read at a fixed t (ReplaceIndex: present, absent inside the lookup table's
# range, and outside it), and sums of shifted inputs with an input read at a
# fixed t (an i-vector added to an affine output, as in TDNN-F; also split by
# scale, in a three-input sum, and the same node at a fixed t and shifted, which
# is left to the general path).
_SUM_PIECES = """
input-node name=input dim=4
input-node name=ivector dim=2
component name=a type=AffineComponent input-dim=4 output-dim=4
component-node name=a component=a input=input
component name=b type=AffineComponent input-dim=4 output-dim=4
component-node name=b component=b input=input
component name=c type=AffineComponent input-dim=30 output-dim=4
component-node name=c component=c input=Append(Sum(Scale(-2.0, a), Sum(Offset(b, -2), Offset(b, 2))), Sum(Scale(0.5, Sum(Offset(a, 1), Offset(a, -1))), b), Sum(Scale(2.0, input), Sum(a, Offset(b, 1))), Sum(Offset(a, -1), b), IfDefined(Offset(a, -3)), Offset(input, 1), ReplaceIndex(ivector, t, 0), IfDefined(ReplaceIndex(ivector, t, 3)), IfDefined(ReplaceIndex(ivector, t, 100)))
component name=d type=AffineComponent input-dim=8 output-dim=3
component-node name=d component=d input=Append(Sum(Scale(3.0, b), Sum(Offset(c, -1), Offset(c, 1))), Sum(Scale(-1.0, Offset(c, 2)), a))
component name=e type=AffineComponent input-dim=2 output-dim=4
component-node name=e component=e input=ivector
component name=f type=AffineComponent input-dim=20 output-dim=3
component-node name=f component=f input=Append(Sum(a, ReplaceIndex(e, t, 0)), Sum(Scale(0.5, Offset(b, 1)), ReplaceIndex(e, t, 0)), Sum(ReplaceIndex(e, t, 0), Sum(Offset(a, -1), b)), Sum(a, ReplaceIndex(a, t, 2)), Sum(IfDefined(ReplaceIndex(e, t, 3)), a))
output-node name=output input=Sum(d, f)
"""


def test_batched_forward_commands_equal_general_path(monkeypatch):
    from engine.compiler.compiler import Compiler, compile_computation
    from engine.compiler.request import ComputationRequest, IoSpecification
    from engine.compiler.serialize import computation_to_data
    from engine.nnet.nnet import Nnet

    nnet = Nnet.from_config(_SUM_PIECES, rng=np.random.default_rng(0))

    def request(num_n: int, chunk: int, deriv: bool) -> ComputationRequest:
        ins = [IoSpecification("input", [Index(n, t, 0) for t in range(-6, chunk + 6)
                                         for n in range(num_n)], deriv),
               IoSpecification("ivector", [Index(n, 0, 0) for n in range(num_n)])]
        outs = [IoSpecification("output", [Index(n, t, 0) for t in range(chunk)
                                           for n in range(num_n)], deriv)]
        return ComputationRequest(ins, outs, need_model_derivative=deriv)

    reqs = [request(n, chunk, deriv) for n in (1, 2, 3) for chunk in (1, 7)
            for deriv in (False, True)]
    batched = [computation_to_data(compile_computation(nnet, [r])) for r in reqs]
    used = []
    real = Compiler._batch_forward

    def spy(self):
        out = real(self)
        used.append(len(out))
        return out
    monkeypatch.setattr(Compiler, "_batch_forward", spy)
    again = [computation_to_data(compile_computation(nnet, [r])) for r in reqs]
    assert again == batched and all(used), "the batched parts are in use"
    monkeypatch.setattr(Compiler, "_batch_forward", lambda self: {})
    general = [computation_to_data(compile_computation(nnet, [r])) for r in reqs]
    assert general == batched


def test_usable_counts_few_ids_path_equals_array_path(monkeypatch):
    """graph_arrays updates usable counts of a few ids in plain Python
    (_add_usable_few, _drop_usable_few, which hand a wide remainder back to NumPy)
    and of more with NumPy: with either path forced throughout, or the hand-back
    forced, recurrent networks get the graph of Kaldi's per-cindex algorithm (the
    statuses and pruning depend on those counts)."""
    import engine.compiler.graph_arrays as ga
    from engine.compiler.graph import ComputationGraph, ComputationGraphBuilder
    from engine.compiler.request import ComputationRequest, IoSpecification
    from engine.nnet.random_config import (GENERATOR_NAMES, GenerationOptions,
                                           generate_config_sequence, random_request)

    def build(nnet, req, arrays: bool):
        graph = ComputationGraph()
        builder = ComputationGraphBuilder(nnet, graph)
        builder.use_arrays = arrays
        builder.compute(req)
        assert builder.all_outputs_are_computable()
        status = builder.array_status
        builder.prune()
        return graph, status

    from inference_nets import RECURRENT, make_nnet
    cases = []
    nnet = make_nnet(RECURRENT)
    for chunk, left in ((5, 0), (21, 9), (60, 30)):
        ins = [IoSpecification("input", [Index(0, t, 0) for t in range(-left - 2, chunk + 2)])]
        outs = [IoSpecification("output", [Index(0, t, 0) for t in range(chunk)])]
        cases.append((nnet, ComputationRequest(ins, outs)))
    opts = GenerationOptions(dim_scale=0.3)
    recurrent = [g for g in GENERATOR_NAMES if "lstm" in g or "gru" in g or "rnn" in g]
    for seed, kind in enumerate(recurrent * 3):
        rng = np.random.default_rng(100 + seed)
        net = generate_config_sequence(rng, opts, kind=kind).build(rng)
        cases.append((net, random_request(net, rng)))
    used = 0
    default_small, default_few_max = ga._SMALL, ga._FEW_MAX
    for nnet, req in cases:
        try:
            want, _ = build(nnet, req, False)
            _, default = build(nnet, req, True)
        except Exception:                                   # noqa: BLE001
            continue            # not computable: the array build is not asked
        for small, few_max in ((0, 0), (1 << 30, 1 << 30), (1 << 30, 2)):
            monkeypatch.setattr(ga, "_SMALL", small)
            monkeypatch.setattr(ga, "_FEW_MAX", few_max)
            got, status = build(nnet, req, True)
            monkeypatch.setattr(ga, "_SMALL", default_small)
            monkeypatch.setattr(ga, "_FEW_MAX", default_few_max)
            # the same graph, and by the array build wherever it applies by default
            assert status == default
            assert got.cindexes == want.cindexes and got.dependencies == want.dependencies
        used += default == "used"
    assert used >= 4, "the array build ran on recurrent networks"


_DIM_RANGES = """
input-node name=input dim=6
component name=a type=AffineComponent input-dim=6 output-dim=6
component-node name=a component=a input=input
dim-range-node name=all input-node=a dim-offset=0 dim=6
dim-range-node name=tail input-node=a dim-offset=2 dim=4
dim-range-node name=head input-node=a dim-offset=0 dim=3
component name=b type=AffineComponent input-dim=13 output-dim=3
component-node name=b component=b input=Append(all, tail, head)
output-node name=output input=b
"""


def test_compiler_whole_submatrices_equal_computation_scan():
    """The compiler notes each matrix's whole submatrix as it makes submatrices (a
    dim-range node covering all columns makes a later one); the computation's
    scan of all submatrices (Kaldi's GetWholeSubmatrices) gives the same."""
    from engine.compiler.compiler import Compiler
    from engine.compiler.request import ComputationRequest, IoSpecification
    from engine.nnet.nnet import Nnet

    nnet = Nnet.from_config(_DIM_RANGES, rng=np.random.default_rng(0))
    for deriv in (False, True):
        req = ComputationRequest(
            [IoSpecification("input", [Index(n, t, 0) for t in range(3) for n in range(2)],
                             deriv)],
            [IoSpecification("output", [Index(n, t, 0) for t in range(3) for n in range(2)],
                             deriv)], need_model_derivative=deriv)
        compiler = Compiler(nnet, [req])
        computation = compiler.create_computation()
        assert compiler._whole == computation.whole_submatrices()
        subs = computation.submatrices
        # the full-width dim-range nodes did make later whole submatrices
        assert any(w != min(s for s in range(1, len(subs)) if subs[s].matrix_index == m)
                   for m, w in enumerate(compiler._whole) if m)


def _compile_cases() -> list:
    """(network, request) pairs: every random architecture twice, and a TDNN with an
    i-vector at a few chunk sizes and two sequences."""
    from engine.compiler.request import ComputationRequest, IoSpecification
    from engine.nnet.random_config import (GENERATOR_NAMES, GenerationOptions,
                                           generate_config_sequence, random_request)
    from inference_nets import RECURRENT, TDNN_IVECTOR, make_nnet

    cases = []
    opts = GenerationOptions(dim_scale=0.3)
    for seed, kind in enumerate(GENERATOR_NAMES * 2):
        rng = np.random.default_rng(200 + seed)
        net = generate_config_sequence(rng, opts, kind=kind).build(rng)
        cases.append((net, random_request(net, rng)))
    tdnn, rnn = make_nnet(TDNN_IVECTOR), make_nnet(RECURRENT)
    for chunk in (1, 8, 21):
        ins = [IoSpecification("input", [Index(n, t, 0) for t in range(-10, chunk + 10)
                                         for n in range(2)]),
               IoSpecification("ivector", [Index(n, 0, 0) for n in range(2)])]
        outs = [IoSpecification("output", [Index(n, t, 0) for t in range(chunk)
                                           for n in range(2)])]
        cases.append((tdnn, ComputationRequest(ins, outs)))
        ins = [IoSpecification("input", [Index(0, t, 0) for t in range(-12, chunk + 2)])]
        outs = [IoSpecification("output", [Index(0, t, 0) for t in range(chunk)])]
        cases.append((rnn, ComputationRequest(ins, outs)))
    return cases


def _compile_all(cases, io_rows: list | None = None) -> list:
    """The computations of ``cases`` (an error's name where compiling fails); with
    ``io_rows``, each compiled from its validated Indexes (one list per case)."""
    from engine.compiler.compiler import compile_computation
    from engine.compiler.serialize import computation_to_data
    out = []
    for k, (nnet, req) in enumerate(cases):
        try:
            rows = None if io_rows is None else [io_rows[k]]
            out.append(computation_to_data(compile_computation(nnet, [req], io_rows=rows)))
        except Exception as e:                             # noqa: BLE001
            out.append(type(e).__name__)
    return out


def test_component_input_steps_in_segment_order_equal_sorted(monkeypatch):
    """A non-simple component's input step is taken in id order when its ids are
    the segment's own (canonical, so already in Cindex order); sorting them by
    Cindex every time gives the same computations."""
    from engine.compiler.steps import ComputationStepsComputer

    cases = _compile_cases()
    calls = []
    real = ComputationStepsComputer._in_cindex_order

    def spy(self, ids):
        out = real(self, ids)
        calls.append(out is ids)
        return out
    monkeypatch.setattr(ComputationStepsComputer, "_in_cindex_order", spy)
    fast = _compile_all(cases)
    assert any(calls), "the id order is taken as it is"

    def always_sort(self, ids):
        c = self.graph.coords[ids]
        return ids[np.lexsort((c[:, 1], c[:, 3], c[:, 2], c[:, 0]))]
    monkeypatch.setattr(ComputationStepsComputer, "_in_cindex_order", always_sort)
    assert _compile_all(cases) == fast


def test_small_dim_range_sub_phases_equal_general_path(monkeypatch):
    """Small dim-range sub-phases (time steps of recurrences) go through
    _dim_range_small in plain Python; the general NumPy path gives the same
    computations."""
    from engine.compiler.steps import ComputationStepsComputer

    cases = _compile_cases()
    taken = []
    real = ComputationStepsComputer._dim_range_small

    def spy(self, node, sub, src_ids):
        out = real(self, node, sub, src_ids)
        taken.append(out)
        return out
    monkeypatch.setattr(ComputationStepsComputer, "_dim_range_small", spy)
    # (sub-phases that are a whole source step are taken before this path)
    monkeypatch.setattr(ComputationStepsComputer, "_whole_source_steps",
                        lambda self, *args: None)
    fast = _compile_all(cases)
    assert sum(taken) > 20, "the small path is in use"
    monkeypatch.setattr(ComputationStepsComputer, "_dim_range_small",
                        lambda self, node, sub, src_ids: False)
    assert _compile_all(cases) == fast


def test_whole_source_step_dim_range_sub_phases_equal_general_path(monkeypatch):
    """Dim-range sub-phases that are exactly an earlier simple component's step
    are found for the whole segment at once (_whole_source_steps); the general
    path gives the same computations."""
    from engine.compiler.steps import ComputationStepsComputer

    cases = _compile_cases()
    found = []
    real = ComputationStepsComputer._whole_source_steps

    def spy(self, *args):
        out = real(self, *args)
        found.append(0 if out is None else sum(j >= 0 for j in out))
        return out
    monkeypatch.setattr(ComputationStepsComputer, "_whole_source_steps", spy)
    fast = _compile_all(cases)
    assert sum(found) > 20, "the whole-step path is in use"
    monkeypatch.setattr(ComputationStepsComputer, "_whole_source_steps",
                        lambda self, *args: None)
    monkeypatch.setattr(ComputationStepsComputer, "_dim_range_small",
                        lambda self, node, sub, src_ids: False)
    assert _compile_all(cases) == fast


def test_deps_of_ascending_rows_equal_csr_gather():
    """The dependencies of ascending rows, one CSR slice when the rows are
    consecutive, equal the general gather."""
    from engine.compiler.steps import _csr_rows, _deps_of_ascending

    rng = np.random.default_rng(5)
    counts = rng.integers(0, 4, size=40)
    ptr = np.zeros(41, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    idx = rng.integers(0, 40, size=int(ptr[-1])).astype(np.int64)
    for _ in range(200):
        a = int(rng.integers(0, 40))
        b = int(rng.integers(a + 1, 41))
        rows = np.arange(a, b)
        if rng.random() < 0.5 and len(rows) > 2:
            rows = np.sort(rng.choice(rows, size=len(rows) - 1, replace=False))
        assert np.array_equal(_deps_of_ascending(ptr, idx, rows), _csr_rows(ptr, idx, rows)[1])


def test_io_steps_from_ids_equal_lookup(monkeypatch):
    """An input node's step is taken from its consecutive supplied ids (numbered in
    request order), an output node's from its ids when the request lists them in
    id order; looking the request's Indexes up gives the same computations."""
    from engine.compiler.steps import ComputationStepsComputer

    cases = _compile_cases()
    taken = []
    real_in = ComputationStepsComputer._supplied_in_request_order
    real_out = ComputationStepsComputer._listed_in_id_order

    def spy_in(sub):
        out = real_in(sub)
        taken.append(("in", out))
        return out

    def spy_out(self, sub, rows):
        out = real_out(self, sub, rows)
        taken.append(("out", out))
        return out
    monkeypatch.setattr(ComputationStepsComputer, "_supplied_in_request_order",
                        staticmethod(spy_in))
    monkeypatch.setattr(ComputationStepsComputer, "_listed_in_id_order", spy_out)
    fast = _compile_all(cases)
    assert sum(ok for kind, ok in taken if kind == "in") > 20, "input ids taken as they are"
    assert sum(ok for kind, ok in taken if kind == "out") > 10, "output ids taken as they are"
    assert not all(ok for kind, ok in taken if kind == "out"), "some outputs are looked up"
    monkeypatch.setattr(ComputationStepsComputer, "_supplied_in_request_order",
                        staticmethod(lambda sub: False))
    monkeypatch.setattr(ComputationStepsComputer, "_listed_in_id_order",
                        lambda self, sub, rows: False)
    assert _compile_all(cases) == fast


def test_validated_io_rows_are_read_once_and_compile_the_same(monkeypatch):
    """compile_computation given the Indexes ComputationRequest.validate returns (what
    compile_request does) builds the graph and the steps from them, converting no
    Index list again, and gives the computations it gives without them; the sweeps
    build (when the interval build declines) reads them too.  The arrays are shared by
    those phases and the shortcut, so validate hands them out read-only."""
    import engine.compiler.graph_intervals as GI
    import engine.compiler.request as R
    import engine.compiler.steps as ST

    cases = _compile_cases()
    plain = _compile_all(cases)
    rows = [req.validate(nnet) for nnet, req in cases]
    assert not any(r.flags.writeable for lst in rows for r in lst), "shared: read-only"
    converted = []
    for mod in (R, ST):        # (the graph builds convert through ComputationRequest)
        real = mod.index_rows

        def spy(indexes, *a, _real=real, **k):
            converted.append(len(indexes))
            return _real(indexes, *a, **k)
        monkeypatch.setattr(mod, "index_rows", spy)
    assert _compile_all(cases, rows) == plain
    assert not converted, "no Index list is converted again"
    monkeypatch.setattr(GI, "ENABLED", False)      # the sweeps build
    assert _compile_all(cases[-6:], rows[-6:]) == plain[-6:]
    assert not converted, "nor by the sweeps build"
    assert _compile_all(cases[-6:]) == plain[-6:] and converted, "(the spies see them)"
