"""/compute: model + request + input matrices (+ output derivatives) -> outputs,
input derivatives and model-parameter gradients as requested."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from schemas.compute import ComputeRequest, ComputeResponse
from service import convert
from service.deps import AUTH, ServicesDep
from service.errors import FieldError, check_answer_size
from service.routes import ParsedBodyRoute, blame, json_answer, run_job
from service.routes.compile import compile_payload

router = APIRouter(route_class=ParsedBodyRoute, tags=["compute"], dependencies=AUTH)


def _matrices(given: dict, specs, nnet, field: str) -> dict:
    """Decode one matrix per spec, shaped (len(indexes), node dim); extra or
    missing names are errors naming the field."""
    wanted = {s.name: s for s in specs}
    for name in given:
        if name not in wanted:
            raise FieldError(f"{field}.{name}", "not in the request (expected "
                                                f"{', '.join(sorted(wanted)) or 'none'})")
    out = {}
    for name, spec in wanted.items():
        if name not in given:
            raise FieldError(f"{field}.{name}", "missing")
        cols = nnet.node_dim(nnet.get_node_index(name))
        out[name] = convert.matrix_from_wire(given[name], f"{field}.{name}", cols=cols,
                                             rows=len(spec.indexes))
    return out


@router.post("/compute", response_model=ComputeResponse, response_model_exclude_none=True)
def compute_route(body: ComputeRequest, services: ServicesDep, request: Request
                  ) -> Response:
    payload = compile_payload(body, services, request)
    nnet = payload["entry"].model.nnet
    engine_request = payload["request"]    # checked against nnet by compile_payload
    answered = [*engine_request.outputs, *(s for s in engine_request.inputs if s.has_deriv)]
    values = sum(len(s.indexes) * nnet.node_dim(nnet.get_node_index(s.name)) for s in answered)
    if engine_request.need_model_derivative:
        values += nnet.num_parameters()
    check_answer_size(values, services.settings.max_response_bytes,
                      "the answer (outputs, input derivatives and model gradient)", "request")
    payload["inputs"] = _matrices(body.inputs, engine_request.inputs, nnet, "inputs")
    payload["output_derivs"] = _matrices(
        body.output_derivs, [s for s in engine_request.outputs if s.has_deriv], nnet,
        "output_derivs")
    with blame(request, "request"):
        compiled, result = run_job(services, "compute", payload)
    enc, thr = body.encoding, services.settings.base64_threshold
    gradient = None
    if result.gradient is not None:
        gradient = convert.gradient_to_wire(result.gradient, enc, thr)
    return json_answer(ComputeResponse.model_construct(
        computation_id=compiled.key,
        outputs={k: convert.matrix_to_wire(v, enc, thr) for k, v in result.outputs.items()},
        input_derivs={k: convert.matrix_to_wire(v, enc, thr)
                      for k, v in result.input_derivs.items()},
        model_gradient=gradient,
        component_stats=None if result.stats is None else convert.stats_to_wire(result.stats)),
        exclude_none=True, request=request)
