"""Direct NumPy forms of the hottest component propagates, for the compiled
program (engine/runtime/program.py).

Kaldi's NnetComputer calls a virtual Propagate whose own cost is nothing next to
the matrix work; here a component's ``propagate`` spends 1-5 microseconds of
Python (shape checks, array-module lookup, temporaries) around 1-2 microseconds
of NumPy work for the small matrices of a 21-frame chunk or of one recurrent
step.  The functions below do the same NumPy operations, in the same order and
precision, writing into the output with ``out=`` instead of through temporaries,
so the results are bit-identical (tests/engine/test_executor_program.py checks
this against the interpreted executor).  Each applies only to the exact class
it was written for, whose ``propagate`` must still be the one it mirrors (a
subclass that overrides it, or an unexpected state such as batch-norm in
training mode, or a shape the component would reject, goes to the component's
own ``propagate``, which also raises the proper error).

Only the NumPy backend uses them; CuPy calls the components.
"""

from __future__ import annotations

import numpy as np

from engine.nnet.components.affine import AffineComponent, NaturalGradientAffineComponent
from engine.nnet.components.dropout import GeneralDropoutComponent
from engine.nnet.components.gradient_control import BackpropTruncationComponent
from engine.nnet.components.misc import ElementwiseProductComponent, NoOpComponent
from engine.nnet.components.nonlinear import (RectifiedLinearComponent, SigmoidComponent,
                                              TanhComponent)
from engine.nnet.components.normalize import BatchNormComponent
from engine.nnet.components.scale_offset import (NaturalGradientPerElementScaleComponent,
                                                 PerElementScaleComponent)

_matmul, _add, _multiply, _copyto = np.matmul, np.add, np.multiply, np.copyto


def _affine(comp, pre, x, out):
    w = comp.linear_params
    if (x.ndim != 2 or out.ndim != 2 or x.shape[1] != w.shape[1]
            or out.shape[0] != x.shape[0] or out.shape[1] != w.shape[0]):
        return comp.propagate(pre, x, out)
    # out[...] = x @ W^T; out += b   (the same GEMM, without the temporary)
    _matmul(x, w.T, out=out)
    _add(out, comp.bias_params, out=out)
    return None


def _cols_ok(x, out, dim) -> bool:
    return (x.ndim == 2 and out.ndim == 2 and x.shape[1] == dim and out.shape[1] == dim
            and out.shape[0] == x.shape[0])


def _sigmoid(comp, pre, x, out):
    if not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    # the stable logistic of nonlinear._sigmoid: exp(-|x|), then 1/(1+e) where x >= 0
    # and e/(1+e) elsewhere; the mask is taken before ``out`` (maybe ``x``) is written.
    e = np.abs(x)
    np.negative(e, out=e)
    np.exp(e, out=e)
    d = 1.0 + e
    mask = x >= 0
    np.divide(e, d, out=e)
    _copyto(out, e)
    np.divide(1.0, d, out=d)
    _copyto(out, d, where=mask)
    return None


def _tanh(comp, pre, x, out):
    if not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    np.tanh(x, out=out)
    return None


def _relu(comp, pre, x, out):
    if not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    np.maximum(x, 0, out=out)
    return None


def _copy(comp, pre, x, out):
    if not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    if out is not x:
        _copyto(out, x)
    return None


def _truncation(comp, pre, x, out):
    if comp.scale_value != 1.0 or not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    if out is not x:
        _copyto(out, x)
    return None


def _dropout(comp, pre, x, out):
    if not comp._inactive() or not _cols_ok(x, out, comp.dim):
        return comp.propagate(pre, x, out)
    if out is not x:
        _copyto(out, x)
    return None


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


def _per_element_scale(comp, pre, x, out):
    s = comp.scales
    if not _cols_ok(x, out, s.shape[0]):
        return comp.propagate(pre, x, out)
    _multiply(x, s, out=out)
    return None


def _batchnorm(comp, pre, x, out):
    if (not comp.test_mode or comp.block_dim != comp.dim
            or comp.offset_vec.shape[0] != comp.block_dim or not _cols_ok(x, out, comp.dim)):
        return comp.propagate(pre, x, out)
    sc = np.asarray(comp.scale_vec, dtype=x.dtype)
    off = np.asarray(comp.offset_vec, dtype=x.dtype)
    _multiply(x, sc, out=out)
    _add(out, off, out=out)
    return None


# class -> (the propagate it mirrors, the fast form)
_FAST = {
    AffineComponent: (AffineComponent.propagate, _affine),
    NaturalGradientAffineComponent: (AffineComponent.propagate, _affine),
    SigmoidComponent: (SigmoidComponent.propagate, _sigmoid),
    TanhComponent: (TanhComponent.propagate, _tanh),
    RectifiedLinearComponent: (RectifiedLinearComponent.propagate, _relu),
    NoOpComponent: (NoOpComponent.propagate, _copy),
    BackpropTruncationComponent: (BackpropTruncationComponent.propagate, _truncation),
    GeneralDropoutComponent: (GeneralDropoutComponent.propagate, _dropout),
    ElementwiseProductComponent: (ElementwiseProductComponent.propagate, _product),
    PerElementScaleComponent: (PerElementScaleComponent.propagate, _per_element_scale),
    NaturalGradientPerElementScaleComponent: (PerElementScaleComponent.propagate,
                                              _per_element_scale),
    BatchNormComponent: (BatchNormComponent.propagate, _batchnorm),
}


def fast_propagate(component_type):
    """The fast form for components of exactly ``component_type``, or None."""
    entry = _FAST.get(component_type)
    if entry is None or component_type.propagate is not entry[0]:
        return None
    return entry[1]
