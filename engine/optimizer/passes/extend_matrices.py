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

from engine.compiler.computation import MatrixDebugInfo, NnetComputation, SubMatrixInfo
from engine.core.errors import CheckError
from engine.core.index import K_NO_TIME, Cindex, Index
from engine.optimizer.analysis import CT
from engine.optimizer.passes.renumber import renumber_computation

# keep in sync with the checker's allowance for reading extended rows
MIN_PROPORTION = 0.8


class _MatrixExtender:
    def __init__(self, computation: NnetComputation):
        self.c = computation
        self.orig_num_rows = [m.num_rows for m in computation.matrices]
        self.is_io = [False] * len(computation.matrices)
        self.copies = []   # the kMatrixCopy commands with alpha 1, in order
        swap, io, copy = CT.SWAP_MATRIX, (CT.ACCEPT_INPUT, CT.PROVIDE_OUTPUT), CT.MATRIX_COPY
        for cmd in computation.commands:
            ct = cmd.command_type
            if ct == copy:
                if cmd.alpha == 1.0:
                    self.copies.append(cmd)
            elif ct == swap:
                raise CheckError("extend_matrices: the computation already has kSwapMatrix "
                                 "commands (it must run before the allocation passes)")
            if ct in io:
                self.is_io[computation.submatrices[cmd.arg1].matrix_index] = True

    def can_be_extended(self, dest_s: int, src_s: int) -> bool:
        c = self.c
        src, dest = c.submatrices[src_s], c.submatrices[dest_s]
        if src.matrix_index == dest.matrix_index or self.is_io[dest.matrix_index]:
            return False
        src_mat = c.matrices[src.matrix_index]
        if src.num_rows < MIN_PROPORTION * self.orig_num_rows[src.matrix_index]:
            return False
        return (src.col_offset == 0 and src.num_cols == src_mat.num_cols
                and src.row_offset == 0 and src.num_rows < src_mat.num_rows
                and dest.row_offset + dest.num_rows == self.orig_num_rows[dest.matrix_index])

    def extend(self, cmd) -> None:
        c = self.c
        src, dest = c.submatrices[cmd.arg2], c.submatrices[cmd.arg1]
        src_mat = c.matrices[src.matrix_index]
        dest_mat = c.matrices[dest.matrix_index]
        new_dest_rows = dest.row_offset + src_mat.num_rows
        if new_dest_rows > dest_mat.num_rows:
            c.matrices[dest.matrix_index] = dest_mat._replace(num_rows=new_dest_rows)
            c.submatrices.append(SubMatrixInfo(dest.matrix_index, 0, new_dest_rows, 0,
                                               dest_mat.num_cols))
        c.submatrices.append(dest._replace(num_rows=src_mat.num_rows))
        cmd.arg1 = len(c.submatrices) - 1
        c.submatrices.append(SubMatrixInfo(src.matrix_index, 0, src_mat.num_rows, 0,
                                           src_mat.num_cols))
        cmd.arg2 = len(c.submatrices) - 1

    def run(self) -> bool:
        changed = False
        for cmd in self.copies:
            if self.can_be_extended(cmd.arg1, cmd.arg2):
                self.extend(cmd)
                changed = True
        if changed:
            self.fix_computation()
        return changed

    def fix_computation(self) -> None:
        c = self.c
        whole = c.whole_submatrices()
        subs, mats, orig_num_rows = c.submatrices, c.matrices, self.orig_num_rows
        sizing, set_const = (CT.ALLOC_MATRIX, CT.DEALLOC_MATRIX), CT.SET_CONST
        for cmd in c.commands:
            ct = cmd.command_type
            if ct in sizing:
                cmd.arg1 = whole[subs[cmd.arg1][0]]
            elif ct == set_const and cmd.alpha == 0.0:
                m, ro, nr, co, nc = subs[cmd.arg1]
                # only a zeroing of the whole (original) matrix grows with it
                if ro == 0 and co == 0 and nc == mats[m].num_cols and nr == orig_num_rows[m]:
                    cmd.arg1 = whole[m]
        if c.matrix_debug_info:
            self.fix_debug_info()
        renumber_computation(c)

    def fix_debug_info(self) -> None:
        c = self.c
        for m in range(1, len(c.matrices)):
            dbg = c.matrix_debug_info[m]
            old, new = len(dbg.cindexes), c.matrices[m].num_rows
            if new == old:
                continue
            extra = new - old
            if extra > old:
                raise CheckError(f"extend_matrices: m{m} grew from {old} to {new} rows")
            # the added rows copy the cindexes just before them, without a time
            tail = [Cindex(node, Index(idx.n, K_NO_TIME, idx.x))
                    for node, idx in dbg.cindexes[old - extra:old]]
            # a new entry: copies of the computation share the old one
            c.matrix_debug_info[m] = MatrixDebugInfo(dbg.is_deriv, list(dbg.cindexes) + tail)


def extend_matrices(computation: NnetComputation, ctx=None) -> bool:
    """Kaldi's ExtendMatrices; returns True if any matrix was extended."""
    return _MatrixExtender(computation).run()
