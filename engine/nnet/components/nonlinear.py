"""Element-wise and per-row nonlinearities: Kaldi's NonlinearComponent
(nnet-component-itf.{h,cc}) and its subclasses in nnet-simple-component.{h,cc}:
SigmoidComponent, TanhComponent, RectifiedLinearComponent, SoftmaxComponent and
LogSoftmaxComponent.

All of them keep Kaldi's activation statistics (value/derivative sums and count,
output-derivative sum of squares and count, self-repair counters) so that models read
and write unchanged; the sums are held in float64 NumPy vectors, as Kaldi holds them in
double, whatever backend the maths runs on.

Self-repair (the extra input-derivative term Kaldi adds for sigmoid, tanh and ReLU when a
dimension's average derivative is out of range) happens in backprop when ``to_update``
is given and this component has statistics; Kaldi's executor passes the stats-storing
copy there also for non-updatable components.  With no statistics (count 0, as in a
freshly initialised model) it does nothing, which is the case in Kaldi's gradient-mode
references.  Kaldi draws the "about half of the minibatches" decisions from its global
generator; here they come from the component's ``rng`` (a ``numpy.random.Generator``
the executor may set; a fixed-seed one is created on first use).
"""

from __future__ import annotations


import numpy as np

from engine.core.xp import array_module, to_numpy
from engine.nnet.components._fields import (
    DOUBLE,
    FLOAT,
    expect_open_token,
    read_optional_fields,
)
from engine.nnet.components.base import Component, ComponentProperty as P, register_component
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter, read_double, write_double  # noqa: F401

# Kaldi's kUnsetThreshold for the self-repair thresholds.
UNSET_THRESHOLD = -1000.0


# --------------------------------------------------------------------------------------
# helpers shared by this package's modules (kept here so they have one home)




