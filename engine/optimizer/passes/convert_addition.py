"""Addition to assignment: Kaldi's ``ConvertAdditionToAssignment`` (nnet-optimize.cc),
run from ``Optimize()`` when ``convert_addition`` is set.

The compiler zeroes every matrix when it allocates it and builds descriptor
sums with "+=" commands (kMatrixAdd, kAddRows, kAddRowsMulti,
kAddToRowsMulti).  When such a command is the first thing, apart from that
zeroing, to touch every part of what it writes, adding to zero is the same as
assigning, so it becomes the copy form (kMatrixCopy, kCopyRows,
kCopyRowsMulti, kCopyToRowsMulti).  That matters because copies can then be
merged away by ``remove_assignments`` and make the zeroing removable by
``initialize_undefined``.

Two details as in Kaldi: kAddToRowsMulti converts only with alpha 1 (its copy
form does not scale); and a kAddRows/kAddRowsMulti with -1 rows is still a
legal conversion, because the copy forms write zero there, which is what the
freshly zeroed rows held.
"""

from __future__ import annotations

from engine.compiler.computation import NnetComputation
from engine.optimizer.analysis import CT, ComponentProperties, command_accesses

_TO_COPY = {
    CT.MATRIX_ADD: CT.MATRIX_COPY,
    CT.ADD_ROWS: CT.COPY_ROWS,
    CT.ADD_ROWS_MULTI: CT.COPY_ROWS_MULTI,
    CT.ADD_TO_ROWS_MULTI: CT.COPY_TO_ROWS_MULTI,
}


def convert_addition_to_assignment(computation: NnetComputation, ctx) -> bool:
    """Kaldi's ConvertAdditionToAssignment; returns True if a command was converted.

    An addition converts when no earlier command other than a zeroing touches
    any part of what it writes (Kaldi asks ComputationAnalysis for the first
    non-zeroing access of each written submatrix).  Converting changes no
    command into or out of a zeroing, so the answers do not depend on earlier
    conversions and one walk over the commands gives them all: it keeps, for
    each matrix, the submatrices that non-zeroing commands have touched so
    far, and tests each addition's written submatrices against them before
    recording its own accesses."""
    cmds = computation.commands
    to_copy, add_to_rows_multi, set_const = _TO_COPY, CT.ADD_TO_ROWS_MULTI, CT.SET_CONST
    props = getattr(ctx, "props", None)   # (an empty one is falsy: test for None)
    if props is None:
        props = ComponentProperties(ctx.nnet)
    subs = computation.submatrices
    seen: list[list[int]] = [[] for _ in computation.matrices]   # submatrices touched so far
    changed = False
    for c, lst in zip(cmds, command_accesses(computation, props)):
        if not lst:
            continue
        ct = c.command_type
        if ct in to_copy and (ct != add_to_rows_multi or c.alpha == 1.0):
            first = True
            for s, a in lst:
                if a & 2:
                    m, ro, nr, co, nc = subs[s]
                    R1, C1 = ro + nr, co + nc
                    for t in seen[m]:
                        _, r0, n0, c0, k0 = subs[t]
                        if r0 < R1 and ro < r0 + n0 and c0 < C1 and co < c0 + k0:
                            first = False
                            break
                    if not first:
                        break
            if first:
                c.command_type = to_copy[ct]
                changed = True
        elif ct == set_const and c.alpha == 0.0:
            continue   # zeroing does not count as an access here
        for s, _ in lst:
            seen[subs[s][0]].append(s)
    if changed and hasattr(ctx, "invalidate"):
        ctx.invalidate()
    return changed
