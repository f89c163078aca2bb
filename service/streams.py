"""Streams in the service: open a stream on a model, push frames in any amounts,
receive output rows as soon as they are computable, finish (flush the right edge),
close (SPEC section 2, "Streams").

Each stream is an ``engine.inference.stream.Stream`` of a ``LoopedModel`` (shared by
the streams of one model and chunk configuration).  Its state is checkpointed after
every push into a ``StreamStore``: with Redis (``NNETC_REDIS_URL``) a stream
survives the loss of the process that served it -- another process (which finds the
model through service/redis_registry.py) imports the last checkpoint and goes on bit
for bit where it stopped.  Checkpoints are msgpack records holding the engine's
exported state (an .npz archive without pickled objects, stamped with the model's
fingerprint); each carries a version, and a save succeeds only over the version the
saving process read (Redis WATCH/MULTI), so two processes advancing one stream at
once cannot both win: the loser answers 409 and the client resends from the offset
it names.  A process that holds a stream live reads the checkpoint's version before
each push and reloads when another process has moved the stream on.

Without Redis the store keeps nothing: streams live in their process only.  When
Redis cannot be reached, streams go on in memory (their next successful save
overwrites whatever is stored) and a stream that is not live here answers 503.

Every method runs on the service's worker (routes submit ``stream_*`` jobs), so
the executors never run two computations at once.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack
import numpy as np
import redis

from engine.core.errors import Cancelled, NnetcError, ResourceLimitError
from engine.inference.common import model_priors
from engine.inference.looped import LoopedConfig, get_chunk_size
from engine.inference.stream import LoopedModel, Stream
from engine.nnet.graph import has_recurrence
from schemas.streams import StreamOptions
from service import deadlines
from service.errors import ServiceError, check_answer_size
from service.redis_types import is_wrong_type

log = logging.getLogger("nnetc.streams")

RECORD_VERSION = 1
KEY_PREFIX = "nnetc:stream:"
_LOOPED_MODELS = 8          # LoopedModels kept (each holds its compiled computation)


def _corrupt(sid: str, what: str) -> ServiceError:
    """The error for a checkpoint of stream ``sid`` that cannot be used (``what``: why,
    after "the checkpoint of stream <sid>")."""
    return ServiceError(500, "CorruptCheckpoint",
                        f"the checkpoint of stream {sid} {what}; the stream is lost: open "
                        f"a new one")


def recurrent_chunk_bound(nnet, chunk: int, fpc: int, sub: int, limit: int | None,
                          where: str = "") -> None:
    """413 RequestTooLarge when ``nnet`` has a recurrence (an LSTM, a GRU: a cycle in its
    node graph) and its chunks are longer than ``limit`` frames (max_recurrent_chunk_frames;
    None: no bound): such a chunk's computation has steps frame by frame, and compiling it
    takes time in proportion (about 7 ms a frame for a fast LSTM on one core), during which
    the worker serves nobody else.  ``chunk``: frames_per_chunk ``fpc`` rounded up to a
    multiple of the subsampling factor ``sub`` and the network's modulus."""
    if limit is None or chunk <= limit or not has_recurrence(nnet):
        return
    field = "frame_subsampling_factor" if sub > fpc else "frames_per_chunk"
    raise ServiceError(413, "RequestTooLarge",
                       f"{where}{field} {sub if sub > fpc else fpc}: chunks of {chunk} frames "
                       f"(frames_per_chunk {fpc} rounded up to a multiple of "
                       f"frame_subsampling_factor {sub} and the network's modulus) on a "
                       f"network with recurrence are more than this service's "
                       f"max_recurrent_chunk_frames ({limit}): their computation is "
                       f"compiled frame by frame; use shorter chunks", f"options.{field}")


