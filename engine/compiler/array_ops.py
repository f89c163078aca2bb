"""Reductions over narrow 2-D integer and boolean arrays (a few columns, many rows),
and the distinct values of a 1-D array.

NumPy reduces an (N, K) array along either axis with a loop that is slow when K is
small: ``a.min(axis=0)`` or ``b.all(axis=1)`` on (30000, 3) arrays take 20-30 times
as long as the same reductions done one column at a time.  The compiler's arrays
are of that shape (cindex rows node/n/t/x, a handful of inputs per row), so these
helpers reduce column by column when there are few columns and leave wide arrays
to NumPy.  Results are exactly those of the NumPy reductions.
"""

from __future__ import annotations

import numpy as np

# up to this many columns, one operation per column beats NumPy's axis reductions
NARROW = 8
# the reductions straight to the ufuncs (ndarray.min/max go through Python wrappers,
# which cost more than the work on the short arrays a compile mostly has): the
# compiler's modules call these
min_reduce, max_reduce = np.minimum.reduce, np.maximum.reduce


def column_bounds(a: np.ndarray) -> tuple[list[int], list[int]]:
    """(per-column minima, per-column maxima) of a non-empty 2-D array, as lists
    of ints (``a.min(axis=0).tolist()``, ``a.max(axis=0).tolist()``)."""
    if a.shape[1] > NARROW:
        return a.min(axis=0).tolist(), a.max(axis=0).tolist()
    cols = [a[:, k] for k in range(a.shape[1])]
    return [int(min_reduce(c)) for c in cols], [int(max_reduce(c)) for c in cols]


def _rows_reduce(b: np.ndarray, op, empty: bool) -> np.ndarray:
    """``op.reduce(b, axis=1)`` of a 2-D boolean array for ``op`` logical_and or
    logical_or (``empty``: the result for zero columns), a column at a time when
    there are few."""
    k = b.shape[1]
    if k > NARROW:
        return op.reduce(b, axis=1)
    if k == 0:
        return np.full(b.shape[0], empty, dtype=bool)
    out = b[:, 0].copy()
    for j in range(1, k):
        op(out, b[:, j], out)
    return out


def rows_all(b: np.ndarray) -> np.ndarray:
    """``b.all(axis=1)`` of a 2-D boolean array."""
    return _rows_reduce(b, np.logical_and, True)


def rows_any(b: np.ndarray) -> np.ndarray:
    """``b.any(axis=1)`` of a 2-D boolean array."""
    return _rows_reduce(b, np.logical_or, False)


def rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(a == b).all(axis=1)`` for 2-D ``a`` and ``b`` of the same width (``b`` may
    be one row, broadcast against every row of ``a``)."""
    k = a.shape[1]
    if k > NARROW:
        return (a == b).all(axis=1)
    if b.ndim == 1:
        b = b[None, :]
    if k == 0:
        return np.ones(np.broadcast_shapes(a.shape, b.shape)[0], dtype=bool)
    out = a[:, 0] == b[:, 0]
    for j in range(1, k):
        out &= a[:, j] == b[:, j]
    return out


def distinct(a: np.ndarray, kind: str | None = None) -> np.ndarray:
    """The distinct values of a 1-D array, sorted (np.unique without its overhead);
    ``kind="stable"`` for long arrays made of sorted runs (NumPy's stable sort
    merges runs, many times faster there than its default sort)."""
    a = np.sort(a, kind=kind)
    if len(a) > 1:
        step = a[1:] != a[:-1]
        if not np.logical_and.reduce(step):
            a = a[np.concatenate(([True], step))]
    return a


def rows_count(b: np.ndarray) -> np.ndarray:
    """``b.sum(axis=1)`` of a 2-D boolean array (int64 counts)."""
    k = b.shape[1]
    if k > NARROW:
        return b.sum(axis=1)
    out = np.zeros(b.shape[0], dtype=np.int64)
    for j in range(k):
        out += b[:, j]
    return out


__all__ = ["column_bounds", "distinct", "rows_all", "rows_any", "rows_equal", "rows_count",
           "NARROW"]
