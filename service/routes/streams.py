"""/streams: online inference over HTTP and WebSocket (service/streams.py).

    POST   /streams                  open (model, options, i-vector or online i-vector
                                     period) -> 201 StreamInfo
    GET    /streams/{id}             StreamInfo
    POST   /streams/{id}/frames      push frames -> the output rows now computable
    POST   /streams/{id}/finish      flush the right edge -> the last rows; the stream ends
    DELETE /streams/{id}             close without finishing -> 204
    WS     /streams/{id}/ws          the same pushes and finish as JSON messages
"""

from __future__ import annotations

import json
import secrets

from fastapi import APIRouter, Request, Response, WebSocket, WebSocketDisconnect
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from engine.core.errors import NnetcError
from engine.core.finite import as_float32, non_finite
from engine.core.index import INT32_MAX
from schemas.streams import (FinishRequest, OpenStreamRequest, PushRequest, StreamInfo,
                             StreamOptions, StreamOutput)
from service import convert
from service.convert import wire_json
from service.deps import AUTH, ServicesDep
from service.errors import FieldError, ServiceError, error_body, error_parts
from service.middleware import lone_surrogate
from service.routes import ParsedBodyRoute, blame, field_of, json_answer, run_job
from service.streams import chunk_bound

router = APIRouter(route_class=ParsedBodyRoute, tags=["streams"])


def stream_info(summary: dict) -> StreamInfo:
    return StreamInfo(**{**summary, "options": StreamOptions(**summary["options"])})


def _vector(v, field: str):
    if v is None:
        return None
    a = as_float32(v)
    bad = non_finite(a)
    if bad:
        raise ServiceError(422, "RequestError", f"{field}: {bad}", field)
    return a


def _output(services, result, encoding: str) -> StreamOutput:
    out, first, summary = result
    return StreamOutput.model_construct(
        output=convert.matrix_to_wire(out, encoding, services.settings.base64_threshold),
        first_frame=int(first), frames_received=int(summary["frames_received"]),
        frames_output=int(summary["frames_output"]), finished=bool(summary["finished"]))


# a push's offset counts frames: beyond this no stream has received that many (and the
# value would not fit the 64-bit integers of a job on the Redis queue)
_MAX_OFFSET = 2 ** 63 - 1


def _push_payload(services, sid: str, body: PushRequest) -> dict:
    if body.offset is not None and body.offset > _MAX_OFFSET:
        raise FieldError("offset", f"{body.offset} is more than any stream receives "
                                   f"(at most {_MAX_OFFSET})")
    features = convert.matrix_from_wire(body.features, "features")
    limit = services.settings.max_request_indexes
    if features.shape[0] > limit:
        raise ServiceError(413, "RequestTooLarge",
                           f"{features.shape[0]} frames in one push is more than this "
                           f"service's max_request_indexes ({limit}): push them in pieces",
                           "features")
    online = None
    if body.online_ivectors is not None:
        online = convert.matrix_from_wire(body.online_ivectors, "online_ivectors")
        if online.shape[0] > limit:
            raise ServiceError(413, "RequestTooLarge",
                               f"{online.shape[0]} i-vector rows in one push is more than this "
                               f"service's max_request_indexes ({limit})", "online_ivectors")
    return {"stream_id": sid, "features": features, "offset": body.offset,
            "ivector": _vector(body.ivector, "ivector"), "online_ivectors": online}


# request fields the engine's stream errors name at the start of their message
_NAMED_FIELDS = ("online_ivector_period", "online_ivectors", "ivector", "options.use_priors",
                 "options.acoustic_scale", "options.frames_per_chunk",
                 "options.frame_subsampling_factor", "options.extra_left_context_initial")


@router.post("/streams", response_model=StreamInfo, status_code=201, dependencies=AUTH)
def open_stream(body: OpenStreamRequest, services: ServicesDep, request: Request) -> StreamInfo:
    entry = services.registry.get(body.model_id)
    period = body.online_ivector_period
    if period is not None and period > INT32_MAX:    # Kaldi's ivector period is an int32
        raise FieldError("online_ivector_period", f"must be at most {INT32_MAX}, got {period}")
    # bounded before the worker compiles anything
    chunk_bound(entry.model.nnet, body.options.model_dump(),
                services.settings.max_request_indexes,
                recurrent_limit=services.settings.max_recurrent_chunk_frames)
    with blame(request, "options", _NAMED_FIELDS):
        summary = run_job(services, "stream_open", {
            "entry": entry, "options": body.options.model_dump(),
            "ivector": _vector(body.ivector, "ivector"),
            "online_ivector_period": body.online_ivector_period})
    return stream_info(summary)


@router.get("/streams/{stream_id}", response_model=StreamInfo, dependencies=AUTH)
def get_stream(stream_id: str, services: ServicesDep) -> StreamInfo:
    return stream_info(run_job(services, "stream_info", {"stream_id": stream_id}))


