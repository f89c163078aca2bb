"""Row-operation simplifications: Kaldi's ``ReplaceRowWithMatrixOps``,
``SnipRowOps`` and ``SplitRowOps`` (nnet-optimize-utils.cc), run from
``Optimize()`` when ``optimize_row_ops``, ``snip_row_ops`` and
``split_row_ops`` are set (in the order snip, split, replace; a renumbering
follows if any of them changed something).

All three only rewrite commands and add submatrices / index tables; they never
change what a computation computes:

- ``replace_row_with_matrix_ops``: kCopyRows/kAddRows whose index table is
  ``-1 ... -1, k, k+1, ..., k+n-1, -1 ... -1`` becomes kMatrixCopy/kMatrixAdd on
  row ranges.  (For kCopyRows the ``-1`` rows would have been zeroed; dropping
  that is safe because the compiler only emits row copies into freshly zeroed
  matrices, and this runs before the zeroing is removed.)
- ``snip_row_ops``: leading/trailing "nothing" rows of add-type row commands
  (kAddRows, kAddRowsMulti, kAddToRowsMulti, kCopyToRowsMulti: ``-1`` entries;
  kAddRowRanges: empty ranges) are cut off, shrinking the destination.  The
  copy-type kCopyRows/kCopyRowsMulti are left alone: there ``-1`` means
  "write zero".
- ``split_row_ops``: a multi-row command whose sources come from at most two
  submatrices (one run each) becomes one or two single-source commands
  (kMatrixCopy/Add when the rows are consecutive, kCopyRows/kAddRows otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import dropwhile

from engine.compiler.computation import Command, NnetComputation, SubMatrixInfo
from engine.optimizer.analysis import CT
from engine.optimizer.passes._edit import insert_commands

# SplitRowOps does not create a single-source command whose source block is
# more than this many times larger than the number of rows it moves.
_MAX_SIZE_RATIO = 2
# SubMatrixInfo from a tuple without the Python-level __new__ of the named tuple
_submatrix_info = partial(tuple.__new__, SubMatrixInfo)


def _special_structure(indexes) -> tuple[int, int, int] | None:
    """(first_nonnegative_pos, first_value, count) when ``indexes`` is -1's, one run of
    consecutive nonnegative values, then -1's; None otherwise."""
    n = len(indexes)
    first = 0
    while first < n and indexes[first] < 0:
        first += 1
    if first == n:
        return None
    last = n - 1
    while indexes[last] < 0:
        last -= 1
    value = int(indexes[first])
    count = last + 1 - first
    run = indexes if count == n else indexes[first:last + 1]
    if indexes[last] != value + count - 1 or list(run) != list(range(value, value + count)):
        return None
    return first, value, count


def replace_row_with_matrix_ops(computation: NnetComputation, ctx=None) -> bool:
    """Kaldi's ReplaceRowWithMatrixOps."""
    changed = False
    copy_rows, add_rows = CT.COPY_ROWS, CT.ADD_ROWS
    subs, indexes = computation.submatrices, computation.indexes
    found_of: dict[int, tuple | None] = {}   # index list -> _special_structure of it
    for c in computation.commands:
        ct = c.command_type
        if ct != copy_rows and ct != add_rows:
            continue
        k = c.arg3
        found = found_of.get(k, False)
        if found is False:
            found = found_of[k] = _special_structure(indexes[k])
        if found is None:
            continue
        pos, value, count = found
        c.arg1 = _rows_of(subs, c.arg1, pos, count)
        c.arg2 = _rows_of(subs, c.arg2, value, count)
        c.arg3 = -1
        c.command_type = CT.MATRIX_COPY if ct == copy_rows else CT.MATRIX_ADD
        changed = True
    return changed


