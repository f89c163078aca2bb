"""The compiler front half's fast paths give exactly what the general code gives.

- engine.compiler.fast_descriptors: generated dependency functions, their
  NumPy form and the compiled IfDefined/Failover/Const evaluation against the
  Descriptor object tree (GetDependencies, IsComputable with used inputs).
- engine.compiler.graph_arrays: the array graph build against Kaldi's
  per-cindex algorithm (ComputationGraphBuilder with use_arrays=False): the
  same cindexes with the same (canonical) ids, dependencies, inputs, segments,
  computable outputs, phases and steps; on the reference networks of
  tests/data/compiler, the models of ../shared/kaldi-ref when present, random
  networks of engine.nnet.random_config, and two-segment (looped-style)
  requests.
- the compiler's input locations through compiled descriptor parts against the
  object-tree path: the same printed computation.
No timing is asserted here (bench/compile_speed.py measures speed).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.compiler import compiler as compiler_mod
from engine.compiler.compiler import Compiler, CompilerOptions
from engine.compiler.fast_descriptors import compile_descriptor
from engine.compiler.graph import (ComputationGraph, ComputationGraphBuilder,
                                   build_computation_graph)
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.steps import compute_computation_phases, compute_computation_steps
from engine.core.errors import NotComputableError, RequestError
from engine.core.index import Cindex, Index
from engine.nnet.random_config import GenerationOptions, generate_config_sequence, random_request

from compiler_ref import CASES, load_case
from refdata import shared_ref

OPTS = GenerationOptions(dim_scale=0.3)
RANDOM_SEEDS = range(60)


def _random(seed: int):
    rng = np.random.default_rng(seed)
    net = generate_config_sequence(rng, OPTS)
    nnet = net.build(rng)
    return nnet, random_request(nnet, rng)


def _build(nnet, requests, arrays: bool):
    """(graph, statuses, computable outputs before each prune) or the error raised."""
    graph = ComputationGraph()
    builder = ComputationGraphBuilder(nnet, graph)
    builder.use_arrays = arrays
    statuses, infos = [], []
    try:
        for req in requests:
            builder.compute(req)
            statuses.append(builder.array_status)
            if not builder.all_outputs_are_computable():
                raise builder.not_computable_error()
            infos.append(builder.get_computable_info())
            builder.prune()
    except (NotComputableError, RequestError) as e:
        return None, statuses, str(e)
    return graph, statuses, infos


def _steps(nnet, requests, graph):
    phases = compute_computation_phases(nnet, graph)
    return [list(s) for s in compute_computation_steps(nnet, requests, phases, graph)]


def _assert_same_build(nnet, requests) -> str:
    """Build both ways, compare everything; returns the array build's status."""
    g1, st1, u1 = _build(nnet, requests, True)
    g0, _, u0 = _build(nnet, requests, False)
    if g0 is None or g1 is None:
        assert g0 is None and g1 is None and u0 == u1, (u0, u1)
        return st1[-1] if st1 else ""
    assert g1.cindexes == g0.cindexes
    assert all(type(c) is Cindex and type(c.index) is Index for c in g1.cindexes)
    assert g1.dependencies == g0.dependencies
    assert g1.is_input == g0.is_input
    assert g1.segment_ends == g0.segment_ends
    assert u1 == u0
    assert (g1.coords == g0.coords).all() and (g1.dep_idx == g0.dep_idx).all()
    assert (g1.dep_ptr == g0.dep_ptr).all()
    assert _steps(nnet, requests, g1) == _steps(nnet, requests, g0)
    return st1[-1]


def _second_segment(req: ComputationRequest, nnet) -> ComputationRequest | None:
    """A looped-style next chunk: the next frames of input and output, reusing
    the first segment's cindexes (ivector only in the first segment)."""
    inp = next(s for s in req.inputs if s.name == "input")
    out = req.outputs[0]
    ts = [i.t for i in inp.indexes]
    ots = [i.t for i in out.indexes]
    shift = max(ots) - min(ots) + 1
    ns = sorted({i.n for i in inp.indexes})
    new_in = [Index(n, t, 0) for n in ns for t in range(max(ts) + 1, max(ts) + 1 + shift)]
    new_out = [Index(i.n, i.t + shift, i.x) for i in out.indexes]
    return ComputationRequest([IoSpecification("input", new_in)],
                              [IoSpecification(out.name, new_out)])


