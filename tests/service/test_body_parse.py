"""Large bodies are parsed in a helper process and large answers written a piece at a
time (service/body_parse.py, service.convert.wire_pieces and msgpack_pieces): the answers
are those of the plain path, and the event loop's process never parses a large body
itself."""

from __future__ import annotations

import base64
import binascii
import json
import math
import random

import msgpack
import numpy as np
import orjson
import pytest
import starlette.requests

from engine.core.finite import as_float32
from schemas.compute import ComputeRequest, ComputeResponse, InferRequest
from schemas.streams import PushRequest
from service import convert
from service.body_parse import (BodyParser, pack_indexes, pack_rows, packed_paths,
                                parse_body)
from tests.service.conftest import TINY_CONFIG, decode, make_client, register, request_for


# -- packing --------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [
    [[1.5, -2.0], [0, 3]],                               # integers are reals
    [[2 ** 53, -(2 ** 53)], [1e39, -1e39]],              # exact integers; float32 overflow
    [[float("nan"), float("inf")]],                      # what json.loads makes of NaN
    [[0.1] * 7] * 3,
])
def test_packed_rows_decode_to_the_values_of_the_rows(rows):
    packed = pack_rows(rows)
    assert packed is not None and packed["shape"] == [len(rows), len(rows[0])]
    got = np.frombuffer(packed["data"], "<f4").reshape(packed["shape"])
    np.testing.assert_array_equal(got, as_float32(rows))


@pytest.mark.parametrize("rows", [
    [], [[]], [[1.0], [2.0, 3.0]],                       # empty, no columns, ragged
    [[1.0, True]], [[1.0, "2"]], [[1.0, None]],          # not numbers: validation says so
    [[2 ** 53 + 1, 0.0]],                                # an integer float64 rounds
    [1.0, 2.0], [[1.0], 2.0], {"shape": [1, 1]}, "rows",
])
def test_rows_that_packing_could_change_are_left_as_sent(rows):
    assert pack_rows(rows) is None


def test_packed_paths_follow_the_body_models():
    request = ("indexes", "request", "inputs", "[]", "indexes"), \
        ("indexes", "request", "outputs", "[]", "indexes")
    assert packed_paths(ComputeRequest) == (*request, ("matrix", "inputs", "*"),
                                            ("matrix", "output_derivs", "*"))
    assert packed_paths(InferRequest) == (("matrix", "features"),
                                          ("matrix", "online_ivectors"))
    assert packed_paths(PushRequest) == (("matrix", "features"),
                                         ("matrix", "online_ivectors"))


def test_packed_indexes_are_the_rows():
    packed = pack_indexes([[0, -5, 0], [1, 2 ** 31 - 1, -(2 ** 31)]])
    assert packed["shape"] == [2, 3]
    assert np.frombuffer(packed["data"], "<i4").tolist() == [0, -5, 0, 1, 2 ** 31 - 1,
                                                              -(2 ** 31)]
    for rows in ([], [[0, 1]], [[0, 1, 2, 3]], [[0, 1.0, 2]], [[0, True, 2]], [[0, 2 ** 31, 0]],
                 [[0, 2 ** 70, 0]], [(0, 1, 2)], [[0, "1", 2]], "rows", [[0, None, 2]]):
        assert pack_indexes(rows) is None, rows


def test_parse_body_packs_only_at_the_paths_and_reports_bad_json_as_fastapi():
    body = json.dumps({"inputs": {"a": [[1.0, 2.0]], "b": [[1, True]]},
                       "request": {"indexes": [[0, 1, 0]]}}).encode()
    kind, value = parse_body(body, (("matrix", "inputs", "*"),))
    assert kind == "ok"
    assert value["inputs"]["a"] == {"shape": [1, 2],
                                    "data": np.float32([1, 2]).astype("<f4").tobytes()}
    assert value["inputs"]["b"] == [[1, True]]
    assert value["request"] == {"indexes": [[0, 1, 0]]}
    assert parse_body(b'{"a": 1,', ()) == ("json_invalid",
                                            "Expecting property name enclosed in double "
                                            "quotes", 8)
    kind, name, _ = parse_body(b"\xff\xfe{", ())
    assert (kind, name) == ("error", "UnicodeDecodeError")


