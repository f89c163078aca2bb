"""Fixed (parameter-free) column maps and gradient controls from Kaldi's
nnet-simple-component.{h,cc} and nnet-general-component.{h,cc}:
PnormComponent, SumGroupComponent, SumBlockComponent, PermuteComponent,
ElementwiseProductComponent and NoOpComponent (ClipGradientComponent and
BackpropTruncationComponent are in gradient_control.py).
"""

from __future__ import annotations

import numpy as np

from engine.core.errors import ComponentError
from engine.core.xp import array_module
from engine.nnet.components.base import ComponentProperty as P, register_component
from engine.nnet.components._fields import (
    FLOAT,
    INT,
    INT_VECTOR,
    SameDimComponent,
    TokenFieldsComponent,
    expect_open_token,
    read_fields,
    skip_old_stats,
    write_scaled,
)
from engine.nnet.components.nonlinear import read_double
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader


class _InOutDims(TokenFieldsComponent):
    """Components whose file format is just <InputDim> <OutputDim> (and, in a subclass,
    the further _FIELDS it lists)."""

    _FIELDS = (("<InputDim>", "in_dim", INT), ("<OutputDim>", "out_dim", INT))

    def __init__(self) -> None:
        super().__init__()
        self.in_dim = 0
        self.out_dim = 0

    def input_dim(self) -> int:
        return self.in_dim

    def output_dim(self) -> int:
        return self.out_dim

    def _problems(self) -> list[str]:
        # what every subclass's maths needs: output columns each made from a block of
        # input-dim/output-dim input columns
        if self.out_dim <= 0 or self.in_dim <= 0 or self.in_dim % self.out_dim != 0:
            return [f"<InputDim> {self.in_dim} must be a positive multiple of <OutputDim> "
                    f"{self.out_dim}"]
        return []


@register_component
class PnormComponent(_InOutDims):
    """Per group of input-dim/output-dim consecutive columns, the 2-norm."""

    type_name = "PnormComponent"

    def properties(self) -> P:
        return P.SIMPLE_COMPONENT | P.BACKPROP_NEEDS_INPUT | P.BACKPROP_NEEDS_OUTPUT

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.out_dim = cfg.get_int("output-dim", required=True)
        self.in_dim = cfg.get_int("input-dim", required=True)
        if self.out_dim <= 0 or self.in_dim <= 0 or self.in_dim % self.out_dim != 0:
            raise cfg.error(f"PnormComponent: input-dim={self.in_dim} must be a positive "
                            f"multiple of output-dim={self.out_dim}")

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.in_dim)
        xp = array_module(in_value)
        g = in_value.reshape(in_value.shape[0], self.out_dim, -1)
        out[...] = xp.sqrt((g * g).sum(axis=2))
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        xp = array_module(in_value)
        rows = in_value.shape[0]
        g = in_value.reshape(rows, self.out_dim, -1)
        y = out_value[:, :, None]
        # d|x|/dx = x/|x|, and 0 where the group's norm is 0 (as Kaldi)
        safe = xp.where(y == 0, 1.0, y)
        d = xp.where(y == 0, 0.0, g / safe) * out_deriv[:, :, None]
        in_deriv[...] = d.reshape(rows, self.in_dim)


_ELEMENTWISE_PRODUCT_PROPS = P.SIMPLE_COMPONENT | P.BACKPROP_NEEDS_INPUT


@register_component
class ElementwiseProductComponent(_InOutDims):
    """Product of the input-dim/output-dim consecutive blocks of output-dim columns."""

    type_name = "ElementwiseProductComponent"

    def properties(self) -> P:
        return _ELEMENTWISE_PRODUCT_PROPS

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.out_dim = cfg.get_int("output-dim", required=True)
        self.in_dim = cfg.get_int("input-dim", required=True)
        if (self.out_dim <= 0 or self.in_dim <= self.out_dim
                or self.in_dim % self.out_dim != 0):
            raise cfg.error(f"ElementwiseProductComponent: input-dim={self.in_dim} must be "
                            f"a multiple (>1) of output-dim={self.out_dim}")

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.in_dim)
        k = self.in_dim // self.out_dim
        blocks = in_value.reshape(in_value.shape[0], k, self.out_dim)
        out[...] = blocks.prod(axis=1)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        k = self.in_dim // self.out_dim
        d = self.out_dim
        # the derivative of block i is out_deriv times the product of the other blocks:
        # (b_0 ... b_{i-1}) * (b_{k-1} ... b_{i+1}), each running product taken in that
        # order (as cumulative products along the blocks make them; no division, so
        # zeros are exact), the first and last factor alone where the other side is
        # empty (1 * b == b)
        block = [in_value[:, i * d:(i + 1) * d] for i in range(k)]
        prefix = [None] * k          # prefix[i]: b_0 ... b_{i-1} (None: empty)
        run = None
        for i in range(k - 1):
            run = block[i] if run is None else run * block[i]
            prefix[i + 1] = run
        suffix = [None] * k          # suffix[i]: b_{k-1} ... b_{i+1}
        run = None
        for i in range(k - 1, 0, -1):
            run = block[i] if run is None else run * block[i]
            suffix[i - 1] = run
        derivs = []
        for i in range(k):
            others = suffix[i] if prefix[i] is None else (
                prefix[i] if suffix[i] is None else prefix[i] * suffix[i])
            derivs.append(others * out_deriv)
        for i in range(k):           # written once all are made
            in_deriv[:, i * d:(i + 1) * d] = derivs[i]


