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

Everything works on the graph's arrays (engine.compiler.graph_nodes): the
graph's ids inside a segment are already in Cindex order (supplied inputs
first), so sorting a phase is sorting ids by node; steps are id arrays, and
``loc_step`` / ``loc_row`` give the (step, row) of every cindex.  Phases and
steps read as lists of id lists (``PhaseList``, ``StepList``) for callers that
want them.  A recurrence's rounds are the longest dependency paths inside it,
found along its chains of cindexes on whole arrays (``_longest_paths``); every
other epoch is one phase.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.compiler.array_ops import distinct, max_reduce, min_reduce
from engine.compiler.compile_utils import unordered_map_order
from engine.compiler.graph import ComputationGraph, node_names
from engine.compiler.graph_nodes import (ADDED_CINDEX_ROOM, COMPONENT, DIM_RANGE, INPUT,
                                         node_table_for)
from engine.core.errors import NotComputableError, RequestError
from engine.core.index import K_NO_TIME, array_to_indexes, index_rows
from engine.nnet.components.base import Component, ComponentProperty
from engine.nnet.graph import compute_nnet_computation_epochs

_SIMPLE = int(ComponentProperty.SIMPLE_COMPONENT)
_REORDERS = int(ComponentProperty.REORDERS_INDEXES)
_all = np.logical_and.reduce
_any = np.logical_or.reduce
# rounds of chain following in _longest_paths before the rest is taken one by one
_MAX_PATH_ROUNDS = 16


class _IdLists(Sequence):
    """A list of id lists kept as one id array and boundaries."""

    def __init__(self, ids: np.ndarray, ptr: np.ndarray) -> None:
        self.ids = ids
        self.ptr = ptr
        self._bounds = ptr.tolist()

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.ids[self._bounds[i]:self._bounds[i + 1]].tolist()

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


class PhaseList(_IdLists):
    """One segment's phases (lists of cindex ids, in order)."""


# --------------------------------------------------------------------------------------
# phases


def _csr_rows(ptr: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner position, dependency id) for every dependency of the cindexes ``rows``."""
    cnt = ptr[rows + 1] - ptr[rows]
    total = int(cnt.sum())
    if not total:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    owner = np.repeat(np.arange(len(rows)), cnt)
    first = np.cumsum(cnt) - cnt
    at = np.repeat(ptr[rows] - first, cnt) + np.arange(total)
    return owner, idx[at]


def _deps_of_ascending(ptr: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The dependency ids of the cindexes ``rows`` (distinct, ascending, at least
    one), concatenated in row order: ``_csr_rows(ptr, idx, rows)[1]``, one slice of
    the CSR when the ids are consecutive (the usual sub-phase of a node)."""
    first, end = int(rows[0]), int(rows[-1]) + 1
    if end - first == len(rows):
        return idx[ptr[first]:ptr[end]]
    return _csr_rows(ptr, idx, rows)[1]


def _epoch_levels(members: np.ndarray, deps_owner: np.ndarray, deps_local: np.ndarray,
                  graph: ComputationGraph, names) -> np.ndarray:
    """Kaldi's ComputeComputationPhasesForEpoch on an epoch of several nodes:
    the round in which each member (ids, ascending) can be computed, given the
    dependencies inside the epoch (consumer and producer as member positions).
    A round holds the members all of whose inputs were computed in earlier
    rounds; Kaldi finds them among the users of the previous round.  The round
    of a member is the longest dependency path inside the epoch that ends at it
    (_longest_paths); a cycle is reported (_report_cycle)."""
    k = len(members)
    if not len(deps_owner):
        return np.zeros(k, dtype=np.int64)      # nothing inside depends on anything inside
    level = _longest_paths(k, deps_owner, deps_local)
    if level is None:
        _report_cycle(members, deps_owner, deps_local, graph, names)
    return level


def _report_cycle(members: np.ndarray, deps_owner: np.ndarray, deps_local: np.ndarray,
                  graph: ComputationGraph, names) -> None:
    """Raise the error for an epoch whose dependencies have a cycle
    (_longest_paths found one): Kahn's rounds, one member at a time, say where
    they get stuck."""
    k = len(members)
    remaining = np.bincount(deps_owner, minlength=k).tolist()
    order = np.argsort(deps_local, kind="stable")
    # the users of member c: flat[b[c]:b[c + 1]]
    flat = deps_owner[order].tolist()
    bounds = np.zeros(k + 1, dtype=np.int64)
    np.add.accumulate(np.bincount(deps_local, minlength=k), out=bounds[1:])
    b = bounds.tolist()
    frontier = [i for i, r in enumerate(remaining) if not r]
    if not frontier:
        raise NotComputableError(
            "the computation has a cycle at the cindex level (e.g. "
            f"{graph.cindex_str(int(members[0]), names)} depends on itself)")
    while frontier:
        nxt = []
        push = nxt.append
        for c in frontier:
            for u in flat[b[c]:b[c + 1]]:
                r = remaining[u] - 1
                remaining[u] = r
                if not r:
                    push(u)
        if not nxt:
            stuck = [u for c in frontier for u in flat[b[c]:b[c + 1]]]
            if stuck:
                raise NotComputableError(
                    "the model has a type of recurrence that cannot be computed (e.g. x[t] "
                    "depending on both x[t+1] and x[t-1]); stuck at "
                    f"{graph.cindex_str(int(members[min(stuck)]), names)}")
        frontier = nxt
    raise AssertionError("phases do not cover every cindex")


