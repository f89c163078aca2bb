"""Non-simple components: TimeHeightConvolution, RestrictedAttention, StatisticsExtraction,
StatisticsPooling, Distribute.

Kaldi's component reference cases cover simple components only, so these are checked
by (a) finite differences through the full index path (get_input_indexes ->
reorder_indexes -> precompute_indexes -> propagate/backprop), (b) independent naive
per-output implementations written from the definitions, (c) the declared property
flags, (d) text/binary I/O (byte-identical on the components of Kaldi's network
models when ../shared/kaldi-ref exists), (e) config errors, shape errors and the
index functions on hand-made index sets.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from component_harness import check_io_roundtrip, component_from_config
from refdata import shared_ref
from engine.core.errors import ComponentError, ConfigError, DimensionError
from engine.core.index import Index, K_NO_TIME, array_to_indexes
from engine.nnet.components import read_component
from engine.nnet.components.base import ComponentProperty as P
from engine.nnet.kaldi_io import KaldiReader

# --------------------------------------------------------------------------------------
# the index path, as the compiler drives it


class Setup:
    """Reordered indexes, precomputed indexes and a float64 copy of the component."""

    def __init__(self, comp, outputs, available=None, need_backprop=True):
        self.comp = comp
        avail = None if available is None else set(available)
        used: set = set()
        for o in outputs:
            if avail is None:
                used.update(comp.get_input_indexes(None, o))
            else:
                u: list = []
                assert comp.is_computable(None, o, lambda i: i in avail, u), o
                used.update(u)
        ins = sorted(used, key=lambda i: (i.t, i.x, i.n))
        outs = sorted(outputs, key=lambda i: (i.t, i.x, i.n))
        if comp.properties() & P.REORDERS_INDEXES:
            ins, outs = comp.reorder_indexes(ins, outs)
        self.ins, self.outs = list(ins), list(outs)
        self.pi = comp.precompute_indexes(None, self.ins, self.outs, need_backprop)
        self.in_mask = np.array([i[1] != K_NO_TIME for i in self.ins], dtype=bool)
        self.out_mask = np.array([i[1] != K_NO_TIME for i in self.outs], dtype=bool)

    def forward(self, comp, x, base=None):
        out = np.zeros((len(self.outs), comp.output_dim()), dtype=x.dtype) \
            if base is None else base.copy()
        memo = comp.propagate(self.pi, x, out)
        return out, memo

    def backward(self, comp, x, y, dy, memo, to_update=None, base=None):
        dx = np.zeros((len(self.ins), comp.input_dim()), dtype=dy.dtype) \
            if base is None else base.copy()
        comp.backprop("test", self.pi, x, y, dy, memo, to_update, dx)
        return dx


def to64(comp):
    c = comp.copy()
    for p in c.PARAMS:
        setattr(c, p, np.asarray(getattr(c, p), dtype=np.float64))
    return c


def check_derivatives_ns(setup: Setup, x, col_mask=None, seed=0, delta=1e-6, rtol=1e-4):
    """Finite differences (float64) of sum(y * dy) w.r.t. the real input rows (and the
    parameters); blank rows stay zero, ``col_mask`` limits the perturbed columns."""
    rng = np.random.default_rng(seed)
    comp = to64(setup.comp)
    x = x.astype(np.float64)
    x[~setup.in_mask] = 0
    y, memo = setup.forward(comp, x)
    dy = rng.standard_normal(y.shape)
    dy[~setup.out_mask] = 0
    grad = None
    if comp.properties() & P.UPDATABLE_COMPONENT:
        grad = comp.copy()
        grad.set_as_gradient()
    dx = setup.backward(comp, x, y, dy, memo, grad)

    def f(c, xx):
        return float(np.sum(setup.forward(c, xx)[0] * dy))

    for _ in range(3):
        d = rng.standard_normal(x.shape) * delta
        d[~setup.in_mask] = 0
        if col_mask is not None:
            d[:, ~col_mask] = 0
        predicted = float(np.sum(dx * d))
        actual = (f(comp, x + d) - f(comp, x - d)) / 2
        assert abs(predicted - actual) <= rtol * max(abs(predicted), abs(actual)) + 1e-13, \
            f"{comp.type_name}: input derivative {predicted:.8g} vs finite difference {actual:.8g}"
    if grad is not None:
        for p in comp.PARAMS:
            orig = getattr(comp, p)
            d = rng.standard_normal(orig.shape) * delta
            predicted = float(np.sum(getattr(grad, p) * d))
            setattr(comp, p, orig + d)
            fp = f(comp, x)
            setattr(comp, p, orig - d)
            fm = f(comp, x)
            setattr(comp, p, orig)
            actual = (fp - fm) / 2
            assert abs(predicted - actual) <= rtol * max(abs(predicted), abs(actual)) + 1e-13, \
                f"{comp.type_name}: gradient of {p} {predicted:.8g} vs {actual:.8g}"
    return y, dx


def check_properties_ns(setup: Setup, x, seed=1):
    """Declared flags hold: PROPAGATE_ADDS / BACKPROP_ADDS add; backprop does not read
    input/output values it does not declare it needs; memo only when USES_MEMO."""
    comp = setup.comp
    rng = np.random.default_rng(seed)
    props = comp.properties()
    x = x.astype(np.float32)
    x[~setup.in_mask] = 0
    y, memo = setup.forward(comp, x)
    if not props & P.USES_MEMO:
        assert memo is None
    if props & P.PROPAGATE_ADDS:
        base = rng.standard_normal(y.shape).astype(np.float32)
        y2, _ = setup.forward(comp, x, base)
        np.testing.assert_allclose(y2, base + y, rtol=1e-5, atol=1e-5)
    else:
        y2, _ = setup.forward(comp, x, rng.standard_normal(y.shape).astype(np.float32))
        np.testing.assert_allclose(y2, y, rtol=1e-6, atol=1e-6)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dy[~setup.out_mask] = 0
    dx = setup.backward(comp, x, y, dy, memo)
    x_arg = x if props & P.BACKPROP_NEEDS_INPUT else None
    y_arg = y if props & P.BACKPROP_NEEDS_OUTPUT else None
    memo2 = setup.forward(comp, x)[1] if props & P.USES_MEMO else None
    dx2 = setup.backward(comp, x_arg, y_arg, dy, memo2) if x_arg is not None or \
        not props & P.UPDATABLE_COMPONENT else dx
    np.testing.assert_allclose(dx2, dx, rtol=1e-5, atol=1e-6)
    base = rng.standard_normal(dx.shape).astype(np.float32)
    dx3 = setup.backward(comp, x, y, dy, memo2, base=base)
    if props & P.BACKPROP_ADDS:
        np.testing.assert_allclose(dx3, base + dx, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(dx3, dx, rtol=1e-5, atol=1e-6)
    return y, dx


def rows_by_index(setup: Setup, y):
    return {tuple(i): y[k] for k, i in enumerate(setup.outs) if i[1] != K_NO_TIME}


def input_lookup(setup: Setup, x):
    table = {tuple(i): x[k] for k, i in enumerate(setup.ins) if i[1] != K_NO_TIME}
    zero = np.zeros(x.shape[1])
    return lambda n, t, xx: table.get((n, t, xx), zero)


def outputs_grid(ns, ts, xs=(0,)):
    return [Index(n, t, x) for t in ts for n in ns for x in xs]


# --------------------------------------------------------------------------------------
# DistributeComponent


@pytest.mark.parametrize("od,nb,xs", [(4, 3, range(6)), (5, 1, range(2)), (2, 4, range(-4, 8))])
def test_distribute(od, nb, xs):
    comp = component_from_config("DistributeComponent", f"input-dim={od * nb} output-dim={od}")
    assert comp.properties() == P.NONE
    assert comp.get_input_indexes(None, Index(1, 2, -1)) == [Index(1, 2, -1 // nb)]
    outs = outputs_grid([0, 1], [0, 1, 2], list(xs))
    s = Setup(comp, outs)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((len(s.ins), comp.input_dim()))
    y, dx = check_derivatives_ns(s, x)
    get = input_lookup(s, x)
    for (n, t, xx), row in rows_by_index(s, y).items():
        b = xx - nb * (xx // nb)
        np.testing.assert_allclose(row, get(n, t, xx // nb)[b * od:(b + 1) * od])
    check_properties_ns(s, x)
    check_io_roundtrip(comp)


def test_distribute_gaps_zero_derivative():
    comp = component_from_config("DistributeComponent", "input-dim=6 output-dim=2")
    s = Setup(comp, [Index(0, 0, 0), Index(0, 0, 2)])   # block 1 of x=0 unused, x=0 only
    dy = np.ones((2, 2))
    dx = np.full((len(s.ins), 6), 7.0)
    comp.backprop("t", s.pi, None, None, dy, None, None, dx)
    np.testing.assert_array_equal(dx, [[1, 1, 0, 0, 1, 1]])


# --------------------------------------------------------------------------------------
# statistics


@pytest.mark.parametrize("ip,op,var", [(1, 1, False), (2, 4, True), (3, 9, True), (1, 3, False)])
def test_statistics_extraction(ip, op, var):
    dim = 3
    comp = component_from_config(
        "StatisticsExtractionComponent",
        f"input-dim={dim} input-period={ip} output-period={op} include-variance={str(var).lower()}")
    assert comp.output_dim() == 1 + dim * (2 if var else 1)
    assert comp.properties() == P.PROPAGATE_ADDS | P.REORDERS_INDEXES | (
        P.BACKPROP_NEEDS_INPUT if var else 0)
    # inputs on the grid, a few missing; outputs at block starts (one per block)
    avail = [Index(n, t, 0) for n in (0, 1) for t in range(-2 * op, 3 * op, ip)
             if (t // ip) % 5 != 3]
    outs = [Index(n, t, 0) for n in (0, 1) for t in range(-2 * op, 3 * op, op)]
    outs = [o for o in outs if comp.is_computable(None, o, set(avail).__contains__, None)]
    s = Setup(comp, outs, avail)
    assert [i.t for i in s.ins] == sorted(i.t for i in s.ins if i.n == 0) + \
        sorted(i.t for i in s.ins if i.n == 1)   # sorted n, x, t
    rng = np.random.default_rng(3)
    x = rng.standard_normal((len(s.ins), dim))
    y, _ = check_derivatives_ns(s, x)
    get = input_lookup(s, x)
    have = {tuple(i) for i in s.ins}
    for (n, t, xx), row in rows_by_index(s, y).items():
        block = [tt for tt in range(t, t + op, ip) if (n, tt, xx) in have]
        xs = np.array([get(n, tt, xx) for tt in block])
        want = [len(block)] + list(xs.sum(0)) + (list((xs * xs).sum(0)) if var else [])
        np.testing.assert_allclose(row, want, rtol=1e-10)
    check_properties_ns(s, x)
    check_io_roundtrip(comp)


def _pooling_input(rng, rows, dim, stddevs):
    x = rng.standard_normal((rows, dim))
    x[:, 0] = 1.0 + rng.random(rows) * 3          # positive counts
    if stddevs:
        f = (dim - 1) // 2
        x[:, 1 + f:] = x[:, 1:1 + f] ** 2 + 1.0 + rng.random((rows, f))  # variance > 0
    return x


@pytest.mark.parametrize("ip,lc,rc,nlog,stddevs", [
    (1, 3, 2, 0, False), (2, 4, 6, 2, True), (3, 9, 0, 1, False), (1, 0, 4, 0, True)])
def test_statistics_pooling(ip, lc, rc, nlog, stddevs):
    f = 2
    dim = 1 + f * (2 if stddevs else 1)
    comp = component_from_config(
        "StatisticsPoolingComponent",
        f"input-dim={dim} input-period={ip} left-context={lc} right-context={rc} "
        f"num-log-count-features={nlog} output-stddevs={str(stddevs).lower()} "
        "variance-floor=1e-10")
    assert comp.output_dim() == dim + nlog - 1
    want_props = P.REORDERS_INDEXES | P.BACKPROP_ADDS
    if stddevs or nlog > 0:
        want_props |= P.BACKPROP_NEEDS_OUTPUT
    if nlog == 0:
        want_props |= P.BACKPROP_NEEDS_INPUT
    assert comp.properties() == want_props
    avail = [Index(n, t, 0) for n in (0, 2) for t in range(0, 12 * ip, ip)]
    outs = [Index(n, t, 0) for n in (0, 2) for t in range(0, 12 * ip, ip)]
    assert not comp.is_computable(None, Index(0, ip * 3 + (1 if ip > 1 else 0), 0),
                                  lambda i: True, None) or ip == 1
    s = Setup(comp, outs, avail)
    rng = np.random.default_rng(5)
    x = _pooling_input(rng, len(s.ins), dim, stddevs)
    col_mask = np.arange(dim) > 0     # the count column is not differentiated (as Kaldi)
    y, _ = check_derivatives_ns(s, x, col_mask=col_mask)
    get = input_lookup(s, x)
    have = {tuple(i) for i in s.ins}
    for (n, t, xx), row in rows_by_index(s, y).items():
        ts = [tt for tt in range(t - lc, t + rc + 1, ip) if (n, tt, xx) in have]
        tot = np.array([get(n, tt, xx) for tt in ts]).sum(0)
        cnt = tot[0]
        stats = tot[1:] / cnt
        if stddevs:
            stats[f:] = np.sqrt(np.maximum(stats[f:] - stats[:f] ** 2, 1e-10))
        np.testing.assert_allclose(row, [np.log(cnt)] * nlog + list(stats), rtol=1e-10)
    check_properties_ns(s, x)
    check_io_roundtrip(comp)


def test_statistics_index_hooks_on_rows():
    """The (k, 3) rows the compiler hands over: reorder_index_arrays sorts on (n, x, t)
    stably as the Index-list form does, gives rows already in order back as the same
    objects, and precompute_index_arrays equals the Index-list form, its refusals naming
    the Index at fault."""
    ext = component_from_config("StatisticsExtractionComponent",
                                "input-dim=2 input-period=1 output-period=3")
    pool = component_from_config("StatisticsPoolingComponent",
                                 "input-dim=3 input-period=3 left-context=3 right-context=3 "
                                 "num-log-count-features=0 output-stddevs=false")
    rng = np.random.default_rng(9)
    for comp, tin, tout in ((ext, range(0, 12), range(0, 12, 3)),
                            (pool, range(0, 12, 3), range(0, 12, 3))):
        ins = [Index(n, t, x) for n in (2, 0) for x in (1, 0) for t in tin]
        outs = [Index(n, t, x) for n in (2, 0) for x in (1, 0) for t in tout]
        rows_in = np.array(ins, dtype=np.int64)[rng.permutation(len(ins))]
        rows_out = np.array(outs, dtype=np.int64)[rng.permutation(len(outs))]
        new_in, new_out = comp.reorder_index_arrays(rows_in, rows_out)
        want_in, want_out = comp.reorder_indexes(array_to_indexes(rows_in),
                                                 array_to_indexes(rows_out))
        assert want_in == sorted(ins, key=lambda i: (i.n, i.x, i.t))
        assert array_to_indexes(new_in) == want_in and array_to_indexes(new_out) == want_out
        again_in, again_out = comp.reorder_index_arrays(new_in, new_out)
        assert again_in is new_in and again_out is new_out
        got = vars(comp.precompute_index_arrays(None, new_in, new_out, True))
        want = vars(comp.precompute_indexes(None, want_in, want_out, True))
        assert got.keys() == want.keys()
        for k in got:
            np.testing.assert_array_equal(got[k], want[k])
    # an output with no inputs, named as an Index
    with pytest.raises(ComponentError, match=r"output Index .*has no inputs"):
        ext.precompute_index_arrays(None, np.array([[0, 0, 0]]), np.array([[0, 0, 0],
                                                                            [0, 6, 0]]), False)


def test_statistics_pipeline_xvector_style():
    """Extraction then pooling over one long sequence, as in an x-vector network."""
    ext = component_from_config("StatisticsExtractionComponent",
                                "input-dim=4 input-period=1 output-period=2")
    pool = component_from_config("StatisticsPoolingComponent",
                                 "input-dim=9 input-period=2 left-context=0 right-context=98 "
                                 "num-log-count-features=0 output-stddevs=true")
    frames = [Index(0, t, 0) for t in range(100)]
    mid = [Index(0, t, 0) for t in range(0, 100, 2)]
    s1 = Setup(ext, mid, frames)
    s2 = Setup(pool, [Index(0, 0, 0)], mid)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 4)).astype(np.float32) + 2
    stats, _ = s1.forward(ext, x)
    order = [s1.outs.index(i) for i in s2.ins]
    out, _ = s2.forward(pool, stats[order])
    np.testing.assert_allclose(out[0, :4], x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(out[0, 4:], x.std(0), rtol=1e-4)


# --------------------------------------------------------------------------------------
# RestrictedAttentionComponent


def naive_attention(comp, s, x):
    H, K, V, C = comp.num_heads, comp.key_dim, comp.value_dim, comp.context_dim
    get = input_lookup(s, x)
    per_in = 2 * K + V + C
    res = {}
    for (n, t, xx) in [tuple(i) for i in s.outs if i[1] != K_NO_TIME]:
        row = []
        for h in range(H):
            q = get(n, t, xx)[h * per_in:(h + 1) * per_in][K + V:]
            scores, vals = [], []
            for o in range(-comp.num_left_inputs, comp.num_right_inputs + 1):
                r = get(n, t + o * comp.time_stride, xx)[h * per_in:(h + 1) * per_in]
                scores.append(comp.key_scale * q[:K] @ r[:K] + q[K + o + comp.num_left_inputs])
                vals.append(r[K:K + V])
            w = np.exp(np.array(scores) - max(scores))
            w /= w.sum()
            row += list(w @ np.array(vals)) + (list(w) if comp.output_context else [])
        res[(n, t, xx)] = np.array(row)
    return res


ATTENTION_CONFIGS = [
    "num-heads=1 key-dim=3 value-dim=2 num-left-inputs=2 num-right-inputs=1",
    "num-heads=2 key-dim=2 value-dim=3 num-left-inputs=3 num-right-inputs=0 time-stride=2 "
    "num-left-inputs-required=1 output-context=false",
    "num-heads=3 key-dim=4 value-dim=1 num-left-inputs=1 num-right-inputs=2 time-stride=3 "
    "num-left-inputs-required=0 num-right-inputs-required=1 key-scale=0.3",
]


@pytest.mark.parametrize("cfg", ATTENTION_CONFIGS)
def test_attention(cfg):
    comp = component_from_config("RestrictedAttentionComponent", cfg)
    assert comp.properties() == (P.REORDERS_INDEXES | P.BACKPROP_NEEDS_INPUT | P.PROPAGATE_ADDS
                                 | P.BACKPROP_ADDS | P.STORES_STATS | P.USES_MEMO)
    st = comp.time_stride
    avail = [Index(n, t, 0) for n in (0, 1) for t in range(-4 * st, 10 * st, st)]
    outs = [Index(n, t, 0) for n in (0, 1) for t in range(0, 6 * st, st)]
    s = Setup(comp, outs, avail)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((len(s.ins), comp.input_dim()))
    y, _ = check_derivatives_ns(s, x)
    for key, row in naive_attention(comp, s, np.where(s.in_mask[:, None], x, 0)).items():
        np.testing.assert_allclose(rows_by_index(s, y)[key], row, rtol=1e-9, atol=1e-12)
    check_properties_ns(s, x)
    check_io_roundtrip(comp)
    # stats: posteriors sum to the row count
    _, memo = s.forward(comp, x.astype(np.float32))
    comp.store_stats(None, None, memo)
    assert comp.stats_count == len(s.outs)
    np.testing.assert_allclose(comp.posterior_stats.sum(1), len(s.outs), rtol=1e-5)
    check_io_roundtrip(comp)


def test_attention_strided_context_views_and_layouts():
    """The context positions are strided views of the input (no gathered copies): the
    same numbers into a column slice of a wider output / input derivative as into
    contiguous ones, for several sequences (rows interleaved) and time strides."""
    for cfg, nseq in ((ATTENTION_CONFIGS[1], 3), (ATTENTION_CONFIGS[2], 4)):
        comp = component_from_config("RestrictedAttentionComponent", cfg)
        st = comp.time_stride
        avail = [Index(n, t, 0) for n in range(nseq) for t in range(-4 * st, 10 * st, st)]
        outs = [Index(n, t, 0) for n in range(nseq) for t in range(0, 6 * st, st)]
        s = Setup(comp, outs, avail)
        rng = np.random.default_rng(3)
        x = rng.standard_normal((len(s.ins), comp.input_dim())).astype(np.float32)
        x[~s.in_mask] = 0
        y, memo = s.forward(comp, x)
        wide = np.zeros((len(s.outs), comp.output_dim() + 3), np.float32)
        comp.propagate(s.pi, x, wide[:, 2:2 + comp.output_dim()])
        np.testing.assert_allclose(wide[:, 2:2 + comp.output_dim()], y, rtol=1e-6, atol=1e-6)
        assert not wide[:, :2].any() and not wide[:, -1].any()
        dy = rng.standard_normal(y.shape).astype(np.float32)
        dx = s.backward(comp, x, y, dy, memo)
        wdx = np.zeros((len(s.ins), comp.input_dim() + 3), np.float32)
        comp.backprop("test", s.pi, x, y, dy, memo, None, wdx[:, 1:1 + comp.input_dim()])
        np.testing.assert_allclose(wdx[:, 1:1 + comp.input_dim()], dx, rtol=1e-6, atol=1e-6)
        # against the definition, float64
        for key, row in naive_attention(comp, s, x.astype(np.float64)).items():
            np.testing.assert_allclose(rows_by_index(s, y)[key], row, rtol=1e-4, atol=1e-5)


def test_attention_index_functions():
    comp = component_from_config(
        "RestrictedAttentionComponent",
        "key-dim=2 value-dim=2 num-left-inputs=2 num-right-inputs=1 time-stride=2 "
        "num-left-inputs-required=1 num-right-inputs-required=0")
    assert comp.get_input_indexes(None, Index(0, 10, 1)) == [
        Index(0, 6, 1), Index(0, 8, 1), Index(0, 10, 1), Index(0, 12, 1)]
    have = {Index(0, 8, 0), Index(0, 10, 0)}
    used: list = []
    assert comp.is_computable(None, Index(0, 10, 0), have.__contains__, used)
    assert used == [Index(0, 8, 0), Index(0, 10, 0)]
    assert not comp.is_computable(None, Index(0, 12, 0), have.__contains__, None)
    # output grid is padded out to the requested context with blank indexes
    ins, outs = comp.reorder_indexes([Index(0, 8, 0), Index(0, 10, 0)], [Index(0, 10, 0)])
    assert outs == [Index(0, 10, 0)]
    assert ins == [Index(0, K_NO_TIME, 0), Index(0, 8, 0), Index(0, 10, 0),
                   Index(0, K_NO_TIME, 0)]
    with pytest.raises(ComponentError, match="RestrictedAttention"):
        comp.reorder_indexes([Index(0, 10, 0)], [Index(0, 10, 0)])   # t=8 required
    # the same on (k, 3) rows, what the compiler hands it: rows in order come back as the
    # same objects, and the precomputed grid is the one of the Index lists
    rows_in = np.array([(0, 8, 0), (0, 10, 0)], dtype=np.int64)
    rows_out = np.array([(0, 10, 0)], dtype=np.int64)
    new_in, new_out = comp.reorder_index_arrays(rows_in, rows_out)
    assert array_to_indexes(new_in) == ins and array_to_indexes(new_out) == outs
    again_in, again_out = comp.reorder_index_arrays(new_in, new_out)
    assert again_in is new_in and again_out is new_out
    assert (vars(comp.precompute_index_arrays(None, new_in, new_out, False))
            == vars(comp.precompute_indexes(None, ins, outs, False)))


# --------------------------------------------------------------------------------------
# TimeHeightConvolutionComponent


def naive_conv(comp, s, x):
    m = comp.model
    fi, fo = m.num_filters_in, m.num_filters_out
    get = input_lookup(s, x)
    W, b = comp.linear_params.astype(np.float64), comp.bias_params.astype(np.float64)
    res = {}
    for (n, t, xx) in [tuple(i) for i in s.outs if i[1] != K_NO_TIME]:
        row = np.tile(b, m.height_out)
        for ho in range(m.height_out):
            for k, (dt, dh) in enumerate(m.offsets):
                hi = ho * m.height_subsample_out + dh
                if 0 <= hi < m.height_in:
                    v = get(n, t + dt, xx)[hi * fi:(hi + 1) * fi]
                    row[ho * fo:(ho + 1) * fo] += W[:, k * fi:(k + 1) * fi] @ v
        res[(n, t, xx)] = row
    return res


CONV_CASES = [
    # (config, input t range/step, output t range/step)
    ("num-filters-in=2 num-filters-out=3 height-in=5 height-out=5 height-offsets=-1,0,1 "
     "time-offsets=-1,0,1", range(-1, 8), range(0, 7)),
    ("num-filters-in=3 num-filters-out=2 height-in=6 height-out=3 height-subsample-out=2 "
     "offsets=0,0;0,1;-2,-1;2,1 required-time-offsets=0 max-memory-mb=1e-5 bias-stddev=1",
     range(-2, 12), range(0, 10)),
    # output stride 3 > input stride 1: frames get appended (reorder_t_in)
    ("num-filters-in=2 num-filters-out=2 height-in=4 height-out=4 height-offsets=-1,0,1 "
     "time-offsets=-1,0,1 required-time-offsets=0", range(-3, 14), range(0, 12, 3)),
    # input stride 2, time offsets -2,0,2, some optional inputs missing at the edges
    ("num-filters-in=1 num-filters-out=4 height-in=3 height-out=2 height-offsets=0,1 "
     "time-offsets=-2,0,2 required-time-offsets=0", range(0, 10, 2), range(0, 10, 2)),
]


@pytest.mark.parametrize("cfg,tin,tout", CONV_CASES)
def test_time_height_convolution(cfg, tin, tout):
    comp = component_from_config("TimeHeightConvolutionComponent",
                                 cfg + " use-natural-gradient=false", seed=4)
    assert comp.properties() == (P.UPDATABLE_COMPONENT | P.REORDERS_INDEXES | P.BACKPROP_ADDS |
                                 P.BACKPROP_NEEDS_INPUT | P.INPUT_CONTIGUOUS |
                                 P.OUTPUT_CONTIGUOUS)
    avail = [Index(n, t, 0) for n in (0, 1) for t in tin]
    outs = [Index(n, t, 0) for n in (0, 1) for t in tout]
    s = Setup(comp, outs, avail)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((len(s.ins), comp.input_dim()))
    y, _ = check_derivatives_ns(s, x)
    for key, row in naive_conv(comp, s, np.where(s.in_mask[:, None], x, 0)).items():
        np.testing.assert_allclose(rows_by_index(s, y)[key], row, rtol=1e-9, atol=1e-12)
    check_properties_ns(s, x)
    check_io_roundtrip(comp)


def test_conv_index_functions():
    comp = component_from_config(
        "TimeHeightConvolutionComponent",
        "num-filters-in=1 num-filters-out=1 height-in=3 height-out=3 height-offsets=-1,0,1 "
        "time-offsets=-1,0,1 required-time-offsets=0")
    assert comp.get_input_indexes(None, Index(2, 5, 0)) == [
        Index(2, 4, 0), Index(2, 5, 0), Index(2, 6, 0)]
    have = {Index(0, 5, 0), Index(0, 6, 0)}
    used: list = []
    assert comp.is_computable(None, Index(0, 5, 0), have.__contains__, used)
    assert used == [Index(0, 5, 0), Index(0, 6, 0)]
    assert not comp.is_computable(None, Index(0, 4, 0), have.__contains__, None)
    ins, outs = comp.reorder_indexes([Index(0, 5, 0), Index(0, 6, 0)], [Index(0, 5, 0)])
    assert outs == [Index(0, 5, 0)]
    assert ins == [Index(0, K_NO_TIME, 0), Index(0, 5, 0), Index(0, 6, 0)]
    pi = comp.precompute_indexes(None, ins, outs, True)
    assert (pi.num_t_in, pi.num_t_out, pi.num_images) == (3, 1, 1)
    with pytest.raises(ComponentError, match="reorder"):
        comp.precompute_indexes(None, [Index(0, 5, 0), Index(0, 6, 0)], outs, True)


def test_conv_init_unit_and_defaults():
    comp = component_from_config(
        "TimeHeightConvolutionComponent",
        "num-filters-in=2 num-filters-out=2 height-in=3 height-out=3 height-offsets=-1,0,1 "
        "time-offsets=0 init-unit=true")
    w = comp.linear_params
    np.testing.assert_array_equal(w[:, 2:4], np.eye(2))
    assert np.count_nonzero(w) == 2
    assert comp.use_natural_gradient and comp.max_memory_mb == 200.0
    assert comp.rank_in == min(80, (w.shape[1] + 2) // 2) and comp.rank_out == 1


# --------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("type_name,cfg,option", [
    ("DistributeComponent", "input-dim=10", "output-dim"),
    ("DistributeComponent", "input-dim=10 output-dim=3", "multiple"),
    ("StatisticsExtractionComponent", "input-period=1", "input-dim"),
    ("StatisticsExtractionComponent", "input-dim=3 input-period=2 output-period=3", "multiple"),
    ("StatisticsExtractionComponent", "input-dim=3 include-variance=maybe", "include-variance"),
    ("StatisticsPoolingComponent", "input-dim=5", "left-context"),
    ("StatisticsPoolingComponent", "input-dim=4 left-context=2 output-stddevs=true", "odd"),
    ("RestrictedAttentionComponent", "key-dim=3 value-dim=3 num-left-inputs=1", "num-right-inputs"),
    ("RestrictedAttentionComponent", "key-dim=3 value-dim=3 num-left-inputs=1 "
     "num-right-inputs=0 num-left-inputs-required=2", "num-left-inputs-required"),
    ("TimeHeightConvolutionComponent", "num-filters-in=1 num-filters-out=1 height-in=3",
     "height-out"),
    ("TimeHeightConvolutionComponent", "num-filters-in=1 num-filters-out=1 height-in=3 "
     "height-out=3 height-offsets=0", "time-offsets"),
    ("TimeHeightConvolutionComponent", "num-filters-in=1 num-filters-out=1 height-in=3 "
     "height-out=3 offsets=0,0;0,x", "offsets"),
    ("TimeHeightConvolutionComponent", "num-filters-in=1 num-filters-out=1 height-in=3 "
     "height-out=3 offsets=0,0 required-time-offsets=1", "required"),
    ("TimeHeightConvolutionComponent", "num-filters-in=1 num-filters-out=1 height-in=3 "
     "height-out=3 offsets=0,0 bogus=1", "bogus"),
])
def test_config_errors(type_name, cfg, option):
    with pytest.raises(ConfigError) as e:
        component_from_config(type_name, cfg)
    assert option in str(e.value) and type_name in str(e.value)


def test_dimension_errors():
    comp = component_from_config("DistributeComponent", "input-dim=6 output-dim=2")
    s = Setup(comp, [Index(0, 0, 0), Index(0, 0, 1)])
    with pytest.raises(DimensionError, match="test"):
        comp.propagate(s.pi, np.zeros((1, 5), np.float32), np.zeros((2, 2), np.float32))
    att = component_from_config("RestrictedAttentionComponent",
                                "key-dim=1 value-dim=1 num-left-inputs=1 num-right-inputs=0")
    s = Setup(att, [Index(0, 1, 0)])
    with pytest.raises(DimensionError):
        att.propagate(s.pi, np.zeros((2, 3), np.float32), np.zeros((1, 3), np.float32))


def test_read_tolerates_repeated_type_token():
    text = b"<DistributeComponent> <DistributeComponent> <InputDim> 4 <OutputDim> 2 " \
           b"</DistributeComponent>"
    comp = read_component(KaldiReader(text, binary=False))
    assert (comp.input_dim(), comp.output_dim()) == (4, 2)


# --------------------------------------------------------------------------------------
# Kaldi's own text, from the network reference models


_TYPES = ("TimeHeightConvolutionComponent|RestrictedAttentionComponent|"
          "StatisticsExtractionComponent|StatisticsPoolingComponent|DistributeComponent")


def _kaldi_component_texts():
    ref = shared_ref()
    if ref is None:
        return []
    out = []
    for f in sorted((ref / "networks").glob("case*/model.txt")):
        data = f.read_bytes()
        for m in re.finditer(rb"<ComponentName> (\S+) (<(" + _TYPES.encode() + rb")>.*?</\3> )",
                             data, re.S):
            out.append(pytest.param(m.group(2), id=f"{f.parent.name}-{m.group(1).decode()}"))
    return out


@pytest.mark.conformance
@pytest.mark.skipif(shared_ref() is None, reason="../shared/kaldi-ref not present")
@pytest.mark.parametrize("text", _kaldi_component_texts())
def test_kaldi_text_byte_identical(text):
    comp = read_component(KaldiReader(text, binary=False))
    check_io_roundtrip(comp, text)


# --------------------------------------------------------------------------------------
# whole networks from Kaldi (compiler + executor): outputs and input derivatives


_NET_TYPES = re.compile(r"<(TimeHeightConvolution|RestrictedAttention|StatisticsExtraction|"
                        r"StatisticsPooling|Distribute)Component>")
_LOCAL_NETS = Path(__file__).resolve().parents[1] / "data" / "components_nonsimple" / "networks"


def _network_cases():
    cases = {p.name: p for p in sorted(_LOCAL_NETS.iterdir())} if _LOCAL_NETS.is_dir() else {}
    ref = shared_ref()
    if ref is not None:
        for d in sorted((ref / "networks").glob("case*")):
            if (d / "model.txt").exists() and _NET_TYPES.search((d / "model.txt").read_text()):
                cases.setdefault(d.name, d)
    return [pytest.param(p, id=name) for name, p in sorted(cases.items())]


def _close(what, ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, what
    tol = 1e-4 + 2e-3 * float(np.max(np.abs(ref)))
    err = float(np.max(np.abs(ours - ref)))
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("case", _network_cases())
def test_kaldi_network(case):
    import json  # noqa: PLC0415

    from engine.compiler.compiler import compile_computation  # noqa: PLC0415
    from engine.compiler.request import ComputationRequest  # noqa: PLC0415
    from engine.nnet.model_io import load_nnet  # noqa: PLC0415
    from engine.runtime.executor import Executor  # noqa: PLC0415

    nnet = load_nnet(str(case / "model.txt"))
    rj = json.loads((case / "request.json").read_text())
    ex = Executor(compile_computation(nnet, ComputationRequest.from_json(rj)), nnet)
    arr = np.load(case / "arrays.npz")
    for io in rj["inputs"]:
        ex.accept_input(io["name"], arr["input." + io["name"]])
    ex.run()
    for io in rj["outputs"]:
        _close(f"{case.name} output {io['name']}", ex.get_output(io["name"]),
               arr["output." + io["name"]])
    with_deriv = [io for io in rj["outputs"] if io.get("has_deriv")]
    if not with_deriv:
        return
    for io in with_deriv:
        ex.accept_output_deriv(io["name"], arr["output_deriv." + io["name"]])
    ex.run()
    for io in rj["inputs"]:
        if io.get("has_deriv"):
            _close(f"{case.name} input_deriv {io['name']}", ex.get_input_deriv(io["name"]),
                   arr["input_deriv." + io["name"]])


def test_add_row_ranges_without_padding_gives_the_padded_bits():
    """_nonsimple_utils.add_row_ranges (statistics extraction and pooling) skips the
    padded copy of its input when every bound but the last is a row and the last is at
    most the end; the sums are the very bits of the padded form, for ranges that end at
    the end, empty ones (also at the end), overlapping and unordered ones."""
    from engine.nnet.components._nonsimple_utils import add_row_ranges  # noqa: PLC0415
    rng = np.random.default_rng(8)
    src = rng.standard_normal((37, 5)).astype(np.float32)
    padded = np.concatenate([src, np.zeros((1, 5), np.float32)])
    cases = [([0, 10, 20], [10, 20, 37]),          # windows to the end (no padding)
             ([0, 5, 30], [10, 37, 37]),           # overlapping, the last at the end
             ([3, 9, 36], [9, 3, 37]),             # an empty (begin > end) one
             ([0, 12, 37], [12, 20, 37]),          # an empty range at the end (padded)
             ([20, 0, 7], [25, 37, 30])]           # unordered; one ends at the end mid-list
    for begins, ends in cases:
        b, e = np.array(begins), np.array(ends)
        got = np.zeros((len(b), 5), np.float32)
        add_row_ranges(src, b, e, got)
        bounds = np.empty(2 * len(b), np.int64)
        bounds[0::2], bounds[1::2] = b, e
        want = np.add.reduceat(padded, bounds, axis=0)[0::2]
        want[b >= e] = 0
        assert np.array_equal(got, want), (begins, ends)
        exact = np.stack([src[i:j].astype(np.float64).sum(axis=0) if i < j else np.zeros(5)
                          for i, j in zip(b, e)])
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
