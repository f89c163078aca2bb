"""Kaldi's ComputationGraphBuilder::Compute and Prune (nnet-computation-graph.cc)
on whole arrays, node by node; engine.compiler.graph uses it when it applies and
runs Kaldi's cindex-by-cindex algorithm otherwise.

What the result depends on.  After pruning, the graph holds the supplied inputs
and every cindex reachable from the requested outputs through *used*
dependencies (all inputs of a plain descriptor or component; the chosen side of
a Failover; an IfDefined input only when it is computable), all of them
computable, each with its used dependencies as a sorted set.  Computability is
a property of the cindex (Kaldi's three-valued evaluation only ever settles a
status to its true value), so any order of discovery that settles the statuses
of everything reachable gives Kaldi's graph; ids are made canonical at the end
(engine.compiler.graph_nodes).

Here the work goes node by node.  The nodes are ordered producers first except
along recurrences (NodeTable.order).  A *sweep* visits them consumers first: the
cindexes demanded of a node since it was last visited get their inputs all at
once; demands on a node further down the order are served in the same sweep,
demands along a recurrence (on a node already visited) in the next one.  After
each sweep the statuses of the new cindexes are settled producers first with
Kaldi's rule (computable if computable with the unsettled inputs absent, not
computable if not computable even with them present).  In networks with
recurrences Kaldi's usable counts are kept as well (the number of dependents
that are usable and not known to be not computable, plus one for a requested
output; a cindex whose count drops to zero withdraws its own contribution from
its inputs, and adds it back if it becomes usable again): only usable cindexes
get their inputs, which is what stops a recurrence where the supplied input
ends.  Pruning follows the used dependencies from the outputs, again node by
node (or keeps everything, when nothing can have been left unused).

A cindex is a key into one dense table over (node, n, t, x).  Inputs that are
the Index shifted by a constant (Offset chains, simple components, dim-range
nodes, TdnnComponent's time offsets) are found by adding a constant to the
key; the table keeps a margin around every cindex so that such a key is always
inside it.  Other descriptors go through their compiled NumPy form
(engine.compiler.fast_descriptors); statistics extraction and pooling,
time-height convolution and restricted attention give their inputs as arrays
(``input_times``, with ``input_rule``: which inputs an output needs), as does
DistributeComponent (whose inputs are at another x: ``input_x``), and are
settled and pruned like a descriptor with optional parts; other components that
give their inputs only Index by Index are asked Index by Index.

The array build gives up (and Kaldi's algorithm runs) for a descriptor without
a compiled form, inputs supplied at component nodes, anything the general path
rejects with an error (which it then reports), outputs that are not
computable, Index ranges too wide for a dense table, statuses that settle only
one step per pass (a recurrence without IfDefined), and more sweeps than
Kaldi's iteration limit.
"""

from __future__ import annotations

import numpy as np

from engine.compiler.array_ops import (column_bounds, distinct as _distinct, max_reduce as _max,
                                      min_reduce as _min, rows_all, rows_any, rows_count)
from engine.compiler.graph_nodes import (COMPONENT, DEPS_DESCRIPTOR, DEPS_GENERAL, DEPS_IDENTITY,
                                         DEPS_NONE, DEPS_OFFSETS, INPUT, CindexTable)
from engine.compiler.graph_intervals import build_intervals
from engine.core.cancel import checkpoint
from engine.core.errors import ComponentError
from engine.core.index import Index

# Kaldi's ComputableInfo values (as in engine.compiler.graph).
U, C, NC = 0, 1, 2
# Dense lookup tables beyond this many cells are refused (the per-cindex
# algorithm handles such requests without the memory) -- unless the request is
# large enough that the graph itself needs comparable memory: up to
# TABLE_CELLS_PER_ROW cells per (node, requested Index) are always allowed.  A long
# single sequence (a 40000-frame TDNN-F request: 100 nodes x 80000 t values with
# the growth margin) is dense, and the per-cindex algorithm took 200 s on it
# against 2 s here; what is refused is a sparse request (Indexes spread over a
# wide t range), where a dense table would be mostly empty.
MAX_TABLE_CELLS = 1 << 23
TABLE_CELLS_PER_ROW = 4
# Settling passes after one sweep before giving up.
MAX_SETTLE_PASSES = 64
_tuple_new = tuple.__new__
_EMPTY = np.zeros(0, dtype=np.int64)
# Usable-count updates of at most this many ids go one id at a time in plain Python
# (NumPy's per-call cost dominates there).
_SMALL = 16
# ... and go back to NumPy when the ids still to visit grow beyond this many (a wide
# cascade of counts).
_FEW_MAX = 256


class GiveUp(Exception):
    """The array build does not apply; use the per-cindex algorithm."""


# reductions straight to the ufuncs (ndarray.any/all go through Python wrappers);
# _all/_any on 1-D arrays, _all_rows/_any_rows with an axis
_all = _all_rows = np.logical_and.reduce
_any = _any_rows = np.logical_or.reduce
_sum = np.add.reduce