@register_component
class SumBlockComponent(_InOutDims):
    """out = scale * sum of the input-dim/output-dim consecutive column blocks."""

    type_name = "SumBlockComponent"
    _FIELDS = _InOutDims._FIELDS + (("<Scale>", "scale_value", FLOAT),)

    def __init__(self) -> None:
        super().__init__()
        self.scale_value = 1.0

    def properties(self) -> P:
        return P.SIMPLE_COMPONENT | P.PROPAGATE_ADDS | P.BACKPROP_ADDS

    def info(self) -> str:
        return (f"{self.type_name}, input-dim={self.in_dim}, output-dim={self.out_dim}, "
                f"scale={self.scale_value:g}")

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.in_dim = cfg.get_int("input-dim", required=True)
        self.out_dim = cfg.get_int("output-dim", required=True)
        if self.in_dim <= 0 or self.out_dim <= 0 or self.in_dim % self.out_dim != 0:
            raise cfg.error(f"SumBlockComponent: invalid values input-dim={self.in_dim} "
                            f"output-dim={self.out_dim}")
        self.scale_value = cfg.get_float("scale", 1.0)

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.in_dim)
        blocks = in_value.reshape(in_value.shape[0], -1, self.out_dim)
        out += self.scale_value * blocks.sum(axis=1)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        xp = array_module(out_deriv)
        in_deriv += self.scale_value * xp.tile(out_deriv, (1, self.in_dim // self.out_dim))


@register_component
class SumGroupComponent(TokenFieldsComponent):
    """Sums of consecutive column groups of the given sizes."""

    type_name = "SumGroupComponent"
    ARRAYS = ("sum_matrix", "reverse_indexes")
    _FIELDS = (("<Sizes>", "sizes", INT_VECTOR),)

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.sum_matrix = np.zeros((0, 0), dtype=np.float32)
        self.reverse_indexes = np.zeros(0, dtype=np.int64)

    def _init_sizes(self, sizes: list[int]) -> None:
        if not sizes or any(s <= 0 for s in sizes):
            raise ComponentError(f"group sizes must be positive, got {sizes}",
                                 component=self.label())
        self.sizes = [int(s) for s in sizes]
        self.reverse_indexes = np.repeat(np.arange(len(sizes)), sizes).astype(np.int64)
        m = np.zeros((sum(sizes), len(sizes)), dtype=np.float32)
        m[np.arange(sum(sizes)), self.reverse_indexes] = 1.0
        self.sum_matrix = m

    def properties(self) -> P:
        return P.SIMPLE_COMPONENT

    def input_dim(self) -> int:
        return int(sum(self.sizes))

    def output_dim(self) -> int:
        return len(self.sizes)

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        if cfg.has("sizes"):
            sizes = cfg.get_int_list("sizes")
            if not sizes or any(s <= 0 for s in sizes):
                raise cfg.error(f"SumGroupComponent: sizes={cfg.values['sizes']} must be a "
                                "non-empty list of positive integers")
            self._init_sizes(sizes)
            return
        input_dim = cfg.get_int("input-dim", required=True)
        output_dim = cfg.get_int("output-dim", required=True)
        if output_dim <= 0 or input_dim <= 0 or input_dim % output_dim != 0:
            raise cfg.error(f"SumGroupComponent: input-dim={input_dim} must be a positive "
                            f"multiple of output-dim={output_dim} (or give sizes=)")
        self._init_sizes([input_dim // output_dim] * output_dim)

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        read_fields(reader, c, cls._FIELDS, opening=True)
        tok = reader.read_token()
        if tok not in ("<SumGroupComponent>", "</SumGroupComponent>"):
            raise reader.error(f"expected </SumGroupComponent>, got {tok!r}")
        c._init_sizes(c.sizes)
        return c

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.input_dim())
        xp = array_module(in_value)
        out[...] = in_value @ xp.asarray(self.sum_matrix, dtype=in_value.dtype)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        xp = array_module(out_deriv)
        in_deriv[...] = out_deriv[:, xp.asarray(self.reverse_indexes)]


@register_component
class PermuteComponent(TokenFieldsComponent):
    """Output column i is input column column_map[i]."""

    type_name = "PermuteComponent"
    ARRAYS = ("column_map", "reverse_column_map")
    _FIELDS = (("<ColumnMap>", "column_map", INT_VECTOR),)

    def __init__(self) -> None:
        super().__init__()
        self.column_map = np.zeros(0, dtype=np.int64)
        self.reverse_column_map = np.zeros(0, dtype=np.int64)

    def _init_map(self, column_map) -> None:
        cm = np.asarray(column_map, dtype=np.int64)
        dim = cm.size
        if dim == 0:
            raise ComponentError("column-map is empty", component=self.label())
        if cm.min() < 0 or cm.max() >= dim or np.unique(cm).size != dim:
            raise ComponentError("column map does not represent a permutation",
                                 component=self.label())
        rev = np.empty(dim, dtype=np.int64)
        rev[cm] = np.arange(dim)
        self.column_map, self.reverse_column_map = cm, rev

    def properties(self) -> P:
        return P.SIMPLE_COMPONENT

    def input_dim(self) -> int:
        return int(self.column_map.size)

    def output_dim(self) -> int:
        return int(self.column_map.size)

    def info(self) -> str:
        cm = [int(v) for v in self.column_map[:5]]
        more = " ..." if self.column_map.size > 5 else ""
        return (f"{self.type_name}, dim={self.column_map.size} , column-map=[ "
                f"{' '.join(map(str, cm))}{more} ]")

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        cm = cfg.get_int_list("column-map", required=True)
        try:
            self._init_map(cm)
        except ComponentError as e:
            raise cfg.error(f"PermuteComponent: bad column-map: {e.reason}") from None

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        expect_open_token(reader, cls.type_name, "<ColumnMap>")
        if reader.binary and reader.peek_byte() in (b"F", b"D"):
            # very old models stored the map as floats (Kaldi rounds them and fixes the
            # last entry the same way).  A byte, not a token, is peeked, as Kaldi does:
            # an integer vector starts with binary size and count bytes
            fm = reader.read_vector()
            cm = (fm + 0.5).astype(np.int64)
            cm[-1] = fm.size - 1
        else:
            cm = reader.read_int_vector()
        reader.expect_token("</PermuteComponent>")
        c._init_map(cm)
        return c

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.input_dim())
        xp = array_module(in_value)
        out[...] = in_value[:, xp.asarray(self.column_map)]
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        xp = array_module(out_deriv)
        in_deriv[...] = out_deriv[:, xp.asarray(self.reverse_column_map)]


_NO_OP_PROPS = P.SIMPLE_COMPONENT | P.PROPAGATE_IN_PLACE | P.BACKPROP_IN_PLACE


@register_component
class NoOpComponent(SameDimComponent, TokenFieldsComponent):
    """Identity forward; backprop scaled by backprop-scale."""

    type_name = "NoOpComponent"
    _FIELDS = (("<Dim>", "dim", INT), ("<BackpropScale>", "backprop_scale", FLOAT))

    def __init__(self) -> None:
        super().__init__()
        self.dim = 0
        self.backprop_scale = 1.0

    def properties(self) -> P:
        return _NO_OP_PROPS

    def info(self) -> str:
        s = f"{self.type_name}, dim={self.dim}"
        if self.backprop_scale != 1.0:
            s += f", backprop-scale={self.backprop_scale:g}"
        return s

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.backprop_scale = cfg.get_float("backprop-scale", 1.0)
        self.dim = cfg.get_int("dim", required=True)
        if self.dim <= 0:
            raise cfg.error(f"NoOpComponent: dim={self.dim} must be > 0")

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        read_fields(reader, c, cls._FIELDS[:1], opening=True)
        if reader.peek_token() == "<ValueAvg>":
            # old format, from when NoOpComponent was a NonlinearComponent: skip stats
            reader.read_token()
            skip_old_stats(reader)
            if reader.peek_token() == "<OderivRms>":
                reader.read_token()
                reader.read_vector()
                reader.expect_token("<OderivCount>")
                read_double(reader)
            tok = reader.read_token()
            if tok == "<NumDimsSelfRepaired>":
                read_double(reader)
                tok = reader.read_token()
            if tok == "<NumDimsProcessed>":
                read_double(reader)
                tok = reader.read_token()
            if tok != "</NoOpComponent>":
                raise reader.error(f"expected </NoOpComponent>, got {tok!r}")
            return c
        read_fields(reader, c, cls._FIELDS[1:])
        reader.expect_token("</NoOpComponent>")
        return c

    def propagate(self, indexes, in_value, out):
        self.copy_input(in_value, out)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        write_scaled(in_deriv, out_deriv, self.backprop_scale)
