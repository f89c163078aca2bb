"""Helpers shared by the non-simple components (statistics, attention, time-height
convolution): Kaldi's row-range sums (CuMatrix::AddRowRanges), integer-pair vector and
double-precision I/O (base/io-funcs), the (n, x) / t lists of nnet-compile-utils
(GetNxList, GetTList) and the regular-grid description of a convolution's input and
output (convolution.h: ConvolutionComputationIo, GetComputationIo).

The index helpers run at compile time on Index lists or their (k, 3) rows; the maths
helpers are vectorised and backend-agnostic.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from engine.core.errors import ComponentError, ResourceLimitError
from engine.core.index import K_NO_TIME, Index, as_index_rows
from engine.core.xp import array_module
from engine.nnet.kaldi_io import (  # noqa: F401  (re-exported for the component modules)
    KaldiReader,
    KaldiWriter,
    format_float,
    read_double,
    read_double_matrix,
    read_double_vector,
    write_double,
    write_double_matrix,
    write_double_vector,
)


# --------------------------------------------------------------------------------------
# maths


def add_row_ranges(src, begins, ends, dst, alpha: float = 1.0) -> None:
    """``dst[i] += alpha * sum(src[begins[i]:ends[i]])`` for every row i (empty ranges,
    marked begin == end, add nothing).  Each range's own rows are summed in the
    source's precision, with no cumulative-sum cancellation: ``add.reduceat`` on
    interleaved (begin, end) boundaries on NumPy (pairwise within a long range), one
    device thread per (range, column) adding in order on CuPy (Kaldi's AddRowRanges;
    CuPy's own ``add.reduceat`` left a one-row range of small values a rounding residue
    of the large rows before it, seen on an H200).  A one-row range gives that row
    itself on both, so a statistic such as the variance of a one-frame window is
    exactly 0 on either backend."""
    xp = array_module(src)
    n = int(begins.shape[0])
    if n == 0 or src.shape[1] == 0:
        return
    if xp is np:
        bounds = xp.empty(2 * n, dtype=np.int64)
        bounds[0::2] = begins
        bounds[1::2] = ends
        rows = src.shape[0]
        last = int(bounds[-1])
        if int(bounds[:-1].max()) < rows and last <= rows:
            # every bound but the last is a row of src and the last is at most the end:
            # reduceat's last segment runs to the end, so a last bound at the end is
            # dropped and no padded copy of src is made (the same segments and sums)
            base, used = src, (bounds[:-1] if last == rows else bounds)
        else:
            base = xp.concatenate([src, xp.zeros((1, src.shape[1]), dtype=src.dtype)], axis=0)
            used = bounds
        sums = xp.add.reduceat(base, used, axis=0)[0::2]
        # reduceat returns src[b] when b >= e; empty ranges must contribute nothing.
        empty = xp.asarray(begins) >= xp.asarray(ends)
        if bool(empty.any()):
            sums = xp.where(empty[:, None], xp.zeros((), dtype=src.dtype), sums)
    else:
        sums = _range_sums_on_device(xp, src, begins, ends)
    if alpha == 1.0:
        dst += sums
    else:
        dst += alpha * sums


_RANGE_SUM_KERNELS: dict = {}


def _range_sums_on_device(xp, src, begins, ends):
    """Per-range sums on a device backend (CuPy): a kernel whose thread
    for (range r, column c) adds rows begins[r] .. ends[r]-1 of column c in order."""
    kernel = _RANGE_SUM_KERNELS.get(xp)
    if kernel is None:
        kernel = _RANGE_SUM_KERNELS[xp] = xp.ElementwiseKernel(
            "raw T src, raw int64 begins, raw int64 ends, int64 cols", "T sums",
            """const ptrdiff_t r = i / cols, c = i % cols;
               T s = 0;
               for (ptrdiff_t k = begins[r]; k < ends[r]; ++k) s += src[k * cols + c];
               sums = s;""",
            "nnetc_row_range_sums")
    src = xp.ascontiguousarray(src)
    sums = xp.empty((int(begins.shape[0]), int(src.shape[1])), dtype=src.dtype)
    kernel(src, xp.asarray(begins, dtype=np.int64), xp.asarray(ends, dtype=np.int64),
           int(src.shape[1]), sums)
    return sums


# --------------------------------------------------------------------------------------
# I/O helpers (base/io-funcs)


def read_int_pair_vector(reader: KaldiReader) -> list[tuple[int, int]]:
    """Kaldi's ReadIntegerPairVector: binary ``\\4 <int32 n> pairs``, text ``[ a,b c,d ]``."""
    start = reader.pos
    if reader.binary:
        size = reader._take(1)[0]
        if size != 4:
            raise reader.error(f"integer pair vector has element size {size}, expected 4",
                               offset=start)
        n = reader.read_int_raw()
        if n < 0 or n * 8 > len(reader.data) - reader.pos:
            raise reader.error(f"integer pair vector size {n} exceeds the file", offset=start)
        flat = np.frombuffer(reader._take(8 * n), dtype="<i4").astype(int)
        return [(int(flat[2 * i]), int(flat[2 * i + 1])) for i in range(n)]
    if reader._word() != "[":
        raise reader.error("expected '[' to start an integer pair vector", offset=start)
    out = []
    while True:
        w_start = reader.pos
        w = reader._word()
        if w == "]":
            return out
        parts = w.split(",")
        try:
            if len(parts) != 2:
                raise ValueError
            out.append((int(parts[0]), int(parts[1])))
        except ValueError:
            raise reader.error(f"expected an integer pair like 3,-1, got {w!r}",
                               offset=w_start) from None


