"""Matrix extension: Kaldi's ``ExtendMatrices`` (class ``MatrixExtender`` in
nnet-optimize-utils.cc), run from ``Optimize()`` when ``extend_matrices`` is set
and the computation is not looped.

Why: a kMatrixCopy (alpha 1) from "almost all" of a matrix A (its first rows, at
least 80% of them) into the last rows of a matrix B cannot be removed by
variable merging, because the source is not a whole matrix.  Growing B by the
few missing rows and copying the whole of A turns it into a whole-matrix copy
that ``remove_assignments`` can then merge away.  The extra rows of B carry no
real cindexes (their debug info gets ``t = kNoTime``), and the checker's
"undefined read" test allows reading such rows (hence the same 80% threshold
there).

After the commands are rewritten the allocation, deallocation and whole-matrix
zeroing commands of the grown matrices are pointed at a submatrix covering the
new size, and the computation is renumbered.
"""

from __future__ import annotations

import numpy as np

from engine.compiler.computation import (DebugCindexes, MatrixDebugInfo, NnetComputation,
                                         SubMatrixInfo, command_types, positions)
from engine.core.errors import CheckError
from engine.core.index import K_NO_TIME, Cindex, Index
from engine.optimizer import native
from engine.optimizer.analysis import CT
from engine.optimizer.passes.renumber import renumber_computation
from engine.optimizer.pipeline import ROW_OP_PASSES, merges_variables

# keep in sync with the checker's allowance for reading extended rows
MIN_PROPORTION = 0.8


def _extend(c: NnetComputation) -> tuple[bool, dict[int, int]]:
    """Kaldi's MatrixExtender::ExtendMatrices without the fix-up: grows the
    destination of each kMatrixCopy (alpha 1) that can be extended, in command
    order, and points the copy at the new submatrices.  Returns whether a copy
    was extended and, for the matrices that grew, matrix -> rows before."""
    cmds, subs, mats = c.commands, c.submatrices, c.matrices
    types = command_types(cmds)
    if CT.SWAP_MATRIX in types:
        raise CheckError("extend_matrices: the computation already has kSwapMatrix "
                         "commands (it must run before the allocation passes)")
    changed = False
    grown: dict[int, int] = {}    # matrix -> rows before it grew
    io: set[int] | None = None    # the matrices of inputs and outputs, when needed
    for i in positions(types, CT.MATRIX_COPY):     # (in command order)
        cmd = cmds[i]
        if cmd.alpha != 1.0:
            continue
        sm, sro, snr, sco, snc = subs[cmd.arg2]
        dm, dro, dnr, _, _ = subs[cmd.arg1]
        src_mat = mats[sm]
        # Kaldi's CanBeExtended: the source is the first rows (at least 80% of
        # the matrix as it was) of another matrix, the destination its last rows
        if (sm == dm or sro != 0 or sco != 0 or snc != src_mat.num_cols
                or snr >= src_mat.num_rows
                or snr < MIN_PROPORTION * grown.get(sm, src_mat.num_rows)
                or dro + dnr != grown.get(dm, mats[dm].num_rows)):
            continue
        if io is None:   # (a scan in C for each kind: few hits among many commands)
            io = {subs[cmds[k].arg1][0] for k in (positions(types, CT.ACCEPT_INPUT)
                                                  + positions(types, CT.PROVIDE_OUTPUT))}
        if dm in io:
            continue
        # Kaldi's Extend
        dest_mat = mats[dm]
        new_dest_rows = dro + src_mat.num_rows
        if new_dest_rows > dest_mat.num_rows:
            grown.setdefault(dm, dest_mat.num_rows)
            mats[dm] = dest_mat._replace(num_rows=new_dest_rows)
            subs.append(SubMatrixInfo(dm, 0, new_dest_rows, 0, dest_mat.num_cols))
        subs.append(subs[cmd.arg1]._replace(num_rows=src_mat.num_rows))
        cmd.arg1 = len(subs) - 1
        subs.append(SubMatrixInfo(sm, 0, src_mat.num_rows, 0, src_mat.num_cols))
        cmd.arg2 = len(subs) - 1
        changed = True
    return changed, grown


