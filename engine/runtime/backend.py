"""Array backends and the buffer pool.

Kaldi's CuMatrix code runs on the CPU or a GPU behind one interface; here the
same role is played by passing an array module ``xp`` (``numpy`` or ``cupy``).
``get_backend(name)`` resolves a name, importing CuPy only when asked.

``BufferPool`` stands in for Kaldi's CuMemoryAllocator caching: matrices freed
by a computation go back to the pool keyed by shape, and the next allocation
of the same shape (in this run or the next run of the same computation) takes
them back instead of asking the backend for new memory.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np

from engine.core.errors import ExecutionError

BACKEND_NAMES = ("numpy", "cupy")


def get_backend(name: str = "numpy"):
    """The array module for ``name`` ('numpy' or 'cupy')."""
    if name == "numpy":
        return np
    if name == "cupy":
        try:
            import cupy  # noqa: PLC0415
        except ImportError as e:
            raise ExecutionError(f"backend 'cupy' is not available: {e}") from None
        try:
            cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001 (CUDA raises its own error types)
            raise ExecutionError(f"backend 'cupy' has no usable GPU: {e}") from None
        return cupy
    raise ExecutionError(f"unknown backend {name!r} (expected one of {', '.join(BACKEND_NAMES)})")


def backend_name(xp) -> str:
    return "numpy" if xp is np else getattr(xp, "__name__", str(xp))


_F32 = np.dtype(np.float32)


def to_host(a) -> np.ndarray:
    """A NumPy array from a numpy or cupy array."""
    if type(a).__module__.startswith("cupy"):
        return a.get()
    return np.asarray(a)


class BufferPool:
    """Free float32 matrices keyed by shape, per backend.  Thread-safe; bounded
    by ``max_bytes`` (beyond that, released buffers are simply dropped)."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._free: dict[tuple, list] = defaultdict(list)
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, xp, num_rows: int, num_cols: int):
        key = ("numpy" if xp is np else backend_name(xp), num_rows, num_cols)
        with self._lock:
            lst = self._free.get(key)
            if lst:
                self.hits += 1
                a = lst.pop()
                self._bytes -= a.nbytes
                return a
            self.misses += 1
        return xp.empty((num_rows, num_cols), dtype=np.float32)

    def release(self, xp, a) -> None:
        # (called for every kDeallocMatrix: the cheap checks first; a dtype comparison
        # by identity before the general one)
        if a is None or a.ndim != 2 or (a.dtype is not _F32 and a.dtype != _F32) \
                or not a.flags.c_contiguous:
            return
        key = ("numpy" if xp is np else backend_name(xp), a.shape[0], a.shape[1])
        with self._lock:
            if self._bytes + a.nbytes > self.max_bytes:
                return
            self._free[key].append(a)
            self._bytes += a.nbytes

    @property
    def pooled_bytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0
