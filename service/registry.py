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
from typing import Protocol

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


class InProcessRegistry:
    def __init__(self, max_models: int = 64, max_nodes: int = DEFAULT_MAX_NODES):
        self.max_models = max_models
        self.max_nodes = max_nodes
        self._models: OrderedDict[str, ModelEntry] = OrderedDict()
        self._lock = threading.Lock()

    def register(self, data: bytes, source_field: str, name: str | None = None,
                 seed: int | None = None) -> tuple[ModelEntry, bool]:
        """Load and register ``data``; returns (entry, created).  The seed (random
        initial parameters of a config) is part of the id."""
        model_id = model_id_of(data, seed)
        with self._lock:
            if model_id in self._models:
                self._models.move_to_end(model_id)
                return self._models[model_id], False
        from service.cli import model_info  # noqa: PLC0415 (the figures of `nnetc info`)
        model = _load(data, source_field, seed)
        if model.nnet.num_nodes() > self.max_nodes:
            # what follows (the network's context, its decoding form, every compile)
            # grows with the node count; no Kaldi recipe comes near the limit
            raise ServiceError(413, "RequestTooLarge",
                               f"{source_field}: the network has {model.nnet.num_nodes()} "
                               f"nodes, more than this service's max_model_nodes "
                               f"({self.max_nodes})", source_field)
        # A registered model is never changed (statistics go to a private copy), so
        # its arrays are made read-only: the executors may then keep derived copies
        # (device-resident weights on a GPU, transposed weights for small products).
        model.nnet.freeze_parameters()
        entry = ModelEntry(model_id, structure_hash(model.nnet), model, model_info(model), name)
        with self._lock:
            if model_id in self._models:       # registered meanwhile by another request
                return self._models[model_id], False
            self._models[model_id] = entry
            while len(self._models) > self.max_models:
                self._models.popitem(last=False)
        return entry, True

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
            if self._models.pop(model_id, None) is None:
                raise not_found("model", model_id, "model_id")


#: the seed of a config registered without one: its random parameters must be the same in
#: every process that loads it by id (another server behind the same Redis, a queue
#: worker, this one after the model was evicted), as Kaldi's own initialisation is
CONFIG_DEFAULT_SEED = 0


def _load(data: bytes, source_field: str, seed: int | None) -> Model:
    from engine.nnet.config import apply_config, no_file_options  # noqa: PLC0415
    # a client's config (or the config section of its model) must not make this
    # machine read its files (matrix=/etc/passwd, /dev/zero...)
    with no_file_options():
        if source_field == "config":
            from engine.nnet.nnet import Nnet  # noqa: PLC0415
            nnet = Nnet()
            apply_config(nnet, data.decode("utf-8"), source="config",
                         rng=np.random.default_rng(CONFIG_DEFAULT_SEED if seed is None
                                                   else seed))
            return Model(nnet, source="config")
        return load_model(data, source=source_field)
