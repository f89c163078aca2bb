"""GRU nonlinearity components: Kaldi's GruNonlinearityComponent and
OutputGruNonlinearityComponent (src/nnet3/nnet-combined-component.{h,cc}).

See ``recurrent.py`` for what these nonlinearity components are and for the two
deliberate departures from Kaldi (no natural-gradient preconditioner; stats and
self-repair on every backprop with ``to_update`` instead of on a random half of
them, with the plain self-repair scale: the expectation of Kaldi's update).
"""

from __future__ import annotations

import numpy as np

from engine.core.errors import ComponentError
from engine.core.xp import array_module
from engine.nnet.components._param_utils import gaussian
from engine.nnet.components.base import P, register_component
from engine.nnet.components.recurrent import (
    RecurrentNonlinearityBase,
    option_error,
    read_double,
    rms,
    updatable_info,
    write_double,
)
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

class _GruBase(RecurrentNonlinearityBase):
    """Stats, self-repair and the shared part of the file format of the two GRUs."""

    ARRAYS = ("value_sum", "deriv_sum")
    STAT_ARRAYS = ARRAYS
    STAT_SCALARS = ("self_repair_total", "count")

    def __init__(self) -> None:
        super().__init__()
        self.cell_dim = 0
        self.value_sum = np.zeros(0)
        self.deriv_sum = np.zeros(0)
        self.self_repair_total = 0.0
        self.count = 0.0
        self.self_repair_threshold = 0.2
        self.self_repair_scale = 1.0e-05
        self.alpha = 4.0
        self.update_period = 4

    def properties(self):
        return (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                | P.BACKPROP_NEEDS_OUTPUT | P.BACKPROP_ADDS)

    def output_dim(self) -> int:
        return 2 * self.cell_dim

    def _stats_info(self) -> str:
        s = (f", self-repair-threshold={self.self_repair_threshold:g}"
             f", self-repair-scale={self.self_repair_scale:g}")
        if self.count > 0:
            s += (f", count={self.count:.3g}, self-repaired-proportion="
                  f"{self.self_repair_total / (self.count * self.cell_dim):g}")
        return s

    @classmethod
    def _read_start(cls, reader: KaldiReader) -> "_GruBase":
        """A new GRU with the learning-rate header and ``<CellDim>`` read."""
        g = cls._read_learning_rate_header(reader)
        reader.expect_token("<CellDim>")
        g.cell_dim = reader.read_int()
        return g

    def _read_end(self, reader: KaldiReader) -> None:
        """``<UpdatePeriod>`` and the closing token, then the checks both GRUs make."""
        reader.expect_token("<UpdatePeriod>")
        self.update_period = reader.read_int()
        reader.expect_token(f"</{self.type_name}>")
        self._check("while reading")

    def _write_start(self, writer: KaldiWriter) -> None:
        """The learning-rate header and ``<CellDim>``."""
        self.write_updatable_common(writer)
        writer.write_token("<CellDim>")
        writer.write_int(self.cell_dim)

    def _write_end(self, writer: KaldiWriter) -> None:
        """``<UpdatePeriod>`` and the closing token."""
        writer.write_token("<UpdatePeriod>")
        writer.write_int(self.update_period)
        writer.write_token(f"</{self.type_name}>")

    def _read_stats(self, reader: KaldiReader) -> None:
        reader.expect_token("<ValueAvg>")
        value_avg = reader.read_vector().astype(np.float64)
        reader.expect_token("<DerivAvg>")
        deriv_avg = reader.read_vector().astype(np.float64)
        reader.expect_token("<SelfRepairTotal>")
        self.self_repair_total = read_double(reader)
        reader.expect_token("<Count>")
        self.count = read_double(reader)
        self.value_sum = value_avg * self.count
        self.deriv_sum = deriv_avg * self.count
        reader.expect_token("<SelfRepairThreshold>")
        self.self_repair_threshold = reader.read_float()
        reader.expect_token("<SelfRepairScale>")
        self.self_repair_scale = reader.read_float()
        reader.expect_token("<Alpha>")
        self.alpha = reader.read_float()

    def _write_stats(self, writer: KaldiWriter) -> None:
        norm = 1.0 / self.count if self.count != 0.0 else 1.0
        writer.write_token("<ValueAvg>")
        writer.write_vector(np.asarray(self.value_sum) * norm)
        writer.write_token("<DerivAvg>")
        writer.write_vector(np.asarray(self.deriv_sum) * norm)
        writer.write_token("<SelfRepairTotal>")
        write_double(writer, self.self_repair_total)
        writer.write_token("<Count>")
        write_double(writer, self.count)
        writer.write_token("<SelfRepairThreshold>")
        writer.write_float(self.self_repair_threshold)
        writer.write_token("<SelfRepairScale>")
        writer.write_float(self.self_repair_scale)
        writer.write_token("<Alpha>")
        writer.write_float(self.alpha)

    def _check(self, where: str) -> None:
        if self.cell_dim <= 0 or self.self_repair_threshold < 0 or self.self_repair_scale < 0:
            raise ComponentError(f"{where}: invalid cell-dim {self.cell_dim} or self-repair "
                                 "options", component=self.label())
        if np.shape(self.value_sum) != (self.cell_dim,) or \
                np.shape(self.deriv_sum) != (self.cell_dim,):
            raise ComponentError(f"{where}: value/deriv stats do not have dim "
                                 f"{self.cell_dim}", component=self.label())

    def _init_common(self, cfg: ConfigLine) -> None:
        self.init_learning_rate_common(cfg)
        cell_dim = cfg.get_int("cell-dim")
        if cell_dim is None or cell_dim <= 0:
            raise option_error(cfg, self, "cell-dim", "cell-dim > 0 is required")
        self.cell_dim = cell_dim
        self.self_repair_threshold = cfg.get_float("self-repair-threshold", 0.2)
        self.self_repair_scale = cfg.get_float("self-repair-scale", 1.0e-05)
        if self.self_repair_threshold < 0:
            raise option_error(cfg, self, "self-repair-threshold", "must be >= 0")
        if self.self_repair_scale < 0:
            raise option_error(cfg, self, "self-repair-scale", "must be >= 0")
        self.count = 0.0
        self.self_repair_total = 0.0
        self.value_sum = np.zeros(cell_dim)
        self.deriv_sum = np.zeros(cell_dim)

    def _tanh_stats_and_self_repair(self, xp, h_t, h_t_deriv):
        """Kaldi's TanhStatsAndSelfRepair, on ``self`` (the to_update component);
        returns the repaired ``h_t_deriv``.  See the module docstring for why this
        runs on every call with the plain scale."""
        self.count += float(h_t.shape[0])
        self.value_sum += h_t.sum(axis=0).astype(xp.float64)
        self.deriv_sum += (1 - h_t * h_t).sum(axis=0).astype(xp.float64)
        if self.count <= 0.0:
            return h_t_deriv
        below = (self.self_repair_threshold * self.count - self.deriv_sum) > 0
        self.self_repair_total += float(below.sum())
        return h_t_deriv - self.self_repair_scale * h_t * below.astype(h_t.dtype)

    def _forward_parts(self, xp, in_value):
        """``(z_t, h_t, c_{t-1})``: the gate, the new value and the previous cell."""
        raise NotImplementedError

    def propagate(self, indexes, in_value, out):
        xp = array_module(in_value)
        self.check_shape("input", in_value, None, self.input_dim())
        self.check_shape("output", out, in_value.shape[0], self.output_dim())
        c = self.cell_dim
        z_t, h_t, c_t1 = self._forward_parts(xp, in_value)
        out[:, :c] = h_t
        out[:, c:] = h_t - z_t * h_t + z_t * c_t1
        return None

    def _check_backprop_shapes(self, in_value, out_value, out_deriv, in_deriv):
        self.check_shape("input value", in_value, None, self.input_dim())
        nr = in_value.shape[0]
        self.check_shape("output value", out_value, nr, self.output_dim())
        self.check_shape("output derivative", out_deriv, nr, self.output_dim())
        if in_deriv is not None:
            self.check_shape("input derivative", in_deriv, nr, self.input_dim())

    def _backprop_gate(self, xp, in_value, out_value, out_deriv, z_t, c_t1, in_deriv, z_sl,
                       c1_sl):
        """Backprop through ``c_t = (1 - z_t) h_t + z_t c_{t-1}`` and the tanh.
        Adds the z_t and c_{t-1} parts to ``in_deriv``; returns (h_t, d tanh-arg)."""
        c = self.cell_dim
        h_t = out_value[:, :c]
        dc_t = out_deriv[:, c:]
        # out_deriv's h_t part is zero in a real GRU; Kaldi keeps it for its tests.
        dh_t = out_deriv[:, :c] + dc_t - dc_t * z_t
        if in_deriv is not None:
            in_deriv[:, z_sl] += dc_t * c_t1 - dc_t * h_t
            in_deriv[:, c1_sl] += dc_t * z_t
        return h_t, dh_t * (1 - h_t * h_t)


