"""Graph algorithms on the network (Kaldi's nnet-graph.cc) and network-level
figures from nnet-utils.cc: computation epochs, orphans, IsSimpleNnet,
ComputeSimpleNnetContext, NumParameters, Modulus.

The node graph has an edge ``a -> b`` when node ``b`` depends on node ``a``.
Tarjan's SCC algorithm and the topological sort are written iteratively (deep
networks would overflow Python's recursion limit) but visit nodes in exactly
the order of Kaldi's recursive versions, so SCC and epoch numbers agree.

``compute_simple_context`` mirrors Kaldi: it asks which outputs of a window of
frames are computable from inputs on the same window (a computability
evaluation over Cindexes, using the descriptors' and components'
``is_computable``), for every shift modulo the network's modulus, doubling the
window until the answer is determined.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from engine.core.errors import ConfigError
from engine.core.index import Cindex, Index
from engine.nnet.nnet import Nnet, NodeType, describe_nodes

Graph = list[list[int]]


# -- basic graph algorithms -----------------------------------------------------------


def nnet_to_directed_graph(nnet: Nnet) -> Graph:
    """graph[a] lists the nodes that depend on node a (Kaldi's NnetToDirectedGraph)."""
    n = nnet.num_nodes()
    graph: Graph = [[] for _ in range(n)]
    for i, node in enumerate(nnet.nodes):
        if node.type == NodeType.INPUT:
            deps: Iterable[int] = ()
        elif node.type == NodeType.DESCRIPTOR:
            deps = node.descriptor.get_node_dependencies()
        elif node.type == NodeType.COMPONENT:
            deps = (i - 1,)
        else:
            deps = (node.node_index,)
        for d in sorted(set(deps)):
            graph[d].append(i)
    return graph


def graph_transpose(graph: Graph) -> Graph:
    out: Graph = [[] for _ in graph]
    for a, succ in enumerate(graph):
        for b in succ:
            out[b].append(a)
    return out


def find_sccs(graph: Graph) -> list[list[int]]:
    """Strongly connected components, in the order Kaldi's recursive Tarjan emits them."""
    n = len(graph)
    index = [-1] * n
    low = [-1] * n
    on_stack = [False] * n
    stack: list[int] = []
    sccs: list[list[int]] = []
    counter = 0
    for root in range(n):
        if index[root] != -1:
            continue
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        work = [(root, 0)]
        while work:
            node, pos = work[-1]
            succ = graph[node]
            if pos < len(succ):
                work[-1] = (node, pos + 1)
                nxt = succ[pos]
                if index[nxt] == -1:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack[nxt] = True
                    work.append((nxt, 0))
                elif on_stack[nxt]:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if low[node] == index[node]:
                scc = []
                while True:
                    m = stack.pop()
                    on_stack[m] = False
                    scc.append(m)
                    if m == node:
                        break
                sccs.append(scc)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sccs


def make_scc_graph(graph: Graph, sccs: list[list[int]]) -> Graph:
    where = [0] * len(graph)
    for i, scc in enumerate(sccs):
        for m in scc:
            where[m] = i
    out: Graph = []
    for i, scc in enumerate(sccs):
        dests = {where[b] for m in scc for b in graph[m] if where[b] != i}
        out.append(sorted(dests))
    return out


def compute_top_sort_order(graph: Graph) -> list[int]:
    """node -> position in a topological order (Kaldi's DFS-based ComputeTopSortOrder)."""
    n = len(graph)
    visited = [False] * n
    on_path = [False] * n
    reversed_order: list[int] = []
    for root in range(n):
        if visited[root]:
            continue
        on_path[root] = True
        work = [(root, 0)]
        while work:
            node, pos = work[-1]
            if pos < len(graph[node]):
                work[-1] = (node, pos + 1)
                nxt = graph[node][pos]
                if on_path[nxt]:
                    raise ConfigError("cycle detected when computing the topological order")
                if not visited[nxt]:
                    on_path[nxt] = True
                    work.append((nxt, 0))
                continue
            work.pop()
            on_path[node] = False
            visited[node] = True
            reversed_order.append(node)
    order = [0] * n
    for i, node in enumerate(reversed_order):
        order[node] = n - i - 1
    return order


def compute_nnet_computation_epochs(nnet: Nnet) -> list[int]:
    """node -> epoch: SCCs of the node graph in topological order (recurrent
    parts of a network share one epoch)."""
    graph = nnet_to_directed_graph(nnet)
    sccs = find_sccs(graph)
    scc_order = compute_top_sort_order(make_scc_graph(graph, sccs))
    epochs = [0] * len(graph)
    for i, scc in enumerate(sccs):
        for m in scc:
            epochs[m] = scc_order[i]
    return epochs


def graph_has_cycles(graph: Graph) -> bool:
    if any(len(s) > 1 for s in find_sccs(graph)):
        return True
    return any(a in succ for a, succ in enumerate(graph))


def has_recurrence(nnet: Nnet) -> bool:
    """Whether a node of ``nnet`` depends on itself through others (an LSTM's or GRU's
    recurrence, at some time offset): then a computation has steps frame by frame."""
    return graph_has_cycles(nnet_to_directed_graph(nnet))


# -- orphans ------------------------------------------------------------------------------


def find_orphan_components(nnet: Nnet) -> list[int]:
    used = {n.component_index for n in nnet.nodes if n.type == NodeType.COMPONENT}
    return [c for c in range(nnet.num_components()) if c not in used]


def find_orphan_nodes(nnet: Nnet) -> list[int]:
    """Nodes that no output node depends on."""
    deps = graph_transpose(nnet_to_directed_graph(nnet))
    required = [False] * nnet.num_nodes()
    queue = [i for i in range(nnet.num_nodes()) if nnet.is_output_node(i)]
    while queue:
        i = queue.pop()
        if not required[i]:
            required[i] = True
            queue.extend(deps[i])
    return [i for i, r in enumerate(required) if not r]


# -- Cindex-level dependencies and computability ---------------------------------------------


def _misc_info():
    from engine.nnet.components.base import MiscComputationInfo  # noqa: PLC0415
    return MiscComputationInfo()


def cindex_dependencies(nnet: Nnet, c: Cindex, misc=None) -> list[Cindex]:
    """Every Cindex that ``c`` may depend on (both sides of Failover, etc.)."""
    node = nnet.nodes[c.node]
    if node.type == NodeType.INPUT:
        return []
    if node.type == NodeType.DESCRIPTOR:
        return node.descriptor.get_dependencies(c.index)
    if node.type == NodeType.DIM_RANGE:
        return [Cindex(node.node_index, c.index)]
    comp = nnet.components[node.component_index]
    return [Cindex(c.node - 1, i) for i in comp.get_input_indexes(misc, c.index)]


# How long a chain of undecided dependencies may grow (plus a share per available input
# Index) before the evaluator gives up: only a recurrence that never reaches the inputs
# (t running off to infinity) gets near it; Kaldi's graph builder gives up after 10000
# rounds in the same situation.
MAX_DEPENDENCY_CHAIN = 10_000


class ComputabilityEvaluator:
    """Decides which Cindexes are computable from a set of available inputs.

    Three-valued, like Kaldi's ComputationGraphBuilder: a Cindex is settled as
    not computable as soon as it is not computable even if every unknown input
    were, and as computable as soon as it is computable even if none were;
    otherwise its first unknown input is evaluated, and if that does not settle
    it, all the others (explicit stack, so long recurrences cannot overflow).  A Cindex met again while it is being
    evaluated (a cycle with no time offset) counts as not computable.
    """

    def __init__(self, nnet: Nnet, available: dict[int, Iterable[Index]]):
        self.nnet = nnet
        self.available = {node: set(ixs) for node, ixs in available.items()}
        self.status: dict[Cindex, bool] = {}
        self.misc = _misc_info()
        self.max_chain = MAX_DEPENDENCY_CHAIN + 2 * len(nnet.nodes) * sum(
            len(ixs) for ixs in self.available.values())

    def _chain_error(self, c: Cindex, top: Cindex) -> ConfigError:
        def name(x: Cindex) -> str:
            return f"{self.nnet.nodes[x.node].name}(t={x.index.t})"
        return ConfigError(
            f"cannot decide whether {name(c)} is computable: its dependencies form a chain "
            f"of more than {self.max_chain} undecided steps (now at {name(top)}), a "
            f"recurrence that never reaches the inputs (an Offset() loop with no "
            f"IfDefined() or Failover() start; bad network topology?)")

    def _eval(self, c: Cindex, lookup: Callable[[Cindex], bool]) -> bool:
        node = self.nnet.nodes[c.node]
        t = node.type
        if t == NodeType.DESCRIPTOR:
            return node.descriptor.is_computable(c.index, lookup, None)
        if t == NodeType.COMPONENT:
            comp = self.nnet.components[node.component_index]
            prev = c.node - 1
            return comp.is_computable(self.misc, c.index,
                                      lambda i: lookup(Cindex(prev, i)), None)
        if t == NodeType.DIM_RANGE:
            return lookup(Cindex(node.node_index, c.index))
        return c.index in self.available.get(c.node, ())

    def is_computable(self, c: Cindex) -> bool:
        status = self.status
        if c in status:
            return status[c]
        in_progress: set[Cindex] = set()
        stack = [c]
        optimistic = lambda d: status.get(d, True)  # noqa: E731
        pessimistic = lambda d: status.get(d, False)  # noqa: E731
        while stack:
            top = stack[-1]
            if top in status:
                stack.pop()
                continue
            if not self._eval(top, optimistic):
                status[top] = False
            elif self._eval(top, pessimistic):
                status[top] = True
            else:
                # Resolve one unknown input at a time: often the first settles
                # ``top`` and the others (e.g. a recurrence reaching back in
                # time) need never be looked at.
                unknown = [d for d in cindex_dependencies(self.nnet, top, self.misc)
                           if d not in status and d not in in_progress]
                if unknown:
                    if top in in_progress:
                        # Still undecided after one input: take all the rest at
                        # once (components such as statistics pooling have
                        # thousands of inputs; one at a time would be quadratic).
                        stack.extend(reversed(unknown))
                    else:
                        in_progress.add(top)
                        if len(in_progress) > self.max_chain:
                            raise self._chain_error(c, top)
                        stack.append(unknown[0])
                    continue
                status[top] = False
            stack.pop()
            in_progress.discard(top)
        return status[c]


def evaluate_computability(nnet: Nnet, inputs: dict[str, Sequence[Index]],
                           outputs: dict[str, Sequence[Index]]) -> dict[str, list[bool]]:
    """For each output name, which of its Indexes are computable from ``inputs``."""
    avail = {}
    for name, ixs in inputs.items():
        i = nnet.get_node_index(name)
        if i < 0 or not nnet.is_input_node(i):
            raise ConfigError(f"no input node named {name!r}")
        avail[i] = ixs
    for name in outputs:
        o = nnet.get_node_index(name)
        if o < 0 or not nnet.is_output_node(o):
            raise ConfigError(f"no output node named {name!r}")
    fast = _array_computability(nnet, inputs, outputs)
    if fast is not None:
        return fast
    ev = ComputabilityEvaluator(nnet, avail)
    return {name: [ev.is_computable(Cindex(nnet.get_node_index(name), ix)) for ix in ixs]
            for name, ixs in outputs.items()}


def _array_computability(nnet: Nnet, inputs, outputs) -> dict[str, list[bool]] | None:
    """evaluate_computability by the compiler's array graph build (Kaldi's own way:
    the graph builder's Compute, node by node on whole arrays), or None where that
    build does not apply (then ComputabilityEvaluator decides Cindex by Cindex)."""
    from engine.compiler.graph import output_computability  # noqa: PLC0415
    from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: PLC0415
    names = list(outputs)
    request = ComputationRequest([IoSpecification(n, list(ixs)) for n, ixs in inputs.items()],
                                 [IoSpecification(n, list(outputs[n])) for n in names])
    ok = output_computability(nnet, request)
    if ok is None:
        return None
    out, at = {}, 0
    for n in names:
        k = len(outputs[n])
        out[n] = ok[at:at + k]
        at += k
    return out


# -- network-level figures ------------------------------------------------------------------------


def is_simple_nnet(nnet: Nnet) -> bool:
    """An output called "output", an input called "input" and, if there are
    other inputs, one called "ivector"."""
    o = nnet.get_node_index("output")
    if o < 0 or not nnet.is_output_node(o):
        return False
    i = nnet.get_node_index("input")
    if i < 0 or not nnet.is_input_node(i):
        return False
    if len(nnet.input_nodes()) == 1:
        return True
    v = nnet.get_node_index("ivector")
    return v >= 0 and nnet.is_input_node(v)


def _context_for_shift(nnet: Nnet, start: int, window: int, modulus: int):
    n = 0  # Kaldi draws n at random; the answer does not depend on it.
    frames = [Index(n, t, 0) for t in range(start, start + window)]
    inputs = {"input": frames}
    if nnet.get_node_index("ivector") >= 0:
        inputs["ivector"] = [Index(n, t, 0) for t in range(start - modulus, start + window)]
    ok = evaluate_computability(nnet, inputs, {"output": frames})["output"]
    try:
        first_ok = ok.index(True)
    except ValueError:
        return None
    try:
        first_not_ok = ok.index(False, first_ok)
    except ValueError:
        first_not_ok = window
    if first_not_ok <= first_ok:
        return None
    return first_ok, window - first_not_ok


def compute_simple_context(nnet: Nnet) -> tuple[int, int]:
    """(left, right) context of a simple network, as Kaldi's ComputeSimpleNnetContext."""
    if not is_simple_nnet(nnet):
        raise ConfigError("not a simple network (needs input 'input', output 'output' and "
                          "optionally input 'ivector')")
    modulus = nnet.modulus()
    window, max_window = 40, 800
    while window < max_window:
        results = []
        for start in range(modulus + 1):
            r = _context_for_shift(nnet, start, window, modulus)
            if r is None:
                break
            results.append(r)
        if len(results) <= modulus:
            window *= 2
            continue
        if results[0] != results[modulus]:
            raise ConfigError("network context differs between time shifts that differ by "
                              "the modulus; the network is not time-invariant")
        return max(r[0] for r in results), max(r[1] for r in results)
    source, line = nnet.nodes[nnet.get_node_index("output")].origin
    raise ConfigError(f"could not compute the network's context: no window of up to "
                      f"{max_window} frames of input node 'input' makes frames of output "
                      f"node 'output' computable (a time offset of more than "
                      f"{max_window // 2} frames, or an input the output can never have)",
                      source=source, line=line)


def num_parameters(nnet: Nnet) -> int:
    return nnet.num_parameters()


def modulus(nnet: Nnet) -> int:
    return nnet.modulus()


# -- validation helper: cycles without a time offset ---------------------------------------------


def _max_t_shift(nnet: Nnet, nodes: Iterable[int]) -> int:
    from engine.nnet.descriptors import (  # noqa: PLC0415
        OffsetForwardingDescriptor, ReplaceIndexForwardingDescriptor, iter_forwarding)
    m = 1
    for i in nodes:
        d = nnet.nodes[i].descriptor
        if d is None:
            continue
        for fd in iter_forwarding(d):
            if isinstance(fd, OffsetForwardingDescriptor):
                m = max(m, abs(fd.offset.t))
            elif isinstance(fd, ReplaceIndexForwardingDescriptor) and fd.variable == "t":
                m = max(m, abs(fd.value))
    return m


def check_no_zero_offset_cycles(nnet: Nnet, max_visits: int = 200_000) -> None:
    """ConfigError if some Cindex depends on itself (a recurrence with no time
    offset, e.g. ``IfDefined(r)`` feeding ``r``).  Searched on Cindexes within
    each strongly connected component of the node graph."""
    graph = nnet_to_directed_graph(nnet)
    mod = nnet.modulus()
    misc = _misc_info()
    for scc in find_sccs(graph):
        members = set(scc)
        if len(scc) == 1 and scc[0] not in graph[scc[0]]:
            continue
        bound = 2 * len(scc) * (_max_t_shift(nnet, scc) + mod) + mod
        start_node = min(scc)
        visits = 0
        for t0 in range(min(mod, 16)):
            root = Cindex(start_node, Index(0, t0, 0))
            color: dict[Cindex, int] = {root: 1}
            work = [(root, iter(cindex_dependencies(nnet, root, misc)))]
            while work:
                c, it = work[-1]
                nxt = next(it, None)
                if nxt is None:
                    color[c] = 2
                    work.pop()
                    continue
                if nxt.node not in members or abs(nxt.index.t - t0) > bound:
                    continue
                col = color.get(nxt, 0)
                if col == 1:
                    cyc = [w[0].node for w in work[[w[0] for w in work].index(nxt):]]
                    i = nxt.node
                    source, line = nnet.nodes[i].origin
                    raise ConfigError(
                        f"cycle with no time offset: {describe_nodes(nnet, dict.fromkeys(cyc))}"
                        f" depend on each other at the same time index (use Offset() in the "
                        f"recurrence)", source=source, line=line)
                if col == 0:
                    visits += 1
                    if visits > max_visits:
                        break
                    color[nxt] = 1
                    work.append((nxt, iter(cindex_dependencies(nnet, nxt, misc))))
