"""Per-network facts kept between compilations (graph_nodes.node_table_for and the
compiler's facts stored with the table): reused while the network is unchanged,
remade when it is edited, and never changing what a compilation produces."""

import gc
import weakref

import numpy as np

from engine.compiler.compiler import compile_computation
from engine.compiler.graph_nodes import NodeTable, node_table_for
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.serialize import computation_to_data
from engine.core.index import Index
from engine.nnet.nnet import Nnet
from engine.nnet.random_config import GenerationOptions, generate_config_sequence, random_request

NET = """
input-node name=input dim=4
component name=a type=AffineComponent input-dim=12 output-dim=6
component-node name=a component=a input=Append(Offset(input, -1), input, Offset(input, 1))
component name=bn type=BatchNormComponent dim=6
component-node name=bn component=bn input=a
dim-range-node name=d input-node=bn dim-offset=2 dim=3
component name=b type=AffineComponent input-dim=9 output-dim=5
component-node name=b component=b input=Append(Offset(d, -2), bn)
component name=c type=AffineComponent input-dim=6 output-dim=5
component-node name=c component=c input=bn
output-node name=output input=Sum(b, Scale(0.5, Offset(c, 1)))
"""


def _request(deriv: bool = True) -> ComputationRequest:
    ins = [Index(0, t, 0) for t in range(-4, 12)]
    outs = [Index(0, t, 0) for t in range(0, 8)]
    return ComputationRequest([IoSpecification("input", ins, deriv)],
                              [IoSpecification("output", outs, deriv)],
                              need_model_derivative=deriv)


def _data(nnet, req):
    return computation_to_data(compile_computation(nnet, [req]))


def _fresh(nnet, req):
    """What a network never compiled before gives (a copy: nothing cached for it)."""
    return _data(nnet.copy(), req)


def test_table_reused_while_unchanged():
    nnet = Nnet.from_config(NET)
    t1 = node_table_for(nnet)
    assert node_table_for(nnet) is t1
    req = _request()
    first = _data(nnet, req)
    assert node_table_for(nnet) is t1 and t1.extra     # the compiler kept its facts
    assert _data(nnet, req) == first == _fresh(nnet, req)


def test_descriptor_edit_invalidates():
    nnet = Nnet.from_config(NET)
    req = _request()
    before = _data(nnet, req)
    t1 = node_table_for(nnet)
    nnet.read_config("output-node name=output input=Sum(b, Scale(0.25, Offset(c, -1)))")
    assert node_table_for(nnet) is not t1
    after = _data(nnet, req)
    assert after == _fresh(nnet, req)
    assert after != before


def test_scale_only_edit_invalidates():
    # the same structure, another scale: only the compiler's facts see the difference
    nnet = Nnet.from_config(NET)
    req = _request()
    _data(nnet, req)
    nnet.read_config("output-node name=output input=Sum(b, Scale(0.75, Offset(c, 1)))")
    after = _data(nnet, req)
    assert after == _fresh(nnet, req)
    alphas = {c[1] for c in after["commands"] if len(c) > 1 and isinstance(c[1], float)}
    assert 0.75 in alphas


def test_component_property_change_invalidates():
    nnet = Nnet.from_config(NET)
    req = _request()
    train = _data(nnet, req)
    t1 = node_table_for(nnet)
    nnet.set_test_mode(True)         # batch-norm stops using memos and storing stats
    assert node_table_for(nnet) is not t1
    test = _data(nnet, req)
    assert test == _fresh(nnet, req)
    assert test != train


def test_component_and_node_replacement_invalidate():
    nnet = Nnet.from_config(NET)
    req = _request()
    _data(nnet, req)
    # a component replaced by one of another dim, and the dim-range node moved
    nnet.read_config("component name=a type=AffineComponent input-dim=12 output-dim=8\n"
                     "component name=bn type=BatchNormComponent dim=8\n"
                     "dim-range-node name=d input-node=bn dim-offset=0 dim=1\n"
                     "component name=b type=AffineComponent input-dim=9 output-dim=5\n"
                     "component name=c type=AffineComponent input-dim=8 output-dim=5")
    after = _data(nnet, req)
    assert after == _fresh(nnet, req)
    assert any(m[1] == 8 for m in after["matrices"])
    # dim-range nodes edited in place (their fields enter the signature)
    node = nnet.nodes[nnet.get_node_index("d")]
    node.dim_offset = 3
    assert _data(nnet, req) == _fresh(nnet, req)


