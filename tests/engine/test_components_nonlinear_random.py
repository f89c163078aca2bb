"""Random components (dropout family, SpecAugment time mask) and gradient controls
(ClipGradient, BackpropTruncation): test mode through the shared checks, training mode
seeded and reproducible, the non-simple index functions on hand-made Index sets, and
config errors."""

from __future__ import annotations

import numpy as np
import pytest

from component_harness import (
    check_derivatives,
    check_io_roundtrip,
    check_properties,
    component_from_config,
    run_backward,
    run_forward,
)
from engine.core.errors import ComponentError, ConfigError
from engine.core.index import Index
from engine.nnet.components.base import ComponentPrecomputedIndexes, ComponentProperty as P

TEST_MODE_CONFIGS = [
    ("DropoutComponent", "dim=6 dropout-proportion=0.3 test-mode=true"),
    ("DropoutComponent", "dim=4 dropout-proportion=0.5 dropout-per-frame=true test-mode=true"),
    ("GeneralDropoutComponent", "dim=8 block-dim=4 test-mode=true"),
    ("GeneralDropoutComponent", "dim=5 dropout-proportion=0.0"),
    ("SpecAugmentTimeMaskComponent", "dim=7 zeroed-proportion=0.0"),
    ("ClipGradientComponent", "dim=5 clipping-threshold=1e6"),
    ("ClipGradientComponent", "dim=3 clipping-threshold=1e6 norm-based-clipping=true"),
    ("NoOpComponent", "dim=4 backprop-scale=1.0"),
]


@pytest.mark.parametrize("cfg", TEST_MODE_CONFIGS, ids=lambda c: f"{c[0]}:{c[1][:30]}")
def test_deterministic_configs(cfg):
    comp = component_from_config(*cfg)
    check_properties(comp)
    check_derivatives(comp, num_rows=6)
    check_io_roundtrip(comp)


def test_io_roundtrip_train_mode_variants():
    for type_name, text in [
        ("DropoutComponent", "dim=6 dropout-proportion=0.3"),
        ("DropoutMaskComponent", "output-dim=2 dropout-proportion=0.2 continuous=true"),
        ("DropoutMaskComponent", "output-dim=3"),
        ("GeneralDropoutComponent", "dim=8 block-dim=2 time-period=5 continuous=true"),
        ("GeneralDropoutComponent",
         "dim=10 specaugment-max-proportion=0.3 specaugment-max-regions=2"),
        ("SpecAugmentTimeMaskComponent", "dim=4 zeroed-proportion=0.2 time-mask-max-frames=5"),
        ("BackpropTruncationComponent", "dim=4 scale=0.9 zeroing-interval=4"),
        ("ClipGradientComponent", "dim=3 norm-based-clipping=true self-repair-scale=0.5"),
    ]:
        check_io_roundtrip(component_from_config(type_name, text))


@pytest.mark.parametrize("type_name,text,option", [
    ("DropoutComponent", "dim=4", "dropout-proportion"),
    ("DropoutComponent", "dim=4 dropout-proportion=1.5", "dropout-proportion"),
    ("DropoutMaskComponent", "dropout-proportion=0.5", "output-dim"),
    ("GeneralDropoutComponent", "dim=6 block-dim=4", "block-dim"),
    ("GeneralDropoutComponent", "dim=6 specaugment-max-proportion=0.5 continuous=true",
     "specaugment-max-proportion"),
    ("SpecAugmentTimeMaskComponent", "dim=6 time-mask-max-frames=1", "time-mask-max-frames"),
    ("ClipGradientComponent", "dim=3 clipping-threshold=-1", "clipping-threshold"),
    ("BackpropTruncationComponent", "dim=3 zeroing-interval=0", "zeroing-interval"),
    ("BackpropTruncationComponent", "scale=0.5", "dim"),
])
def test_config_errors_name_option(type_name, text, option):
    with pytest.raises(ConfigError) as e:
        component_from_config(type_name, text)
    assert option in str(e.value)