# -- fast descriptors ------------------------------------------------------------------------


def _descriptor_nodes():
    out = []
    for seed in RANDOM_SEEDS:
        nnet, _ = _random(seed)
        for node in nnet.nodes:
            if getattr(node, "descriptor", None) is not None:
                out.append(node.descriptor)
    return out


def test_fast_descriptors_match_the_object_tree():
    rng = np.random.default_rng(5)
    descs = _descriptor_nodes()
    seen_general = 0
    for desc in descs:
        fast = compile_descriptor(desc)
        assert fast is not None, desc
        indexes = [Index(int(n), int(t), int(x)) for n, t, x in
                   zip(rng.integers(0, 4, 12), rng.integers(-30, 30, 12), rng.integers(0, 2, 12))]
        for idx in indexes:
            want = desc.get_dependencies(idx)
            got = fast.deps(idx)
            assert got == want
            if fast.dep1 is not None:
                assert [fast.dep1(idx)] == want
            arrays = fast.deps_arrays(np.array([idx.n]), np.array([idx.t]), np.array([idx.x]))
            assert [(int(np.broadcast_to(nd, (1,))[0]), (int(n[0]), int(t[0]), int(x[0])))
                    for nd, n, t, x in arrays] == want
            # every subset of present inputs for small lists, random ones otherwise
            k = len(want)
            masks = ([[(m >> i) & 1 == 1 for i in range(k)] for m in range(1 << k)] if k <= 6
                     else [list(rng.integers(0, 2, k) == 1) for _ in range(40)])
            for present in masks:
                have = {c for c, p in zip(want, present) if p}
                used: list = []
                ok = desc.is_computable(idx, have.__contains__, used)
                fok, fpos = fast.evaluate(present)
                # the same cindex may sit at two positions: presence is per cindex
                if len(set(want)) == len(want):
                    assert fok == ok
                    assert [want[p] for p in fpos] == used
                    assert fast.computable(present) == ok
        if not fast.all_required:
            seen_general += 1
    assert seen_general > 0, "no IfDefined/Failover/Const descriptor among the random networks"


# -- the array graph build -----------------------------------------------------------------------


def test_array_build_equals_kaldi_algorithm_on_reference_networks():
    used = 0
    for case in CASES:
        nnet, req = load_case(case)
        if nnet is None:
            continue
        used += _assert_same_build(nnet, [req]) == "used"
    assert used > len(CASES) // 2, "the array build was seldom taken on the reference networks"


def test_array_build_equals_kaldi_algorithm_on_random_networks():
    status = {}
    for seed in RANDOM_SEEDS:
        nnet, req = _random(seed)
        status[seed] = _assert_same_build(nnet, [req])
    taken = sum(s == "used" for s in status.values())
    # recurrent networks included: the array build applies to nearly all
    assert taken >= len(RANDOM_SEEDS) - 5, status


def test_array_build_equals_kaldi_algorithm_on_two_segments():
    taken = 0
    for seed in RANDOM_SEEDS[:30]:
        nnet, req = _random(seed)
        req2 = _second_segment(req, nnet)
        taken += _assert_same_build(nnet, [req, req2]) == "used"
    assert taken > 0


@pytest.mark.skipif(shared_ref() is None, reason="needs ../shared/kaldi-ref (reference models)")
@pytest.mark.parametrize("model", ["tdnn", "tdnnf", "tdnn_lstm", "blstm"])
def test_array_build_on_reference_models(model):
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    d = shared_ref() / "models" / model
    if not (d / "infer.json").exists():
        pytest.skip(f"models/{model} is not in this reference set")
    nnet = load_model(str(d / "model.raw")).nnet
    info = json.loads((d / "infer.json").read_text())["info"]
    left, right = info["left-context"], info["right-context"]
    for chunk, batch in [(21, 2), (8, 3)]:
        inputs = [IoSpecification("input", [Index(n, t, 0) for n in range(batch)
                                            for t in range(-left, chunk + right)])]
        if nnet.get_node_index("ivector") >= 0:
            inputs.append(IoSpecification("ivector", [Index(n, 0, 0) for n in range(batch)]))
        outputs = [IoSpecification("output", [Index(n, t, 0) for n in range(batch)
                                              for t in range(chunk)])]
        status = _assert_same_build(nnet, [ComputationRequest(inputs, outputs)])
        assert status == "used"