def test_cache_does_not_keep_network_alive():
    nnet = Nnet.from_config(NET)
    _data(nnet, _request())
    ref = weakref.ref(nnet)
    table = node_table_for(nnet)
    assert table.nnet is nnet
    del nnet
    gc.collect()
    assert ref() is None
    assert table.nnet is None


def test_unhashable_network_is_not_cached():
    class Unhashable(Nnet):
        def __eq__(self, other):
            return self is other
        __hash__ = None

    nnet = Unhashable()
    nnet.read_config(NET)
    t1 = node_table_for(nnet)
    assert isinstance(t1, NodeTable) and node_table_for(nnet) is not t1
    req = _request()
    assert _data(nnet, req) == _data(Nnet.from_config(NET), req)


def test_random_networks_recompiled_after_edits_match_fresh():
    opts = GenerationOptions(dim_scale=0.3)
    for seed in range(12):
        rng = np.random.default_rng(500 + seed)
        nnet = generate_config_sequence(rng, opts).build(rng)
        req = random_request(nnet, rng)
        first = _data(nnet, req)
        assert _data(nnet, req) == first == _fresh(nnet, req)
        nnet.set_test_mode(True)
        assert _data(nnet, req) == _fresh(nnet, req)


CHAIN_NET = """
input-node name=input dim=4
component name=a type=AffineComponent input-dim=12 output-dim=6
component-node name=a component=a input=Append(Offset(input, -1), input, Offset(input, 1))
component name=r type=RectifiedLinearComponent dim=6
component-node name=r component=r input=a
component name=bn type=BatchNormComponent dim=6
component-node name=bn component=bn input=r
component name=o type=AffineComponent input-dim=6 output-dim=3
component-node name=o component=o input=bn
output-node name=output input=o
"""


def test_graph_chains_kept_with_the_table_and_remade_on_edit(monkeypatch):
    """The array graph builder's chains (graph_arrays._chains: nodes read by one
    node only, expanded with their reader) live with the NodeTable: an edit that
    gives a chain node a second reader makes a new table whose chains stop there,
    and the computation is what a fresh network gives.  (The interval build, which
    takes this network's requests, is switched off: its plan is the next test's.)"""
    import engine.compiler.graph_intervals as gi
    from engine.compiler.graph_arrays import _chains
    monkeypatch.setattr(gi, "ENABLED", False)
    nnet = Nnet.from_config(CHAIN_NET)
    req = _request(deriv=False)
    before = _data(nnet, req)
    t1 = node_table_for(nnet)
    chains1 = t1.extra["graph_chains"]
    assert _chains(t1, list(range(len(t1.kind)))) is chains1       # kept, not remade
    r_node = nnet.get_node_index("r")
    assert any(r_node in ch[:-1] for ch in chains1)                 # r is inside a chain
    nnet.read_config("output-node name=output2 input=r")
    req2 = ComputationRequest(req.inputs, req.outputs + [IoSpecification(
        "output2", [Index(0, t, 0) for t in range(0, 8)], False)])
    t2 = node_table_for(nnet)
    assert t2 is not t1
    assert "graph_chains" not in t2.extra
    after = _data(nnet, req2)
    chains2 = t2.extra["graph_chains"]
    assert not any(r_node in ch[:-1] for ch in chains2)             # r has two readers now
    assert after == _fresh(nnet, req2)
    assert _data(nnet, req) == _fresh(nnet, req)
    assert before["commands"] == _data(nnet, req)["commands"]


def test_graph_interval_plan_kept_with_the_table_and_remade_on_edit():
    """The interval graph build's plan (graph_intervals.plan_for) lives with the
    NodeTable: made once, and made again for the new table after an edit (here a
    second reader of a node), the computation being what a fresh network gives."""
    from engine.compiler.graph_intervals import plan_for
    nnet = Nnet.from_config(CHAIN_NET)
    req = _request(deriv=False)
    _data(nnet, req)
    t1 = node_table_for(nnet)
    plan1 = t1.extra["graph_interval_plan"]
    assert plan1 is not None and plan_for(t1) is plan1
    nnet.read_config("output-node name=output2 input=r")
    t2 = node_table_for(nnet)
    assert t2 is not t1 and "graph_interval_plan" not in t2.extra
    req2 = ComputationRequest(req.inputs, req.outputs + [IoSpecification(
        "output2", [Index(0, t, 0) for t in range(0, 8)], False)])
    assert _data(nnet, req2) == _fresh(nnet, req2)
    plan2 = t2.extra["graph_interval_plan"]
    assert plan2 is not None and plan2 is not plan1
