"""Components that are the identity forward and shape the gradient backward:
ClipGradientComponent (nnet-simple-component.{h,cc}) and the non-simple
BackpropTruncationComponent (nnet-general-component.{h,cc}), which clips row norms and
zeroes the derivative of rows that cross a multiple of zeroing-interval frames (the
crossing pattern depends on each row's (n, t) and is precomputed per computation).

Their counters (elements clipped / zeroed / processed) accumulate in ``to_update`` as in
Kaldi, and are kept with Kaldi's types so that models read and write unchanged.
"""

from __future__ import annotations

import numpy as np

from engine.core.errors import ComponentError
from engine.core.xp import array_module
from engine.nnet.components.base import (
    Component,
    ComponentPrecomputedIndexes,
    ComponentProperty as P,
    MiscComputationInfo,
    PrecomputeOnRows,
    register_component,
)
from engine.nnet.components._fields import (
    BOOL,
    DOUBLE,
    FLOAT,
    INT,
    SameDimComponent,
    TokenFieldsComponent,
    read_fields,
    read_optional_fields,
    write_fields,
)
from engine.nnet.components.nonlinear import get_rng
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter


def _row_clipping_scales(xp, deriv, threshold: float):
    """Per-row factor min(1, threshold/||row||), and how many rows were left alone
    (squared norm over threshold^2 below 1: Kaldi's ApplyFloor count)."""
    r = (deriv * deriv).sum(axis=1) * (float(threshold) ** -2)
    not_scaled = int((r < 1.0).sum())
    return xp.maximum(r, 1.0) ** -0.5, not_scaled


def _row_norms(deriv):
    xp = array_module(deriv)
    return xp.sqrt((deriv * deriv).sum(axis=1))


