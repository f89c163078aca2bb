"""max_stream_bytes: the memory all open streams of a process may hold together, each
counted at its looped model's estimate (LoopedModel.stream_bytes, checked against
tracemalloc in tests/engine/test_stream_bytes.py) from its open -- or its takeover from
another process -- until it is closed, finished, expires or is dropped; an open beyond
gets the 503 of too many streams, over HTTP and over a WebSocket alike."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest

from schemas.streams import StreamOptions
from service.errors import ServiceError
from service.streams import StreamManager
from tests.engine.inference_nets import TDNN_IVECTOR, TDNN_PLAIN
from tests.service.conftest import make_client, needs_redis

X = np.random.default_rng(3).standard_normal((200, 8)).astype(np.float32)


def _enc(x: np.ndarray) -> dict:
    x = np.ascontiguousarray(x, dtype="<f4")
    return {"shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode()}


def _model(client, config: str = TDNN_PLAIN) -> str:
    r = client.post("/models", json={"config": config, "seed": 1})
    assert r.status_code in (200, 201), r.text
    return r.json()["model_id"]


def _open(client, mid: str, fpc: int = 40):
    return client.post("/streams", json={"model_id": mid,
                                         "options": {"frames_per_chunk": fpc}})


def _streams(client):
    return client.app.state.services.streams


def test_the_budget_refuses_streams_beyond_it_and_every_way_out_gives_it_back():
    with make_client(max_stream_bytes=64 << 20) as c:
        mid, streams = _model(c), _streams(c)
        r = _open(c, mid)
        assert r.status_code == 201, r.text
        one = streams.held_bytes
        a = r.json()["stream_id"]
        assert one > 0
        streams.max_bytes = int(2.5 * one)          # room for two such streams
        b = _open(c, mid).json()["stream_id"]
        assert streams.held_bytes == 2 * one
        r = _open(c, mid)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "TooManyStreams"
        msg = err["message"]
        assert "max_stream_bytes" in msg and f"may hold {one} bytes" in msg
        assert f"streams of this server hold {2 * one}" in msg
        assert streams.held_bytes == 2 * one and len(streams) == 2
        assert f"nnetc_stream_bytes {float(2 * one)}" in c.get("/metrics").text
        # closing one lets a new one open
        assert c.delete(f"/streams/{a}").status_code == 204
        assert streams.held_bytes == one
        a = _open(c, mid).json()["stream_id"]
        # finishing one too
        assert c.post(f"/streams/{b}/frames", json={"features": _enc(X[:50])}).status_code == 200
        assert c.post(f"/streams/{b}/finish").status_code == 200
        assert streams.held_bytes == one
        assert _open(c, mid).status_code == 201
        assert _open(c, mid).status_code == 503
        # and expiring (swept at the next open)
        streams.idle_s = 0
        assert _open(c, mid).status_code == 201
        streams.idle_s = 600
        assert streams.held_bytes == one and len(streams) == 1
        assert c.get(f"/streams/{a}").status_code == 404


def test_a_stream_larger_than_the_whole_budget_is_a_413_naming_frames_per_chunk():
    with make_client(max_stream_bytes=1 << 20) as c:
        mid = _model(c)
        r = _open(c, mid, fpc=5000)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["field"] == "options.frames_per_chunk"
        assert "max_stream_bytes (1048576)" in err["message"]
        assert _streams(c).held_bytes == 0
        assert _open(c, mid, fpc=20).status_code == 201


def test_a_failing_open_leaves_nothing_counted(monkeypatch):
    with make_client() as c:
        streams = _streams(c)
        iv = _model(c, TDNN_IVECTOR)
        r = c.post("/streams", json={"model_id": iv})              # no i-vector given
        assert r.status_code == 422, r.text
        r = c.post("/streams", json={"model_id": iv, "options": {"use_priors": True},
                                     "ivector": [0.0] * 4})        # no priors in a config
        assert r.status_code == 422, r.text
        assert streams.held_bytes == 0 and len(streams) == 0

        def broken(live):
            raise RuntimeError("checkpoint failed")
        monkeypatch.setattr(streams, "_checkpoint", broken)
        assert _open(c, _model(c)).status_code == 500
        assert streams.held_bytes == 0 and len(streams) == 0
        monkeypatch.undo()
        assert _open(c, _model(c)).status_code == 201
        assert streams.held_bytes > 0


@needs_redis
def test_a_takeover_counts_as_an_open_over_http_and_websocket(server):
    """Server b takes over streams opened by a (from their checkpoints): each counts
    against b's budget, a push that would go beyond it gets the 503 of an open -- over a
    WebSocket as the message of that status -- and a's copy of a stream b moved on is
    replaced (not counted twice), and dropped once b finishes it."""
    server.client().flushall()
    with make_client(redis_url=server.url) as a, make_client(redis_url=server.url) as b:
        mid = _model(a)
        _model(b)
        s1, s2 = (_open(a, mid).json()["stream_id"] for _ in range(2))
        one = _streams(a).held_bytes // 2
        assert a.post(f"/streams/{s1}/frames", json={"features": _enc(X[:30]),
                                                    "offset": 0}).status_code == 200
        _streams(b).max_bytes = int(1.5 * one)
        r = b.post(f"/streams/{s1}/frames", json={"features": _enc(X[30:60]), "offset": 30})
        assert r.status_code == 200, r.text                     # taken over
        assert _streams(b).held_bytes == one
        r = b.post(f"/streams/{s2}/frames", json={"features": _enc(X[:30]), "offset": 0})
        assert r.status_code == 503 and r.json()["error"]["type"] == "TooManyStreams"
        assert "max_stream_bytes" in r.json()["error"]["message"]
        with b.websocket_connect(f"/streams/{s2}/ws") as ws:
            ws.send_json({"features": _enc(X[:30]), "offset": 0})
            j = ws.receive_json()
            assert j["status"] == 503 and j["error"]["type"] == "TooManyStreams", j
            assert "max_stream_bytes" in j["error"]["message"]
        assert _streams(b).held_bytes == one and len(_streams(b)) == 1
        # a takes s1 back: its old copy is replaced, not counted again
        assert a.post(f"/streams/{s1}/frames", json={"features": _enc(X[60:90]),
                                                    "offset": 60}).status_code == 200
        assert _streams(a).held_bytes == 2 * one
        # b moves s1 on (replacing its own stale copy) and finishes it: a drops its copy
        # when it next looks
        assert b.post(f"/streams/{s1}/frames", json={"features": _enc(X[90:120]),
                                                    "offset": 90}).status_code == 200
        assert _streams(b).held_bytes == one
        assert b.post(f"/streams/{s1}/finish").status_code == 200
        assert _streams(b).held_bytes == 0
        assert a.get(f"/streams/{s1}").status_code == 404
        assert _streams(a).held_bytes == one
        # with s1 gone from b, s2 can be taken over there, over the WebSocket
        with b.websocket_connect(f"/streams/{s2}/ws") as ws:
            ws.send_json({"features": _enc(X[:30]), "offset": 0})
            j = ws.receive_json()
            assert "error" not in j, j
        assert _streams(b).held_bytes == one


@pytest.mark.parametrize("fpc", [20, 200])
def test_the_counted_figure_is_the_looped_models_estimate(fpc):
    with make_client() as c:
        mid = _model(c)
        assert _open(c, mid, fpc=fpc).status_code == 201
        streams = _streams(c)
        (looped,) = streams._looped.values()
        assert streams.held_bytes == looped.stream_bytes() >= looped.computation.peak_bytes()


def test_opens_at_the_same_time_cannot_both_pass_the_budget(monkeypatch):
    """Admission and entry into the open streams are one step: with room for one more
    stream, of eight opens racing (each slowed down between its admission and its entry,
    where a check-then-act would let them all through) exactly one gets in."""
    with make_client(max_stream_bytes=64 << 20) as c:
        mid, streams = _model(c), _streams(c)
        assert _open(c, mid).status_code == 201
        one = streams.held_bytes
        streams.max_bytes = int(2.5 * one)          # room for one more
        entry = c.app.state.services.registry.get(mid)
        options = StreamOptions(frames_per_chunk=40).model_dump()
        real = StreamManager._admit
        gate = threading.Barrier(8, timeout=10)

        def slow_admit(self, *a, **k):
            out = real(self, *a, **k)
            try:
                gate.wait(0.5)       # all eight admitted at once, were that possible
            except threading.BrokenBarrierError:
                pass
            return out
        monkeypatch.setattr(StreamManager, "_admit", slow_admit)
        results: list = []

        def go():
            try:
                results.append(streams.open({"entry": entry, "options": options,
                                             "ivector": None}))
            except ServiceError as e:
                results.append(e.status)
        threads = [threading.Thread(target=go) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(r if isinstance(r, int) else 201 for r in results) == [201] + [503] * 7
        assert streams.held_bytes == 2 * one and len(streams) == 2

