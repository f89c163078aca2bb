"""The Component interface (Kaldi's nnet-component-itf.h) and the component registry.

A component maps an input matrix to an output matrix (rows = Indexes).  Simple
components map row i to row i; non-simple ones (convolution over time,
statistics pooling, attention, distribute, TDNN) declare the input Indexes an
output Index needs and may precompute per-computation index data.

Conventions shared by every component module:

- Matrices are 2-D float32 arrays of the backend in use (``numpy`` or
  ``cupy``); ``xp = array_module(in_value)`` picks the module, so the same code
  runs on both.  Vectorised maths only, no per-row Python loops.
- ``propagate`` writes into ``out`` (or adds, if the PROPAGATE_ADDS flag is
  declared) and returns a memo (or None).  ``out`` may alias ``in_value`` when
  PROPAGATE_IN_PLACE is declared.
- ``backprop`` writes (or adds, BACKPROP_ADDS) ``in_deriv`` when it is not None,
  and when ``to_update`` is not None accumulates ``to_update.learning_rate *
  gradient`` into ``to_update``'s parameters (Kaldi's plain gradient: in
  gradient mode, after ``set_as_gradient()``, the learning rate is 1 and the
  parameters start at zero).  Natural-gradient components use the plain
  gradient when ``to_update.is_gradient`` is set.
- File format: the registry reads the opening ``<TypeName>`` token and calls
  ``cls.read(reader)``, which must consume up to and including the closing
  ``</TypeName>``; ``write(writer)`` writes both tokens.
- ``PARAMS`` names the trainable array attributes (in Kaldi's vectorisation
  order); ``ARRAYS`` names further non-trainable arrays.  Generic
  copy/scale/add/gradient/backend handling derives from these lists.
"""

from __future__ import annotations

import copy as _copy
from enum import IntFlag
from typing import Any, Callable, ClassVar, Iterable

import numpy as np

from engine.core.errors import ComponentError, ConfigError, DimensionError, ModelFormatError
from engine.core.index import Index, array_to_indexes, as_index_rows
from engine.core.xp import to_numpy
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter


class ComponentProperty(IntFlag):
    """Kaldi's ComponentProperties bit flags (same values)."""

    NONE = 0
    SIMPLE_COMPONENT = 0x001
    UPDATABLE_COMPONENT = 0x002
    PROPAGATE_IN_PLACE = 0x004
    PROPAGATE_ADDS = 0x008
    REORDERS_INDEXES = 0x010
    BACKPROP_ADDS = 0x020
    BACKPROP_NEEDS_INPUT = 0x040
    BACKPROP_NEEDS_OUTPUT = 0x080
    BACKPROP_IN_PLACE = 0x100
    STORES_STATS = 0x200
    INPUT_CONTIGUOUS = 0x400
    OUTPUT_CONTIGUOUS = 0x800
    USES_MEMO = 0x1000
    RANDOM_COMPONENT = 0x2000


P = ComponentProperty


class MiscComputationInfo:
    """Kaldi passes this (currently empty) struct to the index functions."""


class ComponentPrecomputedIndexes:
    """Base for per-computation index data of non-simple components.

    Subclasses hold NumPy arrays; ``to_backend(xp)`` returns a copy whose arrays
    live on that backend (the executor calls it once per computation).
    ``to_data``/``from_data`` give a plain-data form (dict of lists/ints/floats)
    so computations can be cached without pickle.
    """

    def to_backend(self, xp) -> "ComponentPrecomputedIndexes":
        new = _copy.copy(self)
        for k, v in vars(self).items():
            if isinstance(v, np.ndarray):
                setattr(new, k, xp.asarray(v))
        return new

    def to_data(self) -> dict:
        out = {}
        for k, v in vars(self).items():
            if isinstance(v, np.ndarray):
                out[k] = {"__array__": v.tolist(), "dtype": str(v.dtype)}
            else:
                out[k] = v
        return out

    @classmethod
    def from_data(cls, data: dict) -> "ComponentPrecomputedIndexes":
        obj = cls.__new__(cls)
        for k, v in data.items():
            if isinstance(v, dict) and "__array__" in v:
                v = np.asarray(v["__array__"], dtype=v["dtype"])
            setattr(obj, k, v)
        return obj


# --------------------------------------------------------------------------------------
# registry


COMPONENT_TYPES: dict[str, type["Component"]] = {}


