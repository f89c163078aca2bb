"""Computation requests, optimizer options, compile request/response."""

from __future__ import annotations

from pydantic import Field

from schemas.common import Strict


class IoSpec(Strict):
    name: str = Field(description="node name")
    has_deriv: bool = False
    indexes: list[tuple[int, int, int]] = Field(description="[[n, t, x], ...]: the rows of "
                                                            "the matrix, in order")


class ComputationRequestModel(Strict):
    """Kaldi's ComputationRequest."""

    inputs: list[IoSpec]
    outputs: list[IoSpec]
    need_model_derivative: bool = False
    store_component_stats: bool = False


class OptimizerOptions(Strict):
    """Kaldi's NnetOptimizeOptions; a field left out keeps Kaldi's default."""

    optimize: bool | None = None
    consolidate_model_update: bool | None = None
    propagate_in_place: bool | None = None
    backprop_in_place: bool | None = None
    optimize_row_ops: bool | None = None
    split_row_ops: bool | None = None
    extend_matrices: bool | None = None
    convert_addition: bool | None = None
    remove_assignments: bool | None = None
    allow_left_merge: bool | None = None
    allow_right_merge: bool | None = None
    initialize_undefined: bool | None = None
    move_sizing_commands: bool | None = None
    allocate_from_other: bool | None = None
    min_deriv_time: int | None = None
    max_deriv_time: int | None = None
    max_deriv_time_relative: int | None = None
    snip_row_ops: bool | None = None
    memory_compression_level: int | None = None


class CompileOptions(Strict):
    optimizer: OptimizerOptions | None = None
    no_optimize: bool = Field(default=False, description="skip the optimizer "
                                                         "(Kaldi's raw computation)")
    use_shortcut: bool = Field(default=True, description="shortcut compilation for regular "
                                                         "multi-sequence requests")


class CompileRequest(CompileOptions):
    model_id: str
    request: ComputationRequestModel
    listing: bool = Field(default=False, description="include the command listing "
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
