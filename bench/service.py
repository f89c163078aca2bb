"""Service-level benchmark (suite "service"): the in-process service through its ASGI app
(FastAPI's TestClient: HTTP semantics, JSON/base64 bodies, no sockets), per model:

- dynamic batching: ``CLIENTS`` threads each posting a one-sequence chunk compute
  (``CHUNK`` output frames, the request of kaldi_stats.json with batch 1) at once,
  ``ROUNDS`` rounds; the service with ``NNETC_MAX_BATCH=1`` (no batching) and with the
  default (8, 2 ms delay) alternated; median ms per round, the ratio
  (batched / unbatched: below 1 is faster) and the mean computation batch size;
- the computation cache: /compile of that request cold (a miss: compile + optimize +
  store) against a hit, median ms;
- streams: ``STREAM_CLIENTS`` threads, each opening a stream (the service's default
  options; an i-vector when the network reads one), pushing ``STREAM_FRAMES`` frames in
  ``PIECE``-frame pieces as audio would arrive, then finishing it, all at once: the
  median and 95th percentile of a push's round trip and the real-time factor of the
  whole (wall seconds over the seconds of audio, 100 frames/s, of all clients).  Each
  client's output is checked against a stream run alone through the service first.
  Networks that cannot stream (BLSTM) have none of these figures.

- the server as deployed (``measure_service_http``): `nnetc serve` in a process of its own
  and one client sending requests one after another over real HTTP: median milliseconds of
  /healthz, of a one-sequence /compute and of a stream push (what the in-process figures
  above leave out: the HTTP parser, the socket, the answer written out).

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
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bench import common

CLIENTS = 8
ROUNDS = 12
CHUNK = 21
STREAM_CLIENTS = 8
STREAM_FRAMES = 1000
PIECE = 10          # frames per push: 100 ms of audio
LARGE_FRAMES = 20000  # the large body of measure_service_http: 17 MB of JSON rows (TDNN)


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


class _CannotStream(Exception):
    pass


def measure_service_streams(name: str, path, clients: int = STREAM_CLIENTS,
                            frames: int = STREAM_FRAMES, piece: int = PIECE) -> dict:
    """The streams part of the suite (see the module docstring)."""
    from fastapi.testclient import TestClient  # noqa: PLC0415

    from service.app import create_app  # noqa: PLC0415
    from service.settings import Settings  # noqa: PLC0415
    nnet = common.load_for_inference(path)
    rng = np.random.default_rng(1)
    feats = [rng.standard_normal((frames, nnet.input_dim("input"))).astype(np.float32)
             for _ in range(clients)]
    ivector = (rng.standard_normal(nnet.input_dim("ivector")).tolist()
               if "ivector" in nnet.input_names() else None)

    def one(c, mid, x, latencies=None) -> np.ndarray:
        body = {"model_id": mid} if ivector is None else {"model_id": mid, "ivector": ivector}
        r = c.post("/streams", json=body)
        if r.status_code == 422 and "looped compilation is not possible" in r.text:
            raise _CannotStream
        assert r.status_code == 201, r.text
        sid = r.json()["stream_id"]
        out = []
        for i in range(0, frames, piece):
            t = time.perf_counter()
            r = c.post(f"/streams/{sid}/frames",
                       json={"features": _enc(x[i:i + piece]), "encoding": "base64"})
            if latencies is not None:
                latencies.append((time.perf_counter() - t) * 1e3)
            assert r.status_code == 200, r.text
            out.append(_dec(r.json()["output"]))
        r = c.post(f"/streams/{sid}/finish", json={"encoding": "base64"})
        assert r.status_code == 200, r.text
        out.append(_dec(r.json()["output"]))      # (finished: the stream is gone)
        return np.concatenate(out)

    with TestClient(create_app(Settings(log_level="WARNING"))) as c:
        mid = c.post("/models", json=_register_body(path)).json()["model_id"]
        try:
            alone = [one(c, mid, x) for x in feats]      # (also compiles the looped model)
        except _CannotStream:       # a backward recurrence (BLSTM): no streams
            return {}
        latencies: list[float] = []
        with ThreadPoolExecutor(clients) as pool:
            t = time.perf_counter()
            outs = list(pool.map(lambda x: one(c, mid, x, latencies), feats))
            wall = time.perf_counter() - t
    for a, b in zip(outs, alone):
        np.testing.assert_array_equal(a, b)
    latencies.sort()
    return {"stream_clients": clients, "stream_push_ms": statistics.median(latencies),
            "stream_push_ms_p95": latencies[int(0.95 * (len(latencies) - 1))],
            "stream_rtf": wall / (clients * frames / 100.0)}


HTTP_REQUESTS = 200


def _free_port() -> int:
    import socket  # noqa: PLC0415
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(start_timeout_s: float = 60.0, **env_extra):
    """`nnetc serve` (this checkout's) in a process of its own on a free loopback port, up
    and answering /healthz: yields (port, process, the first /healthz answer); stopped on
    the way out.  ``env_extra``: NNETC_* settings.  Its output goes to a temporary file
    (a pipe nobody reads could fill and stall it), told if it does not come up."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import httpx  # noqa: PLC0415
    port = _free_port()
    env = {**os.environ, "NNETC_LOG_LEVEL": "WARNING", **env_extra}
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--host",
                                 "127.0.0.1", "--port", str(port)],
                                cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                try:
                    first = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0)
                    break
                except httpx.TransportError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        tail = log.read().decode(errors="replace")[-2000:]
                        raise RuntimeError(f"nnetc serve did not come up: {tail}") from None
                    time.sleep(0.1)
            yield port, proc, first
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def measure_service_http(name: str, path, requests: int = HTTP_REQUESTS,
                         chunk: int = CHUNK, large_frames: int | None = LARGE_FRAMES) -> dict:
    """The service as deployed: `nnetc serve` in a process of its own (its HTTP parser, its
    event loop, the answer written to a socket), one httpx client in this process sending
    requests one after another; the median milliseconds of /healthz, of a /compute of one
    ``chunk``-frame sequence (base64 input and answer: a warm cache) and of a stream push
    of ``PIECE`` frames, each over ``requests`` requests after ten of warm-up.  Then what
    one large body does to the others: a /compute of ``large_frames`` frames with its
    input as JSON rows (its computation cached by a first one) while a second client asks
    for /healthz every 5 ms: the large request's milliseconds, the slowest /healthz meanwhile
    and that over the median /healthz (``http_healthz_during_large_ratio``); the same in
    msgpack with raw float32 bytes (``http_large_msgpack_*``); left out when
    ``large_frames`` is None."""
    import httpx  # noqa: PLC0415
    nnet = common.load_for_inference(path)
    req = common.chunk_request(nnet, chunk, 1)
    wire_req = {"inputs": [s.to_json() for s in req.inputs],
                "outputs": [s.to_json() for s in req.outputs]}
    rng = np.random.default_rng(0)
    inputs = {s.name: _enc(rng.standard_normal((len(s.indexes), nnet.input_dim(s.name))))
              for s in req.inputs}
    with serving() as (port, _, _), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
        mid = c.post("/models", json=_register_body(path)).json()["model_id"]
        body = {"model_id": mid, "request": wire_req, "inputs": inputs, "encoding": "base64"}

        def timed(send) -> float:
            for _ in range(10):
                send()
            times = []
            for _ in range(requests):
                t = time.perf_counter()
                send()
                times.append((time.perf_counter() - t) * 1e3)
            return statistics.median(times)

        def compute():
            r = c.post("/compute", json=body)
            assert r.status_code == 200, r.text
        row = {"http_healthz_ms": timed(lambda: c.get("/healthz")),
               "http_compute_ms": timed(compute)}
        open_body = {"model_id": mid}
        if "ivector" in nnet.input_names():
            open_body["ivector"] = rng.standard_normal(nnet.input_dim("ivector")).tolist()
        r = c.post("/streams", json=open_body)
        if r.status_code == 201:     # (a backward recurrence cannot stream)
            sid = r.json()["stream_id"]
            piece = {"features": _enc(rng.standard_normal((PIECE, nnet.input_dim("input")))),
                     "encoding": "base64"}

            def push():
                r = c.post(f"/streams/{sid}/frames", json=piece)
                assert r.status_code == 200, r.text
            row["http_push_ms"] = timed(push)
        if large_frames:
            row.update(_large_body(c, port, mid, nnet, large_frames))
            row["http_healthz_during_large_ratio"] = (row["http_healthz_max_during_large_ms"]
                                                      / row["http_healthz_ms"])
        return row


