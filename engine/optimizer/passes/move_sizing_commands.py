"""Moving allocation and deallocation: Kaldi's MoveSizingCommands (nnet-optimize.cc).

The compiler allocates every matrix at the start and frees it at the end, which
makes peak memory the sum of all matrices.  This pass moves each kAllocMatrix
(together with a kSetConst(0) right after it, treated as one unit) to just
before the first command that touches the matrix, and each kDeallocMatrix to
just after the last one.  Input and output commands stay where they are, and
so do swaps (this pass runs before the looped optimization adds any).
"""

from __future__ import annotations

from operator import attrgetter, is_not

from engine.compiler.computation import CommandType, NnetComputation
from engine.optimizer import native
from engine.optimizer.analysis import CT
from engine.optimizer.passes._edit import touched_slots


def _make_plan(ct: CommandType) -> tuple | None:
    """(getter of the submatrix slots as a tuple, getter of the indexes_multi slot
    or None) for a command type that touches submatrices, else None."""
    names, _, multi, _ = touched_slots(ct)
    if not names and multi is None:
        return None
    get = attrgetter(*names) if len(names) > 1 else (
        (lambda c, g=attrgetter(names[0]): (g(c),)) if names else (lambda c: ()))
    return get, attrgetter(multi) if multi is not None else None


# indexed by command type
_PLANS = [_make_plan(t) for t in CommandType]


def move_sizing_commands(computation: NnetComputation, ctx=None) -> bool:
    """Kaldi's MoveSizingCommands: the commands are sorted by a key, 3 * their
    index, except that an allocation gets 3 * (the first command to access its
    matrix) - 1 ("just before") and a deallocation 3 * (the last one) + 1
    ("just after"); the sort is stable, so ties keep command order.  A zeroing
    that follows its allocation gets the allocation's key, which keeps the two
    together (no other command has a position between them).

    What the keys need of the analysis -- each matrix's allocation,
    deallocation and first, second and last accessing commands -- comes from
    one walk over the commands.  The walk and the sort run in C when the extension is
    built (engine.optimizer.native); this is their reference form, and the one that
    runs when the C code leaves the computation to Python (an error to report)."""
    if native.NATIVE is not None:
        found = native.NATIVE.move_sizing_commands(
            computation.commands, computation.submatrices, len(computation.matrices),
            computation.indexes_multi)
        if found is not None:
            computation.commands, changed = found
            return changed
    cmds, subs, indexes_multi = computation.commands, computation.submatrices, \
        computation.indexes_multi
    n, nm = len(cmds), len(computation.matrices)
    alloc_t, set_const, dealloc_t, goto = (CT.ALLOC_MATRIX, CT.SET_CONST, CT.DEALLOC_MATRIX,
                                           CT.GOTO_LABEL)
    plans = _PLANS
    alloc_at, dealloc_at = [-1] * nm, [-1] * nm
    first, second, last = [-1] * nm, [-1] * nm, [-1] * nm   # accessing commands
    for i, c in enumerate(cmds):
        ct = c.command_type
        if ct == alloc_t:
            alloc_at[subs[c.arg1][0]] = i
            continue
        if ct == dealloc_t:
            dealloc_at[subs[c.arg1][0]] = i
            continue
        plan = plans[ct]
        if plan is None:
            if ct == goto:
                raise ValueError("move_sizing_commands must run before the looped "
                                 "optimization")
            continue
        get, get_multi = plan
        touched = get(c)
        if get_multi is not None:
            touched = [*touched, *(s for s, _ in indexes_multi[get_multi(c)])]
        for s in touched:
            if s <= 0:
                continue
            m = subs[s][0]
            f = first[m]
            if f == -1:
                first[m] = i
            elif f != i and second[m] == -1:
                second[m] = i
            last[m] = i
    key = list(range(0, 3 * n, 3))
    for m in range(1, nm):
        f = first[m]
        if f == -1:
            continue   # nothing accesses m: it is not moved
        alloc = alloc_at[m]
        if alloc != -1:
            if f == alloc + 1:
                zero = cmds[f]
                if (zero.command_type == set_const and zero.arg1 == cmds[alloc].arg1
                        and zero.alpha == 0.0):
                    # an (allocation, zeroing) pair: it moves to the next command
                    # to access m, and the zeroing with it
                    f = second[m]
                    if f != -1:
                        key[alloc + 1] = 3 * f - 1
            if f != -1:
                if f <= alloc:
                    raise ValueError(f"move_sizing_commands: m{m} used (c{f}) before its "
                                     f"allocation (c{alloc})")
                key[alloc] = 3 * f - 1
        if dealloc_at[m] != -1:
            key[dealloc_at[m]] = 3 * last[m] + 1
    new = list(map(cmds.__getitem__, sorted(range(n), key=key.__getitem__)))
    changed = any(map(is_not, new, cmds))
    computation.commands = new
    return changed
