"""Service-level benchmark (suite "service"): the in-process service through its ASGI app
(FastAPI's TestClient: HTTP semantics, JSON/base64 bodies, no sockets), per model:

- dynamic batching: ``CLIENTS`` threads each posting a one-sequence chunk compute
  (``CHUNK`` output frames, the request of kaldi_stats.json with batch 1) at once,
  ``ROUNDS`` rounds; the service with ``NNETC_MAX_BATCH=1`` (no batching) and with the
  default (8, 2 ms delay) alternated; median ms per round, the ratio
  (batched / unbatched: below 1 is faster) and the mean computation batch size;
- the computation cache: /compile of that request cold (a miss: compile + optimize +
  store) against a hit, median ms.

Outputs of the batched runs are checked against the unbatched ones before timing.  Two
warm-up rounds come first: each batch-size bucket (1, 2, 4, 8 sequences) is a computation of
its own, compiled the first time a batch of that size forms; with few timed rounds one of
those compiles can still fall inside them.
"""

from __future__ import annotations

import base64
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench import common

CLIENTS = 8
ROUNDS = 12
CHUNK = 21


def _register_body(path: Path) -> dict:
    if str(path).endswith(".cfg"):
        return {"config": Path(path).read_text(), "seed": 0}
    return {"binary_b64": base64.b64encode(Path(path).read_bytes()).decode()}


def _enc(x: np.ndarray) -> dict:
    x = np.ascontiguousarray(x, dtype="<f4")
    return {"shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode()}


def _dec(m: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(m["data"]), "<f4").reshape(m["shape"])


def measure_service(name: str, path, clients: int = CLIENTS, rounds: int = ROUNDS,
                    chunk: int = CHUNK) -> dict:
    from fastapi.testclient import TestClient  # noqa: PLC0415

    from service.app import create_app  # noqa: PLC0415
    from service.settings import Settings  # noqa: PLC0415
    nnet = common.load_for_inference(path)
    req = common.chunk_request(nnet, chunk, 1)
    wire_req = {"inputs": [s.to_json() for s in req.inputs],
                "outputs": [s.to_json() for s in req.outputs]}
    rng = np.random.default_rng(0)
    inputs = [{s.name: _enc(rng.standard_normal((len(s.indexes), nnet.input_dim(s.name))))
               for s in req.inputs} for _ in range(clients)]

    def app(max_batch: int):
        return TestClient(create_app(Settings(max_batch=max_batch, log_level="WARNING")))

    results: dict = {}
    times: dict = {1: [], 8: []}
    batches = {}
    for mb in (1, 8):
        with app(mb) as c:
            mid = c.post("/models", json=_register_body(path)).json()["model_id"]
            body = {"model_id": mid, "request": wire_req}
            if mb == 1:
                t = time.perf_counter()
                r = c.post("/compile", json=body)
                miss = (time.perf_counter() - t) * 1e3
                assert r.status_code == 200 and not r.json()["cached"], r.text
                hits = []
                for _ in range(5):
                    t = time.perf_counter()
                    assert c.post("/compile", json=body).json()["cached"]
                    hits.append((time.perf_counter() - t) * 1e3)
                results["compile_miss_ms"] = miss
                results["compile_hit_ms"] = statistics.median(hits)
            with ThreadPoolExecutor(clients) as pool:
                def round_():
                    rs = list(pool.map(lambda x: c.post("/compute", json={
                        **body, "inputs": x, "encoding": "base64"}), inputs))
                    assert all(r.status_code == 200 for r in rs), rs[0].text
                    return [_dec(r.json()["outputs"]["output"]) for r in rs]
                outs = round_()                          # warm-up (compiles)
                round_()          # (batches of other sizes, each of its own computation)
                if mb == 1:
                    ref = outs
                else:
                    for a, b in zip(outs, ref):
                        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
                for _ in range(rounds):
                    t = time.perf_counter()
                    round_()
                    times[mb].append((time.perf_counter() - t) * 1e3)
            text = c.get("/metrics").text
            count = total = 0.0
            for line in text.splitlines():
                if line.startswith("nnetc_batch_size_count"):
                    count = float(line.split()[-1])
                elif line.startswith("nnetc_batch_size_sum"):
                    total = float(line.split()[-1])
            batches[mb] = total / count if count else float("nan")
    unb, bat = statistics.median(times[1]), statistics.median(times[8])
    return {"model": name, "clients": clients, "chunk": chunk,
            "unbatched_round_ms": unb, "batched_round_ms": bat,
            "batched_over_unbatched": bat / unb, "mean_batch": batches[8],
            "computes_per_s": clients / (bat / 1e3),
            "compile_miss_ms": results["compile_miss_ms"],
            "compile_hit_ms": results["compile_hit_ms"]}


def suite_service(r) -> list[dict]:
    rows = []
    with common.blas_threads(r.plain_settings[0]):
        for name, path in r.models():
            rows.append(measure_service(name, path, rounds=max(2, min(r.repeat, ROUNDS))))
    return rows
