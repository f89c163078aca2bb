"""The compiled program: Kaldi's ``NnetComputation`` (nnet-computation.h/.cc).

A computation is a handful of flat lists that refer to each other by integer
position, position 0 meaning "nothing" as in Kaldi:

- ``matrices``: ``MatrixInfo(num_rows, num_cols, stride_type)``; index 0 is the
  empty matrix.
- ``submatrices``: ``SubMatrixInfo(matrix, row_offset, num_rows, col_offset,
  num_cols)``; index 0 is the empty submatrix.  Commands name submatrices, never
  matrices, so that the optimizer can reason about partial accesses.
- ``indexes`` (row maps for copy/add-rows), ``indexes_multi`` (lists of
  ``(submatrix, row)`` pairs, ``(-1, -1)`` for "none"), ``indexes_ranges``
  (``(start, end)`` row ranges, ``(-1, -1)`` for "none").
- ``component_precomputed_indexes``: per-computation index data of non-simple
  components; index 0 is None.
- ``commands``: ``Command(command_type, alpha, arg1..arg7)``.

The meaning of every argument slot lives in one table, ``COMMAND_SPECS``: which
slots are submatrices (and whether they are read, written or both), which are
components, index tables, nodes or memos, and how the command prints.  The
printer, the executor, the optimizer's analysis and renumbering all derive from
that table instead of keeping their own switch statements.

Printing follows ``NnetComputation::Print`` character for character (same
range compression of Indexes and integer lists, same 200-character elision).
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter
from enum import IntEnum
from typing import Any, Callable, NamedTuple

import numpy as np

from engine.compiler.ir_format import (_elide, _fmt_float, format_cindexes,  # noqa: F401
                                       format_indexes, format_int_vector)
from engine.core.index import K_NO_TIME, index_rows

# Kaldi's MatrixStrideType
K_DEFAULT_STRIDE = 0
K_STRIDE_EQUAL_NUM_COLS = 1


class CommandType(IntEnum):
    """Kaldi's CommandType, same order (hence same integer values)."""

    ALLOC_MATRIX = 0
    DEALLOC_MATRIX = 1
    SWAP_MATRIX = 2
    SET_CONST = 3
    PROPAGATE = 4
    BACKPROP = 5
    BACKPROP_NO_MODEL_UPDATE = 6
    MATRIX_COPY = 7
    MATRIX_ADD = 8
    COPY_ROWS = 9
    ADD_ROWS = 10
    COPY_ROWS_MULTI = 11
    COPY_TO_ROWS_MULTI = 12
    ADD_ROWS_MULTI = 13
    ADD_TO_ROWS_MULTI = 14
    ADD_ROW_RANGES = 15
    COMPRESS_MATRIX = 16
    DECOMPRESS_MATRIX = 17
    ACCEPT_INPUT = 18
    PROVIDE_OUTPUT = 19
    NO_OPERATION = 20
    NO_OPERATION_PERMANENT = 21
    NO_OPERATION_MARKER = 22
    NO_OPERATION_LABEL = 23
    GOTO_LABEL = 24

    @property
    def kaldi_name(self) -> str:
        return "k" + "".join(w.capitalize() for w in self.name.split("_"))


CT = CommandType


class ArgKind(IntEnum):
    """What an argument slot of a command refers to."""

    UNUSED = 0
    SUBMATRIX = 1
    COMPONENT = 2
    PRECOMPUTED = 3      # index into component_precomputed_indexes (0 = None)
    INDEXES = 4          # index into indexes
    INDEXES_MULTI = 5    # index into indexes_multi
    INDEXES_RANGES = 6   # index into indexes_ranges
    NODE = 7             # network node index
    MEMO = 8             # memo index (0 = no memo)
    FLAG = 9             # small integer flag (store-stats, truncate)
    COMMAND = 10         # command index (goto target)
    COMPRESSION = 11     # compression type (1=int8 2=uint8 3=int16 4=uint16)