# -- dropout ------------------------------------------------------------------------


def test_dropout_train_mode_seeded():
    comp = component_from_config("DropoutComponent", "dim=50 dropout-proportion=0.3")
    assert comp.properties() & P.RANDOM_COMPONENT
    x = np.random.default_rng(0).standard_normal((40, 50)).astype(np.float32)
    comp.reset_generator(7)
    y1, _ = run_forward(comp, x)
    comp.reset_generator(7)
    y2, _ = run_forward(comp, x)
    np.testing.assert_array_equal(y1, y2)
    kept = y1 != 0
    assert np.all(y1[kept] == x[kept])
    assert 0.2 < 1 - kept.mean() < 0.4
    dy = np.ones_like(y1)
    dx = run_backward(comp, x, y1, dy, None)
    np.testing.assert_array_equal(dx, kept.astype(np.float32))
    comp.set_test_mode(True)
    y3, _ = run_forward(comp, x)
    np.testing.assert_allclose(y3, 0.7 * x, rtol=1e-6)
    per_frame = component_from_config("DropoutComponent",
                                      "dim=5 dropout-proportion=0.5 dropout-per-frame=true")
    y, _ = run_forward(per_frame, np.ones((30, 5), dtype=np.float32))
    assert np.all((y == 0).all(axis=1) | (y == 1).all(axis=1))


def test_dropout_mask_component():
    comp = component_from_config("DropoutMaskComponent", "output-dim=2 dropout-proportion=0.4")
    assert comp.get_input_indexes(None, Index(0, 3, 0)) == []
    used = [Index()]
    assert comp.is_computable(None, Index(0, 3, 0), lambda i: False, used) and used == []
    out = np.zeros((200, 2), dtype=np.float32)
    comp.propagate(None, np.zeros((0, 2), dtype=np.float32), out)
    assert set(np.unique(out)) <= {0.0, 1.0}
    assert not np.any((out[:, 0] == 0) & (out[:, 1] == 0))  # never both dropped
    comp.set_test_mode(True)
    comp.propagate(None, None, out)
    np.testing.assert_allclose(out, 0.6)
    cont = component_from_config("DropoutMaskComponent",
                                 "output-dim=4 dropout-proportion=0.5 continuous=true")
    out = np.zeros((100, 4), dtype=np.float32)
    cont.propagate(None, None, out)
    assert out.min() >= 0.0 and out.max() <= 2.0 and abs(out.mean() - 1.0) < 0.1


def _seq_indexes(num_n: int, num_t: int) -> list[Index]:
    # Kaldi's usual order: t major, n minor
    return [Index(n, t, 0) for t in range(num_t) for n in range(num_n)]


def test_general_dropout_index_map_and_shared_masks():
    comp = component_from_config("GeneralDropoutComponent",
                                 "dim=6 block-dim=3 time-period=2 dropout-proportion=0.5")
    assert not comp.properties() & P.SIMPLE_COMPONENT
    idx = _seq_indexes(2, 4)  # (n,t): (0,0),(1,0),(0,1),(1,1),(0,2),...
    pre = comp.precompute_indexes(None, idx, idx, True)
    assert isinstance(pre, ComponentPrecomputedIndexes)
    # mask rows by first appearance of (n, t // 2); each row's 2 blocks share one row
    assert pre.num_mask_rows == 4 * 2
    np.testing.assert_array_equal(pre.indexes, np.repeat([0, 1, 0, 1, 2, 3, 2, 3], 2))
    back = type(pre).from_data(pre.to_data())
    np.testing.assert_array_equal(back.indexes, pre.indexes)
    x = np.random.default_rng(1).standard_normal((8, 6)).astype(np.float32) + 5
    out = np.zeros_like(x)
    comp.reset_generator(3)
    memo = comp.propagate(pre, x, out)
    scale = out / x
    assert set(np.round(np.unique(scale), 5)) <= {0.0, 2.0}
    np.testing.assert_array_equal(scale[:, :3], scale[:, 3:])  # block-dim repeat
    np.testing.assert_array_equal(scale[0], scale[2])  # same n, same time block
    dx = np.zeros_like(x)
    comp.backprop("", pre, x, out, np.ones_like(x), memo, None, dx)
    np.testing.assert_allclose(dx, scale, rtol=1e-5)
    with pytest.raises(Exception):
        comp.precompute_indexes(None, idx, idx[::-1], True)


