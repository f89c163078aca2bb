"""Errors -> HTTP, in one place.

Engine errors (engine.core.errors) are mapped by class; the service raises
``ServiceError`` for what only it knows (unknown id, oversize body, auth).
Every error body is ``{"error": {"type", "message", "field"}}``; ``error_parts`` decides
it, for HTTP responses and WebSocket messages alike.  Anything else
is a 500 whose body carries only a request id; the traceback goes to the log.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.errors import (Cancelled, CheckError, CompilerError, ComponentError, ConfigError,
                                ExecutionError, ModelFormatError, NnetcError,
                                NotComputableError, RequestError, ResourceLimitError,
                                clipped)

log = logging.getLogger("nnetc.service")


class ServiceError(Exception):
    """An error the service itself detects; ``status`` is the HTTP status."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.field = field


def check_answer_size(values: int, limit: int, what: str, field: str) -> None:
    """413 before computing an answer of ``values`` float32 values beyond ``limit`` bytes
    (max_response_bytes: encoding an answer takes several times its size)."""
    if 4 * values > limit:
        raise ServiceError(413, "RequestTooLarge",
                           f"{what} would be {values} float32 values ({4 * values} bytes), "
                           f"more than this service's max_response_bytes ({limit}); ask "
                           f"for less at a time", field)


def not_found(what: str, ident: str, field: str) -> ServiceError:
    return ServiceError(404, "NotFound", f"unknown {what} {clipped(ident)!r}", field)


class FieldError(ServiceError):
    """A request value that is well-formed JSON but unusable (422), naming the field."""

    def __init__(self, field: str, message: str, type_: str = "RequestError"):
        super().__init__(422, type_, f"{field}: {message}", field)


# Engine error class -> status.  Order matters: the first isinstance match wins
# (InferenceError is a RequestError, DimensionError a ComponentError).
_ENGINE_STATUS: list[tuple[type, int]] = [
    (Cancelled, 504),               # past the job's deadline (run_job answers it as one)
    (ResourceLimitError, 413),
    (ConfigError, 400),
    (ModelFormatError, 400),
    (NotComputableError, 422),
    (CompilerError, 422),
    (RequestError, 422),
    (ComponentError, 422),
    (ExecutionError, 422),
    (CheckError, 500),
]


def engine_status(e: NnetcError) -> int:
    for cls, status in _ENGINE_STATUS:
        if isinstance(e, cls):
            return status
    return 500


def error_body(type_: str, message: str, field: str | None = None) -> dict:
    return {"error": {"type": type_, "message": message, "field": field}}


def _respond(status: int, type_: str, message: str, field: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(type_, message, field), status_code=status, headers=headers)


def _field_of(e: NnetcError, request: Request) -> str | None:
    """The request field an engine error is about, when the route recorded it."""
    fld = getattr(request.state, "error_field", None)
    if isinstance(e, ConfigError) and fld is None:
        return "config"
    if isinstance(e, NotComputableError) and fld == "request":
        return "request.outputs"    # what cannot be computed is always an output
    return fld


def _internal(what: str, e: BaseException, **extra) -> tuple[int, str, str, None]:
    ident = uuid.uuid4().hex[:12]
    log.error(what, exc_info=e, extra={"request_id": ident, **extra})
    return 500, "InternalError", f"internal error (id {ident})", None


def error_parts(e: BaseException, field: str | None = None
                ) -> tuple[int, str, str, str | None]:
    """(status, type, message, field) the service answers for ``e``, over HTTP and over a
    WebSocket alike; ``field``: the request field an engine error is about, when known."""
    if isinstance(e, ServiceError):
        return e.status, e.type, e.message, e.field
    if isinstance(e, NnetcError):
        status = engine_status(e)
        if status >= 500:
            return _internal("engine check failed", e)
        return status, type(e).__name__, str(e), field
    if isinstance(e, (RequestValidationError, ValidationError)):
        return (422, "ValidationError", *_validation_message(e.errors()))
    return _internal("internal error", e)


# The members of the wire's unions (schemas.common.Matrix: JSON rows or the encoded form;
# EncodedMatrix.data: text or bytes), which pydantic names in the location of an error
# inside them, one error per member, when a value fits none.
_UNION_TAGS = frozenset({"list[list[float]]", "EncodedMatrix", "str", "bytes",
                         "list[tuple[int, int, int]]", "EncodedIndexes"})
_MATRIX_TAGS = frozenset({"list[list[float]]", "EncodedMatrix"})
_INDEXES_TAGS = frozenset({"list[tuple[int, int, int]]", "EncodedIndexes"})