def same_buffer(a, b) -> bool:
    """True if two arrays are the same memory (in-place propagate/backprop)."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))
    try:
        return a.data.ptr == b.data.ptr
    except AttributeError:
        return False


def get_rng(comp) -> np.random.Generator:
    """The component's random generator (created with a fixed seed on first use so runs
    are reproducible; the executor may assign ``comp.rng``)."""
    rng = getattr(comp, "rng", None)
    if rng is None:
        rng = np.random.default_rng(0)
        comp.rng = rng
    return rng


# --------------------------------------------------------------------------------------


class NonlinearComponent(Component):
    """Shared state and file format of Kaldi's NonlinearComponent."""

    STAT_FIELDS = ("value_sum", "deriv_sum", "count", "oderiv_sumsq", "oderiv_count",
                   "num_dims_self_repaired", "num_dims_processed")

    # the fields after the statistics, which older files lack (and the self-repair
    # options are written only when set)
    _TAIL_FIELDS = (("<NumDimsSelfRepaired>", "num_dims_self_repaired", DOUBLE),
                    ("<NumDimsProcessed>", "num_dims_processed", DOUBLE),
                    ("<SelfRepairLowerThreshold>", "self_repair_lower_threshold", FLOAT),
                    ("<SelfRepairUpperThreshold>", "self_repair_upper_threshold", FLOAT),
                    ("<SelfRepairScale>", "self_repair_scale", FLOAT))

    def __init__(self) -> None:
        super().__init__()
        self.dim = 0
        self.block_dim = 0
        self.value_sum = np.zeros(0)
        self.deriv_sum = np.zeros(0)
        self.count = 0.0
        self.oderiv_sumsq = np.zeros(0)
        self.oderiv_count = 0.0
        self.num_dims_self_repaired = 0.0
        self.num_dims_processed = 0.0
        self.self_repair_lower_threshold = UNSET_THRESHOLD
        self.self_repair_upper_threshold = UNSET_THRESHOLD
        self.self_repair_scale = 0.0
        self.rng: np.random.Generator | None = None

    def input_dim(self) -> int:
        return self.dim

    def output_dim(self) -> int:
        return self.dim

    def info(self) -> str:
        s = f"{self.type_name}, dim={self.dim}"
        if self.block_dim != self.dim:
            s += f", block-dim={self.block_dim}"
        if self.self_repair_lower_threshold != UNSET_THRESHOLD:
            s += f", self-repair-lower-threshold={self.self_repair_lower_threshold:g}"
        if self.self_repair_upper_threshold != UNSET_THRESHOLD:
            s += f", self-repair-upper-threshold={self.self_repair_upper_threshold:g}"
        if self.self_repair_scale != 0.0:
            s += f", self-repair-scale={self.self_repair_scale:g}"
        if self.count > 0 and self.value_sum.size == self.dim:
            prop = (self.num_dims_self_repaired / self.num_dims_processed
                    if self.num_dims_processed > 0 else 0)
            s += f", count={self.count:.3g}, self-repaired-proportion={prop:g}"
            s += f", value-avg-mean={float(np.mean(self.value_sum / self.count)):g}"
            if self.deriv_sum.size == self.dim:
                s += f", deriv-avg-mean={float(np.mean(self.deriv_sum / self.count)):g}"
        if self.oderiv_count > 0 and self.oderiv_sumsq.size == self.dim:
            rms = np.sqrt(np.maximum(self.oderiv_sumsq / self.oderiv_count, 0.0))
            s += f", oderiv-rms-mean={float(np.mean(rms)):g}, oderiv-count={self.oderiv_count:g}"
        return s

    # -- config ----------------------------------------------------------------
    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        self.dim = cfg.get_int("dim", required=True)
        self.block_dim = cfg.get_int("block-dim", self.dim)
        self.self_repair_lower_threshold = cfg.get_float("self-repair-lower-threshold",
                                                         UNSET_THRESHOLD)
        self.self_repair_upper_threshold = cfg.get_float("self-repair-upper-threshold",
                                                         UNSET_THRESHOLD)
        self.self_repair_scale = cfg.get_float("self-repair-scale", 0.0)
        if self.dim <= 0:
            raise cfg.error(f"{self.type_name}: dim={self.dim} must be > 0")
        if self.block_dim <= 0 or self.dim % self.block_dim != 0:
            raise cfg.error(f"{self.type_name}: block-dim={self.block_dim} must be > 0 "
                            f"and divide dim={self.dim}")

    # -- file format -------------------------------------------------------------
    @classmethod
    def read(cls, reader: KaldiReader) -> "NonlinearComponent":
        c = cls()
        expect_open_token(reader, cls.type_name, "<Dim>")
        c.dim = reader.read_int()
        if reader.peek_token() == "<BlockDim>":
            reader.read_token()
            c.block_dim = reader.read_int()
        else:
            c.block_dim = c.dim
        reader.expect_token("<ValueAvg>")
        value_avg = reader.read_vector().astype(np.float64)
        reader.expect_token("<DerivAvg>")
        deriv_avg = reader.read_vector().astype(np.float64)
        reader.expect_token("<Count>")
        c.count = read_double(reader)
        if reader.peek_token() == "<OderivRms>":
            reader.read_token()
            rms = reader.read_vector().astype(np.float64)
            reader.expect_token("<OderivCount>")
            c.oderiv_count = read_double(reader)
            c.oderiv_sumsq = rms * rms * c.oderiv_count
        else:
            c.oderiv_count = 0.0
            c.oderiv_sumsq = np.zeros(0)
        # stored count-normalised; kept as sums
        c.value_sum = value_avg * c.count
        c.deriv_sum = deriv_avg * c.count
        end = f"</{cls.type_name}>"
        tok = read_optional_fields(reader, c, cls._TAIL_FIELDS, reader.read_token())
        if tok != end:
            raise reader.error(f"expected {end}, got {tok!r}")
        return c

    def write(self, writer: KaldiWriter) -> None:
        writer.write_token(f"<{self.type_name}>")
        writer.write_token("<Dim>")
        writer.write_int(self.dim)
        if self.block_dim != self.dim:
            writer.write_token("<BlockDim>")
            writer.write_int(self.block_dim)
        writer.write_token("<ValueAvg>")
        writer.write_vector(self.value_sum / self.count if self.count != 0 else self.value_sum)
        writer.write_token("<DerivAvg>")
        writer.write_vector(self.deriv_sum / self.count if self.count != 0 else self.deriv_sum)
        writer.write_token("<Count>")
        write_double(writer, self.count)
        writer.write_token("<OderivRms>")
        sq = (self.oderiv_sumsq / self.oderiv_count if self.oderiv_count != 0
              else self.oderiv_sumsq)
        writer.write_vector(np.sqrt(np.maximum(sq, 0.0)))
        writer.write_token("<OderivCount>")
        write_double(writer, self.oderiv_count)
        writer.write_token("<NumDimsSelfRepaired>")
        write_double(writer, self.num_dims_self_repaired)
        writer.write_token("<NumDimsProcessed>")
        write_double(writer, self.num_dims_processed)
        if self.self_repair_lower_threshold != UNSET_THRESHOLD:
            writer.write_token("<SelfRepairLowerThreshold>")
            writer.write_float(self.self_repair_lower_threshold)
        if self.self_repair_upper_threshold != UNSET_THRESHOLD:
            writer.write_token("<SelfRepairUpperThreshold>")
            writer.write_float(self.self_repair_upper_threshold)
        if self.self_repair_scale != 0.0:
            writer.write_token("<SelfRepairScale>")
            writer.write_float(self.self_repair_scale)
        writer.write_token(f"</{self.type_name}>")

    # -- statistics ----------------------------------------------------------------
    def _store_stats_internal(self, out_value, deriv) -> None:
        """Kaldi's StoreStatsInternal: row sums of the output (and of the
        nonlinearity's derivative, if given) plus the row count."""
        if self.value_sum.size != self.dim:
            self.value_sum = np.zeros(self.dim)
            self.count = 0.0
        if deriv is not None and self.deriv_sum.size != self.dim:
            self.deriv_sum = np.zeros(self.dim)
            self.count = 0.0
            self.value_sum[:] = 0.0
        self.count += out_value.shape[0]
        self.value_sum += to_numpy(out_value.sum(axis=0)).astype(np.float64)
        if deriv is not None:
            self.deriv_sum += to_numpy(deriv.sum(axis=0)).astype(np.float64)

    def _store_backprop_stats(self, out_deriv) -> None:
        """Kaldi's StoreBackpropStats: output-derivative sum of squares, about one
        minibatch in four (always the first)."""
        if get_rng(self).integers(0, 4) == 0 and self.oderiv_count != 0:
            return
        if self.oderiv_sumsq.size != self.dim:
            self.oderiv_sumsq = np.zeros(self.dim)
            self.oderiv_count = 0.0
        self.oderiv_sumsq += to_numpy((out_deriv * out_deriv).sum(axis=0)).astype(np.float64)
        self.oderiv_count += out_deriv.shape[0]

    def _skip_this_stats_minibatch(self) -> bool:
        # Kaldi stores activation stats on about every other minibatch (but always
        # on the first one).
        return bool(get_rng(self).integers(0, 2) == 0 and self.count != 0)

    def zero_stats(self) -> None:
        self.value_sum = np.zeros_like(self.value_sum)
        self.deriv_sum = np.zeros_like(self.deriv_sum)
        self.oderiv_sumsq = np.zeros_like(self.oderiv_sumsq)
        self.count = 0.0
        self.oderiv_count = 0.0
        self.num_dims_self_repaired = 0.0
        self.num_dims_processed = 0.0

    def scale(self, alpha: float) -> None:
        self.value_sum = self.value_sum * alpha
        self.deriv_sum = self.deriv_sum * alpha
        self.oderiv_sumsq = self.oderiv_sumsq * alpha
        self.count *= alpha
        self.oderiv_count *= alpha
        self.num_dims_self_repaired *= alpha
        self.num_dims_processed *= alpha

    def add(self, alpha: float, other: "Component") -> None:
        assert isinstance(other, NonlinearComponent)
        for name in ("value_sum", "deriv_sum", "oderiv_sumsq"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if theirs.size != 0:
                if mine.size == 0:
                    mine = np.zeros(theirs.size)
                setattr(self, name, mine + alpha * theirs)
        self.count += alpha * other.count
        self.oderiv_count += alpha * other.oderiv_count
        self.num_dims_self_repaired += alpha * other.num_dims_self_repaired
        self.num_dims_processed += alpha * other.num_dims_processed

    def _check_self_repair_scale(self) -> None:
        if not 0.0 < self.self_repair_scale < 0.1:
            from engine.core.errors import ComponentError  # noqa: PLC0415
            raise ComponentError(f"self-repair-scale={self.self_repair_scale:g} must be in "
                                 "(0, 0.1)", component=self.label())


# --------------------------------------------------------------------------------------


#: NumPy sigmoids of at most this many elements are SciPy's ``expit``, larger ones (and
#: every sigmoid of another array module) the exp form below.  Both are float32/float64
#: logistics within a few ulps of the exact value (on 1.1 * 10^6 random inputs, normal
#: results: expit, 1 / (1 + exp(-x)) element by element, at most 2.3 ulps off; the exp
#: form 3.4, as Kaldi's two-branch ScalarSigmoid vectorised), except that for x < -88.72,
#: where the logistic is subnormal in float32, expit gives 0 (1 + exp(-x) overflows) and
#: the exp form the subnormal.  So the choice is one of speed: expit is one ufunc call,
#: a scalar loop (0.6 us for 128 elements, 3.2 us for 1024, 150 us for 57,600 on an
#: Intel Xeon), the exp form four calls of NumPy's vector loops (1.6, 2.5 and 46 us).
#: A BLSTM's gates are 128-element sigmoids at batch 1 (900 of them per 150 frames) and
#: 1024-element ones at batch 8.  The fast forms (engine/runtime/fastpaths.py) make the
#: same choice on the same size, so they give the same bits.  Where the two cross depends on
#: the host (one call, fastest of seven rounds: 768 elements 4.11 against 2.58 us, 384 2.25
#: against 1.99, 256 1.64 against 1.81 on an Intel Xeon model 167, whose SIMD exp is fast;
#: 768 on the host that first set it), and an LSTM step takes its i and f gates in one call
#: of twice a gate's size: from 768 down to 512, a TDNN-LSTM step of 3 x 256 per gate takes
#: the exp form, 150x1 forward 10.47 -> 9.61 ms, 21x1 2.10 -> 1.97 ms (model 167, the two
#: settings alternated in one process; BLSTM and batch-8 gates are outside the change).
SMALL_SIGMOID = 512
#: the exp form's input is capped here: below ln(largest float32) = 88.7228, so exp stays
#: finite, and the logistic of anything above it is 1 in float32 and in float64
EXP_INPUT_MAX = 88.72
_EXPIT: list = []


def expit():
    """SciPy's ``expit`` ufunc, imported on first use (SciPy takes ~0.2 s to import), or
    None where SciPy cannot be imported (a dependency, but an environment may lack
    it: every sigmoid then takes the exp form, component and fast forms alike).
    Importing scipy.special also loads SciPy's own OpenBLAS (its ``_ufuncs`` extension
    links it): a second BLAS in the process, which no computation here calls (its
    threads stay idle); engine.runtime.blas leaves it out of what it reports and
    engine.runtime.parallel out of what it holds to one thread."""
    if not _EXPIT:
        try:
            from scipy.special import expit as f  # noqa: PLC0415
        except ImportError:
            f = None
        _EXPIT.append(f)
    return _EXPIT[0]


def small_sigmoid(xp, x) -> bool:
    """Whether the sigmoid of ``x`` is SciPy's expit (see SMALL_SIGMOID)."""
    return (xp is np and x.size <= SMALL_SIGMOID and x.dtype in _EXPIT_TYPES
            and expit() is not None)


_EXPIT_TYPES = (np.dtype(np.float32), np.dtype(np.float64))


def sigmoid(xp, x):
    """The logistic of ``x``, as SigmoidComponent and LstmNonlinearityComponent compute
    it: SciPy's expit for a small array (SMALL_SIGMOID), else the exp form
    u / (1 + u) with u = exp(min(x, EXP_INPUT_MAX)) (Kaldi's ScalarSigmoid takes this
    form for x <= 0 and 1 / (1 + exp(-x)) above; one form needs no masked select:
    u = 0 gives 0, a u so large that 1 + u == u gives 1, NaN stays NaN)."""
    if small_sigmoid(xp, x):
        return expit()(x)
    u = xp.exp(xp.minimum(x, EXP_INPUT_MAX))
    return u / (1.0 + u)


# the properties of the elementwise activations
_ACTIVATION_PROPS = (P.SIMPLE_COMPONENT | P.BACKPROP_NEEDS_OUTPUT | P.PROPAGATE_IN_PLACE
                     | P.STORES_STATS)

# self-repair happens on about half of the minibatches, its scale divided by this
_REPAIR_PROBABILITY = 0.5


class _SelfRepairingActivation(NonlinearComponent):
    """Sigmoid, tanh and ReLU: an elementwise function whose derivative comes from the
    output, stats on about every other minibatch, self-repair in backprop."""

    def properties(self) -> P:
        return _ACTIVATION_PROPS

    def _function(self, xp, x):
        """The nonlinearity, elementwise."""
        raise NotImplementedError

    def _output_deriv(self, out_value):
        """The nonlinearity's derivative, as a function of its output."""
        raise NotImplementedError

    def _input_deriv(self, out_value, out_deriv):
        """The input derivative from the output and the output derivative."""
        return out_deriv * self._output_deriv(out_value)

    def _repair_gradients(self, out_value, in_deriv, to_update) -> None:
        """Self-repair: adds to ``in_deriv``, counts in ``to_update``."""
        raise NotImplementedError

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.dim)
        xp = array_module(in_value)
        out[...] = self._function(xp, in_value)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        self.check_shape("output derivative", out_deriv, out_value.shape[0], self.dim)
        in_deriv[...] = self._input_deriv(out_value, out_deriv)
        if isinstance(to_update, type(self)):
            self._repair_gradients(out_value, in_deriv, to_update)
            to_update._store_backprop_stats(out_deriv)

    def store_stats(self, in_value, out_value, memo) -> None:
        if self._skip_this_stats_minibatch():
            return
        self._store_stats_internal(out_value, self._output_deriv(out_value))

    def _below_lower_threshold(self, in_deriv, to_update, default_lower: float, name: str):
        """The first half of sigmoid and tanh self-repair: counts the dimensions processed
        and, if repair happens this time, returns the 0/1 mask (like ``in_deriv``) of the
        dimensions whose average derivative is below the lower threshold; else None."""
        to_update.num_dims_processed += self.dim
        if (self.self_repair_scale == 0.0 or self.count == 0.0
                or self.deriv_sum.size != self.dim
                or get_rng(to_update).random() > _REPAIR_PROBABILITY):
            return None
        self._check_self_repair_scale()
        if self.self_repair_upper_threshold != UNSET_THRESHOLD:
            from engine.core.errors import ComponentError  # noqa: PLC0415
            raise ComponentError(f"do not set self-repair-upper-threshold for {name} "
                                 "components, it does nothing", component=self.label())
        lower = (default_lower if self.self_repair_lower_threshold == UNSET_THRESHOLD
                 else self.self_repair_lower_threshold)
        lower = np.float32(lower) * np.float32(self.count)
        mask = ((lower - self.deriv_sum.astype(np.float32)) > 0).astype(np.float32)
        to_update.num_dims_self_repaired += float(mask.sum())
        xp = array_module(in_deriv)
        return xp.asarray(mask, dtype=in_deriv.dtype)


