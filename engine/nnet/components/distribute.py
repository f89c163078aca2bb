"""DistributeComponent (Kaldi's nnet-general-component.{h,cc}).

Splits each input row of dimension ``input-dim`` into ``input-dim / output-dim``
blocks and spreads them over the ``x`` index: output Index (n, t, x) takes block
``x mod num_blocks`` of input Index (n, t, floor(x / num_blocks)).  It is used to
turn a wide feature vector into several rows (e.g. for convolution over x).

The precomputed indexes are, per output row, the input row and the block number;
propagate is one gather over a (rows, blocks, output-dim) view, backprop the
matching scatter.
"""

from __future__ import annotations

import numpy as np

from engine.core.errors import ComponentError
from engine.core.index import Index, as_index_rows
from engine.nnet.components._nonsimple_utils import config_errors_name_type, row_positions
from engine.nnet.components._fields import INT, TokenFieldsComponent
from engine.nnet.components.base import (
    ComponentPrecomputedIndexes,
    ComponentProperty as P,
    PrecomputeOnRows,
    register_component,
)


class DistributeIndexes(ComponentPrecomputedIndexes):
    """input_rows[i], blocks[i]: where output row i comes from."""

    def __init__(self, input_rows: np.ndarray, blocks: np.ndarray, num_input_rows: int):
        self.input_rows = input_rows
        self.blocks = blocks
        self.num_input_rows = num_input_rows


@register_component
class DistributeComponent(PrecomputeOnRows, TokenFieldsComponent):
    type_name = "DistributeComponent"
    _FIELDS = (("<InputDim>", "input_dim_", INT), ("<OutputDim>", "output_dim_", INT))

    def __init__(self) -> None:
        super().__init__()
        self.input_dim_ = 0
        self.output_dim_ = 0

    def properties(self):
        return P.NONE

    def input_dim(self) -> int:
        return self.input_dim_

    def output_dim(self) -> int:
        return self.output_dim_

    @property
    def num_blocks(self) -> int:
        return self.input_dim_ // self.output_dim_

    def _problems(self) -> list[str]:
        if self.input_dim_ <= 0 or self.output_dim_ <= 0:
            return ["input-dim and output-dim must be > 0"]
        if self.input_dim_ % self.output_dim_ != 0:
            return [f"input-dim={self.input_dim_} is not a multiple of "
                    f"output-dim={self.output_dim_}"]
        return []

    @config_errors_name_type
    def init_from_config(self, cfg, rng) -> None:
        self.input_dim_ = cfg.get_int("input-dim", required=True)
        self.output_dim_ = cfg.get_int("output-dim", required=True)
        self._raise_problems(cfg)

    # -- indexes ---------------------------------------------------------------------
    def _input_index_and_block(self, output_index: Index) -> tuple[Index, int]:
        nb = self.num_blocks
        # floor division rounds negative x down, which is what Kaldi computes by hand
        in_x = output_index.x // nb
        return Index(output_index.n, output_index.t, in_x), output_index.x - in_x * nb

    def get_input_indexes(self, misc_info, output_index):
        return [self._input_index_and_block(output_index)[0]]

    def is_computable(self, misc_info, output_index, input_index_set, used_inputs):
        idx = self._input_index_and_block(output_index)[0]
        if not input_index_set(idx):
            return False
        if used_inputs is not None:
            used_inputs[:] = [idx]
        return True

    def input_times(self, t: np.ndarray) -> np.ndarray:
        """get_input_indexes of many output Indexes at once (the compiler's array
        graph build), their t: the output's own."""
        return t[:, None]

    def input_x(self, x: np.ndarray) -> np.ndarray:
        """The x of the input of each output x (one column, as ``input_times``)."""
        return (x // self.num_blocks)[:, None]

    def input_rule(self):
        """is_computable on the columns of ``input_times``: the one input is there."""
        return None

    def precompute_index_arrays(self, misc_info, input_rows, output_rows,
                                need_backprop: bool) -> "DistributeIndexes":
        """precompute_indexes on (k, 3) n, t, x int64 rows (what the compiler hands
        over; the Index-list form calls this)."""
        out = as_index_rows(output_rows)
        nb = self.num_blocks
        want = out.copy()
        want[:, 2] = out[:, 2] // nb
        ins = as_index_rows(input_rows)
        rows = row_positions(want, ins)
        missing = np.flatnonzero(rows < 0)
        if len(missing):
            k = int(missing[0])
            raise ComponentError(f"input Index {Index(*want[k].tolist())} needed by output "
                                 f"Index {Index(*out[k].tolist())} is not in the input",
                                 component=self.label())
        return DistributeIndexes(rows, out[:, 2] - want[:, 2] * nb, len(ins))

    # -- maths -------------------------------------------------------------------------
    def propagate(self, indexes, in_value, out):
        if not isinstance(indexes, DistributeIndexes):
            raise ComponentError("propagate needs Distribute precomputed indexes",
                                 component=self.label())
        self.check_shape("input", in_value, None, self.input_dim_)
        self.check_shape("output", out, indexes.input_rows.shape[0], self.output_dim_)
        view = in_value.reshape(in_value.shape[0], self.num_blocks, self.output_dim_)
        out[...] = view[indexes.input_rows, indexes.blocks]
        return None

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv):
        if in_deriv is None:
            return
        if not isinstance(indexes, DistributeIndexes):
            raise ComponentError("backprop needs Distribute precomputed indexes",
                                 component=self.label())
        self.check_shape("output derivative", out_deriv, indexes.input_rows.shape[0],
                         self.output_dim_)
        self.check_shape("input derivative", in_deriv, None, self.input_dim_)
        nb = self.num_blocks
        if out_deriv.shape[0] != in_deriv.shape[0] * nb:
            # some input blocks are never used: their derivative is zero
            in_deriv[...] = 0
        contiguous = bool(in_deriv.flags.c_contiguous)
        target = in_deriv if contiguous else in_deriv.copy()
        view = target.reshape(in_deriv.shape[0], nb, self.output_dim_)
        view[indexes.input_rows, indexes.blocks] = out_deriv
        if not contiguous:  # reshape of a strided view was a copy: write it back
            in_deriv[...] = target
