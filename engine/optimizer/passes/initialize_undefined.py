"""Dropping needless zeroing: Kaldi's RemoveUnnecessaryZeroing (nnet-optimize.cc),
gated by the option initialize_undefined.

The compiler zeroes every matrix after allocating it.  When every variable
(region) of a matrix is first *written* -- not added to or partly copied into
-- after that zeroing, the zeroing is wasted and becomes a no-op, leaving the
allocation undefined.  An output region that nothing ever writes (possible
when deriv-time limits cut a derivative) keeps its zeroing: the user reads it.

Kaldi asks this of each variable's access list.  When the zeroing covers the
matrix (the usual case) the answer comes from one walk over the commands after
it (``_decided_by_sweep``, ``_decided_by_rectangles``), without building the lists;
the lists decide only what the walks leave open.
"""

from __future__ import annotations

from operator import itemgetter

from engine.compiler.computation import NnetComputation
from engine.optimizer.analysis import CT
from engine.optimizer.pipeline import allocates_from_other
from engine.optimizer.passes.remove_no_ops import remove_no_ops

_R, _W = 1, 2   # read and write access, as bits (Analyzer.entries, variable_access_bits_of)
_RECT = itemgetter(2)   # the rectangle of an entry


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
    # the usual case first: writes of all rows, column block after column block
    # from the left, until the columns are covered by a command that touches the
    # matrix nowhere else after that (then the walk below stops there too: False);
    # anything else is left to it
    end = 0
    n = len(ents)
    for i in range(1, n):
        c, a, (r0, r1, c0, c1) = ents[i]
        if a != _W or c0 != end or r0 != 0 or r1 != nr:
            break
        end = c1
        if end == nc:
            if i + 1 == n or ents[i + 1][0] != c:
                return False
            break
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


def _inside(rect: tuple[int, int, int, int], rects: list) -> bool:
    """``rect`` lies within the union of ``rects``: nothing is left of it after
    taking each of them away in turn (the pieces left are rectangles)."""
    pieces = [rect]
    for q0, q1, d0, d1 in rects:
        rest = []
        for p in pieces:
            r0, r1, c0, c1 = p
            if q0 >= r1 or r0 >= q1 or d0 >= c1 or c0 >= d1:
                rest.append(p)
                continue
            if r0 < q0:
                rest.append((r0, q0, c0, c1))
            if q1 < r1:
                rest.append((q1, r1, c0, c1))
            lo, hi = max(r0, q0), min(r1, q1)
            if c0 < d0:
                rest.append((lo, hi, c0, d0))
            if d1 < c1:
                rest.append((lo, hi, d1, c1))
        if not rest:
            return True
        pieces = rest
    return False


def _decided_by_rectangles(ents: list, nr: int, nc: int, is_output: bool) -> bool | None:
    """``_decided_by_sweep`` for accesses of any shape, or None when the zeroing
    does not cover the matrix: the same walk, with the region covered so far
    kept as the list of rectangles the earlier commands accessed.  The zeros are
    needed when a command reads outside that region, or, for an output, when
    the region never becomes the whole matrix."""
    z, _, zr = ents[0]
    if zr != (0, nr, 0, nc) or len(ents) < 2 or ents[1][0] == z:
        return None
    reached: list = []
    i, n = 1, len(ents)
    while i < n:
        c = ents[i][0]
        start = i
        while i < n and ents[i][0] == c:
            _, a, r = ents[i]
            i += 1
            if a & _R and not _inside(r, reached):
                return True
        reached.extend(map(_RECT, ents[start:i]))
    return is_output and not _inside(zr, reached)


def unnecessary_zeroings(computation: NnetComputation, a) -> list[int]:
    """The zeroings (command indexes) that RemoveUnnecessaryZeroing turns into
    no-ops, found on ``a``, an Analyzer of ``computation``.  Only the order of
    command indexes and their equality matter here, and the rectangles
    accessed, so the answer is the same on an analysis taken before no-ops are
    deleted and the computation renumbered (what variable merging does just
    before this pass: see ``remove_unnecessary_zeroing``)."""
    cmds = computation.commands
    mats = computation.matrices
    set_const = CT.SET_CONST
    out = []
    entries = a.entries
    for m in range(1, len(mats)):
        ents = entries[m]
        if not ents:
            continue
        z, _, zr = ents[0]
        cmd = cmds[z]
        if not (cmd.command_type == set_const and cmd.alpha == 0.0):
            continue
        mi = mats[m]
        if len(ents) > 1 and zr == (0, mi.num_rows, 0, mi.num_cols):
            # the usual case, as _decided_by_sweep finds it: the next command to
            # touch the matrix writes all of it and touches it nowhere else
            c1, a1, r1 = ents[1]
            if (r1 == zr and not a1 & _R and c1 != z
                    and (len(ents) == 2 or ents[2][0] != c1)):
                out.append(z)
                continue
        ma = a.matrix_accesses[m]
        needed = _decided_by_sweep(ents, mi.num_rows, mi.num_cols, ma.is_output)
        if needed is None:
            needed = _decided_by_rectangles(ents, mi.num_rows, mi.num_cols, ma.is_output)
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
            out.append(z)
    return out


def remove_unnecessary_zeroing(computation: NnetComputation, ctx) -> bool:
    """Kaldi's RemoveUnnecessaryZeroing.  Variable merging, which runs just before,
    may have decided it already (``ctx.zeroings``: the computation, its number
    of commands, and the zeroing commands themselves), on its own analysis
    before it deleted its no-ops and renumbered: that spares bringing the
    analysis up to date through those edits for this pass alone."""
    decided = getattr(ctx, "zeroings", None)
    if decided is not None:
        ctx.zeroings = None
    if (decided is not None and decided[0] is computation
            and decided[1] == len(computation.commands)):
        gone = decided[2]
    else:
        cmds = computation.commands
        gone = [cmds[z] for z in unnecessary_zeroings(computation, ctx.analyzer(computation))]
    if not gone:
        return False
    noop = CT.NO_OPERATION
    for cmd in gone:
        cmd.command_type = noop
    # (the analysis is not brought up to date: the next pass, moving the
    # allocations, needs less of it than that costs and finds it itself)
    if allocates_from_other(ctx.options):
        # Kaldi leaves these no-ops to RemoveUnnecessaryAllocation, which deletes
        # every no-op at its end; deleted now, the passes in between have fewer
        # commands to walk and place nothing differently.  Without that pass they
        # stay, as in Kaldi's computation.
        remove_no_ops(computation)
    return True
