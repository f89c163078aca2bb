"""Recurrent nonlinearity components: Kaldi's LstmNonlinearityComponent,
GruNonlinearityComponent and OutputGruNonlinearityComponent
(src/nnet3/nnet-combined-component.{h,cc}; the LSTM maths is
cu::ComputeLstmNonlinearity / cu::BackpropLstmNonlinearity in
src/cudamatrix/cu-math.cc).

All three are simple components that compute one time step of the cell's
nonlinear part; the affine parts and the recurrence live in the surrounding
network.  They keep value/derivative statistics of their sigmoid/tanh units,
accumulated in backprop (into ``to_update``) and used for "self-repair", which
nudges the derivatives of saturated units.

Departures from Kaldi, on purpose:

- The natural-gradient preconditioner is a training optimizer and is not
  implemented: the plain gradient is always used.  Its options (rank, alpha,
  update period) are kept and read/written faithfully.
- Kaldi's GRUs accumulate stats and self-repair on a random half of the
  minibatches, with the self-repair scale doubled.  Randomness is a hidden
  global, so here the stats are accumulated on every backprop that has a
  ``to_update`` and self-repair uses the plain scale: the expectation of
  Kaldi's update.  (The LSTM's self-repair is deterministic in Kaldi and is
  reproduced exactly.)

In memory the stats are sums (float64, as Kaldi's double matrices); on disk
they are averages (divided by the count), as in Kaldi.
"""

from __future__ import annotations

import struct

import numpy as np

from engine.core.errors import ComponentError, ConfigError
from engine.core.xp import array_module
from engine.nnet.components.base import P, UpdatableComponent, register_component
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter, format_float

# ----------------------------------------------------------------------------------
# shared helpers


def read_double(reader: KaldiReader) -> float:
    """A Kaldi ``double`` basic type (8-byte in binary; full precision in text)."""
    if reader.binary:
        return reader.read_float()
    start = reader.pos
    tok = reader.read_token()
    try:
        return float(tok)
    except ValueError:
        raise reader.error(f"expected a number, got {tok!r}", offset=start) from None


def write_double(writer: KaldiWriter, value: float) -> None:
    """Kaldi writes doubles like floats in text (%g); more digits are used only
    when 6 would not read back to the same double (so large counts survive)."""
    value = float(value)
    if writer.binary:
        writer.raw(b"\x08" + struct.pack("<d", value))
        return
    text = format_float(value)
    if float(text) != value:
        for prec in range(6, 18):
            text = f"{value:.{prec}g}"
            if float(text) == value:
                break
    writer.raw(text + " ")


def sigmoid(xp, a):
    """Kaldi's ScalarSigmoid, vectorised: exp of a non-positive number only."""
    e = xp.exp(-xp.abs(a))
    return xp.where(a > 0, 1 / (1 + e), e / (1 + e))


def updatable_info(comp: UpdatableComponent) -> str:
    """The prefix of Kaldi's UpdatableComponent::Info()."""
    s = (f"{comp.type_name}, input-dim={comp.input_dim()}, output-dim={comp.output_dim()}, "
         f"learning-rate={comp.learning_rate:g}")
    if comp.is_gradient:
        s += ", is-gradient=true"
    if comp.l2_regularize != 0.0:
        s += f", l2-regularize={comp.l2_regularize:g}"
    if comp.learning_rate_factor != 1.0:
        s += f", learning-rate-factor={comp.learning_rate_factor:g}"
    if comp.max_change > 0.0:
        s += f", max-change={comp.max_change:g}"
    return s


def rms(a) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(np.sqrt(np.mean(a * a))) if a.size else 0.0


def _config_error(cfg: ConfigLine, comp, option: str, message: str) -> ConfigError:
    return cfg.error(f"component {comp.name!r} ({comp.type_name}): option {option}: {message}")


# ----------------------------------------------------------------------------------
# LSTM


