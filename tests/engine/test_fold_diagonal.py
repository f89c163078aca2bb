"""Per-column scale-and-offset nodes folded into the affines around them
(engine/optimizer/fold_diagonal.py): which nodes fold and which stay, the folded
parameters, outputs equal to the original's offline and in a looped stream, and a Kaldi
xconfig TDNN-F with every batch-norm folded (test_xconfig_architectures checks its decoding
form against Kaldi's own outputs)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.shortcut import compile_request
from engine.core.index import Index
from engine.inference.common import prepare_nnet
from engine.nnet.model_io import load_model
from engine.nnet.nnet import Nnet
from engine.nnet.random_config import random_inputs
from engine.optimizer.fold_diagonal import fold_diagonal_nodes_in_place
from engine.runtime.executor import run_computation
from refdata import DATA
from test_fast_lstm import outputs, rewritten


def _nnet(text: str) -> Nnet:
    nnet = Nnet.from_config(text, rng=np.random.default_rng(0))
    # batch-norm statistics that give scales and offsets far from 1 and 0
    for comp in nnet.components:
        if type(comp).__name__ == "BatchNormComponent":
            rng = np.random.default_rng(3)
            comp.count = 10.0
            comp.stats_sum = rng.standard_normal(comp.block_dim) * 10.0
            comp.stats_sumsq = comp.stats_sum ** 2 / 10.0 + rng.uniform(0.5, 4.0, comp.block_dim)
        if type(comp).__name__ == "FixedScaleComponent":
            comp.scales = np.array([-1.5, 2, 0.5, -0.25, 1, 3], np.float32)[:comp.input_dim()]
    nnet.set_test_mode(True)
    return nnet


def _folded(nnet: Nnet) -> tuple[Nnet, int]:
    return rewritten(nnet, fold_diagonal_nodes_in_place)


def _types(nnet: Nnet) -> set[str]:
    """The component types the network's nodes use."""
    return {type(nnet.components[node.component_index]).__name__
            for i, node in enumerate(nnet.nodes) if nnet.is_component_node(i)}


def assert_close_outputs(a: Nnet, b: Nnet, **kw) -> None:
    oa, ob = outputs(a, **kw), outputs(b, **kw)
    assert oa.keys() == ob.keys()
    for k in oa:
        # other products, rounded once in float32: equal to float32 rounding
        scale = 1.0 + float(np.abs(oa[k]).max())
        np.testing.assert_allclose(ob[k], oa[k], rtol=1e-5, atol=1e-5 * scale, err_msg=k)


# Two TDNN-F-like layers: affine -> relu -> batch-norm -> test-mode dropout -> a residual
# sum with a scaled earlier layer, a time-offset linear (no bias) and a TDNN with bias
# reading the sum, and a last linear + affine; the first ReLU is also read by a TDNN.
TDNNF = """
input-node name=input dim=5
component name=a1 type=NaturalGradientAffineComponent input-dim=15 output-dim=8
component name=relu1 type=RectifiedLinearComponent dim=8
component name=bn1 type=BatchNormComponent dim=8 target-rms=1.0
component name=drop1 type=GeneralDropoutComponent dim=8 dropout-proportion=0.5
component name=lin2 type=TdnnComponent input-dim=8 output-dim=3 time-offsets=-1,0 use-bias=false
component name=a2 type=TdnnComponent input-dim=3 output-dim=8 time-offsets=0,1
component name=relu2 type=RectifiedLinearComponent dim=8
component name=bn2 type=BatchNormComponent dim=8 block-dim=4 target-rms=0.5
component name=noop2 type=NoOpComponent dim=8
component name=lin3 type=LinearComponent input-dim=8 output-dim=4
component name=a3 type=AffineComponent input-dim=4 output-dim=6
component name=side type=TdnnComponent input-dim=8 output-dim=2 time-offsets=0 use-bias=false
component name=a4 type=AffineComponent input-dim=12 output-dim=3
component-node name=a1 component=a1 input=Append(Offset(input, -1), input, Offset(input, 1))
component-node name=relu1 component=relu1 input=a1
component-node name=bn1 component=bn1 input=relu1
component-node name=drop1 component=drop1 input=bn1
component-node name=lin2 component=lin2 input=drop1
component-node name=a2 component=a2 input=lin2
component-node name=relu2 component=relu2 input=a2
component-node name=bn2 component=bn2 input=relu2
component-node name=noop2 component=noop2 input=Sum(Scale(0.66, drop1), bn2)
component-node name=lin3 component=lin3 input=noop2
component-node name=a3 component=a3 input=lin3
component-node name=side component=side input=relu1
component-node name=a4 component=a4 input=Append(side, Offset(side, 1), noop2)
output-node name=output input=a3
output-node name=output2 input=a4
"""


