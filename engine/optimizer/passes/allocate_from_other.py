"""Reusing freed matrices: Kaldi's RemoveUnnecessaryAllocation (nnet-optimize.cc),
gated by the option allocate_from_other.

When a matrix is freed and, later, another of the same size (and stride type)
is allocated, the pair becomes one kSwapMatrix: the new matrix takes over the
old one's memory and the allocator is not called.  Pairs are formed per size,
from the latest deallocation backwards, each with the earliest allocation after
it that is still free (Kaldi's greedy rule; it keeps pairs close in time).
The computation stays correct whatever the pairing: kAllocMatrix leaves the
contents undefined, so reused memory is as good as new.
"""

from __future__ import annotations

import bisect

from engine.compiler.computation import K_DEFAULT_STRIDE, NnetComputation
from engine.optimizer.analysis import CT
from engine.optimizer.passes.remove_no_ops import fix_goto_label, remove_no_ops



def _pairs(deallocs: list[int], allocs: list[int]) -> list[tuple[int, int]]:
    free = sorted(allocs)
    out = []
    for d in sorted(deallocs, reverse=True):
        k = bisect.bisect_right(free, d)
        if k == len(free):
            continue
        out.append((d, free.pop(k)))
    return out


def remove_unnecessary_allocation(computation: NnetComputation, ctx) -> bool:
    c = computation
    lists: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    alloc_t, dealloc_t = CT.ALLOC_MATRIX, CT.DEALLOC_MATRIX
    mats, subs = c.matrices, c.submatrices
    for i, cmd in enumerate(c.commands):
        ct = cmd.command_type
        if ct == alloc_t or ct == dealloc_t:
            mi = mats[subs[cmd.arg1][0]]
            cols = mi.num_cols if mi.stride_type == K_DEFAULT_STRIDE else -mi.num_cols
            d, a = lists.setdefault((mi.num_rows, cols), ([], []))
            (d if ct == dealloc_t else a).append(i)
    pairs = [p for d, a in lists.values() for p in _pairs(d, a)]
    if not pairs:
        return False
    for d, a in pairs:
        dealloc, alloc = c.commands[d], c.commands[a]
        assert dealloc.command_type == CT.DEALLOC_MATRIX and alloc.command_type == CT.ALLOC_MATRIX
        dealloc.command_type = CT.NO_OPERATION
        alloc.command_type = CT.SWAP_MATRIX
        alloc.arg2 = dealloc.arg1
    remove_no_ops(c)
    fix_goto_label(c)
    return True
