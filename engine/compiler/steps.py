"""Phases and steps of a computation (Kaldi's nnet-computation-graph.cc:
ComputeComputationPhases and ComputationStepsComputer).

Phases: the cindexes of each segment are grouped by "epoch" (the network's
strongly connected components in topological order, supplied inputs forming
epoch 0); inside an epoch that spans several nodes (a recurrence) cindexes are
peeled off in rounds, each round holding those whose same-epoch dependencies
were computed in earlier rounds.

Steps: each phase is split by node (cindexes sorted in Kaldi's Cindex order:
node, then t, x, n) and each part becomes one or more steps, lists of cindex
ids that will share one matrix:

- input/output nodes: one step, in the request's Index order;
- component nodes: the component-input (descriptor) step immediately followed
  by the component step with the same Indexes (simple components), or, for
  non-simple ones, the sorted union of the used inputs, with the component's
  ``reorder_indexes`` applied when it declares REORDERS_INDEXES (which may
  add blank ``t = kNoTime`` cindexes to the graph);
- component-input nodes: nothing of their own (done with their component);
- dim-range nodes: one step per source step not yet covered, listing all of
  that source step's Indexes (a column range of its matrix), adding to the
  graph any cindexes not already there.

The order of steps, and of cindexes inside them, is the matrix row order that
must reproduce Kaldi's computations, so every rule above follows Kaldi's code;
where Kaldi iterates a hash set the iteration order of its (libstdc++) set is
reproduced (see ``_unordered_set_order``).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

from engine.core.errors import NotComputableError, RequestError
from engine.core.index import Cindex, Index
from engine.compiler.graph import ComputationGraph, node_names
from engine.nnet.components.base import ComponentProperty
from engine.nnet.graph import compute_nnet_computation_epochs

# --------------------------------------------------------------------------------------
# phases


def _epoch_info(nnet, graph: ComputationGraph):
    """Per segment, per epoch, the cindex ids; the segment-and-epoch key of each
    cindex id; and whether each epoch is 'trivial' (at most one node)."""
    node_to_epoch = [e + 1 for e in compute_nnet_computation_epochs(nnet)]
    num_epochs = 1 + max(node_to_epoch)
    nodes_per_epoch = [0] * num_epochs
    for e in node_to_epoch:
        nodes_per_epoch[e] += 1
    epoch_is_trivial = [k <= 1 for k in nodes_per_epoch]
    n = len(graph.cindexes)
    if not graph.segment_ends or graph.segment_ends[-1] != n:
        raise ValueError("the graph has cindexes outside any segment (was prune called?)")
    key = [0] * n
    epochs_per_segment = []
    start = 0
    cindexes, is_input = graph.cindexes, graph.is_input
    for seg, end in enumerate(graph.segment_ends):
        epochs: list[list[int]] = [[] for _ in range(num_epochs)]
        base = seg * num_epochs
        for c in range(start, end):
            e = 0 if is_input[c] else node_to_epoch[cindexes[c][0]]
            key[c] = base + e
            epochs[e].append(c)
        epochs_per_segment.append(epochs)
        start = end
    return epochs_per_segment, key, epoch_is_trivial


def _phases_for_epoch(this_epoch: list[int], deps_subset: dict[int, list[int]],
                      depend_on_subset: dict[int, list[int]], trivial: bool,
                      phase_index: list[int], phases: list[list[int]],
                      graph: ComputationGraph, names: Sequence[str]) -> None:
    if not this_epoch:
        return
    if trivial:
        # One node (or the supplied inputs): nothing inside depends on anything
        # else inside, so the whole epoch is one phase.
        phases.append(list(this_epoch))
        return
    this_phase = [c for c in this_epoch if not deps_subset[c]]
    if not this_phase:
        raise NotComputableError(
            "the computation has a cycle at the cindex level (e.g. "
            f"{graph.cindex_str(this_epoch[0], names)} depends on itself)")
    while this_phase:
        phases.append(this_phase)
        cur = len(phases) - 1
        candidates = set()
        for c in this_phase:
            phase_index[c] = cur
            candidates.update(depend_on_subset[c])
        this_phase = [c for c in sorted(candidates)
                      if all(phase_index[d] >= 0 for d in deps_subset[c])]
        if candidates and not this_phase:
            raise NotComputableError(
                "the model has a type of recurrence that cannot be computed (e.g. x[t] "
                "depending on both x[t+1] and x[t-1]); stuck at "
                f"{graph.cindex_str(min(candidates), names)}")


def compute_computation_phases(nnet, graph: ComputationGraph) -> list[list[list[int]]]:
    """Kaldi's ComputeComputationPhases: per segment, a list of phases (lists of cindex ids).

    Call after the graph is built and pruned for every segment.
    """
    epochs_per_segment, key, epoch_is_trivial = _epoch_info(nnet, graph)
    n = len(graph.cindexes)
    # Dependencies inside the same segment and epoch, both ways; only epochs of
    # several nodes (recurrences) look at them, so only those are computed.
    deps_subset: dict[int, list[int]] = {}
    depend_on_subset: dict[int, list[int]] = {}
    all_deps = graph.dependencies
    for epochs in epochs_per_segment:
        for e, this_epoch in enumerate(epochs):
            if epoch_is_trivial[e]:
                continue
            for c in this_epoch:
                depend_on_subset[c] = []
            for c in this_epoch:
                k = key[c]
                sub = [d for d in all_deps[c] if key[d] == k]
                deps_subset[c] = sub
                for d in sub:
                    depend_on_subset[d].append(c)
    phase_index = [-1] * n
    names = node_names(nnet)
    out = []
    for epochs in epochs_per_segment:
        phases: list[list[int]] = []
        for e, this_epoch in enumerate(epochs):
            _phases_for_epoch(this_epoch, deps_subset, depend_on_subset, epoch_is_trivial[e],
                              phase_index, phases, graph, names)
        out.append(phases)
    if sum(len(p) for phases in out for p in phases) != n:
        raise AssertionError("phases do not cover every cindex")
    return out


# --------------------------------------------------------------------------------------
# the iteration order of Kaldi's std::unordered_set<int32>

# libstdc++'s table of bucket counts (_Prime_rehash_policy), as far as any
# realistic number of steps needs it.
_PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73,
           79, 83, 89, 97, 103, 109, 113, 127, 137, 139, 149, 157, 167, 179, 193, 199, 211,
           227, 241, 257, 277, 293, 313, 337, 359, 383, 409, 439, 467, 503, 541, 577, 619,
           661, 709, 761, 823, 887, 953, 1031, 1109, 1193, 1289, 1381, 1493, 1613, 1741,
           1879, 2029, 2179, 2357, 2549, 2753, 2971, 3209, 3469, 3739, 4027, 4349, 4703,
           5087, 5503, 5953, 6427, 6949, 7517, 8123, 8783, 9497, 10273, 11113, 12011,
           12983, 14033, 15173, 16411, 17749, 19183, 20753, 22447, 24281, 26267, 28411,
           30727, 33223, 35933, 38873, 42043, 45481, 49201, 53201, 57557, 62233, 67307,
           72817, 78779, 85229, 92203, 99733, 107897, 116731, 126271, 136607, 147793,
           159871, 172933, 187091, 202409, 218971, 236897, 256279, 277261, 299951,
           324503, 351061, 379787, 410857, 444487, 480881, 520241, 562841, 608903,
           658753, 712697, 771049, 834181, 902483, 976369]
_FAST_BKT = [2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13]


def _next_bucket_count(n: int) -> int:
    if n < len(_FAST_BKT):
        return _FAST_BKT[n]
    i = bisect_left(_PRIMES, n, lo=6)
    return _PRIMES[i] if i < len(_PRIMES) else n | 1


def _unordered_set_order(values: Sequence[int]) -> list[int]:
    """The iteration order of a libstdc++ ``std::unordered_set<int>`` after
    inserting ``values`` in order (identity hash, prime bucket counts, each
    new element placed first in its bucket, a new bucket's group placed first
    in the list, rehashing when the size would exceed the bucket count).

    Kaldi creates dim-range steps in this order, which fixes step numbering.
    """
    order: list[int] = []          # the singly linked list, front first
    members: set[int] = set()
    num_buckets, next_resize = 1, 0

    def place(lst: list[int], x: int, nb: int) -> None:
        b = x % nb
        for pos, y in enumerate(lst):
            if y % nb == b:
                lst.insert(pos, x)
                return
        lst.insert(0, x)

    for x in values:
        if x in members:
            continue
        count = len(order)
        if count + 1 > next_resize:
            min_bkts = max(count + 1, 11 if next_resize == 0 else 0)
            if min_bkts >= num_buckets:
                num_buckets = _next_bucket_count(max(min_bkts + 1, num_buckets * 2))
                next_resize = num_buckets
                rebuilt: list[int] = []
                for y in order:
                    place(rebuilt, y, num_buckets)
                order = rebuilt
            else:
                next_resize = num_buckets
        place(order, x, num_buckets)
        members.add(x)
    return order


# --------------------------------------------------------------------------------------
# steps


def _sort_key(c: Cindex) -> tuple[int, int, int, int]:
    node, idx = c
    return (node, idx[1], idx[2], idx[0])


class ComputationStepsComputer:
    """Kaldi's ComputationStepsComputer: turns phases into steps, segment by segment.

    ``steps`` (lists of cindex ids), ``locations[c] = (step, row)`` of every
    cindex id, and ``step_to_segment`` accumulate over calls to
    ``compute_for_segment``.  The graph may grow (padding and dim-range
    cindexes).
    """

    def __init__(self, nnet, graph: ComputationGraph) -> None:
        self.nnet = nnet
        self.graph = graph
        self.steps: list[list[int]] = []
        self.locations: list[tuple[int, int]] = [(-1, -1)] * len(graph.cindexes)
        self.step_to_segment: list[int] = []
        self.num_segments_done = 0
        self._dim_range_done: set[tuple[int, int]] = set()
        self._names = node_names(nnet)

    # -- adding steps ----------------------------------------------------------------
    def _add_step_ids(self, ids: list[int]) -> int:
        s = len(self.steps)
        self.steps.append(ids)
        loc = self.locations
        for row, c in enumerate(ids):
            loc[c] = (s, row)
        return s

    def _add_step(self, cindexes: list, add_if_absent: bool = False) -> int:
        graph = self.graph
        if add_if_absent:
            ids = []
            for ci in cindexes:
                c, is_new = graph.get_or_add(ci, False)
                if is_new:
                    self.locations.append((-1, -1))
                ids.append(c)
        else:
            get = graph._ids.get
            ids = [get(ci, -1) for ci in cindexes]
            if -1 in ids:
                bad = cindexes[ids.index(-1)]
                raise AssertionError(f"step cindex {self._names[bad[0]]}{tuple(bad[1])} "
                                     f"is not in the computation graph")
        return self._add_step_ids(ids)

    # -- per segment ----------------------------------------------------------------------
    def compute_for_segment(self, request, phases: list[list[int]]) -> None:
        segment = self.num_segments_done
        for phase in phases:
            for sub_phase in self._split_into_sub_phases(phase):
                self._process_sub_phase(request, sub_phase)
        self.step_to_segment.extend([segment] * (len(self.steps) - len(self.step_to_segment)))
        self.num_segments_done += 1

    def _split_into_sub_phases(self, phase: list[int]) -> list[list[Cindex]]:
        cindexes = self.graph.cindexes
        ordered = sorted((cindexes[c] for c in phase), key=_sort_key)
        out: list[list[Cindex]] = []
        cur = None
        for ci in ordered:
            if ci[0] != cur:
                cur = ci[0]
                out.append([])
            out[-1].append(ci)
        return out

    def _process_sub_phase(self, request, sub_phase: list[Cindex]) -> None:
        nnet = self.nnet
        node = sub_phase[0][0]
        if nnet.is_component_node(node):
            if any(self.graph.is_input[self.graph._ids[ci]] for ci in sub_phase[:1]):
                raise RequestError(f"inputs supplied at component node "
                                   f"{self._names[node]!r} are not supported")
            self._process_component_step(sub_phase)
        elif nnet.is_input_node(node):
            self._process_io_step(request, False, sub_phase)
        elif nnet.is_output_node(node):
            self._process_io_step(request, True, sub_phase)
        elif nnet.is_dim_range_node(node):
            self._process_dim_range_sub_phase(sub_phase)
        elif nnet.is_component_input_node(node):
            # Done together with the component's own step.
            return
        else:
            raise AssertionError(f"node {node} has an unknown type")

    def _process_io_step(self, request, is_output: bool, sub_phase: list[Cindex]) -> None:
        node = sub_phase[0][0]
        name = self._names[node]
        specs = request.outputs if is_output else request.inputs
        spec = None
        for s in specs:
            if s.name == name:
                spec = s
        if spec is None:
            raise AssertionError(f"{'output' if is_output else 'input'} node {name!r} is "
                                 f"not in the request")
        if len(spec.indexes) != len(sub_phase):
            raise AssertionError(f"node {name!r}: {len(sub_phase)} cindexes in the phase but "
                                 f"{len(spec.indexes)} in the request")
        self._add_step([Cindex(node, idx) for idx in spec.indexes])

    def _process_component_step(self, step: list[Cindex]) -> None:
        node = step[0][0]
        in_node = node - 1
        comp = self.nnet.get_component(self.nnet.nodes[node].component_index)
        props = comp.properties()
        if props & ComponentProperty.SIMPLE_COMPONENT:
            # (plain tuples look up the same as Cindexes)
            self._add_step([(in_node, ci[1]) for ci in step])
            self._add_step(step)
            return
        graph = self.graph
        step_ids = [graph._ids[ci] for ci in step]
        input_ids = set()
        for c in step_ids:
            input_ids.update(graph.dependencies[c])
        input_step = sorted((graph.cindexes[c] for c in input_ids), key=_sort_key)
        if props & ComponentProperty.REORDERS_INDEXES:
            in_idx = [ci[1] for ci in input_step]
            out_idx = [ci[1] for ci in step]
            orig = len(in_idx) + len(out_idx)
            in_idx, out_idx = comp.reorder_indexes(in_idx, out_idx)
            padded = len(in_idx) + len(out_idx) != orig
            self._add_step([Cindex(in_node, Index(*i)) for i in in_idx], padded)
            self._add_step([Cindex(node, Index(*i)) for i in out_idx], padded)
        else:
            self._add_step(input_step)
            self._add_step_ids(step_ids)

    def _process_dim_range_sub_phase(self, sub_phase: list[Cindex]) -> None:
        node = sub_phase[0][0]
        src = self.nnet.nodes[node].node_index
        ids, loc = self.graph._ids, self.locations
        source_steps = []
        prev = -1
        for ci in sub_phase:
            s = loc[ids[(src, ci[1])]][0]
            if s < 0:
                raise AssertionError(f"dim-range node {self._names[node]!r}: source cindex "
                                     f"not yet in a step")
            if s != prev:
                prev = s
                source_steps.append(s)
        cindexes = self.graph.cindexes
        for s in _unordered_set_order(source_steps):
            if (s, node) in self._dim_range_done:
                continue
            self._dim_range_done.add((s, node))
            self._add_step([Cindex(node, cindexes[c][1]) for c in self.steps[s]],
                           add_if_absent=True)

    def check(self) -> None:
        """Every cindex has a location that points back at it (blank padding excepted)."""
        from engine.core.index import K_NO_TIME
        if len(self.locations) != len(self.graph.cindexes):
            raise AssertionError("locations and graph disagree in size")
        for c, (s, r) in enumerate(self.locations):
            if not (s >= 0 and r >= 0 and self.steps[s][r] == c):
                if self.graph.cindexes[c][1][1] != K_NO_TIME:
                    raise AssertionError(f"cindex {self.graph.cindex_str(c, self._names)} has "
                                         f"no consistent location in the steps")


def compute_computation_steps(nnet, request, phases, graph: ComputationGraph,
                              computer: ComputationStepsComputer | None = None
                              ) -> list[list[int]]:
    """Steps for one segment (``request``, its ``phases``), or for all segments when
    ``request`` is a list of requests and ``phases`` the per-segment phases.

    Pass the same ``computer`` for successive segments (Kaldi keeps one
    ComputationStepsComputer for the whole computation); its ``locations`` and
    ``step_to_segment`` are what the Compiler needs besides the steps.
    """
    if computer is None:
        computer = ComputationStepsComputer(nnet, graph)
    if isinstance(request, (list, tuple)):
        if len(request) != len(phases):
            raise ValueError("one list of phases per request is needed")
        for req, ph in zip(request, phases):
            computer.compute_for_segment(req, ph)
    else:
        computer.compute_for_segment(request, phases)
    if computer.num_segments_done == len(graph.segment_ends):
        computer.check()
    return computer.steps


__all__ = ["compute_computation_phases", "compute_computation_steps",
           "ComputationStepsComputer"]