@pytest.mark.parametrize("dropout", [
    "GeneralDropoutComponent dim=8 dropout-proportion=0.5",
    # test mode: y = 0.8 x, a diagonal node the carried offset passes through
    "DropoutComponent dim=8 dropout-proportion=0.2",
], ids=["general-dropout", "dropout"])
def test_tdnnf_layers_fold(dropout):
    nnet = _nnet(TDNNF.replace("GeneralDropoutComponent dim=8 dropout-proportion=0.5", dropout))
    folded, n = _folded(nnet)
    assert n == 2
    assert "BatchNormComponent" not in _types(folded)
    # the scale went before the ReLU: the affine's rows are scaled by it
    bn1 = nnet.get_component_by_name("bn1")
    a1, new_a1 = nnet.get_component_by_name("a1"), folded.components[
        folded.nodes[folded.get_node_index("a1")].component_index]
    np.testing.assert_allclose(new_a1.linear_params,
                               a1.linear_params * bn1.scale_vec[:, None], rtol=1e-6)
    folded.validate()
    assert_close_outputs(nnet, folded, names=("output", "output2"))


def test_decoding_preparation_drops_the_folded_nodes():
    """Through prepare_nnet the folded batch-norms and the dropouts become aliases: no
    commands of theirs are left."""
    nnet = _nnet(TDNNF)
    decoding = prepare_nnet(nnet)
    assert not _types(decoding) & {"BatchNormComponent", "GeneralDropoutComponent"}, \
        _types(decoding)
    for name in ("bn1", "drop1", "bn2"):
        assert not decoding.is_component_node(decoding.get_node_index(name)), name
    assert_close_outputs(nnet, decoding, names=("output", "output2"))


def test_looped_stream_equals_the_stored_network():
    from engine.inference import LoopedConfig, LoopedModel  # noqa: PLC0415
    nnet = _nnet(TDNNF)
    x = np.random.default_rng(7).standard_normal((31, 5)).astype(np.float32)
    got = {}
    for collapse in (False, True):
        s = LoopedModel(nnet, LoopedConfig(5, 0, 1), collapse=collapse).stream()
        got[collapse] = np.concatenate([s.push(x[:12]), s.push(x[12:]), s.finish()])
    np.testing.assert_allclose(got[True], got[False], rtol=1e-5, atol=1e-5)


# A fixed scale with negative entries after a ReLU (it cannot go before the ReLU) read
# through a no-op and a dim-range node by affines; a fixed bias read by a linear whose
# constant an affine takes.
GENERAL = """
input-node name=input dim=4
component name=a1 type=AffineComponent input-dim=4 output-dim=6
component name=relu1 type=RectifiedLinearComponent dim=6
component name=scale type=FixedScaleComponent dim=6
component name=noop type=NoOpComponent dim=6
component name=a2 type=AffineComponent input-dim=12 output-dim=5
component name=a3 type=AffineComponent input-dim=2 output-dim=3
component name=bias type=FixedBiasComponent dim=3
component name=lin type=LinearComponent input-dim=3 output-dim=4
component name=a4 type=AffineComponent input-dim=4 output-dim=2
component-node name=a1 component=a1 input=input
component-node name=relu1 component=relu1 input=a1
component-node name=scale component=scale input=relu1
component-node name=noop component=noop input=scale
component-node name=a2 component=a2 input=Append(noop, Offset(noop, -1))
dim-range-node name=part input-node=noop dim-offset=2 dim=2
component-node name=a3 component=a3 input=part
component-node name=bias component=bias input=a3
component-node name=lin component=lin input=bias
component-node name=a4 component=a4 input=lin
output-node name=output input=a2
output-node name=output2 input=a4
"""


