"""The one rule for float32 inputs (engine.core.finite): every value finite in float32,
and an error that names the first value that is not -- in the inference front-end,
for features, i-vectors and online i-vectors alike -- without NumPy's overflow
warning on the way."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from engine.core.errors import InferenceError
from engine.core.finite import F32_MAX, as_float32, non_finite
from engine.inference import Inferencer
from inference_nets import TDNN_IVECTOR, make_nnet


def test_non_finite_names_the_first_bad_value_in_row_order():
    a = np.zeros((4, 3), np.float32)
    assert non_finite(a) is None
    a[2, 0] = np.nan
    a[1, 2] = -np.inf          # earlier in row order than (2, 0)
    msg = non_finite(a)
    assert msg.startswith("contains NaN or infinite values (the first at row 1, column 2: -inf")
    assert "3.403e+38" in msg
    a[1, 2] = 0.0
    assert non_finite(a) == "contains NaN or infinite values (the first at row 2, column 0: NaN)"
    v = np.array([1.0, 2.0, np.inf], np.float32)
    assert "the first at element 2: +inf" in non_finite(v)
    assert "the first at index (0, 0, 0): NaN" in non_finite(np.full((2, 2, 2), np.nan))


def test_a_number_beyond_float32_becomes_infinite_quietly_and_is_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # NumPy's "overflow encountered in cast"
        a = as_float32([[0.0, 1e39], [F32_MAX, -1e300]])
    assert a[0, 1] == np.inf and a[1, 0] == F32_MAX and a[1, 1] == -np.inf
    assert "row 0, column 1: +inf" in non_finite(a)


@pytest.fixture(scope="module")
def inferencer():
    return Inferencer(make_nnet(TDNN_IVECTOR))


def test_inference_names_the_bad_value_of_each_argument(inferencer):
    x = np.zeros((20, 8), np.float32)
    iv = np.zeros(4, np.float32)
    bad_x = x.copy()
    bad_x[7, 3] = np.nan
    with pytest.raises(InferenceError, match=r"^features: .*row 7, column 3: NaN"):
        inferencer.infer(bad_x, iv)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # a Python list with a number too large for float32: refused, no warning
        with pytest.raises(InferenceError, match=r"^ivector: .*element 2: -inf"):
            inferencer.infer(x, [0.0, 0.0, -1e39, 0.0])
        rows = [[0.0] * 4, [0.0, 0.0, 0.0, 1e40]]
        # online i-vectors were not checked for finite values at all before
        with pytest.raises(InferenceError, match=r"^online_ivectors: .*row 1, column 3: \+inf"):
            inferencer.infer(x, online_ivectors=rows, online_ivector_period=10)
    # finite values pass and give finite outputs
    assert np.isfinite(inferencer.infer(x, iv)).all()
