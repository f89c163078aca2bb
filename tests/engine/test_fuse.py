"""Sibling-affine fusion (engine/optimizer/fuse.py) and the decoding network that
prepare_nnet builds with it: which nodes are fused and which are not, outputs and
input derivatives equal to the unfused network's on random networks, the BLSTM of
the test data (fewer commands, the same peak bytes, the same decode), streaming."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.shortcut import compile_request
from engine.core.index import Index
from engine.inference.common import prepare_nnet
from engine.nnet.model_io import load_model
from engine.nnet.nnet import Nnet, NodeType
from engine.nnet.random_config import (GENERATOR_NAMES, generate_config_sequence,
                                       random_inputs, random_output_derivs, random_request)
from engine.optimizer.fuse import fuse_sibling_affines
from engine.runtime.executor import run_computation

DATA = Path(__file__).resolve().parents[1] / "data"
BLSTM = DATA / "inference" / "blstm" / "model.raw"

# A recurrence h(t) <- h(t-1) through three gate-like affines on one input (one of
# them Fixed), an affine on another descriptor, a linear on the same input (not a
# fusable type), and a dim-range node over a member; outside the recurrence, an affine
# on the same input for a second output (not fused: no recurrence, another output).
SIBLINGS = """
input-node name=input dim=6
component name=a type=AffineComponent input-dim=28 output-dim=5
component name=b type=NaturalGradientAffineComponent input-dim=28 output-dim=4
component name=c type=FixedAffineComponent input-dim=28 output-dim=3
component name=d type=AffineComponent input-dim=28 output-dim=4
component name=lin type=LinearComponent input-dim=28 output-dim=4
component name=x type=AffineComponent input-dim=28 output-dim=2
component name=tanh type=TanhComponent dim=22
component-node name=a component=a input=Append(input, IfDefined(Offset(h, -1)))
component-node name=b component=b input=Append(input, IfDefined(Offset(h, -1)))
component-node name=c component=c input=Append(input, IfDefined(Offset(h, -1)))
component-node name=d component=d input=Append(input, IfDefined(Offset(h, -2)))
component-node name=lin component=lin input=Append(input, IfDefined(Offset(h, -1)))
dim-range-node name=b_tail input-node=b dim-offset=1 dim=2
component-node name=h component=tanh input=Append(a, IfDefined(Offset(b, -2)), c, b_tail, lin, d)
component-node name=x component=x input=Append(input, IfDefined(Offset(h, -1)))
output-node name=output input=h
output-node name=output-x input=x
"""


def _nnet(text: str, seed: int = 0) -> Nnet:
    nnet = Nnet.from_config(text, rng=np.random.default_rng(seed))
    nnet.set_test_mode(True)
    return nnet


def _request(nnet: Nnet, frames: int = 5, seqs: int = 2, deriv: bool = False,
             outputs=("output",)) -> ComputationRequest:
    ins = [Index(n, t, 0) for n in range(seqs) for t in range(-4, frames + 4)]
    outs = [Index(n, t, 0) for n in range(seqs) for t in range(frames)]
    return ComputationRequest([IoSpecification("input", ins, deriv)],
                              [IoSpecification(o, outs, deriv) for o in outputs])


def run_request(nnet, request, seed: int = 1):
    """(outputs, input derivatives, stats) of ``request`` on ``nnet``, random inputs and
    output derivatives drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    inputs = random_inputs(nnet, request, rng)
    derivs = random_output_derivs(nnet, request, rng) or None
    comp = compile_request(nnet, request, None)
    outs, in_derivs, _ = run_computation(comp, nnet, inputs, derivs)
    return outs, in_derivs, comp.stats()


def assert_dicts_close(a: dict, b: dict) -> None:
    """The same keys, the arrays equal to float32 rounding of their scale."""
    assert a.keys() == b.keys()
    for k in a:
        scale = 1.0 + float(np.abs(a[k]).max()) if a[k].size else 1.0
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5 * scale, err_msg=k)


def component_kinds(nnet: Nnet) -> dict[str, str]:
    """Component node name -> its component's type."""
    return {n.name: nnet.components[n.component_index].type_name for n in nnet.nodes
            if n.type == NodeType.COMPONENT}


def input_text(nnet: Nnet, name: str) -> str:
    """The input descriptor of component node ``name``, as text."""
    return nnet.nodes[nnet.get_node_index(name) - 1].descriptor.write(nnet.node_names)


