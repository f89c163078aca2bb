"""CompositeComponent (Kaldi's nnet-simple-component.{h,cc}): a chain of simple
sub-components run as one component, through intermediate buffers, at most
max-rows-process rows at a time to bound memory; the backprop re-runs the forward pass
to get the intermediate values instead of keeping them.

Its parameters are those of its updatable sub-components, exposed under dotted names
``components.<i>.<param>`` (so the generic parameter, gradient and backend handling of
``Component`` works on it); copy/scale/add/gradient mode are delegated to the
sub-components as in Kaldi.
"""

from __future__ import annotations

import copy as _copy

import numpy as np

from engine.core.errors import ComponentError, ConfigError
from engine.core.xp import array_module
from engine.nnet.components._fields import BOOL, FLOAT, read_optional_fields
from engine.nnet.components.base import (
    Component,
    ComponentProperty as P,
    UpdatableComponent,
    new_component_from_config,
    read_component,
    register_component,
)
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

_PREFIX = "components."
# How deeply CompositeComponents may sit inside each other.  Kaldi's tools never nest
# them; running a component recurses once per level, so the depth must stay far below
# the interpreter's recursion limit.
MAX_NESTING = 32


def _nesting(comp: Component) -> int:
    """How many CompositeComponents deep ``comp`` is (0 for any other component)."""
    if not isinstance(comp, CompositeComponent):
        return 0
    return 1 + max((_nesting(c) for c in comp.components), default=0)


