"""Model collapsing for inference: Kaldi's CollapseModel / ModelCollapser,
CollapseModelConfig, SetBatchnormTestMode and SetDropoutTestMode (nnet-utils.cc),
plus Nnet::RemoveOrphanNodes / RemoveOrphanComponents (nnet-nnet.cc).

A component node whose input descriptor reads a single other component node
``foo`` (plainly or through Offset()s, possibly several times in an Append) can
absorb foo's component when the pair is one of Kaldi's foldable pairs; the
descriptor then reads foo's own input instead, with the same offsets (the
substitution is textual and the descriptor parser normalises the result, as in
Kaldi).  The pairs, each behind its CollapseModelConfig flag:

- ``collapse_dropout``: Dropout / GeneralDropout (test mode) before
  Affine / NaturalGradientAffine / Linear / Tdnn / TimeHeightConvolution: the
  second component's linear parameters are scaled by what the dropout does in
  test mode.
- ``collapse_batchnorm``: BatchNorm (test mode: y = x * scale + offset per
  block column) before Affine / Linear / Tdnn: the diagonal transform is
  multiplied into the linear parameters and bias (a Linear becomes an Affine;
  a Tdnn without bias gets one).
- ``collapse_affine``: FixedAffine / Affine before Affine, unless the first
  reduces the dimension; an Append of several offsets of the first becomes a
  block-diagonal first factor.
- ``collapse_scale``: Affine before FixedScale.

New components are named as Kaldi names them (``a.b``, ``b.scale0.5``) and
reused when a name exists; orphaned nodes (never inputs) and components are
removed at the end.  Defaults are Kaldi's (dropout and batch-norm folding off;
Kaldi turned them off in 2019 while investigating a bug).  Two deliberate
differences, both where Kaldi's rule would change the network's output:
Kaldi corrects for a collapsed DropoutComponent with 1 / (1 - p), but
DropoutComponent's test mode multiplies by (1 - p), so we scale by (1 - p);
and we do not collapse through a Scale(...) in the descriptor, since a
scaled input does not commute with a bias or a batch-norm offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.errors import ComponentError, ConfigError, NnetcError
from engine.nnet.components.affine import (AffineComponent, FixedAffineComponent,
                                           LinearComponent)
from engine.nnet.components.dropout import (DropoutComponent, GeneralDropoutComponent,
                                            RandomComponent)
from engine.nnet.components.normalize import BatchNormComponent
from engine.nnet.components.scale_offset import FixedScaleComponent
from engine.nnet.components.tdnn import TdnnComponent
from engine.nnet.components.time_height_conv import TimeHeightConvolutionComponent
from engine.nnet.descriptor_parse import DescriptorNames, parse_descriptor
from engine.nnet.descriptors import (OffsetForwardingDescriptor, SimpleForwardingDescriptor,
                                     SimpleSumDescriptor)
from engine.nnet.nnet import Nnet, NodeType


@dataclass(frozen=True)
class CollapseModelConfig:
    """Kaldi's CollapseModelConfig, same fields and defaults."""

    collapse_dropout: bool = False      # dropout, then affine/linear/tdnn/convolution
    collapse_batchnorm: bool = False    # batch-norm, then affine/linear/tdnn
    collapse_affine: bool = True        # fixed-affine or affine, then affine
    collapse_scale: bool = True         # affine, then fixed-scale

    @classmethod
    def everything(cls) -> "CollapseModelConfig":
        """Every kind of folding on."""
        return cls(True, True, True, True)


def set_batchnorm_test_mode(nnet: Nnet, test_mode: bool = True) -> None:
    """Kaldi's SetBatchnormTestMode (in place)."""
    for comp in nnet.components:
        if isinstance(comp, BatchNormComponent):
            comp.set_test_mode(test_mode)


def set_dropout_test_mode(nnet: Nnet, test_mode: bool = True) -> None:
    """Kaldi's SetDropoutTestMode: every random component (in place)."""
    for comp in nnet.components:
        if isinstance(comp, RandomComponent):
            comp.set_test_mode(test_mode)


def prepare_for_test(nnet: Nnet, config: CollapseModelConfig = CollapseModelConfig()) -> Nnet:
    """nnet3-copy --prepare-for-test: a copy with batch-norm and dropout in test
    mode, collapsed."""
    out = nnet.copy()
    set_batchnorm_test_mode(out, True)
    set_dropout_test_mode(out, True)
    return collapse_model_in_place(out, config)