def assert_split_columns(whole: Nnet, split: Nnet, name: str, x_cols, r_cols,
                         r_suffix: str) -> None:
    """The halves of split node ``name``: W_x and W_r are the original's columns, the
    bias on the x half only."""
    w = whole.get_component_by_name(name)
    wx = split.get_component_by_name(f"{name}.x")
    wr = split.get_component_by_name(f"{name}.{r_suffix}")
    np.testing.assert_array_equal(wx.linear_params, w.linear_params[:, x_cols])
    np.testing.assert_array_equal(wr.linear_params, w.linear_params[:, r_cols])
    np.testing.assert_array_equal(wx.bias_params, w.bias_params)
    assert not wr.bias_params.any()


def test_groups_fused_and_kept_apart():
    nnet = _nnet(SIBLINGS)
    before = nnet.config_text()
    fused = fuse_sibling_affines(nnet)
    assert nnet.config_text() == before            # the caller's network is untouched
    kinds = {node.name: node.type for node in fused.nodes}
    # a, b, c (Affine, NG-Affine, FixedAffine on one input, one recurrence) fused
    for name in ("a", "b", "c"):
        assert kinds[name] == NodeType.DIM_RANGE, name
    # another descriptor, another type, outside the recurrence: unchanged
    for name in ("d", "lin", "x"):
        assert kinds[name] == NodeType.COMPONENT, name
    f = fused.get_node_index("a.fused")
    assert fused.nodes[f].type == NodeType.COMPONENT
    comp = fused.get_component(fused.nodes[f].component_index)
    assert type(comp).__name__ == "AffineComponent" and comp.linear_params.shape == (12, 28)
    offsets = {name: (fused.nodes[fused.get_node_index(name)].node_index,
                      fused.nodes[fused.get_node_index(name)].dim_offset,
                      fused.nodes[fused.get_node_index(name)].dim)
               for name in ("a", "b", "c", "b_tail")}
    assert offsets == {"a": (f, 0, 5), "b": (f, 5, 4), "c": (f, 9, 3), "b_tail": (f, 6, 2)}
    # the parameters are the members', stacked in node order
    np.testing.assert_array_equal(comp.linear_params[5:9],
                                  nnet.get_component_by_name("b").linear_params)
    np.testing.assert_array_equal(comp.bias_params[9:],
                                  nnet.get_component_by_name("c").bias_params)
    assert fused.get_component_index("a") == -1 and fused.get_component_index("b") == -1
    fused.validate(allow_orphans=False)


@pytest.mark.parametrize("deriv", [False, True])
def test_siblings_same_outputs_and_input_derivatives(deriv):
    nnet = _nnet(SIBLINGS)
    fused = fuse_sibling_affines(nnet)
    req = _request(nnet, deriv=deriv, outputs=("output", "output-x"))
    o1, d1, s1 = run_request(nnet, req)
    o2, d2, s2 = run_request(fused, req)
    assert_dicts_close(o1, o2)
    assert_dicts_close(d1, d2)
    assert s2["commands"] < s1["commands"]


def test_fused_name_is_unique():
    text = SIBLINGS.replace("component name=x type", "component name=a.fused type").replace(
        "component-node name=x component=x", "component-node name=a.fused component=a.fused"
    ).replace("output-node name=output-x input=x", "output-node name=output-x input=a.fused")
    fused = fuse_sibling_affines(_nnet(text))
    assert fused.get_node_index("a.fused2") >= 0
    assert fused.nodes[fused.get_node_index("a.fused")].type == NodeType.COMPONENT
    assert fused.get_component_by_name("a.fused").linear_params.shape == (2, 28)


def test_nothing_to_fuse_leaves_the_structure():
    nnet = _nnet(SIBLINGS.replace("name=a component=a input=Append(input, IfDefined(Offset("
                                  "h, -1)))", "name=a component=a input=Append(input, "
                                  "IfDefined(Offset(h, -3)))"))
    # a no longer shares b's and c's input: b and c still are siblings
    fused = fuse_sibling_affines(nnet)
    assert fused.nodes[fused.get_node_index("a")].type == NodeType.COMPONENT
    assert fused.nodes[fused.get_node_index("b")].type == NodeType.DIM_RANGE
    plain = _nnet("input-node name=input dim=3\ncomponent name=a type=AffineComponent "
                  "input-dim=3 output-dim=2\ncomponent-node name=a component=a input=input\n"
                  "output-node name=output input=a\n")
    assert fuse_sibling_affines(plain).config_text() == plain.config_text()


