"""`nnetc serve` as a subprocess on a free port: /healthz, /readyz and /docs answer, and a
stream runs over a real WebSocket (uvicorn needs a WebSocket library for that, which
Starlette's TestClient in the other tests does not); settings that do not validate are
a usage error naming the variable; a request whose header never ends is cut off."""

from __future__ import annotations

import json
import socket
import time
from contextlib import contextmanager

import httpx
import numpy as np


STREAM_NET = """input-node name=input dim=3
component name=a type=AffineComponent input-dim=6 output-dim=4
component name=r type=RectifiedLinearComponent dim=4
component-node name=a component=a input=Append(Offset(input, -1), Offset(input, 1))
component-node name=r component=r input=a
output-node name=output input=r
"""


def _websocket_stream(base: str) -> None:
    """The same frames through an HTTP stream and a WebSocket stream give the same
    output."""
    from websockets.sync.client import connect
    mid = httpx.post(f"{base}/models", json={"config": STREAM_NET, "seed": 1}).json()["model_id"]
    x = np.random.default_rng(0).standard_normal((30, 3)).round(3).tolist()
    outs = {}
    for how in ("http", "ws"):
        sid = httpx.post(f"{base}/streams", json={"model_id": mid}).json()["stream_id"]
        rows = []
        if how == "http":
            for a in range(0, 30, 10):
                r = httpx.post(f"{base}/streams/{sid}/frames", json={"features": x[a:a + 10]})
                assert r.status_code == 200, r.text
                rows += r.json()["output"]
            rows += httpx.post(f"{base}/streams/{sid}/finish", json={}).json()["output"]
        else:
            with connect(f"ws{base[4:]}/streams/{sid}/ws") as ws:
                for a in range(0, 30, 10):
                    ws.send(json.dumps({"features": x[a:a + 10]}))
                    j = json.loads(ws.recv(timeout=30))
                    assert "error" not in j, j
                    rows += j["output"]
                ws.send(json.dumps({"finish": True}))
                j = json.loads(ws.recv(timeout=30))
                assert j["finished"] is True
                rows += j["output"]
        outs[how] = np.array(rows)
    assert outs["ws"].shape == (30, 4)
    np.testing.assert_array_equal(outs["ws"], outs["http"])


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except OSError:
        return None


def _endless_header_refused(port: int, pid: int) -> None:
    """A request whose header block never ends (8 MiB of one header, sent in 64 KiB pieces)
    is cut off by the server long before the end -- a 4xx answer or the connection
    closed -- and not held in memory; the server answers as before."""
    before = _rss_kib(pid)
    refused = False
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        try:
            for _ in range(128):
                s.sendall(b"a" * 65536)
            s.sendall(b"\r\n\r\n")
            answer = s.recv(64)
            refused = answer == b"" or answer.startswith(b"HTTP/1.1 4")
        except OSError:         # reset or broken pipe: the server closed the connection
            refused = True
    assert refused, "a request with an 8 MiB header was served"
    after = _rss_kib(pid)
    if before is not None and after is not None:
        assert after - before < 4096, f"the server grew by {after - before} KiB"
    assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200


def test_serve_parses_http_with_h11():
    """`nnetc serve` names h11 as uvicorn's HTTP parser (see cli.uvicorn_options: uvicorn's
    httptools protocol, which its default takes when httptools is installed, keeps an
    endless header block in memory)."""
    from service.cli import uvicorn_options
    from service.settings import Settings
    assert uvicorn_options(Settings())["http"] == "h11"


@contextmanager
def _serve(**env_extra):
    """`nnetc serve` in a subprocess on a free port (bench.service.serving), its /healthz
    answering {"status": "ok"}: (port, process)."""
    from bench.service import serving
    with serving(start_timeout_s=30, **env_extra) as (port, proc, first):
        assert first.status_code == 200 and first.json() == {"status": "ok"}
        yield port, proc


def test_nnetc_serve_subprocess():
    with _serve() as (port, proc):
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
        assert "/compile" in httpx.get(f"http://127.0.0.1:{port}/openapi.json").json()["paths"]
        _websocket_stream(f"http://127.0.0.1:{port}")
        _endless_header_refused(port, proc.pid)


def _healthz_status(sock) -> bytes:
    """The status line of a /healthz asked on ``sock``, the whole answer read (b"" if
    the server closed the connection instead)."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(4096)
        if not more:
            return b""
        data += more
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                   if h.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        more = sock.recv(4096)
        if not more:
            break
        body += more
    return head.split(b"\r\n", 1)[0]


def test_max_connections():
    """NNETC_MAX_CONNECTIONS=2: two keep-alive connections are served; a request on a third
    gets 503 and the server closes that connection; the two are served as before."""
    ok, busy = b"HTTP/1.1 200 OK", b"HTTP/1.1 503 Service Unavailable"
    with _serve(NNETC_MAX_CONNECTIONS="2") as (port, _):
        a = socket.create_connection(("127.0.0.1", port), timeout=10)
        b = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            assert _healthz_status(a) == ok and _healthz_status(b) == ok
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                assert _healthz_status(c) == busy
                assert c.recv(1) == b""      # closed by the server
            time.sleep(0.2)                  # (the server's own bookkeeping of the close)
            assert _healthz_status(a) == ok and _healthz_status(b) == ok
        finally:
            a.close()
            b.close()


def test_invalid_settings_are_a_usage_error(monkeypatch):
    """A NNETC_* value that does not validate stops `nnetc serve` and `nnetc worker` with
    exit status 2 and a message naming the variable, its problem and the value given (not
    a traceback); an option given on the command line is named as the option."""
    from click.testing import CliRunner

    from service.cli import main
    monkeypatch.setenv("NNETC_BLAS_THREAD_POLICY", "bogus")
    r = CliRunner().invoke(main, ["serve", "--port", "1"])
    assert r.exit_code == 2
    assert "NNETC_BLAS_THREAD_POLICY" in r.output and "'stable' or 'adaptive'" in r.output
    assert "'bogus'" in r.output and "Traceback" not in r.output
    monkeypatch.delenv("NNETC_BLAS_THREAD_POLICY")
    monkeypatch.setenv("NNETC_MAX_BATCH", "abc")
    r = CliRunner().invoke(main, ["worker"])
    assert r.exit_code == 2 and "NNETC_MAX_BATCH" in r.output and "integer" in r.output
    monkeypatch.delenv("NNETC_MAX_BATCH")
    r = CliRunner().invoke(main, ["serve", "--port", "70000"])
    assert r.exit_code == 2 and "--port" in r.output
