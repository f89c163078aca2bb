"""Helpers shared by the parameterised component modules (affine.py, block_affine.py,
scale_offset.py, constant.py, tdnn.py): Kaldi's ReadKaldiObject for ``matrix=`` /
``vector=`` style options, InitLearningRatesFromConfig's checks, config errors that
name the component, the token checks after ReadUpdatableCommon, UpdatableComponent::Info
and the summaries of PrintParameterStats (nnet-parse.cc), and shape checks that raise
DimensionError naming the component; the start of an updatable component's read (also
with a field table after the header, and the base of components whose file is header,
table and closing token), the ``<LinearParams>`` / ``<BiasParams>`` pair, and the
natural-gradient options these components read, keep and write (the preconditioner
itself is not implemented; see affine.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from pathlib import Path
from typing import ClassVar

import numpy as np

from engine.core.errors import ConfigError, ModelFormatError
from engine.core.xp import to_numpy
from engine.nnet.components.base import updatable_info  # noqa: F401  (re-exported)
from engine.nnet.components.base import Component, UpdatableComponent
from engine.nnet.components._fields import FLOAT, INT, FieldKind, read_fields, write_fields
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


# Parameters a config may make (random initial values, all components of one
# config together): 2^27 values are 512 MiB of float32, several times any Kaldi model
# (the largest reference layer holds 7M values), and a bound on what a config of a
# few bytes (dim=100000000) can make a service worker allocate.  apply_config counts
# them for the whole config (``planning``) before anything is drawn.
MAX_CONFIG_PARAMETERS = 1 << 27
# values drawn at a time: the float64 draw is converted to float32 block by block, so
# drawing an array costs its float32 size plus one block (8 MiB), not three times its
# float64 size; the values are the same as one draw of the whole array
_DRAW_BLOCK = 1 << 20
_budget: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "parameter_budget", default=None)
_planning: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "parameter_planning", default=None)


@contextlib.contextmanager
def parameter_budget(limit: int | None = None):
    """Within the block, the random parameters made by ``gaussian`` may total at
    most ``limit`` values (None: MAX_CONFIG_PARAMETERS, or the budget of an
    enclosing block when there is one); more raises ConfigError before anything is
    allocated."""
    if limit is None and _budget.get() is not None:
        yield
        return
    total = MAX_CONFIG_PARAMETERS if limit is None else int(limit)
    token = _budget.set([total, total])
    try:
        yield
    finally:
        _budget.reset(token)


@contextlib.contextmanager
def planning():
    """Within the block ``gaussian`` draws nothing and allocates nothing: it returns a
    read-only array of the asked shape that holds no memory (every entry the mean, a
    zero-stride view) and adds its size to the counter this yields (``[values]``).
    apply_config initialises a config's components this way first, to know their
    sizes (dimensions, parameter count) and check the whole config, before drawing
    anything.  A component initialised here must not be used for computing."""
    counter = [0]
    token = _planning.set(counter)
    try:
        yield counter
    finally:
        _planning.reset(token)


def budget_left() -> tuple[int, int]:
    """(values in all, values left) of the enclosing parameter_budget, or
    (MAX_CONFIG_PARAMETERS, MAX_CONFIG_PARAMETERS) outside one."""
    budget = _budget.get()
    if budget is None:
        return MAX_CONFIG_PARAMETERS, MAX_CONFIG_PARAMETERS
    return budget[1], budget[0]


def is_planning() -> bool:
    """Whether ``gaussian`` is counting, not drawing (see ``planning``)."""
    return _planning.get() is not None


def gaussian(rng: np.random.Generator, shape, stddev: float, mean: float = 0.0) -> np.ndarray:
    """Random initial parameters (float32), counted against the parameter budget
    (without one, a single array may not exceed MAX_CONFIG_PARAMETERS values); inside
    ``planning`` only counted."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    n = math.prod(int(d) for d in dims)
    if any(int(d) < 0 for d in dims):
        raise ConfigError(f"a parameter array of shape {dims} has a negative dimension")
    budget = _budget.get()
    limit = budget[0] if budget is not None else MAX_CONFIG_PARAMETERS
    if n > limit:
        if budget is None:
            raise ConfigError(f"a parameter array of shape {dims} would hold {n} values, more "
                              f"than the {MAX_CONFIG_PARAMETERS} a component may hold")
        raise ConfigError(f"a parameter array of shape {dims} would hold {n} values; the "
                          f"components of one config may hold {budget[1]} in all, and "
                          f"{limit} are left")
    plan = _planning.get()
    if plan is not None:
        plan[0] += n
        return np.broadcast_to(np.float32(mean), dims)
    if budget is not None:
        budget[0] -= n
    out = np.empty(dims, dtype=np.float32)
    flat = out.reshape(-1)
    for start in range(0, n, _DRAW_BLOCK):
        block = rng.standard_normal(min(_DRAW_BLOCK, n - start))
        block *= stddev
        block += mean
        flat[start:start + block.shape[0]] = block
    return out


def _g4(x: float) -> str:
    return f"{float(x):.4g}"


def param_stats(name: str, arr, include_mean: bool) -> str:
    """Kaldi's PrintParameterStats (the mean/stddev or rms part)."""
    a = to_numpy(arr).astype(np.float64)  # the parameters may live on a GPU
    if a.size == 0:
        return f", {name}-rms=0"
    if include_mean:
        mean = float(a.mean())
        std = math.sqrt(max(float((a * a).mean()) - mean * mean, 0.0))
        return f", {name}-{{mean,stddev}}={_g4(mean)},{_g4(std)}"
    return f", {name}-rms={_g4(math.sqrt(float((a * a).mean())))}"




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
# reading and writing parameters


