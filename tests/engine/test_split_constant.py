"""The decoding network's i-vector split (engine/optimizer/fuse.py:
split_constant_inputs_in_place) and the forward identities read only whole written into
their readers (engine/optimizer/aliases.py): which nodes change and
which do not, the columns of the two halves, outputs and input derivatives (the
i-vector's included) equal to the original network's, the threshold, and the form the
compiler gives the sum (one AddRows of the per-sequence rows, no extra matrix)."""

from __future__ import annotations

import numpy as np
import pytest

import engine.optimizer.fuse as fuse
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.shortcut import compile_request
from engine.core.index import Index
from engine.nnet.nnet import Nnet
from engine.optimizer.aliases import alias_forward_identities_in_place
from engine.optimizer.fuse import split_constant_inputs_in_place
from test_fuse import assert_dicts_close, assert_split_columns, component_kinds, input_text, \
    run_request

# a: features and an i-vector side by side (split); b: the same, but read through an
# Offset() as well (split, a NoOp keeps the name); c: two constant parts at different
# times (not split); d: a recurrence (not split); pre: a no-op over an Append() read
# whole (inlined); post: a no-op read through Offset() (kept).
NET = """
input-node name=input dim=4
input-node name=ivector dim=3
component name=pre type=NoOpComponent dim=7
component name=a type=NaturalGradientAffineComponent input-dim=7 output-dim=5
component name=b type=AffineComponent input-dim=11 output-dim=4
component name=c type=AffineComponent input-dim=10 output-dim=3
component name=d type=AffineComponent input-dim=9 output-dim=2
component name=relu type=RectifiedLinearComponent dim=5
component name=tanh type=TanhComponent dim=2
component name=post type=NoOpComponent dim=7
component-node name=pre component=pre input=Append(input, ReplaceIndex(ivector, t, 0))
component-node name=a component=a input=pre
component-node name=r component=relu input=a
component-node name=b component=b input=Append(Offset(input, -1), input, ReplaceIndex(ivector, t, 0))
component-node name=c component=c input=Append(input, ReplaceIndex(ivector, t, 0), ReplaceIndex(ivector, t, 1))
component-node name=d component=d input=Append(Scale(0.5, input), IfDefined(Offset(h, -1)), ReplaceIndex(ivector, t, 0))
component-node name=h component=tanh input=d
component-node name=post component=post input=Append(input, ReplaceIndex(ivector, t, 0))
output-node name=output input=Append(r, b, Offset(b, -1), c, h, Offset(post, 1))
"""


def _nnet() -> Nnet:
    nnet = Nnet.from_config(NET, rng=np.random.default_rng(3))
    nnet.set_test_mode(True)
    return nnet


def _request(seqs: int = 2, frames: int = 6, deriv: bool = False) -> ComputationRequest:
    ins = [Index(n, t, 0) for n in range(seqs) for t in range(-2, frames + 2)]
    ivs = [Index(n, t, 0) for n in range(seqs) for t in (0, 1)]
    outs = [Index(n, t, 0) for n in range(seqs) for t in range(frames)]
    return ComputationRequest([IoSpecification("input", ins, deriv),
                               IoSpecification("ivector", ivs, deriv)],
                              [IoSpecification("output", outs, deriv)])


@pytest.fixture
def no_threshold(monkeypatch):
    monkeypatch.setattr(fuse, "MIN_CONSTANT_PRODUCT", 0)


def test_inline_no_op_read_whole():
    nnet = _nnet()
    assert alias_forward_identities_in_place(nnet) == 1
    names = nnet.node_names
    assert "pre" not in names and "post" in names
    assert input_text(nnet, "a") == "Append(input, ReplaceIndex(ivector, t, 0))"
    nnet.validate(allow_orphans=False)
    assert alias_forward_identities_in_place(nnet) == 0


def test_inline_chain_of_no_ops():
    nnet = Nnet.from_config("""
input-node name=input dim=3
component name=n1 type=NoOpComponent dim=6
component name=n2 type=NoOpComponent dim=6
component name=a type=AffineComponent input-dim=6 output-dim=2
component-node name=n1 component=n1 input=Append(input, Offset(input, 1))
component-node name=n2 component=n2 input=n1
component-node name=a component=a input=n2
output-node name=output input=a
""", rng=np.random.default_rng(0))
    assert alias_forward_identities_in_place(nnet) == 2
    assert input_text(nnet, "a") == "Append(input, Offset(input, 1))"


