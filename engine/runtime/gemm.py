"""The affine product ``y = x @ W^T`` in the fastest of equivalent BLAS calls.

Components compute ``x @ W.T``: NumPy passes it to ``sgemm`` as
(row-major, no-trans x, trans W).  The same numbers come out of
``(W @ x.T).T``, which NumPy passes as (row-major, no-trans W, trans x) with the
roles of the two operands exchanged: both forms take every output element as a
dot product of a row of ``x`` with a row of ``W``, and with OpenBLAS they agree
bit for bit (checked on thousands of shapes, strided rows included).  Their
speed does not agree: for a few rows (a recurrent step of 1-48 frames times the
sequences of a batch) OpenBLAS's packing path for the first form can be 2-3x
slower than for the second, while for one row or for many rows the first form is
as fast or faster.

A third form, ``np.dot(x, W.T, out)``, makes the same BLAS call as ``x @ W.T``
through a shorter path (about a microsecond less per call, which matters for the
one-row products of a recurrent step); it needs a C-contiguous output.

``nt_form(x, w, out)`` decides per shape and layout, once per process: it times
the calls on random operands of the same shape and strides and picks another
form than the components' only where it is faster *and* gives exactly the same
result on that sample, so a BLAS library whose forms round differently simply
keeps the components' form.  Large products (where the forms run at the same
speed) are not tried.
"""

from __future__ import annotations

import threading
import time

import numpy as np

DIRECT, EXCHANGED, DOT = 0, 1, 2

_TRY_MAX_MACS = 1 << 24      # larger products: the forms run at the same speed
_lock = threading.Lock()
_choice: dict = {}


def _layout_key(a) -> tuple:
    return (a.shape, a.strides, a.dtype.str)


def _like(a, rng) -> np.ndarray:
    """A random array with a's shape, dtype and strides (a view of a larger one)."""
    rows, cols = a.shape
    item = a.itemsize
    rs, cs = a.strides
    if cs != item or rs % item or rs < cols * item:
        return rng.standard_normal(a.shape).astype(a.dtype)
    ld = rs // item
    base = rng.standard_normal((max(rows, 1), ld)).astype(a.dtype)
    return base[:rows, :cols]


def _time(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _decide(x, w, out) -> int:
    rows, k = x.shape
    n = w.shape[0]
    if rows * n * k > _TRY_MAX_MACS or n < 2 or rows < 1:
        return DIRECT
    rng = np.random.default_rng(12345)
    xs, ws = _like(x, rng), _like(w, rng)
    o1 = np.empty((rows, n), dtype=out.dtype)
    np.matmul(xs, ws.T, out=o1)
    times = {DIRECT: _time(lambda: np.matmul(xs, ws.T, out=o1))}
    if out.flags.c_contiguous:
        o3 = np.empty((rows, n), dtype=out.dtype)
        np.dot(xs, ws.T, out=o3)
        if np.array_equal(o1, o3):
            times[DOT] = _time(lambda: np.dot(xs, ws.T, out=o3))
    if rows > 1:
        o2 = np.empty((n, rows), dtype=out.dtype)
        np.matmul(ws, xs.T, out=o2)
        if np.array_equal(o1, o2.T):
            times[EXCHANGED] = _time(lambda: np.matmul(ws, xs.T, out=o2))
    best = min(times, key=times.get)
    # another form only when clearly faster (timings on a shared machine are noisy)
    return best if times[best] < 0.9 * times[DIRECT] else DIRECT


def nt_form(x, w, out) -> int:
    """DIRECT (``x @ w.T`` into ``out``), DOT (``np.dot(x, w.T, out)``) or
    EXCHANGED (``w @ x.T`` into a transposed temporary) for these operand shapes
    and layouts (see the module docstring).  Only float32 operands are considered."""
    if (x.dtype != np.float32 or w.dtype != np.float32 or out.dtype != np.float32
            or x.ndim != 2 or w.ndim != 2):
        return DIRECT
    key = (_layout_key(x), _layout_key(w), bool(out.flags.c_contiguous))
    form = _choice.get(key)
    if form is None:
        with _lock:
            form = _choice.get(key)
            if form is None:
                form = _choice[key] = _decide(x, w, out)
    return form


def forget_choices() -> None:
    """Forget the measured choices (tests)."""
    with _lock:
        _choice.clear()
