"""Per-element scale/offset components (Kaldi's nnet-simple-component.{h,cc}):
PerElementScaleComponent, NaturalGradientPerElementScaleComponent,
PerElementOffsetComponent, ScaleAndOffsetComponent, FixedScaleComponent,
FixedBiasComponent (constant.py has the constant-output components).

Components with a ``block-dim`` (PerElementOffset, ScaleAndOffset) keep parameters of
the block dimension and apply them to each block of consecutive columns, which is
Kaldi's reshaping of a contiguous (rows, dim) matrix into (rows * dim/block, block).
As in affine.py, natural-gradient preconditioning (a training optimizer) is not
implemented: gradients are exact and other updates use the plain direction.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from engine.core.xp import array_module
from engine.nnet.components._fields import BOOL, INT, VECTOR, read_fields
from engine.nnet.components._param_utils import (
    PERIOD_HISTORY_ALPHA,
    check_backprop_shapes,
    check_rows,
    config_errors,
    gaussian,
    init_learning_rates,
    param_stats,
    UpdatableFieldsComponent,
    read_updatable_fields,
    read_vector_option,
    require_positive,
    skip_old_is_gradient,
    updatable_info,
)
from engine.nnet.components.base import (
    Component,
    ComponentProperty as P,
    register_component,
)
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter


def _copy_unless_same(dst, src) -> None:
    """Kaldi's CopyFromMat, a no-op when the operation runs in place."""
    if dst is not src:
        dst[...] = src


def _min_max_info(name: str, arr) -> str:
    """The ", NAME-min=..., NAME-max=..." part of info() (nothing for an empty array)."""
    if not arr.size:
        return ""
    return f", {name}-min={float(arr.min()):g}, {name}-max={float(arr.max()):g}"


def _block_rows(mat, block: int):
    """The (rows * dim/block, block) view of a (rows, dim) matrix (a copy if needed)."""
    return mat.reshape(-1, block)


# --------------------------------------------------------------------------------------
# PerElementScaleComponent / NaturalGradientPerElementScaleComponent


_PER_ELEMENT_SCALE_PROPS = (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                            | P.PROPAGATE_IN_PLACE | P.BACKPROP_IN_PLACE)


@register_component
class PerElementScaleComponent(UpdatableFieldsComponent):
    """y = x * scales (column-wise); dim with param-mean (1.0) / param-stddev (0.0), or
    vector=FILE."""

    type_name = "PerElementScaleComponent"
    PARAMS = ("scales",)
    _FIELDS = (("<Params>", "scales", VECTOR),)

    def __init__(self) -> None:
        super().__init__()
        self.scales = np.zeros(0, np.float32)

    def properties(self) -> P:
        return _PER_ELEMENT_SCALE_PROPS

    def input_dim(self) -> int:
        return int(self.scales.shape[0])

    output_dim = input_dim

    def info(self) -> str:
        return (updatable_info(self) + _min_max_info("scales", self.scales)
                + param_stats("scales", self.scales, True))

    def _init_scales(self, cfg: ConfigLine, rng, file_option: str) -> None:
        filename = cfg.get_str(file_option)
        if filename is not None:
            self.scales = read_vector_option(cfg, file_option, filename)
            if file_option == "vector":
                dim = cfg.get_int("dim")
                if dim is not None and dim != self.scales.shape[0]:
                    raise cfg.error(f"option dim={dim} does not match the vector in "
                                    f"{filename!r} (dimension {self.scales.shape[0]})")
            return
        mean = cfg.get_float("param-mean", 1.0)
        stddev = cfg.get_float("param-stddev", 0.0)
        dim = require_positive(cfg, "dim", cfg.get_int("dim"))
        if stddev < 0.0:
            raise cfg.error(f"option param-stddev={stddev:g} must not be negative")
        self.scales = gaussian(rng, (dim,), stddev, mean)

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            init_learning_rates(self, cfg)
            self._init_scales(cfg, rng, "vector")

    @classmethod
    def read(cls, reader: KaldiReader) -> "PerElementScaleComponent":
        c = read_updatable_fields(cls, reader, cls._FIELDS)
        skip_old_is_gradient(c, reader)
        reader.expect_token("</PerElementScaleComponent>")
        return c

    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        _copy_unless_same(out, in_value)
        out *= self.scales
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        check_backprop_shapes(self, out_deriv, in_deriv)
        # The update comes first: in_deriv may share memory with out_deriv.
        if to_update is not None:
            self.check_shape("input value", in_value, out_deriv.shape[0], self.input_dim())
            to_update.scales += to_update.learning_rate * (out_deriv * in_value).sum(axis=0)
        if in_deriv is not None:
            _copy_unless_same(in_deriv, out_deriv)
            in_deriv *= self.scales


