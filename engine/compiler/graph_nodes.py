"""The computation graph's container and the per-node facts its builder reads
(the data side of Kaldi's nnet-computation-graph.{h,cc}: ComputationGraph, and
what ComputationGraphBuilder asks of the Nnet for every node).

``ComputationGraph`` holds the cindexes (vertices), which of them are supplied
inputs, their dependency lists and the segment boundaries.  ``NodeTable`` reads
the Nnet once per builder: node kinds, descriptors (and their compiled forms,
engine.compiler.fast_descriptors), components, whether a component is simple
or needs every input it lists, and whether the node graph has a recurrence.
"""

from __future__ import annotations

from itertools import compress
from typing import Sequence

from engine.compiler.fast_descriptors import compile_descriptor
from engine.core.index import Cindex, Index
from engine.nnet.components.base import ComponentProperty

# Node kinds, from the nnet's NodeType (kept as small ints for speed).
INPUT, DESCRIPTOR, COMPONENT, DIM_RANGE = 0, 1, 2, 3
_INPUT, _DESCRIPTOR, _COMPONENT, _DIM_RANGE = INPUT, DESCRIPTOR, COMPONENT, DIM_RANGE


class ComputationGraph:
    """Cindexes, which of them are supplied inputs, and their dependencies."""

    def __init__(self) -> None:
        self.cindexes: list[Cindex] = []
        self.is_input: list[bool] = []
        self.dependencies: list[list[int]] = []
        self.segment_ends: list[int] = []
        self._ids: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self.cindexes)

    def get_cindex_id(self, cindex) -> int:
        """Id of ``cindex`` (a Cindex or ``(node, (n, t, x))`` tuple), or -1."""
        return self._ids.get(cindex, -1)

    def get_or_add(self, cindex, is_input: bool = False) -> tuple[int, bool]:
        """Id of ``cindex``, adding it (with ``is_input``) if absent; returns (id, is_new)."""
        cid = self._ids.get(cindex)
        if cid is not None:
            return cid, False
        cid = len(self.cindexes)
        if type(cindex) is not Cindex:
            cindex = make_cindex(cindex)
        self._ids[cindex] = cid
        self.cindexes.append(cindex)
        self.is_input.append(is_input)
        self.dependencies.append([])
        return cid, True

    def renumber(self, start: int, keep: Sequence[bool]) -> None:
        """Drop cindex ids >= ``start`` whose ``keep[id - start]`` is false, keeping order.

        Dependencies must not point at a dropped cindex (the builder guarantees
        this: only unused cindexes are dropped).
        """
        n = len(self.cindexes)
        assert len(keep) == n - start
        if all(keep):
            return
        cindexes, ids = self.cindexes, self._ids
        kept = list(compress(range(start, n), keep))
        for c in compress(range(start, n), (not k for k in keep)):
            del ids[cindexes[c]]
        # old id -> new id for every id (identity below start, -1 if dropped)
        mapping = list(range(start)) + [-1] * (n - start)
        for new_id, old in enumerate(kept, start):
            mapping[old] = new_id
        new_deps = []
        for old in kept:
            nd = [mapping[d] for d in self.dependencies[old]]
            if -1 in nd:
                raise AssertionError("dependency on a pruned cindex")
            new_deps.append(nd)
        new_cindexes = [cindexes[old] for old in kept]
        new_input = [self.is_input[old] for old in kept]
        for new_id, old in enumerate(kept, start):
            if old != new_id:
                ids[cindexes[old]] = new_id
        del self.cindexes[start:], self.is_input[start:], self.dependencies[start:]
        self.cindexes.extend(new_cindexes)
        self.is_input.extend(new_input)
        self.dependencies.extend(new_deps)

    def cindex_str(self, c: int, node_names: Sequence[str]) -> str:
        node, idx = self.cindexes[c]
        return f"{node_names[node]}({idx.n}, {idx.t}, {idx.x})"

    def print(self, node_names: Sequence[str], max_per_node: int = 50,
              max_deps: int = 5) -> str:
        """Kaldi's ComputationGraph::Print: cindexes sorted, grouped by node."""
        def fmt(ci) -> str:
            # Kaldi's PrintCindex: x is shown only when nonzero
            node, (n, t, x) = ci
            return f"{node_names[node]}({n},{t}" + (f",{x})" if x else ")")
        pairs = sorted(((self.cindexes[c], sorted(self.cindexes[d] for d in self.dependencies[c]),
                         c) for c in range(len(self.cindexes))),
                       key=lambda p: (p[0].node, p[0].index.t, p[0].index.x, p[0].index.n))
        out, cur_node, count = [], None, 0
        for ci, deps, c in pairs:
            if ci.node != cur_node:
                if cur_node is not None:
                    out.append("\n")
                cur_node, count = ci.node, 0
            if count < max_per_node:
                s = "[ " + fmt(ci)
                if not self.is_input[c]:
                    shown = ", ".join(fmt(d) for d in deps[:max_deps])
                    s += " -> " + shown + (", ..." if len(deps) > max_deps else "")
                out.append(s + " ] ")
            elif count == max_per_node:
                out.append("...")
            count += 1
        return "".join(out) + "\n"