def test_scale_and_bias_carried_to_affines():
    nnet = _nnet(GENERAL)
    folded, n = _folded(nnet)
    assert n == 2
    assert not _types(folded) & {"FixedScaleComponent", "FixedBiasComponent"}
    # the linear took no offset (it passes the constant on to a4)
    assert type(folded.components[folded.nodes[folded.get_node_index("lin")]
                                  .component_index]).__name__ == "LinearComponent"
    assert_close_outputs(nnet, folded, names=("output", "output2"))


@pytest.mark.parametrize("change", [
    # an output reads the carried node
    ("output-node name=output2 input=a4", "output-node name=output2 input=noop"),
    # a nonlinearity reads it
    ("component name=a2 type=AffineComponent input-dim=12 output-dim=5",
     "component name=a2 type=TanhComponent dim=12"),
    # IfDefined over it
    ("input=Append(noop, Offset(noop, -1))", "input=Append(noop, IfDefined(Offset(noop, -1)))"),
    # a scaled node summed with an unscaled one
    ("input=Append(noop, Offset(noop, -1))", "input=Append(Sum(noop, relu1), noop)"),
], ids=["output", "nonlinearity", "ifdefined", "mixed-scales"])
def test_scale_stays_where_a_reader_cannot_take_it(change):
    nnet = _nnet(GENERAL.replace(*change))
    folded, _ = _folded(nnet)
    assert "FixedScaleComponent" in _types(folded)
    assert_close_outputs(nnet, folded, names=("output", "output2"))


def test_recurrence_stays():
    """A batch-norm inside a recurrence (read back at t-1 by an earlier node)."""
    text = """
input-node name=input dim=3
component name=a type=AffineComponent input-dim=7 output-dim=4
component name=relu type=RectifiedLinearComponent dim=4
component name=bn type=BatchNormComponent dim=4
component name=out type=AffineComponent input-dim=4 output-dim=2
component-node name=a component=a input=Append(input, IfDefined(Offset(bn, -1)))
component-node name=relu component=relu input=a
component-node name=bn component=bn input=relu
component-node name=out component=out input=bn
output-node name=output input=out
"""
    nnet = _nnet(text)
    folded, n = _folded(nnet)
    assert n == 0 and "BatchNormComponent" in _types(folded)


def test_kaldi_tdnnf_batchnorms_fold():
    """A Kaldi xconfig TDNN-F (tests/data/inference/xconfig/tdnnf_options, with an
    i-vector): every batch-norm of its decoding form is gone, and its outputs are the
    network's (test_xconfig_architectures checks them against Kaldi's)."""
    nnet = load_model(str(DATA / "inference" / "xconfig" / "tdnnf_options" / "model.raw")).nnet
    stored, decoding = prepare_nnet(nnet, collapse=False), prepare_nnet(nnet)
    assert "BatchNormComponent" in _types(stored)
    assert "BatchNormComponent" not in _types(decoding)
    ins = [Index(0, t, 0) for t in range(-30, 42)]
    req = ComputationRequest([IoSpecification("input", ins),
                              IoSpecification("ivector", [Index(0, 0, 0)])],
                             [IoSpecification("output", [Index(0, t, 0) for t in range(12)])])
    inputs = random_inputs(stored, req, np.random.default_rng(1))
    got = [run_computation(compile_request(n, req, None), n, inputs, None)[0]["output"]
           for n in (stored, decoding)]
    np.testing.assert_allclose(got[1], got[0], rtol=1e-5, atol=1e-5 * (1 + np.abs(got[0]).max()))


