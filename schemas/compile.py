"""Computation requests, optimizer options, compile request/response."""

from __future__ import annotations

from pydantic import Field

from schemas.common import Bool, Indexes, Int, Strict


class IoSpec(Strict):
    name: str = Field(description="node name")
    has_deriv: Bool = False
    indexes: Indexes = Field(description="[[n, t, x], ...]: the rows of the matrix, in "
                                         "order; or, for many, {\"shape\": [k, 3], \"data\": "
                                         "<base64 of little-endian int32 n, t, x rows>}")


class ComputationRequestModel(Strict):
    """Kaldi's ComputationRequest."""

    inputs: list[IoSpec]
    outputs: list[IoSpec]
    need_model_derivative: Bool = False
    store_component_stats: Bool = False


class OptimizerOptions(Strict):
    """Kaldi's NnetOptimizeOptions; a field left out keeps Kaldi's default."""

    optimize: Bool | None = None
    consolidate_model_update: Bool | None = None
    propagate_in_place: Bool | None = None
    backprop_in_place: Bool | None = None
    optimize_row_ops: Bool | None = None
    split_row_ops: Bool | None = None
    extend_matrices: Bool | None = None
    convert_addition: Bool | None = None
    remove_assignments: Bool | None = None
    allow_left_merge: Bool | None = None
    allow_right_merge: Bool | None = None
    initialize_undefined: Bool | None = None
    move_sizing_commands: Bool | None = None
    allocate_from_other: Bool | None = None
    # Kaldi's int32 (its "not set" values are the int32 extremes)
    min_deriv_time: Int | None = Field(default=None, ge=-2 ** 31, le=2 ** 31 - 1)
    max_deriv_time: Int | None = Field(default=None, ge=-2 ** 31, le=2 ** 31 - 1)
    max_deriv_time_relative: Int | None = Field(default=None, ge=-2 ** 31, le=2 ** 31 - 1)
    snip_row_ops: Bool | None = None
    memory_compression_level: Int | None = Field(default=None, ge=0, le=3)


class CompileOptions(Strict):
    optimizer: OptimizerOptions | None = None
    no_optimize: Bool = Field(default=False, description="skip the optimizer "
                                                         "(Kaldi's raw computation)")
    use_shortcut: Bool = Field(default=True, description="shortcut compilation for regular "
                                                         "multi-sequence requests")


class CompileRequest(CompileOptions):
    model_id: str
    request: ComputationRequestModel
    listing: Bool = Field(default=False, description="include the command listing "
                                                     "(Kaldi's NnetComputation::Print)")


class CompileStats(Strict):
    commands: int
    matrices: int
    peak_bytes: int
    compile_ms: float
    optimized: bool


class CompileResponse(Strict):
    computation_id: str = Field(description="the cache key of the compiled computation")
    cached: bool
    stats: CompileStats
    listing: str | None = None
