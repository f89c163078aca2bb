"""The computation graph and its builder (Kaldi's nnet-computation-graph.{h,cc}:
ComputationGraph, ComputationGraphBuilder, CindexSet, IndexSet).

The graph's vertices are cindexes ``(node, Index)``; ``dependencies[c]`` lists
the cindex ids that cindex ``c`` reads.  The builder follows Kaldi's algorithm
exactly, because the set of cindexes it keeps decides the rows of every matrix
the compiler later creates:

- Inputs are added as computable, outputs as "usable" (usable_count 1) and
  queued.  Each round pops the current queue: a usable cindex whose
  dependencies are not yet known gets them added (new cindexes are queued);
  otherwise its computability is re-evaluated (kComputable / kNotComputable /
  kUnknown, by asking the descriptor or component with unknown inputs counted
  first as absent, then as present).
- ``usable_count`` is the number of dependents that are themselves usable and
  not known to be uncomputable (plus one for requested outputs).  When a
  cindex turns out uncomputable its whole subtree may stop being usable, which
  stops the expansion: this is what makes recurrences far from t=0 terminate
  instead of walking back in time forever.
- ``prune`` keeps, per dependency list, only the inputs actually used
  (Failover/IfDefined choices resolved), then keeps only cindexes required by
  the outputs (plus the supplied inputs), renumbering the ids.

Kaldi's recursions on usable counts are done here with explicit stacks
(graphs reach 100k cindexes, deeper than Python's recursion limit), visiting
in the same order.  Per-cindex state lives in flat lists of ints.

Speed: the builder first tries engine.compiler.graph_arrays, which computes the
same pruned graph node by node on whole arrays; this module's cindex-by-cindex
algorithm runs when that declines (its docstring lists when) and reports the
errors.  Descriptors are evaluated through generated functions
(engine.compiler.fast_descriptors).  The graph container and per-node facts
live in engine.compiler.graph_nodes; a finished segment is numbered
canonically there, whichever way it was built.
"""

from __future__ import annotations

from engine.compiler.graph_arrays import ArrayGraphBuild, GiveUp, build_arrays
from engine.compiler.graph_nodes import (ComputationGraph, NodeTable, node_table_for,  # noqa: F401
                                         node_names, print_indexes)
from engine.core.cancel import checkpoint
from engine.core.errors import NotComputableError, RequestError, ResourceLimitError
from engine.core.index import Cindex, Index

_tuple_new = tuple.__new__

# Kaldi's ComputableInfo values.
K_UNKNOWN = 0
K_COMPUTABLE = 1
K_NOT_COMPUTABLE = 2
_STATUS_NAMES = {K_UNKNOWN: "kUnknown", K_COMPUTABLE: "kComputable",
                 K_NOT_COMPUTABLE: "kNotComputable"}

# Node kinds (as engine.compiler.graph_nodes numbers them).
_INPUT, _DESCRIPTOR, _COMPONENT, _DIM_RANGE = 0, 1, 2, 3

# Kaldi's guard against runaway graph building (a bad topology).
MAX_BUILD_ITERATIONS = 10000
# The per-cindex build (the fallback when the array build declines: sparse requests
# over wide t ranges, descriptors without a compiled form) costs ~50 us per cindex;
# beyond this many it stops with a ResourceLimitError instead of running for minutes.
MAX_FALLBACK_CINDEXES = 2_000_000


