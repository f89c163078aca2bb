"""Shortcut compilation: Kaldi's CachingOptimizingCompiler::CompileViaShortcut
(nnet-optimize.cc) with RequestIsDecomposable, FindNStride, ConvertNumNValues and
ComputationExpander / ExpandComputation (nnet-optimize-utils.cc).

A minibatch request is usually N copies of one sequence pattern that differ only
in ``n``.  Building the computation graph and the steps costs time in proportion
to N, but the optimized computation of N sequences is the computation of two
sequences with every matrix stretched along ``n``.  So, when a request is
*decomposable* (every input and output lists the same Indexes for each n in
0..N-1, N > 2, the copies a fixed row stride apart and never crossing a block of
``stride * N`` rows), we compile and optimize the same request with N = 2 and
expand the result:

- every matrix gets ``num_rows / 2 * N`` rows (the command list, the submatrix
  column ranges and the component/memo arguments do not change);
- a submatrix keeps its first row (which must hold n = 0) and its last row
  (which must hold n = 1) mapped onto the first row of n = 0 and the last row of
  n = N - 1 of the stretched matrix;
- row-index vectors (copy/add rows, the multi-row forms and row ranges) are
  rebuilt: each entry for an n = 0 row is repeated N times, destination and
  source each stepping by their matrix's n-stride;
- component precomputed indexes are computed afresh from the expanded
  input/output Indexes (the compiler keeps those lists for two-sequence
  computations precisely for this).

Where the mini computation lacks the regular structure (Kaldi raises an error and
tells the user to turn the shortcut off) we return None so that
``compile_request`` falls back to normal compilation.  All index arithmetic is
done on NumPy arrays; nothing loops over rows in Python.

``compile_request(nnet, request, optimize_options=None, use_shortcut=True)`` is
the one entry point callers (CLI, inference, service) use: shortcut when
possible, else Compiler + optimizer.
"""

from __future__ import annotations

import logging
from itertools import chain
from typing import Callable

import numpy as np

from engine.compiler.array_ops import rows_equal
from engine.compiler.computation import (CommandType as CT, DebugCindexes, MatrixDebugInfo,
                                         MatrixInfo, NnetComputation, PrecomputedIndexesInfo,
                                         SubMatrixInfo, copy_command)
from engine.compiler.gc_pause import gc_paused
from engine.compiler.graph_nodes import make_indexes
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.index import K_NO_TIME, Index, index_rows

log = logging.getLogger("engine.compiler.shortcut")

_tuple_new = tuple.__new__
_ROWS_CMDS = (CT.COPY_ROWS, CT.ADD_ROWS)
_MULTI_CMDS = (CT.COPY_ROWS_MULTI, CT.ADD_ROWS_MULTI, CT.COPY_TO_ROWS_MULTI,
               CT.ADD_TO_ROWS_MULTI)


def _rest_keys(rows: np.ndarray) -> np.ndarray:
    """One int64 per (k, 4) node, n, t, x row, equal for rows equal but for n."""
    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    node, t, x = rows[:, 0], rows[:, 2], rows[:, 3]
    t0, x0 = int(t.min()), int(x.min())
    t_span, x_span = int(t.max()) - t0 + 1, int(x.max()) - x0 + 1
    if (int(node.max()) + 1) * t_span * x_span < 2 ** 62:
        return (node * t_span + (t - t0)) * x_span + (x - x0)
    return np.unique(rows[:, [0, 2, 3]], axis=0, return_inverse=True)[1].reshape(-1)


def _first_not_none(entries: np.ndarray) -> np.ndarray:
    return entries[:, 0] >= 0


def _non_empty(ranges: np.ndarray) -> np.ndarray:
    return ranges[:, 0] != ranges[:, 1]


class ShortcutNotApplicable(Exception):
    """Raised inside the expander when the mini computation lacks the structure
    expansion relies on; compile_via_shortcut turns it into None."""


