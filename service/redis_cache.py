"""The computation cache shared through Redis, with the in-process LRU in front
(SPEC section 2, "Cache").

Lookups go to the LRU first, then to Redis; what Redis returns is decoded and
validated (a sha256 of the entry's data and metadata, stored with it, must match,
and ``computation_from_data`` checks every reference) before it is used or copied
into the LRU, so an entry that is not what this code wrote -- truncated, garbled
(a changed number that still references valid matrices would otherwise compute
wrong results), from another IR version, or bytes someone else put under the
key -- is deleted
and counted as ``corrupt``, and the request compiles as on a miss.  Stores write
both.  Entries are msgpack of plain data (lists, numbers, strings: no pickle, so
reading an entry cannot run code), one Redis string per computation under
``<prefix><cache key>``, with an optional expiry.

Redis is an accelerator, not a dependency of correctness: when it cannot be
reached or answers with an error, the lookup or store is skipped (event
``redis_error``, one warning log per outage), requests are served from the LRU or
compiled, and Redis is not tried again for ``retry_after_s`` seconds, so an
outage does not add a connection timeout to every request.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import msgpack
import redis

from engine.compiler.computation import NnetComputation
from engine.compiler.serialize import IR_VERSION, computation_from_data
from engine.core.errors import CheckError
from service.cache import LRUComputationCache, plain_and_validated
from service.redis_types import is_wrong_type

log = logging.getLogger("nnetc.cache")
_WRONG_TYPE = object()     # what _call returns for a key of another Redis type

KEY_PREFIX = "nnetc:computation:"


def _digest(data: dict, meta: dict) -> str:
    """sha256 of an entry's data and metadata as msgpack (which reads back to the same
    values, so a reader packs what it read and compares)."""
    return hashlib.sha256(msgpack.packb([data, meta], use_bin_type=True)).hexdigest()


class RedisComputationCache:
    """``ComputationCache`` over Redis with an ``LRUComputationCache`` in front.
    Events reported: ``hit`` (LRU), ``redis_hit``, ``miss``, ``corrupt``,
    ``redis_error``."""

    def __init__(self, url: str | None = None, capacity: int = 256, on_event=None, *,
                 client: redis.Redis | None = None, ttl_s: int | None = None,
                 timeout_s: float = 1.0, retry_after_s: float = 5.0,
                 prefix: str = KEY_PREFIX, max_bytes: int | None = None):
        if client is None:
            if not url:
                raise ValueError("RedisComputationCache needs a Redis URL or a client")
            client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                          socket_connect_timeout=timeout_s)
        self.client = client
        self.front = LRUComputationCache(capacity, max_bytes=max_bytes)
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.prefix = prefix
        self._on_event = on_event or (lambda event: None)
        self._lock = threading.Lock()
        self._down_until = 0.0       # monotonic time before which Redis is not tried
        self._down = False           # an outage is in progress (logged once)

    # -- Redis access with the outage rule ---------------------------------------------------
    def available(self) -> bool:
        """False while an outage is being waited out (no call is made then)."""
        with self._lock:
            return time.monotonic() >= self._down_until

    def _call(self, fn, *args):
        """fn(*args) against Redis, or None after reporting an error; ``_WRONG_TYPE``
        when the key holds another Redis type (a broken entry, not an outage)."""
        if not self.available():
            return None
        try:
            result = fn(*args)
        except redis.RedisError as e:
            if is_wrong_type(e):
                return _WRONG_TYPE
            with self._lock:
                self._down_until = time.monotonic() + self.retry_after_s
                first = not self._down
                self._down = True
            self._on_event("redis_error")
            if first:
                log.warning("redis unavailable, serving from the in-process cache",
                            extra={"error": f"{type(e).__name__}: {e}"})
            return None
        with self._lock:
            if self._down:
                log.info("redis available again")
            self._down = False
        return result

    def ping(self) -> bool:
        return bool(self._call(self.client.ping))

    # -- ComputationCache ----------------------------------------------------------------------
    def get(self, key: str) -> NnetComputation | None:
        computation, event = self.front.lookup(key)
        if computation is not None:
            self._on_event("hit")
            return computation
        if event == "corrupt":
            self._on_event("corrupt")
        raw = self._call(self.client.get, self.prefix + key)
        if raw is None:
            self._on_event("miss")
            return None
        entry = self._drop_corrupt(key, "the key holds another Redis type") \
            if raw is _WRONG_TYPE else self._decode(key, raw)
        if entry is None:
            return None
        computation, data, meta = entry
        self.front.put_data(key, data, meta, computation)
        self._on_event("redis_hit")
        return computation

    def _decode(self, key: str, raw: bytes):
        """(computation, data, meta) from an entry's bytes, or None after deleting an
        entry that does not decode or validate."""
        try:
            entry = msgpack.unpackb(raw, raw=False, strict_map_key=True)
            if not isinstance(entry, dict) or entry.get("ir_version") != IR_VERSION:
                raise CheckError("not an entry of this IR version")
            data, meta = entry["data"], entry["meta"]
            if not isinstance(data, dict) or not isinstance(meta, dict):
                raise CheckError("entry without data or meta")
            if entry.get("sha256") != _digest(data, meta):
                raise CheckError("the entry's data does not match its digest")
            computation = computation_from_data(data)
        except (CheckError, ValueError, TypeError, KeyError, IndexError,
                msgpack.UnpackException) as e:
            return self._drop_corrupt(key, f"{type(e).__name__}: {e}")
        return computation, data, meta

    def _drop_corrupt(self, key: str, why: str) -> None:
        log.warning("dropping a corrupt cache entry", extra={"computation_id": key,
                                                             "error": why})
        self._call(self.client.delete, self.prefix + key)
        self._on_event("corrupt")
        self._on_event("miss")

    def put(self, key: str, computation: NnetComputation, meta: dict) -> NnetComputation:
        data, validated = plain_and_validated(computation)
        self.front.put_data(key, data, meta, validated)
        meta = dict(meta)
        payload = msgpack.packb({"ir_version": IR_VERSION, "data": data, "meta": meta,
                                 "sha256": _digest(data, meta)}, use_bin_type=True)
        self._call(self.client.set, self.prefix + key, payload, self.ttl_s)
        return validated

    def meta(self, key: str) -> dict | None:
        # (get() copies what it finds in Redis into the LRU, with its metadata)
        return self.front.meta(key)

    def raw(self, key: str) -> dict | None:
        return self.front.raw(key)

    def __len__(self) -> int:
        """Computations held in this process (Redis may hold more)."""
        return len(self.front)
