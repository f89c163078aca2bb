"""LSTM cells of sigmoid, tanh and product nodes rewritten as one LstmNonlinearityComponent
(engine/optimizer/fast_lstm.py): which cells are rewritten and which are left, the
rewritten network's structure, outputs equal to the original's offline and in looped
streams, and the same in the decoding networks prepare_nnet builds."""

from __future__ import annotations

import numpy as np
import pytest

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.shortcut import compile_request
from engine.core.index import Index
from engine.inference.common import prepare_nnet
from engine.nnet.model_io import load_model
from engine.nnet.nnet import Nnet, NodeType
from engine.nnet.random_config import random_inputs
from engine.optimizer.fast_lstm import convert_lstm_cells_in_place
from engine.runtime.executor import run_computation
from refdata import DATA

CELL = 6


def lstmp(name: str = "lstm1", delay: int = -1, c_type: str = "BackpropTruncationComponent",
          c_opts: str = "scale=1.0", extra: str = "", gate_input: str | None = None) -> str:
    """The nodes Kaldi's xconfig writes for an "lstmp-layer" (steps/libs/nnet3/xconfig/
    lstm.py), cell dim 6, recurrent and non-recurrent projections 3 + 2, reading
    ``input`` at t-1, t, t+1 and its own r_t at ``delay``."""
    x = "Offset(input, -1), input, Offset(input, 1)"
    gate_in = f"Append({x}, IfDefined(Offset({name}.r_t, {delay})))"
    delayed = f"IfDefined(Offset({name}.c_t, {delay}))"
    lines = []
    for g in ("i", "f", "o", "c"):
        lines.append(f"component name={name}.W_{g}.xr type=NaturalGradientAffineComponent "
                     f"input-dim={12 + 3} output-dim={CELL}")
    for g in ("i", "f", "o"):
        lines.append(f"component name={name}.w_{g}.c type=NaturalGradientPerElementScaleComponent "
                     f"dim={CELL} param-mean=0.0 param-stddev=1.0")
    for g, kind in (("i", "Sigmoid"), ("f", "Sigmoid"), ("o", "Sigmoid"), ("g", "Tanh"),
                    ("h", "Tanh")):
        lines.append(f"component name={name}.{g} type={kind}Component dim={CELL}")
    for p in ("c1", "c2", "m"):
        lines.append(f"component name={name}.{p} type=ElementwiseProductComponent "
                     f"input-dim={2 * CELL} output-dim={CELL}")
    lines += [
        f"component name={name}.c type={c_type} dim={CELL} {c_opts}",
        f"component name={name}.W_rp.m type=NaturalGradientAffineComponent input-dim={CELL} "
        f"output-dim=5",
        f"component name={name}.r type=BackpropTruncationComponent dim=3",
        f"component-node name={name}.c_t component={name}.c input=Sum({name}.c1_t, {name}.c2_t)",
        f"component-node name={name}.i1_t component={name}.W_i.xr input={gate_in}",
        f"component-node name={name}.i2_t component={name}.w_i.c input={delayed}",
        f"component-node name={name}.i_t component={name}.i input=Sum({name}.i1_t, {name}.i2_t)",
        f"component-node name={name}.f1_t component={name}.W_f.xr input={gate_in}",
        f"component-node name={name}.f2_t component={name}.w_f.c input={delayed}",
        f"component-node name={name}.f_t component={name}.f input=Sum({name}.f1_t, {name}.f2_t)",
        f"component-node name={name}.o1_t component={name}.W_o.xr input={gate_in}",
        f"component-node name={name}.o2_t component={name}.w_o.c input={name}.c_t",
        f"component-node name={name}.o_t component={name}.o input=Sum({name}.o1_t, {name}.o2_t)",
        f"component-node name={name}.h_t component={name}.h input={name}.c_t",
        f"component-node name={name}.g1_t component={name}.W_c.xr "
        f"input={gate_input or gate_in}",
        f"component-node name={name}.g_t component={name}.g input={name}.g1_t",
        f"component-node name={name}.c1_t component={name}.c1 input=Append({name}.f_t, {delayed})",
        f"component-node name={name}.c2_t component={name}.c2 input=Append({name}.i_t, {name}.g_t)",
        f"component-node name={name}.m_t component={name}.m input=Append({name}.o_t, {name}.h_t)",
        f"component-node name={name}.rp_t component={name}.W_rp.m input={name}.m_t",
        f"dim-range-node name={name}.r_t_preclip input-node={name}.rp_t dim-offset=0 dim=3",
        f"component-node name={name}.r_t component={name}.r input={name}.r_t_preclip",
    ]
    return "\n".join(lines) + "\n" + extra


