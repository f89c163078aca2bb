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
from engine.optimizer import native
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


def remove_unnecessary_allocation(computation: NnetComputation, ctx=None) -> bool:
    """The pairs are found in C when the extension is built (engine.optimizer.native);
    the walk below is their reference form."""
    c = computation
    cmds, mats, subs = c.commands, c.matrices, c.submatrices
    pairs = None
    if native.NATIVE is not None:
        pairs = native.NATIVE.allocation_pairs(cmds, subs, mats, K_DEFAULT_STRIDE)
    if pairs is None:
        pairs = _pairs_of(cmds, mats, subs)
    if not pairs:
        return False
    noop, swap = CT.NO_OPERATION, CT.SWAP_MATRIX
    for d, a in pairs:
        dealloc, alloc = cmds[d], cmds[a]
        dealloc.command_type = noop
        alloc.command_type = swap
        alloc.arg2 = dealloc.arg1
    remove_no_ops(c)
    fix_goto_label(c)
    return True


def _pairs_of(cmds: list, mats: list, subs: list) -> list[tuple[int, int]]:
    """The (deallocation, allocation) pairs that become one kSwapMatrix."""
    alloc_t, dealloc_t = CT.ALLOC_MATRIX, CT.DEALLOC_MATRIX
    # each matrix's size class: (rows, columns, negated for kStrideEqualNumCols)
    size = [(mi.num_rows, mi.num_cols if mi.stride_type == K_DEFAULT_STRIDE else -mi.num_cols)
            for mi in mats]
    lists: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for i, cmd in enumerate(cmds):
        ct = cmd.command_type
        if ct == alloc_t or ct == dealloc_t:
            key = size[subs[cmd.arg1][0]]
            pair = lists.get(key)
            if pair is None:
                pair = lists[key] = ([], [])
            pair[ct == alloc_t].append(i)
    return [p for d, a in lists.values() if d and a for p in _pairs(d, a)]