def test_general_dropout_specaugment_bands():
    comp = component_from_config("GeneralDropoutComponent",
                                 "dim=20 specaugment-max-proportion=0.5 "
                                 "specaugment-max-regions=3")
    idx = _seq_indexes(30, 2)
    pre = comp.precompute_indexes(None, idx, idx, False)
    out = np.zeros((60, 20), dtype=np.float32)
    mask = comp.propagate(pre, np.ones((60, 20), dtype=np.float32), out)
    assert mask.shape == (30, 20)
    zeroed = (mask == 0).sum(axis=1)
    assert zeroed.max() <= 10 and zeroed.max() > 0
    assert set(np.unique(mask)) <= {0.0, 1.0}


def test_specaugment_time_mask():
    comp = component_from_config("SpecAugmentTimeMaskComponent",
                                 "dim=3 zeroed-proportion=0.3 time-mask-max-frames=4")
    idx = [Index(n, t, 0) for t in range(40) for n in (5, 2)]
    pre = comp.precompute_indexes(None, idx, idx, True)
    np.testing.assert_array_equal(pre.seq_starts, [0, 40, 80])
    # sequence n=2 first (sorted by n), rows in time order
    np.testing.assert_array_equal(pre.rows[:3], [1, 3, 5])
    # on (k, 3) rows, as the compiler hands them over: the same; refusals as Kaldi's
    rows = np.array(idx, dtype=np.int64)
    by_rows = comp.precompute_index_arrays(None, rows, rows.copy(), True)
    assert vars(by_rows).keys() == vars(pre).keys()
    for k, v in vars(pre).items():
        np.testing.assert_array_equal(getattr(by_rows, k), v)
    with pytest.raises(ComponentError, match="identical"):
        comp.precompute_index_arrays(None, rows, rows[::-1].copy(), True)
    with pytest.raises(ComponentError, match="identical"):
        comp.precompute_indexes(None, idx, idx[:-1], True)
    with pytest.raises(ComponentError, match="no indexes"):
        comp.precompute_indexes(None, [], [], True)
    x = np.ones((80, 3), dtype=np.float32)
    out = x.copy()
    comp.reset_generator(0)
    mask = comp.propagate(pre, out, out)  # in place
    assert set(np.unique(mask)) <= {0.0, 1.0} and 0 < mask.mean() < 1
    np.testing.assert_array_equal(out, mask[:, None] * x)
    # zeroed runs never longer than time-mask-max-frames within a sequence
    seq = mask[pre.rows[:40]]
    run, longest = 0, 0
    for v in seq:
        run = run + 1 if v == 0 else 0
        longest = max(longest, run)
    assert longest <= 4
    dx = np.ones_like(x)
    comp.backprop("", pre, None, None, dx, mask, None, dx)
    np.testing.assert_array_equal(dx, out)
    comp.set_test_mode(True)
    y, memo = run_forward(comp, x)
    assert memo is None and np.all(y == x)


# -- gradient controls --------------------------------------------------------------


