"""Dropping needless zeroing: Kaldi's RemoveUnnecessaryZeroing (nnet-optimize.cc),
gated by the option initialize_undefined.

The compiler zeroes every matrix after allocating it.  When every variable
(region) of a matrix is first *written* -- not added to or partly copied into
-- after that zeroing, the zeroing is wasted and becomes a no-op, leaving the
allocation undefined.  An output region that nothing ever writes (possible
when deriv-time limits cut a derivative) keeps its zeroing: the user reads it.
"""

from __future__ import annotations

from engine.compiler.computation import NnetComputation
from engine.optimizer.analysis import CT
from engine.optimizer.passes.remove_no_ops import remove_no_ops

_W = 2   # write access, as a bit (Analyzer.variable_access_bits_of)


def remove_unnecessary_zeroing(computation: NnetComputation, ctx) -> bool:
    a = ctx.analyzer(computation)
    cmds = computation.commands
    changed = False
    for m in range(1, len(computation.matrices)):
        ma = a.matrix_accesses[m]
        if not ma.accesses:
            continue
        cmd = cmds[ma.accesses[0][0]]
        if not (cmd.command_type == CT.SET_CONST and cmd.alpha == 0.0):
            continue
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
        a.remove_commands({i for i, c in enumerate(cmds) if c.command_type == CT.NO_OPERATION})
        remove_no_ops(computation)
        ctx.analysis_updated(a, computation)
    return changed
