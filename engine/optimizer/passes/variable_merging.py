"""Variable merging: Kaldi's VariableMergingOptimization / VariableMergingOptimizer
(nnet-optimize.cc, nnet-optimize-utils.cc).

Three kinds of command relate a source submatrix s1 to a destination s2 that
could share memory:

- ``s2 = s1`` (kMatrixCopy; option remove_assignments): if s2 is not touched
  before the copy and s1 is not written after it nor read after s2 changes, the
  two are one matrix and the copy disappears;
- propagate of a component with PROPAGATE_IN_PLACE (option propagate_in_place)
  when the input is last used by that propagate and the output first written by
  it;
- backprop of a component with BACKPROP_IN_PLACE (option backprop_in_place), the
  same for output-derivative and input-derivative.

Merging replaces one matrix (the "discarded" one) by a submatrix of the other
(the "kept" one).  A *left merge* keeps s1's matrix (s2 must then be a whole
matrix), a *right merge* keeps s2's (s1 must be whole); allow_left_merge /
allow_right_merge switch them.  The discarded matrix's allocation,
deallocation and initial zeroing become no-ops; inputs and outputs keep their
own matrix.  Each round merges every pair it can among variables not yet
touched by a merge in that round; rounds repeat until nothing merges.
"""

from __future__ import annotations

from engine.compiler.computation import (K_STRIDE_EQUAL_NUM_COLS, CommandType, NnetComputation,
                                         SubMatrixInfo)
from engine.nnet.components.base import ComponentProperty as P
from engine.optimizer.analysis import Analyzer, ComputationAnalysis, matrix_to_submatrices
from engine.optimizer.passes.remove_no_ops import remove_no_ops
from engine.optimizer.passes.renumber import renumber_computation

CT = CommandType


