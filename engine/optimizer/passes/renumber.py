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

from bisect import bisect_right
from functools import partial
from itertools import accumulate
from operator import attrgetter, itemgetter

from engine.compiler.computation import (COMMAND_SPECS, ArgKind, CommandType, NnetComputation,
                                         SubMatrixInfo)
from engine.optimizer import native
from engine.optimizer.analysis import CT


_ARG = tuple(f"arg{i + 1}" for i in range(7))
_TYPES = tuple(CommandType)   # in order of their values
# per command type: ArgKind -> attribute names of the slots of that kind
_KIND_POSITIONS = {ct: {} for ct in CommandType}
for _ct, _spec in COMMAND_SPECS.items():
    for _i, _slot in enumerate(_spec.slots):
        _KIND_POSITIONS[_ct].setdefault(_slot.kind, []).append(_ARG[_i])
_GET = {a: attrgetter(a) for a in _ARG}
# SubMatrixInfo from a tuple without the Python-level __new__ of the named tuple
submatrix_info = partial(tuple.__new__, SubMatrixInfo)
_FIRST = itemgetter(0)
if native.EXTENSION is not None:   # the submatrix slots of each command type, for the C core
    native.EXTENSION.configure_renumber(
        tuple(tuple(int(a[3:]) - 1 for a in _KIND_POSITIONS[ct].get(ArgKind.SUBMATRIX, ()))
              for ct in _TYPES), SubMatrixInfo)


class _Refs:
    """The argument slots of every command, per kind, as (attribute name, the
    commands of one type in command order) -- one walk over the commands serves
    every table (renumbering changes arguments, never command types)."""

    def __init__(self, computation: NnetComputation):
        lists: list[list] = [[] for _ in _TYPES]   # indexed by command type
        for cmd in computation.commands:
            lists[cmd.command_type].append(cmd)
        self.by_type = {ct: lst for ct, lst in zip(_TYPES, lists) if lst}

    def of(self, kind) -> list[tuple[str, list]]:
        return [(a, group) for ct, group in self.by_type.items()
                for a in _KIND_POSITIONS[ct].get(kind, ())]

    @staticmethod
    def values(refs) -> set[int]:
        out: set[int] = set()
        for a, group in refs:
            out.update(map(_GET[a], group))
        return out

    @staticmethod
    def remap(refs, new_of, positive_only: bool = False) -> None:
        for a, group in refs:
            if positive_only:
                get = _GET[a]
                for cmd in group:
                    v = get(cmd)
                    if v > 0:
                        setattr(cmd, a, new_of[v])
            else:
                _remap_slot(group, a, new_of)


def _remap_slot(group: list, a: str, new_of) -> None:
    """Set slot ``a`` of every command in ``group`` to ``new_of[its value]``.  One
    loop per slot, written out: a plain attribute store is ~4x faster than
    setattr() on these slotted objects, and renumbering does little else."""
    if a == "arg1":
        for cmd in group:
            cmd.arg1 = new_of[cmd.arg1]
    elif a == "arg2":
        for cmd in group:
            cmd.arg2 = new_of[cmd.arg2]
    elif a == "arg3":
        for cmd in group:
            cmd.arg3 = new_of[cmd.arg3]
    elif a == "arg4":
        for cmd in group:
            cmd.arg4 = new_of[cmd.arg4]
    elif a == "arg5":
        for cmd in group:
            cmd.arg5 = new_of[cmd.arg5]
    elif a == "arg6":
        for cmd in group:
            cmd.arg6 = new_of[cmd.arg6]
    else:
        for cmd in group:
            cmd.arg7 = new_of[cmd.arg7]


def _renumber_table(computation: NnetComputation, attr: str, refs: list,
                    key=tuple) -> bool:
    """Keep the entries of computation.<attr> that some command uses, merging equal
    ones (first occurrence wins); returns True if the numbering changed."""
    table = getattr(computation, attr)
    if not table:
        return False
    used = sorted(_Refs.values(refs))
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
        _Refs.remap(refs, old_to_new)
    return changed


def _renumber_memos(refs: _Refs) -> bool:
    """Memos numbered 1, 2, ... in the order of the propagates that make them."""
    new_of: dict[int, int] = {}
    changed = False
    props = refs.by_type.get(CT.PROPAGATE, ())
    for cmd in props:
        if cmd.arg5 > 0:
            new_of[cmd.arg5] = len(new_of) + 1
    for cmd in props:
        if cmd.arg5 > 0 and cmd.arg5 != new_of[cmd.arg5]:
            cmd.arg5 = new_of[cmd.arg5]
            changed = True
    for ct in (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE):
        for cmd in refs.by_type.get(ct, ()):
            if cmd.arg7 > 0:
                if cmd.arg7 not in new_of:
                    raise ValueError(f"renumber_computation: memo {cmd.arg7} consumed by a "
                                     "backprop but produced by no propagate")
                if cmd.arg7 != new_of[cmd.arg7]:
                    cmd.arg7 = new_of[cmd.arg7]
                    changed = True
    return changed


def _multi_key(v) -> tuple:
    return tuple(map(tuple, v))


def renumber_computation(computation: NnetComputation, ctx=None,
                         submatrix_order: list[int] | None = None) -> bool:
    """Kaldi's RenumberComputation.  ``submatrix_order``: a sort key per submatrix
    for the new numbering (default: the current numbers); of equal submatrices
    the first in that order stands for all."""
    return renumber_with_maps(computation, submatrix_order)[0]


