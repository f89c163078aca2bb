"""RestrictedAttentionComponent (Kaldi's nnet-attention-component.{h,cc} and the maths
of attention.{h,cc}).

Self-attention restricted to a fixed window of ``num-left-inputs`` .. ``num-right-inputs``
input frames spaced ``time-stride`` apart.  Per head, an input row is
[key (key-dim), value (value-dim), query (key-dim + context-dim)], where
context-dim = num-left-inputs + 1 + num-right-inputs; the extra query part acts as a
per-position bias.  The output per head is the attention-weighted value sum, with the
weights themselves appended when ``output-context`` is true.

Like the time-height convolution, the component reorders its indexes onto a regular
t grid (t-major, then (n, x) "images"), padding missing rows with blank Indexes
(t = kNoTime) whose values the executor leaves at zero; the precomputed indexes are
just that grid (Kaldi's ConvolutionComputationIo).  With that layout the input rows
for context position o of output row r are row r + o * row_shift, so the maths is a
strided gather plus batched dot products; the memo holds the softmax weights.

Stats (entropy and posterior per head) are accumulated on every call to store_stats;
Kaldi stores them for a random third of minibatches only, to save time.
"""

from __future__ import annotations

import math

import numpy as np

from engine.core.errors import ComponentError
from engine.core.index import Index, K_NO_TIME, as_index_rows
from engine.core.xp import array_module, as_strided
from engine.nnet.components._nonsimple_utils import (
    config_errors_name_type,
    ConvolutionComputationIo,
    get_computation_io,
    get_nx_list,
    grid_rows,
    read_double_matrix,
    read_double_vector,
    write_double_matrix,
    write_double_vector,
)
from engine.nnet.components._fields import (
    BOOL,
    DOUBLE,
    FLOAT,
    INT,
    FieldKind,
    TokenFieldsComponent,
)
from engine.nnet.components.base import (
    Component,
    ComponentPrecomputedIndexes,
    ComponentProperty as P,
    PrecomputeOnRows,
    ReorderOnRows,
    register_component,
)


class RestrictedAttentionIndexes(ComponentPrecomputedIndexes):
    """The regular grid of the (reordered) input and output rows."""

    def __init__(self, io: ConvolutionComputationIo):
        self.num_images = io.num_images
        self.start_t_in = io.start_t_in
        self.t_step_in = io.t_step_in
        self.num_t_in = io.num_t_in
        self.start_t_out = io.start_t_out
        self.t_step_out = io.t_step_out
        self.num_t_out = io.num_t_out


class RestrictedAttentionMemo:
    """Softmax weights, shape (output rows, num-heads, context-dim)."""

    def __init__(self, c):
        self.c = c


def _softmax_last(xp, b):
    m = b.max(axis=-1, keepdims=True)
    e = xp.exp(b - m)
    return e / e.sum(axis=-1, keepdims=True)


# the stats' fields (Kaldi keeps them in double precision); the arrays are written from
# the host
_DOUBLE_VECTOR = FieldKind(read_double_vector,
                           lambda w, v: write_double_vector(w, np.asarray(_host(v))))
_DOUBLE_MATRIX = FieldKind(read_double_matrix,
                           lambda w, v: write_double_matrix(w, np.asarray(_host(v))))