# -- residual scales (fold_residual_scales_in_place) -------------------------------------------

# A chain of three TDNN-F-style residual sums, Sum(Scale(a, previous), relu(affine(...))),
# with different scales, read by the next layers' linears and, at the end, by a Linear (as
# the prefinal-l of Kaldi's chain models) and by an output through an affine.
RESIDUAL = """
input-node name=input dim=5
component name=a0 type=AffineComponent input-dim=15 output-dim=6
component name=relu0 type=RectifiedLinearComponent dim=6
component name=lin1 type=TdnnComponent input-dim=6 output-dim=3 time-offsets=-1,0 use-bias=false
component name=a1 type=TdnnComponent input-dim=3 output-dim=6 time-offsets=0,1
component name=relu1 type=RectifiedLinearComponent dim=6
component name=noop1 type=NoOpComponent dim=6
component name=lin2 type=LinearComponent input-dim=6 output-dim=3
component name=a2 type=NaturalGradientAffineComponent input-dim=3 output-dim=6
component name=relu2 type=RectifiedLinearComponent dim=6
component name=noop2 type=NoOpComponent dim=6
component name=lin3 type=TdnnComponent input-dim=6 output-dim=3 time-offsets=0,1 use-bias=false
component name=a3 type=TdnnComponent input-dim=3 output-dim=6 time-offsets=-1,0
component name=relu3 type=RectifiedLinearComponent dim=6
component name=pre type=LinearComponent input-dim=6 output-dim=4
component name=out type=AffineComponent input-dim=4 output-dim=3
component-node name=a0 component=a0 input=Append(Offset(input, -1), input, Offset(input, 1))
component-node name=relu0 component=relu0 input=a0
component-node name=lin1 component=lin1 input=relu0
component-node name=a1 component=a1 input=lin1
component-node name=relu1 component=relu1 input=a1
component-node name=noop1 component=noop1 input=Sum(Scale(0.66, relu0), relu1)
component-node name=lin2 component=lin2 input=noop1
component-node name=a2 component=a2 input=lin2
component-node name=relu2 component=relu2 input=a2
component-node name=noop2 component=noop2 input=Sum(relu2, Scale(0.5, noop1))
component-node name=lin3 component=lin3 input=noop2
component-node name=a3 component=a3 input=lin3
component-node name=relu3 component=relu3 input=a3
component-node name=pre component=pre input=Sum(Scale(0.8, noop2), relu3)
component-node name=out component=out input=pre
output-node name=output input=out
"""


def _sums(nnet: Nnet) -> list[str]:
    return [line.split("input=")[1] for line in nnet.config_text().splitlines()
            if "input=Sum(" in line]


def test_residual_scales_fold_into_the_branches():
    """Each residual sum loses its scale; each branch's affine rows are scaled by the
    product of the scales so far (relu(z / s) = relu(z) / s); the readers of the sums
    (the linears, the last one a Linear that takes the transform into its columns)
    absorb it; the outputs are the network's to float32 rounding, with fewer commands."""
    from engine.optimizer.fold_diagonal import fold_residual_scales_in_place  # noqa: PLC0415
    nnet = _nnet(RESIDUAL)
    folded, n = rewritten(nnet, fold_residual_scales_in_place)
    assert n == 1                                     # one chain
    assert _sums(folded) == ["Sum(relu0, relu1)", "Sum(relu2, noop1)", "Sum(noop2, relu3)"]
    for name, s in (("a1", 0.66), ("a2", 0.66 * 0.5), ("a3", 0.66 * 0.5 * 0.8)):
        old = nnet.get_component_by_name(name)
        new = folded.components[folded.nodes[folded.get_node_index(name)].component_index]
        np.testing.assert_allclose(new.linear_params, old.linear_params / s, rtol=1e-6)
        np.testing.assert_allclose(new.bias_params, old.bias_params / s, rtol=1e-6)
    folded.validate()
    assert_close_outputs(nnet, folded)
    req = ComputationRequest(
        [IoSpecification("input", [Index(0, t, 0) for t in range(-3, 12)])],
        [IoSpecification("output", [Index(0, t, 0) for t in range(9)])])
    assert (compile_request(folded, req, None).stats()["commands"]
            < compile_request(nnet, req, None).stats()["commands"])