def renumber_with_maps(computation: NnetComputation, submatrix_order: list[int] | None = None
                       ) -> tuple[bool, list[bool], list[int]]:
    """``renumber_computation``, returning also what became of the matrices and
    submatrices: (changed, matrix_used, sub_source), matrix_used[m] telling
    whether matrix m was kept (kept matrices keep their order), and new
    submatrix k standing for old submatrix sub_source[k] (the first of its
    extent in the new order; sub_source[0] is 0).  The submatrix and matrix part
    runs in C when the extension is built (engine.optimizer.native); the code
    below is its reference form, and the one that runs when the C code leaves
    the computation to Python."""
    c = computation
    refs = _Refs(c)
    multi_refs = refs.of(ArgKind.INDEXES_MULTI)
    changed = _renumber_table(c, "indexes_multi", multi_refs, key=_multi_key)
    core = None
    if native.NATIVE is not None:
        core = native.NATIVE.renumber_submatrices(c.commands, c.submatrices, len(c.matrices),
                                                  c.indexes_multi, submatrix_order)
    if core is None:
        core = _renumber_submatrices(c, refs, submatrix_order)
    # (the commands' submatrix slots are renumbered already)
    sub_changed, mat_changed, new_subs, matrix_used, sub_source, old_to_new = core
    if sub_changed:
        c.indexes_multi = [[(old_to_new[s], r) if s > 0 else (s, r) for s, r in lst]
                           for lst in c.indexes_multi]
    if sub_changed or mat_changed:
        c.submatrices = new_subs
    else:   # (the C core leaves out the lists when nothing changed)
        matrix_used, sub_source = [True] * len(c.matrices), list(range(len(c.submatrices)))
    if mat_changed:
        c.matrices = [m for m, u in zip(c.matrices, matrix_used) if u]
        if c.matrix_debug_info:
            c.matrix_debug_info = [d for d, u in zip(c.matrix_debug_info, matrix_used) if u]
    return _renumber_rest(c, refs, multi_refs, changed or sub_changed or mat_changed,
                          matrix_used, sub_source)


def _renumber_submatrices(c: NnetComputation, refs: _Refs, submatrix_order: list[int] | None
                          ) -> tuple:
    """The submatrix and matrix part of ``renumber_with_maps`` (its C form:
    engine/optimizer/_native.c, renumber_submatrices): renumbers the commands'
    submatrix slots and returns (submatrices changed, matrices changed, the new
    submatrix list, matrix_used, sub_source, old -> new submatrix number)."""
    # which submatrices are referred to, from commands and from indexes_multi,
    # and the matrices they are on
    sub_refs = refs.of(ArgKind.SUBMATRIX)
    subs = c.submatrices
    nsub = len(subs)
    refd = refs.values(sub_refs)
    for lst in c.indexes_multi:
        refd.update(map(_FIRST, lst))
    # submatrices: drop unused ones and merge duplicates (same matrix and extent)
    refd = sorted(refd)
    kept = refd[bisect_right(refd, 0):]
    if submatrix_order is not None:
        kept.sort(key=submatrix_order.__getitem__)   # stable: ties by number
    infos = list(map(subs.__getitem__, kept))
    used_matrices = set(map(_FIRST, infos))
    matrix_used = list(map(used_matrices.__contains__, range(len(c.matrices))))
    if matrix_used:
        matrix_used[0] = True
    new_subs = subs[:1]
    base = len(new_subs)
    # the extents numbered in order of first occurrence, each submatrix hashed
    # once (hashing the 5-tuples is most of this step's work)
    number: dict = {}
    setdefault = number.setdefault
    new_numbers = [setdefault(info, base + len(number)) for info in infos]
    new_subs.extend(number)
    # a reference of -1 (and of 0) stays as it is
    old_to_new_sub = dict(zip(kept, new_numbers))
    old_to_new_sub[-1] = -1
    old_to_new_sub[0] = 0 if nsub else -1
    sub_changed = len(new_subs) != nsub or new_numbers != kept
    mat_changed = sum(matrix_used) != len(c.matrices)
    if sub_changed:
        if refd and refd[0] < -1:
            _Refs.remap(sub_refs, old_to_new_sub, positive_only=True)
        else:
            _Refs.remap(sub_refs, old_to_new_sub)
    if mat_changed:
        # kept matrices before each one: the new number of a kept matrix
        new_matrix = list(accumulate(matrix_used, initial=0))
        new_subs[1:] = [info if new_matrix[info[0]] == info[0] else
                        submatrix_info((new_matrix[info[0]], info[1], info[2], info[3],
                                        info[4]))
                        for info in new_subs[1:]]
    # the first kept submatrix of each new number
    first = dict(zip(reversed(new_numbers), reversed(kept)))
    return (sub_changed, mat_changed, new_subs, matrix_used,
            [0, *map(first.__getitem__, range(base, len(new_subs)))], old_to_new_sub)


def _renumber_rest(c: NnetComputation, refs: _Refs, multi_refs: list, changed: bool,
                   matrix_used: list[bool], sub_source: list[int]
                   ) -> tuple[bool, list[bool], list[int]]:
    """The index tables and memos, once submatrices and matrices are renumbered."""
    # submatrix renumbering may have made indexes_multi entries equal
    changed |= _renumber_table(c, "indexes_multi", multi_refs, key=_multi_key)
    changed |= _renumber_table(c, "indexes", refs.of(ArgKind.INDEXES))
    changed |= _renumber_table(c, "indexes_ranges", refs.of(ArgKind.INDEXES_RANGES),
                               key=_multi_key)
    changed |= _renumber_memos(refs)
    return changed, matrix_used, sub_source
