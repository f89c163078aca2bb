"""LSTM cells of sigmoid, tanh and product nodes as one LstmNonlinearityComponent, for
inference (an nnetc model simplification; Kaldi has no counterpart, though it is the
relation between its xconfig "lstmp-layer" and "fast-lstmp-layer").

Kaldi's xconfig "lstm-layer" and "lstmp-layer" (and Kaldi-era BLSTMs made of them) write
each cell as fifteen nodes::

    c_t  = c(Sum(c1_t, c2_t))                c: forward-identity (BackpropTruncation
                                                with scale 1, ClipGradient, NoOp)
    i_t  = sigmoid(Sum(i1_t, w_ic * IfDefined(Offset(c_t, d))))
    f_t  = sigmoid(Sum(f1_t, w_fc * IfDefined(Offset(c_t, d))))
    g_t  = tanh(g1_t)
    c1_t = f_t * IfDefined(Offset(c_t, d))    c2_t = i_t * g_t
    o_t  = sigmoid(Sum(o1_t, w_oc * c_t))     h_t = tanh(c_t)
    m_t  = o_t * h_t

where i1_t, f1_t, o1_t, g1_t are the gate affines and the products with w_*c are
PerElementScale (or NaturalGradientPerElementScale) nodes.  That is, term for term and in
the same order of floating-point operations, what Kaldi's LstmNonlinearityComponent
computes from ``Append(i1_t, f1_t, g1_t, o1_t, IfDefined(Offset(c_t, d)))`` with
peepholes (w_ic, w_fc, w_oc), giving [c_t m_t].  The rewrite makes c_t and m_t dim-range
nodes (same names, so every reader keeps its meaning) of one LstmNonlinearityComponent
node, and drops the other nodes.  Where the four gate affines are affine components of
one input descriptor read by nothing else (as xconfig writes them) they become one
AffineComponent with their rows stacked in the order i, f, g, o, which the
nonlinearity reads whole; the recurrent-affine splitting that prepare_nnet runs next
(engine.optimizer.fuse) then takes its recurrent columns into the frame loop as for a
"fast-lstmp-layer".

Per frame of the recurrence, one component and its input assembly replace eleven
components with their input assemblies: on the reference BLSTM, chunk 150: 9,935
commands become about a fourth of that (bench/RESULTS.md).  Outputs are the network's to
float32 rounding (the same expressions; the fast path's sigmoid and tanh are those of
the Sigmoid and Tanh components).

Cells are matched by structure, not by name, and left as they are unless every part
matches: a c component that scales (a "decay-time" BackpropTruncation), an internal
node read from outside the cell, other component types.  Training statistics and
backprop-only settings (self-repair, gradient clipping and truncation) are not
carried over: the network is for decoding (``engine.inference.common.prepare_nnet``).
"""

from __future__ import annotations

import re

import numpy as np

from engine.nnet.components.gradient_control import (BackpropTruncationComponent,
                                                     ClipGradientComponent)
from engine.nnet.components.misc import ElementwiseProductComponent, NoOpComponent
from engine.nnet.components.nonlinear import SigmoidComponent, TanhComponent
from engine.nnet.components.dropout import DropoutMaskComponent
from engine.nnet.components.recurrent import LstmNonlinearityComponent
from engine.nnet.components.scale_offset import (NaturalGradientPerElementScaleComponent,
                                                 PerElementScaleComponent)
from engine.nnet.descriptor_parse import parse_descriptor
from engine.nnet.nnet import Nnet, NodeType
from engine.optimizer.collapse import remove_orphan_components, remove_orphan_nodes
from engine.optimizer.fuse import _FUSABLE, _taking, stacked_affine
from engine.optimizer.node_table import NodeListBuilder, NodeTable

