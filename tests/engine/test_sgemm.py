"""The product kernel of engine.core.sgemm (engine/core/_sgemm.c): each output element
the in-order fused multiply-add chain (checked against exact rational arithmetic), the
same bits whatever the shape, the row's position, the thread count or the instruction
set, its epilogues, the layouts it accepts and the ones it leaves to the BLAS, the
components and the executor's fast forms agreeing bit for bit on frozen weights, threads
following the BLAS count, concurrent callers and a forked child."""

from __future__ import annotations

import contextlib
import os
import threading
from fractions import Fraction

import numpy as np
import pytest

from engine.core import sgemm

needs_kernel = pytest.mark.skipif(
    sgemm.EXTENSION is None,
    reason="engine.core._sgemm is not built or this CPU has neither AVX-512 nor AVX2 + FMA "
           "(pip reports a failed build of the optional extension; test_the_kernel_is_built "
           "says which)")


@pytest.fixture(autouse=True)
def _kernel_on():
    was, threads = sgemm.enabled(), sgemm.threads()
    sgemm.set_enabled(True)
    yield
    sgemm.set_enabled(was)
    sgemm.set_threads(threads)


def _frozen(a):
    a = np.array(a, dtype=np.float32)
    a.flags.writeable = False
    return a


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))


def _fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """round-to-nearest-even float32 of a * b + c, exactly."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    f = np.float32(float(exact))
    best = None
    for cand in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))):
        err = abs(Fraction(float(cand)) - exact)
        even = int(np.array(cand, np.float32).view(np.int32)) % 2 == 0
        key = (err, not even)
        if best is None or key < best[0]:
            best = (key, cand)
    return np.float32(best[1])


def _chain(x, w):
    m, k = x.shape
    n = w.shape[0]
    out = np.zeros((m, n), np.float32)
    for i in range(m):
        for j in range(n):
            acc = np.float32(0.0)
            for kk in range(k):
                acc = _fma32(x[i, kk], w[j, kk], acc)
            out[i, j] = acc
    return out


def _product(x, w, threads: int = 1):
    sgemm.set_threads(threads)
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    assert sgemm.write_nt(x, w, out)
    return out


def test_the_kernel_is_built():
    """Where a C compiler and Python's headers are at hand (pip builds the extension)
    and the CPU has AVX2 + FMA, the kernel is there."""
    import shutil  # noqa: PLC0415
    import sysconfig  # noqa: PLC0415
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if shutil.which(os.environ.get("CC", "cc")) is None or not os.path.exists(header):
        pytest.skip("no C compiler or no Python.h here: the BLAS product is used")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx2 " not in flags and " avx512f " not in flags:
        pytest.skip("this CPU has no AVX2: the BLAS product is used")
    assert sgemm.EXTENSION is not None, "engine.core._sgemm was not built (see pip's log)"
    assert sgemm.isa() in ("avx512", "avx2")


@needs_kernel
def test_each_element_is_the_in_order_fma_chain():
    rng = np.random.default_rng(1)
    for m, n, k in [(1, 1, 1), (3, 5, 7), (9, 17, 4), (8, 33, 3), (2, 40, 11), (10, 16, 2)]:
        x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
        w = _frozen(rng.standard_normal((n, k)) * 3)
        got = _product(x, w)
        assert _same_bits(got, _chain(x, w)), (m, n, k)


@needs_kernel
def test_no_columns_gives_zeros_or_the_bias():
    x = np.zeros((4, 0), np.float32)
    w = _frozen(np.zeros((5, 0)))
    assert _same_bits(_product(x, w), np.zeros((4, 5), np.float32))
    p = sgemm.packed_for(x, w)
    out = np.full((4, 5), 7.0, np.float32)
    bias = np.arange(5, dtype=np.float32)
    sgemm.product(x, p, 5, out, bias)
    assert _same_bits(out, np.broadcast_to(bias, (4, 5)).copy())
    # no rows or no outputs: nothing to do, nothing written
    assert sgemm.write_nt(np.zeros((0, 3), np.float32), _frozen(np.ones((2, 3))),
                          np.zeros((0, 2), np.float32))
    assert sgemm.write_nt(np.ones((2, 3), np.float32), _frozen(np.ones((0, 3))),
                          np.zeros((2, 0), np.float32))


@needs_kernel
def test_rows_do_not_depend_on_shape_position_or_threads():
    rng = np.random.default_rng(2)
    for n, k in [(64, 384), (384, 128), (800, 128), (37, 19), (1, 50), (100, 1)]:
        x = rng.standard_normal((53, k)).astype(np.float32)
        w = _frozen(rng.standard_normal((n, k)))
        whole = _product(x, w, 1)
        for threads in (2, 3, 4):
            assert _same_bits(_product(x, w, threads), whole), (n, k, threads)
        for lo, hi in [(0, 1), (5, 6), (3, 21), (17, 53), (40, 47)]:
            assert _same_bits(_product(x[lo:hi], w, 2), whole[lo:hi]), (n, k, lo, hi)
        # columns: a block of W's rows gives the same columns
        assert _same_bits(_product(x, _frozen(w[7 % n:]), 1), whole[:, 7 % n:])
        assert np.allclose(whole, x.astype(np.float64) @ w.T.astype(np.float64),
                           rtol=1e-4, atol=1e-4 * np.sqrt(k))


@needs_kernel
def test_instruction_sets_agree():
    """The AVX-512 and AVX2 kernels compute the same chains (where the CPU has both)."""
    ext = sgemm.EXTENSION
    first = ext.isa()
    try:
        ext.use_isa("avx512")
        ext.use_isa("avx2")
    except ValueError:
        pytest.skip("this CPU has only one of the two kernels")
    rng = np.random.default_rng(3)
    try:
        for m, n, k in [(21, 800, 128), (37, 64, 768), (150, 384, 128), (7, 45, 33),
                        (1, 17, 9), (13, 8, 300)]:
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = _frozen(rng.standard_normal((n, k)))
            got = {}
            bias = rng.standard_normal(n).astype(np.float32)
            for isa in ("avx512", "avx2"):
                ext.use_isa(isa)
                got[isa] = _product(x, w, 2)
                out = np.empty((m, n), np.float32)
                sgemm.product(x, sgemm.packed_for(x, w), n, out, bias)
                got[isa + "b"] = out
                out = np.empty((m, n), np.float32)
                sgemm.product(x, sgemm.packed_for(x, w), n, out, bias, False, True)
                got[isa + "r"] = out
            for form in ("", "b", "r"):
                assert _same_bits(got["avx512" + form], got["avx2" + form]), (m, n, k, form)
    finally:
        ext.use_isa(first)


@needs_kernel
def test_epilogues_are_the_numpy_additions_they_replace():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((29, 70)).astype(np.float32)
    w = _frozen(rng.standard_normal((50, 70)))
    prod = _product(x, w)
    p = sgemm.packed_for(x, w)
    bias = rng.standard_normal(50).astype(np.float32)
    out = np.empty((29, 50), np.float32)
    assert sgemm.product(x, p, 50, out, bias)
    assert _same_bits(out, prod + bias)
    old = rng.standard_normal((29, 50)).astype(np.float32)
    out = old.copy()
    assert sgemm.product(x, p, 50, out, None, True)
    assert _same_bits(out, old + prod)
    out = old.copy()
    assert sgemm.add_nt(x, w, out)
    assert _same_bits(out, old + prod)
    with pytest.raises(ValueError, match="bias and accumulate"):
        sgemm.product(x, p, 50, out, bias, True)
    # then max(0, .), as NumPy's maximum(v, 0) (a NaN stays, of the product's or the bias')
    xn = x.copy()
    xn[2, 3] = np.nan
    bn = bias.copy()
    bn[7] = np.nan
    pn = _product(xn, w)
    zeros = np.zeros_like(pn)
    out = np.empty((29, 50), np.float32)
    assert sgemm.product(xn, p, 50, out, bn, False, True)
    assert np.array_equal(out, np.maximum(pn + bn, zeros), equal_nan=True)
    assert np.isnan(out[2]).all() and np.isnan(out[:, 7]).all() and (out >= 0).sum() > 0
    out = old.copy()
    assert sgemm.product(x, p, 50, out, None, True, True)
    assert _same_bits(out, np.maximum(old + prod, zeros))


@needs_kernel
def test_layouts():
    """Row-strided views in and out are read and written in place; a column-strided
    output goes through a temporary; an output overlapping the input is refused by the
    C function and written through a temporary by write_nt/add_nt; inputs the kernel
    does not take (column-strided, float64, a writeable weight) are left to the BLAS."""
    rng = np.random.default_rng(5)
    big = rng.standard_normal((40, 90)).astype(np.float32)
    x = big[3:30, 5:69]                              # row stride 90, 64 columns
    w = _frozen(rng.standard_normal((48, 64)))
    want = _product(np.ascontiguousarray(x), w)
    canvas = np.full((30, 100), 5.0, np.float32)
    out = canvas[1:28, 10:58]
    assert sgemm.write_nt(x, w, out)
    assert _same_bits(out, want)
    assert (canvas[:, :10] == 5).all() and (canvas[:, 58:] == 5).all()
    assert (canvas[0] == 5).all() and (canvas[28:] == 5).all()
    col = np.zeros((48, 27), np.float32).T          # column-strided output
    assert sgemm.write_nt(x, w, col) and _same_bits(col, want)
    # overlap: the C function refuses and writes nothing; write_nt takes a temporary
    buf = rng.standard_normal((27, 64 + 48)).astype(np.float32)
    xin, o = buf[:, :64], buf[:, 16:64]
    w2 = _frozen(rng.standard_normal((48, 64)))
    want2 = _product(np.ascontiguousarray(xin), w2)
    before = buf.copy()
    assert sgemm.product(xin, sgemm.packed_for(xin, w2), 48, o) is False
    assert _same_bits(buf, before)
    assert sgemm.write_nt(xin, w2, o) and _same_bits(o, want2)
    # left to the BLAS
    assert sgemm.packed_for(np.asfortranarray(x), w) is None
    assert sgemm.packed_for(x.astype(np.float64), w) is None
    assert sgemm.packed_for(x, np.array(w)) is None              # writeable
    assert sgemm.packed_for(x, w[:, ::2]) is None                 # column-strided weight
    assert sgemm.packed_for(x[:, :10], w) is None                 # columns disagree
    sgemm.set_enabled(False)
    assert sgemm.packed_for(x, w) is None and not sgemm.write_nt(x, w, out)
    assert sgemm.isa() == "none"


@needs_kernel
def test_errors_name_the_argument():
    x = np.ones((3, 4), np.float32)
    w = _frozen(np.ones((5, 4)))
    p = sgemm.packed_for(x, w)
    ext = sgemm.EXTENSION
    with pytest.raises(ValueError, match="x: a 2-D float32"):
        ext.nt(x.astype(np.float64), p, 5, np.empty((3, 5), np.float32), None, False)
    with pytest.raises(ValueError, match="out: shape"):
        ext.nt(x, p, 5, np.empty((3, 6), np.float32), None, False)
    with pytest.raises(ValueError, match="packed"):
        ext.nt(x, p[1:], 5, np.empty((3, 5), np.float32), None, False)
    with pytest.raises(ValueError, match="bias: a contiguous float32 array of 5"):
        ext.nt(x, p, 5, np.empty((3, 5), np.float32), np.ones(4, np.float32), False)
    with pytest.raises(ValueError, match="threads"):
        ext.set_threads(0)


@needs_kernel
def test_packed_copies_are_made_once_and_dropped_with_the_weight():
    import gc  # noqa: PLC0415
    sgemm.forget_derived()
    w = _frozen(np.arange(40 * 6).reshape(40, 6))
    x = np.ones((2, 6), np.float32)
    p = sgemm.packed_for(x, w)
    assert p is sgemm.packed_for(x, w) and not p.flags.writeable
    assert p.__array_interface__["data"][0] % 64 == 0
    assert len(p) == 2 * 6 * sgemm.EXTENSION.PANEL          # two panels, zero-padded
    assert (p.reshape(2, 6, 32)[1, :, 8:] == 0).all()
    del w, p
    gc.collect()
    assert sgemm._derived == {}


@needs_kernel
def test_concurrent_callers_get_their_own_products():
    rng = np.random.default_rng(6)
    cases = []
    for i in range(4):
        x = rng.standard_normal((40 + i, 256)).astype(np.float32)
        w = _frozen(rng.standard_normal((192, 256)))
        cases.append((x, w, _product(x, w, 1)))
    sgemm.set_threads(2)
    errors = []

    def worker(x, w, want):
        out = np.empty_like(want)
        for _ in range(300):
            sgemm.write_nt(x, w, out)
            if not _same_bits(out, want):
                errors.append("differs")
                return
    threads = [threading.Thread(target=worker, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)


@needs_kernel
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_multiplies_on_its_own_workers():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 300)).astype(np.float32)
    w = _frozen(rng.standard_normal((256, 300)))
    want = _product(x, w, 2)                 # the parent's workers exist now
    pid = os.fork()
    if pid == 0:                             # the child: its workers are started afresh
        code = 1
        try:
            code = 0 if _same_bits(_product(x, w, 2), want) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@needs_kernel
def test_threads_follow_the_blas_count():
    from engine.runtime import parallel  # noqa: PLC0415
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not parallel.blas_threads_settable() or not parallel._getters:
        pytest.skip("the BLAS's thread count cannot be read here")
    parallel._blas_setters()
    addr = __import__("ctypes").cast(parallel._getters[0], __import__("ctypes").c_void_p).value
    sgemm.set_threads(1, addr)
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        assert sgemm.threads() == 1
    with threadpoolctl.threadpool_limits(3, user_api="blas"):
        assert sgemm.threads() == 3


# --------------------------------------------------------------------------------------
# the components and the executor's fast forms on frozen weights


def _forms_agree(cls, comp, pre, x, out_cols, start=None):
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import bind_propagate, fast_propagate  # noqa: PLC0415
    base = np.zeros((x.shape[0] if pre is None else start.shape[0], out_cols), np.float32) \
        if start is None else start
    want = base.copy()
    comp.propagate(pre, x, want)
    got = base.copy()
    fast_propagate(cls)(comp, pre, x, got)
    assert _same_bits(got, want)
    got = base.copy()
    bind_propagate(cls, x, got, Scratch(np))(comp, pre)
    assert _same_bits(got, want)
    return want


@needs_kernel
def test_components_and_fast_forms_agree_on_frozen_weights():
    from component_harness import component_from_config  # noqa: PLC0415
    from engine.nnet.components.affine import (AffineComponent,  # noqa: PLC0415
                                               LinearComponent,
                                               NaturalGradientAffineComponent)
    from engine.nnet.components.tdnn import (TdnnComponent,  # noqa: PLC0415
                                             TdnnPrecomputedIndexes)
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import bind_propagate_write  # noqa: PLC0415
    rng = np.random.default_rng(8)
    for cls, name in ((AffineComponent, "AffineComponent"),
                      (NaturalGradientAffineComponent, "NaturalGradientAffineComponent")):
        comp = component_from_config(name, "input-dim=120 output-dim=384", seed=1)
        comp.linear_params = _frozen(rng.standard_normal((384, 120)))
        comp.bias_params = _frozen(rng.standard_normal(384))
        for rows in (1, 21, 37, 150):
            x = rng.standard_normal((rows, 120)).astype(np.float32)
            want = _forms_agree(cls, comp, None, x, 384)
            assert _same_bits(want, _product(x, comp.linear_params) + comp.bias_params)
    lin = component_from_config("LinearComponent", "input-dim=384 output-dim=128", seed=2)
    lin.params = _frozen(rng.standard_normal((128, 384)))
    x = rng.standard_normal((21, 384)).astype(np.float32)
    start = rng.standard_normal((21, 128)).astype(np.float32)
    want = _forms_agree(LinearComponent, lin, None, x, 128, start)
    assert _same_bits(want, start + _product(x, lin.params))
    for d, nout, offsets, bias in ((384, 64, (-1, 0), True), (64, 384, (0, 1), False),
                                   (8, 24, (-3, 0, 3), True)):
        comp = component_from_config(
            "TdnnComponent", f"input-dim={d} output-dim={nout} time-offsets="
            f"{','.join(map(str, offsets))} use-bias={'true' if bias else 'false'}", seed=3)
        comp.linear_params = _frozen(rng.standard_normal(comp.linear_params.shape))
        if bias:
            comp.bias_params = _frozen(rng.standard_normal(nout))
        span = max(offsets) - min(offsets)
        for rows in (21, 36, 150):
            pre = TdnnPrecomputedIndexes(1, [o - min(offsets) for o in offsets])
            x = rng.standard_normal((span + rows, d)).astype(np.float32)
            start = rng.standard_normal((rows, nout)).astype(np.float32)
            got = _forms_agree(TdnnComponent, comp, pre, x, nout, start)
            # one chain over the offsets side by side, then the bias or the old output
            spliced = np.concatenate([x[o:o + rows] for o in pre.row_offsets], axis=1)
            prod = _product(spliced, comp.linear_params)
            assert _same_bits(got, prod + comp.bias_params if bias else start + prod)
            w = comp.linear_params.astype(np.float64)
            ref = (start.astype(np.float64) if not bias else
                   np.broadcast_to(comp.bias_params.astype(np.float64), (rows, nout)).copy())
            for i, o in enumerate(pre.row_offsets):
                ref += x[o:o + rows].astype(np.float64) @ w[:, i * d:(i + 1) * d].T
            assert np.allclose(got, ref, rtol=1e-5, atol=1e-3), (d, nout, rows)
            if not bias:     # zeroed before, the bound write form: the product itself
                w2 = np.full((rows, nout), np.nan, np.float32)
                bind_propagate_write(TdnnComponent, x, w2, Scratch(np))(comp, pre)
                assert _same_bits(w2, prod)


@needs_kernel
def test_switching_the_kernel_off_reaches_bound_forms():
    """set_enabled(False) after a bound form has decided: it decides anew (the BLAS
    product), as the component does, so the two still agree."""
    from component_harness import component_from_config  # noqa: PLC0415
    from engine.nnet.components.affine import AffineComponent  # noqa: PLC0415
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import bind_propagate  # noqa: PLC0415
    rng = np.random.default_rng(9)
    comp = component_from_config("AffineComponent", "input-dim=64 output-dim=96", seed=1)
    comp.linear_params = _frozen(rng.standard_normal((96, 64)))
    comp.bias_params = _frozen(rng.standard_normal(96))
    x = rng.standard_normal((21, 64)).astype(np.float32)
    out = np.empty((21, 96), np.float32)
    f = bind_propagate(AffineComponent, x, out, Scratch(np))
    for on in (True, False, True):
        sgemm.set_enabled(on)
        f(comp, None)
        want = np.empty_like(out)
        comp.propagate(None, x, want)
        assert _same_bits(out, want), on



@needs_kernel
def test_fast_forms_agree_where_the_kernel_cannot_write_the_output():
    """An output with strided columns, or one that overlaps the input: the component and
    the bound forms both take the kernel's product through a temporary (same bits)."""
    from component_harness import component_from_config  # noqa: PLC0415
    from engine.nnet.components.affine import AffineComponent  # noqa: PLC0415
    from engine.nnet.components.tdnn import (TdnnComponent,  # noqa: PLC0415
                                             TdnnPrecomputedIndexes)
    from engine.runtime.arena import Scratch  # noqa: PLC0415
    from engine.runtime.fastpaths import bind_propagate, bind_propagate_write  # noqa: PLC0415
    rng = np.random.default_rng(10)
    aff = component_from_config("AffineComponent", "input-dim=48 output-dim=40", seed=1)
    aff.linear_params = _frozen(rng.standard_normal((40, 48)))
    aff.bias_params = _frozen(rng.standard_normal(40))
    tdnn = component_from_config("TdnnComponent", "input-dim=24 output-dim=40 "
                                 "time-offsets=-1,0 use-bias=false", seed=2)
    tdnn.linear_params = _frozen(rng.standard_normal((40, 48)))
    pre = TdnnPrecomputedIndexes(1, [0, 1])
    for layout in ("columns", "overlap"):
        buf = rng.standard_normal((30, 120)).astype(np.float32)
        if layout == "columns":
            x = buf[:21, :48]
            out = np.zeros((40, 21), np.float32).T
        else:
            x, out = buf[:21, :48], buf[:21, 30:70]        # columns 30-47 shared
        # affine
        want = np.empty((21, 40), np.float32)
        aff.propagate(None, np.array(x), want)
        before = buf.copy()
        bind_propagate(AffineComponent, x, out, Scratch(np))(aff, None)
        assert _same_bits(np.array(out), want), layout
        buf[...] = before
        # TDNN without bias: added to out, and the write form
        xt = buf[:22, :24]
        if layout == "overlap":
            out = buf[:21, 10:50]                           # columns 10-23 shared
        start = np.array(out)
        want = start.copy()
        tdnn.propagate(pre, np.array(xt), want)
        bind_propagate(TdnnComponent, xt, out, Scratch(np))(tdnn, pre)
        assert _same_bits(np.array(out), want), layout
        if layout == "columns":
            out[...] = np.nan           # the write form writes, whatever out held
        zero = np.zeros((21, 40), np.float32)
        tdnn.propagate(pre, np.array(xt), zero)     # (x as it is when the form runs)
        bind_propagate_write(TdnnComponent, xt, out, Scratch(np))(tdnn, pre)
        assert _same_bits(np.array(out), zero), layout


