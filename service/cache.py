"""Cache of compiled computations (Kaldi's CachingOptimizingCompiler, shared
across requests and clients).

The key is sha256 over: the model's structure hash (not its parameter values),
the canonical request bytes, the optimizer options' ``cache_key()``, the
compile flags (optimize, shortcut) and the engine's IR version; so a change of
any of these gives another entry, and retraining a model does not.

Entries are plain data (``engine.compiler.serialize.computation_to_data``: lists
and numbers, no pickle) and are rebuilt and validated on every read, so a
corrupted entry fails as a CheckError (reported and dropped) instead of
running.  ``ComputationCache`` is the interface a Redis-backed cache implements
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


class ComputationCache(Protocol):
    def get(self, key: str) -> NnetComputation | None: ...
    def put(self, key: str, computation: NnetComputation, meta: dict) -> None: ...
    def meta(self, key: str) -> dict | None: ...
    def __len__(self) -> int: ...


class LRUComputationCache:
    """Thread-safe LRU of plain-data computations plus a small metadata dict each
    (model id, request, flags: what a compute by computation id needs)."""

    def __init__(self, capacity: int = 256, on_event=None):
        self.capacity = capacity
        self._data: OrderedDict[str, tuple[dict, dict]] = OrderedDict()
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
        try:
            computation = computation_from_data(item[0])
        except CheckError:
            with self._lock:
                self._data.pop(key, None)
            return None, "corrupt"
        return computation, "hit"

    def meta(self, key: str) -> dict | None:
        with self._lock:
            item = self._data.get(key)
            return dict(item[1]) if item is not None else None

    def put(self, key: str, computation: NnetComputation, meta: dict) -> None:
        self.put_data(key, computation_to_data(computation), meta)

    def put_data(self, key: str, data: dict, meta: dict) -> None:
        """Store plain data already made by ``computation_to_data``."""
        with self._lock:
            self._data[key] = (data, dict(meta))
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def raw(self, key: str) -> dict | None:
        """The stored plain data (tests use it to check what is stored)."""
        with self._lock:
            item = self._data.get(key)
            return item[0] if item is not None else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)
