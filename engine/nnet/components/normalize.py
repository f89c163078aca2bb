"""Normalisation components from Kaldi's nnet-normalize-component.{h,cc}:
NormalizeComponent (each row, or each block of block-dim columns of it, scaled to a
target RMS, optionally with the log of the scale appended) and BatchNormComponent
(per-dimension mean/variance normalisation over the minibatch in training, with the
statistics accumulated by store_stats; the stored statistics in test mode).

With block-dim < dim both work on the matrix viewed as (rows * dim/block-dim) rows of
block-dim columns, which is why Kaldi asks for contiguous inputs/outputs then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.core.errors import ComponentError
from engine.core.xp import array_module, to_numpy
from engine.nnet.components.base import Component, ComponentProperty as P, register_component
from engine.nnet.components._fields import (
    BOOL,
    DOUBLE,
    FLOAT,
    INT,
    SameDimComponent,
    read_fields,
    read_optional_fields,
    skip_old_stats,
    write_fields,
)
from engine.nnet.components.nonlinear import get_rng, same_buffer
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

# 2^-66: exactly representable, and so is the inverse of its square root (2^33), which
# the backprop compares against to detect floored rows.
SQUARED_NORM_FLOOR = 2.0 ** -66


def _positive(x: float) -> bool:
    """x is a finite number above zero (NaN and inf make every output NaN or inf)."""
    return x > 0.0 and math.isfinite(x)


@register_component
class NormalizeComponent(Component):
    type_name = "NormalizeComponent"
    # <BlockDim> is written only when it differs from the dim; old models may lack any
    # field after the first (which they may call <Dim>)
    _FIELDS = (("<InputDim>", "in_dim", INT), ("<BlockDim>", "block_dim", INT),
               ("<TargetRms>", "target_rms", FLOAT), ("<AddLogStddev>", "add_log_stddev", BOOL))

    def __init__(self) -> None:
        super().__init__()
        self.in_dim = 0
        self.block_dim = 0
        self.target_rms = 1.0
        self.add_log_stddev = False

    def properties(self) -> P:
        p = P.SIMPLE_COMPONENT | P.BACKPROP_NEEDS_INPUT | P.BACKPROP_ADDS
        if not self.add_log_stddev:
            p |= P.PROPAGATE_IN_PLACE | P.BACKPROP_IN_PLACE
        if self.block_dim != self.in_dim:
            p |= P.INPUT_CONTIGUOUS | P.OUTPUT_CONTIGUOUS
        return p

    def input_dim(self) -> int:
        return self.in_dim

    def output_dim(self) -> int:
        return self.in_dim + (self.in_dim // self.block_dim if self.add_log_stddev else 0)

    def info(self) -> str:
        s = (f"{self.type_name}, input-dim={self.in_dim}, output-dim={self.output_dim()}, "
             f"target-rms={self.target_rms:g}, add-log-stddev="
             f"{'true' if self.add_log_stddev else 'false'}")
        if self.block_dim != self.in_dim:
            s += f", block-dim={self.block_dim}"
        return s

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        dim = cfg.get_int("dim")
        if dim is None:
            dim = cfg.get_int("input-dim")
        if dim is None:
            raise cfg.error("NormalizeComponent: missing required option dim= (or input-dim=)")
        self.in_dim = dim
        self.block_dim = cfg.get_int("block-dim", dim)
        self.target_rms = cfg.get_float("target-rms", 1.0)
        self.add_log_stddev = cfg.get_bool("add-log-stddev", False)
        if self.in_dim <= 0:
            raise cfg.error(f"NormalizeComponent: dim={self.in_dim} must be > 0")
        if not _positive(self.target_rms):
            raise cfg.error(f"NormalizeComponent: target-rms={self.target_rms:g} must be a "
                            "finite number > 0")
        if self._blocks_invalid():
            raise cfg.error(f"NormalizeComponent: block-dim={self.block_dim} must be > 0 "
                            f"and divide dim={self.in_dim}")

    def _blocks_invalid(self) -> bool:
        """A block dim Kaldi refuses: not positive, or not dividing the input dim."""
        return self.block_dim <= 0 or self.in_dim % self.block_dim != 0

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        tok = reader.read_token()
        if tok == "<NormalizeComponent>":
            tok = reader.read_token()
        if tok not in ("<Dim>", "<InputDim>"):
            raise reader.error(f"expected <InputDim>, got {tok!r}")
        c.in_dim = reader.read_int()
        c.block_dim = c.in_dim
        tok = read_optional_fields(reader, c, cls._FIELDS[1:], reader.read_token())
        if tok == "<ValueAvg>":
            # old models stored (unused) statistics here
            skip_old_stats(reader)
            tok = reader.read_token()
        if tok != "</NormalizeComponent>":
            raise reader.error(f"expected </NormalizeComponent>, got {tok!r}")
        if c.in_dim <= 0 or c._blocks_invalid():
            raise reader.error(f"NormalizeComponent: <BlockDim> {c.block_dim} must be > 0 and "
                               f"divide <InputDim> {c.in_dim}")
        if not _positive(c.target_rms):
            raise reader.error(f"NormalizeComponent: <TargetRms> {c.target_rms:g} must be a "
                               "finite number > 0")
        return c

    def write(self, writer: KaldiWriter) -> None:
        fields = self._FIELDS
        if self.block_dim == self.in_dim:
            fields = fields[:1] + fields[2:]
        write_fields(writer, self, fields, opening=True)
        writer.write_token("</NormalizeComponent>")

    def _inv_rms(self, xp, x):
        """Per row of x: 1/sqrt(max(floor, x.x / (d * target_rms^2)))."""
        d_scaled = x.shape[1] * self.target_rms * self.target_rms
        p = (x * x).sum(axis=1) * (1.0 / d_scaled)
        return xp.maximum(p, SQUARED_NORM_FLOOR) ** -0.5

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.in_dim)
        xp = array_module(in_value)
        rows = in_value.shape[0]
        x = in_value.reshape(rows * (self.in_dim // self.block_dim), self.block_dim)
        f = self._inv_rms(xp, x)
        y = x * f[:, None]
        if self.add_log_stddev:
            log_col = (-xp.log(f) + float(np.log(self.target_rms)))[:, None]
            y = xp.concatenate([y, log_col.astype(y.dtype)], axis=1)
        out[...] = y.reshape(rows, self.output_dim())
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        xp = array_module(in_value)
        rows = in_value.shape[0]
        nb = self.in_dim // self.block_dim
        x = in_value.reshape(rows * nb, self.block_dim)
        od = out_deriv.reshape(rows * nb, self.block_dim + (1 if self.add_log_stddev else 0))
        od_main = od[:, :self.block_dim]
        d_scaled = self.block_dim * self.target_rms * self.target_rms
        dots = (od_main * x).sum(axis=1)
        norm2 = (x * x).sum(axis=1)
        term = None
        if self.add_log_stddev:
            # d log(stddev) / dx = x / (x.x), floored away from division by zero
            inv = 1.0 / xp.maximum(norm2, self.block_dim * SQUARED_NORM_FLOOR)
            term = x * (inv * od[:, self.block_dim])[:, None]
        f = xp.maximum(norm2 * (1.0 / d_scaled), SQUARED_NORM_FLOOR) ** -0.5
        direct = od_main * f[:, None]
        term = direct if term is None else term + direct
        # rows whose norm was floored have a constant scale: no second term
        f3 = xp.where(f == 2.0 ** 33, 0.0, f) ** 3
        term = term + x * ((-1.0 / d_scaled) * f3 * dots)[:, None]
        term = term.reshape(rows, self.in_dim)
        if same_buffer(in_deriv, out_deriv):
            in_deriv[...] = term
        else:
            in_deriv += term


@dataclass
class BatchNormMemo:
    """Training-mode minibatch statistics, per block-dim column (Kaldi's Memo)."""

    num_frames: int
    mean: Any
    uvar: Any
    scale: Any


_BATCHNORM_BASE = (P.SIMPLE_COMPONENT | P.BACKPROP_NEEDS_OUTPUT | P.PROPAGATE_IN_PLACE
                   | P.BACKPROP_IN_PLACE)
# [in blocks][training]: blocks add the contiguity flags, training memo and stats
_BATCHNORM_PROPS = [[p, p | P.USES_MEMO | P.STORES_STATS]
                    for p in (_BATCHNORM_BASE,
                              _BATCHNORM_BASE | P.INPUT_CONTIGUOUS | P.OUTPUT_CONTIGUOUS)]


@register_component
class BatchNormComponent(SameDimComponent):
    type_name = "BatchNormComponent"
    ARRAYS = ("offset_vec", "scale_vec")
    STAT_FIELDS = ("count", "stats_sum", "stats_sumsq")
    # then the statistics: <StatsMean> and <StatsVar> vectors
    _FIELDS = (("<Dim>", "dim", INT), ("<BlockDim>", "block_dim", INT),
               ("<Epsilon>", "epsilon", FLOAT), ("<TargetRms>", "target_rms", FLOAT),
               ("<TestMode>", "test_mode", BOOL), ("<Count>", "count", DOUBLE))

    def __init__(self) -> None:
        super().__init__()
        self.dim = 0
        self.block_dim = 0
        self.epsilon = 1.0e-3
        self.target_rms = 1.0
        self.test_mode = False
        self.count = 0.0
        self.stats_sum = np.zeros(0)
        self.stats_sumsq = np.zeros(0)
        # derived in test mode: out = in * scale_vec + offset_vec (per block column)
        self.offset_vec = np.zeros(0, dtype=np.float32)
        self.scale_vec = np.zeros(0, dtype=np.float32)
        self.rng: np.random.Generator | None = None

    def properties(self) -> P:
        return _BATCHNORM_PROPS[self.block_dim < self.dim][not self.test_mode]

    def info(self) -> str:
        s = (f"{self.type_name}, dim={self.dim}, block-dim={self.block_dim}, "
             f"epsilon={self.epsilon:g}, target-rms={self.target_rms:g}, "
             f"count={self.count:g}, test-mode={'true' if self.test_mode else 'false'}")
        if self.count > 0:
            mean = self.stats_sum / self.count
            var = np.maximum(self.stats_sumsq / self.count - mean * mean, 0.0)
            s += (f", data-mean-avg={float(mean.mean()):g}, "
                  f"data-stddev-avg={float(np.sqrt(var).mean()):g}")
        return s

    def _check(self) -> None:
        if not (self.dim > 0 and self.block_dim > 0 and self.dim % self.block_dim == 0
                and _positive(self.epsilon) and _positive(self.target_rms)):
            raise ComponentError(f"invalid BatchNormComponent: dim={self.dim}, block-dim="
                                 f"{self.block_dim}, epsilon={self.epsilon:g}, target-rms="
                                 f"{self.target_rms:g}", component=self.label())

    def _compute_derived(self) -> None:
        """Kaldi's ComputeDerived: the test-mode scale and offset, in float as Kaldi."""
        if not self.test_mode:
            self.offset_vec = np.zeros(0, dtype=np.float32)
            self.scale_vec = np.zeros(0, dtype=np.float32)
            return
        if self.count == 0.0:
            # Kaldi invents statistics here (with a warning) so that test-mode
            # networks without training still run; it only happens in tests.
            rng = get_rng(self)
            self.count = 1.0
            self.stats_sum = rng.standard_normal(self.block_dim)
            self.stats_sumsq = rng.standard_normal(self.block_dim) + self.stats_sum ** 2
        f32 = np.float32
        inv_count = f32(1.0 / self.count)
        offset = self.stats_sum.astype(f32) * f32(-inv_count)  # -mean
        var = self.stats_sumsq.astype(f32) * inv_count - offset * offset
        var = np.maximum(var, f32(0.0)) + f32(self.epsilon)
        scale = var ** f32(-0.5) * f32(self.target_rms)
        self.scale_vec = scale.astype(f32)
        self.offset_vec = (offset * scale).astype(f32)

    def set_test_mode(self, test_mode: bool) -> None:
        self.test_mode = bool(test_mode)
        self._compute_derived()

    def couples_rows(self) -> bool:
        return not self.test_mode

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.dim = cfg.get_int("dim", required=True)
        self.block_dim = cfg.get_int("block-dim", -1)
        self.epsilon = cfg.get_float("epsilon", 1.0e-3)
        self.target_rms = cfg.get_float("target-rms", 1.0)
        self.test_mode = cfg.get_bool("test-mode", False)
        if self.dim <= 0:
            raise cfg.error(f"BatchNormComponent: dim={self.dim} must be > 0")
        if self.block_dim == -1:
            self.block_dim = self.dim
        if self.block_dim <= 0 or self.dim % self.block_dim != 0:
            raise cfg.error(f"BatchNormComponent: block-dim={self.block_dim} must be > 0 and "
                            f"divide dim={self.dim}")
        if not (_positive(self.epsilon) and _positive(self.target_rms)):
            raise cfg.error(f"BatchNormComponent: epsilon={self.epsilon:g} and target-rms="
                            f"{self.target_rms:g} must be finite numbers > 0")
        self.count = 0.0
        self.stats_sum = np.zeros(self.block_dim)
        self.stats_sumsq = np.zeros(self.block_dim)
        if self.test_mode:
            self._compute_derived()

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        read_fields(reader, c, cls._FIELDS, opening=True)
        reader.expect_token("<StatsMean>")
        mean = reader.read_vector().astype(np.float64)
        reader.expect_token("<StatsVar>")
        var = reader.read_vector().astype(np.float64)
        reader.expect_token("</BatchNormComponent>")
        c.stats_sum = mean * c.count
        c.stats_sumsq = (var + mean * mean) * c.count
        c._check()
        c._compute_derived()
        return c

    def write(self, writer: KaldiWriter) -> None:
        self._check()
        w = writer
        write_fields(w, self, self._FIELDS, opening=True)
        # Kaldi converts the sums to float before normalising them
        f32 = np.float32
        mean = self.stats_sum.astype(f32)
        var = self.stats_sumsq.astype(f32)
        if self.count != 0:
            inv = f32(1.0 / self.count)
            mean = mean * inv
            var = var * inv - mean * mean
        w.write_token("<StatsMean>")
        w.write_vector(mean)
        w.write_token("<StatsVar>")
        w.write_vector(var)
        w.write_token("</BatchNormComponent>")

    # -- statistics (not parameters: scale/add act on the accumulated stats) -------
    def scale(self, alpha: float) -> None:
        if alpha == 0:
            self.count = 0.0
            self.stats_sum = np.zeros_like(self.stats_sum)
            self.stats_sumsq = np.zeros_like(self.stats_sumsq)
        else:
            self.count *= alpha
            self.stats_sum = self.stats_sum * alpha
            self.stats_sumsq = self.stats_sumsq * alpha

    def add(self, alpha: float, other: Component) -> None:
        assert isinstance(other, BatchNormComponent)
        self.count += alpha * other.count
        self.stats_sum = self.stats_sum + alpha * other.stats_sum
        self.stats_sumsq = self.stats_sumsq + alpha * other.stats_sumsq
        self._compute_derived()

    def zero_stats(self) -> None:
        # in test mode the statistics are the transform: keep them
        if not self.test_mode:
            self.count = 0.0
            self.stats_sum = np.zeros_like(self.stats_sum)
            self.stats_sumsq = np.zeros_like(self.stats_sumsq)

    def _blocks(self, m):
        return m.reshape(m.shape[0] * (m.shape[1] // self.block_dim), self.block_dim)

    def _check_cols(self, what: str, m) -> None:
        if m.ndim != 2 or m.shape[1] not in (self.dim, self.block_dim):
            self.check_shape(what, m, None, self.dim)

    # -- maths ---------------------------------------------------------------------
    def propagate(self, indexes, in_value, out):
        self._check_cols("input", in_value)
        xp = array_module(in_value)
        x = self._blocks(in_value)
        if not self.test_mode:
            n = x.shape[0]
            # the column sums accumulated in double: NumPy sums a column of a row-major
            # matrix one row after another in float32, which loses digits over thousands
            # of frames, and the variance below, uvar - mean^2, can cancel most of what is
            # left (Kaldi's BLAS sums are blocked; a mean 15 times the deviation was enough
            # to move an LSTM's outputs by 5e-3 from Kaldi's)
            f32 = x.dtype
            mean = (x.sum(axis=0, dtype=xp.float64) * (1.0 / n)).astype(f32)
            uvar = ((x * x).sum(axis=0, dtype=xp.float64) * (1.0 / n)).astype(f32)
            var_scale = 1.0 / (self.target_rms * self.target_rms)
            # variance / target-rms^2, floored at 0, plus epsilon / target-rms^2
            scale = xp.maximum(uvar * var_scale - mean * mean * var_scale, 0.0)
            scale = (scale + var_scale * self.epsilon) ** -0.5
            y = (x - mean) * scale
            out[...] = y.reshape(out.shape)
            return BatchNormMemo(n, mean, uvar, scale)
        if self.offset_vec.shape[0] != self.block_dim:
            raise ComponentError("test mode is set but there are no statistics",
                                 component=self.label())
        sc = xp.asarray(self.scale_vec, dtype=x.dtype)
        off = xp.asarray(self.offset_vec, dtype=x.dtype)
        out[...] = (x * sc + off).reshape(out.shape)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        xp = array_module(out_deriv)
        od = self._blocks(out_deriv)
        if not self.test_mode:
            if not isinstance(memo, BatchNormMemo):
                raise ComponentError("backprop in training mode needs the memo from "
                                     "propagate", component=self.label())
            y = self._blocks(out_value)
            n = memo.num_frames
            if y.shape[0] != n:
                raise ComponentError(f"memo is for {n} rows, output has {y.shape[0]}",
                                     component=self.label())
            coeff = -1.0 / (self.target_rms * self.target_rms * n)
            f32 = od.dtype
            # (column sums in double, as in propagate)
            var_deriv_mod = ((y * od).sum(axis=0, dtype=xp.float64) * coeff).astype(f32) \
                * memo.scale
            mean_od = (od.sum(axis=0, dtype=xp.float64) * (-1.0 / n)).astype(f32)
            d = (od + mean_od) * memo.scale + y * var_deriv_mod
        else:
            if self.scale_vec.shape[0] != self.block_dim:
                raise ComponentError("test mode is set but there are no statistics",
                                     component=self.label())
            d = od * xp.asarray(self.scale_vec, dtype=od.dtype)
        in_deriv[...] = d.reshape(in_deriv.shape)

    def store_stats(self, in_value, out_value, memo) -> None:
        if self.test_mode:
            raise ComponentError("store_stats called in test mode", component=self.label())
        if not isinstance(memo, BatchNormMemo):
            raise ComponentError("store_stats needs the memo from propagate",
                                 component=self.label())
        n = float(memo.num_frames)
        if self.stats_sum.shape[0] != self.block_dim:
            self.stats_sum = np.zeros(self.block_dim)
            self.stats_sumsq = np.zeros(self.block_dim)
        self.count += n
        self.stats_sum = self.stats_sum + n * to_numpy(memo.mean).astype(np.float64)
        self.stats_sumsq = self.stats_sumsq + n * to_numpy(memo.uvar).astype(np.float64)