@register_component
class GruNonlinearityComponent(_GruBase):
    """Input ``[z_t r_t hpart_t c_{t-1} s_{t-1}]`` (3C + 2R; 4C when R == C, where
    c_{t-1} and s_{t-1} are the same columns), output ``[h_t c_t]`` with
    ``h_t = tanh(hpart_t + W_h (r_t * s_{t-1}))`` and
    ``c_t = (1 - z_t) h_t + z_t c_{t-1}``."""

    type_name = "GruNonlinearityComponent"
    PARAMS = ("w_h",)

    def __init__(self) -> None:
        super().__init__()
        self.recurrent_dim = 0
        self.w_h = np.zeros((0, 0), np.float32)
        self.rank_in = 20
        self.rank_out = 80

    def input_dim(self) -> int:
        c, r = self.cell_dim, self.recurrent_dim
        return 4 * c if r == c else 3 * c + 2 * r

    def info(self) -> str:
        return (updatable_info(self) + f", cell-dim={self.cell_dim}, recurrent-dim="
                f"{self.recurrent_dim}, w_h-rms={rms(self.w_h):.4g}" + self._stats_info()
                + f", alpha={self.alpha:g}, rank-in={self.rank_in}, rank-out={self.rank_out}"
                f", update-period={self.update_period}")

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        self._init_common(cfg)
        c = self.cell_dim
        param_stddev = cfg.get_float("param-stddev", 1.0 / np.sqrt(c))
        self.alpha = cfg.get_float("alpha", 4.0)
        self.rank_in = cfg.get_int("rank-in", 20)
        self.rank_out = cfg.get_int("rank-out", 80)
        self.update_period = cfg.get_int("update-period", 4)
        r = cfg.get_int("recurrent-dim", -1)
        if r < 0:
            r = c
        if r == 0 or r > c:
            raise option_error(cfg, self, "recurrent-dim",
                                f"must be in [1, cell-dim={c}] (got {r})")
        self.recurrent_dim = r
        self.w_h = gaussian(rng, (c, r), param_stddev)

    @classmethod
    def read(cls, reader: KaldiReader) -> "GruNonlinearityComponent":
        g = cls._read_start(reader)
        reader.expect_token("<RecurrentDim>")
        g.recurrent_dim = reader.read_int()
        reader.expect_token("<w_h>")
        g.w_h = reader.read_matrix()
        g._read_stats(reader)
        reader.expect_token("<RankInOut>")
        g.rank_in = reader.read_int()
        g.rank_out = reader.read_int()
        g._read_end(reader)
        if not 0 < g.recurrent_dim <= g.cell_dim or \
                g.w_h.shape != (g.cell_dim, g.recurrent_dim):
            raise ComponentError(f"w_h has shape {g.w_h.shape}, expected (cell-dim, "
                                 f"recurrent-dim) = ({g.cell_dim}, {g.recurrent_dim})",
                                 component=cls.type_name)
        return g

    def write(self, writer: KaldiWriter) -> None:
        self._write_start(writer)
        writer.write_token("<RecurrentDim>")
        writer.write_int(self.recurrent_dim)
        writer.write_token("<w_h>")
        writer.write_matrix(self.w_h)
        self._write_stats(writer)
        writer.write_token("<RankInOut>")
        writer.write_int(self.rank_in)
        writer.write_int(self.rank_out)
        self._write_end(writer)

    def _slices(self):
        c, r = self.cell_dim, self.recurrent_dim
        d = self.input_dim()
        return (slice(0, c), slice(c, c + r), slice(c + r, 2 * c + r),
                slice(2 * c + r, 3 * c + r), slice(d - r, d))

    def _forward_parts(self, xp, in_value):
        z_sl, r_sl, hp_sl, c1_sl, s1_sl = self._slices()
        w_h = xp.asarray(self.w_h).astype(in_value.dtype, copy=False)
        sdotr = in_value[:, r_sl] * in_value[:, s1_sl]
        h_t = xp.tanh(in_value[:, hp_sl] + sdotr @ w_h.T)
        return in_value[:, z_sl], h_t, in_value[:, c1_sl]

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv):
        xp = array_module(in_value)
        self._check_backprop_shapes(in_value, out_value, out_deriv, in_deriv)
        z_sl, r_sl, hp_sl, c1_sl, s1_sl = self._slices()
        r_t, s_t1 = in_value[:, r_sl], in_value[:, s1_sl]
        sdotr = r_t * s_t1
        h_t, dh = self._backprop_gate(xp, in_value, out_value, out_deriv, in_value[:, z_sl],
                                      in_value[:, c1_sl], in_deriv, z_sl, c1_sl)
        if to_update is not None:
            dh = to_update._tanh_stats_and_self_repair(xp, h_t, dh)
            to_update.w_h += (to_update.learning_rate * (dh.T @ sdotr)).astype(
                to_update.w_h.dtype, copy=False)
        if in_deriv is not None:
            w_h = xp.asarray(self.w_h).astype(in_value.dtype, copy=False)
            in_deriv[:, hp_sl] += dh
            dsdotr = dh @ w_h
            in_deriv[:, r_sl] += dsdotr * s_t1
            in_deriv[:, s1_sl] += dsdotr * r_t


