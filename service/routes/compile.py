"""/compile: model + ComputationRequest (+ optimizer options) -> computation id and
statistics (and, on request, the listing)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from schemas.compile import CompileRequest, CompileResponse, CompileStats
from service import convert
from service.deps import AUTH, ServicesDep
from service.errors import FieldError
from service.routes import ParsedBodyRoute, blame, run_job

router = APIRouter(route_class=ParsedBodyRoute, tags=["compile"], dependencies=AUTH)


def compile_payload(body, services, request: Request) -> dict:
    """The compile part of a compile or compute body, converted and checked."""
    entry = services.registry.get(body.model_id)
    with blame(request, "request"):
        engine_request = convert.request_to_engine(
            body.request, max_indexes=services.settings.max_request_indexes)
    nnet = entry.model.nnet
    with blame(request, "request"):
        # here, before a job is queued: node names, and Indexes within Kaldi's 32 bits
        # (a larger one would not fit the integers of a job on the Redis queue either)
        engine_request.validate(nnet)
    for k, spec in enumerate(engine_request.inputs):
        if nnet.is_component_node(nnet.get_node_index(spec.name)):
            # Kaldi's graph builder asserts on such an input; the compiler cannot build it
            raise FieldError(f"request.inputs.{k}.name",
                             f"{spec.name!r} is a component node: a request supplies values "
                             f"for input nodes only")
    with blame(request, "optimizer"):
        options = convert.optimize_options(body.optimizer)
        # a derivative-time window relative to the request's last output t: checked
        # here, against the request, so that an empty one names the optimizer options
        options.check_deriv_times(engine_request.max_output_time())
    return {"entry": entry, "request": engine_request, "options": options,
            "optimize": not body.no_optimize, "use_shortcut": body.use_shortcut}


@router.post("/compile", response_model=CompileResponse, response_model_exclude_none=True)
def compile_route(body: CompileRequest, services: ServicesDep, request: Request
                  ) -> CompileResponse:
    payload = compile_payload(body, services, request)
    with blame(request, "request"):
        compiled = run_job(services, "compile", payload)
    stats = compiled.computation.stats()
    listing = None
    if body.listing:
        listing = compiled.computation.to_text(payload["entry"].model.nnet)
    return CompileResponse(computation_id=compiled.key, cached=compiled.cached,
                           stats=CompileStats(**stats, compile_ms=round(compiled.compile_ms, 3),
                                              optimized=compiled.optimized),
                           listing=listing)