@register_component
class RestrictedAttentionComponent(ReorderOnRows, PrecomputeOnRows, TokenFieldsComponent):
    type_name = "RestrictedAttentionComponent"
    ARRAYS = ("entropy_stats", "posterior_stats")
    STAT_FIELDS = ("entropy_stats", "posterior_stats", "stats_count")
    _FIELDS = (("<NumHeads>", "num_heads", INT), ("<KeyDim>", "key_dim", INT),
              ("<ValueDim>", "value_dim", INT), ("<NumLeftInputs>", "num_left_inputs", INT),
              ("<NumRightInputs>", "num_right_inputs", INT),
              ("<TimeStride>", "time_stride", INT),
              ("<NumLeftInputsRequired>", "num_left_inputs_required", INT),
              ("<NumRightInputsRequired>", "num_right_inputs_required", INT),
              ("<OutputContext>", "output_context", BOOL), ("<KeyScale>", "key_scale", FLOAT),
              ("<StatsCount>", "stats_count", DOUBLE),
              ("<EntropyStats>", "entropy_stats", _DOUBLE_VECTOR),
              ("<PosteriorStats>", "posterior_stats", _DOUBLE_MATRIX))

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 1
        self.key_dim = -1
        self.value_dim = -1
        self.num_left_inputs = -1
        self.num_right_inputs = -1
        self.time_stride = 1
        self.num_left_inputs_required = -1
        self.num_right_inputs_required = -1
        self.output_context = True
        self.key_scale = -1.0
        self.stats_count = 0.0
        self.entropy_stats = np.zeros(0, dtype=np.float64)
        self.posterior_stats = np.zeros((0, 0), dtype=np.float64)

    # -- identity ----------------------------------------------------------------------
    @property
    def context_dim(self) -> int:
        return self.num_left_inputs + 1 + self.num_right_inputs

    def properties(self):
        return (P.REORDERS_INDEXES | P.BACKPROP_NEEDS_INPUT | P.PROPAGATE_ADDS |
                P.BACKPROP_ADDS | P.STORES_STATS | P.USES_MEMO)

    def _in_per_head(self) -> int:
        return self.key_dim + self.value_dim + self.key_dim + self.context_dim

    def _out_per_head(self) -> int:
        return self.value_dim + (self.context_dim if self.output_context else 0)

    def input_dim(self) -> int:
        return self.num_heads * self._in_per_head()

    def output_dim(self) -> int:
        return self.num_heads * self._out_per_head()

    def info(self) -> str:
        s = (f"{self.type_name}, input-dim={self.input_dim()}, output-dim={self.output_dim()}"
             f", num-heads={self.num_heads}, time-stride={self.time_stride}"
             f", key-dim={self.key_dim}, value-dim={self.value_dim}"
             f", num-left-inputs={self.num_left_inputs}"
             f", num-right-inputs={self.num_right_inputs}, context-dim={self.context_dim}"
             f", num-left-inputs-required={self.num_left_inputs_required}"
             f", num-right-inputs-required={self.num_right_inputs_required}"
             f", output-context={'true' if self.output_context else 'false'}"
             f", key-scale={self.key_scale:g}")
        if self.stats_count != 0.0:
            ent = np.asarray(self.entropy_stats) / self.stats_count
            s += ", entropy=" + "".join(f"{v:g}," for v in ent)
            post = np.asarray(self.posterior_stats) / self.stats_count
            for h in range(min(post.shape[0], 5)):  # (none before stats are stored)
                s += f" posterior-stats[{h}]=" + "".join(f"{v:g}," for v in post[h])
            s += f" stats-count={self.stats_count:g}"
        return s

    def _problems(self) -> list[str]:
        bad = []
        if self.num_heads <= 0:
            bad.append("num-heads must be > 0")
        if self.key_dim <= 0:
            bad.append("key-dim must be > 0")
        if self.value_dim <= 0:
            bad.append("value-dim must be > 0")
        if self.num_left_inputs < 0 or self.num_right_inputs < 0 or \
                self.num_left_inputs + self.num_right_inputs <= 0:
            bad.append("num-left-inputs and num-right-inputs must be >= 0 with a positive sum")
        if not 0 <= self.num_left_inputs_required <= max(self.num_left_inputs, 0):
            bad.append("num-left-inputs-required must be in [0, num-left-inputs]")
        if not 0 <= self.num_right_inputs_required <= max(self.num_right_inputs, 0):
            bad.append("num-right-inputs-required must be in [0, num-right-inputs]")
        if self.time_stride <= 0:
            bad.append("time-stride must be > 0")
        if not 0.0 < self.key_scale <= 1.0:
            bad.append("key-scale must be in (0, 1]")
        if self.stats_count < 0.0:
            bad.append("stats count must be >= 0")
        # the stats are empty until some are stored, then one entry per head (and context
        # position); store_stats adds to them
        ent, post = np.shape(self.entropy_stats), np.shape(self.posterior_stats)
        heads, context = self.num_heads, self.context_dim
        if (ent, post) not in (((0,), (0, 0)), ((heads,), (heads, context))):
            bad.append(f"stats of shapes {ent} and {post} do not fit num-heads={heads} and "
                       f"context-dim={context}")
        return bad

    # -- config / files ----------------------------------------------------------------
    @config_errors_name_type
    def init_from_config(self, cfg, rng) -> None:
        missing = [k for k in ("key-dim", "value-dim", "num-left-inputs", "num-right-inputs")
                   if not cfg.has(k)]
        if missing:
            raise cfg.error(f"{self.type_name}: all of key-dim, value-dim, num-left-inputs "
                            f"and num-right-inputs must be given (missing: "
                            f"{', '.join(missing)})")
        self.key_dim = cfg.get_int("key-dim")
        self.value_dim = cfg.get_int("value-dim")
        self.num_left_inputs = cfg.get_int("num-left-inputs")
        self.num_right_inputs = cfg.get_int("num-right-inputs")
        self.num_heads = cfg.get_int("num-heads", 1)
        self.time_stride = cfg.get_int("time-stride", 1)
        self.num_left_inputs_required = cfg.get_int("num-left-inputs-required", -1)
        self.num_right_inputs_required = cfg.get_int("num-right-inputs-required", -1)
        self.output_context = cfg.get_bool("output-context", True)
        self.key_scale = cfg.get_float("key-scale", -1.0)
        if self.key_scale < 0.0 and self.key_dim > 0:
            self.key_scale = float(np.float32(1.0 / math.sqrt(self.key_dim)))
        if self.num_left_inputs_required < 0:
            self.num_left_inputs_required = self.num_left_inputs
        if self.num_right_inputs_required < 0:
            self.num_right_inputs_required = self.num_right_inputs
        self.stats_count = 0.0
        self._raise_problems(cfg)

    # -- indexes ---------------------------------------------------------------------
    def get_input_indexes(self, misc_info, output_index):
        if output_index.t == K_NO_TIME:
            raise ComponentError("blank output Index", component=self.label())
        n, t, x = output_index
        s = self.time_stride
        return [Index(n, t + s * o, x)
                for o in range(-self.num_left_inputs, self.num_right_inputs + 1)]

    def input_times(self, t: np.ndarray) -> np.ndarray:
        """get_input_indexes of many output Indexes at once (the compiler's array
        graph build): row i holds the t of the inputs of an output at t[i]."""
        if (t == K_NO_TIME).any():
            raise ComponentError("blank output Index", component=self.label())
        steps = np.arange(-self.num_left_inputs, self.num_right_inputs + 1, dtype=np.int64)
        return t[:, None] + self.time_stride * steps[None, :]

    def input_rule(self) -> np.ndarray:
        """is_computable as a rule on the columns of ``input_times``: computable when
        the required context positions are, using every input that is."""
        o = np.arange(-self.num_left_inputs, self.num_right_inputs + 1)
        return (o >= -self.num_left_inputs_required) & (o <= self.num_right_inputs_required)

    def is_computable(self, misc_info, output_index, input_index_set, used_inputs):
        n, t, x = output_index
        s = self.time_stride
        if used_inputs is None:
            return all(input_index_set(Index(n, t + s * o, x))
                       for o in range(-self.num_left_inputs_required,
                                      self.num_right_inputs_required + 1))
        used = []
        for o in range(-self.num_left_inputs, self.num_right_inputs + 1):
            idx = Index(n, t + s * o, x)
            if input_index_set(idx):
                used.append(idx)
            elif -self.num_left_inputs_required <= o <= self.num_right_inputs_required:
                used_inputs.clear()
                return False
        used_inputs[:] = used
        return True

    def _computation_structure(self, input_indexes, output_indexes) -> ConvolutionComputationIo:
        io = get_computation_io(input_indexes, output_indexes, self.label())
        s = self.time_stride
        if io.t_step_out == 0:
            io.t_step_out = s
        if io.t_step_in == 0:
            io.t_step_in = s
        # one grid step for input and output, dividing the time stride
        step = math.gcd(math.gcd(io.t_step_out, io.t_step_in), s)
        mult_out, mult_in = io.t_step_out // step, io.t_step_in // step
        io.t_step_in = io.t_step_out = step
        io.num_t_out = 1 + mult_out * (io.num_t_out - 1)
        io.num_t_in = 1 + mult_in * (io.num_t_in - 1)
        first_requested = io.start_t_out - s * self.num_left_inputs
        first_required = io.start_t_out - s * self.num_left_inputs_required
        last_t_out = io.start_t_out + (io.num_t_out - 1) * step
        last_t_in = io.start_t_in + (io.num_t_in - 1) * step
        last_requested = last_t_out + s * self.num_right_inputs
        last_required = last_t_out + s * self.num_right_inputs_required
        if not (io.start_t_in >= first_requested and last_t_in <= last_requested and
                io.start_t_in <= first_required and last_t_in >= last_required):
            raise ComponentError(
                f"input t range [{io.start_t_in}, {last_t_in}] does not fit the output t "
                f"range [{io.start_t_out}, {last_t_out}] (needs at least "
                f"[{first_required}, {last_required}], at most "
                f"[{first_requested}, {last_requested}])", component=self.label())
        # requested-but-not-required inputs become zero-valued padding rows
        io.start_t_in = first_requested
        io.num_t_in = 1 + (last_requested - first_requested) // step
        return io

    def reorder_index_arrays(self, input_rows, output_rows) -> tuple[np.ndarray, np.ndarray]:
        """reorder_indexes on (k, 3) n, t, x int64 rows.  Rows already in that order
        are given back as the same objects (the compiler tests identity to know that
        nothing moved)."""
        ins, outs = as_index_rows(input_rows), as_index_rows(output_rows)
        io = self._computation_structure(ins, outs)
        nx = get_nx_list(ins)
        new_in = grid_rows(nx, io.start_t_in, io.t_step_in, io.num_t_in, 1, ins, self.label())
        new_out = grid_rows(nx, io.start_t_out, io.t_step_out, io.num_t_out, 1, outs,
                            self.label())
        if np.array_equal(new_in, ins) and np.array_equal(new_out, outs):
            return input_rows, output_rows
        return new_in, new_out

    def precompute_index_arrays(self, misc_info, input_rows, output_rows,
                                need_backprop: bool) -> "RestrictedAttentionIndexes":
        """precompute_indexes on (k, 3) n, t, x int64 rows."""
        return RestrictedAttentionIndexes(
            self._computation_structure(as_index_rows(input_rows), as_index_rows(output_rows)))

    # -- maths -------------------------------------------------------------------------
    def _layout(self, indexes, in_rows: int, out_rows: int):
        if not isinstance(indexes, RestrictedAttentionIndexes):
            raise ComponentError("needs RestrictedAttention precomputed indexes",
                                 component=self.label())
        ni = indexes.num_images
        if in_rows != indexes.num_t_in * ni or out_rows != indexes.num_t_out * ni:
            raise ComponentError(
                f"rows (input {in_rows}, output {out_rows}) do not match the precomputed "
                f"grid ({indexes.num_t_in} x {ni} in, {indexes.num_t_out} x {ni} out)",
                component=self.label())
        step = indexes.t_step_in
        left_steps = (indexes.start_t_out - indexes.start_t_in) // step
        row_shift = (self.time_stride // step) * ni
        return left_steps * ni, row_shift

    def _split_input(self, x):
        H, K, V, C = self.num_heads, self.key_dim, self.value_dim, self.context_dim
        x3 = x.reshape(x.shape[0], H, self._in_per_head())
        return x3[:, :, :K], x3[:, :, K:K + V], x3[:, :, K + V:K + V + K], \
            x3[:, :, K + V + K:K + V + K + C]

    @staticmethod
    def _context_view(xp, part, R: int, C: int, row_shift: int):
        """part (rows, H, d) seen as (R, C, H, d): [r, o] is part[r + o * row_shift], a
        strided view (what indexing with r + o * row_shift would copy)."""
        s0, s1, s2 = part.strides
        return as_strided(xp)(part, shape=(R, C, part.shape[1], part.shape[2]),
                              strides=(s0, row_shift * s0, s1, s2))

    def propagate(self, indexes, in_value, out):
        xp = array_module(in_value)
        self.check_shape("input", in_value, None, self.input_dim())
        self.check_shape("output", out, None, self.output_dim())
        R = out.shape[0]
        q_off, row_shift = self._layout(indexes, in_value.shape[0], R)
        C, V = self.context_dim, self.value_dim
        keys, values, qk, qc = self._split_input(in_value)
        qk, qc = qk[q_off:q_off + R], qc[q_off:q_off + R]
        keys_g = self._context_view(xp, keys, R, C, row_shift)              # (R, C, H, K)
        # batched products over (row, head): (1, K) x (K, C), then (1, C) x (C, V)
        b = self.key_scale * xp.matmul(qk[:, :, None, :],
                                       keys_g.transpose(0, 2, 3, 1))[:, :, 0, :] + qc
        c = _softmax_last(xp, b)                                             # (R, H, C)
        # PROPAGATE_ADDS: add both parts (the compiler zeroes the output first)
        out3 = out.reshape(R, self.num_heads, self._out_per_head()) \
            if out.flags.c_contiguous else None
        vals = xp.matmul(c[:, :, None, :], self._context_view(
            xp, values, R, C, row_shift).transpose(0, 2, 1, 3))[:, :, 0, :]
        if out3 is not None:
            out3[:, :, :V] += vals
            if self.output_context:
                out3[:, :, V:] += c
        else:
            add = xp.concatenate([vals, c], axis=2) if self.output_context else vals
            out += add.reshape(R, -1)
        return RestrictedAttentionMemo(c)

    def backprop(self, debug_info, indexes, in_value, out_value, out_deriv, memo,
                 to_update, in_deriv):
        if in_deriv is None:
            return
        if not isinstance(memo, RestrictedAttentionMemo):
            raise ComponentError("backprop needs the memo returned by propagate",
                                 component=self.label())
        xp = array_module(out_deriv)
        self.check_shape("input value", in_value, None, self.input_dim())
        self.check_shape("output derivative", out_deriv, None, self.output_dim())
        self.check_shape("input derivative", in_deriv, in_value.shape[0], self.input_dim())
        R = out_deriv.shape[0]
        q_off, row_shift = self._layout(indexes, in_value.shape[0], R)
        H, K, V, C = self.num_heads, self.key_dim, self.value_dim, self.context_dim
        c = memo.c
        keys, values, qk, _ = self._split_input(in_value)
        qk = qk[q_off:q_off + R]
        d3 = out_deriv.reshape(R, H, self._out_per_head())
        dv = d3[:, :, :V]
        c_deriv = xp.matmul(dv[:, :, None, :], self._context_view(
            xp, values, R, C, row_shift).transpose(0, 2, 3, 1))[:, :, 0, :]
        if self.output_context:
            c_deriv = c_deriv + d3[:, :, V:]
        # back through the softmax
        b_deriv = c * (c_deriv - (c * c_deriv).sum(axis=-1, keepdims=True))
        grad = xp.zeros((in_value.shape[0], H, self._in_per_head()), dtype=in_deriv.dtype)
        grad[q_off:q_off + R, :, K + V + K:] += b_deriv
        grad[q_off:q_off + R, :, K + V:K + V + K] += self.key_scale * xp.matmul(
            b_deriv[:, :, None, :], self._context_view(
                xp, keys, R, C, row_shift).transpose(0, 2, 1, 3))[:, :, 0, :]
        # the keys' and values' derivatives, context position by context position
        # (each a row-shifted block add; no (R, C, H, d) temporaries)
        for o in range(C):
            rows = slice(o * row_shift, o * row_shift + R)
            kd = b_deriv[:, :, o, None] * qk
            kd *= self.key_scale
            grad[rows, :, :K] += kd
            grad[rows, :, K:K + V] += c[:, :, o, None] * dv
        in_deriv += grad.reshape(in_value.shape[0], -1)

    # -- stats -------------------------------------------------------------------------
    def store_stats(self, in_value, out_value, memo) -> None:
        if not isinstance(memo, RestrictedAttentionMemo):
            raise ComponentError("store_stats needs the memo returned by propagate",
                                 component=self.label())
        H, C = self.num_heads, self.context_dim
        if np.asarray(_host(self.entropy_stats)).shape != (H,):
            self.entropy_stats = np.zeros(H, dtype=np.float64)
            self.posterior_stats = np.zeros((H, C), dtype=np.float64)
            self.stats_count = 0.0
        c = memo.c
        xp = array_module(c)
        post = _host(c.sum(axis=0)).astype(np.float64)                       # (H, C)
        logc = xp.log(xp.maximum(c, 1.0e-20))
        ent = _host(-(c * logc).sum(axis=(0, 2))).astype(np.float64)         # (H,)
        self.posterior_stats = np.asarray(_host(self.posterior_stats)) + post
        self.entropy_stats = np.asarray(_host(self.entropy_stats)) + ent
        self.stats_count += float(c.shape[0])

    def zero_stats(self) -> None:
        self.entropy_stats = np.zeros_like(np.asarray(_host(self.entropy_stats)))
        self.posterior_stats = np.zeros_like(np.asarray(_host(self.posterior_stats)))
        self.stats_count = 0.0

    def scale(self, alpha: float) -> None:
        self.entropy_stats = np.asarray(_host(self.entropy_stats)) * alpha
        self.posterior_stats = np.asarray(_host(self.posterior_stats)) * alpha
        self.stats_count *= alpha

    def add(self, alpha: float, other: "Component") -> None:
        oe = np.asarray(_host(other.entropy_stats))
        op = np.asarray(_host(other.posterior_stats))
        if np.asarray(_host(self.entropy_stats)).size == 0 and oe.size:
            self.entropy_stats = np.zeros_like(oe)
        if np.asarray(_host(self.posterior_stats)).size == 0 and op.size:
            self.posterior_stats = np.zeros_like(op)
        if oe.size:
            self.entropy_stats = np.asarray(_host(self.entropy_stats)) + alpha * oe
        if op.size:
            self.posterior_stats = np.asarray(_host(self.posterior_stats)) + alpha * op
        self.stats_count += alpha * other.stats_count


def _host(a):
    from engine.core.xp import to_numpy  # noqa: PLC0415
    return to_numpy(a)