@register_component
class OutputGruNonlinearityComponent(_GruBase):
    """Input ``[z_t hpart_t c_{t-1}]`` (3C), output ``[h_t c_t]`` with
    ``h_t = tanh(hpart_t + w_h * c_{t-1})`` (w_h a diagonal, C-vector) and
    ``c_t = (1 - z_t) h_t + z_t c_{t-1}``."""

    type_name = "OutputGruNonlinearityComponent"
    PARAMS = ("w_h",)

    def __init__(self) -> None:
        super().__init__()
        self.w_h = np.zeros(0, np.float32)
        self.rank = 8
        self.update_period = 10

    def input_dim(self) -> int:
        return 3 * self.cell_dim

    def info(self) -> str:
        return (updatable_info(self) + f", cell-dim={self.cell_dim}, w_h-rms={rms(self.w_h):.4g}"
                + self._stats_info() + f", alpha={self.alpha:g}, rank={self.rank}"
                f", update-period={self.update_period}")

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        self._init_common(cfg)
        param_mean = cfg.get_float("param-mean", 0.0)
        param_stddev = cfg.get_float("param-stddev", 1.0)
        self.alpha = cfg.get_float("alpha", 4.0)
        self.rank = cfg.get_int("rank", 8)
        self.update_period = cfg.get_int("update-period", 10)
        self.w_h = gaussian(rng, (self.cell_dim,), param_stddev, param_mean)

    @classmethod
    def read(cls, reader: KaldiReader) -> "OutputGruNonlinearityComponent":
        g = cls._read_start(reader)
        reader.expect_token("<w_h>")
        g.w_h = reader.read_vector()
        g._read_stats(reader)
        reader.expect_token("<Rank>")
        g.rank = reader.read_int()
        g._read_end(reader)
        if g.w_h.shape != (g.cell_dim,):
            raise ComponentError(f"w_h has dim {g.w_h.shape}, expected cell-dim {g.cell_dim}",
                                 component=cls.type_name)
        return g

    def write(self, writer: KaldiWriter) -> None:
        self._write_start(writer)
        writer.write_token("<w_h>")
        writer.write_vector(self.w_h)
        self._write_stats(writer)
        writer.write_token("<Rank>")
        writer.write_int(self.rank)
        self._write_end(writer)

    def _forward_parts(self, xp, in_value):
        c = self.cell_dim
        z_t, hpart_t, c_t1 = in_value[:, :c], in_value[:, c:2 * c], in_value[:, 2 * c:]
        w_h = xp.asarray(self.w_h).astype(in_value.dtype, copy=False)
        return z_t, xp.tanh(c_t1 * w_h + hpart_t), c_t1

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv):
        xp = array_module(in_value)
        self._check_backprop_shapes(in_value, out_value, out_deriv, in_deriv)
        c = self.cell_dim
        z_sl, hp_sl, c1_sl = slice(0, c), slice(c, 2 * c), slice(2 * c, 3 * c)
        c_t1 = in_value[:, c1_sl]
        h_t, dh = self._backprop_gate(xp, in_value, out_value, out_deriv, in_value[:, z_sl],
                                      c_t1, in_deriv, z_sl, c1_sl)
        if to_update is not None:
            dh = to_update._tanh_stats_and_self_repair(xp, h_t, dh)
            to_update.w_h += (to_update.learning_rate * (dh * c_t1).sum(axis=0)).astype(
                to_update.w_h.dtype, copy=False)
        if in_deriv is not None:
            w_h = xp.asarray(self.w_h).astype(in_value.dtype, copy=False)
            in_deriv[:, hp_sl] += dh
            in_deriv[:, c1_sl] += dh * w_h
