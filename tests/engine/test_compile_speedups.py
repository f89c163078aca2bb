"""Helpers the compiler uses for speed give exactly what the plain code gives:
engine.compiler.array_ops (column-wise reductions), graph_nodes.make_indexes
(shared Index objects, blank Indexes included), PrecomputedIndexesInfo.index_rows
(arrays kept by the compiler, dropped when the lists are replaced) and the
shortcut expander's reuse of expansions of rows that differ by a shift in t."""

from __future__ import annotations

import numpy as np

from engine.compiler.array_ops import (column_bounds, rows_all, rows_any, rows_count,
                                       rows_equal)
from engine.compiler.computation import PrecomputedIndexesInfo
from engine.compiler.graph_nodes import make_indexes
from engine.compiler.shortcut import _Expander, convert_num_n_values, find_n_stride
from engine.core.index import K_NO_TIME, Index, index_rows


def test_array_ops_match_numpy():
    rng = np.random.default_rng(0)
    for width in (0, 1, 2, 3, 5, 8, 9, 12):
        for rows in (1, 7, 300):
            a = rng.integers(-5, 5, (rows, width))
            b = rng.integers(-5, 5, (rows, width))
            m = a > 0
            if width:
                lo, hi = column_bounds(a)
                assert lo == a.min(axis=0).tolist() and hi == a.max(axis=0).tolist()
            assert np.array_equal(rows_all(m), m.all(axis=1))
            assert np.array_equal(rows_any(m), m.any(axis=1))
            assert np.array_equal(rows_count(m), m.sum(axis=1))
            assert np.array_equal(rows_equal(a, b), (a == b).all(axis=1))
            b[::2] = a[::2]
            assert np.array_equal(rows_equal(a, b), (a == b).all(axis=1))
            if width:
                assert np.array_equal(rows_equal(a, a[0]), (a == a[0]).all(axis=1))


def test_make_indexes_values_types_and_sharing():
    rng = np.random.default_rng(1)
    for trial in range(200):
        k = int(rng.integers(0, 400))
        a = np.stack([rng.integers(0, 3, k), rng.integers(-5, 20, k),
                      rng.integers(0, 2, k)], axis=1).astype(np.int64)
        if k and trial % 3:
            a[rng.random(k) < 0.2, 1] = K_NO_TIME
        if k and trial % 11 == 0:
            a[:, 1] = K_NO_TIME
        got = make_indexes(a)
        assert got == [tuple(r) for r in a.tolist()]
        assert all(type(i) is Index for i in got)
        if k >= 64:
            # equal Indexes are one object
            assert len({id(i) for i in got}) == len(set(got))


def test_precomputed_info_index_rows_follow_the_lists():
    ins = [Index(0, t, 0) for t in range(5)]
    outs = [Index(0, t, 0) for t in range(1, 4)]
    info = PrecomputedIndexesInfo(None, ins, outs)
    a, b = info.index_rows()                      # nothing kept: converted
    assert a.tolist() == [list(i) for i in ins] and b.tolist() == [list(i) for i in outs]
    kept_in, kept_out = index_rows(ins), index_rows(outs)
    info.remember_index_rows(kept_in, kept_out)
    a, b = info.index_rows()
    assert a is kept_in and b is kept_out
    # lists replaced (or grown in place): the kept arrays no longer count
    info.input_indexes = [Index(1, t, 0) for t in range(5)]
    a, b = info.index_rows()
    assert a is not kept_in and a[:, 0].tolist() == [1] * 5 and b is not kept_out
    info.remember_index_rows(index_rows(info.input_indexes), kept_out)
    info.output_indexes.append(Index(0, 9, 0))
    a, b = info.index_rows()
    assert b.tolist()[-1] == [0, 9, 0]


def test_shortcut_expansion_of_t_shifted_rows():
    """Rows that differ by one shift of every t share one expansion; the result is
    what find_n_stride + convert_num_n_values give for each."""
    exp = _Expander(None, None, None, 5, False)
    rng = np.random.default_rng(2)
    for trial in range(60):
        per = int(rng.integers(1, 5))
        ts = np.sort(rng.choice(np.arange(-6, 6), size=per, replace=False))
        x = rng.integers(0, 2, per)
        base = np.stack([np.zeros(per, np.int64), ts, x], axis=1)
        if trial % 2:
            rows = np.concatenate([base, base + [1, 0, 0]])          # stride = per
        else:
            rows = np.repeat(base, 2, axis=0)
            rows[1::2, 0] = 1                                        # stride 1
        for shift in (0, 3, -7):
            r = rows + [0, shift, 0]
            if trial % 5 == 0:
                r[0, 1] = K_NO_TIME if shift == 3 else r[0, 1]
            s = find_n_stride(r)
            if s == 0:
                continue
            want = convert_num_n_values(r, s, 2, 5)
            key, got = exp.expand_index_rows(r.copy())
            assert key == r.tobytes()
            assert np.array_equal(got, want), (trial, shift)
    assert exp._expanded_rel


def test_general_dropout_mask_rows_number_pairs_by_first_appearance():
    """GeneralDropoutComponent's mask rows (the table path for compact ranges and the
    sorting path for wide ones) against a plain Python numbering of (n, t-block)
    pairs by first appearance."""
    from component_harness import component_from_config
    rng = np.random.default_rng(5)
    for cfg, period in (("dim=8 block-dim=2 time-period=5", 5), ("dim=6 block-dim=3", 0),
                        ("dim=4 time-period=1", 1)):
        comp = component_from_config("GeneralDropoutComponent", cfg)
        multiple = comp.dim // comp.block_dim
        for k in (1, 2, 9, 40, 300, 2000):
            wide = k == 9
            hi = 2 ** 40 if wide else 30
            arr = np.stack([rng.integers(0, 4, k), rng.integers(-hi, hi, k),
                            np.zeros(k, np.int64)], axis=1).astype(np.int64)
            seen: dict = {}
            want = [seen.setdefault((n, t // period if period else 0), len(seen))
                    for n, t, _ in arr.tolist()]
            got = comp.precompute_index_arrays(None, arr, arr.copy(), True)
            assert got.num_mask_rows == len(seen) * multiple
            assert np.asarray(got.indexes).tolist() == np.repeat(want, multiple).tolist()
