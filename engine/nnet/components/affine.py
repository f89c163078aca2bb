"""The affine family of nnet3 components (Kaldi's nnet-simple-component.{h,cc}):
AffineComponent, NaturalGradientAffineComponent, LinearComponent,
FixedAffineComponent, BlockAffineComponent, RepeatedAffineComponent and
NaturalGradientRepeatedAffineComponent.

Also the helpers the sibling modules (scale_offset.py, tdnn.py) share: reading a
Kaldi matrix/vector file for ``matrix=`` style options (Kaldi's ReadKaldiObject),
naming the component in config errors, the ``<Token>`` checks after Kaldi's
ReadUpdatableCommon, and the parameter summaries of Kaldi's PrintParameterStats.

Natural gradient: Kaldi preconditions the parameter update with an online
natural-gradient estimate during training.  That preconditioner is a training
optimizer and is not implemented here; its options are read, kept and written
faithfully, the gradient (``is_gradient``, Kaldi's SetAsGradient mode) is exact, and
an update outside gradient mode uses the plain (unpreconditioned) direction.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np

from engine.core.errors import ConfigError, ModelFormatError
from engine.core.xp import array_module
from engine.nnet.components.base import (
    Component,
    ComponentProperty as P,
    UpdatableComponent,
    register_component,
)
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

# --------------------------------------------------------------------------------------
# shared helpers


@contextlib.contextmanager
def config_errors(comp: Component, cfg: ConfigLine):
    """Make every ConfigError raised while initialising ``comp`` name the component."""
    try:
        yield
    except ConfigError as e:
        label = comp.label() if comp.name else comp.type_name
        if label in e.reason:
            raise
        raise ConfigError(f"component {label}: {e.reason}", source=e.source, line=e.line,
                          text=e.text) from None


def _read_kaldi_object(cfg: ConfigLine, option: str, filename: str, what: str) -> np.ndarray:
    """Kaldi's ReadKaldiObject for a matrix or vector file (text or binary)."""
    path = Path(filename)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise cfg.error(f"option {option}={filename!r}: cannot read {what} file: "
                        f"{e.strerror or e}") from None
    reader = KaldiReader(data, source=str(path))
    try:
        arr = reader.read_matrix() if what == "matrix" else reader.read_vector()
    except ModelFormatError as e:
        raise cfg.error(f"option {option}={filename!r}: not a Kaldi {what}: {e}") from None
    return arr


def read_matrix_option(cfg: ConfigLine, option: str, filename: str) -> np.ndarray:
    return _read_kaldi_object(cfg, option, filename, "matrix")


def read_vector_option(cfg: ConfigLine, option: str, filename: str) -> np.ndarray:
    return _read_kaldi_object(cfg, option, filename, "vector")


def init_learning_rates(comp: UpdatableComponent, cfg: ConfigLine) -> None:
    """Kaldi's InitLearningRatesFromConfig, including its check for negative values."""
    comp.init_learning_rate_common(cfg)
    for opt, v in (("learning-rate", comp.learning_rate),
                   ("learning-rate-factor", comp.learning_rate_factor),
                   ("max-change", comp.max_change), ("l2-regularize", comp.l2_regularize)):
        if v < 0.0:
            raise cfg.error(f"option {opt}={v:g} must not be negative")


def require_positive(cfg: ConfigLine, option: str, value: int | None) -> int:
    if value is None:
        raise cfg.error(f"missing required option {option}= (a positive integer)")
    if value <= 0:
        raise cfg.error(f"option {option}={value} must be positive")
    return value


def expect_after_common(reader: KaldiReader, pending: str, expected: str) -> None:
    """Expect ``expected``, which ReadUpdatableCommon may already have consumed (when
    the file had no <LearningRate>, the next token comes back as ``pending``)."""
    if pending:
        if pending != expected:
            raise reader.error(f"expected token {expected!r}, got {pending!r}")
    else:
        reader.expect_token(expected)


def skip_old_is_gradient(comp: UpdatableComponent, reader: KaldiReader) -> None:
    """Old files carried <IsGradient> after the parameters; Kaldi still reads it."""
    if reader.try_token("<IsGradient>"):
        comp.is_gradient = reader.read_bool()


def gaussian(rng: np.random.Generator, shape, stddev: float, mean: float = 0.0) -> np.ndarray:
    return (rng.standard_normal(shape) * stddev + mean).astype(np.float32)


def _g4(x: float) -> str:
    return f"{float(x):.4g}"


def param_stats(name: str, arr, include_mean: bool) -> str:
    """Kaldi's PrintParameterStats (the mean/stddev or rms part)."""
    a = np.asarray(arr, dtype=np.float64)
    if a.size == 0:
        return f", {name}-rms=0"
    if include_mean:
        mean = float(a.mean())
        std = math.sqrt(max(float((a * a).mean()) - mean * mean, 0.0))
        return f", {name}-{{mean,stddev}}={_g4(mean)},{_g4(std)}"
    return f", {name}-rms={_g4(math.sqrt(float((a * a).mean())))}"


def updatable_info(comp: UpdatableComponent) -> str:
    """Kaldi's UpdatableComponent::Info."""
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


