"""Constant-output components: ConstantFunctionComponent (Kaldi's
nnet-simple-component.{h,cc}; a simple component that ignores its input) and
ConstantComponent (nnet-general-component.{h,cc}; a non-simple component whose
outputs depend on no input Index at all).  Both are optionally trainable
(is-updatable) and keep their natural-gradient flag; see affine.py for how natural
gradient is handled.
"""

from __future__ import annotations

import numpy as np

from engine.nnet.components._fields import (
    BOOL,
    FLOAT,
    VECTOR,
    read_fields,
    read_optional_fields,
    write_fields,
)
from engine.nnet.components._param_utils import (
    check_backprop_shapes,
    check_rows,
    config_errors,
    gaussian,
    init_learning_rates,
    param_stats,
    require_positive,
    updatable_info,
)
from engine.nnet.components.base import (
    ComponentProperty as P,
    UpdatableComponent,
    register_component,
)
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter


# --------------------------------------------------------------------------------------
# ConstantFunctionComponent and ConstantComponent


class _ConstantBase(UpdatableComponent):
    """Shared parts: the output vector, optionally trainable (is-updatable)."""

    PARAMS = ("output",)
    # the optional header fields (see _read_header), and the fields that end the file
    # (after ConstantFunctionComponent's <InputDim>)
    _HEADER_FIELDS = (("<LearningRateFactor>", "learning_rate_factor", FLOAT),
                      ("<IsGradient>", "is_gradient", BOOL), ("<MaxChange>", "max_change", FLOAT),
                      ("<LearningRate>", "learning_rate", FLOAT))
    _TAIL_FIELDS = (("<Output>", "output", VECTOR), ("<IsUpdatable>", "is_updatable_flag", BOOL),
                    ("<UseNaturalGradient>", "use_natural_gradient", BOOL))

    def __init__(self) -> None:
        super().__init__()
        self.output = np.zeros(0, np.float32)
        self.is_updatable_flag = True
        self.use_natural_gradient = True

    def _sync_param_lists(self) -> None:
        # A non-updatable constant has no trainable parameters: Kaldi's Scale/Add
        # leave it alone, so it must not be zeroed by set_as_gradient either.
        if self.is_updatable_flag:
            self.PARAMS, self.ARRAYS = ("output",), ()
        else:
            self.PARAMS, self.ARRAYS = (), ("output",)

    def output_dim(self) -> int:
        return int(self.output.shape[0])

    def info(self) -> str:
        return (updatable_info(self) + f", {self.type_name}"
                + self._dims_info()
                + f", is-updatable={'true' if self.is_updatable_flag else 'false'}"
                + f", use-natural-gradient={'true' if self.use_natural_gradient else 'false'}"
                + param_stats("output", self.output, True))

    def _init_output(self, cfg: ConfigLine, rng, output_dim: int) -> None:
        self.is_updatable_flag = cfg.get_bool("is-updatable", True)
        self.use_natural_gradient = cfg.get_bool("use-natural-gradient", True)
        mean = cfg.get_float("output-mean", 0.0)
        stddev = cfg.get_float("output-stddev", 0.0)
        self.output = gaussian(rng, (output_dim,), stddev, mean)
        self._sync_param_lists()

    def _read_header(self, reader: KaldiReader, with_max_change: bool) -> str:
        """Kaldi's own header reader for these two types (no <L2Regularize>;
        ConstantFunctionComponent has no <MaxChange> either)."""
        tok = reader.read_token()
        if tok == f"<{self.type_name}>":
            tok = reader.read_token()
        self.learning_rate_factor, self.is_gradient = 1.0, False
        self.max_change, self.learning_rate = 0.0, 0.001
        fields = [f for f in self._HEADER_FIELDS if with_max_change or f[0] != "<MaxChange>"]
        return read_optional_fields(reader, self, fields, tok)

    def _read_tail(self, reader: KaldiReader) -> None:
        """The tail fields (their first token already read) and ``</Type>``."""
        self.output = reader.read_vector()
        read_fields(reader, self, self._TAIL_FIELDS[1:])
        reader.expect_token(f"</{self.type_name}>")
        self._sync_param_lists()

    def _write_tail(self, writer: KaldiWriter) -> None:
        write_fields(writer, self, self._TAIL_FIELDS)
        writer.write_token(f"</{self.type_name}>")

    def propagate(self, indexes, in_value, out):
        self.check_shape("output", out, None, self.output_dim())
        out[...] = self.output
        return None

    def _update(self, out_deriv, to_update) -> None:
        if to_update is not None and to_update.is_updatable_flag:
            to_update.output += to_update.learning_rate * out_deriv.sum(axis=0)