# -- the service, both ways ------------------------------------------------------------------

@pytest.fixture(scope="module")
def clients():
    with make_client() as plain, make_client(parse_offload_bytes=0) as apart:
        mids = [register(c, config=TINY_CONFIG)["model_id"] for c in (plain, apart)]
        assert mids[0] == mids[1]
        yield plain, apart, mids[0]


def _post_raw(client, path: str, body: bytes):
    return client.post(path, content=body, headers={"content-type": "application/json"})


def _bodies(mid: str):
    """Good and bad /compute and /infer bodies, as text (NaN and the like included)."""
    rng = np.random.default_rng(3)
    req = request_for(0, 3)
    x = rng.standard_normal((5, 4))
    good = {"model_id": mid, "request": req, "inputs": {"input": x.tolist()}}
    yield "/compute", json.dumps(good)
    yield "/compute", json.dumps({**good, "encoding": "base64"})
    yield "/compute", json.dumps(good).replace(str(x[1, 2]), "NaN", 1)
    yield "/compute", json.dumps(good).replace(str(x[0, 0]), "1e39", 1)
    yield "/compute", json.dumps(good).replace(str(x[0, 0]), "-Infinity", 1)
    yield "/compute", json.dumps(good).replace(str(x[0, 0]), str(10 ** 30), 1)
    yield "/compute", json.dumps(good).replace(str(x[0, 0]), "true", 1)
    yield "/compute", json.dumps({**good, "inputs": {"input": x[:4].tolist()}})
    yield "/compute", json.dumps({**good, "inputs": {"input": x[:, :3].tolist()}})
    yield "/compute", json.dumps({**good, "inputs": {"input": [[1, 2, 3, 4]] * 5}})
    yield "/compute", json.dumps({**good, "inputs": {"input": x.tolist(), "other": [[1.0]]}})
    yield "/compute", json.dumps({**good, "inputs": {"input": []}})
    yield "/compute", json.dumps({**good, "inputs": {"input": x.tolist()}, "extra": 1})
    for bad in ([[0, 0, 0]] * 5, [[0, t, 0] for t in range(-1, 3)] + [[0, 2 ** 40, 0]],
                [[0, t, 0] for t in range(-1, 3)] + [[0, 9, 0.0]],
                [[0, t, 0] for t in range(-1, 3)] + [[0, True, 0]],
                [[0, t, 0] for t in range(-1, 3)] + [[0, 9]]):
        spec = {**req["inputs"][0], "indexes": bad}
        yield "/compute", json.dumps({**good, "request": {**req, "inputs": [spec]}})
    yield "/compute", json.dumps(good)[:-5]
    yield "/compute", "[" * 5000 + "]" * 5000
    yield "/infer", json.dumps({"model_id": mid, "features": rng.standard_normal((30, 4))
                                .tolist(), "encoding": "json"})
    yield "/infer", json.dumps({"model_id": mid, "features": [[1.0, 2.0]] * 30})


def test_every_body_gets_the_same_answer_parsed_apart(clients):
    plain, apart, mid = clients
    for path, text in _bodies(mid):
        a, b = _post_raw(plain, path, text.encode()), _post_raw(apart, path, text.encode())
        assert (a.status_code, a.content) == (b.status_code, b.content), (path, text[:200])