def _rows_of(subs: list, base: int, row_offset: int, num_rows: int) -> int:
    """``NnetComputation.new_submatrix(base, row_offset, num_rows, 0, -1)``: a new
    submatrix of rows of submatrix ``base``, all its columns."""
    b = subs[base]
    if not (0 <= row_offset and num_rows > 0 and row_offset + num_rows <= b.num_rows):
        raise ValueError(f"new_submatrix: ({row_offset}, {num_rows}, 0, {b.num_cols}) out of "
                         f"range of submatrix {base}")
    subs.append(_submatrix_info((b.matrix_index, b.row_offset + row_offset, num_rows,
                                 b.col_offset, b.num_cols)))
    return len(subs) - 1


def _leading_trailing(empty: list[bool]) -> tuple[int, int] | None:
    """Number of leading and trailing True entries; None if all are True (nothing
    to keep: Kaldi asserts this never happens, we leave such a command alone)."""
    n = len(empty)
    lead = 0
    while lead < n and empty[lead]:
        lead += 1
    if lead == n:
        return None
    trail = 0
    while empty[n - 1 - trail]:
        trail += 1
    return lead, trail


def _snip(computation: NnetComputation, c: Command, table: list, empty: list[bool],
          table_slot: int, tables: list) -> bool:
    lt = _leading_trailing(empty)
    if lt is None or lt == (0, 0):
        return False
    lead, trail = lt
    n = len(table) - lead - trail
    tables.append(list(table[lead:lead + n]))
    c.set_arg(table_slot, len(tables) - 1)
    c.arg1 = computation.new_submatrix(c.arg1, lead, n, 0, -1)
    return True


_SNIPPED = frozenset((CT.ADD_ROWS, CT.ADD_ROW_RANGES, CT.ADD_ROWS_MULTI, CT.ADD_TO_ROWS_MULTI,
                      CT.COPY_TO_ROWS_MULTI))


def snip_row_ops(computation: NnetComputation, ctx=None) -> bool:
    """Kaldi's SnipRowOps."""
    changed = False
    add_rows, add_row_ranges, snipped = CT.ADD_ROWS, CT.ADD_ROW_RANGES, _SNIPPED
    for c in computation.commands:
        ct = c.command_type
        if ct not in snipped:
            continue
        if ct == add_rows:
            table = computation.indexes[c.arg3]
            if table and table[0] >= 0 and table[-1] >= 0:
                continue   # nothing to cut
            changed |= _snip(computation, c, table, [i < 0 for i in table], 2,
                             computation.indexes)
        elif ct == add_row_ranges:
            table = computation.indexes_ranges[c.arg3]
            changed |= _snip(computation, c, table, [p[0] == p[1] for p in table], 2,
                             computation.indexes_ranges)
        else:   # the multi-row commands but kCopyRowsMulti
            table = computation.indexes_multi[c.arg2]
            if table and table[0][0] >= 0 and table[-1][0] >= 0:
                continue
            changed |= _snip(computation, c, table, [p[0] < 0 for p in table], 1,
                             computation.indexes_multi)
    return changed


# ------------------------------------------------------------------------------------------
# SplitRowOps


@dataclass
class _Split:
    offset: int            # first position in the indexes_multi list
    size: int              # number of positions
    submatrix: int         # the one source/destination submatrix of this run
    min_row: int           # smallest row used in that submatrix
    row_range: int         # max row + 1 - min_row
    row_offsets: list[int] | None   # row - min_row per position; None if consecutive


# The lists are short (a chunk's rows), so they are handled as tuples with the
# C-level built-ins rather than as NumPy arrays (each NumPy call on a few dozen
# entries costs more than the whole job).

def _split_info(subs: tuple, rows: tuple, offset: int) -> _Split | None:
    """Kaldi's GetSplitInfo on one run: ``subs``, ``rows`` the submatrices and
    rows from position ``offset`` on."""
    first = subs[0]
    size = len(subs)
    if first < 0 or subs.count(first) != size:
        return None
    lo, hi = min(rows), max(rows)
    if lo < 0:
        return None
    row_range = hi + 1 - lo
    if row_range > size * _MAX_SIZE_RATIO:
        return None
    consecutive = rows == tuple(range(rows[0], rows[0] + size))
    return _Split(offset, size, first, lo, row_range,
                  None if consecutive else list(map(lo.__rsub__, rows)))