def network(*layers: str, outputs: str = "", final: str = "lstm1.rp_t") -> Nnet:
    text = ("input-node name=input dim=4\n" + "".join(layers)
            + "component name=final type=AffineComponent input-dim=5 output-dim=7\n"
            + f"component-node name=final component=final input={final}\n"
            + "output-node name=output input=final\n" + outputs)
    nnet = Nnet.from_config(text, rng=np.random.default_rng(0))
    nnet.set_test_mode(True)
    return nnet


def rewritten(nnet: Nnet, rewrite) -> tuple[Nnet, int]:
    """A copy of ``nnet`` rewritten in place by ``rewrite``, and what it returned."""
    out = nnet.copy()
    return out, rewrite(out)


def converted(nnet: Nnet) -> tuple[Nnet, int]:
    return rewritten(nnet, convert_lstm_cells_in_place)


def outputs(nnet: Nnet, frames: int = 9, seqs: int = 2, names=("output",)) -> dict:
    ins = [Index(n, t, 0) for n in range(seqs) for t in range(-3, frames + 3)]
    outs = [Index(n, t, 0) for n in range(seqs) for t in range(frames)]
    req = ComputationRequest([IoSpecification("input", ins)],
                             [IoSpecification(name, outs) for name in names])
    inputs = random_inputs(nnet, req, np.random.default_rng(1))
    got, _, _ = run_computation(compile_request(nnet, req, None), nnet, inputs, None)
    return got