class VariableMergingOptimizer:
    def __init__(self, options, nnet, computation: NnetComputation):
        self.o = options
        self.nnet = nnet
        self.c = computation
        self.a = Analyzer(nnet, computation)
        self.analysis = ComputationAnalysis(computation, self.a)
        self.matrix_to_submatrix = matrix_to_submatrices(computation)
        self.dirty = [False] * self.a.variables.num_variables

    def _candidate(self, cmd) -> tuple[int, int]:
        """(s1, s2): source and destination that might be merged, or (-1, -1)."""
        o = self.o
        ct = cmd.command_type
        if ct == CT.MATRIX_COPY and o.remove_assignments:
            return cmd.arg2, cmd.arg1
        if ct == CT.PROPAGATE and o.propagate_in_place:
            if self.nnet.components[cmd.arg1].properties() & P.PROPAGATE_IN_PLACE:
                return cmd.arg3, cmd.arg4
        elif ct in (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE) and o.backprop_in_place:
            if self.nnet.components[cmd.arg1].properties() & P.BACKPROP_IN_PLACE:
                s1, s2 = cmd.arg5, cmd.arg6
                # the values the backprop reads must not be overwritten by it
                if cmd.arg3 in (s1, s2) or cmd.arg4 in (s1, s2):
                    return -1, -1
                return s1, s2
        return -1, -1

    def merge_variables(self) -> bool:
        merged = False
        for ci, cmd in enumerate(self.c.commands):
            s1, s2 = self._candidate(cmd)
            if s1 <= 0 or s2 <= 0:
                continue
            left, right = self.may_be_merged(ci, s1, s2)
            if left:
                self.do_merge(ci, s1, s2)
                merged = True
            elif right:
                self.do_merge(ci, s2, s1)
                merged = True
        if merged:
            renumber_computation(self.c)
            remove_no_ops(self.c)
        return merged

    def _mark_dirty(self, s: int) -> None:
        for v in self.a.variables.variables_for_submatrix[s]:
            self.dirty[v] = True

    def may_be_merged(self, ci: int, s1: int, s2: int) -> tuple[bool, bool]:
        """(left merge possible, right merge possible)."""
        o, c = self.o, self.c
        no = (False, False)
        if not o.allow_left_merge and not o.allow_right_merge:
            return no
        m1, m2 = c.submatrices[s1].matrix_index, c.submatrices[s2].matrix_index
        if m1 == m2:
            return no
        vfs = self.a.variables.variables_for_submatrix
        if any(self.dirty[v] for v in vfs[s1]) or any(self.dirty[v] for v in vfs[s2]):
            return no
        a1, a2 = self.a.matrix_accesses[m1], self.a.matrix_accesses[m2]
        if (a1.is_input and a2.is_input) or (a1.is_output and a2.is_output):
            return no
        whole1, whole2 = c.is_whole_matrix(s1), c.is_whole_matrix(s2)
        if (a1.is_input or a1.is_output or a2.is_input or a2.is_output) and not (whole1
                                                                                 and whole2):
            return no
        left = o.allow_left_merge and whole2
        right = o.allow_right_merge and whole1
        # a matrix that must be contiguous may only become a whole matrix
        if c.matrices[m2].stride_type == K_STRIDE_EQUAL_NUM_COLS and not whole1:
            left = False
        if c.matrices[m1].stride_type == K_STRIDE_EQUAL_NUM_COLS and not whole2:
            right = False
        # the kept matrix must exist before the discarded one is first used (Kaldi
        # asserts this; it can fail when one of the merge directions is switched off)
        an = self.analysis
        if left and not self._alloc_precedes(m1, m2):
            left = False
        if right and not self._alloc_precedes(m2, m1):
            right = False
        if not left and not right:
            return no
        cmd = c.commands[ci]
        if cmd.command_type == CT.MATRIX_COPY and cmd.alpha == 1.0:
            ok = (an.first_nontrivial_access(s2) == ci and an.last_write_access(s1) < ci
                  and an.last_access(s1) < an.data_invalidated_command(ci, s2))
        else:
            ok = an.first_nontrivial_access(s2) == ci and an.last_access(s1) == ci
        return (left, right) if ok else no

    def _alloc_precedes(self, m_keep: int, m_discard: int) -> bool:
        ma = self.a.matrix_accesses
        if self.c.commands[ma[m_discard].allocate_command].command_type == CT.ACCEPT_INPUT:
            return True   # the input's own matrix is used, allocated by kAcceptInput
        return self.analysis.first_nontrivial_matrix_access(m_discard) > ma[m_keep].allocate_command

    def do_merge(self, ci: int, s_keep: int, s_discard: int) -> None:
        c = self.c
        self._mark_dirty(s_keep)
        self._mark_dirty(s_discard)
        m_keep = c.submatrices[s_keep].matrix_index
        m_discard = c.submatrices[s_discard].matrix_index
        assert m_keep != m_discard and m_keep > 0 and m_discard > 0
        keep = c.submatrices[s_keep]
        # every submatrix of the discarded matrix becomes the same region of s_keep
        for s in self.matrix_to_submatrix[m_discard]:
            a = c.submatrices[s]
            c.submatrices[s] = SubMatrixInfo(keep.matrix_index, a.row_offset + keep.row_offset,
                                             a.num_rows, a.col_offset + keep.col_offset,
                                             a.num_cols)
        cmd = c.commands[ci]
        if cmd.command_type == CT.MATRIX_COPY and cmd.alpha == 1.0:
            cmd.command_type = CT.NO_OPERATION
            cmd.arg1 = cmd.arg2 = -1
        ma = self.a.matrix_accesses
        # one deallocation goes: the discarded matrix's, or, when it is an output
        # (never deallocated), the kept one's, since the output now owns the memory
        if ma[m_discard].deallocate_command != -1:
            c.commands[ma[m_discard].deallocate_command].command_type = CT.NO_OPERATION
        else:
            assert ma[m_keep].deallocate_command != -1
            c.commands[ma[m_keep].deallocate_command].command_type = CT.NO_OPERATION
        alloc_keep, alloc_discard = ma[m_keep].allocate_command, ma[m_discard].allocate_command
        assert alloc_keep != -1 and alloc_discard != -1
        if c.commands[alloc_discard].command_type == CT.ACCEPT_INPUT:
            # the input's matrix is the one that comes from the user: keep its "allocation"
            c.commands[alloc_keep].command_type = CT.NO_OPERATION
            zero_of = m_keep
        else:
            c.commands[alloc_discard].command_type = CT.NO_OPERATION
            zero_of = m_discard
        first = ma[zero_of].accesses[0][0] if ma[zero_of].accesses else -1
        if first >= 0:
            z = c.commands[first]
            if z.command_type == CT.SET_CONST and z.alpha == 0.0:
                z.command_type = CT.NO_OPERATION
        if c.matrices[m_discard].stride_type == K_STRIDE_EQUAL_NUM_COLS:
            c.matrices[m_keep] = c.matrices[m_keep]._replace(stride_type=K_STRIDE_EQUAL_NUM_COLS)


def variable_merging_optimization(computation: NnetComputation, ctx) -> bool:
    changed = False
    while VariableMergingOptimizer(ctx.options, ctx.nnet, computation).merge_variables():
        changed = True
    return changed
