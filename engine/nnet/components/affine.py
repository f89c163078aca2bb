"""The affine components of Kaldi's nnet-simple-component.{h,cc}: AffineComponent,
NaturalGradientAffineComponent, LinearComponent and FixedAffineComponent
(block_affine.py has the block-diagonal and repeated variants).

Natural gradient: Kaldi preconditions the parameter update with an online
natural-gradient estimate during training.  That preconditioner is a training
optimizer and is not implemented here; its options are read, kept and written
faithfully, the gradient (``is_gradient``, Kaldi's SetAsGradient mode) is exact, and
an update outside gradient mode uses the plain (unpreconditioned) direction.
"""

from __future__ import annotations

import math

import numpy as np

from engine.nnet.components._param_utils import (
    check_backprop_shapes,
    check_rows,
    config_errors,
    expect_after_common,
    gaussian,
    init_learning_rates,
    param_stats,
    read_matrix_option,
    require_positive,
    skip_old_is_gradient,
    updatable_info,
)
from engine.nnet.components.base import (
    Component,
    ComponentProperty as P,
    UpdatableComponent,
    register_component,
)
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

# --------------------------------------------------------------------------------------
# AffineComponent and NaturalGradientAffineComponent


def _rank_default(rank: int, dim: int, cap: int) -> int:
    return rank if rank >= 0 else min(cap, (dim + 1) // 2)


_AFFINE_PROPS = (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                 | P.BACKPROP_ADDS)


@register_component
class AffineComponent(UpdatableComponent):
    """y = x W^T + b; options input-dim, output-dim, param-stddev, bias-stddev,
    orthonormal-constraint, or matrix=FILE (last column is the bias)."""

    type_name = "AffineComponent"
    PARAMS = ("linear_params", "bias_params")

    def __init__(self) -> None:
        super().__init__()
        self.linear_params = np.zeros((0, 0), np.float32)
        self.bias_params = np.zeros(0, np.float32)
        self.orthonormal_constraint = 0.0

    def properties(self) -> P:
        return _AFFINE_PROPS

    def input_dim(self) -> int:
        return int(self.linear_params.shape[1])

    def output_dim(self) -> int:
        return int(self.linear_params.shape[0])

    def info(self) -> str:
        s = updatable_info(self)
        if self.orthonormal_constraint != 0.0:
            s += f", orthonormal-constraint={self.orthonormal_constraint:g}"
        return (s + param_stats("linear-params", self.linear_params, False)
                + param_stats("bias", self.bias_params, True))

    # -- config ------------------------------------------------------------------------
    def _init_params(self, cfg: ConfigLine, rng, with_bias_mean: bool) -> None:
        matrix = cfg.get_str("matrix")
        if matrix is not None:
            mat = read_matrix_option(cfg, "matrix", matrix)
            if mat.shape[1] < 2:
                raise cfg.error(f"option matrix={matrix!r}: the matrix needs at least 2 "
                                f"columns (linear part and bias), it has {mat.shape[1]}")
            self.linear_params = np.ascontiguousarray(mat[:, :-1])
            self.bias_params = np.ascontiguousarray(mat[:, -1])
            for opt, dim in (("input-dim", self.input_dim()), ("output-dim", self.output_dim())):
                given = cfg.get_int(opt)
                if given is not None and given != dim:
                    raise cfg.error(f"option {opt}={given} does not match the matrix in "
                                    f"{matrix!r} ({opt} {dim})")
            return
        input_dim = require_positive(cfg, "input-dim", cfg.get_int("input-dim"))
        output_dim = require_positive(cfg, "output-dim", cfg.get_int("output-dim"))
        param_stddev = cfg.get_float("param-stddev", 1.0 / math.sqrt(input_dim))
        bias_stddev = cfg.get_float("bias-stddev", 1.0)
        bias_mean = cfg.get_float("bias-mean", 0.0) if with_bias_mean else 0.0
        if param_stddev < 0.0:
            raise cfg.error(f"option param-stddev={param_stddev:g} must not be negative")
        if with_bias_mean and bias_stddev < 0.0:
            raise cfg.error(f"option bias-stddev={bias_stddev:g} must not be negative")
        self.linear_params = gaussian(rng, (output_dim, input_dim), param_stddev)
        self.bias_params = gaussian(rng, (output_dim,), bias_stddev, bias_mean)

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            init_learning_rates(self, cfg)
            self._init_params(cfg, rng, with_bias_mean=False)
            self.orthonormal_constraint = cfg.get_float("orthonormal-constraint", 0.0)

    # -- I/O ---------------------------------------------------------------------------
    def _read_params(self, reader: KaldiReader) -> None:
        pending = self.read_updatable_common(reader)
        expect_after_common(reader, pending, "<LinearParams>")
        self.linear_params = reader.read_matrix()
        reader.expect_token("<BiasParams>")
        self.bias_params = reader.read_vector()

    def _check_dims(self, reader: KaldiReader) -> None:
        if self.bias_params.shape[0] != self.linear_params.shape[0]:
            raise reader.error(f"{self.type_name}: bias dimension {self.bias_params.shape[0]} "
                               f"!= linear-params rows {self.linear_params.shape[0]}")

    @classmethod
    def read(cls, reader: KaldiReader) -> "AffineComponent":
        c = cls()
        c._read_params(reader)
        skip_old_is_gradient(c, reader)
        c.orthonormal_constraint = 0.0
        if reader.try_token("<OrthonormalConstraint>"):
            c.orthonormal_constraint = reader.read_float()
        reader.expect_token(f"</{cls.type_name}>")
        c._check_dims(reader)
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<LinearParams>")
        writer.write_matrix(self.linear_params)
        writer.write_token("<BiasParams>")
        writer.write_vector(self.bias_params)
        if self.orthonormal_constraint != 0.0:
            writer.write_token("<OrthonormalConstraint>")
            writer.write_float(self.orthonormal_constraint)
        writer.write_token(f"</{self.type_name}>")

    # -- maths -------------------------------------------------------------------------
    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        out[...] = in_value @ self.linear_params.T
        out += self.bias_params
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        check_backprop_shapes(self, out_deriv, in_deriv)
        if in_deriv is not None:
            in_deriv += out_deriv @ self.linear_params
        if to_update is not None:
            # after the input derivative, so that an in-place update (to_update is
            # self) does not change the derivative we propagate.
            self.check_shape("input value", in_value, out_deriv.shape[0], self.input_dim())
            lr = to_update.learning_rate
            to_update.linear_params += lr * (out_deriv.T @ in_value)
            to_update.bias_params += lr * out_deriv.sum(axis=0)


@register_component
class NaturalGradientAffineComponent(AffineComponent):
    """AffineComponent trained with natural gradient; adds bias-mean and the
    preconditioner options rank-in, rank-out, update-period, num-samples-history, alpha."""

    type_name = "NaturalGradientAffineComponent"

    def __init__(self) -> None:
        super().__init__()
        self.rank_in = 20
        self.rank_out = 80
        self.update_period = 4
        self.num_samples_history = 2000.0
        self.alpha = 4.0

    def info(self) -> str:
        return (super().info() + f", rank-in={self.rank_in}, rank-out={self.rank_out}, "
                f"num-samples-history={self.num_samples_history:g}, "
                f"update-period={self.update_period}, alpha={self.alpha:g}")

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            self.is_gradient = False
            init_learning_rates(self, cfg)
            self._init_params(cfg, rng, with_bias_mean=True)
            self.orthonormal_constraint = cfg.get_float("orthonormal-constraint", 0.0)
            self.num_samples_history = cfg.get_float("num-samples-history", 2000.0)
            self.alpha = cfg.get_float("alpha", 4.0)
            self.rank_in = _rank_default(cfg.get_int("rank-in", -1), self.input_dim(), 20)
            self.rank_out = _rank_default(cfg.get_int("rank-out", -1), self.output_dim(), 80)
            self.update_period = cfg.get_int("update-period", 4)

    @classmethod
    def read(cls, reader: KaldiReader) -> "NaturalGradientAffineComponent":
        c = cls()
        c._read_params(reader)
        reader.expect_token("<RankIn>")
        c.rank_in = reader.read_int()
        reader.expect_token("<RankOut>")
        c.rank_out = reader.read_int()
        c.orthonormal_constraint = 0.0
        if reader.try_token("<OrthonormalConstraint>"):
            c.orthonormal_constraint = reader.read_float()
        reader.expect_token("<UpdatePeriod>")
        c.update_period = reader.read_int()
        reader.expect_token("<NumSamplesHistory>")
        c.num_samples_history = reader.read_float()
        reader.expect_token("<Alpha>")
        c.alpha = reader.read_float()
        if reader.try_token("<MaxChangePerSample>"):  # long-removed option
            reader.read_float()
        skip_old_is_gradient(c, reader)
        if reader.try_token("<UpdateCount>"):  # configs added and later removed
            reader.read_float()
            reader.expect_token("<ActiveScalingCount>")
            reader.read_float()
            reader.expect_token("<MaxChangeScaleStats>")
            reader.read_float()
        start = reader.pos
        tok = reader.read_token()
        # Kaldi accepts either the closing or (old files) the opening tag here.
        if "NaturalGradientAffineComponent>" not in tok:
            raise reader.error(f"expected </NaturalGradientAffineComponent>, got {tok!r}",
                               offset=start)
        c._check_dims(reader)
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<LinearParams>")
        writer.write_matrix(self.linear_params)
        writer.write_token("<BiasParams>")
        writer.write_vector(self.bias_params)
        writer.write_token("<RankIn>")
        writer.write_int(self.rank_in)
        writer.write_token("<RankOut>")
        writer.write_int(self.rank_out)
        if self.orthonormal_constraint != 0.0:
            writer.write_token("<OrthonormalConstraint>")
            writer.write_float(self.orthonormal_constraint)
        writer.write_token("<UpdatePeriod>")
        writer.write_int(self.update_period)
        writer.write_token("<NumSamplesHistory>")
        writer.write_float(self.num_samples_history)
        writer.write_token("<Alpha>")
        writer.write_float(self.alpha)
        writer.write_token("</NaturalGradientAffineComponent>")


# --------------------------------------------------------------------------------------
# LinearComponent


_LINEAR_PROPS = (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                 | P.PROPAGATE_ADDS | P.BACKPROP_ADDS)


@register_component
class LinearComponent(UpdatableComponent):
    """y += x W^T (no bias; PROPAGATE_ADDS); natural-gradient options as
    NaturalGradientAffineComponent plus use-natural-gradient."""

    type_name = "LinearComponent"
    PARAMS = ("params",)

    def __init__(self) -> None:
        super().__init__()
        self.params = np.zeros((0, 0), np.float32)
        self.orthonormal_constraint = 0.0
        self.use_natural_gradient = True
        self.rank_in = 40
        self.rank_out = 80
        self.update_period = 4
        self.num_samples_history = 2000.0
        self.alpha = 4.0

    def properties(self) -> P:
        return _LINEAR_PROPS

    def input_dim(self) -> int:
        return int(self.params.shape[1])

    def output_dim(self) -> int:
        return int(self.params.shape[0])

    def info(self) -> str:
        s = updatable_info(self) + param_stats("params", self.params, False)
        if self.orthonormal_constraint != 0.0:
            s += f", orthonormal-constraint={self.orthonormal_constraint:g}"
        return (s + f", use-natural-gradient={'true' if self.use_natural_gradient else 'false'}"
                f", rank-in={self.rank_in}, rank-out={self.rank_out}, "
                f"num-samples-history={self.num_samples_history:g}, "
                f"update-period={self.update_period}, alpha={self.alpha:g}")

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            self.is_gradient = False
            init_learning_rates(self, cfg)
            matrix = cfg.get_str("matrix")
            if matrix is not None:
                self.params = read_matrix_option(cfg, "matrix", matrix)
                if self.params.shape[0] == 0:
                    raise cfg.error(f"option matrix={matrix!r}: the matrix is empty")
                for opt, dim in (("input-dim", self.input_dim()),
                                 ("output-dim", self.output_dim())):
                    given = cfg.get_int(opt)
                    if given is not None and given != dim:
                        raise cfg.error(f"option {opt}={given} does not match the matrix in "
                                        f"{matrix!r} ({opt} {dim})")
            else:
                input_dim = require_positive(cfg, "input-dim", cfg.get_int("input-dim"))
                output_dim = require_positive(cfg, "output-dim", cfg.get_int("output-dim"))
                stddev = cfg.get_float("param-stddev", 1.0 / math.sqrt(input_dim))
                if stddev < 0.0:
                    raise cfg.error(f"option param-stddev={stddev:g} must not be negative")
                self.params = gaussian(rng, (output_dim, input_dim), stddev)
            self.num_samples_history = cfg.get_float("num-samples-history", 2000.0)
            self.alpha = cfg.get_float("alpha", 4.0)
            rank_in = cfg.get_int("rank-in", -1)
            rank_out = cfg.get_int("rank-out", -1)
            self.update_period = cfg.get_int("update-period", 4)
            self.use_natural_gradient = cfg.get_bool("use-natural-gradient", True)
            self.rank_in = _rank_default(rank_in, self.input_dim(), 20)
            self.rank_out = _rank_default(rank_out, self.output_dim(), 80)
            self.orthonormal_constraint = cfg.get_float("orthonormal-constraint", 0.0)

    @classmethod
    def read(cls, reader: KaldiReader) -> "LinearComponent":
        c = cls()
        pending = c.read_updatable_common(reader)
        expect_after_common(reader, pending, "<Params>")
        c.params = reader.read_matrix()
        c.orthonormal_constraint = 0.0
        if reader.try_token("<OrthonormalConstraint>"):
            c.orthonormal_constraint = reader.read_float()
        reader.expect_token("<UseNaturalGradient>")
        c.use_natural_gradient = reader.read_bool()
        reader.expect_token("<RankInOut>")
        c.rank_in = reader.read_int()
        c.rank_out = reader.read_int()
        reader.expect_token("<Alpha>")
        c.alpha = reader.read_float()
        reader.expect_token("<NumSamplesHistory>")
        c.num_samples_history = reader.read_float()
        reader.expect_token("<UpdatePeriod>")
        c.update_period = reader.read_int()
        reader.expect_token("</LinearComponent>")
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<Params>")
        writer.write_matrix(self.params)
        if self.orthonormal_constraint != 0.0:
            writer.write_token("<OrthonormalConstraint>")
            writer.write_float(self.orthonormal_constraint)
        writer.write_token("<UseNaturalGradient>")
        writer.write_bool(self.use_natural_gradient)
        writer.write_token("<RankInOut>")
        writer.write_int(self.rank_in)
        writer.write_int(self.rank_out)
        writer.write_token("<Alpha>")
        writer.write_float(self.alpha)
        writer.write_token("<NumSamplesHistory>")
        writer.write_float(self.num_samples_history)
        writer.write_token("<UpdatePeriod>")
        writer.write_int(self.update_period)
        writer.write_token("</LinearComponent>")

    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        out += in_value @ self.params.T
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        check_backprop_shapes(self, out_deriv, in_deriv)
        if in_deriv is not None:
            in_deriv += out_deriv @ self.params
        if to_update is not None:
            self.check_shape("input value", in_value, out_deriv.shape[0], self.input_dim())
            to_update.params += to_update.learning_rate * (out_deriv.T @ in_value)


# --------------------------------------------------------------------------------------
# FixedAffineComponent


_FIXED_AFFINE_PROPS = P.SIMPLE_COMPONENT | P.BACKPROP_ADDS


@register_component
class FixedAffineComponent(Component):
    """A non-trainable affine transform: matrix=FILE (Kaldi matrix whose last column is
    the bias) or, for testing, input-dim/output-dim with random parameters."""

    type_name = "FixedAffineComponent"
    ARRAYS = ("linear_params", "bias_params")

    def __init__(self) -> None:
        super().__init__()
        self.linear_params = np.zeros((0, 0), np.float32)
        self.bias_params = np.zeros(0, np.float32)

    def properties(self) -> P:
        return _FIXED_AFFINE_PROPS

    def input_dim(self) -> int:
        return int(self.linear_params.shape[1])

    def output_dim(self) -> int:
        return int(self.linear_params.shape[0])

    def info(self) -> str:
        return (super().info() + param_stats("linear-params", self.linear_params, False)
                + param_stats("bias", self.bias_params, True))

    def _set_from_matrix(self, cfg: ConfigLine, mat: np.ndarray, what: str) -> None:
        if mat.shape[1] < 2 or mat.shape[0] == 0:
            raise cfg.error(f"{what}: the matrix must have at least 1 row and 2 columns "
                            f"(linear part and bias), it is {mat.shape[0]}x{mat.shape[1]}")
        self.linear_params = np.ascontiguousarray(mat[:, :-1])
        self.bias_params = np.ascontiguousarray(mat[:, -1])

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            matrix = cfg.get_str("matrix")
            if matrix is not None:
                # Kaldi accepts nothing else beside matrix= (the registry rejects extras).
                mat = read_matrix_option(cfg, "matrix", matrix)
                self._set_from_matrix(cfg, mat, f"option matrix={matrix!r}")
                return
            input_dim = require_positive(cfg, "input-dim", cfg.get_int("input-dim"))
            output_dim = require_positive(cfg, "output-dim", cfg.get_int("output-dim"))
            self._set_from_matrix(cfg, gaussian(rng, (output_dim, input_dim + 1), 1.0),
                                  "random init")

    @classmethod
    def read(cls, reader: KaldiReader) -> "FixedAffineComponent":
        c = cls()
        reader.try_token("<FixedAffineComponent>")
        reader.expect_token("<LinearParams>")
        c.linear_params = reader.read_matrix()
        reader.expect_token("<BiasParams>")
        c.bias_params = reader.read_vector()
        reader.expect_token("</FixedAffineComponent>")
        if c.bias_params.shape[0] != c.linear_params.shape[0]:
            raise reader.error("FixedAffineComponent: bias and linear-params dimensions differ")
        return c

    def write(self, writer: KaldiWriter) -> None:
        writer.write_token("<FixedAffineComponent>")
        writer.write_token("<LinearParams>")
        writer.write_matrix(self.linear_params)
        writer.write_token("<BiasParams>")
        writer.write_vector(self.bias_params)
        writer.write_token("</FixedAffineComponent>")

    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        out[...] = in_value @ self.linear_params.T
        out += self.bias_params
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        check_backprop_shapes(self, out_deriv, in_deriv)
        if in_deriv is not None:
            in_deriv += out_deriv @ self.linear_params
