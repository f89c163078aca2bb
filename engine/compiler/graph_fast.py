"""A NumPy fast path for Kaldi's ComputationGraphBuilder::Compute
(nnet-computation-graph.cc), used by engine.compiler.graph when it applies.

Why an exact shortcut exists.  In Kaldi's algorithm a cindex only stops being
"usable" when something it feeds turns out not computable.  If that never
happens, every cindex added is popped in the very next round with its
dependencies still unknown, so the order in which cindexes get their ids is a
layered walk: layer 0 is the requested outputs (request order); layer k+1 is
made by taking layer k in reverse order (Kaldi pops its queue from the back)
and appending, for each cindex, its not-yet-seen inputs in GetDependencies
order.  The computability rounds in between only settle states; they add
nothing and reorder nothing.  In the end every cindex is computable, each
dependency list is the sorted set of its inputs, and usable_count is the
number of dependents (+1 for a requested output).

So this module builds the layers with whole-array operations (per node: the
compiled descriptor maps of engine.compiler.fast_descriptors, simple
components and dim-range nodes map an Index to itself on another node; other
components are asked cindex by cindex), looking cindexes up in dense per-node
id grids, and then checks that the premise held:

- no cindex was created on an input node (it would be not computable: the
  request does not supply it);
- every descriptor with IfDefined/Failover/Const and every non-simple
  component is computable from its inputs (all of which are computable);
- there is no cycle (a cindex that needs itself stays kUnknown in Kaldi).

If any check fails, or the network has something this path does not know, it
gives up before touching the graph and the builder runs Kaldi's algorithm
cindex by cindex.  Pruning is shared with the general path.
"""

from __future__ import annotations

import numpy as np

from engine.core.index import Cindex, Index

# Node kinds as in engine.compiler.graph.
_INPUT, _DESCRIPTOR, _COMPONENT, _DIM_RANGE = 0, 1, 2, 3
# Refuse grids bigger than this many cells (a request spread over huge t or n
# ranges): the per-cindex algorithm handles those without the memory.
MAX_GRID_CELLS = 1 << 23
_tuple_new = tuple.__new__


class GiveUp(Exception):
    """The layered shortcut does not apply; use the general algorithm."""