def test_clip_gradient_elementwise_and_norm_based():
    comp = component_from_config("ClipGradientComponent", "dim=2 clipping-threshold=1")
    dy = np.array([[3.0, -0.5], [-2.0, 0.25]], dtype=np.float32)
    x = np.ones_like(dy)
    upd = comp.copy()
    dx = run_backward(comp, x, x, dy, None, upd)
    np.testing.assert_allclose(dx, [[1.0, -0.5], [-1.0, 0.25]])
    assert upd.num_backpropped == 1
    nb = component_from_config("ClipGradientComponent",
                               "dim=2 clipping-threshold=1 norm-based-clipping=true "
                               "self-repair-scale=0")
    upd = nb.copy()
    dy = np.array([[3.0, 4.0], [0.3, 0.4]], dtype=np.float32)
    dx = run_backward(nb, x, x, dy, None, upd)
    np.testing.assert_allclose(dx, [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)
    assert upd.num_clipped == 1 and upd.count == 2
    zero = component_from_config("ClipGradientComponent", "dim=2 clipping-threshold=0")
    assert np.all(run_backward(zero, x, x, dy, None) == 0)


def test_backprop_truncation_zeroing_pattern_and_backprop():
    comp = component_from_config("BackpropTruncationComponent",
                                 "dim=2 clipping-threshold=5 zeroing-threshold=1 "
                                 "zeroing-interval=3 recurrence-interval=1 scale=0.5")
    assert comp.properties() == P.PROPAGATE_IN_PLACE | P.BACKPROP_IN_PLACE
    idx = [Index(n, t, 0) for t in range(6) for n in range(2)]
    pre = comp.precompute_indexes(None, idx, idx, True)
    # row crosses a boundary when floor((t-n)/3) != floor((t-1-n)/3)
    expected = [-1.0 if (t - n) % 3 == 0 else 0.0 for t in range(6) for n in range(2)]
    np.testing.assert_array_equal(pre.zeroing, expected)
    assert pre.zeroing_sum == 4.0
    x = np.ones((12, 2), dtype=np.float32)
    y = np.zeros_like(x)
    comp.propagate(pre, x, y)
    np.testing.assert_allclose(y, 0.5)
    dy = np.zeros((12, 2), dtype=np.float32)
    dy[:, 0] = 4.0      # scaled norm 2 > zeroing-threshold 1, below clipping 5
    dy[1, 0] = 40.0     # scaled norm 20 > clipping-threshold 5
    upd = comp.copy()
    dx = np.zeros_like(dy)
    comp.backprop("", pre, None, None, dy, None, upd, dx)
    zeroed = np.array(expected) == -1
    assert np.all(dx[zeroed] == 0)
    np.testing.assert_allclose(dx[~zeroed, 0][1:], 2.0)
    np.testing.assert_allclose(dx[2, 0], 2.0)
    assert upd.count == 12 and upd.num_clipped == 1 and upd.num_zeroed == 4
    assert upd.count_zeroing_boundaries == 4
    # n=0,t=0 ... row 1 is (n=1, t=0): not a zeroing row, clipped to norm 5
    assert not zeroed[1]
    np.testing.assert_allclose(dx[1], [5.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("interval,recurrence", [(3, 1), (20, 3), (4, 7)])
def test_backprop_truncation_index_arrays_equal_index_lists(interval, recurrence):
    """precompute_index_arrays (what the compiler calls) gives what precompute_indexes
    gives: the same zeroing pattern and sum, for the few-row form (one step of a
    recurrence) and the array form, with negative times and n, and nothing zeroed
    (-0.0, as the negated float32 sum)."""
    comp = component_from_config("BackpropTruncationComponent",
                                 f"dim=2 zeroing-interval={interval} "
                                 f"recurrence-interval={recurrence}")
    rng = np.random.default_rng(7)
    cases = [[(0, 5, 0)], [(1, 4, 0)], [(n, t, 0) for n in range(-2, 3) for t in (-7, 0, 9)]]
    cases += [[tuple(r) for r in rng.integers(-40, 40, size=(k, 3)).tolist()]
              for k in (1, 2, 16, 17, 64)]
    for rows in cases:
        idx = [Index(*r) for r in rows]
        want = comp.precompute_indexes(None, idx, idx, True)
        got = comp.precompute_index_arrays(None, np.array(rows, dtype=np.int64).reshape(-1, 3),
                                           np.array(rows, dtype=np.int64).reshape(-1, 3), True)
        assert got.zeroing.dtype == want.zeroing.dtype == np.float32
        np.testing.assert_array_equal(got.zeroing, want.zeroing)
        assert repr(got.zeroing_sum) == repr(want.zeroing_sum)
    quiet = component_from_config("BackpropTruncationComponent",
                                  "dim=2 zeroing-interval=100 recurrence-interval=1")
    one = np.array([[0, 5, 0]], dtype=np.int64)
    assert repr(quiet.precompute_index_arrays(None, one, one, True).zeroing_sum) == "-0.0"
    with pytest.raises(Exception, match="must be equal"):
        comp.precompute_index_arrays(None, one, np.zeros((0, 3), dtype=np.int64), True)


@pytest.mark.parametrize("cfg", ["dim=8 block-dim=2 time-period=5", "dim=6 block-dim=3",
                                 "dim=4 time-period=1"])
def test_general_dropout_index_arrays_equal_index_lists(cfg):
    """GeneralDropoutComponent.precompute_index_arrays (what the compiler calls) gives
    the mask rows precompute_indexes gives (rows numbered by first appearance of each
    (n, t-block) pair), for repeated and unordered pairs and very wide ranges."""
    comp = component_from_config("GeneralDropoutComponent", cfg)
    rng = np.random.default_rng(11)
    cases = [[(0, 3, 0)], [(1, t, 0) for t in range(-7, 9)] + [(0, t, 0) for t in range(4)]]
    cases += [[tuple(r) for r in rng.integers(-30, 30, size=(k, 3)).tolist()]
              for k in (2, 9, 40)]
    cases += [[(0, -2 ** 31, 0), (5, 2 ** 31 - 1, 0), (0, -2 ** 31, 0), (2 ** 31 - 1, 0, 1)]]
    for rows in cases:
        idx = [Index(*r) for r in rows]
        arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
        want = comp.precompute_indexes(None, idx, idx, True)
        got = comp.precompute_index_arrays(None, arr, arr.copy(), True)
        assert got.to_data() == want.to_data()
    one = np.array([[0, 1, 0]], dtype=np.int64)
    with pytest.raises(Exception, match="identical"):
        comp.precompute_index_arrays(None, one, one + 1, True)
    with pytest.raises(Exception, match="identical"):
        comp.precompute_index_arrays(None, one, np.zeros((0, 3), dtype=np.int64), True)


@pytest.mark.parametrize("cfg", ["dim=8 block-dim=2 time-period=5", "dim=6 block-dim=3",
                                 "dim=4 time-period=1", "dim=4 time-period=3"])
def test_general_dropout_mask_rows_in_python_equal_the_array_path(cfg, monkeypatch):
    """_mask_rows numbers up to _FEW_ROWS rows in Python and more with arrays: both
    give the same mask rows (numbered by first appearance of each (n, t-block)
    pair, negative times floored to their block), checked by running each case both
    ways; also the empty case and rows past the threshold."""
    from engine.nnet.components import dropout  # noqa: PLC0415
    comp = component_from_config("GeneralDropoutComponent", cfg)
    rng = np.random.default_rng(5)
    few = dropout._FEW_ROWS
    cases = [np.zeros((0, 3), dtype=np.int64)]
    cases += [rng.integers(lo, hi, size=(k, 3)) for k, lo, hi in
              ((1, -5, 5), (7, -9, 9), (40, -30, 30), (few, -50, 3), (few + 1, -4, 60),
               (3 * few, -200, 200))]
    for arr in cases:
        arr = arr.astype(np.int64)
        got = []
        for limit in (few, 0):
            monkeypatch.setattr(dropout, "_FEW_ROWS", limit)
            got.append(comp.precompute_index_arrays(None, arr, arr.copy(), True).to_data())
        assert got[0] == got[1], arr.tolist()[:5]
