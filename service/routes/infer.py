"""/infer: model + features (+ i-vectors) -> network output, with the semantics of
Kaldi's nnet3-compute (edge padding, chunking, frame subsampling, i-vectors)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from engine.core.finite import as_float32
from engine.core.index import INT32_MAX
from engine.inference.looped import get_chunk_size
from schemas.compute import InferRequest, InferResponse
from service import convert
from service.deps import AUTH, ServicesDep
from service.errors import FieldError, ServiceError, check_answer_size
from service.routes import ParsedBodyRoute, blame, json_answer, run_job
from service.streams import recurrent_chunk_bound

router = APIRouter(route_class=ParsedBodyRoute, tags=["infer"], dependencies=AUTH)

# request fields the engine's inference errors name at the start of their message
_NAMED_FIELDS = ("online_ivector_period", "online_ivectors", "ivector", "options.output",
                 "options.use_priors", "options.acoustic_scale", "options.frames_per_chunk",
                 "options.frame_subsampling_factor", "options.extra_left_context",
                 "options.extra_right_context", "options.extra_left_context_initial",
                 "options.extra_right_context_final", "options.max_batch", "options.threads")


@router.post("/infer", response_model=InferResponse)
def infer_route(body: InferRequest, services: ServicesDep, request: Request) -> Response:
    entry = services.registry.get(body.model_id)
    features = convert.matrix_from_wire(body.features, "features")
    online = None
    if body.online_ivectors is not None:
        online = convert.matrix_from_wire(body.online_ivectors, "online_ivectors")
    ivector = None
    if body.ivector is not None:
        ivector = as_float32(body.ivector)     # (checked by the engine)
    period = body.online_ivector_period
    if not 0 <= period <= INT32_MAX:      # Kaldi's --online-ivector-period is an int32
        raise FieldError("online_ivector_period", f"must be from 0 (no online i-vectors) to "
                                                  f"{INT32_MAX}, got {period}")
    with blame(request, "options", _NAMED_FIELDS):
        options = convert.inference_options(body.options, services.settings.infer_threads)
        options.check()
    limit = services.settings.max_request_indexes
    # a chunk's computation reads frames_per_chunk frames (rounded up to a multiple of
    # the subsampling factor and the network's modulus, as Kaldi's CheckAndFixConfigs
    # does) plus the extra context on either side (at the utterance's edges the
    # *_initial/*_final values, when set)
    fpc = options.frames_per_chunk
    if fpc <= limit:
        fpc = get_chunk_size(entry.model.nnet, options.frame_subsampling_factor, fpc)
    parts = {"frames_per_chunk": fpc,
             "extra_left_context": options.extra_left_context,
             "extra_left_context_initial": options.extra_left_context_initial,
             "extra_right_context": options.extra_right_context,
             "extra_right_context_final": options.extra_right_context_final}
    left = max(parts["extra_left_context"], parts["extra_left_context_initial"])
    right = max(parts["extra_right_context"], parts["extra_right_context_final"])
    if fpc + left + right > limit:
        field = max(parts, key=parts.get)
        if field == "frames_per_chunk" and options.frame_subsampling_factor > \
                options.frames_per_chunk:
            field = "frame_subsampling_factor"      # what made the chunk this long
        value = getattr(options, field)
        raise ServiceError(413, "RequestTooLarge",
                           f"{field} {value}: chunks of {fpc} frames (frames_per_chunk "
                           f"{options.frames_per_chunk} rounded up to a multiple of "
                           f"frame_subsampling_factor {options.frame_subsampling_factor} and "
                           f"the network's modulus) with up to {left} frames of extra left "
                           f"and {right} of extra right context are more than this service's "
                           f"max_request_indexes ({limit})", f"options.{field}")
    recurrent_chunk_bound(entry.model.nnet, fpc, options.frames_per_chunk,
                          options.frame_subsampling_factor,
                          services.settings.max_recurrent_chunk_frames)
    # the frames all chunks compute together: a bounded multiple of the utterance's
    frames = int(features.shape[0])
    chunks = -(-frames // fpc)
    work = chunks * (fpc + left + right)
    factor = services.settings.max_infer_work_factor
    if work > max(limit, factor * frames):
        raise ServiceError(413, "RequestTooLarge",
                           f"frames_per_chunk {options.frames_per_chunk}: {chunks} chunks of "
                           f"{fpc} frames with up to {left} frames of extra left and {right} "
                           f"of extra right context compute {work} frames for {frames} frames "
                           f"of features, more than this service's max_infer_work_factor "
                           f"({factor}) times as many and more than its max_request_indexes "
                           f"({limit}): use longer chunks or less extra context",
                           "options.frames_per_chunk")
    nnet = entry.model.nnet
    node = nnet.get_node_index(options.output)
    if node >= 0 and nnet.is_output_node(node):     # (else the engine names it)
        fsf = options.frame_subsampling_factor
        rows = -(-int(features.shape[0]) // fsf)
        dim = nnet.output_dim(options.output)
        check_answer_size(rows * dim, services.settings.max_response_bytes,
                          f"the output ({rows} frames x {dim})", "features")
    with blame(request, "features", _NAMED_FIELDS):
        out = run_job(services, "infer", {
            "entry": entry, "features": features, "ivector": ivector,
            "online_ivectors": online, "online_ivector_period": period,
            "options": options})
    return json_answer(InferResponse.model_construct(
        output=convert.matrix_to_wire(out, body.encoding, services.settings.base64_threshold),
        num_frames=int(out.shape[0])), request=request)
