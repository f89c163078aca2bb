"""Row gathers moved before row-wise components, for inference (an nnetc computation
rewrite; Kaldi has no counterpart).

A batched chunk request lists its outputs sequence by sequence (n-major), while the
compiler orders a node's rows time by time (t-major, the sequences inside each t).  The
optimized computation therefore ends with the last component writing a t-major matrix M
and a kCopyRows that reorders M into the output matrix::

    M = undefined(R, D)
    comp.Propagate(NULL, X, &M)        # X: R x K, M: R x D
    ...
    out.CopyRows(1, M[i0, i1, ...])    # every index valid
    M = []

For a component whose output row r is a function of input row r alone (an affine, a
softmax), gathering the rows before the component gives the same rows, and a gather of
the narrower input is cheaper than one of the output (a chain model's output is
thousands of columns wide; its input a few hundred)::

    M = undefined(R', K)               # R' = number of indexes
    M.CopyRows(1, X[i0, i1, ...])      # where the propagate was: X is read as before
    ...
    comp.Propagate(NULL, M, &out)      # where the copy was: writes the output rows

Each output row is the same function of the same input row, so outputs are those of
the computation as compiled to float32 rounding (each row is its own dot products; the
same bits where the BLAS blocks the two products alike).  Peak bytes can only go down
(M narrows from D to K columns).  The command count is unchanged.  Repeated to a fixed
point, so a gather moves through a chain (an affine and its log-softmax).

Conditions, per kCopyRows with alpha 1 and no -1 index whose source is a whole matrix
M: the only commands that name M are its allocation and deallocation, one propagate
before the copy that writes all of M from another matrix's rows (no precomputed
indexes, memo or stored stats), and the copy; the component is of a row-wise type
(``ROW_WISE``, exact types: a subclass may not be row-wise); the propagate's input has
M's rows.  Matrices that are inputs or outputs, swapped or zeroed are named by other
commands and so left alone.

For decoding computations (engine.inference.common.CachingCompiler): the computation
no longer matches Kaldi's command for command (the propagate moves), which the
conformance statistics compare, and derivatives are not considered (a computation
with a backward pass names M in it, so nothing moves).
"""

from __future__ import annotations

import numpy as np

from engine.compiler.computation import (COMMAND_SPECS, ArgKind, Command, CommandType as CT,
                                         DebugCindexes, MatrixDebugInfo, MatrixInfo,
                                         NnetComputation, SubMatrixInfo, command_types,
                                         positions)
from engine.nnet.components.affine import (AffineComponent, FixedAffineComponent,
                                           NaturalGradientAffineComponent)
from engine.nnet.components.nonlinear import LogSoftmaxComponent, SoftmaxComponent

#: component types whose output row r depends on input row r alone and that write
#: (not add to) their output
ROW_WISE = (AffineComponent, NaturalGradientAffineComponent, FixedAffineComponent,
            SoftmaxComponent, LogSoftmaxComponent)

_ARGS = ("arg1", "arg2", "arg3", "arg4", "arg5", "arg6", "arg7")
# per command type: the names of its submatrix slots, and of its indexes_multi slot or None
_SLOTS = {ct: (tuple(a for slot, a in zip(spec.slots, _ARGS) if slot.kind == ArgKind.SUBMATRIX),
               next((a for slot, a in zip(spec.slots, _ARGS)
                     if slot.kind == ArgKind.INDEXES_MULTI), None))
          for ct, spec in COMMAND_SPECS.items()}


def _names(computation: NnetComputation, c: Command, m: int) -> bool:
    """Command ``c`` names a submatrix of matrix ``m`` (any slot, or its indexes_multi list)."""
    subs = computation.submatrices
    names, multi = _SLOTS[c.command_type]
    for a in names:
        s = getattr(c, a)
        if s > 0 and subs[s].matrix_index == m:
            return True
    if multi is not None:
        k = getattr(c, multi)
        if k >= 0:
            return any(s > 0 and subs[s].matrix_index == m
                       for s, _ in computation.indexes_multi[k])
    return False