def register_component(cls: type["Component"]) -> type["Component"]:
    """Class decorator: make ``cls`` known under its Kaldi type name."""
    name = cls.type_name
    if not name:
        raise TypeError(f"{cls.__name__} has no type_name")
    COMPONENT_TYPES[name] = cls
    return cls


def _ensure_loaded() -> None:
    # Importing the package registers every component module.
    import engine.nnet.components  # noqa: F401, PLC0415


def component_class(type_name: str) -> type["Component"] | None:
    _ensure_loaded()
    return COMPONENT_TYPES.get(type_name)


def new_component_from_config(type_name: str, cfg: ConfigLine, name: str = "",
                              rng: np.random.Generator | None = None) -> "Component":
    """Create and initialise a component from its config options (``type=`` already taken).

    Raises ConfigError naming the component, the option and the reason; unknown
    options are an error, as in Kaldi.
    """
    cls = component_class(type_name)
    if cls is None:
        raise cfg.error(f"unknown component type {type_name!r}"
                        + (f" for component {name!r}" if name else ""))
    comp = cls()
    comp.name = name
    try:
        comp.init_from_config(cfg, rng if rng is not None else np.random.default_rng())
    except ConfigError as e:
        if (name and repr(name) in e.reason) or (not name and type_name in e.reason):
            raise
        who = f"component {name!r} ({type_name})" if name else type_name
        raise ConfigError(f"{who}: {e.reason}", source=e.source, line=e.line,
                          text=e.text) from None
    except (ComponentError, ValueError) as e:
        raise cfg.error(f"component {name!r} ({type_name}): {e}") from None
    except (MemoryError, OverflowError) as e:
        raise cfg.error(f"component {name!r} ({type_name}): its sizes are out of range "
                        f"({type(e).__name__}: {e})") from None
    unused = cfg.unused()
    if unused:
        raise cfg.error(f"component {name!r} ({type_name}): unknown option(s) "
                        f"{', '.join(unused)}")
    return comp


def read_component(reader: KaldiReader, name: str = "") -> "Component":
    """Read one component: ``<TypeName> ... </TypeName>``."""
    start = reader.pos
    tok = reader.read_token()
    if len(tok) < 3 or tok[0] != "<" or tok[-1] != ">":
        raise reader.error(f"expected a component type token like <AffineComponent>, got {tok!r}",
                           offset=start)
    type_name = tok[1:-1]
    cls = component_class(type_name)
    if cls is None:
        raise reader.error(f"unknown component type {type_name!r}"
                           + (f" (component {name!r})" if name else ""), offset=start)
    try:
        comp = cls.read(reader)
    except ModelFormatError:
        raise
    except (ComponentError, ValueError, IndexError, KeyError) as e:
        raise reader.error(f"while reading {type_name} {name!r}: {e}", offset=start) from None
    comp.name = name
    return comp


def write_component(comp: "Component", writer: KaldiWriter) -> None:
    comp.write(writer)


# --------------------------------------------------------------------------------------
# the interface