def check_rows(comp: Component, in_value, out) -> None:
    comp.check_shape("input", in_value, None, comp.input_dim())
    comp.check_shape("output", out, in_value.shape[0], comp.output_dim())


def check_backprop_shapes(comp: Component, out_deriv, in_deriv, in_value=None) -> None:
    comp.check_shape("output derivative", out_deriv, None, comp.output_dim())
    rows = out_deriv.shape[0]
    if in_deriv is not None:
        comp.check_shape("input derivative", in_deriv, rows, comp.input_dim())
    if in_value is not None:
        comp.check_shape("input value", in_value, rows, comp.input_dim())


# --------------------------------------------------------------------------------------
# AffineComponent and NaturalGradientAffineComponent


def _rank_default(rank: int, dim: int, cap: int) -> int:
    return rank if rank >= 0 else min(cap, (dim + 1) // 2)


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
        return (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                | P.BACKPROP_ADDS)

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
        return (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                | P.PROPAGATE_ADDS | P.BACKPROP_ADDS)

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
        return P.SIMPLE_COMPONENT | P.BACKPROP_ADDS

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


# --------------------------------------------------------------------------------------
# BlockAffineComponent


@register_component
class BlockAffineComponent(UpdatableComponent):
    """Block-diagonal affine transform: num-blocks independent affine maps, block b
    taking input columns [b*in/nb, (b+1)*in/nb) to output columns [b*out/nb, ...)."""

    type_name = "BlockAffineComponent"
    PARAMS = ("linear_params", "bias_params")

    def __init__(self) -> None:
        super().__init__()
        self.linear_params = np.zeros((0, 0), np.float32)  # (output_dim, input_dim / nb)
        self.bias_params = np.zeros(0, np.float32)
        self.num_blocks = 1

    def properties(self) -> P:
        return (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                | P.BACKPROP_ADDS)

    def input_dim(self) -> int:
        return int(self.linear_params.shape[1]) * self.num_blocks

    def output_dim(self) -> int:
        return int(self.linear_params.shape[0])

    def info(self) -> str:
        return (updatable_info(self) + f", num-blocks={self.num_blocks}"
                + param_stats("linear-params", self.linear_params, False)
                + param_stats("bias", self.bias_params, True))

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            input_dim = require_positive(cfg, "input-dim", cfg.get_int("input-dim"))
            output_dim = require_positive(cfg, "output-dim", cfg.get_int("output-dim"))
            nb = require_positive(cfg, "num-blocks", cfg.get_int("num-blocks"))
            init_learning_rates(self, cfg)
            if input_dim % nb or output_dim % nb:
                raise cfg.error(f"option num-blocks={nb} must divide input-dim={input_dim} "
                                f"and output-dim={output_dim}")
            param_stddev = cfg.get_float("param-stddev", 1.0 / math.sqrt(input_dim // nb))
            bias_stddev = cfg.get_float("bias-stddev", 1.0)
            bias_mean = cfg.get_float("bias-mean", 0.0)
            if param_stddev < 0.0 or bias_stddev < 0.0:
                raise cfg.error("options param-stddev and bias-stddev must not be negative")
            self.num_blocks = nb
            self.linear_params = gaussian(rng, (output_dim, input_dim // nb), param_stddev)
            self.bias_params = gaussian(rng, (output_dim,), bias_stddev, bias_mean)

    @classmethod
    def read(cls, reader: KaldiReader) -> "BlockAffineComponent":
        c = cls()
        pending = c.read_updatable_common(reader)
        expect_after_common(reader, pending, "<NumBlocks>")
        c.num_blocks = reader.read_int()
        reader.expect_token("<LinearParams>")
        c.linear_params = reader.read_matrix()
        reader.expect_token("<BiasParams>")
        c.bias_params = reader.read_vector()
        skip_old_is_gradient(c, reader)
        reader.expect_token("</BlockAffineComponent>")
        if c.num_blocks <= 0 or c.linear_params.shape[0] % c.num_blocks:
            raise reader.error(f"BlockAffineComponent: <NumBlocks> {c.num_blocks} does not "
                               f"divide the output dimension {c.linear_params.shape[0]}")
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<NumBlocks>")
        writer.write_int(self.num_blocks)
        writer.write_token("<LinearParams>")
        writer.write_matrix(self.linear_params)
        writer.write_token("<BiasParams>")
        writer.write_vector(self.bias_params)
        writer.write_token("</BlockAffineComponent>")

    def _blocks(self, linear):
        nb = self.num_blocks
        return linear.reshape(nb, linear.shape[0] // nb, linear.shape[1])  # (nb, rout, cin)

    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        n, nb = in_value.shape[0], self.num_blocks
        x = in_value.reshape(n, nb, -1).transpose(1, 0, 2)  # (nb, n, cin)
        w = self._blocks(self.linear_params)
        y = (x @ w.transpose(0, 2, 1)).transpose(1, 0, 2).reshape(n, -1)
        out[...] = y
        out += self.bias_params
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        check_backprop_shapes(self, out_deriv, in_deriv)
        n, nb = out_deriv.shape[0], self.num_blocks
        dy = out_deriv.reshape(n, nb, -1).transpose(1, 0, 2)  # (nb, n, rout)
        if in_deriv is not None:
            dx = dy @ self._blocks(self.linear_params)  # (nb, n, cin)
            in_deriv += dx.transpose(1, 0, 2).reshape(n, -1)
        if to_update is not None:
            self.check_shape("input value", in_value, n, self.input_dim())
            x = in_value.reshape(n, nb, -1).transpose(1, 0, 2)
            grad = (dy.transpose(0, 2, 1) @ x).reshape(self.linear_params.shape)
            lr = to_update.learning_rate
            to_update.linear_params += lr * grad
            to_update.bias_params += lr * out_deriv.sum(axis=0)


# --------------------------------------------------------------------------------------
# RepeatedAffineComponent and NaturalGradientRepeatedAffineComponent


@register_component
class RepeatedAffineComponent(UpdatableComponent):
    """One small affine map applied to num-repeats consecutive blocks of the input
    (the same parameters for every block)."""

    type_name = "RepeatedAffineComponent"
    PARAMS = ("linear_params", "bias_params")

    def __init__(self) -> None:
        super().__init__()
        self.linear_params = np.zeros((0, 0), np.float32)  # (out/nr, in/nr)
        self.bias_params = np.zeros(0, np.float32)
        self.num_repeats = 1

    def properties(self) -> P:
        return (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                | P.BACKPROP_ADDS | P.INPUT_CONTIGUOUS | P.OUTPUT_CONTIGUOUS)

    def input_dim(self) -> int:
        return int(self.linear_params.shape[1]) * self.num_repeats

    def output_dim(self) -> int:
        return int(self.linear_params.shape[0]) * self.num_repeats

    def info(self) -> str:
        return (updatable_info(self) + f", num-repeats={self.num_repeats}"
                + param_stats("linear-params", self.linear_params, False)
                + param_stats("bias", self.bias_params, True))

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            init_learning_rates(self, cfg)
            nr = require_positive(cfg, "num-repeats", cfg.get_int("num-repeats"))
            input_dim = require_positive(cfg, "input-dim", cfg.get_int("input-dim"))
            output_dim = require_positive(cfg, "output-dim", cfg.get_int("output-dim"))
            if input_dim % nr or output_dim % nr:
                raise cfg.error(f"option num-repeats={nr} must divide input-dim={input_dim} "
                                f"and output-dim={output_dim}")
            param_stddev = cfg.get_float("param-stddev", 1.0 / math.sqrt(input_dim // nr))
            bias_mean = cfg.get_float("bias-mean", 0.0)
            bias_stddev = cfg.get_float("bias-stddev", 0.0)
            if param_stddev < 0.0:
                raise cfg.error(f"option param-stddev={param_stddev:g} must not be negative")
            self.num_repeats = nr
            self.linear_params = gaussian(rng, (output_dim // nr, input_dim // nr), param_stddev)
            self.bias_params = gaussian(rng, (output_dim // nr,), bias_stddev, bias_mean)

    @classmethod
    def read(cls, reader: KaldiReader) -> "RepeatedAffineComponent":
        c = cls()
        pending = c.read_updatable_common(reader)
        expect_after_common(reader, pending, "<NumRepeats>")
        c.num_repeats = reader.read_int()
        reader.expect_token("<LinearParams>")
        c.linear_params = reader.read_matrix()
        reader.expect_token("<BiasParams>")
        c.bias_params = reader.read_vector()
        skip_old_is_gradient(c, reader)
        reader.expect_token(f"</{cls.type_name}>")
        if c.num_repeats <= 0:
            raise reader.error(f"{cls.type_name}: <NumRepeats> must be positive")
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<NumRepeats>")
        writer.write_int(self.num_repeats)
        writer.write_token("<LinearParams>")
        writer.write_matrix(self.linear_params)
        writer.write_token("<BiasParams>")
        writer.write_vector(self.bias_params)
        writer.write_token(f"</{self.type_name}>")

    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        x = in_value.reshape(-1, self.linear_params.shape[1])  # (n * nr, cin)
        y = x @ self.linear_params.T
        y += self.bias_params
        out[...] = y.reshape(out.shape)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        check_backprop_shapes(self, out_deriv, in_deriv)
        dy = out_deriv.reshape(-1, self.linear_params.shape[0])  # (n * nr, rout)
        if in_deriv is not None:
            in_deriv += (dy @ self.linear_params).reshape(in_deriv.shape)
        if to_update is not None:
            self.check_shape("input value", in_value, out_deriv.shape[0], self.input_dim())
            x = in_value.reshape(-1, self.linear_params.shape[1])
            lr = to_update.learning_rate
            to_update.linear_params += lr * (dy.T @ x)
            to_update.bias_params += lr * dy.sum(axis=0)


@register_component
class NaturalGradientRepeatedAffineComponent(RepeatedAffineComponent):
    """RepeatedAffineComponent with a natural-gradient update (fixed preconditioner
    settings in Kaldi: rank min(40, in/nr/2), update period 4; nothing extra on disk)."""

    type_name = "NaturalGradientRepeatedAffineComponent"
