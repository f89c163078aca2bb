"""Row-operation kernels of the executor: Kaldi's CuMatrix CopyRows/AddRows,
the pointer-list variants (CopyRowsMulti, AddRowsMulti, CopyToRowsMulti,
AddToRowsMulti) and AddRowRanges (cu-matrix.h), as vectorised gathers and
scatter-adds on the array backend ``xp`` (numpy or cupy).

Index tables are converted once per computation into "plans" holding backend
index arrays, so a run does no Python work per row:

- ``RowPlan`` for an ``indexes`` vector (destination row -> source row or -1);
- ``MultiPlan`` for an ``indexes_multi`` vector ((submatrix, row) pairs),
  grouped by submatrix so each group is one gather or one scatter;
- ``RangePlan`` for an ``indexes_ranges`` vector ((start, end) per destination
  row), summed with a cumulative sum over the gathered rows.

Semantics follow Kaldi: CopyRows writes zero where the index is -1 (and so does
CopyRowsMulti for a NULL pointer); the Add variants leave such rows alone; the
To-rows variants skip NULL destinations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _asindex(xp, a) -> "np.ndarray":
    return xp.asarray(np.asarray(a, dtype=np.int64))


def scatter_add(xp, target, rows, values) -> None:
    """target[rows] += values, correct when ``rows`` repeats."""
    if xp is np:
        np.add.at(target, rows, values)
    else:  # cupy
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(target, rows, values)


@dataclass
class RowPlan:
    num_rows: int
    identity: bool          # indexes == arange(num_rows)
    all_valid: bool         # no -1
    dest_rows: object       # backend int array (valid destination rows)
    src_rows: object        # backend int array (their source rows)
    invalid_rows: object    # backend int array (rows with -1)
    max_src: int
    # k when the indexes are source rows 0..k-1 over and over (indexes[i] == i % k, k
    # below num_rows and dividing it), else 0: a per-sequence row such as an i-vector
    # repeated for every t of a t-major batch (k sequences), or one row for every row
    # (k = 1).  Such a row operation is a broadcast over the destination's rows seen as
    # (num_rows // k, k, cols): one pass, no gathered temporary (TDNN-F 150x8's i-vector
    # AddRows, 1328 x 384: 263 -> 60 us in the network), the same sums.
    period: int = 0


def _period(idx: np.ndarray) -> int:
    """k when ``idx`` is 0..k-1 repeated (see RowPlan.period), else 0."""
    n = idx.size
    if n < 2 or idx[0] != 0:
        return 0
    k = int(idx.max()) + 1
    if k >= n or n % k:
        return 0
    return k if np.array_equal(idx.reshape(n // k, k), np.broadcast_to(
        np.arange(k, dtype=np.int64), (n // k, k))) else 0


def make_row_plan(xp, indexes) -> RowPlan:
    idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
    valid = idx >= 0
    n = idx.size
    identity = bool(n > 0 and np.array_equal(idx, np.arange(n)))
    return RowPlan(num_rows=n, identity=identity, all_valid=bool(valid.all()),
                   dest_rows=_asindex(xp, np.nonzero(valid)[0]), src_rows=_asindex(xp, idx[valid]),
                   invalid_rows=_asindex(xp, np.nonzero(~valid)[0]),
                   max_src=int(idx.max()) if n else -1, period=_period(idx))


def _tiles(dest, k: int):
    """``dest`` (2-D) as (rows // k, k, cols): a view (splitting the row axis never
    needs a copy, whatever the row stride)."""
    return dest.reshape(dest.shape[0] // k, k, dest.shape[1])


def _check_rows(plan_rows: int, dest, what: str) -> None:
    if dest.shape[0] != plan_rows:
        raise ValueError(f"{what}: index vector has {plan_rows} entries but the destination "
                         f"has {dest.shape[0]} rows")


def _check_src(max_src: int, src, what: str) -> None:
    if max_src >= src.shape[0]:
        raise ValueError(f"{what}: index {max_src} out of range for a source of "
                         f"{src.shape[0]} rows")


def copy_rows(xp, dest, src, plan: RowPlan, alpha: float = 1.0) -> None:
    """dest[i] = alpha * src[indexes[i]] (zero where indexes[i] == -1)."""
    _check_rows(plan.num_rows, dest, "CopyRows")
    _check_src(plan.max_src, src, "CopyRows")
    if alpha == 0.0:
        return  # Kaldi fakes alpha by scaling and skips alpha == 0 entirely
    k = plan.period
    if k:
        # (a source of fewer rows than k is refused above: max_src is k - 1)
        _tiles(dest, k)[...] = src[:k] if alpha == 1.0 else alpha * src[:k]
        return
    if plan.all_valid:
        if (alpha == 1.0 and xp is np and dest.flags.c_contiguous
                and not np.may_share_memory(dest, src)):
            # one gathering pass straight into dest, no temporary (the indexes are
            # checked above, so 'clip' clips nothing; NumPy buffers 'raise'): a
            # 1200x800 reordering 129 -> 70 us, and no fresh 3.8 MB temporary
            np.take(src, plan.src_rows, axis=0, out=dest, mode="clip")
            return
        dest[...] = src[plan.src_rows] if alpha == 1.0 else alpha * src[plan.src_rows]
        return
    dest[plan.dest_rows] = src[plan.src_rows] if alpha == 1.0 else alpha * src[plan.src_rows]
    dest[plan.invalid_rows] = 0


def add_rows(xp, dest, src, plan: RowPlan, alpha: float = 1.0) -> None:
    """dest[i] += alpha * src[indexes[i]] (nothing where indexes[i] == -1)."""
    _check_rows(plan.num_rows, dest, "AddRows")
    _check_src(plan.max_src, src, "AddRows")
    if plan.identity and src.shape[0] == dest.shape[0]:
        dest += src if alpha == 1.0 else alpha * src
        return
    k = plan.period
    if k:
        tiles = _tiles(dest, k)
        tiles += src[:k] if alpha == 1.0 else alpha * src[:k]
        return
    vals = src[plan.src_rows]
    if alpha != 1.0:
        vals *= alpha
    if plan.all_valid:
        dest += vals
    else:
        dest[plan.dest_rows] += vals  # destination rows are distinct


@dataclass
class MultiGroup:
    submatrix: int
    positions: object       # rows of the "this" matrix (backend int array)
    rows: object            # rows of the submatrix (backend int array)
    unique_rows: bool       # no repeats in ``rows``
    max_row: int


@dataclass
class MultiPlan:
    num_rows: int
    groups: list
    null_positions: object  # rows with (-1, -1)
    has_null: bool


def make_multi_plan(xp, pairs) -> MultiPlan:
    arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    groups = []
    subs = arr[:, 0]
    for s in np.unique(subs[subs >= 0]):
        pos = np.nonzero(subs == s)[0]
        rows = arr[pos, 1]
        groups.append(MultiGroup(int(s), _asindex(xp, pos), _asindex(xp, rows),
                                 bool(np.unique(rows).size == rows.size),
                                 int(rows.max()) if rows.size else -1))
    null = np.nonzero(subs < 0)[0]
    return MultiPlan(arr.shape[0], groups, _asindex(xp, null), bool(null.size))


def rows_multi(xp, dest, plan: MultiPlan, get_sub, alpha: float, add: bool) -> None:
    """AddRowsMulti / CopyRowsMulti: dest[i] (+)= alpha * pointer_i."""
    what = "AddRowsMulti" if add else "CopyRowsMulti"
    _check_rows(plan.num_rows, dest, what)
    if not add and alpha == 0.0:
        return
    for g in plan.groups:
        src = get_sub(g.submatrix)
        if src.shape[1] != dest.shape[1]:
            raise ValueError(f"{what}: submatrix {g.submatrix} has {src.shape[1]} columns, "
                             f"destination {dest.shape[1]}")
        _check_src(g.max_row, src, what)
        vals = src[g.rows]
        if alpha != 1.0:
            vals *= alpha
        if add:
            dest[g.positions] += vals
        else:
            dest[g.positions] = vals
    if not add and plan.has_null:
        dest[plan.null_positions] = 0


def to_rows_multi(xp, src, plan: MultiPlan, get_sub, alpha: float, add: bool) -> None:
    """AddToRowsMulti / CopyToRowsMulti: pointer_i (+)= alpha * src[i]."""
    what = "AddToRowsMulti" if add else "CopyToRowsMulti"
    _check_rows(plan.num_rows, src, what)
    for g in plan.groups:
        dest = get_sub(g.submatrix)
        if dest.shape[1] != src.shape[1]:
            raise ValueError(f"{what}: submatrix {g.submatrix} has {dest.shape[1]} columns, "
                             f"source {src.shape[1]}")
        _check_src(g.max_row, dest, what)
        vals = src[g.positions]
        if alpha != 1.0:
            vals = alpha * vals
        if not add:
            dest[g.rows] = vals
        elif g.unique_rows:
            dest[g.rows] += vals
        else:
            scatter_add(xp, dest, g.rows, vals)


@dataclass
class RangePlan:
    num_rows: int
    as_rows: RowPlan | None   # every range has length <= 1: a plain AddRows
    dest_rows: object         # destination rows with a nonempty range
    gather: object            # source rows, ranges concatenated
    seg_end: object           # end offsets of each range within ``gather``
    seg_start: object
    max_src: int


def make_range_plan(xp, pairs) -> RangePlan:
    arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    n = arr.shape[0]
    start, end = arr[:, 0], arr[:, 1]
    lens = np.where(start >= 0, end - start, 0)
    max_src = int(end.max()) - 1 if n else -1
    if n == 0 or lens.max() <= 1:
        idx = np.where(lens == 1, start, -1)
        return RangePlan(n, make_row_plan(xp, idx), None, None, None, None, max_src)
    nz = np.nonzero(lens > 0)[0]
    l_nz = lens[nz]
    ends = np.cumsum(l_nz)
    starts = ends - l_nz
    # source rows: for each nonempty range, start..end-1, concatenated
    offs = np.arange(int(ends[-1])) - np.repeat(starts, l_nz)
    gather = np.repeat(start[nz], l_nz) + offs
    return RangePlan(n, None, _asindex(xp, nz), _asindex(xp, gather), _asindex(xp, ends),
                     _asindex(xp, starts), max_src)


def add_row_ranges(xp, dest, src, plan: RangePlan, alpha: float = 1.0) -> None:
    """dest[i] += alpha * sum(src[start_i:end_i])."""
    _check_rows(plan.num_rows, dest, "AddRowRanges")
    _check_src(plan.max_src, src, "AddRowRanges")
    if alpha == 0.0:
        return
    if plan.as_rows is not None:
        add_rows(xp, dest, src, plan.as_rows, alpha)
        return
    g = src[plan.gather].astype(xp.float64)
    cs = xp.concatenate([xp.zeros((1, g.shape[1]), dtype=xp.float64), xp.cumsum(g, axis=0)])
    sums = cs[plan.seg_end] - cs[plan.seg_start]
    if alpha != 1.0:
        sums *= alpha
    dest[plan.dest_rows] += sums.astype(dest.dtype)


# --------------------------------------------------------------------------------------
# Pointer-list plans in matrix coordinates (used by the compiled program).
#
# A (submatrix, row) pair is a row of an underlying matrix and a column range; pairs
# whose submatrices share matrix and column range become one gather or scatter.  A
# BLSTM's per-frame pointer lists name ~one submatrix per frame, each of the same
# few matrices, so this turns tens of tiny gathers into one; a group of one row is
# done with plain indexing, which costs far less than a one-element fancy index.


@dataclass
class MatrixGroup:
    matrix: int
    cols: object            # None (all columns) or a column slice
    num_cols: int
    positions: object       # rows of the "this" matrix
    rows: object            # rows of the underlying matrix
    unique_rows: bool
    single: tuple | None    # (position, row) when the group has one row


@dataclass
class MatrixMultiPlan:
    num_rows: int
    groups: list
    null_positions: object
    has_null: bool
    error: str | None       # a static range error, raised when the command runs


def _matrix_group(xp, m, cols, ncols, pos, rows) -> MatrixGroup:
    single = (int(pos[0]), int(rows[0])) if pos.size == 1 else None
    return MatrixGroup(m, cols, ncols, _asindex(xp, pos), _asindex(xp, rows),
                       bool(np.unique(rows).size == rows.size), single)


def make_matrix_multi_plan(xp, computation, pairs, views, scatter: bool = False
                           ) -> MatrixMultiPlan:
    """``views[s]`` is (matrix, None or (row slice, column slice)) for submatrix s.
    With ``scatter`` (the To-rows variants) groups are merged only when no
    destination row of a matrix is named twice, so that additions happen in the
    same order as with one group per submatrix."""
    arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    subs = arr[:, 0]
    per_sub = []            # (submatrix, matrix, col key, positions, absolute rows)
    error = None
    for s in np.unique(subs[subs >= 0]):
        s = int(s)
        sm = computation.submatrices[s]
        pos = np.nonzero(subs == s)[0]
        rows = arr[pos, 1]
        if rows.size and (rows.max() >= sm.num_rows or rows.min() < 0) and error is None:
            error = (f"index {int(rows.max())} out of range for a source of "
                     f"{sm.num_rows} rows (submatrix {s})")
        m = sm.matrix_index
        mi = computation.matrices[m]
        whole_cols = sm.col_offset == 0 and sm.num_cols == mi.num_cols
        key = None if whole_cols else (sm.col_offset, sm.num_cols)
        per_sub.append((s, m, key, pos, rows + sm.row_offset, sm.num_cols))
    by_key: dict = {}
    for item in per_sub:
        by_key.setdefault((item[1], item[2]), []).append(item)
    merge = True
    if scatter:
        keys_per_matrix: dict = {}
        for m, key in by_key:
            keys_per_matrix[m] = keys_per_matrix.get(m, 0) + 1
        for (m, key), items in by_key.items():
            rows = np.concatenate([it[4] for it in items])
            if keys_per_matrix[m] > 1 or np.unique(rows).size != rows.size:
                merge = False
    groups = []
    if merge:
        for (m, key), items in by_key.items():
            pos = np.concatenate([it[3] for it in items])
            rows = np.concatenate([it[4] for it in items])
            cols = None if key is None else slice(key[0], key[0] + key[1])
            groups.append(_matrix_group(xp, m, cols, items[0][5], pos, rows))
    else:
        for s, m, key, pos, rows, ncols in per_sub:
            cols = None if key is None else slice(key[0], key[0] + key[1])
            groups.append(_matrix_group(xp, m, cols, ncols, pos, rows))
    null = np.nonzero(subs < 0)[0]
    return MatrixMultiPlan(arr.shape[0], groups, _asindex(xp, null), bool(null.size), error)


def _group_array(mats, g, what: str):
    a = mats[g.matrix]
    if a is None:
        from engine.core.errors import ExecutionError  # noqa: PLC0415
        raise ExecutionError(f"{what}: matrix m{g.matrix} is used before it is allocated")
    return a if g.cols is None else a[:, g.cols]


def rows_multi_by_matrix(xp, dest, plan: MatrixMultiPlan, mats, alpha: float, add: bool) -> None:
    """AddRowsMulti / CopyRowsMulti with a MatrixMultiPlan (same results as rows_multi)."""
    what = "AddRowsMulti" if add else "CopyRowsMulti"
    _check_rows(plan.num_rows, dest, what)
    if plan.error is not None:
        raise ValueError(f"{what}: {plan.error}")
    if not add and alpha == 0.0:
        return
    ncols = dest.shape[1]
    for g in plan.groups:
        if g.num_cols != ncols:
            raise ValueError(f"{what}: a source has {g.num_cols} columns, destination {ncols}")
        src = _group_array(mats, g, what)
        if g.single is not None:
            p, r = g.single
            v = src[r] if alpha == 1.0 else src[r] * alpha
            if add:
                dest[p] += v
            else:
                dest[p] = v
            continue
        vals = src[g.rows]
        if alpha != 1.0:
            vals *= alpha
        if add:
            dest[g.positions] += vals
        else:
            dest[g.positions] = vals
    if not add and plan.has_null:
        dest[plan.null_positions] = 0


def arena_rows_gather(dest, plan: MatrixMultiPlan, arrays: dict, arena):
    """CopyRowsMulti / AddRowsMulti as one gather, for sources that all lie in the
    float32 NumPy buffer ``arena`` (an arena-bound program: arena.py) with contiguous
    rows: returns (windows, offsets, valid) such that ``windows[offsets]`` is the
    rows the command reads, in order -- ``windows`` is ``arena`` seen as overlapping
    rows of dest's width starting at every element, ``offsets`` the element where
    each source row starts (0 for a null entry) and ``valid`` the positions that are
    not null (None when there are none); or None when the plan does not allow it
    (a range error, a source of another width or layout).  One fancy index over
    the windows replaces a gather and a scatter per source matrix: a 1200-row
    CopyRowsMulti of 150 LSTM steps 456 -> 51 us.  Each row is copied (or added,
    once) exactly as before, so the results are the same bits."""
    if dest.ndim != 2:
        return None
    return _arena_windows(dest.shape[1], plan, arrays, arena, writeable=False)


def arena_rows_scatter(src, plan: MatrixMultiPlan, arrays: dict, arena):
    """CopyToRowsMulti / AddToRowsMulti as one scatter (see arena_rows_gather; the
    plan built with scatter=True): (windows, offsets, valid) with ``windows``
    writeable, such that ``windows[offsets[valid]]`` are the destination rows of
    ``src[valid]``; None also when two destination rows overlap in memory (a row
    named twice, or column blocks of one matrix that overlap), where the writes'
    order would matter.  One write (or addition) per destination element, as
    before: the same bits."""
    if src.ndim != 2:
        return None
    found = _arena_windows(src.shape[1], plan, arrays, arena, writeable=True)
    if found is None:
        return None
    _, offsets, valid = found
    starts = np.sort(offsets if valid is None else offsets[valid])
    if starts.size > 1 and int(np.diff(starts).min()) < src.shape[1]:
        return None
    return found


def _arena_windows(ncols: int, plan: MatrixMultiPlan, arrays: dict, arena, writeable: bool):
    """arena_rows_gather / arena_rows_scatter for rows of ``ncols`` columns."""
    if (plan.error is not None or ncols == 0 or arena.dtype != np.float32
            or not arena.flags.c_contiguous or arena.size < ncols):
        return None
    flat = arena.reshape(-1)
    item = flat.itemsize
    start = flat.__array_interface__["data"][0]
    end = start + flat.size * item
    offsets = np.zeros(plan.num_rows, dtype=np.int64)
    for g in plan.groups:
        a = arrays.get(g.matrix)
        if a is None or g.num_cols != ncols:
            return None
        if g.cols is not None:
            a = a[:, g.cols]
        addr = a.__array_interface__["data"][0]
        rs, cs = a.strides
        if (a.dtype != np.float32 or cs != item or rs % item or (addr - start) % item
                or not start <= addr < end):
            return None
        rows = np.asarray(g.rows)
        last = addr + (int(rows.max()) * rs if rows.size else 0) + ncols * item
        if last > end:
            return None
        offsets[np.asarray(g.positions)] = (addr - start) // item + rows * (rs // item)
    windows = np.lib.stride_tricks.as_strided(flat, shape=(flat.size - ncols + 1, ncols),
                                              strides=(item, item), writeable=writeable)
    valid = None
    if plan.has_null:
        valid = np.setdiff1d(np.arange(plan.num_rows), np.asarray(plan.null_positions))
    return windows, offsets, valid


def to_rows_multi_by_matrix(xp, src, plan: MatrixMultiPlan, mats, alpha: float,
                            add: bool) -> None:
    """AddToRowsMulti / CopyToRowsMulti with a MatrixMultiPlan built with scatter=True."""
    what = "AddToRowsMulti" if add else "CopyToRowsMulti"
    _check_rows(plan.num_rows, src, what)
    if plan.error is not None:
        raise ValueError(f"{what}: {plan.error}")
    ncols = src.shape[1]
    for g in plan.groups:
        if g.num_cols != ncols:
            raise ValueError(f"{what}: a destination has {g.num_cols} columns, source {ncols}")
        dest = _group_array(mats, g, what)
        if g.single is not None:
            p, r = g.single
            v = src[p] if alpha == 1.0 else alpha * src[p]
            if add:
                dest[r] += v
            else:
                dest[r] = v
            continue
        vals = src[g.positions]
        if alpha != 1.0:
            vals = alpha * vals
        if not add:
            dest[g.rows] = vals
        elif g.unique_rows:
            dest[g.rows] += vals
        else:
            scatter_add(xp, dest, g.rows, vals)
