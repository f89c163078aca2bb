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
import weakref
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


# -- components on a device ----------------------------------------------------------------

_device_lock = threading.Lock()
# id(component) -> {backend name: (its host arrays, the device copy)}; dropped with the component
_device_copies: dict[int, dict] = {}


def _host_arrays(comp) -> list | None:
    """The NumPy arrays of ``comp`` (and of its sub-components), or None when one
    of them is not frozen (engine/runtime/gemm.py): only arrays that cannot change
    may be represented by a copy made once."""
    from engine.runtime.gemm import frozen  # noqa: PLC0415
    out = []
    for name in tuple(comp.PARAMS) + tuple(comp.ARRAYS):
        v = getattr(comp, name, None)
        if isinstance(v, np.ndarray):
            if not frozen(v):
                return None
            out.append(v)
    for sub in getattr(comp, "components", None) or ():
        got = _host_arrays(sub)
        if got is None:
            return None
        out.extend(got)
    return out


def device_component(comp, xp):
    """``comp`` with its arrays on backend ``xp`` (``comp`` itself for NumPy).

    A component whose arrays are all frozen (a decoding network: ``Nnet.
    freeze_parameters``, as ``prepare_nnet`` leaves it) is copied to the device
    once and the copy shared by every executor, for as long as the component
    keeps those same arrays (assigning new ones makes a new copy); any other
    component is copied for each caller, since its arrays may change in place.
    Callers must not write the arrays of a shared copy (propagation never does;
    gradients and statistics go to copies of their own)."""
    if xp is np:
        return comp
    host = _host_arrays(comp)
    if host is None:
        return comp.to_backend(xp)
    name = backend_name(xp)
    key = id(comp)
    entry = _device_copies.get(key, {}).get(name)
    if entry is not None and len(entry[0]) == len(host) and all(
            a is b for a, b in zip(entry[0], host)):
        return entry[1]
    dev = comp.to_backend(xp)
    with _device_lock:
        per = _device_copies.get(key)
        if per is None:
            per = _device_copies[key] = {}
            weakref.finalize(comp, _device_copies.pop, key, None)
        per[name] = (host, dev)
    return dev


def is_shared_device_copy(comp, dev, xp) -> bool:
    """Whether ``dev`` is the shared device copy of ``comp`` (``device_component``)."""
    entry = _device_copies.get(id(comp), {}).get(backend_name(xp))
    return entry is not None and entry[1] is dev


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
