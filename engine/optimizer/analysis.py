"""Computation analysis: Kaldi's nnet-analyze.{h,cc} (ComputationVariables,
CommandAttributes, variable and matrix accesses, Analyzer, ComputationAnalysis).

A *variable* is the smallest rectangle of a matrix that the computation can
address separately: each matrix is cut at every row and column boundary of
every submatrix on it, and the cells of that grid are the variables.  Reads and
writes are then tracked per variable, which is exact for partial accesses.

Command attributes come from ``COMMAND_SPECS`` (which slots are submatrices and
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
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.compiler.computation import (COMMAND_SPECS, Access, ArgKind, CommandType,
                                         NnetComputation, SubMatrixInfo)
from engine.core.errors import CheckError
from engine.nnet.components.base import ComponentProperty as P

CT = CommandType
READ, WRITE, READWRITE = Access.READ, Access.WRITE, Access.READWRITE


class ComputationVariables:
    """Kaldi's ComputationVariables: the split of every matrix into variables."""

    def __init__(self, computation: NnetComputation):
        nm = len(computation.matrices)
        rows: list[set] = [set() for _ in range(nm)]
        cols: list[set] = [set() for _ in range(nm)]
        for sm in computation.submatrices[1:]:
            m = sm.matrix_index
            rows[m].update((sm.row_offset, sm.row_offset + sm.num_rows))
            cols[m].update((sm.col_offset, sm.col_offset + sm.num_cols))
        self.row_split_points: list[list[int]] = [[0]]
        self.column_split_points: list[list[int]] = [[0]]
        self.matrix_to_variable_index = [0, 0]
        for m in range(1, nm):
            info = computation.matrices[m]
            rows[m].update((0, info.num_rows))
            cols[m].update((0, info.num_cols))
            self.row_split_points.append(sorted(rows[m]))
            self.column_split_points.append(sorted(cols[m]))
            n = (len(self.row_split_points[m]) - 1) * (len(self.column_split_points[m]) - 1)
            self.matrix_to_variable_index.append(self.matrix_to_variable_index[-1] + n)
        self.num_variables = self.matrix_to_variable_index[-1]
        self.variable_to_matrix = [0] * self.num_variables
        for m in range(1, nm):
            for v in range(self.matrix_to_variable_index[m], self.matrix_to_variable_index[m + 1]):
                self.variable_to_matrix[v] = m
        self.submatrix_to_matrix = [0] * len(computation.submatrices)
        self.submatrix_is_whole_matrix = [False] * len(computation.submatrices)
        self.variables_for_submatrix: list[list[int]] = [[]]
        for s in range(1, len(computation.submatrices)):
            sm = computation.submatrices[s]
            m = sm.matrix_index
            if not 0 < m < nm:
                raise CheckError(f"submatrix {s} refers to matrix m{m}, which does not exist")
            self.submatrix_to_matrix[s] = m
            rs, cs = self.row_split_points[m], self.column_split_points[m]
            r0 = bisect.bisect_left(rs, sm.row_offset)
            r1 = bisect.bisect_left(rs, sm.row_offset + sm.num_rows)
            c0 = bisect.bisect_left(cs, sm.col_offset)
            c1 = bisect.bisect_left(cs, sm.col_offset + sm.num_cols)
            ncv = len(cs) - 1
            base = self.matrix_to_variable_index[m]
            self.variables_for_submatrix.append(
                [base + r * ncv + c for r in range(r0, r1) for c in range(c0, c1)])
            self.submatrix_is_whole_matrix[s] = (r0 == 0 and r1 == len(rs) - 1 and c0 == 0
                                                 and c1 == ncv)

    def variables_for_matrix(self, m: int) -> range:
        return range(self.matrix_to_variable_index[m], self.matrix_to_variable_index[m + 1])

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


@dataclass
class MatrixAccesses:
    allocate_command: int = -1      # kAllocMatrix, kSwapMatrix (as destination) or kAcceptInput
    deallocate_command: int = -1    # kDeallocMatrix or kSwapMatrix (as source)
    accesses: list[tuple[int, Access]] = field(default_factory=list)  # (command, access)
    is_input: bool = False
    is_output: bool = False


def command_submatrix_accesses(computation: NnetComputation, command, nnet
                               ) -> list[tuple[int, Access]]:
    """(submatrix, READ/WRITE/READWRITE) for every submatrix a command reads or
    writes (not alloc/dealloc/swap), from COMMAND_SPECS plus the refinements in
    the module docstring."""
    return _submatrix_accesses(computation, command, _ComponentProps(nnet))