# -------------------------------------------------------------------------------------------
# regular structure along n (FindNStride, ConvertNumNValues)


def find_n_stride(rows: np.ndarray) -> int:
    """The n-stride of an (size, k) int array whose column 0 is ``n`` (the other
    columns being the rest of the Index or Cindex), or 0 when the rows lack the
    regular structure: n in 0..N-1 (N = last n + 1 > 1); the row at i with
    n < N-1 has its n+1 twin at i + stride, the row with n > 0 its n-1 twin at
    i - stride; and the N twins never straddle a block of stride * N rows.
    (Kaldi's FindNStride with full_check; we also insist that every n lies in
    0..N-1, which Kaldi's checks imply for the inputs it meets.)"""
    size = rows.shape[0]
    if size < 2:
        return 0
    n = rows[:, 0]
    big_n = int(n[-1]) + 1
    if big_n <= 1 or n[0] != 0 or size % big_n != 0 or n.min() < 0 or n.max() >= big_n:
        return 0
    rest = rows[:, 1:]
    per_n = size // big_n
    # candidate strides: positions of the n = 1 twin of row 0, tried in Kaldi's order
    # (1, then size / N, then the smallest divisor of size below size / N)
    twin = np.flatnonzero((n == 1) & rows_equal(rest, rest[0]))
    twin_set = set(twin.tolist())
    if 1 in twin_set:
        stride = 1
    elif per_n in twin_set:
        stride = per_n
    else:
        ok = [int(s) for s in twin if 2 <= s < per_n and size % s == 0]
        if not ok:
            return 0
        stride = ok[0]
    # Every row's twins one stride either side (as its n asks), never straddling a
    # block of stride * N rows, is the same as: the rows are whole blocks, each N
    # groups of ``stride`` rows where group j holds n = j and the rest of group 0.
    block = stride * big_n
    if stride >= size or size % block:
        return 0
    r = rows.reshape(size // block, big_n, stride, rows.shape[1])
    if not (r[:, :, :, 0] == np.arange(big_n)[:, None]).all():
        return 0
    if not (r[:, 1:, :, 1:] == r[:, :1, :, 1:]).all():
        return 0
    return stride


def convert_num_n_values(rows: np.ndarray, stride: int, old_n: int, new_n: int) -> np.ndarray:
    """Kaldi's ConvertNumNValues: the same rows with n running over 0..new_n-1
    instead of 0..old_n-1, keeping the n-stride (column 0 is n)."""
    size = rows.shape[0]
    first = np.flatnonzero(rows[:, 0] == 0)
    old_block, new_block = stride * old_n, stride * new_n
    base = (first // old_block) * new_block + first % old_block
    pos = base[:, None] + stride * np.arange(new_n)[None, :]
    out = np.empty(((size // old_n) * new_n, rows.shape[1]), dtype=rows.dtype)
    out[pos.ravel()] = np.repeat(rows[first], new_n, axis=0)
    out[pos.ravel(), 0] = np.tile(np.arange(new_n), first.size)
    return out


def _index_rows(indexes) -> np.ndarray:
    return index_rows(indexes)


def request_is_decomposable(request: ComputationRequest,
                            io_rows: list[np.ndarray] | None = None
                            ) -> tuple[ComputationRequest, int] | None:
    """Kaldi's RequestIsDecomposable: (two-sequence mini request, N) when every
    input and output has the regular n structure with the same N > 2, else None.
    ``io_rows``: the Indexes of the inputs, then the outputs, as (N, 3) int64
    arrays, when the caller has them (ComputationRequest.validate returns them)."""
    if not request.inputs or not request.outputs:
        return None
    big_n = None
    minis: list[list[IoSpecification]] = [[], []]
    at = 0
    for k, specs in enumerate((request.inputs, request.outputs)):
        for spec in specs:
            if not spec.indexes:
                return None
            if io_rows is None:
                rows = _index_rows(spec.indexes)
            else:
                rows, at = io_rows[at], at + 1
            this_n = int(rows[-1, 0]) + 1
            # with N <= 2 there would be nothing to gain
            if this_n <= 2 or (big_n is not None and this_n != big_n):
                return None
            big_n = this_n
            stride = find_n_stride(rows)
            if stride == 0:
                return None
            mini_rows = convert_num_n_values(rows, stride, this_n, 2)
            minis[k].append(IoSpecification(spec.name, mini_rows.astype(np.int32),
                                            spec.has_deriv))
    mini = ComputationRequest(minis[0], minis[1], request.need_model_derivative,
                              request.store_component_stats, request.misc_info)
    return mini, int(big_n)


# -------------------------------------------------------------------------------------------
# ComputationExpander


class _Expander:
    def __init__(self, nnet, misc_info, computation: NnetComputation, num_n: int,
                 need_debug_info: bool, in_place: bool = False):
        self.nnet = nnet
        self.misc_info = misc_info
        self.c = computation
        self.in_place = in_place
        self.num_n = num_n
        self.need_debug_info = need_debug_info
        self.out = NnetComputation()
        self._expanded_indexes: dict[bytes, list[Index]] = {}
        self._expanded_rows: dict[bytes, np.ndarray] = {}
        # expansions of rows with t relative to their first row's t (_expand_shifted)
        self._expanded_rel: dict[bytes, np.ndarray] = {}

    # -- strides -------------------------------------------------------------------------
    def init_strides(self) -> None:
        """The n-stride of every matrix from its debug cindexes (FindNStride with
        N = 2), checked for all matrices at once on one concatenated array."""
        c = self.c
        nm = len(c.matrices)
        if len(c.matrix_debug_info) != nm:
            raise ShortcutNotApplicable("the mini computation has no debug info")
        sizes = np.array([0] + [mi.num_rows for mi in c.matrices[1:]], dtype=np.int64)
        if any(len(c.matrix_debug_info[m].cindexes) != sizes[m] for m in range(1, nm)):
            raise ShortcutNotApplicable("the debug info does not cover every matrix row")
        self.sizes = sizes
        self.base = np.cumsum(sizes) - sizes
        # all rows of all matrices as node, n, t, x
        self.rows = rows = c.debug_cindex_rows()
        self.row_n = n = rows[:, 1]
        mat = np.repeat(np.arange(nm), sizes)
        local = np.arange(rows.shape[0]) - self.base[mat]
        self.row_matrix, self.row_local = mat, local
        self.stride = np.zeros(nm, dtype=np.int64)
        if nm == 1:
            return
        rest = _rest_keys(rows)
        ms = np.arange(1, nm)
        first, last = self.base[ms], self.base[ms] + sizes[ms] - 1
        bad = (sizes[ms] % 2 != 0) | (n[first] != 0) | (n[last] != 1)
        if ((n != 0) & (n != 1)).any() or bad.any():
            raise ShortcutNotApplicable("a matrix of the mini computation does not hold "
                                        "n = 0 and n = 1 rows in equal numbers")
        # candidate strides, in Kaldi's order: 1, size / 2, the smallest other divisor
        twin = (n == 1) & (rest == rest[self.base[mat]])
        half = sizes // 2
        other = np.full(nm, np.iinfo(np.int64).max)
        cand = twin & (local >= 2) & (local < half[mat])
        cand[cand] &= sizes[mat[cand]] % local[cand] == 0
        np.minimum.at(other, mat[cand], local[cand])
        stride = np.where(twin[first + 1], 1, np.where(
            twin[first + half[ms]], half[ms], np.where(other[ms] < np.iinfo(np.int64).max,
                                                       other[ms], 0)))
        self.stride[1:] = stride
        s = self.stride[mat]
        zero = n == 0
        # every n = 0 row has its n = 1 twin one stride later within its block of
        # 2 * stride rows, and every n = 1 row its n = 0 twin one stride earlier
        j = np.where(zero, local + s, local - s)
        ok = (stride > 0).all() and bool(((j >= 0) & (j < sizes[mat])).all())
        if ok:
            g = self.base[mat] + j
            ok = bool(((rest[g] == rest) & (n[g] == 1 - n)).all())
            blk = 2 * s[zero]
            ok = ok and bool((local[zero] // blk == (local[zero] + s[zero]) // blk).all())
        if not ok:
            raise ShortcutNotApplicable("a matrix of the mini computation lacks the regular "
                                        "n structure")

    def new_matrix_row(self, m, r):
        """GetNewMatrixLocationInfo, vectorised over (m, r): where old row r of
        matrix m lands, an n = 1 row being sent to its n = N-1 twin."""
        s = self.stride[m]
        off = r % (2 * s)
        old_n = off // s
        new_n = np.where(old_n == 0, 0, self.num_n - 1)
        return (r // (2 * s)) * (self.num_n * s) + off % s + new_n * s

    # -- matrices, submatrices, debug info -------------------------------------------------
    def compute_matrices(self) -> None:
        out, n = self.out, self.num_n
        out.matrices = [self.c.matrices[0]] + [
            _tuple_new(MatrixInfo, ((rows // 2) * n, cols, stride))
            for rows, cols, stride in self.c.matrices[1:]]

    def compute_debug_info(self) -> None:
        """Every matrix's cindexes with n running over 0..N-1: all matrices' node, n,
        t, x rows in one array (each n = 0 row copied to its N places, with n set),
        an entry per matrix holding its slice (DebugCindexes)."""
        big_n = self.num_n
        new_sizes = (self.sizes // 2) * big_n
        new_ends = np.cumsum(new_sizes)
        new_base = new_ends - new_sizes
        i0 = np.flatnonzero(self.row_n == 0)
        m, loc = self.row_matrix[i0], self.row_local[i0]
        s = self.stride[m]
        # the N places of each n = 0 row (row loc of a block of 2 * s rows goes to row
        # loc of a block of N * s, then s, 2 * s, ... further)
        pos = ((new_base[m] + (loc // (2 * s)) * (big_n * s) + loc % s)[:, None]
               + s[:, None] * np.arange(big_n))
        src = np.empty(int(new_ends[-1]), dtype=np.int64)
        src[pos] = i0[:, None]
        rows = np.take(self.rows, src, axis=0)
        rows[:, 1][pos] = np.arange(big_n)
        rows.flags.writeable = False
        is_deriv = [d.is_deriv for d in self.c.matrix_debug_info[1:]]
        self.out.matrix_debug_info = [MatrixDebugInfo(), *map(
            MatrixDebugInfo, is_deriv,
            map(DebugCindexes, map(rows.__getitem__, map(slice, new_base[1:].tolist(),
                                                            new_ends[1:].tolist()))))]

    def compute_submatrices(self) -> None:
        c = self.c
        subs = c.submatrices[1:]
        if not subs:
            self.out.submatrices = list(c.submatrices)
            return
        arr = np.fromiter(chain.from_iterable(subs), np.int64, 5 * len(subs)).reshape(-1, 5)
        m, first = arr[:, 0], arr[:, 1]
        last = first + arr[:, 2] - 1
        bad = (self.row_n[self.base[m] + first] != 0) | (self.row_n[self.base[m] + last] != 1)
        if bad.any():
            s = int(np.flatnonzero(bad)[0]) + 1
            raise ShortcutNotApplicable(f"submatrix s{s} does not run from an n=0 row to an "
                                        f"n=1 row")
        new_first = self.new_matrix_row(m, first)
        new_last = self.new_matrix_row(m, last)
        self.sub_matrix = np.concatenate([[0], m])
        self.sub_old_off = np.concatenate([[0], first])
        self.sub_old_rows = np.concatenate([[0], arr[:, 2]])
        self.sub_new_off = np.concatenate([[0], new_first])
        self.sub_new_rows = np.concatenate([[0], new_last + 1 - new_first])
        self.out.submatrices = [c.submatrices[0]] + [
            _tuple_new(SubMatrixInfo, row) for row in
            zip(m.tolist(), new_first.tolist(), (new_last + 1 - new_first).tolist(),
                arr[:, 3].tolist(), arr[:, 4].tolist())]

    # -- row maps ------------------------------------------------------------------------------
    def sub_rows_n(self, s, i):
        """n of row i of submatrix s in the mini computation (vectorised)."""
        return self.row_n[self.base[self.sub_matrix[s]] + self.sub_old_off[s] + i]

    def new_sub_row(self, s, i):
        """GetNewSubmatLocationInfo for rows with n = 0: the new row within s."""
        m = self.sub_matrix[s]
        return self.new_matrix_row(m, self.sub_old_off[s] + i) - self.sub_new_off[s]

    def _check_src_n0(self, s, i, what: str) -> None:
        if i.size and (self.sub_rows_n(s, i) != 0).any():
            raise ShortcutNotApplicable(f"{what}: an n=0 row reads a row with n != 0")

    def _expand_vectors(self, dests: list[int], old: list[list], width: int, present):
        """The part common to all index vectors, for all vectors of one kind in one
        pass (``old[k]`` a vector of rows, or of pairs with ``width`` 2, for the rows
        of submatrix ``dests[k]``; ``present(entries)``: which entries are not
        "none").  Returns the entries that are present and of n = 0 rows, as a
        (kept, width) array, with the vector each belongs to and its N destination
        positions (n = 0..N-1) in the new vectors end to end, as a (kept, N) array;
        and the new vectors' (start, end) there."""
        s1 = np.array(dests, dtype=np.int64)
        lens = np.fromiter(map(len, old), np.int64, len(old))
        bad = lens != self.sub_old_rows[s1]
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise ShortcutNotApplicable(f"index vector length {int(lens[k])} does not match "
                                        f"submatrix s{dests[k]}")
        total = int(lens.sum())
        flat = chain.from_iterable(old)
        if width > 1:
            flat = chain.from_iterable(flat)
        arr = np.fromiter(flat, np.int64, total * width).reshape(total, width)
        job = np.repeat(np.arange(len(old)), lens)
        i1 = np.arange(total) - (np.cumsum(lens) - lens)[job]
        sj = s1[job]
        keep = (self.sub_rows_n(sj, i1) == 0) & present(arr)
        new_lens = self.sub_new_rows[s1]
        new_ends = np.cumsum(new_lens)
        new_starts = new_ends - new_lens
        job, sj, i1 = job[keep], sj[keep], i1[keep]
        dst = ((new_starts[job] + self.new_sub_row(sj, i1))[:, None]
               + self.stride[self.sub_matrix[sj]][:, None] * np.arange(self.num_n))
        return arr[keep], job, dst, list(zip(new_starts.tolist(), new_ends.tolist()))

    def _sources(self, s2: np.ndarray, i2: np.ndarray) -> np.ndarray:
        """(kept, N) new rows read for n = 0..N-1 from the n = 0 rows ``i2`` of
        submatrices ``s2``."""
        return (self.new_sub_row(s2, i2)[:, None]
                + self.stride[self.sub_matrix[s2]][:, None] * np.arange(self.num_n))

    def expand_rows(self, jobs: list[tuple[int, int, int]]) -> list[list[int]]:
        """The expanded row vectors (copy/add rows) for (old vector, destination,
        source submatrix) ``jobs``."""
        old = [self.c.indexes[j[0]] for j in jobs]
        arr, job, dst, bounds = self._expand_vectors([j[1] for j in jobs], old, 1,
                                                     _first_not_none)
        s2 = np.array([j[2] for j in jobs], dtype=np.int64)[job]
        i2 = arr[:, 0]
        self._check_src_n0(s2, i2, "copy/add rows")
        new = np.full(bounds[-1][1], -1, dtype=np.int64)
        new[dst.ravel()] = self._sources(s2, i2).ravel()
        new = new.tolist()
        return [new[a:b] for a, b in bounds]

    def expand_multi(self, jobs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """The expanded (submatrix, row) vectors of the multi-row commands for (old
        vector, destination submatrix) ``jobs``."""
        old = [self.c.indexes_multi[j[0]] for j in jobs]
        arr, _, dst, bounds = self._expand_vectors([j[1] for j in jobs], old, 2,
                                                   _first_not_none)
        s2, i2 = arr[:, 0], arr[:, 1]
        self._check_src_n0(s2, i2, "multi-row command")
        total = bounds[-1][1]
        new_s = np.full(total, -1, dtype=np.int64)
        new_r = np.full(total, -1, dtype=np.int64)
        dst = dst.ravel()
        new_s[dst] = np.repeat(s2, self.num_n)
        new_r[dst] = self._sources(s2, i2).ravel()
        pairs = list(zip(new_s.tolist(), new_r.tolist()))
        return [pairs[a:b] for a, b in bounds]

    def expand_ranges(self, jobs: list[tuple[int, int, int]]) -> list[list[tuple[int, int]]]:
        """The expanded row ranges (add row ranges) for (old vector, destination,
        source submatrix) ``jobs``; (-1, -1) and empty ranges stay (-1, -1)."""
        old = [self.c.indexes_ranges[j[0]] for j in jobs]
        arr, job, dst, bounds = self._expand_vectors([j[1] for j in jobs], old, 2,
                                                     _non_empty)
        s2 = np.array([j[2] for j in jobs], dtype=np.int64)[job]
        begin, last = arr[:, 0], arr[:, 1] - 1
        self._check_src_n0(s2, begin, "row ranges")
        self._check_src_n0(s2, last, "row ranges")
        new = np.full((bounds[-1][1], 2), -1, dtype=np.int64)
        dst = dst.ravel()
        new[dst, 0] = self._sources(s2, begin).ravel()
        new[dst, 1] = self._sources(s2, last).ravel() + 1
        pairs = list(zip(new[:, 0].tolist(), new[:, 1].tolist()))
        return [pairs[a:b] for a, b in bounds]

    # -- commands, precomputed indexes -----------------------------------------------------
    def compute_commands(self) -> None:
        """The commands with their index vectors expanded: one expanded vector per
        (old vector, destination, source), in the order first used (commands that
        shared a vector in the mini computation share it here too)."""
        c, out = self.c, self.out
        out.commands = cmds = (c.commands if self.in_place
                               else list(map(copy_command, c.commands)))
        rows: dict[tuple, int] = {}
        multi: dict[tuple, int] = {}
        ranges: dict[tuple, int] = {}
        for cmd in cmds:
            ct = cmd.command_type
            if ct in _ROWS_CMDS:
                cmd.arg3 = rows.setdefault((cmd.arg3, cmd.arg1, cmd.arg2), len(rows))
            elif ct in _MULTI_CMDS:
                cmd.arg2 = multi.setdefault((cmd.arg2, cmd.arg1), len(multi))
            elif ct == CT.ADD_ROW_RANGES:
                cmd.arg3 = ranges.setdefault((cmd.arg3, cmd.arg1, cmd.arg2), len(ranges))
        out.indexes = self.expand_rows(list(rows)) if rows else []
        out.indexes_multi = self.expand_multi(list(multi)) if multi else []
        out.indexes_ranges = self.expand_ranges(list(ranges)) if ranges else []

    def expand_index_rows(self, indexes) -> tuple[bytes, np.ndarray]:
        """(key, expanded (k, 3) n, t, x rows) of a two-sequence Index list (or of its
        (k, 3) int64 rows)."""
        rows = indexes if isinstance(indexes, np.ndarray) else _index_rows(indexes)
        # layers with the same time pattern share one expansion (components only
        # read what they are given)
        key = rows.tobytes()
        hit = self._expanded_rows.get(key)
        if hit is None:
            hit = self._expanded_rows[key] = self._expand_shifted(rows)
        return key, hit

    def _expand_shifted(self, rows: np.ndarray) -> np.ndarray:
        """The rows with n running over 0..N-1; rows that differ only by one shift of
        every t (the per-frame steps of a recurrence) share the work: the structure
        along n does not depend on t."""
        if len(rows) and int(rows[:, 1].min()) != K_NO_TIME:
            t0 = int(rows[0, 1])
            rel = rows.copy()
            rel[:, 1] -= t0
            rel_key = rel.tobytes()
            base = self._expanded_rel.get(rel_key)
            if base is None:
                base = self._expanded_rel[rel_key] = self._expand_plain(rel)
            out = base.copy()
            out[:, 1] += t0
            return out
        return self._expand_plain(rows)

    def _expand_plain(self, rows: np.ndarray) -> np.ndarray:
        s = find_n_stride(rows)
        if s == 0 or rows[-1, 0] != 1:
            raise ShortcutNotApplicable("precomputed indexes lack the regular n structure")
        return convert_num_n_values(rows, s, 2, self.num_n)

    def expand_indexes(self, indexes) -> list[Index]:
        key, rows = self.expand_index_rows(indexes)
        if key not in self._expanded_indexes:
            self._expanded_indexes[key] = make_indexes(rows)
        return self._expanded_indexes[key]

    def compute_precomputed_indexes(self) -> None:
        c = self.c
        num = len(c.component_precomputed_indexes)
        component = [-1] * num
        need_backprop = [False] * num
        for cmd in c.commands:
            if cmd.command_type == CT.PROPAGATE and cmd.arg2 > 0:
                component[cmd.arg2] = cmd.arg1
            elif cmd.command_type in (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE) and cmd.arg2 > 0:
                need_backprop[cmd.arg2] = True
        out = [PrecomputedIndexesInfo()] if num else []
        for p in range(1, num):
            info = c.component_precomputed_indexes[p]
            if not info.input_indexes or not info.output_indexes or component[p] < 0:
                raise ShortcutNotApplicable(f"precomputed indexes {p} cannot be rebuilt")
            comp = self.nnet.components[component[p]]
            by_arrays = getattr(comp, "precompute_index_arrays", None)
            if by_arrays is not None:
                in_rows, out_rows = info.index_rows()
                data = by_arrays(self.misc_info, self.expand_index_rows(in_rows)[1],
                                 self.expand_index_rows(out_rows)[1], need_backprop[p])
            else:
                data = comp.precompute_indexes(self.misc_info,
                                               self.expand_indexes(info.input_indexes),
                                               self.expand_indexes(info.output_indexes),
                                               need_backprop[p])
            if data is None:
                raise ShortcutNotApplicable(f"component {self.nnet.component_names[component[p]]}"
                                            f" gave no precomputed indexes when expanded")
            out.append(PrecomputedIndexesInfo(data))
        self.out.component_precomputed_indexes = out

    def expand(self) -> NnetComputation:
        self.init_strides()
        self.compute_matrices()
        if self.need_debug_info:
            self.compute_debug_info()
        self.compute_submatrices()
        self.compute_precomputed_indexes()
        self.compute_commands()
        self.out.need_model_derivative = self.c.need_model_derivative
        self.out.segments = list(self.c.segments)
        return self.out


def expand_computation(nnet, misc_info, computation: NnetComputation, num_n_values: int,
                       need_debug_info: bool = True, in_place: bool = False) -> NnetComputation:
    """Kaldi's ExpandComputation: the computation for N = ``num_n_values`` sequences
    from one compiled (and usually optimized) for n in {0, 1}.  Raises
    ShortcutNotApplicable when ``computation`` lacks the structure required.
    ``in_place``: ``computation`` is not used afterwards, so its commands are
    taken over (and changed) rather than copied."""
    if num_n_values <= 2:
        raise ValueError(f"expand_computation: num_n_values must be > 2, got {num_n_values}")
    return _Expander(nnet, misc_info, computation, num_n_values, need_debug_info,
                     in_place).expand()


# -------------------------------------------------------------------------------------------
# entry points


def _default_options(optimize_options):
    if optimize_options is not None:
        return optimize_options
    from engine.optimizer.options import DEFAULT_OPTIONS  # noqa: PLC0415
    return DEFAULT_OPTIONS


def _compile_normal(nnet, request, optimize_options, optimize: bool,
                    io_rows: list[np.ndarray] | None = None) -> NnetComputation:
    """Compile (and, unless ``optimize`` is False, optimize) ``request``; ``io_rows``:
    its Indexes as ComputationRequest.validate returns them, when at hand."""
    from engine.compiler.compiler import compile_computation  # noqa: PLC0415
    computation = compile_computation(nnet, [request],
                                      io_rows=None if io_rows is None else [io_rows])
    if not optimize:
        return computation
    from engine.optimizer.pipeline import optimize as run_optimizer  # noqa: PLC0415
    # the unoptimized computation is ours alone: optimized in place, not copied
    return run_optimizer(computation, nnet, _default_options(optimize_options), request=request,
                         in_place=True)


def compile_via_shortcut(nnet, request: ComputationRequest, optimize_options=None, *,
                         optimize: bool = True, need_debug_info: bool = True,
                         mini_compiler: Callable[[ComputationRequest], NnetComputation]
                         | None = None, io_rows: list[np.ndarray] | None = None
                         ) -> NnetComputation | None:
    """The computation for ``request`` built from its two-sequence version, or None
    when the request is not decomposable (or the mini computation turns out not
    to have the regular structure; see the module docstring).

    ``mini_compiler(mini_request)`` may be given so that the mini request goes
    through a caller's cache, as Kaldi sends it through CompileInternal; by
    default it is compiled and (unless ``optimize`` is False) optimized here.
    ``io_rows``: as for request_is_decomposable.
    """
    options = _default_options(optimize_options) if optimize else optimize_options
    if options is not None and getattr(options, "optimize_looped_computation", False):
        return None   # a looped computation is not a function of N copies
    found = request_is_decomposable(request, io_rows)
    if found is None:
        return None
    mini, num_n = found
    if mini_compiler is not None:
        mini_computation = mini_compiler(mini)
    else:
        mini_computation = _compile_normal(nnet, mini, options, optimize)
    try:
        # a mini computation made here is ours alone (one from mini_compiler may be
        # kept in the caller's cache)
        return expand_computation(nnet, request.misc_info, mini_computation, num_n,
                                  need_debug_info, in_place=mini_compiler is None)
    except ShortcutNotApplicable as e:
        log.info("shortcut compilation not applicable, compiling normally: %s", e)
        return None


def compile_request(nnet, request: ComputationRequest, optimize_options=None,
                    use_shortcut: bool = True, *, optimize: bool = True) -> NnetComputation:
    """Validate ``request`` and compile it for ``nnet``: via the shortcut when it
    applies, else with the Compiler; optimized with ``optimize_options`` (default
    ``OptimizeOptions()``) unless ``optimize`` is False.  The cyclic garbage
    collector is paused throughout (engine/compiler/gc_pause.py): the shortcut's
    expansion and the request checks allocate as the compiler does, and
    collections during them cost 5-10% of a batch-8 compile."""
    with gc_paused():
        io_rows = request.validate(nnet)
        if use_shortcut:
            computation = compile_via_shortcut(nnet, request, optimize_options,
                                               optimize=optimize, io_rows=io_rows)
            if computation is not None:
                return computation
        return _compile_normal(nnet, request, optimize_options, optimize, io_rows)


__all__ = ["compile_request", "compile_via_shortcut", "expand_computation",
           "request_is_decomposable", "find_n_stride", "convert_num_n_values",
           "ShortcutNotApplicable"]