@needs_kernel
@pytest.mark.parametrize("case", range(4))
def test_time_height_convolution_takes_the_kernel_on_frozen_weights(case):
    """The convolution's im2col products (both forms: with a bias written, without one
    added) go through the kernel for frozen float32 parameters: the float64 convolution
    to float32 rounding, and the BLAS form's numbers to rounding too."""
    from test_components_nonsimple import CONV_CASES, Setup, naive_conv, rows_by_index  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    cfg, tin, tout = CONV_CASES[case]
    comp = component_from_config_frozen("TimeHeightConvolutionComponent",
                                        cfg + " use-natural-gradient=false")
    s = Setup(comp, [Index(n, t, 0) for n in (0, 1) for t in tout],
              [Index(n, t, 0) for n in (0, 1) for t in tin], need_backprop=False)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((len(s.ins), comp.input_dim())).astype(np.float32)
    x[~s.in_mask] = 0.0
    with _counting_kernel() as calls:
        y, _ = s.forward(comp, x)
    assert calls, "the kernel was not taken"
    ref = naive_conv(comp, s, x.astype(np.float64))
    got = rows_by_index(s, y)
    for key, row in ref.items():
        np.testing.assert_allclose(got[key], row, rtol=1e-5, atol=1e-5)
    sgemm.set_enabled(False)
    y_blas, _ = s.forward(comp, x)
    sgemm.set_enabled(True)
    np.testing.assert_allclose(y, y_blas, rtol=1e-5, atol=1e-5)
    # without a bias: the products added to what out holds (the second form)
    base = rng.standard_normal(y.shape).astype(np.float32)
    from engine.nnet.components._convolution import convolve_forward  # noqa: PLC0415
    with _counting_kernel() as calls:
        out = base.copy()
        convolve_forward(s.pi, x, comp.linear_params, out)
    assert calls
    want = base.copy()
    sgemm.set_enabled(False)
    convolve_forward(s.pi, x, comp.linear_params, want)
    sgemm.set_enabled(True)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def component_from_config_frozen(kind, cfg):
    from component_harness import component_from_config  # noqa: PLC0415
    comp = component_from_config(kind, cfg, seed=4)
    for name in ("linear_params", "bias_params"):
        setattr(comp, name, _frozen(getattr(comp, name)))
    return comp