def assert_same_outputs(a: Nnet, b: Nnet, **kw) -> None:
    oa, ob = outputs(a, **kw), outputs(b, **kw)
    assert oa.keys() == ob.keys()
    for k in oa:
        # the same expressions in the same order: equal to float32 rounding
        np.testing.assert_allclose(ob[k], oa[k], rtol=1e-6, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("delay", [-1, -3, 2])
def test_cell_becomes_one_nonlinearity(delay):
    nnet = network(lstmp(delay=delay))
    conv, n = converted(nnet)
    assert n == 1
    names = {type(c).__name__ for c in conv.components}
    assert not names & {"SigmoidComponent", "TanhComponent", "ElementwiseProductComponent",
                        "NaturalGradientPerElementScaleComponent"}, names
    lstm = conv.get_component_by_name("lstm1.lstm_nonlin")
    assert lstm.type_name == "LstmNonlinearityComponent" and lstm.cell_dim == CELL
    assert not lstm.use_dropout
    # the peepholes are the per-element scales, in the order i, f, o
    for row, g in enumerate("ifo"):
        np.testing.assert_array_equal(lstm.params[row],
                                      nnet.get_component_by_name(f"lstm1.w_{g}.c").scales)
    # the gate affines stacked in Kaldi's order i, f, c (the g gate's), o
    w_all = conv.get_component_by_name("lstm1.W_all")
    np.testing.assert_array_equal(
        w_all.linear_params, np.concatenate([nnet.get_component_by_name(f"lstm1.W_{g}.xr")
                                             .linear_params for g in "ifco"]))
    np.testing.assert_array_equal(
        w_all.bias_params, np.concatenate([nnet.get_component_by_name(f"lstm1.W_{g}.xr")
                                           .bias_params for g in "ifco"]))
    text = conv.nodes[conv.get_node_index("lstm1.lstm_nonlin") - 1].descriptor.write(
        conv.node_names)
    assert text == f"Append(lstm1.W_all, IfDefined(Offset(lstm1.c_t, {delay})))"
    for name, offset in (("lstm1.c_t", 0), ("lstm1.m_t", CELL)):
        node = conv.nodes[conv.get_node_index(name)]
        assert (node.type, node.dim_offset, node.dim) == (NodeType.DIM_RANGE, offset, CELL)
    for gone in ("lstm1.i_t", "lstm1.f2_t", "lstm1.c1_t", "lstm1.h_t", "lstm1.i1_t"):
        assert conv.get_node_index(gone) == -1, gone
    conv.validate(allow_orphans=False)
    assert_same_outputs(nnet, conv)


@pytest.mark.parametrize("c_type,c_opts", [("ClipGradientComponent", ""),
                                           ("NoOpComponent", "")])
def test_forward_identity_cell_components(c_type, c_opts):
    nnet = network(lstmp(c_type=c_type, c_opts=c_opts))
    conv, n = converted(nnet)
    assert n == 1
    assert_same_outputs(nnet, conv)


def test_gates_of_different_inputs_are_appended():
    """A gate affine reading another descriptor: no stacking; the nonlinearity reads the
    four pre-activations appended."""
    nnet = network(lstmp(gate_input="Append(input, Offset(input, -1), Offset(input, 2), "
                                    "IfDefined(Offset(lstm1.r_t, -1)))"))
    conv, n = converted(nnet)
    assert n == 1 and conv.get_component_index("lstm1.W_all") == -1
    text = conv.nodes[conv.get_node_index("lstm1.lstm_nonlin") - 1].descriptor.write(
        conv.node_names)
    assert text == ("Append(lstm1.i1_t, lstm1.f1_t, lstm1.g1_t, lstm1.o1_t, "
                    "IfDefined(Offset(lstm1.c_t, -1)))")
    assert_same_outputs(nnet, conv)


@pytest.mark.parametrize("layer,why", [
    (lstmp(c_opts="scale=0.85"), "a c that scales (xconfig decay-time)"),
    (lstmp(c_type="RectifiedLinearComponent", c_opts=""), "c of another type"),
], ids=["decay-time", "relu-c"])
def test_cells_left_alone(layer, why):
    nnet = network(layer)
    conv, n = converted(nnet)
    assert n == 0, why
    assert conv.config_text() == nnet.config_text()


def test_inner_node_read_from_outside():
    """A gate read by another output: the cell is left as it is, outputs and all."""
    extra = "output-node name=output-f input=lstm1.f_t\n"
    nnet = network(lstmp(), outputs=extra)
    conv, n = converted(nnet)
    assert n == 0 and conv.config_text() == nnet.config_text()
    # ... while c_t and m_t may be read anywhere: they stay, as dim-range nodes
    nnet = network(lstmp(), outputs="output-node name=output-c input=Offset(lstm1.c_t, -2)\n"
                                    "output-node name=output-m input=lstm1.m_t\n")
    conv, n = converted(nnet)
    assert n == 1
    assert_same_outputs(nnet, conv, names=("output", "output-c", "output-m"))


def test_two_layers_and_directions():
    """Two cells, one forward and one backward in time, the second reading the first."""
    second = lstmp("lstm2", delay=2).replace(
        "Offset(input, -1), input, Offset(input, 1)",
        "lstm1.rp_t, Offset(lstm1.rp_t, -1), input, Offset(input, 1)").replace(
        f"input-dim={12 + 3}", f"input-dim={5 + 5 + 8 + 3}")
    nnet = network(lstmp(), second, final="lstm2.rp_t")
    conv, n = converted(nnet)
    assert n == 2
    assert_same_outputs(nnet, conv, frames=11)


def test_looped_stream_equals_the_stored_network():
    """A looped stream on the decoding network (the cell rewritten, its affine split)
    gives the stream of the network as stored, frames pushed in two parts."""
    from engine.inference import LoopedConfig, LoopedModel  # noqa: PLC0415
    nnet = network(lstmp(delay=-2))
    x = np.random.default_rng(5).standard_normal((29, 4)).astype(np.float32)
    got = {}
    for collapse in (False, True):
        model = LoopedModel(nnet, LoopedConfig(4, 0, 1), collapse=collapse)
        if collapse:
            assert model.nnet.get_component_by_name("lstm1.lstm_nonlin") is not None
        s = model.stream()
        got[collapse] = np.concatenate([s.push(x[:10]), s.push(x[10:]), s.finish()])
    np.testing.assert_allclose(got[True], got[False], rtol=1e-5, atol=1e-5)


def test_kaldi_xconfig_lstmp():
    """The projected LSTMs Kaldi's xconfig wrote (tests/data/inference/xconfig/lstmp):
    lstm1 has decay-time (its c scales by 0.85) and stays; lstm2 is rewritten."""
    nnet = load_model(str(DATA / "inference" / "xconfig" / "lstmp" / "model.raw")).nnet
    decoding = prepare_nnet(nnet)
    assert decoding.get_node_index("lstm1.i_t") >= 0
    assert decoding.get_node_index("lstm2.i_t") == -1
    assert decoding.get_component_by_name("lstm2.lstm_nonlin").cell_dim == 24