def test_a_large_body_is_not_parsed_by_the_service_process(clients, monkeypatch):
    """Starlette's request.json() (where FastAPI parses a body) is not called on the
    body: the helper's value was handed over, matrices packed."""
    plain, apart, mid = clients
    seen = []

    class Spy:
        @staticmethod
        def loads(body, *args, **kwargs):
            seen.append(len(body))
            return json.loads(body, *args, **kwargs)
    x = np.random.default_rng(0).standard_normal((5, 4))
    body = json.dumps({"model_id": mid, "request": request_for(0, 3),
                       "inputs": {"input": x.tolist()}}).encode()
    want = _post_raw(plain, "/compute", body)
    monkeypatch.setattr(starlette.requests, "json", Spy)
    got = _post_raw(apart, "/compute", body)
    assert got.status_code == 200 and got.content == want.content
    assert seen == []
    _post_raw(plain, "/compute", body)
    assert seen == [len(body)]          # (the spy does see the plain path's parse)


def test_a_helper_that_dies_is_replaced_and_its_body_still_answered(clients):
    plain, apart, mid = clients
    parser: BodyParser = apart.app.state.services.body_parser
    body = json.dumps({"model_id": mid, "request": request_for(0, 3),
                       "inputs": {"input": np.ones((5, 4)).tolist()}}).encode()
    want = _post_raw(plain, "/compute", body).content
    assert _post_raw(apart, "/compute", body).content == want
    (helper,) = parser._all
    helper.proc.kill()
    helper.proc.wait()
    assert _post_raw(apart, "/compute", body).content == want     # parsed as before
    assert parser._all == []
    assert _post_raw(apart, "/compute", body).content == want     # a new helper
    (new,) = parser._all
    assert new is not helper and new.proc.poll() is None


def test_a_helper_that_cannot_start_leaves_the_body_to_the_event_loop(monkeypatch):
    import service.body_parse as body_parse  # noqa: PLC0415

    def refuse():
        raise OSError("Resource temporarily unavailable")
    monkeypatch.setattr(body_parse, "_Helper", refuse)
    parser = BodyParser(1, 0)
    assert parser._call("json", b"{}", ()) is None and parser._all == []
    with make_client(parse_offload_bytes=0) as c:
        r = c.post("/models", json={"config": TINY_CONFIG, "seed": 1})
        assert r.status_code in (200, 201), r.text


def test_closing_stops_the_helpers():
    parser = BodyParser(2, 0)
    assert parser._call("json", b'{"a": [[1.0]]}', (("matrix", "a"),))[0] == "ok"
    procs = [h.proc for h in parser._all]
    parser.close()
    assert procs and all(p.poll() is not None for p in procs)
    assert not parser.wanted(10) and parser._call("json", b"{}", ()) is None


def test_unauthorized_large_bodies_get_401_before_being_read():
    with make_client(parse_offload_bytes=0, auth_token="s3cret") as c:
        r = _post_raw(c, "/compute", b'{"not json')
        assert r.status_code == 401, r.text
        assert c.app.state.services.body_parser._all == []


# -- answers in pieces ----------------------------------------------------------------------

@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(convert, "_PIECE", 256)
    monkeypatch.setattr(convert, "_B64_PIECE", 12)


@pytest.mark.parametrize("shape", [(0, 3), (1, 1), (3, 5), (40, 7), (200, 3), (9, 64)])
def test_wire_pieces_join_to_the_document(small_pieces, shape):
    a = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    m = ComputeResponse.model_construct(
        computation_id="k", outputs={"o": convert.matrix_to_wire(a, "json", 0)},
        input_derivs={"i": convert.matrix_to_wire(a, "base64", 0),
                      "j": convert.matrix_to_wire(a[:1], "base64", 0)},
        model_gradient=None, component_stats=None)
    pieces = convert.wire_pieces(m, exclude_none=True)
    doc = orjson.loads(b"".join(pieces))
    assert doc["outputs"]["o"] == a.astype(np.float64).tolist()
    i = doc["input_derivs"]["i"]
    assert i["shape"] == list(shape)
    assert i["data"] == base64.b64encode(a.astype("<f4").tobytes()).decode()
    assert b"".join(pieces) == convert.wire_json(m, exclude_none=True)
    packed = convert.msgpack_pieces(m, exclude_none=True)
    assert b"".join(packed) == msgpack.packb(orjson.loads(b"".join(pieces)))
    if a.nbytes > 256:       # in pieces of about 256 bytes, or of one row where longer
        row = len(orjson.dumps(a[:1].astype(np.float64), option=orjson.OPT_SERIALIZE_NUMPY))
        assert len(pieces) > 3 and max(map(len, pieces)) < max(256 * 4, 2 * row)