def test_array_build_reports_uncomputable_outputs_like_kaldi():
    # An output frame whose context the request does not supply: the array
    # build declines and the error is the general path's.
    for seed in RANDOM_SEEDS[:20]:
        nnet, req = _random(seed)
        out = req.outputs[0]
        far = [Index(i.n, i.t + 1000, i.x) for i in out.indexes]
        bad = ComputationRequest(req.inputs, [IoSpecification(out.name, far)])
        g1, st1, e1 = _build(nnet, [bad], True)
        g0, _, e0 = _build(nnet, [bad], False)
        assert g1 is None and g0 is None and e1 == e0
        assert st1[0].startswith("declined")


# -- compiler input locations ------------------------------------------------------------------------


def _compiled_text(nnet, req, fast: bool, monkeypatch) -> str:
    if not fast:
        monkeypatch.setattr(compiler_mod, "_compile_part", lambda part: None)
    try:
        comp = Compiler(nnet, [req]).create_computation(CompilerOptions())
    except NotComputableError as e:
        return f"error: {e}"
    finally:
        monkeypatch.undo()
    return comp.to_text(nnet)


def test_input_locations_through_compiled_parts(monkeypatch):
    for seed in RANDOM_SEEDS[:40]:
        nnet, req = _random(seed)
        assert (_compiled_text(nnet, req, True, monkeypatch)
                == _compiled_text(nnet, req, False, monkeypatch))
    for case in CASES[:20]:
        nnet, req = load_case(case)
        if nnet is not None:
            assert (_compiled_text(nnet, req, True, monkeypatch)
                    == _compiled_text(nnet, req, False, monkeypatch))


def test_build_computation_graph_entry_point_uses_the_fast_path():
    for seed in RANDOM_SEEDS:
        nnet, req = _random(seed)
        graph = ComputationGraph()
        builder = ComputationGraphBuilder(nnet, graph)
        try:
            build_computation_graph(nnet, req, graph, builder)
        except NotComputableError:
            continue
        if builder.array_status == "used":
            assert graph.segment_ends == [len(graph.cindexes)]
            return
    pytest.fail("no random network took the array build")


# -- the graph's cindex lookup table ----------------------------------------------------------------


def test_cindex_table_lookups_in_every_mode():
    from engine.compiler.graph_nodes import CindexTable  # noqa: PLC0415
    from engine.core.index import K_NO_TIME  # noqa: PLC0415
    rng = np.random.default_rng(7)
    # compact ranges (dense table), a wide t range (sorted keys), ranges too wide
    # for one int64 key (dict)
    for spread_t, spread_x, mode in ((40, 2, "dense"), (10 ** 9, 2, "sorted"),
                                     (2 ** 40, 2 ** 40, "dict")):
        rows = np.stack([rng.integers(0, 5, 300), rng.integers(0, 3, 300),
                         rng.integers(-spread_t, spread_t, 300),
                         rng.integers(0, spread_x, 300)], axis=1)
        rows = np.unique(rows, axis=0)
        rows = np.concatenate([rows, [[2, 0, K_NO_TIME, 0], [4, 1, K_NO_TIME, 1]]])
        table = CindexTable(rows, num_nodes=6, margin=(0, 3, 0))
        assert table.mode == mode
        want = {tuple(r): i for i, r in enumerate(rows.tolist())}
        probe = np.concatenate([rows, rows + [0, 0, 1, 0], rows + [1, 0, 0, 0],
                                [[9, 0, 0, 0], [2, 0, K_NO_TIME, 0], [3, 0, K_NO_TIME, 0]]])
        got = table.find(probe[:, 0], probe[:, 1], probe[:, 2], probe[:, 3])
        assert got.tolist() == [want.get(tuple(r), -1) for r in probe.tolist()]
        # the same Index shifted, on another node
        on1 = np.flatnonzero((rows[:, 0] == 1) & (rows[:, 2] != K_NO_TIME))
        shifted = table.find_shifted(on1, 1, 3, 0, 2, 0)
        expect = [want.get((3, n, t + 2, x), -1) for _, n, t, x in rows[on1].tolist()]
        if mode == "dict":
            assert shifted is None
        else:
            assert shifted.tolist() == expect
        # adding cindexes keeps every lookup right (or asks for a new table)
        extra = np.array([[0, 0, 5, 0], [5, 2, -1, 1], [1, 1, K_NO_TIME, 0]])
        extra = extra[[tuple(r) not in want for r in extra.tolist()]]
        ids = np.arange(len(rows), len(rows) + len(extra))
        if table.add(extra, ids):
            for r, i in zip(extra.tolist(), ids.tolist()):
                assert table.find(np.array([r[0]]), np.array([r[1]]), np.array([r[2]]),
                                  np.array([r[3]])).tolist() == [i]


