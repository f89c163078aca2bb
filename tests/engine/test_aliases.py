"""Forward-identity nodes made aliases (engine/optimizer/aliases.py) and constant LSTM
dropout masks dropped (engine.optimizer.fast_lstm.drop_constant_dropout_masks_in_place):
which nodes change and which stay, the rewritten structure, outputs equal to the
original's offline and in looped streams."""

from __future__ import annotations

import numpy as np
import pytest

from engine.nnet.nnet import Nnet, NodeType
from engine.optimizer.aliases import alias_forward_identities_in_place
from engine.optimizer.fast_lstm import drop_constant_dropout_masks_in_place
from test_fast_lstm import assert_same_outputs, rewritten
from test_fuse import input_text


def _nnet(text: str) -> Nnet:
    nnet = Nnet.from_config(text, rng=np.random.default_rng(0))
    nnet.set_test_mode(True)
    return nnet


def _aliased(nnet: Nnet) -> tuple[Nnet, int]:
    return rewritten(nnet, alias_forward_identities_in_place)


# A recurrence h(t) <- h(t-1) with a truncation ``t1`` over h read at an offset, a
# clip ``t2`` over the truncation (an identity over an identity), a no-op ``t3`` over a
# dim-range node, and dim-range nodes over a truncation; outputs read them all.
SINGLE = """
input-node name=input dim=4
component name=a type=AffineComponent input-dim=10 output-dim=6
component name=tanh type=TanhComponent dim=6
component name=trunc type=BackpropTruncationComponent dim=6 scale=1.0
component name=clip type=ClipGradientComponent dim=6 clipping-threshold=1.0
component name=noop type=NoOpComponent dim=3
component name=b type=AffineComponent input-dim=11 output-dim=5
component-node name=a component=a input=Append(input, IfDefined(Offset(t1, -1)))
component-node name=h component=tanh input=a
component-node name=t1 component=trunc input=h
component-node name=t2 component=clip input=t1
dim-range-node name=h_tail input-node=h dim-offset=2 dim=3
component-node name=t3 component=noop input=h_tail
dim-range-node name=t1_head input-node=t1 dim-offset=0 dim=2
component-node name=b component=b input=Append(t2, Offset(t3, 1), t1_head)
output-node name=output input=b
output-node name=output-t input=Append(t1, Offset(t2, -1))
"""


def test_single_input_identities_become_aliases():
    nnet = _nnet(SINGLE)
    out, n = _aliased(nnet)
    assert n == 5       # three aliases, two of them (whole) then dropped
    nodes = {node.name: node for node in out.nodes}
    names = out.node_names
    # each an alias (a dim-range node) of the input or component node it reads, through
    # the chain t2 -> t1 -> h and through the dim-range node h_tail; those that cover
    # all of h (t1, t2) give way to h itself
    for name, src, offset, dim in (("t3", "h", 2, 3), ("t1_head", "h", 0, 2)):
        node = nodes[name]
        assert node.type == NodeType.DIM_RANGE, name
        assert (names[node.node_index], node.dim_offset, node.dim) == (src, offset, dim), name
    assert "t1" not in nodes and "t2" not in nodes and "h_tail" not in nodes
    assert input_text(out, "a") == "Append(input, IfDefined(Offset(h, -1)))"
    assert input_text(out, "b") == "Append(h, Offset(t3, 1), t1_head)"
    output_t = out.nodes[out.get_node_index("output-t")]
    assert output_t.descriptor.write(names) == "Append(h, Offset(h, -1))"
    kinds = {type(c).__name__ for c in out.components}
    assert not kinds & {"BackpropTruncationComponent", "ClipGradientComponent",
                        "NoOpComponent"}, kinds
    out.validate(allow_orphans=False)
    assert_same_outputs(nnet, out, names=("output", "output-t"))


# A network's own whole dim-range nodes: ``copy1`` and ``copy2`` over ``idct`` read as
# Kaldi's xconfig reads its delta copies (one sum naming them with scales -1 and 1: they
# stay), ``whole`` read plainly and at an offset (it gives way to ``idct``).
WHOLE = """
input-node name=input dim=4
component name=idct type=FixedAffineComponent input-dim=4 output-dim=4
component name=a type=AffineComponent input-dim=12 output-dim=3
component-node name=idct component=idct input=input
dim-range-node name=copy1 input-node=idct dim-offset=0 dim=4
dim-range-node name=copy2 input-node=idct dim-offset=0 dim=4
dim-range-node name=whole input-node=idct dim-offset=0 dim=4
component-node name=a component=a input=Append(Sum(Scale(-1.0, Offset(copy1, -1)), Offset(copy2, 1)), whole, Offset(whole, 1))
output-node name=output input=Append(a, Offset(whole, -1))
"""


