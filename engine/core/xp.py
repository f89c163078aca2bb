"""Array-module helpers: the backend (NumPy or CuPy) is a parameter, never a global."""

from __future__ import annotations

import numpy as np


def array_module(a):
    """numpy or cupy, whichever owns ``a`` (numpy for anything that is not a CuPy array)."""
    mod = type(a).__module__
    if mod.startswith("cupy"):
        import cupy  # noqa: PLC0415  (lazy: importing engine never needs a GPU)

        return cupy
    return np


def to_numpy(a) -> np.ndarray:
    if type(a).__module__.startswith("cupy"):
        return a.get()
    return np.asarray(a)


def as_strided(xp):
    """The backend's ``lib.stride_tricks.as_strided`` (NumPy's or CuPy's)."""
    if xp is np:
        return np.lib.stride_tricks.as_strided
    import importlib  # noqa: PLC0415

    return importlib.import_module(f"{xp.__name__}.lib.stride_tricks").as_strided
