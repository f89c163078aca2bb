"""The FastAPI application factory (LRU cache, or Redis behind it with ``redis_url``;
one worker thread).

``create_app(settings)`` wires settings -> registry, cache, queue, worker,
metrics, routes and middleware; the lifespan starts and stops the worker.
OpenAPI: ``/openapi.json`` always; ``/docs`` (Swagger UI) is served from the
assets of the ``swagger-ui-bundle`` package when it is installed (no CDN), and
is left out otherwise.
"""

from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager

import redis

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html

from engine.core import sgemm
from engine.optimizer import native
from engine.runtime import blas, parallel
from engine.runtime.backend import get_backend
from service import cpu_limit, logs
from service.body_parse import BodyParser
from service.cache import LRUComputationCache
from service.deps import Services
from service.errors import install_error_handlers
from service.metrics import Metrics
from service.middleware import WireMiddleware
from service.operations import Operations
from service.redis_cache import RedisComputationCache
from service.redis_queue import RedisJobQueue
from service.redis_registry import RedisModelRegistry
from service.registry import InProcessRegistry
from service.routes import compile as compile_routes
from service.routes import compute, health, infer, models
from service.routes import streams as stream_routes
from service.settings import Settings
from service.streams import NoStreamStore, RedisStreamStore, StreamManager
from service.worker import Arrivals, InProcessQueue, job_batchers, job_handlers

log = logging.getLogger("nnetc.service")

_DOCS_STATIC = "/docs/static"


def _swagger_path() -> str | None:
    try:
        from swagger_ui_bundle import swagger_ui_path  # noqa: PLC0415
    except ImportError:
        return None
    return str(swagger_ui_path)


def build_services(settings: Settings) -> Services:
    metrics = Metrics()
    backend = get_backend(settings.backend)
    # the BLAS thread policy (process-wide, as the BLAS thread count is); the products'
    # speed depends on NumPy's BLAS and on environment overrides of its kernel choice:
    # say which, in the log and in /metrics (nnetc_blas_info)
    parallel.set_thread_policy(settings.blas_thread_policy)
    native.set_enabled(settings.native)
    sgemm.set_enabled(settings.own_products)
    libraries = blas.blas_libraries()
    metrics.set_blas(libraries, blas.blas_environment(os.environ), parallel.thread_policy())
    log.info(f"{blas.describe(os.environ)}; thread policy {parallel.thread_policy()}")
    if settings.backend == "numpy":
        # a container's CPU quota does not shrink OpenBLAS's thread pool
        warning = cpu_limit.blas_threads_over_quota(
            libraries[0].get("threads") if libraries else None, cpu_limit.cpu_quota())
        if warning:
            log.warning(warning)
    if settings.redis_url:
        client = redis.Redis.from_url(settings.redis_url,
                                      socket_timeout=settings.redis_timeout_s,
                                      socket_connect_timeout=settings.redis_timeout_s)
        registry = RedisModelRegistry(client, settings.max_models,
                                      max_nodes=settings.max_model_nodes,
                                      max_bytes=settings.max_model_bytes)
        cache = RedisComputationCache(capacity=settings.cache_size, client=client,
                                      on_event=metrics.cache_event, ttl_s=settings.redis_ttl_s,
                                      max_bytes=settings.cache_bytes)
        store = RedisStreamStore(client, ttl_s=settings.stream_idle_s)
    else:
        registry = InProcessRegistry(settings.max_models, settings.max_model_nodes,
                                     settings.max_model_bytes)
        cache = LRUComputationCache(settings.cache_size, on_event=metrics.cache_event,
                                    max_bytes=settings.cache_bytes)
        store = NoStreamStore()
    # one pool for the matrices inference and streams keep between chunks: what all
    # their cached models keep together is bounded by max_pooled_bytes
    from engine.runtime.backend import BufferPool  # noqa: PLC0415
    pool = BufferPool(settings.max_pooled_bytes)
    operations = Operations(cache, metrics, backend,
                            max_computation_bytes=settings.max_computation_bytes, pool=pool)
    streams = StreamManager(registry, backend, store, max_streams=settings.max_streams,
                            idle_s=settings.stream_idle_s, metrics=metrics,
                            max_ivector_rows=settings.max_stream_ivector_rows,
                            max_held_frames=settings.max_request_indexes,
                            max_request_indexes=settings.max_request_indexes,
                            max_computation_bytes=settings.max_computation_bytes,
                            max_response_bytes=settings.max_response_bytes, pool=pool,
                            max_bytes=settings.max_stream_bytes,
                            max_recurrent_chunk_frames=settings.max_recurrent_chunk_frames)
    parser = BodyParser(settings.parse_processes, settings.parse_offload_bytes)
    if settings.queue == "redis":
        queue = RedisJobQueue(client, settings.job_timeout_s, settings.queue_size,
                              metrics=metrics)
        return Services(settings, registry, cache, queue, operations, metrics, streams, parser)
    queue = InProcessQueue(job_handlers(operations, streams), maxsize=settings.queue_size,
                           metrics=metrics, batchers=job_batchers(operations),
                           max_batch=settings.max_batch,
                           batch_delay_s=settings.batch_delay_ms / 1000.0,
                           job_timeout_s=settings.job_timeout_s, arrivals=Arrivals())
    return Services(settings, registry, cache, queue, operations, metrics, streams, parser)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    logs.configure(settings.log_level)
    services = build_services(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.backend == "numpy":
            # whether the BLAS rounds otherwise on one thread, found before anything
            # computes: finding it out holds the process at one BLAS thread for a few
            # milliseconds, which must not fall under another thread's products (a
            # network loaded meanwhile would fold its weights at that count)
            from engine.runtime.parallel import products_depend_on_thread_count  # noqa: PLC0415
            products_depend_on_thread_count()
        services.queue.start()
        services.ready = True
        try:
            yield
        finally:
            services.ready = False
            services.queue.stop()
            services.body_parser.close()

    app = FastAPI(title="nnetc", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None,
                  description="Compile, run and serve Kaldi nnet3 networks.")
    app.state.services = services
    install_error_handlers(app)
    for r in (health.router, models.router, compile_routes.router, compute.router,
              infer.router, stream_routes.router):
        app.include_router(r)
    _mount_docs(app)
    app.add_middleware(WireMiddleware, max_body_bytes=settings.max_body_bytes,
                       metrics=services.metrics,
                       arrivals=getattr(services.queue, "arrivals", None),
                       parser=services.body_parser)
    return app


def _mount_docs(app: FastAPI) -> None:
    path = _swagger_path()
    if path is None:
        return
    from fastapi.staticfiles import StaticFiles  # noqa: PLC0415
    app.mount(_DOCS_STATIC, StaticFiles(directory=path), name="swagger-static")

    @app.get("/docs", include_in_schema=False)
    def docs():
        return get_swagger_ui_html(openapi_url=app.openapi_url, title="nnetc API",
                                   swagger_js_url=f"{_DOCS_STATIC}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{_DOCS_STATIC}/swagger-ui.css",
                                   swagger_favicon_url=f"{_DOCS_STATIC}/favicon-32x32.png")