@contextlib.contextmanager
def _counting_kernel():
    """The kernel with each call's x shape recorded in the list yielded."""
    calls: list = []
    ext = sgemm.EXTENSION

    class Counting:
        def __getattr__(self, name):
            return getattr(ext, name)

        def nt(self, *a):
            calls.append(a[0][0].shape if isinstance(a[0], tuple) else a[0].shape)
            return ext.nt(*a)
    sgemm.EXTENSION = sgemm.KERNEL = Counting()
    try:
        yield calls
    finally:
        sgemm.EXTENSION = sgemm.KERNEL = ext


@needs_kernel
def test_convolution_component_takes_the_kernel_on_frozen_filters():
    """Kaldi's older ConvolutionComponent: its patches times the filters through the
    kernel for frozen float32 filters, the BLAS form's numbers to rounding."""
    from component_harness import component_from_config  # noqa: PLC0415
    comp = component_from_config(
        "ConvolutionComponent", "input-x-dim=7 input-y-dim=6 input-z-dim=3 filt-x-dim=3 "
        "filt-y-dim=2 filt-x-step=2 filt-y-step=2 num-filters=4", seed=2)
    for name in ("filter_params", "bias_params"):
        setattr(comp, name, _frozen(getattr(comp, name)))
    x = np.random.default_rng(5).standard_normal((9, comp.input_dim())).astype(np.float32)
    start = np.random.default_rng(6).standard_normal((9, comp.output_dim())).astype(np.float32)
    with _counting_kernel() as seen:
        got = start.copy()
        comp.propagate(None, x, got)
    assert seen
    sgemm.set_enabled(False)
    want = start.copy()
    comp.propagate(None, x, want)
    sgemm.set_enabled(True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