@pytest.mark.parametrize("seed", range(60))
def test_random_networks_fused_equal_unfused(seed):
    """Every generator's networks (the LSTMs have four gate affines on one input):
    outputs and input derivatives of the fused network equal the network's own;
    fewer commands wherever something was fused, and peak bytes within the range
    measured on such networks (engine/optimizer/fuse.py: -26% to +18%)."""
    rng = np.random.default_rng(7000 + seed)
    kind = ("lstm", "lstm_truncation")[seed % 2] if seed < 20 else \
        GENERATOR_NAMES[seed % len(GENERATOR_NAMES)]
    net = generate_config_sequence(rng, kind=kind)
    nnet = net.build(np.random.default_rng(seed))
    fused = fuse_sibling_affines(nnet)
    if kind.startswith("lstm"):
        assert fused.num_nodes() < nnet.num_nodes(), "the LSTM's gate affines were not fused"
    req = random_request(nnet, rng, need_deriv=True)
    o1, d1, s1 = run_request(nnet, req, seed)
    o2, d2, s2 = run_request(fused, req, seed)
    assert_dicts_close(o1, o2)
    assert_dicts_close(d1, d2)
    if fused.num_nodes() < nnet.num_nodes():
        assert s2["commands"] < s1["commands"], (s1, s2)
        assert s2["peak_bytes"] <= 1.2 * s1["peak_bytes"], (s1, s2)
    else:
        assert s2 == s1


def test_blstm_decoding_network():
    """The reference BLSTM (Kaldi "lstmp-layer" cells of sigmoid, tanh and product nodes)
    as a decoding network: each direction's cell one LstmNonlinearityComponent over the
    stacked gate affine (engine.optimizer.fast_lstm), that affine split; chunk requests:
    under a fourth of the commands, the same output."""
    raw = load_model(str(BLSTM)).nnet
    stored, decoding = prepare_nnet(raw, collapse=False), prepare_nnet(raw)
    kinds = {type(c).__name__ for c in decoding.components}
    assert not kinds & {"SigmoidComponent", "TanhComponent", "ElementwiseProductComponent",
                        "NaturalGradientPerElementScaleComponent"}, kinds
    for d in ("forward", "backward"):
        lstm = f"blstm1-{d}.lstm_nonlin"
        assert decoding.get_component_by_name(lstm).type_name == "LstmNonlinearityComponent"
        for name, offset in ((f"blstm1-{d}.c_t", 0), (f"blstm1-{d}.m_t", 128)):
            node = decoding.nodes[decoding.get_node_index(name)]
            assert node.type == NodeType.DIM_RANGE and node.dim_offset == offset
            assert decoding.node_names[node.node_index] == lstm
        # the stacked gate affine split: its input half (lda, 200 columns, which the
        # second collapse folds in: a 200 x 200 FixedAffine) out of the loop, its
        # recurrent half (32 columns) in it, summed where the nonlinearity reads them
        w_all = f"blstm1-{d}.W_all"
        assert decoding.get_component_by_name(f"{w_all}.r").linear_params.shape == (512, 32)
        assert decoding.get_component_by_name(f"lda.{w_all}.x").linear_params.shape == (512,
                                                                                       200)
        assert decoding.nodes[decoding.get_node_index(lstm) - 1].descriptor.write(
            decoding.node_names).startswith(f"Append(Sum({w_all}.x, {w_all}.r), IfDefined(")
    assert decoding.get_component_index("lda") == -1
    # the recurrent projections' truncation r_t (forward identity) became a dim-range
    # node over rp_t (engine.optimizer.aliases)
    assert decoding.nodes[decoding.get_node_index("blstm1-forward.r_t")].type == \
        NodeType.DIM_RANGE
    assert (decoding.num_components(), stored.num_components()) == (10, 39)
    # preparing a prepared network changes nothing (streams and inferencers may be given one)
    assert prepare_nnet(decoding).config_text() == decoding.config_text()
    for frames, seqs in ((21, 1), (30, 2)):
        left, right = 24, 24
        ins = [Index(n, t, 0) for n in range(seqs) for t in range(-left, frames + right)]
        outs = [Index(n, t, 0) for n in range(seqs) for t in range(frames)]
        req = ComputationRequest([IoSpecification("input", ins)],
                                 [IoSpecification("output", outs)])
        o1, _, s1 = run_request(stored, req)
        o2, _, s2 = run_request(decoding, req)
        assert_dicts_close(o1, o2)
        assert s2["commands"] < 0.25 * s1["commands"], (s1, s2)
        # the split's input halves are computed for every frame before the loop and
        # live through it: memory traded for speed (37-51% more here; fuse.py)
        assert s1["peak_bytes"] < s2["peak_bytes"] <= 1.6 * s1["peak_bytes"], (s1, s2)