class _ComponentProps:
    """Component properties, asked of each component once per analysis."""

    def __init__(self, nnet) -> None:
        self.nnet = nnet   # only touched for commands that name a component
        self.cache: dict[int, int] = {}

    def __getitem__(self, c: int) -> int:
        p = self.cache.get(c)
        if p is None:
            p = self.cache[c] = int(self.nnet.components[c].properties())
        return p


# Per command type, the (slot position, kind, access) of the slots that name
# submatrices or multi-indexes (what command_submatrix_accesses looks at).
_SLOT_CACHE: dict = {}


def _access_slots(ct) -> list[tuple[int, object, object]]:
    slots = _SLOT_CACHE.get(ct)
    if slots is None:
        slots = [(i, slot.kind, slot.access) for i, slot in enumerate(COMMAND_SPECS[ct].slots)
                 if (slot.kind == ArgKind.SUBMATRIX and slot.access in (READ, WRITE, READWRITE))
                 or slot.kind == ArgKind.INDEXES_MULTI]
        _SLOT_CACHE[ct] = slots
    return slots


_PROPAGATE, _BACKPROP_TYPES = CT.PROPAGATE, (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE)
_COPY_ROWS, _COPY_ROWS_MULTI = CT.COPY_ROWS, CT.COPY_ROWS_MULTI
_PROPAGATE_ADDS, _BACKPROP_ADDS = int(P.PROPAGATE_ADDS), int(P.BACKPROP_ADDS)


def _submatrix_accesses(computation: NnetComputation, command, props: _ComponentProps
                        ) -> list[tuple[int, Access]]:
    ct = command.command_type
    args = command.args
    out: list[tuple[int, Access]] = []
    for i, kind, acc in _access_slots(ct):
        a = args[i]
        if kind == ArgKind.SUBMATRIX:
            if a <= 0:
                continue
            if acc == WRITE:
                if ct == _PROPAGATE:
                    if props[command.arg1] & _PROPAGATE_ADDS:
                        acc = READWRITE
                elif ct in _BACKPROP_TYPES:
                    if props[command.arg1] & _BACKPROP_ADDS:
                        acc = READWRITE
            if ct == _COPY_ROWS and i == 0:
                acc = READWRITE if -1 in computation.indexes[command.arg3] else WRITE
            elif ct == _COPY_ROWS_MULTI and i == 0:
                acc = WRITE
            out.append((a, acc))
        else:
            subs = sorted({s for s, _ in computation.indexes_multi[a] if s > 0})
            out.extend((s, acc) for s in subs)
    return out


# Per command type, the plan compute_command_attributes follows: a tuple of
# (attribute name, is a submatrix slot, access as int, rule) for the slots of
# _access_slots, where rule says which data-dependent refinement applies.
_PLAIN, _ADDS_PROP, _ADDS_BACK, _ROWS_DEST, _MULTI_DEST = range(5)
_PLAN_CACHE: dict = {}


def _plan(ct) -> tuple:
    plan = _PLAN_CACHE.get(ct)
    if plan is None:
        items = []
        for i, kind, acc in _access_slots(ct):
            rule = _PLAIN
            if kind == ArgKind.SUBMATRIX:
                if ct == _COPY_ROWS and i == 0:
                    rule = _ROWS_DEST
                elif ct == _COPY_ROWS_MULTI and i == 0:
                    rule = _MULTI_DEST
                elif acc == WRITE and ct == _PROPAGATE:
                    rule = _ADDS_PROP
                elif acc == WRITE and ct in _BACKPROP_TYPES:
                    rule = _ADDS_BACK
            items.append((f"arg{i + 1}", kind == ArgKind.SUBMATRIX, int(acc), rule))
        plan = _PLAN_CACHE[ct] = tuple(items)
    return plan


def _union(lists_of: list, keys: list[int]) -> list[int]:
    """sorted(set(chain of lists_of[k] for k in keys)), copying when one list."""
    if len(keys) == 1:
        return list(lists_of[keys[0]])
    acc: set = set()
    for k in keys:
        acc.update(lists_of[k])
    return sorted(acc)


