"""One APIRouter per resource."""

from __future__ import annotations

import concurrent.futures
import typing
from contextlib import contextmanager

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel

from engine.core.errors import Cancelled, NnetcError
from service.body_parse import is_json, packed_paths
from service.convert import msgpack_pieces, wire_pieces
from service.deps import check_auth, require_auth
from service.errors import FASTAPI_BODY_ERROR, BodyReadError, ServiceError
from service.middleware import MSGPACK, send_pieces


class ParsedBodyRoute(APIRoute):
    """A route whose large JSON bodies are parsed in a helper process
    (service/body_parse.py), the matrices and Indexes of its body model packed there: the
    parsed value is handed to FastAPI as Starlette's cached ``request.json()``, which
    FastAPI then reads instead of parsing the body itself; a body that is not valid JSON
    is refused as FastAPI refuses it.  A route that needs the bearer token checks it first
    (401 before anything of the body is read, as before)."""

    def get_route_handler(self):
        handle = super().get_route_handler()
        if self.body_field is None:
            return handle
        hints = typing.get_type_hints(self.endpoint)
        paths = tuple(p for name, t in hints.items()
                      if name != "return" and isinstance(t, type) and issubclass(t, BaseModel)
                      for p in packed_paths(t))
        needs_auth = any(d.call is require_auth for d in self.dependant.dependencies)

        async def parse_then_handle(request: Request) -> Response:
            await _parse_large_body(request, paths, needs_auth)
            return await handle(request)
        return parse_then_handle


async def _parse_large_body(request: Request, paths, needs_auth: bool) -> None:
    parser = request.app.state.services.body_parser
    if parser is None or not is_json(request.headers.get("content-type")):
        return
    body = await request.body()
    if not parser.wanted(len(body)):
        return
    if needs_auth:
        check_auth(request)
    result = await parser.parse(body, paths)
    if result is None:
        return                  # the helper died: FastAPI parses it, as before
    if result[0] == "ok":
        request._json = result[1]   # Starlette's cache of request.json()
    elif result[0] == "json_invalid":
        _, msg, pos = result
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", pos),
                                       "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": msg}}], body=body)
    else:
        _, kind, message = result
        raise HTTPException(400, FASTAPI_BODY_ERROR) from BodyReadError(kind, message)


def field_of(e: Exception, default: str, named: tuple[str, ...] = ()) -> str:
    """The request field an engine error is about: the one of ``named`` whose last part
    its message starts with (``"ivector: ..."`` for ``ivector``, ``"use_priors: ..."`` for
    ``options.use_priors``), else ``default``."""
    text = str(e)
    return next((f for f in named if text.startswith(f.rsplit(".", 1)[-1] + ":")), default)


@contextmanager
def blame(request: Request, field: str, named: tuple[str, ...] = ()):
    """Engine errors raised inside are reported against request field ``field``, or
    against the field of ``named`` that their message starts with."""
    try:
        yield
    except NnetcError as e:
        if getattr(request.state, "error_field", None) is None:
            request.state.error_field = field_of(e, field, named)
        raise


class PiecewiseResponse(Response):
    """A Response whose body is a list of pieces (service.convert.wire_pieces), handed
    to the server one at a time: its flow control then holds the next piece until the
    client has read what went before, where one message of the whole answer was copied
    into the socket's buffer in one go (a 107 MB answer held the event loop 0.4 s)."""

    def __init__(self, pieces: list[bytes], media_type: str = "application/json"):
        super().__init__(b"", media_type=media_type)
        self.pieces = pieces
        self.headers["content-length"] = str(sum(map(len, pieces)))

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        await send_pieces(send, self.pieces)


def json_answer(model, exclude_none: bool = False, request: Request | None = None
                ) -> Response:
    """``model`` (a wire model made with ``model_construct``, its JSON-rows matrices as
    arrays: service.convert.wire_json) as the HTTP answer: JSON, or msgpack when
    ``request`` accepts it (written here, the bytes the middleware's re-encoding of the
    JSON gives, without the JSON).  A route returning it skips FastAPI's validation of
    its response model, which such a model would not pass; the route's response_model
    still describes it in the OpenAPI schema."""
    if request is not None and MSGPACK in request.headers.get("accept", "").lower():
        return PiecewiseResponse(msgpack_pieces(model, exclude_none), media_type=MSGPACK)
    return PiecewiseResponse(wire_pieces(model, exclude_none))


def run_job(services, kind: str, payload: dict):
    """Submit a job to the worker and wait for its result (routes are sync and run in
    the thread pool, so waiting here does not block the event loop)."""
    future = services.queue.submit(kind, payload)
    try:
        return future.result(timeout=services.settings.job_timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()      # not started yet: never started; running: stops at its deadline
    except Cancelled:
        pass                 # the worker stopped it at its deadline (service/deadlines.py)
    raise ServiceError(504, "Timeout", f"{kind} job did not finish within "
                                       f"{services.settings.job_timeout_s} s"
                                       + _UNDONE.get(kind, ""))


# the worker undoes a stream push or finish that has not finished by the job's deadline
# (engine Stream.push, service/streams.py); one finished just as the deadline passed (the
# answer on its way) is kept, which a push's offset tells apart
_UNDONE = {
    "stream_push": "; a push not finished by then is undone, the stream left as before it: "
                   "send it again, with its offset (409 OffsetMismatch then says it was "
                   "kept after all)",
    "stream_finish": "; a finish not finished by then is undone, the stream left open: "
                     "finish it again",
}