@register_component
class CompositeComponent(UpdatableComponent):
    type_name = "CompositeComponent"
    # Kaldi's (temporary) header code: only these optional fields before
    # <MaxRowsProcess>
    _HEADER_FIELDS = (("<LearningRateFactor>", "learning_rate_factor", FLOAT),
                      ("<IsGradient>", "is_gradient", BOOL),
                      ("<LearningRate>", "learning_rate", FLOAT))

    def __init__(self) -> None:
        super().__init__()
        self.components: list[Component] = []
        self.max_rows_process = 4096

    # -- dotted access to the sub-components' arrays ------------------------------------
    def __getattr__(self, name: str):
        # only called when normal lookup fails (also during copy/unpickle, before
        # 'components' exists: then it must just fail)
        if name.startswith(_PREFIX):
            comps = self.__dict__.get("components")
            if comps is not None:
                _, i, attr = name.split(".", 2)
                return getattr(comps[int(i)], attr)
        raise AttributeError(name)

    def __setattr__(self, name: str, value) -> None:
        if name.startswith(_PREFIX):
            _, i, attr = name.split(".", 2)
            setattr(self.components[int(i)], attr, value)
        else:
            object.__setattr__(self, name, value)

    @property
    def PARAMS(self) -> tuple[str, ...]:  # type: ignore[override]  # noqa: N802
        return tuple(f"{_PREFIX}{i}.{p}" for i, c in enumerate(self.components)
                     if c.properties() & P.UPDATABLE_COMPONENT for p in c.PARAMS)

    @property
    def ARRAYS(self) -> tuple[str, ...]:  # type: ignore[override]  # noqa: N802
        return tuple(f"{_PREFIX}{i}.{a}" for i, c in enumerate(self.components)
                     for a in c.ARRAYS)

    # -- identity ------------------------------------------------------------------
    def _init(self, components: list[Component], max_rows_process: int) -> None:
        if not components:
            raise ComponentError("CompositeComponent needs at least one sub-component",
                                 component=self.label())
        depth = 1 + max(_nesting(c) for c in components)
        if depth > MAX_NESTING:
            raise ComponentError(f"CompositeComponents nested {depth} deep (at most "
                                 f"{MAX_NESTING})", component=self.label())
        for i, c in enumerate(components):
            if not c.properties() & P.SIMPLE_COMPONENT:
                raise ComponentError(f"sub-component {i + 1} ({c.type_name}) is not simple",
                                     component=self.label())
            if i > 0 and c.input_dim() != components[i - 1].output_dim():
                raise ComponentError(
                    f"sub-component {i + 1} has input-dim {c.input_dim()} but sub-component "
                    f"{i} has output-dim {components[i - 1].output_dim()}",
                    component=self.label())
        self.components = components
        self.max_rows_process = max_rows_process

    def properties(self) -> P:
        # each sub-component asked once: with composites inside composites, asking
        # more often would cost exponential time in the nesting depth
        sub = [c.properties() for c in self.components]
        first, last = sub[0], sub[-1]
        # the input is always needed: the backprop recomputes the intermediate values
        p = (P.SIMPLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
             | (last & (P.PROPAGATE_ADDS | P.BACKPROP_NEEDS_OUTPUT | P.OUTPUT_CONTIGUOUS))
             | (first & (P.BACKPROP_ADDS | P.INPUT_CONTIGUOUS)))
        if any(s & P.UPDATABLE_COMPONENT for s in sub):
            p |= P.UPDATABLE_COMPONENT
        # stats of sub-components are stored during backprop, which then needs the
        # final output if the last one stores stats
        if last & P.STORES_STATS:
            p |= P.BACKPROP_NEEDS_OUTPUT
        return p

    def input_dim(self) -> int:
        return self.components[0].input_dim()

    def output_dim(self) -> int:
        return self.components[-1].output_dim()

    def info(self) -> str:
        parts = [f"sub-component{i + 1} = {{ {c.info()} }}"
                 for i, c in enumerate(self.components)]
        return f"{self.type_name} " + ", ".join(parts)

    # -- config / files ------------------------------------------------------------------
    def init_from_config(self, cfg: ConfigLine, rng: np.random.Generator) -> None:
        max_rows = cfg.get_int("max-rows-process", 4096)
        num = cfg.get_int("num-components")
        if num is None or num < 1:
            raise cfg.error("CompositeComponent: expected num-components= to be defined "
                            "and >= 1")
        comps: list[Component] = []
        for i in range(1, num + 1):
            key = f"component{i}"
            text = cfg.get_str(key)
            if text is None:
                raise cfg.error(f"CompositeComponent: expected {key}= to be defined")
            try:
                nested = ConfigLine(text, source=cfg.source, line=cfg.line)
            except ConfigError as e:
                raise cfg.error(f"CompositeComponent: could not parse {key}: {e.reason}") from None
            sub_type = nested.get_str("type")
            if sub_type is None or nested.first_token != "":
                raise cfg.error(f"CompositeComponent: {key}= must be 'type=... options' "
                                "with a component type")
            if sub_type == "CompositeComponent":
                raise cfg.error(f"CompositeComponent: {key}: a CompositeComponent may not be "
                                "nested in a CompositeComponent (reduce max-rows-process "
                                "instead)")
            try:
                sub = new_component_from_config(sub_type, nested, name=f"{self.name}.{key}",
                                                rng=rng)
            except ConfigError as e:
                raise cfg.error(f"CompositeComponent: {key}: {e.reason}") from None
            props = sub.properties()
            if props & P.RANDOM_COMPONENT or not props & P.SIMPLE_COMPONENT:
                raise cfg.error(f"CompositeComponent: {key}: disallowed component type "
                                f"{sub_type} (random or non-simple)")
            comps.append(sub)
        try:
            self._init(comps, max_rows)
        except ComponentError as e:
            raise cfg.error(f"CompositeComponent: {e.reason}") from None

    @classmethod
    def read(cls, reader: KaldiReader) -> "CompositeComponent":
        c = cls()
        tok = reader.read_token()
        if tok == "<CompositeComponent>":
            tok = reader.read_token()
        c.learning_rate_factor = 1.0
        c.is_gradient = False
        tok = read_optional_fields(reader, c, cls._HEADER_FIELDS, tok)
        if tok != "<MaxRowsProcess>":
            raise reader.error(f"expected token <MaxRowsProcess>, got {tok!r}")
        max_rows = reader.read_int()
        reader.expect_token("<NumComponents>")
        num = reader.read_int()
        if num < 0 or num > 100000:
            raise reader.error(f"bad number of sub-components {num}")
        comps = [read_component(reader, name=f"component{i + 1}") for i in range(num)]
        c._init(comps, max_rows)
        reader.expect_token("</CompositeComponent>")
        return c

    def write(self, writer: KaldiWriter) -> None:
        self.write_updatable_common(writer)
        writer.write_token("<MaxRowsProcess>")
        writer.write_int(self.max_rows_process)
        writer.write_token("<NumComponents>")
        writer.write_int(len(self.components))
        for c in self.components:
            c.write(writer)
        writer.write_token("</CompositeComponent>")

    # -- parameters (delegated) --------------------------------------------------------
    def num_parameters(self) -> int:
        return sum(c.num_parameters() for c in self.components
                   if c.properties() & P.UPDATABLE_COMPONENT)

    def copy(self) -> "CompositeComponent":
        return _copy.deepcopy(self)

    def set_zero(self) -> None:
        for c in self.components:
            c.set_zero()

    def set_as_gradient(self) -> None:
        # as the base class: learning rate 1, is-gradient, parameters zero (of every
        # updatable sub-component)
        self.learning_rate = 1.0
        self.is_gradient = True
        for c in self.components:
            if c.properties() & P.UPDATABLE_COMPONENT:
                c.set_as_gradient()

    def scale(self, alpha: float) -> None:
        for c in self.components:
            c.scale(alpha)

    def add(self, alpha: float, other: Component) -> None:
        if not isinstance(other, CompositeComponent) or len(other.components) != len(
                self.components):
            raise ComponentError("mismatching CompositeComponent topologies",
                                 component=self.label())
        for mine, theirs in zip(self.components, other.components):
            mine.add(alpha, theirs)

    def couples_rows(self) -> bool:
        return any(c.couples_rows() for c in self.components)

    def zero_stats(self) -> None:
        for c in self.components:
            c.zero_stats()

    @property
    def STAT_FIELDS(self) -> tuple[str, ...]:  # type: ignore[override]  # noqa: N802
        return tuple(f"{_PREFIX}{i}.{f}" for i, c in enumerate(self.components)
                     for f in c.STAT_FIELDS)

    def stats(self) -> dict:
        return {f"{_PREFIX}{i}.{k}": v for i, c in enumerate(self.components)
                for k, v in c.stats().items()}

    def to_backend(self, xp) -> "CompositeComponent":
        new = _copy.copy(self)
        object.__setattr__(new, "components", [c.to_backend(xp) for c in self.components])
        return new

    # -- maths ---------------------------------------------------------------------------
    @staticmethod
    def _buffer(xp, comp: Component, rows: int, cols: int, dtype, adds_flag: P):
        if comp.properties() & adds_flag:
            return xp.zeros((rows, cols), dtype=dtype)
        return xp.empty((rows, cols), dtype=dtype)

    def _chunks(self, rows: int):
        step = self.max_rows_process
        if step > 0 and rows > step:
            return [(r, min(r + step, rows)) for r in range(0, rows, step)]
        return [(0, rows)]

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.input_dim())
        self.check_shape("output", out, in_value.shape[0], self.output_dim())
        for r0, r1 in self._chunks(in_value.shape[0]):
            self._propagate_part(in_value[r0:r1], out[r0:r1])
        return None

    def _propagate_part(self, in_value, out) -> None:
        xp = array_module(in_value)
        rows = in_value.shape[0]
        cur = in_value
        last = len(self.components) - 1
        for i, c in enumerate(self.components):
            dest = out if i == last else self._buffer(xp, c, rows, c.output_dim(),
                                                      in_value.dtype, P.PROPAGATE_ADDS)
            c.propagate(None, cur, dest)  # memos are regenerated in backprop
            cur = dest

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        self.check_shape("input", in_value, None, self.input_dim())
        self.check_shape("output derivative", out_deriv, in_value.shape[0], self.output_dim())
        have_out = out_value is not None and out_value.shape[0] != 0
        for r0, r1 in self._chunks(in_value.shape[0]):
            self._backprop_part(debug_info, in_value[r0:r1],
                                out_value[r0:r1] if have_out else None,
                                out_deriv[r0:r1], to_update,
                                in_deriv[r0:r1] if in_deriv is not None else None)

    def _backprop_part(self, debug_info, in_value, out_value, out_deriv, to_update,
                       in_deriv) -> None:
        xp = array_module(in_value)
        comps = self.components
        num = len(comps)
        rows = in_value.shape[0]
        dtype = in_value.dtype
        # which forward values are needed again: the last component's only if it uses
        # a memo; the last-but-one's only if either side of it needs it
        num_prop = num
        if not comps[-1].properties() & P.USES_MEMO:
            num_prop -= 1
            if num > 1:
                prev, nxt = comps[-2].properties(), comps[-1].properties()
                if not prev & (P.BACKPROP_NEEDS_OUTPUT | P.USES_MEMO) and \
                        not nxt & P.BACKPROP_NEEDS_INPUT:
                    num_prop -= 1
        outputs: list = [None] * num
        memos: list = [None] * num
        for i in range(num_prop):
            buf = self._buffer(xp, comps[i], rows, comps[i].output_dim(), dtype,
                               P.PROPAGATE_ADDS)
            memos[i] = comps[i].propagate(None, in_value if i == 0 else outputs[i - 1], buf)
            outputs[i] = buf
        upd_list = to_update.components if isinstance(to_update, CompositeComponent) else None
        deriv = out_deriv
        for i in range(num - 1, -1, -1):
            c = comps[i]
            this_in = in_value if i == 0 else outputs[i - 1]
            this_out = out_value if i == num - 1 else outputs[i]
            upd = upd_list[i] if upd_list is not None else None
            if upd is not None and c.properties() & P.STORES_STATS:
                upd.store_stats(this_in, this_out, memos[i])
            if i > 0:
                this_in_deriv = self._buffer(xp, c, rows, c.input_dim(), dtype, P.BACKPROP_ADDS)
            else:
                this_in_deriv = in_deriv
            if not (i == 0 and not c.properties() & P.UPDATABLE_COMPONENT and in_deriv is None):
                c.backprop(debug_info, None, this_in, this_out, deriv, memos[i], upd,
                           this_in_deriv)
            deriv = this_in_deriv