class Access(IntEnum):
    """How a submatrix slot is touched.  ALLOC/DEALLOC concern whole matrices;
    for propagate/backprop the component's flags may turn WRITE into READWRITE
    (PROPAGATE_ADDS, BACKPROP_ADDS): see ``submatrix_accesses``."""

    NONE = 0
    READ = 1
    WRITE = 2
    READWRITE = 3
    ALLOC = 4
    DEALLOC = 5


class Slot(NamedTuple):
    kind: ArgKind = ArgKind.UNUSED
    access: Access = Access.NONE


_U = Slot()
_SUB_R = Slot(ArgKind.SUBMATRIX, Access.READ)
_SUB_W = Slot(ArgKind.SUBMATRIX, Access.WRITE)
_SUB_RW = Slot(ArgKind.SUBMATRIX, Access.READWRITE)


@dataclass(frozen=True)
class CommandSpec:
    slots: tuple[Slot, ...]          # arg1..arg7
    uses_alpha: bool
    printer: Callable[["_PrintCtx", "Command"], str]
    is_noop: bool = False            # not counted in stats()


@dataclass(slots=True)
class Command:
    command_type: CommandType = CT.NO_OPERATION_MARKER
    alpha: float = 1.0
    arg1: int = -1
    arg2: int = -1
    arg3: int = -1
    arg4: int = -1
    arg5: int = -1
    arg6: int = -1
    arg7: int = -1

    @classmethod
    def make(cls, command_type: CommandType, *args: int, alpha: float = 1.0) -> "Command":
        full = list(args) + [-1] * (7 - len(args))
        return cls(CommandType(command_type), float(alpha), *full)

    @property
    def args(self) -> list[int]:
        return [self.arg1, self.arg2, self.arg3, self.arg4, self.arg5, self.arg6, self.arg7]

    def set_arg(self, i: int, value: int) -> None:
        """Set argument slot ``i`` (0-based, i.e. arg{i+1})."""
        setattr(self, f"arg{i + 1}", int(value))

    def to_data(self) -> list:
        return [int(self.command_type), float(self.alpha)] + self.args


def copy_command(c: Command, make=object.__new__, cls=Command) -> Command:
    """A copy of a command, slot by slot on an instance made without __init__ (~10x
    faster than copy.copy on a slotted dataclass and ~20% faster than the
    constructor)."""
    d = make(cls)
    d.command_type = c.command_type
    d.alpha = c.alpha
    d.arg1 = c.arg1
    d.arg2 = c.arg2
    d.arg3 = c.arg3
    d.arg4 = c.arg4
    d.arg5 = c.arg5
    d.arg6 = c.arg6
    d.arg7 = c.arg7
    return d


class MatrixInfo(NamedTuple):
    num_rows: int
    num_cols: int
    stride_type: int = K_DEFAULT_STRIDE


class SubMatrixInfo(NamedTuple):
    matrix_index: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int


class DebugCindexes(Sequence):
    """The debug cindexes of one matrix held as a (k, 4) int64 array of node, n, t, x
    rows (``rows``, not to be written to), read as the sequence of (node, Index)
    pairs they stand for.  The pairs are made when first read (most computations
    never read them: the optimizer asks only for their number), the array stays
    valid throughout since the sequence cannot be changed; a slice is another
    DebugCindexes over the rows sliced."""

    __slots__ = ("rows", "_pairs")

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self._pairs: list | None = None

    def _list(self) -> list:
        if self._pairs is None:
            from engine.compiler.graph_nodes import make_indexes  # noqa: PLC0415
            rows = self.rows
            self._pairs = list(zip(rows[:, 0].tolist(), make_indexes(rows[:, 1:])))
        return self._pairs

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return DebugCindexes(self.rows[i])
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        if isinstance(other, DebugCindexes):
            return self.rows.shape == other.rows.shape and bool((self.rows == other.rows).all())
        if isinstance(other, (list, tuple)):
            return self._list() == list(other)
        return NotImplemented

    __hash__ = None   # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"DebugCindexes({self._list()!r})"