@register_component
class NaturalGradientPerElementScaleComponent(PerElementScaleComponent):
    """PerElementScaleComponent with natural-gradient options rank (8),
    update-period (10), num-samples-history (2000), alpha (4); scales=FILE."""

    type_name = "NaturalGradientPerElementScaleComponent"
    # Kaldi writes <IsGradient> here unconditionally (besides the common header).
    _FIELDS = (PerElementScaleComponent._FIELDS
               + (("<IsGradient>", "is_gradient", BOOL), ("<Rank>", "rank", INT))
               + PERIOD_HISTORY_ALPHA)

    def __init__(self) -> None:
        super().__init__()
        self.rank = 8
        self.update_period = 10
        self.num_samples_history = 2000.0
        self.alpha = 4.0

    def info(self) -> str:
        return (super().info() + f", rank={self.rank}, update-period={self.update_period}, "
                f"num-samples-history={self.num_samples_history:g}, alpha={self.alpha:g}")

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            self.rank = cfg.get_int("rank", 8)
            self.update_period = cfg.get_int("update-period", 10)
            self.num_samples_history = cfg.get_float("num-samples-history", 2000.0)
            self.alpha = cfg.get_float("alpha", 4.0)
            init_learning_rates(self, cfg)
            self._init_scales(cfg, rng, "scales")

    @classmethod
    def read(cls, reader: KaldiReader) -> "NaturalGradientPerElementScaleComponent":
        c = read_updatable_fields(cls, reader, cls._FIELDS)
        if reader.try_token("<MaxChangePerMinibatch>"):  # removed option, old files
            reader.read_float()
        reader.expect_token("</NaturalGradientPerElementScaleComponent>")
        return c


# --------------------------------------------------------------------------------------
# PerElementOffsetComponent


@register_component
class PerElementOffsetComponent(UpdatableFieldsComponent):
    """y = x + offsets, the offsets (of dimension block-dim) repeated over each block of
    the dim columns; options dim, block-dim, param-mean (0), param-stddev (0),
    use-natural-gradient, or vector=FILE."""

    type_name = "PerElementOffsetComponent"
    PARAMS = ("offsets",)
    # old files lack <Dim> and <UseNaturalGradient>
    _FIELDS = (("<Offsets>", "offsets", VECTOR), ("<Dim>", "dim", INT),
               ("<UseNaturalGradient>", "use_natural_gradient", BOOL))

    def __init__(self) -> None:
        super().__init__()
        self.offsets = np.zeros(0, np.float32)
        self.dim = 0
        self.use_natural_gradient = True

    def properties(self) -> P:
        p = (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_IN_PLACE
             | P.PROPAGATE_IN_PLACE)
        if self.dim != self.offsets.shape[0]:
            p |= P.OUTPUT_CONTIGUOUS
        return p

    def input_dim(self) -> int:
        return self.dim

    output_dim = input_dim

    def info(self) -> str:
        s = updatable_info(self) + _min_max_info("offsets", self.offsets)
        s += (f", block-dim={self.offsets.shape[0]}, use-natural-gradient="
              f"{'true' if self.use_natural_gradient else 'false'}")
        return s + param_stats("offsets", self.offsets, True)

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            init_learning_rates(self, cfg)
            filename = cfg.get_str("vector")
            if filename is not None:
                self.offsets = read_vector_option(cfg, "vector", filename)
                self.dim = cfg.get_int("dim", self.offsets.shape[0])
                # Kaldi checks the divisibility the other way round, which lets through
                # dims its propagation cannot use; here dim must be a multiple of the
                # vector's dimension (the block dimension), as in the block-dim form.
                block = self.offsets.shape[0]
                if block == 0 or self.dim <= 0 or self.dim % block != 0:
                    raise cfg.error(f"invalid dimension dim={self.dim} for the vector in "
                                    f"{filename!r} (dim must be a positive multiple of the "
                                    f"vector's dimension {block})")
            else:
                self.dim = require_positive(cfg, "dim", cfg.get_int("dim"))
                mean = cfg.get_float("param-mean", 0.0)
                stddev = cfg.get_float("param-stddev", 0.0)
                block = cfg.get_int("block-dim", self.dim)
                if block <= 0 or self.dim % block != 0:
                    raise cfg.error(f"invalid value block-dim={block} (must be positive "
                                    f"and divide dim={self.dim})")
                self.offsets = gaussian(rng, (block,), stddev, mean)
            self.use_natural_gradient = cfg.get_bool("use-natural-gradient", True)

    @classmethod
    def read(cls, reader: KaldiReader) -> "PerElementOffsetComponent":
        c = read_updatable_fields(cls, reader, cls._FIELDS[:1])
        skip_old_is_gradient(c, reader)
        # (the first newer field's token is tried here, to tell old files)
        if reader.try_token("<Dim>"):
            c.dim = reader.read_int()
            read_fields(reader, c, cls._FIELDS[2:])
        else:
            c.dim = int(c.offsets.shape[0])
            c.use_natural_gradient = True
        reader.expect_token("</PerElementOffsetComponent>")
        block = c.offsets.shape[0]
        if block == 0 or c.dim % block != 0:
            raise reader.error(f"PerElementOffsetComponent: <Dim> {c.dim} is not a multiple "
                               f"of the offsets dimension {block}")
        return c

    def _tiled(self, xp, arr):
        reps = self.dim // arr.shape[0]
        return arr if reps == 1 else xp.tile(arr, reps)

    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        _copy_unless_same(out, in_value)
        out += self._tiled(array_module(out), self.offsets)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        check_backprop_shapes(self, out_deriv, in_deriv)
        if in_deriv is not None:
            _copy_unless_same(in_deriv, out_deriv)
        if to_update is not None:
            block = self.offsets.shape[0]
            to_update.offsets += (to_update.learning_rate
                                  * _block_rows(out_deriv, block).sum(axis=0))