def compute_command_attributes(nnet, computation: NnetComputation,
                               vars_: ComputationVariables) -> list[CommandAttributes]:
    """Every list in the result is sorted and free of duplicates, so the accesses
    are gathered per command as submatrices read / written (and matrices read
    because only part of them is written) and expanded once at the end."""
    out = []
    append = out.append
    props = _ComponentProps(nnet)
    updatable = int(P.UPDATABLE_COMPONENT)
    backprop = CT.BACKPROP
    s2m, vfs = vars_.submatrix_to_matrix, vars_.variables_for_submatrix
    whole = vars_.submatrix_is_whole_matrix
    indexes, indexes_multi = computation.indexes, computation.indexes_multi
    plans = {ct: _plan(ct) for ct in COMMAND_SPECS}
    rw, w = int(READWRITE), int(WRITE)
    for c in computation.commands:
        ct = c.command_type
        plan = plans[ct]
        if not plan:
            append(CommandAttributes())
            continue
        rd: list[int] = []
        wr: list[int] = []
        part: list[int] = []   # matrices written in part or read-write: read too
        for attr, is_sub, acc, rule in plan:
            a = getattr(c, attr)
            if is_sub:
                if a <= 0:
                    continue
                if rule:
                    if rule == _ROWS_DEST:
                        acc = rw if -1 in indexes[c.arg3] else w
                    elif rule == _MULTI_DEST:
                        acc = w
                    elif rule == _ADDS_PROP:
                        if props[c.arg1] & _PROPAGATE_ADDS:
                            acc = rw
                    elif props[c.arg1] & _BACKPROP_ADDS:
                        acc = rw
                if acc & 2:
                    wr.append(a)
                    if acc == rw or not whole[a]:
                        part.append(s2m[a])
                if acc & 1:
                    rd.append(a)
            else:
                subs = {s for s, _ in indexes_multi[a] if s > 0}
                for s in subs:
                    if acc & 2:
                        wr.append(s)
                        if acc == rw or not whole[s]:
                            part.append(s2m[s])
                    if acc & 1:
                        rd.append(s)
        if rd:
            vr = _union(vfs, rd)
            if len(rd) > 1:
                rd = sorted(set(rd))
            part.extend(s2m[s] for s in rd)
        else:
            vr = []
        if wr:
            vw = _union(vfs, wr)
            if len(wr) > 1:
                wr = sorted(set(wr))
            mw = [s2m[wr[0]]] if len(wr) == 1 else sorted({s2m[s] for s in wr})
        else:
            vw, mw = [], []
        mr = part if len(part) < 2 else sorted(set(part))
        append(CommandAttributes(vr, vw, rd, wr, mr, mw, ct == backprop
                                 and bool(props[c.arg1] & updatable)))
    return out


def _append_sorted_accesses(out: list[list], c: int, r: list[int], w: list[int]) -> None:
    """out[x].append((c, access)) for each x read or written, in increasing x.
    ``r`` and ``w`` are sorted and free of duplicates (what CommandAttributes
    holds); the (c, access) tuples are shared between the lists they go into."""
    if not w:
        if r:
            t = (c, READ)
            for x in r:
                out[x].append(t)
    elif not r:
        t = (c, WRITE)
        for x in w:
            out[x].append(t)
    elif r == w:
        t = (c, READWRITE)
        for x in r:
            out[x].append(t)
    else:
        rs, ws = set(r), set(w)
        tr, tw, trw = (c, READ), (c, WRITE), (c, READWRITE)
        for x in sorted(rs | ws):
            out[x].append(trw if x in rs and x in ws else tr if x in rs else tw)


def compute_variable_accesses(vars_: ComputationVariables,
                              attributes: list[CommandAttributes]
                              ) -> list[list[tuple[int, Access]]]:
    out: list[list[tuple[int, Access]]] = [[] for _ in range(vars_.num_variables)]
    for c, attr in enumerate(attributes):
        _append_sorted_accesses(out, c, attr.variables_read, attr.variables_written)
    return out