def _large_body(c, port: int, mid: str, nnet, frames: int) -> dict:
    """See measure_service_http: the input as JSON rows (answer JSON, its matrix in
    base64), then the same request in msgpack with raw float32 bytes (answer msgpack)."""
    import json  # noqa: PLC0415

    import msgpack  # noqa: PLC0415
    req = common.chunk_request(nnet, frames, 1)
    rng = np.random.default_rng(1)
    inputs = {s.name: rng.standard_normal((len(s.indexes), nnet.input_dim(s.name)))
              .astype("<f4") for s in req.inputs}
    wire_req = {"inputs": [s.to_json() for s in req.inputs],
                "outputs": [s.to_json() for s in req.outputs]}
    as_json = json.dumps({"model_id": mid, "encoding": "base64", "request": wire_req,
                          "inputs": {k: v.tolist() for k, v in inputs.items()}}).encode()
    as_msgpack = msgpack.packb({"model_id": mid, "encoding": "base64", "request": wire_req,
                                "inputs": {k: {"shape": list(v.shape), "data": v.tobytes()}
                                           for k, v in inputs.items()}})
    row = {}
    for body, ctype, key in ((as_json, "application/json", "large"),
                             (as_msgpack, "application/msgpack", "large_msgpack")):
        headers = {"content-type": ctype, "accept": ctype}
        assert c.post("/compute", content=body, headers=headers).status_code == 200
        took, waited = _while_polling(port, lambda: c.post("/compute", content=body,
                                                           headers=headers))
        row.update({f"http_{key}_body_mb": len(body) / 1e6, f"http_{key}_compute_ms": took,
                    f"http_healthz_max_during_{key}_ms": waited})
    return row