def chunk_bound(nnet, options: dict, limit: int, where: str = "",
                recurrent_limit: int | None = None) -> None:
    """413 RequestTooLarge, naming the option, when the first chunk's computation of a
    stream with ``options`` (a dict of schemas.streams.StreamOptions) would read more
    than ``limit`` frames: chunk_size (frames_per_chunk rounded up to a multiple of the
    subsampling factor and the network's modulus) plus extra_left_context_initial; or,
    on a network with recurrence, when chunk_size is more than ``recurrent_limit``
    (recurrent_chunk_bound).  ``where`` starts the message (a checkpoint's stream)."""
    fpc, sub = options["frames_per_chunk"], options["frame_subsampling_factor"]
    extra = options["extra_left_context_initial"]
    if fpc > limit:
        raise ServiceError(413, "RequestTooLarge",
                           f"{where}frames_per_chunk {fpc} is more than this service's "
                           f"max_request_indexes ({limit})", "options.frames_per_chunk")
    chunk = get_chunk_size(nnet, sub, fpc)
    if chunk + extra > limit:
        field = ("extra_left_context_initial" if extra >= chunk
                 else "frame_subsampling_factor" if sub > 1 else "frames_per_chunk")
        raise ServiceError(413, "RequestTooLarge",
                           f"{where}{field} {options[field]}: a chunk of {chunk} frames "
                           f"(frames_per_chunk {fpc} rounded up to a multiple of "
                           f"frame_subsampling_factor {sub} and the network's modulus) plus "
                           f"extra_left_context_initial {extra} is more than this service's "
                           f"max_request_indexes ({limit})", f"options.{field}")
    recurrent_chunk_bound(nnet, chunk, fpc, sub, recurrent_limit, where)


class StreamConflict(Exception):
    """The stored checkpoint is not the version the saving process started from."""


class StoreUnavailable(Exception):
    pass


class NoStreamStore:
    """Keeps nothing: streams live in their process only."""

    shared = False

    def load(self, sid: str) -> dict | None:
        return None

    def version(self, sid: str) -> int | None:
        return None

    def save(self, sid: str, record: dict, expect_version: int | None) -> None:
        pass

    def delete(self, sid: str) -> None:
        pass

    def end(self, sid: str) -> None:
        pass

    def discard(self, sid: str, what: str) -> ServiceError:
        return _corrupt(sid, what)