class ComputationGraphBuilder:
    """Builds one segment of a ComputationGraph per request (Compute, then Prune)."""

    def __init__(self, nnet, graph: ComputationGraph) -> None:
        self.nnet = nnet
        self.graph = graph
        table = graph.node_table
        self.nodes = table if table is not None and table.nnet is nnet else node_table_for(nnet)
        graph.node_table = self.nodes
        self.request = None
        self.io_rows: list | None = None     # the request's Indexes as arrays, if given
        # Per-cindex state of the general algorithm (sized by _sync_state).
        self.computable: list[int] = []
        self.usable: list[int] = []
        self.queued: list[bool] = []
        self.deps_done: list[bool] = []
        # Dependents of each cindex; None stands for an empty list (most
        # entries, and saves allocating one list per graph vertex).
        self.depend_on_this: list[list[int] | None] = []
        self.current_queue: list[int] = []
        self.next_queue: list[int] = []
        # Try the array build first (engine.compiler.graph_arrays); it gives the
        # same graph, and declines where it does not apply.
        self.use_arrays = True
        # "used" or "declined: <why>" for the last compute() (for tests and profiling),
        # and which array build was tried last ("intervals" or "sweeps", graph_arrays)
        self.array_status = ""
        self.array_method = ""
        self._array_result = None

    def _sync_state(self) -> None:
        """Cindexes of earlier segments were all computable and kept (Kaldi's
        state right after Prune): usable_count 1 so they never propagate."""
        m = len(self.graph) - len(self.computable)
        if m > 0:
            self.computable.extend([K_COMPUTABLE] * m)
            self.usable.extend([1] * m)
            self.queued.extend([False] * m)
            self.deps_done.extend([False] * m)
            self.depend_on_this.extend([None] * m)

    # -- adding cindexes ------------------------------------------------------------
    def _new_info(self) -> None:
        self.computable.append(K_UNKNOWN)
        self.usable.append(0)
        self.queued.append(False)
        self.deps_done.append(False)
        self.depend_on_this.append(None)

    def _add_inputs(self) -> None:
        graph, nnet = self.graph, self.nnet
        for spec in self.request.inputs:
            node = nnet.get_node_index(spec.name)
            if node == -1:
                raise RequestError(f"the network has no input node named {spec.name!r}")
            if self.nodes.kind[node] not in (_INPUT, _COMPONENT):
                raise RequestError(f"input {spec.name!r}: inputs are only allowed for input "
                                   f"nodes and component nodes")
            for idx in spec.indexes:
                cid, is_new = graph.get_or_add(Cindex(node, idx), True)
                if not is_new:
                    raise RequestError(f"input {spec.name!r}: index {tuple(idx)} is listed "
                                       f"more than once (or already in an earlier segment)")
                self._new_info()
                self.computable[cid] = K_COMPUTABLE

    def _add_outputs(self) -> None:
        graph, nnet = self.graph, self.nnet
        if not any(spec.indexes for spec in self.request.outputs):
            raise RequestError("cannot process a computation request with no outputs")
        for spec in self.request.outputs:
            node = nnet.get_node_index(spec.name)
            if node == -1:
                raise RequestError(f"the network has no output node named {spec.name!r}")
            for idx in spec.indexes:
                cid, is_new = graph.get_or_add(Cindex(node, idx), False)
                if not is_new:
                    raise RequestError(f"output {spec.name!r}: index {tuple(idx)} is listed "
                                       f"more than once (or already in an earlier segment)")
                self._new_info()
                self.usable[cid] = 1
                self.queued[cid] = True
                self.next_queue.append(cid)
        self.current_queue, self.next_queue = self.next_queue, []

    # -- the main loop --------------------------------------------------------------
    def compute(self, request, io_rows: list | None = None) -> None:
        """``io_rows``: as for build_computation_graph."""
        if self.request is not None and not self.graph.segment_ends:
            raise RuntimeError("call compute(), prune(), compute(), prune() ... in that order")
        self.request = request
        self.io_rows = io_rows
        self.array_status = ""
        self.array_method = ""
        self._array_result = None
        if self.use_arrays:
            self._array_result = build_arrays(self, request, MAX_BUILD_ITERATIONS)
            if self._array_result is not None:
                return
        self._sync_state()
        self._add_inputs()
        self._add_outputs()
        for _ in range(MAX_BUILD_ITERATIONS):
            self._build_one_iter()
            if not self.current_queue:
                return
            if len(self.graph) > MAX_FALLBACK_CINDEXES:
                raise ResourceLimitError(
                    f"the computation graph grew past {MAX_FALLBACK_CINDEXES} cindexes on "
                    f"the per-cindex build (the array build {self.array_status or 'was off'}"
                    f"); ask for fewer or denser Indexes")
        raise NotComputableError("loop detected while building the computation graph "
                                 f"(more than {MAX_BUILD_ITERATIONS} rounds, as Kaldi: a "
                                 "recurrence followed over that many steps -- a request "
                                 "this long on a recurrent network -- or a bad network "
                                 "topology)")

    def _build_one_iter(self) -> None:
        queue = self.current_queue
        queued, deps_done, usable, computable = (self.queued, self.deps_done, self.usable,
                                                 self.computable)
        todo = 0
        while queue:
            if not todo:
                # at the start of every round and then every 4096 cindexes (about 20 ms
                # of work: this build is the slow fallback)
                checkpoint("the per-cindex graph build")
                todo = 4096
            todo -= 1
            c = queue.pop()
            queued[c] = False
            if not deps_done[c] and usable[c] != 0:
                deps_done[c] = True
                self._add_dependencies(c)
                if not queued[c]:
                    queued[c] = True
                    self.next_queue.append(c)
            elif computable[c] == K_UNKNOWN and usable[c] != 0:
                # (_update_computable_info returns at once for unusable cindexes)
                self._update_computable_info(c)
        self.current_queue, self.next_queue = self.next_queue, queue

    def _input_cindexes(self, c: int) -> list:
        """Input cindexes of ``c`` as Cindexes or plain ``(node, (n, t, x))`` tuples."""
        node, idx = self.graph.cindexes[c]
        nodes = self.nodes
        kind = nodes.kind[node]
        if kind == _DESCRIPTOR:
            fast = nodes.fast[node]
            if fast is not None:
                return fast.deps(idx)
            return nodes.descriptor[node].get_dependencies(idx)
        if kind == _COMPONENT:
            if nodes.simple[node]:
                return [(node - 1, idx)]
            comp = nodes.component[node]
            return [(node - 1, i) for i in comp.get_input_indexes(self.request.misc_info, idx)]
        if kind == _DIM_RANGE:
            return [(nodes.dim_range_src[node], idx)]
        return []

    def _add_dependencies(self, c: int) -> None:
        graph = self.graph
        ids, cindexes, dependencies = graph._ids, graph.cindexes, graph.dependencies
        usable, computable, queued = self.usable, self.computable, self.queued
        # The two commonest kinds inline; the rest through _input_cindexes.
        node, idx = cindexes[c]
        nodes = self.nodes
        kind = nodes.kind[node]
        if kind == _DESCRIPTOR and nodes.fast[node] is not None:
            inputs = nodes.fast[node].deps(idx)
        elif kind == _COMPONENT and nodes.simple[node]:
            inputs = [(node - 1, idx)]
        else:
            inputs = self._input_cindexes(c)
        this_dep = []
        for ci in inputs:
            d = ids.get(ci)
            if d is None:
                # A new cindex (graph.get_or_add and _new_info, inlined): unknown,
                # queued for the next round.
                d = len(cindexes)
                if type(ci) is not Cindex:
                    i = ci[1]
                    ci = _tuple_new(Cindex, (ci[0], i if type(i) is Index
                                             else _tuple_new(Index, i)))
                ids[ci] = d
                cindexes.append(ci)
                graph.is_input.append(False)
                dependencies.append([])
                computable.append(K_UNKNOWN)
                usable.append(0)
                queued.append(True)
                self.deps_done.append(False)
                self.depend_on_this.append(None)
                self.next_queue.append(d)
            this_dep.append(d)
        if len(this_dep) > 1:
            this_dep = sorted(set(this_dep))
        dependencies[c] = this_dep
        dot = self.depend_on_this
        for d in this_dep:
            lst = dot[d]
            if lst is None:
                dot[d] = [c]
            else:
                lst.append(c)
            if usable[d] == 0 and computable[d] != K_NOT_COMPUTABLE:
                if not dependencies[d] and (queued[d] or computable[d] != K_UNKNOWN):
                    # What _increment_usable would do here: nothing below d to
                    # make usable and nothing to queue.
                    usable[d] = 1
                else:
                    self._increment_usable(d)
            else:
                usable[d] += 1

    # -- computability ------------------------------------------------------------------
    def _cindex_set(self, treat_unknown: bool):
        ids, computable = self.graph._ids, self.computable

        def contains(cindex) -> bool:
            cid = ids.get(cindex)
            if cid is None:
                return False
            s = computable[cid]
            return s == K_COMPUTABLE or (treat_unknown and s == K_UNKNOWN)
        return contains

    def _index_set(self, node: int, treat_unknown: bool):
        ids, computable = self.graph._ids, self.computable

        def contains(index) -> bool:
            cid = ids.get((node, index))
            if cid is None:
                return False
            s = computable[cid]
            return s == K_COMPUTABLE or (treat_unknown and s == K_UNKNOWN)
        return contains

    def _all_inputs_status(self, c: int) -> int:
        """Status of a cindex that needs every one of its dependencies: computable
        iff every input is, not computable as soon as one input is not (all inputs
        are in the graph by now), unknown otherwise."""
        computable = self.computable
        status = K_COMPUTABLE
        for d in self.graph.dependencies[c]:
            s = computable[d]
            if s == K_NOT_COMPUTABLE:
                return K_NOT_COMPUTABLE
            if s == K_UNKNOWN:
                status = K_UNKNOWN
        return status

    def _compute_computable_info(self, c: int) -> int:
        node, idx = self.graph.cindexes[c]
        nodes = self.nodes
        kind = nodes.kind[node]
        computable = self.computable
        if kind == _DESCRIPTOR:
            fast = nodes.fast[node]
            if fast is not None:
                if fast.all_required:
                    return self._all_inputs_status(c)
                get = self.graph._ids.get
                states = []
                for ci in fast.deps(idx):
                    d = get(ci)
                    states.append(K_NOT_COMPUTABLE if d is None else computable[d])
                if fast.computable([s == K_COMPUTABLE for s in states]):
                    return K_COMPUTABLE
                if not fast.computable([s != K_NOT_COMPUTABLE for s in states]):
                    return K_NOT_COMPUTABLE
                return K_UNKNOWN
            desc = nodes.descriptor[node]
            if desc.is_computable(idx, self._cindex_set(False), None):
                return K_COMPUTABLE
            if not desc.is_computable(idx, self._cindex_set(True), None):
                return K_NOT_COMPUTABLE
            return K_UNKNOWN
        if kind == _COMPONENT:
            if nodes.simple[node]:
                # A simple component needs exactly the same Index at its input.
                d = self.graph._ids.get((node - 1, idx))
                return K_NOT_COMPUTABLE if d is None else computable[d]
            if nodes.comp_all_required[node]:
                return self._all_inputs_status(c)
            comp, misc = nodes.component[node], self.request.misc_info
            if comp.is_computable(misc, idx, self._index_set(node - 1, False), None):
                return K_COMPUTABLE
            if not comp.is_computable(misc, idx, self._index_set(node - 1, True), None):
                return K_NOT_COMPUTABLE
            return K_UNKNOWN
        if kind == _DIM_RANGE:
            d = self.graph._ids.get((nodes.dim_range_src[node], idx))
            return K_UNKNOWN if d is None else computable[d]
        return K_COMPUTABLE if self.graph.is_input[c] else K_NOT_COMPUTABLE

    def _update_computable_info(self, c: int) -> None:
        if self.usable[c] == 0:
            # Not reachable from anything that might still be computed: don't bother.
            return
        status = self._compute_computable_info(c)
        self.computable[c] = status
        if status == K_UNKNOWN:
            return
        computable, queued = self.computable, self.queued
        for o in self.depend_on_this[c] or ():
            if computable[o] == K_UNKNOWN and not queued[o]:
                queued[o] = True
                self.next_queue.append(o)
        if status == K_NOT_COMPUTABLE and self.usable[c] != 0:
            for d in self.graph.dependencies[c]:
                self._decrement_usable(d)

    def _increment_usable(self, c0: int) -> None:
        usable, computable, deps = self.usable, self.computable, self.graph.dependencies
        usable[c0] += 1
        if usable[c0] != 1 or computable[c0] == K_NOT_COMPUTABLE:
            return
        # Depth-first in Kaldi's order: a cindex that just became usable makes
        # its dependencies usable first, then queues itself if still unknown.
        stack = [(c0, 0)]
        while stack:
            c, i = stack[-1]
            dl = deps[c]
            if i < len(dl):
                stack[-1] = (c, i + 1)
                d = dl[i]
                usable[d] += 1
                if usable[d] == 1 and computable[d] != K_NOT_COMPUTABLE:
                    stack.append((d, 0))
            else:
                stack.pop()
                if computable[c] == K_UNKNOWN and not self.queued[c]:
                    self.queued[c] = True
                    self.next_queue.append(c)

    def _decrement_usable(self, c0: int) -> None:
        usable, computable, deps = self.usable, self.computable, self.graph.dependencies
        stack = [c0]
        while stack:
            c = stack.pop()
            usable[c] -= 1
            if usable[c] == 0 and computable[c] != K_NOT_COMPUTABLE:
                # Order of visiting does not matter here: nothing is queued.
                stack.extend(deps[c])

    # -- results --------------------------------------------------------------------------
    def all_outputs_are_computable(self) -> bool:
        if self._array_result is not None:
            return True      # the array build declines otherwise
        is_output, cindexes, computable = self.nodes.is_output, self.graph.cindexes, self.computable
        return all(computable[c] == K_COMPUTABLE for c in range(len(cindexes))
                   if is_output[cindexes[c].node])

    def get_computable_info(self) -> list[list[bool]]:
        """Per requested output, per Index: computable or not (call before prune)."""
        if self._array_result is not None:
            return [[True] * len(spec.indexes) for spec in self.request.outputs]
        out = []
        for spec in self.request.outputs:
            node = self.nnet.get_node_index(spec.name)
            out.append([self.computable[self.graph._ids[(node, idx)]] == K_COMPUTABLE
                        for idx in spec.indexes])
        return out

    def explain_why_not_computable(self, c0: int, max_lines: int = 100) -> list[str]:
        """Kaldi's ExplainWhyNotComputable: breadth-first over uncomputable dependencies."""
        names = node_names(self.nnet)
        graph, lines, seen, queue = self.graph, [], {c0}, [c0]
        head = 0
        while head < len(queue) and len(lines) < max_lines:
            c = queue[head]
            head += 1
            parts = []
            for d in graph.dependencies[c]:
                parts.append(f"{graph.cindex_str(d, names)}[{_STATUS_NAMES[self.computable[d]]}]")
                if self.computable[d] != K_COMPUTABLE and d not in seen:
                    seen.add(d)
                    queue.append(d)
            lines.append(f"{graph.cindex_str(c, names)} is {_STATUS_NAMES[self.computable[c]]}, "
                         f"dependencies: {', '.join(parts)}")
        return lines

    def _first_missing_input(self, c0: int) -> int:
        """The first (breadth-first) uncomputable cindex behind ``c0`` that has no
        uncomputable dependency of its own: usually an input Index the request lacks."""
        graph, seen, queue, head = self.graph, {c0}, [c0], 0
        fallback = c0
        while head < len(queue):
            c = queue[head]
            head += 1
            bad = [d for d in graph.dependencies[c] if self.computable[d] != K_COMPUTABLE]
            if not bad:
                node = graph.cindexes[c].node
                if self.nodes.kind[node] == _INPUT:
                    return c
                if fallback == c0:
                    fallback = c
            for d in bad:
                if d not in seen:
                    seen.add(d)
                    queue.append(d)
        return fallback

    def not_computable_error(self) -> NotComputableError:
        """The error Kaldi's ExplainWhyAllOutputsNotComputable would log, as an exception."""
        names = node_names(self.nnet)
        graph = self.graph
        bad = [c for c in range(len(graph.cindexes))
               if self.nodes.is_output[graph.cindexes[c].node]
               and self.computable[c] != K_COMPUTABLE]
        total = sum(1 for ci in graph.cindexes if self.nodes.is_output[ci.node])
        shown = ", ".join(graph.cindex_str(c, names) for c in bad[:10])
        missing = self._first_missing_input(bad[0])
        mnode, midx = graph.cindexes[missing]
        if self.nodes.kind[mnode] == _INPUT:
            why = (f"the first missing input behind {graph.cindex_str(bad[0], names)} is "
                   f"{graph.cindex_str(missing, names)}, which the request does not supply")
        else:
            why = (f"{graph.cindex_str(bad[0], names)} fails at "
                   f"{graph.cindex_str(missing, names)}")
        err = NotComputableError(
            f"{len(bad)} of {total} requested output indexes cannot be computed: {shown}"
            f"{' ...' if len(bad) > 10 else ''}; {why}")
        err.outputs = [(names[graph.cindexes[c].node], graph.cindexes[c].index) for c in bad]
        err.missing = (names[mnode], midx)
        err.details = self.explain_why_not_computable(bad[0])
        return err

    # -- pruning ----------------------------------------------------------------------------
    def _prune_dependencies(self, c: int) -> None:
        graph = self.graph
        status, usable = self.computable[c], self.usable[c]
        if status == K_NOT_COMPUTABLE or usable == 0:
            graph.dependencies[c] = []
            return
        if status != K_COMPUTABLE:
            raise AssertionError(f"cindex {c} is usable but its computability is unknown")
        node, idx = graph.cindexes[c]
        nodes = self.nodes
        kind = nodes.kind[node]
        if kind == _DESCRIPTOR:
            fast = nodes.fast[node]
            if fast is not None:
                if fast.all_required:
                    # Every input is used, and computable since c is: the list
                    # built when the dependencies were added stays as it is.
                    return
                get, computable = graph._ids.get, self.computable
                dep_ids = [get(ci) for ci in fast.deps(idx)]
                ok, used = fast.evaluate([d is not None and computable[d] == K_COMPUTABLE
                                          for d in dep_ids])
                ids = [dep_ids[i] for i in used]
            else:
                used_ci: list = []
                ok = nodes.descriptor[node].is_computable(idx, self._cindex_set(False), used_ci)
                ids = [graph._ids[ci] for ci in used_ci]
        elif kind == _COMPONENT:
            if nodes.simple[node] and not graph.is_input[c]:
                # The one input, already the dependency list.
                return
            if nodes.simple[node]:
                d = graph._ids.get((node - 1, idx))
                if d is None or self.computable[d] != K_COMPUTABLE:
                    raise self._input_at_component(node, idx)
                graph.dependencies[c] = [d]
                return
            used_idx: list = []
            ok = nodes.component[node].is_computable(
                self.request.misc_info, idx, self._index_set(node - 1, False), used_idx)
            if not ok and graph.is_input[c]:
                raise self._input_at_component(node, idx)
            ids = [graph._ids[(node - 1, i)] for i in used_idx]
        else:
            return
        if not ok:
            raise AssertionError(f"cindex {c} was computable but no longer is")
        graph.dependencies[c] = sorted(set(ids))

    def _input_at_component(self, node: int, idx) -> RequestError:
        """A value supplied at a component node whose own input is not in the graph.
        Kaldi's graph builder accepts inputs at component nodes, then asserts that each
        is computable from the component's input (which nothing asks for, as the
        supplied value stands in for it): such a request cannot be compiled."""
        name = self.nnet.get_node_name(node)
        return RequestError(
            f"input {name!r} is a component node: a value supplied there needs the "
            f"component's own input in the computation too, which Kaldi's compiler cannot "
            f"build either (at Index {tuple(idx)}); supply the network's input nodes")

    def _compute_required(self, start: int) -> list[bool]:
        graph, is_output = self.graph, self.nodes.is_output
        n = len(graph.cindexes)
        required = [False] * (n - start)
        stack = []
        for c in range(start, n):
            if is_output[graph.cindexes[c].node]:
                required[c - start] = True
                stack.append(c)
        deps = graph.dependencies
        while stack:
            c = stack.pop()
            for d in deps[c]:
                if d >= start and not required[d - start]:
                    required[d - start] = True
                    stack.append(d)
        return required

    def prune(self) -> None:
        graph = self.graph
        if self._array_result is not None:
            graph.append_arrays(*self._array_result)
            self._array_result = None
            graph.segment_ends.append(len(graph))
            return
        start = graph.segment_ends[-1] if graph.segment_ends else 0
        n = len(graph.cindexes)
        cindexes, is_input = graph.cindexes, graph.is_input
        computable, usable, trivial = self.computable, self.usable, self.nodes.prune_trivial
        for c in range(start, n):
            if (trivial[cindexes[c][0]] and computable[c] == K_COMPUTABLE and usable[c] != 0
                    and not is_input[c]):
                # Kaldi's PruneDependencies would keep this list as it is (every
                # input is required and computable); skip the call.
                continue
            self._prune_dependencies(c)
        required = self._compute_required(start)
        keep = [required[c - start] or is_input[c] for c in range(start, n)]
        for c in range(start, n):
            if keep[c - start] and computable[c] != K_COMPUTABLE:
                raise AssertionError("prune called while not everything is computable")
        graph.renumber(start, keep)
        graph.commit_lists(start)
        new_n = len(graph.cindexes)
        # As in Kaldi: everything kept is computable; usable_count 1 stops any
        # later segment from propagating through these cindexes.
        del self.computable[start:], self.usable[start:], self.queued[start:]
        del self.deps_done[start:], self.depend_on_this[start:]
        graph.segment_ends.append(new_n)
        self._sync_state()