def begin_updatable_read(cls, reader: KaldiReader, first_token: str):
    """A new ``cls`` with its UpdatableComponent header read and ``first_token`` after it."""
    c = cls()
    pending = c.read_updatable_common(reader)
    expect_after_common(reader, pending, first_token)
    return c


def read_updatable_fields(cls, reader: KaldiReader, fields):
    """A new ``cls`` with its UpdatableComponent header and then ``fields`` (a field
    table, see _fields) read; the header may already have consumed the first field's
    token."""
    token, attr, kind = fields[0]
    c = begin_updatable_read(cls, reader, token)
    setattr(c, attr, kind.read(reader))
    read_fields(reader, c, fields[1:])
    return c


class UpdatableFieldsComponent(UpdatableComponent):
    """An updatable component whose file is its UpdatableComponent header, then
    ``_FIELDS`` in order, then ``</Type>``; its read (the fields through
    read_updatable_fields) adds what older files may hold and the checks."""

    _FIELDS: ClassVar[tuple[tuple[str, str, FieldKind], ...]] = ()

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        write_fields(writer, self, self._FIELDS)
        writer.write_token(f"</{self.type_name}>")


def read_linear_and_bias(reader: KaldiReader, pending: str = ""):
    """``<LinearParams>`` matrix ``<BiasParams>`` vector, as (linear, bias); ``pending``
    is the token read_updatable_common already consumed, if any."""
    expect_after_common(reader, pending, "<LinearParams>")
    linear = reader.read_matrix()
    reader.expect_token("<BiasParams>")
    return linear, reader.read_vector()


def check_linear_and_bias(reader: KaldiReader, what: str, linear, bias) -> None:
    """A read error unless ``bias`` has one entry per row of ``linear`` (what the
    product-plus-bias of ``what``, a component type, needs)."""
    if bias.shape[0] != linear.shape[0]:
        raise reader.error(f"{what}: bias dimension {bias.shape[0]} != linear-params rows "
                           f"{linear.shape[0]}")


def write_linear_and_bias(writer: KaldiWriter, linear, bias) -> None:
    """``<LinearParams>`` matrix ``<BiasParams>`` vector."""
    writer.write_token("<LinearParams>")
    writer.write_matrix(linear)
    writer.write_token("<BiasParams>")
    writer.write_vector(bias)


def linear_and_bias_stats(comp) -> str:
    """The info() summaries of a component's linear_params and bias_params."""
    return (param_stats("linear-params", comp.linear_params, False)
            + param_stats("bias", comp.bias_params, True))


# --------------------------------------------------------------------------------------
# natural-gradient options


def rank_default(rank: int, dim: int, cap: int) -> int:
    """A natural-gradient rank option: as given, or if negative min(cap, (dim + 1) // 2)."""
    return rank if rank >= 0 else min(cap, (dim + 1) // 2)


# a field table (NaturalGradientPerElementScaleComponent's ends with it)
PERIOD_HISTORY_ALPHA = (("<UpdatePeriod>", "update_period", INT),
                        ("<NumSamplesHistory>", "num_samples_history", FLOAT),
                        ("<Alpha>", "alpha", FLOAT))


def read_period_history_alpha(reader: KaldiReader, comp) -> None:
    """``<UpdatePeriod>``, ``<NumSamplesHistory>`` and ``<Alpha>`` into ``comp``."""
    read_fields(reader, comp, PERIOD_HISTORY_ALPHA)


def write_period_history_alpha(writer: KaldiWriter, comp) -> None:
    """``<UpdatePeriod>``, ``<NumSamplesHistory>`` and ``<Alpha>`` of ``comp``."""
    write_fields(writer, comp, PERIOD_HISTORY_ALPHA)


def init_in_out_options(comp, cfg: ConfigLine, dim_in: int, dim_out: int,
                        rank_in_cap: int) -> None:
    """The config options use-natural-gradient, rank-in, rank-out, alpha-in, alpha-out of
    a component with an input and an output preconditioner (ranks from rank_default)."""
    comp.use_natural_gradient = cfg.get_bool("use-natural-gradient", True)
    rank_in = cfg.get_int("rank-in", -1)
    rank_out = cfg.get_int("rank-out", -1)
    comp.alpha_in = cfg.get_float("alpha-in", 4.0)
    comp.alpha_out = cfg.get_float("alpha-out", 4.0)
    comp.rank_in = rank_default(rank_in, dim_in, rank_in_cap)
    comp.rank_out = rank_default(rank_out, dim_out, 80)


def write_in_out_options(writer: KaldiWriter, comp, history_token: str,
                         history: float) -> None:
    """``<UseNaturalGradient>``, the history option, ``<AlphaInOut>`` and ``<RankInOut>``
    of a component with an input and an output preconditioner."""
    writer.write_token("<UseNaturalGradient>")
    writer.write_bool(comp.use_natural_gradient)
    writer.write_token(history_token)
    writer.write_float(history)
    writer.write_token("<AlphaInOut>")
    writer.write_float(comp.alpha_in)
    writer.write_float(comp.alpha_out)
    writer.write_token("<RankInOut>")
    writer.write_int(comp.rank_in)
    writer.write_int(comp.rank_out)
