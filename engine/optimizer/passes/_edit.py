"""Small command-list edits shared by several passes: Kaldi's ``InsertCommands``
(nnet-optimize-utils.cc) and ``GetCommandsOfType``; ``FixGotoLabel`` lives with
``remove_no_ops`` and is re-exported here.  Also ``touched_slots``: which
argument slots of a command type name the submatrices it touches, for passes
that need only that much of the analysis.

Passes that add commands (SplitRowOps, OptimizeMemoryCompression) collect
``(position, command)`` pairs meaning "insert just before the command now at
``position``" and apply them in one merge, so that positions computed on the
unmodified list stay valid.  A looped computation ends with a ``kGotoLabel``
whose argument is a command index; any insertion shifts the label, hence the
fix-up after every edit.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.compiler.computation import (COMMAND_SPECS, Access, ArgKind, Command, CommandType,
                                         NnetComputation)
from engine.core.errors import CheckError
from engine.optimizer import native
from engine.optimizer.analysis import CT
from engine.optimizer.passes.remove_no_ops import fix_goto_label

__all__ = ["ADDITION_TO_COPY", "TouchedSlots", "commands_of_type", "fix_goto_label",
           "insert_commands", "touched_slots"]

# the "+=" commands and their "=" forms (ConvertAdditionToAssignment)
ADDITION_TO_COPY = {
    CT.MATRIX_ADD: CT.MATRIX_COPY,
    CT.ADD_ROWS: CT.COPY_ROWS,
    CT.ADD_ROWS_MULTI: CT.COPY_ROWS_MULTI,
    CT.ADD_TO_ROWS_MULTI: CT.COPY_TO_ROWS_MULTI,
}


class TouchedSlots(NamedTuple):
    """The slots (attribute names) of a command type that name the submatrices
    its commands read or write, those it writes among them, and its
    indexes_multi slot (None if it has none) with whether the submatrices listed
    there are written."""
    submatrices: tuple[str, ...]
    written: tuple[str, ...]
    multi: str | None
    multi_written: bool


def touched_slots(ct: CommandType) -> TouchedSlots:
    """From COMMAND_SPECS: the submatrices a command touches are those of the
    analysis (``command_accesses``, which only refines whether they are read or
    written); a slot holding 0 or less names none."""
    names, written, multi, multi_written = [], [], None, False
    for i, slot in enumerate(COMMAND_SPECS[ct].slots):
        name = f"arg{i + 1}"
        if slot.kind == ArgKind.INDEXES_MULTI:
            multi, multi_written = name, bool(slot.access & Access.WRITE)
        elif slot.kind == ArgKind.SUBMATRIX and slot.access in (Access.READ, Access.WRITE,
                                                                Access.READWRITE):
            names.append(name)
            if slot.access & Access.WRITE:
                written.append(name)
    return TouchedSlots(tuple(names), tuple(written), multi, multi_written)


def _native_slots() -> tuple:
    """``touched_slots`` of every command type as the C passes take them
    (engine/optimizer/_native.c, configure_convert): (touches submatrices, its
    submatrix slots (numbers from 0), the written one among them for an addition
    (position in those, or -1), its indexes_multi slot (-1 if none), the type of its
    copy form (-1 if it is no addition), whether the indexes_multi submatrices are
    written)."""
    out = []
    for ct in CommandType:
        names, written, multi, multi_written = touched_slots(ct)
        copy = ADDITION_TO_COPY.get(ct)
        if copy is not None and len(written) > 1:
            raise AssertionError(f"{ct.name} writes more than one submatrix slot")
        out.append((bool(names) or multi is not None, tuple(int(a[3:]) - 1 for a in names),
                    names.index(written[0]) if written and copy is not None else -1,
                    int(multi[3:]) - 1 if multi is not None else -1,
                    int(copy) if copy is not None else -1, multi_written))
    return tuple(out)


if native.EXTENSION is not None:
    native.EXTENSION.configure_convert(_native_slots())


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