def debug_rows(cindexes) -> np.ndarray:
    """A matrix's debug cindexes as a (k, 4) int64 array of node, n, t, x rows: the
    array of a DebugCindexes (not to be written to), a list of (node, Index) pairs
    read in one go."""
    if type(cindexes) is DebugCindexes:
        return cindexes.rows
    k = len(cindexes)
    out = np.empty((k, 4), dtype=np.int64)
    if k:
        out[:, 0] = np.fromiter(map(itemgetter(0), cindexes), np.int64, k)
        out[:, 1:] = np.fromiter(chain.from_iterable(map(itemgetter(1), cindexes)),
                                 np.int64, 3 * k).reshape(k, 3)
    return out


@dataclass
class MatrixDebugInfo:
    is_deriv: bool = False
    # the (node, Index) pairs of the matrix's rows: a list, or the compiler's array
    # form (DebugCindexes), which reads the same; replaced rather than changed
    cindexes: list | DebugCindexes = field(default_factory=list)


@dataclass
class PrecomputedIndexesInfo:
    data: Any = None
    input_indexes: list = field(default_factory=list)
    output_indexes: list = field(default_factory=list)

    def remember_index_rows(self, input_rows: np.ndarray, output_rows: np.ndarray) -> None:
        """Keep (k, 3) int64 n, t, x arrays equal to ``input_indexes`` and
        ``output_indexes`` (the compiler has them at hand), so that ``index_rows``
        need not convert the lists back; they count only while the lists are the
        same objects, of the same lengths."""
        self._rows = (self.input_indexes, len(self.input_indexes), input_rows,
                      self.output_indexes, len(self.output_indexes), output_rows)

    def index_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """``input_indexes`` and ``output_indexes`` as (k, 3) int64 arrays (not to be
        written to)."""
        kept = getattr(self, "_rows", None)
        if (kept is not None and kept[0] is self.input_indexes
                and kept[1] == len(self.input_indexes) and kept[3] is self.output_indexes
                and kept[4] == len(self.output_indexes)):
            return kept[2], kept[5]
        return index_rows(self.input_indexes), index_rows(self.output_indexes)


# --------------------------------------------------------------------------------------
# printers, one per command type


class _PrintCtx:
    def __init__(self, computation: "NnetComputation", nnet):
        self.c = computation
        self.nnet = nnet
        self.sub = computation.submatrix_strings()
        self._idx_cache: dict[int, str] = {}
        self._multi_cache: dict[int, str] = {}

    def node_name(self, i: int) -> str:
        return node_names_of(self.nnet, i)

    def component_name(self, i: int) -> str:
        return component_name_of(self.nnet, i)

    def indexes(self, i: int) -> str:
        if i not in self._idx_cache:
            self._idx_cache[i] = format_int_vector(self.c.indexes[i])
        return self._idx_cache[i]

    def indexes_multi(self, i: int) -> str:
        if i in self._multi_cache:
            return self._multi_cache[i]
        c = self.c
        parts = []
        for s, r in c.indexes_multi[i]:
            if s == -1:
                parts.append("NULL")
                continue
            sm = c.submatrices[s]
            mat = c.matrices[sm.matrix_index]
            row = r + sm.row_offset
            if sm.col_offset == 0 and sm.num_cols == mat.num_cols:
                parts.append(f"m{sm.matrix_index}({row},:)")
            else:
                parts.append(f"m{sm.matrix_index}({row},{sm.col_offset}:"
                             f"{sm.col_offset + sm.num_cols - 1})")
        s = "[" + ",".join(parts) + "]"
        self._multi_cache[i] = s
        return s

    def dim(self, s: int) -> str:
        sm = self.c.submatrices[s]
        return f"{sm.num_rows} x {sm.num_cols}"


def _p_alloc(p, c):
    sm = p.c.submatrices[c.arg1]
    return f"{p.sub[c.arg1]} = undefined({sm.num_rows},{sm.num_cols})"


def _p_dealloc(p, c):
    return f"{p.sub[c.arg1]} = []"


def _p_swap(p, c):
    return f"{p.sub[c.arg1]}.swap({p.sub[c.arg2]}) [dim = {p.dim(c.arg1)}]"