# --------------------------------------------------------------------------------------
# ScaleAndOffsetComponent


@register_component
class ScaleAndOffsetComponent(UpdatableFieldsComponent):
    """y = x * scales + offsets per block of block-dim columns; scales start at 1,
    offsets at 0.  Backprop reconstructs the input from the output (it needs the
    output, not the input), with scales kept away from zero by 1e-4 in propagation."""

    type_name = "ScaleAndOffsetComponent"
    PARAMS = ("scales", "offsets")
    EPSILON = 1.0e-04
    _FIELDS = (("<Dim>", "dim", INT), ("<Scales>", "scales", VECTOR),
               ("<Offsets>", "offsets", VECTOR),
               ("<UseNaturalGradient>", "use_natural_gradient", BOOL), ("<Rank>", "rank", INT))

    def __init__(self) -> None:
        super().__init__()
        self.dim = 0
        self.scales = np.zeros(0, np.float32)
        self.offsets = np.zeros(0, np.float32)
        self.use_natural_gradient = True
        self.rank = 20

    def properties(self) -> P:
        p = (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_IN_PLACE
             | P.PROPAGATE_IN_PLACE | P.BACKPROP_NEEDS_OUTPUT)
        if self.dim != self.scales.shape[0]:
            p |= P.INPUT_CONTIGUOUS | P.OUTPUT_CONTIGUOUS
        return p

    def input_dim(self) -> int:
        return self.dim

    output_dim = input_dim

    def info(self) -> str:
        s = updatable_info(self) + f", rank={self.rank}"
        if self.dim != self.scales.shape[0]:
            s += f", block-size={self.scales.shape[0]}"
        return (s + param_stats("scales", self.scales, True)
                + param_stats("offsets", self.offsets, True))

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            init_learning_rates(self, cfg)
            self.dim = require_positive(cfg, "dim", cfg.get_int("dim"))
            self.use_natural_gradient = cfg.get_bool("use-natural-gradient", True)
            block = cfg.get_int("block-dim", self.dim)
            if block <= 0 or self.dim % block != 0:
                raise cfg.error(f"invalid block-dim={block} (must be positive and divide "
                                f"dim={self.dim})")
            self.rank = cfg.get_int("rank", 20)
            self.scales = np.ones(block, np.float32)
            self.offsets = np.zeros(block, np.float32)

    @classmethod
    def read(cls, reader: KaldiReader) -> "ScaleAndOffsetComponent":
        c = read_updatable_fields(cls, reader, cls._FIELDS)
        reader.expect_token("</ScaleAndOffsetComponent>")
        block = c.scales.shape[0]
        if block == 0 or c.offsets.shape[0] != block or c.dim % block != 0:
            raise reader.error(f"ScaleAndOffsetComponent: <Dim> {c.dim}, scales "
                               f"{block} and offsets {c.offsets.shape[0]} do not agree")
        return c

    def _nonzero_scales(self, xp):
        # Kaldi's cu::EnsureNonzero: |s| < eps becomes +eps (s >= 0) or -eps.
        s, eps = self.scales, self.EPSILON
        small = (s > -eps) & (s < eps)
        return xp.where(small, xp.where(s >= 0, eps, -eps).astype(s.dtype), s)

    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        xp = array_module(out)
        x = _block_rows(in_value, self.scales.shape[0])
        # computed into a temporary first, so that out may alias in_value
        out[...] = (x * self._nonzero_scales(xp) + self.offsets).reshape(out.shape)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        check_backprop_shapes(self, out_deriv, in_deriv)
        xp = array_module(out_deriv)
        block = self.scales.shape[0]
        dy = _block_rows(out_deriv, block)
        if to_update is not None:
            self.check_shape("output value", out_value, out_deriv.shape[0], self.output_dim())
            lr = to_update.learning_rate
            to_update.offsets += lr * dy.sum(axis=0)
            # the input, reconstructed from the output with this component's parameters
            x = (_block_rows(out_value, block) - self.offsets) / self._nonzero_scales(xp)
            to_update.scales += lr * (x * dy).sum(axis=0)
        if in_deriv is not None:
            # Kaldi multiplies by the raw scales here (not the nonzero version).
            in_deriv[...] = (dy * self.scales).reshape(in_deriv.shape)


