"""The product ``x @ W^T`` of a frozen float32 weight, by a kernel of our own.

Why: the products of a speech network's decoding chunk are small (21-150 rows times
a weight of 64-1536 by 64-1536) and BLAS libraries spend them packing the weight,
which does not change, at every call: OpenBLAS 0.3.31 runs TDNN-F's 21-37-row
products at 85-130 GFLOP/s on two threads of a core that does 175 on one.  The
extension ``engine.core._sgemm`` (engine/core/_sgemm.c, built by ``pip install``
where a C compiler is at hand; pyproject.toml, optional) multiplies by a copy of W
packed once (``packed``) with AVX-512 or AVX2 + FMA: the same products at 150-165
GFLOP/s on one thread and 240-370 on two (Intel Xeon model 167, bench/RESULTS.md).

What it computes: each output element is one chain of fused multiply-adds over
k = 0 .. K-1 in order, from zero.  Its value depends on the row of x and the row of W
only: not on the product's shape, the row's position, the instruction set or the
number of threads -- so a chunk of a stream, the same frames computed offline, and a
batch of any size give the same bits for the same rows.  It is not what a BLAS gives
(its sums are blocked otherwise): the two differ by float32 rounding.

Where it is used: ``write_nt``/``add_nt``/``parts_nt``/``matmul_nt`` in the components'
propagates (affine, linear, TDNN, and the time-height convolution's im2col products) and
the executor's fast forms of them (engine/runtime/fastpaths.py),
which therefore agree bit for bit, for weights that are *frozen* (``frozen``: a
read-only array whose memory no writeable array owns; decoding networks are frozen by
``Nnet.freeze_parameters``).  Training networks, CuPy arrays, other dtypes, a CPU
without AVX2 + FMA, a build without the extension, or ``set_enabled(False)`` (the
service's ``NNETC_OWN_PRODUCTS=false``) keep the BLAS product.

Threads: as many as the BLAS library's thread count says at each product, where the
runtime has handed the kernel the library's getter (engine.runtime.parallel, so
holding the BLAS at one thread holds these products too); else ``set_threads``.
Products of under 64K multiply-adds per thread run on the calling thread.  A product
is cut into one piece per thread, by rows where it has more rows than outputs (each
thread then reads its share of x and all of W), else by 32-row panels of W; the pieces are
claimed as they come, the caller taking any no worker has claimed by the time it is
through its own.  The workers are threads of the extension that spin for 3 ms after a
product, then sleep; the GIL is released while a product runs.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np


def _extension():
    try:
        from engine.core import _sgemm  # noqa: PLC0415
    except ImportError:
        return None
    return _sgemm if _sgemm.isa() != "none" else None


EXTENSION = _extension()
KERNEL = EXTENSION          # None: the BLAS product everywhere
_F32 = np.dtype(np.float32)
_ndarray = np.ndarray


def set_enabled(enabled: bool) -> None:
    """Use the kernel (where built and the CPU has AVX2 + FMA) or, with False, the
    BLAS product everywhere.  Packed copies made so far stay until their weights go."""
    global KERNEL
    KERNEL = EXTENSION if enabled else None


def enabled() -> bool:
    return KERNEL is not None


def isa() -> str:
    """The kernel's instruction set: 'avx512', 'avx2', or 'none' (not built, no such
    CPU, or disabled)."""
    return KERNEL.isa() if KERNEL is not None else "none"


def set_threads(n: int, source: int = 0) -> None:
    """Products on ``n`` threads or, with ``source`` (the address of a C function
    ``int f(void)``, a BLAS library's thread-count getter), on as many as it says at
    each product."""
    if EXTENSION is not None:
        EXTENSION.set_threads(n, source)


def threads() -> int:
    """The thread count of the next large product (1 without the kernel)."""
    return EXTENSION.threads() if EXTENSION is not None else 1


# --------------------------------------------------------------------------------------
# frozen weights and what is derived from them once


def frozen(w) -> bool:
    """True when ``w`` cannot change under a copy made of it: a read-only NumPy
    array whose whole chain of bases is read-only NumPy arrays or ``bytes``."""
    a = w
    while isinstance(a, _ndarray):
        if a.flags.writeable:
            return False
        a = a.base
    return a is None or isinstance(a, bytes)


_lock = threading.Lock()
_derived: dict = {}      # id(root) -> {(kind, byte offset, shape, strides, dtype): array}
_finalizers: dict = {}   # id(root) -> the finalizer that drops the root's entries


def _root(a):
    while isinstance(a.base, _ndarray):
        a = a.base
    return a


def _drop_root(rid: int) -> None:
    _derived.pop(rid, None)
    _finalizers.pop(rid, None)


def derived(w, kind: str, make):
    """``make(w)``, made once per frozen array ``w`` (per view: its offset, shape and
    strides in the memory it shares) and ``kind``, and dropped when that memory's
    owning array goes.  The caller checks ``frozen(w)``."""
    root = _root(w)
    rid = id(root)
    offset = w.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    key = (kind, offset, w.shape, w.strides, w.dtype.str)
    per_root = _derived.get(rid)
    got = None if per_root is None else per_root.get(key)
    if got is None:
        with _lock:
            per_root = _derived.get(rid)
            if per_root is None:
                per_root = _derived[rid] = {}
                _finalizers[rid] = weakref.finalize(root, _drop_root, rid)
            got = per_root.get(key)
            if got is None:
                got = per_root[key] = make(w)
    return got


def forget_derived() -> None:
    """Drop every derived array (tests)."""
    with _lock:
        for rid in list(_finalizers):
            f = _finalizers.pop(rid, None)
            if f is not None:
                f.detach()
        _derived.clear()


def _pack(w) -> np.ndarray:
    n, k = w.shape
    size = KERNEL.packed_len(n, k)
    buf = np.empty(size + 16, dtype=_F32)
    start = (-buf.__array_interface__["data"][0] % 64) // 4
    p = buf[start:start + size]
    KERNEL.pack(w, p)
    p.flags.writeable = False
    return p


# --------------------------------------------------------------------------------------
# the products


def packed_for(x, w):
    """W's packed panels when ``x @ w.T`` is the kernel's: the kernel is on, ``x``
    and ``w`` are 2-D float32 NumPy arrays with contiguous rows whose columns agree,
    and ``w`` is frozen; else None (the BLAS product)."""
    return _packed(x, w, 1)


def _packed(x, w, parts: int):
    """packed_for with ``w`` as wide as ``parts`` times ``x``."""
    if (KERNEL is None or type(x) is not _ndarray or type(w) is not _ndarray
            or x.dtype != _F32 or w.dtype != _F32 or x.ndim != 2 or w.ndim != 2
            or w.shape[1] != parts * x.shape[1] or not _rows_ok(x) or not _rows_ok(w)
            or not frozen(w)):
        return None
    return derived(w, "sgemm", _pack)


def product(x, packed, n: int, out, bias=None, accumulate: bool = False,
            relu: bool = False) -> bool:
    """``out = x @ W^T`` (+ ``bias``, or + ``out`` with ``accumulate``; then, with
    ``relu``, max(0, .) as NumPy's ``maximum(v, 0)``: a NaN stays) from ``packed``
    (``packed_for``, or ``packed_for_parts`` with ``x`` the tuple of parts); False, with
    nothing written, where ``out`` overlaps ``x``."""
    return EXTENSION.nt(x, packed, n, out, bias, accumulate, relu)


def _rows_ok(a) -> bool:
    """A 2-D float32 array's layout is the kernel's: contiguous rows (any layout when
    it is empty)."""
    rs, cs = a.strides
    return (cs == 4 or a.shape[1] <= 1) and rs % 4 == 0 and rs >= 0 or a.size == 0


def out_ok(out) -> bool:
    """Whether the kernel can write ``out``: a writeable 2-D float32 NumPy array with
    contiguous rows."""
    return (type(out) is _ndarray and out.dtype == _F32 and out.ndim == 2
            and _rows_ok(out) and out.flags.writeable)


def product_into(x, packed, n: int, out) -> None:
    """``out[...] = x @ W^T`` from ``packed`` (``packed_for(x, w)``, ``n`` rows of W),
    through a temporary where ``out`` is not a float32 array with contiguous rows or
    overlaps ``x``."""
    if not (out_ok(out) and EXTENSION.nt(x, packed, n, out, None, False)):
        t = np.empty((x.shape[0], n), dtype=_F32)
        EXTENSION.nt(x, packed, n, t, None, False)
        out[...] = t


def matmul_nt(x, w):
    """``x @ w.T`` as a new array by the kernel where it applies (``packed_for``); None
    where it does not."""
    p = packed_for(x, w)
    if p is None:
        return None
    t = np.empty((x.shape[0], w.shape[0]), dtype=_F32)
    EXTENSION.nt(x, p, w.shape[0], t, None, False)
    return t


def write_nt(x, w, out) -> bool:
    """``out[...] = x @ w.T`` by the kernel where it applies (``packed_for``); False,
    with nothing written, where it does not."""
    p = packed_for(x, w)
    if p is None:
        return False
    product_into(x, p, w.shape[0], out)
    return True


def add_nt(x, w, out) -> bool:
    """``out += x @ w.T`` (the product rounded, then added: as NumPy's ``out += x @
    w.T``) by the kernel where it applies; False, with nothing done, where it does not."""
    return parts_nt((x,), w, out)


def packed_for_parts(parts: tuple, w):
    """W's packed panels when the product of ``parts`` side by side (each (rows, d), one
    shape and row stride: a TDNN's time offsets as views of its input) by ``w.T``
    ((n, len(parts) * d), frozen) is the kernel's; else None."""
    if len(parts) > MAX_PARTS:
        return None
    packed = _packed(parts[0], w, len(parts))
    if packed is None:
        return None
    x = parts[0]
    for y in parts[1:]:
        if (type(y) is not _ndarray or y.dtype != _F32 or y.shape != x.shape
                or (y.strides != x.strides and y.size)):
            return None
    return packed


MAX_PARTS = 32      # the C function's limit (MAX_SEGS)


def parts_nt(parts: tuple, w, out, bias=None) -> bool:
    """With ``bias``: ``out[...] = (parts side by side) @ w.T + bias``; without:
    ``out += (parts side by side) @ w.T`` (one chain over all the parts' columns, then
    one addition) -- by the kernel where it applies (``packed_for_parts``); False, with
    nothing done, where it does not."""
    p = packed_for_parts(parts, w)
    if p is None:
        return False
    n = w.shape[0]
    if bias is not None and not (type(bias) is _ndarray and bias.dtype == _F32
                                 and bias.shape == (n,) and bias.flags.c_contiguous):
        bias = np.ascontiguousarray(bias, dtype=_F32).reshape(n)
    if not (out_ok(out) and EXTENSION.nt(parts, p, n, out, bias, bias is None)):
        t = np.empty((parts[0].shape[0], n), dtype=_F32)
        EXTENSION.nt(parts, p, n, t, None, False)
        if bias is not None:
            np.add(t, bias, out=out)
        else:
            out += t
    return True
