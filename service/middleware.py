"""ASGI middleware around the whole app: body-size limit (413), msgpack bodies,
request timing (Prometheus + one structured log line per request).

msgpack: a request with ``Content-Type: application/msgpack`` is decoded and
handed to the routes as JSON (raw ``bytes`` values become base64 strings, which
is what the matrix ``data`` field expects), so routes, validation and the
OpenAPI schema are the same for both content types; a request with ``Accept:
application/msgpack`` gets its JSON response re-encoded as msgpack (the routes that
answer with matrices write msgpack themselves: service.routes.json_answer).  Large
bodies and answers are converted by the helper processes of service/body_parse.py,
not in the event loop.
"""

from __future__ import annotations

import logging
import re
import time

import msgpack
import orjson

from service.body_parse import json_to_msgpack, msgpack_to_json
from service.errors import error_body

MSGPACK = "application/msgpack"
log = logging.getLogger("nnetc.access")
# a JSON escape of a UTF-16 surrogate: legal JSON, but alone (not a high one followed by a
# low one) it is no character, and no text made of it can be encoded (UTF-8, a hash, a
# Redis key, an error message)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate(body: bytes) -> str | None:
    """Why a JSON body is unusable because of a lone surrogate escape, or None (no such
    escape, or the body is malformed for another reason: left to the routes' parser)."""
    if _SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if "surrogate" in str(e):
            return str(e)
    return None


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


# an answer is handed to the server this many bytes at a time: the server's flow control
# then holds the rest until the client has read what went before, where one message of the
# whole answer was copied into the socket's buffer in one go (a 107 MB answer held the
# event loop 0.4 s, every other client waiting)
ANSWER_PIECE = 1 << 20


async def send_body(send, body: bytes) -> None:
    """``body`` as the answer's body messages, ``ANSWER_PIECE`` bytes each."""
    view = memoryview(body)
    await send_pieces(send, [bytes(view[at:at + ANSWER_PIECE])
                             for at in range(0, len(body), ANSWER_PIECE)])


async def send_pieces(send, pieces: list[bytes]) -> None:
    """``pieces`` as the answer's body messages, one each (an empty body for none)."""
    last = len(pieces) - 1
    for k, piece in enumerate(pieces):
        await send({"type": "http.response.body", "body": piece, "more_body": k < last})
    if not pieces:
        await send({"type": "http.response.body", "body": b""})


async def _send_json(send, status: int, body: dict, msgpack_out: bool) -> None:
    data = msgpack.packb(body) if msgpack_out else orjson.dumps(body)
    ctype = MSGPACK if msgpack_out else "application/json"
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype.encode()),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class WireMiddleware:
    def __init__(self, app, max_body_bytes: int, metrics, arrivals=None, parser=None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        # large msgpack bodies and answers are converted by its helper processes
        # (service.body_parse.BodyParser), not in the event loop
        self.parser = parser
        # requests of the batched kinds in flight, for the worker's batching
        # (service.worker.Arrivals)
        self.arrivals = arrivals

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        state = {"status": 500}
        kind = (self.arrivals.kind_of(scope["method"], scope["path"])
                if self.arrivals is not None else None)
        if kind is not None:
            self.arrivals.enter(kind)
        try:
            await self._handle(scope, receive, send, state)
        finally:
            if kind is not None:
                self.arrivals.leave(kind)
            seconds = time.perf_counter() - t0
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.metrics.request_latency.labels(route=path, method=scope["method"],
                                                status=str(state["status"])).observe(seconds)
            log.info("request", extra={"method": scope["method"], "path": scope["path"],
                                       "route": path, "status": state["status"],
                                       "ms": round(seconds * 1000.0, 3)})

    async def _convert(self, op: str, convert, data: bytes) -> tuple:
        """``convert(data)``: in a helper process when ``data`` is large, else here."""
        if self.parser is not None and self.parser.wanted(len(data)):
            result = await self.parser.call(op, data)
            if result is not None:
                return result
        return convert(data)

    async def _handle(self, scope, receive, send, state):
        outer = scope
        headers = _headers(scope)
        msgpack_out = MSGPACK in headers.get("accept", "").lower()
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            state["status"] = 413
            await _send_json(send, 413, error_body(
                "PayloadTooLarge", f"request body of {declared} bytes exceeds the limit of "
                                   f"{self.max_body_bytes} bytes"), msgpack_out)
            return
        body = b""
        if scope["method"] in ("POST", "PUT", "PATCH"):
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    state["status"] = 413
                    await _send_json(send, 413, error_body(
                        "PayloadTooLarge", f"request body exceeds the limit of "
                                           f"{self.max_body_bytes} bytes"), msgpack_out)
                    return
                chunks.append(chunk)
                more = message.get("more_body", False)
            body = b"".join(chunks)
            # media types are case-insensitive (RFC 9110)
            if headers.get("content-type", "").split(";")[0].strip().lower() == MSGPACK:
                converted = await self._convert("msgpack_to_json", msgpack_to_json, body)
                if converted[0] != "ok":
                    state["status"] = 400
                    await _send_json(send, 400, error_body("BadRequest", converted[1]),
                                     msgpack_out)
                    return
                body = converted[1]
                scope = dict(scope)
                scope["headers"] = [(k, v) for k, v in scope["headers"]
                                    if k.lower() not in (b"content-type", b"content-length")]
                scope["headers"] += [(b"content-type", b"application/json"),
                                     (b"content-length", str(len(body)).encode())]
            elif "json" in headers.get("content-type", "json").lower():
                why = lone_surrogate(body)
                if why is not None:
                    state["status"] = 422
                    await _send_json(send, 422, error_body(
                        "ValidationError", f"body: a string holds a lone UTF-16 surrogate "
                                           f"escape, which is no character ({why})"),
                        msgpack_out)
                    return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        start: dict = {}
        parts: list[bytes] = []

        async def capture(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                ctype = dict(message.get("headers", [])).get(b"content-type", b"")
                if msgpack_out and ctype.startswith(b"application/json"):
                    start.update(message)
                    return
            elif message["type"] == "http.response.body" and start:
                parts.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                joined = b"".join(parts)
                converted = await self._convert("json_to_msgpack", json_to_msgpack, joined)
                data = (converted[1] if converted[0] == "ok"
                        else msgpack.packb(orjson.loads(joined)))   # (raises as it did)
                hdrs = [(k, v) for k, v in start.get("headers", [])
                        if k.lower() not in (b"content-type", b"content-length")]
                hdrs += [(b"content-type", MSGPACK.encode()),
                         (b"content-length", str(len(data)).encode())]
                await send({**start, "headers": hdrs})
                await send_body(send, data)
                return
            await send(message)

        await self.app(scope, replay, capture)
        if scope is not outer and "route" in scope:
            outer["route"] = scope["route"]   # for the metric label
