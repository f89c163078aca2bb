"""The old 3-D convolution and max-pooling components: Kaldi's ConvolutionComponent
and MaxpoolingComponent (src/nnet3/nnet-combined-component.{h,cc}).

Both are simple components: each row is one vectorised (x, y, z) tensor and
the convolution/pooling happens within the row.  As in Kaldi, the input is
first gathered into "patches" with one column-index array (a single gather),
after which the convolution is a single GEMM and max-pooling a reduction.
Backprop scatters the patch derivatives back to the input with the inverse
map, split into groups of distinct target columns so each group is a plain
fancy-indexed add (Kaldi's RearrangeIndexes + AddCols).

Vectorisation orders (Kaldi's TensorVectorizationType): ``zyx`` (value 1,
z fastest: index = x*Y*Z + y*Z + z) and ``yzx`` (value 0, y fastest:
index = x*Y*Z + z*Y + y).  MaxpoolingComponent always uses z fastest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.core import sgemm
from engine.core.errors import ComponentError, ModelFormatError
from engine.core.xp import array_module
from engine.nnet.components._fields import (
    INT,
    MATRIX,
    VECTOR,
    TokenFieldsComponent,
    read_fields,
    write_fields,
)
from engine.nnet.components._param_utils import gaussian
from engine.nnet.components.base import P, UpdatableComponent, register_component
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

K_YZX, K_ZYX = 0, 1
_ORDERS = {"yzx": K_YZX, "zyx": K_ZYX}


def read_matrix_file(cfg: ConfigLine, option: str, filename: str) -> np.ndarray:
    """Kaldi's ReadKaldiObject for a matrix (text or binary), errors naming the option."""
    try:
        data = Path(filename).read_bytes()
    except OSError as e:
        raise cfg.error(f"option {option}={filename}: cannot read file: {e.strerror}") from None
    try:
        return KaldiReader(data, binary=None, source=filename).read_matrix()
    except ModelFormatError as e:
        raise cfg.error(f"option {option}={filename}: not a Kaldi matrix: {e}") from None


class _ScatterMap:
    """Inverse of a column gather ``patches = x[:, col_map]``: adds patch columns
    back into the input columns.  Targets repeat when patches overlap, so the
    (patch column, input column) pairs are split by occurrence number into groups
    whose targets are distinct (Kaldi's RearrangeIndexes)."""

    def __init__(self, col_map: np.ndarray):
        order = np.argsort(col_map, kind="stable")
        targets = col_map[order]
        # occurrence rank of each patch column among those with the same target
        first = np.searchsorted(targets, targets, side="left")
        rank = np.arange(targets.size) - first
        self.groups = [(targets[rank == k], order[rank == k])
                       for k in range(int(rank.max()) + 1 if rank.size else 0)]
        self._on_backend: dict = {"numpy": self.groups}

    def add_to(self, xp, patches, out) -> None:
        groups = self._on_backend.get(xp.__name__)
        if groups is None:
            groups = self._on_backend[xp.__name__] = [(xp.asarray(t), xp.asarray(s))
                                                      for t, s in self.groups]
        for tgt, src in groups:
            out[:, tgt] += patches[:, src]


def _cached_maps(comp, geometry, xp):
    """``comp``'s patch column map on backend ``xp`` and its _ScatterMap, made by
    ``comp._column_map()`` once per geometry (the values of the ``geometry`` fields) and
    copied once per backend, kept in ``comp._maps``."""
    key = tuple(getattr(comp, attr) for _, attr, _ in geometry)
    m = comp._maps.get(key)
    if m is None:
        col_map = comp._column_map()
        m = comp._maps[key] = {"col_map": col_map, "scatter": _ScatterMap(col_map)}
    dev = m.get(xp.__name__)
    if dev is None:
        dev = m[xp.__name__] = xp.asarray(m["col_map"])
    return dev, m["scatter"]


def _steps(in_dim: int, size: int, step: int) -> int:
    return 1 + (in_dim - size) // step