def _streams(nnet, seed: int, frames: int, chunk: int, cut: int):
    """The outputs of a looped stream (chunk size ``chunk``, frames pushed in two parts
    cut at ``cut``) on the network as stored and on the decoding network, and the
    decoding network."""
    from engine.inference import LoopedConfig, LoopedModel  # noqa: PLC0415
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((frames, nnet.input_dim("input"))).astype(np.float32)
    got, decoding = {}, None
    for collapse in (False, True):
        model = LoopedModel(nnet, LoopedConfig(chunk, 0, 1), collapse=collapse)
        s = model.stream()
        got[collapse] = np.concatenate([s.push(x[:cut]), s.push(x[cut:]), s.finish()])
        decoding = model.nnet
    return got[False], got[True], decoding


def test_streaming_fused_and_unfused():
    """A looped stream on the decoding network (siblings on the recurrence fused)
    gives the stream of the network as stored."""
    stored, decoded, decoding = _streams(_nnet(SIBLINGS), 3, 37, 5, 13)
    assert any(n.name.endswith(".fused") for n in decoding.nodes)
    np.testing.assert_allclose(decoded, stored, rtol=1e-5, atol=1e-5)


# -- splitting recurrent affines (split_recurrent_affines_in_place) ----------------------------

# A recurrence h(t) <- h(t-1), h(t-2) through affines whose inputs mix outside parts
# (input at several offsets) and recurrent ones, in any order: ``a`` splits (outside
# columns 0-9 and 14-23, recurrent 10-13, the recurrent part not wrapped in IfDefined
# behind a Failover) and, read only as a term of a Sum(), is replaced there by the
# Sum() of its halves; ``b`` (NaturalGradient) splits and, read through a dim-range node
# and at an offset, stays as a no-op over that Sum(); ``c`` is mostly recurrent (kept
# whole); ``d`` reads only the outside (on no recurrence: kept); ``e`` is a Linear (not
# an affine type: kept).
SPLITS = """
input-node name=input dim=10
component name=a type=AffineComponent input-dim=24 output-dim=4
component name=b type=NaturalGradientAffineComponent input-dim=18 output-dim=6
component name=c type=AffineComponent input-dim=22 output-dim=4
component name=d type=AffineComponent input-dim=10 output-dim=4
component name=e type=LinearComponent input-dim=14 output-dim=4
component name=tanh type=TanhComponent dim=4
component name=sig type=SigmoidComponent dim=6
component-node name=a component=a input=Append(Offset(input, -1), Failover(Offset(h, -1), Offset(d, 5)), input)
component-node name=b component=b input=Append(input, IfDefined(Offset(h, -2)), IfDefined(Offset(h, -1)))
dim-range-node name=b_mid input-node=b dim-offset=1 dim=4
component-node name=c component=c input=Append(IfDefined(Offset(h, -1)), IfDefined(Offset(h, -2)), IfDefined(Offset(h, -3)), Offset(input, 1))
component-node name=d component=d input=input
component-node name=e component=e input=Append(input, IfDefined(Offset(h, -1)))
component-node name=g component=sig input=Sum(b, Offset(b, -1))
component-node name=h component=tanh input=Sum(Sum(a, b_mid), Sum(Sum(c, d), e))
output-node name=output input=h
output-node name=output-g input=g
"""