def test_cindex_table_adds_a_few_rows_as_it_adds_many(monkeypatch):
    """CindexTable.add takes a few rows (up to _FEW_ROWS) in Python: the same
    entries, blank cindexes, key_of and refusals (outside the table or its margin)
    as the array path, checked by running both on the same additions."""
    from engine.compiler import graph_nodes  # noqa: PLC0415
    from engine.compiler.graph_nodes import CindexTable  # noqa: PLC0415
    from engine.core.index import K_NO_TIME  # noqa: PLC0415
    rng = np.random.default_rng(11)
    rows = np.unique(np.stack([rng.integers(0, 4, 200), rng.integers(0, 2, 200),
                               rng.integers(-20, 20, 200), rng.integers(0, 2, 200)], axis=1),
                     axis=0)
    have = {tuple(r) for r in rows.tolist()}
    few_rows = graph_nodes._FEW_ROWS
    tried = refused = 0
    for trial in range(300):
        k = int(rng.integers(1, 6))
        # mostly within the table, t often at its edges (where the margin decides),
        # now and then a node, n or x outside it, or a blank t
        extra = np.stack([rng.integers(0, 5, k), rng.integers(0, 2, k),
                          rng.integers(-24, 25, k), rng.integers(0, 2, k)], axis=1)
        outside = rng.random(k) < 0.1
        extra[outside, int(rng.integers(0, 4))] += 7
        extra[rng.random(k) < 0.15, 2] = K_NO_TIME
        extra = np.unique(extra, axis=0)
        extra = extra[[tuple(r) not in have for r in extra.tolist()]]
        if not len(extra):
            continue
        ids = np.arange(len(rows), len(rows) + len(extra))
        tables = []
        for few in (few_rows, 0):
            monkeypatch.setattr(graph_nodes, "_FEW_ROWS", few)
            table = CindexTable(rows, num_nodes=5, margin=(0, 2, 0))
            tables.append((table.add(extra, ids), table))
        (ok_few, a), (ok_arrays, b) = tables
        assert ok_few == ok_arrays, extra.tolist()
        tried += 1
        refused += not ok_few
        if ok_few:
            assert a.key_of.tolist() == b.key_of.tolist()
            assert np.array_equal(a.table, b.table) and a.blank == b.blank
    assert tried > 100 and 0 < refused < tried


