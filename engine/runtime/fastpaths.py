"""Direct NumPy forms of the hottest component propagates, for the compiled
program (engine/runtime/program.py) and the arena-bound program (arena.py).

Kaldi's NnetComputer calls a virtual Propagate whose own cost is nothing next to
the matrix work; here a component's ``propagate`` spends 1-5 microseconds of
Python (shape checks, array-module lookup, temporaries) around 1-2 microseconds
of NumPy work for the small matrices of a 21-frame chunk or of one recurrent
step.  The functions below do the same NumPy operations on the same values, in
the same order and precision, writing with ``out=`` into the output or into
temporaries instead of allocating, so the results are bit-identical
(tests/engine/test_executor_program.py checks this against the components on
random and reference networks):

- element-wise arithmetic (+, -, *, /, max) is exact in IEEE arithmetic, so its
  grouping into calls and the memory it writes do not matter;
- transcendental functions (exp, tanh, log) are evaluated on inputs and into
  outputs of the same layout as in the component (a contiguous temporary where
  the component makes a fresh array), as NumPy may pick a different loop for
  other strides;
- reductions (sums) run over arrays of the same layout as in the component;
- matrix products are the same calls (same operands, same transposition) or, for frozen
  weights, the same product kernel (engine.core.sgemm), whose bits do not depend on the
  product's shape or on where its output goes.

The logistic of a small array (at most ``nonlinear.SMALL_SIGMOID`` elements) is SciPy's
``expit``, one ufunc call, as the component takes it for that size; expit's loop is
the same scalar code for every layout, so writing into a strided output changes no
bits.  For larger arrays it is the component's exp form, u = exp(min(x, 88.72)) into a
contiguous temporary, then u / (1 + u): the same four operations, with the cap read
from an array of x's shape (a shared read-only block, as ReLU's zeros below: NumPy's
minimum takes its vector loop against a same-shape array, 1.5x faster than against a
scalar, with the same bits).

ReLU is max(x, 0) against a zero *array* of x's row shape (a shared read-only
block of 64K zeros, a row block at a time): NumPy 2's maximum/minimum run their
vector loop only when both operands are arrays of the same shape and take a
scalar loop 2-3x slower against a scalar or a broadcast row; the ufunc and the
values are the same, so the bits are too (NaN and -0 included).

Each form applies only to the exact class it was written for, whose
``propagate`` must still be the one it mirrors (a subclass that overrides it, an
unexpected state such as batch-norm in training mode, or a shape the component
would reject goes to the component's own ``propagate``, which also raises the
proper error).

Two variants exist: ``fast_propagate(type)`` gives ``f(comp, indexes, x, out)``
for the dynamic program (temporaries allocated per call), and
``bind_propagate(type, x, out, scratch)`` gives ``f(comp, indexes)`` with the
input and output arrays, their shape checks and the temporaries bound once
(arena.BoundProgram).  Only the NumPy backend uses them; CuPy calls the
components.
"""

from __future__ import annotations

import weakref

import numpy as np

from engine.core import sgemm
from engine.nnet.components.affine import (AffineComponent, FixedAffineComponent,
                                           LinearComponent, NaturalGradientAffineComponent)
from engine.nnet.components.dropout import GeneralDropoutComponent
from engine.nnet.components.gradient_control import BackpropTruncationComponent
from engine.nnet.components.misc import ElementwiseProductComponent, NoOpComponent
from engine.nnet.components.nonlinear import (EXP_INPUT_MAX, LogSoftmaxComponent,
                                              RectifiedLinearComponent, SigmoidComponent,
                                              TanhComponent, expit, small_sigmoid)
from engine.nnet.components.normalize import BatchNormComponent
from engine.nnet.components.recurrent import LstmNonlinearityComponent
from engine.nnet.components.scale_offset import (NaturalGradientPerElementScaleComponent,
                                                 PerElementScaleComponent)
from engine.nnet.components.tdnn import TdnnComponent, spliced_product
from engine.runtime.gemm import (DIRECT, DOT, EXCHANGED, PANELS, TCOPY, frozen, nt_form,
                                 panel_product, panel_width, transposed_copy,
                                 transposed_panels)

_matmul, _dot, _add, _multiply, _copyto = np.matmul, np.dot, np.add, np.multiply, np.copyto
_packed_for, _kernel_into, _kernel_out_ok = sgemm.packed_for, sgemm.product_into, sgemm.out_ok
_kernel_nt = sgemm.product     # False, with nothing written, where out overlaps x
_exp, _divide, _maximum, _minimum = np.exp, np.divide, np.maximum, np.minimum
_np_tanh, _log, _subtract = np.tanh, np.log, np.subtract
_max_reduce, _add_reduce = np.maximum.reduce, np.add.reduce
_F32 = np.dtype(np.float32)
# scalar operands as 0-d float32 arrays: the same float32 values a Python number
# takes against a float32 array, without converting it on every call
_ONE = np.array(1.0, np.float32)
_ZERO = np.array(0.0, np.float32)
# max(x, 0) reads its zeros from here, a row block at a time (see the docstring)
_ZEROS = np.zeros(1 << 16, np.float32)
_ZEROS.flags.writeable = False
# the logistic's exp input cap (nonlinear.EXP_INPUT_MAX), as an array of up to 64K
# elements (see the docstring)
_CAPS = np.full(1 << 16, EXP_INPUT_MAX, np.float32)
_CAPS.flags.writeable = False


class _Fresh:
    """Scratch stand-in for the dynamic forms: a new temporary every time."""

    @staticmethod
    def get(shape, slot: int = 0, dtype=np.float32):
        return np.empty(shape, dtype=dtype)


_FRESH = _Fresh()


def _inner_contiguous(a) -> bool:
    """Rows are contiguous (the layout a fresh array has, row by row)."""
    return a.ndim == 2 and (a.shape[1] <= 1 or a.strides[1] == a.itemsize)


def _c_contiguous(a) -> bool:
    return a.flags.c_contiguous