class RedisStreamStore:
    """Checkpoints in Redis, one msgpack record per stream, expiring after
    ``ttl_s`` without a save."""

    shared = True

    def __init__(self, client: redis.Redis, ttl_s: int, prefix: str = KEY_PREFIX):
        self.client = client
        self.ttl_s = ttl_s
        self.prefix = prefix

    def _decode(self, sid: str, raw: bytes) -> dict:
        try:
            rec = msgpack.unpackb(raw, raw=False)
            if not isinstance(rec, dict) or rec.get("v") != RECORD_VERSION:
                raise ValueError("not a stream record of this version")
            if rec.get("ended") is True:
                return {"ended": True}
            for k, t in (("version", int), ("model_id", str), ("options", dict),
                         ("frames_output", int)):
                if not isinstance(rec.get(k), t):
                    raise ValueError(f"field {k!r} missing or of the wrong type")
            if not isinstance(rec.get("state"), bytes):
                raise ValueError("no state")
            return rec
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise _corrupt(sid, f"is not readable ({e})") from None

    def _error(self, sid: str, e: redis.RedisError) -> Exception:
        """What a Redis error on the key of stream ``sid`` means: a key of another Redis
        type than a checkpoint's (a string) is a broken checkpoint (deleted); anything
        else, the store cannot be reached."""
        if is_wrong_type(e):
            return self.discard(sid, "is not readable (its key holds another Redis type)")
        return StoreUnavailable(f"{type(e).__name__}: {e}")

    def _call(self, fn, sid: str, *args):
        """fn(key of ``sid``, *args), its Redis errors as _error tells."""
        try:
            return fn(self.prefix + sid, *args)
        except redis.RedisError as e:
            raise self._error(sid, e) from None

    def discard(self, sid: str, what: str) -> ServiceError:
        """Delete the unusable checkpoint of ``sid`` (if Redis can be reached); the
        error to answer with (``what``: as for _corrupt)."""
        try:
            self.client.delete(self.prefix + sid)
        except redis.RedisError:
            pass
        return _corrupt(sid, what)

    def load(self, sid: str) -> dict | None:
        raw = self._call(self.client.get, sid)
        if raw is None:
            return None
        try:
            return self._decode(sid, raw)
        except ServiceError:
            self._call(self.client.delete, sid)
            raise

    def version(self, sid: str) -> int | None:
        rec = self.load(sid)
        return None if rec is None else rec.get("version")

    def save(self, sid: str, record: dict, expect_version: int | None) -> None:
        """Store ``record``; with ``expect_version`` only over a stored record of that
        version (None: unconditionally)."""
        key = self.prefix + sid
        payload = msgpack.packb(record, use_bin_type=True)
        try:
            with self.client.pipeline() as pipe:
                pipe.watch(key)
                if expect_version is not None:
                    raw = pipe.get(key)
                    rec = self._decode(sid, raw) if raw is not None else None
                    if rec is not None and rec.get("ended"):
                        raise StreamConflict("ended")
                    found = rec["version"] if rec is not None else None
                    if found != expect_version:
                        raise StreamConflict(found)
                pipe.multi()
                pipe.set(key, payload, ex=self.ttl_s)
                pipe.execute()
        except redis.WatchError:
            raise StreamConflict(None) from None
        except redis.RedisError as e:
            raise self._error(sid, e) from None

    def delete(self, sid: str) -> None:
        self._call(self.client.delete, sid)

    def end(self, sid: str) -> None:
        """Replace the checkpoint by a marker that the stream has ended (finished or
        closed), kept as long as a checkpoint would be: a process still holding the
        stream learns of it instead of carrying on (or saving it back)."""
        self._call(self.client.set, sid, msgpack.packb({"v": RECORD_VERSION, "ended": True}),
                   self.ttl_s)


@dataclass
class LiveStream:
    stream_id: str
    model_id: str
    options: dict                # schemas.streams.StreamOptions as a dict
    looped: LoopedModel
    stream: Stream
    version: int = 0             # of the last checkpoint this process saved or loaded
    nbytes: int = 0              # what it may hold (LoopedModel.stream_bytes): max_stream_bytes
    unsaved: bool = False        # a save failed (store unreachable): memory is ahead
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def frames_received(self) -> int:
        return self.stream.num_received

    @property
    def frames_output(self) -> int:
        return self.stream.num_emitted

    def summary(self) -> dict:
        """What the routes report (schemas.streams.StreamInfo's fields): plain data, so
        a worker in another process can send it back."""
        m = self.looped
        return {"stream_id": self.stream_id, "model_id": self.model_id,
                "options": dict(self.options), "chunk_size": m.chunk_size,
                "left_context": m.frames_left_context, "right_context": m.frames_right_context,
                "input_dim": m.input_dim, "output_dim": m.output_dim,
                "frames_received": self.frames_received, "frames_output": self.frames_output,
                "finished": self.stream.finished,
                "online_ivector_period": self.stream.online_period or None,
                "ivector_rows_received": self.stream.online_received,
                "truncated_recurrence": m.truncation}


def _release(live: LiveStream) -> None:
    """Give the memory of a stream no longer held here back to its model's pool."""
    live.stream.close()