def test_split_nodes_and_columns():
    from engine.optimizer.fuse import split_recurrent_affines_in_place
    nnet = _nnet(SPLITS)
    split = nnet.copy()
    assert split_recurrent_affines_in_place(split) == 2
    names = split.node_names
    kinds = component_kinds(split)
    assert "a" not in names and kinds["b"] == "NoOpComponent"
    assert kinds["a.x"] == kinds["a.r"] == kinds["b.x"] == kinds["b.r"] == "AffineComponent"
    assert kinds["c"] == kinds["d"] == "AffineComponent" and kinds["e"] == "LinearComponent"

    def text(name):
        return input_text(split, name)
    assert text("h") == "Sum(Sum(Sum(a.x, a.r), b_mid), Sum(Sum(c, d), e))"
    assert text("b") == "Sum(b.x, b.r)"
    assert text("a.x") == "Append(Offset(input, -1), input)"
    assert text("a.r") == "Failover(Offset(h, -1), Offset(d, 5))"
    assert text("b.x") == "input"
    assert text("b.r") == "Append(IfDefined(Offset(h, -2)), IfDefined(Offset(h, -1)))"
    # the columns: W_x and W_r are the original's, bias on the outside half only
    for name, x_cols, r_cols in (("a", np.r_[0:10, 14:24], np.r_[10:14]),
                                 ("b", np.r_[0:10], np.r_[10:18])):
        assert_split_columns(nnet, split, name, x_cols, r_cols, "r")
    # references to a split node by name (dim-range node, offsets) are unchanged
    b_mid = split.nodes[split.get_node_index("b_mid")]
    assert names[b_mid.node_index] == "b" and (b_mid.dim_offset, b_mid.dim) == (1, 4)
    assert text("g") == "Sum(b, Offset(b, -1))"
    split.validate(allow_orphans=False)
    # nothing left to split
    assert split_recurrent_affines_in_place(split.copy()) == 0


@pytest.mark.parametrize("deriv", [False, True])
def test_split_same_outputs_and_input_derivatives(deriv):
    from engine.optimizer.fuse import split_recurrent_affines_in_place
    nnet = _nnet(SPLITS)
    split = nnet.copy()
    split_recurrent_affines_in_place(split)
    req = _request(nnet, frames=7, deriv=deriv, outputs=("output", "output-g"))
    o1, d1, s1 = run_request(nnet, req)
    o2, d2, s2 = run_request(split, req)
    assert_dicts_close(o1, o2)
    assert_dicts_close(d1, d2)


@pytest.mark.parametrize("seed", range(24))
def test_random_networks_split_equal_whole(seed):
    """Random LSTMs and networks of every generator, fused as decoding networks are:
    split, outputs and input derivatives equal those of the unsplit network."""
    from engine.optimizer.fuse import split_recurrent_affines_in_place
    rng = np.random.default_rng(7100 + seed)
    kind = ("lstm", "lstm_truncation")[seed % 2] if seed < 16 else \
        GENERATOR_NAMES[seed % len(GENERATOR_NAMES)]
    net = generate_config_sequence(rng, kind=kind)
    nnet = fuse_sibling_affines(net.build(np.random.default_rng(seed)))
    split = nnet.copy()
    count = split_recurrent_affines_in_place(split)
    if kind.startswith("lstm"):
        assert count > 0, "the LSTM's gate affine was not split"
    req = random_request(nnet, rng, need_deriv=True)
    o1, d1, _ = run_request(nnet, req, seed)
    o2, d2, _ = run_request(split, req, seed)
    assert_dicts_close(o1, o2)
    assert_dicts_close(d1, d2)
    if count == 0:
        assert split.config_text() == nnet.config_text()


def test_streaming_split_and_whole():
    """A looped stream on the decoding network (recurrent affines split) gives the
    stream of the network as stored."""
    stored, decoded, decoding = _streams(_nnet(SPLITS), 4, 41, 6, 17)
    assert decoding.get_node_index("a.x") >= 0 > decoding.get_node_index("a")
    np.testing.assert_allclose(decoded, stored, rtol=1e-5, atol=1e-5)


def test_split_node_read_by_another_split_node():
    """Two recurrences, the second's affine reading the first's split affine as its
    outside part: that reference is substituted in the second's outside half too."""
    from engine.optimizer.fuse import split_recurrent_affines_in_place
    nnet = _nnet("""
input-node name=input dim=6
component name=a type=AffineComponent input-dim=9 output-dim=3
component name=b type=AffineComponent input-dim=6 output-dim=3
component name=tanh type=TanhComponent dim=3
component-node name=a component=a input=Append(input, IfDefined(Offset(h1, -1)))
component-node name=h1 component=tanh input=a
component-node name=b component=b input=Append(a, IfDefined(Offset(h2, -1)))
component-node name=h2 component=tanh input=b
output-node name=output input=Sum(h1, h2)
""")
    split = nnet.copy()
    assert split_recurrent_affines_in_place(split) == 2
    names = split.node_names
    assert input_text(split, "b.x") == "Sum(a.x, a.r)"
    assert "a" not in names and "b" not in names
    req = _request(nnet, frames=6, deriv=True)
    o1, d1, _ = run_request(nnet, req)
    o2, d2, _ = run_request(split, req)
    assert_dicts_close(o1, o2)
    assert_dicts_close(d1, d2)