def _cat(parts: list) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _counts(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values, how often each occurs) of ``a``."""
    if len(a) < 2:
        return a, np.ones(len(a), dtype=np.int64)
    a = np.sort(a)
    step = a[1:] != a[:-1]
    if _all(step):
        return a, np.ones(len(a), dtype=np.int64)
    starts = np.concatenate(([True], step)).nonzero()[0]
    ends = np.append(starts, len(a))
    return a[starts], ends[1:] - ends[:-1]


class _NodeDeps:
    """Expanded cindexes of one node and their inputs: ``rows`` (ids) and ``deps``
    ((len(rows), K) input ids, K fixed per node), or per-row id arrays
    (``lists``) for components asked Index by Index.  ``open`` holds the
    (rows, deps) parts whose statuses are not settled yet (all unknown), in the
    order they were added."""

    __slots__ = ("parts", "rows", "deps", "lists", "open", "num_unsettled")

    def __init__(self) -> None:
        self.parts: list = []
        self.rows = None
        self.deps = None
        self.lists: list | None = None
        self.open: list = []
        self.num_unsettled = 0

    def add(self, rows: np.ndarray, deps) -> None:
        self.parts.append((rows, deps))
        self.rows = None
        self.open.append((rows, deps))
        self.num_unsettled += len(rows)

    def merged(self):
        if not self.parts:
            return None, None
        if self.rows is None:
            rows = _cat([p[0] for p in self.parts])
            deps = _cat([p[1] for p in self.parts]) if self.lists is None else None
            self.parts = [(rows, deps)]
            self.rows, self.deps = rows, deps
        return self.rows, self.deps

    def unsettled(self):
        """(rows, deps) of the cindexes not settled yet (deps None for ``lists``)."""
        op = self.open
        if len(op) > 1:
            rows = _cat([p[0] for p in op])
            deps = _cat([p[1] for p in op]) if self.lists is None else None
            self.open = op = [(rows, deps)]
        return op[0]

    def keep_unsettled(self, rows: np.ndarray, deps) -> None:
        """After settling: only these (rows, deps) are still unknown."""
        self.open = [(rows, deps)] if len(rows) else []
        self.num_unsettled = len(rows)


class ArrayGraphBuild:
    """One segment's Compute + Prune.  ``run()`` returns what the graph gets
    (ComputationGraph.append_arrays), or raises GiveUp; the graph is not
    touched either way."""

    def __init__(self, builder, request, max_sweeps: int) -> None:
        self.builder = builder
        self.nodes = nodes = builder.nodes
        self.graph = builder.graph
        self.request = request
        self.misc = request.misc_info
        self.max_sweeps = max_sweeps
        num = len(nodes.kind)
        self.num_nodes = num
        (self.pos, self.is_input_node, self.producers, self.one_producer, self.settle_fast,
         self.all_required, self.partial_nodes, self.chains,
         self.uses_present) = _node_facts(nodes)
        self.node_deps = [_NodeDeps() for _ in range(num)]
        self.pending: list[list] = [[] for _ in range(num)]
        # whether a node's pending ids may repeat (beyond one list from one consumer)
        self.pending_dup = [False] * num
        # Kaldi's usable counts matter only where a recurrence could go on forever.
        self.track_usable = nodes.recurrent
        # how many cindexes of each node are not (yet) known to be computable (a list:
        # read and updated one node at a time)
        self.not_c = [0] * num
        # the margins the table keeps around every cindex (largest constant shifts)
        self.margin = list(nodes.margin)
        # per node: its shifts as key deltas for a table's strides (_shift_plan); kept
        # with the network's NodeTable, as requests of one kind give the same strides
        self._plans: dict = nodes.extra.setdefault("graph_shift_plans", {})
        # per chain start v (_chains): (node stride, the key deltas of its chain's
        # nodes but the last, as a column); kept likewise
        self._chain_deltas: dict = nodes.extra.setdefault("graph_chain_deltas", {})

    # -- keys and the table -----------------------------------------------------------------------
    def _init_rows(self, base_coords: np.ndarray, specs: list) -> None:
        r = np.concatenate([base_coords[:, 1:]] + specs)
        self.size = len(base_coords)
        self.max_cells = max(MAX_TABLE_CELLS, TABLE_CELLS_PER_ROW * self.num_nodes * len(r))
        # room for what a segment usually grows to (about half the nodes times the
        # requested Indexes) so that the arrays are seldom regrown
        cap = max(1024, 4 * (self.size + len(r)),
                  self.size + self.num_nodes * sum(len(a) for a in specs) * 3 // 4)
        self.keys = np.empty(cap, dtype=np.int64)
        self.status = np.full(cap, C, dtype=np.int8)
        self.expanded = np.ones(cap, dtype=bool)
        self.usable = np.zeros(cap, dtype=np.int64)
        self.estart = np.zeros(cap, dtype=np.int64)
        self.ecount = np.zeros(cap, dtype=np.int64)
        self.scratch = np.zeros(cap, dtype=np.int64)
        self.edges = np.empty(4 * cap, dtype=np.int64)
        self.num_edges = 0
        self._make_table(*column_bounds(r), base_coords)

    def _make_table(self, lo, hi, coords: np.ndarray) -> None:
        """A table covering n, t, x in [lo, hi] plus margins (room to grow in t);
        ``coords`` are the (node, n, t, x) rows of the ids so far."""
        mg = self.margin
        lo = [int(lo[0]) - mg[0], int(lo[1]) - mg[1], int(lo[2]) - mg[2]]
        hi = [int(hi[0]) + mg[0], int(hi[1]) + mg[1], int(hi[2]) + mg[2]]
        # room to grow in t: half the span on each side, less when that would take the
        # table past its limit (a statistics pooling window of 10000 frames spans the
        # table that far ahead of the data: padded by half, eight sequences of the
        # x-vector network no longer fit; a cindex that later falls outside the table
        # grows it, _regrow)
        per_t = self.num_nodes * (hi[0] - lo[0] + 1) * (hi[2] - lo[2] + 1)
        t_span = hi[1] - lo[1] + 1
        pad = max(16, (t_span - 1) // 2)
        if per_t * (t_span + 2 * pad) > self.max_cells:
            pad = max(0, (self.max_cells // per_t - t_span) // 2)
        lo[1] -= pad
        hi[1] += pad
        span = [self.num_nodes, hi[0] - lo[0] + 1, hi[1] - lo[1] + 1, hi[2] - lo[2] + 1]
        cells = span[0] * span[1] * span[2] * span[3]
        if cells > self.max_cells:
            raise GiveUp("Index ranges too wide for a dense table")
        self.lo, self.hi = lo, hi
        self.stride_t = span[3]
        self.stride_n = span[2] * span[3]
        self.stride_node = span[1] * self.stride_n
        self.table = np.full(cells, -1, dtype=np.int64)
        if self.size:
            keys = self._encode(coords[:, 0], coords[:, 1], coords[:, 2], coords[:, 3])
            self.keys[:self.size] = keys
            self.table[keys] = np.arange(self.size)

    def _encode(self, node, n, t, x):
        lo = self.lo
        return (node * self.stride_node + (n - lo[0]) * self.stride_n
                + (t - lo[1]) * self.stride_t + (x - lo[2]))

    def _decode(self, keys: np.ndarray) -> np.ndarray:
        """(k, 4) rows node, n, t, x of keys."""
        node, n, t, x = self._split(keys)
        lo = self.lo
        out = np.empty((len(keys), 4), dtype=np.int64)
        out[:, 0] = node
        out[:, 1] = n + lo[0]
        out[:, 2] = t + lo[1]
        out[:, 3] = x + lo[2]
        return out

    def _split(self, keys: np.ndarray):
        """node and the n, t, x offsets from the table's low corner of keys, as four
        arrays (floor divisions and products: np.divmod is many times slower)."""
        sn, st, snode = self.stride_n, self.stride_t, self.stride_node
        node = keys // snode
        rem = keys - node * snode
        n = rem // sn
        rem -= n * sn
        t = rem // st
        return node, n, t, rem - t * st

    def coords_of(self, ids: np.ndarray) -> np.ndarray:
        return self._decode(self.keys[ids])

    def _key_checked(self, node, n, t, x) -> np.ndarray:
        """Keys of arbitrary (node, n, t, x) arrays, growing the table first if needed."""
        lo, hi = self.lo, self.hi
        if len(t):
            ext = [int(_min(n)), int(_min(t)), int(_min(x))], \
                  [int(_max(n)), int(_max(t)), int(_max(x))]
            if any(ext[0][k] < lo[k] or ext[1][k] > hi[k] for k in range(3)):
                self._regrow(ext[0], ext[1])
        return self._encode(node, n, t, x)

    def _regrow(self, lo_need, hi_need) -> None:
        coords = self._decode(self.keys[:self.size])
        mg = self.margin
        lo = [min(self.lo[k] + mg[k], lo_need[k]) for k in range(3)]
        hi = [max(self.hi[k] - mg[k], hi_need[k]) for k in range(3)]
        self._make_table(lo, hi, coords)

    def _lookup(self, keys: np.ndarray, node: int = -1, shifted: bool = True,
                distinct: bool = False) -> np.ndarray:
        """Ids of the cindexes with these (in-table) keys, adding the missing ones
        (unsettled, not expanded; on input nodes not computable, nothing to expand).
        ``node``: the one node of all keys, if known; ``shifted``: whether the keys
        may lie outside the Index ranges of the cindexes so far (else no table
        margin can be crossed); ``distinct``: no key repeats."""
        table = self.table
        got = table[keys]
        miss = got < 0
        num_miss = int(np.count_nonzero(miss))
        if not num_miss:
            return got
        every = num_miss == len(keys)
        mk = keys if every else keys[miss]
        start = self.size
        new = np.arange(start, start + num_miss)
        table[mk] = new
        if distinct:
            uk = mk
            back = new
        else:
            back = table[mk]
            if _all(back == new):
                uk = mk
            else:
                # a key asked for more than once: the last write won; renumber the
                # winners
                uk = mk[back == new]
                table[uk] = np.arange(start, start + len(uk))
                back = table[mk]
        if every:
            got = back
        else:
            got[miss] = back
        end = start + len(uk)
        if end > len(self.keys):
            self._grow_rows(end)
        self.keys[start:end] = uk
        # (usable counts and edge counts of new rows are zero from allocation)
        if node >= 0:
            if self.is_input_node[node]:
                self.status[start:end] = NC
                self.expanded[start:end] = True
            else:
                self.status[start:end] = U
                self.expanded[start:end] = False
            self.not_c[node] += end - start
        else:
            nd = uk // self.stride_node
            on_input = self.is_input_node[nd]
            self.status[start:end] = np.where(on_input, NC, U)
            self.expanded[start:end] = on_input
            counts = np.bincount(nd)
            not_c = self.not_c
            for node, k in zip(counts.nonzero()[0].tolist(), counts[counts > 0].tolist()):
                not_c[node] += k
        self.size = end
        if shifted:
            # keep the margins: a new cindex near the edge of the table grows it
            mg, lo, hi = self.margin, self.lo, self.hi
            rel_t = (uk % self.stride_n) // self.stride_t
            t_lo, t_hi = int(_min(rel_t)) + lo[1], int(_max(rel_t)) + lo[1]
            grow = t_lo - mg[1] < lo[1] or t_hi + mg[1] > hi[1]
            if grow or mg[0] or mg[2]:
                rows = self._decode(uk)
                ext = column_bounds(rows[:, 1:])
                if any(ext[0][k] - mg[k] < lo[k] or ext[1][k] + mg[k] > hi[k]
                       for k in range(3)):
                    self._regrow(ext[0], ext[1])
        return got

    def _grow_rows(self, end: int) -> None:
        cap = max(end, 2 * len(self.keys))
        for name in ("keys", "status", "expanded", "usable", "estart", "ecount", "scratch"):
            old = getattr(self, name)
            arr = np.zeros(cap, dtype=old.dtype)      # zeros: see _lookup
            arr[:self.size] = old[:self.size]
            setattr(self, name, arr)

    # -- usable counts ----------------------------------------------------------------------------
    def _inputs_of(self, rows: np.ndarray) -> np.ndarray:
        """The input ids of expanded cindexes ``rows``, concatenated."""
        cnt = self.ecount[rows]
        total = int(_sum(cnt))
        if not total:
            return _EMPTY
        first = np.cumsum(cnt) - cnt
        at = np.repeat(self.estart[rows] - first, cnt) + np.arange(total)
        return self.edges[at]

    def _add_usable(self, targets: np.ndarray, distinct: bool = False,
                    queued: bool = False, few: bool = True) -> None:
        """One more usable dependent for each entry of ``targets`` (Kaldi's
        IncrementUsableCount): a cindex that becomes usable gives its inputs one
        too, or, not expanded yet, is queued for expansion.  ``distinct``: no
        target repeats; ``queued``: every target is already queued on its node
        (the expansion that found them queued them all); ``few``: whether a few
        targets may go to _add_usable_few."""
        usable, status, expanded = self.usable, self.status, self.expanded
        while len(targets):
            if few and len(targets) <= _SMALL:
                self._add_usable_few(targets.tolist(), queued)
                return
            before = usable[targets]
            if distinct:
                usable[targets] = before + 1
                distinct = False
            else:
                np.add.at(usable, targets, 1)
            woke = targets[before == 0]
            if not len(woke):
                return
            woke = woke[status[woke] != NC]
            ex = expanded[woke]
            if queued:
                queued = False
            elif not _all(ex):
                self._queue(woke[~ex])          # repeats are dropped when expanding
            # an expanded cindex that becomes usable again: its inputs, once each
            targets = self._inputs_of(_distinct(woke[ex])) if _any(ex) else _EMPTY

    def _add_usable_few(self, targets: list, queued: bool) -> None:
        """_add_usable for a few targets (a list of ids) in plain Python, one id at a
        time (with NumPy again for what is left if that grows wide); the ids to
        queue are queued together at the end.  The same counts and
        the same ids queued as level by level: a cindex becomes usable once, at its
        first increment, whatever the order."""
        usable, status, expanded = self.usable, self.status, self.expanded
        estart, ecount, edges = self.estart, self.ecount, self.edges
        to_queue: list = []
        todo: list = []

        def bump(c, may_queue: bool) -> None:
            # one increment: a cindex that becomes usable passes it on to its inputs
            # (expanded) or is queued for expansion
            before = int(usable[c])
            usable[c] = before + 1
            if not before and status[c] != NC:
                if expanded[c]:
                    k = int(ecount[c])
                    if k:
                        e = int(estart[c])
                        todo.extend(edges[e:e + k].tolist())
                elif may_queue:
                    to_queue.append(c)

        # the targets themselves first (queued already when ``queued``), then what
        # they pass on
        for c in targets:
            bump(c, not queued)
        while todo:
            if len(todo) > _FEW_MAX:
                if to_queue:
                    self._queue(np.array(to_queue, dtype=np.int64))
                self._add_usable(np.array(todo, dtype=np.int64), few=False)
                return
            bump(todo.pop(), True)
        if to_queue:
            self._queue(np.array(to_queue, dtype=np.int64))

    def _drop_usable(self, targets: np.ndarray, few: bool = True) -> None:
        """Kaldi's DecrementUsableCount: a cindex left with no usable dependent (and
        not known to be not computable) withdraws from its inputs in turn
        (``few``: whether a few targets may go to _drop_usable_few)."""
        usable, status = self.usable, self.status
        while len(targets):
            if few and len(targets) <= _SMALL:
                self._drop_usable_few(targets.tolist())
                return
            u, cnt = _counts(targets)
            after = usable[u] - cnt
            usable[u] = after
            targets = self._inputs_of(u[(after == 0) & (status[u] != NC)])

    def _drop_usable_few(self, todo: list) -> None:
        """_drop_usable for a few targets (a list of ids), one at a time in plain
        Python (NumPy's per-call cost dominates there; NumPy again for what is left
        if that grows wide).  The order does not matter:
        decrements commute, and a count reaches zero once whatever the order, as
        counts never drop below zero."""
        usable, status, estart, ecount, edges = (self.usable, self.status, self.estart,
                                                 self.ecount, self.edges)
        while todo:
            if len(todo) > _FEW_MAX:
                self._drop_usable(np.array(todo, dtype=np.int64), few=False)
                return
            c = todo.pop()
            left = int(usable[c]) - 1
            usable[c] = left
            if not left and status[c] != NC:
                k = int(ecount[c])
                if k:
                    e = int(estart[c])
                    todo += edges[e:e + k].tolist()

    def _queue(self, rows: np.ndarray, node: int = -1) -> None:
        """Queue ids (possibly repeated) on their nodes (``node``: the one node of
        them all, when known)."""
        if node >= 0:
            self.pending[node].append(rows)
            self.pending_dup[node] = True
            return
        nd = self.keys[rows] // self.stride_node
        first = int(nd[0])
        if _all(nd == first):
            self.pending[first].append(rows)
            self.pending_dup[first] = True
            return
        for v in np.unique(nd).tolist():
            self.pending[v].append(rows[nd == v])
            self.pending_dup[v] = True

    # -- expanding ------------------------------------------------------------------------------
    def _expand(self, v: int, g: np.ndarray) -> None:
        nodes = self.nodes
        shifts = nodes.shifts[v]
        m = len(g)
        if shifts is not None:
            k = len(shifts)
            if k == 0:
                self._record(v, g, np.zeros((m, 0), dtype=np.int64))
                return
            kg = self.keys[g]
            if k == 1 and self.chains[v] and self._expand_chain(v, g, kg):
                return
            deltas, node, shifted = self._shift_plan(v, shifts)
            if k == 1:
                # distinct rows, one input each: distinct keys
                flat = self._lookup(kg + deltas[0, 0], node, shifted, distinct=True)
            else:
                flat = self._lookup((deltas + kg[None, :]).ravel(), node, shifted)
            self._route([sh[0] for sh in shifts], flat, m, True)
            self._record(v, g, flat.reshape(k, m).T if k > 1 else flat[:, None])
            return
        mode = nodes.deps_mode[v]
        c = self.coords_of(g)
        n, t, x = c[:, 1], c[:, 2], c[:, 3]
        if mode == DEPS_GENERAL:
            if self.settle_fast[v] is not None:
                self._expand_columns(v, g, n, t, x)
            else:
                self._expand_general(v, g, n, t, x)
            return
        if mode != DEPS_DESCRIPTOR:
            raise GiveUp("a node without inputs was asked for its inputs")
        slots = nodes.fast[v].deps_arrays(n, t, x)
        k = len(slots)
        block_nodes = [sl[0] for sl in slots]
        fixed = all(type(b) is int for b in block_nodes)     # no Switch: one node a slot
        if fixed:
            node_col = np.repeat(np.array(block_nodes, dtype=np.int64), m)
            one = block_nodes[0] if block_nodes.count(block_nodes[0]) == k else -1
        else:
            node_col = np.concatenate([np.broadcast_to(np.asarray(b, np.int64), (m,))
                                       for b in block_nodes])
            one = -1
        flat = self._lookup(self._key_checked(node_col, np.concatenate([sl[1] for sl in slots]),
                                              np.concatenate([sl[2] for sl in slots]),
                                              np.concatenate([sl[3] for sl in slots])), one)
        if fixed:
            self._route(block_nodes, flat, m, False)
        else:
            self._queue(flat, self.one_producer[v])
        self._record(v, g, flat.reshape(k, m).T)

    def _expand_chain(self, v: int, g: np.ndarray, kg: np.ndarray) -> bool:
        """Expand ``g`` on node v and, at once, their inputs along v's chain
        (_chains): each node of the chain reads the same Index on the next and has
        no other reader, so its cindexes are those its reader asks for, and they are
        expanded here as visiting the chain node by node would; the last node's
        cindexes are looked up and queued as usual.  False (nothing done) when some
        chain cindex exists already."""
        chain = self.chains[v]
        snode = self.stride_node
        m = len(g)
        # keys of the chain's cindexes, level by level (the same Index on each node)
        mid = chain[:-1]
        hit = self._chain_deltas.get(v)
        if hit is None or hit[0] != snode:
            hit = self._chain_deltas[v] = (
                snode, ((np.array(mid, dtype=np.int64) - v) * snode)[:, None])
        flat_mid = (hit[1] + kg).ravel()
        table = self.table
        if _any(table[flat_mid] >= 0):
            return False
        start = self.size
        end = start + len(flat_mid)
        if end > len(self.keys):
            self._grow_rows(end)
        ids = np.arange(start, end)
        table[flat_mid] = ids
        self.keys[start:end] = flat_mid
        self.status[start:end] = U
        self.expanded[start:end] = True
        self.size = end
        not_c = self.not_c
        for c in mid:
            not_c[c] += m
        last = chain[-1]
        tail = self._lookup(kg + (last - v) * snode, last, False, distinct=True)
        # v reads level 0, each chain node the next level, the last one the tail:
        # the rows g, ids read ids, tail (one input each), level by level
        deps = np.concatenate((ids, tail))
        col = deps[:, None]
        node_deps = self.node_deps
        node_deps[v].add(g, col[:m])
        for j, owner in enumerate(mid):
            node_deps[owner].add(ids[j * m:(j + 1) * m], col[(j + 1) * m:(j + 2) * m])
        if self.track_usable:
            self._store_edges(np.concatenate((g, ids)), deps, 1)
        self.pending[last].append(tail)
        if self.track_usable:
            # each chain cindex has one usable reader (as _record would count it),
            # the tail one more each
            self.usable[start:end] = 1
            self._add_usable(tail, distinct=True, queued=True)
        return True

    def _shift_plan(self, v: int, shifts: list):
        """((k, 1) key deltas of node v's constant shifts in the current table, the
        one node all inputs are on or -1, whether any shift moves n, t or x);
        remade when the table's strides differ from those it was made for."""
        strides = (self.stride_n, self.stride_t, self.stride_node)
        hit = self._plans.get(v)
        if hit is not None and hit[0] == strides:
            return hit[1]
        sn, st, snode = strides
        deltas = np.array([[(p - v) * snode + dn * sn + dt * st + dx]
                           for p, dn, dt, dx in shifts], dtype=np.int64)
        one = shifts[0][0]
        plan = (deltas, one if all(sh[0] == one for sh in shifts) else -1,
                any(sh[1] or sh[2] or sh[3] for sh in shifts))
        self._plans[v] = (strides, plan)
        return plan

    def _route(self, block_nodes: list, flat: np.ndarray, m: int, distinct_blocks: bool) -> None:
        """Queue ``flat``, blocks of ``m`` ids on the nodes ``block_nodes``
        (``distinct_blocks``: no id repeats within a block, as for the inputs of
        distinct rows through one constant shift)."""
        pending, pending_dup = self.pending, self.pending_dup
        first = block_nodes[0]
        if block_nodes.count(first) == len(block_nodes):
            pending[first].append(flat)
            if len(block_nodes) > 1 or not distinct_blocks:
                pending_dup[first] = True
            return
        for k, b in enumerate(block_nodes):
            pending[b].append(flat[k * m:(k + 1) * m])
            if not distinct_blocks:
                pending_dup[b] = True

    def _record(self, v: int, g: np.ndarray, deps: np.ndarray) -> None:
        """Store the (m, K) inputs of cindexes g of node v (all of them queued on
        their nodes already)."""
        self.node_deps[v].add(g, deps)
        k = deps.shape[1]
        if self.track_usable and k:
            flat = deps.ravel()
            self._store_edges(g, flat, k)
            # one input per row: distinct, as the rows are
            self._add_usable(flat, distinct=k == 1, queued=True)

    def _store_edges(self, g, flat, counts) -> None:
        """Edges of rows g: ``counts`` inputs each (an int: as many for every row)."""
        e0 = self.num_edges
        e1 = e0 + len(flat)
        if e1 > len(self.edges):
            grown = np.empty(max(e1, 2 * len(self.edges)), dtype=np.int64)
            grown[:e0] = self.edges[:e0]
            self.edges = grown
        self.edges[e0:e1] = flat
        if type(counts) is int:
            self.estart[g] = np.arange(e0, e1, counts)
        else:
            self.estart[g] = e0 + np.cumsum(counts) - counts
        self.ecount[g] = counts
        self.num_edges = e1

    def _expand_columns(self, v: int, g, n, t, x) -> None:
        """Inputs of a component that gives them as arrays (``input_times``: a fixed
        number per row, at the row's x unless ``input_x`` gives another), settled and
        pruned by its _ColumnRule as a descriptor's with optional parts."""
        comp, src = self.nodes.component[v], self.nodes.src[v]
        try:
            times = comp.input_times(t)
        except ComponentError as e:
            raise GiveUp(f"input times: {e}") from None
        k = times.shape[1]
        # the inputs' x: the output's, unless the component moves it (``input_x``)
        input_x = getattr(comp, "input_x", None)
        xs = input_x(x).ravel() if input_x is not None else np.repeat(x, k)
        flat = self._lookup(self._key_checked(src, np.repeat(n, k), times.ravel(), xs))
        self._queue(flat, src)
        self._record(v, g, flat.reshape(len(g), k))

    def _expand_general(self, v: int, g, n, t, x) -> None:
        nodes = self.nodes
        if nodes.kind[v] != COMPONENT:
            raise GiveUp("descriptor class without a compiled form")
        comp, src = nodes.component[v], nodes.src[v]
        lists = [comp.get_input_indexes(self.misc, _tuple_new(Index, r))
                 for r in zip(n.tolist(), t.tolist(), x.tolist())]
        counts = np.array([len(lst) for lst in lists], dtype=np.int64)
        vals = [i for lst in lists for i in lst]
        nd = self.node_deps[v]
        if nd.lists is None:
            nd.lists = []
        if vals:
            a = np.array(vals, dtype=np.int64).reshape(-1, 3)
            flat = self._lookup(self._key_checked(src, a[:, 0], a[:, 1], a[:, 2]))
            self.pending[src].append(flat)
            self.pending_dup[src] = True
            bounds = np.cumsum(counts).tolist()
            nd.lists.extend(np.split(flat, bounds[:-1]))
            if self.track_usable:
                self._store_edges(g, flat, counts)
                self._add_usable(flat, queued=True)
        else:
            nd.lists.extend(_EMPTY for _ in range(len(g)))
        nd.add(g, None)

    # -- statuses --------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Settle what can be settled, producers first, until nothing changes."""
        order = self.nodes.order
        node_deps = self.node_deps
        for _ in range(MAX_SETTLE_PASSES):
            changed = False
            for v in order:
                nd = node_deps[v]
                if nd.num_unsettled and self._settle_node(v, nd):
                    changed = True
            if not changed:
                return
        raise GiveUp("statuses settle too slowly (a long recurrence without IfDefined)")

    def _settle_node(self, v: int, nd: _NodeDeps) -> bool:
        status = self.status
        all_required = self.all_required[v]
        not_c = self.not_c
        if all_required:
            for p in self.producers[v]:
                if not_c[p]:
                    break
            else:
                # every cindex of every node read is computable: so are these (part
                # by part: their rows and inputs need not be gathered)
                for rows, _ in nd.open:
                    status[rows] = C
                not_c[v] -= nd.num_unsettled
                nd.keep_unsettled(_EMPTY, None)
                return True
        rows, deps = nd.unsettled()
        num_sel = len(rows)
        if deps is None:
            new = self._settle_general(v, rows)
        else:
            st = status[deps]
            if all_required:
                width = st.shape[1]
                if width == 0:
                    new = np.full(num_sel, C, dtype=np.int8)
                elif width == 1:
                    new = st[:, 0]          # the status of the one input
                else:
                    new = np.where(rows_all(st == C), C,
                                   np.where(rows_any(st == NC), NC, U)).astype(np.int8)
            else:
                fast = self.settle_fast[v]
                ok_lo = fast.computable_arrays(st == C)
                ok_hi = fast.computable_arrays(st != NC)
                new = np.where(ok_lo, C, np.where(ok_hi, U, NC)).astype(np.int8)
        # how many rows settle, and how many of them as not computable
        counts = np.bincount(new, minlength=3).tolist()
        k = num_sel - counts[U]
        if not k:
            return False
        if k == num_sel:
            newd = new
            changed_rows = rows
            nd.keep_unsettled(_EMPTY, None)
        else:
            done = new != U
            newd = new[done]
            changed_rows = rows[done]
            left = ~done
            nd.keep_unsettled(rows[left], None if deps is None else deps[left])
        status[changed_rows] = newd
        num_bad = counts[NC]
        not_c[v] -= k - num_bad
        if self.track_usable and num_bad:
            bad = changed_rows[newd == NC]
            # Kaldi: a cindex found not computable while usable withdraws from its
            # inputs.
            if num_bad > _SMALL:
                bad = bad[self.usable[bad] != 0]
                if len(bad):
                    self._drop_usable(self._inputs_of(bad))
            else:
                # (a few: their inputs gathered in plain Python too)
                usable, estart, ecount, edges = self.usable, self.estart, self.ecount, self.edges
                todo: list = []
                for c in bad.tolist():
                    k = int(ecount[c])
                    if k and usable[c]:
                        e = int(estart[c])
                        todo += edges[e:e + k].tolist()
                if todo:
                    self._drop_usable_few(todo)
        return True

    def _index_set(self, node: int, treat_unknown: bool):
        lo, hi, table, status = self.lo, self.hi, self.table, self.status
        base = node * self.stride_node
        sn, st = self.stride_n, self.stride_t

        def contains(index) -> bool:
            n, t, x = index
            if not (lo[0] <= n <= hi[0] and lo[1] <= t <= hi[1] and lo[2] <= x <= hi[2]):
                return False
            gid = int(table[base + (n - lo[0]) * sn + (t - lo[1]) * st + (x - lo[2])])
            if gid < 0:
                return False
            s = status[gid]
            return s == C or (treat_unknown and s == U)
        return contains

    def _settle_general(self, v: int, rows) -> np.ndarray:
        comp, src, misc = self.nodes.component[v], self.nodes.src[v], self.misc
        have, maybe = self._index_set(src, False), self._index_set(src, True)
        out = np.empty(len(rows), dtype=np.int8)
        for j, r in enumerate(self.coords_of(rows)[:, 1:].tolist()):
            idx = _tuple_new(Index, r)
            if comp.is_computable(misc, idx, have, None):
                out[j] = C
            elif not comp.is_computable(misc, idx, maybe, None):
                out[j] = NC
            else:
                out[j] = U
        return out

    # -- the build -------------------------------------------------------------------------------
    def run(self):
        base, inputs, outs = self._compute()
        if _any(self.status[outs] != C):
            raise GiveUp("some outputs are not computable")
        return self._prune(base, inputs, outs)

    def output_computability(self) -> np.ndarray:
        """Kaldi's Compute then GetComputableInfo: whether each requested output
        Index (in request order) is computable; the graph is left as it was.
        Raises GiveUp where run() would, and when an output's status is still
        undecided after the sweeps."""
        _, _, outs = self._compute()
        st = self.status[outs]
        if _any(st == U):
            raise GiveUp("some outputs' computability is undecided")
        return st == C

    def _compute(self):
        """Kaldi's Compute: the sweeps and settling; (base, input ids, output ids)."""
        nodes, nnet, req, graph = self.nodes, self.builder.nnet, self.request, self.graph
        base = len(graph)
        in_specs, out_specs = [], []
        # the Indexes as arrays: validated ones when the builder was given them
        io_rows = self.builder.io_rows
        if io_rows is None:
            io_rows = req.index_rows()
        for spec, rows in zip(req.inputs, io_rows):
            node = nnet.get_node_index(spec.name)
            if node == -1 or nodes.kind[node] != INPUT:
                raise GiveUp("input at a component node (or not an input node)")
            in_specs.append((node, rows))
        if not any(spec.indexes for spec in req.outputs):
            raise GiveUp("no outputs")
        for spec, rows in zip(req.outputs, io_rows[len(req.inputs):]):
            node = nnet.get_node_index(spec.name)
            if node == -1 or nodes.kind[node] == INPUT:
                raise GiveUp("no such output node, or an output at an input node")
            out_specs.append((node, rows))
        self._init_rows(graph.coords, [a for _, a in in_specs] + [a for _, a in out_specs])
        # supplied inputs (computable), then the outputs; all new and distinct
        input_ids, output_ids = [], []
        for specs, ids_out in ((in_specs, input_ids), (out_specs, output_ids)):
            for node, a in specs:
                if not len(a):
                    continue
                before = self.size
                # (the table was made around these Indexes: no margin to check)
                ids = self._lookup(self._encode(node, a[:, 0], a[:, 1], a[:, 2]), node, False)
                if _min(ids) < before or self.size - before != len(a):
                    raise GiveUp("an Index repeated or already in the graph")
                ids_out.append(ids)
        inputs = _cat(input_ids) if input_ids else _EMPTY
        outs = _cat(output_ids)
        self.status[inputs] = C
        for node, a in in_specs:
            self.not_c[node] -= len(a)
        self.usable[outs] = 1
        self._queue(outs)
        rev = nodes.order[::-1]
        pending = self.pending
        track = self.track_usable
        for _ in range(self.max_sweeps):
            checkpoint("the graph build")
            work = False
            for v in rev:
                parts = pending[v]
                if not parts:
                    continue
                pending[v] = []
                dup = self.pending_dup[v] or len(parts) > 1
                self.pending_dup[v] = False
                g = _cat(parts)
                keep = ~self.expanded[g]
                if track:
                    keep &= (self.usable[g] > 0) & (self.status[g] != NC)
                g = g[keep]
                if not len(g):
                    continue
                if dup and len(g) > 1:
                    # distinct ids (any order): the last write of each id wins
                    scratch = self.scratch
                    at = np.arange(len(g))
                    scratch[g] = at
                    g = g[scratch[g] == at]
                self.expanded[g] = True
                self._expand(v, g)
                work = True
            if not work:
                break
            self._settle()
        else:
            raise GiveUp("too many sweeps")
        return base, inputs, outs

    # -- pruning ---------------------------------------------------------------------------------
    def _inputs_by_width(self):
        """The expanded cindexes' inputs for _required, without merging node by node:
        (rowpos, deps, lists): ``deps[K]`` the (m, K) inputs of the rows of every node
        with K inputs per row (components asked Index by Index excepted), stacked,
        ``rowpos`` each expanded row's position in its node's block (its width's
        stack, or, for those components, its node's ``lists[v]``, which hold the
        used input ids of the computable rows only)."""
        status = self.status
        rowpos = np.full(self.size, -1, dtype=np.int64)
        rows_by: dict = {}
        deps_by: dict = {}
        lists: dict = {}
        for v, nd in enumerate(self.node_deps):
            if not nd.parts:
                continue
            if nd.lists is not None:
                rows, _ = nd.merged()
                rows, lists[v] = self._used_general(v, rows, status[rows] == C)
                rowpos[rows] = np.arange(len(rows))
                continue
            for rows, deps in nd.parts:
                k = deps.shape[1]
                rows_by.setdefault(k, []).append(rows)
                deps_by.setdefault(k, []).append(deps)
        for k, parts in rows_by.items():
            rows = _cat(parts)
            rowpos[rows] = np.arange(len(rows))
            deps_by[k] = _cat(deps_by[k])
        return rowpos, deps_by, lists

    def _used_general(self, v: int, rows, ok):
        """(computable rows, per such row the ids of the inputs it uses) of node v, a
        component asked Index by Index (``ok``: which of ``rows`` are computable)."""
        nodes = self.nodes
        comp, src, misc = nodes.component[v], nodes.src[v], self.misc
        have = self._index_set(src, False)
        out_rows, lists = [], []
        sel = np.flatnonzero(ok)
        for r, idx in zip(rows[sel].tolist(), self.coords_of(rows[sel])[:, 1:].tolist()):
            used: list = []
            if not comp.is_computable(misc, _tuple_new(Index, idx), have, used):
                raise GiveUp("a component's computability changed")
            out_rows.append(r)
            if used:
                a = np.array(used, dtype=np.int64).reshape(-1, 3)
                lists.append(self.table[self._encode(src, a[:, 0], a[:, 1], a[:, 2])])
            else:
                lists.append(_EMPTY)
        return np.array(out_rows, dtype=np.int64), lists

    def _everything_used(self, base: int) -> bool:
        """Whether every cindex of the segment is computable and every dependency
        used: then every cindex added was added as an input of one reachable from
        the outputs, so all are required (no usable counts: all were expanded)."""
        if self.track_usable or not _all(self.status[base:self.size] == C):
            return False
        node_deps = self.node_deps
        return not any(node_deps[v].parts for v in self.partial_nodes)

    def _prune(self, base: int, input_ids: np.ndarray, outs: np.ndarray):
        size = self.size
        if self._everything_used(base):
            edges_src, edges_dst = [], []
            for nd in self.node_deps:
                for rows, deps in nd.parts:
                    k = deps.shape[1]
                    if k:
                        edges_src.append(rows if k == 1 else rows.repeat(k))
                        edges_dst.append(deps.ravel())
            required = np.ones(size, dtype=bool)
        elif self.track_usable and self.uses_present:
            required, edges_src, edges_dst = self._required_from_counts()
        else:
            required, edges_src, edges_dst = self._required(base, outs)
        # the kept cindexes of this segment, numbered canonically
        keep = required[base:size].copy()
        keep[input_ids - base] = False
        rest = keep.nonzero()[0] + base
        # sorted by (node, t, x, n): one composite key (unique per cindex), whose
        # stable sort is fast on the runs discovery leaves
        node, n, t, x = self._split(self.keys[rest])
        span_n = self.stride_node // self.stride_n
        span_t = self.stride_n // self.stride_t
        perm = np.argsort(((node * span_t + t) * self.stride_t + x) * span_n + n, kind="stable")
        rest = rest[perm]
        order = np.concatenate((input_ids, rest))
        m = len(order)
        new_id = np.arange(size, dtype=np.int64)
        new_id[base:] = -1
        new_id[order] = np.arange(base, base + m)
        if edges_src:
            src = new_id[np.concatenate(edges_src)] - base
            dst = new_id[np.concatenate(edges_dst)]
            if _any(dst < 0) or _any(src < 0):
                raise GiveUp("inconsistent pruned dependencies")
            pair = _distinct(src * (base + m) + dst, "stable")
            src = pair // (base + m)
            dst = pair - src * (base + m)
            ptr = np.zeros(m + 1, dtype=np.int64)
            np.add.accumulate(np.bincount(src, minlength=m), out=ptr[1:])
        else:
            ptr, dst = np.zeros(m + 1, dtype=np.int64), _EMPTY
        is_input = np.zeros(m, dtype=bool)
        is_input[:len(input_ids)] = True
        # the table, renumbered, is the graph's lookup table from now on
        keys = self.keys
        self.table[keys[:size]] = new_id
        table = CindexTable.from_dense(
            self.table, self.lo, self.hi, (self.stride_n, self.stride_t, self.stride_node),
            np.concatenate((keys[:base], keys[order])), tuple(self.margin))
        return self.coords_of(order), is_input, ptr, dst, table

    def _required_from_counts(self):
        """_required where Kaldi's usable counts are kept and every node uses exactly
        its computable inputs (_node_facts): then the required cindexes are the
        usable computable ones, and their used dependencies their computable
        inputs.  (A usable computable cindex has a usable computable reader, which
        uses it, or is an output; the readers lead to an output as the graph has
        no cycles.  A required cindex is read by a required one, which counts for
        it.)  Every width's rows at once instead of node by node."""
        size = self.size
        status = self.status[:size]
        computable = status == C
        required = computable & (self.usable[:size] > 0)
        rows_by: dict = {}
        deps_by: dict = {}
        for nd in self.node_deps:
            for rows, deps in nd.parts:
                k = deps.shape[1]
                if k:
                    rows_by.setdefault(k, []).append(rows)
                    deps_by.setdefault(k, []).append(deps)
        edges_src, edges_dst = [], []
        for k, parts in rows_by.items():
            rows, deps = _cat(parts), _cat(deps_by[k])
            sel = required[rows]
            if not _all(sel):
                rows, deps = rows[sel], deps[sel]
            used = computable[deps]
            if _all(used.ravel()):
                edges_src.append(rows if k == 1 else rows.repeat(k))
                edges_dst.append(deps.ravel())
            else:
                edges_src.append(np.repeat(rows, rows_count(used)))
                edges_dst.append(deps[used])
        return required, edges_src, edges_dst

    def _required(self, base: int, outs: np.ndarray):
        """Cindexes reachable from the outputs by used dependencies, and those
        dependencies (as parallel id arrays).  All of them are computable (the
        outputs are, and a computable cindex uses only computable inputs); that is
        checked once at the end rather than row by row."""
        num = self.num_nodes
        size = self.size
        rowpos, deps_by, lists_of = self._inputs_by_width()
        node_deps, fast_of, status = self.node_deps, self.settle_fast, self.status
        required = np.zeros(size, dtype=bool)
        pending: list[list] = [[] for _ in range(num)]
        # whether a node's pending ids may repeat beyond what several parts bring
        # (the inputs of distinct rows repeat unless a node reads one constant
        # shift of its Index)
        pending_dup = [False] * num
        snode = self.stride_node
        out_nodes = self.keys[outs] // snode
        for v in np.unique(out_nodes).tolist():
            pending[v].append(outs[out_nodes == v])
        rev = self.nodes.order[::-1]
        pos = self.pos
        shifts = self.nodes.shifts
        edges_src, edges_dst = [], []
        for _ in range(self.max_sweeps):
            checkpoint("the graph build")
            later: list[list] = [[] for _ in range(num)]
            later_dup = [False] * num
            any_later = False
            for v in rev:
                parts = pending[v]
                if not parts:
                    continue
                pending[v] = []
                g = _cat(parts)
                g = g[~required[g]]
                if not len(g):
                    continue
                if len(parts) > 1 or pending_dup[v]:
                    g = _distinct(g)
                required[g] = True
                nd = node_deps[v]
                if not nd.parts:
                    continue
                if base:
                    g = g[g >= base]
                p = rowpos[g]
                if _any(p < 0):
                    raise GiveUp("a required cindex was not expanded")
                mask = None
                if nd.lists is not None:
                    used_lists = lists_of[v]
                    lists = [used_lists[i] for i in p.tolist()]
                    counts = [len(lst) for lst in lists]
                    if not sum(counts):
                        continue
                    dst = np.concatenate(lists)
                    src = np.repeat(g, counts)
                else:
                    k = nd.parts[0][1].shape[1]
                    d = deps_by[k][p]
                    fast = fast_of[v]
                    if fast is None or fast.all_required:
                        src = g if k == 1 else np.repeat(g, k)
                        dst = d.ravel()
                    else:
                        # the inputs used (meaningful for computable rows, the only
                        # ones that can be required: checked at the end)
                        mk = mask = fast.used_arrays(status[d] == C)
                        src = np.repeat(g, rows_count(mk))
                        dst = d[mk]
                if not len(dst):
                    continue
                edges_src.append(src)
                edges_dst.append(dst)
                one = self.one_producer[v]
                sh = shifts[v]
                if one >= 0:
                    groups = [(one, dst)]
                    dup = sh is None or len(sh) != 1
                elif sh is not None:
                    # one constant shift per column: each column's ids are on one
                    # node, and distinct
                    groups = [(s[0], d[:, j] if mask is None else d[mk[:, j], j])
                              for j, s in enumerate(sh)]
                    dup = False
                else:
                    dn = self.keys[dst] // snode
                    groups = [(w, dst[dn == w]) for w in np.unique(dn).tolist()]
                    dup = True
                for w, ids in groups:
                    if pos[w] < pos[v]:
                        pending[w].append(ids)
                        pending_dup[w] |= dup
                    else:
                        later[w].append(ids)
                        later_dup[w] |= dup
                        any_later = True
            if not any_later:
                break
            pending, pending_dup = later, later_dup
        else:
            raise GiveUp("too many sweeps")
        if _any(required & (self.status[:size] != C)):
            raise GiveUp("a required cindex is not computable")
        return required, edges_src, edges_dst