def _cap(shape):
    """nonlinear.EXP_INPUT_MAX in a read-only contiguous array of ``shape`` (a view of
    the shared block), or as a float32 scalar (the same value) beyond its size."""
    n = 1
    for k in shape:
        n *= k
    if n > _CAPS.size:
        return _CAPS[0]
    return _CAPS[:n].reshape(shape)


def _logistic(a, out, t, d, cap) -> None:
    """out = the logistic of ``a`` in the components' exp form (nonlinear.sigmoid):
    u = exp(min(a, cap)) in ``t``, then u / (1 + u); t, d: contiguous temporaries of
    a's shape; cap: ``_cap(a.shape)``; out may be a."""
    _minimum(a, cap, out=t)
    _exp(t, t)
    _add(t, _ONE, d)
    _divide(t, d, out)


# --------------------------------------------------------------------------------------
# affine-type components: out[...] = x @ W^T (+ b).  The product is the components'
# ``x @ W.T`` or, where gemm.nt_form has found it faster and equal bit for bit,
# ``(W @ x.T).T``, ``np.dot`` or, for frozen weights, ``x @ (copy of W.T)`` (gemm.py).


def _product_nt(x, w, direct_out):
    """x @ w.T: into ``direct_out`` (returned) or, in the exchanged form, into a
    new (n, rows) array whose transpose is returned."""
    packed = _packed_for(x, w)
    if packed is not None:          # the product kernel's (engine.core.sgemm)
        _kernel_into(x, packed, w.shape[0], direct_out)
        return direct_out
    form = nt_form(x, w, direct_out)
    if form == EXCHANGED:
        t = np.empty((w.shape[0], x.shape[0]), dtype=direct_out.dtype)
        _matmul(w, x.T, out=t)
        return t.T
    wT = _weight_operand(w, form)
    if form == DOT:
        _dot(x, wT, direct_out)
    elif form >= PANELS:
        panel_product(x, wT, direct_out)
    else:       # DIRECT (wT is w.T) or TCOPY (wT is the contiguous copy)
        _matmul(x, wT, out=direct_out)
    return direct_out


def _weight_operand(w, form: int):
    """What the product in ``form`` multiplies x by: the transposed copy (TCOPY),
    its panels (panel forms) or the view ``w.T`` (DIRECT, DOT; unused by EXCHANGED)."""
    if form == TCOPY:
        return transposed_copy(w)
    if form >= PANELS:
        return transposed_panels(w, panel_width(form))
    return w.T


class _BoundNT:
    """x @ w.T for a fixed x (and output shape), the form decided per weight array:
    the product kernel's where it applies (engine.core.sgemm), else gemm.nt_form's."""

    def __init__(self, x, out_shape, scratch, slot: int):
        self.x, self.xT = x, x.T
        self.shape = out_shape
        self.scratch, self.slot = scratch, slot
        self.w = self.wT = self.packed = None
        self.kernel = sgemm.KERNEL      # the decision's (sgemm.set_enabled: decide anew)
        self.form = DIRECT
        self.t = self.tT = None

    def __call__(self, w, direct_out):
        # a weight made writeable again after its copy was taken: decide anew
        if (w is not self.w or sgemm.KERNEL is not self.kernel
                or ((self.form >= TCOPY or self.packed is not None) and not frozen(w))):
            self.kernel = sgemm.KERNEL
            self.packed = _packed_for(self.x, w)
            self.form = DIRECT if self.packed is not None else nt_form(self.x, w, direct_out)
            if self.form == EXCHANGED and self.t is None:
                self.t = self.scratch.get((self.shape[1], self.shape[0]), self.slot,
                                          direct_out.dtype)
                self.tT = self.t.T
            self.w, self.wT = w, _weight_operand(w, self.form)
        if self.packed is not None:
            _kernel_into(self.x, self.packed, self.shape[1], direct_out)
            return direct_out
        if self.form == EXCHANGED:
            _matmul(w, self.xT, self.t)
            return self.tT
        if self.form == DOT:
            _dot(self.x, self.wT, direct_out)
        elif self.form >= PANELS:
            panel_product(self.x, self.wT, direct_out)
        else:       # DIRECT (wT is w.T) or TCOPY (wT is the contiguous copy)
            _matmul(self.x, self.wT, direct_out)
        return direct_out


def _affine(comp, pre, x, out):
    w = comp.linear_params
    if (x.ndim != 2 or out.ndim != 2 or x.shape[1] != w.shape[1]
            or out.shape[0] != x.shape[0] or out.shape[1] != w.shape[0]):
        return comp.propagate(pre, x, out)
    # out[...] = x @ W^T; out += b   (the same GEMM, without the temporary)
    _add(_product_nt(x, w, out), comp.bias_params, out=out)
    return None


def _bind_affine(x, out, scratch):
    if x.ndim != 2 or out.ndim != 2 or out.shape[0] != x.shape[0]:
        return None
    wshape = (out.shape[1], x.shape[1])
    xT = x.T
    # per weight array (checked by identity): the product kernel's packed weight, or its
    # transpose, the product form and, for the exchanged form, the (n, rows) temporary
    # and its transpose
    cur_w = wT = t = add_bias_t = packed = None
    kernel = sgemm.KERNEL       # the decision's (sgemm.set_enabled: decide anew)
    form = DIRECT
    add_bias = _row_adder(out)
    # the kernel adds the bias as it writes (one rounding of product + bias, as the
    # component's two steps) where out takes its stores, the bias is a plain vector and
    # out does not overlap x (else the product through a temporary, then the bias)
    fused = _kernel_out_ok(out)

    def f(comp, pre):
        nonlocal cur_w, wT, t, add_bias_t, form, packed, kernel
        w = comp.linear_params
        if (w is not cur_w or w.shape != wshape or sgemm.KERNEL is not kernel
                or ((form >= TCOPY or packed is not None) and not frozen(w))):
            if w.ndim != 2 or w.shape != wshape:
                return comp.propagate(pre, x, out)
            kernel = sgemm.KERNEL
            packed = _packed_for(x, w)
            form = DIRECT if packed is not None else nt_form(x, w, out)
            if form == EXCHANGED and t is None:
                t = scratch.get((wshape[0], x.shape[0]), 20)
                add_bias_t = _same_shape_op(t.T, out, _add)    # out = t^T + b
            cur_w, wT = w, _weight_operand(w, form)
        if packed is not None:
            b = comp.bias_params
            if not (fused and b.dtype == _F32 and b.shape == (wshape[0],)
                    and b.flags.c_contiguous and _kernel_nt(x, packed, wshape[0], out, b, False)):
                _kernel_into(x, packed, wshape[0], out)
                add_bias(b)
        elif form == EXCHANGED:
            _matmul(w, xT, t)
            add_bias_t(comp.bias_params)
        else:
            if form == DOT:
                _dot(x, wT, out)
            elif form >= PANELS:
                panel_product(x, wT, out)
            else:       # DIRECT (wT is w.T) or TCOPY (wT is the contiguous copy)
                _matmul(x, wT, out)
            add_bias(comp.bias_params)
        return None
    return f


