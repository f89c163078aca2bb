"""Registered models shared through Redis: a model registered on one service process
is known to every process using the same Redis (streams and cached computations
name models by id, so another process can take a stream over or compute with a
model without the client registering it there again).

Each model is a Redis hash ``nnetc:model:<id>`` holding the bytes as registered,
how to read them (source field, seed) and the figures ``GET /models`` shows (name,
structure hash, ``nnetc info`` figures), plus its id in the set ``nnetc:models``.
Every process keeps the models it has loaded in its ``InProcessRegistry`` (LRU);
a lookup it does not hold reads the hash and loads the bytes, and the id is checked
again (sha256 of the bytes and seed), so bytes that are not what was registered
under that id are refused and deleted.

A deletion removes the hash and the id and lists the id in ``nnetc:deleted-models``:
every process checks that set (and the hash) when it is asked for a model it holds,
so a model deleted by one process is gone from all of them at their next lookup;
registering the same bytes again takes the id off the list.

When Redis cannot be reached: registering still loads the model here (the write is
retried at the next registration of the same bytes), lookups of models held here
work, a lookup of another model gets 503, listing shows the models held here.  A
model Redis lost without a deletion (a restart without persistence) keeps serving
where it is held.
"""

from __future__ import annotations

import json
import logging

import redis

from service.convert import model_info
from service.errors import ServiceError, not_found
from service.redis_types import is_wrong_type
from service.registry import (DEFAULT_MAX_MODEL_BYTES, DEFAULT_MAX_NODES,
                              InProcessRegistry, ModelEntry, model_id_of)

log = logging.getLogger("nnetc.registry")

KEY_PREFIX = "nnetc:model:"
SET_KEY = "nnetc:models"
# ids of deleted models (a process that holds one of them drops it; registering the same
# bytes again takes the id out)
DELETED_KEY = "nnetc:deleted-models"


