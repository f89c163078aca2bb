"""ComputationGraphBuilder on small hand-written networks: the cindexes kept, the
dependencies left after pruning, NotComputableError, recurrences far from t=0,
multi-segment graphs.  Expectations are derived from Kaldi's algorithm (see the
comments in each test)."""


import pytest

from engine.compiler.graph import ComputationGraph, build_computation_graph
from engine.compiler.request import ComputationRequest, io_spec
from engine.core.errors import NotComputableError, RequestError
from engine.core.index import Cindex, Index
from engine.nnet.nnet import Nnet

CHAIN = """
input-node name=input dim=3
component name=a type=AffineComponent input-dim=3 output-dim=4
component-node name=a component=a input=input
component name=r type=RectifiedLinearComponent dim=4
component-node name=r component=r input=a
output-node name=output input=r
"""

CONTEXT = """
input-node name=input dim=2
component name=a type=AffineComponent input-dim=6 output-dim=3
component-node name=a component=a input=Append(Offset(input, -1), input, Offset(input, 1))
output-node name=output input=Offset(a, 2)
"""

RECURRENT = """
input-node name=input dim=2
component name=a type=AffineComponent input-dim=5 output-dim=3
component-node name=a component=a input=Append(input, IfDefined(Offset(a, -1)))
output-node name=output input=a
"""

FAILOVER = """
input-node name=input dim=2
component name=a type=AffineComponent input-dim=2 output-dim=2
component-node name=a component=a input=Failover(Offset(input, -1), input)
output-node name=output input=a
"""

IVECTOR = """
input-node name=input dim=2
input-node name=ivector dim=3
component name=a type=AffineComponent input-dim=5 output-dim=2
component-node name=a component=a input=Append(input, ReplaceIndex(ivector, t, 0))
output-node name=output input=Append(a, Round(a, 3))
"""


def net(cfg):
    return Nnet.from_config(cfg)


def request(inputs, outputs, **kw):
    return ComputationRequest([io_spec(name, idx) for name, idx in inputs],
                              [io_spec(name, idx) for name, idx in outputs], **kw)


def ts(t_values, n=0):
    return [Index(n, t, 0) for t in t_values]


def cindex_set(nnet, graph):
    """{(node name, n, t, x)} of the graph."""
    return {(nnet.node_names[c.node], *c.index) for c in graph.cindexes}


def deps_of(nnet, graph, name, index):
    c = graph.get_cindex_id(Cindex(nnet.get_node_index(name), index))
    assert c >= 0, f"{name}{index} not in graph"
    return sorted((nnet.node_names[graph.cindexes[d].node], *graph.cindexes[d].index)
                  for d in graph.dependencies[c])


def test_simple_chain_exact_cindexes():
    nnet = net(CHAIN)
    g = build_computation_graph(nnet, request([("input", ts(range(5)))],
                                              [("output", ts(range(5)))]))
    expected = {(name, 0, t, 0) for t in range(5)
                for name in ("input", "a_input", "a", "r_input", "r", "output")}
    assert cindex_set(nnet, g) == expected
    assert g.segment_ends == [30]
    # inputs come first (Kaldi adds the request's inputs, then its outputs)
    assert all(g.is_input[:5]) and not any(g.is_input[5:])
    assert deps_of(nnet, g, "r", Index(0, 3, 0)) == [("r_input", 0, 3, 0)]
    assert deps_of(nnet, g, "a_input", Index(0, 0, 0)) == [("input", 0, 0, 0)]
    assert deps_of(nnet, g, "input", Index(0, 0, 0)) == []


def test_offsets_keep_only_required_cindexes():
    # output(t) = a(t+2); a(t) reads input(t-1), input(t), input(t+1).
    nnet = net(CONTEXT)
    g = build_computation_graph(nnet, request([("input", ts(range(10)))],
                                              [("output", ts(range(6)))]))
    got = cindex_set(nnet, g)
    expected = ({("input", 0, t, 0) for t in range(10)}       # inputs are always kept
                | {("a_input", 0, t, 0) for t in range(2, 8)}
                | {("a", 0, t, 0) for t in range(2, 8)}
                | {("output", 0, t, 0) for t in range(6)})
    assert got == expected
    assert deps_of(nnet, g, "a_input", Index(0, 4, 0)) == [
        ("input", 0, 3, 0), ("input", 0, 4, 0), ("input", 0, 5, 0)]
    assert deps_of(nnet, g, "output", Index(0, 0, 0)) == [("a", 0, 2, 0)]


def test_recurrence_prunes_unused_optional_inputs():
    # a_input(0) cannot use a(-1) (input(-1) absent): IfDefined drops it.
    nnet = net(RECURRENT)
    g = build_computation_graph(nnet, request([("input", ts(range(4)))],
                                              [("output", ts(range(4)))]))
    expected = {(name, 0, t, 0) for t in range(4)
                for name in ("input", "a_input", "a", "output")}
    assert cindex_set(nnet, g) == expected
    assert deps_of(nnet, g, "a_input", Index(0, 0, 0)) == [("input", 0, 0, 0)]
    assert deps_of(nnet, g, "a_input", Index(0, 2, 0)) == [("a", 0, 1, 0), ("input", 0, 2, 0)]


def test_failover_uses_first_computable_alternative():
    nnet = net(FAILOVER)
    g = build_computation_graph(nnet, request([("input", ts(range(3)))],
                                              [("output", ts(range(3)))]))
    assert deps_of(nnet, g, "a_input", Index(0, 0, 0)) == [("input", 0, 0, 0)]
    assert deps_of(nnet, g, "a_input", Index(0, 1, 0)) == [("input", 0, 0, 0)]
    assert deps_of(nnet, g, "a_input", Index(0, 2, 0)) == [("input", 0, 1, 0)]
    # input(2) is supplied but unused: still kept, like every supplied input.
    assert ("input", 0, 2, 0) in cindex_set(nnet, g)


