"""StatisticsExtractionComponent and StatisticsPoolingComponent (Kaldi's
nnet-general-component.{h,cc}), the pair behind x-vector style statistics pooling.

Extraction turns frames at ``input-period`` into per-block sufficient statistics
[count, sum x, (sum x^2)] at ``output-period`` (one output per block of
``output-period`` frames).  Pooling sums those statistics over a window
[t - left-context, t + right-context] and turns them into means (and standard
deviations), optionally prefixed by log-count features.

Both sort their indexes by (n, x, t) in ``reorder_indexes`` so that every output's
inputs form one contiguous row range; the precomputed indexes are those ranges
(forward) and, for backprop, the reverse map / ranges.  Sums over ranges use
``add_row_ranges`` (vectorised, exact).
"""

from __future__ import annotations

import numpy as np

from engine.core.errors import ComponentError
from engine.core.index import Index, as_index_rows
from engine.core.xp import array_module
from engine.nnet.components._nonsimple_utils import add_row_ranges, config_errors_name_type
from engine.nnet.components._fields import BOOL, FLOAT, INT, TokenFieldsComponent
from engine.nnet.components.base import (
    ComponentPrecomputedIndexes,
    ComponentProperty as P,
    PrecomputeOnRows,
    ReorderOnRows,
    register_component,
)
from engine.nnet.kaldi_io import KaldiReader


# The most input Indexes one output Index may gather (output-period / input-period for
# extraction, the pooling window / input-period for pooling).  Kaldi's recipes pool over at
# most 10000 frames; a period or context of billions (a corrupted or mistyped model) would
# make every output's list of inputs billions of Indexes long.
MAX_INPUTS_PER_OUTPUT = 1 << 17


def _span_problem(what: str, num_inputs: int) -> list[str]:
    if num_inputs > MAX_INPUTS_PER_OUTPUT:
        return [f"{what} gives each output {num_inputs} inputs (at most "
                f"{MAX_INPUTS_PER_OUTPUT})"]
    return []


def _nxt_order(rows: np.ndarray) -> np.ndarray | None:
    """The stable permutation sorting (k, 3) n, t, x rows as Kaldi's IndexLessNxt (n, then
    x, then t); None when they are in that order already."""
    if len(rows) < 2:
        return None
    n, t, x = rows[:, 0], rows[:, 1], rows[:, 2]
    dn, dx, dt = n[1:] - n[:-1], x[1:] - x[:-1], t[1:] - t[:-1]
    if ((dn > 0) | ((dn == 0) & ((dx > 0) | ((dx == 0) & (dt >= 0))))).all():
        return None
    return np.lexsort((t, x, n))


def _indexes(rows: np.ndarray, i: int) -> Index:
    """Row ``i`` of (k, 3) n, t, x rows as an Index (for messages)."""
    return Index(*rows[i].tolist())


