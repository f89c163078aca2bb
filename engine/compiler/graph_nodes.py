"""The computation graph's container and the per-node facts its builders read
(the data side of Kaldi's nnet-computation-graph.{h,cc}: ComputationGraph, and
what ComputationGraphBuilder asks of the Nnet for every node).

``ComputationGraph`` holds the cindexes (vertices), which of them are supplied
inputs, their dependency lists and the segment boundaries.  Its primary form is
arrays: ``coords`` ((N, 4) int64 rows node, n, t, x), ``is_input_array`` and the
dependencies as CSR (``dep_ptr``, ``dep_idx``, each list a sorted set of ids);
``find`` looks cindex ids up for whole arrays.  The list form Kaldi's
per-cindex algorithm works on (``cindexes`` of Cindex tuples, ``is_input``,
``dependencies``, the id dict) is made from the arrays when first asked for;
the per-cindex builder appends to it and hands a finished segment back with
``commit_lists``.

Ids within a segment are canonical: the supplied inputs in request order, then
every other cindex sorted by (node, t, x, n).  Kaldi numbers cindexes in the
order its builder meets them; nothing computed from the graph depends on that
numbering (phases and steps sort cindexes, the compiler sorts the inputs it
sums), so both builders give the same graph.

``NodeTable`` reads the Nnet once per builder: node kinds, descriptors (and
their compiled forms, engine.compiler.fast_descriptors), components, how a
node's inputs follow from its Indexes, and an order of the nodes in which
producers come before their consumers except along recurrences.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np

from engine.compiler.array_ops import column_bounds
from engine.compiler.fast_descriptors import compile_descriptor
from engine.core.index import K_NO_TIME, Cindex, Index, array_to_indexes
from engine.nnet.components.base import Component, ComponentProperty

# Node kinds, from the nnet's NodeType (kept as small ints for speed).
INPUT, DESCRIPTOR, COMPONENT, DIM_RANGE = 0, 1, 2, 3
_INPUT, _DESCRIPTOR, _COMPONENT, _DIM_RANGE = INPUT, DESCRIPTOR, COMPONENT, DIM_RANGE

# How a node's input cindexes follow from an Index (NodeTable.deps_mode).
DEPS_NONE = 0        # input node
DEPS_IDENTITY = 1    # the same Index on one other node (simple components, dim-range nodes,
                     # components with the default GetInputIndexes/IsComputable)
DEPS_DESCRIPTOR = 2  # a compiled descriptor
DEPS_OFFSETS = 3     # a component whose inputs are fixed shifts of the Index (input_offsets)
DEPS_GENERAL = 4     # asked of the object (descriptor or component), Index by Index

_tuple_new = tuple.__new__
_SIMPLE = int(ComponentProperty.SIMPLE_COMPONENT)


# room kept for the few cindexes added after a graph is built (padding, dim-range
# cindexes: steps.py), in the graph's arrays and the steps' location arrays, so that
# adding them does not copy those arrays
ADDED_CINDEX_ROOM = 64


def _grow(a: np.ndarray, need: int) -> np.ndarray:
    """``a`` with room for ``need`` rows (a new array, the rows kept, when it has
    less): doubled, or, the first time, what is needed and ADDED_CINDEX_ROOM rows
    more."""
    if need <= len(a):
        return a
    new = np.empty((max(need + ADDED_CINDEX_ROOM, 2 * len(a)),) + a.shape[1:], dtype=a.dtype)
    new[:len(a)] = a
    return new


# at most this many cindexes are added to a CindexTable by CindexTable._add_few
_FEW_ROWS = 32


class CindexTable:
    """Cindex (node, n, t, x) -> id for whole arrays at once.

    Cindexes are keys ((node * span_n + n) * span_t + t) * span_x + x (relative to
    the low corner) into a dense table when the ranges are compact, sorted keys
    otherwise; blank (t = kNoTime) cindexes live in a dict.  The table keeps
    ``margin`` (n, t, x) free around every cindex and covers nodes 0 ..
    ``num_nodes`` - 1, so that ``find_shifted`` (the same Index shifted by a
    small constant, on another node) is one addition and one lookup."""

    MAX_DENSE = 1 << 22

    def __init__(self, coords: np.ndarray, num_nodes: int = 0,
                 margin: tuple[int, int, int] = (0, 0, 0)) -> None:
        coords = np.asarray(coords, dtype=np.int64).reshape(-1, 4)
        self.margin = tuple(margin)
        blank = coords[:, 2] == K_NO_TIME
        self.blank: dict[tuple[int, int, int], int] = {}
        ids = np.arange(len(coords), dtype=np.int64)
        if blank.any():
            for i in np.flatnonzero(blank).tolist():
                node, n, _, x = coords[i].tolist()
                self.blank[(node, n, x)] = i
            real, rids = coords[~blank], ids[~blank]
        else:
            real, rids = coords, ids
        if len(real):
            lo, hi = column_bounds(real)
        else:
            lo, hi = [0, 0, 0, 0], [0, 0, 0, 0]
        lo[0] = min(lo[0], 0)
        hi[0] = max(hi[0], num_nodes - 1)
        for k in range(3):
            lo[k + 1] -= margin[k]
            hi[k + 1] += margin[k]
        self.lo = lo
        self.hi = hi
        span = [hi[k] - lo[k] + 1 for k in range(4)]
        self.stride_t = span[3]
        self.stride_n = span[2] * span[3]
        self.stride_node = span[1] * self.stride_n
        cells = span[0] * self.stride_node
        self.mode = ("dense" if cells <= max(self.MAX_DENSE, 8 * len(real))
                     else "sorted" if cells < 1 << 62 else "dict")
        self.key_of = np.full(len(coords), -1, dtype=np.int64)
        if self.mode == "dict":
            self.dict = {tuple(r): i for r, i in zip(real.tolist(), rids.tolist())}
            return
        keys = self._key(real[:, 0], real[:, 1], real[:, 2], real[:, 3])
        self.key_of[rids] = keys
        if self.mode == "dense":
            self.table = np.full(cells, -1, dtype=np.int64)
            self.table[keys] = rids
        else:
            order = np.argsort(keys, kind="stable")
            self.sorted_keys, self.sorted_ids = keys[order], rids[order]

    @classmethod
    def from_dense(cls, table: np.ndarray, lo: Sequence[int], hi: Sequence[int],
                   strides: tuple[int, int, int], key_of: np.ndarray,
                   margin: tuple[int, int, int]) -> "CindexTable":
        """A dense table made elsewhere (the array graph builder's): ``table`` maps
        node * stride_node + (n - lo[0]) * stride_n + (t - lo[1]) * stride_t +
        (x - lo[2]) to ids (-1 where absent), for nodes from 0 on and n, t, x within
        ``lo`` .. ``hi`` (``strides``: stride_n, stride_t, stride_node); ``key_of``
        the key of every id; every cindex has ``margin`` free around it."""
        self = cls.__new__(cls)
        self.margin = tuple(margin)
        self.blank = {}
        self.stride_n, self.stride_t, self.stride_node = strides
        self.lo = [0, lo[0], lo[1], lo[2]]
        self.hi = [len(table) // self.stride_node - 1, hi[0], hi[1], hi[2]]
        self.mode = "dense"
        self.key_of = key_of
        self.table = table
        return self

    def _key(self, node, n, t, x):
        lo = self.lo
        return ((node - lo[0]) * self.stride_node + (n - lo[1]) * self.stride_n
                + (t - lo[2]) * self.stride_t + (x - lo[3]))

    def add(self, coords: np.ndarray, ids: np.ndarray) -> bool:
        """Add cindexes (ids continuing from the last); False when they do not fit
        with the margin (then build a new table)."""
        coords = np.asarray(coords, dtype=np.int64).reshape(-1, 4)
        if self.mode != "dense" or len(ids) and int(ids[0]) != len(self.key_of):
            return False
        if len(coords) <= _FEW_ROWS:
            return self._add_few(coords.tolist(), np.asarray(ids).tolist())
        blank = coords[:, 2] == K_NO_TIME
        keys = np.full(len(coords), -1, dtype=np.int64)
        real = ~blank
        if real.any():
            c = coords[real]
            lo, hi, mg = self.lo, self.hi, self.margin
            ext_lo, ext_hi = column_bounds(c)
            if ext_lo[0] < lo[0] or ext_hi[0] > hi[0] or any(
                    ext_lo[k + 1] - mg[k] < lo[k + 1] or ext_hi[k + 1] + mg[k] > hi[k + 1]
                    for k in range(3)):
                return False
            keys[real] = self._key(c[:, 0], c[:, 1], c[:, 2], c[:, 3])
            self.table[keys[real]] = ids[real]
        for (node, n, _, x), i in zip(coords[blank].tolist(), ids[blank].tolist()):
            self.blank[(node, n, x)] = i
        self.key_of = np.concatenate((self.key_of, keys))
        return True

    def _add_few(self, rows: list, ids: list) -> bool:
        """``add`` for a few cindexes (lists of rows and ids), in Python: the same
        checks and entries without the dozen array operations, each of which costs
        more than the whole of this for a handful of rows (the steps computer adds
        2-4 dim-range cindexes at a time)."""
        lo, hi, (mn, mt, mx) = self.lo, self.hi, self.margin
        keys = []
        for node, n, t, x in rows:
            if t == K_NO_TIME:
                keys.append(-1)
                continue
            if not (lo[0] <= node <= hi[0] and lo[1] <= n - mn and n + mn <= hi[1]
                    and lo[2] <= t - mt and t + mt <= hi[2] and lo[3] <= x - mx
                    and x + mx <= hi[3]):
                return False
            keys.append(self._key(node, n, t, x))
        table, blank = self.table, self.blank
        for (node, n, _, x), k, i in zip(rows, keys, ids):
            if k < 0:
                blank[(node, n, x)] = i
            else:
                table[k] = i
        self.key_of = np.concatenate((self.key_of, np.array(keys, dtype=np.int64)))
        return True

    def _lookup(self, keys: np.ndarray) -> np.ndarray:
        if self.mode == "dense":
            return self.table[keys]
        if not len(self.sorted_keys):
            return np.full(len(keys), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.sorted_keys, keys), len(self.sorted_keys) - 1)
        return np.where(self.sorted_keys[pos] == keys, self.sorted_ids[pos], -1)

    def find(self, node, n, t, x) -> np.ndarray:
        """Ids of the cindexes (node, n, t, x) (int64 arrays; node may be an int), -1
        where absent."""
        lo, hi = self.lo, self.hi
        out = np.full(len(t), -1, dtype=np.int64)
        if self.mode == "dict":
            nodes = np.broadcast_to(node, t.shape).tolist()
            for j, key in enumerate(zip(nodes, n.tolist(), t.tolist(), x.tolist())):
                out[j] = self.dict.get(key, self.blank.get((key[0], key[1], key[3]), -1)
                                       if key[2] == K_NO_TIME else -1)
            return out
        ok = (t >= lo[2]) & (t <= hi[2]) & (n >= lo[1]) & (n <= hi[1]) & (x >= lo[3]) \
            & (x <= hi[3])
        if isinstance(node, (int, np.integer)):
            if not lo[0] <= node <= hi[0]:
                ok[:] = False
        else:
            ok &= (node >= lo[0]) & (node <= hi[0])
        if ok.all():
            out = self._lookup(self._key(node, n, t, x))
        elif ok.any():
            sel = np.flatnonzero(ok)
            nd = node if isinstance(node, (int, np.integer)) else node[sel]
            out[sel] = self._lookup(self._key(nd, n[sel], t[sel], x[sel]))
        if self.blank:
            for j in np.flatnonzero(t == K_NO_TIME).tolist():
                nd = int(node) if isinstance(node, (int, np.integer)) else int(node[j])
                out[j] = self.blank.get((nd, int(n[j]), int(x[j])), -1)
        return out

    def shift_ok(self, dn: int, dt: int, dx: int) -> bool:
        mg = self.margin
        return self.mode != "dict" and abs(dn) <= mg[0] and abs(dt) <= mg[1] \
            and abs(dx) <= mg[2]

    def find_shifted(self, ids: np.ndarray, from_node: int, to_node: int,
                     dn: int = 0, dt: int = 0, dx: int = 0) -> np.ndarray | None:
        """Ids of (to_node, n + dn, t + dt, x + dx) for the cindexes ``ids`` (all on
        ``from_node``), -1 where absent; None when the shift exceeds the margin or
        some of ``ids`` are blank (ask ``find``)."""
        if not self.shift_ok(dn, dt, dx) or not self.lo[0] <= to_node <= self.hi[0]:
            return None
        keys = self.key_of[ids]
        if len(keys) and keys.min() < 0:
            return None
        delta = ((to_node - from_node) * self.stride_node + dn * self.stride_n
                 + dt * self.stride_t + dx)
        return self._lookup(keys + delta)


class ComputationGraph:
    """Cindexes, which of them are supplied inputs, and their dependencies."""

    def __init__(self) -> None:
        self._coords = np.empty((0, 4), dtype=np.int64)
        self._num = 0                                  # cindexes held in the arrays
        self._input_arr = np.empty(0, dtype=bool)
        self._dep_parts: list[tuple[np.ndarray, np.ndarray]] = []
        self._dep_cache: tuple[np.ndarray, np.ndarray] | None = (
            np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
        self.segment_ends: list[int] = []
        self._table: CindexTable | None = None
        # the NodeTable of the network the graph is being built for (set by the builder)
        self.node_table = None
        # the list form (the first len(self._cindex_list) ids)
        self._cindex_list: list[Cindex] = []
        self._input_list: list[bool] = []
        self._deps_list: list[list[int]] = []
        self._id_dict: dict[tuple, int] = {}

    def __len__(self) -> int:
        return max(self._num, len(self._cindex_list))

    # -- the array form ------------------------------------------------------------------
    @property
    def coords(self) -> np.ndarray:
        """(N, 4) int64 rows (node, n, t, x), one per cindex id."""
        self._check_arrays()
        return self._coords[:self._num]

    @property
    def is_input_array(self) -> np.ndarray:
        self._check_arrays()
        return self._input_arr[:self._num]

    @property
    def dep_ptr(self) -> np.ndarray:
        return self._deps_csr()[0]

    @property
    def dep_idx(self) -> np.ndarray:
        return self._deps_csr()[1]

    def _check_arrays(self) -> None:
        if len(self._cindex_list) > self._num:
            raise RuntimeError("the graph has cindexes not yet committed from the list form")

    def _deps_csr(self) -> tuple[np.ndarray, np.ndarray]:
        self._check_arrays()
        if self._dep_cache is None:
            ptrs, idxs = [np.zeros(1, dtype=np.int64)], []
            base = 0
            for ptr, idx in self._dep_parts:
                ptrs.append(ptr[1:] + base)
                idxs.append(idx)
                base += int(ptr[-1])
            self._dep_cache = (np.concatenate(ptrs),
                               np.concatenate(idxs) if idxs else np.zeros(0, dtype=np.int64))
            self._dep_parts = [(self._dep_cache[0], self._dep_cache[1])]
        return self._dep_cache

    def append_arrays(self, coords: np.ndarray, is_input: np.ndarray,
                      dep_ptr: np.ndarray | None = None, dep_idx: np.ndarray | None = None,
                      table: CindexTable | None = None) -> int:
        """Add cindexes (ids from len(self) on) with their dependency lists (CSR,
        ``dep_ptr`` of length m + 1; none when omitted); returns the first new id.
        ``table``: a lookup table of all the cindexes the graph then has, if the
        caller has one (the array graph builder)."""
        self._check_arrays()
        m = len(coords)
        start = self._num
        self._coords = _grow(self._coords, start + m)
        self._coords[start:start + m] = coords
        self._input_arr = _grow(self._input_arr, start + m)
        self._input_arr[start:start + m] = is_input
        if dep_ptr is None:
            dep_ptr = np.zeros(m + 1, dtype=np.int64)
            dep_idx = np.zeros(0, dtype=np.int64)
        part = (np.asarray(dep_ptr, dtype=np.int64), np.asarray(dep_idx, dtype=np.int64))
        if start:
            self._dep_parts.append(part)
            self._dep_cache = None
        else:
            # the first cindexes: their lists are the CSR as it is
            self._dep_parts = [part]
            self._dep_cache = part
        self._num = start + m
        if table is not None:
            self._table = table
        elif self._table is not None and not self._table.add(coords,
                                                              np.arange(start, start + m)):
            self._table = None
        return start

    def table(self, num_nodes: int = 0, margin: tuple[int, int, int] = (0, 0, 0)
              ) -> CindexTable:
        """The lookup table of the graph's cindexes (kept up to date as cindexes are
        added), covering nodes 0 .. num_nodes - 1 with at least ``margin``."""
        t = self._table
        if t is not None and num_nodes == 0 and margin == (0, 0, 0):
            return t
        if (t is None or t.hi[0] < num_nodes - 1 or t.margin[0] < margin[0]
                or t.margin[1] < margin[1] or t.margin[2] < margin[2]):
            if t is not None:
                num_nodes = max(num_nodes, t.hi[0] + 1)
                margin = tuple(max(t.margin[k], margin[k]) for k in range(3))
            t = self._table = CindexTable(self.coords, num_nodes, margin)
        return t

    def add_cindexes(self, coords: np.ndarray) -> np.ndarray:
        """Add cindexes (not inputs, no dependencies) given as (m, 4) rows; their ids."""
        start = self.append_arrays(coords, np.zeros(len(coords), dtype=bool))
        return np.arange(start, start + len(coords))

    def find(self, node, n, t, x) -> np.ndarray:
        """Ids of cindexes given as int64 arrays (node may be one int), -1 where absent."""
        return self.table().find(node, n, t, x)

    def find_like(self, ids: np.ndarray, from_node: int, to_node: int) -> np.ndarray:
        """Ids of the cindexes on ``to_node`` with the Indexes of cindexes ``ids``
        (all on ``from_node``), -1 where absent."""
        table = self.table()
        out = table.find_shifted(ids, from_node, to_node)
        if out is None:
            c = self.coords[ids]
            out = table.find(to_node, c[:, 1], c[:, 2], c[:, 3])
        return out

    # -- the list form --------------------------------------------------------------------
    def _sync_lists(self) -> None:
        done = len(self._cindex_list)
        if done >= self._num:
            return
        rows = self._coords[done:self._num]
        new = make_cindexes(rows)
        self._cindex_list.extend(new)
        self._id_dict.update(zip(new, range(done, self._num)))
        self._input_list.extend(self._input_arr[done:self._num].tolist())
        ptr, idx = self._deps_csr()
        b = ptr[done:self._num + 1].tolist()
        flat = idx[b[0]:b[-1]].tolist()
        b0 = b[0]
        self._deps_list.extend(flat[b[j] - b0:b[j + 1] - b0] for j in range(len(b) - 1))

    @property
    def cindexes(self) -> list[Cindex]:
        self._sync_lists()
        return self._cindex_list

    @property
    def is_input(self) -> list[bool]:
        self._sync_lists()
        return self._input_list

    @property
    def dependencies(self) -> list[list[int]]:
        self._sync_lists()
        return self._deps_list

    @property
    def _ids(self) -> dict[tuple, int]:
        self._sync_lists()
        return self._id_dict

    def get_cindex_id(self, cindex) -> int:
        """Id of ``cindex`` (a Cindex or ``(node, (n, t, x))`` tuple), or -1."""
        return self._ids.get(cindex, -1)

    def get_or_add(self, cindex, is_input: bool = False) -> tuple[int, bool]:
        """(List form) id of ``cindex``, adding it (with ``is_input``) if absent;
        returns (id, is_new).  Cindexes added this way are committed to the arrays
        by ``commit_lists``."""
        ids = self._ids
        cid = ids.get(cindex)
        if cid is not None:
            return cid, False
        cid = len(self._cindex_list)
        if type(cindex) is not Cindex:
            cindex = make_cindex(cindex)
        ids[cindex] = cid
        self._cindex_list.append(cindex)
        self._input_list.append(is_input)
        self._deps_list.append([])
        return cid, True

    def renumber(self, start: int, keep: Sequence[bool]) -> None:
        """(List form) drop cindex ids >= ``start`` whose ``keep[id - start]`` is false,
        keeping order.  Dependencies must not point at a dropped cindex."""
        n = len(self._cindex_list)
        assert len(keep) == n - start
        if all(keep):
            return
        cindexes, ids = self._cindex_list, self._id_dict
        kept = [c for c in range(start, n) if keep[c - start]]
        for c in range(start, n):
            if not keep[c - start]:
                del ids[cindexes[c]]
        mapping = list(range(start)) + [-1] * (n - start)
        for new_id, old in enumerate(kept, start):
            mapping[old] = new_id
        new_deps = []
        for old in kept:
            nd = [mapping[d] for d in self._deps_list[old]]
            if -1 in nd:
                raise AssertionError("dependency on a pruned cindex")
            new_deps.append(nd)
        new_cindexes = [cindexes[old] for old in kept]
        new_input = [self._input_list[old] for old in kept]
        for new_id, old in enumerate(kept, start):
            if old != new_id:
                ids[cindexes[old]] = new_id
        del self._cindex_list[start:], self._input_list[start:], self._deps_list[start:]
        self._cindex_list.extend(new_cindexes)
        self._input_list.extend(new_input)
        self._deps_list.extend(new_deps)

    def commit_lists(self, start: int) -> None:
        """Renumber the list-form cindexes from ``start`` on canonically (supplied
        inputs first, as they are, then the rest sorted by node, t, x, n) and add
        them to the arrays."""
        if start != self._num:
            raise RuntimeError("commit_lists: the arrays do not end where the segment starts")
        cindexes, deps, inputs = self._cindex_list, self._deps_list, self._input_list
        n = len(cindexes)
        m = n - start
        rows = np.array([(c[0], c[1][0], c[1][1], c[1][2]) for c in cindexes[start:]],
                        dtype=np.int64).reshape(-1, 4)
        inp = np.array(inputs[start:], dtype=bool)
        first = np.flatnonzero(inp)
        rest = np.flatnonzero(~inp)
        r = rows[rest]
        rest = rest[np.lexsort((r[:, 1], r[:, 3], r[:, 2], r[:, 0]))]
        order = np.concatenate((first, rest))            # new position -> old offset
        new_of = np.empty(m, dtype=np.int64)
        new_of[order] = np.arange(start, n)
        mapping = np.concatenate((np.arange(start, dtype=np.int64), new_of))
        old_deps = [deps[start + o] for o in order.tolist()]
        lens = np.fromiter((len(d) for d in old_deps), dtype=np.int64, count=m)
        flat = np.fromiter((d for lst in old_deps for d in lst), dtype=np.int64,
                           count=int(lens.sum()))
        flat = mapping[flat]
        ptr = np.zeros(m + 1, dtype=np.int64)
        np.add.accumulate(lens, out=ptr[1:])
        # each list a sorted set of the new ids (the renumbering is one to one, so
        # sorting each list again is enough)
        owner = np.repeat(np.arange(m), lens)
        flat = flat[np.lexsort((flat, owner))]
        new_rows = rows[order]
        ol = order.tolist()
        new_c = [cindexes[start + o] for o in ol]
        del cindexes[start:], deps[start:], inputs[start:]
        self.append_arrays(new_rows, inp[order], ptr, flat)
        # the lists in the new order
        cindexes.extend(new_c)
        inputs.extend(inp[order].tolist())
        fl, pl = flat.tolist(), ptr.tolist()
        deps.extend(fl[pl[j]:pl[j + 1]] for j in range(m))
        self._id_dict.update(zip(new_c, range(start, n)))

    # -- printing -------------------------------------------------------------------------
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
        cindexes, dependencies, is_input = self.cindexes, self.dependencies, self.is_input
        pairs = sorted(((cindexes[c], sorted(cindexes[d] for d in dependencies[c]), c)
                        for c in range(len(cindexes))),
                       key=lambda p: (p[0].node, p[0].index.t, p[0].index.x, p[0].index.n))
        out, cur_node, count = [], None, 0
        for ci, deps, c in pairs:
            if ci.node != cur_node:
                if cur_node is not None:
                    out.append("\n")
                cur_node, count = ci.node, 0
            if count < max_per_node:
                s = "[ " + fmt(ci)
                if not is_input[c]:
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


def make_indexes(nxt: np.ndarray) -> list[Index]:
    """Index objects for (k, 3) n/t/x rows; equal rows share one object (fewer
    allocations, and cheaper copies later)."""
    if not len(nxt):
        return []
    if len(nxt) < 64:
        return array_to_indexes(nxt)
    n, t, x = nxt[:, 0], nxt[:, 1], nxt[:, 2]
    blank = t == K_NO_TIME
    if blank.any():
        # blank Indexes (t = kNoTime) are keyed with t one below every real t
        real_t = t[~blank]
        t = np.where(blank, int(real_t.min()) - 1 if len(real_t) else 0, t)
    n0, t0, x0 = int(n.min()), int(t.min()), int(x.min())
    s0, s1, s2 = int(n.max()) - n0 + 1, int(t.max()) - t0 + 1, int(x.max()) - x0 + 1
    if s0 * s1 * s2 > 4 * len(nxt) + 4096:
        return array_to_indexes(nxt)
    # one representative row per distinct Index through a dense table (the last
    # row written wins), no sorting
    key = ((n - n0) * s1 + (t - t0)) * s2 + (x - x0)
    table = np.full(s0 * s1 * s2, -1, dtype=np.int64)
    table[key] = np.arange(len(nxt))
    rep = table[key]
    reps = table[table >= 0]
    objs = np.empty(len(nxt), dtype=object)
    objs[reps] = np.fromiter(array_to_indexes(nxt[reps]),
                             dtype=object, count=len(reps))
    return objs[rep].tolist()


def make_cindexes(rows: np.ndarray) -> list[Cindex]:
    """Cindex objects for (k, 4) node/n/t/x rows (Index objects shared)."""
    if not len(rows):
        return []
    return [_tuple_new(Cindex, pair)
            for pair in zip(rows[:, 0].tolist(), make_indexes(rows[:, 1:]))]


def node_names(nnet) -> list[str]:
    names = nnet.node_names
    return names() if callable(names) else names


# Non-simple components whose IsComputable is "every Index GetInputIndexes
# lists is present" and which then use all of them: the base class's default,
# Kaldi's TdnnComponent (time offsets, all required), DropoutMaskComponent and
# ConstantComponent (no inputs, always computable).  For these the graph builders settle
# computability from the dependency states alone.
_ALL_INPUTS_COMPONENTS = ("TdnnComponent", "DropoutMaskComponent", "ConstantComponent")


def _needs_all_inputs(comp) -> bool:
    cls = type(comp)
    if cls.__name__ in _ALL_INPUTS_COMPONENTS:
        return True
    return cls.is_computable is Component.is_computable


class NodeTable:
    """Per-node facts the builders, the steps computer and the compiler need, read
    once per compilation from the Nnet (the graph builder makes it and the graph
    carries it as ``node_table``)."""

    def __init__(self, nnet) -> None:
        num = nnet.num_nodes() if callable(getattr(nnet, "num_nodes", None)) else len(nnet.nodes)
        # a weak reference: the table is cached for the network (node_table_for)
        self._nnet = weakref.ref(nnet)
        # per-network facts of later stages (the compiler's), kept with the table
        self.extra: dict = {}
        self.kind: list[int] = []
        self.props: list[int] = []        # component properties (0 for other nodes)
        self.component_index: list[int] = []
        self.is_component_input: list[bool] = []
        self.descriptor: list = []
        self.component: list = []
        self.simple: list[bool] = []
        self.dim_range_src: list[int] = []
        self.is_output: list[bool] = []
        # Descriptors compiled to generated functions; None where the object
        # tree has to be asked (a descriptor class fast_descriptors lacks).
        self.fast: list = []
        self.deps_mode: list[int] = []
        self.src: list[int] = []          # the one source node of components and dim-range nodes
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
            fast = compile_descriptor(node.descriptor) if kind == _DESCRIPTOR else None
            props = int(comp.properties()) if comp is not None else 0
            self.kind.append(kind)
            self.props.append(props)
            self.component_index.append(node.component_index if kind == _COMPONENT else -1)
            self.is_component_input.append(kind == _DESCRIPTOR and nnet.is_component_input_node(i))
            self.descriptor.append(node.descriptor if kind == _DESCRIPTOR else None)
            self.component.append(comp)
            simple = bool(props & _SIMPLE)
            self.simple.append(simple)
            self.dim_range_src.append(node.node_index if kind == _DIM_RANGE else -1)
            self.is_output.append(bool(nnet.is_output_node(i)))
            self.fast.append(fast)
            src = -1
            if kind == _INPUT:
                mode = DEPS_NONE
            elif kind == _DIM_RANGE:
                mode, src = DEPS_IDENTITY, node.node_index
            elif kind == _DESCRIPTOR:
                mode = DEPS_DESCRIPTOR if fast is not None else DEPS_GENERAL
            elif simple or (type(comp).get_input_indexes is Component.get_input_indexes
                            and _needs_all_inputs(comp)):
                mode, src = DEPS_IDENTITY, i - 1
            elif callable(getattr(comp, "input_offsets", None)) and _needs_all_inputs(comp):
                mode, src = DEPS_OFFSETS, i - 1
            else:
                mode, src = DEPS_GENERAL, i - 1
            self.deps_mode.append(mode)
            self.src.append(src)
        # Inputs as constant shifts: per dependency position (node, dn, dt, dx),
        # or None where some input is not (Round, Switch, ReplaceIndex, or asked
        # Index by Index); and the nodes a node reads (None: decided by t).
        self.shifts: list = []
        self.producers: list = []
        for i in range(num):
            mode = self.deps_mode[i]
            if mode == DEPS_IDENTITY:
                sh = [(self.src[i], 0, 0, 0)]
            elif mode == DEPS_OFFSETS:
                sh = [(self.src[i], a, b, c) for a, b, c in self.component[i].input_offsets()]
            elif mode == DEPS_DESCRIPTOR:
                sh = self.fast[i].linear_positions()
            else:
                sh = None
            self.shifts.append(sh)
            if mode == DEPS_DESCRIPTOR:
                prods = set(self.descriptor[i].get_node_dependencies())
            elif mode == DEPS_NONE:
                prods = set()
            else:
                prods = {self.src[i]}
            self.producers.append(sorted(prods))
        # the largest constant shifts (n, t, x): lookup tables keep this margin
        margin = [0, 0, 0]
        for sh in self.shifts:
            for _, dn, dt, dx in sh or ():
                margin = [max(margin[0], abs(dn)), max(margin[1], abs(dt)),
                          max(margin[2], abs(dx))]
        self.margin: tuple[int, int, int] = tuple(margin)
        # Nodes whose computable, usable cindexes keep their dependency lists
        # through pruning (all inputs required): inputs, dim-range nodes, simple
        # components and descriptors without IfDefined/Failover/Const.
        self.comp_all_required: list[bool] = [
            c is not None and not s and _needs_all_inputs(c)
            for c, s in zip(self.component, self.simple)]
        from engine.nnet.graph import compute_nnet_computation_epochs  # noqa: PLC0415
        # Kaldi's computation epochs (strongly connected components of the node
        # graph in topological order); a recurrence is an epoch of several nodes
        self.epochs: list[int] = compute_nnet_computation_epochs(nnet)
        self.recurrent = len(set(self.epochs)) < num
        self.prune_trivial: list[bool] = [
            k in (_INPUT, _DIM_RANGE) or (k == _COMPONENT and (s or a))
            or (k == _DESCRIPTOR and f is not None and f.all_required)
            for k, s, a, f in zip(self.kind, self.simple, self.comp_all_required, self.fast)]
        self._order: list[int] | None = None

    @property
    def nnet(self):
        return self._nnet()

    @property
    def order(self) -> list[int]:
        """The nodes, producers before consumers except along recurrences: Kaldi's
        computation epochs (strongly connected components in topological order);
        inside an epoch, producers first along the edges that keep t (a
        recurrence goes back or forward in time), by node index otherwise."""
        if self._order is None:
            self._order = self._compute_order()
        return self._order

    def _compute_order(self) -> list[int]:
        import heapq  # noqa: PLC0415

        epochs = self.epochs
        if not self.recurrent:
            return sorted(range(len(epochs)), key=epochs.__getitem__)
        members: dict[int, list[int]] = {}
        for i, e in enumerate(epochs):
            members.setdefault(e, []).append(i)
        order: list[int] = []
        for e in sorted(members):
            group = members[e]
            if len(group) == 1:
                order.extend(group)
                continue
            inside = set(group)
            users: dict[int, list[int]] = {i: [] for i in group}
            pending = {i: 0 for i in group}
            for i in group:
                for j in self._same_time_sources(i):
                    if j in inside and j != i:
                        users[j].append(i)
                        pending[i] += 1
            ready = [i for i in group if pending[i] == 0]
            heapq.heapify(ready)
            done = set()
            while ready:
                i = heapq.heappop(ready)
                order.append(i)
                done.add(i)
                for u in users[i]:
                    pending[u] -= 1
                    if pending[u] == 0:
                        heapq.heappush(ready, u)
            order.extend(i for i in group if i not in done)
        return order

    def _same_time_sources(self, i: int) -> set[int]:
        """Source nodes of node i reached with t unchanged (for ordering only)."""
        mode = self.deps_mode[i]
        if mode in (DEPS_IDENTITY, DEPS_OFFSETS) or (mode == DEPS_GENERAL
                                                    and self.kind[i] == _COMPONENT):
            return {self.src[i]}
        if mode == DEPS_DESCRIPTOR:
            return {fd_node for fd_node in (_same_time_node(fd)
                                            for fd in self.fast[i].forwarding)
                    if fd_node is not None}
        return set()


def _network_signature(nnet) -> tuple[tuple, tuple]:
    """What a NodeTable and the compiler's per-network facts are computed from: per
    node its object, type, descriptor object, component index, source node, dim
    offset and dim; per component its object, type, properties, dims and input
    offsets.  Objects enter by identity (the cache keeps them, _network_objects, so
    an identity cannot be taken over by a new object while the signature is kept):
    a network is edited by assigning nodes, descriptors or components, as the
    config reader, collapsing and renumbering do; descriptor trees are not edited
    in place.  Properties and dims are asked every time, as a component can change
    them in place (test mode, for one)."""
    return (tuple([(id(n), n.type, id(n.descriptor), n.component_index, n.node_index,
                    n.dim_offset, n.dim) for n in nnet.nodes]),
            tuple([(id(c), type(c), int(c.properties()), c.input_dim(), c.output_dim(),
                    _input_offsets(c)) for c in nnet.components]))


def _input_offsets(comp) -> tuple | None:
    offsets = getattr(comp, "input_offsets", None)
    return tuple(offsets()) if callable(offsets) else None


def _network_objects(nnet) -> tuple:
    """The objects whose identities enter _network_signature."""
    nodes = nnet.nodes
    return tuple(nodes), tuple(n.descriptor for n in nodes), tuple(nnet.components)


# NodeTables by network (weak keys: a table does not keep its network alive).
_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def node_table_for(nnet) -> NodeTable:
    """The NodeTable of ``nnet``, made once and reused while the network's
    signature (_network_signature) stays the same; an edited network gets a new
    table (and with it new per-network facts in ``NodeTable.extra``)."""
    try:
        hit = _TABLES.get(nnet)
    except TypeError:                      # not weakly referenceable: no cache
        return NodeTable(nnet)
    sig = _network_signature(nnet)
    if hit is not None and hit[0] == sig:
        return hit[2]
    table = NodeTable(nnet)
    _TABLES[nnet] = (sig, _network_objects(nnet), table)
    return table


def _same_time_node(fd):
    """The node a forwarding descriptor reads with t unchanged, or None."""
    from engine.nnet.descriptors import (OffsetForwardingDescriptor,  # noqa: PLC0415
                                         ReplaceIndexForwardingDescriptor,
                                         SimpleForwardingDescriptor)
    kind = type(fd)
    if kind is SimpleForwardingDescriptor:
        return fd.node_index
    if kind is OffsetForwardingDescriptor:
        return _same_time_node(fd.src) if fd.offset.t == 0 else None
    if kind is ReplaceIndexForwardingDescriptor and fd.variable != "t":
        return _same_time_node(fd.src)
    return None


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


__all__ = ["ComputationGraph", "CindexTable", "NodeTable", "node_table_for", "node_names", "make_cindex",
           "make_cindexes", "make_indexes", "print_indexes", "INPUT", "DESCRIPTOR",
           "COMPONENT", "DIM_RANGE"]