@router.post("/streams/{stream_id}/frames", response_model=StreamOutput, dependencies=AUTH)
def push_frames(stream_id: str, body: PushRequest, services: ServicesDep,
                request: Request) -> Response:
    payload = _push_payload(services, stream_id, body)
    with blame(request, "features", _NAMED_FIELDS):
        result = run_job(services, "stream_push", payload)
    return json_answer(_output(services, result, body.encoding), request=request)


@router.post("/streams/{stream_id}/finish", response_model=StreamOutput, dependencies=AUTH)
def finish_stream(stream_id: str, services: ServicesDep, request: Request,
                  body: FinishRequest | None = None) -> Response:
    with blame(request, "stream_id", _NAMED_FIELDS):
        result = run_job(services, "stream_finish", {"stream_id": stream_id})
    return json_answer(_output(services, result, (body or FinishRequest()).encoding),
                       request=request)


@router.delete("/streams/{stream_id}", status_code=204, dependencies=AUTH)
def close_stream(stream_id: str, services: ServicesDep) -> Response:
    run_job(services, "stream_close", {"stream_id": stream_id})
    return Response(status_code=204)


# -- WebSocket ---------------------------------------------------------------------------------

def _ws_authorized(ws: WebSocket, token: str | None) -> bool:
    if not token:
        return True
    scheme, _, given = ws.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(),
                                                                 token.encode())


def _ws_error(e: Exception, field: str | None = None) -> dict:
    """The error message a WebSocket client gets: the body and status HTTP would give
    (``field``: what an engine error is blamed on, as the HTTP route does)."""
    status, type_, message, field = error_parts(e, field)
    return {**error_body(type_, message, field), "status": status}


async def _receive_json(ws: WebSocket):
    """The client's next message, parsed; ValueError for one that is not JSON text (a
    binary message included)."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    if message.get("text") is None:
        raise ValueError("not a text message")
    why = lone_surrogate(message["text"].encode())
    if why is not None:
        raise ValueError(f"a string holds a lone UTF-16 surrogate escape, which is no "
                         f"character ({why})")
    try:
        return json.loads(message["text"])
    except RecursionError:           # nested deeper than the parser goes: not usable JSON
        raise ValueError("nested too deeply") from None


@router.websocket("/streams/{stream_id}/ws")
async def stream_ws(ws: WebSocket, stream_id: str) -> None:
    """Messages from the client: a PushRequest (``{"features": ..., "offset": ...}``)
    or ``{"finish": true, "encoding": ...}``; each is answered with a StreamOutput, or
    with ``{"error": {...}, "status": <the HTTP status it would have>}`` (the socket
    stays open).  After the finish the server closes the socket (code 1000)."""
    services = ws.app.state.services
    if not _ws_authorized(ws, services.settings.auth_token):
        await ws.close(code=1008, reason="missing or invalid bearer token")
        return
    await ws.accept()
    try:
        while True:
            message = await _receive_json(ws)
            blamed = None
            try:
                if not isinstance(message, dict):
                    raise ServiceError(422, "RequestError", "a message must be a JSON object")
                if "finish" in message:
                    if message["finish"] is not True:
                        raise ServiceError(422, "RequestError",
                                           f"finish: must be true, got "
                                           f"{json.dumps(message['finish'])[:100]} (a push has no "
                                           f"finish field)", "finish")
                    extra = set(message) - {"finish", "encoding"}
                    if extra:
                        raise ServiceError(422, "RequestError",
                                           f"unknown fields in a finish message: {sorted(extra)}",
                                           sorted(extra)[0])
                    fin = FinishRequest(**{k: v for k, v in message.items() if k != "finish"})
                    blamed = "stream_id"     # engine errors: as finish_stream blames them
                    result = await run_in_threadpool(run_job, services, "stream_finish",
                                                     {"stream_id": stream_id})
                    await ws.send_text(
                        wire_json(_output(services, result, fin.encoding)).decode())
                    await ws.close(code=1000)
                    return
                body = PushRequest.model_validate(message)
                payload = _push_payload(services, stream_id, body)
                blamed = "features"          # engine errors: as push_frames blames them
                result = await run_in_threadpool(run_job, services, "stream_push", payload)
                await ws.send_text(wire_json(_output(services, result, body.encoding)).decode())
            except (ServiceError, ValidationError, NnetcError) as e:
                await ws.send_json(_ws_error(e, field_of(e, blamed, _NAMED_FIELDS)
                                             if blamed else None))
    except WebSocketDisconnect:
        return
    except ValueError as e:   # not JSON
        await ws.send_json(_ws_error(ServiceError(400, "BadMessage",
                                                  f"messages must be JSON text ({e})"[:300])))
        await ws.close(code=1003)