def test_large_answers_arrive_whole_as_json_and_msgpack(clients, small_pieces):
    plain, apart, mid = clients
    x = np.random.default_rng(2).standard_normal((30, 4))
    body = {"model_id": mid, "features": x.tolist()}
    for enc in ("json", "base64"):
        r = apart.post("/infer", json={**body, "encoding": enc})
        m = apart.post("/infer", json={**body, "encoding": enc},
                       headers={"accept": "application/msgpack"})
        assert r.status_code == m.status_code == 200
        assert int(r.headers["content-length"]) == len(r.content)
        want = decode(r.json()["output"])
        assert want.shape[0] == 30
        np.testing.assert_array_equal(decode(msgpack.unpackb(m.content)["output"]), want)
        # written as msgpack by the route: the bytes of the JSON answer re-encoded
        assert m.headers["content-type"] == "application/msgpack"
        assert m.content == msgpack.packb(orjson.loads(r.content))


# -- base64 a piece at a time ----------------------------------------------------------------

def _verdict(decode_fn, text):
    try:
        return "ok", decode_fn(text)
    except (binascii.Error, ValueError):
        return ("error",)


def test_base64_in_pieces_is_base64(small_pieces):
    """Coding and decoding a piece at a time give what the one-call functions give, for
    every length around the piece size and for corrupted text (characters outside the
    alphabet, padding in the middle, at the piece boundaries and in excess)."""
    rng = random.Random(5)
    text_piece = convert._B64_PIECE // 3 * 4
    for n in list(range(0, 40)) + [60, 61, 62]:
        raw = np.random.default_rng(n).bytes(n)
        text = base64.b64encode(raw).decode()
        assert convert.b64encode(raw) == text
        assert convert.b64decode(text) == raw
        for _ in range(40 if text else 0):
            s = list(text)
            pos = min(len(s) - 1, rng.choice([rng.randrange(len(s)), len(s) - 1, len(s) - 2,
                                              text_piece - 1, text_piece, text_piece + 1]))
            kind = rng.randrange(7)
            if kind == 0:
                s[pos] = "="
            elif kind == 1:
                s[pos] = rng.choice("\n -_.é")
            elif kind == 2:
                del s[pos]
            elif kind == 3:
                s.insert(pos, "=")
            elif kind == 4:
                s += ["="] * rng.randrange(1, 6)
            elif kind == 5:
                s = s[:pos]
            else:
                s[pos:pos] = ["="] * rng.randrange(1, 4)
            bad = "".join(s)
            assert _verdict(convert.b64decode, bad) == \
                _verdict(lambda t: base64.b64decode(t, validate=True), bad), bad
    assert math.isclose(len(convert.b64encode(bytes(1000))), 4 * math.ceil(1000 / 3))


def test_msgpack_answers_with_gradients_and_statistics_are_the_json_re_encoded(clients):
    plain, apart, mid = clients
    x = np.random.default_rng(4).standard_normal((5, 4))
    body = {"model_id": mid, "request": {**request_for(0, 3, deriv=True),
                                         "store_component_stats": True},
            "inputs": {"input": x.tolist()}, "output_derivs": {"output": np.ones((3, 3))
                                                              .tolist()}}
    for client in (plain, apart):
        for enc in ("json", "base64"):
            r = client.post("/compute", json={**body, "encoding": enc})
            m = client.post("/compute", json={**body, "encoding": enc},
                            headers={"accept": "application/msgpack"})
            assert r.status_code == m.status_code == 200, r.text
            assert {"model_gradient", "component_stats"} <= set(r.json())
            assert m.content == msgpack.packb(orjson.loads(r.content))
