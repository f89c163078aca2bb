"""pydantic v2 wire models (imports only pydantic)."""

from schemas.common import EncodedMatrix, ErrorDetail, ErrorResponse, Matrix
from schemas.compile import (CompileRequest, CompileResponse, CompileStats,
                             ComputationRequestModel, IoSpec, OptimizerOptions)
from schemas.compute import (ComputeRequest, ComputeResponse, InferOptions, InferRequest,
                             InferResponse)
from schemas.models import ModelInfo, ModelList, ModelResponse, RegisterModelRequest
from schemas.streams import (FinishRequest, OpenStreamRequest, PushRequest, StreamInfo,
                             StreamOptions, StreamOutput)

__all__ = ["EncodedMatrix", "ErrorDetail", "ErrorResponse", "Matrix", "CompileRequest",
           "CompileResponse", "CompileStats", "ComputationRequestModel", "IoSpec",
           "OptimizerOptions", "ComputeRequest", "ComputeResponse", "InferOptions",
           "InferRequest", "InferResponse", "ModelInfo", "ModelList", "ModelResponse",
           "RegisterModelRequest", "FinishRequest", "OpenStreamRequest", "PushRequest",
           "StreamInfo", "StreamOptions", "StreamOutput"]