# --------------------------------------------------------------------------------------
# FixedScaleComponent and FixedBiasComponent


class _FixedVectorComponent(Component):
    """A fixed vector applied to every row, in place (FixedScaleComponent,
    FixedBiasComponent).  ``ARRAYS[0]`` names the vector's attribute, its config option
    (a vector file) and its info() summary; ``VECTOR_TOKEN`` its token on disk."""

    VECTOR_TOKEN: ClassVar[str] = ""

    def __init__(self) -> None:
        super().__init__()
        setattr(self, self.ARRAYS[0], np.zeros(0, np.float32))

    def properties(self) -> P:
        return P.SIMPLE_COMPONENT | P.PROPAGATE_IN_PLACE | P.BACKPROP_IN_PLACE

    def input_dim(self) -> int:
        return int(getattr(self, self.ARRAYS[0]).shape[0])

    output_dim = input_dim

    def info(self) -> str:
        name = self.ARRAYS[0]
        return super().info() + param_stats(name, getattr(self, name), True)

    def _vector_from_config(self, cfg: ConfigLine, rng: np.random.Generator):
        """The vector when no file is given: option dim, random values."""
        dim = require_positive(cfg, "dim", cfg.get_int("dim"))
        return gaussian(rng, (dim,), 1.0)

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        with config_errors(self, cfg):
            name = self.ARRAYS[0]
            filename = cfg.get_str(name)
            if filename is not None:
                vector = read_vector_option(cfg, name, filename)
                setattr(self, name, vector)
                if vector.shape[0] == 0:
                    raise cfg.error(f"option {name}={filename!r}: the vector is empty")
                return
            setattr(self, name, self._vector_from_config(cfg, rng))

    @classmethod
    def read(cls, reader: KaldiReader) -> "_FixedVectorComponent":
        c = cls()
        reader.try_token(f"<{cls.type_name}>")
        reader.expect_token(cls.VECTOR_TOKEN)
        setattr(c, cls.ARRAYS[0], reader.read_vector())
        reader.expect_token(f"</{cls.type_name}>")
        return c

    def write(self, writer: KaldiWriter) -> None:
        writer.write_token(f"<{self.type_name}>")
        writer.write_token(self.VECTOR_TOKEN)
        writer.write_vector(getattr(self, self.ARRAYS[0]))
        writer.write_token(f"</{self.type_name}>")

    def _apply(self, mat) -> None:
        """Apply the vector to ``mat`` in place (propagation)."""
        raise NotImplementedError

    def _apply_to_deriv(self, deriv) -> None:
        """Turn the output derivative into the input derivative, in place."""
        raise NotImplementedError

    def propagate(self, indexes, in_value, out):
        check_rows(self, in_value, out)
        _copy_unless_same(out, in_value)
        self._apply(out)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        check_backprop_shapes(self, out_deriv, in_deriv)
        if in_deriv is not None:
            _copy_unless_same(in_deriv, out_deriv)
            self._apply_to_deriv(in_deriv)


@register_component
class FixedScaleComponent(_FixedVectorComponent):
    """y = x * scales, fixed: scales=FILE, or dim with scale=S (all S) or random."""

    type_name = "FixedScaleComponent"
    ARRAYS = ("scales",)
    VECTOR_TOKEN = "<Scales>"

    def _vector_from_config(self, cfg: ConfigLine, rng: np.random.Generator):
        scale = cfg.get_float("scale")
        if scale is None:
            return super()._vector_from_config(cfg, rng)
        return np.full(require_positive(cfg, "dim", cfg.get_int("dim")), scale, np.float32)

    def _apply(self, mat) -> None:
        mat *= self.scales

    _apply_to_deriv = _apply  # the derivative of x * scales is scaled the same way


@register_component
class FixedBiasComponent(_FixedVectorComponent):
    """y = x + bias, fixed: bias=FILE, or dim with a random bias."""

    type_name = "FixedBiasComponent"
    ARRAYS = ("bias",)
    VECTOR_TOKEN = "<Bias>"

    def _apply(self, mat) -> None:
        mat += self.bias

    def _apply_to_deriv(self, deriv) -> None:
        pass  # the derivative of x + bias is the identity
