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
"""

from __future__ import annotations

from collections import Counter

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