def _range_lookup(input_indexes, output_indexes, lo_t: np.ndarray, hi_t: np.ndarray,
                  period: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """For each output i, the [begin, end) rows of ``input_indexes`` (sorted n, x, t)
    that share its (n, x) and have lo_t[i] <= t <= hi_t[i] on the grid t % period == 0.

    Kaldi looks each grid time up separately and asserts the hits are contiguous;
    here the sort order makes the hits a searchsorted range, and off-grid inputs
    inside a range (which Kaldi's assertion would reject) are reported."""
    inp = as_index_rows(input_indexes)
    out = as_index_rows(output_indexes)
    if inp.shape[0] > 1:
        prev, nxt = inp[:-1], inp[1:]
        ok = (prev[:, 0] < nxt[:, 0]) | ((prev[:, 0] == nxt[:, 0]) & (
            (prev[:, 2] < nxt[:, 2]) | ((prev[:, 2] == nxt[:, 2]) & (prev[:, 1] < nxt[:, 1]))))
        if not ok.all():
            raise ComponentError(f"{what}: input indexes are not sorted on (n, x, t) "
                                 "or repeat (reorder_indexes was not applied)")
    # Encode (n, x, t) as one sortable int64 key; n, x, t fit in 21 bits each after
    # shifting to non-negative ranges only for realistic index sets, so use a
    # lexicographic search over the (n, x) group instead of packing.
    pairs_in = inp[:, [0, 2]]
    groups, group_start = np.unique(pairs_in, axis=0, return_index=True)
    group_end = np.append(group_start[1:], inp.shape[0])
    # group id of every output's (n, x); -1 if absent
    if out.shape[0] == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z
    key_groups = groups[:, 0] * (1 << 32) + (groups[:, 1] + (1 << 31))
    key_out = out[:, 0] * (1 << 32) + (out[:, 2] + (1 << 31))
    g = np.searchsorted(key_groups, key_out)
    g_ok = (g < len(key_groups)) & (key_groups[np.minimum(g, len(key_groups) - 1)] == key_out)
    begins = np.zeros(out.shape[0], dtype=np.int64)
    ends = np.zeros(out.shape[0], dtype=np.int64)
    t_in = inp[:, 1]
    for_g = np.nonzero(g_ok)[0]
    if for_g.size:
        gs = group_start[g[for_g]]
        ge = group_end[g[for_g]]
        # within a group, t is sorted; search each output's window.  Offsetting by
        # the group's row start keeps one global searchsorted valid: t values of
        # different groups are made disjoint by adding group_index * span.
        span = int(t_in.max() - t_in.min() + 2) if t_in.size else 1
        row_group = np.repeat(np.arange(len(groups)), group_end - group_start)
        global_t = row_group * span + (t_in - t_in.min())
        base = g[for_g] * span - t_in.min()
        lo = np.clip(lo_t[for_g] + base, g[for_g] * span - 1, g[for_g] * span + span)
        hi = np.clip(hi_t[for_g] + base, g[for_g] * span - 1, g[for_g] * span + span)
        b = np.searchsorted(global_t, lo, side="left")
        e = np.searchsorted(global_t, hi, side="right")
        b = np.clip(b, gs, ge)
        e = np.clip(e, gs, ge)
        e = np.maximum(e, b)
        begins[for_g] = b
        ends[for_g] = e
    if period > 1 and inp.shape[0]:
        off = (t_in % period) != 0
        if off.any():
            cum = np.concatenate([[0], np.cumsum(off)])
            if (cum[ends] - cum[begins]).any():
                raise ComponentError(f"{what}: an input Index inside an output's window "
                                     f"is not on the t grid of period {period}")
    return begins, ends


# --------------------------------------------------------------------------------------


class _StatisticsComponent(ReorderOnRows, PrecomputeOnRows, TokenFieldsComponent):
    """What extraction and pooling share: input-dim and input-period, the info line,
    the (n, x, t) index order and computability (any of the inputs present)."""

    def __init__(self) -> None:
        super().__init__()
        self.input_dim_ = -1
        self.input_period = 1

    def input_dim(self) -> int:
        return self.input_dim_

    def info(self) -> str:
        return (f"{self.type_name}, input-dim={self.input_dim()}, "
                f"output-dim={self.output_dim()}")

    def input_rule(self):
        """is_computable as a rule on the columns of ``input_times`` (get_input_indexes
        of many output Indexes at once, row i the t of the inputs of an output at t[i],
        which each subclass gives; the compiler's array graph build reads both): None,
        computable when any input is, using those that are."""
        return None

    def is_computable(self, misc_info, output_index, input_index_set, used_inputs):
        present = [i for i in self.get_input_indexes(misc_info, output_index)
                   if input_index_set(i)]
        if used_inputs is not None:
            used_inputs[:] = present
        return bool(present)

    def reorder_index_arrays(self, input_rows, output_rows) -> tuple[np.ndarray, np.ndarray]:
        """reorder_indexes on (k, 3) n, t, x int64 rows: both sorted on (n, x, t), stably.
        Rows already in that order are given back as the same objects (the compiler tests
        identity to know that nothing moved)."""
        ins, outs = as_index_rows(input_rows), as_index_rows(output_rows)
        oi, oo = _nxt_order(ins), _nxt_order(outs)
        if oi is None and oo is None:
            return input_rows, output_rows
        return (ins if oi is None else ins[oi]), (outs if oo is None else outs[oo])



class StatisticsExtractionIndexes(ComponentPrecomputedIndexes):
    """forward_begin/end: row range of inputs per output row; counts: its size (float);
    backward: for each input row, the output row it contributes to."""

    def __init__(self, forward_begin, forward_end, counts, backward):
        self.forward_begin = forward_begin
        self.forward_end = forward_end
        self.counts = counts
        self.backward = backward


@register_component
class StatisticsExtractionComponent(_StatisticsComponent):
    type_name = "StatisticsExtractionComponent"
    _FIELDS = (("<InputDim>", "input_dim_", INT), ("<InputPeriod>", "input_period", INT),
              ("<OutputPeriod>", "output_period", INT),
              ("<IncludeVarinance>", "include_variance", BOOL))  # sic: Kaldi's spelling

    def __init__(self) -> None:
        super().__init__()
        self.output_period = 1
        self.include_variance = True

    def properties(self):
        return P.PROPAGATE_ADDS | P.REORDERS_INDEXES | (
            P.BACKPROP_NEEDS_INPUT if self.include_variance else P.NONE)

    def output_dim(self) -> int:
        return 1 + self.input_dim_ + (self.input_dim_ if self.include_variance else 0)

    def _check(self) -> None:
        if not (self.input_dim_ > 0 and self.input_period > 0 and self.output_period > 0
                and self.output_period % self.input_period == 0):
            raise ComponentError(
                f"invalid configuration: input-dim={self.input_dim_} (must be > 0), "
                f"input-period={self.input_period}, output-period={self.output_period} "
                "(both > 0, output-period a multiple of input-period)",
                component=self.label())
        bad = self._span_problems()
        if bad:
            raise ComponentError(bad[0], component=self.label())

    def _span_problems(self) -> list[str]:
        return _span_problem(f"output-period={self.output_period} with input-period="
                             f"{self.input_period}", self.output_period // self.input_period)

    @config_errors_name_type
    def init_from_config(self, cfg, rng) -> None:
        self.input_dim_ = cfg.get_int("input-dim", required=True)
        self.input_period = cfg.get_int("input-period", 1)
        self.output_period = cfg.get_int("output-period", 1)
        self.include_variance = cfg.get_bool("include-variance", True)
        if self.input_dim_ <= 0:
            raise cfg.error(f"{self.type_name}: input-dim must be > 0")
        if self.input_period <= 0 or self.output_period <= 0:
            raise cfg.error(f"{self.type_name}: input-period and output-period must be > 0")
        if self.output_period % self.input_period != 0:
            raise cfg.error(f"{self.type_name}: output-period={self.output_period} is not a "
                            f"multiple of input-period={self.input_period}")
        bad = self._span_problems()
        if bad:
            raise cfg.error(f"{self.type_name}: {bad[0]}")

    def _check_read(self, reader: KaldiReader) -> None:
        """After reading, a bad configuration is a ComponentError (as ``_check``)."""
        self._check()

    # -- indexes ---------------------------------------------------------------------
    def _block(self, t: int) -> tuple[int, int]:
        # Python's floor division already rounds negative t down, as Kaldi's fix-up does.
        start = self.output_period * (t // self.output_period)
        return start, start + self.output_period

    def get_input_indexes(self, misc_info, output_index):
        start, end = self._block(output_index.t)
        n, x = output_index.n, output_index.x
        return [Index(n, t, x) for t in range(start, end, self.input_period)]

    def input_times(self, t: np.ndarray) -> np.ndarray:
        start = self.output_period * np.floor_divide(t, self.output_period)
        return start[:, None] + np.arange(0, self.output_period, self.input_period)[None, :]

    def precompute_index_arrays(self, misc_info, input_rows, output_rows,
                                need_backprop: bool) -> StatisticsExtractionIndexes:
        """precompute_indexes on (k, 3) n, t, x int64 rows."""
        input_rows, output_rows = as_index_rows(input_rows), as_index_rows(output_rows)
        out_t = output_rows[:, 1]
        lo = self.output_period * np.floor_divide(out_t, self.output_period)
        hi = lo + self.output_period - 1
        begins, ends = _range_lookup(input_rows, output_rows, lo, hi,
                                     self.input_period, self.label())
        counts = (ends - begins).astype(np.float32)
        if (counts == 0).any():
            bad = _indexes(output_rows, int(np.nonzero(counts == 0)[0][0]))
            raise ComponentError(f"output Index {bad} has no inputs", component=self.label())
        n_in = len(input_rows)
        backward = np.full(n_in, -1, dtype=np.int64)
        cover = np.zeros(n_in + 1, dtype=np.int64)
        np.add.at(cover, begins, 1)
        np.add.at(cover, ends, -1)
        if (np.cumsum(cover)[:n_in] != 1).any():
            raise ComponentError("each input Index must feed exactly one output Index",
                                 component=self.label())
        # ranges are disjoint and cover every input: input j belongs to the output
        # whose range starts last at or before j.
        order = np.argsort(begins, kind="stable")
        pos = np.searchsorted(begins[order], np.arange(n_in), side="right") - 1
        backward[:] = order[pos]
        return StatisticsExtractionIndexes(begins.astype(np.int64), ends.astype(np.int64),
                                           counts, backward if need_backprop else None)

    # -- maths -------------------------------------------------------------------------
    def propagate(self, indexes, in_value, out):
        if not isinstance(indexes, StatisticsExtractionIndexes):
            raise ComponentError("propagate needs StatisticsExtraction precomputed indexes",
                                 component=self.label())
        d = self.input_dim_
        self.check_shape("input", in_value, None, d)
        self.check_shape("output", out, indexes.forward_begin.shape[0], self.output_dim())
        xp = array_module(in_value)
        # PROPAGATE_ADDS: everything is added (Kaldi zeroes and sets; the compiler
        # zeroes the output of a propagate-adds component first, so both agree).
        out[:, 0] += xp.asarray(indexes.counts, dtype=out.dtype)
        add_row_ranges(in_value, indexes.forward_begin, indexes.forward_end,
                       out[:, 1:1 + d])
        if self.include_variance:
            add_row_ranges(in_value * in_value, indexes.forward_begin,
                           indexes.forward_end, out[:, 1 + d:1 + 2 * d])
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv):
        if in_deriv is None:
            return
        if not isinstance(indexes, StatisticsExtractionIndexes) or indexes.backward is None:
            raise ComponentError("backprop needs precomputed indexes made with "
                                 "need_backprop=True", component=self.label())
        d = self.input_dim_
        self.check_shape("output derivative", out_deriv, None, self.output_dim())
        self.check_shape("input derivative", in_deriv, indexes.backward.shape[0], d)
        bw = indexes.backward
        in_deriv[...] = out_deriv[bw, 1:1 + d]
        if self.include_variance:
            in_deriv += 2.0 * out_deriv[bw, 1 + d:1 + 2 * d] * in_value


# --------------------------------------------------------------------------------------


class StatisticsPoolingIndexes(ComponentPrecomputedIndexes):
    """forward_begin/end: input row range summed for each output row;
    backward_begin/end: output row range each input row contributes to."""

    def __init__(self, forward_begin, forward_end, backward_begin, backward_end):
        self.forward_begin = forward_begin
        self.forward_end = forward_end
        self.backward_begin = backward_begin
        self.backward_end = backward_end


@register_component
class StatisticsPoolingComponent(_StatisticsComponent):
    type_name = "StatisticsPoolingComponent"
    _FIELDS = (("<InputDim>", "input_dim_", INT), ("<InputPeriod>", "input_period", INT),
              ("<LeftContext>", "left_context", INT), ("<RightContext>", "right_context", INT),
              ("<NumLogCountFeatures>", "num_log_count_features", INT),
              ("<OutputStddevs>", "output_stddevs", BOOL),
              ("<VarianceFloor>", "variance_floor", FLOAT))

    def __init__(self) -> None:
        super().__init__()
        self.left_context = -1
        self.right_context = -1
        self.num_log_count_features = 0
        self.output_stddevs = False
        self.variance_floor = 1.0e-10

    def properties(self):
        p = P.REORDERS_INDEXES | P.BACKPROP_ADDS
        if self.output_stddevs or self.num_log_count_features > 0:
            p |= P.BACKPROP_NEEDS_OUTPUT
        if self.num_log_count_features == 0:
            p |= P.BACKPROP_NEEDS_INPUT
        return p

    def output_dim(self) -> int:
        return self.input_dim_ + self.num_log_count_features - 1

    def _problems(self) -> list[str]:
        bad = []
        if self.input_dim_ <= 0:
            bad.append("input-dim must be > 0")
        if self.input_period <= 0:
            bad.append("input-period must be > 0")
        if self.left_context < 0 or self.right_context < 0 or \
                self.left_context + self.right_context <= 0:
            bad.append("left-context and right-context must be >= 0 with a positive sum")
        elif self.input_period > 0 and (self.left_context % self.input_period or
                                        self.right_context % self.input_period):
            bad.append("left-context and right-context must be multiples of input-period")
        elif self.input_period > 0:
            bad += _span_problem(
                f"left-context={self.left_context}, right-context={self.right_context} "
                f"with input-period={self.input_period}",
                (self.left_context + self.right_context) // self.input_period + 1)
        if self.num_log_count_features < 0:
            bad.append("num-log-count-features must be >= 0")
        if not 0.0 < self.variance_floor < 1.0:
            bad.append("variance-floor must be in (0, 1)")
        if self.output_stddevs and (self.input_dim_ - 1) % 2 != 0:
            bad.append("output-stddevs=true needs an odd input-dim (count + x + x^2 stats)")
        return bad

    @config_errors_name_type
    def init_from_config(self, cfg, rng) -> None:
        self.input_dim_ = cfg.get_int("input-dim", required=True)
        self.input_period = cfg.get_int("input-period", 1)
        self.left_context = cfg.get_int("left-context", -1)
        self.right_context = cfg.get_int("right-context", -1)
        self.num_log_count_features = cfg.get_int("num-log-count-features", 0)
        self.output_stddevs = cfg.get_bool("output-stddevs", False)
        self.variance_floor = cfg.get_float("variance-floor", 1.0e-10)
        self._raise_problems(cfg)

    # -- indexes ---------------------------------------------------------------------
    def get_input_indexes(self, misc_info, output_index):
        if output_index.t % self.input_period != 0:
            raise ComponentError(f"output Index {output_index} has t not a multiple of "
                                 f"input-period={self.input_period}", component=self.label())
        n, t0, x = output_index
        return [Index(n, t, x) for t in range(t0 - self.left_context,
                                              t0 + self.right_context + 1, self.input_period)]

    def input_times(self, t: np.ndarray) -> np.ndarray:
        off = t % self.input_period != 0
        if off.any():
            bad = int(t[np.flatnonzero(off)[0]])
            raise ComponentError(f"output Index with t={bad}: t not a multiple of "
                                 f"input-period={self.input_period}", component=self.label())
        steps = np.arange(-self.left_context, self.right_context + 1, self.input_period)
        return t[:, None] + steps[None, :]

    def is_computable(self, misc_info, output_index, input_index_set, used_inputs):
        if used_inputs is not None:
            used_inputs.clear()
        # outputs are only defined at multiples of the input period
        if output_index.t % self.input_period != 0:
            return False
        return super().is_computable(misc_info, output_index, input_index_set, used_inputs)

    def precompute_index_arrays(self, misc_info, input_rows, output_rows,
                                need_backprop: bool) -> StatisticsPoolingIndexes:
        """precompute_indexes on (k, 3) n, t, x int64 rows."""
        input_rows, output_rows = as_index_rows(input_rows), as_index_rows(output_rows)
        out_t = output_rows[:, 1]
        begins, ends = _range_lookup(input_rows, output_rows,
                                     out_t - self.left_context, out_t + self.right_context,
                                     self.input_period, self.label())
        if (ends <= begins).any():
            bad = _indexes(output_rows, int(np.nonzero(ends <= begins)[0][0]))
            raise ComponentError(f"output Index {bad} has no inputs", component=self.label())
        n_in = len(input_rows)
        # Outputs are sorted (n, x, t) like the inputs, so both range ends are
        # non-decreasing; the outputs using input j are those with begin <= j < end,
        # a contiguous range found by two searchsorted calls.
        if (np.diff(begins) < 0).any() or (np.diff(ends) < 0).any():
            raise ComponentError("output indexes are not sorted on (n, x, t) "
                                 "(reorder_indexes was not applied)", component=self.label())
        j = np.arange(n_in)
        bb = np.searchsorted(ends, j, side="right")
        be = np.searchsorted(begins, j, side="right")
        if (be <= bb).any():
            bad = _indexes(input_rows, int(np.nonzero(be <= bb)[0][0]))
            raise ComponentError(f"input Index {bad} is used by no output",
                                 component=self.label())
        return StatisticsPoolingIndexes(begins, ends,
                                        bb.astype(np.int64) if need_backprop else None,
                                        be.astype(np.int64) if need_backprop else None)

    # -- maths -------------------------------------------------------------------------
    def propagate(self, indexes, in_value, out):
        if not isinstance(indexes, StatisticsPoolingIndexes):
            raise ComponentError("propagate needs StatisticsPooling precomputed indexes",
                                 component=self.label())
        xp = array_module(in_value)
        d = self.input_dim_
        nl = self.num_log_count_features
        rows = indexes.forward_begin.shape[0]
        self.check_shape("input", in_value, None, d)
        self.check_shape("output", out, rows, self.output_dim())
        out[...] = 0
        counts = xp.zeros((rows, 1), dtype=in_value.dtype)
        add_row_ranges(in_value[:, 0:1], indexes.forward_begin, indexes.forward_end, counts)
        stats = out[:, nl:nl + d - 1]
        add_row_ranges(in_value[:, 1:d], indexes.forward_begin, indexes.forward_end, stats)
        stats /= counts
        if nl > 0:
            out[:, 0:nl] = xp.log(counts)
        if self.output_stddevs:
            f = (d - 1) // 2
            mean = out[:, nl:nl + f]
            var = out[:, nl + f:nl + 2 * f]
            var -= mean * mean
            xp.maximum(var, self.variance_floor, out=var)
            xp.sqrt(var, out=var)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv_in, memo,
                 to_update, in_deriv):
        if in_deriv is None:
            return
        if not isinstance(indexes, StatisticsPoolingIndexes) or indexes.backward_begin is None:
            raise ComponentError("backprop needs precomputed indexes made with "
                                 "need_backprop=True", component=self.label())
        xp = array_module(out_deriv_in)
        d = self.input_dim_
        nl = self.num_log_count_features
        rows = out_deriv_in.shape[0]
        self.check_shape("output derivative", out_deriv_in, indexes.forward_begin.shape[0],
                         self.output_dim())
        self.check_shape("input derivative", in_deriv, indexes.backward_begin.shape[0], d)
        out_deriv = out_deriv_in.copy()
        if self.output_stddevs:
            # the variance floor is ignored here, as in Kaldi (an approximation)
            f = (d - 1) // 2
            mean_deriv = out_deriv[:, nl:nl + f]
            var_deriv = out_deriv[:, nl + f:nl + 2 * f]
            var_deriv /= out_value[:, nl + f:nl + 2 * f]
            var_deriv *= 0.5
            mean_deriv -= 2.0 * out_value[:, nl:nl + f] * var_deriv
        if nl > 0:
            counts = xp.exp(out_value[:, 0:1])
        else:
            counts = xp.zeros((rows, 1), dtype=out_deriv.dtype)
            add_row_ranges(in_value[:, 0:1], indexes.forward_begin, indexes.forward_end,
                           counts)
        out_deriv /= counts
        # the count column is not differentiable: its derivative stays untouched
        add_row_ranges(out_deriv[:, nl:nl + d - 1], indexes.backward_begin,
                       indexes.backward_end, in_deriv[:, 1:d])