class Component:
    """Base of every nnet3 component.  See the module docstring for conventions."""

    type_name: ClassVar[str] = ""
    PARAMS: ClassVar[tuple[str, ...]] = ()
    ARRAYS: ClassVar[tuple[str, ...]] = ()
    # the statistics it keeps (what ``store_stats`` and a backprop's ``to_update`` add
    # to, and ``zero_stats`` clears)
    STAT_FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.name = ""

    # -- identity --------------------------------------------------------------
    def properties(self) -> ComponentProperty:
        raise NotImplementedError(f"{type(self).__name__}.properties")

    def input_dim(self) -> int:
        raise NotImplementedError(f"{type(self).__name__}.input_dim")

    def output_dim(self) -> int:
        raise NotImplementedError(f"{type(self).__name__}.output_dim")

    def label(self) -> str:
        return f"{self.name!r} ({self.type_name})" if self.name else self.type_name

    def info(self) -> str:
        """One-line summary like nnet3-info's component lines."""
        return (f"type={self.type_name}, input-dim={self.input_dim()}, "
                f"output-dim={self.output_dim()}")

    # -- config / files ----------------------------------------------------------
    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        raise NotImplementedError(f"{type(self).__name__}.init_from_config")

    @classmethod
    def read(cls, reader: KaldiReader) -> "Component":
        raise NotImplementedError(f"{cls.__name__}.read")

    def write(self, writer: KaldiWriter) -> None:
        raise NotImplementedError(f"{type(self).__name__}.write")

    def to_text(self) -> str:
        w = KaldiWriter(binary=False)
        self.write(w)
        return w.getvalue().decode("ascii")

    # -- maths ---------------------------------------------------------------------
    def propagate(self, indexes: ComponentPrecomputedIndexes | None, in_value, out) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.propagate")

    def backprop(self, debug_info: str, indexes: ComponentPrecomputedIndexes | None,
                 in_value, out_value, out_deriv, memo: Any,
                 to_update: "Component | None", in_deriv) -> None:
        raise NotImplementedError(f"{type(self).__name__}.backprop")

    def store_stats(self, in_value, out_value, memo: Any) -> None:
        """Accumulate stats (only components with STORES_STATS do anything)."""

    def zero_stats(self) -> None:
        pass

    def stats(self) -> dict[str, np.ndarray]:
        """The statistics (``STAT_FIELDS``) as float64 host arrays (0-d for counts)."""
        return {f: np.array(to_numpy(getattr(self, f)), dtype=np.float64)
                for f in self.STAT_FIELDS}

    # -- non-simple components: index interface -------------------------------------
    def get_input_indexes(self, misc_info: MiscComputationInfo | None,
                          output_index: Index) -> list[Index]:
        """Indexes at the input node this output Index depends on (simple: itself)."""
        return [output_index]

    def is_computable(self, misc_info: MiscComputationInfo | None, output_index: Index,
                      input_index_set: Callable[[Index], bool],
                      used_inputs: list[Index] | None) -> bool:
        """Whether ``output_index`` can be computed given the available inputs.

        ``input_index_set(index)`` says whether an input Index is available.  If
        ``used_inputs`` is a list, it is filled with the input Indexes the
        computation will use (only meaningful when the answer is True).
        """
        needed = self.get_input_indexes(misc_info, output_index)
        for i in needed:
            if not input_index_set(i):
                return False
        if used_inputs is not None:
            used_inputs[:] = needed
        return True

    def reorder_indexes(self, input_indexes: list[Index],
                        output_indexes: list[Index]) -> tuple[list[Index], list[Index]]:
        """Components with REORDERS_INDEXES may reorder/pad (blank Index t=kNoTime)."""
        return input_indexes, output_indexes

    def precompute_indexes(self, misc_info: MiscComputationInfo | None,
                           input_indexes: list[Index], output_indexes: list[Index],
                           need_backprop: bool) -> ComponentPrecomputedIndexes | None:
        return None

    # -- parameters ------------------------------------------------------------------
    @property
    def is_updatable(self) -> bool:
        return bool(self.properties() & P.UPDATABLE_COMPONENT)

    def num_parameters(self) -> int:
        return int(sum(int(np.asarray(getattr(self, p)).size) for p in self.PARAMS))

    def param_arrays(self) -> list:
        return [getattr(self, p) for p in self.PARAMS]

    def copy(self) -> "Component":
        return _copy.deepcopy(self)

    def set_zero(self) -> None:
        for p in self.PARAMS:
            getattr(self, p)[...] = 0

    def set_as_gradient(self) -> None:
        """Kaldi's SetAsGradient: learning rate 1, is_gradient, parameters zero."""
        if hasattr(self, "learning_rate"):
            self.learning_rate = 1.0
            self.is_gradient = True
        self.set_zero()

    def scale(self, alpha: float) -> None:
        for p in self.PARAMS:
            arr = getattr(self, p)
            arr *= alpha

    def add(self, alpha: float, other: "Component") -> None:
        for p in self.PARAMS:
            arr = getattr(self, p)
            arr += alpha * getattr(other, p)

    def to_backend(self, xp) -> "Component":
        """A copy whose arrays live on backend ``xp`` (numpy or cupy)."""
        new = _copy.copy(self)
        for p in self.PARAMS + self.ARRAYS:
            v = getattr(self, p)
            if v is not None:
                setattr(new, p, xp.asarray(v))
        return new

    def set_test_mode(self, test_mode: bool) -> None:
        """Batch-norm and dropout components switch to inference behaviour."""

    def couples_rows(self) -> bool:
        """Whether a row's output depends on the other rows of the same propagate
        (batch-norm in training mode: the minibatch's mean and variance), so that
        sequences computed together are not computed independently."""
        return False

    # -- helpers for subclasses -----------------------------------------------------------
    def check_shape(self, what: str, arr, rows: int | None, cols: int) -> None:
        if arr.ndim != 2 or arr.shape[1] != cols or (rows is not None and arr.shape[0] != rows):
            want = f"({rows if rows is not None else '*'}, {cols})"
            raise DimensionError(f"{what} has shape {tuple(arr.shape)}, expected {want}",
                                 component=self.label())