@register_component
class SigmoidComponent(_SelfRepairingActivation):
    type_name = "SigmoidComponent"

    def _function(self, xp, x):
        return sigmoid(xp, x)

    def _output_deriv(self, out_value):
        return out_value * (1.0 - out_value)

    def _input_deriv(self, out_value, out_deriv):
        # in this order (out_deriv * _output_deriv would round differently)
        return out_deriv * out_value * (1.0 - out_value)

    def _repair_gradients(self, out_value, in_deriv, to_update) -> None:
        # the derivative is at most 0.25; dimensions whose average derivative is
        # below the threshold get a term that pushes the input towards zero.
        m = self._below_lower_threshold(in_deriv, to_update, 0.05, "sigmoid")
        if m is not None:
            s = self.self_repair_scale / _REPAIR_PROBABILITY
            in_deriv += (-2.0 * s) * out_value * m + s * m


@register_component
class TanhComponent(_SelfRepairingActivation):
    type_name = "TanhComponent"

    def _function(self, xp, x):
        return xp.tanh(x)

    def _output_deriv(self, out_value):
        return 1.0 - out_value * out_value

    def _repair_gradients(self, out_value, in_deriv, to_update) -> None:
        m = self._below_lower_threshold(in_deriv, to_update, 0.2, "tanh")
        if m is not None:
            in_deriv += (-self.self_repair_scale / _REPAIR_PROBABILITY) * out_value * m