class RedisModelRegistry:
    def __init__(self, client: redis.Redis, max_models: int = 64, prefix: str = KEY_PREFIX,
                 set_key: str = SET_KEY, max_nodes: int = DEFAULT_MAX_NODES,
                 deleted_key: str = DELETED_KEY,
                 max_bytes: int | None = DEFAULT_MAX_MODEL_BYTES):
        self.client = client
        # models kept in Redis may be dropped here to make room for others (max_bytes):
        # they are loaded again from there when asked for
        self.local = InProcessRegistry(max_models, max_nodes, max_bytes,
                                       reloadable=lambda mid: mid in self._stored)
        self.prefix, self.set_key, self.deleted_key = prefix, set_key, deleted_key
        # the models held here that are (or were) in Redis: one of them that Redis
        # lists as deleted was deleted by another process; one Redis lost without a
        # deletion (a restart without persistence) keeps serving here.  (A model whose
        # write to Redis failed stays this process's own until it is registered again.)
        self._stored: set[str] = set()

    def _unavailable(self, e: Exception, what: str) -> ServiceError:
        return ServiceError(503, "StoreUnavailable",
                            f"{what}: the model store (Redis) cannot be reached now "
                            f"({type(e).__name__}: {e}); retry")

    def register(self, data: bytes, source_field: str, name: str | None = None,
                 seed: int | None = None) -> tuple[ModelEntry, bool]:
        entry, created_here = self.local.register(data, source_field, name, seed)
        key = self.prefix + entry.model_id
        record = {"data": data, "source": source_field,
                  "seed": "" if seed is None else str(seed), "name": name or "",
                  "structure_hash": entry.structure_hash,
                  "info": json.dumps(entry.info, sort_keys=True)}
        try:
            try:
                existed = self._store(key, record, entry.model_id)
            except redis.ResponseError as e:
                if not is_wrong_type(e):
                    raise
                # the model's key or the index holds another Redis type: replace it
                log.warning("a registry key of the wrong Redis type is replaced",
                            extra={"model_id": entry.model_id, "error": str(e)})
                if self.client.type(key) not in (b"hash", b"none"):
                    self.client.delete(key)
                self._repair_index()
                existed = self._store(key, record, entry.model_id)
        except redis.RedisError as e:
            log.warning("model not stored in Redis (registered in this process only)",
                        extra={"model_id": entry.model_id,
                               "error": f"{type(e).__name__}: {e}"})
            return entry, created_here
        self._stored.add(entry.model_id)
        return entry, not existed

    def _repair_index(self) -> None:
        """When the index of model ids holds another Redis type than a set, make it
        again from the model keys there are."""
        if self.client.type(self.set_key) in (b"set", b"none"):
            return
        ids = [k[len(self.prefix):] for k in self.client.scan_iter(
            match=self.prefix.encode() + b"*", count=1000)]
        log.warning("the model index had the wrong Redis type; made again from the model "
                    "keys", extra={"models": len(ids)})
        with self.client.pipeline() as pipe:
            pipe.delete(self.set_key)
            if ids:
                pipe.sadd(self.set_key, *ids)
            pipe.execute()

    def _store(self, key: str, record: dict, model_id: str) -> bool:
        """Write the record (and list the id); whether the key existed before."""
        with self.client.pipeline() as pipe:
            pipe.exists(key)
            pipe.hset(key, mapping=record)
            pipe.sadd(self.set_key, model_id)
            pipe.srem(self.deleted_key, model_id)
            return bool(pipe.execute()[0])

    def get(self, model_id: str) -> ModelEntry:
        try:
            entry = self.local.get(model_id)
        except ServiceError as missing:
            try:
                rec = self.client.hgetall(self.prefix + model_id)
            except redis.RedisError as e:
                if is_wrong_type(e):
                    raise self._corrupt(model_id, "the key holds another Redis type than "
                                                  "a hash") from None
                raise self._unavailable(e, f"model {model_id} is not loaded here") from None
            if not rec:
                raise missing from None
        else:
            if model_id in self._stored and self._deleted_elsewhere(entry):
                self._forget(model_id)
                raise not_found("model", model_id, "model_id")
            return entry
        data = rec.get(b"data", b"")
        source = rec.get(b"source", b"").decode("utf-8", "replace")
        seed_s = rec.get(b"seed", b"").decode("ascii", "replace")
        name = rec.get(b"name", b"").decode("utf-8", "replace") or None
        try:
            seed = int(seed_s) if seed_s else None
            if model_id_of(data, seed) != model_id or source not in ("config", "text",
                                                                     "binary_b64", "upload"):
                raise ValueError("the stored bytes do not have this id")
        except ValueError as e:
            raise self._corrupt(model_id, str(e)) from None
        entry, _ = self.local.register(data, source, name, seed)
        self._stored.add(model_id)
        return entry

    def _deleted_elsewhere(self, entry: ModelEntry) -> bool:
        """Whether another process deleted the model held here.  False when Redis
        cannot be reached, or lost the model without a deletion (a restart without
        persistence): the model keeps serving here, as documented."""
        try:
            with self.client.pipeline() as pipe:
                pipe.exists(self.prefix + entry.model_id)
                pipe.sismember(self.deleted_key, entry.model_id)
                exists, deleted = pipe.execute()
        except redis.RedisError:
            return False
        return not exists and bool(deleted)

    def _forget(self, model_id: str) -> None:
        self._stored.discard(model_id)
        try:
            self.local.delete(model_id)
        except ServiceError:
            pass

    def _corrupt(self, model_id: str, why: str) -> ServiceError:
        """Delete the broken record of ``model_id``; the error to answer with."""
        self._drop(model_id)
        return ServiceError(500, "CorruptModelRecord",
                            f"the stored record of model {model_id} is not valid ({why}); "
                            f"it was deleted: register the model again")

    def _drop(self, model_id: str) -> None:
        try:
            self.client.delete(self.prefix + model_id)
            self.client.srem(self.set_key, model_id)
        except redis.RedisError:
            pass

    def list(self) -> list[ModelEntry]:
        """Every model in Redis (those not loaded here are described from their record,
        with ``model`` None) and those held here."""
        held = {e.model_id: e for e in self.local.list()}
        try:
            try:
                members = self.client.smembers(self.set_key)
            except redis.ResponseError as e:
                if not is_wrong_type(e):
                    raise
                self._repair_index()
                members = self.client.smembers(self.set_key)
            ids = sorted(i.decode("ascii", "replace") for i in members)
            listed = set(ids)
            for mid in [m for m in held if m in self._stored and m not in listed]:
                if self._deleted_elsewhere(held[mid]):
                    self._forget(mid)
                    del held[mid]
            out = []
            for mid in ids:
                if mid in held:
                    out.append(held.pop(mid))
                    continue
                try:
                    vals = self.client.hmget(self.prefix + mid,
                                             ["structure_hash", "info", "name"])
                except redis.ResponseError as e:
                    if not is_wrong_type(e):
                        raise
                    log.warning("a model record that cannot be listed is left out",
                                extra={"model_id": mid, "error": str(e)})
                    continue
                if vals[0] is None or vals[1] is None:
                    continue
                try:
                    info = json.loads(vals[1])
                    model_info(info)          # the figures GET /models shows must be there
                except (ValueError, TypeError, KeyError, AttributeError) as e:
                    # one broken record must not fail the listing of every model
                    log.warning("a model record that cannot be listed is left out",
                                extra={"model_id": mid, "error": f"{type(e).__name__}: {e}"})
                    continue
                out.append(ModelEntry(mid, vals[0].decode("ascii", "replace"), None, info,
                                      (vals[2] or b"").decode("utf-8", "replace") or None))
        except (redis.RedisError, ValueError):
            return list(self.local.list())          # Redis unreachable: the models held here
        return out + list(held.values())

    def delete(self, model_id: str) -> None:
        found = True
        self._stored.discard(model_id)
        try:
            self.local.delete(model_id)
        except ServiceError:
            found = False
        try:
            with self.client.pipeline() as pipe:
                pipe.delete(self.prefix + model_id)
                pipe.srem(self.set_key, model_id)
                pipe.sadd(self.deleted_key, model_id)
                removed = pipe.execute()[0]
        except redis.RedisError as e:
            raise self._unavailable(e, f"model {model_id} cannot be deleted everywhere") \
                from None
        if not (found or removed):
            raise not_found("model", model_id, "model_id")
