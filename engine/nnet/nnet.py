"""The network: nodes, components and their consistency checks (Kaldi's
nnet-nnet.h/.cc: NetworkNode, Nnet, Nnet::Check, GetConfigLines, Info).

Node structure is Kaldi's: a ``component-node X`` is two nodes, a descriptor
node ``X_input`` immediately followed by the component node ``X``; an output
node is a descriptor node not followed by a component node; ``dim-range-node``
selects columns of an input or component node.  Reading configs (including
applying a config to an existing network) is in ``config.py``.
"""

from __future__ import annotations

import math
from enum import Enum, IntEnum
from typing import Iterable

import numpy as np

from engine.core.errors import ComponentError, ConfigError
from engine.nnet.descriptors import Descriptor


def _is_component(obj) -> bool:
    from engine.nnet.components.base import Component  # noqa: PLC0415
    return isinstance(obj, Component)


class NodeType(IntEnum):
    INPUT = 0
    DESCRIPTOR = 1
    COMPONENT = 2
    DIM_RANGE = 3


class ObjectiveType(str, Enum):
    LINEAR = "linear"
    QUADRATIC = "quadratic"


class NetworkNode:
    """One node.  ``descriptor`` for DESCRIPTOR nodes, ``component_index`` for
    COMPONENT nodes, ``node_index``/``dim_offset``/``dim`` for DIM_RANGE nodes,
    ``dim`` for INPUT nodes, ``objective_type`` for output (descriptor) nodes.
    ``origin`` is ``(source, line)`` of the config line that defined it."""

    __slots__ = ("name", "type", "descriptor", "component_index", "node_index",
                 "dim_offset", "dim", "objective_type", "origin")

    def __init__(self, name: str, type: NodeType, *, descriptor: Descriptor | None = None,
                 component_index: int = -1, node_index: int = -1, dim_offset: int = 0,
                 dim: int = 0, objective_type: ObjectiveType = ObjectiveType.LINEAR,
                 origin: tuple[str | None, int | None] = (None, None)):
        self.name = name
        self.type = NodeType(type)
        self.descriptor = descriptor
        self.component_index = component_index
        self.node_index = node_index
        self.dim_offset = dim_offset
        self.dim = dim
        self.objective_type = ObjectiveType(objective_type)
        self.origin = origin

    def copy(self) -> "NetworkNode":
        return NetworkNode(self.name, self.type,
                           descriptor=self.descriptor.copy() if self.descriptor else None,
                           component_index=self.component_index, node_index=self.node_index,
                           dim_offset=self.dim_offset, dim=self.dim,
                           objective_type=self.objective_type, origin=self.origin)

    def __repr__(self) -> str:
        return f"NetworkNode({self.name!r}, {self.type.name})"


