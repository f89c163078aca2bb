"""The time-height convolution engine (Kaldi's convolution.{h,cc}): the model
(filters, heights, (time, height) offsets), its compilation against a set of input
and output Indexes into a ConvolutionComputation, and the GEMM-based forward and
backward passes.

Compilation follows Kaldi step by step: put input and output t values on regular
grids (GetComputationIo), pad the input's t grid to the model's time offsets,
zero-pad the model's height, append input frames together when the output t step
is a multiple of the input's (so that every step is a plain row shift), make one
"step" per distinct time offset (a row shift of the input, a column gather of the
input heights it reads and a block of the parameter matrix), then undo the height
padding by turning padded heights into -1 (zero) columns.  The Index lists are
rewritten onto the grids, with blank Indexes (t = kNoTime) for rows nobody asked for.

Each step of the maths is: gather columns (or take a contiguous column block) of a
row-shifted slice of the input, view it as (rows * height_out, cols / height_out)
and multiply by the step's parameter block.  ``temp_rows`` (from max-memory-mb) only
limits the size of the gathered temporary; the time range is processed in chunks of
that many rows, which does not change the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.core import sgemm
from engine.core.errors import ComponentError
from engine.core.xp import array_module, as_strided
from engine.nnet.components._nonsimple_utils import (
    ConvolutionComputationIo,
    get_computation_io,
    get_nx_list,
    grid_rows,
)


# The largest height-in / height-out accepted.  Checking a model costs time and memory in
# proportion to its heights (Kaldi's ConvolutionModel::Check works the same way), and
# Kaldi's convolutional networks have heights of tens to hundreds; a corrupted height of
# two billion must not make a 2 GB table.
MAX_HEIGHT = 1 << 16


@dataclass
class ConvolutionModel:
    num_filters_in: int = 0
    num_filters_out: int = 0
    height_in: int = 0
    height_out: int = 0
    height_subsample_out: int = 1
    offsets: list = field(default_factory=list)          # sorted (time, height) pairs
    required_time_offsets: set = field(default_factory=set)

    @property
    def all_time_offsets(self) -> list[int]:
        return sorted({t for t, _ in self.offsets})

    @property
    def time_offsets_modulus(self) -> int:
        ts = self.all_time_offsets
        m = 0
        for a, b in zip(ts, ts[1:]):
            m = math.gcd(m, b - a)
        return m

    def input_dim(self) -> int:
        return self.num_filters_in * self.height_in

    def output_dim(self) -> int:
        return self.num_filters_out * self.height_out

    def param_rows(self) -> int:
        return self.num_filters_out

    def param_cols(self) -> int:
        return self.num_filters_in * len(self.offsets)

    def copy(self) -> "ConvolutionModel":
        return ConvolutionModel(self.num_filters_in, self.num_filters_out, self.height_in,
                                self.height_out, self.height_subsample_out,
                                list(self.offsets), set(self.required_time_offsets))

    def info(self) -> str:
        offs = " ".join(f"{t},{h}" for t, h in self.offsets)
        req = ",".join(str(t) for t in sorted(self.required_time_offsets))
        return (f"num-filters-in={self.num_filters_in}, num-filters-out={self.num_filters_out}"
                f", height-in={self.height_in}, height-out={self.height_out}"
                f", height-subsample-out={self.height_subsample_out}"
                f", {{time,height}}-offsets=[{offs}], required-time-offsets=[{req}]"
                f", input-dim={self.input_dim()}, output-dim={self.output_dim()}")

    def problem(self, check_heights_used: bool, allow_height_padding: bool) -> str | None:
        """Kaldi's ConvolutionModel::Check: None if fine, else what is wrong."""
        if (self.num_filters_in <= 0 or self.num_filters_out <= 0 or self.height_in <= 0
                or self.height_out <= 0 or self.height_subsample_out <= 0
                or not self.offsets or not self.required_time_offsets):
            return ("num-filters-in/out, height-in/out and height-subsample-out must be > 0 "
                    "and the offsets and required time offsets non-empty")
        if max(self.height_in, self.height_out) > MAX_HEIGHT:
            return (f"height-in={self.height_in} and height-out={self.height_out} must not "
                    f"exceed {MAX_HEIGHT}")
        if sorted(set(self.offsets)) != list(self.offsets):
            return "offsets must be sorted and unique"
        if not set(self.required_time_offsets) <= set(self.all_time_offsets):
            return "required time offsets must be a subset of the time offsets"
        h_in_used = np.zeros(self.height_in, dtype=bool)
        offsets_used = np.zeros(len(self.offsets), dtype=bool)
        for h_out in range(0, self.height_out * self.height_subsample_out,
                           self.height_subsample_out):
            some_input = False
            for i, (t, h) in enumerate(self.offsets):
                h_in = h_out + h
                if 0 <= h_in < self.height_in:
                    offsets_used[i] = True
                    h_in_used[h_in] = True
                    if t in self.required_time_offsets:
                        some_input = True
                elif not allow_height_padding:
                    return "height padding would be needed but is not allowed"
            if not some_input:
                return (f"output height {h_out // self.height_subsample_out} has no input "
                        "when only the required time offsets are available")
        if check_heights_used and not h_in_used.all():
            return f"input height {int(np.nonzero(~h_in_used)[0][0])} is never used"
        if not offsets_used.all():
            t, h = self.offsets[int(np.nonzero(~offsets_used)[0][0])]
            return f"(time,height) offset ({t},{h}) is never used"
        return None