@register_component
class ConstantFunctionComponent(_ConstantBase):
    """Outputs a constant vector whatever its input (input-dim, output-dim,
    is-updatable, use-natural-gradient, output-mean, output-stddev)."""

    type_name = "ConstantFunctionComponent"

    def __init__(self) -> None:
        super().__init__()
        self.input_dim_ = 0

    def properties(self) -> P:
        p = P.SIMPLE_COMPONENT | P.BACKPROP_ADDS
        if self.is_updatable_flag:
            p |= P.UPDATABLE_COMPONENT
        if self.input_dim() == self.output_dim():
            p |= P.PROPAGATE_IN_PLACE
        return p

    def input_dim(self) -> int:
        return self.input_dim_

    def _dims_info(self) -> str:
        return f", input-dim={self.input_dim()}, output-dim={self.output_dim()}"

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            init_learning_rates(self, cfg)
            output_dim = require_positive(cfg, "output-dim", cfg.get_int("output-dim"))
            self.input_dim_ = require_positive(cfg, "input-dim", cfg.get_int("input-dim"))
            self._init_output(cfg, rng, output_dim)

    @classmethod
    def read(cls, reader: KaldiReader) -> "ConstantFunctionComponent":
        c = cls()
        tok = c._read_header(reader, with_max_change=False)
        if tok != "<InputDim>":
            raise reader.error(f"expected token <InputDim>, got {tok!r}")
        c.input_dim_ = reader.read_int()
        reader.expect_token("<Output>")
        c._read_tail(reader)
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<InputDim>")
        writer.write_int(self.input_dim_)
        self._write_tail(writer)

    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        return super().propagate(indexes, in_value, out)

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        # BACKPROP_ADDS and the output does not depend on the input: in_deriv is
        # left untouched.
        check_backprop_shapes(self, out_deriv, in_deriv)
        self._update(out_deriv, to_update)


@register_component
class ConstantComponent(_ConstantBase):
    """Like ConstantFunctionComponent but with no input at all: a non-simple
    component whose output Indexes depend on no input Indexes (output-dim,
    is-updatable, use-natural-gradient, output-mean, output-stddev)."""

    type_name = "ConstantComponent"

    def properties(self) -> P:
        return P.UPDATABLE_COMPONENT if self.is_updatable_flag else P.NONE

    def input_dim(self) -> int:
        # Kaldi: a don't-care, reported as the output dimension.
        return self.output_dim()

    def _dims_info(self) -> str:
        return f", output-dim={self.output_dim()}"

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            init_learning_rates(self, cfg)
            output_dim = require_positive(cfg, "output-dim", cfg.get_int("output-dim"))
            self._init_output(cfg, rng, output_dim)

    @classmethod
    def read(cls, reader: KaldiReader) -> "ConstantComponent":
        c = cls()
        tok = c._read_header(reader, with_max_change=True)
        if tok != "<Output>":
            raise reader.error(f"expected token <Output>, got {tok!r}")
        c._read_tail(reader)
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        self._write_tail(writer)

    def get_input_indexes(self, misc_info, output_index):
        return []

    def input_offsets(self) -> list[tuple[int, int, int]]:
        """get_input_indexes as fixed shifts of the output Index: none (the compiler's
        graph builders then take every output Index as computable at once)."""
        return []

    def is_computable(self, misc_info, output_index, input_index_set, used_inputs) -> bool:
        if used_inputs is not None:
            used_inputs.clear()
        return True

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        self.check_shape("output derivative", out_deriv, None, self.output_dim())
        # No BACKPROP_ADDS: the (input-independent) derivative is written as zero.
        if in_deriv is not None and in_deriv.size:
            in_deriv[...] = 0
        self._update(out_deriv, to_update)
