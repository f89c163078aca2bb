"""Derivative time limits: Kaldi's ``LimitDerivativeTimes`` (class
``DerivativeTimeLimiter`` in nnet-optimize-utils.cc), run first in ``Optimize()``
whenever ``min_deriv_time``, ``max_deriv_time`` or ``max_deriv_time_relative``
is set.

Meaning: derivatives are treated as zero for every row whose ``t`` lies outside
``[min_deriv_time, max_deriv_time]`` (this is how truncated BPTT is set up for
recurrent training).  Value matrices are untouched; for derivative matrices
(told apart by the matrix debug info, which is therefore required):

1. each derivative matrix gets the row range that holds its in-range rows;
   every submatrix gets its image inside that range (or none);
2. commands are rewritten to work on those images only: matrix copies/adds on
   the common kept rows, row commands with re-based index tables where rows
   that are out of range become -1 / empty ranges, backprops of simple
   components (without memos) on the kept rows, and commands left with
   nothing to do become no-ops (a backprop removed this way takes its memo
   with it, so the propagate stops producing it);
3. derivative matrices that are now never used (apart from zeroing) lose their
   allocation and zeroing; those used only inside their kept range shrink to it.

Turning a copy into a no-op is only right because this runs before any other
pass: at that point every matrix is zeroed at allocation and nothing
overwrites a nonzero value, so skipping a copy of zeros changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.compiler.computation import MatrixDebugInfo, NnetComputation
from engine.core.errors import CheckError
from engine.nnet.components.base import ComponentProperty as P
from engine.optimizer.analysis import CT, Analyzer
from engine.optimizer.options import INT32_MAX, INT32_MIN
from engine.optimizer.passes.remove_no_ops import remove_no_ops
from engine.optimizer.passes.renumber import renumber_computation


@dataclass
class _PruneInfo:
    fully_inside: bool = False
    partly_inside: bool = False
    row_begin: int = 0
    row_end: int = 0


class DerivativeTimeLimiter:
    def __init__(self, nnet, min_t: int, max_t: int, computation: NnetComputation):
        if max_t < min_t:
            raise CheckError(f"limit_derivative_times: max_deriv_time {max_t} < "
                             f"min_deriv_time {min_t}")
        self.nnet = nnet
        self.min_t = min_t
        self.max_t = max_t
        self.c = computation
        self.memos_to_delete: set[int] = set()

    # -- set-up ---------------------------------------------------------------------------
    def _compute_matrix_prune_info(self) -> None:
        c = self.c
        if len(c.matrix_debug_info) != len(c.matrices):
            raise CheckError("limiting derivative times needs the matrix debug info "
                             "(compile with output_debug_info)")
        self.t_of: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        self.is_deriv = [False] + [d.is_deriv for d in c.matrix_debug_info[1:]]
        self.prune: list[_PruneInfo] = [_PruneInfo()]
        for m in range(1, len(c.matrices)):
            cidx = c.matrix_debug_info[m].cindexes
            if len(cidx) != c.matrices[m].num_rows:
                raise CheckError(f"m{m}: debug info has {len(cidx)} cindexes for "
                                 f"{c.matrices[m].num_rows} rows")
            t = np.fromiter((ci[1][1] for ci in cidx), dtype=np.int64, count=len(cidx))
            self.t_of.append(t)
            inside = np.nonzero((t >= self.min_t) & (t <= self.max_t))[0]
            info = _PruneInfo()
            if inside.size == 0:
                pass
            elif inside[0] == 0 and inside[-1] == len(t) - 1:
                info.fully_inside = True
            else:
                info.partly_inside = True
                info.row_begin, info.row_end = int(inside[0]), int(inside[-1]) + 1
            self.prune.append(info)

    def _compute_submatrix_maps(self) -> None:
        c = self.c
        n = len(c.submatrices)
        self.map = [0] * n
        self.map_if_deriv = [0] * n
        for s in range(1, n):
            sm = c.submatrices[s]
            info = self.prune[sm.matrix_index]
            if info.fully_inside:
                mapped = s
            elif not info.partly_inside:
                mapped = 0
            else:
                begin = max(info.row_begin, sm.row_offset)
                end = min(info.row_end, sm.row_offset + sm.num_rows)
                mapped = (0 if end <= begin else
                          c.new_submatrix(s, begin - sm.row_offset, end - begin, 0, -1))
            self.map[s] = mapped
            self.map_if_deriv[s] = mapped if self.is_deriv[sm.matrix_index] else s

    # -- helpers --------------------------------------------------------------------------
    def _kept(self, s: int, rows: np.ndarray) -> np.ndarray:
        """Kaldi's RowIsKept for many rows of submatrix s at once."""
        sm = self.c.submatrices[s]
        if not self.is_deriv[sm.matrix_index]:
            return np.ones(rows.shape, dtype=bool)
        t = self.t_of[sm.matrix_index][rows + sm.row_offset]
        return (t >= self.min_t) & (t <= self.max_t)

    def _left_prune(self, s: int, mapped: int) -> int:
        return self.c.submatrices[mapped].row_offset - self.c.submatrices[s].row_offset

    def _prunes(self, s: int, mapped: int) -> tuple[int, int]:
        left = self._left_prune(s, mapped)
        right = (self.c.submatrices[s].num_rows - self.c.submatrices[mapped].num_rows - left)
        return left, right

    # -- commands -------------------------------------------------------------------------
    def _modify_command(self, cmd) -> None:
        ct = cmd.command_type
        if ct == CT.PROPAGATE:
            # no stats for an output that is entirely out of range (as Kaldi)
            if self.map[cmd.arg4] == 0:
                cmd.arg6 = 0
        elif ct in (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE):
            self._map_backprop(cmd)
        elif ct in (CT.MATRIX_COPY, CT.MATRIX_ADD):
            self._map_simple(cmd)
        elif ct in (CT.COPY_ROWS, CT.ADD_ROWS):
            self._map_indexes(cmd)
        elif ct in (CT.COPY_ROWS_MULTI, CT.COPY_TO_ROWS_MULTI, CT.ADD_ROWS_MULTI,
                    CT.ADD_TO_ROWS_MULTI):
            self._map_indexes_multi(cmd)
        elif ct == CT.ADD_ROW_RANGES:
            self._map_row_ranges(cmd)
        elif ct in (CT.COMPRESS_MATRIX, CT.DECOMPRESS_MATRIX, CT.GOTO_LABEL):
            raise CheckError(f"limit_derivative_times: unexpected {ct.kaldi_name} (this pass "
                             "must run on a freshly compiled computation)")

    def _map_backprop(self, cmd) -> None:
        props = self.nnet.components[cmd.arg1].properties()
        if not props & P.SIMPLE_COMPONENT:
            return   # non-simple components would need new precomputed indexes
        m_in, m_out, m_oderiv, m_ideriv = (self.map[a] for a in (cmd.arg3, cmd.arg4, cmd.arg5,
                                                                  cmd.arg6))
        if m_oderiv == 0:
            cmd.command_type = CT.NO_OPERATION
            if cmd.arg7 > 0:
                self.memos_to_delete.add(cmd.arg7)
        elif m_oderiv != cmd.arg5 and not props & P.USES_MEMO:
            cmd.arg3, cmd.arg4, cmd.arg5, cmd.arg6 = m_in, m_out, m_oderiv, m_ideriv

    def _map_simple(self, cmd) -> None:
        s1, s2 = cmd.arg1, cmd.arg2
        m1, m2 = self.map_if_deriv[s1], self.map_if_deriv[s2]
        if m1 == s1 and m2 == s2:
            return
        if m1 == 0 or m2 == 0:
            cmd.command_type = CT.NO_OPERATION
            return
        p1, p2 = self._prunes(s1, m1), self._prunes(s2, m2)
        if p1 == p2:
            cmd.arg1, cmd.arg2 = m1, m2
            return
        left, right = max(p1[0], p2[0]), max(p1[1], p2[1])
        rows = self.c.submatrices[s1].num_rows
        if left + right >= rows:
            cmd.command_type = CT.NO_OPERATION
            return
        n = rows - left - right
        cmd.arg1 = self.c.new_submatrix(s1, left, n, 0, -1)
        cmd.arg2 = self.c.new_submatrix(s2, left, n, 0, -1)

    def _map_indexes(self, cmd) -> None:
        out_s, in_s = cmd.arg1, cmd.arg2
        in_m, out_m = self.map_if_deriv[in_s], self.map_if_deriv[out_s]
        if in_m == 0 or out_m == 0:
            cmd.command_type = CT.NO_OPERATION
            return
        old = np.asarray(self.c.indexes[cmd.arg3], dtype=np.int64)
        lp_in, lp_out = self._left_prune(in_s, in_m), self._left_prune(out_s, out_m)
        n_out = self.c.submatrices[out_m].num_rows
        orig = old[lp_out:lp_out + n_out]
        valid = orig >= 0
        keep = valid.copy()
        keep[valid] = self._kept(in_s, orig[valid])
        keep &= self._kept(out_m, np.arange(n_out))
        if not keep.any():
            cmd.command_type = CT.NO_OPERATION
            return
        new = np.where(keep, orig - lp_in, -1)
        self.c.indexes.append(new.tolist())
        cmd.arg1, cmd.arg2, cmd.arg3 = out_m, in_m, len(self.c.indexes) - 1

    def _map_indexes_multi(self, cmd) -> None:
        c = self.c
        dest, dest_m = cmd.arg1, self.map_if_deriv[cmd.arg1]
        if dest_m == 0:
            cmd.command_type = CT.NO_OPERATION
            return
        lp = self._left_prune(dest, dest_m)
        n = c.submatrices[dest_m].num_rows
        old = np.asarray(c.indexes_multi[cmd.arg2], dtype=np.int64).reshape(-1, 2)
        new = old[lp:lp + n].copy()
        dest_kept = self._kept(dest_m, np.arange(n))
        any_kept = False
        for src in np.unique(new[:, 0]):
            if src < 0:
                continue
            pos = np.nonzero(new[:, 0] == src)[0]
            keep = self._kept(int(src), new[pos, 1]) & dest_kept[pos]
            drop = pos[~keep]
            new[drop] = -1
            pos = pos[keep]
            if pos.size == 0:
                continue
            src_m = self.map_if_deriv[int(src)]
            if src_m == 0:
                raise CheckError(f"limit_derivative_times: kept rows in submatrix {src}, "
                                 "which lies outside the time range")
            new[pos, 0] = src_m
            new[pos, 1] -= self._left_prune(int(src), src_m)
            any_kept = True
        if not any_kept:
            cmd.command_type = CT.NO_OPERATION
            return
        new_list = [tuple(p) for p in new.tolist()]
        if dest_m == dest and new_list == [tuple(p) for p in old.tolist()]:
            return
        c.indexes_multi.append(new_list)
        cmd.arg1, cmd.arg2 = dest_m, len(c.indexes_multi) - 1

    def _map_row_ranges(self, cmd) -> None:
        c = self.c
        dest, src = cmd.arg1, cmd.arg2
        dest_m, src_m = self.map_if_deriv[dest], self.map_if_deriv[src]
        if dest_m == dest and src_m == src:
            return
        if dest_m == 0 or src_m == 0:
            cmd.command_type = CT.NO_OPERATION
            return
        n = c.submatrices[dest_m].num_rows
        lp_dest, lp_src = self._left_prune(dest, dest_m), self._left_prune(src, src_m)
        ranges = np.asarray(c.indexes_ranges[cmd.arg3], dtype=np.int64).reshape(-1, 2)
        ranges = ranges[lp_dest:lp_dest + n].copy()
        start, end = ranges[:, 0].copy(), ranges[:, 1].copy()
        n_src = c.submatrices[src].num_rows
        kept = self._kept(src, np.arange(n_src))
        # first kept row at or after r, and last kept row at or before r
        idx = np.arange(n_src)
        next_kept = np.minimum.accumulate(np.where(kept, idx, n_src)[::-1])[::-1]
        prev_kept = np.maximum.accumulate(np.where(kept, idx, -1))
        live = (start >= 0) & self._kept(dest_m, np.arange(n))
        st = start[live]
        en = end[live]
        nonempty = st < en
        st2 = st.copy()
        st2[nonempty] = np.minimum(next_kept[st[nonempty]], en[nonempty])
        en2 = en.copy()
        ne2 = st2 < en2
        en2[ne2] = np.maximum(prev_kept[en2[ne2] - 1] + 1, st2[ne2])
        empty = st2 == en2
        st2 = np.where(empty, -1, st2 - lp_src)
        en2 = np.where(empty, -1, en2 - lp_src)
        start[live], end[live] = st2, en2
        start[~live & (start >= 0)] = -1
        end[start == -1] = -1
        if not (start >= 0).any():
            cmd.command_type = CT.NO_OPERATION
            return
        c.indexes_ranges.append(list(zip(start.tolist(), end.tolist())))
        cmd.arg1, cmd.arg2, cmd.arg3 = dest_m, src_m, len(c.indexes_ranges) - 1

    # -- matrices -------------------------------------------------------------------------
    def _can_limit(self, analyzer: Analyzer, m: int) -> bool:
        s_whole = self.whole[m]
        s_mapped = self.map[s_whole]
        vars_ = analyzer.variables.variables_for_submatrix
        excluded = set(vars_[s_whole]) - set(vars_[s_mapped])
        cmds = self.c.commands
        return all(cmds[ci].command_type == CT.SET_CONST
                   for v in excluded for ci, _ in analyzer.variable_accesses[v])

    def _prune_matrices(self) -> None:
        c = self.c
        analyzer = Analyzer(self.nnet, c)
        will_limit = [False] * len(c.matrices)
        for m in range(1, len(c.matrices)):
            acc = analyzer.matrix_accesses[m]
            info = self.prune[m]
            if info.fully_inside or acc.is_input or acc.is_output or not self.is_deriv[m]:
                continue
            if not info.partly_inside:
                if all(c.commands[ci].command_type in (CT.NO_OPERATION, CT.SET_CONST)
                       for ci, _ in acc.accesses):
                    for ci in [acc.allocate_command, acc.deallocate_command] + [
                            ci for ci, _ in acc.accesses]:
                        if ci >= 0:
                            c.commands[ci].command_type = CT.NO_OPERATION
            elif self._can_limit(analyzer, m):
                will_limit[m] = True
        if any(will_limit):
            self._limit_matrices(will_limit)

    def _limit_matrices(self, will_limit: list[bool]) -> None:
        c = self.c
        for s in range(1, len(c.submatrices)):
            sm = c.submatrices[s]
            m = sm.matrix_index
            if not will_limit[m]:
                continue
            info = self.prune[m]
            rows = info.row_end - info.row_begin
            begin = sm.row_offset - info.row_begin
            if begin >= 0 and sm.num_rows + begin <= rows:
                c.submatrices[s] = sm._replace(row_offset=begin)
            elif c.is_whole_matrix(s):
                c.submatrices[s] = sm._replace(num_rows=rows)
            else:
                # never used after the rewrite; a 1x1 shape makes any use fail loudly
                c.submatrices[s] = sm._replace(row_offset=0, num_rows=1, col_offset=0,
                                               num_cols=1)
        for m in range(1, len(c.matrices)):
            if will_limit[m]:
                info = self.prune[m]
                # a new entry: copies of the computation share the old one
                dbg = c.matrix_debug_info[m]
                c.matrix_debug_info[m] = MatrixDebugInfo(
                    dbg.is_deriv, list(dbg.cindexes[info.row_begin:info.row_end]))
                c.matrices[m] = c.matrices[m]._replace(num_rows=info.row_end - info.row_begin)

    def _remove_unused_memos(self) -> None:
        if not self.memos_to_delete:
            return
        removed = 0
        for cmd in self.c.commands:
            if cmd.command_type == CT.PROPAGATE and cmd.arg5 in self.memos_to_delete:
                cmd.arg5 = 0
                removed += 1
        if removed != len(self.memos_to_delete):
            raise CheckError("limit_derivative_times: a deleted memo had no propagate")

    def limit(self) -> bool:
        if self.min_t == INT32_MIN and self.max_t == INT32_MAX:
            return False
        self.whole = self.c.whole_submatrices()
        self._compute_matrix_prune_info()
        self._compute_submatrix_maps()
        for cmd in self.c.commands:
            self._modify_command(cmd)
        self._prune_matrices()
        remove_no_ops(self.c)
        self._remove_unused_memos()
        renumber_computation(self.c)
        return True


def limit_derivative_times(computation: NnetComputation, ctx) -> bool:
    """Kaldi's LimitDerivativeTimes with the limits from ``ctx.options`` (the
    relative maximum is taken from the largest output t of ``ctx``'s request)."""
    o = ctx.options
    max_out = getattr(ctx, "max_output_time", None)
    max_t = o.effective_max_deriv_time(max_out if o.max_deriv_time_relative != INT32_MAX
                                       else None)
    o.check_deriv_times(max_out)
    return DerivativeTimeLimiter(ctx.nnet, o.min_deriv_time, max_t, computation).limit()
