"""TimeHeightConvolutionComponent's array hooks (reorder_index_arrays,
precompute_index_arrays) and the computation reorder_index_arrays hands on to
precompute_index_arrays (time_height_conv._COMPILED).

What makes the hand-on sound: compiling the convolution again from the Indexes that
reordering produced (what Kaldi's PrecomputeIndexes does) gives the same computation and
the same Indexes.  Checked here on the configurations of test_components_nonsimple and on
random ones: several sequences and x values, rows in random order, optional inputs
missing, output strides above the input's (frames appended)."""

from __future__ import annotations

import numpy as np
import pytest

from component_harness import component_from_config
from engine.core.errors import ComponentError
from engine.core.index import K_NO_TIME, Index, array_to_indexes
from engine.core.memo import clear_request_memos
from engine.nnet.components import time_height_conv
from engine.nnet.components._convolution import compile_convolution_rows

CONFIGS = [
    # (config, input times, output times, optional inputs may be missing)
    ("num-filters-in=2 num-filters-out=3 height-in=5 height-out=5 height-offsets=-1,0,1 "
     "time-offsets=-1,0,1", range(-1, 8), range(0, 7), False),
    ("num-filters-in=3 num-filters-out=2 height-in=6 height-out=3 height-subsample-out=2 "
     "offsets=0,0;0,1;-2,-1;2,1 required-time-offsets=0 max-memory-mb=1e-5",
     range(-2, 12), range(0, 10), True),
    ("num-filters-in=2 num-filters-out=2 height-in=4 height-out=4 height-offsets=-1,0,1 "
     "time-offsets=-1,0,1 required-time-offsets=0", range(-3, 14), range(0, 12, 3), True),
    ("num-filters-in=1 num-filters-out=4 height-in=3 height-out=2 height-offsets=0,1 "
     "time-offsets=-2,0,2 required-time-offsets=0", range(0, 10, 2), range(0, 10, 2), True),
]


def _case(seed: int):
    """(component, input rows, output rows) in random row order."""
    rng = np.random.default_rng(seed)
    cfg, tin, tout, optional = CONFIGS[seed % len(CONFIGS)]
    comp = component_from_config("TimeHeightConvolutionComponent", cfg, seed=seed)
    ns = rng.choice(8, size=int(rng.integers(1, 4)), replace=False)
    xs = rng.choice(3, size=int(rng.integers(1, 3)), replace=False)
    outs = [(n, t, x) for n in ns for x in xs for t in tout]
    # the inputs the outputs use (more time context than that Kaldi refuses), some of the
    # optional ones missing
    used = {t + dt for t in tout for dt in comp.model.all_time_offsets}
    ins = [(n, t, x) for n in ns for x in xs for t in tin
           if t in used and not (optional and t not in tout and rng.random() < 0.3)]
    ins = np.array(ins, dtype=np.int64)[rng.permutation(len(ins))]
    outs = np.array(outs, dtype=np.int64)[rng.permutation(len(outs))]
    return comp, ins, outs


def _fields(p) -> dict:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in vars(p).items()}


@pytest.mark.parametrize("seed", range(40))
def test_compiling_the_reordered_rows_again_gives_the_same(seed):
    comp, ins, outs = _case(seed)
    cc, new_in, new_out = compile_convolution_rows(comp.model, ins, outs, comp.max_memory_mb)
    cc2, again_in, again_out = compile_convolution_rows(comp.model, new_in, new_out,
                                                        comp.max_memory_mb)
    assert cc2 == cc
    np.testing.assert_array_equal(again_in, new_in)
    np.testing.assert_array_equal(again_out, new_out)
    # the padding rows are blank, and every row given is among the new ones
    assert set(map(tuple, ins.tolist())) <= set(map(tuple, new_in.tolist()))
    assert set(map(tuple, outs.tolist())) <= set(map(tuple, new_out.tolist()))
    assert all(r[1] == K_NO_TIME for r in new_in.tolist() if tuple(r) not in
               set(map(tuple, ins.tolist())))