class _ColumnRule:
    """The settling and pruning rule of a component whose inputs come as arrays
    (``input_times``, one column per input): computable when the inputs of the
    ``required`` columns are (None: when any input is), using every input that is
    (what a compiled descriptor's parts give the same two functions for)."""

    all_required = False
    uses_present = True

    def __init__(self, required: np.ndarray | None) -> None:
        self.required = required

    def computable_arrays(self, ok: np.ndarray) -> np.ndarray:
        if self.required is None:
            return rows_any(ok)
        return rows_all(ok[:, self.required])

    @staticmethod
    def used_arrays(ok: np.ndarray) -> np.ndarray:
        return ok


def _column_rule(nodes, v: int) -> _ColumnRule | None:
    """The rule of node v, a component asked Index by Index that gives its inputs as
    arrays (``input_times`` and ``input_rule``: statistics, time-height
    convolution, restricted attention, distribute), or None."""
    comp = nodes.component[v]
    if (nodes.deps_mode[v] != DEPS_GENERAL or comp is None
            or not callable(getattr(comp, "input_times", None))
            or not callable(getattr(comp, "input_rule", None))):
        return None
    return _ColumnRule(comp.input_rule())


def _node_facts(nodes) -> tuple:
    """Per node of a NodeTable, what the array build reads (kept with the table): its
    position in the node order, whether it is an input node (a boolean array), its
    producers (a tuple), the one node all its inputs are on or -1, its compiled
    descriptor where that decides its statuses, whether it needs all its inputs
    (and the list of the nodes that do not), its chain (_chains), and whether every
    node with inputs uses exactly those that are computable (no Failover, no
    component asked Index by Index: _required_from_counts applies)."""
    hit = nodes.extra.get("graph_node_facts")
    if hit is not None:
        return hit
    num = len(nodes.kind)
    pos = [0] * num
    for p, v in enumerate(nodes.order):
        pos[v] = p
    is_input_node = np.array([k == INPUT for k in nodes.kind], dtype=bool)
    producers = [tuple(p) for p in nodes.producers]
    one_producer = [p[0] if len(p) == 1 else -1 for p in producers]
    settle_fast = [nodes.fast[v] if nodes.deps_mode[v] == DEPS_DESCRIPTOR
                   else _column_rule(nodes, v) for v in range(num)]
    all_required = [nodes.deps_mode[v] != DEPS_GENERAL and (f is None or f.all_required)
                    for v, f in enumerate(settle_fast)]
    partial_nodes = [v for v in range(num) if not all_required[v]]
    # whether every node with inputs uses exactly the computable ones
    uses_present = all(nodes.deps_mode[v] in (DEPS_IDENTITY, DEPS_OFFSETS)
                       or (settle_fast[v] is not None and settle_fast[v].uses_present)
                       for v in range(num) if nodes.deps_mode[v] != DEPS_NONE)
    out = (pos, is_input_node, producers, one_producer, settle_fast, all_required,
           partial_nodes, _chains(nodes, pos), uses_present)
    nodes.extra["graph_node_facts"] = out
    return out