def _linear(comp, pre, x, out):
    w = comp.params
    if (x.ndim != 2 or out.ndim != 2 or x.shape[1] != w.shape[1]
            or out.shape[0] != x.shape[0] or out.shape[1] != w.shape[0]):
        return comp.propagate(pre, x, out)
    # out += x @ W^T
    if w.dtype != _F32 or x.dtype != _F32 or out.dtype != _F32:
        _add(out, _matmul(x, w.T), out=out)
    else:
        _add(out, _product_nt(x, w, np.empty(out.shape, _F32)), out=out)
    return None


def _bind_linear(x, out, scratch, write: bool = False):
    """``write``: ``out`` holds nothing to add to (the zeroing before it is dropped,
    see bind_propagate_write): the product is written into it."""
    if x.ndim != 2 or out.ndim != 2 or out.shape[0] != x.shape[0]:
        return None
    nin, nout = x.shape[1], out.shape[1]
    if x.dtype != _F32 or out.dtype != _F32:
        return None
    tmp = None if write else scratch.get(out.shape, 0)
    prod = _BoundNT(x, out.shape, scratch, 20)

    def f(comp, pre):
        w = comp.params
        if w.shape[1] != nin or w.shape[0] != nout or w.dtype != _F32:
            if write:
                out.fill(0.0)
            return comp.propagate(pre, x, out)
        _product_into(prod, w, out, tmp, write)
        return None
    return f


def _product_into(prod, w, out, tmp, write: bool) -> None:
    """The product ``prod(w, ...)`` (a _BoundNT) written into ``out`` (``write``) or
    added to it (through ``tmp``)."""
    if write:
        r = prod(w, out)
        if r is not out:
            _copyto(out, r)
    else:
        _add(out, prod(w, tmp), out=out)


