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

from operator import attrgetter

from engine.compiler.computation import CommandType, NnetComputation
from engine.optimizer import native
from engine.optimizer.analysis import CT
from engine.optimizer.passes._edit import ADDITION_TO_COPY, touched_slots


def _make_plan(ct: CommandType) -> tuple | None:
    """What the walk needs of a command type (``touched_slots``): (getter of the
    one submatrix slot, or None; getter of the submatrix slots as a tuple when
    there are several, or None; getter of the indexes_multi slot or None; the
    copy form when ``ct`` is an addition, else None; getter of its written
    submatrix slot or None; whether it writes the indexes_multi submatrices).
    None for a type that touches no submatrix."""
    names, written, multi, multi_written = touched_slots(ct)
    if not names and multi is None:
        return None
    copy_form = ADDITION_TO_COPY.get(ct)
    if copy_form is not None and len(written) > 1:
        raise AssertionError(f"{ct.name} writes more than one submatrix slot")
    return (attrgetter(names[0]) if len(names) == 1 else None,
            attrgetter(*names) if len(names) > 1 else None,
            attrgetter(multi) if multi is not None else None, copy_form,
            attrgetter(written[0]) if written else None, multi_written)


# indexed by command type
_PLANS = [_make_plan(t) for t in CommandType]



def convert_addition_to_assignment(computation: NnetComputation, ctx=None) -> bool:
    """Kaldi's ConvertAdditionToAssignment; returns True if a command was converted.

    An addition converts when no earlier command other than a zeroing touches
    any part of what it writes (Kaldi asks ComputationAnalysis for the first
    non-zeroing access of each written submatrix).  Converting changes no
    command into or out of a zeroing, so the answers do not depend on earlier
    conversions and one walk over the commands gives them all: it keeps, for
    each matrix, the submatrices that non-zeroing commands have touched so
    far, and tests each addition's written submatrices against them before
    recording what it touches itself.  Which submatrices a command touches
    does not depend on whether it reads or writes them, so the walk takes them
    from the command's slots (COMMAND_SPECS) directly.

    The walk runs in C when the extension is built (engine.optimizer.native); this
    is its reference form, and the one that runs when the C code leaves the
    computation to Python."""
    if native.NATIVE is not None:
        cmds = computation.commands
        found = native.NATIVE.convert_addition(cmds, computation.submatrices,
                                               len(computation.matrices),
                                               computation.indexes_multi)
        if found is not None:
            for i in found:
                c = cmds[i]
                c.command_type = ADDITION_TO_COPY[c.command_type]
            if found and hasattr(ctx, "invalidate"):
                ctx.invalidate()
            return bool(found)
    plans, add_to_rows_multi, set_const = _PLANS, CT.ADD_TO_ROWS_MULTI, CT.SET_CONST
    subs, indexes_multi = computation.submatrices, computation.indexes_multi
    multi_subs: dict[int, list[int]] = {}   # indexes_multi entry -> its submatrices
    seen = _Touched(subs, len(computation.matrices))
    add = seen.add
    changed = False
    for c in computation.commands:
        ct = c.command_type
        plan = plans[ct]
        if plan is None or (ct == set_const and c.alpha == 0.0):
            continue   # touches nothing; or zeroing, which does not count here
        get1, get, get_multi, copy_form, get_written, multi_written = plan
        multi = ()
        if get_multi is not None:
            k = get_multi(c)
            multi = multi_subs.get(k)
            if multi is None:
                multi = multi_subs[k] = sorted({s for s, _ in indexes_multi[k] if s > 0})
        if copy_form is not None and (ct != add_to_rows_multi or c.alpha == 1.0):
            first = True
            if get_written is not None:
                s = get_written(c)
                if s > 0:
                    first = seen.untouched(s)
            if first and multi_written:
                first = all(seen.untouched(s) for s in multi)
            if first:
                c.command_type = copy_form
                changed = True
        if get1 is not None:
            s = get1(c)
            if s > 0:
                add(s)
        else:
            for s in get(c):
                if s > 0:
                    add(s)
        for s in multi:
            add(s)
    if changed and hasattr(ctx, "invalidate"):
        ctx.invalidate()
    return changed


class _Touched:
    """The parts of each matrix touched so far: its distinct rectangles and their
    bounding box.  A rectangle outside the box is untouched at once (the column blocks
    of a long Append are written one after another: each test would otherwise scan all
    the blocks before it, quadratic in the number of terms); otherwise the distinct
    rectangles are scanned."""

    __slots__ = ("subs", "rects", "box")

    def __init__(self, subs: list, num_matrices: int) -> None:
        self.subs = subs
        self.rects: list[set | None] = [None] * num_matrices
        self.box: list[list[int] | None] = [None] * num_matrices

    def add(self, s: int) -> None:
        m, ro, nr, co, nc = self.subs[s]
        rects = self.rects[m]
        if rects is None:
            self.rects[m] = {(ro, ro + nr, co, co + nc)}
            self.box[m] = [ro, ro + nr, co, co + nc]
            return
        key = (ro, ro + nr, co, co + nc)
        if key in rects:
            return
        rects.add(key)
        b = self.box[m]
        if ro < b[0]:
            b[0] = ro
        if ro + nr > b[1]:
            b[1] = ro + nr
        if co < b[2]:
            b[2] = co
        if co + nc > b[3]:
            b[3] = co + nc

    def untouched(self, s: int) -> bool:
        """No rectangle touched so far overlaps submatrix ``s``."""
        m, ro, nr, co, nc = self.subs[s]
        rects = self.rects[m]
        if rects is None:
            return True
        R1, C1 = ro + nr, co + nc
        b = self.box[m]
        if not (b[0] < R1 and ro < b[1] and b[2] < C1 and co < b[3]):
            return True
        for r0, r1, c0, c1 in rects:
            if r0 < R1 and ro < r1 and c0 < C1 and co < c1:
                return False
        return True