@register_component
class ClipGradientComponent(SameDimComponent):
    type_name = "ClipGradientComponent"
    STAT_FIELDS = ("count", "num_clipped", "num_self_repaired", "num_backpropped")
    # in groups, as old models lack the self-repair ones
    _FIELDS = (("<Dim>", "dim", INT), ("<ClippingThreshold>", "clipping_threshold", FLOAT),
               ("<NormBasedClipping>", "norm_based_clipping", BOOL))
    _REPAIR_FIELDS = (("<SelfRepairClippedProportionThreshold>",
                       "self_repair_clipped_proportion_threshold", FLOAT),
                      ("<SelfRepairTarget>", "self_repair_target", FLOAT),
                      ("<SelfRepairScale>", "self_repair_scale", FLOAT))
    _COUNT_FIELDS = (("<NumElementsClipped>", "num_clipped", INT),
                     ("<NumElementsProcessed>", "count", INT))
    _REPAIR_COUNT_FIELDS = (("<NumSelfRepaired>", "num_self_repaired", INT),
                            ("<NumBackpropped>", "num_backpropped", INT))

    def __init__(self) -> None:
        super().__init__()
        self.dim = 0
        self.clipping_threshold = 15.0
        self.norm_based_clipping = False
        self.self_repair_clipped_proportion_threshold = 0.01
        self.self_repair_target = 0.0
        self.self_repair_scale = 1.0
        self.num_clipped = 0
        self.count = 0
        self.num_self_repaired = 0
        self.num_backpropped = 0
        self.rng: np.random.Generator | None = None

    def properties(self) -> P:
        return (P.SIMPLE_COMPONENT | P.PROPAGATE_IN_PLACE | P.BACKPROP_IN_PLACE
                | P.BACKPROP_NEEDS_INPUT)

    def info(self) -> str:
        prop = self.num_clipped / self.count if self.count > 0 else 0
        s = (f"{self.type_name}, dim={self.dim}, norm-based-clipping="
             f"{'true' if self.norm_based_clipping else 'false'}, clipping-threshold="
             f"{self.clipping_threshold:g}, clipped-proportion={prop:g}")
        if self.self_repair_scale != 0.0:
            s += (f", self-repair-clipped-proportion-threshold="
                  f"{self.self_repair_clipped_proportion_threshold:g}, self-repair-target="
                  f"{self.self_repair_target:g}, self-repair-scale={self.self_repair_scale:g}")
        return s

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.dim = cfg.get_int("dim", required=True)
        self.clipping_threshold = cfg.get_float("clipping-threshold", 15.0)
        self.norm_based_clipping = cfg.get_bool("norm-based-clipping", False)
        self.self_repair_clipped_proportion_threshold = cfg.get_float(
            "self-repair-clipped-proportion-threshold", 0.01)
        self.self_repair_target = cfg.get_float("self-repair-target", 0.0)
        self.self_repair_scale = cfg.get_float("self-repair-scale", 1.0)
        for name, v in (("dim", self.dim - 1), ("clipping-threshold", self.clipping_threshold),
                        ("self-repair-clipped-proportion-threshold",
                         self.self_repair_clipped_proportion_threshold),
                        ("self-repair-target", self.self_repair_target),
                        ("self-repair-scale", self.self_repair_scale)):
            if v < 0:
                raise cfg.error(f"ClipGradientComponent: invalid {name}= (must be "
                                f"{'> 0' if name == 'dim' else '>= 0'})")

    @classmethod
    def read(cls, reader: KaldiReader):
        # (where a group is optional its first token is read here, to see which follows)
        c = cls()
        read_fields(reader, c, cls._FIELDS, opening=True)
        tok = reader.read_token()
        if tok == "<SelfRepairClippedProportionThreshold>":
            c.self_repair_clipped_proportion_threshold = reader.read_float()
            read_fields(reader, c, cls._REPAIR_FIELDS[1:])
            reader.expect_token("<NumElementsClipped>")
        else:
            c.self_repair_clipped_proportion_threshold = 1.0
            c.self_repair_target = 0.0
            c.self_repair_scale = 0.0
            if tok != "<NumElementsClipped>":
                raise reader.error(f"expected <NumElementsClipped>, got {tok!r}")
        c.num_clipped = reader.read_int()
        read_fields(reader, c, cls._COUNT_FIELDS[1:])
        tok = reader.read_token()
        if tok == "<NumSelfRepaired>":
            c.num_self_repaired = reader.read_int()
            read_fields(reader, c, cls._REPAIR_COUNT_FIELDS[1:])
            reader.expect_token("</ClipGradientComponent>")
        elif tok != "</ClipGradientComponent>":
            raise reader.error(f"expected </ClipGradientComponent>, got {tok!r}")
        return c

    def write(self, writer: KaldiWriter) -> None:
        fields = self._FIELDS + self._REPAIR_FIELDS + self._COUNT_FIELDS + self._REPAIR_COUNT_FIELDS
        write_fields(writer, self, fields, opening=True)
        writer.write_token("</ClipGradientComponent>")

    def zero_stats(self) -> None:
        self.count = 0
        self.num_clipped = 0
        self.num_self_repaired = 0
        self.num_backpropped = 0

    def scale(self, alpha: float) -> None:
        # Kaldi keeps these as int32: the scaled values are truncated
        self.count = int(self.count * alpha)
        self.num_clipped = int(self.num_clipped * alpha)

    def add(self, alpha: float, other: Component) -> None:
        assert isinstance(other, ClipGradientComponent)
        self.count = int(self.count + alpha * other.count)
        self.num_clipped = int(self.num_clipped + alpha * other.num_clipped)

    def propagate(self, indexes, in_value, out):
        self.copy_input(in_value, out)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        self.check_shape("output derivative", out_deriv, None, self.dim)
        xp = array_module(out_deriv)
        upd = to_update if isinstance(to_update, ClipGradientComponent) else None
        thr = self.clipping_threshold
        if thr > 0:
            if self.norm_based_clipping:
                scales, not_scaled = _row_clipping_scales(xp, out_deriv, thr)
                rows = out_deriv.shape[0]
                if not_scaled != rows:
                    in_deriv[...] = out_deriv * scales[:, None]
                    if upd is not None:
                        upd.num_clipped += rows - not_scaled
                else:
                    in_deriv[...] = out_deriv
                if upd is not None:
                    upd.count += rows
            else:
                in_deriv[...] = xp.clip(out_deriv, -thr, thr)
            if upd is not None:
                upd.num_backpropped += 1
                self._repair_gradients(debug_info, in_value, in_deriv, upd)
        elif thr == 0.0:
            in_deriv[...] = 0
        else:
            in_deriv[...] = out_deriv

    def _repair_gradients(self, debug_info, in_value, in_deriv, to_update) -> None:
        # When too many rows were clipped, add a term pulling |input| towards
        # self-repair-target, scaled to the average derivative norm, then restore the
        # original average norm.
        repair_probability = 0.5
        if (self.self_repair_clipped_proportion_threshold >= 1.0
                or self.self_repair_scale == 0.0 or self.count == 0
                or get_rng(to_update).random() > repair_probability):
            return
        clipped_proportion = self.num_clipped / self.count if self.count > 0 else 0.0
        if clipped_proportion <= self.self_repair_clipped_proportion_threshold:
            return
        to_update.num_self_repaired += 1
        xp = array_module(in_deriv)
        sign = xp.where(in_value > 0, 1.0, -1.0)
        repair = xp.maximum(xp.abs(in_value) - self.self_repair_target, 0.0) * sign
        norms = _row_norms(in_deriv)
        norm_sum = float(norms.sum())
        magnitude = self.self_repair_scale * clipped_proportion * (norm_sum / norms.shape[0])
        repair_norm_sum = float(_row_norms(repair).sum())
        scale = 0.0
        if repair_norm_sum != 0.0:
            scale = magnitude / (repair_norm_sum / norms.shape[0])
        in_deriv += (-scale / repair_probability) * repair.astype(in_deriv.dtype)
        repaired_sum = float(_row_norms(in_deriv).sum())
        if repaired_sum != 0.0:
            in_deriv *= norm_sum / repaired_sum


