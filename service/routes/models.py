"""/models: register (config, Kaldi text or base64 binary), list, info, delete."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from schemas.models import ModelList, ModelResponse, RegisterModelRequest
from service import convert
from service.deps import AUTH, ServicesDep
from service.registry import ModelEntry, decode_model_bytes
from service.routes import blame

router = APIRouter(prefix="/models", tags=["models"], dependencies=AUTH)


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
