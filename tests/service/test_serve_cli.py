"""`nnetc serve` as a subprocess on a free port: /healthz, /readyz and /docs answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nnetc_serve_subprocess():
    port = _free_port()
    env = {**os.environ, "NNETC_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--host",
                             "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read().decode(errors="replace") if proc.poll() else ""
                    raise AssertionError(f"server did not come up: {out[-2000:]}")
                time.sleep(0.1)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
        assert "/compile" in httpx.get(f"http://127.0.0.1:{port}/openapi.json").json()["paths"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