def _p_set_const(p, c):
    return f"{p.sub[c.arg1]}.set({_fmt_float(c.alpha)}) [dim = {p.dim(c.arg1)}];"


def _p_propagate(p, c):
    pre = "NULL, " if c.arg2 == 0 else f"precomputed_indexes[{c.arg2}], "
    return f"{p.component_name(c.arg1)}.Propagate({pre}{p.sub[c.arg3]}, &{p.sub[c.arg4]})"


def _p_backprop(p, c):
    pre = "NULL, " if c.arg2 == 0 else f"precomputed_indexes[{c.arg2}], "
    upd = ("[component-pointer], " if p.c.need_model_derivative
           and c.command_type == CT.BACKPROP else "NULL, ")
    ind = "NULL" if c.arg6 == 0 else "&" + p.sub[c.arg6]
    return (f"{p.component_name(c.arg1)}.Backprop({pre}{p.sub[c.arg3]}, {p.sub[c.arg4]}, "
            f"{p.sub[c.arg5]}, {upd}{ind})")


def _p_matrix_copy_add(p, c):
    op = "=" if c.command_type == CT.MATRIX_COPY else "+="
    if c.alpha == 1.0:
        return f"{p.sub[c.arg1]} {op} {p.sub[c.arg2]}"
    return f"{p.sub[c.arg1]} {op} {_fmt_float(c.alpha)} * {p.sub[c.arg2]}"


def _p_rows(p, c):
    name = "AddRows" if c.command_type == CT.ADD_ROWS else "CopyRows"
    return f"{p.sub[c.arg1]}.{name}({_fmt_float(c.alpha)}, {p.sub[c.arg2]}{p.indexes(c.arg3)})"


_MULTI_NAMES = {CT.ADD_ROWS_MULTI: "AddRowsMulti", CT.ADD_TO_ROWS_MULTI: "AddToRowsMulti",
                CT.COPY_ROWS_MULTI: "CopyRowsMulti", CT.COPY_TO_ROWS_MULTI: "CopyToRowsMulti"}


def _p_multi(p, c):
    return (f"{p.sub[c.arg1]}.{_MULTI_NAMES[c.command_type]}({_fmt_float(c.alpha)}, "
            f"{p.indexes_multi(c.arg2)})")


def _p_row_ranges(p, c):
    pairs = p.c.indexes_ranges[c.arg3]
    body = ",".join("null" if a == -1 else f"{a}:{b - 1}" for a, b in pairs)
    return f"{p.sub[c.arg1]}.AddRowRanges({_fmt_float(c.alpha)}, {p.sub[c.arg2]}, [{body}])"


_COMPRESSION_NAMES = {1: "int8", 2: "uint8", 3: "int16", 4: "uint16"}


def _p_compress(p, c):
    trunc = "true" if c.arg3 != 0 else "false"
    return (f"CompressMatrix({p.sub[c.arg1]}, {_fmt_float(c.alpha)}, "
            f"{_COMPRESSION_NAMES.get(c.arg2, 'uint16')}, {trunc})")


def _p_decompress(p, c):
    return f"DecompressMatrix({p.sub[c.arg1]})"


def _p_accept(p, c):
    return f"{p.sub[c.arg1]} = user input [for node: '{p.node_name(c.arg2)}']"


def _p_provide(p, c):
    return f"output {p.sub[c.arg1]} to user [for node: '{p.node_name(c.arg2)}']"


def _const(text):
    return lambda p, c: text


_BACKPROP_SLOTS = (Slot(ArgKind.COMPONENT), Slot(ArgKind.PRECOMPUTED), _SUB_R, _SUB_R, _SUB_R,
                   _SUB_W, Slot(ArgKind.MEMO))

