"""Moving allocation and deallocation: Kaldi's MoveSizingCommands (nnet-optimize.cc).

The compiler allocates every matrix at the start and frees it at the end, which
makes peak memory the sum of all matrices.  This pass moves each kAllocMatrix
(together with a kSetConst(0) right after it, treated as one unit) to just
before the first command that touches the matrix, and each kDeallocMatrix to
just after the last one.  Input and output commands stay where they are, and
so do swaps (this pass runs before the looped optimization adds any).
"""

from __future__ import annotations

from operator import is_not

from engine.compiler.computation import NnetComputation
from engine.optimizer.analysis import CT


def move_sizing_commands(computation: NnetComputation, ctx) -> bool:
    """Kaldi's MoveSizingCommands: the commands are sorted by a key, 3 * their
    index, except that an allocation gets 3 * (its matrix's first access) - 1
    ("just before") and a deallocation 3 * (the last access) + 1 ("just
    after"); the sort is stable, so ties keep command order.  A zeroing that
    follows its allocation gets the allocation's key, which keeps the two
    together (no other command has a position between them)."""
    cmds = computation.commands
    n = len(cmds)
    if CT.GOTO_LABEL in [c.command_type for c in cmds]:
        raise ValueError("move_sizing_commands must run before the looped optimization")
    a = ctx.analyzer(computation)
    alloc_t, set_const, dealloc_t = CT.ALLOC_MATRIX, CT.SET_CONST, CT.DEALLOC_MATRIX
    key = list(range(0, 3 * n, 3))
    for m, (ma, ents) in enumerate(zip(a.matrix_accesses, a.entries)):
        if not ents:
            continue   # (matrix 0, and matrices nothing reads or writes: not moved)
        alloc = ma.allocate_command
        if alloc != -1 and cmds[alloc].command_type == alloc_t:
            first = ents[0][0]
            zero = cmds[alloc + 1] if alloc + 1 < n else None
            if (first == alloc + 1 and zero.command_type == set_const
                    and zero.arg1 == cmds[alloc].arg1 and zero.alpha == 0.0):
                # an (allocation, zeroing) pair: it moves to the next command
                # to access m, and the zeroing with it
                first = next((c for c, _, _ in ents if c != first), -1)
                if first != -1:
                    key[alloc + 1] = 3 * first - 1
            if first != -1:
                if first <= alloc:
                    raise ValueError(f"move_sizing_commands: m{m} used (c{first}) before its "
                                     f"allocation (c{alloc})")
                key[alloc] = 3 * first - 1
        dealloc = ma.deallocate_command
        if dealloc != -1 and cmds[dealloc].command_type == dealloc_t:
            key[dealloc] = 3 * ents[-1][0] + 1
    new = list(map(cmds.__getitem__, sorted(range(n), key=key.__getitem__)))
    changed = any(map(is_not, new, cmds))
    computation.commands = new
    return changed