def _chains(nodes, pos: list) -> "_Chains":
    """Per node v whose one input is the same Index on another node: the nodes
    c1, ..., cL its expansion can run through at once (ArrayGraphBuild._expand_chain):
    c1 is v's input node, each ci before the last reads the same Index on c(i+1),
    is read by no node but c(i-1) (v for c1), is no input node and comes earlier
    in the node order; cL is where the chain stops.  An empty list where there
    is no such chain (fewer than two nodes).  Kept with the network's NodeTable."""
    hit = nodes.extra.get("graph_chains")
    if hit is not None:
        return hit
    out = nodes.extra["graph_chains"] = _Chains(nodes, pos)
    return out


class _Chains:
    """``chains[v]``: v's chain (see _chains), made when first asked for.  Each node
    has at most one link to follow (``link[u]``: the next chain node after u, or
    -1 where a chain through u stops at ``nxt[u]``), found for all nodes in one
    pass; a chain is then the links followed from v.  (Walking every node's chain
    in full up front, with a list-membership test per step, cost O(N^3) on a network
    that is one long chain of N nodes: a 2000-node chain took minutes to compile.)
    The order condition (each node earlier than its reader) makes the links
    acyclic."""

    def __init__(self, nodes, pos: list):
        num = len(nodes.kind)
        readers: list[list[int]] = [[] for _ in range(num)]
        for v in range(num):
            for p in nodes.producers[v]:
                readers[p].append(v)
        nxt = [-1] * num            # the node v reads the same Index on, or -1
        for v in range(num):
            sh = nodes.shifts[v]
            if sh is not None and len(sh) == 1 and sh[0][1:] == (0, 0, 0):
                nxt[v] = sh[0][0]
        link = [-1] * num
        for u in range(num):
            c = nxt[u]
            if (c >= 0 and nxt[c] >= 0 and readers[c] == [u] and nodes.kind[c] != INPUT
                    and pos[c] < pos[u]):
                link[u] = c
        self.nxt, self.link = nxt, link
        self._made: dict[int, list[int]] = {}

    def __getitem__(self, v: int) -> list[int]:
        got = self._made.get(v)
        if got is None:
            link = self.link
            chain = []
            c = link[v]
            while c >= 0:
                chain.append(c)
                last = c
                c = link[c]
            got = self._made[v] = chain + [self.nxt[last]] if chain else []
        return got


def build_arrays(builder, request, max_sweeps: int):
    """(coords, is_input, dep_ptr, dep_idx, table) of the segment for ``request``
    (what ComputationGraph.append_arrays takes; the table covers the graph's
    cindexes after that), or None when the array build does not apply
    (builder.array_status says why)."""
    result = build_intervals(builder, request)
    if result is not None:
        builder.array_status = "used"
        builder.array_method = "intervals"
        return result
    builder.array_method = "sweeps"
    try:
        result = ArrayGraphBuild(builder, request, max_sweeps).run()
    except GiveUp as e:
        builder.array_status = f"declined: {e}"
        return None
    builder.array_status = "used"
    return result


__all__ = ["build_arrays", "GiveUp", "ArrayGraphBuild"]