@dataclass
class ConvolutionStep:
    input_time_shift: int
    params_start_col: int
    height_map: list


@dataclass
class ConvolutionComputation:
    num_filters_in: int = 0
    num_filters_out: int = 0
    height_in: int = 0
    height_out: int = 0
    num_t_in: int = 0
    num_t_out: int = 0
    num_images: int = 0
    temp_rows: int = 0
    temp_cols: int = 0
    steps: list = field(default_factory=list)


# --------------------------------------------------------------------------------------
# compilation


def _is_contiguous(v) -> bool:
    return all(b == a + 1 for a, b in zip(v, v[1:]))


def _compute_temp_matrix_size(max_memory_mb: float, cc: ConvolutionComputation) -> None:
    temp_cols = 0
    for step in cc.steps:
        ncols = len(step.height_map) * cc.num_filters_in
        contiguous = step.height_map[0] != -1 and _is_contiguous(step.height_map)
        need_temp = not (contiguous and step.height_map[0] == 0 and
                         ncols == cc.num_filters_in * cc.height_in)
        if need_temp:
            temp_cols = max(temp_cols, ncols)
    temp_rows = 0
    if temp_cols > 0:
        temp_rows = cc.num_t_out * cc.num_images
        megabytes = 4 * (temp_rows / 1000.0) * (temp_cols / 1000.0)
        ratio = int(1.0 + megabytes / max_memory_mb)
        temp_rows = ((cc.num_t_out + ratio - 1) // ratio) * cc.num_images
    cc.temp_rows, cc.temp_cols = temp_rows, temp_cols


def _pad_model_height(model: ConvolutionModel) -> ConvolutionModel:
    hs = [h for _, h in model.offsets]
    bottom = max(0, -min(hs))
    top = max(0, max(hs) + model.height_subsample_out * (model.height_out - 1)
              - (model.height_in - 1))
    padded = model.copy()
    padded.height_in += bottom + top
    padded.offsets = [(t, h + bottom) for t, h in model.offsets]
    return padded


def _pad_computation_input_time(model: ConvolutionModel, io: ConvolutionComputationIo) -> None:
    modulus = model.time_offsets_modulus
    if modulus == 0:
        return
    ts = model.all_time_offsets
    old_step = io.t_step_in
    io.t_step_in = math.gcd(io.t_step_in, modulus)
    if io.t_step_out != 0:
        io.t_step_in = math.gcd(io.t_step_in, io.t_step_out)
    io.num_t_in = 1 + (old_step * (io.num_t_in - 1)) // io.t_step_in
    first_desired = io.start_t_out + ts[0]
    if first_desired < io.start_t_in:
        io.num_t_in += (io.start_t_in - first_desired) // io.t_step_in
        io.start_t_in = first_desired
    last_desired = io.start_t_out + (io.num_t_out - 1) * io.t_step_out + ts[-1]
    last_in = io.start_t_in + (io.num_t_in - 1) * io.t_step_in
    if last_desired > last_in:
        io.num_t_in += (last_desired - last_in) // io.t_step_in


def _append_input_frames(model: ConvolutionModel, io: ConvolutionComputationIo):
    """Kaldi's AppendInputFrames (with PrepareIoForAppending): returns the model and
    io of the frame-appended view; ``io`` itself gets reorder_t_in set."""
    if io.t_step_out == 0:
        io.t_step_out = io.t_step_in
    if io.t_step_out == io.t_step_in:
        return model, io.copy()
    if io.t_step_in == 0 or io.t_step_out % io.t_step_in != 0:
        raise ComponentError(f"output t step {io.t_step_out} is not a multiple of the "
                             f"input t step {io.t_step_in}")
    ratio = io.t_step_out // io.t_step_in
    io.reorder_t_in = ratio
    if io.num_t_in % ratio != 0:
        io.num_t_in += ratio - io.num_t_in % ratio
    io_app = io.copy()
    io_app.reorder_t_in = 1
    io_app.t_step_in = io.t_step_out
    io_app.num_t_in //= ratio
    step_out, step_in = io_app.t_step_out, io.t_step_in
    first = model.all_time_offsets[0]
    appended = ConvolutionModel(model.num_filters_in, model.num_filters_out,
                                ratio * model.height_in, model.height_out,
                                model.height_subsample_out)
    new_offsets = []
    for t, h in model.offsets:
        t0 = t - first
        new_t = step_out * (t0 // step_out)
        row = (t0 - new_t) // step_in
        new_offsets.append((new_t + first, h + row * model.height_in))
    appended.offsets = new_offsets
    appended.required_time_offsets = {t for t, _ in new_offsets}
    return appended, io_app


def _make_computation(model: ConvolutionModel, io: ConvolutionComputationIo,
                      max_memory_mb: float) -> ConvolutionComputation:
    cc = ConvolutionComputation(model.num_filters_in, model.num_filters_out,
                                model.height_in, model.height_out, io.num_t_in,
                                io.num_t_out, io.num_images)
    t_step = max(1, io.t_step_in)
    num_extra = io.num_t_in - io.num_t_out
    offs = model.offsets
    start = 0
    while start < len(offs):
        end = start
        while end < len(offs) and offs[end][0] == offs[start][0]:
            end += 1
        shift_t = offs[start][0] + io.start_t_out - io.start_t_in
        if shift_t < 0 or shift_t % t_step != 0 or shift_t // t_step > num_extra:
            raise ComponentError(f"time offset {offs[start][0]} does not fit the input grid")
        hmap = [h_out + offs[o][1]
                for h_out in range(0, model.height_out * model.height_subsample_out,
                                   model.height_subsample_out)
                for o in range(start, end)]
        cc.steps.append(ConvolutionStep(shift_t // t_step, model.num_filters_in * start, hmap))
        start = end
    _compute_temp_matrix_size(max_memory_mb, cc)
    return cc


def _unpad_model_height(max_memory_mb: float, model: ConvolutionModel,
                        padded: ConvolutionModel, cc: ConvolutionComputation) -> None:
    bottom = padded.offsets[0][1] - model.offsets[0][1]
    top = padded.height_in - model.height_in - bottom
    ratio = cc.height_in // padded.height_in
    cc.height_in = ratio * model.height_in
    for step in cc.steps:
        new = []
        for c in step.height_map:
            h, m = c % padded.height_in, c // padded.height_in
            if h < bottom or h >= padded.height_in - top:
                new.append(-1)
            else:
                new.append(h - bottom + m * model.height_in)
        step.height_map = new
    _compute_temp_matrix_size(max_memory_mb, cc)


def _check_model_and_io(model: ConvolutionModel, io: ConvolutionComputationIo,
                        allow_extra_input: bool) -> None:
    ts = model.all_time_offsets
    if not allow_extra_input:
        last_in = io.start_t_in + io.t_step_in * (io.num_t_in - 1)
        last_out = io.start_t_out + io.t_step_out * (io.num_t_out - 1)
        if io.start_t_in < io.start_t_out + ts[0] or last_in > last_out + ts[-1]:
            raise ComponentError("the input has more time context than the model uses")
    # Every output time's required inputs must lie on the input grid (Kaldi samples
    # a few output times; all of them are checked here).
    t_out = io.start_t_out + io.t_step_out * np.arange(io.num_t_out)
    step_in = max(1, io.t_step_in)
    for off in sorted(model.required_time_offsets):
        t = t_out + off
        ok = (t >= io.start_t_in) & (t < io.start_t_in + step_in * io.num_t_in) & \
            ((t - io.start_t_in) % step_in == 0)
        if not ok.all():
            raise ComponentError(f"time {int(t[~ok][0])} is required but not in the input")


def compile_convolution_rows(model: ConvolutionModel, input_indexes, output_indexes,
                             max_memory_mb: float, what: str = "a component"):
    """Kaldi's CompileConvolutionComputation: returns (computation, new input Indexes,
    new output Indexes), the new Indexes as (k, 3) int64 n, t, x rows (``input_indexes``
    and ``output_indexes`` may be Indexes or such rows).  Raises ComponentError where
    Kaldi would assert."""
    io = get_computation_io(input_indexes, output_indexes, what)
    _check_model_and_io(model, io, False)
    _pad_computation_input_time(model, io)
    _check_model_and_io(model, io, False)
    padded = _pad_model_height(model)
    _check_model_and_io(padded, io, False)
    appended, io_app = _append_input_frames(padded, io)
    _check_model_and_io(appended, io_app, True)
    cc = _make_computation(appended, io_app, max_memory_mb)
    _unpad_model_height(max_memory_mb, model, padded, cc)
    nx = get_nx_list(input_indexes)
    new_in = grid_rows(nx, io.start_t_in, io.t_step_in, io.num_t_in, io.reorder_t_in,
                       input_indexes, what)
    new_out = grid_rows(nx, io.start_t_out, io.t_step_out, io.num_t_out, 1, output_indexes,
                        what)
    return cc, new_in, new_out


# --------------------------------------------------------------------------------------
# the maths


# step_arrays' results by what they are made of (the filters, the input height and each
# step's time shift, first parameter column and height map: the model's structure, and its
# frames appended when the output's time step is a multiple of the input's), so that the
# compiles of a network after its first reuse them, as they reuse its other per-node plans;
# the arrays are read-only and the meta rows copied for each caller.
_STEP_ARRAYS: dict = {}
_STEP_ARRAYS_SIZE = 256


def step_arrays(cc: ConvolutionComputation):
    """Per-step column data: (meta rows, gather columns, backward column passes).

    meta[s] = [time shift, params start col, number of columns, contiguous (0/1),
    first column, offset into ``columns``, number of backward passes, offset into
    ``backward``]; columns use ``input_dim`` for a zero column (height -1)."""
    key = (cc.num_filters_in, cc.height_in,
           tuple((s.input_time_shift, s.params_start_col, tuple(s.height_map))
                 for s in cc.steps))
    hit = _STEP_ARRAYS.get(key)
    if hit is None:
        meta, columns, backward = _step_arrays(cc)
        columns.flags.writeable = False
        backward.flags.writeable = False
        if len(_STEP_ARRAYS) >= _STEP_ARRAYS_SIZE:
            _STEP_ARRAYS.clear()
        _STEP_ARRAYS[key] = hit = (tuple(map(tuple, meta)), columns, backward)
    meta, columns, backward = hit
    return [list(m) for m in meta], columns, backward


def _step_arrays(cc: ConvolutionComputation):
    f_in = cc.num_filters_in
    input_dim = cc.height_in * f_in
    meta, cols_all, bw_all = [], [], []
    c_off = b_off = 0
    for step in cc.steps:
        hm = np.asarray(step.height_map, dtype=np.int64)
        cols = (hm[:, None] * f_in + np.arange(f_in)[None, :]).reshape(-1)
        cols[np.repeat(hm == -1, f_in)] = input_dim
        contiguous = bool(hm[0] != -1 and _is_contiguous(step.height_map))
        # reverse map in passes with no repeated input column within a pass
        valid = np.nonzero(cols != input_dim)[0]
        order = np.argsort(cols[valid], kind="stable")
        src = valid[order]
        dst = cols[src]
        first_of = np.searchsorted(dst, dst, side="left")
        rank = np.arange(dst.size) - first_of
        npass = int(rank.max()) + 1 if dst.size else 0
        bw = np.full((npass, input_dim), cols.size, dtype=np.int64)
        bw[rank, dst] = src
        meta.append([step.input_time_shift, step.params_start_col, int(cols.size),
                     int(contiguous), int(cols[0]), c_off, npass, b_off])
        cols_all.append(cols)
        bw_all.append(bw.reshape(-1))
        c_off += cols.size
        b_off += bw.size
    return (meta, np.concatenate(cols_all) if cols_all else np.zeros(0, np.int64),
            np.concatenate(bw_all) if bw_all else np.zeros(0, np.int64))


def _chunks(ci, rows_out: int):
    """Row chunks of the output (and matching input) limited by temp_rows."""
    ni = ci.num_images
    if ci.temp_rows == 0 or ci.temp_rows >= rows_out:
        yield 0, rows_out
        return
    step = ci.temp_rows
    for r0 in range(0, rows_out, step):
        yield r0, min(rows_out, r0 + step)
    del ni


def _step_input(ci, meta, inp, r0, r1, xp):
    """The (r1-r0, ncols) gathered input block of a step for output rows r0:r1."""
    shift, _, ncols, contiguous, first, c_off, _, _ = meta
    base = shift * ci.num_images
    part = inp[base + r0:base + r1]
    if contiguous:
        return part[:, first:first + ncols]
    cols = ci.columns[c_off:c_off + ncols]
    padded = xp.concatenate([part, xp.zeros((part.shape[0], 1), dtype=part.dtype)], axis=1)
    return padded[:, cols]


# the gathered input of all steps side by side (im2col) is kept under this many
# elements per chunk of output rows (32 MB of float32)
_IM2COL_ELEMENTS = 8 << 20


def _window(height_map: list, ho: int, height_in: int):
    """(first, step) when the step reads, for output height h and its j-th height
    offset, input height first + step * h + j (heights outside the input being
    the -1 zero columns): the heights read form a window sliding by ``step``.
    None otherwise."""
    n = len(height_map)
    if ho == 0 or n % ho:
        return None
    n_off = n // ho
    starts = []
    for h in range(ho):
        row = height_map[h * n_off:(h + 1) * n_off]
        v0 = None
        for j, x in enumerate(row):
            if x != -1:
                if v0 is None:
                    v0 = x - j
                elif x - j != v0:
                    return None
        if v0 is None:
            return None
        for j, x in enumerate(row):
            if x == -1 and 0 <= v0 + j < height_in:
                return None
        starts.append(v0)
    step = starts[1] - starts[0] if ho > 1 else 1
    if step <= 0 or any(starts[h] != starts[0] + step * h for h in range(ho)):
        return None
    return starts[0], step


def _step_plan(ci, k_total: int):
    """(pad_below, pad_above, steps), with per step (row base, params start column,
    params columns, kind, what): kind "block" when the step reads a contiguous column
    block of the input (what: its first column), "window" when its height map slides
    regularly over the input heights padded with ``pad_below`` zero heights below and
    ``pad_above`` above (what: (first height, height step), see ``_window``), else
    "gather" (what: the step's index, whose gather columns are in ``ci``).  None when
    the steps' parameter blocks are not a partition of the ``k_total`` parameter
    columns (then the step-by-step form is used)."""
    ho, f_in, h_in = ci.height_out, ci.num_filters_in, ci.height_in
    plan, covered = [], []
    below = above = 0
    for k, (shift, pstart, ncols, contiguous, first, c_off, _, _) in enumerate(ci.meta):
        pc = ncols // ho
        base = shift * ci.num_images
        covered.append((pstart, pstart + pc))
        if contiguous:
            plan.append((base, pstart, pc, "block", first))
            continue
        win = _window(ci.height_maps[k], ho, h_in) if pc % f_in == 0 else None
        if win is None:
            plan.append((base, pstart, pc, "gather", k))
            continue
        lo, step = win
        hi = lo + step * (ho - 1) + pc // f_in   # one past the last height read
        below, above = max(below, -lo), max(above, hi - h_in)
        plan.append((base, pstart, pc, "window", win))
    covered.sort()
    pos = 0
    for a, b in covered:
        if a != pos:
            return None
        pos = b
    return (below, above, plan) if pos == k_total else None


def _rows_per_chunk(rows_out: int, ho: int, k_total: int) -> int:
    """Output rows per chunk: the gathered (rows * height_out, k_total) block stays
    under _IM2COL_ELEMENTS."""
    return max(1, min(rows_out, _IM2COL_ELEMENTS // max(1, ho * k_total)))


def _im2col_chunks(ci, inp, rows_out: int, plan, k_total: int, xp):
    """(r0, r1, block): for row chunks of the output, the (rows * height_out,
    k_total) matrix whose row (r, h) holds, in the parameters' column order, every
    input value output row r at height h multiplies (zeros for padded heights)."""
    below, above, steps = plan
    ho, f_in = ci.height_out, ci.num_filters_in
    dim = inp.shape[1]
    if len(steps) == 1:
        base, _, pc, kind, first = steps[0]
        if kind == "block" and first == 0 and pc * ho == dim and inp.flags.c_contiguous:
            # the input rows themselves, viewed as (rows * height_out, k_total)
            yield 0, rows_out, inp[base:base + rows_out].reshape(rows_out * ho, k_total)
            return
    padded = gather_src = None
    kinds = {s[3] for s in steps}
    if "window" in kinds:
        # the input with zero heights below and above, once for every step
        padded = xp.zeros((inp.shape[0], dim + (below + above) * f_in), dtype=inp.dtype)
        padded[:, below * f_in:below * f_in + dim] = inp
    if "gather" in kinds:
        # one zero column for the padded heights of gathered steps
        gather_src = xp.empty((inp.shape[0], dim + 1), dtype=inp.dtype)
        gather_src[:, :dim] = inp
        gather_src[:, dim] = 0
    item = inp.dtype.itemsize
    strided = as_strided(xp)
    per = _rows_per_chunk(rows_out, ho, k_total)
    buf = xp.empty((per, ho, k_total), dtype=inp.dtype)
    for r0 in range(0, rows_out, per):
        r1 = min(rows_out, r0 + per)
        n = r1 - r0
        big = buf[:n]
        for base, pstart, pc, kind, what in steps:
            if kind == "block":
                src = inp[base + r0:base + r1, what:what + pc * ho].reshape(n, ho, pc)
            elif kind == "window":
                lo, step = what
                rows = padded[base + r0:base + r1, (lo + below) * f_in:]
                src = strided(rows, shape=(n, ho, pc),
                              strides=(rows.strides[0], step * f_in * item, item))
            else:
                c_off = ci.meta[what][5]
                src = xp.take(gather_src[base + r0:base + r1],
                              ci.columns[c_off:c_off + pc * ho], axis=1).reshape(n, ho, pc)
            big[:, :, pstart:pstart + pc] = src
        yield r0, r1, big.reshape(n * ho, k_total)


def convolve_forward(ci, inp, params, out, bias=None) -> None:
    """out += convolution of inp (rows reshaped to num_t_in * num_images); with
    ``bias``, out = convolution + bias (the bias once per output height).

    All steps at once: the gathered inputs of the steps side by side (im2col) and
    one product with the whole parameter matrix per chunk of rows, instead of a
    product per step (Kaldi's form, kept for parameter layouts the steps do not
    partition): one large GEMM and no per-step copies."""
    xp = array_module(inp)
    rows_req = ci.num_t_in * ci.num_images
    inp = inp.reshape(rows_req, -1)
    rows_out = out.shape[0]
    ho, fo = ci.height_out, ci.num_filters_out
    k_total = params.shape[1]
    plan = _step_plan(ci, k_total)
    if bias is not None and (plan is None or not out.flags.c_contiguous):
        out[...] = xp.tile(bias, ho)[None, :]
        bias = None
    if plan is None:
        _convolve_forward_steps(ci, inp, params, out)
        return
    # (frozen parameters, decoding: the product kernel of engine.core.sgemm, as the
    # affine and TDNN components take it)
    if bias is not None:
        # the products straight into the output, seen as (rows * height_out, filters)
        out2d = out.reshape(rows_out * ho, fo)
        for r0, r1, block in _im2col_chunks(ci, inp, rows_out, plan, k_total, xp):
            dst = out2d[r0 * ho:r1 * ho]
            if not sgemm.write_nt(block, params, dst):
                xp.matmul(block, params.T, out=dst)
        out2d += bias
        return
    for r0, r1, block in _im2col_chunks(ci, inp, rows_out, plan, k_total, xp):
        product = sgemm.matmul_nt(block, params)
        if product is None:
            product = block @ params.T
        out[r0:r1] += product.reshape(r1 - r0, ho * fo)


def _convolve_forward_steps(ci, inp, params, out) -> None:
    """convolve_forward one step at a time (Kaldi's ConvolveForward)."""
    xp = array_module(inp)
    rows_out = out.shape[0]
    ho, fo = ci.height_out, ci.num_filters_out
    for r0, r1 in _chunks(ci, rows_out):
        acc = xp.zeros(((r1 - r0) * ho, fo), dtype=out.dtype)
        for meta in ci.meta:
            block = _step_input(ci, meta, inp, r0, r1, xp)
            pc = meta[2] // ho
            acc += block.reshape(-1, pc) @ params[:, meta[1]:meta[1] + pc].T
        out[r0:r1] += acc.reshape(r1 - r0, ho * fo)


def convolve_backward_data(ci, params, out_deriv, in_deriv) -> None:
    """in_deriv += derivative through the convolution.

    The transpose of convolve_forward's form: one product per chunk of rows gives
    the derivative of every gathered input value (col2im's columns), which is then
    added back where each value came from -- per height offset a sliding window
    whose heights do not overlap, a column block, or the gather's reverse passes."""
    xp = array_module(out_deriv)
    k_total = params.shape[1]
    plan = _step_plan(ci, k_total)
    if plan is not None:
        _backward_data_col2im(ci, params, out_deriv, in_deriv, plan, k_total, xp)
        return
    _backward_data_steps(ci, params, out_deriv, in_deriv, xp)


def _backward_data_col2im(ci, params, out_deriv, in_deriv, plan, k_total, xp) -> None:
    below, above, steps = plan
    rows_req = ci.num_t_in * ci.num_images
    ho, fo, f_in = ci.height_out, ci.num_filters_out, ci.num_filters_in
    dim = ci.height_in * f_in
    # the derivative of the input padded with zero heights (and a zero column for the
    # gathers' padded heights), added to in_deriv at the end
    lo_col = below * f_in
    pdx = xp.zeros((rows_req, dim + (below + above) * f_in + 1), dtype=out_deriv.dtype)
    item = pdx.dtype.itemsize
    rows_out = out_deriv.shape[0]
    per = _rows_per_chunk(rows_out, ho, k_total)
    strided = as_strided(xp)
    for r0 in range(0, rows_out, per):
        r1 = min(rows_out, r0 + per)
        n = r1 - r0
        col = (out_deriv[r0:r1].reshape(n * ho, fo) @ params).reshape(n, ho, k_total)
        for base, pstart, pc, kind, what in steps:
            rows = pdx[base + r0:base + r1]
            if kind == "block":
                view = strided(rows[:, lo_col + what:], shape=(n, ho, pc),
                               strides=(rows.strides[0], pc * item, item))
                view += col[:, :, pstart:pstart + pc]
            elif kind == "window":
                lo, step = what
                # height offset j of every output height: heights lo + j + step * h,
                # distinct for one j, so each window view is written once per element
                for j in range(pc // f_in):
                    view = strided(rows[:, (lo + below + j) * f_in:], shape=(n, ho, f_in),
                                   strides=(rows.strides[0], step * f_in * item, item))
                    c0 = pstart + j * f_in
                    view += col[:, :, c0:c0 + f_in]
            else:
                _, _, ncols, _, _, _, npass, b_off = ci.meta[what]
                temp = col[:, :, pstart:pstart + pc].reshape(n, ncols)
                tz = xp.concatenate([temp, xp.zeros((n, 1), dtype=temp.dtype)], axis=1)
                part = rows[:, lo_col:lo_col + dim]
                for k in range(npass):
                    part += tz[:, ci.backward[b_off + k * dim:b_off + (k + 1) * dim]]
    ind = in_deriv.reshape(rows_req, -1) if in_deriv.flags.c_contiguous else None
    if ind is not None:
        ind += pdx[:, lo_col:lo_col + dim]
    else:
        in_deriv += pdx[:, lo_col:lo_col + dim].reshape(in_deriv.shape)


def _backward_data_steps(ci, params, out_deriv, in_deriv, xp) -> None:
    """convolve_backward_data one step at a time (Kaldi's ConvolveBackwardData)."""
    rows_req = ci.num_t_in * ci.num_images
    contiguous = bool(in_deriv.flags.c_contiguous)
    target = in_deriv if contiguous else in_deriv.copy()
    ind = target.reshape(rows_req, -1)
    rows_out = out_deriv.shape[0]
    ho, fo = ci.height_out, ci.num_filters_out
    for r0, r1 in _chunks(ci, rows_out):
        od = out_deriv[r0:r1].reshape(-1, fo)
        for meta in ci.meta:
            shift, pstart, ncols, contig, first, c_off, npass, b_off = meta
            pc = ncols // ho
            temp = (od @ params[:, pstart:pstart + pc]).reshape(r1 - r0, ncols)
            base = shift * ci.num_images
            part = ind[base + r0:base + r1]
            if contig:
                part[:, first:first + ncols] += temp
            else:
                tz = xp.concatenate([temp, xp.zeros((temp.shape[0], 1), dtype=temp.dtype)],
                                    axis=1)
                dim = ind.shape[1]
                for k in range(npass):
                    part += tz[:, ci.backward[b_off + k * dim:b_off + (k + 1) * dim]]
    if not contiguous:
        in_deriv[...] = target


def convolve_backward_params(ci, inp, out_deriv, alpha: float, params_deriv) -> None:
    xp = array_module(inp)
    rows_req = ci.num_t_in * ci.num_images
    inp = inp.reshape(rows_req, -1)
    rows_out = out_deriv.shape[0]
    ho, fo = ci.height_out, ci.num_filters_out
    k_total = params_deriv.shape[1]
    plan = _step_plan(ci, k_total)
    if plan is not None:
        # one product per chunk of rows with the gathered inputs of all steps
        for r0, r1, block in _im2col_chunks(ci, inp, rows_out, plan, k_total, xp):
            od = out_deriv[r0:r1].reshape(-1, fo)
            params_deriv += alpha * (od.T @ block)
        return
    for r0, r1 in _chunks(ci, rows_out):
        od = out_deriv[r0:r1].reshape(-1, fo)
        for meta in ci.meta:
            block = _step_input(ci, meta, inp, r0, r1, xp)
            pc = meta[2] // ho
            params_deriv[:, meta[1]:meta[1] + pc] += alpha * (od.T @ block.reshape(-1, pc))
