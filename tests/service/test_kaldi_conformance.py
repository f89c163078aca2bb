"""Kaldi's references through the HTTP API, end to end.

Networks: a client registers the model text (POST /models), compiles the reference request
(POST /compile with the listing) and runs it (POST /compute with Kaldi's inputs and output
derivatives); the statistics and listing must be Kaldi's (stats.json, computation.txt) and
the outputs, input derivatives and model gradients Kaldi's to float32 rounding (arrays.npz,
model_grad.txt); also through Redis (one service stores the model and the computation,
another runs them), through the job queue, and batched (four concurrent one-sequence jobs
merged along n).  Components: each reference component as a
one-component network through POST /compute.  Models: POST /infer against nnet3-compute
(infer.json; also through the job queue) and streams against the looped decodable
(looped.json; over HTTP, WebSocket, the job queue, and two services taking turns through
Redis).  Always on the Kaldi-made cases of tests/data (14 networks, 33 components, the
online-i-vector cases); on everything in ../shared/kaldi-ref when it is there."""

from __future__ import annotations

import base64
import itertools
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.nnet.model_io import load_nnet
from refdata import DATA, network_case_params, shared_ref
from tests.engine.inference_nets import (assert_close, infer_reference,
                                         infer_reference_params, looped_reference,
                                         looped_reference_params)
from tests.service.conftest import decode, make_client, needs_redis

LOCAL = sorted((DATA / "networks_kaldi_gen").iterdir())


