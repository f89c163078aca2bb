"""The nnet3 optimizer: analysis, checker, options and the pass pipeline
(Kaldi's nnet-analyze, nnet-optimize, nnet-optimize-utils).

``optimize(computation, nnet, options=OptimizeOptions(), request=None)`` returns an
optimized copy (``in_place=True``: the computation itself, optimized);
``check_computation(nnet, computation)`` raises CheckError on a malformed
computation.
"""

from engine.optimizer.checker import ComputationChecker, check_computation
from engine.optimizer.options import OptimizeOptions
from engine.optimizer.pipeline import PASSES, PassContext, format_pass_table, optimize, run_passes

__all__ = ["OptimizeOptions", "optimize", "run_passes", "PASSES", "PassContext",
           "format_pass_table", "check_computation", "ComputationChecker"]
