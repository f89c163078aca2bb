"""Renumbering: Kaldi's RenumberComputation / ComputationRenumberer
(nnet-optimize-utils.cc).

After passes have rewritten commands, the computation keeps matrices,
submatrices and index tables nobody refers to, and duplicates (two submatrices
with the same extent, two equal index lists).  This pass drops the unused
entries, merges the duplicates and renumbers every reference, including memo
indexes (renumbered 1, 2, ... in order of the propagate that makes them).

Which command slots hold which kind of reference comes from COMMAND_SPECS;
submatrices are also referred to from inside ``indexes_multi``.
"""

from __future__ import annotations

from engine.compiler.computation import COMMAND_SPECS, ArgKind, CommandType, NnetComputation

CT = CommandType


_ARG = tuple(f"arg{i + 1}" for i in range(7))
_KIND_POSITIONS: dict = {}


def _positions(ct) -> dict:
    """ArgKind -> attribute names of the slots of that kind, per command type."""
    pos = _KIND_POSITIONS.get(ct)
    if pos is None:
        pos = {}
        for i, slot in enumerate(COMMAND_SPECS[ct].slots):
            pos.setdefault(slot.kind, []).append(_ARG[i])
        _KIND_POSITIONS[ct] = pos
    return pos


def _all_slots(computation: NnetComputation) -> dict:
    """ArgKind -> [(command, attribute name)] for every argument slot, in command
    order (one walk over the commands serves every table: renumbering changes
    arguments, never command types)."""
    out: dict = {k: [] for k in ArgKind}
    for cmd in computation.commands:
        for kind, names in _positions(cmd.command_type).items():
            lst = out[kind]
            for a in names:
                lst.append((cmd, a))
    return out


def _renumber_table(computation: NnetComputation, attr: str, refs: list,
                    key=tuple) -> bool:
    """Keep the entries of computation.<attr> that some command uses, merging equal
    ones (first occurrence wins); returns True if the numbering changed."""
    table = getattr(computation, attr)
    if not table:
        return False
    used = sorted({getattr(cmd, a) for cmd, a in refs})
    old_to_new: dict[int, int] = {}
    seen: dict = {}
    new_table = []
    for old in used:
        k = key(table[old])
        if k in seen:
            old_to_new[old] = seen[k]
        else:
            seen[k] = old_to_new[old] = len(new_table)
            new_table.append(table[old])
    changed = len(new_table) != len(table) or any(o != n for o, n in old_to_new.items())
    if changed:
        setattr(computation, attr, new_table)
        for cmd, a in refs:
            setattr(cmd, a, old_to_new[getattr(cmd, a)])
    return changed


def _renumber_memos(computation: NnetComputation) -> bool:
    new_of: dict[int, int] = {}
    changed = False
    for cmd in computation.commands:
        if cmd.command_type == CT.PROPAGATE and cmd.arg5 > 0:
            new_of[cmd.arg5] = len(new_of) + 1
    for cmd in computation.commands:
        if cmd.command_type == CT.PROPAGATE and cmd.arg5 > 0:
            new = new_of[cmd.arg5]
        elif cmd.command_type in (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE) and cmd.arg7 > 0:
            if cmd.arg7 not in new_of:
                raise ValueError(f"renumber_computation: memo {cmd.arg7} consumed by a backprop "
                                 "but produced by no propagate")
            new = new_of[cmd.arg7]
        else:
            continue
        attr = "arg5" if cmd.command_type == CT.PROPAGATE else "arg7"
        if getattr(cmd, attr) != new:
            setattr(cmd, attr, new)
            changed = True
    return changed


def renumber_computation(computation: NnetComputation, ctx=None) -> bool:
    c = computation
    slots = _all_slots(c)
    changed = _renumber_table(c, "indexes_multi", slots[ArgKind.INDEXES_MULTI],
                              key=lambda v: tuple(map(tuple, v)))
    # which submatrices are referred to, from commands and from indexes_multi
    sub_refs = slots[ArgKind.SUBMATRIX]
    used = [False] * len(c.submatrices)
    used[0] = True
    for cmd, a in sub_refs:
        v = getattr(cmd, a)
        if v > 0:
            used[v] = True
    for lst in c.indexes_multi:
        for s, _ in lst:
            if s > 0:
                used[s] = True
    matrix_used = [False] * len(c.matrices)
    if matrix_used:
        matrix_used[0] = True
    for s in range(1, len(c.submatrices)):
        if used[s]:
            matrix_used[c.submatrices[s].matrix_index] = True
    old_to_new_matrix = []
    n = 0
    for u in matrix_used:
        old_to_new_matrix.append(n if u else -1)
        n += u
    # submatrices: drop unused ones and merge duplicates (same matrix and extent)
    old_to_new_sub = [-1] * len(c.submatrices)
    old_to_new_sub[0] = 0 if c.submatrices else -1
    new_subs = c.submatrices[:1]
    by_info: dict = {}
    for s in range(1, len(c.submatrices)):
        if not used[s]:
            continue
        info = c.submatrices[s]
        if info in by_info:
            old_to_new_sub[s] = by_info[info]
        else:
            by_info[info] = old_to_new_sub[s] = len(new_subs)
            new_subs.append(info)
    sub_changed = len(new_subs) != len(c.submatrices) or any(
        old_to_new_sub[s] != s for s in range(len(c.submatrices)) if used[s])
    mat_changed = n != len(c.matrices)
    if sub_changed:
        for cmd, a in sub_refs:
            v = getattr(cmd, a)
            if v > 0:
                setattr(cmd, a, old_to_new_sub[v])
        c.indexes_multi = [[(old_to_new_sub[s], r) if s > 0 else (s, r) for s, r in lst]
                           for lst in c.indexes_multi]
    if sub_changed or mat_changed:
        c.submatrices = [info if k == 0 else info._replace(
            matrix_index=old_to_new_matrix[info.matrix_index])
            for k, info in enumerate(new_subs)]
    if mat_changed:
        c.matrices = [m for m, u in zip(c.matrices, matrix_used) if u]
        if c.matrix_debug_info:
            c.matrix_debug_info = [d for d, u in zip(c.matrix_debug_info, matrix_used) if u]
    changed |= sub_changed or mat_changed
    # submatrix renumbering may have made indexes_multi entries equal
    changed |= _renumber_table(c, "indexes_multi", slots[ArgKind.INDEXES_MULTI],
                               key=lambda v: tuple(map(tuple, v)))
    changed |= _renumber_table(c, "indexes", slots[ArgKind.INDEXES])
    changed |= _renumber_table(c, "indexes_ranges", slots[ArgKind.INDEXES_RANGES],
                               key=lambda v: tuple(map(tuple, v)))
    changed |= _renumber_memos(c)
    return changed