def _split_indexes(computation: NnetComputation) -> list[list[_Split]]:
    """Kaldi's SplitIndexes: per indexes_multi entry, one or two runs of equal
    submatrix, or [] when it cannot be split."""
    out = []
    for pairs_list in computation.indexes_multi:
        if not pairs_list:
            out.append([])
            continue
        subs, rows = zip(*pairs_list)
        p = subs.count(subs[0])
        if p == len(subs):
            sp = _split_info(subs, rows, 0)
            out.append([sp] if sp is not None else [])
            continue
        # where the first run ends
        p = len(subs) - sum(1 for _ in dropwhile(subs[0].__eq__, subs))
        a = _split_info(subs[:p], rows[:p], 0)
        b = _split_info(subs[p:], rows[p:], p)
        out.append([a, b] if a is not None and b is not None else [])
    return out


def _split_command(computation: NnetComputation, c: Command,
                   splits: list[_Split]) -> list[Command] | None:
    ct = c.command_type
    pieces = []
    for sp in splits:
        own = computation.new_submatrix(c.arg1, sp.offset, sp.size, 0, -1)
        other = computation.new_submatrix(sp.submatrix, sp.min_row, sp.row_range, 0, -1)
        to_rows = ct in (CT.ADD_TO_ROWS_MULTI, CT.COPY_TO_ROWS_MULTI)
        adds = ct in (CT.ADD_ROWS_MULTI, CT.ADD_TO_ROWS_MULTI)
        if sp.row_offsets is None:
            new_type = CT.MATRIX_ADD if adds else CT.MATRIX_COPY
            dest, src = (other, own) if to_rows else (own, other)
            pieces.append(Command.make(new_type, dest, src, alpha=c.alpha))
            continue
        if ct == CT.COPY_TO_ROWS_MULTI:
            # a kCopyRows in the other direction would zero the rows it does not
            # name, where CopyToRowsMulti leaves them alone
            return None
        if ct == CT.ADD_TO_ROWS_MULTI:
            if len(set(sp.row_offsets)) != sp.size:
                return None   # a destination row named twice: not expressible as AddRows
            inverse = [-1] * sp.row_range
            for k, r in enumerate(sp.row_offsets):
                inverse[r] = k
            computation.indexes.append(inverse)
            pieces.append(Command.make(CT.ADD_ROWS, other, own, len(computation.indexes) - 1,
                                       alpha=c.alpha))
        else:
            computation.indexes.append(list(sp.row_offsets))   # its own list per command
            new_type = CT.ADD_ROWS if ct == CT.ADD_ROWS_MULTI else CT.COPY_ROWS
            pieces.append(Command.make(new_type, own, other, len(computation.indexes) - 1,
                                       alpha=c.alpha))
    return pieces


def split_row_ops(computation: NnetComputation, ctx=None) -> bool:
    """Kaldi's SplitRowOps."""
    split_info = _split_indexes(computation)
    if not any(split_info):
        return False
    changed = False
    extra: list[tuple[int, Command]] = []
    multi = (CT.ADD_ROWS_MULTI, CT.COPY_ROWS_MULTI, CT.ADD_TO_ROWS_MULTI, CT.COPY_TO_ROWS_MULTI)
    for i, c in enumerate(computation.commands):
        if c.command_type not in multi:
            continue
        splits = split_info[c.arg2]
        if not splits:
            continue
        pieces = _split_command(computation, c, splits)
        if pieces is None:
            continue
        computation.commands[i] = pieces[0]
        extra.extend((i + 1, p) for p in pieces[1:])
        changed = True
    insert_commands(extra, computation)
    return changed
