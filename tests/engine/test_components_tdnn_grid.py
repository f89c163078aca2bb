"""TdnnComponent's shortcut for rows already on the grid (engine/nnet/components/tdnn.py:
_full_grid, _grid_unchanged): reorder_index_arrays and precompute_index_arrays give
exactly what the general path (tdnn_time_grid + tdnn_index_rows_for_grid, the order
check) gives, for complete grids, grids with holes, subsampled outputs, several
sequences and x values, and rows out of order."""

from __future__ import annotations

import numpy as np
import pytest
from component_harness import component_from_config

from engine.core.errors import ComponentError
from engine.core.index import K_NO_TIME
from engine.nnet.components.tdnn import (_full_grid, _grid_unchanged, tdnn_index_rows_for_grid,
                                         tdnn_time_grid)


def _tdnn(offsets: str):
    return component_from_config("TdnnComponent",
                                 f"input-dim=2 output-dim=3 time-offsets={offsets}")


def _general(ins: np.ndarray, outs: np.ndarray):
    g = tdnn_time_grid(ins, outs)
    return g, tdnn_index_rows_for_grid(g, ins, outs)


def _grid(ns, xs, ts) -> np.ndarray:
    """Rows t-major, then (n, x) pairs in order: the grid reorder_indexes makes."""
    return np.array([(n, t, x) for t in ts for n in ns for x in xs],
                    dtype=np.int64).reshape(-1, 3)


def _cases(rng):
    for _ in range(300):
        ns = sorted(rng.choice(4, size=int(rng.integers(1, 4)), replace=False).tolist())
        xs = sorted(rng.choice(3, size=int(rng.integers(1, 3)), replace=False).tolist())
        offsets = sorted(rng.choice(np.arange(-3, 4), size=int(rng.integers(1, 4)),
                                    replace=False).tolist())
        step_out = int(rng.choice([1, 1, 1, 2, 3]))
        t0 = int(rng.integers(-5, 5))
        touts = [t0 + step_out * k for k in range(int(rng.integers(1, 7)))]
        tins = sorted({t + o for t in touts for o in offsets})
        ins, outs = _grid(ns, xs, tins), _grid(ns, xs, touts)
        yield offsets, ins, outs
        # the same with a row dropped, two rows swapped, or the rows sorted differently
        kind = int(rng.integers(0, 4))
        if kind == 0 and len(ins) > 1:
            yield offsets, np.delete(ins, int(rng.integers(0, len(ins))), axis=0), outs
        elif kind == 1 and len(outs) > 1:
            i = int(rng.integers(0, len(outs) - 1))
            swapped = outs.copy()
            swapped[[i, i + 1]] = swapped[[i + 1, i]]
            yield offsets, ins, swapped
        elif kind == 2:
            order = np.lexsort((ins[:, 1], ins[:, 2], ins[:, 0]))
            yield offsets, ins[order], outs
        else:
            blank = outs.copy()
            blank[int(rng.integers(0, len(blank))), 1] = K_NO_TIME
            yield offsets, ins, blank


def test_tdnn_grid_shortcut_matches_general_path():
    rng = np.random.default_rng(7)
    hits = 0
    checked = 0
    for offsets, ins, outs in _cases(rng):
        c = _tdnn(",".join(map(str, offsets)))
        try:
            g, (want_in, want_out) = _general(ins, outs)
        except ComponentError:
            with pytest.raises(ComponentError):
                c.reorder_index_arrays(ins, outs)
            continue
        fast = _grid_unchanged(ins, outs)
        if fast is not None:
            hits += 1
            # the shortcut only fires where nothing moves, and knows the same grid
            assert fast == g
            assert np.array_equal(want_in, ins) and np.array_equal(want_out, outs)
        got_in, got_out = c.reorder_index_arrays(ins, outs)
        assert np.array_equal(got_in, want_in) and np.array_equal(got_out, want_out)
        if fast is not None:
            # given back as the same objects: the steps computer relies on this
            assert got_in is ins and got_out is outs
        # precomputed indexes: the general path on the reordered rows
        try:
            general = c._precomputed_for_grid(c._checked_grid(want_in, want_out))
        except ComponentError:
            continue
        pre = c.precompute_index_arrays(None, want_in, want_out, True)
        assert pre.row_stride == general.row_stride
        assert pre.row_offsets.tolist() == general.row_offsets.tolist()
        checked += 1
    assert hits > 100 and checked > 200