def _longest_paths(k: int, owner: np.ndarray, local: np.ndarray) -> np.ndarray | None:
    """The round of each of ``k`` members in Kahn's order (_epoch_levels): the length
    of the longest dependency path inside the epoch that ends at it; None when
    the dependencies (``owner`` reads ``local``, member positions, each pair once)
    have a cycle (the caller then takes Kahn's rounds, which say where).

    Most members of a recurrence read one other member: along such chains the
    round grows by the length of each step, so each chain is followed to its
    first member that reads none or several (pointer doubling, on whole arrays).
    The members that read several then read chain starts; a reader's steps to
    one start are kept as the longest, and the same is done again on those
    (usually the several inputs of a member go back to one start, which leaves
    one chain) until no member reads several, or, where that does not reduce
    them, the chain starts are taken one by one (_weighted_rounds)."""
    weight = np.ones(len(owner), dtype=np.int64)
    layers = []
    for _ in range(_MAX_PATH_ROUNDS):
        num_deps = np.bincount(owner, minlength=k)
        single = num_deps[owner] == 1
        # a member's chain reaches jump[u] after dist[u] steps
        jump = np.arange(k)
        jump[owner[single]] = local[single]
        dist = np.zeros(k, dtype=np.int64)
        dist[owner[single]] = weight[single]
        start = num_deps != 1           # where chains start (jump to themselves)
        for _ in range(k.bit_length() + 1):
            if _all(start[jump]):
                break
            dist += dist[jump]
            jump = jump[jump]
        else:
            return None                 # a chain that never starts: a cycle
        layers.append((jump, dist))
        many = ~single
        if not _any(many):
            owner = owner[many]         # (no dependencies left)
            break
        # the readers of several members: their longest way to each chain start
        dep = local[many]
        o, r, w = owner[many], jump[dep], dist[dep] + weight[many]
        order = np.lexsort((w, r, o))
        o, r, w = o[order], r[order], w[order]
        last = np.ones(len(o), dtype=bool)
        last[:-1] = (o[1:] != o[:-1]) | (r[1:] != r[:-1])
        reduced = _any(single) or not _all(last)
        owner, local, weight = o[last], r[last], w[last]
        if not reduced:
            break
    if len(owner):
        level = _weighted_rounds(k, owner, local, weight)
        if level is None:
            return None
    else:
        level = np.zeros(k, dtype=np.int64)
    for jump, dist in reversed(layers):
        level = level[jump] + dist
    return level


def _weighted_rounds(k: int, owner: np.ndarray, local: np.ndarray,
                     weight: np.ndarray) -> np.ndarray | None:
    """The longest path ending at each of ``k`` members, ``owner`` reading ``local``
    over a path of ``weight`` steps, visiting members in Kahn's order one by one;
    None when there is a cycle."""
    remaining = np.bincount(owner, minlength=k).tolist()
    users: dict[int, list] = {}
    for o, src, w in zip(owner.tolist(), local.tolist(), weight.tolist()):
        users.setdefault(src, []).append((o, w))
    level = [0] * k
    todo = [m for m in users if not remaining[m]]
    while todo:
        m = todo.pop()
        base = level[m]
        for o, w in users.get(m, ()):
            if base + w > level[o]:
                level[o] = base + w
            remaining[o] -= 1
            if not remaining[o]:
                todo.append(o)
    if any(remaining):
        return None
    return np.array(level, dtype=np.int64)


def _epoch_facts(epochs: list[int]) -> tuple[np.ndarray, int, list[bool]]:
    """(epoch + 1 of each node, number of epochs + 1, whether each of those holds at
    most one node): epoch 0 is the supplied inputs'."""
    node_to_epoch = np.array(epochs, dtype=np.int64) + 1
    num_epochs = 1 + int(node_to_epoch.max())
    trivial = (np.bincount(node_to_epoch, minlength=num_epochs) <= 1).tolist()
    return node_to_epoch, num_epochs, trivial