COMMAND_SPECS: dict[CommandType, CommandSpec] = {
    CT.ALLOC_MATRIX: CommandSpec((Slot(ArgKind.SUBMATRIX, Access.ALLOC),), False, _p_alloc),
    CT.DEALLOC_MATRIX: CommandSpec((Slot(ArgKind.SUBMATRIX, Access.DEALLOC),), False, _p_dealloc),
    CT.SWAP_MATRIX: CommandSpec((Slot(ArgKind.SUBMATRIX, Access.ALLOC),
                                 Slot(ArgKind.SUBMATRIX, Access.DEALLOC)), False, _p_swap),
    CT.SET_CONST: CommandSpec((_SUB_W,), True, _p_set_const),
    CT.PROPAGATE: CommandSpec((Slot(ArgKind.COMPONENT), Slot(ArgKind.PRECOMPUTED), _SUB_R, _SUB_W,
                               Slot(ArgKind.MEMO), Slot(ArgKind.FLAG)), False, _p_propagate),
    CT.BACKPROP: CommandSpec(_BACKPROP_SLOTS, False, _p_backprop),
    CT.BACKPROP_NO_MODEL_UPDATE: CommandSpec(_BACKPROP_SLOTS, False, _p_backprop),
    CT.MATRIX_COPY: CommandSpec((_SUB_W, _SUB_R), True, _p_matrix_copy_add),
    CT.MATRIX_ADD: CommandSpec((_SUB_RW, _SUB_R), True, _p_matrix_copy_add),
    CT.COPY_ROWS: CommandSpec((_SUB_RW, _SUB_R, Slot(ArgKind.INDEXES)), True, _p_rows),
    CT.ADD_ROWS: CommandSpec((_SUB_RW, _SUB_R, Slot(ArgKind.INDEXES)), True, _p_rows),
    # the multi-row commands touch the submatrices listed in indexes_multi too
    # (read for Copy/AddRowsMulti, read-write for Copy/AddToRowsMulti).
    CT.COPY_ROWS_MULTI: CommandSpec((_SUB_RW, Slot(ArgKind.INDEXES_MULTI, Access.READ)), True,
                                    _p_multi),
    CT.COPY_TO_ROWS_MULTI: CommandSpec((_SUB_R, Slot(ArgKind.INDEXES_MULTI, Access.READWRITE)),
                                       True, _p_multi),
    CT.ADD_ROWS_MULTI: CommandSpec((_SUB_RW, Slot(ArgKind.INDEXES_MULTI, Access.READ)), True,
                                   _p_multi),
    CT.ADD_TO_ROWS_MULTI: CommandSpec((_SUB_R, Slot(ArgKind.INDEXES_MULTI, Access.READWRITE)),
                                      True, _p_multi),
    CT.ADD_ROW_RANGES: CommandSpec((_SUB_RW, _SUB_R, Slot(ArgKind.INDEXES_RANGES)), True,
                                   _p_row_ranges),
    CT.COMPRESS_MATRIX: CommandSpec((_SUB_RW, Slot(ArgKind.COMPRESSION), Slot(ArgKind.FLAG)),
                                    True, _p_compress),
    CT.DECOMPRESS_MATRIX: CommandSpec((_SUB_RW,), False, _p_decompress),
    CT.ACCEPT_INPUT: CommandSpec((Slot(ArgKind.SUBMATRIX, Access.WRITE), Slot(ArgKind.NODE)),
                                 False, _p_accept),
    CT.PROVIDE_OUTPUT: CommandSpec((_SUB_R, Slot(ArgKind.NODE)), False, _p_provide),
    CT.NO_OPERATION: CommandSpec((), False, _const("[no-op]"), is_noop=True),
    CT.NO_OPERATION_PERMANENT: CommandSpec((), False, _const("[no-op-permanent]"), is_noop=True),
    # Kaldi's reference stats count the segment marker (and labels), only the
    # two no-op kinds are left out.
    CT.NO_OPERATION_MARKER: CommandSpec(
        (), False, _const("# computation segment separator [e.g., begin backward commands]")),
    CT.NO_OPERATION_LABEL: CommandSpec((), False, _const("[label for goto statement]")),
    CT.GOTO_LABEL: CommandSpec((Slot(ArgKind.COMMAND),), False, lambda p, c: f"goto c{c.arg1}"),
}