def _union_at(err: dict, errs: list, start: int) -> int | None:
    """The first position (from ``start``) in ``err``'s location that names a union
    member: one where another error has the same location before it and another member
    there."""
    loc = tuple(err.get("loc", ()))
    for i in range(start, len(loc)):
        if loc[i] in _UNION_TAGS and any(
                len(o["loc"]) > i and tuple(o["loc"][:i]) == loc[:i]
                and o["loc"][i] in _UNION_TAGS and o["loc"][i] != loc[i] for o in errs):
            return i
    return None


def _validation_message(errs: list) -> tuple[str, str | None]:
    """(message, field) for pydantic's errors: the first, named by its dotted location.
    Inside a union it is the error of the member the value came closest to (the deepest
    location: a matrix sent in the encoded form with a wrong dtype is told about its
    dtype, not that it is not a list of rows), the members left out of the location."""
    if not errs:
        return "body: invalid request", None
    first, count, cut, at = errs[0], len(errs), set(), -1
    while (at := _union_at(first, errs, at + 1)) is not None:
        prefix = tuple(first["loc"][:at])
        members = [o for o in errs if len(o["loc"]) > at and tuple(o["loc"][:at]) == prefix
                   and o["loc"][at] in _UNION_TAGS]
        best = max(members, key=lambda o: len(o["loc"]))
        count -= sum(1 for o in members if o["loc"][at] != best["loc"][at])
        first = best
        cut.add(at)
    loc = first.get("loc", ())
    if first.get("type") == "json_invalid":
        where = f" at character {loc[-1]}" if len(loc) > 1 else ""
        error = (first.get("ctx") or {}).get("error")
        return f"body: not valid JSON{where}" + (f" ({error})" if error else ""), None
    if tuple(loc) == ("body",) and first.get("type") == "missing":
        return "body: empty: send a JSON object", None
    if tuple(loc) == ("body",) and first.get("type") == "model_attributes_type":
        given = first.get("input")
        if isinstance(given, (bytes, bytearray)):       # not read as JSON: its content type
            return ("body: expected a JSON object, sent with Content-Type: application/json "
                    "(or msgpack, with Content-Type: application/msgpack)"), None
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null",
                int: "a number", float: "a number"}.get(type(given), type(given).__name__)
        return f"body: expected a JSON object, got {kind}", None
    where = ".".join(str(p) for i, p in enumerate(loc) if p != "body" and i not in cut) or None
    msg = first.get("msg", "invalid request")
    if cut and loc[max(cut)] in _MATRIX_TAGS and len(loc) == max(cut) + 1:
        # a value that is neither form of a matrix
        msg = ('expected a matrix: a list of rows ([[1.0, 2.0], ...]) or {"shape": '
               '[rows, cols], "data": <base64 of little-endian float32>}')
    if cut and loc[max(cut)] in _INDEXES_TAGS and len(loc) == max(cut) + 1:
        msg = ('expected Indexes: a list of [n, t, x] ([[0, 5, 0], ...]) or {"shape": '
               '[rows, 3], "data": <base64 of little-endian int32 n, t, x>}')
    more = f" (and {count - 1} more)" if count > 1 else ""
    return f"{where or 'body'}: {msg}{more}", where


FASTAPI_BODY_ERROR = "There was an error parsing the body"


class BodyReadError(Exception):
    """Why a body could not be read as JSON, as told by the helper process that tried
    (service/body_parse.py): ``kind`` is the exception's class name there."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _unauthorized(request: Request) -> ServiceError | None:
    """The 401 of a request to a route that needs the bearer token and lacks it, or
    None."""
    from service.deps import check_auth, require_auth  # noqa: PLC0415 (deps imports this)
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None or not any(d.call is require_auth for d in dependant.dependencies):
        return None
    try:
        check_auth(request)
    except ServiceError as e:
        return e
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service(request: Request, e: ServiceError):
        return _respond(*error_parts(e))

    @app.exception_handler(NnetcError)
    async def _engine(request: Request, e: NnetcError):
        return _respond(*error_parts(e, _field_of(e, request)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        # FastAPI reads and validates the body before the route's dependencies run:
        # a client without the token learns nothing of the schemas (401 first)
        unauthorized = _unauthorized(request)
        if unauthorized is not None:
            return _respond(*error_parts(unauthorized))
        return _respond(*error_parts(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        unauthorized = _unauthorized(request)
        if unauthorized is not None:
            return _respond(*error_parts(unauthorized))
        cause = e.__cause__
        if e.detail == FASTAPI_BODY_ERROR and cause is not None:
            # FastAPI's answer to a body its JSON parser gave up on (not UTF-8, nested too
            # deeply, an integer too long to read): say why
            kind = getattr(cause, "kind", type(cause).__name__)
            return _respond(400, "BadRequest", f"body: not readable as JSON "
                                               f"({kind}: {cause})"[:500])
        return _respond(e.status_code, "HTTPError", str(e.detail))

    @app.exception_handler(Exception)
    async def _other(request: Request, e: Exception):
        return _respond(*_internal("internal error", e, path=request.url.path))