def test_dense_table_scales_with_the_request(monkeypatch):
    """The array build's dense (node, n, t, x) table may grow with the request (up to
    TABLE_CELLS_PER_ROW cells per node and requested Index) beyond MAX_TABLE_CELLS: a
    long single sequence is dense and stays on the array build (a 40000-frame TDNN-F
    request fell back to the per-cindex algorithm: 200 s instead of 2 s); a sparse
    request over a wide t range still falls back.  Both give the per-cindex graph.
    (The fixed limit is made small here so that small requests cross it.)"""
    from engine.compiler import graph_arrays  # noqa: PLC0415
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    monkeypatch.setattr(graph_arrays, "MAX_TABLE_CELLS", 2000)
    nnet = Nnet.from_config(
        "input-node name=input dim=3\n"
        "component name=a type=AffineComponent input-dim=9 output-dim=4\n"
        "component-node name=a component=a input=Append(Offset(input, -1), input, "
        "Offset(input, 1))\n"
        "component name=r type=RectifiedLinearComponent dim=4\n"
        "component-node name=r component=r input=a\n"
        "component name=b type=AffineComponent input-dim=8 output-dim=2\n"
        "component-node name=b component=b input=Append(Offset(r, -2), Offset(r, 2))\n"
        "output-node name=output input=b\n")
    frames = 400
    dense = ComputationRequest(
        [IoSpecification("input", [Index(0, t, 0) for t in range(-3, frames + 3)])],
        [IoSpecification("output", [Index(0, t, 0) for t in range(frames)])])
    assert _assert_same_build(nnet, [dense]) == "used"
    sparse = ComputationRequest(
        [IoSpecification("input", [Index(0, t, 0) for t in list(range(-3, 4))
                                   + list(range(99997, 100004))])],
        [IoSpecification("output", [Index(0, 0, 0), Index(0, 100000, 0)])])
    assert _assert_same_build(nnet, [sparse]).startswith("declined: Index ranges too wide")


def test_per_cindex_fallback_stops_at_its_cindex_limit(monkeypatch):
    """A sparse request over a wide t range goes to the per-cindex build (~50 us a
    cindex); past MAX_FALLBACK_CINDEXES it stops with a ResourceLimitError naming the
    limit and why the array build declined, instead of running for minutes."""
    from engine.compiler import graph as graph_mod  # noqa: PLC0415
    from engine.core.errors import ResourceLimitError  # noqa: PLC0415
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    nnet = Nnet.from_config(
        "input-node name=input dim=3\n"
        "component name=a type=AffineComponent input-dim=9 output-dim=4\n"
        "component-node name=a component=a input=Append(Offset(input, -1), input, "
        "Offset(input, 1))\noutput-node name=output input=a\n")
    ts = [k * 10_000_000 for k in range(40)]
    sparse = ComputationRequest(
        [IoSpecification("input", [Index(0, t + d, 0) for t in ts for d in (-1, 0, 1)])],
        [IoSpecification("output", [Index(0, t, 0) for t in ts])])
    graph, _, _ = _build(nnet, [sparse], True)      # within the default limit: built
    assert graph is not None and len(graph) > 0
    monkeypatch.setattr(graph_mod, "MAX_FALLBACK_CINDEXES", 50)
    with pytest.raises(ResourceLimitError, match=r"past 50 cindexes .*declined: Index ranges"):
        build_computation_graph(nnet, sparse)


def test_tiled_vectors_are_made_once_per_frozen_vector():
    """fastpaths._tiled: a frozen vector is tiled once and shared (closures bound on
    every run reuse it), a writeable one anew on every call, the values np.tile's."""
    from engine.runtime.fastpaths import _tiled  # noqa: PLC0415
    v = np.arange(6, dtype=np.float32)
    w = np.arange(6, dtype=np.float32)
    w.flags.writeable = False
    assert _tiled(v, 3) is not _tiled(v, 3)
    assert _tiled(w, 3) is _tiled(w, 3) and _tiled(w, 2) is not _tiled(w, 3)
    assert np.array_equal(_tiled(w, 3), np.tile(w, 3)) and not _tiled(w, 3).flags.writeable


def test_nested_rounds_compile_linearly_and_match():
    """Round() inside Round() (with Offset and Switch around): the compiled form names t
    once per level (it doubled with each level, 20 levels took a minute to compile and
    30 ran out of memory) and maps every Index as the object tree does, negative t
    included."""
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    expr = "input"
    for k in range(40):
        expr = f"Round({expr}, {2 + k % 3})" if k % 7 else f"Offset({expr}, {k % 5 - 2})"
    nnet = Nnet.from_config(f"input-node name=input dim=2\noutput-node name=output input={expr}\n")
    desc = nnet.nodes[nnet.get_node_index("output")].descriptor
    fast = compile_descriptor(desc)
    assert fast is not None
    for t in range(-40, 41):
        idx = Index(0, t, 0)
        assert fast.deps(idx) == desc.get_dependencies(idx)


