"""Small command-list edits shared by several passes: Kaldi's ``InsertCommands``
(nnet-optimize-utils.cc) and ``GetCommandsOfType``; ``FixGotoLabel`` lives with
``remove_no_ops`` and is re-exported here.

Passes that add commands (SplitRowOps, OptimizeMemoryCompression) collect
``(position, command)`` pairs meaning "insert just before the command now at
``position``" and apply them in one merge, so that positions computed on the
unmodified list stay valid.  A looped computation ends with a ``kGotoLabel``
whose argument is a command index; any insertion shifts the label, hence the
fix-up after every edit.
"""

from __future__ import annotations

from engine.compiler.computation import Command, NnetComputation
from engine.core.errors import CheckError
from engine.optimizer.analysis import CT
from engine.optimizer.passes.remove_no_ops import fix_goto_label

__all__ = ["commands_of_type", "fix_goto_label", "insert_commands"]


def commands_of_type(computation: NnetComputation, command_type: CT) -> list[int]:
    """Kaldi's GetCommandsOfType: indexes of the commands of one type, in order."""
    return [i for i, c in enumerate(computation.commands) if c.command_type == command_type]


def insert_commands(new_commands: list[tuple[int, Command]],
                    computation: NnetComputation) -> None:
    """Kaldi's InsertCommands: each ``(position, command)`` goes just before the
    command currently at ``position`` (``position == len(commands)`` appends);
    commands with equal positions keep their order in ``new_commands``."""
    if not new_commands:
        return
    n_old = len(computation.commands)
    ordered = sorted(enumerate(new_commands), key=lambda p: (p[1][0], p[0]))
    for _, (pos, _cmd) in ordered:
        if not 0 <= pos <= n_old:
            raise CheckError(f"insert_commands: position {pos} outside 0..{n_old}")
    merged: list[Command] = []
    k = 0
    for i in range(n_old + 1):
        while k < len(ordered) and ordered[k][1][0] <= i:
            merged.append(ordered[k][1][1])
            k += 1
        if i < n_old:
            merged.append(computation.commands[i])
    computation.commands = merged
    fix_goto_label(computation)