class _Grids:
    """Dense (n, t, x) -> cindex id tables, one per node, grown on demand."""

    def __init__(self, num_nodes: int) -> None:
        self.lo: list = [None] * num_nodes    # (n0, t0, x0)
        self.ids: list = [None] * num_nodes   # int64 array, -1 = absent
        self.cells = 0

    def _fit(self, node: int, n: np.ndarray, t: np.ndarray, x: np.ndarray) -> None:
        if len(n) == 1:
            lo = hi = (int(n[0]), int(t[0]), int(x[0]))
        else:
            lo = (int(n.min()), int(t.min()), int(x.min()))
            hi = (int(n.max()), int(t.max()), int(x.max()))
        old = self.ids[node]
        if old is not None:
            o = self.lo[node]
            ohi = (o[0] + old.shape[0] - 1, o[1] + old.shape[1] - 1, o[2] + old.shape[2] - 1)
            if all(lo[k] >= o[k] and hi[k] <= ohi[k] for k in range(3)):
                return
            lo = tuple(min(lo[k], o[k]) for k in range(3))
            hi = tuple(max(hi[k], ohi[k]) for k in range(3))
        # Room to grow along t (the axis that moves as layers go back in time).
        pad = max(8, (hi[1] - lo[1]) // 4)
        lo = (lo[0], lo[1] - pad, lo[2])
        hi = (hi[0], hi[1] + pad, hi[2])
        shape = tuple(hi[k] - lo[k] + 1 for k in range(3))
        size = shape[0] * shape[1] * shape[2]
        self.cells += size - (old.size if old is not None else 0)
        if self.cells > MAX_GRID_CELLS:
            raise GiveUp("index ranges too wide for dense tables")
        new = np.full(shape, -1, dtype=np.int64)
        if old is not None:
            o = self.lo[node]
            new[o[0] - lo[0]:o[0] - lo[0] + old.shape[0], o[1] - lo[1]:o[1] - lo[1] + old.shape[1],
                o[2] - lo[2]:o[2] - lo[2] + old.shape[2]] = old
        self.lo[node], self.ids[node] = lo, new

    def lookup(self, node: int, n, t, x) -> np.ndarray:
        self._fit(node, n, t, x)
        o = self.lo[node]
        return self.ids[node][n - o[0], t - o[1], x - o[2]]

    def store(self, node: int, n, t, x, ids, fits: bool = False) -> None:
        if not fits:
            self._fit(node, n, t, x)
        o = self.lo[node]
        self.ids[node][n - o[0], t - o[1], x - o[2]] = ids

    def linear(self, node: int, n, t, x) -> np.ndarray:
        """Position in this node's table (after lookup made it fit)."""
        o, shape = self.lo[node], self.ids[node].shape
        return ((n - o[0]) * shape[1] + (t - o[1])) * shape[2] + (x - o[2])


class _Coords:
    """node, n, t, x of every cindex id, as growing int64 arrays."""

    def __init__(self, rows: np.ndarray) -> None:
        self.data = rows
        self.size = len(rows)

    def append(self, rows: np.ndarray) -> None:
        need = self.size + len(rows)
        if need > len(self.data):
            grown = np.empty((max(need, 2 * len(self.data)), 4), dtype=np.int64)
            grown[:self.size] = self.data[:self.size]
            self.data = grown
        self.data[self.size:need] = rows
        self.size = need


def _layer_inputs(builder, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For cindexes ``rows`` ((k, 4) node/n/t/x, in processing order): the input
    cindexes of all of them, flattened in order ((m, 4)), and the per-row counts."""
    nodes = builder.nodes
    counts = np.zeros(len(rows), dtype=np.int64)
    pieces = []   # (row positions, list of (node, n, t, x) per dependency slot) or per-row lists
    for node in np.unique(rows[:, 0]).tolist():
        pos = np.flatnonzero(rows[:, 0] == node)
        n, t, x = rows[pos, 1], rows[pos, 2], rows[pos, 3]
        kind = nodes.kind[node]
        if kind == _DESCRIPTOR:
            fast = nodes.fast[node]
            if fast is None:
                raise GiveUp("descriptor class without a compiled form")
            slots = fast.deps_arrays(n, t, x)
            counts[pos] = len(slots)
            pieces.append((pos, slots))
        elif kind == _COMPONENT and nodes.simple[node]:
            counts[pos] = 1
            pieces.append((pos, [(node - 1, n, t, x)]))
        elif kind == _DIM_RANGE:
            counts[pos] = 1
            pieces.append((pos, [(nodes.dim_range_src[node], n, t, x)]))
        elif kind == _COMPONENT:
            comp, misc = nodes.component[node], builder.request.misc_info
            lists = [comp.get_input_indexes(misc, _tuple_new(Index, r))
                     for r in zip(n.tolist(), t.tolist(), x.tolist())]
            counts[pos] = [len(v) for v in lists]
            pieces.append((pos, (node - 1, lists)))
        else:
            raise GiveUp("a cindex on an input node that the request does not supply")
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    flat = np.empty((int(starts[-1]), 4), dtype=np.int64)
    for pos, slots in pieces:
        if isinstance(slots, tuple):
            src, lists = slots
            cnt = counts[pos]
            total = int(cnt.sum())
            # positions starts[p] .. starts[p + 1] - 1 of every row p, in order
            first = np.cumsum(cnt) - cnt
            at = np.repeat(starts[pos] - first, cnt) + np.arange(total)
            vals = [i for v in lists for i in v]
            if vals:
                flat[at, 0] = src
                flat[at, 1:] = np.array(vals, dtype=np.int64).reshape(-1, 3)
            continue
        base = starts[pos]
        for j, (nd, n, t, x) in enumerate(slots):
            at = base + j
            flat[at, 0] = nd
            flat[at, 1] = n
            flat[at, 2] = t
            flat[at, 3] = x
    return flat, counts


def _has_cycle(num: int, dep_rows: np.ndarray, dep_ids: np.ndarray) -> bool:
    """Whether the edges row -> dep (distinct pairs) contain a cycle (Kahn's peeling)."""
    if not len(dep_rows):
        return False
    remaining = np.bincount(dep_rows, minlength=num)
    order = np.argsort(dep_ids, kind="stable")
    by_dep_rows = dep_rows[order]
    dep_starts = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(np.bincount(dep_ids, minlength=num), out=dep_starts[1:])
    frontier = np.flatnonzero(remaining == 0)
    done = len(frontier)
    while len(frontier):
        lens = dep_starts[frontier + 1] - dep_starts[frontier]
        total = int(lens.sum())
        if not total:
            break
        offs = np.repeat(dep_starts[frontier] - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
        users = by_dep_rows[offs + np.arange(total)]
        np.subtract.at(remaining, users, 1)
        users = np.unique(users)
        frontier = users[remaining[users] == 0]
        done += len(frontier)
    return done < num


def build_layered(builder, outputs: list[int], max_layers: int) -> bool:
    """Compute one segment's graph by layers; True when done (the builder's state
    is then what Kaldi's Compute would leave), False when it does not apply
    (nothing changed)."""
    try:
        plan = _plan(builder, outputs, max_layers)
    except GiveUp as e:
        builder.layered_status = f"declined: {e}"
        return False
    _commit(builder, *plan)
    builder.layered_status = "used"
    return True


def _plan(builder, outputs: list[int], max_layers: int):
    graph = builder.graph
    base = len(graph.cindexes)
    nodes = builder.nodes
    for spec in builder.request.inputs:
        # Kaldi's pruning asks a supplied component-node cindex for its inputs;
        # leave that corner to the general path.
        if nodes.kind[builder.nnet.get_node_index(spec.name)] != _INPUT:
            raise GiveUp("input at a component node")
    rows0 = np.array([(c[0], c[1][0], c[1][1], c[1][2]) for c in graph.cindexes],
                     dtype=np.int64).reshape(-1, 4)
    coords = _Coords(rows0)
    grids = _Grids(len(nodes.kind))
    for node in np.unique(rows0[:, 0]).tolist():
        pos = np.flatnonzero(rows0[:, 0] == node)
        grids.store(node, rows0[pos, 1], rows0[pos, 2], rows0[pos, 3], pos)
    next_id = base
    layer = np.array(outputs, dtype=np.int64)
    proc_rows, proc_flat_ids, proc_counts = [], [], []
    for _ in range(max_layers):
        if not len(layer):
            break
        rev = layer[::-1]
        rows = coords.data[rev]
        flat, counts = _layer_inputs(builder, rows)
        ids = np.empty(len(flat), dtype=np.int64)
        new_parts = []
        for node in np.unique(flat[:, 0]).tolist():
            pos = np.flatnonzero(flat[:, 0] == node)
            n, t, x = flat[pos, 1], flat[pos, 2], flat[pos, 3]
            got = grids.lookup(node, n, t, x)
            ids[pos] = got
            miss = got < 0
            if miss.any():
                mpos = pos[miss]
                key = grids.linear(node, n[miss], t[miss], x[miss])
                _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
                new_parts.append((node, mpos, first, inverse))
        if new_parts:
            # New cindexes numbered in order of first appearance in the layer.
            firsts = np.concatenate([p[1][p[2]] for p in new_parts])
            order = np.argsort(firsts, kind="stable")
            new_id_of_first = np.empty(len(firsts), dtype=np.int64)
            new_id_of_first[order] = next_id + np.arange(len(firsts))
            k = 0
            for node, mpos, first, inverse in new_parts:
                mine = new_id_of_first[k:k + len(first)]
                k += len(first)
                ids[mpos] = mine[inverse]
                src = flat[mpos[first]]
                grids.store(node, src[:, 1], src[:, 2], src[:, 3], mine, fits=True)
            coords.append(flat[np.sort(firsts)])
            layer = next_id + np.arange(len(firsts))
            next_id += len(firsts)
        else:
            layer = layer[:0]
        proc_rows.append(rev)
        proc_flat_ids.append(ids)
        proc_counts.append(counts)
    else:
        raise GiveUp("too many layers")
    rows_done = np.concatenate(proc_rows)
    counts = np.concatenate(proc_counts)
    flat_ids = np.concatenate(proc_flat_ids)
    # Distinct (cindex, input) pairs: each dependency list is a sorted set.
    owner = np.repeat(rows_done, counts)
    pairs = np.unique(owner * next_id + flat_ids) if len(owner) else np.zeros(0, np.int64)
    dep_rows, dep_ids = pairs // next_id, pairs % next_id
    if _has_cycle(next_id, dep_rows, dep_ids):
        raise GiveUp("a cindex depends on itself")
    _check_general_nodes(builder, coords, rows_done)
    return base, coords, rows_done, dep_rows, dep_ids, next_id


def _check_general_nodes(builder, coords: _Coords, rows_done: np.ndarray) -> None:
    """IfDefined/Failover/Const descriptors and non-simple components must come
    out computable when all their inputs are (they are, if this path applies)."""
    nodes = builder.nodes
    node_of = coords.data[rows_done, 0]
    for node in np.unique(node_of).tolist():
        kind = nodes.kind[node]
        general_desc = kind == _DESCRIPTOR and not nodes.fast[node].all_required
        general_comp = (kind == _COMPONENT and not nodes.simple[node]
                        and not nodes.comp_all_required[node])
        if not (general_desc or general_comp):
            continue
        rows = coords.data[rows_done[node_of == node]]
        if general_desc:
            if not nodes.fast[node].computable([True] * nodes.fast[node].num_deps):
                raise GiveUp("a descriptor not computable from all of its inputs")
            continue
        comp, misc = nodes.component[node], builder.request.misc_info
        # Asked with exactly its listed inputs present (Kaldi settles it while
        # other cindexes of the input node may not exist yet; IsComputable is
        # monotone, so computable from these means computable at any time).
        for r in rows[:, 1:].tolist():
            idx = _tuple_new(Index, r)
            listed = set(comp.get_input_indexes(misc, idx))
            if not comp.is_computable(misc, idx, listed.__contains__, None):
                raise GiveUp("a component not computable from all of its inputs")


def _make_cindexes(rows: np.ndarray) -> list:
    """Cindex objects for (k, 4) node/n/t/x rows; cindexes with the same (n, t, x)
    share one Index object (fewer allocations, and cheaper copies later)."""
    if not len(rows):
        return []
    idx = rows[:, 1:]
    lo = idx.min(axis=0)
    span = idx.max(axis=0) - lo + 1
    key = ((idx[:, 0] - lo[0]) * span[1] + (idx[:, 1] - lo[1])) * span[2] + (idx[:, 2] - lo[2])
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    objs = [_tuple_new(Index, r) for r in idx[first].tolist()]
    shared = [objs[i] for i in inverse.tolist()]
    return [_tuple_new(Cindex, pair) for pair in zip(rows[:, 0].tolist(), shared)]


def _commit(builder, base, coords, rows_done, dep_rows, dep_ids, total) -> None:
    graph = builder.graph
    m = total - base
    new_cindexes = _make_cindexes(coords.data[base:total])
    graph.cindexes.extend(new_cindexes)
    graph._ids.update(zip(new_cindexes, range(base, total)))
    graph.is_input.extend([False] * m)
    # Dependency lists (sorted sets) of every cindex whose inputs were added:
    # the outputs, then every new cindex (in id order).
    ids_list = dep_ids.tolist()
    deps = graph.dependencies
    old_arr = rows_done[rows_done < base]
    old = old_arr.tolist()
    lo = np.searchsorted(dep_rows, old_arr).tolist()
    hi = np.searchsorted(dep_rows, old_arr, side="right").tolist()
    for c, s, e in zip(old, lo, hi):
        deps[c] = ids_list[s:e]
    b = np.searchsorted(dep_rows, np.arange(base, total + 1)).tolist()
    deps.extend([ids_list[b[j]:b[j + 1]] for j in range(m)])
    # What Kaldi's rounds leave: all computable, usable_count = dependents
    # (+1 for requested outputs), nothing queued.  depend_on_this is not
    # filled in: only the computability rounds read it, and there are none
    # left before prune() resets the segment.
    users = np.bincount(dep_ids, minlength=total)
    computable, usable, deps_done = builder.computable, builder.usable, builder.deps_done
    computable.extend([1] * m)
    usable.extend(users[base:].tolist())
    builder.queued.extend([False] * m)
    deps_done.extend([True] * m)
    builder.depend_on_this.extend([None] * m)
    trivial = builder.nodes.prune_trivial
    node_col = coords.data[:total, 0]
    general_nodes = [k for k in np.unique(node_col[rows_done]).tolist() if not trivial[k]]
    builder._layered_general = (
        rows_done[np.isin(node_col[rows_done], general_nodes)].tolist() if general_nodes else [])
    for c in old:
        computable[c] = 1
        deps_done[c] = True
        builder.queued[c] = False
    for c in np.flatnonzero(users[:base]).tolist():
        usable[c] += int(users[c])
    builder.current_queue = []
    builder.next_queue = []
