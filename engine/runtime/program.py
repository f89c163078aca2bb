"""The executor's command list compiled into closures (the dispatch loop of
Kaldi's NnetComputer::Run / ExecuteCommand, nnet-compute.cc, without its
per-command interpretation cost).

Kaldi's C++ ``ExecuteCommand`` pays a switch and a few pointer loads per
command; a Python interpreter that re-reads the command, looks its submatrices
up and compares shapes on every run pays several microseconds instead, which
dominates small chunks (a 21-frame BLSTM chunk is ~2000 commands).  So each
command is turned, once per computation and backend, into a closure with
everything static already bound: matrix numbers, slice tuples of its
submatrices, row/pointer/range plans, alpha, and shape checks done at build
time when they depend only on the computation.  A run then is one loop calling
``op(executor, matrices)``; the closure returns a new program counter only for
kGotoLabel.

Results are identical to the interpreted handlers of executor.py (the same
NumPy/CuPy operations in the same order, only without the lookups); commands
whose cost is dominated by their own work (backprop, propagate that stores
statistics) simply call those handlers.

Matrices are re-read from the executor's list on every call, never bound into
the closures, because allocation, swapping and state import replace them.
"""

from __future__ import annotations

import numpy as np

from engine.compiler.computation import CommandType as CT
from engine.runtime import kernels as K
from engine.runtime.fastpaths import fast_propagate


def _views(computation):
    """Per submatrix: (matrix index, None for the whole matrix or a slice pair)."""
    out = [(0, None)]
    mats = computation.matrices
    for sm in computation.submatrices[1:]:
        mi = mats[sm.matrix_index]
        if (sm.row_offset == 0 and sm.col_offset == 0 and sm.num_rows == mi.num_rows
                and sm.num_cols == mi.num_cols):
            out.append((sm.matrix_index, None))
        else:
            out.append((sm.matrix_index,
                        (slice(sm.row_offset, sm.row_offset + sm.num_rows),
                         slice(sm.col_offset, sm.col_offset + sm.num_cols))))
    return out


def _getter(xp, views, s):
    """A function mats -> the array of submatrix ``s``."""
    if s == 0:
        # Kaldi's empty submatrix (e.g. the input of a component that needs none)
        return lambda mats: xp.zeros((0, 0), dtype=np.float32)
    m, key = views[s]
    if key is None:
        return lambda mats: mats[m]
    return lambda mats: mats[m][key]


def _shape(computation, s):
    sm = computation.submatrices[s]
    return (sm.num_rows, sm.num_cols)


def _raiser(message):
    def op(ex, mats):
        raise ValueError(message)
    return op


def command_matrices(computation, c) -> list[int]:
    """Matrix numbers a command names through its submatrix arguments (used to
    diagnose 'used before it is allocated' after a compiled command fails)."""
    from engine.compiler.computation import COMMAND_SPECS, ArgKind  # noqa: PLC0415
    out = []
    for pos, slot in enumerate(COMMAND_SPECS[c.command_type].slots, start=1):
        if slot.kind == ArgKind.SUBMATRIX:
            s = getattr(c, f"arg{pos}")
            if s > 0:
                out.append(computation.submatrices[s].matrix_index)
    return out