def make_cindex(ci) -> Cindex:
    """A Cindex (of an Index) from any ``(node, (n, t, x))`` pair, without the
    Python-level named-tuple constructors (this runs once per graph vertex)."""
    idx = ci[1]
    if type(idx) is not Index:
        idx = _tuple_new(Index, idx)
    return _tuple_new(Cindex, (ci[0], idx))


_tuple_new = tuple.__new__


def node_names(nnet) -> list[str]:
    names = nnet.node_names
    return names() if callable(names) else names


# Non-simple components whose IsComputable is "every Index GetInputIndexes
# lists is present" and which then use all of them: the base class's default,
# and Kaldi's TdnnComponent (time offsets, all required).  For these the graph
# builder settles computability from the dependency states alone.
_ALL_INPUTS_COMPONENTS = ("TdnnComponent",)


def _needs_all_inputs(comp) -> bool:
    cls = type(comp)
    if cls.__name__ in _ALL_INPUTS_COMPONENTS:
        return True
    base = next((k for k in cls.__mro__ if k.__name__ == "Component"), None)
    return base is not None and cls.is_computable is base.is_computable


def _has_node_cycle(table) -> bool:
    """Whether the node graph has a cycle (a recurrence).  A recurrence walks
    back in time until the supplied input runs out, so something always turns
    out not computable and the layered fast path would only decline late."""
    num = len(table.kind)
    users: list[list[int]] = [[] for _ in range(num)]
    pending = [0] * num
    for i in range(num):
        kind = table.kind[i]
        if kind == _DESCRIPTOR:
            srcs = set(table.descriptor[i].get_node_dependencies())
        elif kind == _COMPONENT:
            srcs = {i - 1}
        elif kind == _DIM_RANGE:
            srcs = {table.dim_range_src[i]}
        else:
            srcs = set()
        pending[i] = len(srcs)
        for j in srcs:
            users[j].append(i)
    ready = [i for i in range(num) if pending[i] == 0]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                ready.append(u)
    return done < num


class NodeTable:
    """Per-node facts the builder needs, read once from the Nnet."""

    def __init__(self, nnet) -> None:
        num = nnet.num_nodes() if callable(getattr(nnet, "num_nodes", None)) else len(nnet.nodes)
        self.kind: list[int] = []
        self.descriptor: list = []
        self.component: list = []
        self.simple: list[bool] = []
        self.dim_range_src: list[int] = []
        self.is_output: list[bool] = []
        # Descriptors compiled to generated functions; None where the object
        # tree has to be asked (a descriptor class fast_descriptors lacks).
        self.fast: list = []
        for i in range(num):
            node = nnet.nodes[i]
            if nnet.is_input_node(i):
                kind = _INPUT
            elif nnet.is_component_node(i):
                kind = _COMPONENT
            elif nnet.is_dim_range_node(i):
                kind = _DIM_RANGE
            else:
                kind = _DESCRIPTOR
            comp = nnet.get_component(node.component_index) if kind == _COMPONENT else None
            self.kind.append(kind)
            self.descriptor.append(node.descriptor if kind == _DESCRIPTOR else None)
            self.component.append(comp)
            self.simple.append(bool(comp is not None and comp.properties()
                                    & ComponentProperty.SIMPLE_COMPONENT))
            self.dim_range_src.append(node.node_index if kind == _DIM_RANGE else -1)
            self.is_output.append(bool(nnet.is_output_node(i)))
            self.fast.append(compile_descriptor(node.descriptor) if kind == _DESCRIPTOR else None)
        # Nodes whose computable, usable cindexes keep their dependency lists
        # through pruning (all inputs required): inputs, dim-range nodes, simple
        # components and descriptors without IfDefined/Failover/Const.
        self.comp_all_required: list[bool] = [
            c is not None and not s and _needs_all_inputs(c)
            for c, s in zip(self.component, self.simple)]
        self.recurrent = _has_node_cycle(self)
        self.prune_trivial: list[bool] = [
            k in (_INPUT, _DIM_RANGE) or (k == _COMPONENT and (s or a))
            or (k == _DESCRIPTOR and f is not None and f.all_required)
            for k, s, a, f in zip(self.kind, self.simple, self.comp_all_required, self.fast)]


def print_indexes(indexes: Sequence) -> str:
    """Kaldi's PrintIndexes: runs of consecutive t (same n, x) as ``(n,t1:t2[,x])``,
    strings over 200 characters shortened with `` ... `` in the middle."""
    if not indexes:
        return "[ ]"
    parts = []
    start = 0
    num = len(indexes)
    for i in range(1, num + 1):
        if i == num or not (indexes[i][1] == indexes[i - 1][1] + 1
                            and indexes[i][0] == indexes[i - 1][0]
                            and indexes[i][2] == indexes[i - 1][2]):
            n, t, x = indexes[start]
            s = f"({n},{t}" if i == start + 1 else f"({n},{t}:{indexes[i - 1][1]}"
            parts.append(s + (f",{x})" if x != 0 else ")"))
            start = i
    text = "[" + ", ".join(parts) + "]"
    if len(text) > 200:
        text = text[:100] + " ... " + text[-100:]
    return text


__all__ = ["ComputationGraph", "NodeTable", "node_names", "make_cindex", "print_indexes",
           "INPUT", "DESCRIPTOR", "COMPONENT", "DIM_RANGE"]
