"""Recurrent nonlinearity components: Kaldi's LstmNonlinearityComponent
(src/nnet3/nnet-combined-component.{h,cc}; the maths is
cu::ComputeLstmNonlinearity / cu::BackpropLstmNonlinearity in
src/cudamatrix/cu-math.cc), plus the helpers shared with the GRU
nonlinearities in ``gru.py``.

The recurrent nonlinearities are simple components that compute one time
step of the cell's nonlinear part; the affine parts and the recurrence live in the surrounding
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

from typing import ClassVar

import numpy as np

from engine.core.errors import ComponentError, ConfigError
from engine.core.xp import array_module
from engine.nnet.components.base import updatable_info  # noqa: F401  (re-exported)
from engine.nnet.components._param_utils import gaussian
from engine.nnet.components.base import P, UpdatableComponent, register_component
# the gates' logistic, SigmoidComponent's (the fast form, engine/runtime/fastpaths.py,
# decides between its two forms on one gate's size, as this does)
from engine.nnet.components.nonlinear import sigmoid
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import (  # noqa: F401  (re-exported for gru.py)
    KaldiReader,
    KaldiWriter,
    format_float,
    read_double,
    write_double,
)

# ----------------------------------------------------------------------------------
# shared helpers






def rms(a) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(np.sqrt(np.mean(a * a))) if a.size else 0.0


def option_error(cfg: ConfigLine, comp, option: str, message: str) -> ConfigError:
    return cfg.error(f"component {comp.name!r} ({comp.type_name}): option {option}: {message}")


class RecurrentNonlinearityBase(UpdatableComponent):
    """The recurrent nonlinearities' common ground: Kaldi's SetZero, Scale and Add act on
    the parameters (``PARAMS``) and the stats (``STAT_ARRAYS``, ``STAT_SCALARS``), and
    their files start with the learning-rate header."""

    STAT_ARRAYS: ClassVar[tuple[str, ...]] = ()
    STAT_SCALARS: ClassVar[tuple[str, ...]] = ("count",)

    @property
    def STAT_FIELDS(self) -> tuple[str, ...]:  # type: ignore[override]  # noqa: N802
        return self.STAT_ARRAYS + self.STAT_SCALARS

    @classmethod
    def _read_learning_rate_header(cls, reader: KaldiReader):
        """A new component with the learning-rate header read (it must be there)."""
        c = cls()
        tok = c.read_updatable_common(reader)
        if tok:
            raise reader.error(f"expected <LearningRate> in {cls.type_name}, got {tok!r}")
        return c

    def zero_stats(self) -> None:
        for n in self.STAT_ARRAYS:
            getattr(self, n)[...] = 0
        for n in self.STAT_SCALARS:
            setattr(self, n, 0.0)

    def set_zero(self) -> None:
        super().set_zero()
        self.zero_stats()

    def scale(self, alpha: float) -> None:
        if alpha == 0.0:
            self.set_zero()
            return
        for n in self.PARAMS + self.STAT_ARRAYS:
            getattr(self, n)[...] *= alpha
        for n in self.STAT_SCALARS:
            setattr(self, n, getattr(self, n) * alpha)

    def add(self, alpha: float, other: "RecurrentNonlinearityBase") -> None:
        for n in self.PARAMS + self.STAT_ARRAYS:
            getattr(self, n)[...] += alpha * getattr(other, n)
        for n in self.STAT_SCALARS:
            setattr(self, n, getattr(self, n) + alpha * getattr(other, n))


# ----------------------------------------------------------------------------------
# LSTM


_LSTM_NONLINEARITY_PROPS = P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT


@register_component
class LstmNonlinearityComponent(RecurrentNonlinearityBase):
    """Input ``[i_part f_part c_part o_part c_prev]`` (5C, plus 3 dropout-mask
    columns with use-dropout), output ``[c_t m_t]`` (2C); params are the
    diagonal peephole weights ``w_ic, w_fc, w_oc`` (a 3 x C matrix)."""

    type_name = "LstmNonlinearityComponent"
    PARAMS = ("params",)
    ARRAYS = ("value_sum", "deriv_sum", "self_repair_config", "self_repair_total")
    STAT_ARRAYS = ("value_sum", "deriv_sum", "self_repair_total")

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
        return _LSTM_NONLINEARITY_PROPS

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
                raise option_error(cfg, self, opt, why)
        self.params = gaussian(rng, (3, cell_dim), param_stddev)
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
        c = cls._read_learning_rate_header(reader)
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