@register_component
class LstmNonlinearityComponent(UpdatableComponent):
    """Input ``[i_part f_part c_part o_part c_prev]`` (5C, plus 3 dropout-mask
    columns with use-dropout), output ``[c_t m_t]`` (2C); params are the
    diagonal peephole weights ``w_ic, w_fc, w_oc`` (a 3 x C matrix)."""

    type_name = "LstmNonlinearityComponent"
    PARAMS = ("params",)
    ARRAYS = ("value_sum", "deriv_sum", "self_repair_config", "self_repair_total")

    def __init__(self) -> None:
        super().__init__()
        self.params = np.zeros((3, 0), np.float32)
        self.use_dropout = False
        self.value_sum = np.zeros((5, 0))
        self.deriv_sum = np.zeros((5, 0))
        self.self_repair_config = np.zeros(10, np.float32)
        self.self_repair_total = np.zeros(5)
        self.count = 0.0

    @property
    def cell_dim(self) -> int:
        return int(self.params.shape[1])

    def properties(self):
        return P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT

    def input_dim(self) -> int:
        return 5 * self.cell_dim + (3 if self.use_dropout else 0)

    def output_dim(self) -> int:
        return 2 * self.cell_dim

    def info(self) -> str:
        s = (updatable_info(self) + f", cell-dim={self.cell_dim}, use-dropout="
             f"{'true' if self.use_dropout else 'false'}")
        for i, n in enumerate(("w_ic", "w_fc", "w_oc")):
            s += f", {n}-rms={rms(self.params[i]):.4g}"
        if self.count > 0:
            s += f", count={self.count:.3g}"
        names = ("i_t_sigmoid", "f_t_sigmoid", "c_t_tanh", "o_t_sigmoid", "m_t_tanh")
        cfg = np.asarray(self.self_repair_config)
        for i, n in enumerate(names):
            s += (f", {n}={{ self-repair-lower-threshold={cfg[i]:g}, "
                  f"self-repair-scale={cfg[i + 5]:g}")
            if self.count != 0:
                prop = float(self.self_repair_total[i]) / (self.count * self.cell_dim)
                s += f", self-repaired-proportion={prop:g}"
            s += " }"
        return s

    # -- config / files ----------------------------------------------------------------
    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        self.init_learning_rate_common(cfg)
        cell_dim = cfg.get_int("cell-dim", required=True)
        param_stddev = cfg.get_float("param-stddev", 1.0)
        tanh_thr = cfg.get_float("tanh-self-repair-threshold", 0.2)
        sigm_thr = cfg.get_float("sigmoid-self-repair-threshold", 0.05)
        scale = cfg.get_float("self-repair-scale", 1.0e-05)
        self.use_dropout = cfg.get_bool("use-dropout", False)
        checks = [("cell-dim", cell_dim > 0, "must be > 0"),
                  ("param-stddev", param_stddev >= 0.0, "must be >= 0"),
                  ("tanh-self-repair-threshold", 0.0 <= tanh_thr <= 1.0, "must be in [0, 1]"),
                  ("sigmoid-self-repair-threshold", 0.0 <= sigm_thr <= 0.25,
                   "must be in [0, 0.25]"),
                  ("self-repair-scale", 0.0 <= scale <= 0.1, "must be in [0, 0.1]")]
        for opt, ok, why in checks:
            if not ok:
                raise _config_error(cfg, self, opt, why)
        self.params = (rng.standard_normal((3, cell_dim)) * param_stddev).astype(np.float32)
        self.value_sum = np.zeros((5, cell_dim))
        self.deriv_sum = np.zeros((5, cell_dim))
        # thresholds for the 5 nonlinearities (sigmoid, sigmoid, tanh, sigmoid, tanh),
        # then the 5 self-repair scales
        self.self_repair_config = np.array([sigm_thr, sigm_thr, tanh_thr, sigm_thr, tanh_thr]
                                           + [scale] * 5, dtype=np.float32)
        self.self_repair_total = np.zeros(5)
        self.count = 0.0

    @classmethod
    def read(cls, reader: KaldiReader) -> "LstmNonlinearityComponent":
        c = cls()
        tok = c.read_updatable_common(reader)
        if tok:
            raise reader.error(f"expected <LearningRate> in {cls.type_name}, got {tok!r}")
        reader.expect_token("<Params>")
        c.params = reader.read_matrix()
        reader.expect_token("<ValueAvg>")
        value_avg = reader.read_matrix().astype(np.float64)
        reader.expect_token("<DerivAvg>")
        deriv_avg = reader.read_matrix().astype(np.float64)
        reader.expect_token("<SelfRepairConfig>")
        c.self_repair_config = reader.read_vector()
        reader.expect_token("<SelfRepairProb>")
        sr_prob = reader.read_vector().astype(np.float64)
        tok = reader.read_token()
        c.use_dropout = False
        if tok == "<UseDropout>":
            c.use_dropout = reader.read_bool()
            tok = reader.read_token()
        if tok != "<Count>":
            raise reader.error(f"expected <Count> in {cls.type_name}, got {tok!r}")
        c.count = read_double(reader)
        reader.expect_token(f"</{cls.type_name}>")
        cd = c.params.shape[1]
        if (c.params.shape[0] != 3 or value_avg.shape != (5, cd) or deriv_avg.shape != (5, cd)
                or c.self_repair_config.shape != (10,) or sr_prob.shape != (5,)):
            raise ComponentError(
                f"inconsistent sizes: params {c.params.shape}, value-avg {value_avg.shape}, "
                f"deriv-avg {deriv_avg.shape}, self-repair-config {c.self_repair_config.shape}, "
                f"self-repair-prob {sr_prob.shape}", component=cls.type_name)
        # on disk: averages; in memory: sums (self-repair total is per cell too)
        c.value_sum = value_avg * c.count
        c.deriv_sum = deriv_avg * c.count
        c.self_repair_total = sr_prob * (c.count * cd)
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        norm = 1.0 / self.count if self.count != 0.0 else 1.0
        writer.write_token("<Params>")
        writer.write_matrix(self.params)
        writer.write_token("<ValueAvg>")
        writer.write_matrix(np.asarray(self.value_sum) * norm)
        writer.write_token("<DerivAvg>")
        writer.write_matrix(np.asarray(self.deriv_sum) * norm)
        writer.write_token("<SelfRepairConfig>")
        writer.write_vector(self.self_repair_config)
        writer.write_token("<SelfRepairProb>")
        sr_norm = 1.0 / (self.count * self.cell_dim) if self.count != 0.0 else 1.0
        writer.write_vector(np.asarray(self.self_repair_total) * sr_norm)
        if self.use_dropout:
            writer.write_token("<UseDropout>")
            writer.write_bool(True)
        writer.write_token("<Count>")
        write_double(writer, self.count)
        writer.write_token(f"</{self.type_name}>")

    # -- parameters and stats (Kaldi's Scale/Add touch the stats too) --------------------
    def zero_stats(self) -> None:
        for n in ("value_sum", "deriv_sum", "self_repair_total"):
            getattr(self, n)[...] = 0
        self.count = 0.0

    def set_zero(self) -> None:
        self.params[...] = 0
        self.zero_stats()

    def scale(self, alpha: float) -> None:
        if alpha == 0.0:
            self.set_zero()
            return
        for n in ("params", "value_sum", "deriv_sum", "self_repair_total"):
            getattr(self, n)[...] *= alpha
        self.count *= alpha

    def add(self, alpha: float, other: "LstmNonlinearityComponent") -> None:
        for n in ("params", "value_sum", "deriv_sum", "self_repair_total"):
            getattr(self, n)[...] += alpha * getattr(other, n)
        self.count += alpha * other.count

    # -- maths -------------------------------------------------------------------------
    def _split(self, xp, x):
        cd = self.cell_dim
        parts = [x[:, k * cd:(k + 1) * cd] for k in range(5)]
        if self.use_dropout:
            scales = [x[:, 5 * cd + k:5 * cd + k + 1] for k in range(3)]
        else:
            scales = [1.0, 1.0, 1.0]
        w = xp.asarray(self.params).astype(x.dtype, copy=False)
        return parts, scales, w

    def propagate(self, indexes, in_value, out):
        xp = array_module(in_value)
        self.check_shape("input", in_value, None, self.input_dim())
        self.check_shape("output", out, in_value.shape[0], self.output_dim())
        cd = self.cell_dim
        (i_part, f_part, c_part, o_part, c_prev), (i_s, f_s, o_s), w = self._split(xp, in_value)
        i_t = sigmoid(xp, i_part + w[0] * c_prev)
        f_t = sigmoid(xp, f_part + w[1] * c_prev)
        c_t = f_t * f_s * c_prev + i_t * i_s * xp.tanh(c_part)
        o_t = sigmoid(xp, o_part + w[2] * c_t)
        out[:, :cd] = c_t
        out[:, cd:] = o_t * o_s * xp.tanh(c_t)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv):
        xp = array_module(in_value)
        self.check_shape("input value", in_value, None, self.input_dim())
        nr = in_value.shape[0]
        self.check_shape("output derivative", out_deriv, nr, self.output_dim())
        if in_deriv is not None:
            self.check_shape("input derivative", in_deriv, nr, self.input_dim())
        cd = self.cell_dim
        dt = in_value.dtype
        (i_part, f_part, c_part, o_part, c_prev), (i_s, f_s, o_s), w = self._split(xp, in_value)
        # forward quantities again
        i_t = sigmoid(xp, i_part + w[0] * c_prev)
        f_t = sigmoid(xp, f_part + w[1] * c_prev)
        tanh_c_part = xp.tanh(c_part)
        c_t = f_t * f_s * c_prev + i_t * i_s * tanh_c_part
        o_t = sigmoid(xp, o_part + w[2] * c_t)
        tanh_c_t = xp.tanh(c_t)
        # Self-repair is switched on per unit when this component's average
        # derivative is below threshold (count + 1 avoids dividing by zero).
        cfg = xp.asarray(self.self_repair_config).astype(dt, copy=False)
        deriv_avg = xp.asarray(self.deriv_sum) / (1.0 + self.count)
        repair_on = deriv_avg < cfg[:5, None]                     # (5, C)
        sr = xp.where(repair_on, cfg[5:, None], 0).astype(dt)     # (5, C)

        dc_t_out = out_deriv[:, :cd]
        dm_t = out_deriv[:, cd:]
        dtanh_c_t = o_t * o_s * dm_t
        do_t = o_s * tanh_c_t * dm_t
        do_t_input = o_t * (1 - o_t) * do_t - (2 * o_t - 1) * sr[3]
        dc_t = ((1 - tanh_c_t * tanh_c_t) * dtanh_c_t + dc_t_out + do_t_input * w[2]
                - tanh_c_t * sr[4])
        dtanh_c_part = i_t * i_s * dc_t
        df_t = dc_t * f_s * c_prev
        df_t_input = df_t * f_t * (1 - f_t) - (2 * f_t - 1) * sr[1]
        di_t = dc_t * i_s * tanh_c_part
        di_t_input = di_t * i_t * (1 - i_t) - (2 * i_t - 1) * sr[0]

        if in_deriv is not None:
            in_deriv[:, :cd] = di_t_input
            in_deriv[:, cd:2 * cd] = df_t_input
            in_deriv[:, 2 * cd:3 * cd] = ((1 - tanh_c_part * tanh_c_part) * dtanh_c_part
                                          - tanh_c_part * sr[2])
            in_deriv[:, 3 * cd:4 * cd] = do_t_input
            in_deriv[:, 4 * cd:5 * cd] = (w[0] * di_t_input + w[1] * df_t_input
                                          + f_t * f_s * dc_t)
            if self.use_dropout:
                # Kaldi computes no derivative for the dropout masks.
                in_deriv[:, 5 * cd:] = 0

        if to_update is not None:
            params_deriv = xp.stack([(c_prev * di_t_input).sum(axis=0),
                                     (c_prev * df_t_input).sum(axis=0),
                                     (c_t * do_t_input).sum(axis=0)])
            values = (i_t, f_t, tanh_c_part, o_t, tanh_c_t)
            derivs = (i_t * (1 - i_t), f_t * (1 - f_t), 1 - tanh_c_part * tanh_c_part,
                      o_t * (1 - o_t), 1 - tanh_c_t * tanh_c_t)
            value_sums = xp.stack([v.sum(axis=0) for v in values]).astype(xp.float64)
            deriv_sums = xp.stack([d.sum(axis=0) for d in derivs]).astype(xp.float64)
            # the self-repair count uses the decision made above (before this
            # minibatch's stats are added, which matters when to_update is self)
            repaired = repair_on.sum(axis=1).astype(xp.float64) * nr
            to_update.value_sum += value_sums
            to_update.deriv_sum += deriv_sums
            to_update.self_repair_total += repaired
            to_update.count += float(nr)
            to_update.params += to_update.learning_rate * params_deriv.astype(
                to_update.params.dtype, copy=False)


