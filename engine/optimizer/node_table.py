"""What the decoding-network rewrites (fast_lstm.py, aliases.py) look up about a
network's nodes: names, each component node's input descriptor as text and as a list of
parts, each node's readers, and where dim-range nodes and plain pass-throughs lead."""

from __future__ import annotations

from engine.nnet.components.base import ComponentProperty as P
from engine.nnet.descriptor_parse import DescriptorNames, parse_descriptor
from engine.nnet.descriptors import SimpleForwardingDescriptor, SimpleSumDescriptor
from engine.nnet.nnet import NetworkNode, Nnet, NodeType
from engine.optimizer.collapse import remove_orphan_components


def bare_node(part) -> int | None:
    """The node a descriptor part names plainly (unscaled, no offset or other
    expression around it), else None."""
    if isinstance(part, SimpleSumDescriptor):
        src = part.src
        if isinstance(src, SimpleForwardingDescriptor) and src.scale == 1.0:
            return src.node_index
    return None


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

    def part_texts(self, n: int) -> list[str]:
        """The texts of the parts component node n's input appends (one: the whole)."""
        return self._parts.get(n, [])

    def bare_parts(self, n: int) -> list[int] | None:
        """The nodes component node n's input appends, each read plainly (no offset,
        scale or other expression), or None when its input is anything else."""
        parts = [self.index.get(t, -1) for t in self.part_texts(n)]
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


class NodeListBuilder:
    """A new node list for ``nnet`` made node by node (the rewrites' common last step):
    old nodes kept as they are, component nodes added with their input descriptors
    (as text) and components, dim-range nodes added over a source named; ``install``
    makes it the network's (descriptors parsed, dim-range sources found by name, unused
    components removed)."""

    def __init__(self, nnet: Nnet) -> None:
        self.nnet = nnet
        self.names = nnet.node_names
        self.texts = {i: node.descriptor.write(self.names) for i, node in enumerate(nnet.nodes)
                      if node.type == NodeType.DESCRIPTOR}
        self.nodes: list = []
        self.pending: dict[int, str] = {}         # new position -> descriptor text
        self.dim_range_src: dict[int, str] = {}   # new position -> source node name

    def keep(self, i: int, text: str | None = None) -> None:
        """Old node i as it is (a descriptor node: with ``text`` when given)."""
        node = self.nnet.nodes[i]
        if node.type == NodeType.DESCRIPTOR:
            self.pending[len(self.nodes)] = self.texts[i] if text is None else text
        elif node.type == NodeType.DIM_RANGE:
            self.dim_range_src[len(self.nodes)] = self.names[node.node_index]
        self.nodes.append(node.copy())

    def component(self, name: str, comp_name: str, comp, text: str, origin) -> None:
        """A component node ``name`` of a new component over descriptor ``text``."""
        comp.name = comp_name
        self.nnet.components.append(comp)
        self.nnet.component_names.append(comp_name)
        self.pending[len(self.nodes)] = text
        self.nodes.append(NetworkNode(f"{name}_input", NodeType.DESCRIPTOR, origin=origin))
        self.nodes.append(NetworkNode(name, NodeType.COMPONENT,
                                      component_index=len(self.nnet.components) - 1,
                                      origin=origin))

    def dim_range(self, name: str, source: str, offset: int, dim: int, origin) -> None:
        self.dim_range_src[len(self.nodes)] = source
        self.nodes.append(NetworkNode(name, NodeType.DIM_RANGE, dim_offset=offset, dim=dim,
                                      origin=origin))

    def install(self) -> None:
        nnet = self.nnet
        nnet.nodes = self.nodes
        names = nnet.node_names
        parse_names = DescriptorNames(nnet.referable_names(), names)
        index = {name: i for i, name in enumerate(names)}
        for i, node in enumerate(self.nodes):
            if node.type == NodeType.DESCRIPTOR:
                node.descriptor = parse_descriptor(self.pending[i], parse_names)
            elif node.type == NodeType.DIM_RANGE:
                node.node_index = index[self.dim_range_src[i]]
        remove_orphan_components(nnet)