def _while_polling(port: int, send) -> tuple[float, float]:
    """(milliseconds of ``send()``, the slowest /healthz that a second client asking every
    5 ms got meanwhile)."""
    import threading  # noqa: PLC0415

    import httpx  # noqa: PLC0415
    waits: list[float] = []
    stop = threading.Event()

    def poll():
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as h:
            while not stop.is_set():
                t = time.perf_counter()
                h.get("/healthz")
                waits.append((time.perf_counter() - t) * 1e3)
                time.sleep(0.005)
    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.1)
    t = time.perf_counter()
    r = send()
    took = (time.perf_counter() - t) * 1e3
    time.sleep(0.1)
    stop.set()
    poller.join()
    assert r.status_code == 200, r.text[:300]
    return took, max(waits)


def suite_service(r) -> list[dict]:
    rows = []
    with common.blas_threads(r.plain_settings[0]):
        for name, path in r.models():
            row = measure_service(name, path, rounds=max(2, min(r.repeat, ROUNDS)))
            row.update(measure_service_streams(name, path))
            # the large body on the TDNN alone: it measures the HTTP layer, and 20000 frames
            # of a recurrent network compile for minutes
            row.update(measure_service_http(name, path, large_frames=LARGE_FRAMES
                                            if name == "tdnn" else None))
            rows.append(row)
    return rows
