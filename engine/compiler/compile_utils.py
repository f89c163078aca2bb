"""Kaldi's nnet-compile-utils.cc: turning per-row lists of source locations
into commands that each touch every row at most once, on arrays.

- ``split_columns`` (SplitLocations): per-row source lists (padded arrays of
  submatrices and rows) -> "columns" with at most one source per row; sources
  used by more than half the rows get their own columns first (they become
  AddRows).
- ``column_source`` (ConvertToIndexes): the one submatrix a column reads.
- ``split_columns_backward`` (SplitLocationsBackward) with ``contiguous_parts``
  (EnsureContiguousProperty) and ``pair_columns`` (SplitPairList): the backward
  version, where a column must not write any destination row twice.
- ``row_ranges`` (HasContiguousProperty): whether a row map can be run as
  AddRowRanges.
- ``unordered_map_order``: the iteration order of libstdc++'s unordered_map, which
  Kaldi's GetSubmatCounts exposes (it orders the terms of a summed input).

The same functions with Kaldi's list signatures (``split_locations``,
``convert_to_indexes``, ``ensure_contiguous_property``, ``split_pair_list``,
``split_locations_backward``, ``has_contiguous_property``) wrap them.
"""

from __future__ import annotations

import numpy as np

from engine.compiler.array_ops import rows_count

# The prime bucket counts of libstdc++'s _Prime_rehash_policy, as far as any
# computation here can need them (a hash map of submatrix indexes).
_LIBSTDCXX_PRIMES = (
    2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83,
    89, 97, 103, 109, 113, 127, 137, 139, 149, 157, 167, 179, 193, 199, 211, 227, 241, 257,
    277, 293, 313, 337, 359, 383, 409, 439, 467, 503, 541, 577, 619, 661, 709, 761, 823,
    887, 953, 1031, 1109, 1193, 1289, 1381, 1493, 1613, 1741, 1879, 2029, 2179, 2357, 2549,
    2753, 2971, 3209, 3469, 3739, 4027, 4349, 4703, 5087, 5503, 5953, 6427, 6949, 7517,
    8123, 8783, 9497, 10273, 11113, 12011, 12983, 14033, 15173, 16411, 17749, 19183, 20753,
    22447, 24281, 26267, 28411, 30727, 33223, 35933, 38873, 42043, 45481, 49201, 53201,
    57557, 62233, 67307, 72817, 78779, 85229, 92203, 99733, 107897, 116731, 126271, 136607,
    147793, 159871, 172933, 187091, 202409, 218971, 236897, 256279, 277261, 299951, 324503,
    351061, 379787, 410857, 444487, 480881, 520241, 562841, 608903, 658753, 712697, 771049,
    834181, 902483, 976369)
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)


def unordered_map_order(keys) -> list[int]:
    """The iteration order of a libstdc++ ``std::unordered_map<int32, ...>`` into
    which the distinct non-negative ints ``keys`` were inserted in this order.

    Kaldi iterates such maps in a few places where the order shows in the
    computation (GetSubmatCounts decides which summed term is added first, and so
    which add the optimizer can turn into a copy); reproducing the order makes our
    command sequences Kaldi's.  The model: identity hash, one bucket until the
    first insert, then prime bucket counts (load factor 1, growth x2); a key whose
    bucket is empty goes to the front of the node list, otherwise in front of its
    bucket's first node; a rehash re-inserts the nodes in list order by the same
    rule."""
    if len(keys) <= 2:
        # the first insert makes 13 buckets; a second key goes to the front of the
        # list whether or not it shares the first key's bucket
        return list(keys)[::-1]
    order: list[int] = []
    n_bkt, next_resize = 1, 0

    def place(lst: list[int], k: int, nb: int) -> None:
        b = k % nb
        for i, x in enumerate(lst):
            if x % nb == b:
                lst.insert(i, k)
                return
        lst.insert(0, k)

    def next_bkt(n: int) -> tuple[int, int]:
        if n < len(_FAST_BUCKETS):
            return _FAST_BUCKETS[n], _FAST_BUCKETS[n]
        for p in _LIBSTDCXX_PRIMES[6:]:
            if p >= n:
                return p, p
        raise ValueError(f"unordered_map_order: {n} buckets is beyond the modelled range")

    for k in keys:
        n_elt = len(order)
        if n_elt + 1 > next_resize:
            min_bkts = max(n_elt + 1, 0 if next_resize else 11)
            if min_bkts >= n_bkt:
                n_bkt, next_resize = next_bkt(max(min_bkts + 1, n_bkt * 2))
                old, order = order, []
                for x in old:
                    place(order, x, n_bkt)
            else:
                next_resize = n_bkt
        place(order, k, n_bkt)
    return order


