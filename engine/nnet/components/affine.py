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

from engine.core import sgemm
from engine.nnet.components._param_utils import (
    begin_updatable_read,
    check_backprop_shapes,
    check_linear_and_bias,
    check_rows,
    config_errors,
    gaussian,
    init_learning_rates,
    is_planning,
    linear_and_bias_stats,
    param_stats,
    rank_default,
    read_linear_and_bias,
    read_matrix_option,
    read_period_history_alpha,
    require_positive,
    skip_old_is_gradient,
    updatable_info,
    write_linear_and_bias,
    write_period_history_alpha,
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
# helpers of this module


class _AffineMap:
    """y = x W^T + b with W = linear_params (output-dim x input-dim), b = bias_params:
    the arrays, dimensions and propagation of AffineComponent and FixedAffineComponent."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_params = np.zeros((0, 0), np.float32)
        self.bias_params = np.zeros(0, np.float32)

    def input_dim(self) -> int:
        return int(self.linear_params.shape[1])

    def output_dim(self) -> int:
        return int(self.linear_params.shape[0])

    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        if not sgemm.write_nt(in_value, self.linear_params, out):
            out[...] = in_value @ self.linear_params.T
        out += self.bias_params
        return None

    def _backprop_input(self, out_deriv, in_deriv) -> None:
        """Check the backprop shapes and add the input derivative dy W to in_deriv."""
        check_backprop_shapes(self, out_deriv, in_deriv)
        if in_deriv is not None:
            in_deriv += out_deriv @ self.linear_params


def _check_matrix_dims(comp, cfg: ConfigLine, matrix: str) -> None:
    """Options input-dim / output-dim, when given, must match the matrix read from a file."""
    for opt, dim in (("input-dim", comp.input_dim()), ("output-dim", comp.output_dim())):
        given = cfg.get_int(opt)
        if given is not None and given != dim:
            raise cfg.error(f"option {opt}={given} does not match the matrix in "
                            f"{matrix!r} ({opt} {dim})")


def _read_orthonormal_constraint(reader: KaldiReader) -> float:
    """The optional ``<OrthonormalConstraint>`` (0 when absent)."""
    return reader.read_float() if reader.try_token("<OrthonormalConstraint>") else 0.0


def _write_orthonormal_constraint(writer: KaldiWriter, value: float) -> None:
    """``<OrthonormalConstraint>``, written only when not 0."""
    if value != 0.0:
        writer.write_token("<OrthonormalConstraint>")
        writer.write_float(value)


def _init_natural_gradient(comp, cfg: ConfigLine) -> None:
    """The options num-samples-history, alpha, rank-in, rank-out and update-period of
    NaturalGradientAffineComponent and LinearComponent."""
    comp.num_samples_history = cfg.get_float("num-samples-history", 2000.0)
    comp.alpha = cfg.get_float("alpha", 4.0)
    comp.rank_in = rank_default(cfg.get_int("rank-in", -1), comp.input_dim(), 20)
    comp.rank_out = rank_default(cfg.get_int("rank-out", -1), comp.output_dim(), 80)
    comp.update_period = cfg.get_int("update-period", 4)


def _natural_gradient_info(comp) -> str:
    """The info() part of NaturalGradientAffineComponent's and LinearComponent's options."""
    return (f", rank-in={comp.rank_in}, rank-out={comp.rank_out}, "
            f"num-samples-history={comp.num_samples_history:g}, "
            f"update-period={comp.update_period}, alpha={comp.alpha:g}")


# --------------------------------------------------------------------------------------
# AffineComponent and NaturalGradientAffineComponent


_AFFINE_PROPS = (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                 | P.BACKPROP_ADDS)


@register_component
class AffineComponent(_AffineMap, UpdatableComponent):
    """y = x W^T + b; options input-dim, output-dim, param-stddev, bias-stddev,
    orthonormal-constraint, or matrix=FILE (last column is the bias)."""

    type_name = "AffineComponent"
    PARAMS = ("linear_params", "bias_params")

    def __init__(self) -> None:
        super().__init__()
        self.orthonormal_constraint = 0.0

    def properties(self) -> P:
        return _AFFINE_PROPS

    def info(self) -> str:
        s = updatable_info(self)
        if self.orthonormal_constraint != 0.0:
            s += f", orthonormal-constraint={self.orthonormal_constraint:g}"
        return s + linear_and_bias_stats(self)

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
            _check_matrix_dims(self, cfg, matrix)
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
        self.linear_params, self.bias_params = read_linear_and_bias(reader, pending)

    def _check_dims(self, reader: KaldiReader) -> None:
        check_linear_and_bias(reader, self.type_name, self.linear_params, self.bias_params)

    @classmethod
    def read(cls, reader: KaldiReader) -> "AffineComponent":
        c = cls()
        c._read_params(reader)
        skip_old_is_gradient(c, reader)
        c.orthonormal_constraint = _read_orthonormal_constraint(reader)
        reader.expect_token(f"</{cls.type_name}>")
        c._check_dims(reader)
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        write_linear_and_bias(writer, self.linear_params, self.bias_params)
        _write_orthonormal_constraint(writer, self.orthonormal_constraint)
        writer.write_token(f"</{self.type_name}>")

    # -- maths (propagate: _AffineMap) ---------------------------------------------------
    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        self._backprop_input(out_deriv, in_deriv)
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
        return super().info() + _natural_gradient_info(self)

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            self.is_gradient = False
            init_learning_rates(self, cfg)
            self._init_params(cfg, rng, with_bias_mean=True)
            self.orthonormal_constraint = cfg.get_float("orthonormal-constraint", 0.0)
            _init_natural_gradient(self, cfg)

    @classmethod
    def read(cls, reader: KaldiReader) -> "NaturalGradientAffineComponent":
        c = cls()
        c._read_params(reader)
        reader.expect_token("<RankIn>")
        c.rank_in = reader.read_int()
        reader.expect_token("<RankOut>")
        c.rank_out = reader.read_int()
        c.orthonormal_constraint = _read_orthonormal_constraint(reader)
        read_period_history_alpha(reader, c)
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
        write_linear_and_bias(writer, self.linear_params, self.bias_params)
        writer.write_token("<RankIn>")
        writer.write_int(self.rank_in)
        writer.write_token("<RankOut>")
        writer.write_int(self.rank_out)
        _write_orthonormal_constraint(writer, self.orthonormal_constraint)
        write_period_history_alpha(writer, self)
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
                + _natural_gradient_info(self))

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            self.is_gradient = False
            init_learning_rates(self, cfg)
            matrix = cfg.get_str("matrix")
            if matrix is not None:
                self.params = read_matrix_option(cfg, "matrix", matrix)
                if self.params.shape[0] == 0:
                    raise cfg.error(f"option matrix={matrix!r}: the matrix is empty")
                _check_matrix_dims(self, cfg, matrix)
            else:
                input_dim = require_positive(cfg, "input-dim", cfg.get_int("input-dim"))
                output_dim = require_positive(cfg, "output-dim", cfg.get_int("output-dim"))
                stddev = cfg.get_float("param-stddev", 1.0 / math.sqrt(input_dim))
                if stddev < 0.0:
                    raise cfg.error(f"option param-stddev={stddev:g} must not be negative")
                self.params = gaussian(rng, (output_dim, input_dim), stddev)
            _init_natural_gradient(self, cfg)
            self.use_natural_gradient = cfg.get_bool("use-natural-gradient", True)
            self.orthonormal_constraint = cfg.get_float("orthonormal-constraint", 0.0)

    @classmethod
    def read(cls, reader: KaldiReader) -> "LinearComponent":
        c = begin_updatable_read(cls, reader, "<Params>")
        c.params = reader.read_matrix()
        c.orthonormal_constraint = _read_orthonormal_constraint(reader)
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
        _write_orthonormal_constraint(writer, self.orthonormal_constraint)
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
        if not sgemm.add_nt(in_value, self.params, out):
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
class FixedAffineComponent(_AffineMap, Component):
    """A non-trainable affine transform: matrix=FILE (Kaldi matrix whose last column is
    the bias) or, for testing, input-dim/output-dim with random parameters."""

    type_name = "FixedAffineComponent"
    ARRAYS = ("linear_params", "bias_params")

    def properties(self) -> P:
        return _FIXED_AFFINE_PROPS

    def info(self) -> str:
        return super().info() + linear_and_bias_stats(self)

    def _set_from_matrix(self, cfg: ConfigLine, mat: np.ndarray, what: str) -> None:
        if mat.shape[1] < 2 or mat.shape[0] == 0:
            raise cfg.error(f"{what}: the matrix must have at least 1 row and 2 columns "
                            f"(linear part and bias), it is {mat.shape[0]}x{mat.shape[1]}")
        if is_planning():
            # apply_config's counting pass: the matrix holds no memory, nor may its parts
            self.linear_params, self.bias_params = mat[:, :-1], mat[:, -1]
            return
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
        c.linear_params, c.bias_params = read_linear_and_bias(reader)
        reader.expect_token("</FixedAffineComponent>")
        if c.bias_params.shape[0] != c.linear_params.shape[0]:
            raise reader.error("FixedAffineComponent: bias and linear-params dimensions differ")
        return c

    def write(self, writer: KaldiWriter) -> None:
        writer.write_token("<FixedAffineComponent>")
        write_linear_and_bias(writer, self.linear_params, self.bias_params)
        writer.write_token("</FixedAffineComponent>")

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        self._backprop_input(out_deriv, in_deriv)
