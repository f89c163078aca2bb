"""Compute (Kaldi's NnetComputer on a request) and infer (nnet3-compute)."""

from __future__ import annotations

from typing import Union

from pydantic import Field

from schemas.common import Bool, Float, Int, Matrix, MatrixEncoding, Strict, Vector
from schemas.compile import CompileOptions, ComputationRequestModel


class ComputeRequest(CompileOptions):
    model_id: str
    request: ComputationRequestModel
    inputs: dict[str, Matrix] = Field(description="one matrix per request input, rows in "
                                                  "the order of its indexes")
    output_derivs: dict[str, Matrix] = Field(default_factory=dict,
                                             description="one per output with has_deriv")
    encoding: MatrixEncoding = Field(default="auto", description="how to return matrices: "
                                     "json rows, base64, or auto (base64 above a size)")


class ComputeResponse(Strict):
    computation_id: str
    outputs: dict[str, Matrix]
    input_derivs: dict[str, Matrix] = Field(default_factory=dict)
    model_gradient: dict[str, dict[str, Matrix]] | None = Field(
        default=None, description="component -> parameter name -> gradient, for "
                                  "updatable components (need_model_derivative)")
    component_stats: dict[str, dict[str, Union[Float, Vector, list[Vector]]]] | None = Field(
        default=None, description="store_component_stats: component -> statistic -> "
        "value, what this computation stored (Kaldi's fields, from zero: e.g. value_sum, "
        "deriv_sum, count, oderiv_sumsq, oderiv_count of a nonlinearity; count, stats_sum, "
        "stats_sumsq of batch-norm in training mode), for the components that store "
        "statistics in the forward pass and the non-updatable ones whose backprop does; "
        "counts as numbers, vectors as lists, matrices as lists of rows")


class InferOptions(Strict):
    """The options of Kaldi's nnet3-compute."""

    frames_per_chunk: Int = 50
    extra_left_context: Int = 0
    extra_right_context: Int = 0
    extra_left_context_initial: Int = -1
    extra_right_context_final: Int = -1
    frame_subsampling_factor: Int = 1
    acoustic_scale: Float = 1.0
    apply_exp: Bool = False
    use_priors: Bool = False
    output: str = "output"


class InferRequest(Strict):
    model_id: str
    features: Matrix
    ivector: Vector | None = None
    online_ivectors: Matrix | None = None
    online_ivector_period: Int = 0
    options: InferOptions = Field(default_factory=InferOptions)
    encoding: MatrixEncoding = "auto"


class InferResponse(Strict):
    output: Matrix
    num_frames: int