def _b64(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


def _close(what: str, ours, ref) -> None:
    assert_close(np.asarray(ours, np.float64), np.asarray(ref, np.float64), what)


def _compute_body(mid: str, request: dict, arrays) -> dict:
    """POST /compute's body for a reference case: Kaldi's inputs and output derivatives."""
    return {"model_id": mid, "request": request, "encoding": "base64",
            "inputs": {s["name"]: _b64(arrays[f"input.{s['name']}"]) for s in request["inputs"]},
            "output_derivs": {s["name"]: _b64(arrays[f"output_deriv.{s['name']}"])
                              for s in request["outputs"] if s.get("has_deriv")}}


def _check_compute(res: dict, request: dict, arrays, what: str) -> None:
    """Outputs and (when output derivatives were given) input derivatives as Kaldi's."""
    for s in request["outputs"]:
        _close(f"{what} output {s['name']}", decode(res["outputs"][s["name"]]),
               arrays[f"output.{s['name']}"])
    if any(s.get("has_deriv") for s in request["outputs"]):
        for s in request["inputs"]:
            if s.get("has_deriv"):
                _close(f"{what} input derivative {s['name']}",
                       decode(res["input_derivs"][s["name"]]), arrays[f"input_deriv.{s['name']}"])


@pytest.mark.parametrize("case", network_case_params())
def test_reference_network_over_http(client, case: Path):
    r = client.post("/models", json={"text": (case / "model.txt").read_text()})
    assert r.status_code in (200, 201), r.text
    mid = r.json()["model_id"]
    request = json.loads((case / "request.json").read_text())

    r = client.post("/compile", json={"model_id": mid, "request": request, "listing": True})
    assert r.status_code == 200, r.text
    got = r.json()
    want = json.loads((case / "stats.json").read_text())["optimized"]
    assert (got["stats"]["commands"], got["stats"]["peak_bytes"]) == (
        want["commands"], want["peak_bytes"])
    if (case / "computation.txt").exists():
        assert got["listing"] == (case / "computation.txt").read_text()

    arrays = np.load(case / "arrays.npz")
    r = client.post("/compute", json=_compute_body(mid, request, arrays))
    assert r.status_code == 200, r.text
    res = r.json()
    _check_compute(res, request, arrays, case.name)
    if request.get("need_model_derivative") and (case / "model_grad.txt").exists():
        # Kaldi's SetNnetAsGradient convention: model_grad.txt holds parameters + gradient
        ref, orig = load_nnet(case / "model_grad.txt"), load_nnet(case / "model.txt")
        grads = res["model_gradient"] or {}
        checked = 0
        for name, theirs, o in zip(ref.component_names, ref.components, orig.components):
            if name not in grads:
                continue
            for p, b, a0 in zip(theirs.PARAMS, theirs.param_arrays(), o.param_arrays()):
                if p in grads[name]:
                    _close(f"gradient {name}.{p}", decode(grads[name][p]).reshape(b.shape),
                           np.asarray(b, np.float64) - np.asarray(a0, np.float64))
                    checked += 1
        if any(c.is_updatable for c in orig.components):
            assert checked, "no model gradient compared"


@pytest.mark.parametrize("case", LOCAL, ids=lambda p: p.name)
def test_structure_hash_leaves_the_model_alone(case: Path):
    """Registering hashes a model's structure with its parameters zeroed in a copy; the
    copy must not share arrays with the model (it did for a CompositeComponent, whose
    parameters live in its members: seed218's weights came out zero)."""
    from service.registry import structure_hash  # noqa: PLC0415
    nnet = load_nnet(case / "model.txt")
    before = [a.copy() for c in nnet.components for a in c.param_arrays()]
    first = structure_hash(nnet)
    after = [a for c in nnet.components for a in c.param_arrays()]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert structure_hash(nnet) == first


# -- models: nnet3-compute (POST /infer) and the looped decodable (streams) -----------------


def _upload(client, path: Path) -> str:
    r = client.post("/models/upload", content=path.read_bytes(),
                    headers={"Content-Type": "application/octet-stream"})
    assert r.status_code in (200, 201), r.text
    return r.json()["model_id"]


@pytest.mark.parametrize("kind,folder,setting", infer_reference_params())
def test_reference_inference_over_http(client, kind, folder: Path, setting):
    """POST /infer against Kaldi's nnet3-compute: the reference models' utterances with
    their options (../shared), and the Kaldi-made online-i-vector case (always)."""
    _reference_inference(client, kind, folder, setting)


@needs_redis
@pytest.mark.parametrize("kind,folder,setting", infer_reference_params())
def test_reference_inference_through_the_job_queue(server, kind, folder: Path, setting):
    """The same with NNETC_QUEUE=redis: each /infer is a job a worker runs."""
    from tests.service.test_redis_queue import ThreadWorker, _api  # noqa: PLC0415
    with _api(server.url) as api, ThreadWorker(server.url):
        _reference_inference(api, kind, folder, setting)


def _reference_inference(client, kind: str, folder: Path, setting) -> None:
    fields = ("frames_per_chunk", "extra_left_context", "extra_right_context",
              "extra_left_context_initial", "extra_right_context_final",
              "frame_subsampling_factor", "acoustic_scale", "apply_exp", "use_priors")
    model, o, jobs = infer_reference(kind, folder, setting)
    mid = _upload(client, model)
    opts, period = {k: o[k] for k in fields if k in o}, o.get("online_ivector_period")
    for feats, ivector, online, want in jobs:
        body = {"model_id": mid, "features": _b64(feats), "options": opts,
                "encoding": "base64"}
        if ivector is not None:
            body["ivector"] = np.asarray(ivector, np.float32).tolist()
        if online is not None:
            body["online_ivectors"] = _b64(online)
            body["online_ivector_period"] = period
        r = client.post("/infer", json=body)
        assert r.status_code == 200, r.text
        _close(f"{folder.name} /infer", decode(r.json()["output"]), want)


@pytest.mark.parametrize("kind,folder,setting", looped_reference_params())
def test_reference_streams_over_http(client, kind, folder: Path, setting):
    """POST /streams, frames pushed in pieces of 1-40 (online i-vector rows with the
    frames they describe), finish: Kaldi's looped decodable output (its looped.json
    references in ../shared, and the Kaldi-made online-i-vector case always).  A network
    with a recurrence reading later frames is opened as Kaldi runs it, cut at each
    chunk's end (truncate_future_recurrence)."""
    _reference_streams([client], kind, folder, setting)


@pytest.mark.parametrize("kind,folder,setting", looped_reference_params())
def test_reference_streams_over_websocket(client, kind, folder: Path, setting):
    """The same pushes and finish as WebSocket messages (/streams/{id}/ws)."""
    _reference_streams([client], kind, folder, setting, websocket=True)


@needs_redis
@pytest.mark.parametrize("kind,folder,setting", looped_reference_params())
def test_reference_streams_through_redis(server, kind, folder: Path, setting):
    """The same with two services sharing one Redis taking turns on each stream (every
    push goes to the other one, which takes the stream over from its checkpoint)."""
    with make_client(redis_url=server.url) as a, make_client(redis_url=server.url) as b:
        _reference_streams([a, b], kind, folder, setting)
        restored = sum(float(line.rsplit(" ", 1)[1]) for c in (a, b)
                       for line in c.get("/metrics").text.splitlines()
                       if line.startswith('nnetc_stream_events_total{event="restored"}'))
        assert restored > 0, "no stream was taken over from its checkpoint"


@needs_redis
@pytest.mark.parametrize("kind,folder,setting", looped_reference_params())
def test_reference_streams_through_the_job_queue(server, kind, folder: Path, setting):
    """The same with NNETC_QUEUE=redis: every stream request is a job a worker runs."""
    from tests.service.test_redis_queue import ThreadWorker, _api  # noqa: PLC0415
    with _api(server.url) as api, ThreadWorker(server.url):
        _reference_streams([api], kind, folder, setting)


def test_reference_streams_at_once(client):
    """Every reference stream case at the same time on one service (a thread each):
    each still gives Kaldi's output (streams share the service's models, compiled
    looped computations and worker)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415
    cases = [p.values for p in looped_reference_params()]
    with ThreadPoolExecutor(len(cases)) as pool:
        for f in [pool.submit(_reference_streams, [client], *v) for v in cases]:
            f.result()


def _reference_streams(clients: list, kind: str, folder: Path, setting: dict,
                       websocket: bool = False) -> None:
    """Each utterance of the case streamed, push k going to clients[k % len(clients)]
    (the model registered on the first), or with ``websocket`` as messages on one
    socket, against Kaldi's output."""
    path, o, jobs = looped_reference(kind, folder, setting)
    mid = _upload(clients[0], path)
    options = {k: o[k] for k in ("frames_per_chunk", "extra_left_context_initial",
                                 "frame_subsampling_factor", "truncate_future_recurrence")}
    period = o["online_ivector_period"]
    rng = np.random.default_rng(5)
    turn = itertools.cycle(clients)
    for feats, ivector, online, want in jobs:
        body = {"model_id": mid, "options": options}
        if ivector is not None:
            body["ivector"] = np.asarray(ivector, np.float32).tolist()
        if online is not None:
            body["online_ivector_period"] = period
        r = next(turn).post("/streams", json=body)
        assert r.status_code == 201, r.text
        sid = r.json()["stream_id"]
        pushes, pos, sent = [], 0, 0
        while pos < len(feats):
            n = int(rng.integers(1, 41))
            push = {"features": _b64(feats[pos:pos + n]), "encoding": "base64"}
            if online is not None:
                want_rows = min(len(online), -(-(pos + n) // period))
                if want_rows > sent:
                    push["online_ivectors"] = _b64(online[sent:want_rows])
                    sent = want_rows
            pushes.append(push)
            pos += n
        if online is not None and sent < len(online):
            pushes.append({"features": _b64(feats[:0]), "online_ivectors": _b64(online[sent:]),
                           "encoding": "base64"})
        outs = []
        if websocket:
            with clients[0].websocket_connect(f"/streams/{sid}/ws") as ws:
                for push in [*pushes, {"finish": True, "encoding": "base64"}]:
                    ws.send_json(push)
                    j = ws.receive_json()
                    assert "error" not in j, j
                    outs.append(decode(j["output"]))
        else:
            for push in pushes:
                r = next(turn).post(f"/streams/{sid}/frames", json=push)
                assert r.status_code == 200, r.text
                outs.append(decode(r.json()["output"]))
            r = next(turn).post(f"/streams/{sid}/finish", json={"encoding": "base64"})
            assert r.status_code == 200, r.text
            outs.append(decode(r.json()["output"]))
        got = np.concatenate([o.reshape(-1, want.shape[1]) for o in outs])
        _close(f"{folder.name} {setting['key']} stream", got, want)


# -- components: each Kaldi reference component in a one-component network over HTTP ------


def _component_cases() -> list:
    from tests.engine.component_harness import reference_cases  # noqa: PLC0415
    local = reference_cases()
    out = [pytest.param(c, id=f"{c.parent.name}-{c.name}") for c in local]
    out += [pytest.param(c, id=f"ref-{c.parent.name}-{c.name}", marks=pytest.mark.conformance)
            for c in reference_cases(full=True) if c not in local]
    return out


@pytest.mark.parametrize("case", _component_cases())
def test_reference_component_over_http(client, case: Path):
    """Kaldi's component case wrapped as input -> component -> output (its model text
    written around component.txt), registered and run through POST /compute, one row
    per frame: output, input derivative and parameter gradient as Kaldi's.  Every
    component type goes through the service's registration (structure hash), cache and
    executor this way."""
    arrays = np.load(case / "arrays.npz")
    x, dy = arrays["input"].astype(np.float32), arrays["output_deriv"].astype(np.float32)
    text = (case / "component.txt").read_text().strip()
    model = (f"<Nnet3> \ninput-node name=input dim={x.shape[1]}\n"
             "component-node name=c component=c input=input\n"
             "output-node name=output input=c\n\n"
             f"<NumComponents> 1 \n<ComponentName> c {text} \n</Nnet3> \n")
    r = client.post("/models", json={"text": model})
    assert r.status_code in (200, 201), r.text
    mid = r.json()["model_id"]
    rows = [[0, t, 0] for t in range(x.shape[0])]
    grad = (case / "gradient.txt").exists()
    request = {"inputs": [{"name": "input", "indexes": rows, "has_deriv": True}],
               "outputs": [{"name": "output", "indexes": rows, "has_deriv": True}],
               "need_model_derivative": grad}
    r = client.post("/compute", json={"model_id": mid, "request": request, "encoding": "base64",
                                      "inputs": {"input": _b64(x)},
                                      "output_derivs": {"output": _b64(dy)}})
    assert r.status_code == 200, r.text
    res = r.json()
    _close(f"{case.name} output", decode(res["outputs"]["output"]), arrays["output"])
    _close(f"{case.name} input derivative", decode(res["input_derivs"]["input"]),
           arrays["input_deriv"])
    if grad:
        from tests.engine.component_harness import load_component_text  # noqa: PLC0415
        ref = load_component_text(case / "gradient.txt")
        orig = load_component_text(case / "component.txt")
        got = (res["model_gradient"] or {}).get("c", {})
        for p, theirs, o in zip(ref.PARAMS, ref.param_arrays(), orig.param_arrays()):
            assert p in got, f"{case.name}: no gradient for {p} ({sorted(got)})"
            _close(f"{case.name} gradient {p}", decode(got[p]).reshape(np.shape(theirs)),
                   np.asarray(theirs, np.float64) - np.asarray(o, np.float64))


def _request_cases() -> list:
    from tests.engine.inference_nets import model_dirs  # noqa: PLC0415
    return [pytest.param(d, id=f"ref-{d.name}", marks=pytest.mark.conformance)
            for d in model_dirs(shared_ref(), "request.json")]


@pytest.mark.skipif(shared_ref() is None, reason="../shared/kaldi-ref not present (its "
                    "models' request.json cases)")
@pytest.mark.parametrize("folder", _request_cases())
def test_reference_model_request_over_http(client, folder: Path):
    """A reference model's explicit request (the x-vector's: output at t=0 per sequence)
    through POST /compute: every output Kaldi gave."""
    from tests.engine.inference_nets import model_file  # noqa: PLC0415
    mid = _upload(client, model_file(folder))
    request = json.loads((folder / "request.json").read_text())
    z = np.load(folder / "request_arrays.npz")
    r = client.post("/compute", json={"model_id": mid, "request": request, "encoding": "base64",
                                      "inputs": {s["name"]: _b64(z[f"input.{s['name']}"])
                                                 for s in request["inputs"]}})
    assert r.status_code == 200, r.text
    outs = r.json()["outputs"]
    for k in (k for k in z.files if k.startswith("output.")):
        _close(f"{folder.name} {k}", decode(outs[k.split(".", 1)[1]]), z[k])


# -- through Redis: the model and the computation another process stored ------------------


@needs_redis
@pytest.mark.parametrize("case", network_case_params())
def test_reference_network_through_redis(server, case: Path):
    """Two service processes sharing one Redis: the first registers the model and
    compiles the request (both stored in Redis), the second -- nothing in memory --
    loads the model and the cached computation from Redis and runs it: Kaldi's numbers."""
    request = json.loads((case / "request.json").read_text())
    url = server.url
    with make_client(redis_url=url) as a:
        r = a.post("/models", json={"text": (case / "model.txt").read_text()})
        assert r.status_code in (200, 201), r.text
        mid = r.json()["model_id"]
        r = a.post("/compile", json={"model_id": mid, "request": request})
        assert r.status_code == 200, r.text
    arrays = np.load(case / "arrays.npz")
    with make_client(redis_url=url) as b:
        r = b.post("/compile", json={"model_id": mid, "request": request})
        assert r.status_code == 200 and r.json()["cached"] is True, r.text   # from Redis
        r = b.post("/compute", json=_compute_body(mid, request, arrays))
        assert r.status_code == 200, r.text
    _check_compute(r.json(), request, arrays, case.name)


@needs_redis
def test_reference_networks_through_the_job_queue(server):
    """NNETC_QUEUE=redis: the API puts each job on the Redis Stream and a worker (with
    services of its own, as a separate process has) registers nothing itself -- it
    loads the model from Redis -- compiles and computes: Kaldi's numbers for every case."""
    from tests.service.test_redis_queue import ThreadWorker, _api  # noqa: PLC0415
    cases = [p.values[0] for p in network_case_params()]
    with _api(server.url) as api, ThreadWorker(server.url):
        for case in cases:
            request = json.loads((case / "request.json").read_text())
            r = api.post("/models", json={"text": (case / "model.txt").read_text()})
            assert r.status_code in (200, 201), r.text
            mid = r.json()["model_id"]
            arrays = np.load(case / "arrays.npz")
            r = api.post("/compute", json=_compute_body(mid, request, arrays))
            assert r.status_code == 200, f"{case.name}: {r.text}"
            _check_compute(r.json(), request, arrays, case.name)


@pytest.mark.parametrize("case", network_case_params())
def test_reference_network_batched(case: Path):
    """Dynamic batching against Kaldi: the case's first sequence alone (the rows of its
    lowest n, renumbered n = 0: nnet3 never mixes sequences, so Kaldi's rows for it are
    the answer), sent as four concurrent jobs that the service merges along n into one
    computation."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415
    request = json.loads((case / "request.json").read_text())
    arrays = np.load(case / "arrays.npz")
    first = min(ix[0] for s in request["outputs"] for ix in s["indexes"])
    sub: dict = {"inputs": [], "outputs": []}
    inputs, want = {}, {}
    for key, part, into in (("inputs", "input", inputs), ("outputs", "output", want)):
        for s in request[key]:
            rows = [i for i, ix in enumerate(s["indexes"]) if ix[0] == first]
            if not rows:
                pytest.skip(f"{s['name']} has no row of sequence {first}")
            sub[key].append({"name": s["name"],
                             "indexes": [[0, *s["indexes"][i][1:]] for i in rows]})
            into[s["name"]] = arrays[f"{part}.{s['name']}"][rows]
    with make_client(max_batch=8, batch_delay_ms=50) as client:
        r = client.post("/models", json={"text": (case / "model.txt").read_text()})
        body = {"model_id": r.json()["model_id"], "request": sub, "encoding": "base64",
                "inputs": {k: _b64(v) for k, v in inputs.items()}}
        # the worker is held by a job of its own until the four are queued behind it:
        # four requests sent at once did not always overlap (on a loaded machine one was
        # sometimes answered before the next arrived, and all four ran alone)
        work = client.app.state.services.queue
        release = threading.Event()
        work.handlers["hold"] = lambda payload: release.wait(60)
        held = work.submit("hold", {})
        deadline = time.monotonic() + 60
        while work.depth() > 0 and time.monotonic() < deadline:    # the worker has it
            time.sleep(0.005)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(client.post, "/compute", json=body) for _ in range(4)]
            deadline = time.monotonic() + 60
            while work.depth() < 4 and time.monotonic() < deadline:
                time.sleep(0.005)
            release.set()
            answers = [f.result() for f in futures]
        held.result(timeout=60)
        sizes = {line.split(" ")[0]: float(line.split(" ")[1])
                 for line in client.get("/metrics").text.splitlines()
                 if line.startswith(("nnetc_batch_size_count", "nnetc_batch_size_sum"))}
    for r in answers:
        assert r.status_code == 200, r.text
        for name, ref in want.items():
            _close(f"{case.name} {name}", decode(r.json()["outputs"][name]), ref)
    # four jobs, fewer batches: at least two of them ran as one computation
    assert sizes["nnetc_batch_size_sum"] == 4 and sizes["nnetc_batch_size_count"] < 4, sizes
