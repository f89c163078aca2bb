"""Removal of no-op commands: Kaldi's RemoveNoOps (nnet-optimize-utils.cc), plus
FixGotoLabel, which every pass that deletes or inserts commands needs afterwards
(a goto names its label by command index).

Only kNoOperation is removed: kNoOperationPermanent, markers and labels carry
meaning (Kaldi keeps them too).
"""

from __future__ import annotations

from itertools import compress

from engine.compiler.computation import NnetComputation
from engine.optimizer.analysis import CT


def fix_goto_label(computation: NnetComputation, ctx=None) -> bool:
    """Point a trailing kGotoLabel back at the label when commands moved (Kaldi's
    FixGotoLabel).  The goto is the last command, possibly followed by outputs."""
    cmds = computation.commands
    for c in range(len(cmds) - 1, -1, -1):
        ct = cmds[c].command_type
        if ct == CT.GOTO_LABEL:
            dest = cmds[c].arg1
            if 0 <= dest < len(cmds) and cmds[dest].command_type == CT.NO_OPERATION_LABEL:
                return False
            for d in range(len(cmds) - 1):
                if cmds[d].command_type == CT.NO_OPERATION_LABEL:
                    cmds[c].arg1 = d
                    return True
            raise ValueError("fix_goto_label: the computation has a goto but no label")
        if ct != CT.PROVIDE_OUTPUT:
            return False
    return False


def remove_no_ops(computation: NnetComputation, ctx=None) -> bool:
    before = len(computation.commands)
    noop = CT.NO_OPERATION
    computation.commands = [c for c in computation.commands if c.command_type != noop]
    if len(computation.commands) == before:
        return False
    fix_goto_label(computation)
    return True


def remove_no_ops_from(computation: NnetComputation, analyzer) -> bool:
    """``remove_no_ops`` that also brings ``analyzer`` (an Analyzer of the
    computation) up to date (``Analyzer.keep_commands``)."""
    noop = CT.NO_OPERATION
    cmds = computation.commands
    kept = [c.command_type != noop for c in cmds]
    computation.commands = list(compress(cmds, kept))
    if len(computation.commands) == len(cmds):
        return False
    analyzer.keep_commands(kept)
    fix_goto_label(computation)
    return True