def test_whole_dim_ranges_give_way_to_their_source():
    nnet = _nnet(WHOLE)
    out, n = _aliased(nnet)
    assert n == 1 and out.get_node_index("whole") == -1
    assert input_text(out, "a") == ("Append(Sum(Offset(Scale(-1, copy1), -1), "
                                    "Offset(copy2, 1)), idct, Offset(idct, 1))")
    names = out.node_names
    assert out.nodes[out.get_node_index("output")].descriptor.write(names) == \
        "Append(a, Offset(idct, -1))"
    for name in ("copy1", "copy2"):
        node = out.nodes[out.get_node_index(name)]
        assert node.type == NodeType.DIM_RANGE and names[node.node_index] == "idct"
    out.validate(allow_orphans=False)
    assert_same_outputs(nnet, out, frames=9)


@pytest.mark.parametrize("line", [
    "component name=trunc type=BackpropTruncationComponent dim=6 scale=0.5",
    "component name=trunc type=ScaleAndOffsetComponent dim=6",
], ids=["scaling-truncation", "another-type"])
def test_not_identities_stay(line):
    text = SINGLE.replace(
        "component name=trunc type=BackpropTruncationComponent dim=6 scale=1.0", line)
    nnet = _nnet(text)
    out, _ = _aliased(nnet)
    assert out.nodes[out.get_node_index("t1")].type == NodeType.COMPONENT


# A fast projected LSTM as Kaldi's xconfig writes it ("fast-lstmp-layer", delay -2,
# dropout mask), its truncation ``cr_trunc`` over Append(c, r) read through dim-range
# nodes only.
FAST_LSTMP = """
input-node name=input dim=4
component name=W_all type=AffineComponent input-dim=7 output-dim=20
component name=lstm_nonlin type=LstmNonlinearityComponent cell-dim=5 use-dropout=true
component name=dropout_mask type=DropoutMaskComponent output-dim=3 dropout-proportion={p}
component name=W_rp type=AffineComponent input-dim=5 output-dim=4
component name=cr_trunc type=BackpropTruncationComponent dim=8 scale=1.0
component name=final type=AffineComponent input-dim=4 output-dim=3
component-node name=W_all component=W_all input=Append(input, IfDefined(Offset(r_trunc, -2)))
component-node name=dropout_mask component=dropout_mask input=dropout_mask
component-node name=lstm_nonlin component=lstm_nonlin input=Append(W_all, IfDefined(Offset(c_trunc, -2)), dropout_mask)
dim-range-node name=c input-node=lstm_nonlin dim-offset=0 dim=5
dim-range-node name=m input-node=lstm_nonlin dim-offset=5 dim=5
component-node name=rp component=W_rp input=m
dim-range-node name=r input-node=rp dim-offset=0 dim=3
component-node name=cr_trunc component=cr_trunc input=Append(c, r)
dim-range-node name=c_trunc input-node=cr_trunc dim-offset=0 dim=5
dim-range-node name=r_trunc input-node=cr_trunc dim-offset=5 dim=3
component-node name=final component=final input=rp
output-node name=output input=final
"""


def test_appended_identity_read_through_dim_ranges_is_dropped():
    nnet = _nnet(FAST_LSTMP.format(p=0.0))
    out, n = _aliased(nnet)
    assert n == 1 and out.get_node_index("cr_trunc") == -1
    names = out.node_names
    for name, src, offset in (("c_trunc", "lstm_nonlin", 0), ("r_trunc", "rp", 0)):
        node = out.nodes[out.get_node_index(name)]
        assert (names[node.node_index], node.dim_offset) == (src, offset), name
    assert_same_outputs(nnet, out, frames=13)


def test_appended_identity_kept():
    # read by something other than a dim-range node
    text = FAST_LSTMP.format(p=0.0) + "output-node name=output-cr input=cr_trunc\n"
    out, n = _aliased(_nnet(text))
    assert n == 0 and out.get_node_index("cr_trunc") >= 0
    # parts computable at other frames (r from the input at t+1): IfDefined of a reader
    # would see more frames defined
    text = FAST_LSTMP.format(p=0.0).replace(
        "component-node name=rp component=W_rp input=m",
        "component name=W_x type=AffineComponent input-dim=4 output-dim=4\n"
        "component-node name=rp component=W_rp input=m\n"
        "component-node name=x component=W_x input=Offset(input, 1)").replace(
        "dim-range-node name=r input-node=rp", "dim-range-node name=r input-node=x")
    out, n = _aliased(_nnet(text))
    assert n == 0 and out.get_node_index("cr_trunc") >= 0


