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
from itertools import count

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


_NOBODY = object()    # BufferPool._lender: no free buffer to take


class BufferPool:
    """Free float32 matrices keyed by shape, per backend.  Thread-safe; bounded
    by ``max_bytes`` (beyond that, released buffers are simply dropped).

    Owners: a caller that runs the same computation again and again on its own
    state (a stream's executor) names itself with a token from ``new_owner()``.  A
    buffer it releases comes back to it first when it next asks for that shape;
    when it has none of its own it gets one released without an owner, else a new
    one -- never another owner's.  So streams interleaved on one pool keep running
    on their own buffers, chunk after chunk, which is what their bound fast paths
    (runtime/program.py) are keyed by: taking each other's buffers, every stream
    missed them on every chunk, and once one stream took another's, each took the
    next one's from then on.  An unnamed caller takes unnamed buffers first, then
    the latest owner's; so does a named one when the pool is too full to take a new
    buffer back.  ``disown(owner)`` makes an owner's free buffers unnamed (a stream
    that ended).  The byte bound counts every owner's buffers: each stream keeps the
    buffers its chunks use at once (per shape) in the pool, within that bound
    (0.4-0.6 MB more per interleaved stream on the reference models at 21-frame
    chunks, for 11-18% less time on TDNN and TDNN-F: bench/RESULTS.md)."""

    _owners = count(1)

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        # shape key -> owner -> free buffers, last released last (the owners in the
        # order their first buffer of that shape came in; emptied lists are removed)
        self._free: dict[tuple, dict] = defaultdict(dict)
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, xp, num_rows: int, num_cols: int, owner=None):
        key = ("numpy" if xp is np else backend_name(xp), num_rows, num_cols)
        with self._lock:
            by_owner = self._free.get(key)
            if by_owner:
                lender = owner if owner in by_owner else self._lender(
                    by_owner, owner, 4 * num_rows * num_cols)
                if lender is not _NOBODY:
                    lst = by_owner[lender]
                    a = lst.pop()
                    if not lst:
                        del by_owner[lender]
                    self.hits += 1
                    self._bytes -= a.nbytes
                    return a
            self.misses += 1
        return xp.empty((num_rows, num_cols), dtype=np.float32)

    def _lender(self, by_owner: dict, owner, nbytes: int):
        """Whose free buffer of one shape (``by_owner``: none of them ``owner``'s) a
        get by ``owner`` takes: an unnamed one; else, for an unnamed caller or when
        the pool is too full to take a new buffer back, the latest owner's; else
        _NOBODY (a new buffer)."""
        if None in by_owner:
            return None
        if owner is None or self._bytes + nbytes > self.max_bytes:
            return next(reversed(by_owner))
        return _NOBODY

    def release(self, xp, a, owner=None) -> None:
        # (called for every kDeallocMatrix: the cheap checks first; a dtype comparison
        # by identity before the general one)
        if a is None or a.ndim != 2 or (a.dtype is not _F32 and a.dtype != _F32) \
                or not a.flags.c_contiguous:
            return
        key = ("numpy" if xp is np else backend_name(xp), a.shape[0], a.shape[1])
        with self._lock:
            if self._bytes + a.nbytes > self.max_bytes:
                return
            by_owner = self._free[key]
            lst = by_owner.get(owner)
            if lst is None:
                by_owner[owner] = [a]
            else:
                lst.append(a)
            self._bytes += a.nbytes

    def new_owner(self) -> int:
        """A token to name a caller with (see the class docstring)."""
        return next(self._owners)

    def disown(self, *owners) -> None:
        """Make the free buffers of ``owners`` unnamed: anyone may take them."""
        with self._lock:
            for by_owner in self._free.values():
                for owner in owners:
                    lst = by_owner.pop(owner, None)
                    if lst:
                        by_owner.setdefault(None, []).extend(lst)

    def held(self) -> list:
        """The free buffers, all shapes and owners (for tests and diagnostics)."""
        with self._lock:
            return [a for d in self._free.values() for lst in d.values() for a in lst]

    @property
    def pooled_bytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0