class Nnet:
    """A Kaldi nnet3 network."""

    def __init__(self) -> None:
        self.nodes: list[NetworkNode] = []
        self.components: list = []
        self.component_names: list[str] = []

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_config(cls, *texts: str, source: str | None = None, rng=None) -> "Nnet":
        """Build from one or more config texts, applied in order (as nnet3-init)."""
        from engine.nnet.config import apply_config  # noqa: PLC0415
        nnet = cls()
        for i, t in enumerate(texts):
            src = source if source is not None else f"<config {i}>"
            apply_config(nnet, t, source=src, rng=rng)
        return nnet

    def read_config(self, text: str, source: str | None = None, rng=None) -> None:
        """Add or replace nodes and components (Kaldi's Nnet::ReadConfig)."""
        from engine.nnet.config import apply_config  # noqa: PLC0415
        apply_config(self, text, source=source, rng=rng)

    def copy(self) -> "Nnet":
        new = Nnet()
        new.nodes = [n.copy() for n in self.nodes]
        new.components = [c.copy() for c in self.components]
        new.component_names = list(self.component_names)
        return new

    def stats_copy(self) -> "Nnet":
        """A network for a computation's statistics (``Executor(nnet_to_store_stats=)``)
        that leaves this one untouched: every component that keeps statistics is a copy
        with them zeroed, the others (and the nodes) are shared -- so what it holds after
        a run is what that run stored."""
        from engine.nnet.components.base import ComponentProperty as P  # noqa: PLC0415
        new = Nnet()
        new.nodes = self.nodes
        new.component_names = list(self.component_names)
        new.components = []
        for c in self.components:
            if c.STAT_FIELDS or c.properties() & P.STORES_STATS:
                c = c.copy()
                c.zero_stats()
            new.components.append(c)
        return new

    # -- names and lookups -----------------------------------------------------------
    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def num_nodes(self) -> int:
        return len(self.nodes)

    def num_components(self) -> int:
        return len(self.components)

    def get_node(self, i: int) -> NetworkNode:
        return self.nodes[i]

    def get_node_name(self, i: int) -> str:
        return self.nodes[i].name

    def get_component(self, c: int):
        return self.components[c]

    def get_component_name(self, c: int) -> str:
        return self.component_names[c]

    def get_node_index(self, name: str) -> int:
        """The index of the node named ``name``, or -1.  Looked up in a name -> index
        table that is checked against the node it points at and made again when it is
        stale (nodes are added, removed, reordered and renamed in place by config
        edits, collapsing and fusion): executors ask once per input and output of
        every run, and a scan of a large network's nodes cost more than the rest of
        an I/O call."""
        nodes = self.nodes
        table = self.__dict__.get("_node_table")
        if table is not None:
            i = table.get(name)
            if i is not None and i < len(nodes) and nodes[i].name == name:
                return i
        table = {}
        for i, n in enumerate(nodes):
            table.setdefault(n.name, i)   # the first of a name, as a scan finds it
        self._node_table = table
        return table.get(name, -1)

    def get_component_index(self, name: str) -> int:
        try:
            return self.component_names.index(name)
        except ValueError:
            return -1

    def get_component_by_name(self, name: str):
        c = self.get_component_index(name)
        return self.components[c] if c >= 0 else None

    def referable_names(self) -> list[str | None]:
        """Kaldi's GetSomeNodeNames: descriptors may refer to input, component
        and dim-range nodes only."""
        return [n.name if n.type != NodeType.DESCRIPTOR else None for n in self.nodes]

    # -- node kinds --------------------------------------------------------------------
    def is_input_node(self, i: int) -> bool:
        return self.nodes[i].type == NodeType.INPUT

    def is_descriptor_node(self, i: int) -> bool:
        return self.nodes[i].type == NodeType.DESCRIPTOR

    def is_component_node(self, i: int) -> bool:
        return self.nodes[i].type == NodeType.COMPONENT

    def is_dim_range_node(self, i: int) -> bool:
        return self.nodes[i].type == NodeType.DIM_RANGE

    def is_output_node(self, i: int) -> bool:
        return (self.nodes[i].type == NodeType.DESCRIPTOR
                and (i + 1 == len(self.nodes) or self.nodes[i + 1].type != NodeType.COMPONENT))

    def is_component_input_node(self, i: int) -> bool:
        return (i + 1 < len(self.nodes) and self.nodes[i].type == NodeType.DESCRIPTOR
                and self.nodes[i + 1].type == NodeType.COMPONENT)

    def input_nodes(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if self.is_input_node(i)]

    def output_nodes(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if self.is_output_node(i)]

    def input_names(self) -> list[str]:
        return [self.nodes[i].name for i in self.input_nodes()]

    def output_names(self) -> list[str]:
        return [self.nodes[i].name for i in self.output_nodes()]

    # -- dimensions ---------------------------------------------------------------------
    def node_dim(self, i: int) -> int:
        node = self.nodes[i]
        if node.type in (NodeType.INPUT, NodeType.DIM_RANGE):
            return node.dim
        if node.type == NodeType.DESCRIPTOR:
            return node.descriptor.dim(self)
        return int(self.components[node.component_index].output_dim())

    def input_dim(self, name: str) -> int:
        i = self.get_node_index(name)
        if i < 0 or not self.is_input_node(i):
            return -1
        return self.nodes[i].dim

    def output_dim(self, name: str) -> int:
        i = self.get_node_index(name)
        if i < 0 or not self.is_output_node(i):
            return -1
        return self.node_dim(i)

    # -- whole-network figures -----------------------------------------------------------
    def modulus(self) -> int:
        from engine.nnet.descriptors import lcm  # noqa: PLC0415
        ans = 1
        for n in self.nodes:
            if n.type == NodeType.DESCRIPTOR:
                ans = lcm(ans, n.descriptor.modulus())
        return ans

    def num_parameters(self) -> int:
        """Kaldi's NumParameters: parameters of updatable components only."""
        return sum(int(c.num_parameters()) for c in self.components if c.is_updatable)

    def set_test_mode(self, test_mode: bool = True) -> None:
        for c in self.components:
            c.set_test_mode(test_mode)

    def row_coupled_components(self) -> list[str]:
        """The components whose output for a row depends on the other rows computed with
        it (``Component.couples_rows``: batch-norm in training mode).  With any, the
        sequences of a multi-sequence computation are not computed independently: each
        one's output depends on the others' inputs."""
        return [name for name, c in zip(self.component_names, self.components)
                if c.couples_rows()]

    def array_bytes(self) -> int:
        """The bytes of the arrays the components hold (parameters, statistics, fixed
        vectors; a CompositeComponent's members' too), each array counted once.  Of a
        network apply_config has not drawn yet (its ``check``), the bytes its random
        arrays will hold."""
        seen: set[int] = set()
        total = 0
        stack: list = list(self.components)
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if hasattr(obj, "nbytes") and hasattr(obj, "shape"):      # NumPy or CuPy
                total += int(obj.nbytes)
            elif isinstance(obj, (list, tuple)):
                stack.extend(obj)
            elif isinstance(obj, dict):
                stack.extend(obj.values())
            elif _is_component(obj):
                stack.extend(vars(obj).values())
        return total

    def freeze_parameters(self) -> "Nnet":
        """Make every component's parameter and fixed arrays read-only (NumPy arrays
        only), in place; returns the network.  For decoding copies: the executor may
        then keep derived copies of the weights (a contiguous transpose, see
        engine/runtime/gemm.py), which stay valid because the arrays cannot change.
        To change a frozen network's weights, assign new arrays (never make a frozen
        array writeable again); copies (``copy``) are writeable."""
        for c in self.components:
            for name in tuple(c.PARAMS) + tuple(c.ARRAYS):
                v = getattr(c, name, None)
                if isinstance(v, np.ndarray):
                    v.flags.writeable = False
        return self

    def component_type_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.components:
            out[c.type_name] = out.get(c.type_name, 0) + 1
        return dict(sorted(out.items()))

    # -- config text -----------------------------------------------------------------------
    def get_as_config_line(self, i: int, include_dim: bool = False) -> str:
        node = self.nodes[i]
        names = self.node_names
        if node.type == NodeType.INPUT:
            return f"input-node name={node.name} dim={node.dim}"
        if node.type == NodeType.DESCRIPTOR:
            if not self.is_output_node(i):
                raise ValueError(f"node {node.name} is a component-input node")
            s = f"output-node name={node.name} input={node.descriptor.write(names)}"
            if include_dim:
                s += f" dim={self.node_dim(i)}"
            return s + f" objective={node.objective_type.value}"
        if node.type == NodeType.COMPONENT:
            prev = self.nodes[i - 1]
            s = (f"component-node name={node.name} "
                 f"component={self.component_names[node.component_index]} "
                 f"input={prev.descriptor.write(names)}")
            if include_dim:
                s += f" input-dim={self.node_dim(i - 1)} output-dim={self.node_dim(i)}"
            return s
        return (f"dim-range-node name={node.name} input-node={names[node.node_index]} "
                f"dim-offset={node.dim_offset} dim={node.dim}")

    def config_lines(self, include_dim: bool = False) -> list[str]:
        return [self.get_as_config_line(i, include_dim) for i in range(len(self.nodes))
                if not self.is_component_input_node(i)]

    def config_text(self) -> str:
        return "".join(line + "\n" for line in self.config_lines())

    def info(self) -> str:
        """Kaldi's Nnet::Info (nnet3-info), without per-component statistics."""
        from engine.nnet.graph import compute_simple_context, is_simple_nnet  # noqa: PLC0415
        out = []
        if is_simple_nnet(self):
            left, right = compute_simple_context(self)
            out += [f"left-context: {left}", f"right-context: {right}"]
        out += [f"num-parameters: {self.num_parameters()}", f"modulus: {self.modulus()}"]
        out += self.config_lines(include_dim=True)
        for name, c in zip(self.component_names, self.components):
            out.append(f"component name={name} type={c.info()}")
        return "\n".join(out) + "\n"

    # -- checks --------------------------------------------------------------------------
    def _node_error(self, i: int, message: str) -> ConfigError:
        source, line = self.nodes[i].origin
        return ConfigError(message, source=source, line=line)

    def validate(self, allow_orphans: bool = True) -> None:
        """Kaldi's Nnet::Check plus a check for cycles without a time offset.

        Raises ConfigError naming the node and, where known, the config line.
        With ``allow_orphans=False``, unused components and nodes that no output
        depends on are errors too (Kaldi only warns).
        """
        nodes = self.nodes
        if not nodes:
            raise ConfigError("the network has no nodes")
        seen: dict[str, int] = {}
        num_in = num_out = 0
        for i, node in enumerate(nodes):
            if node.name in seen:
                raise self._node_error(i, f"duplicate node name {node.name!r}")
            seen[node.name] = i
            if node.type == NodeType.INPUT:
                if node.dim <= 0:
                    raise self._node_error(i, f"input node {node.name}: dim must be > 0")
                num_in += 1
            elif node.type == NodeType.DESCRIPTOR:
                if node.descriptor is None:
                    raise self._node_error(i, f"node {node.name} has no descriptor")
                if self.is_output_node(i):
                    num_out += 1
                for src in sorted(set(node.descriptor.get_node_dependencies())):
                    if not 0 <= src < len(nodes):
                        raise self._node_error(i, f"node {node.name}: descriptor refers to "
                                                  f"node index {src} out of range")
                    if nodes[src].type == NodeType.DESCRIPTOR:
                        raise self._node_error(i, f"node {node.name}: descriptor source "
                                                  f"{nodes[src].name} is not an input, "
                                                  f"component or dim-range node")
                try:
                    dim = node.descriptor.dim(self)
                except ConfigError as e:
                    raise self._node_error(i, f"node {self._user_name(i)}: {e.reason}") from None
                if dim <= 0:
                    raise self._node_error(i, f"node {node.name}: descriptor dim {dim} <= 0")
                self._check_scales(i)
            elif node.type == NodeType.COMPONENT:
                if i == 0 or nodes[i - 1].type != NodeType.DESCRIPTOR:
                    raise self._node_error(i, f"component node {node.name} is not preceded "
                                              f"by its input descriptor node")
                if not 0 <= node.component_index < len(self.components):
                    raise self._node_error(i, f"component node {node.name} refers to "
                                              f"component index {node.component_index}")
                comp = self.components[node.component_index]
                src_dim = self.node_dim(i - 1)
                try:
                    in_dim = int(comp.input_dim())
                except (ComponentError, ValueError, NotImplementedError) as e:
                    raise self._node_error(i, f"component node {node.name}: {e}") from None
                if src_dim != in_dim:
                    cname = self.component_names[node.component_index]
                    raise self._node_error(
                        i, f"dimension mismatch for component node {node.name}: its input "
                           f"has dim {src_dim} but component {cname} "
                           f"({comp.type_name}) has input-dim {in_dim}")
            elif node.type == NodeType.DIM_RANGE:
                src = node.node_index
                if not 0 <= src < len(nodes) or nodes[src].type not in (NodeType.INPUT,
                                                                         NodeType.COMPONENT):
                    raise self._node_error(i, f"dim-range node {node.name}: input-node must "
                                              f"be an input or component node")
                in_dim = self.node_dim(src)
                if not (node.dim > 0 and node.dim_offset >= 0
                        and node.dim + node.dim_offset <= in_dim):
                    raise self._node_error(
                        i, f"invalid dimensions for dim-range node {node.name}: input-dim="
                           f"{in_dim}, dim={node.dim}, dim-offset={node.dim_offset}")
        if len(set(self.component_names)) != len(self.component_names):
            raise ConfigError("duplicate component names")
        if len(self.component_names) != len(self.components):
            raise ConfigError("component names and components disagree in number")
        if num_in == 0:
            raise ConfigError("the network has no input node")
        if num_out == 0:
            raise ConfigError("the network has no output node")
        from engine.nnet.graph import (  # noqa: PLC0415
            check_no_zero_offset_cycles, find_orphan_components, find_orphan_nodes)
        check_no_zero_offset_cycles(self)
        if not allow_orphans:
            for c in find_orphan_components(self):
                raise ConfigError(f"component {self.component_names[c]} is not used by any node")
            for i in find_orphan_nodes(self):
                if not self.is_component_input_node(i):
                    raise self._node_error(i, f"node {nodes[i].name} is not used to compute "
                                              f"any output")

    def _check_scales(self, i: int) -> None:
        """Each input node of each part of node i's descriptor must come with one finite
        scale (and its constant term be finite): what the compiler splits the part by
        (Kaldi's SplitByScale, which stops at the first compile otherwise)."""
        desc = self.nodes[i].descriptor
        for p in range(desc.num_parts()):
            part = desc.part(p)
            for src in sorted(set(part.get_node_dependencies())) + [-1]:
                what = f"input node {self._user_name(src)}" if src >= 0 else "the constant term"
                try:
                    alpha = part.get_scale_for_node(src)
                except ConfigError as e:
                    reason = e.reason.replace(f"node {src} ", f"node {self._user_name(src)} ")
                    raise self._node_error(i, f"node {self._user_name(i)}: {reason}") from None
                if not math.isfinite(alpha):
                    raise self._node_error(i, f"node {self._user_name(i)}: the scale of "
                                              f"{what} is not finite ({alpha})")

    def _user_name(self, i: int) -> str:
        """The name a user wrote: X for X's hidden input node X_input."""
        if self.is_component_input_node(i):
            return self.nodes[i + 1].name
        return self.nodes[i].name

    def __repr__(self) -> str:
        return (f"Nnet({len(self.nodes)} nodes, {len(self.components)} components, "
                f"inputs={self.input_names()}, outputs={self.output_names()})")


def describe_nodes(nnet: Nnet, nodes: Iterable[int]) -> str:
    return ", ".join(nnet._user_name(i) for i in nodes)
