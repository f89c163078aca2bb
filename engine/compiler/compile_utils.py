"""Kaldi's nnet-compile-utils.cc: turning per-row lists of source locations
into commands that each touch every row at most once.

- ``split_locations`` (SplitLocations): per-row lists of (submatrix, row)
  sources -> "columns" with at most one source per row; sources used by more
  than half the rows get their own columns first (they become AddRows).
- ``convert_to_indexes`` (ConvertToIndexes): a column reading one submatrix ->
  a row-index vector.
- ``split_locations_backward`` (SplitLocationsBackward) with
  ``ensure_contiguous_property`` and ``split_pair_list``: the backward version,
  where a column must not write any destination row twice.
- ``has_contiguous_property`` (HasContiguousProperty): whether a row map can be
  run as AddRowRanges.
- ``unordered_map_order``: the iteration order of libstdc++'s unordered_map, which
  Kaldi's GetSubmatCounts exposes (it orders the terms of a summed input).
"""

from __future__ import annotations

from collections import Counter

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


def split_locations(submat_lists: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """Kaldi's SplitLocations: lists (one per row) of (submatrix, row) sources ->
    vectors with at most one source per row, sources used by more than half the
    rows separated out first (so they become whole-matrix AddRows)."""
    num_rows = len(submat_lists)
    width = max((len(lst) for lst in submat_lists), default=0)
    if width == 0:
        return []
    if width == 1:
        return [[lst[0] if lst else (-1, -1) for lst in submat_lists]]
    counts = Counter(s for lst in submat_lists for s, _ in lst)
    cutoff = num_rows // 2
    large = [s for s, n in counts.items() if n > cutoff]
    if len(large) > 1:
        # Kaldi collects them by iterating an unordered_map: their order is the order
        # in which the summed terms are written
        large = [s for s in unordered_map_order(counts) if counts[s] > cutoff]
    if large:
        pos = {s: i for i, s in enumerate(large)}
        split = [[(-1, -1)] * num_rows for _ in large]
        reduced: list[list[tuple[int, int]]] = [[] for _ in range(num_rows)]
        for r, lst in enumerate(submat_lists):
            for pair in lst:
                k = pos.get(pair[0])
                if k is None or split[k][r][0] >= 0:
                    reduced[r].append(pair)
                else:
                    split[k][r] = pair
        return split + split_locations(reduced)
    out = [[(-1, -1)] * num_rows for _ in range(width)]
    for r, lst in enumerate(submat_lists):
        for i, pair in enumerate(lst):
            out[i][r] = pair
    return out


def convert_to_indexes(locations: list[tuple[int, int]]) -> tuple[bool, int, list[int]]:
    """Kaldi's ConvertToIndexes: if every non-(-1) source is the same submatrix,
    (True, submatrix, rows with -1 for none); otherwise (False, -1, [])."""
    first = -1
    rows = []
    for s, r in locations:
        if s != -1:
            if first == -1:
                first = s
            elif s != first:
                return False, -1, []
            rows.append(r)
        else:
            rows.append(-1)
    return True, first, rows


def ensure_contiguous_property(indexes: list[int]) -> list[list[int]]:
    """Kaldi's EnsureContiguousProperty: split ``indexes`` into vectors in which each
    value occupies one contiguous run."""
    if not indexes:
        return []
    mx = max(indexes)
    if mx == -1:
        return []
    seen = [0] * (mx + 1)
    out: list[list[int]] = []
    n = len(indexes)
    i = 0
    while i < n:
        v = indexes[i]
        if v == -1:
            i += 1
            continue
        start = i
        while i < n and indexes[i] == v:
            i += 1
        k = seen[v]
        seen[v] += 1
        if k >= len(out):
            out.append([-1] * n)
        out[k][start:i] = [v] * (i - start)
    return out


def split_pair_list(lst: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Kaldi's SplitPairList: split so that no vector repeats a (submatrix, row) pair."""
    counts: dict[tuple[int, int], int] = {}
    out: list[list[tuple[int, int]]] = []
    for i, pair in enumerate(lst):
        if pair[0] == -1:
            continue
        k = counts.get(pair, 0) + 1
        counts[pair] = k
        if k > len(out):
            out.append([(-1, -1)] * len(lst))
        out[k - 1][i] = pair
    return out


def split_locations_backward(submat_lists):
    """Kaldi's SplitLocationsBackward: like split_locations, but each resulting
    command must write every destination row at most once."""
    out = []
    for lst in split_locations(submat_lists):
        ok, first, rows = convert_to_indexes(lst)
        if ok:
            if first == -1:
                continue
            parts = ensure_contiguous_property(rows)
            if len(parts) == 1:
                out.append(lst)
            else:
                for part in parts:
                    out.append([(first, r) if r != -1 else (-1, r) for r in part])
        else:
            out.extend(split_pair_list(lst))
    return out


def has_contiguous_property(indexes: list[int]) -> tuple[bool, list[tuple[int, int]]]:
    """Kaldi's HasContiguousProperty: for each value, the (begin, end) run of rows
    holding it, provided each value's rows are contiguous."""
    if not indexes:
        return True, []
    n_in = max(indexes) + 1
    if n_in == 0:
        return True, []
    rev = [(-1, -1)] * n_in
    for i, j in enumerate(indexes):
        if j == -1:
            continue
        a, b = rev[j]
        rev[j] = (i, i + 1) if a == -1 else (min(a, i), max(b, i + 1))
    for v, (a, b) in enumerate(rev):
        if a != -1 and any(indexes[k] != v for k in range(a, b)):
            return False, []
    return True, rev