@pytest.mark.parametrize("seed", range(40))
def test_precompute_after_reorder_equals_a_fresh_compile(seed):
    comp, ins, outs = _case(seed)
    clear_request_memos()
    new_in, new_out = comp.reorder_index_arrays(ins, outs)
    handed_on = comp.precompute_index_arrays(None, new_in, new_out, True)
    clear_request_memos()
    fresh = comp.precompute_index_arrays(None, new_in, new_out, True)
    assert _fields(handed_on) == _fields(fresh)
    # the Index-list forms give the same
    ins_l, outs_l = comp.reorder_indexes(array_to_indexes(ins), array_to_indexes(outs))
    assert ins_l == array_to_indexes(new_in) and outs_l == array_to_indexes(new_out)
    assert all(isinstance(i, Index) for i in ins_l + outs_l)
    assert _fields(comp.precompute_indexes(None, ins_l, outs_l, False)) == _fields(fresh)


def test_rows_already_in_order_come_back_as_the_same_objects():
    comp, ins, outs = _case(0)
    new_in, new_out = comp.reorder_index_arrays(ins, outs)
    again_in, again_out = comp.reorder_index_arrays(new_in, new_out)
    assert again_in is new_in and again_out is new_out


def test_precompute_refuses_rows_out_of_order():
    comp, ins, outs = _case(1)
    comp.name = "conv1"
    new_in, new_out = comp.reorder_index_arrays(ins, outs)
    shuffled = new_in[::-1].copy()
    clear_request_memos()
    with pytest.raises(ComponentError, match="conv1.*reorder them first"):
        comp.precompute_index_arrays(None, shuffled, new_out, False)


def test_an_entry_made_for_another_model_object_is_not_used():
    comp, ins, outs = _case(2)
    new_in, new_out = comp.reorder_index_arrays(ins, outs)
    key = (id(comp), new_in.tobytes(), new_out.tobytes())
    right = time_height_conv._COMPILED[key]
    # as if the component had died and another had its id: a different model object
    other = component_from_config("TimeHeightConvolutionComponent", CONFIGS[0][0], seed=0)
    time_height_conv._COMPILED[key] = (other.model, right[1], "not a computation")
    got = comp.precompute_index_arrays(None, new_in, new_out, False)
    clear_request_memos()
    assert _fields(got) == _fields(comp.precompute_index_arrays(None, new_in, new_out, False))


def test_the_memo_stays_bounded_and_is_a_request_memo():
    comp, ins, outs = _case(3)
    clear_request_memos()
    for shift in range(3 * time_height_conv._COMPILED_SIZE):
        moved_in, moved_out = ins.copy(), outs.copy()
        moved_in[:, 1] += shift
        moved_out[:, 1] += shift
        comp.reorder_index_arrays(moved_in, moved_out)
        assert len(time_height_conv._COMPILED) <= time_height_conv._COMPILED_SIZE
    clear_request_memos()
    assert not time_height_conv._COMPILED


@pytest.mark.parametrize("seed", range(8))
def test_step_arrays_kept_by_content_equal_a_fresh_build(seed):
    """step_arrays keeps its results by what they are made of: a second call (another
    computation object of the same structure) gives the same numbers as a build from
    scratch, the arrays read-only and the meta rows the caller's own."""
    from engine.nnet.components import _convolution
    comp, ins, outs = _case(seed)
    cc = compile_convolution_rows(comp.model, ins, outs, comp.max_memory_mb)[0]
    cc_again = compile_convolution_rows(comp.model, ins, outs, comp.max_memory_mb)[0]
    assert cc_again is not cc and cc_again == cc
    _convolution._STEP_ARRAYS.clear()
    first = _convolution.step_arrays(cc)
    second = _convolution.step_arrays(cc_again)
    fresh = _convolution._step_arrays(cc)
    for got in (first, second):
        assert got[0] == fresh[0]
        np.testing.assert_array_equal(got[1], fresh[1])
        np.testing.assert_array_equal(got[2], fresh[2])
        assert not got[1].flags.writeable and not got[2].flags.writeable
    first[0][0][0] += 1          # a caller's meta rows are its own
    assert _convolution.step_arrays(cc)[0] == fresh[0]