def compute_computation_phases(nnet, graph: ComputationGraph) -> list[PhaseList]:
    """Kaldi's ComputeComputationPhases: per segment, its phases (a PhaseList:
    lists of cindex ids).  Call after the graph is built and pruned for every
    segment."""
    table = graph.node_table
    if table is None or table.nnet is not nnet:
        node_to_epoch, num_epochs, trivial = _epoch_facts(compute_nnet_computation_epochs(nnet))
    else:
        # (they depend on the network alone: kept with its NodeTable)
        hit = table.extra.get("phase_epochs")
        if hit is None:
            hit = table.extra["phase_epochs"] = _epoch_facts(table.epochs)
        node_to_epoch, num_epochs, trivial = hit
    n = len(graph)
    if not graph.segment_ends or graph.segment_ends[-1] != n:
        raise ValueError("the graph has cindexes outside any segment (was prune called?)")
    coords, is_input = graph.coords, graph.is_input_array
    epoch_of = np.where(is_input, 0, node_to_epoch[coords[:, 0]])
    ptr, idx = graph.dep_ptr, graph.dep_idx
    names = None
    out = []
    start = 0
    for end in graph.segment_ends:
        ep = epoch_of[start:end]
        order = np.argsort(ep, kind="stable") + start
        counts = np.bincount(ep, minlength=num_epochs).tolist()
        # the ids epoch by epoch as ``order`` has them; an epoch of one node (or the
        # supplied inputs) is one phase as it is (nothing inside depends on anything
        # else inside), the others are reordered by level in place (in a copy)
        ids = order
        sizes = []
        pos = 0
        for e, k in enumerate(counts):
            if not k:
                continue
            if trivial[e]:
                sizes.append(k)
                pos += k
                continue
            members = order[pos:pos + k]
            owner, dep = _csr_rows(ptr, idx, members)
            inside = (dep >= start) & (dep < end)
            inside[inside] = epoch_of[dep[inside]] == e
            if names is None:
                names = node_names(nnet)
            level = _epoch_levels(members, owner[inside],
                                  np.searchsorted(members, dep[inside]), graph, names)
            if ids is order:
                ids = order.copy()
            ids[pos:pos + k] = members[np.lexsort((members, level))]
            sizes.extend(np.bincount(level).tolist())
            pos += k
        bounds = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.add.accumulate(sizes, out=bounds[1:])   # (np.cumsum of a list is slower)
        out.append(PhaseList(ids, bounds))
        start = end
    return out


# --------------------------------------------------------------------------------------
# the iteration order of Kaldi's std::unordered_set<int32>


def _unordered_set_order(values: Sequence[int]) -> list[int]:
    """The iteration order of a libstdc++ ``std::unordered_set<int>`` after
    inserting ``values`` in order (repeats ignored): that of an unordered_map
    with the distinct values as keys (engine.compiler.compile_utils).

    Kaldi creates dim-range steps in this order, which fixes step numbering.
    """
    return unordered_map_order(list(dict.fromkeys(values)))


# --------------------------------------------------------------------------------------
# steps

# node roles for the steps computer
_R_INPUT, _R_OUTPUT, _R_COMPONENT, _R_COMPONENT_INPUT, _R_DIM_RANGE = range(5)


class StepList(_IdLists):
    """The steps (lists of cindex ids) of a ComputationStepsComputer."""


def _step_roles(table) -> tuple:
    """Per node of a NodeTable: its role for the steps computer, whether its input
    step is the same Indexes as its own (simple), whether its component reorders
    Indexes, whether its steps' locations are read while steps are still being made
    (the sources of dim-range nodes), and the node whose same Index a row reads
    (the input of a simple component, the source of a dim-range node; -1 for
    others) and whether it is a simple component, as arrays, and whether it is a
    dim-range node, as an array.  Kept with the table (it depends only on the
    network)."""
    hit = table.extra.get("step_roles")
    if hit is not None:
        return hit
    roles, simple, reorders = [], [], []
    for i, kind in enumerate(table.kind):
        props, comp = table.props[i], table.component[i]
        # A non-simple component that reads exactly its own Index (Kaldi's
        # default GetInputIndexes and IsComputable) and keeps the order: its
        # input step, the sorted union of its inputs, is the same Indexes.
        simple.append(bool(props & _SIMPLE) or (
            comp is not None and not props & _REORDERS
            and type(comp).get_input_indexes is Component.get_input_indexes
            and type(comp).is_computable is Component.is_computable))
        reorders.append(bool(props & _REORDERS))
        if kind == COMPONENT:
            roles.append(_R_COMPONENT)
        elif kind == INPUT:
            roles.append(_R_INPUT)
        elif table.is_output[i]:
            roles.append(_R_OUTPUT)
        elif kind == DIM_RANGE:
            roles.append(_R_DIM_RANGE)
        elif table.is_component_input[i]:
            roles.append(_R_COMPONENT_INPUT)
        else:
            roles.append(-1)
    read_early = [False] * len(roles)
    for src in table.dim_range_src:
        if src >= 0:
            read_early[src] = True
    link_src = np.array([i - 1 if simple[i] else table.dim_range_src[i]
                         for i in range(len(roles))], dtype=np.int64)
    simple_component = np.array([s and r == _R_COMPONENT for s, r in zip(simple, roles)],
                                dtype=bool)
    out = (roles, simple, reorders, read_early, link_src, simple_component,
           np.array(roles) == _R_DIM_RANGE)
    table.extra["step_roles"] = out
    return out