def _tdnn_ok(comp, x, out) -> bool:
    w = comp.linear_params
    k = len(comp.time_offsets)
    return not (x.ndim != 2 or out.ndim != 2 or k == 0 or w.shape[1] % k or w.dtype != _F32
                or x.dtype != _F32 or out.dtype != _F32
                or x.shape[1] != w.shape[1] // k or out.shape[1] != w.shape[0])


def _tdnn(comp, pre, x, out):
    if not _tdnn_ok(comp, x, out):
        return comp.propagate(pre, x, out)
    w = comp.linear_params
    d, rows = x.shape[1], out.shape[0]
    stride, offsets = comp._layout(pre, x.shape[0], rows)   # raises as propagate would
    bias = comp.bias_params
    if sgemm.parts_nt(tuple(comp._part(x, off, stride, rows) for off in offsets), w, out,
                      bias if bias.shape[0] != 0 else None):
        return None         # the product kernel, as the component takes it
    # the products to sum: one over the offsets' rows side by side (tdnn.spliced_product),
    # else one per offset with its column block of the weights
    if spliced_product(rows, d, len(offsets), out.shape[1]):
        spliced = np.empty((rows, len(offsets) * d), _F32)
        for i, off in enumerate(offsets):
            _copyto(spliced[:, i * d:(i + 1) * d], comp._part(x, off, stride, rows))
        terms = [(spliced, w)]
    else:
        terms = [(comp._part(x, off, stride, rows), w[:, i * d:(i + 1) * d])
                 for i, off in enumerate(offsets)]
    tmp = np.empty(out.shape, dtype=out.dtype)
    for i, (part, block) in enumerate(terms):
        if i == 0 and bias.shape[0] != 0:
            # bias + first product, as the component sums them (addition commutes exactly)
            _add(_product_nt(part, block, out), bias, out=out)
        else:
            # out += part @ W_i^T, the product in a temporary as the component makes it
            _add(out, _product_nt(part, block, tmp), out=out)
    return None


def _bind_tdnn(x, out, scratch, write: bool = False):
    """``write``: as _bind_linear's (a TDNN without bias adds to its output)."""
    if x.ndim != 2 or out.ndim != 2 or x.dtype != _F32 or out.dtype != _F32:
        return None
    tmp = scratch.get(out.shape, 0, out.dtype)
    d, rows = x.shape[1], out.shape[0]
    # the parts of x per (row offset, stride), each with its own product form, and
    # the column blocks of the weights (kept while the weight array is the same)
    parts: dict = {}
    blocks: list = [None, ()]
    # the checks and the row layout, redone only when the weight array, the component
    # or the precomputed indexes are other objects than at the last call
    last: list = [None, None, None, None]     # w, comp, pre, (stride, offsets)
    add_bias = _row_adder(out)
    # the spliced form (tdnn.spliced_product): per (stride, offsets), the copies of the
    # offsets' rows into the spliced buffer and the product over that buffer
    spliced: list = [None, (), None]

    def first(prod, block, bias) -> None:
        """The first (or only) product into ``out``: the component writes the bias,
        then adds the product -- the same sum (addition commutes exactly) without the
        pass that copies the bias; with no bias, zeroed before (``write``): 0 +
        product is the product (but for the sign of a zero); else added to ``out``."""
        if bias.shape[0] != 0:
            r = prod(block, out)
            if r is out:
                add_bias(bias)
            else:
                _add(r, bias, out=out)
        else:
            _product_into(prod, block, out, tmp, write)

    # the product kernel's (engine.core.sgemm): the parts (views of x per offset) and the
    # packed weight, decided again when the layout, the weight array or the switch change
    kern: list = [None, None, None]        # parts, packed (or None), sgemm.KERNEL
    kernel_out = _kernel_out_ok(out)

    def f(comp, pre):
        w = comp.linear_params
        if w is not last[0] or comp is not last[1] or pre is not last[2]:
            if not _tdnn_ok(comp, x, out):
                if write:
                    out.fill(0.0)
                return comp.propagate(pre, x, out)
            last[:] = w, comp, pre, comp._layout(pre, x.shape[0], rows)
            kern[2] = False
        stride, offsets = last[3]
        if kern[2] is not sgemm.KERNEL or (kern[1] is not None and not frozen(w)):
            kern[0] = tuple(comp._part(x, off, stride, rows) for off in offsets)
            kern[1] = sgemm.packed_for_parts(kern[0], w)
            kern[2] = sgemm.KERNEL
        if kern[1] is not None:
            # the kernel writes out directly where it can (out's layout, no overlap with
            # x: else _kernel_nt answers False having written nothing), else parts_nt's
            # temporary (and its conversion of an unusual bias)
            b = comp.bias_params
            n = out.shape[1]
            if b.shape[0] != 0:
                if not (kernel_out and b.dtype == _F32 and b.shape == (n,)
                        and b.flags.c_contiguous and _kernel_nt(kern[0], kern[1], n, out, b,
                                                                False)):
                    sgemm.parts_nt(kern[0], w, out, b)
            # without bias: added to out, or (write: out's zeroing dropped) written
            elif not (kernel_out and _kernel_nt(kern[0], kern[1], n, out, None, not write)):
                if write:       # (0 + product, computed before out, which may overlap x)
                    t0 = np.zeros(out.shape, _F32)
                    sgemm.parts_nt(kern[0], w, t0, None)
                    out[...] = t0
                else:
                    sgemm.parts_nt(kern[0], w, out, None)
            return None
        k = len(offsets)
        if spliced_product(rows, d, k, out.shape[1]):
            key = (stride, tuple(offsets))
            if spliced[0] != key:
                buf = scratch.get((rows, k * d), 21)
                spliced[:] = (key, tuple((buf[:, i * d:(i + 1) * d],
                                          comp._part(x, off, stride, rows))
                                         for i, off in enumerate(offsets)),
                              _BoundNT(buf, out.shape, scratch, 20))
            for dst, src in spliced[1]:
                _copyto(dst, src)
            first(spliced[2], w, comp.bias_params)
            return None
        if blocks[0] is not w:
            blocks[0] = w
            blocks[1] = tuple(w[:, i * d:(i + 1) * d] for i in range(len(offsets)))
        wb = blocks[1]
        bias = comp.bias_params
        for i, off in enumerate(offsets):
            prod = parts.get((off, stride, i))
            if prod is None:
                prod = parts[(off, stride, i)] = _BoundNT(comp._part(x, off, stride, rows),
                                                          out.shape, scratch, 20)
            if i == 0:
                first(prod, wb[0], bias)
            else:
                _add(out, prod(wb[i], tmp), out=out)
        return None
    return f



# --------------------------------------------------------------------------------------
# a product and the ReLU after it, in one pass (program.relu_after_product)


def bind_product_relu(ctype, x, y):
    """``f(comp, pre) -> bool`` for an affine-type component (or a TDNN with bias) of
    class ``ctype`` reading ``x`` whose output only a ReLU writing ``y`` reads: the
    product kernel writes max(0, x @ W^T + b) into ``y`` -- the bits of the component's
    propagate (the kernel's product plus the bias, one rounding) followed by the ReLU's
    maximum(v, 0).  False, having written nothing, where the kernel does not apply (a
    weight not frozen, no bias, a layout it does not take, ``y`` overlapping ``x``): the
    caller then runs the two commands.  None where ``ctype`` has no such form."""
    if (ctype not in (AffineComponent, NaturalGradientAffineComponent, FixedAffineComponent,
                      TdnnComponent)
            or x.ndim != 2 or y.ndim != 2 or not _kernel_out_ok(y)):
        return None
    n = y.shape[1]
    tdnn = ctype is TdnnComponent
    # per weight array (and, for a TDNN, per layout): the parts and the packed weight
    state: list = [None, None, None, None]       # w, pre, x or parts, packed

    def f(comp, pre) -> bool:
        if sgemm.KERNEL is None:
            return False
        w, b = comp.linear_params, comp.bias_params
        if w is not state[0] or pre is not state[1] or not frozen(w):
            state[0] = state[3] = None
            if w.ndim != 2 or w.shape[0] != n or b.shape != (n,):
                return False
            if tdnn:
                rows = y.shape[0]
                if w.shape[1] % max(len(comp.time_offsets), 1) or x.dtype != _F32:
                    return False
                stride, offsets = comp._layout(pre, x.shape[0], rows)
                parts = tuple(comp._part(x, off, stride, rows) for off in offsets)
                if w.shape[1] != len(parts) * x.shape[1]:
                    return False
                packed = sgemm.packed_for_parts(parts, w)
            else:
                if x.shape[0] != y.shape[0]:
                    return False
                parts, packed = x, _packed_for(x, w)
            if packed is None:
                return False
            state[:] = w, pre, parts, packed
        if b.dtype != _F32 or not b.flags.c_contiguous:
            return False
        return _kernel_nt(state[2], state[3], n, y, b, False, True)
    return f

# --------------------------------------------------------------------------------------
# element-wise components


def _cols_ok(x, out, dim) -> bool:
    return (x.ndim == 2 and out.ndim == 2 and x.shape[1] == dim and out.shape[1] == dim
            and out.shape[0] == x.shape[0])


def _sigmoid(comp, pre, x, out):
    if not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    if x.dtype != _F32 or out.dtype != _F32:
        return comp.propagate(pre, x, out)
    if small_sigmoid(np, x):
        # the component's choice for this size (SciPy's expit: one scalar loop, the same
        # bits for any layout of input and output)
        expit()(x, out=out)
        return None
    shape = x.shape
    _logistic(x, out, np.empty(shape, _F32), np.empty(shape, _F32), _cap(shape))
    return None


def _bind_sigmoid(x, out, scratch):
    if not (x.ndim == 2 and out.shape == x.shape and x.dtype == _F32 and out.dtype == _F32):
        return None
    dim = x.shape[1]
    if small_sigmoid(np, x):
        logistic = expit()

        def f_small(comp, pre):
            if comp.dim != dim:
                return comp.propagate(pre, x, out)
            logistic(x, out=out)
            return None
        return f_small
    t, d = scratch.get(x.shape, 0), scratch.get(x.shape, 1)
    cap = _cap(x.shape)

    def f(comp, pre):
        if comp.dim != dim:
            return comp.propagate(pre, x, out)
        _logistic(x, out, t, d, cap)
        return None
    return f


def _tanh(comp, pre, x, out):
    if not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    if _inner_contiguous(out):
        _np_tanh(x, out=out)
    else:
        _copyto(out, np.tanh(x))
    return None


def _bind_tanh(x, out, scratch):
    if not (x.ndim == 2 and out.shape == x.shape):
        return None
    dim = x.shape[1]
    if _inner_contiguous(out):
        def f(comp, pre):
            if comp.dim != dim:
                return comp.propagate(pre, x, out)
            _np_tanh(x, out)
            return None
    else:
        tmp = scratch.get(x.shape, 0, out.dtype)

        def f(comp, pre):
            if comp.dim != dim:
                return comp.propagate(pre, x, out)
            _np_tanh(x, tmp)
            out[...] = tmp
            return None
    return f


def _relu_blocks(x, out) -> list[tuple]:
    """(x rows, zeros, out rows) per row block for max(x, 0) into ``out`` (one
    block when x fits the zeros; [] when a single row does not)."""
    rows, cols = x.shape
    per = _ZEROS.shape[0] // cols if cols else 0
    if per == 0:
        return []
    if rows <= per:
        return [(x, _ZEROS[:rows * cols].reshape(rows, cols), out)]
    z = _ZEROS[:per * cols].reshape(per, cols)
    return [(x[r:r + per], z[:min(per, rows - r)], out[r:r + per])
            for r in range(0, rows, per)]


def _relu(comp, pre, x, out):
    if not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    blocks = _relu_blocks(x, out)
    if not blocks:
        _maximum(x, _ZERO, out=out)
    for xb, zb, ob in blocks:
        _maximum(xb, zb, out=ob)
    return None


def _bind_relu(x, out, scratch):
    if not (x.ndim == 2 and out.shape == x.shape):
        return None
    dim = x.shape[1]
    blocks = _relu_blocks(x, out)
    if len(blocks) == 1:
        (xb, zb, ob), = blocks

        def f(comp, pre):
            if comp.dim != dim:
                return comp.propagate(pre, x, out)
            _maximum(xb, zb, out=ob)
            return None
        return f
    if not blocks:
        blocks = [(x, _ZERO, out)]

    def f(comp, pre):
        if comp.dim != dim:
            return comp.propagate(pre, x, out)
        for xb, zb, ob in blocks:
            _maximum(xb, zb, out=ob)
        return None
    return f


def _copy(comp, pre, x, out):
    if not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    if out is not x:
        _copyto(out, x)
    return None


def _bind_copy(x, out, scratch):
    if not (x.ndim == 2 and out.shape == x.shape):
        return None
    dim = x.shape[1]
    same = out is x

    def f(comp, pre):
        if comp.dim != dim:
            return comp.propagate(pre, x, out)
        if not same:
            out[...] = x
        return None
    return f


def _truncation(comp, pre, x, out):
    if comp.scale_value != 1.0 or not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    if out is not x:
        _copyto(out, x)
    return None


def _bind_truncation(x, out, scratch):
    if not (x.ndim == 2 and out.shape == x.shape):
        return None
    dim = x.shape[1]
    same = out is x

    def f(comp, pre):
        if comp.scale_value != 1.0 or comp.dim != dim:
            return comp.propagate(pre, x, out)
        if not same:
            out[...] = x
        return None
    return f


def _dropout(comp, pre, x, out):
    if not comp._inactive() or not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    if out is not x:
        _copyto(out, x)
    return None


def _bind_dropout(x, out, scratch):
    if not (x.ndim == 2 and out.shape == x.shape):
        return None
    dim = x.shape[1]
    same = out is x

    def f(comp, pre):
        if not comp._inactive() or comp.dim != dim:
            return comp.propagate(pre, x, out)
        if not same:
            out[...] = x
        return None
    return f


def _product(comp, pre, x, out):
    k = comp.in_dim // comp.out_dim
    if (x.ndim != 2 or x.shape[1] != comp.in_dim or out.ndim != 2
            or out.shape != (x.shape[0], comp.out_dim) or out is x):
        return comp.propagate(pre, x, out)
    if k == 2:
        # a two-block product reduces to one multiply (prod's reduction starts from
        # the first block, so the rounding is the same)
        d = comp.out_dim
        _multiply(x[:, :d], x[:, d:], out=out)
    else:
        np.prod(x.reshape(x.shape[0], k, comp.out_dim), axis=1, out=out)
    return None


def _bind_product(x, out, scratch):
    if (x.ndim != 2 or out.ndim != 2 or out.shape[0] != x.shape[0] or out is x
            or out.shape[1] == 0 or x.shape[1] != 2 * out.shape[1]):
        return None
    d, nin = out.shape[1], x.shape[1]
    a, b = x[:, :d], x[:, d:]

    def f(comp, pre):
        if comp.in_dim != nin or comp.out_dim != d:
            return comp.propagate(pre, x, out)
        _multiply(a, b, out)
        return None
    return f


def _per_element_scale(comp, pre, x, out):
    s = comp.scales
    if not _cols_ok(x, out, s.shape[0]):
        return comp.propagate(pre, x, out)
    _multiply(x, s, out=out)
    return None


def _bind_per_element_scale(x, out, scratch):
    if not (x.ndim == 2 and out.shape == x.shape):
        return None
    dim = x.shape[1]
    scale = _same_shape_op(x, out, _multiply)

    def f(comp, pre):
        s = comp.scales
        if s.shape[0] != dim:
            return comp.propagate(pre, x, out)
        scale(s)
        return None
    return f


def _batchnorm_ok(comp) -> bool:
    return (comp.test_mode and comp.block_dim > 0 and comp.dim % comp.block_dim == 0
            and comp.offset_vec.shape[0] == comp.block_dim)


def _batchnorm_blocks(x, out, block: int):
    """x and out viewed as rows of ``block`` columns (a batch-norm with block-dim <
    dim normalises each block of every row alike), or None when a view would need
    a copy."""
    if x.shape[1] == block:
        return x, out
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        return None
    return x.reshape(-1, block), out.reshape(-1, block)


def _batchnorm(comp, pre, x, out):
    if not _batchnorm_ok(comp) or not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    views = _batchnorm_blocks(x, out, comp.block_dim)
    if views is None:
        return comp.propagate(pre, x, out)
    xb, ob = views
    sc = np.asarray(comp.scale_vec, dtype=x.dtype)
    off = np.asarray(comp.offset_vec, dtype=x.dtype)
    _multiply(xb, sc, out=ob)
    _add(ob, off, out=ob)
    return None


def _bind_batchnorm(x, out, scratch):
    if not (x.ndim == 2 and out.shape == x.shape):
        return None
    dim, dt = x.shape[1], x.dtype
    # block-dim -> (x * scale into out, out + offset into out) on x and out viewed as
    # rows of that many columns (_row_op), or None when a view would need a copy
    ops: dict = {}

    def f(comp, pre):
        if comp.dim != dim or not _batchnorm_ok(comp):
            return comp.propagate(pre, x, out)
        block = comp.block_dim
        if block not in ops:
            v = _batchnorm_blocks(x, out, block)
            ops[block] = None if v is None else (_row_op(v[0], v[1], _multiply),
                                                 _row_op(v[1], v[1], _add))
        op = ops[block]
        if op is None:
            return comp.propagate(pre, x, out)
        sc, off = comp.scale_vec, comp.offset_vec
        if sc.dtype != dt:
            sc = np.asarray(sc, dtype=dt)
        if off.dtype != dt:
            off = np.asarray(off, dtype=dt)
        op[0](sc)
        op[1](off)
        return None
    return f


_TILE_MIN = 4096      # elements per row of the widened views


def _tiled_rows(x, out):
    """x and out (C-contiguous, same shape) seen as rows of k times as many columns
    (k rows side by side), so that a per-column scale and offset broadcast along
    rows of at least _TILE_MIN elements: NumPy's loop then runs a few long rows
    instead of many short ones (a 1312x384 batch-norm 104 -> 67 us).  Returns
    (x wide, out wide, k, (x tail, out tail) or None) or (None,) when it does not
    pay or a view would need a copy.  The numbers are the same: every element is
    still x * scale + offset of its own column."""
    rows, cols = x.shape
    if cols == 0 or cols >= _TILE_MIN or not (x.flags.c_contiguous and out.flags.c_contiguous):
        return (None,)
    k = -(-_TILE_MIN // cols)
    whole = rows // k
    if whole < 2:
        return (None,)
    n = whole * k
    tail = None if n == rows else (x[n:], out[n:])
    return (x[:n].reshape(whole, k * cols), out[:n].reshape(whole, k * cols), k, tail)


_TILED: dict = {}    # (id(v), k) -> (weak reference to v, v tiled k times, read-only)


def _tiled(v, k: int):
    """``np.tile(v, k)``; for a frozen ``v`` made once per process and kept while v
    lives: closures bound afresh on every run (those writing a network output, which
    lives outside the arena) would otherwise tile a bias on every run (15 us of a
    TDNN-F 21x1 run of 0.7 ms)."""
    if not frozen(v):
        return np.tile(v, k)
    key = (id(v), k)
    entry = _TILED.get(key)
    if entry is not None and entry[0]() is v:
        return entry[1]
    t = np.tile(v, k)
    t.flags.writeable = False
    _TILED[key] = (weakref.ref(v), t)
    weakref.finalize(v, _TILED.pop, key, None)
    return t


def _same_shape_op(x, out, ufunc):
    """op(v): out = ufunc(x, v) for a per-column vector v, with v given to the ufunc in
    x's own shape where that costs no copy per call: a (1, dim) view of v for one row
    (valid whatever v holds), v's rows tiled once while it is the same frozen array
    for more.  NumPy 2 broadcasts a (dim,) vector against (rows, dim) through its
    iterator: 0.63 against 0.21 us for 1 x 128, 0.91 against 0.31 us for 8 x 128,
    6.7 against 3.7 us for 150 x 384 (numpy 2.4, Zen 5).  A v that is not frozen
    against several rows is broadcast as it is."""
    rows = x.shape[0]
    cache: list = [None, None]      # v, v in x's shape

    def op(v):
        if v.ndim == 1 and (rows == 1 or frozen(v)):
            if cache[0] is not v:
                cache[0], cache[1] = v, (v.reshape(1, v.shape[0]) if rows == 1 else
                                         _tiled(v, rows).reshape(rows, v.shape[0]))
            ufunc(x, cache[1], out)
        else:
            cache[0] = None     # (a tile of v is stale once v is writeable)
            ufunc(x, v, out)
    return op


def _row_op(x, out, ufunc):
    """op(v): out = ufunc(x, v) for a per-column vector v (x may be out), on the wide
    rows of _tiled_rows when they apply (v tiled once while it is the same frozen
    array, anew on every call otherwise), else with v in x's shape
    (_same_shape_op).  The same bits every way: every element is ufunc of its own x
    and its column's v."""
    t = _tiled_rows(x, out)
    if t[0] is None:
        return _same_shape_op(x, out, ufunc)
    xw, ow, k, tail = t
    cache: list = [None, None]      # v, v tiled k times
    tail_op = None if tail is None else _same_shape_op(tail[0], tail[1], ufunc)

    def op_wide(v):
        if cache[0] is not v or not frozen(v):
            cache[0], cache[1] = v, _tiled(v, k)
        ufunc(xw, cache[1], ow)
        if tail_op is not None:
            tail_op(v)
    return op_wide


def _row_adder(out):
    """add(v): out += v (a per-column vector), on wide rows where they apply."""
    return _row_op(out, out, _add)


# --------------------------------------------------------------------------------------
# log-softmax: shifted = x - max(x); out = shifted - log(sum(exp(shifted)))


def _log_softmax_core(x, out, shifted, ex, col, lcol) -> None:
    # (max and sum as the ufunc reductions np.max / np.sum call)
    _max_reduce(x, 1, None, col, True)
    _subtract(x, col, shifted)
    _exp(shifted, ex)
    _add_reduce(ex, 1, None, col, True)
    _log(col, lcol)
    _subtract(shifted, lcol, out)


def _log_softmax_shapes_ok(x, out) -> bool:
    return (x.ndim == 2 and out.shape == x.shape and x.shape[1] > 0
            and x.dtype == _F32 and out.dtype == _F32)


def _log_softmax(comp, pre, x, out):
    if not _log_softmax_shapes_ok(x, out) or x.shape[1] != comp.dim:
        return comp.propagate(pre, x, out)
    r = x.shape[0]
    _log_softmax_core(x, out, np.empty(x.shape, _F32), np.empty(x.shape, _F32),
                      np.empty((r, 1), _F32), np.empty((r, 1), _F32))
    return None


def _bind_log_softmax(x, out, scratch):
    if not _log_softmax_shapes_ok(x, out):
        return None
    dim, r = x.shape[1], x.shape[0]
    shifted, ex = scratch.get(x.shape, 0), scratch.get(x.shape, 1)
    col, lcol = scratch.get((r, 1), 2), scratch.get((r, 1), 3)

    def f(comp, pre):
        if comp.dim != dim:
            return comp.propagate(pre, x, out)
        _log_softmax_core(x, out, shifted, ex, col, lcol)
        return None
    return f


# --------------------------------------------------------------------------------------
# LstmNonlinearityComponent (recurrent.py): i, f, o gates with peepholes, cell c


class _LstmViews:
    """The parts of input and output one LSTM propagate reads and writes."""

    def __init__(self, x, out, cd: int, drop: bool):
        r = x.shape[0]
        self.if_part = x[:, :2 * cd].reshape(r, 2, cd)   # i and f pre-activations
        self.c_part = x[:, 2 * cd:3 * cd]
        self.o_part = x[:, 3 * cd:4 * cd]
        self.c_prev = x[:, 4 * cd:5 * cd]
        self.c_prev3 = self.c_prev.reshape(r, 1, cd)
        if drop:
            cols = [x[:, 5 * cd + k:5 * cd + k + 1] for k in range(3)]
            if r == 1:
                # one row: the (1, 1) scale columns as 0-d views (still of x), which
                # NumPy multiplies as scalars: 0.27 against 0.66 us for 256 columns
                cols = [col.reshape(()) for col in cols]
            self.i_s, self.f_s, self.o_s = cols
        self.c_out = out[:, :cd]
        self.m_out = out[:, cd:]


def _lstm_ok(comp, x, out) -> bool:
    w = comp.params
    if w.ndim != 2 or w.shape[0] != 3:
        return False
    cd = w.shape[1]
    return (cd > 0 and x.ndim == 2 and out.ndim == 2 and x.shape[1] == comp.input_dim()
            and out.shape == (x.shape[0], 2 * cd) and x.dtype == _F32 and out.dtype == _F32)


def _lstm_temps(get, r: int, cd: int) -> tuple:
    """The 9 temporaries of _lstm_core (three of the i and f gates' shape (r, 2, cd),
    six of (r, cd)), then the logistic's caps for the two shapes."""
    t = tuple(get((r, 2, cd) if k < 3 else (r, cd), k) for k in range(9))
    return t + (_cap((r, 2, cd)), _cap((r, cd)))


def _lstm_core(comp, v: _LstmViews, drop: bool, temps, small: bool = False) -> None:
    """The component's propagate, operation for operation (see the module
    docstring for why the grouping of element-wise operations is free).  ``small``:
    the gates (rows x cell-dim each) are small enough for expit, as the component
    decides on each gate (nonlinear.SMALL_SIGMOID); expit's result per element does
    not depend on the i and f gates going through it together."""
    w = comp.params
    if w.dtype != _F32:
        w = w.astype(_F32)
    g, e, d, tc, a, b, c_t, e1, d1, cap_g, cap_a = temps
    # i_t, f_t = sigmoid(i_part + w0 * c_prev), sigmoid(f_part + w1 * c_prev)
    _multiply(w[:2], v.c_prev3, g)
    _add(v.if_part, g, g)
    if small:
        expit()(g, out=g)
    else:
        _logistic(g, g, e, d, cap_g)
    i_t, f_t = g[:, 0], g[:, 1]
    # c_t = f_t * f_s * c_prev + i_t * i_s * tanh(c_part)
    _np_tanh(v.c_part, tc)
    if drop:
        _multiply(f_t, v.f_s, a)
        _multiply(a, v.c_prev, a)
        _multiply(i_t, v.i_s, b)
        _multiply(b, tc, b)
    else:      # x * 1.0 == x exactly
        _multiply(f_t, v.c_prev, a)
        _multiply(i_t, tc, b)
    _add(a, b, c_t)
    v.c_out[...] = c_t
    # o_t = sigmoid(o_part + w2 * c_t); m_t = o_t * o_s * tanh(c_t)
    _multiply(w[2:3], c_t, a)    # (1, cd): one row is then a same-shape product
    _add(v.o_part, a, a)
    if small:
        expit()(a, out=a)
    else:
        _logistic(a, a, e1, d1, cap_a)
    _np_tanh(c_t, tc)
    if drop:
        _multiply(a, v.o_s, a)
    _multiply(a, tc, v.m_out)


def _lstm_views(x, out, cd: int, drop: bool):
    v = _LstmViews(x, out, cd, drop)
    # the gate views must be views of x, never copies
    if not (np.shares_memory(v.if_part, x) and np.shares_memory(v.c_prev3, x)):
        return None
    return v


def _lstm(comp, pre, x, out):
    if not _lstm_ok(comp, x, out) or np.may_share_memory(x, out):
        return comp.propagate(pre, x, out)
    drop = bool(comp.use_dropout)
    cd = comp.params.shape[1]
    v = _lstm_views(x, out, cd, drop)
    if v is None:
        return comp.propagate(pre, x, out)
    _lstm_core(comp, v, drop, _lstm_temps(_FRESH.get, x.shape[0], cd),
               small_sigmoid(np, v.c_part))
    return None


def _bind_lstm(x, out, scratch):
    if (x.ndim != 2 or out.ndim != 2 or out.shape[0] != x.shape[0] or out.shape[1] % 2
            or out.shape[1] == 0 or np.may_share_memory(x, out)
            or x.dtype != _F32 or out.dtype != _F32):
        return None
    cd = out.shape[1] // 2
    if x.shape[1] == 5 * cd + 3:
        drop = True
    elif x.shape[1] == 5 * cd:
        drop = False
    else:
        return None
    views = _lstm_views(x, out, cd, drop)
    if views is None:
        return None
    temps = _lstm_temps(scratch.get, x.shape[0], cd)
    small = small_sigmoid(np, views.c_part)     # one gate's size, as the component decides

    def f(comp, pre):
        w = comp.params
        if w.ndim != 2 or w.shape[0] != 3 or w.shape[1] != cd or bool(comp.use_dropout) != drop:
            return comp.propagate(pre, x, out)
        _lstm_core(comp, views, drop, temps, small)
        return None
    return f


# class -> (the propagate it mirrors, the dynamic form, the bound form)
_FAST = {
    AffineComponent: (AffineComponent.propagate, _affine, _bind_affine),
    NaturalGradientAffineComponent: (AffineComponent.propagate, _affine, _bind_affine),
    FixedAffineComponent: (FixedAffineComponent.propagate, _affine, _bind_affine),
    LinearComponent: (LinearComponent.propagate, _linear, _bind_linear),
    TdnnComponent: (TdnnComponent.propagate, _tdnn, _bind_tdnn),
    SigmoidComponent: (SigmoidComponent.propagate, _sigmoid, _bind_sigmoid),
    TanhComponent: (TanhComponent.propagate, _tanh, _bind_tanh),
    RectifiedLinearComponent: (RectifiedLinearComponent.propagate, _relu, _bind_relu),
    LogSoftmaxComponent: (LogSoftmaxComponent.propagate, _log_softmax, _bind_log_softmax),
    NoOpComponent: (NoOpComponent.propagate, _copy, _bind_copy),
    BackpropTruncationComponent: (BackpropTruncationComponent.propagate, _truncation,
                                  _bind_truncation),
    GeneralDropoutComponent: (GeneralDropoutComponent.propagate, _dropout, _bind_dropout),
    ElementwiseProductComponent: (ElementwiseProductComponent.propagate, _product,
                                  _bind_product),
    PerElementScaleComponent: (PerElementScaleComponent.propagate, _per_element_scale,
                               _bind_per_element_scale),
    NaturalGradientPerElementScaleComponent: (PerElementScaleComponent.propagate,
                                              _per_element_scale, _bind_per_element_scale),
    BatchNormComponent: (BatchNormComponent.propagate, _batchnorm, _bind_batchnorm),
    LstmNonlinearityComponent: (LstmNonlinearityComponent.propagate, _lstm, _bind_lstm),
}


def _entry(component_type):
    entry = _FAST.get(component_type)
    if entry is None or component_type.propagate is not entry[0]:
        return None
    return entry


def fast_propagate(component_type):
    """The fast form ``f(comp, indexes, x, out)`` for components of exactly
    ``component_type``, or None."""
    entry = _entry(component_type)
    return None if entry is None else entry[1]


# the bound forms that can write their output instead of adding to it
_WRITE_FORMS = frozenset((LinearComponent, TdnnComponent))


def bind_propagate_write(component_type, x, out, scratch):
    """Like ``bind_propagate``, for a propagate whose output was zeroed by the command
    right before it (kSetConst 0, which Kaldi's compiler puts before a component that
    adds to its output: a Linear, a TDNN without bias): ``f(comp, indexes)`` writes
    the result into ``out`` -- one pass over the output instead of the zeroing and
    the addition; the same numbers (0 + p is p, up to the sign of a zero).  When it
    falls back to the component's own propagate, it zeroes ``out`` first.  None when
    the type has no such form."""
    entry = _entry(component_type)
    if (entry is None or component_type not in _WRITE_FORMS or x is None or out is None):
        return None
    return entry[2](x, out, scratch, write=True)


def bind_propagate(component_type, x, out, scratch):
    """``f(comp, indexes)`` computing the propagate of a component of exactly
    ``component_type`` from the fixed array ``x`` into the fixed array ``out``
    (temporaries from ``scratch``), or None when there is no bound form for this
    type or these arrays."""
    entry = _entry(component_type)
    if entry is None or x is None or out is None:
        return None
    return entry[2](x, out, scratch)
