"""Random components (Kaldi's RandomComponent family): DropoutComponent
(nnet-simple-component), and DropoutMaskComponent, GeneralDropoutComponent and
SpecAugmentTimeMaskComponent (nnet-general-component).

In test mode each is deterministic (identity, or Kaldi's expected-value scaling for
DropoutComponent / DropoutMaskComponent).  In training mode the random masks come from
the component's ``rng`` (a ``numpy.random.Generator``; ``reset_generator(seed)`` or
assigning ``rng`` makes runs reproducible; a fixed-seed generator is created on first
use).  Masks are drawn on the host and moved to the backend of the data.  Kaldi's own
random streams cannot be reproduced, so training-mode outputs match Kaldi in
distribution, not bit for bit.

GeneralDropoutComponent and SpecAugmentTimeMaskComponent are non-simple: their masks are
shared across rows with the same sequence (n) and time block, so the row-to-mask map is
precomputed from the Indexes; the mask itself is the memo passed to backprop.
"""

from __future__ import annotations

import numpy as np

from engine.core.errors import ComponentError
from engine.core.index import Index
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


class RandomComponent(Component):
    """Kaldi's RandomComponent: a test-mode flag and a random generator."""

    def __init__(self) -> None:
        super().__init__()
        self.test_mode = False
        self.rng: np.random.Generator | None = None

    def set_test_mode(self, test_mode: bool) -> None:
        self.test_mode = bool(test_mode)

    def reset_generator(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def _uniform(self, shape) -> np.ndarray:
        return get_rng(self).random(shape, dtype=np.float32)


@register_component
class DropoutComponent(RandomComponent, SameDimComponent, TokenFieldsComponent):
    type_name = "DropoutComponent"
    # <DropoutPerFrame> and <TestMode> may be absent from old models
    _FIELDS = (("<Dim>", "dim", INT), ("<DropoutProportion>", "dropout_proportion", FLOAT),
               ("<DropoutPerFrame>", "dropout_per_frame", BOOL),
               ("<TestMode>", "test_mode", BOOL))

    def __init__(self) -> None:
        super().__init__()
        self.dim = 0
        self.dropout_proportion = 0.0
        self.dropout_per_frame = False

    def properties(self) -> P:
        return (P.BACKPROP_IN_PLACE | P.SIMPLE_COMPONENT | P.BACKPROP_NEEDS_INPUT
                | P.BACKPROP_NEEDS_OUTPUT | P.RANDOM_COMPONENT)

    def info(self) -> str:
        return (f"{self.type_name}, dim={self.dim}, dropout-proportion="
                f"{self.dropout_proportion:g}, dropout-per-frame="
                f"{'true' if self.dropout_per_frame else 'false'}")

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.dim = cfg.get_int("dim", required=True)
        self.dropout_proportion = cfg.get_float("dropout-proportion", required=True)
        self.dropout_per_frame = cfg.get_bool("dropout-per-frame", False)
        self.test_mode = cfg.get_bool("test-mode", False)
        if self.dim <= 0:
            raise cfg.error(f"DropoutComponent: dim={self.dim} must be > 0")
        if not 0.0 <= self.dropout_proportion <= 1.0:
            raise cfg.error(f"DropoutComponent: dropout-proportion="
                            f"{self.dropout_proportion:g} must be in [0, 1]")

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        read_fields(reader, c, cls._FIELDS[:2], opening=True)
        tok = read_optional_fields(reader, c, cls._FIELDS[2:3], reader.read_token())
        if tok == "<TestMode>":
            c.test_mode = reader.read_bool()
            reader.expect_token("</DropoutComponent>")
        elif tok != "</DropoutComponent>":
            raise reader.error(f"expected </DropoutComponent>, got {tok!r}")
        return c

    def propagate(self, indexes, in_value, out):
        self.check_shape("input", in_value, None, self.dim)
        xp = array_module(in_value)
        p = self.dropout_proportion
        if self.test_mode:
            out[...] = in_value * (1.0 - p)
            return None
        rows = in_value.shape[0]
        if self.dropout_per_frame:
            keep = self._uniform((rows, 1)) - p > 0
        else:
            keep = self._uniform((rows, self.dim)) - p > 0
        out[...] = in_value * xp.asarray(keep, dtype=in_value.dtype)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        xp = array_module(out_deriv)
        # out/in is the mask (0 or 1); where the input was 0, Kaldi takes the scale as 1
        nz = in_value != 0
        ratio = out_value / xp.where(nz, in_value, 1.0)
        in_deriv[...] = xp.where(nz, out_deriv * ratio, out_deriv)


@register_component
class DropoutMaskComponent(RandomComponent):
    """Outputs a dropout mask (no input rows); used by LSTM-style dropout."""

    type_name = "DropoutMaskComponent"
    # <TestMode> may be absent from old models
    _FIELDS = (("<OutputDim>", "out_dim", INT),
               ("<DropoutProportion>", "dropout_proportion", FLOAT),
               ("<TestMode>", "test_mode", BOOL))

    def __init__(self) -> None:
        super().__init__()
        self.out_dim = -1
        self.dropout_proportion = 0.5
        self.continuous = False

    def properties(self) -> P:
        return P.RANDOM_COMPONENT

    def input_dim(self) -> int:
        # Kaldi reports the output dim here too; the input is never read
        return self.out_dim

    def output_dim(self) -> int:
        return self.out_dim

    def info(self) -> str:
        s = (f"{self.type_name}, output-dim={self.out_dim}, dropout-proportion="
             f"{self.dropout_proportion:g}")
        return s + (", continuous=true" if self.continuous else "")

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.out_dim = cfg.get_int("output-dim", required=True)
        if self.out_dim <= 0:
            raise cfg.error(f"DropoutMaskComponent: output-dim={self.out_dim} must be > 0")
        self.dropout_proportion = cfg.get_float("dropout-proportion", 0.5)
        self.continuous = cfg.get_bool("continuous", False)
        self.test_mode = cfg.get_bool("test-mode", False)

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        read_fields(reader, c, cls._FIELDS[:2], opening=True)
        if reader.peek_token() == "<TestMode>":
            reader.read_token()
            c.test_mode = reader.read_bool()
        c.continuous = reader.try_token("<Continuous>")
        reader.expect_token("</DropoutMaskComponent>")
        return c

    def write(self, writer: KaldiWriter) -> None:
        write_fields(writer, self, self._FIELDS, opening=True)
        if self.continuous:
            writer.write_token("<Continuous>")
        writer.write_token("</DropoutMaskComponent>")

    # -- index interface: the mask needs no input ------------------------------------
    def get_input_indexes(self, misc_info, output_index: Index) -> list[Index]:
        return []

    def input_offsets(self) -> list[tuple[int, int, int]]:
        """get_input_indexes as fixed shifts of the output Index: none (the compiler's
        graph builders then treat every output Index as computable at once)."""
        return []

    def is_computable(self, misc_info, output_index, input_index_set, used_inputs) -> bool:
        if used_inputs is not None:
            used_inputs.clear()
        return True

    def propagate(self, indexes, in_value, out):
        if out.ndim != 2 or out.shape[1] != self.out_dim:
            self.check_shape("output", out, None, self.out_dim)
        xp = array_module(out)
        p = self.dropout_proportion
        if not 0.0 <= p <= 1.0:
            raise ComponentError(f"dropout-proportion={p:g} not in [0, 1]",
                                 component=self.label())
        rows = out.shape[0]
        if p == 0:
            out[...] = 1.0
            return None
        if self.continuous:
            if self.test_mode:
                out[...] = 1.0
            else:
                u = self._uniform((rows, self.out_dim))
                out[...] = xp.asarray(u * (4.0 * p) + (1.0 - 2.0 * p), dtype=out.dtype)
            return None
        if self.test_mode:
            out[...] = 1.0 - p
            return None
        mask = (self._uniform((rows, self.out_dim)) - p > 0).astype(np.float32)
        if self.out_dim in (2, 3):
            # LSTM special case: never drop both of the first two columns of a row
            u = self._uniform(rows)
            mask[:, 0] = (u - p > 0)
            mask[:, 1] = (-(u - 1.0 + p) > 0)
        out[...] = xp.asarray(mask, dtype=out.dtype)
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        return None


class IndexedMaskComponent(RandomComponent, SameDimComponent):
    """Base of the non-simple random components: the output is the input times, in
    training, a mask laid out by the precomputed indexes; the mask is backprop's memo.

    Subclasses give PRECOMPUTED (their precomputed-indexes class), ``_inactive()`` (no
    mask: test mode or nothing to drop), ``_get_mask(indexes)``, ``_apply(mat, mask,
    indexes)`` (multiplies ``mat`` in place) and ``_check_memo(memo, indexes)``.
    """

    PRECOMPUTED: type[ComponentPrecomputedIndexes]

    def _check_identical(self, input_rows: np.ndarray, output_rows: np.ndarray) -> None:
        """Raises unless the input and output indexes ((k, 3) rows) are identical (as
        Kaldi asks)."""
        # (rows of one dtype compared as bytes: a compile asks this of every dropout
        # layer, and np.array_equal costs seven times as much on a chunk's few rows)
        if not (input_rows.shape == output_rows.shape
                and (input_rows.tobytes() == output_rows.tobytes()
                     if input_rows.dtype == output_rows.dtype
                     else np.array_equal(input_rows, output_rows))):
            raise ComponentError("input and output indexes must be identical",
                                 component=self.label())

    def propagate(self, indexes, in_value, out):
        self.copy_input(in_value, out)
        if self._inactive():
            return None
        if not isinstance(indexes, self.PRECOMPUTED):
            raise ComponentError("training-mode propagate needs the precomputed indexes",
                                 component=self.label())
        xp = array_module(out)
        mask = xp.asarray(self._get_mask(indexes), dtype=out.dtype)
        self._apply(out, mask, indexes)
        return mask

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv) -> None:
        if in_deriv is None:
            return
        in_deriv[...] = out_deriv
        if self._inactive():
            return
        self._check_memo(memo, indexes)
        self._apply(in_deriv, memo, indexes)