@pytest.mark.parametrize("kind", ["statistics", "cnn_new", "attention", "distribute"])
def test_array_form_components_take_the_array_build(kind, monkeypatch):
    """Statistics extraction and pooling (computable when any input is), time-height
    convolution and restricted attention (when the inputs at their required time
    offsets are), distribute (its one input, at x // blocks: ``input_x``) get
    their inputs as arrays (``input_times``, ``input_rule``), not Index by Index: on
    random networks (statistics periods 1-9 and contexts up to 90 frames; convolutions
    with optional time offsets) and two-segment requests the graph, statuses, outputs
    and steps equal the per-cindex algorithm's, with no component asked Index by
    Index."""
    from engine.compiler.graph_arrays import ArrayGraphBuild
    from engine.nnet.components.statistics import (StatisticsExtractionComponent,
                                                   StatisticsPoolingComponent)

    def refuse(*a, **k):
        raise AssertionError("a component was asked Index by Index")

    for seed in range(25):
        rng = np.random.default_rng(seed)
        nnet = generate_config_sequence(rng, OPTS, kind=kind).build(rng)
        req = random_request(nnet, rng)
        with monkeypatch.context() as m:
            m.setattr(ArrayGraphBuild, "_expand_general", refuse)
            m.setattr(ArrayGraphBuild, "_settle_general", refuse)
            g, statuses, _ = _build(nnet, [req], True)
        assert g is not None and statuses == ["used"], (seed, statuses)
        assert _assert_same_build(nnet, [req]) == "used"
        assert _assert_same_build(nnet, [req, _second_segment(req, nnet)]) == "used"
    # the array form is the per-Index form, row by row
    ext = StatisticsExtractionComponent()
    ext.input_period, ext.output_period = 3, 9
    pool = StatisticsPoolingComponent()
    pool.input_period, pool.left_context, pool.right_context = 3, 6, 9
    for comp, ts in ((ext, range(-20, 20)), (pool, range(-21, 21, 3))):
        t = np.array(list(ts), dtype=np.int64)
        rows = comp.input_times(t).tolist()
        assert rows == [[i.t for i in comp.get_input_indexes(None, Index(0, int(u), 0))]
                        for u in t]


def test_constant_component_takes_the_array_build(monkeypatch):
    """ConstantComponent (no input at all) is a node of fixed, empty shifts: the array
    build does not ask it Index by Index, and builds what the per-cindex one does."""
    from engine.compiler.graph_arrays import ArrayGraphBuild
    from engine.nnet.nnet import Nnet
    nnet = Nnet.from_config("""input-node name=input dim=4
component name=c type=ConstantComponent output-dim=4
component-node name=c component=c input=input
component name=a type=AffineComponent input-dim=8 output-dim=2
component-node name=a component=a input=Append(Offset(input, -1), c)
output-node name=output input=a
""")
    req = ComputationRequest(
        [IoSpecification("input", [Index(n, t, 0) for n in range(2) for t in range(-3, 9)])],
        [IoSpecification("output", [Index(n, t, 0) for n in range(2) for t in range(6)],
                         True)], need_model_derivative=True)

    def refuse(*a, **k):
        raise AssertionError("a component was asked Index by Index")

    with monkeypatch.context() as m:
        m.setattr(ArrayGraphBuild, "_expand_general", refuse)
        m.setattr(ArrayGraphBuild, "_settle_general", refuse)
        g, statuses, _ = _build(nnet, [req], True)
    assert g is not None and statuses == ["used"]
    assert _assert_same_build(nnet, [req]) == "used"
    assert _assert_same_build(nnet, [req, _second_segment(req, nnet)]) == "used"


