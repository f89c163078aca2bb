"""Phases and steps: hand-written networks (expectations from Kaldi's rules) and
every reference network, whose Kaldi matrices must be made of our steps with
the same rows in the same order."""

import pytest

from engine.compiler.graph import ComputationGraph, build_computation_graph, print_indexes
from engine.compiler.request import ComputationRequest, io_spec
from engine.compiler.steps import (ComputationStepsComputer, _unordered_set_order,
                                   compute_computation_phases, compute_computation_steps)
from engine.core.index import K_NO_TIME, Index
from engine.nnet.nnet import Nnet

from compiler_ref import CASES, explain_by_steps, kaldi_matrices, load_case, parse_indexes
from refdata import shared_ref
from test_graph_builder import CHAIN, IVECTOR, RECURRENT

DIM_RANGE = """
input-node name=input dim=4
component name=a type=AffineComponent input-dim=4 output-dim=6
component-node name=a component=a input=input
dim-range-node name=d input-node=a dim-offset=2 dim=3
output-node name=output input=Append(Offset(d, 1), a)
"""


def steps_for(nnet, req):
    g = build_computation_graph(nnet, req)
    phases = compute_computation_phases(nnet, g)
    steps = compute_computation_steps(nnet, req, phases[0], g)
    return g, phases, [(nnet.node_names[g.cindexes[s[0]].node],
                        [tuple(g.cindexes[c].index) for c in s]) for s in steps]


def tlist(ts, n=0):
    return [(n, t, 0) for t in ts]


def test_chain_steps_and_request_order():
    nnet = Nnet.from_config(CHAIN)
    out_order = [Index(0, t, 0) for t in (3, 1, 4, 0, 2)]
    req = ComputationRequest([io_spec("input", [Index(0, t, 0) for t in (2, 0, 1, 4, 3)])],
                             [io_spec("output", out_order)])
    g, phases, steps = steps_for(nnet, req)
    assert len(phases) == 1 and len(phases[0]) == 6     # one phase per node
    # inputs and outputs in the request's order, component steps sorted by t
    assert steps == [("input", tlist([2, 0, 1, 4, 3])),
                     ("a_input", tlist(range(5))), ("a", tlist(range(5))),
                     ("r_input", tlist(range(5))), ("r", tlist(range(5))),
                     ("output", tlist([3, 1, 4, 0, 2]))]


def test_steps_sort_by_t_then_x_then_n():
    nnet = Nnet.from_config(IVECTOR)
    inputs = [io_spec("input", [Index(n, t, 0) for n in range(2) for t in range(3)]),
              io_spec("ivector", [Index(1, 0, 0), Index(0, 0, 0)])]
    outputs = [io_spec("output", [Index(n, t, 0) for n in range(2) for t in range(3)])]
    g, phases, steps = steps_for(nnet, ComputationRequest(inputs, outputs))
    names = [s[0] for s in steps]
    assert names == ["input", "ivector", "a_input", "a", "output"]
    assert steps[1][1] == [(1, 0, 0), (0, 0, 0)]
    assert steps[2][1] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 2, 0), (1, 2, 0)]


def test_recurrent_steps_one_time_at_a_time():
    nnet = Nnet.from_config(RECURRENT)
    req = ComputationRequest([io_spec("input", [Index(0, t, 0) for t in range(3)])],
                             [io_spec("output", [Index(0, t, 0) for t in range(3)])])
    g, phases, steps = steps_for(nnet, req)
    # epoch of the inputs, then the recurrent epoch one cindex per phase
    # (a_input(t), a(t) alternate), then the output epoch.
    assert [len(p) for p in phases[0]] == [3, 1, 1, 1, 1, 1, 1, 3]
    assert steps == [("input", tlist(range(3))),
                     ("a_input", tlist([0])), ("a", tlist([0])),
                     ("a_input", tlist([1])), ("a", tlist([1])),
                     ("a_input", tlist([2])), ("a", tlist([2])),
                     ("output", tlist(range(3)))]