class StreamManager:
    def __init__(self, registry, backend, store=None, max_streams: int = 256,
                 idle_s: float = 600.0, metrics=None, max_ivector_rows: int = 4096,
                 max_held_frames: int = 100_000, max_request_indexes: int = 100_000,
                 max_computation_bytes: int | None = None,
                 max_response_bytes: int | None = None, pool=None,
                 max_bytes: int | None = None,
                 max_recurrent_chunk_frames: int | None = None):
        """``max_bytes``: what the open streams may hold together, each counted at its
        looped model's ``stream_bytes()`` (max_stream_bytes; None: no bound).
        ``max_recurrent_chunk_frames``: chunks of networks with recurrence
        (recurrent_chunk_bound; None: no bound)."""
        self.registry = registry
        self.max_bytes = max_bytes
        # the matrices every looped model's streams keep between chunks (one bound for all)
        self.pool = pool
        self.max_computation_bytes = max_computation_bytes
        self.max_response_bytes = max_response_bytes
        self.max_request_indexes = max_request_indexes
        self.max_recurrent_chunk_frames = max_recurrent_chunk_frames
        self.max_ivector_rows = max_ivector_rows
        self.max_held_frames = max_held_frames
        self.xp = backend
        self.store = store if store is not None else NoStreamStore()
        self.max_streams = max_streams
        self.idle_s = idle_s
        self.metrics = metrics
        self._live: dict[str, LiveStream] = {}
        self._looped: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        # held from the admission of a stream (_admit) until it is in _live, so that two
        # opens or takeovers at once cannot both pass the same bounds
        self._admitting = threading.Lock()

    # -- bookkeeping -------------------------------------------------------------------------
    def _gauge(self) -> None:
        if self.metrics is not None:
            with self._lock:
                count, held = len(self._live), self._held_bytes()
            self.metrics.streams_open.set(count)
            self.metrics.stream_bytes.set(held)

    def _held_bytes(self) -> int:
        """What the open streams may hold together (under ``_lock``): the sum over the
        streams held, so that a stream leaving ``_live`` by any path leaves the count."""
        return sum(live.nbytes for live in self._live.values())

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes()

    def _too_many(self) -> ServiceError:
        return ServiceError(503, "TooManyStreams",
                            f"this server holds {self.max_streams} open streams (its "
                            f"max_streams); finish or close some, or retry later")

    def _admit(self, looped: LoopedModel, sid: str | None, options: dict) -> int:
        """The bytes a stream of ``looped`` is counted at, after checking that this
        process can hold one more (``sid``: a stream restored here, which replaces the
        copy of it held here, if any): 503 TooManyStreams beyond max_streams or beyond
        max_stream_bytes, 413 for a stream larger than max_stream_bytes alone."""
        est = looped.stream_bytes()
        where = f"stream {sid}" if sid is not None else "this stream"
        if self.max_bytes is not None and est > self.max_bytes:
            raise ServiceError(413, "RequestTooLarge",
                               f"{where} (frames_per_chunk {options['frames_per_chunk']}: "
                               f"chunks of {looped.chunk_size} frames) may hold {est} bytes "
                               f"(its looped computation's matrices and one chunk's input), "
                               f"more than this server's max_stream_bytes ({self.max_bytes}) "
                               f"for all its streams: use a smaller frames_per_chunk",
                               "options.frames_per_chunk")
        with self._lock:
            old = self._live.get(sid) if sid is not None else None
            count = len(self._live) - (old is not None)
            held = self._held_bytes() - (old.nbytes if old is not None else 0)
        if count >= self.max_streams:
            raise self._too_many()
        if self.max_bytes is not None and held + est > self.max_bytes:
            raise ServiceError(503, "TooManyStreams",
                               f"{where} may hold {est} bytes (frames_per_chunk "
                               f"{options['frames_per_chunk']}: its looped computation's "
                               f"matrices and one chunk's input) and the {count} open "
                               f"streams of this server hold {held}: together more than its "
                               f"max_stream_bytes ({self.max_bytes}); finish or close some, "
                               f"use a smaller frames_per_chunk, or retry later")
        return est

    def _event(self, event: str, count: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.stream_events.labels(event=event).inc(count)

    def _sweep(self) -> None:
        """Close streams idle for longer than ``idle_s`` (their checkpoints expire
        on their own)."""
        now = time.monotonic()
        with self._lock:
            idle = [s for s, live in self._live.items() if now - live.last_used > self.idle_s]
            dropped = [self._live.pop(s) for s in idle]
        for live in dropped:
            _release(live)
        if idle:
            self._event("expired", len(idle))
            self._gauge()

    def looped_model(self, entry, options: dict) -> LoopedModel:
        truncate = bool(options.get("truncate_future_recurrence", False))
        key = (entry.model_id, options["frames_per_chunk"],
               options["extra_left_context_initial"], options["frame_subsampling_factor"],
               options["use_priors"], truncate)
        with self._lock:
            looped = self._looped.get(key)
            if looped is not None:
                self._looped.move_to_end(key)
                return looped
        looped = LoopedModel(entry.model.nnet,
                             LoopedConfig(options["frames_per_chunk"],
                                          options["extra_left_context_initial"],
                                          options["frame_subsampling_factor"],
                                          truncate_future_recurrence=truncate),
                             priors=model_priors(entry.model), use_priors=options["use_priors"],
                             backend=self.xp, max_peak_bytes=self.max_computation_bytes,
                             pool=self.pool)
        with self._lock:
            self._looped[key] = looped
            while len(self._looped) > _LOOPED_MODELS:
                self._looped.popitem(last=False)
        return looped

    def _record(self, live: LiveStream, version: int) -> dict:
        return {"v": RECORD_VERSION, "version": version, "model_id": live.model_id,
                "options": live.options, "state": live.stream.export_state(),
                "frames_output": live.frames_output}

    def _checkpoint(self, live: LiveStream) -> None:
        """Save the stream's state as version ``live.version + 1``."""
        if not self.store.shared:
            return
        # (a new stream's id is fresh: nothing to compare with)
        expect = None if live.unsaved or live.version == 0 else live.version
        try:
            self.store.save(live.stream_id, self._record(live, live.version + 1), expect)
        except StoreUnavailable as e:
            if not live.unsaved:
                log.warning("stream checkpoint not saved: the store is unreachable",
                            extra={"stream_id": live.stream_id, "error": str(e)})
            live.unsaved = True
            self._event("checkpoint_error")
            return
        except StreamConflict as e:
            self._drop(live.stream_id)
            if e.args and e.args[0] == "ended":
                raise ServiceError(404, "NotFound",
                                   f"stream {live.stream_id} was finished or closed by "
                                   f"another request", "stream_id") from None
            self._event("conflict")
            raise ServiceError(409, "StreamConflict",
                               f"stream {live.stream_id} was advanced by another request "
                               f"meanwhile; this push was not kept: read the stream's "
                               f"frames_received and resend from there",
                               "stream_id") from None
        live.version += 1
        live.unsaved = False

    def _restore(self, sid: str, rec: dict) -> LiveStream:
        try:
            # the options as a client could have sent them (a pydantic ValidationError is
            # a ValueError), not a KeyError or TypeError deep in restoring the stream
            if set(rec["options"]) != set(StreamOptions.model_fields):
                raise ValueError("they are not the options a stream has")
            rec = dict(rec, options=StreamOptions.model_validate(rec["options"],
                                                                 strict=True).model_dump())
        except ValueError as e:
            raise self.store.discard(sid, f"is not readable (its options: {e})") from None
        entry = self._model_of(sid, rec["model_id"])
        # bounded as opening the stream here would be (413; the checkpoint may come from
        # a server with a larger bound, so it is kept), before anything is compiled
        chunk_bound(entry.model.nnet, rec["options"], self.max_request_indexes,
                    f"the checkpoint of stream {sid}: ", self.max_recurrent_chunk_frames)
        try:
            looped = self.looped_model(entry, rec["options"])
        except ResourceLimitError:
            raise                       # this server's bound (413), not a broken record
        except NnetcError as e:
            # options a client could not have opened the stream with (use_priors on a
            # model without priors)
            raise self.store.discard(sid, f"cannot be restored ({e})") from None
        # held here within this server's bounds (a takeover counts as an open), before
        # the state is imported
        with self._admitting:
            nbytes = self._admit(looped, sid, rec["options"])
            try:
                stream = looped.import_stream(rec["state"], rec["options"]["acoustic_scale"])
            except NnetcError as e:
                # a state that does not fit the model
                raise self.store.discard(sid, f"cannot be restored ({e})") from None
            live = LiveStream(sid, rec["model_id"], rec["options"], looped, stream,
                              version=rec["version"], nbytes=nbytes)
            with self._lock:
                old = self._live.pop(sid, None)
                self._live[sid] = live
        if old is not None:
            _release(old)
        self._event("restored")
        self._gauge()
        return live

    def get(self, sid: str) -> LiveStream:
        """The live stream ``sid``: held here (and still the latest), or restored
        from the store's checkpoint."""
        with self._lock:
            live = self._live.get(sid)
        try:
            if live is not None:
                if live.unsaved or not self.store.shared:
                    live.last_used = time.monotonic()
                    return live
                rec = self.store.load(sid)
                if rec is None:
                    # the checkpoint expired while this process kept the stream alive:
                    # the next save writes it again whatever was there
                    live.unsaved = True
                if rec is None or rec.get("version") == live.version:
                    live.last_used = time.monotonic()
                    return live
                if rec.get("ended"):
                    self._drop(sid)
                    raise self._not_found(sid)
                return self._restore(sid, rec)       # another process moved it on
            rec = self.store.load(sid)
        except StoreUnavailable as e:
            if live is not None:
                live.last_used = time.monotonic()
                return live
            raise ServiceError(503, "StoreUnavailable",
                               f"stream {sid} is not held by this server and its checkpoint "
                               f"cannot be read now ({e}); retry") from None
        if rec is None or rec.get("ended"):
            raise self._not_found(sid)
        return self._restore(sid, rec)

    def _model_of(self, sid: str, model_id: str):
        """The registry entry of the model stream ``sid`` runs; 409 ModelNotRegistered
        when the model is not registered (deleted, here or by another process)."""
        try:
            return self.registry.get(model_id)
        except ServiceError as e:
            if e.status != 404:
                raise
            raise ServiceError(409, "ModelNotRegistered",
                               f"stream {sid} runs model {model_id}, which is not "
                               f"registered on this server: register the same model again "
                               f"(same bytes, same id) and retry", "model_id") from None

    def _not_found(self, sid: str) -> ServiceError:
        return ServiceError(404, "NotFound",
                            f"no stream with id {sid!r} (never opened, finished, closed, or "
                            f"idle for more than {self.idle_s:g} s)", "stream_id")

    def _drop(self, sid: str) -> None:
        with self._lock:
            live = self._live.pop(sid, None)
        if live is not None:
            _release(live)
        self._gauge()

    # -- operations (worker jobs) -----------------------------------------------------------
    def info(self, p: dict) -> dict:
        return self.get(p["stream_id"]).summary()

    def open(self, p: dict) -> dict:
        self._sweep()
        with self._lock:
            if len(self._live) >= self.max_streams:     # (before compiling anything)
                raise self._too_many()
        entry, options = p["entry"], p["options"]
        # (its compile stops between phases once the deadline has passed: engine.core.cancel)
        with deadlines.compiles_stopped(p):
            looped = self.looped_model(entry, options)
        with self._admitting:
            nbytes = self._admit(looped, None, options)
            stream = looped.stream(p["ivector"], p.get("online_ivector_period"),
                                   options["acoustic_scale"])
            sid = "s-" + secrets.token_urlsafe(18)
            live = LiveStream(sid, entry.model_id, options, looped, stream, nbytes=nbytes)
            if deadlines.passed(deadlines.deadline_of(p)):
                # the API answered 504 meanwhile: nobody would learn the stream's id, and
                # it would hold its bytes until it idled out
                _release(live)
                raise Cancelled("stream_open job finished past its deadline; the stream "
                                "was not kept")
            self._checkpoint(live)
            with self._lock:
                self._live[sid] = live
        self._event("opened")
        self._gauge()
        return live.summary()

    def push(self, p: dict) -> tuple[np.ndarray, int, dict]:
        self._sweep()
        live = self.get(p["stream_id"])
        self._model_of(live.stream_id, live.model_id)     # not deleted meanwhile
        with live.lock:
            offset = p.get("offset")
            if offset is not None and offset != live.frames_received:
                raise ServiceError(409, "OffsetMismatch",
                                   f"offset {offset} given, but stream {live.stream_id} has "
                                   f"received {live.frames_received} frames: send the frames "
                                   f"from {live.frames_received} on", "offset")
            first = live.frames_output
            rows = p.get("online_ivectors")
            s = live.stream
            if rows is not None and s.online_period:
                held = s.held_ivector_rows + int(np.shape(rows)[0])
                if held > self.max_ivector_rows:
                    raise ServiceError(413, "RequestTooLarge",
                                       f"stream {live.stream_id} would hold {held} online "
                                       f"i-vector rows that no computed chunk has read yet, "
                                       f"more than this service's max_stream_ivector_rows "
                                       f"({self.max_ivector_rows}): push the rows with the "
                                       f"frames they describe", "online_ivectors")
            if s.online_period:
                # frames wait for the rows their chunks read: bound what waits
                held = s.held_frames + int(np.shape(p["features"])[0])
                if held > self.max_held_frames:
                    raise ServiceError(413, "RequestTooLarge",
                                       f"stream {live.stream_id} would hold {held} frames "
                                       f"waiting for their online i-vector rows, more than "
                                       f"this service's max_request_indexes "
                                       f"({self.max_held_frames}): push the rows with the "
                                       f"frames", "features")
            self._check_answer(live, int(np.shape(p["features"])[0]))
            # all or nothing: stopped between chunks once the job's deadline has passed,
            # or done past it, the push is undone (engine Stream.push) and answered 504
            out = s.push(p["features"], p.get("ivector"), rows,
                         should_stop=deadlines.job_stop_hook(p))
            self._checkpoint(live)
        return out, first, live.summary()

    def _check_answer(self, live: LiveStream, rows: int) -> None:
        """413 before a push of ``rows`` frames whose answer could carry more than
        max_response_bytes of output: at most every received frame not yet output
        (subsampled) comes out of it.  (A finish returns no more than the last push
        could have.)"""
        if self.max_response_bytes is None:
            return
        m = live.looped
        out_rows = -(-(live.frames_received + rows) // m.fsf) - live.frames_output
        check_answer_size(out_rows * m.output_dim, self.max_response_bytes,
                          f"the answer to pushing {rows} frames to stream {live.stream_id} "
                          f"(up to {out_rows} output frames of dim {m.output_dim})", "features")

    def finish(self, p: dict) -> tuple[np.ndarray, int, dict]:
        live = self.get(p["stream_id"])
        self._model_of(live.stream_id, live.model_id)
        with live.lock:
            first = live.frames_output
            out = live.stream.finish(should_stop=deadlines.job_stop_hook(p))
            self._forget(live.stream_id)
        self._event("finished")
        return out, first, live.summary()

    def close(self, p: dict) -> None:
        sid = p["stream_id"]
        with self._lock:
            found = sid in self._live
        self._drop(sid)
        try:
            if not found and self.store.shared:
                rec = self.store.load(sid)
                found = rec is not None and not rec.get("ended")
            if found:
                self.store.end(sid)
        except StoreUnavailable as e:
            if not found:
                raise ServiceError(503, "StoreUnavailable",
                                   f"stream {sid} is not held by this server and the store "
                                   f"cannot be reached now ({e}); retry") from None
        if not found:
            raise self._not_found(sid)
        self._event("closed")

    def _forget(self, sid: str) -> None:
        """After finish: the stream is gone here and, as ended, in the store."""
        with self._lock:
            self._live.pop(sid, None)
        try:
            self.store.end(sid)
        except StoreUnavailable:
            pass     # the checkpoint expires on its own
        self._gauge()

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)
