"""Index and Cindex, as in Kaldi's nnet3 "Data types" (nnet-common.h).

An ``Index`` is ``(n, t, x)``: sequence number in the minibatch, time, and an
extra dimension (used by convolutional setups).  Kaldi orders Indexes by
``t`` first, then ``x``, then ``n``; a ``Cindex`` is ``(node_index, Index)``
ordered by node first.

Scalars are small immutable tuples (hashable, cheap); for bulk sets use the
NumPy representation: an ``(N, 3)`` int32 array of ``[n, t, x]`` rows, with
``sort_indexes`` giving Kaldi's order.
"""

from __future__ import annotations

from functools import partial
from itertools import chain
from typing import Iterable, NamedTuple

import numpy as np

# Kaldi's int32 range: Index values, integer config options and the optimizer's
# "not set" deriv-times are 32-bit there
INT32_MIN = -(2 ** 31)
INT32_MAX = 2 ** 31 - 1

# Kaldi's kNoTime: the 't' of an Index that is a blank/padding row.
K_NO_TIME = INT32_MIN


class Index(NamedTuple):
    n: int = 0
    t: int = 0
    x: int = 0

    # Kaldi's ordering: (t, x, n).
    def key(self) -> tuple[int, int, int]:
        return (self.t, self.x, self.n)

    def __lt__(self, other):  # type: ignore[override]
        return (self.t, self.x, self.n) < (other.t, other.x, other.n)

    def __le__(self, other):  # type: ignore[override]
        return (self.t, self.x, self.n) <= (other.t, other.x, other.n)

    def __gt__(self, other):  # type: ignore[override]
        return (self.t, self.x, self.n) > (other.t, other.x, other.n)

    def __ge__(self, other):  # type: ignore[override]
        return (self.t, self.x, self.n) >= (other.t, other.x, other.n)

    def __add__(self, other):  # type: ignore[override]
        return Index(self.n + other.n, self.t + other.t, self.x + other.x)

    def __str__(self) -> str:
        # Kaldi prints Indexes as (n,t,x) e.g. "(0,5,0)"
        return f"({self.n}, {self.t}, {self.x})"

    # Immutable values of ints: a copy is the object itself.  copy.deepcopy
    # would otherwise rebuild every named tuple through __reduce_ex__, which
    # made copying a computation's debug info (one Cindex per matrix row)
    # most of the optimizer's time.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class Cindex(NamedTuple):
    node: int
    index: Index

    def __lt__(self, other):  # type: ignore[override]
        if self.node != other.node:
            return self.node < other.node
        return self.index < other.index

    def __le__(self, other):  # type: ignore[override]
        return self == other or self < other

    def __gt__(self, other):  # type: ignore[override]
        return other < self

    def __ge__(self, other):  # type: ignore[override]
        return self == other or other < self

    # Immutable (see Index.__deepcopy__).
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def index_sort_key(i: Index) -> tuple[int, int, int]:
    return (i.t, i.x, i.n)


def cindex_sort_key(c: Cindex) -> tuple[int, int, int, int]:
    return (c.node, c.index.t, c.index.x, c.index.n)


def index_rows(indexes: Iterable[Index], dtype=np.int64) -> np.ndarray:
    """Bulk form: (N, 3) array of [n, t, x] rows of a sequence of Indexes (or of
    any 3-sequences).  Read as one flat stream (4x faster than ``np.array`` of
    the tuples, which inspects each one as a nested sequence)."""
    flat = np.fromiter(chain.from_iterable(indexes), dtype=dtype)
    if flat.size % 3:
        raise ValueError(f"index rows: {flat.size} values are not whole (n, t, x) triples")
    return flat.reshape(-1, 3)


def as_index_rows(indexes) -> np.ndarray:
    """(k, 3) int64 n, t, x rows of a sequence of Indexes or of an array of such rows; a
    (k, 3) int64 array is returned as it is (the components' row hooks give such arrays
    back unchanged to say that nothing moved)."""
    if isinstance(indexes, np.ndarray):
        if indexes.dtype == np.int64 and indexes.ndim == 2 and indexes.shape[1] == 3:
            return indexes
        return indexes.reshape(-1, 3).astype(np.int64, copy=False)
    return index_rows(indexes)


def indexes_to_array(indexes: Iterable[Index]) -> np.ndarray:
    """Bulk form: (N, 3) int32 array of [n, t, x] rows."""
    return index_rows(indexes, np.int32)


_index_from_row = partial(tuple.__new__, Index)


def array_to_indexes(arr: np.ndarray) -> list[Index]:
    """One Index per [n, t, x] row of an integer array (made in C: no Python call
    per row)."""
    return list(map(_index_from_row, np.asarray(arr).reshape(-1, 3).tolist()))


def sort_order(arr: np.ndarray) -> np.ndarray:
    """Permutation that sorts an (N,3) [n,t,x] array into Kaldi's (t, x, n) order."""
    arr = np.asarray(arr).reshape(-1, 3)
    return np.lexsort((arr[:, 0], arr[:, 2], arr[:, 1]))
