"""Float32 inputs: the one rule for values a caller hands the engine (features,
i-vectors, request inputs and output derivatives), shared by the inference front-end,
the command line and the service.

Every value must be finite in float32.  A number beyond float32's range (about
3.4e38 in magnitude) becomes infinite when it is converted, so it is refused like an
infinity, and the message says where the first such value is and why.  The conversion
itself is silent (``as_float32``): NumPy's "overflow encountered in cast" warning
would only repeat what the error then says.
"""

from __future__ import annotations

import math

import numpy as np

F32_MAX = float(np.finfo(np.float32).max)


def as_float32(values) -> np.ndarray:
    """``np.asarray(values, dtype=float32)`` without NumPy's overflow warning: a value
    too large for float32 becomes infinite, which ``non_finite`` then reports."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, dtype=np.float32)


def to_float32(a: np.ndarray) -> np.ndarray:
    """``a.astype(float32, copy=False)``, as quietly as ``as_float32``."""
    with np.errstate(over="ignore", invalid="ignore"):
        return a.astype(np.float32, copy=False)


def non_finite(a: np.ndarray) -> str | None:
    """None when every value of ``a`` is finite; otherwise what is wrong, naming the
    first value that is not (in row order): "contains NaN or infinite values (the first
    at row 3, column 1: +inf ...)"."""
    ok = np.isfinite(a)
    if ok.all():
        return None
    at = np.unravel_index(int(np.argmin(ok.reshape(-1))), a.shape)   # the first False
    if a.ndim == 2:
        where = f"row {at[0]}, column {at[1]}"
    elif a.ndim == 1:
        where = f"element {at[0]}"
    else:
        where = "index " + str(tuple(int(i) for i in at))
    v = float(a[at])
    kind = "NaN" if math.isnan(v) else ("+inf" if v > 0 else "-inf")
    text = f"contains NaN or infinite values (the first at {where}: {kind}"
    if kind != "NaN":
        text += f"; float32 holds magnitudes up to {F32_MAX:.4g}, a larger number becomes infinite"
    return text + ")"


__all__ = ["F32_MAX", "as_float32", "non_finite", "to_float32"]