def build_computation_graph(nnet, request, graph: ComputationGraph | None = None,
                            builder: ComputationGraphBuilder | None = None,
                            io_rows: list | None = None) -> ComputationGraph:
    """Add one segment for ``request`` to ``graph`` (a new graph if None) and prune it.
    ``io_rows``: the request's Indexes as ComputationRequest.validate returns them
    (inputs, then outputs, as (N, 3) int64 arrays), when the caller has them.

    For multi-segment (looped) computations call it once per request with the
    same graph.  Raises NotComputableError naming the requested output Indexes
    that cannot be computed and the first missing input behind them.
    """
    if graph is None:
        graph = ComputationGraph()
    if builder is None:
        builder = ComputationGraphBuilder(nnet, graph)
    builder.compute(request, io_rows)
    if not builder.all_outputs_are_computable():
        raise builder.not_computable_error()
    builder.prune()
    return graph


def output_computability(nnet, request) -> list[bool] | None:
    """Kaldi's EvaluateComputationRequest on the array build: whether each requested
    output Index (outputs in request order, Indexes in order) is computable from the
    supplied inputs; None where the array build does not apply (the caller then
    decides Index by Index)."""
    builder = ComputationGraphBuilder(nnet, ComputationGraph())
    try:
        ok = ArrayGraphBuild(builder, request, MAX_BUILD_ITERATIONS).output_computability()
    except GiveUp:
        return None
    return ok.tolist()


__all__ = ["ComputationGraph", "ComputationGraphBuilder", "build_computation_graph", "print_indexes",
           "output_computability",
           "K_UNKNOWN", "K_COMPUTABLE", "K_NOT_COMPUTABLE", "MAX_BUILD_ITERATIONS"]