def _movable(computation: NnetComputation, nnet, ci: int):
    """(propagate command index, matrix M) when the kCopyRows at ``ci`` can move
    before the propagate that writes its source (module docstring), else None.  Only
    M's lifetime is walked: back from the copy to M's allocation, forward to its
    deallocation (no command outside them can name it)."""
    cmds, subs = computation.commands, computation.submatrices
    c = cmds[ci]
    if c.command_type != CT.COPY_ROWS or c.alpha != 1.0 or c.arg2 <= 0 or c.arg1 <= 0:
        return None
    if not computation.is_whole_matrix(c.arg2):
        return None
    m = subs[c.arg2].matrix_index
    pi = -1
    k = ci - 1
    while True:
        if k < 0:
            return None        # no allocation: an input
        d = cmds[k]
        if _names(computation, d, m):
            if d.command_type == CT.ALLOC_MATRIX:
                break
            if pi >= 0:
                return None    # another command names M
            pi = k
        k -= 1
    if pi < 0 or not computation.is_whole_matrix(d.arg1):
        return None
    for k in range(ci + 1, len(cmds)):
        d = cmds[k]
        if _names(computation, d, m):
            if d.command_type != CT.DEALLOC_MATRIX or not computation.is_whole_matrix(d.arg1):
                return None    # read again, swapped, or an output
            break
    else:
        return None
    p = cmds[pi]
    if (p.command_type != CT.PROPAGATE or p.arg2 != 0 or p.arg5 > 0 or p.arg6 > 0
            or p.arg3 <= 0 or p.arg4 <= 0 or not computation.is_whole_matrix(p.arg4)
            or subs[p.arg3].matrix_index == m
            or type(nnet.components[p.arg1]) not in ROW_WISE
            or subs[p.arg3].num_rows != computation.matrices[m].num_rows):
        return None
    idx = computation.indexes[c.arg3]
    if len(idx) == 0 or min(idx) < 0:
        return None
    return pi, m


def _debug_rows(computation: NnetComputation, x: SubMatrixInfo, idx) -> MatrixDebugInfo | None:
    """Debug info of the gathered matrix: the cindexes of the input's rows, gathered."""
    info = computation.matrix_debug_info
    if not info:
        return None
    src = info[x.matrix_index]
    rows = np.asarray(idx, dtype=np.int64) + x.row_offset
    if isinstance(src.cindexes, DebugCindexes):
        return MatrixDebugInfo(src.is_deriv, DebugCindexes(src.cindexes.rows[rows]))
    return MatrixDebugInfo(src.is_deriv, [src.cindexes[r] for r in rows.tolist()])


def gather_before_row_wise(computation: NnetComputation, nnet) -> int:
    """Move each movable kCopyRows before the row-wise propagate that writes its source
    (module docstring), in place, until none moves; returns the number of moves."""
    cmds, subs = computation.commands, computation.submatrices
    # the copies, found by a scan in C; a moved copy is tried again where it went
    todo = positions(command_types(cmds), CT.COPY_ROWS)
    moves = 0
    while todo:
        ci = todo.pop()
        found = _movable(computation, nnet, ci)
        if found is None:
            continue
        pi, m = found
        p, c = cmds[pi], cmds[ci]
        x = subs[p.arg3]
        rows = len(computation.indexes[c.arg3])
        old = computation.matrices[m]
        computation.matrices[m] = MatrixInfo(rows, x.num_cols, old.stride_type)
        for s in range(1, len(subs)):
            if subs[s].matrix_index == m:
                subs[s] = SubMatrixInfo(m, 0, rows, 0, x.num_cols)
        debug = _debug_rows(computation, x, computation.indexes[c.arg3])
        if debug is not None:
            computation.matrix_debug_info[m] = debug
        # the gather where the propagate was (reading the input when it did), the
        # propagate where the gather was (writing the copy's destination)
        cmds[pi] = Command.make(CT.COPY_ROWS, p.arg4, p.arg3, c.arg3)
        cmds[ci] = Command.make(CT.PROPAGATE, p.arg1, p.arg2, c.arg2, c.arg1, p.arg5, p.arg6,
                                p.arg7)
        todo.append(pi)
        moves += 1
    return moves