_SCALES = (PerElementScaleComponent, NaturalGradientPerElementScaleComponent)
_NAME = r"([^\s(),]+)"
_SUM = re.compile(rf"Sum\({_NAME}, {_NAME}\)")
_APPEND = re.compile(rf"Append\({_NAME}, (.+)\)")
_APPEND2 = re.compile(rf"Append\({_NAME}, {_NAME}\)")
_DELAYED = r"IfDefined\(Offset\({}, -?\d+\)\)"


def convert_lstm_cells_in_place(nnet: Nnet) -> int:
    """Rewrite, in place, each LSTM cell written as sigmoid, tanh and product nodes as
    one LstmNonlinearityComponent node (see the module docstring).  Returns the number
    of cells rewritten."""
    cells = _Cells(nnet).find()
    if not cells:
        return 0
    _rewrite(nnet, cells)
    nnet.validate()
    return len(cells)


def drop_constant_dropout_masks_in_place(nnet: Nnet) -> int:
    """An LstmNonlinearityComponent with use-dropout whose mask part is a
    DropoutMaskComponent node that outputs ones (dropout-proportion 0, or test mode with
    continuous masks: a decoding network's, as Kaldi's fast LSTMs trained with dropout
    end up) multiplies three gates by one per frame: in place, it is given a copy of its
    component without use-dropout and its input loses the mask part (a copy per step of
    a recurrence), and the mask node goes when nothing else reads it.  Returns the
    number of nodes changed."""
    table = NodeTable(nnet)
    edits: dict[int, list[str]] = {}
    for n in range(len(nnet.nodes)):
        comp = table.comp(n)
        if type(comp) is not LstmNonlinearityComponent or not comp.use_dropout:
            continue
        texts = table.part_texts(n)
        m = table.node(texts[-1])
        mask = table.comp(m) if m >= 0 else None
        if type(mask) is DropoutMaskComponent and mask.output_dim() == 3 and (
                mask.dropout_proportion == 0.0 or (mask.test_mode and mask.continuous)):
            edits[n] = texts[:-1]
    users: dict[int, int] = {}
    for node in nnet.nodes:
        if node.type == NodeType.COMPONENT:
            users[node.component_index] = users.get(node.component_index, 0) + 1
    taken = set(nnet.node_names) | set(nnet.component_names)
    for n, texts in edits.items():
        node = nnet.nodes[n]
        comp = nnet.components[node.component_index].copy()
        comp.use_dropout = False
        if users[node.component_index] == 1:
            nnet.components[node.component_index] = comp
        else:                               # shared with another node: a copy of its own
            comp.name = _taking(f"{nnet.component_names[node.component_index]}.no_mask",
                                taken)
            nnet.components.append(comp)
            nnet.component_names.append(comp.name)
            node.component_index = len(nnet.components) - 1
        text = texts[0] if len(texts) == 1 else "Append(" + ", ".join(texts) + ")"
        nnet.nodes[n - 1].descriptor = parse_descriptor(text, nnet.referable_names(),
                                                        nnet.node_names)
    if edits:
        remove_orphan_nodes(nnet)
        remove_orphan_components(nnet)
        nnet.validate()
    return len(edits)