def _fix_computation(c: NnetComputation, grown: dict[int, int]) -> None:
    """Kaldi's MatrixExtender::FixComputation: every allocation and deallocation,
    and every zeroing of a whole matrix as it was, on the (last) submatrix
    covering the matrix now; the debug info of the grown matrices (the renumbering
    is left to the caller)."""
    subs, mats = c.submatrices, c.matrices
    # the last submatrix of each whole-matrix extent (GetWholeSubmatrices)
    last = dict(zip(subs, range(len(subs))))
    whole = [last.get((m, 0, mi.num_rows, 0, mi.num_cols), 0) for m, mi in enumerate(mats)]
    if not all(whole[1:]):
        c.whole_submatrices()   # raises, naming the matrix
    alloc, dealloc, set_const = CT.ALLOC_MATRIX, CT.DEALLOC_MATRIX, CT.SET_CONST
    for cmd in c.commands:
        ct = cmd.command_type
        if ct == alloc or ct == dealloc:
            cmd.arg1 = whole[subs[cmd.arg1][0]]
        elif ct == set_const and cmd.alpha == 0.0:
            m, ro, nr, co, nc = subs[cmd.arg1]
            # only a zeroing of the whole (original) matrix grows with it
            if ro == 0 and co == 0 and nc == mats[m].num_cols and nr == grown.get(
                    m, mats[m].num_rows):
                cmd.arg1 = whole[m]
    if c.matrix_debug_info:
        _fix_debug_info(c, grown)


def _fix_debug_info(c: NnetComputation, grown: dict[int, int]) -> None:
    for m in grown:
        dbg = c.matrix_debug_info[m]
        old, new = len(dbg.cindexes), c.matrices[m].num_rows
        if new == old:
            continue
        extra = new - old
        if extra > old:
            raise CheckError(f"extend_matrices: m{m} grew from {old} to {new} rows")
        # the added rows copy the cindexes just before them, without a time; a
        # new entry, since copies of the computation share the old one
        if type(dbg.cindexes) is DebugCindexes:
            # the compiler's array form: the rows grow without making the pairs
            rows = dbg.cindexes.rows
            tail = rows[old - extra:old].copy()
            tail[:, 2] = K_NO_TIME
            cindexes = DebugCindexes(np.concatenate((rows, tail)))
        else:
            cindexes = list(dbg.cindexes) + [
                Cindex(node, Index(idx.n, K_NO_TIME, idx.x))
                for node, idx in dbg.cindexes[old - extra:old]]
        c.matrix_debug_info[m] = MatrixDebugInfo(dbg.is_deriv, cindexes)


def _apply_native(c: NnetComputation, found) -> bool:
    """Make the changes the C form of ``_extend`` + ``_fix_computation`` found
    (engine/optimizer/_native.c, extend_matrices); whether a copy was extended."""
    new_subs, grown, copies, edits = found
    if not copies:
        return False
    c.submatrices.extend(SubMatrixInfo(*x) for x in new_subs)
    mats, cmds = c.matrices, c.commands
    before = {}
    for m, rows_before, rows in grown:
        mats[m] = mats[m]._replace(num_rows=rows)
        before[m] = rows_before
    for i, a1, a2 in copies:
        cmd = cmds[i]
        cmd.arg1, cmd.arg2 = a1, a2
    for i, a1 in edits:
        cmds[i].arg1 = a1
    if c.matrix_debug_info:
        _fix_debug_info(c, before)
    return True


def extend_matrices(computation: NnetComputation, ctx=None) -> bool:
    """Kaldi's ExtendMatrices; returns True if any matrix was extended.  Given a
    ``ctx`` (the pipeline's), it also takes over the renumbering Kaldi does after
    the row-op passes (the pipeline then skips its own) and the one after its own
    changes, and leaves that one renumbering to variable merging's final one when
    that pass runs next (``ctx.renumber_due``), else does it here.  Neither what is
    extended or merged nor the end result depends on the numbering in between:
    both passes look at extents, and a renumbering keeps the order of what it keeps,
    taking the first of equal entries (the renumbered computation's first is the
    first in use before).

    The walk and the fix-up run in C when the extension is built
    (engine.optimizer.native): ``_extend`` and ``_fix_computation`` are their
    reference form, and run when the C code leaves the computation to Python."""
    pending = ctx is not None and any(ctx.changed.get(n) for n in ROW_OP_PASSES)
    found = None
    if native.NATIVE is not None:
        found = native.NATIVE.extend_matrices(computation.commands, computation.submatrices,
                                              computation.matrices, MIN_PROPORTION)
    if found is not None:
        changed = _apply_native(computation, found)
    else:
        changed, grown = _extend(computation)
        if changed:
            _fix_computation(computation, grown)
    if changed or pending:
        if ctx is not None and merges_variables(ctx.options):
            ctx.renumber_due = True    # variable merging renumbers at its end
        else:
            renumber_computation(computation)
    return changed or pending
