"""Optimizer passes, one per module, each a function ``pass_name(computation, ctx) -> bool``
named after Kaldi's function in snake_case.  The order and gating live in
engine.optimizer.pipeline.PASSES; this list only names the modules.

O1 (optimizer foundation): remove_no_ops, renumber, variable_merging,
consolidate_model_update, initialize_undefined (remove_unnecessary_zeroing),
move_sizing_commands, allocate_from_other (remove_unnecessary_allocation),
consolidate_io (consolidate_io_operations, fix_goto_label).
O2: limit_derivative_times, convert_addition, optimize_row_ops, extend_matrices,
optimize_looped, memory_compression.
"""

MODULES = (
    "limit_derivative_times",
    "consolidate_model_update",
    "convert_addition",
    "optimize_row_ops",
    "renumber",
    "extend_matrices",
    "variable_merging",
    "initialize_undefined",
    "move_sizing_commands",
    "optimize_looped",
    "allocate_from_other",
    "consolidate_io",
    "memory_compression",
    "remove_no_ops",
)