def test_distribute_array_forms_equal_the_per_index_ones():
    """DistributeComponent's input (``input_times``, ``input_x``) and its precomputed
    indexes, made on arrays, equal the per-Index definition, negative x included; an
    output whose input is missing names both Indexes."""
    from engine.core.errors import ComponentError
    from engine.nnet.components.distribute import DistributeComponent
    comp = DistributeComponent()
    comp.input_dim_, comp.output_dim_ = 12, 4
    rng = np.random.default_rng(3)
    out = [Index(int(n), int(t), int(x)) for n, t, x in
           zip(rng.integers(0, 3, 60), rng.integers(-5, 5, 60), rng.integers(-7, 9, 60))]
    out = sorted(set(out))
    n, t, x = (np.array(c, dtype=np.int64) for c in zip(*out))
    got = list(zip(n.tolist(), comp.input_times(t)[:, 0].tolist(),
                   comp.input_x(x)[:, 0].tolist()))
    per_index = [comp.get_input_indexes(None, o) for o in out]
    assert all(len(p) == 1 for p in per_index)
    assert got == [tuple(p[0]) for p in per_index]
    inputs = sorted(set(p[0] for p in per_index))
    rng.shuffle(inputs)
    pre = comp.precompute_indexes(None, inputs, out, True)
    for k, o in enumerate(out):
        assert inputs[pre.input_rows[k]] == per_index[k][0]
        assert pre.blocks[k] == o.x - (o.x // 3) * 3
    with pytest.raises(ComponentError, match=r"input Index .* needed by output Index .* "
                                             r"is not in the input"):
        comp.precompute_indexes(None, inputs[1:], out, True)


def test_statistics_pooling_off_its_period_reports_the_general_error():
    """An output asked of statistics pooling at a t that is not a multiple of its
    input period: the array build declines and the error is the per-cindex one."""
    from engine.core.errors import ComponentError
    from engine.nnet.nnet import Nnet
    nnet = Nnet.from_config("""input-node name=input dim=3
component name=e type=StatisticsExtractionComponent input-dim=3 input-period=1 output-period=2
component name=p type=StatisticsPoolingComponent input-dim=7 input-period=2 left-context=4 right-context=4
component-node name=e component=e input=input
component-node name=p component=p input=e
output-node name=output input=p
""")
    req = ComputationRequest([IoSpecification("input", [Index(0, t, 0) for t in range(-8, 9)])],
                             [IoSpecification("output", [Index(0, 1, 0)])])
    errors = []
    for arrays in (True, False):
        builder = ComputationGraphBuilder(nnet, ComputationGraph())
        builder.use_arrays = arrays
        with pytest.raises(ComponentError) as e:
            builder.compute(req)
        errors.append(str(e.value))
        if arrays:
            assert builder.array_status.startswith("declined: input times")
    assert errors[0] == errors[1] and "input-period=2" in errors[0]


def test_grid_rows_equal_their_definition():
    """Kaldi's GetIndexesForComputation grid (convolution, restricted attention) made on
    arrays equals the definition written Index by Index, blanks included."""
    from engine.core.index import K_NO_TIME, array_to_indexes
    from engine.nnet.components._nonsimple_utils import get_nx_list, get_t_list, grid_rows

    def grid_indexes(*args):
        rows = grid_rows(*args)
        assert rows.dtype == np.int64 and rows.ndim == 2 and rows.shape[1] == 3
        return array_to_indexes(rows)

    def definition(nx, t_start, t_step, num_t, reorder_t, present):
        t_step = t_step or 1
        outer, have, out = t_step * reorder_t, set(present), []
        for t_block in range(t_start, t_start + num_t * t_step, outer):
            for n, x in nx:
                for t in range(t_block, t_block + outer, t_step):
                    idx = Index(n, t, x)
                    out.append(idx if idx in have else Index(n, K_NO_TIME, x))
        return out

    rng = np.random.default_rng(5)
    for _ in range(200):
        step = int(rng.integers(0, 4))
        present = [Index(int(n), int(t), int(x)) for n, t, x in
                   zip(rng.integers(-2, 3, 40), rng.integers(-30, 30, 40),
                       rng.integers(0, 2, 40))]
        present += [Index(0, K_NO_TIME, 0)] * int(rng.integers(0, 2))
        nx = get_nx_list(present)
        assert nx == sorted({(i.n, i.x) for i in present})
        assert get_t_list(present) == sorted({i.t for i in present if i.t != K_NO_TIME})
        args = (nx, int(rng.integers(-30, 0)), step, int(rng.integers(1, 20)),
                int(rng.integers(1, 4)))
        got = grid_indexes(*args, present)
        assert got == definition(*args, present)
        assert all(type(i) is Index and type(i.t) is int for i in got)
    assert grid_indexes([(0, 0)], 0, 1, 3, 1, []) == [Index(0, K_NO_TIME, 0)] * 3