class BackpropTruncationComponentPrecomputedIndexes(ComponentPrecomputedIndexes):
    """``zeroing[i]`` is -1 for rows whose gradient may be zeroed, else 0;
    ``zeroing_sum`` is the number of such rows."""

    def __init__(self, zeroing: np.ndarray, zeroing_sum: float) -> None:
        self.zeroing = zeroing
        self.zeroing_sum = zeroing_sum


_BACKPROP_TRUNCATION_PROPS = P.PROPAGATE_IN_PLACE | P.BACKPROP_IN_PLACE


@register_component
class BackpropTruncationComponent(PrecomputeOnRows, SameDimComponent, TokenFieldsComponent):
    type_name = "BackpropTruncationComponent"
    STAT_FIELDS = ("num_clipped", "num_zeroed", "count", "count_zeroing_boundaries")
    # <Scale> may be absent from old models
    _FIELDS = (("<Dim>", "dim", INT), ("<Scale>", "scale_value", FLOAT),
               ("<ClippingThreshold>", "clipping_threshold", FLOAT),
               ("<ZeroingThreshold>", "zeroing_threshold", FLOAT),
               ("<ZeroingInterval>", "zeroing_interval", INT),
               ("<RecurrenceInterval>", "recurrence_interval", INT),
               ("<NumElementsClipped>", "num_clipped", DOUBLE),
               ("<NumElementsZeroed>", "num_zeroed", DOUBLE),
               ("<NumElementsProcessed>", "count", DOUBLE),
               ("<NumZeroingBoundaries>", "count_zeroing_boundaries", DOUBLE))

    def __init__(self) -> None:
        super().__init__()
        self.dim = 0
        self.scale_value = 1.0
        self.clipping_threshold = -1.0
        self.zeroing_threshold = -1.0
        self.zeroing_interval = 0
        self.recurrence_interval = 0
        self.num_clipped = 0.0
        self.num_zeroed = 0.0
        self.count = 0.0
        self.count_zeroing_boundaries = 0.0

    def properties(self) -> P:
        return _BACKPROP_TRUNCATION_PROPS

    def info(self) -> str:
        clipped = self.num_clipped / self.count if self.count > 0 else 0
        zeroed = (self.num_zeroed / self.count_zeroing_boundaries
                  if self.count_zeroing_boundaries > 0 else 0)
        return (f"{self.type_name}, dim={self.dim}, scale={self.scale_value:g}, "
                f"count={self.count:.3g}, recurrence-interval={self.recurrence_interval}, "
                f"clipping-threshold={self.clipping_threshold:g}, clipped-proportion="
                f"{clipped:g}, zeroing-threshold={self.zeroing_threshold:g}, "
                f"zeroing-interval={self.zeroing_interval}, zeroed-proportion={zeroed:g}, "
                f"count-zeroing-boundaries={int(self.count_zeroing_boundaries)}")

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.dim = cfg.get_int("dim", required=True)
        self.scale_value = cfg.get_float("scale", 1.0)
        self.clipping_threshold = cfg.get_float("clipping-threshold", 30.0)
        self.zeroing_threshold = cfg.get_float("zeroing-threshold", 15.0)
        self.zeroing_interval = cfg.get_int("zeroing-interval", 20)
        self.recurrence_interval = cfg.get_int("recurrence-interval", 1)
        checks = (("dim", self.dim > 0, "> 0"), ("scale", self.scale_value > 0, "> 0"),
                  ("clipping-threshold", self.clipping_threshold >= 0, ">= 0"),
                  ("zeroing-threshold", self.zeroing_threshold >= 0, ">= 0"),
                  ("zeroing-interval", self.zeroing_interval >= 1, ">= 1"),
                  ("recurrence-interval", self.recurrence_interval >= 1, ">= 1"))
        for name, ok, want in checks:
            if not ok:
                raise cfg.error(f"BackpropTruncationComponent: {name}= must be {want}")
        self.num_clipped = self.num_zeroed = self.count = self.count_zeroing_boundaries = 0.0

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        read_fields(reader, c, cls._FIELDS[:1], opening=True)
        tok = read_optional_fields(reader, c, cls._FIELDS[1:2], reader.read_token())
        if tok != "<ClippingThreshold>":
            raise reader.error(f"expected <ClippingThreshold>, got {tok!r}")
        c.clipping_threshold = reader.read_float()
        read_fields(reader, c, cls._FIELDS[3:])
        reader.expect_token("</BackpropTruncationComponent>")
        return c

    def zero_stats(self) -> None:
        self.num_clipped = self.num_zeroed = self.count = self.count_zeroing_boundaries = 0.0

    def scale(self, alpha: float) -> None:
        self.count *= alpha
        self.count_zeroing_boundaries *= alpha
        self.num_clipped *= alpha
        self.num_zeroed *= alpha

    def add(self, alpha: float, other: Component) -> None:
        assert isinstance(other, BackpropTruncationComponent)
        self.count += alpha * other.count
        self.count_zeroing_boundaries += alpha * other.count_zeroing_boundaries
        self.num_clipped += alpha * other.num_clipped
        self.num_zeroed += alpha * other.num_zeroed

    # -- index interface (inputs = outputs; only the precomputed zeroing pattern) --
    def precompute_index_arrays(self, misc_info: MiscComputationInfo | None,
                                input_rows: np.ndarray, output_rows: np.ndarray,
                                need_backprop: bool
                                ) -> BackpropTruncationComponentPrecomputedIndexes:
        """precompute_indexes on (k, 3) n, t, x int64 arrays."""
        if len(input_rows) != len(output_rows):
            raise ComponentError(f"{len(input_rows)} input vs {len(output_rows)} "
                                 "output indexes (must be equal)", component=self.label())
        return self._zeroing(output_rows)

    def _zeroing(self, arr: np.ndarray) -> BackpropTruncationComponentPrecomputedIndexes:
        zi, ri = self.zeroing_interval, self.recurrence_interval
        # the row's frame t and the frame it recurs from (t - recurrence-interval) lie in
        # different zeroing-interval blocks; the block grid is shifted by n so that
        # sequences do not all zero at the same frame
        if zi != 0 and len(arr) <= 16:
            # a few rows (recurrent steps hold one frame per sequence): plain Python,
            # the same values (// is floor division for ints, as np.floor_divide)
            z = [-1.0 if (t - n) // zi != (t - ri - n) // zi else 0.0
                 for n, t, _ in arr.tolist()]
            # (-0.0 when nothing is zeroed, as the negated float32 sum)
            return BackpropTruncationComponentPrecomputedIndexes(
                np.array(z, dtype=np.float32), -sum(z, 0.0))
        n, t = arr[:, 0], arr[:, 1]
        crosses = np.floor_divide(t - n, zi) != np.floor_divide(t - ri - n, zi)
        zeroing = np.where(crosses, -1.0, 0.0).astype(np.float32)
        return BackpropTruncationComponentPrecomputedIndexes(zeroing, float(-zeroing.sum()))

    def propagate(self, indexes, in_value, out):
        self.copy_input(in_value, out, self.scale_value)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        if not isinstance(indexes, BackpropTruncationComponentPrecomputedIndexes):
            raise ComponentError("backprop needs the precomputed indexes",
                                 component=self.label())
        rows = out_deriv.shape[0]
        if indexes.zeroing.shape[0] != rows:
            raise ComponentError(f"precomputed indexes are for {indexes.zeroing.shape[0]} "
                                 f"rows, derivative has {rows}", component=self.label())
        xp = array_module(out_deriv)
        d = out_deriv * self.scale_value if self.scale_value != 1.0 else out_deriv
        clip_thr = self.clipping_threshold if self.clipping_threshold > 0.0 else 1.0e10
        clip_scales, not_scaled = _row_clipping_scales(xp, d, clip_thr)
        zero_thr = self.zeroing_threshold if self.zeroing_threshold > 0.0 else 1.0e10
        sq = (d * d).sum(axis=1)
        over = (sq - float(zero_thr) ** 2 > 0).astype(d.dtype)
        zeroing = xp.asarray(indexes.zeroing, dtype=d.dtype) * over  # -1 where zeroed
        upd = to_update if isinstance(to_update, BackpropTruncationComponent) else None
        if upd is not None:
            upd.num_clipped += rows - not_scaled
            upd.count += rows
            upd.num_zeroed -= float(zeroing.sum())
            upd.count_zeroing_boundaries += indexes.zeroing_sum
        combined = clip_scales * (zeroing + 1.0)
        in_deriv[...] = d * combined[:, None]