def node_names_of(nnet, i: int) -> str:
    if nnet is None:
        return f"node{i}"
    try:
        return nnet.nodes[i].name
    except (AttributeError, IndexError, TypeError):
        return f"node{i}"


def component_name_of(nnet, i: int) -> str:
    if nnet is None:
        return f"component{i}"
    try:
        return nnet.component_names[i]
    except (AttributeError, IndexError, TypeError):
        return f"component{i}"


def _all_node_names(nnet) -> list[str]:
    try:
        return [n.name for n in nnet.nodes]
    except (AttributeError, TypeError):
        return []


# --------------------------------------------------------------------------------------
# the computation


class NnetComputation:
    def __init__(self) -> None:
        self.matrices: list[MatrixInfo] = []
        self.matrix_debug_info: list[MatrixDebugInfo] = []
        self.submatrices: list[SubMatrixInfo] = []
        self.component_precomputed_indexes: list[PrecomputedIndexesInfo] = []
        self.indexes: list[list[int]] = []
        self.indexes_multi: list[list[tuple[int, int]]] = []
        self.indexes_ranges: list[list[tuple[int, int]]] = []
        self.commands: list[Command] = []
        self.need_model_derivative = False
        # segment boundaries (command indexes of the markers), filled by the compiler
        self.segments: list[tuple[int, int]] = []

    # -- building ----------------------------------------------------------------------
    def new_matrix(self, num_rows: int, num_cols: int, stride_type: int = K_DEFAULT_STRIDE) -> int:
        """Add a matrix and a submatrix covering it; returns the submatrix index."""
        if num_rows <= 0 or num_cols <= 0:
            raise ValueError(f"new_matrix: bad dimensions {num_rows} x {num_cols}")
        if not self.matrices:
            self.matrices.append(MatrixInfo(0, 0, K_DEFAULT_STRIDE))
            self.submatrices.append(SubMatrixInfo(0, 0, 0, 0, 0))
        m = len(self.matrices)
        self.matrices.append(MatrixInfo(num_rows, num_cols, stride_type))
        if self.matrix_debug_info:
            self.matrix_debug_info.append(MatrixDebugInfo())
        self.submatrices.append(SubMatrixInfo(m, 0, num_rows, 0, num_cols))
        return len(self.submatrices) - 1

    def new_submatrix(self, base: int, row_offset: int, num_rows: int, col_offset: int,
                      num_cols: int) -> int:
        """A submatrix of submatrix ``base``; -1 for a count means 'all the rest'."""
        b = self.submatrices[base]
        if num_rows == -1:
            num_rows = b.num_rows - row_offset
        if num_cols == -1:
            num_cols = b.num_cols - col_offset
        if not (0 <= row_offset and row_offset + num_rows <= b.num_rows and 0 <= col_offset
                and col_offset + num_cols <= b.num_cols and num_rows > 0 and num_cols > 0):
            raise ValueError(f"new_submatrix: ({row_offset}, {num_rows}, {col_offset}, "
                             f"{num_cols}) out of range of submatrix {base}")
        self.submatrices.append(SubMatrixInfo(b.matrix_index, b.row_offset + row_offset, num_rows,
                                              b.col_offset + col_offset, num_cols))
        return len(self.submatrices) - 1

    def add(self, command_type: CommandType, *args: int, alpha: float = 1.0) -> Command:
        c = Command.make(command_type, *args, alpha=alpha)
        self.commands.append(c)
        return c

    # -- queries -------------------------------------------------------------------------
    def is_whole_matrix(self, s: int) -> bool:
        sm = self.submatrices[s]
        m = self.matrices[sm.matrix_index]
        return (sm.row_offset == 0 and sm.col_offset == 0 and sm.num_rows == m.num_rows
                and sm.num_cols == m.num_cols)

    def whole_submatrices(self) -> list[int]:
        """For each matrix, a submatrix index covering all of it (Kaldi's
        GetWholeSubmatrices: the last such submatrix)."""
        out = [0] * len(self.matrices)
        mats, subs = self.matrices, self.submatrices
        for s in range(1, len(subs)):
            m, ro, nr, co, nc = subs[s]
            if ro == 0 and co == 0 and nr == mats[m].num_rows and nc == mats[m].num_cols:
                out[m] = s
        for m in range(1, len(self.matrices)):
            if out[m] == 0:
                raise ValueError(f"matrix m{m} has no submatrix covering all of it")
        return out

    def peak_bytes(self) -> int:
        """Peak matrix memory as Kaldi's reference stats count it (the issue's
        definition): the most float32 bytes allocated and not yet freed over the
        command list, where kAllocMatrix adds its matrix's bytes and kDeallocMatrix
        subtracts them.  kSwapMatrix changes nothing (it only exchanges two
        same-sized matrices), and a supplied input (kAcceptInput) adds nothing
        although its kDeallocMatrix subtracts, exactly as the kaldi-ref
        stats.json numbers were produced."""
        cur = peak = 0
        for c in self.commands:
            ct = c.command_type
            if ct == CT.ALLOC_MATRIX or ct == CT.DEALLOC_MATRIX:
                mi = self.matrices[self.submatrices[c.arg1].matrix_index]
                nbytes = 4 * mi.num_rows * mi.num_cols
                if ct == CT.ALLOC_MATRIX:
                    cur += nbytes
                    peak = max(peak, cur)
                else:
                    cur -= nbytes
        return peak

    def stats(self) -> dict:
        """Command count (without no-ops, as Kaldi's reference stats), matrix count and
        peak bytes (``peak_bytes()``, Kaldi's convention)."""
        n_cmd = sum(1 for c in self.commands if not COMMAND_SPECS[c.command_type].is_noop)
        return {"commands": n_cmd, "matrices": max(0, len(self.matrices) - 1),
                "peak_bytes": self.peak_bytes()}

    def copy(self) -> "NnetComputation":
        """A copy whose lists and commands can be changed without changing this
        computation.  The debug-info entries are shared: to change one in a
        copy, replace it (``matrix_debug_info[m] = MatrixDebugInfo(...)``) rather
        than changing it in place, as the optimizer's passes do."""
        new = _copy.copy(self)
        new.matrices = list(self.matrices)
        new.matrix_debug_info = list(self.matrix_debug_info)
        new.submatrices = list(self.submatrices)
        new.component_precomputed_indexes = list(self.component_precomputed_indexes)
        new.indexes = [list(v) for v in self.indexes]
        new.indexes_multi = [list(v) for v in self.indexes_multi]
        new.indexes_ranges = [list(v) for v in self.indexes_ranges]
        new.commands = list(map(copy_command, self.commands))
        new.segments = list(self.segments)
        return new

    def debug_cindex_rows(self) -> np.ndarray:
        """The debug-info cindexes of matrices 1.. in order as a (k, 4) int64 array of
        node, n, t, x rows (not to be written to): the arrays of the entries held as
        such (DebugCindexes), the other entries' lists read in one go (debug_rows)."""
        entries = self.matrix_debug_info[1:]
        parts: list = [None] * len(entries)
        missing = []
        for i, d in enumerate(entries):
            if type(d.cindexes) is DebugCindexes:
                parts[i] = d.cindexes.rows
            else:
                missing.append(i)
        if missing:
            lists = [entries[i].cindexes for i in missing]
            read = debug_rows([ci for lst in lists for ci in lst])
            at = 0
            for i, lst in zip(missing, lists):
                parts[i] = read[at:at + len(lst)]
                at += len(lst)
        return np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int64)

    # -- printing ------------------------------------------------------------------------
    def submatrix_strings(self) -> list[str]:
        out = ["[]"]
        for s in range(1, len(self.submatrices)):
            sm = self.submatrices[s]
            if self.is_whole_matrix(s):
                out.append(f"m{sm.matrix_index}")
            else:
                out.append(f"m{sm.matrix_index}({sm.row_offset}:{sm.row_offset + sm.num_rows - 1},"
                           f" {sm.col_offset}:{sm.col_offset + sm.num_cols - 1})")
        return out

    def command_strings(self, nnet=None) -> list[str]:
        """One printed line (without 'cN: ' and newline) per command."""
        ctx = _PrintCtx(self, nnet)
        return [COMMAND_SPECS[c.command_type].printer(ctx, c) for c in self.commands]

    def command_string(self, i: int, nnet=None) -> str:
        ctx = _PrintCtx(self, nnet)
        c = self.commands[i]
        return _elide_command(f"c{i}: " + COMMAND_SPECS[c.command_type].printer(ctx, c))

    def preamble(self, nnet=None) -> str:
        lines = ["matrix " + ", ".join(f"m{i}({m.num_rows}, {m.num_cols})"
                                       for i, m in enumerate(self.matrices) if i > 0)]
        if self.matrix_debug_info:
            lines.append("# The following show how matrices correspond to network-nodes and")
            lines.append("# cindex-ids.  Format is: matrix = <node-id>.[value|deriv][ "
                         "<list-of-cindex-ids> ]")
            lines.append("# where a cindex-id is written as (n,t[,x]) but ranges of t values "
                         "are compressed")
            lines.append("# so we write (n, tfirst:tlast).")
            names = _all_node_names(nnet)
            for i in range(1, len(self.matrices)):
                d = self.matrix_debug_info[i]
                lines.append(f"m{i} == {'deriv: ' if d.is_deriv else 'value: '}"
                             + format_cindexes(d.cindexes, names))
        return "\n".join(lines) + "\n"

    def to_text(self, nnet=None) -> str:
        """Kaldi's NnetComputation::Print."""
        ctx = _PrintCtx(self, nnet)
        out = [self.preamble(nnet), "# begin forward commands\n"]
        for i, c in enumerate(self.commands):
            out.append(_elide_command(f"c{i}: " + COMMAND_SPECS[c.command_type].printer(ctx, c)))
        return "".join(out)

    print = to_text


