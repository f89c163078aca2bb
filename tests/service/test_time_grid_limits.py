"""A config the compiler cannot compute for a few frames without a grid of billions of
rows (restricted attention with time-stride=2147483647: a 400-byte registration that
took a server to 48 GiB and a 500) registers -- it is a legal Kaldi config -- and its
compile is a 413 naming the component, with nothing allocated; the server goes on."""

from __future__ import annotations

from tests.service.conftest import make_client

CONFIG = """input-node name=input dim=8
component name=affine type=AffineComponent input-dim=8 output-dim=16
component-node name=affine component=affine input=input
component name=attention type=RestrictedAttentionComponent num-heads=1 key-dim=4 \
value-dim=4 time-stride=2147483647 num-left-inputs=3 num-right-inputs=0 \
num-left-inputs-required=0 num-right-inputs-required=0 output-context=true
component-node name=attention component=attention input=affine
output-node name=output input=attention
"""
REQUEST = {"inputs": [{"name": "input", "indexes": [[0, t, 0] for t in range(4)]}],
           "outputs": [{"name": "output", "indexes": [[0, t, 0] for t in range(2)]}]}


def test_a_time_stride_beyond_all_frames_is_a_413_naming_the_component():
    with make_client() as c:
        r = c.post("/models", json={"config": CONFIG, "seed": 1})
        assert r.status_code == 201, r.text
        mid = r.json()["model_id"]
        for path in ("/compile", "/compute"):
            body = {"model_id": mid, "request": REQUEST}
            if path == "/compute":
                body["inputs"] = {"input": [[0.0] * 8] * 4}
            r = c.post(path, json=body)
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert "'attention' (RestrictedAttentionComponent)" in err["message"], err
            assert "greatest common step of 1" in err["message"]
        # nothing was kept and the server answers the next request
        assert c.get("/readyz").json()["cached_computations"] == 0
        small = dict(REQUEST, outputs=[{"name": "output", "indexes": [[0, 0, 0]]}])
        r = c.post("/models", json={"config": CONFIG.replace("2147483647", "1"), "seed": 1})
        r = c.post("/compile", json={"model_id": r.json()["model_id"], "request": small})
        assert r.status_code == 200, r.text