def collapse_model(nnet: Nnet, config: CollapseModelConfig = CollapseModelConfig()) -> Nnet:
    """Kaldi's CollapseModel on a copy of ``nnet`` (left unchanged).  Batch-norm
    and dropout components to be folded must be in test mode already (see
    ``prepare_for_test``), else ComponentError."""
    return collapse_model_in_place(nnet.copy(), config)


def collapse_model_in_place(nnet: Nnet, config: CollapseModelConfig = CollapseModelConfig()
                            ) -> Nnet:
    """``collapse_model`` on ``nnet`` itself (a copy the caller made); returns it."""
    return _Collapser(config, nnet).collapse()


# -------------------------------------------------------------------------------------------


def tiled(vec: np.ndarray, dim: int) -> np.ndarray:
    """``vec`` in float64, repeated to ``dim`` entries (a per-block vector per column)."""
    return np.tile(np.asarray(vec, np.float64), dim // vec.shape[0])


def pre_multiply(offset: np.ndarray, scale: np.ndarray, bias: np.ndarray,
                 linear: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bias, linear) of W (s x + o) + b, i.e. b + W o and W diag(s), with o and s
    repeated across the input columns (Kaldi's PreMultiplyAffineParameters)."""
    w = np.asarray(linear, np.float64)
    o, s = tiled(offset, w.shape[1]), tiled(scale, w.shape[1])
    new_bias = np.asarray(bias, np.float64) + w @ o
    return new_bias.astype(np.float32), (w * s[None, :]).astype(np.float32)


class _Collapser:
    def __init__(self, config: CollapseModelConfig, nnet: Nnet):
        self.config = config
        self.nnet = nnet

    def collapse(self) -> Nnet:
        nnet = self.nnet
        # the node list stays as it is until the loop ends (folding changes descriptors
        # and component indexes only): its names, and the table descriptors are parsed
        # against, are made once (per fold they made a long network's collapse O(N^2))
        self.names = nnet.node_names
        self.parse_names = DescriptorNames(nnet.referable_names(), self.names)
        for _ in range(11):
            changed = False
            for n in range(nnet.num_nodes()):
                if self.optimize_node(n):
                    changed = True
            if not changed:
                break
        else:
            raise NnetcError("collapsing the model did not settle after 10 passes")
        remove_orphan_nodes(nnet)
        remove_orphan_components(nnet)
        nnet.validate()
        return nnet

    # -- the descriptor side ------------------------------------------------------------
    @staticmethod
    def _part_node(part) -> int:
        """The node of a part that is ``foo`` or ``Offset(foo, ...)`` (scale 1),
        else -1 (Kaldi's SumDescriptorIsCollapsible)."""
        if not isinstance(part, SimpleSumDescriptor):
            return -1
        fd = part.src
        if isinstance(fd, OffsetForwardingDescriptor):
            fd = fd.src
        if not isinstance(fd, SimpleForwardingDescriptor) or fd.scale != 1.0:
            return -1
        return fd.node_index

    def descriptor_node(self, desc) -> int:
        nodes = {self._part_node(p) for p in desc.parts}
        return nodes.pop() if len(nodes) == 1 else -1

    def replaced_descriptor(self, desc, node: int, expr):
        """``desc`` with node ``node`` replaced by the expression ``expr``."""
        names = self.names
        fake = list(names)
        fake[node] = expr.write(names)
        return parse_descriptor(desc.write(fake), self.parse_names)

    def optimize_node(self, n: int) -> bool:
        nnet = self.nnet
        if (nnet.nodes[n].type != NodeType.DESCRIPTOR or n + 1 >= nnet.num_nodes()
                or nnet.nodes[n + 1].type != NodeType.COMPONENT):
            return False
        desc = nnet.nodes[n].descriptor
        src = self.descriptor_node(desc)
        if src < 0 or nnet.nodes[src].type != NodeType.COMPONENT:
            return False
        combined = self.collapse_components(nnet.nodes[src].component_index,
                                            nnet.nodes[n + 1].component_index)
        if combined < 0:
            return False
        try:
            new_desc = self.replaced_descriptor(desc, src, nnet.nodes[src - 1].descriptor)
        except ConfigError:
            return False   # an expression the descriptor language cannot nest here
        nnet.nodes[n].descriptor = new_desc
        nnet.nodes[n + 1].component_index = combined
        return True

    # -- the component side ---------------------------------------------------------------
    def collapse_components(self, c1: int, c2: int) -> int:
        cfg = self.config
        for flag, fn in ((cfg.collapse_dropout, self.collapse_dropout),
                         (cfg.collapse_batchnorm, self.collapse_batchnorm),
                         (cfg.collapse_affine, self.collapse_affine),
                         (cfg.collapse_scale, self.collapse_scale)):
            if flag:
                ans = fn(c1, c2)
                if ans >= 0:
                    return ans
        return -1

    def _add(self, name: str, comp) -> int:
        comp.name = name
        self.nnet.components.append(comp)
        self.nnet.component_names.append(name)
        return len(self.nnet.components) - 1

    def _name(self, c: int) -> str:
        return self.nnet.component_names[c]

    def collapse_dropout(self, c1: int, c2: int) -> int:
        comp = self.nnet.components[c1]
        if not isinstance(comp, (DropoutComponent, GeneralDropoutComponent)):
            return -1
        if not comp.test_mode:
            raise ComponentError("dropout must be in test mode before it is collapsed "
                                 "(set_dropout_test_mode)", component=comp.label())
        # what the component does in test mode: DropoutComponent multiplies by
        # 1 - p; GeneralDropoutComponent is the identity
        scale = 1.0 - comp.dropout_proportion if isinstance(comp, DropoutComponent) else 1.0
        return self.scaled_component(c2, scale)

    def scaled_component(self, c: int, scale: float) -> int:
        """A component giving what ``c`` gives on its input scaled by ``scale``
        (Kaldi's GetScaledComponentIndex)."""
        if scale == 1.0:
            return c
        name = f"{self._name(c)}.scale{scale:.3g}"
        existing = self.nnet.get_component_index(name)
        if existing >= 0:
            return existing
        comp = self.nnet.components[c]
        if isinstance(comp, (AffineComponent, TimeHeightConvolutionComponent, TdnnComponent)):
            new = comp.copy()
            new.linear_params = (new.linear_params * np.float32(scale)).astype(np.float32)
        elif isinstance(comp, LinearComponent):
            new = comp.copy()
            new.params = (new.params * np.float32(scale)).astype(np.float32)
        else:
            return -1
        return self._add(name, new)

    def collapse_batchnorm(self, c1: int, c2: int) -> int:
        bn = self.nnet.components[c1]
        if not isinstance(bn, BatchNormComponent):
            return -1
        if not bn.test_mode or bn.offset_vec.shape[0] == 0:
            raise ComponentError("batch-norm must be in test mode before it is collapsed "
                                 "(set_batchnorm_test_mode)", component=bn.label())
        return self.pre_modified_component(bn.offset_vec, bn.scale_vec, self._name(c1), c2)

    def pre_modified_component(self, offset, scale, src_name: str, c: int) -> int:
        """A component giving what ``c`` gives on ``x * scale + offset`` (Kaldi's
        GetDiagonallyPreModifiedComponentIndex)."""
        offset = np.asarray(offset)
        scale = np.asarray(scale)
        if not offset.any() and (scale == 1.0).all():
            return c
        name = f"{src_name}.{self._name(c)}"
        existing = self.nnet.get_component_index(name)
        if existing >= 0:
            return existing
        comp = self.nnet.components[c]
        if isinstance(comp, (AffineComponent, TdnnComponent)):
            linear = comp.linear_params
        elif isinstance(comp, LinearComponent):
            linear = comp.params
        else:
            return -1
        if linear.shape[1] % offset.shape[0] != 0:
            return -1
        if isinstance(comp, LinearComponent):
            new = AffineComponent()
            new.learning_rate = comp.learning_rate
            bias = np.zeros(linear.shape[0], np.float32)
        else:
            new = comp.copy()
            bias = comp.bias_params
            if bias.shape[0] == 0:          # a Tdnn without bias gets one
                bias = np.zeros(linear.shape[0], np.float32)
        new.bias_params, new.linear_params = pre_multiply(offset, scale, bias, linear)
        return self._add(name, new)

    def collapse_affine(self, c1: int, c2: int) -> int:
        comp1, comp2 = self.nnet.components[c1], self.nnet.components[c2]
        if (not isinstance(comp2, AffineComponent)
                or not isinstance(comp1, (FixedAffineComponent, AffineComponent))):
            return -1
        name = f"{self._name(c1)}.{self._name(c2)}"
        existing = self.nnet.get_component_index(name)
        if existing >= 0:
            return existing
        if comp1.input_dim() > comp1.output_dim():
            return -1   # merging a dimension-reducing transform costs time
        w1 = np.asarray(comp1.linear_params, np.float64)
        b1 = np.asarray(comp1.bias_params, np.float64)
        out1, in1 = w1.shape
        in2 = comp2.input_dim()
        if in2 % out1 != 0:
            return -1
        multiple = in2 // out1
        # the second reads `multiple` appended copies (offsets) of the first's output
        w1_full = np.kron(np.eye(multiple), w1)
        b1_full = np.tile(b1, multiple)
        w2 = np.asarray(comp2.linear_params, np.float64)
        new = AffineComponent()
        new.linear_params = (w2 @ w1_full).astype(np.float32)
        new.bias_params = (np.asarray(comp2.bias_params, np.float64) + w2 @ b1_full
                           ).astype(np.float32)
        return self._add(name, new)

    def collapse_scale(self, c1: int, c2: int) -> int:
        comp1, comp2 = self.nnet.components[c1], self.nnet.components[c2]
        if (not isinstance(comp1, AffineComponent) or not isinstance(comp2, FixedScaleComponent)
                or comp1.output_dim() != comp2.input_dim()):
            return -1
        name = f"{self._name(c1)}.{self._name(c2)}"
        existing = self.nnet.get_component_index(name)
        if existing >= 0:
            return existing
        s = np.asarray(comp2.scales, np.float64)
        new = comp1.copy()
        new.bias_params = (np.asarray(comp1.bias_params, np.float64) * s).astype(np.float32)
        new.linear_params = (np.asarray(comp1.linear_params, np.float64) * s[:, None]
                             ).astype(np.float32)
        return self._add(name, new)


# -------------------------------------------------------------------------------------------
# orphan removal (Nnet::RemoveOrphanNodes / RemoveOrphanComponents)


def remove_orphan_nodes(nnet: Nnet, remove_orphan_inputs: bool = False) -> int:
    """Remove nodes no output depends on (input nodes only when asked); descriptors
    are renumbered through their text form.  Returns the number removed."""
    from engine.nnet.graph import find_orphan_nodes  # noqa: PLC0415
    drop = set(find_orphan_nodes(nnet))
    if not remove_orphan_inputs:
        drop = {i for i in drop if not nnet.is_input_node(i)}
    if not drop:
        return 0
    old_names = nnet.node_names
    keep = [i for i in range(nnet.num_nodes()) if i not in drop]
    old_to_new = {old: new for new, old in enumerate(keep)}
    texts = {i: nnet.nodes[i].descriptor.write(old_names) for i in keep
             if nnet.nodes[i].type == NodeType.DESCRIPTOR}
    nnet.nodes = [nnet.nodes[i] for i in keep]
    names = DescriptorNames(nnet.referable_names(), nnet.node_names)
    for old, new in old_to_new.items():
        node = nnet.nodes[new]
        if node.type == NodeType.DESCRIPTOR:
            node.descriptor = parse_descriptor(texts[old], names)
        elif node.type == NodeType.DIM_RANGE:
            node.node_index = old_to_new[node.node_index]
    return len(drop)


def remove_orphan_components(nnet: Nnet) -> int:
    """Remove components no node uses; returns the number removed."""
    used = sorted({n.component_index for n in nnet.nodes if n.type == NodeType.COMPONENT})
    if len(used) == nnet.num_components():
        return 0
    old_to_new = {old: new for new, old in enumerate(used)}
    removed = nnet.num_components() - len(used)
    nnet.components = [nnet.components[c] for c in used]
    nnet.component_names = [nnet.component_names[c] for c in used]
    for node in nnet.nodes:
        if node.type == NodeType.COMPONENT:
            node.component_index = old_to_new[node.component_index]
    return removed


__all__ = ["CollapseModelConfig", "collapse_model", "collapse_model_in_place", "prepare_for_test",
           "pre_multiply", "tiled",
           "set_batchnorm_test_mode", "set_dropout_test_mode", "remove_orphan_nodes",
           "remove_orphan_components"]