def _elide_command(line: str) -> str:
    # Kaldi elides the whole command string, newline included, beyond 200 chars.
    s = line + "\n"
    if len(s) <= 200:
        return s
    return s[:100] + " ... " + s[len(s) - 100:]


def no_time_index(n: int = 0) -> tuple[int, int, int]:
    return (n, K_NO_TIME, 0)


def submatrix_accesses(computation: NnetComputation, command: Command,
                       nnet=None) -> list[tuple[int, Access]]:
    """(submatrix, access) pairs a command touches, from COMMAND_SPECS, refined by the
    component's PROPAGATE_ADDS / BACKPROP_ADDS flags and expanded over indexes_multi."""
    spec = COMMAND_SPECS[command.command_type]
    args = command.args
    out: list[tuple[int, Access]] = []
    for i, slot in enumerate(spec.slots):
        a = args[i]
        if slot.kind == ArgKind.SUBMATRIX and a > 0:
            acc = slot.access
            if nnet is not None and acc == Access.WRITE:
                from engine.nnet.components.base import ComponentProperty as P  # noqa: PLC0415
                ct = command.command_type
                if ct == CT.PROPAGATE or ct in (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE):
                    props = nnet.components[command.arg1].properties()
                    flag = P.PROPAGATE_ADDS if ct == CT.PROPAGATE else P.BACKPROP_ADDS
                    if props & flag:
                        acc = Access.READWRITE
            out.append((a, acc))
        elif slot.kind == ArgKind.INDEXES_MULTI:
            seen = sorted({s for s, _ in computation.indexes_multi[a] if s > 0})
            out.extend((s, slot.access) for s in seen)
    return out


def indexes_multi_array(pairs) -> np.ndarray:
    """(N, 2) int array form of an indexes_multi entry."""
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)


_command_type = attrgetter("command_type")


def command_types(commands: list) -> list:
    """The command type of each command, in order (made in C: no Python call per
    command)."""
    return list(map(_command_type, commands))


def positions(items: list, value) -> list[int]:
    """The positions of ``value`` in ``items``, in order (list.index: a scan in C, for
    few hits in a long list)."""
    out = []
    at = -1
    try:
        while True:
            at = items.index(value, at + 1)
            out.append(at)
    except ValueError:
        return out
