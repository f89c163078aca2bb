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
    alloc_t, set_const, dealloc_t = CT.ALLOC_MATRIX, CT.SET_CONST, CT.DEALLOC_MATRIX
    for i in range(n - 1):
        x = cmds[i]
        if x.command_type == alloc_t:
            y = cmds[i + 1]
            if y.command_type == set_const and x.arg1 == y.arg1 and y.alpha == 0.0:
                is_pair[i] = True
    # sort keys are 3 * index, minus 1 for "just before", plus 1 for "just after"
    key = [3 * i for i in range(n)]
    for m in range(1, len(computation.matrices)):
        ma = a.matrix_accesses[m]
        ents = a.entries[m]   # the commands that access m, in order (Analyzer.entries)
        alloc = ma.allocate_command
        if alloc != -1 and cmds[alloc].command_type == alloc_t:
            first = -1
            if ents:
                first = ents[0][0]
                if first == alloc + 1 and is_pair[alloc]:
                    # the next command to access m
                    first = next((c for c, _, _ in ents if c != first), -1)
            if first != -1:
                if first <= alloc:
                    raise ValueError(f"move_sizing_commands: m{m} used (c{first}) before its "
                                     f"allocation (c{alloc})")
                key[alloc] = 3 * first - 1
        dealloc = ma.deallocate_command
        if dealloc != -1 and ents and cmds[dealloc].command_type == dealloc_t:
            key[dealloc] = 3 * ents[-1][0] + 1
    order = sorted(range(n), key=key.__getitem__)   # stable: ties keep command order
    new = []
    goto = CT.GOTO_LABEL
    for old in order:
        if cmds[old].command_type == goto:
            raise ValueError("move_sizing_commands must run before the looped optimization")
        if old > 0 and is_pair[old - 1]:
            continue  # the zeroing travels with its allocation
        new.append(cmds[old])
        if is_pair[old]:
            new.append(cmds[old + 1])
    changed = any(x is not y for x, y in zip(new, cmds))
    computation.commands = new
    return changed