@pytest.mark.parametrize("change", [
    # a negative scale: relu(z / s) is not relu(z) / s
    ("Sum(Scale(0.66, relu0), relu1)", "Sum(Scale(-0.66, relu0), relu1)"),
    # the branch is not a ReLU
    ("component name=relu1 type=RectifiedLinearComponent dim=6",
     "component name=relu1 type=TanhComponent dim=6"),
    # another node reads the branch
    ("output-node name=output input=out", "output-node name=output input=out\n"
     "output-node name=output2 input=relu1"),
], ids=["negative", "tanh", "branch-read-elsewhere"])
def test_residual_scale_stays(change):
    """Where the first sum cannot take the rule, it keeps its scale (the later sums,
    whose chain would start from it, are tried on their own), and outputs are equal."""
    from engine.optimizer.fold_diagonal import fold_residual_scales_in_place  # noqa: PLC0415
    nnet = _nnet(RESIDUAL.replace(*change))
    folded, _ = rewritten(nnet, fold_residual_scales_in_place)
    assert "Scale(" in _sums(folded)[0]
    folded.validate()
    names = ("output", "output2") if "output2" in change[1] else ("output",)
    assert_close_outputs(nnet, folded, names=names)


def test_residual_chain_stays_where_a_reader_cannot_take_it():
    """A carried sum read by an output: the whole chain stays as it was."""
    from engine.optimizer.fold_diagonal import fold_residual_scales_in_place  # noqa: PLC0415
    nnet = _nnet(RESIDUAL.replace("output-node name=output input=out",
                                  "output-node name=output input=out\n"
                                  "output-node name=output2 input=noop2"))
    folded, n = rewritten(nnet, fold_residual_scales_in_place)
    assert n == 0 or all("Scale(" in s for s in _sums(folded)[:2])
    assert_close_outputs(nnet, folded, names=("output", "output2"))


def test_reference_tdnnf_decoding_form_has_no_residual_scales():
    """The reference TDNN-F (Kaldi xconfig tdnnf-layers, bypass-scale 0.66): its decoding
    form's residual sums carry no scale (the chain is folded from the first layer to
    prefinal-l), and its outputs are the stored network's."""
    nnet = load_model(str(DATA / "inference" / "xconfig" / "tdnnf_options" / "model.raw")).nnet
    stored, decoding = prepare_nnet(nnet, collapse=False), prepare_nnet(nnet)
    assert any("Scale(" in s for s in _sums(stored))
    assert not any("Scale(" in s for s in _sums(decoding)), _sums(decoding)
    ins = [Index(0, t, 0) for t in range(-30, 42)]
    req = ComputationRequest([IoSpecification("input", ins),
                              IoSpecification("ivector", [Index(0, 0, 0)])],
                             [IoSpecification("output", [Index(0, t, 0) for t in range(12)])])
    inputs = random_inputs(stored, req, np.random.default_rng(2))
    got = [run_computation(compile_request(n, req, None), n, inputs, None)[0]["output"]
           for n in (stored, decoding)]
    np.testing.assert_allclose(got[1], got[0], rtol=1e-5, atol=1e-5 * (1 + np.abs(got[0]).max()))


