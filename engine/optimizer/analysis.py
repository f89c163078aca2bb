"""Computation analysis: Kaldi's nnet-analyze.{h,cc} (ComputationVariables,
CommandAttributes, variable and matrix accesses, Analyzer, ComputationAnalysis).

A *variable* is the smallest rectangle of a matrix that the computation can
address separately: each matrix is cut at every row and column boundary of
every submatrix on it, and the cells of that grid are the variables.  Reads and
writes are tracked per variable, which is exact for partial accesses.

Command accesses come from ``COMMAND_SPECS`` (which slots are submatrices and
how they are accessed), refined only where the access depends on data the
static table cannot see:

- a component's PROPAGATE_ADDS / BACKPROP_ADDS flag turns the output write into
  read-write;
- kCopyRows counts as read-write when its index list has -1 entries (Kaldi's
  convention: the result then depends on what the rows held before), and
  kCopyRowsMulti writes its destination (null rows are zeroed);
- a write to part of a matrix counts as a read of the *matrix* (the rest of it
  survives), as in Kaldi.

Allocation, deallocation and swap commands touch no variable: they leave the
matrix undefined.  Their command indexes are recorded in ``MatrixAccesses``.

How it is computed.  A command touches a variable of submatrix s exactly when
one of the submatrices it accesses overlaps s (every submatrix is a union of
variables), so every question Kaldi asks about the variables of s -- first and
last access, last write, next write -- is answered from the accesses of s's
matrix with a rectangle test.  ``Analyzer`` therefore keeps, per matrix, its
accesses in command order (``entries``: command, access bits, the rectangle
accessed) in Kaldi's ``MatrixAccesses``; matrices are accessed a few times
each, so these scans are short.  Kaldi's per-matrix access list, the
variables themselves and the access list of every variable (what the checker
walks) are made only when asked for; the optimizer's passes use the entries.
``Analyzer.reanalyze`` redoes just the matrices that a round of variable
merging changed; ``Analyzer.renumbered`` and ``Analyzer.remove_commands`` follow
a renumbering and the deletion of commands, so that a pass can hand its
analysis on instead of the next pass analysing again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, compress
from operator import attrgetter, itemgetter
from types import SimpleNamespace

from engine.compiler.computation import (COMMAND_SPECS, Access, ArgKind, CommandType,
                                         NnetComputation, SubMatrixInfo)
from engine.core.errors import CheckError
from engine.nnet.components.base import ComponentProperty as P

# The command types as plain attributes: looking a member up on the enum class goes
# through the enum metaclass (~0.1 us, more than the comparison it is for, in loops
# over every command); on a namespace it is a dictionary lookup.  Same objects.
CT = SimpleNamespace(**CommandType.__members__)
READ, WRITE, READWRITE = Access.READ, Access.WRITE, Access.READWRITE
# accesses are handled as plain ints in the loops (bit 1 read, bit 2 write) and
# stored as Access members in the Kaldi-shaped lists; _ACCESS maps one to the other
_R, _W, _RW = 1, 2, 3
_ACCESS = (Access.NONE, READ, WRITE, READWRITE)
_FIRST = itemgetter(0)


class ComponentProperties(dict):
    """component index -> its properties as an int, asked of each component once
    (the network does not change while a computation is optimized, so one
    instance can serve every analysis of an optimization)."""

    def __init__(self, nnet) -> None:
        super().__init__()
        self.nnet = nnet   # only touched for commands that name a component

    def __missing__(self, c: int) -> int:
        p = self[c] = int(self.nnet.components[c].properties())
        return p


# -- per-command accesses -------------------------------------------------------------------

_PLAIN, _ADDS_PROP, _ADDS_BACK, _ROWS_DEST, _MULTI_DEST = range(5)
_PROPAGATE, _BACKPROP_TYPES = CT.PROPAGATE, (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE)
_PROPAGATE_ADDS, _BACKPROP_ADDS = int(P.PROPAGATE_ADDS), int(P.BACKPROP_ADDS)


def _adds(rule: int, props, component: int) -> bool:
    """Whether the written slot of a propagate (``rule`` _ADDS_PROP) or backprop
    (_ADDS_BACK) of ``component`` is added to rather than overwritten (then the
    slot is read as well as written)."""
    return bool(props[component] & (_PROPAGATE_ADDS if rule == _ADDS_PROP else _BACKPROP_ADDS))


def _make_plan(ct) -> tuple:
    """(getter, is a submatrix slot, access as int, refinement rule, slot number
    from 0) for each slot of ``ct`` that names submatrices (directly or through
    indexes_multi)."""
    items = []
    for i, slot in enumerate(COMMAND_SPECS[ct].slots):
        if slot.kind == ArgKind.INDEXES_MULTI:
            items.append((attrgetter(f"arg{i + 1}"), False, int(slot.access), _PLAIN, i))
        elif slot.kind == ArgKind.SUBMATRIX and slot.access in (READ, WRITE, READWRITE):
            rule = _PLAIN
            if ct == CT.COPY_ROWS and i == 0:
                rule = _ROWS_DEST
            elif ct == CT.COPY_ROWS_MULTI and i == 0:
                rule = _MULTI_DEST
            elif slot.access == WRITE and ct == _PROPAGATE:
                rule = _ADDS_PROP
            elif slot.access == WRITE and ct in _BACKPROP_TYPES:
                rule = _ADDS_BACK
            items.append((attrgetter(f"arg{i + 1}"), True, int(slot.access), rule, i))
    return tuple(items)


def _make_short(ct, plan: tuple) -> tuple | None:
    """For the usual commands, whose plan is one or two submatrix slots with no
    refinement but for the second slot's PROPAGATE_ADDS / BACKPROP_ADDS: (number
    of slots, one getter of the slots, their accesses, the second's rule); for
    commands that access nothing (0, None, (), 0); None for the others."""
    if not plan:
        return (0, None, (), _PLAIN)
    if len(plan) > 2 or not all(item[1] for item in plan):
        return None
    if plan[0][3] != _PLAIN or (len(plan) == 2 and plan[1][3] not in (
            _PLAIN, _ADDS_PROP, _ADDS_BACK)):
        return None
    names = [f"arg{i + 1}" for i, slot in enumerate(COMMAND_SPECS[ct].slots)
             if slot.kind == ArgKind.SUBMATRIX and slot.access in (READ, WRITE, READWRITE)]
    return (len(plan), attrgetter(*names), tuple(item[2] for item in plan),
            plan[-1][3])


# indexed by command type
_PLANS = [_make_plan(CommandType(t)) for t in range(len(CommandType))]
_SHORT = [_make_short(CommandType(t), plan) for t, plan in enumerate(_PLANS)]


def native_plans() -> tuple:
    """The plans as the native variable merging takes them (engine/optimizer/_native.c):
    per command type, (0, ()) when it accesses nothing, (1, slots) when every slot is a
    submatrix whose access is the table's or, for the written slot of a propagate or
    backprop, the component's PROPAGATE_ADDS / BACKPROP_ADDS (slots: (slot number from
    0, access bits, 0 plain / 1 propagate adds / 2 backprop adds)), and (2, ()) for
    the others, whose accesses it asks of ``_accesses_of``."""
    out = []
    for plan in _PLANS:
        if not plan:
            out.append((0, ()))
        elif all(is_sub and rule in (_PLAIN, _ADDS_PROP, _ADDS_BACK)
                 for _, is_sub, _, rule, _ in plan):
            rules = {_PLAIN: 0, _ADDS_PROP: 1, _ADDS_BACK: 2}
            out.append((1, tuple((i, acc, rules[rule]) for _, _, acc, rule, i in plan)))
        else:
            out.append((2, ()))
    return tuple(out)


def accesses_submatrices(command_type) -> bool:
    """Whether commands of this type read or write submatrices (not allocation,
    deallocation, swap, no-ops, markers, labels, goto)."""
    return bool(_PLANS[command_type])


def command_accesses(computation: NnetComputation, props) -> list[list[tuple[int, int]]]:
    """Per command, its (submatrix, access) pairs with access as an int (1 read, 2
    write, 3 read-write): the slots of COMMAND_SPECS plus the refinements in the
    module docstring, the submatrices of an indexes_multi list once each in
    increasing order.  ``props``: component index -> properties as an int."""
    out: list[list[tuple[int, int]]] = []
    append = out.append
    shorts = _SHORT
    for cmd in computation.commands:
        short = shorts[cmd.command_type]
        if short is not None:
            n, get, accs, rule = short
            if n == 1:
                a = get(cmd)
                append([(a, accs[0])] if a > 0 else [])
                continue
            if not n:
                append(())
                continue
            a, b = get(cmd)
            if a > 0 and b > 0:
                acc = _RW if rule and _adds(rule, props, cmd.arg1) else accs[1]
                append([(a, accs[0]), (b, acc)])
                continue
        append(_accesses_of(cmd, computation, props))
    return out


def _accesses_of(cmd, computation: NnetComputation, props) -> list[tuple[int, int]]:
    """The (submatrix, access) pairs of one command (``command_accesses``), slot
    by slot."""
    lst = []
    for get, is_sub, acc, rule, _ in _PLANS[cmd.command_type]:
        a = get(cmd)
        if is_sub:
            if a <= 0:
                continue
            if rule:
                if rule == _ROWS_DEST:
                    acc = _RW if -1 in computation.indexes[cmd.arg3] else _W
                elif rule == _MULTI_DEST:
                    acc = _W
                elif _adds(rule, props, cmd.arg1):
                    acc = _RW
            lst.append((a, acc))
        else:
            lst.extend((s, acc) for s in sorted({s for s, _ in computation.indexes_multi[a]
                                                 if s > 0}))
    return lst


# -- variables ------------------------------------------------------------------------------


class ComputationVariables:
    """Kaldi's ComputationVariables: the split of every matrix into variables,
    numbered matrix by matrix."""

    def __init__(self, computation: NnetComputation):
        subs, mats = computation.submatrices, computation.matrices
        nm, ns = len(mats), len(subs)
        rows: list = [None] * nm       # split points beyond (0, num_rows), when any
        cols: list = [None] * nm
        s2m = [0] * ns
        for s in range(1, ns):
            m, ro, nr, co, nc = subs[s]
            if not 0 < m < nm:
                raise CheckError(f"submatrix {s} refers to matrix m{m}, which does not exist")
            s2m[s] = m
            mi = mats[m]
            if ro or nr != mi.num_rows:
                r = rows[m]
                if r is None:
                    r = rows[m] = {0, mi.num_rows}
                r.add(ro)
                r.add(ro + nr)
            if co or nc != mi.num_cols:
                c = cols[m]
                if c is None:
                    c = cols[m] = {0, mi.num_cols}
                c.add(co)
                c.add(co + nc)
        self.submatrix_to_matrix = s2m
        self.row_split_points: list[list[int]] = [[0]]
        self.column_split_points: list[list[int]] = [[0]]
        self.matrix_to_variable_index = [0, 0]
        for m in range(1, nm):
            mi = mats[m]
            rs = sorted(rows[m]) if rows[m] is not None else sorted({0, mi.num_rows})
            cs = sorted(cols[m]) if cols[m] is not None else sorted({0, mi.num_cols})
            self.row_split_points.append(rs)
            self.column_split_points.append(cs)
            self.matrix_to_variable_index.append(self.matrix_to_variable_index[-1]
                                                 + (len(rs) - 1) * (len(cs) - 1))
        self.num_variables = self.matrix_to_variable_index[-1]
        self._variable_to_matrix: list[int] | None = None
        whole = self.submatrix_is_whole_matrix = [False] * ns
        vfs = self.variables_for_submatrix = [[] for _ in range(ns)]
        index: dict = {}
        for s in range(1, ns):
            m, ro, nr, co, nc = subs[s]
            rs, cs = self.row_split_points[m], self.column_split_points[m]
            base = self.matrix_to_variable_index[m]
            nrv, ncv = len(rs) - 1, len(cs) - 1
            if nrv == 1 and ncv == 1:
                vfs[s] = [base]
                whole[s] = ro == rs[0] and ro + nr == rs[1] and co == cs[0] and co + nc == cs[1]
                continue
            ix = index.get(m)
            if ix is None:
                ix = index[m] = ({p: i for i, p in enumerate(rs)},
                                 {p: i for i, p in enumerate(cs)})
            r0, r1, c0, c1 = ix[0][ro], ix[0][ro + nr], ix[1][co], ix[1][co + nc]
            if ncv == 1:
                vfs[s] = list(range(base + r0, base + r1))
            else:
                vfs[s] = [base + r * ncv + c for r in range(r0, r1) for c in range(c0, c1)]
            whole[s] = r0 == 0 and r1 == nrv and c0 == 0 and c1 == ncv

    def variables_for_matrix(self, m: int) -> range:
        return range(self.matrix_to_variable_index[m], self.matrix_to_variable_index[m + 1])

    @property
    def variable_to_matrix(self) -> list[int]:
        if self._variable_to_matrix is None:
            out = [0] * self.num_variables
            for m in range(1, len(self.row_split_points)):
                for v in self.variables_for_matrix(m):
                    out[v] = m
            self._variable_to_matrix = out
        return self._variable_to_matrix

    def variable_info(self, v: int) -> SubMatrixInfo:
        m = self.variable_to_matrix[v]
        off = v - self.matrix_to_variable_index[m]
        rs, cs = self.row_split_points[m], self.column_split_points[m]
        r, c = divmod(off, len(cs) - 1)
        return SubMatrixInfo(m, rs[r], rs[r + 1] - rs[r], cs[c], cs[c + 1] - cs[c])

    def describe_variable(self, v: int) -> str:
        """m3, or m3(0:9,10:19) when the matrix is split (inclusive ranges)."""
        info = self.variable_info(v)
        m = info.matrix_index
        nr, nc = len(self.row_split_points[m]) - 1, len(self.column_split_points[m]) - 1
        if nr == 1 and nc == 1:
            return f"m{m}"
        r = ":" if nr == 1 else f"{info.row_offset}:{info.row_offset + info.num_rows - 1}"
        c = ":" if nc == 1 else f"{info.col_offset}:{info.col_offset + info.num_cols - 1}"
        return f"m{m}({r},{c})"


@dataclass
class CommandAttributes:
    variables_read: list[int] = field(default_factory=list)
    variables_written: list[int] = field(default_factory=list)
    submatrices_read: list[int] = field(default_factory=list)
    submatrices_written: list[int] = field(default_factory=list)
    matrices_read: list[int] = field(default_factory=list)
    matrices_written: list[int] = field(default_factory=list)
    has_side_effects: bool = False


class MatrixAccesses:
    """Kaldi's MatrixAccesses of one matrix.  ``accesses``: (command, Access) in
    command order, one per command, a write to part of the matrix counted as
    read-write; it is made from the matrix's entries (``Analyzer.entries``, the
    list given here, and ``full``: the matrix's whole rectangle) when first
    read, and made again after ``entries_changed()``: the optimizer's own passes
    need only the entries."""

    __slots__ = ("allocate_command", "deallocate_command", "is_input", "is_output",
                 "_entries", "_full", "_accesses")

    def __init__(self, entries: list | tuple = (), full: tuple | None = None):
        self.allocate_command = -1    # kAllocMatrix, kSwapMatrix (as destination), kAcceptInput
        self.deallocate_command = -1  # kDeallocMatrix or kSwapMatrix (as source)
        self.is_input = False
        self.is_output = False
        self._entries, self._full = entries, full
        self._accesses: list[tuple[int, Access]] | None = None

    @property
    def accesses(self) -> list[tuple[int, Access]]:
        if self._accesses is None:
            full = self._full
            out: list = []
            for c, a, r in self._entries:
                if a == _W and r != full:
                    a = _RW
                if out and out[-1][0] == c:
                    out[-1] = (c, out[-1][1] | a)
                else:
                    out.append((c, a))
            self._accesses = [(c, _ACCESS[a]) for c, a in out]
        return self._accesses

    def entries_changed(self) -> None:
        self._accesses = None

    def restart(self, entries: list) -> None:
        """As a new MatrixAccesses of the same matrix (same size) on ``entries``: nothing
        known yet (what Analyzer.reanalyze fills in again)."""
        self.allocate_command = self.deallocate_command = -1
        self.is_input = self.is_output = False
        self._entries = entries
        self._accesses = None

    def __repr__(self) -> str:
        return (f"MatrixAccesses(allocate_command={self.allocate_command}, "
                f"deallocate_command={self.deallocate_command}, accesses={self.accesses}, "
                f"is_input={self.is_input}, is_output={self.is_output})")


_MATRIX_LIFE = frozenset((CT.ALLOC_MATRIX, CT.SWAP_MATRIX, CT.DEALLOC_MATRIX, CT.ACCEPT_INPUT,
                          CT.PROVIDE_OUTPUT))


class _Life:
    """Allocation, deallocation, input and output of matrices (the part of Kaldi's
    ComputeMatrixAccesses that is not about reads and writes), with its errors."""

    def __init__(self, computation: NnetComputation, out: list[MatrixAccesses],
                 whole: list[bool], s2m: list[int]):
        self.c, self.out, self.whole, self.s2m = computation, out, whole, s2m

    @staticmethod
    def error(c: int, reason: str) -> CheckError:
        e = CheckError(f"c{c}: {reason}")
        e.command, e.reason = c, reason   # the checker reprints the command in full
        return e

    def matrix(self, s: int, c: int) -> int:
        if 0 < s < len(self.whole) and self.whole[s]:
            return self.s2m[s]
        raise self.error(c, "command does not operate on a whole matrix")

    def set_alloc(self, m: int, c: int) -> None:
        ma = self.out[m]
        if ma.allocate_command != -1:
            raise self.error(c, f"matrix m{m} is initialized twice (first by "
                                f"c{ma.allocate_command})")
        ma.allocate_command = c

    def set_dealloc(self, m: int, c: int) -> None:
        ma = self.out[m]
        if ma.deallocate_command != -1:
            raise self.error(c, f"matrix m{m} is destroyed twice (first by "
                                f"c{ma.deallocate_command})")
        ma.deallocate_command = c

    def apply(self, c: int, only=None) -> None:
        """Record command c (a life command); with ``only``, just for those matrices."""
        cmd = self.c.commands[c]
        ct = cmd.command_type
        if ct == CT.ALLOC_MATRIX:
            m = self.matrix(cmd.arg1, c)
            if only is None or m in only:
                self.set_alloc(m, c)
        elif ct == CT.SWAP_MATRIX:
            m, m2 = self.matrix(cmd.arg1, c), self.matrix(cmd.arg2, c)
            if only is None or m in only:
                self.set_alloc(m, c)
            if only is None or m2 in only:
                self.set_dealloc(m2, c)
        elif ct == CT.DEALLOC_MATRIX:
            m = self.matrix(cmd.arg1, c)
            if only is None or m in only:
                self.set_dealloc(m, c)
        elif ct == CT.ACCEPT_INPUT:
            m = self.matrix(cmd.arg1, c)
            if only is None or m in only:
                ma = self.out[m]
                ma.is_input = True
                if ma.allocate_command == -1:
                    ma.allocate_command = c
        elif ct == CT.PROVIDE_OUTPUT:
            m = self.matrix(cmd.arg1, c)
            if only is None or m in only:
                self.out[m].is_output = True


class Analyzer:
    """Kaldi's Analyzer: the per-matrix ``entries`` the queries use, allocation,
    deallocation, input and output of each matrix at once; the access lists of
    ``MatrixAccesses``, variables, variable accesses and command attributes when
    first asked for.

    ``command_accesses[c]``: the (submatrix, access bits) pairs of command c.
    ``submatrix_matrix``, ``submatrix_whole``, ``submatrix_rect``: per submatrix,
    its matrix, whether it covers all of it, (row begin, row end, column begin,
    column end).
    ``entries[m]``: (command, access bits, (row begin, row end, column begin,
    column end)) for each submatrix of m a command accesses, in command order.
    ``matrix_accesses`` raises CheckError (at construction) for a matrix
    initialized or destroyed twice, or a sizing command on part of a matrix.
    ``props``: a shared ComponentProperties (one is made if not given)."""

    def __init__(self, nnet, computation: NnetComputation, props=None):
        self.computation = computation
        self.props = props if props is not None else ComponentProperties(nnet)
        subs, mats = computation.submatrices, computation.matrices
        nm, ns = len(mats), len(subs)
        s2m = [0] * ns
        whole = [False] * ns
        rect: list = [None] * ns
        for s in range(1, ns):
            m, ro, nr, co, nc = subs[s]
            if not 0 < m < nm:
                raise CheckError(f"submatrix {s} refers to matrix m{m}, which does not exist")
            s2m[s] = m
            mi = mats[m]
            whole[s] = ro == 0 and co == 0 and nr == mi.num_rows and nc == mi.num_cols
            rect[s] = (ro, ro + nr, co, co + nc)
        self.submatrix_matrix, self.submatrix_whole, self.submatrix_rect = s2m, whole, rect
        self._num_commands = len(computation.commands)   # the commands described
        self.entries: list[list[tuple]] = [[] for _ in range(nm)]
        self.matrix_accesses = out = [MatrixAccesses(e, (0, mi.num_rows, 0, mi.num_cols))
                                      for e, mi in zip(self.entries, mats)]
        self._submatrices_of: list[list[int]] | None = None
        self._variables: ComputationVariables | None = None
        self._variable_accesses: list[list[tuple[int, Access]]] | None = None
        self._command_attributes: list[CommandAttributes] | None = None
        life = _Life(computation, out, whole, s2m)
        alloc, dealloc, life_types = CT.ALLOC_MATRIX, CT.DEALLOC_MATRIX, _MATRIX_LIFE
        entries = self.entries
        # the command accesses (as command_accesses() makes them), entered as they are
        # made: the usual one- and two-slot commands inline, the others by _accesses_of
        cacc: list = []
        self._command_accesses = cacc
        keep, shorts, props = cacc.append, _SHORT, self.props
        set_const = CT.SET_CONST
        for ci, cmd in enumerate(computation.commands):
            ct = cmd.command_type
            # the three commands the compiler gives every matrix first, inline (the
            # allocations and deallocations as reanalyze takes them: a call per command
            # would cost what inlining saves); anything unusual, and every error, in _Life
            if ct == alloc or ct == dealloc:
                keep(())
                s = cmd.arg1
                if 0 < s < ns and whole[s]:
                    ma = out[s2m[s]]
                    if ct == alloc:
                        if ma.allocate_command == -1:
                            ma.allocate_command = ci
                            continue
                    elif ma.deallocate_command == -1:
                        ma.deallocate_command = ci
                        continue
                life.apply(ci)
                continue
            if ct == set_const:
                s = cmd.arg1
                if s > 0:
                    keep([(s, _W)])
                    entries[s2m[s]].append((ci, _W, rect[s]))
                else:
                    keep([])
                continue
            short = shorts[ct]
            if short is not None and short[0] != 2:
                n, get, accs, _ = short
                if n:
                    s = get(cmd)
                    if s > 0:
                        a = accs[0]
                        keep([(s, a)])
                        entries[s2m[s]].append((ci, a, rect[s]))
                    else:
                        keep([])
                else:
                    keep(())
            else:
                lst = None
                if short is not None:
                    _, get, accs, rule = short
                    s, t = get(cmd)
                    if s > 0 and t > 0:
                        a = _RW if rule and _adds(rule, props, cmd.arg1) else accs[1]
                        lst = [(s, accs[0]), (t, a)]
                        entries[s2m[s]].append((ci, accs[0], rect[s]))
                        entries[s2m[t]].append((ci, a, rect[t]))
                if lst is None:
                    lst = _accesses_of(cmd, computation, props)
                    for s, a in lst:
                        entries[s2m[s]].append((ci, a, rect[s]))
                keep(lst)
            if ct in life_types:        # swaps, inputs and outputs (see above for the rest)
                life.apply(ci)

    # -- built when first asked for --------------------------------------------------------
    @property
    def command_accesses(self) -> list:
        """Per command, its (submatrix, access bits) pairs (``command_accesses()``);
        computed again from the computation when a renumbering dropped them."""
        if self._command_accesses is None:
            self._command_accesses = command_accesses(self.computation, self.props)
        return self._command_accesses

    @command_accesses.setter
    def command_accesses(self, value: list) -> None:
        self._command_accesses = value

    @property
    def submatrices_of(self) -> list[list[int]]:
        """matrix -> its submatrices (Kaldi's ComputeMatrixToSubmatrix)."""
        if self._submatrices_of is None:
            out: list[list[int]] = [[] for _ in self.matrix_accesses]
            for s in range(1, len(self.submatrix_matrix)):
                out[self.submatrix_matrix[s]].append(s)
            self._submatrices_of = out
        return self._submatrices_of

    @property
    def variables(self) -> ComputationVariables:
        if self._variables is None:
            self._variables = ComputationVariables(self.computation)
        return self._variables

    @property
    def variable_accesses(self) -> list[list[tuple[int, Access]]]:
        """Per variable, (command, access) in command order."""
        if self._variable_accesses is None:
            v = self.variables
            out: list[list] = [[] for _ in range(v.num_variables)]
            vfs, s2m = v.variables_for_submatrix, v.submatrix_to_matrix
            for c, lst in enumerate(self.command_accesses):
                if not lst:
                    continue
                if len(lst) == 1 or len({s2m[s] for s, _ in lst}) == len(lst):
                    # submatrices on different matrices share no variable
                    for s, a in lst:
                        t = (c, _ACCESS[a])
                        for x in vfs[s]:
                            out[x].append(t)
                    continue
                bits: dict[int, int] = {}
                for s, a in lst:
                    for x in vfs[s]:
                        bits[x] = bits.get(x, 0) | a
                for x, a in bits.items():
                    out[x].append((c, _ACCESS[a]))
            self._variable_accesses = out
        return self._variable_accesses

    @property
    def command_attributes(self) -> list[CommandAttributes]:
        if self._command_attributes is None:
            vfs = self.variables.variables_for_submatrix
            s2m, whole = self.submatrix_matrix, self.submatrix_whole
            out = []
            for c, lst in enumerate(self.command_accesses):
                rd = sorted({s for s, a in lst if a & _R})
                wr = sorted({s for s, a in lst if a & _W})
                mr = {s2m[s] for s, a in lst if a & _R or (a == _W and not whole[s])}
                cmd = self.computation.commands[c]
                out.append(CommandAttributes(
                    sorted({x for s in rd for x in vfs[s]}),
                    sorted({x for s in wr for x in vfs[s]}), rd, wr, sorted(mr),
                    sorted({s2m[s] for s in wr}),
                    cmd.command_type == CT.BACKPROP
                    and bool(self.props[cmd.arg1] & P.UPDATABLE_COMPONENT)))
            self._command_attributes = out
        return self._command_attributes

    def variable_accesses_of(self, m: int) -> list[list[tuple[int, Access]]]:
        """The access lists of the variables of matrix m that something touches:
        every such variable's list is one of these (variables with the same
        accesses may share one)."""
        return [[(c, _ACCESS[a]) for c, a in lst] for lst in self.variable_access_bits_of(m)]

    def variable_access_bits_of(self, m: int) -> list[list[tuple[int, int]]]:
        """``variable_accesses_of`` with the accesses as bits (1 read, 2 write).
        Computed on the grid cut by the accesses themselves; when the rectangles
        accessed are disjoint, apart from one covering all that is accessed, each
        of them stands for its variables."""
        ents = self.entries[m]
        if not ents:
            return []
        by_rect: dict = {}
        for c, a, rc in ents:
            lst = by_rect.get(rc)
            if lst is None:
                by_rect[rc] = [(c, a)]
            elif lst[-1][0] == c:
                lst[-1] = (c, lst[-1][1] | a)
            else:
                lst.append((c, a))
        if len(by_rect) == 1:
            return list(by_rect.values())
        parts = sorted(by_rect)
        b0, b1, b2, b3 = parts[0]
        for r0, r1, c0, c1 in parts:
            if r1 > b1:
                b1 = r1
            if c0 < b2:
                b2 = c0
            if c1 > b3:
                b3 = c1
        box = (b0, b1, b2, b3)   # parts[0] has the first row of all
        everywhere = by_rect.get(box)
        if everywhere is not None:
            parts.remove(box)
        if _disjoint(parts):
            if everywhere is None:
                return [by_rect[rc] for rc in parts]
            lists = [_merged(everywhere, by_rect[rc]) for rc in parts]
            if _area(box) > sum(map(_area, parts)):
                lists.append(everywhere)   # variables only the covering accesses touch
            return lists
        rows = sorted({r for _, _, rc in ents for r in rc[:2]})
        cols = sorted({c for _, _, rc in ents for c in rc[2:]})
        ncv = len(cols) - 1
        cells: list[list] = [[] for _ in range((len(rows) - 1) * ncv)]
        ri = {p: i for i, p in enumerate(rows)}
        ki = {p: i for i, p in enumerate(cols)}
        for c, a, (r0, r1, c0, c1) in ents:
            for r in range(ri[r0], ri[r1]):
                for k in range(ki[c0], ki[c1]):
                    cell = cells[r * ncv + k]
                    if cell and cell[-1][0] == c:
                        cell[-1] = (c, cell[-1][1] | a)
                    else:
                        cell.append((c, a))
        return [cell for cell in cells if cell]

    # -- incremental update ------------------------------------------------------------------
    def remove_commands(self, gone: set[int]) -> None:
        """Bring the analysis up to date after the commands ``gone`` (kNoOperation
        now) are deleted from the list, the later ones moving up (indexes in
        ``gone`` are those before the deletion)."""
        kept = [True] * self._num_commands
        for i in gone:
            kept[i] = False
        self.keep_commands(kept)

    def keep_commands(self, kept: list[bool]) -> None:
        """``remove_commands`` given what stays: ``kept[c]`` is False for each
        command c deleted (one flag per command before the deletion)."""
        new_index = list(accumulate(kept, initial=0))   # kept commands before each
        self._num_commands = new_index[-1]
        if self._command_accesses is not None:
            self._command_accesses = list(compress(self._command_accesses, kept))
        self._variables = self._variable_accesses = self._command_attributes = None
        for ma, ents in zip(self.matrix_accesses, self.entries):
            if ents:
                ents[:] = [(new_index[c], a, r) for c, a, r in ents if kept[c]]
                ma.entries_changed()
            c = ma.allocate_command
            if c >= 0:
                ma.allocate_command = new_index[c] if kept[c] else -1
            c = ma.deallocate_command
            if c >= 0:
                ma.deallocate_command = new_index[c] if kept[c] else -1

    def renumbered(self, matrix_used: list[bool], sub_source: list[int]) -> None:
        """Bring the analysis up to date after a renumbering of the computation
        (``renumber_with_maps``) that kept the matrices in ``matrix_used`` (in
        order) and made new submatrix k the same as old submatrix
        ``sub_source[k]``.  Command indexes and the rectangles accessed do not
        change; the command accesses are made again when next asked for."""
        new_matrix = list(accumulate(matrix_used, initial=0))   # for the kept ones
        s2m = self.submatrix_matrix
        self.submatrix_matrix = [new_matrix[s2m[s]] for s in sub_source]
        self.submatrix_whole = list(map(self.submatrix_whole.__getitem__, sub_source))
        self.submatrix_rect = list(map(self.submatrix_rect.__getitem__, sub_source))
        if not all(matrix_used):
            for ma, ents, u in zip(self.matrix_accesses, self.entries, matrix_used):
                if not u and (ents or ma.allocate_command != -1
                              or ma.deallocate_command != -1):
                    raise ValueError("Analyzer.renumbered: a dropped matrix is still in use")
            self.matrix_accesses = [x for x, u in zip(self.matrix_accesses, matrix_used) if u]
            self.entries = [x for x, u in zip(self.entries, matrix_used) if u]
        self._command_accesses = None
        self._submatrices_of = None
        self._variables = self._variable_accesses = self._command_attributes = None

    def reanalyze(self, groups: dict[int, list[int]]) -> tuple[set[int], set[int]]:
        """Bring the analysis up to date after edits that moved every submatrix of
        some matrices onto another matrix and turned commands into kNoOperation,
        and nothing else (what a round of variable merging does).  ``groups``:
        receiving matrix -> the matrices whose submatrices and commands it now
        holds, itself included.  The receiving matrices are analysed again, the
        others of each group are left empty.  Returns the submatrices of the
        receiving matrices that commands still refer to, and the commands that
        accessed a matrix of a group before (those that access a receiving
        matrix now, and the ones turned into kNoOperation)."""
        c = self.computation
        cmds, subs, mats = c.commands, c.submatrices, c.matrices
        self._variables = self._variable_accesses = self._command_attributes = None
        of = self.submatrices_of
        s2m, whole, rect = self.submatrix_matrix, self.submatrix_whole, self.submatrix_rect
        macc, entries = self.matrix_accesses, self.entries
        touched: set[int] = set()
        life: set[int] = set()
        for keep, group in groups.items():
            moved: list[int] = []
            for m in group:
                ma = macc[m]
                touched.update(map(_FIRST, entries[m]))
                life.add(ma.allocate_command)
                life.add(ma.deallocate_command)
                if m != keep:
                    moved.extend(of[m])
                    of[m] = []
                    entries[m] = []
                    ma.restart(entries[m])
            mi = mats[keep]
            for s in moved:
                m, ro, nr, co, nc = subs[s]
                s2m[s] = m
                whole[s] = ro == 0 and co == 0 and nr == mi.num_rows and nc == mi.num_cols
                rect[s] = (ro, ro + nr, co, co + nc)
            of[keep] = sorted(of[keep] + moved)
            entries[keep] = []
            macc[keep].restart(entries[keep])   # (merging does not resize matrices)
        noop, io = CT.NO_OPERATION, (CT.ACCEPT_INPUT, CT.PROVIDE_OUTPUT)
        cacc = self.command_accesses
        used: set[int] = set()
        for ci in sorted(touched):
            ct = cmds[ci].command_type
            if ct == noop:
                cacc[ci] = ()
                continue
            for s, a in cacc[ci]:
                m = s2m[s]
                if m in groups:
                    used.add(s)
                    entries[m].append((ci, a, rect[s]))
            if ct in io:
                life.add(ci)
        life.discard(-1)
        life_c = _Life(c, macc, whole, s2m)
        alloc, dealloc, swap = CT.ALLOC_MATRIX, CT.DEALLOC_MATRIX, CT.SWAP_MATRIX
        ns = len(s2m)
        for ci in sorted(life):
            cmd = cmds[ci]
            ct = cmd.command_type
            if ct == noop:
                cacc[ci] = ()
                continue
            s = cmd.arg1
            # the usual cases inline (as in __init__); anything else (and every error)
            # in _Life
            if (ct == alloc or ct == dealloc) and 0 < s < ns and whole[s]:
                m = s2m[s]
                if m not in groups:
                    continue
                used.add(s)
                ma = macc[m]
                if ct == alloc:
                    if ma.allocate_command == -1:
                        ma.allocate_command = ci
                        continue
                elif ma.deallocate_command == -1:
                    ma.deallocate_command = ci
                    continue
            life_c.apply(ci, only=groups)
            for s in (cmd.arg1, cmd.arg2) if ct == swap else (cmd.arg1,):
                if s2m[s] in groups:
                    used.add(s)
        return used, touched


def _area(rect: tuple[int, int, int, int]) -> int:
    return (rect[1] - rect[0]) * (rect[3] - rect[2])


def _merged(first: list | None, second: list) -> list:
    """Two (command, bits) lists in command order as one, a command in both
    with its bits combined."""
    if not first:
        return second
    out: list = []
    for c, a in sorted(first + second):
        if out and out[-1][0] == c:
            out[-1] = (c, out[-1][1] | a)
        else:
            out.append((c, a))
    return out


def _disjoint(rects: list[tuple[int, int, int, int]]) -> bool:
    """No two of these rectangles (sorted) overlap."""
    for i, (r0, r1, c0, c1) in enumerate(rects):
        for j in range(i + 1, len(rects)):
            q0, q1, d0, d1 = rects[j]
            if q0 >= r1:
                break   # sorted by first row: none of the rest reaches row r1
            if d0 < c1 and c0 < d1:
                return False
    return True


def _is_zeroing(cmd) -> bool:
    return cmd.command_type == CT.SET_CONST and cmd.alpha == 0.0


class ComputationAnalysis:
    """Kaldi's ComputationAnalysis: queries about when submatrices and matrices are
    first/last touched.  ``n`` (the number of commands) means "never" for first-access
    queries, -1 for last-access queries.  A command touches a variable of s when
    one of its accesses overlaps s (see the module docstring)."""

    def __init__(self, computation: NnetComputation, analyzer: Analyzer):
        self.c = computation
        self.a = analyzer
        self._entries = analyzer.entries

    def _where(self, s: int):
        m, ro, nr, co, nc = self.c.submatrices[s]
        return self._entries[m], ro, ro + nr, co, co + nc

    def first_access(self, s: int) -> int:
        ents, R0, R1, C0, C1 = self._where(s)
        for c, _, (r0, r1, c0, c1) in ents:
            if r0 < R1 and R0 < r1 and c0 < C1 and C0 < c1:
                return c
        return len(self.c.commands)

    def first_nontrivial_access(self, s: int) -> int:
        """First access other than zeroing (kSetConst with alpha 0)."""
        ents, R0, R1, C0, C1 = self._where(s)
        cmds = self.c.commands
        set_const = CT.SET_CONST
        for c, _, (r0, r1, c0, c1) in ents:
            if r0 < R1 and R0 < r1 and c0 < C1 and C0 < c1:
                cmd = cmds[c]
                if cmd.command_type != set_const or cmd.alpha != 0.0:
                    return c
        return len(cmds)

    def first_use_at(self, s: int, c: int) -> int:
        """When command ``c`` is the first access of ``s`` other than a zeroing
        (``first_nontrivial_access(s) == c``): ``data_invalidated_command(c, s)``,
        found on the same walk over the accesses; otherwise -1."""
        ents, R0, R1, C0, C1 = self._where(s)
        cmds = self.c.commands
        set_const = CT.SET_CONST
        rest = iter(ents)
        for ci, _, (r0, r1, c0, c1) in rest:
            if r0 < R1 and R0 < r1 and c0 < C1 and C0 < c1:
                cmd = cmds[ci]
                if cmd.command_type != set_const or cmd.alpha != 0.0:
                    break
        else:
            return -1
        if ci != c:
            return -1
        ans = self.a.matrix_accesses[self.c.submatrices[s].matrix_index].deallocate_command
        if ans == -1:
            ans = len(cmds)
        for ci, a, (r0, r1, c0, c1) in rest:   # (in command order: those from c on)
            if ci > c and a & _W and r0 < R1 and R0 < r1 and c0 < C1 and C0 < c1:
                return min(ans, ci)
        return ans

    def last_access_and_write(self, s: int) -> tuple[int, int]:
        """(``last_access(s)``, ``last_write_access(s)``) in one walk."""
        ents, R0, R1, C0, C1 = self._where(s)
        last = -1
        output = self.a.matrix_accesses[self.c.submatrices[s].matrix_index].is_output
        for c, a, (r0, r1, c0, c1) in reversed(ents):
            if r0 < R1 and R0 < r1 and c0 < C1 and C0 < c1:
                if last == -1:
                    last = c
                    if output:
                        break
                if a & _W:
                    return last, (len(self.c.commands) if output else c)
        return last, (len(self.c.commands) if output else -1)

    def first_nontrivial_matrix_access(self, m: int) -> int:
        cmds = self.c.commands
        for ci, _ in self.a.matrix_accesses[m].accesses:
            if not _is_zeroing(cmds[ci]):
                return ci
        return len(cmds)

    def last_matrix_access(self, m: int) -> int:
        acc = self.a.matrix_accesses[m].accesses
        return acc[-1][0] if acc else -1

    def last_access(self, s: int) -> int:
        ents, R0, R1, C0, C1 = self._where(s)
        for c, _, (r0, r1, c0, c1) in reversed(ents):
            if r0 < R1 and R0 < r1 and c0 < C1 and C0 < c1:
                return c
        return -1

    def last_write_access(self, s: int) -> int:
        """Last command writing any part of ``s``; the number of commands when the
        matrix is an output (the user reads it after the end)."""
        m = self.c.submatrices[s].matrix_index
        if self.a.matrix_accesses[m].is_output:
            return len(self.c.commands)
        ents, R0, R1, C0, C1 = self._where(s)
        for c, a, (r0, r1, c0, c1) in reversed(ents):
            if a & _W and r0 < R1 and R0 < r1 and c0 < C1 and C0 < c1:
                return c
        return -1

    def data_invalidated_command(self, c: int, s: int) -> int:
        """First command after ``c`` that writes any part of ``s`` or deallocates its
        matrix (number of commands if none)."""
        m = self.c.submatrices[s].matrix_index
        ans = self.a.matrix_accesses[m].deallocate_command
        if ans == -1:
            ans = len(self.c.commands)
        ents, R0, R1, C0, C1 = self._where(s)
        for ci, a, (r0, r1, c0, c1) in ents:
            if ci > c and a & _W and r0 < R1 and R0 < r1 and c0 < C1 and C0 < c1:
                return min(ans, ci)
        return ans


def matrix_to_submatrices(computation: NnetComputation) -> list[list[int]]:
    """Kaldi's ComputeMatrixToSubmatrix."""
    out: list[list[int]] = [[] for _ in computation.matrices]
    for s in range(1, len(computation.submatrices)):
        out[computation.submatrices[s].matrix_index].append(s)
    return out


def max_memory_use(computation: NnetComputation) -> int:
    """Kaldi's GetMaxMemoryUse: float32 bytes, kAcceptInput counted as an allocation,
    compressed matrices at their compressed size."""
    cur = peak = 0
    compressed: dict[int, int] = {}
    subs = computation.submatrices
    for c in computation.commands:
        ct = c.command_type
        if not 0 <= c.arg1 < len(subs):
            continue
        sm = subs[c.arg1]
        nbytes = 4 * sm.num_rows * sm.num_cols
        if ct in (CT.ALLOC_MATRIX, CT.ACCEPT_INPUT):
            cur += nbytes
        elif ct == CT.DEALLOC_MATRIX:
            cur -= nbytes
        elif ct == CT.COMPRESS_MATRIX:
            cb = (1 if c.arg2 in (1, 2) else 2) * sm.num_rows * sm.num_cols
            compressed[c.arg1] = cb
            cur += cb - nbytes
        elif ct == CT.DECOMPRESS_MATRIX:
            cur += nbytes - compressed.get(c.arg1, 0)
        peak = max(peak, cur)
    return peak


def reference_peak_bytes(computation: NnetComputation) -> int:
    """Peak memory as the kaldi-ref stats.json files count it; one implementation,
    ``NnetComputation.peak_bytes()`` (also what ``stats()`` reports)."""
    return computation.peak_bytes()