class _Cells(NodeTable):
    """The matching, on the network's node table."""

    def is_(self, n: int, types, dim: int) -> bool:
        c = self.comp(n) if n >= 0 else None
        return (c is not None and type(c) in types
                and c.input_dim() == c.output_dim() == dim)

    def only_read_by(self, n: int, reader: int) -> bool:
        return self.readers[n] == {reader}

    def find(self) -> list[dict]:
        cells, used = [], set()
        for n in range(len(self.nnet.nodes)):
            cell = self.cell(n)
            if cell is not None and not used.intersection(cell["drop"]):
                used.update(cell["drop"])
                cells.append(cell)
        return cells

    def cell(self, c: int) -> dict | None:
        """The cell whose c_t is node ``c``, or None."""
        comp = self.comp(c)
        if not (type(comp) in (BackpropTruncationComponent, ClipGradientComponent,
                               NoOpComponent)
                and (type(comp) is not BackpropTruncationComponent
                     or comp.scale_value == 1.0)):
            return None
        dim = comp.input_dim()
        m = _SUM.fullmatch(self.text.get(c, ""))
        if m is None:
            return None
        c_name = self.nnet.node_names[c]
        delayed = re.compile(_DELAYED.format(re.escape(c_name)))
        for c1, c2 in ((m[1], m[2]), (m[2], m[1])):
            found = self._cell_parts(c, c_name, dim, self.node(c1), self.node(c2), delayed)
            if found is not None:
                return found
        return None

    def _cell_parts(self, c, c_name, dim, c1, c2, delayed) -> dict | None:
        if c1 == c2 or not (self._product(c1, dim) and self._product(c2, dim)):
            return None
        # c1_t = f_t * c_t(delayed); c2_t = i_t * g_t (either order)
        m1 = _APPEND.fullmatch(self.text[c1])
        if m1 is None or not delayed.fullmatch(m1[2]):
            return None
        delay_text = m1[2]
        f = self._gate(self.node(m1[1]), dim, delay_text)
        m2 = _two(self.text[c2])
        if f is None or m2 is None:
            return None
        for i_name, g_name in (m2, m2[::-1]):
            i = self._gate(self.node(i_name), dim, delay_text)
            g = self.node(g_name)
            if i is not None and self.is_(g, (TanhComponent,), dim) \
                    and self.text[g] in self.index:
                break
        else:
            return None
        g1 = self.index[self.text[g]]
        # o_t = sigmoid(o1 + w_oc * c_t), h_t = tanh(c_t), m_t = o_t * h_t
        h = [r for r in self.readers[c]
             if self.is_(r, (TanhComponent,), dim) and self.text[r] == c_name]
        o = [r for r in self.readers[c] if self.is_(r, _SCALES, dim) and self.text[r] == c_name]
        if len(h) != 1 or len(o) != 1 or len(self.readers[h[0]]) != 1 \
                or len(self.readers[o[0]]) != 1:
            return None
        h, o2 = h[0], o[0]
        o_gate = next(iter(self.readers[o2]))
        m_node = next(iter(self.readers[h]))
        o = self._gate(o_gate, dim, c_name)
        names = self.nnet.node_names
        if o is None or not self._product(m_node, dim) or _two(self.text[m_node]) not in (
                (names[o_gate], names[h]), (names[h], names[o_gate])):
            return None
        i_gate, f_gate = self.node(i_name), self.node(m1[1])
        # the cell's inner nodes are read only inside it
        inner = {i_gate: c2, f_gate: c1, g: c2, o_gate: m_node, h: m_node, c1: c, c2: c,
                 i[1]: i_gate, f[1]: f_gate, o2: o_gate}
        if len(set(inner)) != 10 or any(not self.only_read_by(n, r) for n, r in inner.items()):
            return None
        if not {i[1], f[1], c1, o2, h} <= self.readers[c]:
            return None
        gates = [i[0], f[0], g1, o[0]]            # the pre-activations, in Kaldi's order
        if len(set(gates)) != 4 or set(gates) & (set(inner) | {c, m_node}):
            return None
        stack = self._stackable(gates, {i_gate, f_gate, g, o_gate})
        drop = set(inner) | (set(gates) if stack else set())
        return {"c": c, "m": m_node, "dim": dim, "delayed": delay_text, "gates": gates,
                "stack": stack, "drop": drop,
                "peepholes": [self.comp(i[1]).scales, self.comp(f[1]).scales,
                              self.comp(o2).scales]}

    def _product(self, n: int, dim: int) -> bool:
        comp = self.comp(n) if n >= 0 else None
        return (type(comp) is ElementwiseProductComponent and comp.output_dim() == dim
                and comp.input_dim() == 2 * dim and n in self.text)

    def _gate(self, n: int, dim: int, peephole_input: str) -> tuple[int, int] | None:
        """(pre-activation node, peephole node) of the sigmoid gate ``n`` reading
        Sum(pre-activation, peephole) with the peephole a per-element scale of
        ``peephole_input``; None when ``n`` is not such a gate."""
        if n < 0 or not self.is_(n, (SigmoidComponent,), dim):
            return None
        m = _SUM.fullmatch(self.text[n])
        if m is None:
            return None
        a, b = self.node(m[1]), self.node(m[2])
        for pre, peep in ((a, b), (b, a)):
            if pre >= 0 and pre != peep and self.is_(peep, _SCALES, dim) \
                    and self.text[peep] == peephole_input and self.dim(pre) == dim:
                return pre, peep
        return None

    def _stackable(self, gates: list[int], readers: set[int]) -> bool:
        """The four pre-activations are affine nodes of one input descriptor, float32,
        each read only by its gate."""
        comps = [self.comp(n) for n in gates]
        return (all(type(c) in _FUSABLE and c.linear_params.dtype == np.float32
                    and c.bias_params.dtype == np.float32 for c in comps)
                and len({self.text[n] for n in gates}) == 1
                and all(len(self.readers[n]) == 1 and self.readers[n] <= readers
                        for n in gates))