@pytest.mark.parametrize("identity", [
    "BackpropTruncationComponent dim=6",
    "ClipGradientComponent dim=6",
    "GeneralDropoutComponent dim=6 dropout-proportion=0.5",
    "DropoutComponent dim=6 dropout-proportion=0.0",
])
def test_inline_every_forward_identity(identity):
    """Any forward identity read only whole is written into its readers (test mode); one
    that is also read through an Offset() stays, and so does a Dropout that scales."""
    config = f"""
input-node name=input dim=3
component name=i1 type={identity}
component name=i2 type={identity}
component name=a type=AffineComponent input-dim=6 output-dim=2
component name=b type=AffineComponent input-dim=6 output-dim=2
component-node name=i1 component=i1 input=Append(input, Offset(input, 1))
component-node name=i2 component=i2 input=Append(input, Offset(input, -1))
component-node name=a component=a input=i1
component-node name=b component=b input=i2
output-node name=output input=Append(a, b, Offset(i2, 1))
"""
    nnet = Nnet.from_config(config, rng=np.random.default_rng(0))
    nnet.set_test_mode(True)
    before = nnet.copy()
    assert alias_forward_identities_in_place(nnet) == 1
    assert "i1" not in nnet.node_names and "i2" in nnet.node_names
    assert input_text(nnet, "a") == "Append(input, Offset(input, 1))"
    nnet.validate(allow_orphans=False)
    ins = [Index(0, t, 0) for t in range(-2, 6)]
    req = ComputationRequest([IoSpecification("input", ins)],
                             [IoSpecification("output", [Index(0, t, 0) for t in range(4)])])
    o1, _, _ = run_request(before, req)
    o2, _, _ = run_request(nnet, req)
    assert_dicts_close(o1, o2)
    scaling = Nnet.from_config(config.replace(identity, "DropoutComponent dim=6 "
                                              "dropout-proportion=0.5"),
                               rng=np.random.default_rng(0))
    scaling.set_test_mode(True)
    assert alias_forward_identities_in_place(scaling) == 0


def test_split_nodes_and_columns(no_threshold):
    nnet = _nnet()
    alias_forward_identities_in_place(nnet)
    whole = nnet.copy()
    assert split_constant_inputs_in_place(nnet) == 2
    names = nnet.node_names
    kinds = component_kinds(nnet)
    # a: every reference bare, replaced by the sum; b: read through Offset() too, a no-op
    assert "a" not in names and kinds["b"] == "NoOpComponent"
    assert kinds["c"] == kinds["d"] == "AffineComponent"
    assert input_text(nnet, "r") == "Sum(a.x, ReplaceIndex(a.c, t, 0))"
    assert input_text(nnet, "b") == "Sum(b.x, ReplaceIndex(b.c, t, 0))"
    assert input_text(nnet, "a.x") == "input" and input_text(nnet, "a.c") == "ivector"
    assert input_text(nnet, "b.x") == "Append(Offset(input, -1), input)"
    # the constant half before the other in the node list (see the docstring)
    assert nnet.get_node_index("a.c") < nnet.get_node_index("a.x")
    for name, x_cols, c_cols in (("a", np.r_[0:4], np.r_[4:7]),
                                 ("b", np.r_[0:8], np.r_[8:11])):
        assert_split_columns(whole, nnet, name, x_cols, c_cols, "c")
    nnet.validate(allow_orphans=False)
    assert split_constant_inputs_in_place(nnet) == 0


def test_threshold_keeps_small_products():
    nnet = _nnet()
    alias_forward_identities_in_place(nnet)
    assert split_constant_inputs_in_place(nnet) == 0    # 3 columns x 5 outputs


@pytest.mark.parametrize("deriv", [False, True])
@pytest.mark.parametrize("seqs", [1, 3])
def test_same_outputs_and_input_derivatives(no_threshold, deriv, seqs):
    """Outputs and the derivatives of the features and the i-vector (summed over the
    frames that read it) equal the original network's."""
    nnet = _nnet()
    changed = nnet.copy()
    alias_forward_identities_in_place(changed)
    split_constant_inputs_in_place(changed)
    req = _request(seqs=seqs, deriv=deriv)
    o1, d1, _ = run_request(nnet, req)
    o2, d2, _ = run_request(changed, req)
    assert_dicts_close(o1, o2)
    assert_dicts_close(d1, d2)


def test_sum_is_one_add_rows(no_threshold):
    """The compiled sum: the x half's matrix is the reader's (the copy merged away)
    and the per-sequence rows are added to it by one AddRows."""
    nnet = Nnet.from_config("""
input-node name=input dim=4
input-node name=ivector dim=3
component name=a type=AffineComponent input-dim=7 output-dim=5
component name=relu type=RectifiedLinearComponent dim=5
component-node name=a component=a input=Append(input, ReplaceIndex(ivector, t, 0))
component-node name=r component=relu input=a
output-node name=output input=r
""", rng=np.random.default_rng(0))
    assert split_constant_inputs_in_place(nnet) == 1
    req = ComputationRequest(
        [IoSpecification("input", [Index(0, t, 0) for t in range(8)]),
         IoSpecification("ivector", [Index(0, 0, 0)])],
        [IoSpecification("output", [Index(0, t, 0) for t in range(8)])])
    text = compile_request(nnet, req, None).to_text(nnet)
    assert "AddRows(1, m" in text and "CopyRows" not in text and " += " not in text
