"""Cache of compiled computations (Kaldi's CachingOptimizingCompiler, shared
across requests and clients).

The key is sha256 over: the model's structure hash (not its parameter values),
the canonical request bytes, the optimizer options' ``cache_key()``, the
compile flags (optimize, shortcut) and the engine's IR version; so a change of
any of these gives another entry, and retraining a model does not.

Entries are plain data (``engine.compiler.serialize.computation_to_data``: lists
and numbers, no pickle); the computation a hit returns is rebuilt from that data
and validated once (when stored, or when first read for data from Redis), so a
corrupted entry fails as a CheckError (reported and dropped) instead of running.  ``ComputationCache`` is the interface a Redis-backed cache implements
(bytes in a hash, same keys); ``LRUComputationCache`` is the in-process one.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Protocol

from engine.compiler.computation import NnetComputation
from engine.compiler.request import ComputationRequest
from engine.compiler.serialize import IR_VERSION, computation_from_data, computation_to_data
from engine.core.errors import CheckError
from engine.optimizer.options import OptimizeOptions


def cache_key(structure_hash: str, request: ComputationRequest, options: OptimizeOptions,
              optimize: bool, use_shortcut: bool) -> str:
    h = hashlib.sha256()
    for part in (f"ir={IR_VERSION}", f"model={structure_hash}",
                 f"opts={options.cache_key() if optimize else 'none'}",
                 f"shortcut={int(use_shortcut)}"):
        h.update(part.encode("ascii") + b"\n")
    h.update(request.canonical_bytes())
    return h.hexdigest()


def plain_and_validated(computation: NnetComputation) -> tuple[dict, NnetComputation]:
    """(plain data of ``computation``, the computation rebuilt from that data and
    validated): what a cache stores for it, and what its hits return."""
    data = computation_to_data(computation)
    return data, computation_from_data(data)


#: memory of a computation in the cache per number or list its plain data holds: the data
#: and the computation rebuilt from it (measured with tracemalloc: 56-73 bytes on the
#: reference models' chunk requests, 81 on a long request of a small network)
BYTES_PER_ITEM = 100
#: the same for an item of a flat list of integers (the rows of Indexes, IR version 2):
#: at most a list slot, an int object and an int64 of the rebuilt array (tracemalloc: 17-23
#: bytes on average, small integers being shared)
BYTES_PER_INT = 48


def estimated_bytes(data) -> int:
    """The memory a cache entry of plain computation ``data`` takes, estimated from the
    number of items its lists and dicts hold."""
    total, stack = 0, [data]
    while stack:
        x = stack.pop()
        values = x.values() if isinstance(x, dict) else x
        nested = [v for v in values if isinstance(v, (list, tuple, dict))]
        flat_ints = (not nested and not isinstance(x, dict) and len(x) > 0
                     and type(x[0]) is int)
        total += len(x) * (BYTES_PER_INT if flat_ints else BYTES_PER_ITEM)
        stack.extend(nested)
    return total


class ComputationCache(Protocol):
    def get(self, key: str) -> NnetComputation | None: ...
    def put(self, key: str, computation: NnetComputation, meta: dict) -> NnetComputation: ...
    def meta(self, key: str) -> dict | None: ...
    def __len__(self) -> int: ...


class LRUComputationCache:
    """Thread-safe LRU of computations: per key the plain data, a small metadata dict
    (model id, compile time) and the computation built from that data and validated.

    Data enters validated: ``put`` stores ``computation_to_data`` of the computation
    and the computation rebuilt from it (``computation_from_data`` checks every
    reference), ``put_data`` (data from outside the process: Redis) is rebuilt and
    checked when first read, and dropped as ``corrupt`` if it fails.  A hit then
    returns the same computation object every time: no rebuilding per request, and the
    executor's compiled program, cached per computation object, is reused (a BLSTM
    21-frame chunk: 6 ms to rebuild and 19 ms to build the program, against a 2.2 ms
    forward).  Computations are never modified after they are cached."""

    def __init__(self, capacity: int = 256, on_event=None, max_bytes: int | None = None):
        self.capacity = capacity
        # entries are also dropped while their estimated size is above this (the newest
        # one stays): 256 computations of a large request are tens of GB
        self.max_bytes = max_bytes
        # key -> [plain data, meta, computation (None until validated), estimated bytes]
        self._data: OrderedDict[str, list] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._on_event = on_event or (lambda event: None)   # 'hit' / 'miss' / 'corrupt'

    def get(self, key: str) -> NnetComputation | None:
        computation, event = self.lookup(key)
        self._on_event(event)
        return computation

    def lookup(self, key: str) -> tuple[NnetComputation | None, str]:
        """(computation or None, 'hit' / 'miss' / 'corrupt'), no event reported."""
        with self._lock:
            item = self._data.get(key)
            if item is not None:
                self._data.move_to_end(key)
        if item is None:
            return None, "miss"
        if item[2] is not None:
            return item[2], "hit"
        try:
            computation = computation_from_data(item[0])
        except CheckError:
            with self._lock:
                if self._data.get(key) is item:
                    del self._data[key]
                    self._bytes -= item[3]
            return None, "corrupt"
        item[2] = computation
        return computation, "hit"

    def meta(self, key: str) -> dict | None:
        with self._lock:
            item = self._data.get(key)
            return dict(item[1]) if item is not None else None

    def put(self, key: str, computation: NnetComputation, meta: dict) -> NnetComputation:
        """Store ``computation``; returns the validated computation rebuilt from its
        plain data, which later hits return (use it instead of the argument)."""
        data, validated = plain_and_validated(computation)
        self._store(key, [data, dict(meta), validated])
        return validated

    def put_data(self, key: str, data: dict, meta: dict,
                 computation: NnetComputation | None = None) -> None:
        """Store plain data made by ``computation_to_data`` elsewhere (checked when first
        read), or with the ``computation`` already rebuilt from it and validated."""
        self._store(key, [data, dict(meta), computation])

    def _store(self, key: str, item: list) -> None:
        item.append(estimated_bytes(item[0]))
        with self._lock:
            old = self._data.get(key)
            if old is not None:
                self._bytes -= old[3]
            self._data[key] = item
            self._data.move_to_end(key)
            self._bytes += item[3]
            while len(self._data) > self.capacity or (
                    self.max_bytes is not None and self._bytes > self.max_bytes
                    and len(self._data) > 1):
                self._bytes -= self._data.popitem(last=False)[1][3]

    @property
    def estimated_bytes(self) -> int:
        """The estimated memory of the entries held."""
        with self._lock:
            return self._bytes

    def raw(self, key: str) -> dict | None:
        """The stored plain data (tests use it to check what is stored)."""
        with self._lock:
            item = self._data.get(key)
            return item[0] if item is not None else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)
