"""TimeHeightConvolutionComponent (Kaldi's nnet-convolutional-component.{h,cc}); the
convolution itself (model, compilation, GEMM passes) is in ``_convolution.py``
(Kaldi's convolution.{h,cc}).

The input row of a frame is ``height-in`` blocks of ``num-filters-in`` values; the
output row is ``height-out`` blocks of ``num-filters-out``.  The filter reads the
(time, height) offsets listed in the model; ``required-time-offsets`` are the time
offsets an output cannot do without (the others are zero-padded when absent).
The linear parameters are (num-filters-out, num-offsets * num-filters-in), offset
blocks in the model's sorted offset order, plus a bias per output filter.

Natural gradient: the options are read and written faithfully (<UseNaturalGradient>,
<NumMinibatchesHistory>, <AlphaInOut>, <RankInOut>) but the preconditioner is not
implemented; backprop gives the plain gradient (Kaldi does the same when
``is_gradient`` is set or use-natural-gradient=false).
"""

from __future__ import annotations

import math

import numpy as np

from engine.core.errors import ComponentError
from engine.core.index import Index, K_NO_TIME, as_index_rows
from engine.core.memo import request_memo
from engine.nnet.components._convolution import (
    ConvolutionComputation,
    ConvolutionModel,
    compile_convolution_rows,
    convolve_backward_data,
    convolve_backward_params,
    convolve_forward,
    step_arrays,
)
from engine.nnet.components._fields import INT, FieldKind, read_fields, write_fields
from engine.nnet.components._nonsimple_utils import (
    config_errors_name_type,
    read_int_pair_vector,
    write_int_pair_vector,
)
from engine.nnet.components._param_utils import (
    gaussian,
    init_in_out_options,
    read_linear_and_bias,
    write_in_out_options,
    write_linear_and_bias,
)
from engine.nnet.components.base import (
    ComponentPrecomputedIndexes,
    ComponentProperty as P,
    PrecomputeOnRows,
    ReorderOnRows,
    UpdatableComponent,
    register_component,
)
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

# The ConvolutionModel's fields on disk (between <ConvolutionModel> and its closing
# token): the offsets are (time, height) pairs, the required time offsets a set, written
# in sorted order.
_MODEL_FIELDS = (
    ("<NumFiltersIn>", "num_filters_in", INT), ("<NumFiltersOut>", "num_filters_out", INT),
    ("<HeightIn>", "height_in", INT), ("<HeightOut>", "height_out", INT),
    ("<HeightSubsampleOut>", "height_subsample_out", INT),
    ("<Offsets>", "offsets", FieldKind(read_int_pair_vector, write_int_pair_vector)),
    ("<RequiredTimeOffsets>", "required_time_offsets",
     FieldKind(lambda r: set(r.read_int_vector()), lambda w, v: w.write_int_vector(sorted(v)))))


class TimeHeightConvolutionIndexes(ComponentPrecomputedIndexes):
    """A compiled ConvolutionComputation: sizes, per-step metadata (plain ints) and
    the column gather / backward scatter arrays (see ``_convolution.step_arrays``)."""

    def __init__(self, cc: ConvolutionComputation):
        self.num_filters_in = cc.num_filters_in
        self.num_filters_out = cc.num_filters_out
        self.height_in = cc.height_in
        self.height_out = cc.height_out
        self.num_t_in = cc.num_t_in
        self.num_t_out = cc.num_t_out
        self.num_images = cc.num_images
        self.temp_rows = cc.temp_rows
        self.temp_cols = cc.temp_cols
        self.height_maps = [list(s.height_map) for s in cc.steps]
        self.meta, self.columns, self.backward = step_arrays(cc)