def test_constant_dropout_mask_dropped():
    nnet = _nnet(FAST_LSTMP.format(p=0.0))
    out = nnet.copy()
    assert drop_constant_dropout_masks_in_place(out) == 1
    lstm = out.get_component_by_name("lstm_nonlin")
    assert not lstm.use_dropout and lstm.input_dim() == 25
    assert nnet.get_component_by_name("lstm_nonlin").use_dropout   # the original is kept
    assert out.get_node_index("dropout_mask") == -1
    assert out.nodes[out.get_node_index("lstm_nonlin") - 1].descriptor.write(
        out.node_names) == "Append(W_all, IfDefined(Offset(c_trunc, -2)))"
    out.validate(allow_orphans=False)
    assert_same_outputs(nnet, out, frames=13)
    # a mask of 0.7 in test mode scales the gates: kept
    kept = _nnet(FAST_LSTMP.format(p=0.3))
    assert drop_constant_dropout_masks_in_place(kept) == 0
    assert kept.get_component_by_name("lstm_nonlin").use_dropout


def test_looped_stream_equals_the_stored_network():
    """A looped stream on the decoding network (mask dropped, truncation gone, W_all
    split) gives the stream of the network as stored."""
    from engine.inference import LoopedConfig, LoopedModel  # noqa: PLC0415
    nnet = _nnet(FAST_LSTMP.format(p=0.0))
    x = np.random.default_rng(7).standard_normal((31, 4)).astype(np.float32)
    got = {}
    for collapse in (False, True):
        model = LoopedModel(nnet, LoopedConfig(5, 0, 1), collapse=collapse)
        if collapse:
            assert model.nnet.get_node_index("cr_trunc") == -1
            assert model.nnet.get_node_index("dropout_mask") == -1
        s = model.stream()
        got[collapse] = np.concatenate([s.push(x[:12]), s.push(x[12:]), s.finish()])
    np.testing.assert_allclose(got[True], got[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(24))
def test_random_networks_decoding_equals_stored(seed):
    """Every generator's networks (Kaldi's GenerateConfigSequence kinds) through the whole
    decoding preparation (collapse, LSTM cells, masks, aliases, fusion, splitting): the
    outputs of the network as stored, to float32 rounding."""
    from engine.inference.common import prepare_nnet  # noqa: PLC0415
    from engine.nnet.random_config import (GENERATOR_NAMES,  # noqa: PLC0415
                                           generate_config_sequence, random_inputs,
                                           random_request)
    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    from engine.runtime.executor import run_computation  # noqa: PLC0415
    rng = np.random.default_rng(9100 + seed)
    kind = "lstm_truncation" if seed < 6 else GENERATOR_NAMES[seed % len(GENERATOR_NAMES)]
    nnet = generate_config_sequence(rng, kind=kind).build(np.random.default_rng(seed))
    stored, decoding = prepare_nnet(nnet, collapse=False), prepare_nnet(nnet)
    req = random_request(nnet, rng, need_deriv=False)
    inputs = random_inputs(nnet, req, rng)
    outs = [run_computation(compile_request(n, req, None), n, inputs, None)[0]
            for n in (stored, decoding)]
    for name in outs[0]:
        scale = 1.0 + float(np.abs(outs[0][name]).max())
        np.testing.assert_allclose(outs[1][name], outs[0][name], rtol=1e-4,
                                   atol=1e-4 * scale, err_msg=f"{kind} seed {seed} {name}")
    # no forward identity over a plain node is left (these generators' truncations scale
    # by 0.9-1.1 in the forward direction too: they stay)
    from engine.optimizer.node_table import NodeTable  # noqa: PLC0415
    table = NodeTable(decoding)
    for n in range(decoding.num_nodes()):
        comp = table.comp(n)
        if type(comp).__name__ in ("BackpropTruncationComponent", "ClipGradientComponent") \
                and getattr(comp, "scale_value", 1.0) == 1.0:
            parts = table.bare_parts(n)
            assert parts is None or len(parts) > 1, decoding.node_names[n]