# ----------------------------------------------------------------------------------
# GRUs


class _GruBase(UpdatableComponent):
    """Stats, self-repair and the shared part of the file format of the two GRUs."""

    ARRAYS = ("value_sum", "deriv_sum")

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

    def zero_stats(self) -> None:
        self.value_sum[...] = 0
        self.deriv_sum[...] = 0
        self.self_repair_total = 0.0
        self.count = 0.0

    def set_zero(self) -> None:
        self.w_h[...] = 0
        self.zero_stats()

    def scale(self, alpha: float) -> None:
        if alpha == 0.0:
            self.set_zero()
            return
        self.w_h[...] *= alpha
        self.value_sum[...] *= alpha
        self.deriv_sum[...] *= alpha
        self.self_repair_total *= alpha
        self.count *= alpha

    def add(self, alpha: float, other: "_GruBase") -> None:
        self.w_h[...] += alpha * other.w_h
        self.value_sum[...] += alpha * other.value_sum
        self.deriv_sum[...] += alpha * other.deriv_sum
        self.self_repair_total += alpha * other.self_repair_total
        self.count += alpha * other.count

    def _init_common(self, cfg: ConfigLine) -> None:
        self.init_learning_rate_common(cfg)
        cell_dim = cfg.get_int("cell-dim")
        if cell_dim is None or cell_dim <= 0:
            raise _config_error(cfg, self, "cell-dim", "cell-dim > 0 is required")
        self.cell_dim = cell_dim
        self.self_repair_threshold = cfg.get_float("self-repair-threshold", 0.2)
        self.self_repair_scale = cfg.get_float("self-repair-scale", 1.0e-05)
        if self.self_repair_threshold < 0:
            raise _config_error(cfg, self, "self-repair-threshold", "must be >= 0")
        if self.self_repair_scale < 0:
            raise _config_error(cfg, self, "self-repair-scale", "must be >= 0")
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
            raise _config_error(cfg, self, "recurrent-dim",
                                f"must be in [1, cell-dim={c}] (got {r})")
        self.recurrent_dim = r
        self.w_h = (rng.standard_normal((c, r)) * param_stddev).astype(np.float32)

    @classmethod
    def read(cls, reader: KaldiReader) -> "GruNonlinearityComponent":
        g = cls()
        tok = g.read_updatable_common(reader)
        if tok:
            raise reader.error(f"expected <LearningRate> in {cls.type_name}, got {tok!r}")
        reader.expect_token("<CellDim>")
        g.cell_dim = reader.read_int()
        reader.expect_token("<RecurrentDim>")
        g.recurrent_dim = reader.read_int()
        reader.expect_token("<w_h>")
        g.w_h = reader.read_matrix()
        g._read_stats(reader)
        reader.expect_token("<RankInOut>")
        g.rank_in = reader.read_int()
        g.rank_out = reader.read_int()
        reader.expect_token("<UpdatePeriod>")
        g.update_period = reader.read_int()
        reader.expect_token(f"</{cls.type_name}>")
        g._check("while reading")
        if not 0 < g.recurrent_dim <= g.cell_dim or \
                g.w_h.shape != (g.cell_dim, g.recurrent_dim):
            raise ComponentError(f"w_h has shape {g.w_h.shape}, expected (cell-dim, "
                                 f"recurrent-dim) = ({g.cell_dim}, {g.recurrent_dim})",
                                 component=cls.type_name)
        return g

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<CellDim>")
        writer.write_int(self.cell_dim)
        writer.write_token("<RecurrentDim>")
        writer.write_int(self.recurrent_dim)
        writer.write_token("<w_h>")
        writer.write_matrix(self.w_h)
        self._write_stats(writer)
        writer.write_token("<RankInOut>")
        writer.write_int(self.rank_in)
        writer.write_int(self.rank_out)
        writer.write_token("<UpdatePeriod>")
        writer.write_int(self.update_period)
        writer.write_token(f"</{self.type_name}>")

    def _slices(self):
        c, r = self.cell_dim, self.recurrent_dim
        d = self.input_dim()
        return (slice(0, c), slice(c, c + r), slice(c + r, 2 * c + r),
                slice(2 * c + r, 3 * c + r), slice(d - r, d))

    def propagate(self, indexes, in_value, out):
        xp = array_module(in_value)
        self.check_shape("input", in_value, None, self.input_dim())
        self.check_shape("output", out, in_value.shape[0], self.output_dim())
        z_sl, r_sl, hp_sl, c1_sl, s1_sl = self._slices()
        c = self.cell_dim
        z_t, c_t1 = in_value[:, z_sl], in_value[:, c1_sl]
        w_h = xp.asarray(self.w_h).astype(in_value.dtype, copy=False)
        sdotr = in_value[:, r_sl] * in_value[:, s1_sl]
        h_t = xp.tanh(in_value[:, hp_sl] + sdotr @ w_h.T)
        out[:, :c] = h_t
        out[:, c:] = h_t - z_t * h_t + z_t * c_t1
        return None

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
        self.w_h = (rng.standard_normal(self.cell_dim) * param_stddev
                    + param_mean).astype(np.float32)

    @classmethod
    def read(cls, reader: KaldiReader) -> "OutputGruNonlinearityComponent":
        g = cls()
        tok = g.read_updatable_common(reader)
        if tok:
            raise reader.error(f"expected <LearningRate> in {cls.type_name}, got {tok!r}")
        reader.expect_token("<CellDim>")
        g.cell_dim = reader.read_int()
        reader.expect_token("<w_h>")
        g.w_h = reader.read_vector()
        g._read_stats(reader)
        reader.expect_token("<Rank>")
        g.rank = reader.read_int()
        reader.expect_token("<UpdatePeriod>")
        g.update_period = reader.read_int()
        reader.expect_token(f"</{cls.type_name}>")
        g._check("while reading")
        if g.w_h.shape != (g.cell_dim,):
            raise ComponentError(f"w_h has dim {g.w_h.shape}, expected cell-dim {g.cell_dim}",
                                 component=cls.type_name)
        return g

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<CellDim>")
        writer.write_int(self.cell_dim)
        writer.write_token("<w_h>")
        writer.write_vector(self.w_h)
        self._write_stats(writer)
        writer.write_token("<Rank>")
        writer.write_int(self.rank)
        writer.write_token("<UpdatePeriod>")
        writer.write_int(self.update_period)
        writer.write_token(f"</{self.type_name}>")

    def propagate(self, indexes, in_value, out):
        xp = array_module(in_value)
        self.check_shape("input", in_value, None, self.input_dim())
        self.check_shape("output", out, in_value.shape[0], self.output_dim())
        c = self.cell_dim
        z_t, hpart_t, c_t1 = in_value[:, :c], in_value[:, c:2 * c], in_value[:, 2 * c:]
        w_h = xp.asarray(self.w_h).astype(in_value.dtype, copy=False)
        h_t = xp.tanh(c_t1 * w_h + hpart_t)
        out[:, :c] = h_t
        out[:, c:] = h_t - z_t * h_t + z_t * c_t1
        return None

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