@register_component
class ConvolutionComponent(UpdatableComponent):
    """Filters of shape (filt-x-dim, filt-y-dim, input-z-dim) slid over x and y;
    output column ``(x_step * num_y_steps + y_step) * num_filters + f``."""

    type_name = "ConvolutionComponent"
    PARAMS = ("filter_params", "bias_params")
    # after the UpdatableComponent header: the geometry, then the parameters
    _GEOMETRY_FIELDS = (("<InputXDim>", "input_x_dim", INT), ("<InputYDim>", "input_y_dim", INT),
                        ("<InputZDim>", "input_z_dim", INT), ("<FiltXDim>", "filt_x_dim", INT),
                        ("<FiltYDim>", "filt_y_dim", INT), ("<FiltXStep>", "filt_x_step", INT),
                        ("<FiltYStep>", "filt_y_step", INT),
                        ("<InputVectorization>", "input_vectorization", INT))
    _PARAM_FIELDS = (("<FilterParams>", "filter_params", MATRIX),
                     ("<BiasParams>", "bias_params", VECTOR))

    def __init__(self) -> None:
        super().__init__()
        self.input_x_dim = self.input_y_dim = self.input_z_dim = 0
        self.filt_x_dim = self.filt_y_dim = 0
        self.filt_x_step = self.filt_y_step = 0
        self.input_vectorization = K_ZYX
        self.filter_params = np.zeros((0, 0), np.float32)
        self.bias_params = np.zeros(0, np.float32)
        self._maps: dict = {}

    # -- geometry ----------------------------------------------------------------------
    def _num_steps(self) -> tuple[int, int]:
        return (_steps(self.input_x_dim, self.filt_x_dim, self.filt_x_step),
                _steps(self.input_y_dim, self.filt_y_dim, self.filt_y_step))

    def properties(self):
        return (P.SIMPLE_COMPONENT | P.UPDATABLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                | P.BACKPROP_ADDS | P.PROPAGATE_ADDS)

    def input_dim(self) -> int:
        return self.input_x_dim * self.input_y_dim * self.input_z_dim

    def output_dim(self) -> int:
        nx, ny = self._num_steps()
        return nx * ny * int(self.filter_params.shape[0])

    def _column_map(self) -> np.ndarray:
        """Input column of each patch column: patch-major, then (x, y, z), z fastest."""
        nx, ny = self._num_steps()
        Y, Z = self.input_y_dim, self.input_z_dim
        xs = (np.arange(nx)[:, None] * self.filt_x_step
              + np.arange(self.filt_x_dim)[None, :])             # (nx, fx)
        ys = (np.arange(ny)[:, None] * self.filt_y_step
              + np.arange(self.filt_y_dim)[None, :])             # (ny, fy)
        x = xs[:, None, :, None, None]
        y = ys[None, :, None, :, None]
        z = np.arange(Z)[None, None, None, None, :]
        if self.input_vectorization == K_ZYX:
            idx = x * (Y * Z) + y * Z + z
        else:
            idx = x * (Y * Z) + z * Y + y
        return idx.reshape(-1).astype(np.int64)                  # (nx, ny, fx, fy, Z)

    def _maps_for(self, xp):
        return _cached_maps(self, self._GEOMETRY_FIELDS, xp)

    def info(self) -> str:
        from engine.nnet.components.base import updatable_info  # noqa: PLC0415
        f, b = np.asarray(self.filter_params, np.float64), np.asarray(self.bias_params, np.float64)
        rms_f = float(np.sqrt(np.mean(f * f))) if f.size else 0.0
        mean_b = float(b.mean()) if b.size else 0.0
        std_b = float(np.sqrt(max(np.mean(b * b) - mean_b ** 2, 0.0))) if b.size else 0.0
        return (updatable_info(self) + f", input-x-dim={self.input_x_dim}, input-y-dim="
                f"{self.input_y_dim}, input-z-dim={self.input_z_dim}, filt-x-dim="
                f"{self.filt_x_dim}, filt-y-dim={self.filt_y_dim}, filt-x-step="
                f"{self.filt_x_step}, filt-y-step={self.filt_y_step}, input-vectorization="
                f"{self.input_vectorization}, num-filters={self.filter_params.shape[0]}"
                f", filter-params-rms={rms_f:.4g}, bias-params-{{mean,stddev}}="
                f"{mean_b:.4g},{std_b:.4g}")

    # -- config / files ------------------------------------------------------------------
    def _check_geometry(self, where: str) -> None:
        for name in ("input_x_dim", "input_y_dim", "input_z_dim", "filt_x_dim", "filt_y_dim",
                     "filt_x_step", "filt_y_step"):
            if getattr(self, name) <= 0:
                raise ComponentError(f"{where}: {name.replace('_', '-')} must be > 0 "
                                     f"(got {getattr(self, name)})", component=self.label())
        if self.filt_x_dim > self.input_x_dim or self.filt_y_dim > self.input_y_dim:
            raise ComponentError(f"{where}: filter ({self.filt_x_dim} x {self.filt_y_dim}) is "
                                 f"larger than the input ({self.input_x_dim} x "
                                 f"{self.input_y_dim})", component=self.label())
        if self.filter_params.ndim != 2 or self.bias_params.shape != \
                (self.filter_params.shape[0],) or self.filter_params.shape[0] == 0 or \
                self.filter_params.shape[1] != self.filt_x_dim * self.filt_y_dim * self.input_z_dim:
            raise ComponentError(
                f"{where}: filter params {self.filter_params.shape} and bias "
                f"{self.bias_params.shape} do not fit filt-x-dim * filt-y-dim * input-z-dim = "
                f"{self.filt_x_dim * self.filt_y_dim * self.input_z_dim}",
                component=self.label())

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        self.init_learning_rate_common(cfg)
        for opt in ("input-x-dim", "input-y-dim", "input-z-dim", "filt-x-dim", "filt-y-dim",
                    "filt-x-step", "filt-y-step"):
            setattr(self, opt.replace("-", "_"), cfg.get_int(opt, required=True))
        order = cfg.get_choice("input-vectorization-order", ["zyx", "yzx"], "zyx")
        self.input_vectorization = _ORDERS[order]
        for d, f, s in (("x", self.filt_x_dim, self.filt_x_step),
                        ("y", self.filt_y_dim, self.filt_y_step)):
            if f <= 0 or s <= 0:
                raise cfg.error(f"component {self.name!r} ({self.type_name}): filt-{d}-dim and "
                                f"filt-{d}-step must be > 0")
        filter_dim = self.filt_x_dim * self.filt_y_dim * self.input_z_dim
        matrix = cfg.get_str("matrix")
        if matrix is not None:
            mat = read_matrix_file(cfg, "matrix", matrix)
            if mat.shape[1] != filter_dim + 1 or mat.shape[0] == 0:
                raise cfg.error(f"option matrix={matrix}: matrix is {mat.shape[0]} x "
                                f"{mat.shape[1]}, expected num-filters x {filter_dim + 1} "
                                "(filters, then the bias column)")
            self.filter_params = np.ascontiguousarray(mat[:, :filter_dim])
            self.bias_params = np.ascontiguousarray(mat[:, filter_dim])
        else:
            num_filters = cfg.get_int("num-filters", required=True)
            if num_filters <= 0:
                raise cfg.error(f"option num-filters={num_filters}: must be > 0")
            for d, i, f, s in (("x", self.input_x_dim, self.filt_x_dim, self.filt_x_step),
                               ("y", self.input_y_dim, self.filt_y_dim, self.filt_y_step)):
                if (i - f) % s != 0:
                    raise cfg.error(f"component {self.name!r} ({self.type_name}): "
                                    f"input-{d}-dim - filt-{d}-dim ({i} - {f}) must be a "
                                    f"multiple of filt-{d}-step ({s})")
            param_stddev = cfg.get_float("param-stddev", 1.0 / np.sqrt(filter_dim))
            bias_stddev = cfg.get_float("bias-stddev", 1.0)
            if param_stddev < 0 or bias_stddev < 0:
                raise cfg.error("options param-stddev and bias-stddev must be >= 0")
            self.filter_params = gaussian(rng, (num_filters, filter_dim), param_stddev)
            self.bias_params = gaussian(rng, (num_filters,), bias_stddev)
        self._check_geometry("in config")

    @classmethod
    def read(cls, reader: KaldiReader) -> "ConvolutionComponent":
        c = cls()
        tok = c.read_updatable_common(reader)
        if tok:
            raise reader.error(f"expected <LearningRate> in {cls.type_name}, got {tok!r}")
        read_fields(reader, c, cls._GEOMETRY_FIELDS)
        if c.input_vectorization not in (K_YZX, K_ZYX):
            raise reader.error(f"bad <InputVectorization> {c.input_vectorization} "
                               "(0 = yzx, 1 = zyx)")
        read_fields(reader, c, cls._PARAM_FIELDS)
        tok = reader.read_token()
        # Kaldi: a missing trailing <IsGradient> means false, whatever the header said
        c.is_gradient = False
        if tok == "<IsGradient>":
            c.is_gradient = reader.read_bool()
            tok = reader.read_token()
        if tok != f"</{cls.type_name}>":
            raise reader.error(f"expected </{cls.type_name}>, got {tok!r}")
        c._check_geometry("while reading")
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        write_fields(writer, self, self._GEOMETRY_FIELDS + self._PARAM_FIELDS)
        writer.write_token("<IsGradient>")
        writer.write_bool(self.is_gradient)
        writer.write_token(f"</{self.type_name}>")

    # -- maths -------------------------------------------------------------------------
    def _patches(self, xp, x, col_map):
        """(rows * num_patches, filter_dim) view of the gathered input."""
        fd = self.filter_params.shape[1]
        return x[:, col_map].reshape(-1, fd)

    def propagate(self, indexes, in_value, out):
        xp = array_module(in_value)
        self.check_shape("input", in_value, None, self.input_dim())
        nr = in_value.shape[0]
        self.check_shape("output", out, nr, self.output_dim())
        col_map, _ = self._maps_for(xp)
        w = xp.asarray(self.filter_params).astype(in_value.dtype, copy=False)
        b = xp.asarray(self.bias_params).astype(in_value.dtype, copy=False)
        patches = self._patches(xp, in_value, col_map)            # (rows * patches, fd)
        y = sgemm.matmul_nt(patches, w)       # the product kernel, for frozen filters
        if y is None:
            y = patches @ w.T
        y += b                                                    # (rows * patches, F)
        out += y.reshape(nr, -1)                                  # PROPAGATE_ADDS
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv):
        xp = array_module(out_deriv)
        nr = out_deriv.shape[0]
        self.check_shape("output derivative", out_deriv, None, self.output_dim())
        nf = self.filter_params.shape[0]
        dy = out_deriv.reshape(-1, nf)                            # (rows * patches, F)
        col_map, scatter = self._maps_for(xp)
        if in_deriv is not None:
            self.check_shape("input derivative", in_deriv, nr, self.input_dim())
            w = xp.asarray(self.filter_params).astype(out_deriv.dtype, copy=False)
            dpatches = (dy @ w).reshape(nr, -1)
            scatter.add_to(xp, dpatches, in_deriv)                # BACKPROP_ADDS
        if to_update is not None:
            self.check_shape("input value", in_value, nr, self.input_dim())
            patches = self._patches(xp, in_value, col_map)
            lr = to_update.learning_rate
            to_update.filter_params += (lr * (dy.T @ patches)).astype(
                to_update.filter_params.dtype, copy=False)
            to_update.bias_params += (lr * dy.sum(axis=0)).astype(
                to_update.bias_params.dtype, copy=False)


