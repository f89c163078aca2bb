"""max_recurrent_chunk_frames: a chunk of a network with recurrence is compiled frame by
frame (about 7 ms a frame for a fast LSTM on one core), so a stream or /infer asking for
very long chunks -- frames_per_chunk 12000, or frame_subsampling_factor 9000 rounding a
chunk up to 9000 frames -- held the one worker for minutes while every other client
waited.  Such chunks get a 413 naming the option that made them long, before anything is
compiled; networks without recurrence are not bound by it."""

from __future__ import annotations

import numpy as np

from tests.engine.inference_nets import RECURRENT, TDNN_PLAIN
from tests.service.conftest import encode, make_client

X = np.random.default_rng(5).standard_normal((300, 8)).astype(np.float32)


def _model(client, config: str) -> str:
    r = client.post("/models", json={"config": config, "seed": 1})
    assert r.status_code in (200, 201), r.text
    return r.json()["model_id"]


def _refused(r, field: str) -> str:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["type"] == "RequestTooLarge" and err["field"] == f"options.{field}", err
    assert "max_recurrent_chunk_frames (64)" in err["message"], err
    return err["message"]


def test_long_chunks_of_a_recurrent_network_are_refused_naming_the_option():
    with make_client(max_recurrent_chunk_frames=64) as c:
        rnn, tdnn = _model(c, RECURRENT), _model(c, TDNN_PLAIN)
        msg = _refused(c.post("/streams", json={"model_id": rnn,
                                                "options": {"frames_per_chunk": 100}}),
                       "frames_per_chunk")
        assert "frames_per_chunk 100: chunks of 100 frames" in msg
        _refused(c.post("/streams", json={"model_id": rnn, "options": {
            "frames_per_chunk": 20, "frame_subsampling_factor": 90}}),
            "frame_subsampling_factor")
        _refused(c.post("/infer", json={"model_id": rnn, "features": encode(X),
                                        "encoding": "base64",
                                        "options": {"frames_per_chunk": 100}}),
                 "frames_per_chunk")
        assert len(c.app.state.services.streams) == 0
        # within the bound, and any length without recurrence
        assert c.post("/streams", json={"model_id": rnn,
                                        "options": {"frames_per_chunk": 64}}).status_code == 201
        assert c.post("/streams", json={"model_id": tdnn,
                                        "options": {"frames_per_chunk": 200}}).status_code == 201
        r = c.post("/infer", json={"model_id": tdnn, "features": encode(X),
                                   "encoding": "base64", "options": {"frames_per_chunk": 200}})
        assert r.status_code == 200, r.text
        r = c.post("/infer", json={"model_id": rnn, "features": encode(X),
                                   "encoding": "base64", "options": {"frames_per_chunk": 50}})
        assert r.status_code == 200, r.text
