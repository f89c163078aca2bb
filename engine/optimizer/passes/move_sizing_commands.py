"""Moving allocation and deallocation: Kaldi's MoveSizingCommands (nnet-optimize.cc).

The compiler allocates every matrix at the start and frees it at the end, which
makes peak memory the sum of all matrices.  This pass moves each kAllocMatrix
(together with a kSetConst(0) right after it, treated as one unit) to just
before the first command that touches the matrix, and each kDeallocMatrix to
just after the last one.  Input and output commands stay where they are, and
so do swaps (this pass runs before the looped optimization adds any).
"""

from __future__ import annotations

from engine.compiler.computation import NnetComputation
from engine.optimizer.analysis import CT



def move_sizing_commands(computation: NnetComputation, ctx) -> bool:
    cmds = computation.commands
    n = len(cmds)
    a = ctx.analyzer(computation)
    # (alloc, zero) pairs move together
    is_pair = [False] * n
    for i in range(n - 1):
        x, y = cmds[i], cmds[i + 1]
        if (x.command_type == CT.ALLOC_MATRIX and y.command_type == CT.SET_CONST
                and x.arg1 == y.arg1 and y.alpha == 0.0):
            is_pair[i] = True
    # sort keys are 3 * index, minus 1 for "just before", plus 1 for "just after"
    key = [3 * i for i in range(n)]
    for m in range(1, len(computation.matrices)):
        ma = a.matrix_accesses[m]
        alloc = ma.allocate_command
        if alloc != -1 and cmds[alloc].command_type == CT.ALLOC_MATRIX:
            first = -1
            if ma.accesses:
                first = ma.accesses[0][0]
                if first == alloc + 1 and is_pair[alloc]:
                    first = ma.accesses[1][0] if len(ma.accesses) > 1 else -1
            if first != -1:
                if first <= alloc:
                    raise ValueError(f"move_sizing_commands: m{m} used (c{first}) before its "
                                     f"allocation (c{alloc})")
                key[alloc] = 3 * first - 1
        dealloc = ma.deallocate_command
        if (dealloc != -1 and ma.accesses
                and cmds[dealloc].command_type == CT.DEALLOC_MATRIX):
            key[dealloc] = 3 * ma.accesses[-1][0] + 1
    order = sorted(range(n), key=key.__getitem__)   # stable: ties keep command order
    new = []
    for old in order:
        if cmds[old].command_type == CT.GOTO_LABEL:
            raise ValueError("move_sizing_commands must run before the looped optimization")
        if old > 0 and is_pair[old - 1]:
            continue  # the zeroing travels with its allocation
        new.append(cmds[old])
        if is_pair[old]:
            new.append(cmds[old + 1])
    changed = any(x is not y for x, y in zip(new, cmds))
    computation.commands = new
    return changed
