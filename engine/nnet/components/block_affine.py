"""Block-diagonal and repeated affine components (Kaldi's nnet-simple-component.{h,cc}):
BlockAffineComponent, RepeatedAffineComponent, NaturalGradientRepeatedAffineComponent.

Both view a (rows, dim) matrix as blocks of consecutive columns and run all blocks
in one batched matrix product; see affine.py for how natural gradient is handled.
"""

from __future__ import annotations

import math

import numpy as np

from engine.nnet.components._param_utils import (
    begin_updatable_read,
    check_backprop_shapes,
    check_linear_and_bias,
    check_rows,
    config_errors,
    gaussian,
    init_learning_rates,
    linear_and_bias_stats,
    read_linear_and_bias,
    require_positive,
    skip_old_is_gradient,
    updatable_info,
    write_linear_and_bias,
)
from engine.nnet.components.base import (
    ComponentProperty as P,
    UpdatableComponent,
    register_component,
)
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

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
                + linear_and_bias_stats(self))

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
        c = begin_updatable_read(cls, reader, "<NumBlocks>")
        c.num_blocks = reader.read_int()
        c.linear_params, c.bias_params = read_linear_and_bias(reader)
        skip_old_is_gradient(c, reader)
        reader.expect_token("</BlockAffineComponent>")
        if c.num_blocks <= 0 or c.linear_params.shape[0] % c.num_blocks:
            raise reader.error(f"BlockAffineComponent: <NumBlocks> {c.num_blocks} does not "
                               f"divide the output dimension {c.linear_params.shape[0]}")
        check_linear_and_bias(reader, "BlockAffineComponent", c.linear_params, c.bias_params)
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<NumBlocks>")
        writer.write_int(self.num_blocks)
        write_linear_and_bias(writer, self.linear_params, self.bias_params)
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
                + linear_and_bias_stats(self))

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
        c = begin_updatable_read(cls, reader, "<NumRepeats>")
        c.num_repeats = reader.read_int()
        c.linear_params, c.bias_params = read_linear_and_bias(reader)
        skip_old_is_gradient(c, reader)
        reader.expect_token(f"</{cls.type_name}>")
        if c.num_repeats <= 0:
            raise reader.error(f"{cls.type_name}: <NumRepeats> must be positive")
        check_linear_and_bias(reader, cls.type_name, c.linear_params, c.bias_params)
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<NumRepeats>")
        writer.write_int(self.num_repeats)
        write_linear_and_bias(writer, self.linear_params, self.bias_params)
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