_RELU_BLOCKS_PROPS = _ACTIVATION_PROPS | P.INPUT_CONTIGUOUS


@register_component
class RectifiedLinearComponent(_SelfRepairingActivation):
    type_name = "RectifiedLinearComponent"

    def properties(self) -> P:
        return _ACTIVATION_PROPS if self.block_dim == self.dim else _RELU_BLOCKS_PROPS

    def _function(self, xp, x):
        return xp.maximum(x, 0)

    def _output_deriv(self, out_value):
        return (out_value > 0).astype(out_value.dtype)

    def _input_deriv(self, out_value, out_deriv):
        return out_deriv * (out_value > 0)   # the boolean mask, no float copy

    def _repair_gradients(self, out_value, in_deriv, to_update) -> None:
        # Dimensions that are almost never active (average derivative below the lower
        # threshold) are pushed up, almost always active ones pushed down.  With
        # block-dim < dim, the statistics are averaged over the blocks and the term is
        # added per block.
        dim, block_dim = self.dim, self.block_dim
        if self.self_repair_scale == 0.0 or self.count == 0.0 or self.deriv_sum.size != dim:
            return
        if get_rng(to_update).random() > _REPAIR_PROBABILITY:
            return
        to_update.num_dims_processed += block_dim
        self._check_self_repair_scale()
        count = np.float32(self.count)
        lower = np.float32(0.05 if self.self_repair_lower_threshold == UNSET_THRESHOLD
                           else self.self_repair_lower_threshold) * count
        upper = np.float32(0.95 if self.self_repair_upper_threshold == UNSET_THRESHOLD
                           else self.self_repair_upper_threshold) * count
        if block_dim == dim:
            stats = self.deriv_sum.astype(np.float32)
        else:
            stats = (self.deriv_sum.reshape(dim // block_dim, block_dim).sum(axis=0)
                     * (block_dim / dim)).astype(np.float32)
        above_lower = (stats - lower > 0).astype(np.float32)
        above_upper = (stats - upper > 0).astype(np.float32)
        direction = above_lower + above_upper - 1.0  # -1 below lower, +1 above upper
        to_update.num_dims_self_repaired += float((direction * direction).sum())
        term = direction * np.float32(-self.self_repair_scale / _REPAIR_PROBABILITY)
        xp = array_module(in_deriv)
        t = xp.asarray(term, dtype=in_deriv.dtype)
        # the same per-block term for every block of the row
        in_deriv += xp.tile(t, dim // block_dim)


@register_component
class SoftmaxComponent(NonlinearComponent):
    type_name = "SoftmaxComponent"

    def properties(self) -> P:
        return (P.SIMPLE_COMPONENT | P.PROPAGATE_IN_PLACE | P.BACKPROP_IN_PLACE
                | P.BACKPROP_NEEDS_OUTPUT | P.STORES_STATS)

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.dim)
        xp = array_module(in_value)
        e = xp.exp(in_value - in_value.max(axis=1, keepdims=True))
        y = e / e.sum(axis=1, keepdims=True)
        # Kaldi floors the output so that later logs cannot overflow
        out[...] = xp.maximum(y, 1.0e-20)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if isinstance(to_update, SoftmaxComponent):
            to_update._store_backprop_stats(out_deriv)
        if in_deriv is None:
            return
        self.check_shape("output derivative", out_deriv, out_value.shape[0], self.dim)
        pe = (out_value * out_deriv).sum(axis=1, keepdims=True)
        in_deriv[...] = out_value * out_deriv - out_value * pe

    def store_stats(self, in_value, out_value, memo) -> None:
        # activation statistics only, on every minibatch (as Kaldi)
        self._store_stats_internal(out_value, None)


_LOG_SOFTMAX_PROPS = P.SIMPLE_COMPONENT | P.BACKPROP_NEEDS_OUTPUT | P.STORES_STATS


@register_component
class LogSoftmaxComponent(NonlinearComponent):
    type_name = "LogSoftmaxComponent"

    def properties(self) -> P:
        return _LOG_SOFTMAX_PROPS

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.dim)
        xp = array_module(in_value)
        shifted = in_value - in_value.max(axis=1, keepdims=True)
        out[...] = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if isinstance(to_update, LogSoftmaxComponent):
            to_update._store_backprop_stats(out_deriv)
        if in_deriv is None:
            return
        self.check_shape("output derivative", out_deriv, out_value.shape[0], self.dim)
        xp = array_module(out_value)
        in_deriv[...] = out_deriv - xp.exp(out_value) * out_deriv.sum(axis=1, keepdims=True)

    def store_stats(self, in_value, out_value, memo) -> None:
        # Kaldi's LogSoftmaxComponent inherits NonlinearComponent's no-op StoreStats
        # despite declaring kStoresStats.
        return None
