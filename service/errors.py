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

from engine.core.errors import (CheckError, ComponentError, ConfigError, ExecutionError,
                                ModelFormatError, NnetcError, NotComputableError, RequestError,
                                ResourceLimitError)

log = logging.getLogger("nnetc.service")


class ServiceError(Exception):
    """An error the service itself detects; ``status`` is the HTTP status."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.field = field


def not_found(what: str, ident: str, field: str) -> ServiceError:
    return ServiceError(404, "NotFound", f"unknown {what} {ident!r}", field)


class FieldError(ServiceError):
    """A request value that is well-formed JSON but unusable (422), naming the field."""

    def __init__(self, field: str, message: str, type_: str = "RequestError"):
        super().__init__(422, type_, f"{field}: {message}", field)


# Engine error class -> status.  Order matters: the first isinstance match wins
# (InferenceError is a RequestError, DimensionError a ComponentError).
_ENGINE_STATUS: list[tuple[type, int]] = [
    (ResourceLimitError, 413),
    (ConfigError, 400),
    (ModelFormatError, 400),
    (NotComputableError, 422),
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
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        return 422, "ValidationError", f"{where or 'body'}: {msg}{more}", where
    return _internal("internal error", e)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service(request: Request, e: ServiceError):
        return _respond(*error_parts(e))

    @app.exception_handler(NnetcError)
    async def _engine(request: Request, e: NnetcError):
        return _respond(*error_parts(e, _field_of(e, request)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return _respond(*error_parts(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return _respond(e.status_code, "HTTPError", str(e.detail))

    @app.exception_handler(Exception)
    async def _other(request: Request, e: Exception):
        return _respond(*_internal("internal error", e, path=request.url.path))