# The computation reorder_index_arrays compiled, under (component, the rows it returned),
# for precompute_index_arrays of the same rows later in the same compile: Kaldi compiles the
# convolution again there, from the reordered Indexes, and gets the same computation (it
# depends on the model and on the (n, x) pairs and times the Indexes hold, which reordering
# keeps: tests/engine/test_time_height_conv_rows.py).  Each entry keeps its model, so an entry
# is used only for the model object it was made with (a component's id may be reused once it
# is gone; its model cannot while the entry holds it).  A request memo: emptied for cold
# compiles.
_COMPILED: dict = request_memo()
_COMPILED_SIZE = 64


def _parse_int_list(cfg, key: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")] if text != "" else []
    except ValueError:
        raise cfg.error(f"TimeHeightConvolutionComponent: option {key}={text!r} is not a "
                        "comma-separated integer list") from None
    return [cfg.check_int32(key, v) for v in values]


@register_component
class TimeHeightConvolutionComponent(ReorderOnRows, PrecomputeOnRows, UpdatableComponent):
    type_name = "TimeHeightConvolutionComponent"
    PARAMS = ("linear_params", "bias_params")

    def __init__(self) -> None:
        super().__init__()
        self.model = ConvolutionModel()
        self.linear_params = np.zeros((0, 0), dtype=np.float32)
        self.bias_params = np.zeros(0, dtype=np.float32)
        self.max_memory_mb = 200.0
        self.use_natural_gradient = True
        self.num_minibatches_history = 4.0
        self.alpha_in = 4.0
        self.alpha_out = 4.0
        self.rank_in = 20
        self.rank_out = 80

    # -- identity ----------------------------------------------------------------------
    def properties(self):
        return (P.UPDATABLE_COMPONENT | P.REORDERS_INDEXES | P.BACKPROP_ADDS |
                P.BACKPROP_NEEDS_INPUT | P.INPUT_CONTIGUOUS | P.OUTPUT_CONTIGUOUS)

    def input_dim(self) -> int:
        return self.model.input_dim()

    def output_dim(self) -> int:
        return self.model.output_dim()

    def info(self) -> str:
        def stats(name, a):
            a = np.asarray(a, dtype=np.float64)
            mean = float(a.mean()) if a.size else 0.0
            std = float(np.sqrt(max(0.0, float((a * a).mean()) - mean * mean))) if a.size else 0.0
            return f", {name}-rms={math.sqrt(float((a * a).mean())) if a.size else 0.0:g}" \
                f", {name}-mean={mean:g}, {name}-stddev={std:g}"
        s = (f"{self.type_name}, learning-rate={self.learning_rate:g} {self.model.info()}"
             + stats("filter-params", self.linear_params)
             + stats("bias-params", self.bias_params)
             + f", num-params={self.num_parameters()}, max-memory-mb={self.max_memory_mb:g}"
             f", use-natural-gradient={int(self.use_natural_gradient)}")
        if self.use_natural_gradient:
            s += (f", num-minibatches-history={self.num_minibatches_history:g}"
                  f", rank-in={self.rank_in}, rank-out={self.rank_out}, alpha={self.alpha_in:g}")
        return s

    def _check(self) -> str | None:
        bad = self.model.problem(False, True)
        if bad:
            return bad
        lp, bp = np.shape(self.linear_params), np.shape(self.bias_params)
        if lp != (self.model.param_rows(), self.model.param_cols()) or \
                bp != (self.model.num_filters_out,):
            return (f"parameter shapes {lp} and {bp} do not match the model "
                    f"({self.model.param_rows()} x {self.model.param_cols()} and "
                    f"{self.model.num_filters_out})")
        return None

    # -- config ----------------------------------------------------------------------
    @config_errors_name_type
    def init_from_config(self, cfg, rng) -> None:
        self.init_learning_rate_common(cfg)
        m = ConvolutionModel()
        missing = [k for k in ("num-filters-in", "num-filters-out", "height-in", "height-out")
                   if not cfg.has(k)]
        if missing:
            raise cfg.error(f"{self.type_name}: num-filters-in, num-filters-out, height-in "
                            f"and height-out must all be given (missing: {', '.join(missing)})")
        m.num_filters_in = cfg.get_int("num-filters-in")
        m.num_filters_out = cfg.get_int("num-filters-out")
        m.height_in = cfg.get_int("height-in")
        m.height_out = cfg.get_int("height-out")
        required = cfg.get_str("required-time-offsets", "undef")
        m.height_subsample_out = cfg.get_int("height-subsample-out", 1)
        self.max_memory_mb = cfg.get_float("max-memory-mb", 200.0)
        if not self.max_memory_mb > 0.0:
            raise cfg.error(f"{self.type_name}: max-memory-mb must be > 0")
        if cfg.has("offsets"):
            text = cfg.get_str("offsets")
            offs = []
            for part in text.split(";"):
                pair = _parse_int_list(cfg, "offsets", part)
                if len(pair) != 2:
                    raise cfg.error(f"{self.type_name}: bad offsets={text!r} (expected "
                                    "t1,h1;t2,h2;...)")
                offs.append((pair[0], pair[1]))
            offs.sort()
            if not offs or len(set(offs)) != len(offs):
                raise cfg.error(f"{self.type_name}: offsets={text!r} is empty or repeats "
                                "an offset")
            m.offsets = offs
        elif cfg.has("height-offsets") and cfg.has("time-offsets"):
            hs = _parse_int_list(cfg, "height-offsets", cfg.get_str("height-offsets"))
            ts = _parse_int_list(cfg, "time-offsets", cfg.get_str("time-offsets"))
            for key, v in (("height-offsets", hs), ("time-offsets", ts)):
                if not v or sorted(set(v)) != v:
                    raise cfg.error(f"{self.type_name}: {key} must be non-empty, sorted "
                                    "and unique")
            m.offsets = [(t, h) for t in ts for h in hs]
        else:
            raise cfg.error(f"{self.type_name}: expected either offsets=, or both "
                            "height-offsets= and time-offsets=")
        if required == "undef":
            m.required_time_offsets = {t for t, _ in m.offsets}
        else:
            req = _parse_int_list(cfg, "required-time-offsets", required)
            if not req or sorted(set(req)) != req:
                raise cfg.error(f"{self.type_name}: required-time-offsets={required!r} must "
                                "be non-empty, sorted and unique")
            m.required_time_offsets = set(req)
        bad = m.problem(False, True)
        if bad:
            raise cfg.error(f"{self.type_name}: parameters do not make sense: {bad}")
        self.model = m
        param_stddev = cfg.get_float("param-stddev", -1.0)
        bias_stddev = cfg.get_float("bias-stddev", 0.0)
        init_unit = cfg.get_bool("init-unit", False)
        if param_stddev < 0.0:
            param_stddev = 1.0 / math.sqrt(m.num_filters_in * len(m.offsets))
        rows, cols = m.param_rows(), m.param_cols()
        if not init_unit:
            self.linear_params = gaussian(rng, (rows, cols), param_stddev)
        else:
            if m.num_filters_in != m.num_filters_out:
                raise cfg.error(f"{self.type_name}: init-unit=true needs num-filters-in == "
                                "num-filters-out")
            if (0, 0) not in m.offsets:
                raise cfg.error(f"{self.type_name}: init-unit=true needs the offset (0,0)")
            k = m.offsets.index((0, 0))
            self.linear_params = np.zeros((rows, cols), dtype=np.float32)
            f = m.num_filters_in
            self.linear_params[:, k * f:(k + 1) * f] += np.eye(f, dtype=np.float32)
        self.bias_params = gaussian(rng, (m.num_filters_out,), bias_stddev)
        init_in_out_options(self, cfg, cols + 1, rows, 80)
        self.num_minibatches_history = cfg.get_float("num-minibatches-history", 4.0)

    # -- files -------------------------------------------------------------------------
    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        tok = c.read_updatable_common(reader)
        if tok == "":
            reader.expect_token("<Model>")
        elif tok != "<Model>":
            raise reader.error(f"expected <Model>, got {tok!r}")
        m = ConvolutionModel()
        tok = reader.read_token()
        if tok == "<ConvolutionModel>":
            tok = reader.read_token()
        if tok != "<NumFiltersIn>":
            raise reader.error(f"expected <NumFiltersIn>, got {tok!r}")
        m.num_filters_in = reader.read_int()
        read_fields(reader, m, _MODEL_FIELDS[1:])
        reader.expect_token("</ConvolutionModel>")
        c.model = m
        c.linear_params, c.bias_params = read_linear_and_bias(reader)
        reader.expect_token("<MaxMemoryMb>")
        c.max_memory_mb = reader.read_float()
        reader.expect_token("<UseNaturalGradient>")
        c.use_natural_gradient = reader.read_bool()
        reader.expect_token("<NumMinibatchesHistory>")
        c.num_minibatches_history = reader.read_float()
        reader.expect_token("<AlphaInOut>")
        c.alpha_in = reader.read_float()
        c.alpha_out = reader.read_float()
        reader.expect_token("<RankInOut>")
        c.rank_in = reader.read_int()
        c.rank_out = reader.read_int()
        reader.expect_token(f"</{cls.type_name}>")
        bad = c._check()
        if bad:
            raise reader.error(f"{cls.type_name}: {bad}")
        if not c.max_memory_mb > 0.0:
            raise reader.error(f"{cls.type_name}: <MaxMemoryMb> {c.max_memory_mb:g} must be > 0")
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        m = self.model
        writer.write_token("<Model>")
        writer.write_token("<ConvolutionModel>")
        write_fields(writer, m, _MODEL_FIELDS)
        writer.write_token("</ConvolutionModel>")
        write_linear_and_bias(writer, _host(self.linear_params), _host(self.bias_params))
        writer.write_token("<MaxMemoryMb>")
        writer.write_float(self.max_memory_mb)
        write_in_out_options(writer, self, "<NumMinibatchesHistory>",
                             self.num_minibatches_history)
        writer.write_token(f"</{self.type_name}>")

    # -- indexes ---------------------------------------------------------------------
    def get_input_indexes(self, misc_info, output_index):
        if output_index.t == K_NO_TIME:
            raise ComponentError("blank output Index", component=self.label())
        n, t, x = output_index
        return [Index(n, t + dt, x) for dt in self.model.all_time_offsets]

    def input_times(self, t: np.ndarray) -> np.ndarray:
        """get_input_indexes of many output Indexes at once (the compiler's array
        graph build): row i holds the t of the inputs of an output at t[i]."""
        if (t == K_NO_TIME).any():
            raise ComponentError("blank output Index", component=self.label())
        return t[:, None] + np.asarray(self.model.all_time_offsets, dtype=np.int64)[None, :]

    def input_rule(self) -> np.ndarray:
        """is_computable as a rule on the columns of ``input_times``: computable when
        the inputs at the required time offsets are, using every input that is."""
        req = self.model.required_time_offsets
        return np.array([dt in req for dt in self.model.all_time_offsets], dtype=bool)

    def is_computable(self, misc_info, output_index, input_index_set, used_inputs):
        n, t, x = output_index
        req = self.model.required_time_offsets
        if used_inputs is None:
            return all(input_index_set(Index(n, t + dt, x)) for dt in sorted(req))
        used = []
        for dt in self.model.all_time_offsets:
            idx = Index(n, t + dt, x)
            if input_index_set(idx):
                used.append(idx)
            elif dt in req:
                used_inputs.clear()
                return False
        used_inputs[:] = used
        return True

    def _compile_rows(self, input_rows: np.ndarray, output_rows: np.ndarray):
        try:
            return compile_convolution_rows(self.model, input_rows, output_rows,
                                            self.max_memory_mb, self.label())
        except ComponentError as e:
            raise ComponentError(e.reason, component=self.label()) from None

    def reorder_index_arrays(self, input_rows, output_rows) -> tuple[np.ndarray, np.ndarray]:
        """reorder_indexes on (k, 3) n, t, x int64 rows.  Rows already in that order
        are given back as the same objects (the compiler tests identity to know that
        nothing moved).  The computation compiled on the way is remembered for
        precompute_index_arrays of the rows returned (see _COMPILED)."""
        ins, outs = as_index_rows(input_rows), as_index_rows(output_rows)
        cc, new_in, new_out = self._compile_rows(ins, outs)
        if len(_COMPILED) >= _COMPILED_SIZE:
            _COMPILED.clear()
        _COMPILED[(id(self), new_in.tobytes(), new_out.tobytes())] = (
            self.model, self.max_memory_mb, cc)
        if np.array_equal(new_in, ins) and np.array_equal(new_out, outs):
            return input_rows, output_rows
        return new_in, new_out

    def precompute_index_arrays(self, misc_info, input_rows, output_rows,
                                need_backprop: bool) -> TimeHeightConvolutionIndexes:
        """precompute_indexes on (k, 3) n, t, x int64 rows, which must be in the order
        reorder_indexes gives them (ComponentError otherwise)."""
        ins, outs = as_index_rows(input_rows), as_index_rows(output_rows)
        hit = _COMPILED.get((id(self), ins.tobytes(), outs.tobytes()))
        if hit is not None and hit[0] is self.model and hit[1] == self.max_memory_mb:
            return TimeHeightConvolutionIndexes(hit[2])
        cc, new_in, new_out = self._compile_rows(ins, outs)
        if not (np.array_equal(new_in, ins) and np.array_equal(new_out, outs)):
            raise ComponentError("precompute_indexes got Indexes that reorder_indexes "
                                 "would change (reorder them first)", component=self.label())
        return TimeHeightConvolutionIndexes(cc)

    # -- maths -------------------------------------------------------------------------
    def _check_rows(self, ci, in_rows: int, out_rows: int) -> None:
        if not isinstance(ci, TimeHeightConvolutionIndexes):
            raise ComponentError("needs TimeHeightConvolution precomputed indexes",
                                 component=self.label())
        need_in = ci.num_t_in * ci.num_images * ci.height_in * ci.num_filters_in
        if out_rows != ci.num_t_out * ci.num_images or \
                in_rows * self.input_dim() != need_in:
            raise ComponentError(
                f"rows (input {in_rows}, output {out_rows}) do not match the compiled "
                f"computation (output {ci.num_t_out} x {ci.num_images})",
                component=self.label())

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.input_dim())
        self.check_shape("output", out, None, self.output_dim())
        self._check_rows(indexes, in_value.shape[0], out.shape[0])
        params = self.linear_params
        bias = self.bias_params
        if params.dtype != in_value.dtype:
            params, bias = params.astype(in_value.dtype), bias.astype(in_value.dtype)
        # every output height gets the bias (Kaldi's CopyRowsFromVec before the products)
        convolve_forward(indexes, in_value, params, out, bias=bias)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv):
        self.check_shape("output derivative", out_deriv, None, self.output_dim())
        self._check_rows(indexes, in_value.shape[0] if in_value is not None else
                         in_deriv.shape[0], out_deriv.shape[0])
        params = self.linear_params
        if params.dtype != out_deriv.dtype:
            params = params.astype(out_deriv.dtype)
        if in_deriv is not None:
            self.check_shape("input derivative", in_deriv, None, self.input_dim())
            convolve_backward_data(indexes, params, out_deriv, in_deriv)
        if to_update is not None and to_update.learning_rate != 0.0:
            # plain gradient; the natural-gradient preconditioner is not implemented
            lr = to_update.learning_rate
            m = self.model
            to_update.bias_params += lr * out_deriv.reshape(-1, m.num_filters_out).sum(axis=0)
            convolve_backward_params(indexes, in_value, out_deriv, lr,
                                     to_update.linear_params)


def _host(a):
    from engine.core.xp import to_numpy  # noqa: PLC0415
    return to_numpy(a)