def _two(text: str) -> tuple[str, str] | None:
    """The two node names of ``Append(a, b)``, or None."""
    m = _APPEND2.fullmatch(text)
    return (m[1], m[2]) if m else None


def _rewrite(nnet: Nnet, cells: list[dict]) -> None:
    out = NodeListBuilder(nnet)
    names, taken = out.names, set(out.names) | set(nnet.component_names)
    drop: set[int] = set()
    at_c: dict[int, list] = {}      # c_t node -> (node name, component, input text) to add
    dim_range: dict[int, tuple[str, int, int]] = {}   # c_t, m_t -> (source, offset, dim)
    for cell in cells:
        c, dim = cell["c"], cell["dim"]
        drop |= cell["drop"]
        # xconfig's "<layer>.c_t" gives "<layer>.W_all", "<layer>.lstm_nonlin"
        prefix = names[c][:-3] if names[c].endswith(".c_t") else f"{names[c]}."
        added = []
        if cell["stack"]:
            w_all = stacked_affine([nnet.components[nnet.nodes[n].component_index]
                                    for n in cell["gates"]])
            w_name = _taking(f"{prefix}W_all", taken)
            added.append((w_name, w_all, out.texts[cell["gates"][0] - 1]))
            parts = [w_name]
        else:
            parts = [names[n] for n in cell["gates"]]
        lstm = LstmNonlinearityComponent()
        lstm.params = np.ascontiguousarray(
            np.stack([np.asarray(p, np.float32) for p in cell["peepholes"]]))
        lstm.value_sum, lstm.deriv_sum = np.zeros((5, dim)), np.zeros((5, dim))
        # Kaldi's defaults (sigmoid, sigmoid, tanh, sigmoid, tanh thresholds; scales)
        lstm.self_repair_config = np.array([0.05, 0.05, 0.2, 0.05, 0.2] + [1e-5] * 5,
                                           dtype=np.float32)
        lstm_name = _taking(f"{prefix}lstm_nonlin", taken)
        added.append((lstm_name, lstm,
                      "Append(" + ", ".join(parts + [cell["delayed"]]) + ")"))
        at_c[c] = added
        dim_range[c] = (lstm_name, 0, dim)
        dim_range[cell["m"]] = (lstm_name, dim, dim)
    for i, node in enumerate(nnet.nodes):
        if i + 1 in drop or i + 1 in dim_range or i in drop:
            continue                        # a dropped node or the input of one
        for name, comp, text in at_c.get(i, ()):
            out.component(name, name, comp, text, node.origin)
        if i in dim_range:
            out.dim_range(node.name, *dim_range[i], node.origin)
        else:
            out.keep(i)
    out.install()


__all__ = ["convert_lstm_cells_in_place", "drop_constant_dropout_masks_in_place"]