def test_replace_index_and_round():
    nnet = net(IVECTOR)
    inputs = [("input", [Index(n, t, 0) for t in range(6) for n in range(2)]),
              ("ivector", [Index(n, 0, 0) for n in range(2)])]
    outputs = [("output", [Index(n, t, 0) for t in range(6) for n in range(2)])]
    g = build_computation_graph(nnet, request(inputs, outputs))
    assert deps_of(nnet, g, "a_input", Index(1, 4, 0)) == [("input", 1, 4, 0),
                                                          ("ivector", 1, 0, 0)]
    # Round(a, 3) maps t to the multiple of 3 at or below it.
    assert deps_of(nnet, g, "output", Index(0, 5, 0)) == [("a", 0, 3, 0), ("a", 0, 5, 0)]
    assert deps_of(nnet, g, "output", Index(1, 2, 0)) == [("a", 1, 0, 0), ("a", 1, 2, 0)]
    got = cindex_set(nnet, g)
    assert {c for c in got if c[0] == "a"} == {("a", n, t, 0) for n in range(2) for t in range(6)}
    # an ivector at t=1 would not be reachable: Round/ReplaceIndex never ask for it.
    inputs[1] = ("ivector", [Index(n, t, 0) for n in range(2) for t in range(2)])
    g2 = build_computation_graph(nnet, request(inputs, outputs))
    c = g2.get_cindex_id(Cindex(nnet.get_node_index("ivector"), Index(0, 1, 0)))
    assert c >= 0 and g2.is_input[c]
    assert not any(c in d for d in g2.dependencies)


def test_not_computable_names_outputs_and_missing_input():
    nnet = net(CONTEXT)
    req = request([("input", ts(range(7)))], [("output", ts(range(6)))])
    with pytest.raises(NotComputableError) as e:
        build_computation_graph(nnet, req)
    err = e.value
    # output(t) needs input(t+1..t+3): t = 4, 5 need input(7), input(8).
    assert [(name, tuple(i)) for name, i in err.outputs] == [("output", (0, 4, 0)),
                                                               ("output", (0, 5, 0))]
    assert err.missing == ("input", Index(0, 7, 0))
    assert "2 of 6 requested output indexes" in str(err)
    assert "input(0, 7, 0), which the request does not supply" in str(err)
    assert err.details and err.details[0].startswith("output(0, 4, 0) is kNotComputable")


def test_recurrence_far_from_zero_terminates_quickly():
    nnet = net(RECURRENT)
    t0 = 10 ** 7
    g = build_computation_graph(nnet, request([("input", ts(range(t0, t0 + 50)))],
                                              [("output", ts(range(t0, t0 + 50)))]))
    # nothing beyond the 50 frames was explored (a(t0 - 1) is not followed down to t=0)
    assert len(g.cindexes) == 200
    assert deps_of(nnet, g, "a_input", Index(0, t0, 0)) == [("input", 0, t0, 0)]


def test_uncomputable_recurrence_raises_instead_of_hanging():
    # Without IfDefined, a(t) needs a(t-1) forever back: nothing is computable.
    cfg = RECURRENT.replace("IfDefined(Offset(a, -1))", "Offset(a, -1)")
    nnet = net(cfg)
    with pytest.raises(NotComputableError) as e:
        build_computation_graph(nnet, request([("input", ts(range(-5, 1000)))],
                                              [("output", ts([500]))]))
    assert e.value.missing == ("input", Index(0, -6, 0))


def test_two_segments_share_one_graph():
    # A looped computation: segment 2's a_input(4) reads a(3) from segment 1.
    nnet = net(RECURRENT)
    g = ComputationGraph()
    build_computation_graph(nnet, request([("input", ts(range(4)))],
                                          [("output", ts(range(4)))]), g)
    assert g.segment_ends == [16]
    build_computation_graph(nnet, request([("input", ts(range(4, 8)))],
                                          [("output", ts(range(4, 8)))]), g)
    assert g.segment_ends == [16, 32]
    c = g.get_cindex_id(Cindex(nnet.get_node_index("a_input"), Index(0, 4, 0)))
    assert c >= 16
    a3 = g.get_cindex_id(Cindex(nnet.get_node_index("a"), Index(0, 3, 0)))
    assert a3 < 16 and a3 in g.dependencies[c]


def test_request_errors_from_the_builder():
    nnet = net(CHAIN)
    with pytest.raises(RequestError, match="no input node named 'nope'"):
        build_computation_graph(nnet, request([("nope", ts([0]))], [("output", ts([0]))]))
    with pytest.raises(RequestError, match="listed more than once"):
        build_computation_graph(nnet, request([("input", ts([0, 0]))], [("output", ts([0]))]))


def test_graph_ids_and_renumber():
    g = ComputationGraph()
    a, new = g.get_or_add(Cindex(0, Index(0, 1, 0)), True)
    assert (a, new) == (0, True)
    assert g.get_or_add((0, (0, 1, 0))) == (0, False)
    b, _ = g.get_or_add(Cindex(1, Index(0, 1, 0)))
    c, _ = g.get_or_add(Cindex(2, Index(0, 1, 0)))
    g.dependencies[c] = [a]
    g.renumber(0, [True, False, True])
    assert g.cindexes == [Cindex(0, Index(0, 1, 0)), Cindex(2, Index(0, 1, 0))]
    assert g.dependencies == [[], [0]]
    assert g.get_cindex_id(Cindex(1, Index(0, 1, 0))) == -1
    assert g.get_cindex_id(Cindex(2, Index(0, 1, 0))) == 1
    assert g.is_input == [True, False]