class ProgramBuilder:
    """Builds the closures for one computation on one backend."""

    def __init__(self, computation, xp, plan, components=None):
        self.c = computation
        self.xp = xp
        self.components = components   # to choose fast propagates (fastpaths.py)
        self.plan = plan            # Executor._plan-like: (kind, index) -> kernel plan
        self.views = _views(computation)

    def build(self) -> list:
        ops = []
        for c in self.c.commands:
            ct = c.command_type
            if ct in (CT.ACCEPT_INPUT, CT.PROVIDE_OUTPUT):
                ops.append(None)     # the run loop stops here
                continue
            make = _FACTORIES.get(ct)
            ops.append(make(self, c) if make is not None else _slow(c))
        return ops

    # -- one factory per command type ------------------------------------------------------
    def alloc(self, c):
        m = self.c.submatrices[c.arg1].matrix_index
        info = self.c.matrices[m]
        rows, cols, xp = info.num_rows, info.num_cols, self.xp

        def op(ex, mats):
            old = mats[m]
            if old is not None:
                ex.pool.release(xp, old)
            mats[m] = ex.pool.get(xp, rows, cols)
        return op

    def dealloc(self, c):
        m = self.c.submatrices[c.arg1].matrix_index
        xp = self.xp

        def op(ex, mats):
            old = mats[m]
            if old is not None:
                ex.pool.release(xp, old)
                mats[m] = None
        return op

    def swap(self, c):
        m1 = self.c.submatrices[c.arg1].matrix_index
        m2 = self.c.submatrices[c.arg2].matrix_index

        def op(ex, mats):
            mats[m1], mats[m2] = mats[m2], mats[m1]
        return op

    def set_const(self, c):
        alpha = c.alpha
        if c.arg1 == 0:
            return _nop
        m, key = self.views[c.arg1]
        if key is None:
            def op(ex, mats):
                mats[m].fill(alpha)
        else:
            def op(ex, mats):
                mats[m][key] = alpha
        return op

    def propagate(self, c):
        if c.arg6:      # stores statistics: rare (training), keep the full handler
            return _slow(c)
        ci, pi, memo_index = c.arg1, c.arg2, c.arg5
        get_in = _getter(self.xp, self.views, c.arg3)
        m_out, key_out = self.views[c.arg4]
        if c.arg4 == 0:
            get_out = _getter(self.xp, self.views, 0)
        elif key_out is None:
            def get_out(mats):
                return mats[m_out]
        else:
            def get_out(mats):
                return mats[m_out][key_out]
        fast, ctype = None, None
        if self.xp is np and self.components is not None and ci < len(self.components):
            ctype = type(self.components[ci])
            fast = fast_propagate(ctype)
        if memo_index > 0:
            def op(ex, mats):
                ex._memos[memo_index] = ex._components[ci].propagate(
                    ex._precomputed[pi], get_in(mats), get_out(mats))
        elif fast is not None:
            def op(ex, mats):
                comp = ex._components[ci]
                if type(comp) is ctype:
                    fast(comp, ex._precomputed[pi], get_in(mats), get_out(mats))
                else:
                    comp.propagate(ex._precomputed[pi], get_in(mats), get_out(mats))
        elif c.arg3 > 0 and key_out is None and self.views[c.arg3][1] is None:
            m_in = self.views[c.arg3][0]

            def op(ex, mats):      # whole input, whole output
                ex._components[ci].propagate(ex._precomputed[pi], mats[m_in], mats[m_out])
        else:
            def op(ex, mats):
                ex._components[ci].propagate(ex._precomputed[pi], get_in(mats), get_out(mats))
        return op

    def matrix_copy(self, c):
        if _shape(self.c, c.arg1) != _shape(self.c, c.arg2):
            return _raiser(f"shape mismatch {_shape(self.c, c.arg1)} vs {_shape(self.c, c.arg2)}")
        get_d, get_s = _getter(self.xp, self.views, c.arg1), _getter(self.xp, self.views, c.arg2)
        alpha, xp = c.alpha, self.xp
        if alpha == 1.0:
            if c.arg1 == c.arg2:
                return _nop
            copyto = xp.copyto

            def op(ex, mats):
                copyto(get_d(mats), get_s(mats))
        else:
            multiply = xp.multiply

            def op(ex, mats):
                # float32 * Python float stays float32, as ``alpha * src`` does
                multiply(get_s(mats), alpha, out=get_d(mats))
        return op

    def matrix_add(self, c):
        if _shape(self.c, c.arg1) != _shape(self.c, c.arg2):
            return _raiser(f"shape mismatch {_shape(self.c, c.arg1)} vs {_shape(self.c, c.arg2)}")
        get_d, get_s = _getter(self.xp, self.views, c.arg1), _getter(self.xp, self.views, c.arg2)
        alpha, add = c.alpha, self.xp.add
        if alpha == 1.0:
            def op(ex, mats):
                d = get_d(mats)
                add(d, get_s(mats), out=d)
        else:
            def op(ex, mats):
                d = get_d(mats)
                add(d, alpha * get_s(mats), out=d)
        return op

    def copy_rows(self, c):
        get_d, get_s = _getter(self.xp, self.views, c.arg1), _getter(self.xp, self.views, c.arg2)
        plan, alpha, xp = self.plan("rows", c.arg3), c.alpha, self.xp
        fn = K.add_rows if c.command_type == CT.ADD_ROWS else K.copy_rows

        def op(ex, mats):
            fn(xp, get_d(mats), get_s(mats), plan, alpha)
        return op

    def rows_multi(self, c):
        get_d = _getter(self.xp, self.views, c.arg1)
        plan = K.make_matrix_multi_plan(self.xp, self.c, self.c.indexes_multi[c.arg2],
                                        self.views)
        alpha, xp, add = c.alpha, self.xp, c.command_type == CT.ADD_ROWS_MULTI

        def op(ex, mats):
            K.rows_multi_by_matrix(xp, get_d(mats), plan, mats, alpha, add)
        return op

    def to_rows_multi(self, c):
        if c.command_type == CT.COPY_TO_ROWS_MULTI and c.alpha != 1.0:
            return _raiser("CopyToRowsMulti does not support alpha != 1 (as in Kaldi)")
        get_s = _getter(self.xp, self.views, c.arg1)
        plan = K.make_matrix_multi_plan(self.xp, self.c, self.c.indexes_multi[c.arg2],
                                        self.views, scatter=True)
        alpha, xp, add = c.alpha, self.xp, c.command_type == CT.ADD_TO_ROWS_MULTI

        def op(ex, mats):
            K.to_rows_multi_by_matrix(xp, get_s(mats), plan, mats, alpha, add)
        return op

    def add_row_ranges(self, c):
        get_d, get_s = _getter(self.xp, self.views, c.arg1), _getter(self.xp, self.views, c.arg2)
        plan, alpha, xp = self.plan("ranges", c.arg3), c.alpha, self.xp

        def op(ex, mats):
            K.add_row_ranges(xp, get_d(mats), get_s(mats), plan, alpha)
        return op

    def compress(self, c):
        # Kaldi's CPU build leaves the matrix as it is (see Executor._compress); the
        # only effect is the check that the matrix exists.
        m = self.c.submatrices[c.arg1].matrix_index if c.arg1 > 0 else 0

        def op(ex, mats):
            if m and mats[m] is None:
                raise TypeError(f"matrix m{m} is not allocated")
        return op

    def noop(self, c):
        return _nop

    def goto(self, c):
        target = c.arg1
        cmds = self.c.commands
        if not (0 <= target < len(cmds)) or cmds[target].command_type != CT.NO_OPERATION_LABEL:
            return _raiser(f"goto target c{target} is not a label")

        def op(ex, mats):
            return target      # the loop then steps past the label
        return op