def compute_matrix_accesses(computation: NnetComputation, attributes: list[CommandAttributes]
                            ) -> list[MatrixAccesses]:
    out = [MatrixAccesses() for _ in computation.matrices]

    def error(c: int, reason: str) -> CheckError:
        e = CheckError(f"c{c}: {reason}")
        e.command, e.reason = c, reason   # the checker reprints the command in full
        return e

    subs, mats = computation.submatrices, computation.matrices
    nsub = len(subs)

    def whole(s: int, c: int) -> int:
        # computation.is_whole_matrix, inlined: this runs for every (de)allocation
        if 0 < s < nsub:
            m, ro, nr, co, nc = subs[s]
            mi = mats[m]
            if ro == 0 and co == 0 and nr == mi.num_rows and nc == mi.num_cols:
                return m
        raise error(c, "command does not operate on a whole matrix")

    def set_alloc(m: int, c: int) -> None:
        if out[m].allocate_command != -1:
            raise error(c, f"matrix m{m} is initialized twice (first by "
                           f"c{out[m].allocate_command})")
        out[m].allocate_command = c

    def set_dealloc(m: int, c: int) -> None:
        if out[m].deallocate_command != -1:
            raise error(c, f"matrix m{m} is destroyed twice (first by "
                           f"c{out[m].deallocate_command})")
        out[m].deallocate_command = c

    acc_lists = [ma.accesses for ma in out]
    life = _MATRIX_LIFE
    for c, (attr, cmd) in enumerate(zip(attributes, computation.commands)):
        _append_sorted_accesses(acc_lists, c, attr.matrices_read, attr.matrices_written)
        ct = cmd.command_type
        if ct not in life:
            continue
        if ct == CT.ALLOC_MATRIX:
            set_alloc(whole(cmd.arg1, c), c)
        elif ct == CT.SWAP_MATRIX:
            set_alloc(whole(cmd.arg1, c), c)
            set_dealloc(whole(cmd.arg2, c), c)
        elif ct == CT.DEALLOC_MATRIX:
            set_dealloc(whole(cmd.arg1, c), c)
        elif ct == CT.ACCEPT_INPUT:
            m = whole(cmd.arg1, c)
            out[m].is_input = True
            if out[m].allocate_command == -1:
                out[m].allocate_command = c
        elif ct == CT.PROVIDE_OUTPUT:
            out[whole(cmd.arg1, c)].is_output = True
    return out


_MATRIX_LIFE = frozenset((CT.ALLOC_MATRIX, CT.SWAP_MATRIX, CT.DEALLOC_MATRIX, CT.ACCEPT_INPUT,
                          CT.PROVIDE_OUTPUT))


class Analyzer:
    """Kaldi's Analyzer: variables, command attributes, variable and matrix accesses."""

    def __init__(self, nnet, computation: NnetComputation):
        self.variables = ComputationVariables(computation)
        self.command_attributes = compute_command_attributes(nnet, computation, self.variables)
        self.variable_accesses = compute_variable_accesses(self.variables,
                                                           self.command_attributes)
        self.matrix_accesses = compute_matrix_accesses(computation, self.command_attributes)


def _is_zeroing(cmd) -> bool:
    return cmd.command_type == CT.SET_CONST and cmd.alpha == 0.0


class ComputationAnalysis:
    """Kaldi's ComputationAnalysis: queries about when submatrices and matrices are
    first/last touched.  ``n`` (the number of commands) means "never" for first-access
    queries, -1 for last-access queries."""

    def __init__(self, computation: NnetComputation, analyzer: Analyzer):
        self.c = computation
        self.a = analyzer

    def _vars(self, s: int) -> list[int]:
        return self.a.variables.variables_for_submatrix[s]

    def first_access(self, s: int) -> int:
        ans = len(self.c.commands)
        for v in self._vars(s):
            acc = self.a.variable_accesses[v]
            if acc:
                ans = min(ans, acc[0][0])
        return ans

    def first_nontrivial_access(self, s: int) -> int:
        """First access other than zeroing (kSetConst with alpha 0)."""
        ans = len(self.c.commands)
        cmds = self.c.commands
        for v in self._vars(s):
            for ci, _ in self.a.variable_accesses[v]:
                if not _is_zeroing(cmds[ci]):
                    ans = min(ans, ci)
                    break
        return ans

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
        ans = -1
        for v in self._vars(s):
            acc = self.a.variable_accesses[v]
            if acc:
                ans = max(ans, acc[-1][0])
        return ans

    def last_write_access(self, s: int) -> int:
        """Last command writing any part of ``s``; the number of commands when the
        matrix is an output (the user reads it after the end)."""
        m = self.c.submatrices[s].matrix_index
        if self.a.matrix_accesses[m].is_output:
            return len(self.c.commands)
        ans = -1
        for v in self._vars(s):
            for ci, acc in reversed(self.a.variable_accesses[v]):
                if acc != READ:
                    ans = max(ans, ci)
                    break
        return ans

    def data_invalidated_command(self, c: int, s: int) -> int:
        """First command after ``c`` that writes any part of ``s`` or deallocates its
        matrix (number of commands if none)."""
        m = self.c.submatrices[s].matrix_index
        ans = self.a.matrix_accesses[m].deallocate_command
        if ans == -1:
            ans = len(self.c.commands)
        for v in self._vars(s):
            for ci, acc in self.a.variable_accesses[v]:
                if ci > c and acc != READ:
                    ans = min(ans, ci)
                    break
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