class ReorderOnRows:
    """Mixin (before Component in the bases) for a component whose reordering works on
    (k, 3) n, t, x int64 rows (``reorder_index_arrays``, what the compiler calls): the
    Index-list form converts and calls it."""

    def reorder_indexes(self, input_indexes, output_indexes):
        new_in, new_out = self.reorder_index_arrays(as_index_rows(input_indexes),
                                                    as_index_rows(output_indexes))
        return array_to_indexes(new_in), array_to_indexes(new_out)


class PrecomputeOnRows:
    """Mixin (before Component in the bases) for a component whose precomputed indexes
    are made from (k, 3) n, t, x int64 rows (``precompute_index_arrays``, what the
    compiler and the shortcut's expansion call): the Index-list form converts and calls
    it."""

    def precompute_indexes(self, misc_info, input_indexes, output_indexes, need_backprop):
        return self.precompute_index_arrays(misc_info, as_index_rows(input_indexes),
                                            as_index_rows(output_indexes), need_backprop)


class UpdatableComponent(Component):
    """Kaldi's UpdatableComponent: learning-rate fields and their file-format header."""

    def __init__(self) -> None:
        super().__init__()
        self.learning_rate = 0.001
        self.learning_rate_factor = 1.0
        self.is_gradient = False
        self.max_change = 0.0
        self.l2_regularize = 0.0

    def updatable_info(self) -> str:
        """The prefix of Kaldi's UpdatableComponent::Info()."""
        s = (f"{self.type_name}, input-dim={self.input_dim()}, output-dim={self.output_dim()}, "
             f"learning-rate={self.learning_rate:g}")
        if self.is_gradient:
            s += ", is-gradient=true"
        if self.l2_regularize != 0.0:
            s += f", l2-regularize={self.l2_regularize:g}"
        if self.learning_rate_factor != 1.0:
            s += f", learning-rate-factor={self.learning_rate_factor:g}"
        if self.max_change > 0.0:
            s += f", max-change={self.max_change:g}"
        return s

    def init_learning_rate_common(self, cfg: ConfigLine) -> None:
        self.learning_rate = cfg.get_float("learning-rate", 0.001)
        self.learning_rate_factor = cfg.get_float("learning-rate-factor", 1.0)
        self.max_change = cfg.get_float("max-change", 0.0)
        self.l2_regularize = cfg.get_float("l2-regularize", 0.0)

    def read_updatable_common(self, reader: KaldiReader) -> str:
        """Read the learning-rate header; return the next token if it is not
        ``<LearningRate>`` (Kaldi's ReadUpdatableCommon), else ''."""
        tok = reader.read_token()
        if tok == f"<{self.type_name}>":
            tok = reader.read_token()
        self.learning_rate_factor = 1.0
        self.is_gradient = False
        self.max_change = 0.0
        self.l2_regularize = 0.0
        if tok == "<LearningRateFactor>":
            self.learning_rate_factor = reader.read_float()
            tok = reader.read_token()
        if tok == "<IsGradient>":
            self.is_gradient = reader.read_bool()
            tok = reader.read_token()
        if tok == "<MaxChange>":
            self.max_change = reader.read_float()
            tok = reader.read_token()
        if tok == "<L2Regularize>":
            self.l2_regularize = reader.read_float()
            tok = reader.read_token()
        if tok == "<LearningRate>":
            self.learning_rate = reader.read_float()
            return ""
        return tok

    def write_updatable_common(self, writer: KaldiWriter) -> None:
        """Writes the opening ``<TypeName>`` token and the learning-rate header."""
        writer.write_token(f"<{self.type_name}>")
        if self.learning_rate_factor != 1.0:
            writer.write_token("<LearningRateFactor>")
            writer.write_float(self.learning_rate_factor)
        if self.is_gradient:
            writer.write_token("<IsGradient>")
            writer.write_bool(self.is_gradient)
        if self.max_change > 0.0:
            writer.write_token("<MaxChange>")
            writer.write_float(self.max_change)
        if self.l2_regularize > 0.0:
            writer.write_token("<L2Regularize>")
            writer.write_float(self.l2_regularize)
        writer.write_token("<LearningRate>")
        writer.write_float(self.learning_rate)


def updatable_info(comp: UpdatableComponent) -> str:
    """Kaldi's UpdatableComponent::Info prefix (function form for the component modules)."""
    return comp.updatable_info()


def iter_types() -> Iterable[str]:
    _ensure_loaded()
    return sorted(COMPONENT_TYPES)