def test_dim_range_step_covers_whole_source_step():
    # output(t) = [d(t+1), a(t)]: a is needed at t=0..4, d only at 1..4, yet the
    # d step lists all of a's step (it is a column range of a's matrix), which
    # adds d(0) to the graph.
    nnet = Nnet.from_config(DIM_RANGE)
    req = ComputationRequest([io_spec("input", [Index(0, t, 0) for t in range(5)])],
                             [io_spec("output", [Index(0, t, 0) for t in range(4)])])
    g = build_computation_graph(nnet, req)
    before = len(g.cindexes)
    phases = compute_computation_phases(nnet, g)
    computer = ComputationStepsComputer(nnet, g)
    steps = compute_computation_steps(nnet, req, phases[0], g, computer)
    assert len(g.cindexes) == before + 1
    named = [(nnet.node_names[g.cindexes[s[0]].node], [g.cindexes[c].index.t for c in s])
             for s in steps]
    assert named == [("input", list(range(5))), ("a_input", list(range(5))),
                     ("a", list(range(5))), ("d", list(range(5))), ("output", list(range(4)))]
    d0 = g.get_cindex_id((nnet.get_node_index("d"), (0, 0, 0)))
    assert computer.locations[d0] == (3, 0)
    assert computer.step_to_segment == [0] * 5


def test_two_segments_steps():
    nnet = Nnet.from_config(RECURRENT)
    reqs = [ComputationRequest([io_spec("input", [Index(0, t, 0) for t in range(s, s + 2)])],
                               [io_spec("output", [Index(0, t, 0) for t in range(s, s + 2)])])
            for s in (0, 2)]
    g = ComputationGraph()
    for r in reqs:
        build_computation_graph(nnet, r, g)
    phases = compute_computation_phases(nnet, g)
    assert len(phases) == 2
    computer = ComputationStepsComputer(nnet, g)
    steps = compute_computation_steps(nnet, reqs, phases, g, computer)
    assert len(steps) == 12
    assert computer.step_to_segment == [0] * 6 + [1] * 6
    assert [g.cindexes[c].index.t for c in steps[6]] == [2, 3]       # segment 2's input


def test_unordered_set_order_matches_libstdcxx():
    # Small sets: 13 buckets, identity hash; a new bucket goes to the front,
    # so distinct values come out in reverse insertion order...
    assert _unordered_set_order([3, 7, 5]) == [5, 7, 3]
    # ...except that values sharing a bucket (mod 13) stay grouped.
    assert _unordered_set_order([1, 14, 2]) == [2, 14, 1]
    assert _unordered_set_order([4, 4, 4]) == [4]


def _check_against_kaldi(nnet, req, matrices):
    g = build_computation_graph(nnet, req)
    phases = compute_computation_phases(nnet, g)
    computer = ComputationStepsComputer(nnet, g)
    steps = compute_computation_steps(nnet, req, phases[0], g, computer)
    computer.check()
    by_node: dict[str, list] = {}
    printed = set()
    for s in steps:
        if s:
            node = nnet.node_names[g.cindexes[s[0]].node]
            idx = [g.cindexes[c].index for c in s]
            by_node.setdefault(node, []).append(idx)
            printed.add(node + print_indexes(idx))
    checked = 0
    for m, node, text in matrices:
        rows, complete = parse_indexes(text)
        if complete or node + text not in printed:
            assert explain_by_steps(rows, by_node.get(node, []), partial_end=not complete), \
                f"{m}: {node}{text}"
        checked += 1
    return checked, steps, g


@pytest.mark.parametrize("case", CASES)
def test_reference_matrices_are_made_of_our_steps(case):
    nnet, req = load_case(case)
    assert nnet is not None, f"reference network does not load: {req}"
    checked, steps, g = _check_against_kaldi(nnet, req, kaldi_matrices(case))
    assert checked > 0
    # blank rows appear only where a component reorders its indexes
    for s in steps:
        for c in s:
            if g.cindexes[c].index.t == K_NO_TIME:
                node = g.cindexes[c].node
                comp_node = node if nnet.is_component_node(node) else node + 1
                comp = nnet.get_component(nnet.nodes[comp_node].component_index)
                assert comp.properties() & 0x010, f"blank row at {nnet.node_names[node]}"