def test_full_grid_rejects_what_is_not_a_complete_grid():
    rows = _grid([0, 1], [0], range(3, 8))
    assert _full_grid(rows) == (3, 1, 5)
    assert _full_grid(rows[:-1]) is None                 # a row missing
    assert _full_grid(rows[::-1].copy()) is None         # t falling
    swapped = rows.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert _full_grid(swapped) is None                   # pairs out of order
    blank = rows.copy()
    blank[0, 1] = K_NO_TIME
    assert _full_grid(blank) is None
    assert _full_grid(_grid([0], [0], [4])) == (4, 0, 1)
    assert _full_grid(np.zeros((0, 3), dtype=np.int64)) is None
    assert _full_grid(_grid([0], [0], [1, 4, 7])) == (1, 3, 3)
    assert _full_grid(_grid([0, 2], [0, 1], [1, 10, 19])) == (1, 9, 3)   # a step of 8 or more
    uneven = _grid([0], [0], [1, 10, 20])
    assert _full_grid(uneven) is None                    # steps differ
    shifted_x = _grid([0, 1], [0], range(3, 8))
    shifted_x[-1, 2] = 1
    assert _full_grid(shifted_x) is None                 # a pair changes from block to block


def test_grid_memo_answers_by_content_and_stays_bounded():
    """_grid_unchanged remembers its answers by the rows' bytes (a compile asks for each
    layer's rows twice, on different arrays): a strided view and a copy of the same rows
    get the same grid, other rows their own, and the memo never grows past its size."""
    from engine.nnet.components import tdnn as T
    rows = np.array([[0, t, 0] for t in range(-3, 12)], dtype=np.int64)
    wide = np.zeros((len(rows), 4), dtype=np.int64)
    wide[:, 1:] = rows
    outs = rows[3:10].copy()
    a = T._grid_unchanged(wide[:, 1:], outs)
    b = T._grid_unchanged(rows.copy(), outs.copy())
    assert a is not None and b is a and a == T._grid_unchanged_of(rows, outs)
    shifted = rows + [0, 1, 0]
    assert T._grid_unchanged(shifted, outs) == T._grid_unchanged_of(shifted, outs) != a
    for k in range(3 * T._GRID_MEMO_SIZE):
        T._grid_unchanged(rows[: 1 + k % len(rows)] + [0, k, 0], outs)
        assert len(T._GRID_MEMO) <= T._GRID_MEMO_SIZE


def test_grid_memo_is_a_request_memo_that_cold_compiles_empty(monkeypatch):
    """The grid memo is keyed by a request's rows, so it is registered with
    engine.core.memo: clear_request_memos() empties it, and the benchmarks' cold
    compile does so before compiling (an equal request compiled before leaves nothing
    it could use)."""
    from bench import common
    from engine.core.memo import clear_request_memos
    from engine.nnet.components import tdnn as T
    rows = np.array([[0, t, 0] for t in range(-3, 12)], dtype=np.int64)
    T._grid_unchanged(rows, rows[3:10].copy())
    assert T._GRID_MEMO
    clear_request_memos()
    assert not T._GRID_MEMO
    T._grid_unchanged(rows, rows[3:10].copy())
    seen = []
    import engine.compiler.shortcut as S
    real = S.compile_request

    def spy(*a, **k):
        seen.append(len(T._GRID_MEMO))
        return real(*a, **k)
    monkeypatch.setattr(S, "compile_request", spy)
    nnet = common.load_for_inference(dict(common.synthetic_models())["cnn-tdnn"])
    common.compile_cold(nnet, common.chunk_request(nnet, 4, 1))
    assert seen == [0]