class ComputationStepsComputer:
    """Kaldi's ComputationStepsComputer: turns phases into steps, segment by segment.

    ``step_ids`` (id arrays; ``steps`` as lists), ``loc_step`` / ``loc_row``
    (``locations[c] = (step, row)``) of every cindex id, ``step_nodes`` and
    ``step_to_segment`` accumulate over calls to ``compute_for_segment``.  The
    graph may grow (padding and dim-range cindexes).
    """

    def __init__(self, nnet, graph: ComputationGraph) -> None:
        self.nnet = nnet
        self.graph = graph
        self.step_ids: list[np.ndarray] = []
        self.step_nodes: list[int] = []
        n = len(graph)
        # (with room for the cindexes the steps add to the graph: see _fit_locations)
        self.loc_step = np.full(n + ADDED_CINDEX_ROOM, -1, dtype=np.int64)
        self.loc_row = np.full(n + ADDED_CINDEX_ROOM, -1, dtype=np.int64)
        self.step_to_segment: list[int] = []
        self.num_segments_done = 0
        self._dim_range_done: set[tuple[int, int]] = set()
        self._segment_range = (0, 0)
        self._names = node_names(nnet)
        self._located = 0        # steps whose cindexes have their (step, row) filled in
        self._io_rows: list | None = None   # the segment's Indexes as arrays, if given
        self._steps_view: StepList | None = None
        table = graph.node_table
        if table is None or table.nnet is not nnet:
            table = node_table_for(nnet)
        self._component = table.component
        self._dim_range_src = table.dim_range_src
        self._margin = table.margin
        (self._roles, self._simple, self._reorders, self._read_early,
         self._link_src, self._simple_component, self._is_dim_range) = _step_roles(table)

    # -- views ----------------------------------------------------------------------------
    @property
    def steps(self) -> StepList:
        if self._steps_view is None or len(self._steps_view) != len(self.step_ids):
            lens = [len(a) for a in self.step_ids]
            ptr = np.zeros(len(lens) + 1, dtype=np.int64)
            np.add.accumulate(lens, out=ptr[1:])   # (np.cumsum of a list is slower)
            ids = (np.concatenate(self.step_ids) if self.step_ids
                   else np.zeros(0, dtype=np.int64))
            self._steps_view = StepList(ids, ptr)
        return self._steps_view

    @property
    def locations(self) -> list[tuple[int, int]]:
        self._flush_locations()
        n = len(self.graph)
        return list(zip(self.loc_step[:n].tolist(), self.loc_row[:n].tolist()))

    # -- adding steps ----------------------------------------------------------------
    def _add_step_ids(self, ids: np.ndarray, node: int) -> int:
        s = len(self.step_ids)
        self.step_ids.append(ids)
        self.step_nodes.append(node)
        if self._read_early[node]:
            # dim-range steps look up where their source cindexes are
            self.loc_step[ids] = s
        return s

    def _write_step_locations(self, steps: list[int]) -> None:
        """The step of every cindex of ``steps`` (ascending), as _add_step_ids writes
        it for the steps of read-early nodes, for them all at once."""
        parts = [self.step_ids[s] for s in steps]
        self.loc_step[np.concatenate(parts)] = np.repeat(
            np.array(steps, dtype=np.int64), [len(p) for p in parts])

    def _flush_locations(self) -> None:
        """(step, row) of the cindexes of the steps added since the last call, all at
        once (a cindex in several steps, a blank padding row, keeps its last place)."""
        done, n = self._located, len(self.step_ids)
        if done == n:
            return
        # (from the steps view, which the Compiler and check() read as well)
        view = self.steps
        ptr = view.ptr[done:]
        ids = view.ids[ptr[0]:]
        lens = ptr[1:] - ptr[:-1]
        self.loc_step[ids] = np.arange(done, n).repeat(lens)
        self.loc_row[ids] = np.arange(len(ids)) - (ptr[:-1] - ptr[0]).repeat(lens)
        self._located = n

    def _fit_locations(self) -> None:
        n = len(self.graph)
        if n > len(self.loc_step):
            grow = max(n, 2 * len(self.loc_step))
            for name in ("loc_step", "loc_row"):
                old = getattr(self, name)
                arr = np.full(grow, -1, dtype=np.int64)
                arr[:len(old)] = old
                setattr(self, name, arr)

    def _add_step_like(self, node: int, src: np.ndarray, src_node: int,
                       add_if_absent: bool = False) -> int:
        """A step of node ``node`` with the Indexes of cindexes ``src`` (on ``src_node``)."""
        ids = self.graph.find_like(src, src_node, node)
        if (ids < 0).any():
            return self._add_step(node, self.graph.coords[src, 1:], add_if_absent, ids)
        return self._add_step_ids(ids, node)

    def _add_step(self, node: int, rows: np.ndarray, add_if_absent: bool = False,
                  ids: np.ndarray | None = None) -> int:
        """A step of node ``node`` with Indexes ``rows`` ((m, 3) n, t, x)."""
        graph = self.graph
        if ids is None:
            ids = graph.find(node, rows[:, 0], rows[:, 1], rows[:, 2])
        miss = ids < 0
        if miss.any():
            if not add_if_absent:
                bad = rows[int(np.flatnonzero(miss)[0])].tolist()
                raise AssertionError(f"step cindex {self._names[node]}{tuple(bad)} "
                                     f"is not in the computation graph")
            # new cindexes, numbered in order of first appearance (a repeated
            # blank Index is one cindex)
            where = np.flatnonzero(miss)
            first: dict[tuple, int] = {}
            for j, r in zip(where.tolist(), rows[where].tolist()):
                first.setdefault(tuple(r), j)
            new_rows = np.array([[node, *r] for r in first], dtype=np.int64).reshape(-1, 4)
            new_ids = graph.add_cindexes(new_rows)
            self._fit_locations()
            pos = dict(zip(first, new_ids.tolist()))
            ids = ids.copy()
            ids[where] = [pos[tuple(r)] for r in rows[where].tolist()]
        return self._add_step_ids(ids, node)

    # -- per segment ----------------------------------------------------------------------
    def compute_for_segment(self, request, phases, io_rows: list | None = None) -> None:
        """The steps of the next segment: ``request``, its ``phases``; ``io_rows``:
        the request's Indexes as ComputationRequest.validate returns them, if given."""
        self._io_rows = io_rows
        if not isinstance(phases, PhaseList):
            lists = list(phases)
            sizes = [len(p) for p in lists]
            bounds = np.zeros(len(sizes) + 1, dtype=np.int64)
            np.add.accumulate(sizes, out=bounds[1:])
            phases = PhaseList(np.array([c for p in lists for c in p], dtype=np.int64), bounds)
        segment = self.num_segments_done
        ends = self.graph.segment_ends
        # the ids the graph builder gave this segment
        self._segment_range = (ends[segment - 1] if segment else 0, ends[segment])
        ids = phases.ids
        if len(ids):
            # sub-phases: each phase split by node, in Kaldi's Cindex order (ids
            # are in that order within a node, except supplied inputs, whose step
            # follows the request anyway)
            ptr = phases.ptr
            phase = np.arange(len(phases)).repeat(ptr[1:] - ptr[:-1])
            node = self.graph.coords[ids, 0]
            order = np.lexsort((ids, node, phase))
            ids, node, phase = ids[order], node[order], phase[order]
            cut = ((node[1:] != node[:-1]) | (phase[1:] != phase[:-1])).nonzero()[0] + 1
            bounds = [0] + cut.tolist() + [len(ids)]
            starts = bounds[:-1]
            sub_node = node[starts]
            nodes = sub_node.tolist()
            # the cindexes of each row on the node a simple component or a
            # dim-range node reads, looked up for all rows at once
            linked = self._linked_ids(ids, node)
            # the common case inline: a simple component whose rows all have their
            # input on the node before (two steps: the input's, the component's)
            if linked is not None:
                plain_arr = (self._simple_component[sub_node]
                             & ~(self.graph.is_input_array[ids[starts]]
                                 | np.logical_or.reduceat(linked < 0, starts)))
                plain = plain_arr.tolist()
                whole = self._whole_source_steps(ids, bounds, sub_node, linked, plain_arr)
            else:
                plain = [False] * len(nodes)
                whole = None
            roles, early = self._roles, self._read_early
            # the step of each plain sub-phase (a dim-range sub-phase's source)
            step_ids, step_nodes = self.step_ids, self.step_nodes
            step_of = [-1] * len(nodes) if whole is not None else None
            # The inline cases below add their steps without writing the locations
            # of read-early nodes one step at a time (_add_step_ids): ``deferred``
            # lists those steps, written together just before a step is made
            # otherwise (which may read them); those still deferred at the end are
            # written by _flush_locations with all the others.
            deferred: list[int] = []
            for k, v in enumerate(nodes):
                role = roles[v]
                if role == _R_COMPONENT_INPUT:
                    continue        # done together with the component's own step
                a, b = bounds[k], bounds[k + 1]
                if whole is not None and whole[k] >= 0:
                    # the whole step of a plain sub-phase, in its order: this
                    # sub-phase is the dim-range step (_dim_range_small's first case)
                    self._dim_range_done.add((step_of[whole[k]], v))
                    if early[v]:
                        deferred.append(len(step_ids))
                    step_ids.append(ids[a:b])
                    step_nodes.append(v)
                    continue
                if plain[k]:
                    if early[v - 1]:
                        deferred.append(len(step_ids))
                    step_ids.append(linked[a:b])
                    step_nodes.append(v - 1)
                    if early[v]:
                        deferred.append(len(step_ids))
                    step_ids.append(ids[a:b])
                    step_nodes.append(v)
                    if step_of is not None:
                        step_of[k] = len(step_ids) - 1
                    continue
                if deferred:
                    self._write_step_locations(deferred)
                    deferred = []
                if (role == _R_DIM_RANGE and b - a <= 32 and linked is not None
                        and self._dim_range_small(v, ids[a:b], linked[a:b].tolist())):
                    continue
                self._process_sub_phase(request, v, ids[a:b],
                                        None if linked is None else linked[a:b])
        self._flush_locations()
        self.step_to_segment.extend([segment] * (len(self.step_ids) - len(self.step_to_segment)))
        self.num_segments_done += 1

    def _whole_source_steps(self, ids: np.ndarray, bounds: list, nodes: np.ndarray,
                            linked: np.ndarray, plain: np.ndarray) -> list | None:
        """Per sub-phase (``ids[bounds[k]:bounds[k + 1]]`` on ``nodes[k]``) of a
        dim-range node whose source cindexes (``linked``) are, in order, exactly an
        earlier plain sub-phase (a simple component's, its step as it is: ``plain``),
        that sub-phase's position, else -1; None when there are no such sub-phases.
        Such a sub-phase is its own step, and no other step of its node reads that
        source step (the source rows are its rows' Indexes, one to one)."""
        dim = self._is_dim_range[nodes]
        if not dim.any() or not plain.any():
            return None
        num = len(nodes)
        starts = np.array(bounds[:-1], dtype=np.int64)
        ends = np.array(bounds, dtype=np.int64)
        sizes = ends[1:] - ends[:-1]
        # the position in ``ids`` of each row's source cindex (-1: none or elsewhere)
        where = np.full(len(self.graph), -1, dtype=np.int64)
        where[ids] = np.arange(len(ids))
        pos = np.where(linked >= 0, where[np.maximum(linked, 0)], -1)
        # rows whose source is as far along ``ids`` as their sub-phase's first row's
        lag = pos - np.arange(len(ids))
        aligned = (pos >= 0) & (lag == lag[starts].repeat(sizes))
        ok = np.logical_and.reduceat(aligned, starts) & dim
        first = pos[starts]
        sub = np.arange(num).repeat(sizes)
        src = np.where(ok, sub[np.maximum(first, 0)], 0)
        ok &= ((starts[src] == first) & (sizes[src] == sizes) & plain[src]
               & (src < np.arange(num)))
        if not ok.any():
            return None
        return np.where(ok, src, -1).tolist()

    def _linked_ids(self, ids: np.ndarray, node: np.ndarray) -> np.ndarray | None:
        """For rows of simple components the id of the same Index on the component's
        input node, for rows of dim-range nodes that on the source node (-1 if absent,
        or for other rows); None where the lookup table cannot do it."""
        table = self.graph.table(len(self._roles), self._margin)
        keys = table.key_of[ids]
        if table.mode == "dict" or (len(keys) and min_reduce(keys) < 0):
            return None
        to = self._link_src[node]
        out = np.full(len(ids), -1, dtype=np.int64)
        sel = (to >= 0).nonzero()[0]
        if len(sel):
            out[sel] = table._lookup(keys[sel] + (to[sel] - node[sel]) * table.stride_node)
        return out

    def _process_sub_phase(self, request, node: int, sub: np.ndarray,
                           linked: np.ndarray | None) -> None:
        role = self._roles[node]
        if role == _R_COMPONENT:
            if self.graph.is_input_array[sub[0]]:
                raise RequestError(f"inputs supplied at component node "
                                   f"{self._names[node]!r} are not supported")
            if self._simple[node]:
                if linked is None:
                    linked = self.graph.find_like(sub, node, node - 1)
                if (linked < 0).any():
                    self._add_step(node - 1, self.graph.coords[sub, 1:], False, linked)
                else:
                    self._add_step_ids(linked, node - 1)
                self._add_step_ids(sub, node)
            else:
                self._process_component_step(node, sub)
        elif role == _R_INPUT:
            self._process_io_step(request, False, node, sub)
        elif role == _R_OUTPUT:
            self._process_io_step(request, True, node, sub)
        elif role == _R_DIM_RANGE:
            self._process_dim_range_sub_phase(node, sub, linked)
        elif role == _R_COMPONENT_INPUT:
            # Done together with the component's own step.
            return
        else:
            raise AssertionError(f"node {node} has an unknown type")

    def _process_io_step(self, request, is_output: bool, node: int, sub: np.ndarray) -> None:
        name = self._names[node]
        specs = request.outputs if is_output else request.inputs
        spec = None
        for k, s in enumerate(specs):
            if s.name == name:
                spec, at = s, k
        if spec is None:
            raise AssertionError(f"{'output' if is_output else 'input'} node {name!r} is "
                                 f"not in the request")
        if len(spec.indexes) != len(sub):
            raise AssertionError(f"node {name!r}: {len(sub)} cindexes in the phase but "
                                 f"{len(spec.indexes)} in the request")
        if not is_output and self._supplied_in_request_order(sub):
            self._add_step_ids(sub, node)
            return
        if self._io_rows is not None:
            rows = self._io_rows[at + len(request.inputs) if is_output else at]
        else:
            rows = index_rows(spec.indexes)
        if self._listed_in_id_order(sub, rows):
            self._add_step_ids(sub, node)
            return
        self._add_step(node, rows)

    @staticmethod
    def _supplied_in_request_order(sub: np.ndarray) -> bool:
        """Whether the ids ``sub`` of an input node's supplied cindexes (ascending) are
        its step as they are: the graph numbers a segment's supplied inputs first,
        in request order, so consecutive ids are the Indexes of one input in that
        order."""
        return int(sub[-1]) - int(sub[0]) == len(sub) - 1

    def _listed_in_id_order(self, sub: np.ndarray, rows: np.ndarray) -> bool:
        """Whether the request lists Indexes ``rows`` of a node in the order of their
        cindexes' ids ``sub`` (then ``sub`` is the step; compared as bytes, cheaper
        than looking the Indexes up)."""
        return rows.tobytes() == self.graph.coords[sub, 1:].tobytes()

    def _process_component_step(self, node: int, step: np.ndarray) -> None:
        """A non-simple component's input step and its own step."""
        in_node = node - 1
        comp = self._component[node]
        graph = self.graph
        coords = graph.coords
        deps = _deps_of_ascending(graph.dep_ptr, graph.dep_idx, step)
        input_step = self._in_cindex_order(distinct(deps, "stable"))
        if self._reorders[node]:
            in_rows, out_rows = coords[input_step, 1:], coords[step, 1:]
            orig = len(in_rows) + len(out_rows)
            by_arrays = getattr(comp, "reorder_index_arrays", None)
            if by_arrays is not None:
                new_in, new_out = by_arrays(in_rows, out_rows)
                if new_in is in_rows and new_out is out_rows:
                    # nothing moved (the component says so by giving the arrays back)
                    self._add_step_ids(input_step, in_node)
                    self._add_step_ids(step, node)
                    return
                in_rows, out_rows = new_in, new_out
            else:
                in_idx, out_idx = comp.reorder_indexes(array_to_indexes(in_rows),
                                                       array_to_indexes(out_rows))
                in_rows = np.array(in_idx, dtype=np.int64).reshape(-1, 3)
                out_rows = np.array(out_idx, dtype=np.int64).reshape(-1, 3)
            padded = len(in_rows) + len(out_rows) != orig
            self._add_step(in_node, in_rows, padded)
            self._add_step(node, out_rows, padded)
        else:
            self._add_step_ids(input_step, in_node)
            self._add_step_ids(step, node)

    def _in_cindex_order(self, ids: np.ndarray) -> np.ndarray:
        """Distinct ids of cindexes of one non-input node, ascending, sorted by Cindex
        (node, t, x, n).  The ids the graph builder gave the current segment are in
        that order already (only supplied inputs come first, out of it)."""
        lo, hi = self._segment_range
        if len(ids) and lo <= ids[0] and ids[-1] < hi:
            return ids
        c = self.graph.coords[ids]
        return ids[np.lexsort((c[:, 1], c[:, 3], c[:, 2], c[:, 0]))]

    def _dim_range_small(self, node: int, sub: np.ndarray, src_ids: list) -> bool:
        """_process_dim_range_sub_phase for a small sub-phase (a time step of a
        recurrence) whose source cindexes ``src_ids`` (a list) are all in one step,
        with Python scalars; False (nothing done) otherwise."""
        loc = self.loc_step
        first = -1
        for c in src_ids:
            if c < 0:
                return False
            s = int(loc[c])
            if s != first:
                if first >= 0 or s < 0:
                    return False
                first = s
        key = (first, node)
        if key not in self._dim_range_done:
            self._dim_range_done.add(key)
            source = self.step_ids[first]
            if len(source) == len(src_ids) and source.tolist() == src_ids:
                # the sub-phase is the whole source step, in its order
                self._add_step_ids(sub, node)
            else:
                self._add_step_like(node, source, self._dim_range_src[node],
                                    add_if_absent=True)
        return True

    def _process_dim_range_sub_phase(self, node: int, sub: np.ndarray,
                                     src_ids: np.ndarray | None) -> None:
        src = self._dim_range_src[node]
        if src_ids is None:
            src_ids = self.graph.find_like(sub, node, src)
        s = self.loc_step[src_ids]
        if (src_ids < 0).any() or (s < 0).any():
            raise AssertionError(f"dim-range node {self._names[node]!r}: source cindex "
                                 f"not yet in a step")
        first = int(s[0])
        if bool((s == first).all()):
            if (first, node) in self._dim_range_done:
                return
            self._dim_range_done.add((first, node))
            source = self.step_ids[first]
            if len(source) == len(sub) and (source == src_ids).all():
                # the sub-phase is the whole source step, in its order
                self._add_step_ids(sub, node)
            else:
                self._add_step_like(node, source, src, add_if_absent=True)
            return
        s = s[np.concatenate(([True], s[1:] != s[:-1]))]
        for step in _unordered_set_order(s.tolist()):
            if (step, node) in self._dim_range_done:
                continue
            self._dim_range_done.add((step, node))
            self._add_step_like(node, self.step_ids[step], src, add_if_absent=True)

    def check(self) -> None:
        """Every cindex has a location that points back at it (blank padding excepted)."""
        self._flush_locations()
        n = len(self.graph)
        s, r = self.loc_step[:n], self.loc_row[:n]
        steps = self.steps
        flat = steps.ids
        if n and min_reduce(s) >= 0 and min_reduce(r) >= 0:
            # the usual case: every cindex has a place; it must hold that cindex
            at = steps.ptr[s] + r
            if max_reduce(at) < len(flat) and np.array_equal(flat[at], np.arange(n)):
                return
        ok = (s >= 0) & (r >= 0)
        at = np.where(ok, steps.ptr[np.maximum(s, 0)] + r, 0)
        ok &= (at < len(flat))
        ok[ok] = flat[at[ok]] == np.flatnonzero(ok)
        if not ok.all():
            coords = self.graph.coords
            for c in np.flatnonzero(~ok).tolist():
                if coords[c, 2] != K_NO_TIME:
                    raise AssertionError(f"cindex {self.graph.cindex_str(c, self._names)} has "
                                         f"no consistent location in the steps")