@register_component
class MaxpoolingComponent(TokenFieldsComponent):
    """Max over (pool-x, pool-y, pool-z) windows of a z-fastest (x, y, z) tensor;
    output column ``(x_pool * ny + y_pool) * nz + z_pool``."""

    type_name = "MaxpoolingComponent"
    _FIELDS = (("<InputXDim>", "input_x_dim", INT), ("<InputYDim>", "input_y_dim", INT),
               ("<InputZDim>", "input_z_dim", INT), ("<PoolXSize>", "pool_x_size", INT),
               ("<PoolYSize>", "pool_y_size", INT), ("<PoolZSize>", "pool_z_size", INT),
               ("<PoolXStep>", "pool_x_step", INT), ("<PoolYStep>", "pool_y_step", INT),
               ("<PoolZStep>", "pool_z_step", INT))

    def __init__(self) -> None:
        super().__init__()
        for _, attr, _ in self._FIELDS:
            setattr(self, attr, 0)
        self._maps: dict = {}

    def properties(self):
        return (P.SIMPLE_COMPONENT | P.BACKPROP_NEEDS_INPUT | P.BACKPROP_NEEDS_OUTPUT
                | P.BACKPROP_ADDS)

    def _num_pools(self) -> tuple[int, int, int]:
        return (_steps(self.input_x_dim, self.pool_x_size, self.pool_x_step),
                _steps(self.input_y_dim, self.pool_y_size, self.pool_y_step),
                _steps(self.input_z_dim, self.pool_z_size, self.pool_z_step))

    def input_dim(self) -> int:
        return self.input_x_dim * self.input_y_dim * self.input_z_dim

    def output_dim(self) -> int:
        nx, ny, nz = self._num_pools()
        return nx * ny * nz

    def info(self) -> str:
        return self.type_name + "".join(f", {a.replace('_', '-')}={getattr(self, a)}"
                                        for _, a, _ in self._FIELDS)

    def check(self) -> None:
        """Kaldi's MaxpoolingComponent::Check; raises ComponentError naming the rule."""
        for _, a, _ in self._FIELDS:
            if getattr(self, a) <= 0:
                raise ComponentError(f"{a.replace('_', '-')} must be > 0", component=self.label())
        for d in "xyz":
            i, s, st = (getattr(self, f"input_{d}_dim"), getattr(self, f"pool_{d}_size"),
                        getattr(self, f"pool_{d}_step"))
            if i < s:
                raise ComponentError(f"pool-{d}-size {s} exceeds input-{d}-dim {i}",
                                     component=self.label())
            if s < st:
                raise ComponentError(f"pool-{d}-step {st} exceeds pool-{d}-size {s}",
                                     component=self.label())
            if (i - s) % st != 0:
                raise ComponentError(f"input-{d}-dim - pool-{d}-size ({i} - {s}) is not a "
                                     f"multiple of pool-{d}-step {st}", component=self.label())

    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        for _, attr, _ in self._FIELDS:
            setattr(self, attr, cfg.get_int(attr.replace("_", "-"), required=True))
        try:
            self.check()
        except ComponentError as e:
            raise cfg.error(f"component {self.name!r} ({self.type_name}): {e.reason}") from None

    def _check_read(self, reader: KaldiReader) -> None:
        self.check()  # a ComponentError, as for a config

    def _column_map(self) -> np.ndarray:
        """Input column of each patch column: window offset (x, y, z) major, then
        pool (x_pool, y_pool, z_pool); so column q * num_pools + p."""
        nx, ny, nz = self._num_pools()
        Y, Z = self.input_y_dim, self.input_z_dim
        ox = np.arange(self.pool_x_size)[:, None, None, None, None, None]
        oy = np.arange(self.pool_y_size)[None, :, None, None, None, None]
        oz = np.arange(self.pool_z_size)[None, None, :, None, None, None]
        px = np.arange(nx)[None, None, None, :, None, None] * self.pool_x_step
        py = np.arange(ny)[None, None, None, None, :, None] * self.pool_y_step
        pz = np.arange(nz)[None, None, None, None, None, :] * self.pool_z_step
        idx = (px + ox) * (Y * Z) + (py + oy) * Z + (pz + oz)
        return idx.reshape(-1).astype(np.int64)

    def _maps_for(self, xp):
        return _cached_maps(self, self._FIELDS, xp)

    def _patches(self, xp, x):
        col_map, scatter = self._maps_for(xp)
        return x[:, col_map].reshape(x.shape[0], -1, self.output_dim()), scatter

    def propagate(self, indexes, in_value, out):
        xp = array_module(in_value)
        self.check_shape("input", in_value, None, self.input_dim())
        self.check_shape("output", out, in_value.shape[0], self.output_dim())
        patches, _ = self._patches(xp, in_value)
        # Kaldi starts from -1e20 and takes the running max
        out[...] = xp.maximum(patches.max(axis=1), in_value.dtype.type(-1e20))
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv):
        if in_deriv is None:
            return
        xp = array_module(in_value)
        self.check_shape("input value", in_value, None, self.input_dim())
        nr = in_value.shape[0]
        self.check_shape("output value", out_value, nr, self.output_dim())
        self.check_shape("output derivative", out_deriv, nr, self.output_dim())
        self.check_shape("input derivative", in_deriv, nr, self.input_dim())
        patches, scatter = self._patches(xp, in_value)
        # every window member equal to the max gets the whole derivative (ties
        # included, as Kaldi's EqualElementMask)
        mask = patches == out_value[:, None, :]
        contrib = (mask * out_deriv[:, None, :]).astype(in_deriv.dtype, copy=False)
        scatter.add_to(xp, contrib.reshape(nr, -1), in_deriv)
