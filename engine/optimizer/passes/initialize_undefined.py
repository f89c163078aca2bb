"""Dropping needless zeroing: Kaldi's RemoveUnnecessaryZeroing (nnet-optimize.cc),
gated by the option initialize_undefined.

The compiler zeroes every matrix after allocating it.  When every variable
(region) of a matrix is first *written* -- not added to or partly copied into
-- after that zeroing, the zeroing is wasted and becomes a no-op, leaving the
allocation undefined.  An output region that nothing ever writes (possible
when deriv-time limits cut a derivative) keeps its zeroing: the user reads it.

Kaldi asks this of each variable's access list.  When the zeroing covers the
matrix (the usual case) the answer comes from one walk over the commands after
it (``_decided_by_sweep``, ``_decided_on_grid``), without building the lists;
the lists decide only what the walks leave open.
"""

from __future__ import annotations

from engine.compiler.computation import NnetComputation
from engine.optimizer.analysis import CT
from engine.optimizer.passes.remove_no_ops import remove_no_ops

_R, _W = 1, 2   # read and write access, as bits (Analyzer.entries, variable_access_bits_of)


def _decided_by_sweep(ents: list, nr: int, nc: int, is_output: bool) -> bool | None:
    """Whether the zeroing of a matrix of ``nr`` x ``nc`` (the first command on it;
    ``ents`` its entries, Analyzer.entries) is needed, found by a walk over the
    commands after it, or None when the walk cannot tell (the generic test on
    the variables then decides).

    When the zeroing covers the matrix, every variable has it as first access,
    and its second access is the first later command that reaches it.  So,
    walking the later commands in order with the region they covered so far: a
    read that reaches beyond that region needs the zeros; once the region is
    the whole matrix, nothing more can; if it never gets there, some variables
    have only the zeroing, which matters only for an output.  The region is
    kept as intervals of rows (or of columns) while every access spans all
    columns (or rows); anything else gives up."""
    if len(ents) == 1:
        return is_output   # the zeroing is all there is: the zeros are the output
    z, _, zr = ents[0]
    if zr != (0, nr, 0, nc) or ents[1][0] == z:
        return None
    covered: list[tuple[int, int]] = []   # sorted, disjoint, not touching
    axis = -1                             # 0: intervals of rows, 1: of columns
    i, n = 1, len(ents)
    while i < n:
        c = ents[i][0]
        spans = []
        everything = False
        while i < n and ents[i][0] == c:
            _, a, (r0, r1, c0, c1) = ents[i]
            i += 1
            if r0 == 0 and r1 == nr and c0 == 0 and c1 == nc:
                if a & _R:
                    return True   # covered is not everything yet (else we stopped)
                everything = True
                continue
            if c0 == 0 and c1 == nc and axis != 1:
                axis, lo, hi = 0, r0, r1
            elif r0 == 0 and r1 == nr and axis != 0:
                axis, lo, hi = 1, c0, c1
            else:
                return None
            if a & _R and not any(x <= lo and hi <= y for x, y in covered):
                return True
            spans.append((lo, hi))
        if everything:
            return False   # c writes all of the matrix and reads nothing new
        for lo, hi in spans:
            merged = []
            for x, y in covered:
                if y < lo or hi < x:
                    merged.append((x, y))
                else:
                    lo, hi = min(lo, x), max(hi, y)
            merged.append((lo, hi))
            merged.sort()
            covered = merged
        if covered == [(0, nr if axis == 0 else nc)]:
            return False
    return is_output


def _decided_on_grid(ents: list, nr: int, nc: int, is_output: bool) -> bool | None:
    """``_decided_by_sweep`` for accesses of any shape, or None when the zeroing
    does not cover the matrix: the same walk, with the region covered so far
    kept as cells of the grid that the accesses cut the matrix into."""
    z, _, zr = ents[0]
    if zr != (0, nr, 0, nc) or len(ents) < 2 or ents[1][0] == z:
        return None
    rows = sorted({r for _, _, rc in ents for r in rc[:2]})
    cols = sorted({k for _, _, rc in ents for k in rc[2:]})
    ri = {p: i for i, p in enumerate(rows)}
    ki = {p: i for i, p in enumerate(cols)}
    ncv = len(cols) - 1
    left = (len(rows) - 1) * ncv   # cells no command after the zeroing reached yet
    reached = bytearray(left)
    i, n = 1, len(ents)
    while i < n:
        c = ents[i][0]
        new = []
        while i < n and ents[i][0] == c:
            _, a, (r0, r1, c0, c1) = ents[i]
            i += 1
            k0, k1 = ki[c0], ki[c1]
            for r in range(ri[r0], ri[r1]):
                base = r * ncv
                for k in range(base + k0, base + k1):
                    if not reached[k]:
                        if a & _R:
                            return True
                        new.append(k)
        for k in new:
            if not reached[k]:
                reached[k] = 1
                left -= 1
        if not left:
            return False
    return is_output


def remove_unnecessary_zeroing(computation: NnetComputation, ctx) -> bool:
    a = ctx.analyzer(computation)
    cmds = computation.commands
    mats = computation.matrices
    set_const = CT.SET_CONST
    changed = False
    for m in range(1, len(mats)):
        ma = a.matrix_accesses[m]
        if not ma.accesses:
            continue
        cmd = cmds[ma.accesses[0][0]]
        if not (cmd.command_type == set_const and cmd.alpha == 0.0):
            continue
        mi = mats[m]
        ents = a.entries[m]
        needed = _decided_by_sweep(ents, mi.num_rows, mi.num_cols, ma.is_output)
        if needed is None:
            needed = _decided_on_grid(ents, mi.num_rows, mi.num_cols, ma.is_output)
        if needed is None:
            needed = False
            for acc in a.variable_access_bits_of(m):
                if len(acc) > 1 and acc[1][1] != _W:
                    needed = True   # something reads or adds to the zeros
                    break
                if len(acc) == 1 and ma.is_output:
                    needed = True   # the zeros themselves are the output
                    break
        if not needed:
            cmd.command_type = CT.NO_OPERATION
            changed = True
    if changed:
        # the analysis follows the deletion (moving allocations needs it next)
        noop = CT.NO_OPERATION
        a.remove_commands({i for i, c in enumerate(cmds) if c.command_type == noop})
        remove_no_ops(computation)
        ctx.analysis_updated(a, computation)
    return changed