def compute_computation_steps(nnet, request, phases, graph: ComputationGraph,
                              computer: ComputationStepsComputer | None = None,
                              io_rows: list | None = None) -> StepList:
    """Steps for one segment (``request``, its ``phases``), or for all segments when
    ``request`` is a list of requests and ``phases`` the per-segment phases.
    ``io_rows``: the requests' Indexes as ComputationRequest.validate returns them
    (one list of arrays per request; for one request, its list), when at hand.

    Pass the same ``computer`` for successive segments (Kaldi keeps one
    ComputationStepsComputer for the whole computation); its locations and
    ``step_to_segment`` are what the Compiler needs besides the steps.
    """
    if computer is None:
        computer = ComputationStepsComputer(nnet, graph)
    if isinstance(request, (list, tuple)):
        if len(request) != len(phases):
            raise ValueError("one list of phases per request is needed")
        for req, ph, rows in zip(request, phases, io_rows or [None] * len(request)):
            computer.compute_for_segment(req, ph, rows)
    else:
        computer.compute_for_segment(request, phases, io_rows)
    if computer.num_segments_done == len(graph.segment_ends):
        computer.check()
    return computer.steps


__all__ = ["compute_computation_phases", "compute_computation_steps",
           "ComputationStepsComputer", "PhaseList", "StepList"]