# -- the array forms ------------------------------------------------------------------------
#
# A list of per-row source lists is held as two (num_rows, width) int64 arrays,
# submatrices S and rows R, each row's sources left-aligned in order and -1
# (in both) where a row has no more; a "column" (at most one source per row) is a
# pair of (num_rows,) arrays.


def left_align(S: np.ndarray, R: np.ndarray, keep: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """S, R with the entries where ``keep`` (default S >= 0) moved to the left of
    each row in order, -1 elsewhere, and empty trailing columns dropped."""
    if keep is None:
        keep = S >= 0
    S = np.where(keep, S, -1)
    R = np.where(keep, R, -1)
    if S.shape[1] > 1 and not (keep[:, 1:] <= keep[:, :-1]).all():
        order = np.argsort(~keep, axis=1, kind="stable")
        S = np.take_along_axis(S, order, axis=1)
        R = np.take_along_axis(R, order, axis=1)
    width = int(rows_count(keep).max()) if len(keep) else 0
    return S[:, :width], R[:, :width]


def split_columns(S: np.ndarray, R: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Kaldi's SplitLocations on left-aligned S, R: columns with at most one source
    per row; sources used by more than half the rows get their own columns first
    (they become whole-matrix AddRows), in libstdc++ unordered_map order when
    there are several."""
    num_rows, width = S.shape
    if width == 0:
        return []
    if width == 1:
        return [(S[:, 0], R[:, 0])]
    valid = S >= 0
    flat = S[valid]                        # row-major: Kaldi's counting order
    keys, first, counts = np.unique(flat, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    keys, counts = keys[order].tolist(), counts[order].tolist()
    cutoff = num_rows // 2
    count = dict(zip(keys, counts))
    large = [k for k in keys if count[k] > cutoff]
    if len(large) > 1:
        large = [k for k in unordered_map_order(keys) if count[k] > cutoff]
    if not large:
        return [(S[:, j], R[:, j]) for j in range(width)]
    rows = np.arange(num_rows)
    taken = np.zeros(S.shape, dtype=bool)
    out = []
    for k in large:
        eq = S == k
        at = eq.argmax(axis=1)
        has = eq[rows, at]
        out.append((np.where(has, k, -1), np.where(has, R[rows, at], -1)))
        taken[rows[has], at[has]] = True
    rest = valid & ~taken
    if rest.any():
        out.extend(split_columns(*left_align(S, R, rest)))
    return out


def column_source(cs: np.ndarray) -> int:
    """Kaldi's ConvertToIndexes: the one submatrix a column reads, -1 when it reads
    none, -2 when it reads several."""
    valid = cs[cs >= 0]
    if not len(valid):
        return -1
    first = int(valid[0])
    return first if (valid == first).all() else -2


def contiguous_parts(rows: np.ndarray) -> list[np.ndarray]:
    """Kaldi's EnsureContiguousProperty: ``rows`` split into vectors in which each
    value occupies one contiguous run (the k-th run of a value goes to vector k)."""
    n = len(rows)
    if not n or rows.max() == -1:
        return []
    valid = rows != -1
    start = valid.copy()
    start[1:] &= rows[1:] != rows[:-1]
    run_val = rows[start]
    order = np.argsort(run_val, kind="stable")
    sv = run_val[order]
    group = np.ones(len(sv), dtype=bool)
    group[1:] = sv[1:] != sv[:-1]
    gstart = np.maximum.accumulate(np.where(group, np.arange(len(sv)), 0))
    rank = np.empty(len(sv), dtype=np.int64)
    rank[order] = np.arange(len(sv)) - gstart
    if not rank.any():
        return [rows]
    run_of = np.cumsum(start) - 1
    out = np.full((int(rank.max()) + 1, n), -1, dtype=np.int64)
    pos = np.flatnonzero(valid)
    out[rank[run_of[pos]], pos] = rows[pos]
    return list(out)


def pair_columns(cs: np.ndarray, cr: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Kaldi's SplitPairList: columns in which no (submatrix, row) pair repeats
    (the k-th occurrence of a pair goes to column k)."""
    pos = np.flatnonzero(cs != -1)
    if not len(pos):
        return []
    key = cs[pos] * (int(cr.max()) + 2) + cr[pos]
    order = np.argsort(key, kind="stable")
    sk = key[order]
    group = np.ones(len(sk), dtype=bool)
    group[1:] = sk[1:] != sk[:-1]
    gstart = np.maximum.accumulate(np.where(group, np.arange(len(sk)), 0))
    rank = np.empty(len(sk), dtype=np.int64)
    rank[order] = np.arange(len(sk)) - gstart
    out = []
    for k in range(int(rank.max()) + 1):
        sel = pos[rank == k]
        s = np.full(len(cs), -1, dtype=np.int64)
        r = np.full(len(cs), -1, dtype=np.int64)
        s[sel], r[sel] = cs[sel], cr[sel]
        out.append((s, r))
    return out


def split_columns_backward(S: np.ndarray, R: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Kaldi's SplitLocationsBackward: like split_columns, but no resulting column
    writes a destination row twice."""
    out = []
    for cs, cr in split_columns(S, R):
        src = column_source(cs)
        if src == -1:
            continue
        if src >= 0:
            parts = contiguous_parts(cr)
            if len(parts) == 1:
                out.append((cs, cr))
            else:
                out.extend((np.where(p != -1, src, -1), p) for p in parts)
        else:
            out.extend(pair_columns(cs, cr))
    return out


def row_ranges(rows: np.ndarray) -> np.ndarray | None:
    """Kaldi's HasContiguousProperty: for each value 0 .. max, the (begin, end) run
    of rows holding it ((-1, -1) if absent), or None when some value's rows are
    not contiguous."""
    if not len(rows):
        return np.zeros((0, 2), dtype=np.int64)
    n_in = int(rows.max()) + 1
    if n_in <= 0:
        return np.zeros((0, 2), dtype=np.int64)
    pos = np.flatnonzero(rows != -1)
    vals = rows[pos]
    out = np.full((n_in, 2), -1, dtype=np.int64)
    begin = np.full(n_in, len(rows), dtype=np.int64)
    np.minimum.at(begin, vals, pos)
    end = np.zeros(n_in, dtype=np.int64)
    np.maximum.at(end, vals, pos + 1)
    count = np.bincount(vals, minlength=n_in)
    present = count > 0
    if (end[present] - begin[present] != count[present]).any():
        return None
    out[present, 0] = begin[present]
    out[present, 1] = end[present]
    return out


# -- the list forms (Kaldi's signatures, for callers holding lists) ------------------------------


def _to_arrays(submat_lists) -> tuple[np.ndarray, np.ndarray]:
    num_rows = len(submat_lists)
    width = max((len(lst) for lst in submat_lists), default=0)
    S = np.full((num_rows, width), -1, dtype=np.int64)
    R = np.full((num_rows, width), -1, dtype=np.int64)
    for i, lst in enumerate(submat_lists):
        for j, (a, b) in enumerate(lst):
            S[i, j], R[i, j] = a, b
    return S, R


def _to_pairs(column) -> list[tuple[int, int]]:
    return list(zip(column[0].tolist(), column[1].tolist()))


def split_locations(submat_lists: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """Kaldi's SplitLocations (see split_columns) on per-row lists of
    (submatrix, row) pairs."""
    return [_to_pairs(c) for c in split_columns(*_to_arrays(submat_lists))]


def split_locations_backward(submat_lists):
    """Kaldi's SplitLocationsBackward (see split_columns_backward) on lists."""
    return [_to_pairs(c) for c in split_columns_backward(*_to_arrays(submat_lists))]


def convert_to_indexes(locations: list[tuple[int, int]]) -> tuple[bool, int, list[int]]:
    """Kaldi's ConvertToIndexes: if every non-(-1) source is the same submatrix,
    (True, submatrix, rows with -1 for none); otherwise (False, -1, [])."""
    cs = np.array([s for s, _ in locations], dtype=np.int64)
    src = column_source(cs)
    if src == -2:
        return False, -1, []
    return True, src, [r if s != -1 else -1 for s, r in locations]


def ensure_contiguous_property(indexes: list[int]) -> list[list[int]]:
    """Kaldi's EnsureContiguousProperty (see contiguous_parts) on a list."""
    return [p.tolist() for p in contiguous_parts(np.array(indexes, dtype=np.int64))]


def split_pair_list(lst: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Kaldi's SplitPairList (see pair_columns) on a list of pairs."""
    cs = np.array([s for s, _ in lst], dtype=np.int64)
    cr = np.array([r for _, r in lst], dtype=np.int64)
    return [_to_pairs(c) for c in pair_columns(cs, cr)]


def has_contiguous_property(indexes: list[int]) -> tuple[bool, list[tuple[int, int]]]:
    """Kaldi's HasContiguousProperty (see row_ranges) on a list."""
    ranges = row_ranges(np.array(indexes, dtype=np.int64))
    if ranges is None:
        return False, []
    return True, [tuple(r) for r in ranges.tolist()]