def _nop(ex, mats):
    return None


def _slow(c):
    """A command run by the executor's interpreted handler."""
    def op(ex, mats):
        ex._execute(c)
    return op


_FACTORIES = {
    CT.ALLOC_MATRIX: ProgramBuilder.alloc,
    CT.DEALLOC_MATRIX: ProgramBuilder.dealloc,
    CT.SWAP_MATRIX: ProgramBuilder.swap,
    CT.SET_CONST: ProgramBuilder.set_const,
    CT.PROPAGATE: ProgramBuilder.propagate,
    CT.MATRIX_COPY: ProgramBuilder.matrix_copy,
    CT.MATRIX_ADD: ProgramBuilder.matrix_add,
    CT.COPY_ROWS: ProgramBuilder.copy_rows,
    CT.ADD_ROWS: ProgramBuilder.copy_rows,
    CT.COPY_ROWS_MULTI: ProgramBuilder.rows_multi,
    CT.ADD_ROWS_MULTI: ProgramBuilder.rows_multi,
    CT.COPY_TO_ROWS_MULTI: ProgramBuilder.to_rows_multi,
    CT.ADD_TO_ROWS_MULTI: ProgramBuilder.to_rows_multi,
    CT.ADD_ROW_RANGES: ProgramBuilder.add_row_ranges,
    CT.COMPRESS_MATRIX: ProgramBuilder.compress,
    CT.DECOMPRESS_MATRIX: ProgramBuilder.compress,
    CT.NO_OPERATION: ProgramBuilder.noop,
    CT.NO_OPERATION_PERMANENT: ProgramBuilder.noop,
    CT.NO_OPERATION_MARKER: ProgramBuilder.noop,
    CT.NO_OPERATION_LABEL: ProgramBuilder.noop,
    CT.GOTO_LABEL: ProgramBuilder.goto,
    # BACKPROP / BACKPROP_NO_MODEL_UPDATE: the interpreted handler (see _slow)
}


def build_program(computation, xp, plan, components=None) -> list:
    """The closures of ``computation``'s commands (None for input/output commands).
    ``components``: the network's components, to pick fast propagates by type."""
    return ProgramBuilder(computation, xp, plan, components).build()
