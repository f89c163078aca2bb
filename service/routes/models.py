"""/models: register (config, Kaldi text or base64 binary), list, info, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from schemas.models import ModelList, ModelResponse, RegisterModelRequest
from service import convert
from service.deps import AUTH, ServicesDep
from service.errors import FieldError
from service.registry import ModelEntry, decode_model_bytes
from service.routes import ParsedBodyRoute, blame

router = APIRouter(route_class=ParsedBodyRoute, prefix="/models", tags=["models"],
                   dependencies=AUTH)


def _response(entry: ModelEntry, created: bool) -> ModelResponse:
    return ModelResponse(model_id=entry.model_id, structure_hash=entry.structure_hash,
                         name=entry.name, created=created, info=convert.model_info(entry.info))


@router.post("", response_model=ModelResponse, status_code=200,
             responses={201: {"model": ModelResponse}})
def register_model(body: RegisterModelRequest, services: ServicesDep, request: Request,
                   response: Response) -> ModelResponse:
    data, field = decode_model_bytes(body.config, body.text, body.binary_b64)
    with blame(request, field):
        entry, created = services.registry.register(data, field, body.name, body.seed)
    response.status_code = 201 if created else 200
    return _response(entry, created)


def _upload_kind(data: bytes) -> str:
    """How to read an uploaded file: "upload" for a Kaldi model, binary ("\\0B" then a
    token) or text (``<Nnet3>``/``<TransitionModel>``; the model reader tells the two
    apart), else "config" for an nnet3 config."""
    if data.startswith(b"\0B") or data[:256].lstrip().startswith((b"<Nnet3>",
                                                                    b"<TransitionModel>")):
        return "upload"
    return "config"


@router.post("/upload", response_model=ModelResponse, status_code=200,
             responses={201: {"model": ModelResponse}},
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string",
                                                         "format": "binary"}}}}})
async def upload_model(request: Request, services: ServicesDep, response: Response,
                       name: Annotated[str | None, Query(max_length=200)] = None,
                       seed: Annotated[int | None, Query(ge=0)] = None) -> ModelResponse:
    """Register a model file sent as the raw request body (``Content-Type:
    application/octet-stream``): a Kaldi binary or text model (.raw/.mdl) or a config,
    told apart by their first bytes; ``seed`` for a config's random parameters.  The id is
    the one the JSON registration of the same bytes gives."""
    data = await request.body()
    if not data:
        raise FieldError("body", "empty: send the bytes of the model file")
    kind = _upload_kind(data)
    if kind == "config":
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise FieldError("body", "neither a Kaldi model (binary or text) nor a UTF-8 "
                                     "config") from None
    with blame(request, "body"):
        entry, created = await run_in_threadpool(services.registry.register, data, kind, name,
                                                  seed)
    response.status_code = 201 if created else 200
    return _response(entry, created)


@router.get("", response_model=ModelList)
def list_models(services: ServicesDep) -> ModelList:
    return ModelList(models=[_response(e, False) for e in services.registry.list()])


@router.get("/{model_id}", response_model=ModelResponse)
def get_model(model_id: str, services: ServicesDep) -> ModelResponse:
    return _response(services.registry.get(model_id), False)


@router.delete("/{model_id}", status_code=204)
def delete_model(model_id: str, services: ServicesDep) -> Response:
    services.registry.delete(model_id)
    return Response(status_code=204)