# GeneralDropoutComponent._mask_rows numbers at most this many rows in Python
_FEW_ROWS = 256


class GeneralDropoutComponentPrecomputedIndexes(ComponentPrecomputedIndexes):
    """``indexes[r]``: the mask row for row r of the (block-reshaped) matrix;
    ``num_mask_rows``: how many mask rows to draw."""

    def __init__(self, num_mask_rows: int, indexes: np.ndarray) -> None:
        self.num_mask_rows = num_mask_rows
        self.indexes = indexes


# GeneralDropoutComponent's properties (made once: flag arithmetic is slow and the
# compiler asks for them on every compilation); with block-dim < dim the rows are
# reshaped, so input and output must be contiguous
_GENERAL_PROPS = P.RANDOM_COMPONENT | P.PROPAGATE_IN_PLACE | P.BACKPROP_IN_PLACE | P.USES_MEMO
_GENERAL_PROPS_BLOCKS = _GENERAL_PROPS | P.INPUT_CONTIGUOUS | P.OUTPUT_CONTIGUOUS


@register_component
class GeneralDropoutComponent(PrecomputeOnRows, IndexedMaskComponent):
    """Dropout with one mask per sequence (n), or per block of time-period frames;
    optionally continuous, or SpecAugment's frequency masking."""

    type_name = "GeneralDropoutComponent"
    PRECOMPUTED = GeneralDropoutComponentPrecomputedIndexes
    _FIELDS = (("<Dim>", "dim", INT), ("<BlockDim>", "block_dim", INT),
               ("<TimePeriod>", "time_period", INT),
               ("<DropoutProportion>", "dropout_proportion", FLOAT))

    def __init__(self) -> None:
        super().__init__()
        self.dim = -1
        self.block_dim = -1
        self.time_period = 0
        self.dropout_proportion = 0.5
        self.specaugment_max_proportion = 0.0
        self.specaugment_max_regions = 1
        self.continuous = False

    def properties(self) -> P:
        return _GENERAL_PROPS if self.block_dim == self.dim else _GENERAL_PROPS_BLOCKS

    def info(self) -> str:
        s = (f"{self.type_name}, dim={self.dim}, block-dim={self.block_dim}, "
             f"dropout-proportion={self.dropout_proportion:g}")
        if self.continuous:
            s += ", continuous=true"
        if self.specaugment_max_proportion != 0:
            s += (f", specaugment-max-proportion={self.specaugment_max_proportion:g}, "
                  f"specaugment-max-regions={self.specaugment_max_regions}")
        if self.time_period > 0:
            s += f", time-period={self.time_period}"
        return s

    def _blocks_invalid(self) -> bool:
        """A block dim Kaldi refuses: not positive, or not dividing dim."""
        return self.block_dim <= 0 or self.dim % self.block_dim != 0

    def _specaugment_invalid(self) -> bool:
        """SpecAugment settings Kaldi refuses: a proportion outside [0, 1] or with
        continuous masks, or fewer than one region."""
        return self.specaugment_max_proportion != 0.0 and (
            not 0.0 <= self.specaugment_max_proportion <= 1.0 or self.continuous
            or self.specaugment_max_regions < 1)

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.dim = cfg.get_int("dim", required=True)
        if self.dim <= 0:
            raise cfg.error(f"GeneralDropoutComponent: dim={self.dim} must be > 0")
        self.block_dim = cfg.get_int("block-dim", self.dim)
        if self._blocks_invalid():
            raise cfg.error(f"GeneralDropoutComponent: invalid configuration dim={self.dim}, "
                            f"block-dim={self.block_dim}")
        self.time_period = cfg.get_int("time-period", 0)
        self.dropout_proportion = cfg.get_float("dropout-proportion", 0.5)
        self.specaugment_max_proportion = cfg.get_float("specaugment-max-proportion", 0.0)
        self.specaugment_max_regions = cfg.get_int("specaugment-max-regions", 1)
        self.continuous = cfg.get_bool("continuous", False)
        self.test_mode = cfg.get_bool("test-mode", False)
        if self._specaugment_invalid():
            raise cfg.error("GeneralDropoutComponent: invalid config values: "
                            f"specaugment-max-proportion={self.specaugment_max_proportion:g} "
                            "(must be in [0, 1], and not with continuous=true), "
                            f"specaugment-max-regions={self.specaugment_max_regions} (>= 1)")

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        read_fields(reader, c, cls._FIELDS, opening=True)
        if reader.try_token("<SpecAugmentMaxProportion>"):
            c.specaugment_max_proportion = reader.read_float()
            if reader.try_token("<SpecAugmentMaxRegions>"):
                c.specaugment_max_regions = reader.read_int()
        c.test_mode = reader.try_token("<TestMode>")
        c.continuous = reader.try_token("<Continuous>")
        reader.expect_token("</GeneralDropoutComponent>")
        if c.dim <= 0 or c._blocks_invalid():
            raise reader.error(f"GeneralDropoutComponent: <BlockDim> {c.block_dim} must be > 0 "
                               f"and divide <Dim> {c.dim}")
        if c._specaugment_invalid():
            raise reader.error(
                f"GeneralDropoutComponent: <SpecAugmentMaxProportion> "
                f"{c.specaugment_max_proportion:g} must be in [0, 1] (and not with "
                f"<Continuous>), <SpecAugmentMaxRegions> {c.specaugment_max_regions} >= 1")
        return c

    def write(self, writer: KaldiWriter) -> None:
        w = writer
        write_fields(w, self, self._FIELDS, opening=True)
        if self.specaugment_max_proportion:
            w.write_token("<SpecAugmentMaxProportion>")
            w.write_float(self.specaugment_max_proportion)
            if self.specaugment_max_regions != 1:
                w.write_token("<SpecAugmentMaxRegions>")
                w.write_int(self.specaugment_max_regions)
        if self.test_mode:
            w.write_token("<TestMode>")
        if self.continuous:
            w.write_token("<Continuous>")
        w.write_token("</GeneralDropoutComponent>")

    # -- index interface ---------------------------------------------------------------
    def precompute_index_arrays(self, misc_info: MiscComputationInfo | None,
                                input_rows: np.ndarray, output_rows: np.ndarray,
                                need_backprop: bool) -> GeneralDropoutComponentPrecomputedIndexes:
        """precompute_indexes on (k, 3) n, t, x int64 arrays."""
        self._check_identical(input_rows, output_rows)
        return self._mask_rows(input_rows)

    def _mask_rows(self, arr: np.ndarray) -> GeneralDropoutComponentPrecomputedIndexes:
        multiple = self.dim // self.block_dim
        if len(arr) <= _FEW_ROWS:
            # a chunk's rows: numbered in Python (each array operation below costs
            # more than this whole loop for a few dozen rows)
            period = self.time_period
            n = arr[:, 0].tolist()
            blocks = [t // period for t in arr[:, 1].tolist()] if period > 0 else [0] * len(n)
            first: dict = {}
            rows = [first.setdefault(pair, len(first)) for pair in zip(n, blocks)]
            indexes = np.array(rows, dtype=np.int64)
            return GeneralDropoutComponentPrecomputedIndexes(
                len(first) * multiple, np.repeat(indexes, multiple) if multiple > 1 else indexes)
        n = arr[:, 0]
        t = (np.floor_divide(arr[:, 1], self.time_period) if self.time_period > 0
             else np.zeros_like(n))
        # mask rows numbered by first appearance of each (n, t-block) pair (the
        # numbering does not depend on how the pairs are found: one int key per pair
        # where the ranges allow it, else the pairs as rows)
        if len(n):
            n0, t0 = int(n.min()), int(t.min())
            span_t = int(t.max()) - t0 + 1
            cells = (int(n.max()) - n0 + 1) * span_t
            flat = cells < 2 ** 62
        else:
            flat = False
        if flat and cells == 1:
            # one (n, t-block) pair (one sequence, no time blocks): one mask row
            rows = np.zeros(len(n), dtype=np.int64)
            num_pairs = 1
        elif flat and cells <= 4 * len(n) + 4096:
            # few (n, t-block) cells: each row's first occurrence through a table
            # indexed by cell (no sorting), then first occurrences numbered in order
            key = (n - n0) * span_t + (t - t0)
            at = np.arange(len(n))
            first = np.full(cells, len(n), dtype=np.int64)
            np.minimum.at(first, key, at)
            first_row = first[key]
            rank = np.cumsum(first_row == at) - 1
            rows = rank[first_row]
            num_pairs = int(rank[-1]) + 1
        else:
            if flat:
                _, first, inverse = np.unique((n - n0) * span_t + (t - t0), return_index=True,
                                              return_inverse=True)
            else:
                _, first, inverse = np.unique(np.stack([n, t], axis=1), axis=0,
                                              return_index=True, return_inverse=True)
            inverse = inverse.reshape(-1)
            order = np.argsort(first, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(order.size)
            rows = rank[inverse].astype(np.int64)
            num_pairs = int(order.size)
        num_mask_rows = num_pairs * multiple
        # every block of a row uses the row's mask (Kaldi draws 'multiple' times more
        # mask rows than it uses; we keep its sizes)
        return GeneralDropoutComponentPrecomputedIndexes(num_mask_rows,
                                                         np.repeat(rows, multiple))

    def _get_mask(self, indexes: GeneralDropoutComponentPrecomputedIndexes) -> np.ndarray:
        num_mask_rows = indexes.num_mask_rows
        bd = self.block_dim
        rng = get_rng(self)
        if self.specaugment_max_proportion != 0.0:
            # zero a random (wrapping) band of up to max-proportion of the bins per mask
            # row; with max-regions > 1, flip random half-circles to split the band
            max_zeroed = int(bd * self.specaugment_max_proportion + 0.5)
            num_zeroed = rng.integers(0, max_zeroed + 1, size=num_mask_rows)
            start = rng.integers(0, bd, size=num_mask_rows)
            offs = (np.arange(bd)[None, :] - start[:, None]) % bd
            mask = (offs >= num_zeroed[:, None]).astype(np.float32)
            half = bd // 2
            quarter = half // 2
            rows = np.arange(num_mask_rows)[:, None]
            active = (num_zeroed > 0)[:, None]
            for _ in range(1, self.specaugment_max_regions):
                s2 = rng.integers(0, bd, size=num_mask_rows)[:, None]
                i = np.arange(quarter)[None, :]
                a = (s2 + i) % bd
                b = (s2 + half - i) % bd
                va, vb = mask[rows, a], mask[rows, b]
                mask[rows, a] = np.where(active, vb, va)
                mask[rows, b] = np.where(active, va, vb)
            return mask
        p = self.dropout_proportion
        u = rng.random((num_mask_rows, bd), dtype=np.float32)
        if not self.continuous:
            return ((u - p > 0).astype(np.float32) * np.float32(1.0 / (1.0 - p)))
        return (u * np.float32(4.0 * p) + np.float32(1.0 - 2.0 * p)).astype(np.float32)

    def _inactive(self) -> bool:
        return self.test_mode or (self.dropout_proportion == 0.0
                                  and self.specaugment_max_proportion == 0.0)

    def _apply(self, mat, mask, indexes) -> None:
        xp = array_module(mat)
        rows = mat.shape[0]
        m = xp.asarray(mask, dtype=mat.dtype)[xp.asarray(indexes.indexes)]
        view = mat.reshape(rows * (self.dim // self.block_dim), self.block_dim)
        mat[...] = (view * m).reshape(rows, self.dim)

    def _check_memo(self, memo, indexes) -> None:
        if memo is None or not isinstance(indexes, GeneralDropoutComponentPrecomputedIndexes):
            raise ComponentError("training-mode backprop needs the memo and the "
                                 "precomputed indexes", component=self.label())


class SpecAugmentTimeMaskComponentPrecomputedIndexes(ComponentPrecomputedIndexes):
    """Rows grouped by sequence and ordered by t: ``rows[seq_starts[s]:seq_starts[s+1]]``
    are the row indexes of sequence s in time order; ``tot_size`` is the row count."""

    def __init__(self, rows: np.ndarray, seq_starts: np.ndarray, tot_size: int) -> None:
        self.rows = rows
        self.seq_starts = seq_starts
        self.tot_size = tot_size


@register_component
class SpecAugmentTimeMaskComponent(PrecomputeOnRows, IndexedMaskComponent):
    """SpecAugment's time masking: alternating kept and zeroed runs of frames."""

    type_name = "SpecAugmentTimeMaskComponent"
    PRECOMPUTED = SpecAugmentTimeMaskComponentPrecomputedIndexes
    _FIELDS = (("<Dim>", "dim", INT), ("<ZeroedProportion>", "zeroed_proportion", FLOAT),
               ("<TimeMaskMaxFrames>", "time_mask_max_frames", INT))

    def __init__(self) -> None:
        super().__init__()
        self.dim = -1
        self.zeroed_proportion = 0.25
        self.time_mask_max_frames = 10

    def properties(self) -> P:
        return P.RANDOM_COMPONENT | P.PROPAGATE_IN_PLACE | P.BACKPROP_IN_PLACE | P.USES_MEMO

    def info(self) -> str:
        return (f"{self.type_name}, dim={self.dim}, zeroed-proportion="
                f"{self.zeroed_proportion:g}, time-mask-max-frames={self.time_mask_max_frames}")

    def init_from_config(self, cfg: ConfigLine, rng) -> None:
        self.dim = cfg.get_int("dim", required=True)
        if self.dim <= 0:
            raise cfg.error(f"SpecAugmentTimeMaskComponent: dim={self.dim} must be > 0")
        self.zeroed_proportion = cfg.get_float("zeroed-proportion", 0.25)
        self.time_mask_max_frames = cfg.get_int("time-mask-max-frames", 10)
        if self.time_mask_max_frames <= 1:
            raise cfg.error("SpecAugmentTimeMaskComponent: time-mask-max-frames="
                            f"{self.time_mask_max_frames} must be > 1")

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        read_fields(reader, c, cls._FIELDS, opening=True)
        c.test_mode = reader.try_token("<TestMode>")
        reader.expect_token("</SpecAugmentTimeMaskComponent>")
        return c

    def write(self, writer: KaldiWriter) -> None:
        write_fields(writer, self, self._FIELDS, opening=True)
        if self.test_mode:
            writer.write_token("<TestMode>")
        writer.write_token("</SpecAugmentTimeMaskComponent>")

    def precompute_index_arrays(self, misc_info, input_rows: np.ndarray,
                                output_rows: np.ndarray, need_backprop: bool
                                ) -> SpecAugmentTimeMaskComponentPrecomputedIndexes:
        """precompute_indexes on (k, 3) n, t, x int64 arrays: the rows sorted by (n, t),
        stably, and where each sequence starts."""
        self._check_identical(input_rows, output_rows)
        if not len(input_rows):
            raise ComponentError("no indexes", component=self.label())
        arr = np.asarray(input_rows, dtype=np.int64).reshape(-1, 3)
        order = np.lexsort((np.arange(arr.shape[0]), arr[:, 1], arr[:, 0]))
        n_sorted = arr[order, 0]
        starts = np.flatnonzero(np.r_[True, n_sorted[1:] != n_sorted[:-1]])
        seq_starts = np.r_[starts, n_sorted.size].astype(np.int64)
        return SpecAugmentTimeMaskComponentPrecomputedIndexes(order.astype(np.int64),
                                                              seq_starts, int(arr.shape[0]))

    def _get_mask(self, idx: SpecAugmentTimeMaskComponentPrecomputedIndexes) -> np.ndarray:
        z = self.zeroed_proportion
        max_zeroed = self.time_mask_max_frames
        max_kept = int(max_zeroed * (1.0 - z) / z)
        if max_zeroed <= 0 or max_kept <= 0:
            raise ComponentError(f"zeroed-proportion={z:g} leaves no room for kept frames",
                                 component=self.label())
        rng = get_rng(self)
        mask = np.empty(idx.tot_size, dtype=np.float32)
        for s in range(idx.seq_starts.size - 1):  # one vectorised draw per sequence
            rows = idx.rows[idx.seq_starts[s]:idx.seq_starts[s + 1]]
            length = rows.size
            # alternate kept / zeroed runs (each at least 1 frame); the first kept run
            # happens with probability z, else the sequence starts with a zeroed run
            pairs = length // 2 + 1
            kept = rng.integers(1, max_kept + 1, size=pairs)
            zeroed = rng.integers(1, max_zeroed + 1, size=pairs)
            if not rng.random() < z:
                kept[0] = 0
            runs = np.stack([kept, zeroed], axis=1).reshape(-1)
            values = np.tile(np.array([1.0, 0.0], dtype=np.float32), pairs)
            seq_mask = np.repeat(values, runs)[:length]
            mask[rows] = seq_mask
        return mask

    def _inactive(self) -> bool:
        return self.test_mode or self.zeroed_proportion == 0.0

    def _apply(self, mat, mask, indexes) -> None:
        xp = array_module(mat)
        mat *= xp.asarray(mask, dtype=mat.dtype)[:, None]

    def _check_memo(self, memo, indexes) -> None:
        if memo is None:
            raise ComponentError("training-mode backprop needs the memo",
                                 component=self.label())