def _random_tdnnf(rng: np.random.Generator) -> str:
    """A Kaldi tdnnf-layer stack (1-4 layers) with random sizes, time offsets, bypass
    scales and batch-norm statistics: linear (TDNN, no bias) -> affine (TDNN) -> relu ->
    batch-norm -> dropout -> noop = Sum(Scale(bypass, previous), dropout); a prefinal
    Linear and affine, or an affine."""
    dim, bottleneck = int(rng.integers(4, 9)), int(rng.integers(2, 5))
    lines = ["input-node name=input dim=5",
             f"component name=a0 type=AffineComponent input-dim=15 output-dim={dim}",
             f"component name=relu0 type=RectifiedLinearComponent dim={dim}",
             "component-node name=a0 component=a0 input=Append(Offset(input, -1), input, "
             "Offset(input, 1))",
             "component-node name=relu0 component=relu0 input=a0"]
    prev = "relu0"
    for k in range(1, int(rng.integers(2, 6))):
        offs = [str(o) for o in sorted(rng.choice([-3, -1, 0, 1, 3], size=2, replace=False))]
        bypass = float(rng.choice([0.66, 0.5, 0.8, 1.2]))
        lines += [
            f"component name=lin{k} type=TdnnComponent input-dim={dim} output-dim={bottleneck} "
            f"time-offsets={','.join(offs)} use-bias=false",
            f"component name=aff{k} type=TdnnComponent input-dim={bottleneck} output-dim={dim} "
            f"time-offsets=0",
            f"component name=relu{k} type=RectifiedLinearComponent dim={dim}",
            f"component name=bn{k} type=BatchNormComponent dim={dim} target-rms=1.0",
            f"component name=drop{k} type=GeneralDropoutComponent dim={dim} "
            "dropout-proportion=0.5",
            f"component name=noop{k} type=NoOpComponent dim={dim}",
            f"component-node name=lin{k} component=lin{k} input={prev}",
            f"component-node name=aff{k} component=aff{k} input=lin{k}",
            f"component-node name=relu{k} component=relu{k} input=aff{k}",
            f"component-node name=bn{k} component=bn{k} input=relu{k}",
            f"component-node name=drop{k} component=drop{k} input=bn{k}",
            f"component-node name=noop{k} component=noop{k} "
            f"input=Sum(Scale({bypass}, {prev}), drop{k})"]
        prev = f"noop{k}"
    # the prefinal layer: a Linear and an affine after it (Kaldi's prefinal-l and the
    # chain branch's affine: what a batch-norm's offset carried along the sums needs to
    # end in a bias), or an affine alone
    if rng.integers(0, 2):
        lines += [f"component name=pre type=LinearComponent input-dim={dim} output-dim=4",
                  "component name=out type=AffineComponent input-dim=4 output-dim=3",
                  f"component-node name=pre component=pre input={prev}",
                  "component-node name=out component=out input=pre",
                  "output-node name=output input=out"]
    else:
        lines += [f"component name=pre type=AffineComponent input-dim={dim} output-dim=3",
                  f"component-node name=pre component=pre input={prev}",
                  "output-node name=output input=pre"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("seed", range(16))
def test_random_tdnnf_stacks_decode_as_stored(seed):
    """Random tdnnf-layer stacks through prepare_nnet (batch-norms folded, dropouts and
    no-ops aliased, residual scales folded): no residual sum keeps its scale, and the
    outputs of two sequences are the stored network's to float32 rounding."""
    rng = np.random.default_rng(3300 + seed)
    nnet = _nnet(_random_tdnnf(rng))
    decoding = prepare_nnet(nnet)
    assert not any("Scale(" in s for s in _sums(decoding)), _sums(decoding)
    # (up to 4 layers of offsets up to 3 each side: inputs from -16 to 7 + 16)
    req = ComputationRequest(
        [IoSpecification("input", [Index(n, t, 0) for n in range(2) for t in range(-16, 23)])],
        [IoSpecification("output", [Index(n, t, 0) for n in range(2) for t in range(7)])])
    inputs = random_inputs(nnet, req, np.random.default_rng(seed))
    got = [run_computation(compile_request(n, req, None), n, inputs, None)[0]["output"]
           for n in (nnet, decoding)]
    np.testing.assert_allclose(got[1], got[0], rtol=1e-5, atol=1e-5 * (1 + np.abs(got[0]).max()))
