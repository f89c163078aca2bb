"""What the decoding-network rewrites (fast_lstm.py, aliases.py) look up about a
network's nodes: names, each component node's input descriptor as text and as a list of
parts, each node's readers, and where dim-range nodes and plain pass-throughs lead."""

from __future__ import annotations

from engine.nnet.components.base import ComponentProperty as P
from engine.nnet.nnet import Nnet, NodeType


class NodeTable:
    """``index``: node name -> node; ``text[n]``: the text of component node n's input
    descriptor; ``readers[n]``: the nodes whose input reads node n (a component node,
    for its input descriptor; an output node; a dim-range node)."""

    def __init__(self, nnet: Nnet) -> None:
        self.nnet = nnet
        names = nnet.node_names
        self.index = {name: i for i, name in enumerate(names)}
        self.text: dict[int, str] = {}
        self._parts: dict[int, list[str]] = {}
        self.readers: list[set[int]] = [set() for _ in nnet.nodes]
        last = len(nnet.nodes) - 1
        for i, node in enumerate(nnet.nodes):
            if node.type == NodeType.DESCRIPTOR:
                owner = i + 1 if i < last and nnet.is_component_node(i + 1) else i
                if owner == i + 1:
                    self.text[owner] = node.descriptor.write(names)
                    self._parts[owner] = [p.write(names) for p in node.descriptor.parts]
                for d in node.descriptor.get_node_dependencies():
                    self.readers[d].add(owner)
            elif node.type == NodeType.DIM_RANGE:
                self.readers[node.node_index].add(i)

    def comp(self, n: int):
        """The component of node n, or None when n is not a component node."""
        node = self.nnet.nodes[n]
        return (self.nnet.components[node.component_index]
                if node.type == NodeType.COMPONENT else None)

    def node(self, name: str) -> int:
        return self.index.get(name, -1)

    def dim(self, n: int) -> int:
        """The output dimension of node n (input, component or dim-range node)."""
        node = self.nnet.nodes[n]
        if node.type == NodeType.COMPONENT:
            return self.comp(n).output_dim()
        return node.dim

    def bare_parts(self, n: int) -> list[int] | None:
        """The nodes component node n's input appends, each read plainly (no offset,
        scale or other expression), or None when its input is anything else."""
        parts = [self.index.get(t, -1) for t in self._parts.get(n, ())]
        return parts if parts and min(parts) >= 0 else None

    def source(self, n: int, offset: int) -> tuple[int, int]:
        """(input or component node, column offset) where column ``offset`` of node n
        lives: through a dim-range node to its source."""
        node = self.nnet.nodes[n]
        if node.type == NodeType.DIM_RANGE:
            return node.node_index, node.dim_offset + offset
        return n, offset

    def root(self, n: int) -> int:
        """The node n is computable wherever: n traced back through dim-range nodes and
        simple components reading one node plainly."""
        seen = set()
        while n not in seen:
            seen.add(n)
            node = self.nnet.nodes[n]
            if node.type == NodeType.DIM_RANGE:
                n = node.node_index
                continue
            comp = self.comp(n)
            parts = self.bare_parts(n) if comp is not None else None
            if parts is None or len(parts) != 1 or not comp.properties() & P.SIMPLE_COMPONENT:
                return n
            n = parts[0]
        return n
