"""Dependencies of the routes, as ``Annotated`` aliases."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from service.errors import ServiceError
from service.settings import Settings


class Services:
    """What the app's lifespan builds and the routes use (on ``app.state.services``)."""

    def __init__(self, settings, registry, cache, queue, operations, metrics, streams=None,
                 body_parser=None):
        self.settings = settings
        self.registry = registry
        self.cache = cache
        self.queue = queue
        self.operations = operations
        self.metrics = metrics
        self.streams = streams          # service.streams.StreamManager
        self.body_parser = body_parser  # service.body_parse.BodyParser
        self.ready = False


# The dependencies are coroutines although they never wait: FastAPI runs a plain
# function dependency in its thread pool, a hop to a worker thread and back (110 us
# median on a 2-core machine) for each dependency of each request; a coroutine runs in
# the event loop at once.


async def get_services(request: Request) -> Services:
    return request.app.state.services


async def get_settings(request: Request) -> Settings:
    return request.app.state.services.settings


async def require_auth(request: Request) -> None:
    """Bearer-token check when the settings carry a token (``check_auth``)."""
    check_auth(request)


def check_auth(request: Request) -> None:
    """Raise 401 unless the request carries the settings' bearer token (none set: any
    request passes)."""
    token = request.app.state.services.settings.auth_token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(),
                                                                 token.encode()):
        raise ServiceError(401, "Unauthorized", "missing or invalid bearer token",
                           "Authorization")


ServicesDep = Annotated[Services, Depends(get_services)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
AUTH = [Depends(require_auth)]
