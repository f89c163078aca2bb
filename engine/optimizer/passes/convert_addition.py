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
from engine.optimizer.analysis import CT, Analyzer, ComputationAnalysis

_TO_COPY = {
    CT.MATRIX_ADD: CT.MATRIX_COPY,
    CT.ADD_ROWS: CT.COPY_ROWS,
    CT.ADD_ROWS_MULTI: CT.COPY_ROWS_MULTI,
    CT.ADD_TO_ROWS_MULTI: CT.COPY_TO_ROWS_MULTI,
}


def convert_addition_to_assignment(computation: NnetComputation, ctx) -> bool:
    """Kaldi's ConvertAdditionToAssignment; returns True if a command was converted."""
    analyzer = ctx.analyzer(computation) if hasattr(ctx, "analyzer") else Analyzer(ctx.nnet,
                                                                                    computation)
    analysis = None
    accesses = analyzer.command_accesses
    changed = False
    for i, c in enumerate(computation.commands):
        new_type = _TO_COPY.get(c.command_type)
        if new_type is None:
            continue
        if c.command_type == CT.ADD_TO_ROWS_MULTI and c.alpha != 1.0:
            continue
        written = {s for s, a in accesses[i] if a & 2}
        if not written:
            continue
        if analysis is None:
            analysis = ComputationAnalysis(computation, analyzer)
        # the first non-zeroing access of each written submatrix must be this
        # command; an earlier one means there is something to add to
        if any(analysis.first_nontrivial_access(s) != i for s in written):
            continue
        c.command_type = new_type
        changed = True
    if changed and hasattr(ctx, "invalidate"):
        ctx.invalidate()
    return changed