def write_int_pair_vector(writer: KaldiWriter, pairs) -> None:
    pairs = [(int(a), int(b)) for a, b in pairs]
    if writer.binary:
        writer.raw(b"\x04" + struct.pack("<i", len(pairs)))
        writer.raw(np.asarray(pairs, dtype="<i4").reshape(-1).tobytes())
    else:
        writer.raw("[ " + "".join(f"{a},{b} " for a, b in pairs) + "]\n")








def read_basic_bool(reader: KaldiReader) -> bool:
    return reader.read_bool()


# --------------------------------------------------------------------------------------
# index helpers (nnet-compile-utils, convolution.cc)


def get_nx_list(indexes) -> list[tuple[int, int]]:
    """Sorted unique (n, x) pairs over all indexes (blank ones included, as Kaldi)."""
    a = as_index_rows(indexes)
    if not len(a):
        return []
    return list(map(tuple, np.unique(a[:, ::2], axis=0).tolist()))


def get_t_list(indexes) -> list[int]:
    """Sorted unique t values, ignoring blank (kNoTime) indexes."""
    t = as_index_rows(indexes)[:, 1]
    return np.unique(t[t != K_NO_TIME]).tolist()


# How many more Indexes than it was given a regular time grid may hold (see check_grid):
# four times as many, plus this many.
GRID_SLACK = 1 << 16


def check_grid(num_images: int, t_start: int, t_step: int, num_t: int, given: int,
               what: str) -> None:
    """Refuse (ResourceLimitError, before anything is allocated) a regular time grid of
    ``num_images`` x ``num_t`` Indexes far larger than the ``given`` Indexes it is made
    for.  The grid's step is the greatest common divisor of the times' differences, so a
    time stride or offsets far apart with times one apart between them (a time-stride of
    2^31 - 1 in restricted attention, say) make a grid of billions of rows for a few
    frames: Kaldi would try to allocate it; ``what`` names the component."""
    cells = num_images * num_t
    if cells > 4 * given + GRID_SLACK:
        last = t_start + (num_t - 1) * (t_step or 1)
        raise ResourceLimitError(
            f"{what}: its {given} Indexes have times from {t_start} to {last} with a "
            f"greatest common step of {t_step or 1}, a regular grid of {cells} Indexes "
            f"({num_images} sequences x {num_t} times); at most {4 * given + GRID_SLACK} "
            f"are allowed for that many (a time stride or time offsets this far apart "
            f"cannot be computed)")


def grid_rows(nx: list[tuple[int, int]], t_start: int, t_step: int, num_t: int,
              reorder_t: int, present, what: str = "a component") -> np.ndarray:
    """Kaldi's GetIndexesForComputation (convolution, restricted attention), as (k, 3)
    int64 n, t, x rows: the Indexes of a regular grid -- blocks of ``reorder_t`` times,
    in each block every (n, x) of ``nx`` with its times -- with t = kNoTime where the
    Index is not among ``present`` (Indexes, or their rows).  Refused by check_grid when
    far larger than ``present`` (``what`` names the component)."""
    check_grid(len(nx), t_start, t_step, num_t, len(present), what)
    t_step = t_step or 1
    outer = t_step * reorder_t
    blocks = np.arange(t_start, t_start + num_t * t_step, outer, dtype=np.int64)
    inner = np.arange(0, outer, t_step, dtype=np.int64)
    nxa = np.asarray(nx, dtype=np.int64).reshape(-1, 2)
    shape = (len(blocks), len(nxa), len(inner))
    rows = np.empty(shape + (3,), dtype=np.int64)
    rows[..., 0] = nxa[None, :, 0:1]
    rows[..., 1] = blocks[:, None, None] + inner[None, None, :]
    rows[..., 2] = nxa[None, :, 1:2]
    rows = rows.reshape(-1, 3)
    have = as_index_rows(present)
    have = have[have[:, 1] != K_NO_TIME]
    rows[~_rows_in(rows, have), 1] = K_NO_TIME
    return rows