SHARED_CASES = ["case000", "case003", "case024", "case037", "case040"]


@pytest.mark.parametrize("case", SHARED_CASES)
def test_reference_models_from_shared(case):
    ref = shared_ref()
    if ref is None:
        pytest.skip("../shared/kaldi-ref not present (only the copied cases run)")
    from engine.nnet.model_io import load_nnet
    import json
    d = ref / "networks" / case
    if not (d / "model.txt").exists():
        pytest.skip(f"{case} is not in this reference set")
    nnet = load_nnet(str(d / "model.txt"))
    req = ComputationRequest.from_json(json.loads((d / "request.json").read_text()))
    checked, _, _ = _check_against_kaldi(nnet, req, kaldi_matrices(case, ref / "networks"))
    assert checked > 0


def _kahn_rounds(k, owner, local):
    """Kahn's rounds, member by member (the reference for _longest_paths)."""
    remaining = [0] * k
    users = [[] for _ in range(k)]
    for o, src in zip(owner, local):
        remaining[o] += 1
        users[src].append(o)
    level, frontier, lev = [0] * k, [i for i in range(k) if not remaining[i]], 0
    while frontier:
        nxt = []
        for c in frontier:
            level[c] = lev
            for u in users[c]:
                remaining[u] -= 1
                if not remaining[u]:
                    nxt.append(u)
        frontier, lev = nxt, lev + 1
    return None if any(remaining) else level


def test_longest_paths_equal_kahn_rounds():
    """The rounds of a recurrence's cindexes found along chains on whole arrays are
    Kahn's rounds; a cycle gives None (the caller then reports it)."""
    import numpy as np

    from engine.compiler.steps import _longest_paths

    rng = np.random.default_rng(7)
    cycles = 0
    for trial in range(1500):
        k = int(rng.integers(2, 70))
        rank = rng.permutation(k)
        by_rank = np.argsort(rank)
        choices = [0, 1, 1, 1, 1, 2, 3] if trial % 2 else [0, 1, 2, 2, 3, 4]
        edges = set()
        for u in range(k):
            for _ in range(int(rng.choice(choices))):
                if rank[u]:
                    lo = max(0, rank[u] - int(rng.integers(1, 6)))
                    edges.add((u, int(by_rank[rng.integers(lo, rank[u])])))
        if trial % 4 == 0:
            a, b = sorted(rng.integers(0, k, 2).tolist())
            edges.add((int(by_rank[a]), int(by_rank[b])))      # maybe a cycle
        if not edges:
            continue
        owner, local = np.array(sorted(edges)).T
        want = _kahn_rounds(k, owner.tolist(), local.tolist())
        got = _longest_paths(k, owner, local)
        cycles += want is None
        if want is None:
            assert got is None
        else:
            assert got is not None and got.tolist() == want
    assert cycles > 50


def test_check_reports_a_cindex_whose_place_holds_another():
    """ComputationStepsComputer.check: a located cindex whose (step, row) holds another
    cindex, or that has no place, is reported by name; the usual case passes."""
    nnet = Nnet.from_config(CHAIN)
    req = ComputationRequest([io_spec("input", tlist(range(5)))],
                             [io_spec("output", tlist(range(5)))])
    g = build_computation_graph(nnet, req)
    phases = compute_computation_phases(nnet, g)
    computer = ComputationStepsComputer(nnet, g)
    compute_computation_steps(nnet, req, phases[0], g, computer)
    computer.check()
    c = int(g.dep_idx[0]) if len(g.dep_idx) else 0
    row = int(computer.loc_row[c])
    computer.loc_row[c] = row + 1 if row == 0 else row - 1   # a neighbour's place
    with pytest.raises(AssertionError, match="no consistent location"):
        computer.check()
    computer.loc_row[c] = row
    computer.check()
    computer.loc_step[c] = -1                                # no place at all
    with pytest.raises(AssertionError, match="no consistent location"):
        computer.check()
