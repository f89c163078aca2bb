"""/healthz (the process answers), /readyz (the worker runs), /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response

from service.deps import ServicesDep
from service.errors import ServiceError
from service.metrics import CONTENT_TYPE

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict:
    # a coroutine: it answers from the event loop even when every thread of FastAPI's
    # pool is taken by requests waiting for their computations
    return {"status": "ok"}


@router.get("/readyz")
def readyz(services: ServicesDep) -> dict:
    if not (services.ready and services.queue.alive()):
        what = ("no worker process is running (start `nnetc worker`)"
                if hasattr(services.queue, "workers") else "the worker is not running")
        raise ServiceError(503, "NotReady", what)
    out = {"status": "ready", "queue_depth": services.queue.depth(),
           "cached_computations": len(services.cache),
           "models": len(services.registry.list()), "cache": "memory"}
    if hasattr(services.queue, "workers"):
        out["workers"] = services.queue.workers()
    ping = getattr(services.cache, "ping", None)
    if ping is not None:
        # Redis only speeds compiles up: the service is ready without it, and says so
        out["cache"] = "redis" if ping() else "memory (redis unavailable)"
    return out


@router.get("/metrics")
def metrics(services: ServicesDep) -> Response:
    services.metrics.queue_depth.set(services.queue.depth())
    return Response(services.metrics.render(), media_type=CONTENT_TYPE)