def _rows_in(rows: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Which of the (k, 3) ``rows`` are rows of ``ref``."""
    return row_positions(rows, ref) >= 0


def row_positions(rows: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """For each of the (k, 3) ``rows``, its position among the rows of ``ref`` (rows
    that are distinct), or -1 where it is not one of them."""
    if not len(rows) or not len(ref):
        return np.full(len(rows), -1, dtype=np.int64)
    both = np.concatenate([rows, ref])
    lo, hi = both.min(axis=0), both.max(axis=0)
    span = [int(h) - int(l) + 1 for l, h in zip(lo.tolist(), hi.tolist())]
    if span[0] * span[1] * span[2] >= 1 << 62:     # ranges too wide for one int64 key
        where = {r: i for i, r in enumerate(map(tuple, ref.tolist()))}
        return np.fromiter((where.get(r, -1) for r in map(tuple, rows.tolist())), np.int64,
                           len(rows))
    off = both - lo
    key = (off[:, 0] * span[1] + off[:, 1]) * span[2] + off[:, 2]
    want, have = key[:len(rows)], key[len(rows):]
    order = np.argsort(have, kind="stable")
    pos = np.searchsorted(have[order], want)
    pos[pos == len(have)] = 0
    found = order[pos]
    return np.where(have[found] == want, found, -1)


def _regularize_t_list(t_values: list[int]) -> tuple[int, int, int]:
    """(start, step, num): the coarsest regular grid containing all t values."""
    if not t_values:
        raise ComponentError("no time values in the index list (all blank?)")
    start = t_values[0]
    step = 0
    for a, b in zip(t_values, t_values[1:]):
        step = math.gcd(step, b - a)
    if step == 0:
        return start, 0, 1
    return start, step, 1 + (t_values[-1] - start) // step


@dataclass
class ConvolutionComputationIo:
    """Kaldi's ConvolutionComputationIo: a regular t grid for input and output, the
    number of (n, x) 'images', and the frame-appending factor of the input."""

    num_images: int = 0
    start_t_in: int = 0
    t_step_in: int = 0
    num_t_in: int = 0
    start_t_out: int = 0
    t_step_out: int = 0
    num_t_out: int = 0
    reorder_t_in: int = 1

    def copy(self) -> "ConvolutionComputationIo":
        return ConvolutionComputationIo(**vars(self))

    def as_list(self) -> list[int]:
        return [self.num_images, self.start_t_in, self.t_step_in, self.num_t_in,
                self.start_t_out, self.t_step_out, self.num_t_out, self.reorder_t_in]


def get_computation_io(input_indexes, output_indexes,
                       what: str = "a component") -> ConvolutionComputationIo:
    nx = get_nx_list(input_indexes)
    if not nx:
        raise ComponentError("empty input index list")
    io = ConvolutionComputationIo(num_images=len(nx))
    io.start_t_in, io.t_step_in, io.num_t_in = _regularize_t_list(get_t_list(input_indexes))
    io.start_t_out, io.t_step_out, io.num_t_out = _regularize_t_list(
        get_t_list(output_indexes))
    # (before the grids' sizes are used; grid_rows checks again after padding)
    check_grid(len(nx), io.start_t_in, io.t_step_in, io.num_t_in, len(input_indexes), what)
    check_grid(len(nx), io.start_t_out, io.t_step_out, io.num_t_out, len(output_indexes),
               what)
    io.reorder_t_in = 1
    return io


def blank_missing(indexes: list[Index], ref) -> list[Index]:
    """Kaldi's SetSomeIndexesBlank: Indexes not in ``ref`` get t = kNoTime."""
    ref_set = set(ref)
    return [i if i in ref_set else Index(i[0], K_NO_TIME, i[2]) for i in indexes]


def config_errors_name_type(init):
    """Decorator for ``init_from_config``: ConfigErrors raised by the option getters
    (missing/malformed values) get the component type and name prefixed."""
    import functools  # noqa: PLC0415

    from engine.core.errors import ConfigError  # noqa: PLC0415

    @functools.wraps(init)
    def wrapper(self, cfg, rng):
        try:
            return init(self, cfg, rng)
        except ConfigError as e:
            prefix = f"{self.type_name}"
            if self.name:
                prefix += f" {self.name!r}"
            if e.reason.startswith(self.type_name):
                reason = e.reason[len(self.type_name):].lstrip(": ")
            else:
                reason = e.reason
            raise cfg.error(f"{prefix}: {reason}") from None
    return wrapper
